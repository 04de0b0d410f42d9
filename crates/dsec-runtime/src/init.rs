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
//!   namespace cannot kill init either (the kernel protects a namespace's PID 1).
//!
//! A VM guest's agent (`dsec-agent`) is this same loop, entered through [`serve_guest`]
//! once the agent has built the guest's root: there the channel is a virtio-serial port
//! or a vsock connection, and file requests arrive on it too. The agent first takes the
//! guest's identity with full privileges, then confines itself as init does.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::files::{FileError, SandboxRoot};
use crate::proto::{self, ExecExit, ExecSpec, Frame, FrameKind, InitError};
use crate::seccomp::SeccompProfile;
use crate::spec::SandboxSpec;

/// Output init keeps queued for the edge before it stops reading command pipes.
const MAX_QUEUED: usize = 8 << 20;
/// Bytes read from a pipe at a time (and the largest output frame).
const CHUNK: usize = 64 << 10;
/// Stack of a command's first process between `clone` and `execve`.
const CHILD_STACK: usize = 256 << 10;
/// Pipe reads after a command's exit, to collect what it wrote just before exiting,
/// without waiting on background processes that keep the pipe open.
const DRAIN_READS: usize = 32;

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
        .map_err(|e| io_setup_error("open /dev/null", e))?;
    // As a container's init: /proc/1/fd (the channel) stays closed to commands.
    // SAFETY: prctl(PR_SET_DUMPABLE) takes integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    let signals = signal_fd()?;
    let mut out = Vec::new();
    encode_ready(&mut out, None);
    let fd = control.as_raw_fd();
    write_all_blocking(fd, &out).map_err(|e| io_setup_error("report ready", e))?;
    let mut inbuf = Vec::new();
    let identity = loop {
        match proto::decode(&mut inbuf) {
            Ok(Some(frame)) if frame.kind == FrameKind::Identity => break frame,
            Ok(Some(frame)) => {
                let mut answer = Vec::new();
                let err = setup_error(
                    "identity",
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
                        return Err(io_setup_error("read the channel", err));
                    }
                    n => inbuf.extend_from_slice(&chunk[..n as usize]),
                }
            }
            Err(e) => return Err(setup_error("decode", e, None)),
        }
    };
    let mut answer = Vec::new();
    let taken = identity
        .json::<proto::Identity>()
        .map_err(|e| setup_error("identity", e, None))
        .and_then(|id| {
            take_identity(&id).map_err(|e| io_setup_error("identity", e))?;
            cgroup
                .set_pids_max(id.pids_max)
                .map_err(|e| io_setup_error("pids limit", e))
        });
    match &taken {
        Ok(()) => proto::encode(&mut answer, FrameKind::Done, identity.exec_id, &[]),
        Err(err) => proto::encode_json(&mut answer, FrameKind::Error, identity.exec_id, err),
    }
    write_all_blocking(fd, &answer).map_err(|e| io_setup_error("answer the identity", e))?;
    taken?;
    crate::caps::drop_to_default().map_err(|e| setup_error("drop capabilities", e, None))?;
    seccomp
        .apply()
        .map_err(|e| setup_error("install seccomp filter", e, None))?;
    let prepared = Prepared {
        upper: None,
        confine: Confine::Inherited,
        signals,
        devnull: devnull.into(),
        cgroup_procs: Some(cgroup.procs),
    };
    Init::new(control, prepared, Vec::new(), inbuf).serve();
    Ok(())
}

struct Prepared {
    /// Held for the edge's snapshots; see [`crate::rootfs::setup`]. A VM guest has none:
    /// its writable layer lives on its own disk.
    upper: Option<OwnedFd>,
    confine: Confine,
    signals: SignalFd,
    devnull: OwnedFd,
    /// A VM guest's commands cgroup (`cgroup.procs`, write-only), see [`GuestCgroup`].
    /// Only a guest has one; there the whole machine is the sandbox, so its OOM kills
    /// are read from `/proc/vmstat` (a container's edge asks the container's cgroup).
    cgroup_procs: Option<OwnedFd>,
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
        .map_err(|e| setup_error("block SIGCHLD", e, Some(e as i32)))?;
    SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(|e| setup_error("signalfd", e, Some(e as i32)))
}

fn setup_error(stage: &str, err: impl std::fmt::Display, errno: Option<i32>) -> InitError {
    InitError {
        stage: stage.to_owned(),
        errno,
        message: err.to_string(),
        file: None,
    }
}

