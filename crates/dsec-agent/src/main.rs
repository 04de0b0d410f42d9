//! dsec's agent: PID 1 of every dsec VM guest.
//!
//! The host boots the guest's kernel with an initramfs holding this (static) binary and
//! the few kernel modules it needs. The agent loads them, opens its channel to the host —
//! the virtio-serial port named [`guest::PORT_NAME`], or a vsock listener when the VMM
//! offers no such port — mounts the image's read-only disk and the sandbox's scratch
//! disk, stacks an overlay of the two into the guest's root, then serves the container
//! backend's protocol ([`dsec_runtime::init::serve_guest`]): the same exec, timeout,
//! output and file semantics, byte for byte.
//!
//! The channel cannot be opened or forged from inside the guest: the agent holds the
//! only open of the port (virtio-serial allows one), the guest's root has its own
//! minimal `/dev` without the port's node, the initramfs' `/dev` is unmounted, and every
//! command runs with Docker's default capabilities minus `CAP_MKNOD` (no `mknod`, no
//! `mount`, no `ptrace` of the non-dumpable agent) under the same seccomp filter as a
//! container.
//!
//! The guest has no network but loopback until the host gives it one: the network
//! driver's modules are opened at boot, before the root replaces the initramfs, and
//! loaded by the identity that first carries an address (see `dsec_vm::qemu`).
//!
//! A bootable disk of the user's own (the `vm` backend's disk images) boots its own kernel
//! and init instead; there the agent runs as a service of that init (`--service`, see
//! [`service`]) and serves the same protocol from the guest's own root.
//!
//! When the host closes the channel the guest has no further purpose: the agent exits.
//! Having confined itself it may not call `reboot(2)` any more, so its exit panics the
//! kernel, which `panic=-1` turns into an immediate reboot, which ends QEMU (started with
//! `-no-reboot`). A setup failure reboots directly, still privileged.

mod service;

use std::fs;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsec_runtime::guest::{self, BootArgs};
use dsec_runtime::init::GuestCgroup;
use dsec_runtime::proto::{self, FrameKind, InitError};
use dsec_runtime::seccomp::SeccompProfile;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::socket::{
    accept4, bind, getpeername, listen, socket, AddressFamily, Backlog, SockFlag, SockType,
    VsockAddr,
};

/// How long devices may take to appear once their drivers are loaded.
const DEVICE_WAIT: Duration = Duration::from_secs(10);

fn main() {
    if std::env::args().nth(1).as_deref() == Some(service::FLAG) {
        match service::run() {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                eprintln!("dsec-agent: {e}");
                std::process::exit(1);
            }
        }
    }
    if std::process::id() != 1 {
        eprintln!(
            "dsec-agent runs as PID 1 of a dsec VM guest (the host starts it), or as a \
             service of a guest's own init with {}",
            service::FLAG
        );
        std::process::exit(2);
    }
    if let Err(e) = run() {
        eprintln!("dsec-agent: {e}");
    }
    nix::unistd::sync();
    // QEMU runs with -no-reboot and exits.
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
}

/// Boots the guest and serves the host until it goes away.
fn run() -> Result<(), String> {
    mount_early()?;
    let cmdline = fs::read_to_string("/proc/cmdline").map_err(|e| format!("/proc/cmdline: {e}"))?;
    let args = BootArgs::parse(&cmdline);
    load_modules(&cmdline)?;
    let net_modules = open_net_modules()?;
    let control = open_channel()?;
    if args.probe {
        let mut ready = Vec::new();
        proto::encode_json(
            &mut ready,
            FrameKind::Ready,
            0,
            &proto::Ready {
                version: proto::VERSION,
                upper_fd: -1,
            },
        );
        return fs::File::from(control)
            .write_all(&ready)
            .map_err(|e| format!("answering the probe: {e}"));
    }
    serve(control, build_root(&args), net_modules)
}

