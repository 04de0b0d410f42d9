//! The sandbox's PID 1: builds the sandbox, then runs commands for the edge.
//!
//! init is a fork of the zygote, so it starts without `execve` and without a Rust
//! runtime to initialise; it stays single-threaded, which is what makes `fork` for each
//! command safe. One `poll(2)` loop serves the control channel, the output pipes of every
//! running command, `SIGCHLD` (through a signalfd) and the commands' deadlines.
//!
//! Invariants:
//! - init never blocks on a pipe or on the channel: everything is non-blocking, and output
//!   pipes are not read while the channel's send queue is over [`MAX_QUEUED`], so a slow
//!   edge throttles the commands instead of growing init's memory;
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
//! - init serves the sandbox's files from the same loop ([`FileService`]), a chunk per
//!   request and only from regular files of the sandbox's own filesystems, so a file
//!   request never blocks it.
//!
//! A VM guest's agent (`dsec-agent`) is this same loop, entered through [`serve_guest`]
//! once the agent has built the guest's root: there the channel is a virtio-serial port
//! or a vsock connection. The agent first takes the guest's identity with full
//! privileges, then confines itself as init does.

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::files::service::FileService;
use crate::files::{FileError, SandboxRoot};
use crate::proto::{self, ExecExit, ExecSpec, Frame, FrameKind, InitError, InitStage};
use crate::seccomp::SeccompProfile;
use crate::spec::SandboxSpec;
use crate::steps::{Program, StepFds, StepPlan};

/// Output init keeps queued for the edge before it stops reading command pipes.
const MAX_QUEUED: usize = 8 << 20;
/// Bytes read from a pipe at a time (and the largest output frame).
const CHUNK: usize = 64 << 10;
/// Stack of a command's first process between `clone` and `execve`.
const CHILD_STACK: usize = 256 << 10;
/// Pipe reads after a command's exit, to collect what it wrote just before exiting,
/// without waiting on background processes that keep the pipe open.
const DRAIN_READS: usize = 32;
/// How much longer than the sum of its steps' timeouts a stepped call may take (building
/// its root, writing and fetching files) before init kills it.
const STEPS_GRACE: Duration = Duration::from_secs(10);
/// Most bytes of a failing command child's report (stage, errno, a file error).
const REPORT_MAX: usize = 8 << 10;

/// Sets up the sandbox and serves commands until the edge closes the channel; never
/// returns. Runs in the child the zygote cloned into fresh namespaces.
pub fn run(spec: &SandboxSpec, control: OwnedFd, seccomp: &SeccompProfile) -> ! {
    let mut out = Vec::new();
    let code = match prepare(spec, seccomp) {
        Ok(prepared) => {
            encode_ready(&mut out, prepared.upper.as_ref().map(AsRawFd::as_raw_fd));
            let mut init = Init::new(control, prepared, out, Vec::new());
            init.serve();
            0
        }
        Err(err) => {
            proto::encode_json(&mut out, FrameKind::Error, 0, &err);
            let _ = write_all_blocking(control.as_raw_fd(), &out);
            1
        }
    };
    // SAFETY: _exit(2) ends the process without running destructors of a forked image.
    unsafe { libc::_exit(code) }
}

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
        write_all_blocking(self.pids_max.as_raw_fd(), text.as_bytes())
    }
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
    // SAFETY: prctl(PR_SET_DUMPABLE) takes integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    let signals = signal_fd()?;
    let mut out = Vec::new();
    encode_ready(&mut out, None);
    let fd = control.as_raw_fd();
    write_all_blocking(fd, &out).map_err(|e| io_setup_error(InitStage::ReportReady, e))?;
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
                let _ = write_all_blocking(fd, &answer);
            }
            Ok(None) => {
                let mut chunk = [0u8; 4096];
                // SAFETY: reading into a local buffer of chunk.len() bytes.
                let n = unsafe { libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len()) };
                match n {
                    0 => return Ok(()),
                    n if n < 0 => {
                        let err = std::io::Error::last_os_error();
                        if err.kind() == std::io::ErrorKind::Interrupted {
                            continue;
                        }
                        return Err(io_setup_error(InitStage::ReadChannel, err));
                    }
                    n => inbuf.extend_from_slice(&chunk[..n as usize]),
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
    write_all_blocking(fd, &answer).map_err(|e| io_setup_error(InitStage::AnswerIdentity, e))?;
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
    mask.add(Signal::SIGCHLD);
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

fn prepare(spec: &SandboxSpec, seccomp: &SeccompProfile) -> Result<Prepared, InitError> {
    let io = io_setup_error;
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    // The zygote ignores SIGCHLD to auto-reap; init must see its children's status.
    // SAFETY: restoring default dispositions; no handler code is involved.
    unsafe {
        libc::signal(libc::SIGCHLD, libc::SIG_DFL);
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
    let upper = crate::rootfs::setup(spec).map_err(|e| setup_error(InitStage::Rootfs, &e, None))?;
    let files = match spec.worker {
        true => None,
        false => Some(
            SandboxRoot::open(std::path::Path::new("/"))
                .map_err(|e| io(InitStage::OpenFilesRoot, e))?,
        ),
    };
    crate::rootfs::set_hostname(&spec.id).map_err(|e| io(InitStage::Sethostname, e))?;
    crate::rootfs::loopback_up().map_err(|e| io(InitStage::Loopback, e))?;
    for fd in 0..3 {
        // SAFETY: dup2 onto the standard descriptors, which init owns.
        unsafe { libc::dup2(devnull.as_raw_fd(), fd) };
    }
    // SAFETY: prctl(PR_SET_DUMPABLE) takes integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
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

pub(crate) fn write_all_blocking(fd: RawFd, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        // SAFETY: data points to data.len() initialised bytes.
        let n = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        data = &data[n as usize..];
    }
    Ok(())
}

/// Result of a non-blocking read.
enum Read {
    Data(usize),
    WouldBlock,
    Eof,
}

fn read_nonblocking(fd: RawFd, buf: &mut [u8]) -> Read {
    loop {
        // SAFETY: buf is a valid, writable buffer of buf.len() bytes.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            return Read::Data(n as usize);
        }
        if n == 0 {
            return Read::Eof;
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EAGAIN) => return Read::WouldBlock,
            _ => return Read::Eof,
        }
    }
}

