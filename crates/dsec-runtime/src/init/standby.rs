//! A fncall worker's next call, set up before the call comes.
//!
//! A call's first process costs about 2 ms before its command can start: its clone into
//! new namespaces, its root (the detach of the old root after the pivot waits for an RCU
//! grace period), its `/proc`, its confinement. The teardown of its mounts when it exits
//! waits the same way, before init learns of the exit. A worker serves one call at a time,
//! so between calls init starts a standby of two processes that do all of it ahead:
//!
//! - the *holder*, forked into mount and IPC namespaces of its own (an IPC namespace, too,
//!   costs a filesystem to make and to tear down), builds the call's root
//!   ([`crate::rootfs::prepare_call_root`]) and then holds both namespaces until init
//!   releases it, once the call's result is sent: their teardown waits in its exit, off
//!   the call's path;
//! - the *first process*, which the holder clones into a new pid namespace as a child of
//!   init (`CLONE_PARENT`: init reaps it and learns its exit as any command's), mounts its
//!   `/proc` ([`crate::rootfs::finish_call_root`]), confines itself
//!   ([`CallSetup::confine`]) and waits on a socket for the call: its spec, the contents
//!   of its files, a stepped call's stdin, and its descriptors. Then it runs the call from
//!   the same code as a first process cloned for it ([`Launch::run_call`]): it becomes the
//!   call's command, PID 1 of its namespace, or its steps' runner.
//!
//! A call that comes while the standby is still being set up waits for it: what is left
//! of it is less than a whole setup. A call that finds the standby dead clones its first
//! process, which builds the same root itself (`rootfs::setup_call`). Either way a call
//! has the worker's processes but init and one holder: no second setup runs beside it.

use std::borrow::Cow;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::pipe::{pipe_with, PipeFlags};
use serde::{Deserialize, Serialize};

use crate::launch::{self, exit_now, CallRoot, CallSetup, ChildFds, Launch, StepFds};
use crate::proto::ExecSpec;
use crate::steps::StepPlan;

/// Most descriptors one `SCM_RIGHTS` message carries (the kernel's `SCM_MAX_FD`); a call
/// with more (a stepped call of over 120 steps) clones its own first process.
const MAX_FDS: usize = 253;
/// How long a call waits for a standby that is still being set up before it gives up on
/// it and clones its own first process: far more than any setup takes.
const WAIT_FOR_STANDBY: Duration = Duration::from_secs(5);
/// The fixed part of a handoff, sent with the descriptors: the header's length.
const PREFIX: usize = 4;

/// A standby: its first process, through the socket to it, and its holder.
pub(super) struct Standby {
    /// init's end of the socket to the first process: a byte comes when it is ready
    /// (end-of-file if it failed); the call goes.
    handoff: UnixStream,
    /// The first process's pid, from the holder once it cloned it (end-of-file if the
    /// holder failed first). Non-blocking.
    cloned: OwnedFd,
    pid: Option<i32>,
    ready: bool,
    /// The holder exits when this closes (dropped with the `Standby`); init reaps it with
    /// its other children.
    _release: OwnedFd,
}

/// Where a standby is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum State {
    Building,
    Ready,
    Failed,
}

/// What a call's first process is told besides its descriptors (init sends the spec it
/// holds; the first process reads its own copy).
#[derive(Serialize, Deserialize)]
struct Header<'a> {
    spec: Cow<'a, ExecSpec>,
    /// The lengths of the files' contents, then of a stepped call's stdin, which follow
    /// the header in this order.
    lengths: Vec<usize>,
    /// The descriptors include the commands' cgroup to join.
    join_cgroup: bool,
    controlling_tty: bool,
    /// A stepped call's number of steps (their descriptors come last); zero otherwise.
    steps: usize,
}

impl Standby {
    /// Forks a holder that builds a root for `call` and clones the call's first process.
    pub(super) fn start(call: &CallSetup) -> std::io::Result<Standby> {
        let (handoff, first) = UnixStream::pair()?;
        let (cloned_r, cloned_w) = pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
        let (release_r, release_w) = pipe_with(PipeFlags::CLOEXEC)?;
        let pid = launch::fork_into(libc::CLONE_NEWNS | libc::CLONE_NEWIPC)?;
        if pid == 0 {
            hold(call, cloned_w, release_r, first);
        }
        drop((cloned_w, release_r, first));
        Ok(Standby {
            handoff,
            cloned: cloned_r,
            pid: None,
            ready: false,
            _release: release_w,
        })
    }