/// Serves the host on `control` until it goes away, its commands in `cgroup`; a guest that
/// could not be set up (`cgroup` is the reason) tells the host why, on the channel.
fn serve(
    control: OwnedFd,
    cgroup: Result<GuestCgroup, String>,
    net_modules: Vec<OwnedFd>,
) -> Result<(), String> {
    let prepared = cgroup.and_then(|cgroup| {
        let seccomp =
            SeccompProfile::docker_default().map_err(|e| format!("seccomp profile: {e}"))?;
        Ok((seccomp, cgroup))
    });
    let (seccomp, cgroup) = match prepared {
        Ok(prepared) => prepared,
        Err(message) => {
            report_setup_error(control, &message);
            return Err(message);
        }
    };
    dsec_runtime::init::serve_guest(control, seccomp, cgroup, net_modules).map_err(|e| e.message)
}

/// Opens the network driver's modules ([`guest::NET_MODULE_ORDER`]), dependencies first,
/// while the initramfs is still the root: they are loaded only when the sandbox is given
/// a network. None when the kernel has the driver built in.
fn open_net_modules() -> Result<Vec<OwnedFd>, String> {
    let dir = Path::new(guest::MODULE_DIR);
    let order = fs::read_to_string(dir.join(guest::NET_MODULE_ORDER)).unwrap_or_default();
    order
        .lines()
        .filter(|l| !l.is_empty())
        .map(|name| {
            let path = dir.join(name);
            fs::File::open(&path)
                .map(OwnedFd::from)
                .map_err(|e| format!("{}: {e}", path.display()))
        })
        .collect()
}

fn mount_early() -> Result<(), String> {
    for (fstype, target) in [("devtmpfs", "/dev"), ("proc", "/proc"), ("sysfs", "/sys")] {
        fs::create_dir_all(target).map_err(|e| format!("mkdir {target}: {e}"))?;
        mount(
            Some(fstype),
            target,
            Some(fstype),
            MsFlags::MS_NOSUID,
            None::<&str>,
        )
        .map_err(|e| format!("mount {fstype} on {target}: {e}"))?;
    }
    Ok(())
}

/// Loads the modules the host listed, in its order (dependencies first), each with the
/// `<module>.<param>=<value>` words of the kernel command line meant for it — as
/// modprobe would; QEMU's microvm declares its virtio-mmio devices that way.
fn load_modules(cmdline: &str) -> Result<(), String> {
    let dir = Path::new(guest::MODULE_DIR);
    let order = fs::read_to_string(dir.join(guest::MODULE_ORDER)).unwrap_or_default();
    for name in order.lines().filter(|l| !l.is_empty()) {
        let path = dir.join(name);
        let file = fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let module = name.split(".ko").next().unwrap_or(name).replace('-', "_");
        let params: Vec<&str> = cmdline
            .split_whitespace()
            .filter_map(|w| w.strip_prefix(module.as_str())?.strip_prefix('.'))
            .collect();
        let params = std::ffi::CString::new(params.join(" "))
            .map_err(|_| format!("parameters of {name} hold a NUL byte"))?;
        match nix::kmod::finit_module(&file, &params, nix::kmod::ModuleInitFlags::empty()) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(format!("loading {name}: {e}")),
        }
    }
    Ok(())
}

/// Polls `probe` until it yields or [`DEVICE_WAIT`] passes.
fn wait_for<T>(what: &str, probe: impl FnMut() -> Option<T>) -> Result<T, String> {
    wait_within(what, DEVICE_WAIT, probe)
}

