//! init's request loop: one `poll(2)` over the control channel, every running command's
//! pipes and the `SIGCHLD` signalfd, serving the edge's frames — exec (plain commands and
//! stepped calls), kill, file requests — and relaying output, step reports and exits.
//!
//! Invariants: nothing here blocks (every descriptor is non-blocking, but a command's
//! report pipe, read once right after its clone: the child writes it or closes it before
//! it can block; and a fncall worker's standby, waited for while it sets up, see
//! [`standby`]); output pipes are not read while more than [`MAX_QUEUED`] bytes wait for
//! the edge; a command's output is bounded by its `max_output_bytes` (the rest is dropped
//! and the exit marked truncated).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::fs::OFlags;
use rustix::io::Errno;
use rustix::pipe::PipeFlags;

use super::standby::{self, Standby};
use super::{agent, setup_error, Confine, Prepared};
use crate::files::service::FileService;
use crate::files::FileError;
use crate::launch::{self, CallRoot, ChildFds, ChildStage, Launch, StepFds, REPORT_MAX};
use crate::proto::{
    self, ExecExit, ExecSpec, Frame, FrameKind, InitError, InitStage, Started, WinSize,
};
use crate::steps::StepPlan;

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

/// Result of a non-blocking read.
enum Read {
    Data(usize),
    WouldBlock,
    Eof,
}

fn read_nonblocking(fd: BorrowedFd<'_>, buf: &mut [u8]) -> Read {
    loop {
        return match rustix::io::read(fd, &mut *buf) {
            Ok(0) => Read::Eof,
            Ok(n) => Read::Data(n),
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => Read::WouldBlock,
            Err(_) => Read::Eof,
        };
    }
}

fn set_nonblocking(fd: impl AsFd) {
    if let Ok(flags) = rustix::fs::fcntl_getfl(&fd) {
        let _ = rustix::fs::fcntl_setfl(&fd, flags | OFlags::NONBLOCK);
    }
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(rustix::pipe::pipe_with(PipeFlags::CLOEXEC)?)
}

