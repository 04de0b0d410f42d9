//! A VM guest's way into init's loop: the guest agent (`dsec-agent`, PID 1 of the guest)
//! builds the guest's root, then calls [`serve_guest`], which takes the guest's identity
//! with full privileges, confines the agent as a container's init is confined, and serves
//! the edge from the same loop ([`super::serve`]).
//!
//! Invariant: nothing is served before the identity is taken and the agent is confined;
//! the first request must be the identity, and every other request before it is refused.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use super::{encode_ready, io_setup_error, setup_error, signal_fd, Confine, Init, Prepared};
use rustix::io::Errno;
use rustix::process::DumpableBehavior;
use rustix::time::{ClockId, Timespec};

use crate::files::SandboxRoot;
use crate::launch::write_all_blocking;
use crate::proto::{self, FrameKind, InitError, InitStage};
use crate::seccomp::SeccompProfile;

/// The cgroup (v2) a VM guest's commands run in, made by the agent before it confines
/// itself. Its memory limit leaves the kernel and the agent a reserve, so a memory hog
/// meets the cgroup's OOM killer quickly instead of thrashing the whole guest (under
/// binary translation the global OOM killer can take tens of seconds to act), and its
/// `pids.max` is the sandbox's process limit.
pub struct GuestCgroup {
    /// `cgroup.procs`, opened for writing: each command joins by writing `0`.
    pub procs: OwnedFd,
    /// `pids.max`, opened for writing.
    pub pids_max: OwnedFd,
    /// The cgroup's directory, whose counters [`FrameKind::Usage`] reads.
    pub dir: OwnedFd,
    /// The root of the scratch disk's filesystem (the writable layer), for its usage.
    pub scratch: OwnedFd,
    /// The roots of the image's layers, under the overlay, for what commands replaced of
    /// them (see [`crate::layers`]).
    pub lowers: Vec<OwnedFd>,
}

impl GuestCgroup {
    fn set_pids_max(&self, limit: Option<u64>) -> std::io::Result<()> {
        let Some(limit) = limit else {
            return Ok(());
        };
        let text = limit.to_string();
        write_all_blocking(&self.pids_max, text.as_bytes())
    }
}

/// Serves a VM guest's commands and file requests over `control` until the edge closes
/// it, then returns. The caller (the guest agent, PID 1 of the guest) has built the root.
///
/// The agent reports ready, then waits for the guest's [`proto::Identity`] — a boot
/// template is saved right there, so every guest restored from it takes its own — and
/// takes it with full privileges. Then it confines itself exactly as a container's init
/// does (capabilities, no_new_privs, `seccomp`): commands inherit all of it for free,
/// and installing a filter per command would cost a BPF JIT compile each time, which is
/// slow under binary translation.
///
/// `net_modules` are the network driver's modules ([`crate::guest::NET_MODULE_ORDER`]),
/// opened before the guest's root replaced the initramfs: the identity loads them when it
/// first gives the guest a network.
pub fn serve_guest(
    control: OwnedFd,
    seccomp: SeccompProfile,
    cgroup: GuestCgroup,
    net_modules: Vec<OwnedFd>,
) -> Result<(), InitError> {
    // SAFETY: restoring default dispositions; no handler code is involved.
    unsafe {
        libc::signal(libc::SIGCHLD, libc::SIG_DFL);
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    let devnull = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| io_setup_error(InitStage::OpenDevNull, e))?;
    // As a container's init: /proc/1/fd (the channel) stays closed to commands.
    let _ = rustix::process::set_dumpable_behavior(DumpableBehavior::NotDumpable);
    let signals = signal_fd()?;
    let mut out = Vec::new();
    encode_ready(&mut out, None);
    write_all_blocking(&control, &out).map_err(|e| io_setup_error(InitStage::ReportReady, e))?;
    let mut inbuf = Vec::new();
    let identity = loop {
        match proto::decode(&mut inbuf) {
            Ok(Some(frame)) if frame.kind == FrameKind::Identity => break frame,
            Ok(Some(frame)) => {
                let mut answer = Vec::new();
                let err = setup_error(
                    InitStage::Identity,
                    "the first request must be the guest's identity",
                    None,
                );
                proto::encode_json(&mut answer, FrameKind::Error, frame.exec_id, &err);
                let _ = write_all_blocking(&control, &answer);
            }
            Ok(None) => {
                let mut chunk = [0u8; 4096];
                match rustix::io::read(&control, &mut chunk) {
                    Ok(0) => return Ok(()),
                    Ok(n) => inbuf.extend_from_slice(&chunk[..n]),
                    Err(Errno::INTR) => continue,
                    Err(e) => return Err(io_setup_error(InitStage::ReadChannel, e.into())),
                }
            }
            Err(e) => return Err(setup_error(InitStage::Decode, e, None)),
        }
    };
    let mut answer = Vec::new();
    let taken = identity
        .json::<proto::Identity>()
        .map_err(|e| setup_error(InitStage::Identity, e, None))
        .and_then(|id| {
            take_identity(&id, &net_modules).map_err(|e| io_setup_error(InitStage::Identity, e))?;
            cgroup
                .set_pids_max(id.pids_max)
                .map_err(|e| io_setup_error(InitStage::PidsLimit, e))
        });
    match &taken {
        Ok(()) => proto::encode(&mut answer, FrameKind::Done, identity.exec_id, &[]),
        Err(err) => proto::encode_json(&mut answer, FrameKind::Error, identity.exec_id, err),
    }
    write_all_blocking(&control, &answer)
        .map_err(|e| io_setup_error(InitStage::AnswerIdentity, e))?;
    taken?;
    let identity_keeper = IdentityKeeper::start(&control, net_modules)
        .map_err(|e| io_setup_error(InitStage::Identity, e))?;
    crate::caps::drop_to_default()
        .map_err(|e| setup_error(InitStage::DropCapabilities, e, None))?;
    seccomp
        .apply()
        .map_err(|e| setup_error(InitStage::InstallSeccomp, e, None))?;
    let files = SandboxRoot::open(std::path::Path::new("/"))
        .map_err(|e| io_setup_error(InitStage::OpenFilesRoot, e))?;
    let prepared = Prepared {
        upper: None,
        files: Some(files),
        confine: Confine::Inherited,
        signals,
        devnull: devnull.into(),
        commands_cgroup: Some(cgroup.procs),
        guest: true,
        identity_keeper: Some(identity_keeper),
        usage: Some(UsageSource {
            cgroup: cgroup.dir,
            scratch: cgroup.scratch,
            lowers: cgroup.lowers,
        }),
    };
    Init::new(control, prepared, Vec::new(), inbuf).serve();
    Ok(())
}