    /// Waits, at most [`WAIT_FOR_STANDBY`], for a standby still being set up.
    pub(super) fn wait(&mut self) -> State {
        let deadline = Instant::now() + WAIT_FOR_STANDBY;
        loop {
            let state = self.state();
            let left = deadline.saturating_duration_since(Instant::now());
            if state != State::Building || left.is_zero() {
                return state;
            }
            let fd = match self.pid {
                None => self.cloned.as_fd(),
                Some(_) => self.handoff.as_fd(),
            };
            let timeout = Timespec::try_from(left).unwrap_or_default();
            let _ = rustix::event::poll(&mut [PollFd::new(&fd, PollFlags::IN)], Some(&timeout));
        }
    }

    /// Whether the first process waits for a call, without waiting.
    pub(super) fn state(&mut self) -> State {
        if self.ready {
            return State::Ready;
        }
        if self.pid.is_none() {
            let mut pid = [0u8; 4];
            match rustix::io::read(&self.cloned, &mut pid) {
                Ok(4) => self.pid = Some(i32::from_le_bytes(pid)),
                Err(Errno::AGAIN | Errno::INTR) => return State::Building,
                Ok(_) | Err(_) => return State::Failed,
            }
        }
        let mut byte = [0u8];
        match rustix::net::recv(&self.handoff, &mut byte, rustix::net::RecvFlags::DONTWAIT) {
            Ok((1, _)) => {
                self.ready = true;
                State::Ready
            }
            Err(Errno::AGAIN | Errno::INTR) => State::Building,
            Ok(_) | Err(_) => State::Failed,
        }
    }

    /// Gives a ready standby's first process its call, and waits until it has it; returns
    /// its pid, init's child. An error leaves the call to a first process cloned for it
    /// (the standby died; the descriptors init sent it are closed with its socket).
    pub(super) fn hand_over(
        &self,
        spec: &ExecSpec,
        launch: &Launch,
        plan: Option<&StepPlan>,
        fds: &ChildFds<'_>,
    ) -> std::io::Result<i32> {
        let pid = self.pid.filter(|_| self.ready).ok_or(Errno::INVAL)?;
        let mut contents: Vec<&[u8]> = launch.file_contents().collect();
        contents.extend(plan.map(StepPlan::stdin));
        let header = serde_json::to_vec(&Header {
            spec: Cow::Borrowed(spec),
            lengths: contents.iter().map(|c| c.len()).collect(),
            join_cgroup: fds.join_cgroup.is_some(),
            controlling_tty: fds.controlling_tty,
            steps: fds.steps.as_ref().map_or(0, |s| s.outputs.len()),
        })
        .map_err(std::io::Error::other)?;
        let descriptors = carried(fds);
        if descriptors.len() > MAX_FDS {
            return Err(Errno::TOOMANYREFS.into());
        }
        let prefix = u32::try_from(header.len())
            .map_err(|_| Errno::TOOBIG)?
            .to_le_bytes();
        let sent = sendmsg::<()>(
            self.handoff.as_raw_fd(),
            &[IoSlice::new(&prefix)],
            &[ControlMessage::ScmRights(&descriptors)],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )?;
        if sent != PREFIX {
            return Err(Errno::PIPE.into());
        }
        // The first process reads as this writes: neither waits on the other for long.
        let mut socket = &self.handoff;
        socket.write_all(&header)?;
        for c in contents {
            socket.write_all(c)?;
        }
        // Its byte once it has the call: a standby that died before (killed while it
        // waited) takes nothing of the call with it, which then goes to a first process
        // cloned for it.
        socket.read_exact(&mut [0u8])?;
        Ok(pid)
    }
}

/// The descriptors a call's first process starts from, in the order [`receive`] expects:
/// stdin, stdout, stderr, the report pipe, the commands' cgroup, then a stepped call's
/// (see [`StepFds::all`]).
fn carried(fds: &ChildFds<'_>) -> Vec<RawFd> {
    let mut all = vec![
        fds.stdin.as_raw_fd(),
        fds.stdout.as_raw_fd(),
        fds.stderr.as_raw_fd(),
        fds.report.as_raw_fd(),
    ];
    all.extend(fds.join_cgroup.map(|fd| fd.as_raw_fd()));
    if let Some(steps) = &fds.steps {
        all.extend(steps.all());
    }
    all
}

/// The holder: builds the root in the mount namespace it was forked into, clones the
/// first process, says its pid on `cloned`, and holds the namespaces until `release`
/// closes.
fn hold(call: &CallSetup, cloned: OwnedFd, release: OwnedFd, first: UnixStream) -> ! {
    // Standard input, output and error stay (init's /dev/null): the descriptors the first
    // process receives are never 0 to 2.
    let own = [cloned.as_raw_fd(), release.as_raw_fd(), first.as_raw_fd()];
    let keep = [0, 1, 2, own[0], own[1], own[2]];
    // SAFETY: this process only builds the root, clones, waits and exits; it never
    // touches what owned init's other descriptors.
    if unsafe { crate::fds::close_all_but(&keep) }.is_err() {
        exit_now(1)
    }
    if crate::rootfs::prepare_call_root(call.layer_count, call.disk_bytes).is_err() {
        exit_now(1)
    }
    let pid = match launch::fork_into(libc::CLONE_NEWPID | libc::CLONE_PARENT) {
        Ok(0) => first_process(call, first),
        Ok(pid) => pid,
        Err(_) => exit_now(1),
    };
    // The socket is the first process's alone: its end-of-file tells init it died.
    drop(first);
    if rustix::io::write(&cloned, &pid.to_le_bytes()) != Ok(4) {
        exit_now(1)
    }
    let mut byte = [0u8];
    while rustix::io::read(&release, &mut byte) == Err(Errno::INTR) {}
    exit_now(0)
}

