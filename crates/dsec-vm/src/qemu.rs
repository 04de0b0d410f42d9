//! One QEMU process per sandbox.
//!
//! QEMU inherits two socketpair ends — the guest agent's virtio-serial port and the QMP
//! monitor — so a VM has no socket file, tap device or pid file on the host: its
//! sandbox directory (console log, scratch disk) is all there is, and it is removed at
//! stop. QEMU runs with `PR_SET_PDEATHSIG`, so it dies with the server, and dsec signals
//! it only through a pidfd opened while it was still an unreaped child.
//!
//! A VM starts either cold (kernel boot, the agent builds the root and reports ready)
//! or from a boot template: a guest booted once, idle in its agent's poll loop, and
//! saved as three files — its RAM, its device state and its scratch disk. The template's
//! QEMU keeps its RAM in a file it maps shared, so the guest's memory is the file; its
//! devices and CPUs are saved by a migration that skips that RAM (`x-ignore-shared`).
//! A restored guest maps the same file *private*: the pages it only reads are the host's
//! page cache, one copy for every guest of the template, and a page it writes becomes
//! its own (copy-on-write, as Firecracker restores snapshots and Kata clones templates).
//! Restoring is a copy of the small scratch qcow2, that mapping, and an incoming
//! migration of the device state; the guest then takes a fresh
//! [`Identity`](dsec_runtime::proto::Identity).
//!
//! Networking: every QEMU runs in a network namespace of its own, empty when it starts,
//! and every guest has one virtio-net device on QEMU's user-mode network (`-netdev
//! user`, libslirp), so that a boot template serves sandboxes with and without a network
//! alike. The guest's packets never reach the host's stack as packets: QEMU makes each
//! of the guest's connections itself, with its own sockets, from its namespace. A
//! sandbox with a network has that namespace plugged into the server's bridge exactly
//! as a container's is (`dsec_net::Attachment::plug`: a veth, the sandbox's address, the
//! same nftables policy, resolver and name-checking proxy), so the guest meets the
//! container's enforcement, not a second one; without a network the namespace has no
//! interface at all, and the guest has not even loaded its driver (loopback only). The
//! guest's `eth0` carries the sandbox's address (a /32) and routes everything through
//! [`guest::NET_GATEWAY`]; it is set by the guest's identity, so a restored or forked
//! guest takes its own address as it takes its own name. Nothing of it is on the host
//! once QEMU is gone: the namespace, and the veth in it, go with the process.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dsec_runtime::channel::{Channel, WriteHold};
use dsec_runtime::guest::{self, BootArgs};
use dsec_runtime::proto::{self, FrameKind};
use tokio::net::UnixStream;
use tokio::sync::watch;

use crate::assets::GuestAssets;
use crate::bootdisk::boot_disk_args;
use crate::disk::BaseFs;
use crate::qmp::Qmp;
use crate::VmError;

/// The QEMU binary.
const QEMU: &str = "qemu-system-x86_64";

/// How long a cold boot may take before create gives up (TCG on a busy host is slow).
const BOOT_TIMEOUT: Duration = Duration::from_secs(120);

/// How long a restored guest may take to answer its first request.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long saving or loading a boot template's device state may take.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(60);

/// Bytes a restored guest's stream may hold before the answer to its identity request
/// before the older ones are dropped ([`identify_restored`]).
const MAX_STALE_BUFFER: usize = 1 << 20;

/// A migration bandwidth (bytes/s) no local copy reaches.
const UNLIMITED_BANDWIDTH: u64 = 1 << 40;

/// The name under which QEMU holds what a guest migrates through (`getfd`): a socket to
/// the receiving QEMU, or a saved device state.
const MIGRATION_FD: &str = "migration";

/// How long a pause waits for the guest to read what was sent to it.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The kind of virtual machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Machine {
    /// QEMU's `microvm`: virtio-mmio devices, no PCI, no firmware, direct kernel boot.
    Microvm,
    /// A full PC (q35 chipset, PCI, ACPI).
    Q35,
}

impl Machine {
    /// The dsec backend name.
    pub fn backend(self) -> &'static str {
        match self {
            Machine::Microvm => "microvm",
            Machine::Q35 => "vm",
        }
    }

    fn virtio(self, device: &str) -> String {
        match self {
            Machine::Microvm => format!("{device}-device"),
            Machine::Q35 => format!("{device}-pci"),
        }
    }

    fn machine_arg(self) -> &'static str {
        match self {
            // ACPI stays on: it is how the guest finds the virtio-mmio devices (Debian's
            // kernel ignores virtio_mmio.device= on the command line).
            Machine::Microvm => "microvm,x-option-roms=off",
            Machine::Q35 => "q35",
        }
    }
}

