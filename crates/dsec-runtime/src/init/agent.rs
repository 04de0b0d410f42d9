//! A VM guest's way into init's loop: the guest agent (`dsec-agent`, PID 1 of the guest)
//! builds the guest's root, then calls [`serve_guest`], which takes the guest's identity
//! with full privileges, confines the agent as a container's init is confined, and serves
//! the edge from the same loop ([`super::serve`]).
//!
//! Invariant: nothing is served before the identity is taken and the agent is confined;
//! the first request must be the identity, and every other request before it is refused.

use std::os::fd::{AsRawFd, OwnedFd};

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
pub fn serve_guest(
    control: OwnedFd,
    seccomp: SeccompProfile,
    cgroup: GuestCgroup,
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
            take_identity(&id).map_err(|e| io_setup_error(InitStage::Identity, e))?;
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
    };
    Init::new(control, prepared, Vec::new(), inbuf).serve();
    Ok(())
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
/// forced reseed of the kernel's generator, and the current time.
fn take_identity(identity: &proto::Identity) -> std::io::Result<()> {
    crate::rootfs::set_hostname(&identity.hostname)?;
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