/// Polls `probe` until it yields or `limit` passes.
fn wait_within<T>(
    what: &str,
    limit: Duration,
    mut probe: impl FnMut() -> Option<T>,
) -> Result<T, String> {
    let start = Instant::now();
    loop {
        if let Some(found) = probe() {
            return Ok(found);
        }
        if start.elapsed() > limit {
            return Err(format!("{what} did not appear within {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// virtio device ids (virtio spec 5): console (virtio-serial) and socket (vsock).
const VIRTIO_CONSOLE: &str = "0x0003";
const VIRTIO_VSOCK: &str = "0x0013";

/// Whether a virtio device of type `id` is present.
fn virtio_device(id: &str) -> bool {
    fs::read_dir("/sys/bus/virtio/devices").is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| fs::read_to_string(e.path().join("device")).is_ok_and(|d| d.trim() == id))
    })
}

/// The host's channel: the named virtio-serial port if the VMM offers a virtio console
/// device, else the first vsock connection from the host.
fn open_channel() -> Result<OwnedFd, String> {
    let serial = wait_for("a virtio console or vsock device", || {
        if virtio_device(VIRTIO_CONSOLE) {
            Some(true)
        } else {
            virtio_device(VIRTIO_VSOCK).then_some(false)
        }
    })?;
    if !serial {
        return accept_vsock();
    }
    let node = wait_for("the agent's virtio-serial port", serial_port)?;
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&node)
        .map_err(|e| format!("{}: {e}", node.display()))?;
    Ok(file.into())
}

/// `/dev/<port>` of the port named [`guest::PORT_NAME`].
fn serial_port() -> Option<PathBuf> {
    fs::read_dir("/sys/class/virtio-ports")
        .ok()?
        .flatten()
        .find(|e| {
            fs::read_to_string(e.path().join("name")).is_ok_and(|n| n.trim() == guest::PORT_NAME)
        })
        .map(|e| Path::new("/dev").join(e.file_name()))
        .filter(|node| node.exists())
}

fn accept_vsock() -> Result<OwnedFd, String> {
    let listener = socket(
        AddressFamily::Vsock,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| format!("vsock socket: {e}"))?;
    let addr = VsockAddr::new(libc::VMADDR_CID_ANY, guest::VSOCK_PORT);
    bind(listener.as_raw_fd(), &addr).map_err(|e| format!("vsock bind: {e}"))?;
    let backlog = Backlog::new(1).map_err(|e| format!("vsock listen: {e}"))?;
    listen(&listener, backlog).map_err(|e| format!("vsock listen: {e}"))?;
    loop {
        let conn = accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC)
            .map_err(|e| format!("vsock accept: {e}"))?;
        // SAFETY: conn was just returned by accept4(2) and nothing else owns it.
        let conn = unsafe { OwnedFd::from_raw_fd(conn) };
        let peer = getpeername::<VsockAddr>(conn.as_raw_fd());
        if peer.is_ok_and(|p| p.cid() == libc::VMADDR_CID_HOST) {
            return Ok(conn);
        }
    }
}

/// `/dev/<vdX>` of the virtio disk whose serial is `serial`.
fn disk_with_serial(serial: &str) -> Option<PathBuf> {
    fs::read_dir("/sys/block")
        .ok()?
        .flatten()
        .find(|e| fs::read_to_string(e.path().join("serial")).is_ok_and(|s| s.trim() == serial))
        .map(|e| Path::new("/dev").join(e.file_name()))
        .filter(|node| node.exists())
}

/// Memory the kernel and the agent keep out of the commands' cgroup: at least this, or an
/// eighth of what is available at boot.
const MEMORY_RESERVE: u64 = 16 << 20;