/// How guest code runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Accel {
    /// Hardware virtualisation through `/dev/kvm`.
    Kvm,
    /// QEMU's binary translator: slower, works everywhere.
    Tcg,
}

impl Accel {
    /// The name `sb.info()` reports.
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// Everything QEMU's command line depends on; a boot template is valid for exactly one.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Hardware {
    /// Machine type.
    pub machine: Machine,
    /// Accelerator.
    pub accel: Accel,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Guest memory in MiB.
    pub memory_mb: u64,
}

/// Where a VM's disks are.
#[derive(Clone, Debug)]
pub struct Disks {
    /// The image's read-only disks, top layer first: one merged disk, or a layer's blob
    /// each (at most [`guest::MAX_IMAGE_DISKS`]).
    pub image: Vec<PathBuf>,
    /// Their filesystem.
    pub base_fs: BaseFs,
    /// The sandbox's scratch qcow2.
    pub scratch: PathBuf,
}

/// A running QEMU and the guest agent's channel.
pub struct Vm {
    pid: i32,
    pidfd: OwnedFd,
    channel: Channel,
    qmp: Qmp,
    exited: watch::Receiver<bool>,
    /// QEMU's exit status, once it has exited and been reaped.
    status: Arc<OnceLock<ExitStatus>>,
    console: PathBuf,
    /// While paused: the channel's writes, held since everything sent before the pause
    /// reached the guest (so a snapshot has no request half-delivered).
    held: tokio::sync::Mutex<Option<WriteHold>>,
}

fn clear_cloexec(fd: i32) -> std::io::Result<()> {
    // SAFETY: fcntl(2) on a descriptor this process owns, integer arguments only.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn socketpair() -> Result<(UnixStream, OwnedFd), VmError> {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| VmError::Qemu(format!("socketpair: {e}")))?;
    ours.set_nonblocking(true)
        .map_err(|e| VmError::Qemu(format!("socketpair: {e}")))?;
    let ours = UnixStream::from_std(ours).map_err(|e| VmError::Qemu(format!("socketpair: {e}")))?;
    Ok((ours, theirs.into()))
}

/// The end of a guest console log, for error messages.
pub fn console_tail(path: &Path) -> String {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// The host's TSC frequency, from the first `cpu MHz` of `/proc/cpuinfo`.
fn host_tsc_khz() -> Option<u64> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = cpuinfo
        .lines()
        .find(|l| l.starts_with("cpu MHz"))?
        .split(':')
        .nth(1)?
        .trim()
        .parse()
        .ok()?;
    // A positive frequency far below u64::MAX kHz; `as` from f64 saturates regardless.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let khz = (mhz * 1000.0) as u64;
    Some(khz)
}