fn set_nonblocking(fd: RawFd) {
    // SAFETY: fcntl on a descriptor this process owns, integer arguments only.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?)
}

/// One running command.
struct Exec {
    pid: i32,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    stdin: Option<OwnedFd>,
    stdin_data: Vec<u8>,
    stdin_sent: usize,
    started: Instant,
    deadline: Option<Instant>,
    max_output: u64,
    sent: [u64; 2],
    truncated: bool,
    timed_out: bool,
    status: Option<WaitStatus>,
    /// A stepped call's later pipes and reports.
    relay: Option<StepRelay>,
}

/// init's side of a stepped call (see [`crate::steps`]): `Exec::stdout`/`stderr` are the
/// current step's pipes; the runner's reports are relayed in order, each once all output
/// of the step it describes has been relayed, so the edge reads every step's output
/// before that step's end.
struct StepRelay {
    /// Output pipes (stdout, stderr) of the steps after the current one.
    later: VecDeque<(OwnedFd, OwnedFd)>,
    /// The runner's report pipe, until end-of-file.
    reports: Option<OwnedFd>,
    /// Report bytes received and not relayed yet.
    pending: Vec<u8>,
}

struct Init {
    control: OwnedFd,
    inbuf: Vec<u8>,
    outbuf: Vec<u8>,
    prepared: Prepared,
    execs: HashMap<u32, Exec>,
    by_pid: HashMap<i32, u32>,
    scratch: Vec<u8>,
    /// A VM guest's OOM kill count as last read.
    oom_seen: Option<u64>,
    /// The stack each command's first process runs on until its `execve`.
    child_stack: Vec<u8>,
    files: FileService,
}

/// What a poll slot stands for.
#[derive(Clone, Copy)]
enum Slot {
    Control,
    Signals,
    Stdout(u32),
    Stderr(u32),
    Stdin(u32),
    Reports(u32),
}

impl Init {
    /// `outbuf` holds frames to send first, `inbuf` bytes already received.
    fn new(control: OwnedFd, mut prepared: Prepared, outbuf: Vec<u8>, inbuf: Vec<u8>) -> Self {
        set_nonblocking(control.as_raw_fd());
        let oom_seen = if prepared.guest { oom_kills() } else { None };
        let files = FileService::new(prepared.files.take());
        Init {
            files,
            control,
            inbuf,
            outbuf,
            oom_seen,
            child_stack: vec![0; CHILD_STACK],
            prepared,
            execs: HashMap::new(),
            by_pid: HashMap::new(),
            scratch: vec![0; CHUNK],
        }
    }