fn io_setup_error(stage: &str, err: std::io::Error) -> InitError {
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
    let _ = std::fs::write("/proc/self/oom_score_adj", "-1000");
    for dir in &spec.cgroup_dirs {
        std::fs::write(dir.join("cgroup.procs"), "0").map_err(|e| io("join cgroup", e))?;
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWCGROUP)
        .map_err(|e| setup_error("unshare cgroup namespace", e, Some(e as i32)))?;
    // Opened before the pivot: a fncall worker's root has no /dev of its own.
    let devnull = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| io("open /dev/null", e))?;
    let upper = crate::rootfs::setup(spec).map_err(|e| setup_error("rootfs", &e, None))?;
    crate::rootfs::set_hostname(&spec.id).map_err(|e| io("sethostname", e))?;
    crate::rootfs::loopback_up().map_err(|e| io("loopback", e))?;
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
        crate::caps::drop_to_default().map_err(|e| setup_error("drop capabilities", e, None))?;
        seccomp
            .apply()
            .map_err(|e| setup_error("install seccomp filter", e, None))?;
        Confine::Inherited
    };
    Ok(Prepared {
        upper: Some(upper),
        confine,
        signals,
        devnull: devnull.into(),
        cgroup_procs: None,
    })
}

fn write_all_blocking(fd: RawFd, mut data: &[u8]) -> std::io::Result<()> {
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
}

/// What a poll slot stands for.
#[derive(Clone, Copy)]
enum Slot {
    Control,
    Signals,
    Stdout(u32),
    Stderr(u32),
    Stdin(u32),
}