/// What the guest boots: dsec's kernel and initramfs, or a bootable disk of the user's own
/// (a sandbox's overlay of it) through the firmware.
enum BootFrom<'a> {
    Kernel(&'a GuestAssets),
    Disk(&'a Path),
}

/// QEMU's arguments for a VM of `hw` in `dir`.
fn qemu_args(
    hw: &Hardware,
    from: BootFrom<'_>,
    boot: &BootArgs,
    disks: Option<&Disks>,
    memory: Option<(&Path, bool)>,
    fds: (i32, i32),
    console: &Path,
) -> Vec<String> {
    let (agent_fd, qmp_fd) = fds;
    let cpu = match hw.accel {
        Accel::Kvm => "host",
        Accel::Tcg => "max",
    };
    let mut args: Vec<String> = [
        "-nodefaults",
        "-no-user-config",
        "-no-reboot",
        "-display",
        "none",
    ]
    .map(String::from)
    .to_vec();
    let mut append = format!(
        "console=ttyS0 quiet panic=-1 no_timer_check {}",
        boot.to_cmdline()
    );
    if hw.machine == Machine::Microvm && hw.accel == Accel::Tcg {
        // Under TCG the guest reads the host's TSC. microvm has no timer that the kernel
        // can calibrate the TSC against reliably (about one boot in three hung): tell it.
        if let Some(khz) = host_tsc_khz() {
            append.push_str(&format!(" tsc_early_khz={khz}"));
        }
    }
    let mut machine = hw.machine.machine_arg().to_owned();
    if let Some((path, shared)) = memory {
        machine.push_str(",memory-backend=ram");
        args.extend([
            "-object".into(),
            format!(
                "memory-backend-file,id=ram,size={}M,mem-path={},share={}",
                hw.memory_mb,
                option_value(path),
                if shared { "on" } else { "off" }
            ),
        ]);
    }
    args.extend([
        "-machine".into(),
        machine,
        "-accel".into(),
        hw.accel.name().into(),
        "-cpu".into(),
        cpu.into(),
        "-smp".into(),
        hw.vcpus.to_string(),
        "-m".into(),
        format!("{}M", hw.memory_mb),
        "-chardev".into(),
        format!("file,id=console,path={}", console.display()),
        "-serial".into(),
        "chardev:console".into(),
        "-chardev".into(),
        format!("socket,id=agent,fd={agent_fd}"),
        "-device".into(),
        hw.machine.virtio("virtio-serial"),
        "-device".into(),
        format!("virtserialport,chardev=agent,name={}", guest::PORT_NAME),
        "-chardev".into(),
        format!("socket,id=qmp,fd={qmp_fd}"),
        "-mon".into(),
        "chardev=qmp,mode=control".into(),
        // The same device in every guest (see the module docs); no IPv6, which the
        // sandbox's namespace does not route.
        "-netdev".into(),
        "user,id=net0,ipv6=off".into(),
        "-device".into(),
        match hw.machine {
            Machine::Microvm => "virtio-net-device,netdev=net0".into(),
            // No option ROM: the kernel is booted directly.
            Machine::Q35 => "virtio-net-pci,netdev=net0,romfile=".into(),
        },
    ]);
    args.extend(match from {
        BootFrom::Kernel(assets) => [
            "-kernel".into(),
            assets.kernel.to_string_lossy().into_owned(),
            "-initrd".into(),
            assets.initramfs.to_string_lossy().into_owned(),
            "-append".into(),
            append,
        ],
        BootFrom::Disk(disk) => boot_disk_args(disk),
    });
    if let Some(d) = disks {
        for (i, image) in d.image.iter().enumerate() {
            args.extend([
                "-drive".into(),
                format!(
                    "file={},format=raw,if=none,id=image{i},readonly=on",
                    image.display()
                ),
                "-device".into(),
                format!(
                    "{},drive=image{i},serial={}",
                    hw.machine.virtio("virtio-blk"),
                    guest::image_disk_serial(i)
                ),
            ]);
        }
        args.extend([
            "-drive".into(),
            format!(
                "file={},format=qcow2,if=none,id=scratch,discard=unmap,cache=unsafe",
                d.scratch.display()
            ),
            "-device".into(),
            format!(
                "{},drive=scratch,serial={}",
                hw.machine.virtio("virtio-blk"),
                guest::SCRATCH_DISK_SERIAL
            ),
        ]);
    }
    args
}

/// How a new VM starts.
pub enum Start<'a> {
    /// Boot the kernel; once the agent reports ready the guest takes its identity.
    Cold(GuestIdentity<'a>),
    /// Boot the kernel with its RAM in the template's memory file and stop when the agent
    /// reports ready, before it takes an identity: the state a boot template is saved in
    /// ([`Vm::save_template`]).
    Template(TemplateFiles<'a>),
    /// Resume a boot template or a snapshot (over a copy of its scratch disk); the guest
    /// takes its identity.
    Restore(GuestIdentity<'a>, TemplateFiles<'a>),
    /// Resume a guest saved from a paused sandbox (see [`Vm::take_hold`]) on the channel it
    /// had, which goes on exactly where it stopped; the guest then takes its identity
    /// again (the clock above all: it was stopped for a while).
    Resume(GuestIdentity<'a>, TemplateFiles<'a>, Resumed),
    /// Wait, stopped, for a running guest's memory and devices to come in from
    /// [`Vm::send_state`], keeping its RAM in `files.memory` (mapped shared), so that it
    /// can be saved as a template ([`Vm::save_template`]): how a running guest becomes
    /// a snapshot.
    Receive(TemplateFiles<'a>),
    /// Boot only far enough for the agent to answer (accelerator probe; no disks).
    Probe,
    /// Boot a bootable disk of the user's own through the firmware, its own bootloader,
    /// kernel and init, whose agent runs as a service; once it reports ready the guest
    /// takes its identity (see [`crate::bootdisk`]).
    Disk(GuestIdentity<'a>, &'a Path),
}

/// The channel of a guest saved to disk, with the hold of its writes, taken before it
/// stopped; a [`Start::Resume`] goes on with both.
pub struct Resumed {
    /// The channel, suspended ([`Channel::suspend`]).
    pub channel: Channel,
    /// Its writes, held since the guest took all that was sent to it.
    pub hold: WriteHold,
}

/// What a sandbox's guest is told once it runs.
#[derive(Clone, Copy, Debug)]
pub struct GuestIdentity<'a> {
    /// Its hostname (the sandbox id).
    pub hostname: &'a str,
    /// The process limit of its commands.
    pub pids_max: u64,
    /// Its address, when it has a network (see the module docs).
    pub network: Option<std::net::Ipv4Addr>,
}

/// A boot template's saved guest (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct TemplateFiles<'a> {
    /// The guest's RAM, all of it: mapped shared by the template's QEMU, private by
    /// every restored guest's. Never written after the template is saved.
    pub memory: &'a Path,
    /// The CPUs' and devices' state: a migration stream without the RAM.
    pub state: &'a Path,
    /// The first request id the saved guest has never seen (1 for a boot template; past
    /// the running guest's last for a snapshot): a restored guest's requests start there.
    pub first_request: u32,
}

impl<'a> Start<'a> {
    fn identity(&self) -> Option<GuestIdentity<'a>> {
        match self {
            Start::Cold(identity)
            | Start::Disk(identity, _)
            | Start::Restore(identity, _)
            | Start::Resume(identity, ..) => Some(*identity),
            Start::Template(_) | Start::Receive(_) | Start::Probe => None,
        }
    }

    /// The memory file and whether this QEMU maps it shared.
    fn memory(&self) -> Option<(&'a Path, bool)> {
        match self {
            Start::Template(files) | Start::Receive(files) => Some((files.memory, true)),
            Start::Restore(_, files) | Start::Resume(_, files, _) => Some((files.memory, false)),
            Start::Cold(_) | Start::Disk(..) | Start::Probe => None,
        }
    }
}