    fn serve(&mut self) {
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut slots: Vec<Slot> = Vec::new();
        loop {
            fds.clear();
            slots.clear();
            let mut add = |fd: RawFd, events: libc::c_short, slot: Slot| {
                fds.push(libc::pollfd {
                    fd,
                    events,
                    revents: 0,
                });
                slots.push(slot);
            };
            let control_events = if self.outbuf.is_empty() {
                libc::POLLIN
            } else {
                libc::POLLIN | libc::POLLOUT
            };
            add(self.control.as_raw_fd(), control_events, Slot::Control);
            add(
                self.prepared.signals.as_raw_fd(),
                libc::POLLIN,
                Slot::Signals,
            );
            let reading = self.outbuf.len() < MAX_QUEUED;
            for (id, ex) in &self.execs {
                if reading {
                    if let Some(fd) = &ex.stdout {
                        add(fd.as_raw_fd(), libc::POLLIN, Slot::Stdout(*id));
                    }
                    if let Some(fd) = &ex.stderr {
                        add(fd.as_raw_fd(), libc::POLLIN, Slot::Stderr(*id));
                    }
                }
                if let Some(fd) = &ex.stdin {
                    add(fd.as_raw_fd(), libc::POLLOUT, Slot::Stdin(*id));
                }
                if let Some(fd) = ex.relay.as_ref().and_then(|r| r.reports.as_ref()) {
                    if reading {
                        add(fd.as_raw_fd(), libc::POLLIN, Slot::Reports(*id));
                    }
                }
            }
            let timeout = self.next_deadline().map_or(-1, |d| {
                d.saturating_duration_since(Instant::now())
                    .as_millis()
                    .min(i32::MAX as u128) as i32
                    + 1
            });
            // SAFETY: fds is a valid array of fds.len() pollfd structs.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
            if n < 0 {
                continue;
            }
            for i in 0..fds.len() {
                let revents = fds[i].revents;
                if revents == 0 {
                    continue;
                }
                match slots[i] {
                    Slot::Control => {
                        if revents & libc::POLLOUT != 0 {
                            self.flush();
                        }
                        if revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
                            && !self.read_control()
                        {
                            return;
                        }
                    }
                    Slot::Signals => self.reap(),
                    Slot::Stdout(id) => self.pump_output(id, 0),
                    Slot::Stderr(id) => self.pump_output(id, 1),
                    Slot::Stdin(id) => self.pump_stdin(id),
                    Slot::Reports(id) => self.pump_reports(id),
                }
            }
            self.expire_deadlines();
            self.flush();
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.execs.values().filter_map(|e| e.deadline).min()
    }

    /// Reads and handles requests; false when the edge has gone.
    fn read_control(&mut self) -> bool {
        loop {
            match read_nonblocking(self.control.as_raw_fd(), &mut self.scratch) {
                Read::Data(n) => self.inbuf.extend_from_slice(&self.scratch[..n]),
                Read::WouldBlock => break,
                Read::Eof => return false,
            }
        }
        loop {
            match proto::decode(&mut self.inbuf) {
                Ok(Some(frame)) => self.handle(frame),
                Ok(None) => return true,
                Err(_) => return false,
            }
        }
    }

    fn handle(&mut self, frame: Frame) {
        match frame.kind {
            FrameKind::Exec => match proto::decode_exec(&frame) {
                Ok(payload) => {
                    let stdin = payload.stdin.to_vec();
                    let files = payload.files.iter().map(|f| f.to_vec()).collect();
                    self.start(frame.exec_id, payload.spec, stdin, files);
                }
                Err(e) => self.send_error(frame.exec_id, InitStage::Decode, None, e.to_string()),
            },
            FrameKind::Kill => {
                if let Some(ex) = self.execs.get(&frame.exec_id) {
                    kill_command(ex.pid, self.prepared.confine.own_pid_namespace());
                }
            }
            FrameKind::ReadFile
            | FrameKind::WriteFile
            | FrameKind::ListDir
            | FrameKind::ReadChunk
            | FrameKind::WriteChunk
            | FrameKind::CloseFile => match self.files.serve(&frame) {
                Some(Ok(answer)) => {
                    proto::encode(&mut self.outbuf, FrameKind::Done, frame.exec_id, &answer)
                }
                Some(Err(err)) => {
                    proto::encode_json(&mut self.outbuf, FrameKind::Error, frame.exec_id, &err)
                }
                None => {}
            },
            FrameKind::Identity => self.send_error(
                frame.exec_id,
                InitStage::Identity,
                None,
                "the guest took its identity when it started; it cannot change".into(),
            ),
            _ => {}
        }
    }

    fn send_error(&mut self, exec_id: u32, stage: InitStage, errno: Option<i32>, message: String) {
        let err = setup_error(stage, message, errno);
        proto::encode_json(&mut self.outbuf, FrameKind::Error, exec_id, &err);
    }

    fn start(&mut self, id: u32, spec: ExecSpec, stdin: Vec<u8>, files: Vec<Vec<u8>>) {
        match self.spawn(id, &spec, stdin, files) {
            Ok(()) => {}
            Err(Spawn::Setup(stage, errno, message)) => self.send_error(id, stage, errno, message),
            Err(Spawn::Files(err)) => {
                let err = InitError {
                    stage: ChildStage::Files.stage(),
                    errno: None,
                    message: err.to_string(),
                    file: Some(Box::new(err)),
                };
                proto::encode_json(&mut self.outbuf, FrameKind::Error, id, &err);
            }
            Err(Spawn::Exec(errno)) => {
                let err = std::io::Error::from_raw_os_error(errno);
                let msg = format!(
                    "dsec: cannot execute {:?}: {err}\n",
                    spec.argv.first().map(String::as_str).unwrap_or_default()
                );
                proto::encode(&mut self.outbuf, FrameKind::Stderr, id, msg.as_bytes());
                let code = if errno == libc::ENOENT { 127 } else { 126 };
                proto::encode_json(
                    &mut self.outbuf,
                    FrameKind::Exit,
                    id,
                    &ExecExit {
                        exit_code: Some(code),
                        ..Default::default()
                    },
                );
            }
        }
    }

    fn spawn(
        &mut self,
        id: u32,
        spec: &ExecSpec,
        stdin: Vec<u8>,
        files: Vec<Vec<u8>>,
    ) -> Result<(), Spawn> {
        let stepped = spec.is_stepped();
        if stepped && !self.prepared.confine.own_pid_namespace() {
            return Err(Spawn::Setup(
                InitStage::Spec,
                None,
                "steps and fetched files are for fncall calls only".into(),
            ));
        }
        // A stepped call's runner keeps the stdin to give each step (see crate::steps).
        let (stdin, step_stdin) = if stepped {
            (Vec::new(), stdin)
        } else {
            (stdin, Vec::new())
        };
        let launch = Launch::new(spec, files, step_stdin)
            .map_err(|m| Spawn::Setup(InitStage::Spec, None, m))?;
        let errno = |stage: InitStage| {
            move |e: std::io::Error| Spawn::Setup(stage, e.raw_os_error(), e.to_string())
        };
        // One (stdout, stderr) pair per step: a plain command is a single step.
        let mut outputs = Vec::with_capacity(1 + spec.then.len());
        for _ in 0..if stepped { 1 + spec.then.len() } else { 1 } {
            outputs.push((
                pipe().map_err(errno(InitStage::Pipe))?,
                pipe().map_err(errno(InitStage::Pipe))?,
            ));
        }
        let reports = match stepped {
            true => Some(pipe().map_err(errno(InitStage::Pipe))?),
            false => None,
        };
        let (report_r, report_w) = pipe().map_err(errno(InitStage::Pipe))?;
        let stdin_pipe = if stdin.is_empty() {
            None
        } else {
            Some(pipe().map_err(errno(InitStage::Pipe))?)
        };
        let stdin_child = stdin_pipe
            .as_ref()
            .map_or(self.prepared.devnull.as_raw_fd(), |(r, _)| r.as_raw_fd());
        let started = Instant::now();
        let fds = ChildFds {
            stdin: stdin_child,
            stdout: outputs[0].0 .1.as_raw_fd(),
            stderr: outputs[0].1 .1.as_raw_fd(),
            report: report_w.as_raw_fd(),
            join_cgroup: self
                .prepared
                .commands_cgroup
                .as_ref()
                .map(AsRawFd::as_raw_fd),
            steps: reports.as_ref().map(|(_, w)| StepFds {
                outputs: outputs
                    .iter()
                    .map(|((_, out), (_, err))| (out.as_raw_fd(), err.as_raw_fd()))
                    .collect(),
                reports: w.as_raw_fd(),
                devnull: self.prepared.devnull.as_raw_fd(),
            }),
        };
        let pid = match self.prepared.confine {
            // A fncall worker's command gets mount, pid and IPC namespaces of its own, so
            // it is PID 1 there and everything it leaves behind dies with it.
            Confine::Call(_) => {
                let flags = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC;
                let pid = crate::zygote::fork_into(flags).map_err(errno(InitStage::Fork))?;
                if pid == 0 {
                    launch.exec_child(&fds, &self.prepared.confine);
                }
                pid
            }
            Confine::Inherited => spawn_shared(&launch, &fds, &mut self.child_stack)
                .map_err(errno(InitStage::Clone))?,
        };
        drop(report_w);
        let mut outputs = outputs
            .into_iter()
            .map(|((out_r, _), (err_r, _))| (out_r, err_r));
        let (out_r, err_r) = outputs.next().expect("one step at least");
        let relay = reports.map(|(r, _)| {
            set_nonblocking(r.as_raw_fd());
            StepRelay {
                later: outputs.collect(),
                reports: Some(r),
                pending: Vec::new(),
            }
        });
        let stdin_w = stdin_pipe.map(|(r, w)| {
            drop(r);
            set_nonblocking(w.as_raw_fd());
            w
        });
        // The report pipe closes on a successful execve (close-on-exec); otherwise the
        // child wrote why it failed: stage and errno, then, for its files, the FileError.
        let mut report = vec![0u8; REPORT_MAX];
        let mut got = 0;
        while got < report.len() {
            // SAFETY: reading into the remaining part of a local buffer.
            let n = unsafe {
                libc::read(
                    report_r.as_raw_fd(),
                    report[got..].as_mut_ptr().cast(),
                    report.len() - got,
                )
            };
            if n > 0 {
                got += n as usize;
            } else if n == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR)
            {
                break;
            }
        }
        if got >= 8 {
            let _ = waitpid(Pid::from_raw(pid), None);
            let stage = u32::from_le_bytes(report[..4].try_into().expect("4 bytes"));
            let err = i32::from_le_bytes(report[4..8].try_into().expect("4 bytes"));
            if let Ok(file) = serde_json::from_slice::<FileError>(&report[8..got]) {
                return Err(Spawn::Files(file));
            }
            return Err(match ChildStage::from_u32(stage) {
                ChildStage::Exec => Spawn::Exec(err),
                other => Spawn::Setup(
                    other.stage(),
                    Some(err),
                    match other {
                        ChildStage::Chdir => format!(
                            "working directory {:?}: {}",
                            spec.cwd,
                            std::io::Error::from_raw_os_error(err)
                        ),
                        _ => std::io::Error::from_raw_os_error(err).to_string(),
                    },
                ),
            });
        }
        set_nonblocking(out_r.as_raw_fd());
        set_nonblocking(err_r.as_raw_fd());
        self.by_pid.insert(pid, id);
        self.execs.insert(
            id,
            Exec {
                pid,
                stdout: Some(out_r),
                stderr: Some(err_r),
                stdin: stdin_w,
                stdin_data: stdin,
                stdin_sent: 0,
                started,
                deadline: deadline(spec, started),
                max_output: spec.max_output_bytes,
                sent: [0, 0],
                truncated: false,
                timed_out: false,
                status: None,
                relay,
            },
        );
        Ok(())
    }