impl Init {
    /// `outbuf` holds frames to send first, `inbuf` bytes already received.
    fn new(control: OwnedFd, prepared: Prepared, outbuf: Vec<u8>, inbuf: Vec<u8>) -> Self {
        set_nonblocking(control.as_raw_fd());
        let oom_seen = prepared.cgroup_procs.as_ref().and_then(|_| oom_kills());
        Init {
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
                Err(e) => self.send_error(frame.exec_id, "decode", None, e.to_string()),
            },
            FrameKind::Kill => {
                if let Some(ex) = self.execs.get(&frame.exec_id) {
                    kill_command(ex.pid, self.prepared.confine.own_pid_namespace());
                }
            }
            FrameKind::ReadFile | FrameKind::WriteFile | FrameKind::ListDir => {
                match serve_file_request(&frame) {
                    Ok(answer) => {
                        proto::encode(&mut self.outbuf, FrameKind::Done, frame.exec_id, &answer)
                    }
                    Err(err) => {
                        proto::encode_json(&mut self.outbuf, FrameKind::Error, frame.exec_id, &err)
                    }
                }
            }
            FrameKind::Identity => self.send_error(
                frame.exec_id,
                "identity",
                None,
                "the guest took its identity when it started; it cannot change".into(),
            ),
            _ => {}
        }
    }

    fn send_error(&mut self, exec_id: u32, stage: &str, errno: Option<i32>, message: String) {
        proto::encode_json(
            &mut self.outbuf,
            FrameKind::Error,
            exec_id,
            &InitError {
                stage: stage.to_owned(),
                errno,
                message,
                file: None,
            },
        );
    }

    fn start(&mut self, id: u32, spec: ExecSpec, stdin: Vec<u8>, files: Vec<Vec<u8>>) {
        match self.spawn(id, &spec, stdin, files) {
            Ok(()) => {}
            Err(Spawn::Setup(stage, errno, message)) => self.send_error(id, stage, errno, message),
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
        let launch = Launch::new(spec, files).map_err(|m| Spawn::Setup("spec", None, m))?;
        let errno = |stage: &'static str| {
            move |e: std::io::Error| Spawn::Setup(stage, e.raw_os_error(), e.to_string())
        };
        let (out_r, out_w) = pipe().map_err(errno("pipe"))?;
        let (err_r, err_w) = pipe().map_err(errno("pipe"))?;
        let (report_r, report_w) = pipe().map_err(errno("pipe"))?;
        let stdin_pipe = if stdin.is_empty() {
            None
        } else {
            Some(pipe().map_err(errno("pipe"))?)
        };
        let stdin_child = stdin_pipe
            .as_ref()
            .map_or(self.prepared.devnull.as_raw_fd(), |(r, _)| r.as_raw_fd());
        let started = Instant::now();
        let fds = ChildFds {
            stdin: stdin_child,
            stdout: out_w.as_raw_fd(),
            stderr: err_w.as_raw_fd(),
            report: report_w.as_raw_fd(),
            cgroup_procs: self.prepared.cgroup_procs.as_ref().map(AsRawFd::as_raw_fd),
        };
        let pid = match self.prepared.confine {
            // A fncall worker's command gets mount, pid and IPC namespaces of its own, so
            // it is PID 1 there and everything it leaves behind dies with it.
            Confine::Call(_) => {
                let flags = libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWIPC;
                let pid = crate::zygote::fork_into(flags).map_err(errno("fork"))?;
                if pid == 0 {
                    launch.exec_child(&fds, &self.prepared.confine);
                }
                pid
            }
            Confine::Inherited => {
                spawn_shared(&launch, &fds, &mut self.child_stack).map_err(errno("clone"))?
            }
        };
        drop((out_w, err_w, report_w));
        let stdin_w = stdin_pipe.map(|(r, w)| {
            drop(r);
            set_nonblocking(w.as_raw_fd());
            w
        });
        // The report pipe closes on a successful execve (close-on-exec); otherwise the
        // child wrote why it failed.
        let mut report = [0u8; 8];
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
        if got == report.len() {
            let _ = waitpid(Pid::from_raw(pid), None);
            let stage = u32::from_le_bytes(report[..4].try_into().expect("4 bytes"));
            let err = i32::from_le_bytes(report[4..].try_into().expect("4 bytes"));
            return Err(match ChildStage::from_u32(stage) {
                ChildStage::Exec => Spawn::Exec(err),
                other => Spawn::Setup(
                    other.name(),
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
                deadline: spec
                    .timeout_ms
                    .map(|ms| started + Duration::from_millis(ms)),
                max_output: spec.max_output_bytes,
                sent: [0, 0],
                truncated: false,
                timed_out: false,
                status: None,
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
            Read::Eof => *pipe = None,
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
                        if let Some(ex) = self.execs.get_mut(&id) {
                            ex.status = Some(status);
                        }
                        self.finish(id);
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

/// Answers a guest's file request from its own root, confined exactly as the edge
/// confines a container's file access.
fn serve_file_request(frame: &Frame) -> Result<Vec<u8>, InitError> {
    let failed = |e: FileError| InitError {
        stage: "files".to_owned(),
        errno: None,
        message: e.to_string(),
        file: Some(e.fault()),
    };
    let decode = |e: proto::ProtoError| setup_error("decode", e, None);
    let root = SandboxRoot::at("/");
    match frame.kind {
        FrameKind::ReadFile => {
            let path = String::from_utf8_lossy(&frame.payload);
            let mut file = root.open_read(&path).map_err(failed)?;
            let mut data = Vec::new();
            let limit = (proto::MAX_PAYLOAD - proto::HEADER_LEN) as u64;
            std::io::Read::read_to_end(&mut std::io::Read::take(&mut file, limit + 1), &mut data)
                .map_err(|e| {
                failed(FileError::Io {
                    path: path.to_string(),
                    source: e,
                })
            })?;
            if data.len() as u64 > limit {
                return Err(failed(FileError::WrongType {
                    path: path.to_string(),
                    reason: "is larger than the 256 MiB a VM sandbox reads at once".into(),
                }));
            }
            Ok(data)
        }
        FrameKind::WriteFile => {
            let (header, data): (proto::WriteFile, _) =
                proto::decode_with_header(frame).map_err(decode)?;
            root.write(&header.path, data, header.mode)
                .map_err(failed)?;
            Ok(Vec::new())
        }
        _ => {
            let path = String::from_utf8_lossy(&frame.payload);
            let entries = root.list(&path).map_err(failed)?;
            Ok(serde_json::to_vec(&entries).expect("entries serialize"))
        }
    }
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

/// Kills a command and everything it started. A fncall call is PID 1 of its own pid
/// namespace: killing it makes the kernel kill the rest.
fn kill_command(pid: i32, own_pid_namespace: bool) {
    if own_pid_namespace {
        // SAFETY: kill(2) with integer arguments, on the command's own process.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    } else {
        kill_tree(pid);
    }
}

/// Kills a command's main process and every descendant.
///
/// The main process is a subreaper, so its subtree holds everything it started, double
/// forks included. Each round stops the members found so far (a stopped process cannot
/// fork) and rescans until no new member appears; then all are SIGKILLed. The scan reads
/// the sandbox's own `/proc`, which lists only the sandbox's few processes.
fn kill_tree(main: i32) {
    let mut members = vec![main];
    for _ in 0..64 {
        for pid in &members {
            // SAFETY: kill(2) with integer arguments, on a process of this command.
            unsafe { libc::kill(*pid, libc::SIGSTOP) };
        }
        let before = members.len();
        for pid in descendants(main) {
            if !members.contains(&pid) {
                members.push(pid);
            }
        }
        if members.len() == before {
            break;
        }
    }
    for pid in &members {
        // SAFETY: kill(2) with integer arguments, on a process of this command.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
}

/// Pids whose chain of parents leads to `root`, read from `/proc/<pid>/stat`.
fn descendants(root: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(i32, i32)> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // The command name may hold spaces and parentheses: parse after the last ')'.
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid))
        })
        .collect();
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    tree.remove(0);
    tree
}

/// Why a command could not be started.
enum Spawn {
    /// Before execve: bad spec, chdir...; reported as an error.
    Setup(&'static str, Option<i32>, String),
    /// execve failed: reported like a shell does, exit 127 or 126.
    Exec(i32),
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
}

impl ChildStage {
    fn from_u32(v: u32) -> ChildStage {
        match v {
            1 => ChildStage::Subreaper,
            5 => ChildStage::CallRoot,
            6 => ChildStage::Confine,
            7 => ChildStage::Files,
            2 => ChildStage::Stdio,
            3 => ChildStage::Chdir,
            _ => ChildStage::Exec,
        }
    }

    fn name(self) -> &'static str {
        match self {
            ChildStage::Subreaper => "become subreaper",
            ChildStage::CallRoot => "build the call\'s root",
            ChildStage::Confine => "drop privileges",
            ChildStage::Files => "write the command\'s files",
            ChildStage::Stdio => "set up stdio",
            ChildStage::Chdir => "chdir",
            ChildStage::Exec => "exec",
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

/// Writes a file (parents created) in the command's own root.
fn write_file(path: &str, mode: u32, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::path::Path::new(path);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, data)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o7777))
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
    /// A VM guest's commands cgroup: its `cgroup.procs`, which the child joins.
    cgroup_procs: Option<RawFd>,
}

/// Everything the child needs, converted before `fork` so that the child only makes
/// syscalls.
struct Launch {
    argv: Vec<CString>,
    env: Vec<CString>,
    candidates: Vec<CString>,
    cwd: CString,
    /// Files to write in the command's root first: (path, mode, contents).
    files: Vec<(String, u32, Vec<u8>)>,
}

fn cstring(s: &str, what: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} contains a NUL byte"))
}

impl Launch {
    fn new(spec: &ExecSpec, contents: Vec<Vec<u8>>) -> Result<Launch, String> {
        let argv = spec
            .argv
            .iter()
            .map(|a| cstring(a, "argument"))
            .collect::<Result<Vec<_>, _>>()?;
        let program = spec.argv.first().ok_or("empty command")?;
        let env = spec
            .env
            .iter()
            .map(|e| cstring(e, "environment"))
            .collect::<Result<Vec<_>, _>>()?;
        let candidates = if program.contains('/') {
            vec![cstring(program, "program")?]
        } else {
            let path = spec
                .env
                .iter()
                .find_map(|e| e.strip_prefix("PATH="))
                .unwrap_or("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
            path.split(':')
                .filter(|d| !d.is_empty())
                .map(|d| cstring(&format!("{d}/{program}"), "program"))
                .collect::<Result<Vec<_>, _>>()?
        };
        Ok(Launch {
            argv,
            env,
            candidates,
            cwd: cstring(&spec.cwd, "working directory")?,
            files: spec
                .files
                .iter()
                .zip(contents)
                .map(|(f, data)| (f.path.clone(), f.mode, data))
                .collect(),
        })
    }

    /// Runs in the forked child: becomes a subreaper, wires stdio, enters the working
    /// directory and execs; capabilities, no_new_privs and seccomp are inherited from
    /// init. Reports a failing step through the report pipe and exits.
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
        // init is exempt from the OOM killer; its commands must not be.
        let _ = std::fs::write("/proc/self/oom_score_adj", "0");
        if let Some(procs) = fds.cgroup_procs {
            // SAFETY: writing a constant to a descriptor this process owns.
            if unsafe { libc::write(procs, c"0".as_ptr().cast(), 1) } < 0 {
                fail(ChildStage::Confine, last_errno());
            }
        }
        for (path, mode, data) in &self.files {
            if let Err(e) = write_file(path, *mode, data) {
                fail(ChildStage::Files, e.raw_os_error().unwrap_or(libc::EIO));
            }
        }
        for (from, to) in [(fds.stdin, 0), (fds.stdout, 1), (fds.stderr, 2)] {
            // SAFETY: dup2 between descriptors this process owns.
            if unsafe { libc::dup2(from, to) } < 0 {
                fail(ChildStage::Stdio, last_errno());
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
        let mut argv: Vec<*const libc::c_char> = self.argv.iter().map(|a| a.as_ptr()).collect();
        argv.push(std::ptr::null());
        let mut envp: Vec<*const libc::c_char> = self.env.iter().map(|e| e.as_ptr()).collect();
        envp.push(std::ptr::null());
        let mut errno = libc::ENOENT;
        for path in &self.candidates {
            // SAFETY: path, argv and envp are NUL-terminated and outlive the call.
            unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
            let e = last_errno();
            if e != libc::ENOENT && e != libc::ENOTDIR {
                errno = e;
            }
        }
        fail(ChildStage::Exec, errno)
    }
}