/// Makes the cgroup every command joins (see [`GuestCgroup`]), on a cgroup2 mount that
/// stays in the initramfs, out of the commands' reach.
fn guest_cgroup() -> Result<GuestCgroup, String> {
    let root = Path::new("/mnt/cgroup");
    fs::create_dir_all(root).map_err(|e| format!("mkdir {}: {e}", root.display()))?;
    // favordynmods: each command joins the cgroup as it starts; without it every
    // migration waits for an RCU grace period (milliseconds under binary translation).
    mount(
        Some("cgroup2"),
        root,
        Some("cgroup2"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("favordynmods"),
    )
    .map_err(|e| format!("mount cgroup2: {e}"))?;
    commands_cgroup(root, Path::new("/mnt/scratch"))
}

/// Makes `<parent>/commands`, the cgroup every command joins, with the memory and pids
/// controllers; `parent` must hold no process. `scratch` is the root of the filesystem
/// the commands write to, whose usage the host is told.
fn commands_cgroup(parent: &Path, scratch: &Path) -> Result<GuestCgroup, String> {
    let write = |path: PathBuf, value: &str| {
        fs::write(&path, value).map_err(|e| format!("{}: {e}", path.display()))
    };
    write(parent.join("cgroup.subtree_control"), "+memory +pids")?;
    let commands = parent.join("commands");
    fs::create_dir_all(&commands).map_err(|e| format!("mkdir {}: {e}", commands.display()))?;
    let meminfo = fs::read_to_string("/proc/meminfo").map_err(|e| format!("/proc/meminfo: {e}"))?;
    let available_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or("no MemAvailable in /proc/meminfo")?;
    let available = available_kib * 1024;
    let limit = available.saturating_sub(MEMORY_RESERVE.max(available / 8));
    write(commands.join("memory.max"), &limit.to_string())?;
    let open = |name: &str| {
        let path = commands.join(name);
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map(OwnedFd::from)
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    let dir = |path: &Path| {
        fs::File::open(path)
            .map(OwnedFd::from)
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    Ok(GuestCgroup {
        procs: open("cgroup.procs")?,
        pids_max: open("pids.max")?,
        dir: dir(&commands)?,
        scratch: dir(scratch)?,
        lowers: Vec::new(),
    })
}

fn build_root(args: &BootArgs) -> Result<GuestCgroup, String> {
    let mut mounts = Vec::with_capacity(args.image_disks + 1);
    let mut lowers = Vec::with_capacity(args.image_disks);
    for i in 0..args.image_disks {
        let serial = guest::image_disk_serial(i);
        let disk = wait_for(&format!("image disk {serial}"), || {
            disk_with_serial(&serial)
        })?;
        let lower = PathBuf::from(format!("/mnt/image-{i}"));
        mounts.push((
            disk,
            lower.clone(),
            args.base_fs.as_str(),
            MsFlags::MS_RDONLY,
        ));
        lowers.push(lower);
    }
    let scratch = wait_for("the scratch disk", || {
        disk_with_serial(guest::SCRATCH_DISK_SERIAL)
    })?;
    let upper = Path::new("/mnt/scratch");
    mounts.push((scratch, upper.to_owned(), "ext4", MsFlags::empty()));
    for (device, target, fstype, flags) in &mounts {
        let (target, fstype, flags) = (target.as_path(), *fstype, *flags);
        fs::create_dir_all(target).map_err(|e| format!("mkdir {}: {e}", target.display()))?;
        mount(
            Some(device.as_path()),
            target,
            Some(fstype),
            flags | MsFlags::MS_NODEV,
            None::<&str>,
        )
        .map_err(|e| {
            format!(
                "mount {} ({fstype}) on {}: {e}",
                device.display(),
                target.display()
            )
        })?;
    }
    let mut cgroup = guest_cgroup()?;
    cgroup.lowers = dsec_runtime::layers::open_layers(&lowers);
    // Nothing of the initramfs' own view may remain reachable from the guest's root.
    for target in ["/dev", "/proc", "/sys"] {
        umount2(target, MntFlags::MNT_DETACH).map_err(|e| format!("unmount {target}: {e}"))?;
    }
    dsec_runtime::rootfs::setup_guest(&lowers, upper, Path::new("/mnt/root"))
        .map_err(|e| e.to_string())?;
    dsec_runtime::rootfs::set_hostname(&args.hostname).map_err(|e| format!("sethostname: {e}"))?;
    dsec_runtime::rootfs::loopback_up().map_err(|e| format!("loopback: {e}"))?;
    Ok(cgroup)
}

/// Tells the host why the guest cannot serve, before rebooting it.
fn report_setup_error(control: OwnedFd, message: &str) {
    let mut frame = Vec::new();
    proto::encode_json(
        &mut frame,
        FrameKind::Error,
        0,
        &InitError {
            stage: proto::InitStage::GuestSetup,
            errno: None,
            message: message.to_owned(),
            file: None,
        },
    );
    let _ = fs::File::from(control).write_all(&frame);
}