    fn pump_output(&mut self, id: u32, stream: usize) {
        let Some(ex) = self.execs.get_mut(&id) else {
            return;
        };
        let pipe = if stream == 0 {
            &mut ex.stdout
        } else {
            &mut ex.stderr
        };
        let Some(fd) = pipe.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        match read_nonblocking(fd, &mut self.scratch) {
            Read::Data(n) => forward(&mut self.outbuf, id, ex, stream, &self.scratch[..n]),
            Read::WouldBlock => {}
            Read::Eof => {
                *pipe = None;
                self.relay_steps(id);
            }
        }
    }

    /// Reads a stepped call's reports from its runner.
    fn pump_reports(&mut self, id: u32) {
        let Some(relay) = self.execs.get_mut(&id).and_then(|ex| ex.relay.as_mut()) else {
            return;
        };
        let Some(fd) = relay.reports.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        match read_nonblocking(fd, &mut self.scratch) {
            Read::Data(n) => relay.pending.extend_from_slice(&self.scratch[..n]),
            Read::WouldBlock => return,
            Read::Eof => relay.reports = None,
        }
        self.relay_steps(id);
    }

    /// Relays the reports of a stepped call whose steps' output is all relayed: a step's
    /// end (then the next step's pipes become current), a fetched file, the call's end.
    /// A runner that exited without its final report (killed at the call's deadline, or
    /// dead) ends the call like a plain command.
    fn relay_steps(&mut self, id: u32) {
        let Some(ex) = self.execs.get_mut(&id) else {
            return;
        };
        let Some(relay) = ex.relay.as_mut() else {
            return;
        };
        let mut ended = false;
        while ex.stdout.is_none() && ex.stderr.is_none() && !ended {
            let frame = match proto::decode(&mut relay.pending) {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(_) => {
                    relay.pending.clear();
                    break;
                }
            };
            match frame.kind {
                FrameKind::StepExit | FrameKind::Exit => {
                    let Ok(mut exit) = frame.json::<ExecExit>() else {
                        continue;
                    };
                    exit.truncated = ex.truncated;
                    proto::encode_json(&mut self.outbuf, frame.kind, id, &exit);
                    ended = frame.kind == FrameKind::Exit;
                    ex.truncated = false;
                    ex.sent = [0, 0];
                    if let Some((out, err)) = relay.later.pop_front() {
                        set_nonblocking(out.as_raw_fd());
                        set_nonblocking(err.as_raw_fd());
                        (ex.stdout, ex.stderr) = (Some(out), Some(err));
                    }
                }
                FrameKind::Fetched => {
                    proto::encode(&mut self.outbuf, FrameKind::Fetched, id, &frame.payload)
                }
                _ => {}
            }
        }
        if ended {
            self.execs.remove(&id);
        } else if relay.reports.is_none()
            && ex.status.is_some()
            && ex.stdout.is_none()
            && ex.stderr.is_none()
        {
            self.finish(id);
        }
    }

