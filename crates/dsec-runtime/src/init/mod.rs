//! The sandbox's PID 1: builds the sandbox, then runs commands for the edge.
//!
//! init is a fork of the zygote, so it starts without `execve` and without a Rust
//! runtime to initialise; it stays single-threaded, which is what makes `fork` for each
//! command safe. One `poll(2)` loop (`serve`) serves the control channel, the output
//! pipes of every running command, `SIGCHLD` (through a signalfd) and the commands'
//! deadlines; what a command's first process does before its `execve` is
//! `crate::launch`'s.
//!
//! Invariants:
//! - init never blocks on a pipe or on the channel: everything is non-blocking, and output
//!   pipes are not read while the channel's send queue is over a bound, so a slow edge
//!   throttles the commands instead of growing init's memory;
//! - each command's main process is a child subreaper (`PR_SET_CHILD_SUBREAPER`, kept
//!   across `execve`), so everything it starts stays in its subtree even after a double
//!   fork; a timeout stops that whole subtree with SIGSTOP (a stopped process cannot fork
//!   away), then SIGKILLs it, children that ignore SIGTERM included. Per-command cgroups
//!   would do the same, but on cgroup v1 each migration waits for an RCU grace period
//!   (~10 ms when the host is otherwise idle), which would dominate exec latency;
//! - every descriptor init holds is close-on-exec and init is non-dumpable, so commands
//!   cannot reach the channel through `/proc/1/fd`; signals from inside the pid
//!   namespace cannot kill init either (the kernel protects a namespace's PID 1). Each
//!   command's first process marks every descriptor above 2 close-on-exec right before
//!   its `execve` ([`crate::fds`]), so nothing else reaches it either;
//! - init serves the sandbox's files from the same loop
//!   ([`FileService`](crate::files::service::FileService)), a chunk per request and only
//!   from regular files of the sandbox's own filesystems, so a file request never blocks
//!   it.
//!
//! A VM guest's agent (`dsec-agent`) is this same loop, entered through [`serve_guest`]
//! (`agent`) once the agent has built the guest's root: there the channel is a
//! virtio-serial port or a vsock connection. The agent first takes the guest's identity
//! with full privileges, then confines itself as init does.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::sys::signal::SigSet;
use nix::sys::signalfd::{SfdFlags, SignalFd};
use rustix::process::{DumpableBehavior, Signal};

use crate::files::SandboxRoot;
use crate::launch::{write_all_blocking, CallSetup};
use crate::proto::{self, FrameKind, InitError, InitStage};
use crate::seccomp::SeccompProfile;
use crate::spec::SandboxSpec;

mod agent;
mod serve;
mod standby;

pub use agent::{serve_guest, GuestCgroup};
use serve::Init;

/// Sets up the sandbox and serves commands until the edge closes the channel; never
/// returns. Runs in the child the zygote cloned into fresh namespaces; `network` is the
/// spare network namespace it enters first (`None`: the clone made one).
pub fn run(
    spec: &SandboxSpec,
    control: OwnedFd,
    network: Option<OwnedFd>,
    seccomp: &SeccompProfile,
) -> ! {
    let mut out = Vec::new();
    let code = match prepare(spec, network, seccomp) {
        Ok(prepared) => {
            encode_ready(&mut out, prepared.upper.as_ref().map(AsRawFd::as_raw_fd));
            let mut init = Init::new(control, prepared, out, Vec::new());
            init.serve();
            0
        }
        Err(err) => {
            proto::encode_json(&mut out, FrameKind::Error, 0, &err);
            let _ = write_all_blocking(&control, &out);
            1
        }
    };
    // Ends the process without running destructors of a forked image.
    crate::launch::exit_now(code)
}

fn encode_ready(out: &mut Vec<u8>, upper_fd: Option<RawFd>) {
    proto::encode_json(
        out,
        FrameKind::Ready,
        0,
        &proto::Ready {
            version: proto::VERSION,
            upper_fd: upper_fd.unwrap_or(-1),
        },
    );
}

struct Prepared {
    /// Held for the edge's snapshots; see [`crate::rootfs::setup`]. A VM guest has none:
    /// its writable layer lives on its own disk.
    upper: Option<OwnedFd>,
    /// The root file requests are served from; `None` in a fncall worker.
    files: Option<SandboxRoot>,
    confine: Confine,
    signals: SignalFd,
    devnull: OwnedFd,
    /// The file (write-only) each command writes `0` to, to enter the cgroup it runs in:
    /// a v1 container's memory cgroup (init lives apart, see [`crate::cgroup`]), a VM
    /// guest's [`GuestCgroup`].
    commands_cgroup: Option<OwnedFd>,
    /// A VM guest: the whole machine is the sandbox, so its OOM kills are read from
    /// `/proc/vmstat` (a container's edge asks the container's cgroup).
    guest: bool,
    /// A VM guest's privileged helper that takes a new identity after the guest is
    /// restored from a snapshot of its running self (see [`agent::IdentityKeeper`]).
    identity_keeper: Option<agent::IdentityKeeper>,
    /// A VM guest's counters, for the edge's [`proto::FrameKind::Usage`].
    usage: Option<agent::UsageSource>,
}

/// Where commands get their capabilities, no_new_privs and seccomp filter from.
enum Confine {
    /// init confined itself before serving; commands inherit it at no cost.
    Inherited,
    /// A fncall worker: each command builds its own namespaces and root, then confines
    /// itself (init stays privileged to build them).
    Call(CallSetup),
}

impl Confine {
    /// Whether each command is PID 1 of a pid namespace of its own.
    fn own_pid_namespace(&self) -> bool {
        matches!(self, Confine::Call(_))
    }
}