/// The largest identity request the keeper reads (64 bytes of entropy and a hostname
/// fit many times over).
const MAX_IDENTITY: usize = 16 << 10;

/// A child of the agent forked before it confines itself, which keeps the privileges
/// a new identity needs (hostname, entropy, clock, network interface) and nothing else: a guest restored
/// from a snapshot of its running self — a fork's child — is already confined when it
/// is told who it is now. It serves only the agent, over a socket pair no command can
/// reach (the agent is not dumpable, so its descriptors are closed to them), and takes
/// nothing but an [`proto::Identity`] over it.
pub(super) struct IdentityKeeper {
    socket: OwnedFd,
}

impl IdentityKeeper {
    fn start(control: &OwnedFd, net_modules: Vec<OwnedFd>) -> std::io::Result<IdentityKeeper> {
        use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
        let (ours, theirs) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        // SAFETY: the agent is single-threaded here (it has started no thread), so the
        // child may run any code; it only loops below and exits.
        match unsafe { libc::fork() } {
            -1 => Err(std::io::Error::last_os_error()),
            0 => {
                drop(ours);
                // The channel stays the agent's alone.
                // SAFETY: closing a descriptor this process inherited and never uses.
                unsafe { libc::close(control.as_raw_fd()) };
                Self::serve(&theirs, &net_modules);
                // SAFETY: the keeper's end; nothing of the agent's is left to unwind.
                unsafe { libc::_exit(0) }
            }
            // The agent itself keeps no module: only the keeper loads them.
            _ => Ok(IdentityKeeper { socket: ours }),
        }
    }

    /// The keeper's loop: one identity per message, answered with `0`, or `1` and the
    /// error's text; ends when the agent's end closes.
    fn serve(socket: &OwnedFd, net_modules: &[OwnedFd]) {
        use rustix::net::{recv, send, RecvFlags, SendFlags};
        let mut buf = vec![0u8; MAX_IDENTITY];
        loop {
            let n = match recv(socket, &mut buf, RecvFlags::empty()) {
                Ok((0, _)) => return,
                Ok((n, _)) => n,
                Err(Errno::INTR) => continue,
                Err(_) => return,
            };
            let answer = serde_json::from_slice::<proto::Identity>(&buf[..n])
                .map_err(|e| e.to_string())
                .and_then(|id| take_identity(&id, net_modules).map_err(|e| e.to_string()));
            let reply = match answer {
                Ok(()) => vec![0],
                Err(e) => [&[1], e.as_bytes()].concat(),
            };
            if send(socket, &reply, SendFlags::empty()).is_err() {
                return;
            }
        }
    }