    fn pump_stdin(&mut self, id: u32) {
        let Some(ex) = self.execs.get_mut(&id) else {
            return;
        };
        let Some(fd) = ex.stdin.as_ref().map(AsRawFd::as_raw_fd) else {
            return;
        };
        let rest = &ex.stdin_data[ex.stdin_sent..];
        // SAFETY: rest points to rest.len() initialised bytes.
        let n = unsafe { libc::write(fd, rest.as_ptr().cast(), rest.len()) };
        if n > 0 {
            ex.stdin_sent += n as usize;
        }
        let failed = n < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EAGAIN);
        if failed || ex.stdin_sent == ex.stdin_data.len() {
            ex.stdin = None;
            ex.stdin_data = Vec::new();
        }
    }

    fn reap(&mut self) {
        while let Ok(Some(_)) = self.prepared.signals.read_signal() {}
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(status) => {
                    let Some(pid) = status.pid() else { break };
                    if let Some(id) = self.by_pid.remove(&pid.as_raw()) {
                        let Some(ex) = self.execs.get_mut(&id) else {
                            continue;
                        };
                        ex.status = Some(status);
                        // A stepped call ends with its runner's last report, relayed once
                        // the output before it is.
                        if ex.relay.is_some() {
                            self.relay_steps(id);
                        } else {
                            self.finish(id);
                        }
                    }
                }
            }
        }
    }

    /// Collects what the command wrote before exiting and reports its end.
    fn finish(&mut self, id: u32) {
        let Some(mut ex) = self.execs.remove(&id) else {
            return;
        };
        for stream in 0..2 {
            for _ in 0..DRAIN_READS {
                let pipe = if stream == 0 { &ex.stdout } else { &ex.stderr };
                let Some(fd) = pipe.as_ref().map(AsRawFd::as_raw_fd) else {
                    break;
                };
                match read_nonblocking(fd, &mut self.scratch) {
                    Read::Data(n) => {
                        forward(&mut self.outbuf, id, &mut ex, stream, &self.scratch[..n])
                    }
                    Read::WouldBlock | Read::Eof => break,
                }
            }
        }
        let (exit_code, signal) = match ex.status {
            Some(WaitStatus::Exited(_, code)) => (Some(code), None),
            Some(WaitStatus::Signaled(_, sig, _)) => (Some(128 + sig as i32), Some(sig as i32)),
            _ => (None, None),
        };
        let exit = ExecExit {
            exit_code: if ex.timed_out { None } else { exit_code },
            signal,
            timed_out: ex.timed_out,
            truncated: ex.truncated,
            duration_us: ex.started.elapsed().as_micros() as u64,
            oom_killed: exit_code == Some(128 + libc::SIGKILL) && self.oom_kill_since_last(),
        };
        proto::encode_json(&mut self.outbuf, FrameKind::Exit, id, &exit);
    }

    /// Whether a VM guest's OOM killer struck since the last look. Asked only when a
    /// command ended by SIGKILL (itself, or its shell reporting 137): reading
    /// `/proc/vmstat` costs too much under binary translation to do per command.
    fn oom_kill_since_last(&mut self) -> bool {
        let Some(seen) = self.oom_seen else {
            return false;
        };
        let now = oom_kills().unwrap_or(seen);
        self.oom_seen = Some(now);
        now > seen
    }

    fn expire_deadlines(&mut self) {
        let now = Instant::now();
        for ex in self.execs.values_mut() {
            if ex.deadline.is_some_and(|d| d <= now) {
                ex.deadline = None;
                ex.timed_out = true;
                kill_command(ex.pid, self.prepared.confine.own_pid_namespace());
            }
        }
    }

    fn flush(&mut self) {
        while !self.outbuf.is_empty() {
            // SAFETY: outbuf holds outbuf.len() initialised bytes. The channel is
            // non-blocking and SIGPIPE ignored; write(2), not send(2): a guest's channel
            // may be a character device.
            let n = unsafe {
                libc::write(
                    self.control.as_raw_fd(),
                    self.outbuf.as_ptr().cast(),
                    self.outbuf.len(),
                )
            };
            if n <= 0 {
                return;
            }
            self.outbuf.drain(..n as usize);
        }
    }
}