/// `poll`'s timeout until `deadline`, in whole milliseconds plus one: woken just before
/// its deadline, init would only poll again.
fn poll_timeout(deadline: Instant) -> Timespec {
    let left = deadline.saturating_duration_since(Instant::now());
    let wait = Duration::from_millis(u64::try_from(left.as_millis()).unwrap_or(u64::MAX))
        .saturating_add(Duration::from_millis(1));
    Timespec {
        tv_sec: i64::try_from(wait.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(wait.subsec_nanos()),
    }
}

/// One running command.
struct Exec {
    pid: i32,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    stdin: Option<OwnedFd>,
    stdin_data: Vec<u8>,
    stdin_sent: usize,
    /// No more input comes: the writer closes once `stdin_data` is written.
    stdin_eof: bool,
    /// An interactive command: the edge hears of each byte of input init no longer holds
    /// ([`FrameKind::StdinTaken`]), which bounds what it sends ahead.
    reports_stdin: bool,
    /// The master side of the command's terminal, when it runs on one.
    terminal: Option<OwnedFd>,
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

/// init's side of a stepped call (see `crate::steps`): `Exec::stdout`/`stderr` are the
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

pub(super) struct Init {
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
    /// A fncall worker's next call, set up ahead (see [`standby`]).
    standby: Option<Standby>,
    /// The standby a running call took, and that call's id: its holder is released when
    /// the call ends.
    standby_in_use: Option<(u32, Standby)>,
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
    Watches,
}

impl Init {
    /// `outbuf` holds frames to send first, `inbuf` bytes already received.
    pub(super) fn new(
        control: OwnedFd,
        mut prepared: Prepared,
        outbuf: Vec<u8>,
        inbuf: Vec<u8>,
    ) -> Self {
        set_nonblocking(&control);
        let oom_seen = if prepared.guest {
            agent::oom_kills()
        } else {
            None
        };
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
            standby: None,
            standby_in_use: None,
        }
    }

    /// Starts setting up the next call if a fncall worker has no standby. A standby that
    /// cannot start is no error: the call then clones its own first process.
    fn refill_standby(&mut self) {
        if let (Confine::Call(call), None) = (&self.prepared.confine, &self.standby) {
            self.standby = Standby::start(call).ok();
        }
    }

    /// The standby for a call, once it is ready; `None` (and the standby dropped) if it
    /// failed.
    fn ready_standby(&mut self) -> Option<Standby> {
        let mut standby = self.standby.take()?;
        match standby.state() {
            standby::State::Ready => Some(standby),
            standby::State::Building => {
                (standby.wait() == standby::State::Ready).then_some(standby)
            }
            standby::State::Failed => None,
        }
    }

    pub(super) fn serve(&mut self) {
        self.refill_standby();
        let mut slots: Vec<Slot> = Vec::new();
        let mut ready: Vec<(Slot, PollFlags)> = Vec::new();
        loop {
            slots.clear();
            let mut fds: Vec<PollFd<'_>> = Vec::new();
            let mut add = |fd, events, slot| {
                fds.push(PollFd::from_borrowed_fd(fd, events));
                slots.push(slot);
            };
            let control_events = if self.outbuf.is_empty() {
                PollFlags::IN
            } else {
                PollFlags::IN | PollFlags::OUT
            };
            add(self.control.as_fd(), control_events, Slot::Control);
            add(self.prepared.signals.as_fd(), PollFlags::IN, Slot::Signals);
            let reading = self.outbuf.len() < MAX_QUEUED;
            for (id, ex) in &self.execs {
                if reading {
                    if let Some(fd) = &ex.stdout {
                        add(fd.as_fd(), PollFlags::IN, Slot::Stdout(*id));
                    }
                    if let Some(fd) = &ex.stderr {
                        add(fd.as_fd(), PollFlags::IN, Slot::Stderr(*id));
                    }
                }
                if let Some(fd) = &ex.stdin {
                    if ex.stdin_sent < ex.stdin_data.len() {
                        add(fd.as_fd(), PollFlags::OUT, Slot::Stdin(*id));
                    }
                }
                if let Some(fd) = ex.relay.as_ref().and_then(|r| r.reports.as_ref()) {
                    if reading {
                        add(fd.as_fd(), PollFlags::IN, Slot::Reports(*id));
                    }
                }
            }
            if let Some(fd) = self.files.watch_fd().filter(|_| reading) {
                add(fd, PollFlags::IN, Slot::Watches);
            }
            let timeout = self.next_deadline().map(poll_timeout);
            if rustix::event::poll(&mut fds, timeout.as_ref()).is_err() {
                continue;
            }
            ready.clear();
            ready.extend(
                slots
                    .iter()
                    .zip(&fds)
                    .filter(|(_, fd)| !fd.revents().is_empty())
                    .map(|(slot, fd)| (*slot, fd.revents())),
            );
            drop(fds);
            for &(slot, revents) in &ready {
                match slot {
                    Slot::Control => {
                        if revents.contains(PollFlags::OUT) {
                            self.flush();
                        }
                        if revents.intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR)
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
                    Slot::Watches => self.files.pump_watches(&mut self.outbuf),
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
            match read_nonblocking(self.control.as_fd(), &mut self.scratch) {
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
            FrameKind::Watch => {
                let id = frame.exec_id;
                match self.files.watch(&frame) {
                    Ok(()) => proto::encode(&mut self.outbuf, FrameKind::Watching, id, &[]),
                    Err(err) => proto::encode_json(&mut self.outbuf, FrameKind::Error, id, &err),
                }
            }
            FrameKind::Unwatch => self.files.unwatch(frame.exec_id),
            FrameKind::Stdin => {
                let Some(ex) = self.execs.get_mut(&frame.exec_id) else {
                    return;
                };
                if ex.stdin.is_some() && !ex.stdin_eof {
                    ex.stdin_data.extend_from_slice(&frame.payload);
                } else if ex.reports_stdin {
                    // Input past its end is dropped: the edge may send more.
                    stdin_taken(&mut self.outbuf, frame.exec_id, frame.payload.len());
                }
            }
            FrameKind::CloseStdin => {
                if let Some(ex) = self.execs.get_mut(&frame.exec_id) {
                    // Closing a terminal's master would hang it up: type its EOF instead.
                    if ex.terminal.is_some() && !ex.stdin_eof {
                        ex.stdin_data.push(EOF_CHAR);
                    }
                    ex.stdin_eof = true;
                    if ex.stdin_sent == ex.stdin_data.len() {
                        ex.stdin = None;
                    }
                }
            }
            FrameKind::Signal => {
                if let (Some(ex), Ok(sig)) = (
                    self.execs.get(&frame.exec_id),
                    frame.json::<proto::Signal>(),
                ) {
                    if let Ok(sig) = nix::sys::signal::Signal::try_from(sig.signal) {
                        let _ = nix::sys::signal::kill(Pid::from_raw(ex.pid), sig);
                    }
                }
            }
            FrameKind::Resize => {
                let terminal = self
                    .execs
                    .get(&frame.exec_id)
                    .and_then(|ex| ex.terminal.as_ref());
                if let (Some(fd), Ok(size)) = (terminal, frame.json::<WinSize>()) {
                    let _ = rustix::termios::tcsetwinsize(fd, winsize(size));
                }
            }
            FrameKind::ReadFile
            | FrameKind::WriteFile
            | FrameKind::ListDir
            | FrameKind::Stat
            | FrameKind::MakeDir
            | FrameKind::MovePath
            | FrameKind::RemovePath
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
            FrameKind::Usage => match &self.prepared.usage {
                Some(source) => {
                    let usage = source.read();
                    proto::encode_json(&mut self.outbuf, FrameKind::Done, frame.exec_id, &usage);
                }
                None => self.send_error(
                    frame.exec_id,
                    InitStage::Decode,
                    None,
                    "a container's usage is read by the edge, not asked".into(),
                ),
            },
            FrameKind::Identity => match &self.prepared.identity_keeper {
                Some(keeper) => match keeper.take(&frame.payload) {
                    Ok(()) => proto::encode(&mut self.outbuf, FrameKind::Done, frame.exec_id, &[]),
                    Err(message) => {
                        self.send_error(frame.exec_id, InitStage::Identity, None, message);
                    }
                },
                None => self.send_error(
                    frame.exec_id,
                    InitStage::Identity,
                    None,
                    "a container's identity is set when it starts; it cannot change".into(),
                ),
            },
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
            Err(Spawn::Exec { errno, pid }) => {
                if spec.interactive {
                    proto::encode_json(&mut self.outbuf, FrameKind::Started, id, &Started { pid });
                }
                let arg_bytes =
                    launch::exec_arg_bytes(spec.argv.iter().chain(&spec.env).map(String::len));
                let msg = launch::exec_failure_message(
                    spec.argv.first().map(String::as_str).unwrap_or_default(),
                    errno,
                    arg_bytes,
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
        if (spec.interactive && stepped) || (spec.pty.is_some() && !spec.interactive) {
            return Err(Spawn::Setup(
                InitStage::Spec,
                None,
                "terminals are for interactive plain commands only".into(),
            ));
        }
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
        // The user is looked up right before its command starts: the sandbox may have
        // added it, or changed its home, a moment ago.
        let user = match &spec.run_as {
            Some(run_as) => {
                let root = self.files.sandbox_root().ok_or_else(|| {
                    Spawn::Setup(
                        InitStage::User,
                        None,
                        "user= is not supported by fncall calls".into(),
                    )
                })?;
                let (account, home_is_dir) = crate::users::lookup(root, &run_as.user)
                    .map_err(|e| Spawn::Setup(InitStage::User, None, e.to_string()))?;
                let cwd = match run_as.home_cwd && home_is_dir {
                    true => account.home.clone(),
                    false => spec.cwd.clone(),
                };
                Some((account, cwd))
            }
            None => None,
        };
        let launch = Launch::new(spec, files, user.as_ref().map(|(a, cwd)| (a, cwd.as_str())))
            .map_err(|m| Spawn::Setup(InitStage::Spec, None, m))?;
        let plan = match stepped {
            true => Some(
                StepPlan::new(spec, step_stdin)
                    .map_err(|m| Spawn::Setup(InitStage::Spec, None, m))?,
            ),
            false => None,
        };
        let errno = |stage: InitStage| {
            move |e: std::io::Error| Spawn::Setup(stage, e.raw_os_error(), e.to_string())
        };
        let terminal = match spec.pty {
            Some(size) => Some(open_terminal(size).map_err(errno(InitStage::Terminal))?),
            None => None,
        };
        // One (stdout, stderr) pair per step: a plain command is a single step; one on a
        // terminal has none.
        let steps = match (stepped, &terminal) {
            (_, Some(_)) => 0,
            (true, None) => 1 + spec.then.len(),
            (false, None) => 1,
        };
        let mut outputs = Vec::with_capacity(steps);
        for _ in 0..steps {
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
        let stdin_pipe = if (stdin.is_empty() && !spec.interactive) || terminal.is_some() {
            None
        } else {
            Some(pipe().map_err(errno(InitStage::Pipe))?)
        };
        let started = Instant::now();
        // A fncall call takes the worker's standby: it is released when the call ends, or
        // here if the call fails.
        let mut standby = match self.prepared.confine {
            Confine::Call(_) => self.ready_standby(),
            Confine::Inherited => None,
        };
        let stdin_child = stdin_pipe
            .as_ref()
            .map_or(self.prepared.devnull.as_fd(), |(r, _)| r.as_fd());
        let [stdin_child, stdout_child, stderr_child] = match (&terminal, outputs.first()) {
            (Some((_, slave)), _) => [slave.as_fd(); 3],
            (None, Some(((_, out), (_, err)))) => [stdin_child, out.as_fd(), err.as_fd()],
            (None, None) => unreachable!("a command off a terminal has a step"),
        };
        let failure = AtomicU64::new(0);
        let fds = ChildFds {
            failure: &failure,
            stdin: stdin_child,
            stdout: stdout_child,
            stderr: stderr_child,
            controlling_tty: terminal.is_some(),
            report: report_w.as_fd(),
            join_cgroup: self.prepared.commands_cgroup.as_ref().map(AsFd::as_fd),
            steps: reports.as_ref().map(|(_, w)| StepFds {
                outputs: outputs
                    .iter()
                    .map(|((_, out), (_, err))| (out.as_fd(), err.as_fd()))
                    .collect(),
                reports: w.as_fd(),
                devnull: self.prepared.devnull.as_fd(),
            }),
        };
        let pid = match self.prepared.confine {
            // A fncall worker's command gets mount, pid and IPC namespaces of its own, so
            // it is PID 1 there and everything it leaves behind dies with it: from a
            // standby that set them up ahead, or cloned now.
            Confine::Call(ref setup) => {
                let handed = standby
                    .as_ref()
                    .and_then(|s| s.hand_over(spec, &launch, plan.as_ref(), &fds).ok());
                match handed {
                    Some(pid) => pid,
                    None => {
                        standby = None;
                        let flags = libc::CLONE_NEWPID | libc::CLONE_NEWNS | libc::CLONE_NEWIPC;
                        let pid = launch::fork_into(flags).map_err(errno(InitStage::Fork))?;
                        if pid == 0 {
                            launch.run_call(plan.as_ref(), &fds, &CallRoot::Build(setup))
                        }
                        pid
                    }
                }
            }
            Confine::Inherited => launch::spawn_shared(&launch, &fds, &mut self.child_stack)
                .map_err(errno(InitStage::Clone))?,
        };
        drop(report_w);
        let mut outputs = outputs
            .into_iter()
            .map(|((out_r, _), (err_r, _))| (out_r, err_r));
        // The terminal's master, three times: output read from, input written to (closed
        // by CloseStdin), and resized; the slave is the command's alone from here.
        let (out_r, err_r, terminal, stdin_w) = match terminal {
            Some((master, slave)) => {
                drop(slave);
                let dup = |fd: &OwnedFd| fd.try_clone().map_err(errno(InitStage::Terminal));
                let (out, input) = (dup(&master)?, dup(&master)?);
                set_nonblocking(&input);
                (out, None, Some(master), Some(input))
            }
            None => {
                let (out_r, err_r) = outputs.next().expect("one step at least");
                let stdin_w = stdin_pipe.map(|(r, w)| {
                    drop(r);
                    set_nonblocking(&w);
                    w
                });
                (out_r, Some(err_r), None, stdin_w)
            }
        };
        let relay = reports.map(|(r, _)| {
            set_nonblocking(&r);
            StepRelay {
                later: outputs.collect(),
                reports: Some(r),
                pending: Vec::new(),
            }
        });
        // The report pipe closes on a successful execve (close-on-exec); otherwise the
        // child wrote why it failed: stage and errno, then, for its files, the FileError.
        let mut report = vec![0u8; REPORT_MAX];
        let mut got = 0;
        while got < report.len() {
            match rustix::io::read(&report_r, &mut report[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(Errno::INTR) => {}
                Err(_) => break,
            }
        }
        if got == 0 {
            if let Some(left) = launch::failure_report(failure.load(Ordering::Relaxed)) {
                report[..8].copy_from_slice(&left);
                got = 8;
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
                ChildStage::Exec => Spawn::Exec { errno: err, pid },
                other => Spawn::Setup(
                    other.stage(),
                    Some(err),
                    match other {
                        ChildStage::Chdir => format!(
                            "working directory {:?}: {}",
                            user.as_ref().map_or(&spec.cwd, |(_, cwd)| cwd),
                            std::io::Error::from_raw_os_error(err)
                        ),
                        _ => std::io::Error::from_raw_os_error(err).to_string(),
                    },
                ),
            });
        }
        set_nonblocking(&out_r);
        if let Some(err_r) = &err_r {
            set_nonblocking(err_r);
        }
        if spec.interactive {
            proto::encode_json(&mut self.outbuf, FrameKind::Started, id, &Started { pid });
        }
        self.by_pid.insert(pid, id);
        if let Some(standby) = standby {
            self.standby_in_use = Some((id, standby));
        }
        self.execs.insert(
            id,
            Exec {
                pid,
                stdout: Some(out_r),
                stderr: err_r,
                stdin: stdin_w,
                stdin_data: stdin,
                stdin_sent: 0,
                stdin_eof: !spec.interactive,
                reports_stdin: spec.interactive,
                terminal,
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
        let Some(fd) = pipe.as_ref().map(AsFd::as_fd) else {
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
        let Some(fd) = relay.reports.as_ref().map(AsFd::as_fd) else {
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
                        set_nonblocking(&out);
                        set_nonblocking(&err);
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
        let Some(fd) = ex.stdin.as_ref() else {
            return;
        };
        let before = ex.stdin_sent;
        let failed = match rustix::io::write(fd, &ex.stdin_data[ex.stdin_sent..]) {
            Ok(n) => {
                ex.stdin_sent += n;
                false
            }
            Err(e) => e != Errno::AGAIN,
        };
        if ex.reports_stdin {
            // Written, or (the command closed its input) dropped.
            let taken = if failed {
                ex.stdin_data.len()
            } else {
                ex.stdin_sent
            };
            stdin_taken(&mut self.outbuf, id, taken - before);
        }
        if failed || ex.stdin_sent == ex.stdin_data.len() {
            ex.stdin_data = Vec::new();
            ex.stdin_sent = 0;
            if failed || ex.stdin_eof {
                ex.stdin = None;
            }
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
                let Some(fd) = pipe.as_ref().map(AsFd::as_fd) else {
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
            duration_us: u64::try_from(ex.started.elapsed().as_micros()).unwrap_or(u64::MAX),
            oom_killed: exit_code == Some(128 + libc::SIGKILL) && self.oom_kill_since_last(),
        };
        proto::encode_json(&mut self.outbuf, FrameKind::Exit, id, &exit);
        let released = self.standby_in_use.take_if(|(call, _)| *call == id);
        let calls = matches!(self.prepared.confine, Confine::Call(_));
        if released.is_some() || (calls && self.standby.is_none()) {
            // The result first: the next root is built while it travels.
            self.flush();
            drop(released);
            self.refill_standby();
        }
    }

    /// Whether a VM guest's OOM killer struck since the last look. Asked only when a
    /// command ended by SIGKILL (itself, or its shell reporting 137): reading
    /// `/proc/vmstat` costs too much under binary translation to do per command.
    fn oom_kill_since_last(&mut self) -> bool {
        let Some(seen) = self.oom_seen else {
            return false;
        };
        let now = agent::oom_kills().unwrap_or(seen);
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
            // The channel is non-blocking and SIGPIPE ignored; write(2), not send(2): a
            // guest's channel may be a character device.
            match rustix::io::write(&self.control, &self.outbuf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    self.outbuf.drain(..n);
                }
            }
        }
    }
}

/// Queues output for the edge, up to the command's bound; the rest is dropped.
fn forward(outbuf: &mut Vec<u8>, id: u32, ex: &mut Exec, stream: usize, data: &[u8]) {
    let room = usize::try_from(ex.max_output.saturating_sub(ex.sent[stream])).unwrap_or(usize::MAX);
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

/// What a terminal reads as end-of-file at the start of a line (`VEOF`, Ctrl-D).
const EOF_CHAR: u8 = 0x04;

/// Tells the edge that init no longer holds `n` bytes of command `id`'s input.
fn stdin_taken(outbuf: &mut Vec<u8>, id: u32, n: usize) {
    if n > 0 {
        proto::encode(outbuf, FrameKind::StdinTaken, id, &(n as u64).to_le_bytes());
    }
}

/// A new terminal of `size`: its master and slave sides, both close-on-exec.
fn open_terminal(size: WinSize) -> std::io::Result<(OwnedFd, OwnedFd)> {
    use rustix::pty::OpenptFlags;
    let master =
        rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let name = rustix::pty::ptsname(&master, Vec::new())?;
    let slave = rustix::fs::open(
        name.as_c_str(),
        OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    rustix::termios::tcsetwinsize(&master, winsize(size))?;
    Ok((master, slave))
}

fn winsize(size: WinSize) -> rustix::termios::Winsize {
    rustix::termios::Winsize {
        ws_col: size.cols,
        ws_row: size.rows,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
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
    Exec {
        /// Why.
        errno: i32,
        /// The process that failed to exec (reported as a spawned process's pid).
        pid: i32,
    },
    /// A fncall call's file could not be written.
    Files(FileError),
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