/// The first process, PID 1 of its pid namespace: finishes the root, confines itself, says
/// it is ready, and runs the call init hands it (or exits when init drops the standby).
fn first_process(call: &CallSetup, mut socket: UnixStream) -> ! {
    // SAFETY: as in `hold`, whose copies of these descriptors this process never uses.
    if unsafe { crate::fds::close_all_but(&[0, 1, 2, socket.as_raw_fd()]) }.is_err() {
        exit_now(1)
    }
    if crate::rootfs::finish_call_root().is_err()
        || call.confine().is_err()
        || socket.write_all(&[1]).is_err()
    {
        exit_now(1)
    }
    let Some(received) = receive(&socket) else {
        exit_now(0)
    };
    if socket.write_all(&[1]).is_err() {
        exit_now(1)
    }
    drop(socket);
    received.run()
}

/// A call as its first process received it.
struct Received {
    header: Header<'static>,
    contents: Vec<Vec<u8>>,
    fds: Vec<OwnedFd>,
}

/// Reads a call from init; `None` at end-of-file (the standby was dropped unused) or on a
/// malformed handoff.
fn receive(mut socket: &UnixStream) -> Option<Received> {
    let mut prefix = [0u8; PREFIX];
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(&mut prefix)];
    let msg = loop {
        match recvmsg::<()>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_WAITALL,
        ) {
            Err(nix::Error::EINTR) => {}
            other => break other.ok()?,
        }
    };
    let mut fds = Vec::new();
    for c in msg.cmsgs().ok()? {
        if let ControlMessageOwned::ScmRights(received) = c {
            // SAFETY: SCM_RIGHTS installed these descriptors in this process for us.
            fds.extend(
                received
                    .iter()
                    .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    if msg.bytes != PREFIX {
        return None;
    }
    let mut read = |len: usize| {
        let mut buf = vec![0u8; len];
        socket.read_exact(&mut buf).ok().map(|()| buf)
    };
    let header: Header =
        serde_json::from_slice(&read(u32::from_le_bytes(prefix) as usize)?).ok()?;
    let contents = header
        .lengths
        .iter()
        .map(|&len| read(len))
        .collect::<Option<Vec<_>>>()?;
    Some(Received {
        header,
        contents,
        fds,
    })
}

impl Received {
    /// Runs the call as a first process cloned for it would, from the same code.
    fn run(mut self) -> ! {
        let failure = AtomicU64::new(0);
        let stdin = self
            .header
            .spec
            .is_stepped()
            .then(|| self.contents.pop().unwrap_or_default());
        let fd = |i: usize| self.fds.get(i).map(AsFd::as_fd);
        let fixed = 4 + usize::from(self.header.join_cgroup);
        let (Some(stdin_fd), Some(stdout), Some(stderr), Some(report)) =
            (fd(0), fd(1), fd(2), fd(3))
        else {
            exit_now(127)
        };
        let steps = match self.header.steps {
            0 => None,
            n => {
                let step = |i: usize| fd(fixed + 2 + i).ok_or(());
                let (Some(reports), Some(devnull)) = (fd(fixed), fd(fixed + 1)) else {
                    exit_now(127)
                };
                let outputs = (0..n)
                    .map(|s| Ok((step(2 * s)?, step(2 * s + 1)?)))
                    .collect::<Result<Vec<_>, ()>>()
                    .unwrap_or_else(|()| exit_now(127));
                Some(StepFds {
                    outputs,
                    reports,
                    devnull,
                })
            }
        };
        let fds = ChildFds {
            stdin: stdin_fd,
            stdout,
            stderr,
            report,
            join_cgroup: self.header.join_cgroup.then(|| fd(4)).flatten(),
            steps,
            controlling_tty: self.header.controlling_tty,
            failure: &failure,
        };
        // init built both from the same spec before it handed the call over: neither fails.
        let spec = &self.header.spec;
        let (Ok(launch), Ok(plan)) = (
            Launch::new(spec, std::mem::take(&mut self.contents), None),
            stdin.map(|stdin| StepPlan::new(spec, stdin)).transpose(),
        ) else {
            exit_now(127)
        };
        launch.run_call(plan.as_ref(), &fds, &CallRoot::Built)
    }
}