fn signal_fd() -> Result<SignalFd, InitError> {
    let mut mask = SigSet::empty();
    mask.add(nix::sys::signal::Signal::SIGCHLD);
    mask.thread_block()
        .map_err(|e| setup_error(InitStage::BlockSigchld, e, Some(e as i32)))?;
    SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(|e| setup_error(InitStage::Signalfd, e, Some(e as i32)))
}

fn setup_error(stage: InitStage, err: impl std::fmt::Display, errno: Option<i32>) -> InitError {
    InitError {
        stage,
        errno,
        message: err.to_string(),
        file: None,
    }
}

fn io_setup_error(stage: InitStage, err: std::io::Error) -> InitError {
    let errno = err.raw_os_error();
    setup_error(stage, err, errno)
}

fn prepare(
    spec: &SandboxSpec,
    network: Option<OwnedFd>,
    seccomp: &SeccompProfile,
) -> Result<Prepared, InitError> {
    let io = io_setup_error;
    let _ = rustix::process::set_parent_process_death_signal(Some(Signal::KILL));
    // First: what is mounted below (sysfs) and set up (loopback) is the namespace's. A
    // spare's loopback is up already (the zygote brought it up when it made it).
    let loopback_is_up = network.is_some();
    if let Some(network) = network {
        nix::sched::setns(&network, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| setup_error(InitStage::JoinNetworkNamespace, e, Some(e as i32)))?;
    }
    // Every signal is at its default already (see `zygote::serve`). SIGPIPE is ignored by
    // init alone: a command's child resets it before its execve.
    // SAFETY: setting a disposition; no handler code is involved.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    protect_from_oom_killer();
    for file in &spec.init_cgroups {
        std::fs::write(file, "0").map_err(|e| io(InitStage::JoinCgroup, e))?;
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWCGROUP)
        .map_err(|e| setup_error(InitStage::UnshareCgroupNamespace, e, Some(e as i32)))?;
    if let Some(home) = &spec.init_memory_home {
        std::fs::write(home, "0").map_err(|e| io(InitStage::LeaveMemoryCgroup, e))?;
    }
    let commands_cgroup = match &spec.commands_cgroup {
        Some(file) => Some(
            std::fs::OpenOptions::new()
                .write(true)
                .open(file)
                .map_err(|e| io(InitStage::OpenCommandsCgroup, e))?
                .into(),
        ),
        None => None,
    };
    if spec.worker {
        // Calls share the worker's network namespace. A socket dies with its processes,
        // but an actively closed TCP connection would linger in TIME_WAIT (60 s), where
        // the next call could see it; without buckets the kernel closes it at once. A
        // namespace per call would cost ~2 ms of kernel work each (the fncall backend's
        // documentation has the measurement).
        std::fs::write("/proc/sys/net/ipv4/tcp_max_tw_buckets", "0")
            .map_err(|e| io(InitStage::DisableTimeWait, e))?;
    }
    // Opened before the pivot: a fncall worker's root has no /dev of its own.
    let devnull = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| io(InitStage::OpenDevNull, e))?;
    let upper = crate::rootfs::setup(spec)
        .map_err(|e| setup_error(InitStage::Rootfs, &e, Some(e.errno())))?;
    let files = match spec.worker {
        true => None,
        false => Some(
            SandboxRoot::open(std::path::Path::new("/"))
                .map_err(|e| io(InitStage::OpenFilesRoot, e))?,
        ),
    };
    crate::rootfs::set_hostname(&spec.id).map_err(|e| io(InitStage::Sethostname, e))?;
    if !loopback_is_up {
        crate::rootfs::loopback_up().map_err(|e| io(InitStage::Loopback, e))?;
    }
    let _ = rustix::stdio::dup2_stdin(&devnull);
    let _ = rustix::stdio::dup2_stdout(&devnull);
    let _ = rustix::stdio::dup2_stderr(&devnull);
    let _ = rustix::process::set_dumpable_behavior(DumpableBehavior::NotDumpable);
    let signals = signal_fd()?;
    let confine = if spec.worker {
        Confine::Call(CallSetup {
            layer_count: spec.layers.len(),
            disk_bytes: spec.disk_bytes,
            seccomp: seccomp.clone(),
        })
    } else {
        // Confine init itself: every command is a fork of it and inherits the reduced
        // capability sets, no_new_privs and the seccomp filter, so none of that costs
        // anything per command. init needs nothing beyond them once the sandbox is built.
        crate::caps::drop_to_default()
            .map_err(|e| setup_error(InitStage::DropCapabilities, e, None))?;
        seccomp
            .apply()
            .map_err(|e| setup_error(InitStage::InstallSeccomp, e, None))?;
        Confine::Inherited
    };
    Ok(Prepared {
        upper: Some(upper),
        files,
        confine,
        signals,
        devnull: devnull.into(),
        commands_cgroup,
        guest: false,
        identity_keeper: None,
        usage: None,
    })
}

/// Takes init out of the OOM killer's reach where the host allows it (`CAP_SYS_RESOURCE`,
/// which the server may lack: then both writes change nothing, and what protects init is
/// that on v1 hosts it lives outside its sandbox's memory limit, see [`crate::cgroup`]). The modern file also sets the floor below
/// which a process without that capability cannot go, and children inherit the floor:
/// written with `-1000`, every command could make itself unkillable. So the floor goes
/// to 0 first (through the modern file), and `-1000` through the legacy `oom_adj`
/// (`-17`), which sets the score alone: each command writes `0` before it execs and
/// cannot go lower. The kernel logs once per boot that `oom_adj` is deprecated.
fn protect_from_oom_killer() {
    let _ = std::fs::write("/proc/self/oom_score_adj", "0");
    let _ = std::fs::write("/proc/self/oom_adj", "-17");
}