/// The migration capability that leaves RAM in shared memory files out of the stream
/// (`state`: on or off).
fn ignore_shared(state: bool) -> serde_json::Value {
    serde_json::json!({"capabilities": [{"capability": "x-ignore-shared", "state": state}]})
}

/// Waits until the migration (either way) has completed and `done` holds; a failed one
/// is an error with QEMU's reason.
async fn migration_done(qmp: &Qmp, what: &str, done: impl Fn() -> bool) -> Result<(), VmError> {
    let waiting = async {
        // Loading a device state takes milliseconds, a guest's RAM up to seconds.
        let mut pause = Duration::from_millis(1);
        loop {
            let info = qmp.execute("query-migrate", serde_json::json!({})).await?;
            match info.get("status").and_then(serde_json::Value::as_str) {
                Some("completed") if done() => return Ok(()),
                Some("failed" | "cancelled") => {
                    let why = info
                        .get("error-desc")
                        .and_then(serde_json::Value::as_str)
                        .unwrap_or("QEMU gave no reason");
                    return Err(VmError::Qemu(format!("{what} failed: {why}")));
                }
                _ => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(10));
                }
            }
        }
    };
    tokio::time::timeout(MIGRATION_TIMEOUT, waiting)
        .await
        .unwrap_or_else(|_| {
            Err(VmError::Qemu(format!(
                "{what} took over {} s",
                MIGRATION_TIMEOUT.as_secs()
            )))
        })
}

/// Leaves the kernel out of the arguments of a microvm whose guest comes in by migration:
/// it never boots, and QEMU would hold the whole kernel image in its own memory (~14 MiB
/// of every guest's private memory). Its migration state does not depend on the kernel;
/// a q35 machine's does (its linuxboot option ROM is migrated RAM), so it keeps it.
fn without_kernel(args: &mut Vec<String>) {
    let mut kept = Vec::with_capacity(args.len());
    let mut rest = std::mem::take(args).into_iter();
    while let Some(arg) = rest.next() {
        if matches!(arg.as_str(), "-kernel" | "-initrd" | "-append") {
            rest.next();
        } else {
            kept.push(arg);
        }
    }
    *args = kept;
}

/// `path` quoted for `/bin/sh`, which runs QEMU's `exec:` migration commands.
fn shell_quoted(path: &Path) -> String {
    format!("'{}'", path.to_string_lossy().replace('\'', r"'\''"))
}