    /// Has the keeper take the identity in `request` (an [`proto::Identity`] as JSON).
    pub(super) fn take(&self, request: &[u8]) -> Result<(), String> {
        use rustix::net::{recv, send, RecvFlags, SendFlags};
        if request.len() > MAX_IDENTITY {
            return Err(format!(
                "an identity of {} bytes is too large",
                request.len()
            ));
        }
        let failed = |e: Errno| format!("the guest's identity keeper is gone: {e}");
        send(&self.socket, request, SendFlags::empty()).map_err(failed)?;
        let mut reply = vec![0u8; 4096];
        let n = loop {
            match recv(&self.socket, &mut reply, RecvFlags::empty()) {
                Err(Errno::INTR) => continue,
                Ok((0, _)) => return Err("the guest's identity keeper is gone".into()),
                other => break other.map_err(failed)?.0,
            }
        };
        match reply[..n] {
            [0] => Ok(()),
            _ => Err(String::from_utf8_lossy(&reply[1..n]).into_owned()),
        }
    }
}

/// Where a guest's usage is read from (see [`GuestCgroup`]).
pub(super) struct UsageSource {
    cgroup: OwnedFd,
    scratch: OwnedFd,
    lowers: Vec<OwnedFd>,
}

impl UsageSource {
    /// What the guest's commands use now.
    pub(super) fn read(&self) -> proto::GuestUsage {
        let text = |name: &str| {
            rustix::fs::openat(
                &self.cgroup,
                name,
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::CLOEXEC,
                rustix::fs::Mode::empty(),
            )
            .ok()
            .and_then(|fd| std::io::read_to_string(std::fs::File::from(fd)).ok())
            .unwrap_or_default()
        };
        let number = |name: &str| text(name).trim().parse().unwrap_or(0);
        let pids_limit_hits = text("pids.events")
            .lines()
            .find_map(|l| l.strip_prefix("max "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let disk = rustix::fs::fstatvfs(&self.scratch).ok();
        proto::GuestUsage {
            memory_bytes: number("memory.current"),
            memory_peak_bytes: number("memory.peak"),
            pids: number("pids.current"),
            pids_limit_hits,
            oom_kills: oom_kills().unwrap_or(0),
            disk_bytes: disk
                .as_ref()
                .map_or(0, |st| st.f_blocks.saturating_sub(st.f_bfree) * st.f_frsize),
            disk_inodes: disk.map_or(0, |st| st.f_files.saturating_sub(st.f_ffree)),
            replaced: self.replaced(),
        }
    }

    /// The image's binaries commands replaced, read from the overlay's upper directory
    /// (`upper` on the scratch disk, as `rootfs::setup_guest` stacks it).
    fn replaced(&self) -> Vec<String> {
        let Ok(upper) = rustix::fs::openat(
            &self.scratch,
            "upper",
            rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ) else {
            return Vec::new();
        };
        let mut replaced = crate::layers::replaced_image_files(
            upper.as_fd(),
            &self.lowers,
            &crate::layers::IMAGE_BINARY_DIRS,
        );
        replaced.truncate(proto::MAX_REPLACED_REPORTED);
        replaced
    }
}

/// OOM kills since boot, from `/proc/vmstat`: in a VM guest the whole machine is the
/// sandbox, so any kill during a command is charged to it.
pub(super) fn oom_kills() -> Option<u64> {
    std::fs::read_to_string("/proc/vmstat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))?
        .trim()
        .parse()
        .ok()
}

/// Makes a restored guest distinct from its siblings: hostname, credited entropy and a
/// forced reseed of the kernel's generator, the current time, and its network.
fn take_identity(identity: &proto::Identity, net_modules: &[OwnedFd]) -> std::io::Result<()> {
    crate::rootfs::set_hostname(&identity.hostname)?;
    take_network(identity.network.as_ref(), net_modules)?;
    let urandom = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")?;
    let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let buf_size =
        i32::try_from(identity.entropy.len()).map_err(|_| invalid("too much entropy"))?;
    let entropy_bits = buf_size
        .checked_mul(8)
        .ok_or_else(|| invalid("too much entropy"))?;
    let mut info = Vec::with_capacity(8 + identity.entropy.len());
    info.extend_from_slice(&entropy_bits.to_ne_bytes());
    info.extend_from_slice(&buf_size.to_ne_bytes());
    info.extend_from_slice(&identity.entropy);
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    // SAFETY: ioctls on a descriptor we own; info is a valid rand_pool_info that
    // outlives the call, and RNDRESEEDCRNG takes no argument.
    unsafe {
        if libc::ioctl(urandom.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) < 0
            || libc::ioctl(urandom.as_raw_fd(), RNDRESEEDCRNG) < 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    let now = Timespec {
        tv_sec: i64::try_from(identity.unix_time_ns / 1_000_000_000)
            .map_err(|_| invalid("time out of range"))?,
        tv_nsec: (identity.unix_time_ns % 1_000_000_000) as i64,
    };
    Ok(rustix::time::clock_settime(ClockId::Realtime, now)?)
}

/// Gives the guest the interface `network` describes: its driver loaded (until then the
/// guest has loopback only), the sandbox's address alone on it, a route to the gateway
/// and the default route through it. `None` takes an interface the guest has down, its
/// routes with it (a restored snapshot of a guest that had a network keeps the device,
/// never a route out).
fn take_network(network: Option<&proto::GuestNetwork>, modules: &[OwnedFd]) -> std::io::Result<()> {
    use crate::guest::{NET_GATEWAY, NET_INTERFACE};
    let socket = rustix::net::socket_with(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::DGRAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )?;
    let Some(network) = network else {
        return match set_interface_up(&socket, NET_INTERFACE, false) {
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
            other => other,
        };
    };
    for module in modules {
        // SAFETY: finit_module(2) on a descriptor we own, with an empty parameter string.
        let rc =
            unsafe { libc::syscall(libc::SYS_finit_module, module.as_raw_fd(), c"".as_ptr(), 0) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(e);
            }
        }
    }
    let mut ifr = ifreq(NET_INTERFACE);
    ifr.ifr_ifru.ifru_addr = sockaddr(network.address);
    interface_ioctl(&socket, libc::SIOCSIFADDR, &mut ifr)?;
    ifr.ifr_ifru.ifru_netmask = sockaddr(std::net::Ipv4Addr::BROADCAST);
    interface_ioctl(&socket, libc::SIOCSIFNETMASK, &mut ifr)?;
    set_interface_up(&socket, NET_INTERFACE, true)?;
    let mut dev = *b"eth0\0";
    debug_assert_eq!(&dev[..4], NET_INTERFACE.as_bytes());
    let unspecified = std::net::Ipv4Addr::UNSPECIFIED;
    // The gateway on the link, then everything through it.
    for (dst, mask, gateway, flags) in [
        (
            NET_GATEWAY,
            std::net::Ipv4Addr::BROADCAST,
            unspecified,
            libc::RTF_HOST,
        ),
        (unspecified, unspecified, NET_GATEWAY, libc::RTF_GATEWAY),
    ] {
        // SAFETY: rtentry is plain old data; all-zeroes is a valid value.
        let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
        route.rt_dst = sockaddr(dst);
        route.rt_genmask = sockaddr(mask);
        route.rt_gateway = sockaddr(gateway);
        route.rt_flags = libc::RTF_UP | flags;
        route.rt_dev = dev.as_mut_ptr().cast();
        // SAFETY: SIOCADDRT reads a valid rtentry whose device name outlives the call.
        let rc = unsafe { libc::ioctl(socket.as_raw_fd(), libc::SIOCADDRT, &route) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(e);
            }
        }
    }
    Ok(())
}

/// An `ifreq` naming interface `name` (ASCII, shorter than `IFNAMSIZ`).
fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: ifreq is plain old data; all-zeroes is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    // ASCII, byte for byte (c_char is i8 or u8 by architecture).
    #[allow(clippy::cast_possible_wrap)]
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    ifr
}

/// `addr` as the `sockaddr` the interface and route ioctls take.
fn sockaddr(addr: std::net::Ipv4Addr) -> libc::sockaddr {
    // AF_INET is 2.
    #[allow(clippy::cast_possible_truncation)]
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(addr).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size; the kernel reads it as the
    // family says.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn interface_ioctl(
    socket: &OwnedFd,
    request: libc::c_ulong,
    ifr: &mut libc::ifreq,
) -> std::io::Result<()> {
    // SAFETY: an interface ioctl on a valid, initialised ifreq that outlives the call.
    if unsafe { libc::ioctl(socket.as_raw_fd(), request, ifr as *mut libc::ifreq) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Sets or clears `IFF_UP` on interface `name`, keeping its other flags.
fn set_interface_up(socket: &OwnedFd, name: &str, up: bool) -> std::io::Result<()> {
    let mut ifr = ifreq(name);
    interface_ioctl(socket, libc::SIOCGIFFLAGS, &mut ifr)?;
    // SAFETY: SIOCGIFFLAGS filled in the flags member.
    let flags = unsafe { ifr.ifr_ifru.ifru_flags };
    #[allow(clippy::cast_possible_truncation)] // IFF_UP is 1
    let bit = libc::IFF_UP as libc::c_short;
    ifr.ifr_ifru.ifru_flags = if up { flags | bit } else { flags & !bit };
    interface_ioctl(socket, libc::SIOCSIFFLAGS, &mut ifr)
}