/// Queues output for the edge, up to the command's bound; the rest is dropped.
fn forward(outbuf: &mut Vec<u8>, id: u32, ex: &mut Exec, stream: usize, data: &[u8]) {
    let room = ex.max_output.saturating_sub(ex.sent[stream]) as usize;
    let n = room.min(data.len());
    if n < data.len() {
        ex.truncated = true;
    }
    if n > 0 {
        let kind = if stream == 0 {
            FrameKind::Stdout
        } else {
            FrameKind::Stderr
        };
        proto::encode(outbuf, kind, id, &data[..n]);
        ex.sent[stream] += n as u64;
    }
}

/// OOM kills since boot, from `/proc/vmstat`: in a VM guest the whole machine is the
/// sandbox, so any kill during a command is charged to it.
fn oom_kills() -> Option<u64> {
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
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + identity.entropy.len());
    info.extend_from_slice(&((identity.entropy.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(identity.entropy.len() as i32).to_ne_bytes());
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
    let now = libc::timespec {
        tv_sec: (identity.unix_time_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (identity.unix_time_ns % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: clock_settime with a valid timespec.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &now) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// When init kills a command: its timeout after it started; for a stepped call, the sum
/// of its steps' timeouts and [`STEPS_GRACE`] (each step's own timeout is the runner's).
fn deadline(spec: &ExecSpec, started: Instant) -> Option<Instant> {
    if !spec.is_stepped() {
        return spec
            .timeout_ms
            .map(|ms| started + Duration::from_millis(ms));
    }
    let total: Option<u64> = std::iter::once(spec.timeout_ms)
        .chain(spec.then.iter().map(|s| s.timeout_ms))
        .sum();
    total.map(|ms| started + Duration::from_millis(ms) + STEPS_GRACE)
}

/// Kills a command and everything it started. A fncall call is PID 1 of its own pid
/// namespace: killing it makes the kernel kill the rest.
fn kill_command(pid: i32, own_pid_namespace: bool) {
    if own_pid_namespace {
        crate::tree::kill_namespace_init(pid);
    } else {
        // init's `/proc` is the sandbox's: every process it lists is the sandbox's.
        crate::tree::kill_tree(pid, None);
    }
}

/// Why a command could not be started.
enum Spawn {
    /// Before execve: bad spec, chdir...; reported as an error.
    Setup(InitStage, Option<i32>, String),
    /// execve failed: reported like a shell does, exit 127 or 126.
    Exec(i32),
    /// A fncall call's file could not be written.
    Files(FileError),
}

/// The step of the child's preparation that failed, as written to the report pipe.
#[derive(Clone, Copy)]
#[repr(u32)]
enum ChildStage {
    Subreaper = 1,
    Stdio = 2,
    Chdir = 3,
    Exec = 4,
    CallRoot = 5,
    Confine = 6,
    Files = 7,
    Cgroup = 8,
}

impl ChildStage {
    fn from_u32(v: u32) -> ChildStage {
        match v {
            1 => ChildStage::Subreaper,
            5 => ChildStage::CallRoot,
            6 => ChildStage::Confine,
            7 => ChildStage::Files,
            8 => ChildStage::Cgroup,
            2 => ChildStage::Stdio,
            3 => ChildStage::Chdir,
            _ => ChildStage::Exec,
        }
    }

    fn stage(self) -> InitStage {
        match self {
            ChildStage::Subreaper => InitStage::Subreaper,
            ChildStage::CallRoot => InitStage::CallRoot,
            ChildStage::Confine => InitStage::Confine,
            ChildStage::Files => InitStage::CallFiles,
            ChildStage::Cgroup => InitStage::CommandsCgroup,
            ChildStage::Stdio => InitStage::Stdio,
            ChildStage::Chdir => InitStage::Chdir,
            ChildStage::Exec => InitStage::Exec,
        }
    }
}

/// Starts a command the way `posix_spawn` does: `clone(CLONE_VM | CLONE_VFORK)` onto a
/// stack of its own. The child shares init's memory until its `execve` while init is
/// suspended, so nothing is copied — no page tables, no copy-on-write faults afterwards.
/// That is a large share of an exec's cost in a VM guest under binary translation (and
/// free to save in a container). The child makes syscalls and small allocations only,
/// which is safe: init is single-threaded and waits, holding no lock.
fn spawn_shared(launch: &Launch, fds: &ChildFds, stack: &mut [u8]) -> std::io::Result<i32> {
    struct Args<'a> {
        launch: &'a Launch,
        fds: &'a ChildFds,
    }
    extern "C" fn entry(arg: *mut libc::c_void) -> libc::c_int {
        // SAFETY: `arg` points to the `Args` below, on the stack of the parent, which is
        // suspended (CLONE_VFORK) until this child execs or exits.
        let args = unsafe { &*(arg as *const Args<'_>) };
        args.launch.exec_child(args.fds, &Confine::Inherited)
    }
    let args = Args { launch, fds };
    let end = stack.as_mut_ptr_range().end as usize;
    let top = (end & !15) as *mut libc::c_void;
    // SAFETY: `top` is the 16-byte aligned end of a writable buffer that outlives the
    // child's use of it (the parent resumes only after the child's execve or exit), and
    // `entry` never returns into the parent's frames.
    let pid = unsafe {
        libc::clone(
            entry,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            (&raw const args).cast_mut().cast(),
        )
    };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(pid)
}

/// Writes a fncall call's files in its root (the child's `/`, after the call's root is
/// built). Only ever runs in a forked child (not a vfork), so it may allocate.
fn write_call_files(files: &[(String, u32, Vec<u8>)]) -> Result<(), FileError> {
    let root = SandboxRoot::open(std::path::Path::new("/")).map_err(|e| FileError::os("/", e))?;
    files
        .iter()
        .try_for_each(|(path, mode, data)| root.write_all(path, data, *mode))
}

/// How a fncall worker's commands are set up (see [`crate::spec::SandboxSpec::worker`]).
struct CallSetup {
    layer_count: usize,
    disk_bytes: u64,
    seccomp: SeccompProfile,
}

struct ChildFds {
    stdin: RawFd,
    stdout: RawFd,
    stderr: RawFd,
    report: RawFd,
    /// The file the child writes `0` to, to enter the commands' cgroup (see
    /// `Prepared::commands_cgroup`).
    join_cgroup: Option<RawFd>,
    /// A stepped call's runner: every step's pipes and the report pipe.
    steps: Option<StepFds>,
}

/// Everything the child needs, converted before `fork` so that the child only makes
/// syscalls.
struct Launch {
    program: Program,
    env: Vec<CString>,
    cwd: CString,
    /// Files to write in the command's root first: (path, mode, contents).
    files: Vec<(String, u32, Vec<u8>)>,
    /// A stepped call: what its runner runs instead of `program` alone.
    steps: Option<StepPlan>,
}

fn cstring(s: &str, what: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} contains a NUL byte"))
}

impl Launch {
    /// `stdin` is the stepped call's input, which its runner gives every step.
    fn new(spec: &ExecSpec, contents: Vec<Vec<u8>>, stdin: Vec<u8>) -> Result<Launch, String> {
        let env = spec
            .env
            .iter()
            .map(|e| cstring(e, "environment"))
            .collect::<Result<Vec<_>, _>>()?;
        let path = spec
            .env
            .iter()
            .find_map(|e| e.strip_prefix("PATH="))
            .unwrap_or("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        let steps = match spec.is_stepped() {
            false => None,
            true => Some(StepPlan {
                steps: std::iter::once((&spec.argv, spec.timeout_ms))
                    .chain(spec.then.iter().map(|s| (&s.argv, s.timeout_ms)))
                    .map(|(argv, ms)| {
                        Ok((Program::new(argv, path)?, ms.map(Duration::from_millis)))
                    })
                    .collect::<Result<_, String>>()?,
                stdin,
                fetch: spec.fetch.clone(),
                fetch_max_bytes: spec.fetch_max_bytes,
            }),
        };
        Ok(Launch {
            program: Program::new(&spec.argv, path)?,
            env,
            cwd: cstring(&spec.cwd, "working directory")?,
            files: spec
                .files
                .iter()
                .zip(contents)
                .map(|(f, data)| (f.path.clone(), f.mode, data))
                .collect(),
            steps,
        })
    }

    /// Runs in the forked child: enters the commands' cgroup, becomes a subreaper, wires
    /// stdio, enters the working directory and execs; capabilities, no_new_privs and
    /// seccomp are inherited from init. Reports a failing step through the report pipe
    /// and exits. A stepped call's child becomes its runner instead of exec'ing (see
    /// [`crate::steps`]).
    fn exec_child(&self, fds: &ChildFds, confine: &Confine) -> ! {
        let fail = |stage: ChildStage, errno: i32| -> ! {
            let mut msg = [0u8; 8];
            msg[..4].copy_from_slice(&(stage as u32).to_le_bytes());
            msg[4..].copy_from_slice(&errno.to_le_bytes());
            // SAFETY: writing a local buffer to our pipe, then leaving without unwinding.
            unsafe {
                libc::write(fds.report, msg.as_ptr().cast(), msg.len());
                libc::_exit(127)
            }
        };
        let last_errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        let _ = nix::sys::signal::pthread_sigmask(
            SigmaskHow::SIG_SETMASK,
            Some(&SigSet::empty()),
            None,
        );
        // SAFETY: restoring the default disposition before exec.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        // SAFETY: setsid(2) has no arguments.
        unsafe { libc::setsid() };
        // Into the commands' cgroup first: everything the command makes from here on is
        // charged under the sandbox's limit, and none of it to init.
        if let Some(file) = fds.join_cgroup {
            // SAFETY: writing a constant to a descriptor this process owns.
            if unsafe { libc::write(file, c"0".as_ptr().cast(), 1) } < 0 {
                fail(ChildStage::Cgroup, last_errno());
            }
        }
        match confine {
            Confine::Call(call) => {
                if let Err(e) = crate::rootfs::setup_call(call.layer_count, call.disk_bytes) {
                    fail(ChildStage::CallRoot, e.errno());
                }
            }
            // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes integer arguments only.
            _ if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } < 0 => {
                fail(ChildStage::Subreaper, last_errno());
            }
            _ => {}
        }
        match (&self.steps, &fds.steps) {
            // The runner keeps only its own descriptors, and stays exempt from the OOM
            // killer like init (its steps are not).
            (Some(_), Some(step_fds)) => {
                let mut keep = step_fds.all();
                keep.push(fds.report);
                if let Err(e) = crate::steps::close_other_fds(&keep) {
                    fail(ChildStage::CallRoot, e.raw_os_error().unwrap_or(libc::EIO));
                }
            }
            // init is exempt from the OOM killer where the host allows it; its commands
            // must not be (see `protect_from_oom_killer`). Not through the shared memory:
            // the kernel gives a vfork child its own score.
            _ => {
                let _ = std::fs::write("/proc/self/oom_score_adj", "0");
            }
        }
        if !self.files.is_empty() {
            // A fncall call's files, in its fresh root: written with the same checks as
            // the files API, since the image itself may carry hostile links.
            if let Err(e) = write_call_files(&self.files) {
                let mut msg = Vec::with_capacity(REPORT_MAX);
                msg.extend_from_slice(&(ChildStage::Files as u32).to_le_bytes());
                msg.extend_from_slice(&0i32.to_le_bytes());
                serde_json::to_writer(&mut msg, &e).expect("serializes");
                msg.truncate(REPORT_MAX);
                // SAFETY: writing a local buffer to our pipe, then leaving without unwinding.
                unsafe {
                    libc::write(fds.report, msg.as_ptr().cast(), msg.len());
                    libc::_exit(127)
                }
            }
        }
        if fds.steps.is_none() {
            for (from, to) in [(fds.stdin, 0), (fds.stdout, 1), (fds.stderr, 2)] {
                // SAFETY: dup2 between descriptors this process owns.
                if unsafe { libc::dup2(from, to) } < 0 {
                    fail(ChildStage::Stdio, last_errno());
                }
            }
        }
        // SAFETY: cwd is a valid NUL-terminated string.
        if unsafe { libc::chdir(self.cwd.as_ptr()) } < 0 {
            fail(ChildStage::Chdir, last_errno());
        }
        if let Confine::Call(call) = confine {
            if crate::caps::drop_to_default().is_err() {
                fail(ChildStage::Confine, libc::EPERM);
            }
            if call.seccomp.apply().is_err() {
                fail(ChildStage::Confine, last_errno());
            }
        }
        if let (Some(plan), Some(step_fds)) = (&self.steps, &fds.steps) {
            // Set up: init stops waiting for a failure report when this closes.
            // SAFETY: closing our end of the report pipe, used no more.
            unsafe { libc::close(fds.report) };
            // The runner waits for its steps with SIGCHLD blocked, as init keeps it.
            let mut chld = SigSet::empty();
            chld.add(Signal::SIGCHLD);
            let _ = nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&chld), None);
            plan.run(&self.env, step_fds)
        }
        if crate::fds::close_on_exec_above_stdio().is_err() {
            fail(ChildStage::Stdio, last_errno());
        }
        fail(ChildStage::Exec, self.program.exec(&self.env))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::ExecStep;

    #[test]
    fn a_stepped_call_is_killed_after_all_its_steps_had_their_time() {
        let now = Instant::now();
        let plain = ExecSpec {
            timeout_ms: Some(1000),
            ..ExecSpec::default()
        };
        assert_eq!(deadline(&plain, now), Some(now + Duration::from_secs(1)));
        let stepped = ExecSpec {
            then: vec![ExecStep {
                argv: vec!["./test".into()],
                timeout_ms: Some(2000),
            }],
            ..plain.clone()
        };
        assert_eq!(
            deadline(&stepped, now),
            Some(now + Duration::from_secs(3) + STEPS_GRACE)
        );
        let unbounded = ExecSpec {
            then: vec![ExecStep::default()],
            ..plain
        };
        assert_eq!(deadline(&unbounded, now), None);
    }
}