/// `path` as a value of a QEMU `key=value,...` option (commas doubled).
fn option_value(path: &Path) -> String {
    path.to_string_lossy().replace(',', ",,")
}

/// Gives the guest its name, fresh randomness and the time; the agent confines itself
/// right after.
async fn send_identity(channel: &Channel, guest: GuestIdentity<'_>) -> Result<(), String> {
    channel
        .request(FrameKind::Identity, &identity_payload(guest))
        .await
        .map(drop)
        .map_err(|e| format!("the guest refused its identity: {e}"))
}

/// Gives a restored guest its identity as request `id`, straight on its channel, and
/// returns what the channel had read past the answer.
///
/// What the guest sends before the answer is dropped: a snapshot of a running guest
/// may have been taken halfway through a frame the guest was writing, whose first part
/// went to the snapshotted guest's own channel. The guest writes its frames in order,
/// so the stream is whole again from the answer on; `id` was never used before, and is
/// chosen at random far from the ids used before, so that no older output can hold the
/// answer's header by chance.
async fn identify_restored(
    stream: &mut UnixStream,
    guest: GuestIdentity<'_>,
    id: u32,
) -> Result<Vec<u8>, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let payload = identity_payload(guest);
    let mut frame = proto::header(FrameKind::Identity, id, payload.len()).to_vec();
    frame.extend_from_slice(&payload);
    let gone = |e: std::io::Error| format!("the guest's channel failed: {e}");
    stream.write_all(&frame).await.map_err(gone)?;
    // Kind and id: the last five bytes of the answer's header.
    let tail = |kind| proto::header(kind, id, 0)[4..].to_vec();
    let (done, error) = (tail(FrameKind::Done), tail(FrameKind::Error));
    let mut buf = Vec::new();
    loop {
        let found = buf
            .windows(5)
            .enumerate()
            .skip(4)
            .find(|(_, w)| *w == done.as_slice() || *w == error.as_slice());
        if let Some((at, _)) = found {
            let start = at - 4;
            if let Some((kind, _, len)) = proto::decode_header(&buf[start..]).ok().flatten() {
                let end = start + proto::HEADER_LEN + len;
                if buf.len() >= end {
                    if kind == FrameKind::Done {
                        return Ok(buf.split_off(end));
                    }
                    let err: proto::InitError =
                        serde_json::from_slice(&buf[start + proto::HEADER_LEN..end])
                            .map_err(|e| format!("the guest's answer is unreadable: {e}"))?;
                    return Err(format!("the guest refused its identity: {}", err.message));
                }
            }
        }
        if buf.len() > MAX_STALE_BUFFER {
            if found.is_some() {
                return Err("the guest's answer to its identity is too large".into());
            }
            // Only the answer's header matters: what the guest sent before it can go,
            // so a guest that floods and never answers costs no memory (up to the timeout).
            buf.drain(..buf.len() - (proto::HEADER_LEN - 1));
        }
        let mut chunk = [0u8; 16 << 10];
        match stream.read(&mut chunk).await.map_err(gone)? {
            0 => return Err("the guest closed its channel".into()),
            n => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// An [`proto::Identity`] for `guest`, as JSON.
fn identity_payload(guest: GuestIdentity<'_>) -> Vec<u8> {
    let identity = proto::Identity {
        hostname: guest.hostname.to_owned(),
        pids_max: Some(guest.pids_max),
        network: guest.network.map(|address| proto::GuestNetwork { address }),
        entropy: (0..64).map(|_| rand::random::<u8>()).collect(),
        unix_time_ns: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    };
    serde_json::to_vec(&identity).expect("identity serializes")
}

impl Vm {
    /// Starts QEMU for a VM of `hw` whose files live in `dir`.
    pub async fn start(
        hw: &Hardware,
        assets: &GuestAssets,
        disks: Option<&Disks>,
        start: Start<'_>,
        dir: &Path,
        timeout: Option<Duration>,
    ) -> Result<Vm, VmError> {
        let (agent_host, agent_qemu) = socketpair()?;
        let (qmp_host, qmp_qemu) = socketpair()?;
        let console = dir.join("console.log");
        let boot = BootArgs {
            hostname: start.identity().map_or("dsec", |i| i.hostname).to_owned(),
            base_fs: disks.map_or(BaseFs::Ext4, |d| d.base_fs).name().into(),
            image_disks: disks.map_or(1, |d| d.image.len()),
            probe: matches!(start, Start::Probe),
        };
        let from = match start {
            Start::Disk(_, disk) => BootFrom::Disk(disk),
            _ => BootFrom::Kernel(assets),
        };
        let mut args = qemu_args(
            hw,
            from,
            &boot,
            disks,
            start.memory(),
            (agent_qemu.as_raw_fd(), qmp_qemu.as_raw_fd()),
            &console,
        );
        if matches!(
            start,
            Start::Restore(..) | Start::Resume(..) | Start::Receive(_)
        ) {
            if hw.machine == Machine::Microvm {
                without_kernel(&mut args);
            }
            args.extend(["-incoming".into(), "defer".into()]);
        }
        let log_path = dir.join("qemu.log");
        let log = std::fs::File::create(&log_path).map_err(VmError::io("create", &log_path))?;
        let mut cmd = tokio::process::Command::new(QEMU);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        let inherited = [agent_qemu.as_raw_fd(), qmp_qemu.as_raw_fd()];
        // Its own network namespace, empty (see the module docs).
        // PR_SET_PDEATHSIG fires when the *thread* that forked exits: this runs on the
        // runtime's worker threads, which live as long as the server — as long as no
        // one calls `block_in_place` on them (it turns the worker into a blocking-pool
        // thread, which exits when idle) and this is never called from spawn_blocking,
        // whose threads come and go. The server calls neither.
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
        // syscalls (fcntl, prctl, unshare) on descriptors and state of the child.
        unsafe {
            cmd.pre_exec(move || {
                for fd in inherited {
                    clear_cloexec(fd)?;
                }
                if libc::unshare(libc::CLONE_NEWNET) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| {
            VmError::Unavailable(format!("cannot run {QEMU} ({e}); run scripts/setup.sh"))
        })?;
        drop((agent_qemu, qmp_qemu));
        let pid = i32::try_from(
            child
                .id()
                .expect("a child that was not waited for has a pid"),
        )
        .expect("a pid is a pid_t");
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(pid).expect("positive pid"),
            rustix::process::PidfdFlags::empty(),
        )
        .map_err(|e| VmError::Qemu(format!("pidfd_open: {e}")))?;
        let (exited_tx, exited) = watch::channel(false);
        let status = Arc::new(OnceLock::new());
        let reaped = Arc::clone(&status);
        tokio::spawn(async move {
            if let Ok(status) = child.wait().await {
                let _ = reaped.set(status);
            }
            let _ = exited_tx.send(true);
        });
        let failed = |reason: String| {
            let qemu_log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let mut console_text = console_tail(&console);
            if !qemu_log.trim().is_empty() {
                console_text = format!("{console_text}\n[qemu] {}", qemu_log.trim());
            }
            VmError::Boot {
                reason,
                console: console_text,
            }
        };
        let kill = || {
            let _ = rustix::process::pidfd_send_signal(&pidfd, rustix::process::Signal::KILL);
        };
        let qmp = match Qmp::connect(qmp_host).await {
            Ok(qmp) => qmp,
            Err(e) => {
                kill();
                return Err(failed(e.to_string()));
            }
        };
        if let Start::Restore(_, files) | Start::Resume(_, files, _) = &start {
            // The guest runs once its state is in.
            let incoming = async {
                qmp.execute("migrate-set-capabilities", ignore_shared(true))
                    .await?;
                // Read by QEMU itself: no shell and `cat` to start.
                let state =
                    std::fs::File::open(files.state).map_err(VmError::io("open", files.state))?;
                qmp.send_fd(MIGRATION_FD, state.as_fd()).await?;
                drop(state);
                let uri = format!("fd:{MIGRATION_FD}");
                qmp.execute("migrate-incoming", serde_json::json!({ "uri": uri }))
                    .await?;
                migration_done(&qmp, "loading the boot template's device state", || true).await?;
                // The template was saved stopped, and a guest comes in as it went out.
                qmp.execute("cont", serde_json::json!({})).await
            };
            if let Err(e) = incoming.await.map(drop) {
                kill();
                return Err(failed(e.to_string()));
            }
        }
        let wait = timeout.unwrap_or(RESTORE_TIMEOUT);
        let answered = |_| format!("the guest did not answer within {} s", wait.as_secs());
        let channel = async {
            match start {
                Start::Restore(identity, files) => {
                    let mut stream = agent_host;
                    let id = files.first_request;
                    let pending =
                        tokio::time::timeout(wait, identify_restored(&mut stream, identity, id))
                            .await
                            .map_err(answered)??;
                    Ok(Channel::attach(stream, pending, id.wrapping_add(1)))
                }
                Start::Resume(identity, _, Resumed { channel, hold }) => {
                    channel.resume_on(agent_host, hold);
                    tokio::time::timeout(wait, send_identity(&channel, identity))
                        .await
                        .map_err(answered)??;
                    Ok(channel)
                }
                // Its guest never runs: the channel is never used.
                Start::Receive(_) => Ok(Channel::attach(agent_host, Vec::new(), 1)),
                Start::Cold(_) | Start::Disk(..) | Start::Template(_) | Start::Probe => {
                    let channel = Channel::open(agent_host, timeout.unwrap_or(BOOT_TIMEOUT))
                        .await
                        .map(|(channel, _)| channel)
                        .map_err(|e| e.to_string())?;
                    if let Some(identity) = start.identity() {
                        tokio::time::timeout(wait, send_identity(&channel, identity))
                            .await
                            .map_err(answered)??;
                    }
                    Ok::<_, String>(channel)
                }
            }
        }
        .await;
        match channel {
            Ok(channel) => Ok(Vm {
                pid,
                pidfd,
                channel,
                qmp,
                exited,
                status,
                console,
                held: tokio::sync::Mutex::new(None),
            }),
            Err(reason) => {
                kill();
                Err(failed(reason))
            }
        }
    }

    /// QEMU's host pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// QEMU's network namespace (see the module docs), for plugging it into the bridge.
    pub fn netns(&self) -> Result<OwnedFd, VmError> {
        let path = format!("/proc/{}/ns/net", self.pid);
        let netns: OwnedFd = std::fs::File::open(&path)
            .map_err(|e| VmError::Qemu(format!("opening {path}: {e}")))?
            .into();
        // The pid was QEMU's when the namespace was opened if QEMU (alive, or a zombie
        // not reaped yet, whose pid cannot be reused) is still there now.
        // SAFETY: pidfd_send_signal(2) with signal 0 (a check only) on our own pidfd.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                0,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc < 0 {
            return Err(VmError::Qemu(format!(
                "QEMU is gone: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(netns)
    }

    /// Has the running guest take `identity` again: how its network changes.
    pub async fn identify(&self, identity: GuestIdentity<'_>) -> Result<(), VmError> {
        send_identity(&self.channel, identity)
            .await
            .map_err(VmError::Qemu)
    }

    /// The guest agent's channel.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// The guest's serial console log.
    pub fn console(&self) -> &Path {
        &self.console
    }

    /// False once QEMU has exited or the agent's channel closed.
    pub fn is_alive(&self) -> bool {
        !*self.exited.borrow() && self.channel.is_alive()
    }

    /// Stops the vCPUs (the guest's clocks stop with them), once the guest has taken
    /// what was sent to it; no request is sent until [`Vm::resume`].
    pub async fn pause(&self) -> Result<(), VmError> {
        let mut held = self.held.lock().await;
        if held.is_none() {
            *held = Some(self.channel.hold_writes(DRAIN_TIMEOUT).await);
        }
        self.qmp
            .execute("stop", serde_json::json!({}))
            .await
            .map(drop)
    }

    /// Restarts the vCPUs.
    pub async fn resume(&self) -> Result<(), VmError> {
        let mut held = self.held.lock().await;
        self.qmp.execute("cont", serde_json::json!({})).await?;
        *held = None;
        Ok(())
    }

    /// The hold of a paused guest's writes (see [`Vm::pause`]), for a [`Start::Resume`] of
    /// the guest once this QEMU is gone; `None` unless paused.
    pub async fn take_hold(&self) -> Option<WriteHold> {
        self.held.lock().await.take()
    }

    /// Sends a paused guest's memory and devices to `receiver` (started with
    /// [`Start::Receive`], for the same hardware and disks), which then holds the same
    /// guest, stopped. This guest stays paused: [`Vm::resume`] runs it on.
    pub async fn send_state(&self, receiver: &Vm) -> Result<(), VmError> {
        let drained = self.held.lock().await.as_ref().map(WriteHold::drained);
        if drained != Some(true) {
            return Err(VmError::Qemu(
                "the guest has not taken all that was sent to it; it cannot be saved now \
                 (try again)"
                    .into(),
            ));
        }
        // One socket pair between the two QEMUs: the RAM goes from one to the other with
        // no process or pipe in between.
        let (out, into) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| VmError::Qemu(format!("socketpair: {e}")))?;
        // RAM included: this guest's is private, the receiver's a shared file.
        for vm in [self, receiver] {
            vm.qmp
                .execute("migrate-set-capabilities", ignore_shared(false))
                .await?;
        }
        // A copy between two processes of this host: QEMU's default cap on migration
        // bandwidth (128 MiB/s) would be most of the time a snapshot takes.
        self.qmp
            .execute(
                "migrate-set-parameters",
                serde_json::json!({ "max-bandwidth": UNLIMITED_BANDWIDTH }),
            )
            .await?;
        receiver.qmp.send_fd(MIGRATION_FD, into.as_fd()).await?;
        drop(into);
        let uri = serde_json::json!({ "uri": format!("fd:{MIGRATION_FD}") });
        receiver
            .qmp
            .execute("migrate-incoming", uri.clone())
            .await?;
        self.qmp.send_fd(MIGRATION_FD, out.as_fd()).await?;
        drop(out);
        self.qmp.execute("migrate", uri).await?;
        migration_done(&self.qmp, "sending the guest's state", || true).await?;
        migration_done(&receiver.qmp, "receiving the guest's state", || true).await
    }

    /// Saves a guest started with [`Start::Template`]: stops it and writes its CPUs' and
    /// devices' state to `state` (its RAM is already its memory file; its scratch disk
    /// is flushed as the migration ends). `state` appears only once it is whole. The
    /// guest stays stopped: kill it after.
    pub async fn save_template(&self, state: &Path) -> Result<(), VmError> {
        let partial = state.with_extension("partial");
        let _ = std::fs::remove_file(&partial);
        self.qmp.execute("stop", serde_json::json!({})).await?;
        self.qmp
            .execute("migrate-set-capabilities", ignore_shared(true))
            .await?;
        // `cat` ends when QEMU closes the stream, after the migration reports completed:
        // the rename marks the end of the file.
        let uri = format!(
            "exec:cat > {} && mv {} {}",
            shell_quoted(&partial),
            shell_quoted(&partial),
            shell_quoted(state)
        );
        self.qmp
            .execute("migrate", serde_json::json!({ "uri": uri }))
            .await?;
        migration_done(&self.qmp, "saving the guest's device state", || {
            state.exists()
        })
        .await
    }

    /// Kills QEMU and waits until it is gone. Idempotent.
    pub async fn kill(&self) {
        let _ = rustix::process::pidfd_send_signal(&self.pidfd, rustix::process::Signal::KILL);
        let mut exited = self.exited.clone();
        let _ = tokio::time::timeout(Duration::from_secs(10), exited.wait_for(|e| *e)).await;
    }

    /// Resolves when QEMU exits.
    pub fn exited(&self) -> watch::Receiver<bool> {
        self.exited.clone()
    }

    /// QEMU's exit status, once it has exited (`None` while it runs).
    pub fn exit_status(&self) -> Option<ExitStatus> {
        self.status.get().copied()
    }
}

impl Drop for Vm {
    /// A VM nobody holds any more must not keep running until the server exits.
    fn drop(&mut self) {
        let _ = rustix::process::pidfd_send_signal(&self.pidfd, rustix::process::Signal::KILL);
    }
}

/// Whether KVM runs this guest: boots the kernel and agent with nothing else attached
/// and waits up to `deadline` for the agent. A nested `/dev/kvm` that opens but stalls
/// Linux early in boot (as on some CI hosts) fails here and dsec falls back to TCG.
pub async fn probe_kvm(assets: &GuestAssets, dir: &Path, deadline: Duration) -> Result<(), String> {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return Err("/dev/kvm cannot be opened".into());
    }
    let hw = Hardware {
        machine: Machine::Q35,
        accel: Accel::Kvm,
        vcpus: 1,
        memory_mb: 128,
    };
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let started = tokio::time::Instant::now();
    let result = Vm::start(&hw, assets, None, Start::Probe, dir, Some(deadline)).await;
    let outcome = match &result {
        Ok(vm) => {
            vm.kill().await;
            Ok(())
        }
        Err(e) => Err(format!(
            "a KVM guest did not reach its agent within {:.1} s: {}",
            started.elapsed().as_secs_f64(),
            // The last line is QEMU's own complaint when it has one.
            e.to_string().lines().last().unwrap_or_default()
        )),
    };
    let _ = std::fs::remove_dir_all(dir);
    outcome
}
