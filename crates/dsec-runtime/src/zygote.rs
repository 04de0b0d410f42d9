//! The zygote: a small single-threaded process that clones sandboxes.
//!
//! The server is multi-threaded (tokio), and a fork of a multi-threaded process may only
//! call async-signal-safe functions until it execs — far too little to build a sandbox.
//! runc pays for that with a fresh `execve` of itself per container. dsec instead starts
//! one zygote at server start (`dsec __zygote`, a re-exec of the server binary) whose only
//! job is to `clone(2)` a child into new namespaces on request: the child is a copy of a
//! single-threaded process, so it can run ordinary Rust code as the sandbox's init, with
//! the seccomp program already compiled, and no `execve` on the create path at all.
//!
//! Requests travel over a `SOCK_SEQPACKET` socketpair (one JSON [`Request`] per message,
//! one reply each). A create's reply carries init's host pid and, as `SCM_RIGHTS`, the
//! edge's end of the new sandbox's control channel: the one descriptor the server holds per
//! sandbox.
//!
//! The zygote is every init's parent, and it reaps an init only once the server has
//! *released* it ([`Init`]): until then an init that exits stays a zombie, and a zombie's
//! pid is never reused. So for as long as the server holds an [`Init`] and the zygote
//! lives, the pid names that init and no other process, and the server takes hold of init
//! by pid (a pidfd, `/proc/<pid>`) as safely as through a pidfd made at the clone —
//! without keeping one open per sandbox (with a host's hard `RLIMIT_NOFILE` of 20,000,
//! that halved the sandboxes an edge held). Neither does the zygote hold a descriptor per
//! sandbox: the parent's claim on a zombie is all it needs. Should the zygote die, its
//! children go to another reaper and their pids may be reused: what the server took by
//! pid counts only if the zygote was still there after it took it ([`Init::with_pid`]).
//!
//! A new network namespace is the dearest part of the clone (~0.8 ms of kernel work: every
//! per-namespace subsystem initialises its state, against ~0.2 ms for the other four
//! namespaces together), so the zygote makes a few ahead while it waits for requests
//! ([`SpareNetworks`]): a create takes one and init enters it (`setns`) before anything
//! else, and the clone makes a namespace only when none is left. Each spare is fresh (the
//! zygote enters it only to bring its loopback up and open it); none is reused from a
//! stopped sandbox.
//!
//! The zygote dies with the server (`PDEATHSIG`), and each init dies with the zygote, so a
//! killed server takes its sandboxes along.
//!
//! The zygote starts with an empty environment: every init is a fork of it, and what init
//! holds a sandbox can try to read (`/proc/1/environ`); none of the server's variables
//! (tokens, credentials of the operator's shell) may be there.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
    SockFlag, SockType,
};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::process::Pid;
use serde::{Deserialize, Serialize};

use crate::launch::fork_into;
use crate::seccomp::SeccompProfile;
use crate::spec::SandboxSpec;

/// The hidden argument that turns the `dsec` binary into a zygote.
pub const ZYGOTE_ARG: &str = "__zygote";

/// The descriptor number the zygote finds its socket at.
const ZYGOTE_FD: RawFd = 3;

/// Largest request or reply.
const MAX_MESSAGE: usize = 1 << 20;

/// How often the zygote looks again for released inits that have not exited yet (an init
/// killed while its sandbox's processes take a while to die).
const REAP_INTERVAL: Timespec = Timespec {
    tv_sec: 0,
    tv_nsec: 100_000_000,
};

/// A poll that only looks.
const NO_WAIT: Timespec = Timespec {
    tv_sec: 0,
    tv_nsec: 0,
};

/// Talking to the zygote failed.
#[derive(Debug, thiserror::Error)]
pub enum ZygoteError {
    /// Starting the zygote process failed.
    #[error("starting the zygote: {0}")]
    Spawn(#[source] std::io::Error),
    /// The socket to the zygote failed: the zygote died.
    #[error("zygote channel: {0}")]
    Channel(#[source] nix::Error),
    /// The zygote could not clone the sandbox.
    #[error("cloning the sandbox: {0}")]
    Clone(String),
    /// A reply did not parse.
    #[error("malformed reply from the zygote")]
    Malformed,
    /// The reply's descriptor did not fit: the kernel truncates `SCM_RIGHTS` when the
    /// receiver is at its limit of open files.
    #[error("the server is out of file descriptors (RLIMIT_NOFILE) and cannot take the sandbox's")]
    Descriptors,
}

/// A sandbox's init, as the zygote cloned it.
#[derive(Debug)]
pub struct Created {
    /// init, by its pid.
    pub init: Init,
    /// The edge's end of the control channel.
    pub channel: OwnedFd,
}

/// What the server asks of the zygote.
#[derive(Serialize, Deserialize)]
enum Request {
    /// Clone a sandbox's init.
    Create(SandboxSpec),
    /// The server no longer names this init by its pid: reap it once it has exited.
    Release { pid: i32 },
}

#[derive(Serialize, Deserialize)]
enum Reply {
    Created { pid: i32 },
    Released,
    Failed { message: String },
}

/// The server's end of the zygote's socket, shared with every [`Init`] (which releases
/// through it).
#[derive(Debug)]
struct Link {
    socket: OwnedFd,
    /// Held for a request and its reply: one at a time.
    turn: Mutex<()>,
}

/// A reply and the descriptors that came with it.
struct Received {
    reply: Reply,
    fds: Vec<OwnedFd>,
    /// The kernel dropped descriptors that did not fit (`MSG_CTRUNC`).
    truncated: bool,
}

impl Link {
    /// Sends `request` and waits for its reply.
    fn call(&self, request: &Request) -> Result<Received, ZygoteError> {
        let request = serde_json::to_vec(request).expect("request serializes");
        let _turn = self.turn.lock().expect("zygote lock");
        let socket = &self.socket;
        sendmsg::<()>(
            socket.as_raw_fd(),
            &[IoSlice::new(&request)],
            &[],
            MsgFlags::empty(),
            None,
        )
        .map_err(ZygoteError::Channel)?;
        let mut buf = vec![0u8; 4096];
        let mut cmsg = nix::cmsg_space!([RawFd; 1]);
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(ZygoteError::Channel)?;
        let mut fds = Vec::new();
        // nix reports a truncated control message (MSG_CTRUNC) as ENOBUFS.
        let truncated = match msg.cmsgs() {
            Ok(cmsgs) => {
                for c in cmsgs {
                    if let ControlMessageOwned::ScmRights(received) = c {
                        // SAFETY: SCM_RIGHTS installed these descriptors in this process
                        // for us.
                        fds.extend(received.iter().map(|f| unsafe { OwnedFd::from_raw_fd(*f) }));
                    }
                }
                false
            }
            Err(_) => true,
        };
        let len = msg.bytes;
        if len == 0 {
            return Err(ZygoteError::Channel(nix::Error::EPIPE));
        }
        let reply = serde_json::from_slice(&buf[..len]).map_err(|_| ZygoteError::Malformed)?;
        Ok(Received {
            reply,
            fds,
            truncated,
        })
    }

    /// Asks the zygote to reap `pid` once it has exited.
    fn release(&self, pid: Pid) -> Result<(), ZygoteError> {
        let pid = pid.as_raw_nonzero().get();
        match self.call(&Request::Release { pid })?.reply {
            Reply::Released => Ok(()),
            _ => Err(ZygoteError::Malformed),
        }
    }

    /// Whether the zygote has not started exiting. An exiting process's descriptors are
    /// closed (so its end of the socket, which only it holds — a just-cloned init closes
    /// its copy first thing — and ours hangs up) before its children are handed to another
    /// reaper: while this holds, no unreleased init has been reaped.
    fn zygote_lives(&self) -> bool {
        let mut hangup = [PollFd::new(&self.socket, PollFlags::empty())];
        match rustix::event::poll(&mut hangup, Some(&Timespec::default())) {
            Ok(0) => true,
            Ok(_) => hangup[0]
                .revents()
                .intersection(PollFlags::HUP | PollFlags::ERR)
                .is_empty(),
            Err(_) => false,
        }
    }
}

/// A sandbox's init, named by its host pid for as long as this is not released.
///
/// The zygote leaves init unreaped until then (see the module documentation), so the pid
/// names init, alive or a zombie, and no other process: [`with_pid`](Self::with_pid) takes
/// hold of it by pid. Released by [`release`](Self::release) or on drop.
#[derive(Debug)]
pub struct Init {
    /// `None` once released. Locked while a caller uses the pid, so a release waits.
    pid: Mutex<Option<Pid>>,
    link: Arc<Link>,
}

impl Init {
    /// Runs `f` with init's pid and returns what it took hold of by that pid (a pidfd, a
    /// descriptor of `/proc/<pid>/…`, what it read there), which is init's: `None` once
    /// released (init is gone, or about to be), or if the zygote died, since then the pid
    /// may have been reaped and reused while `f` ran. So `f` only takes hold, never acts
    /// by pid: to signal init, open a pidfd in `f` and signal through it after.
    pub fn with_pid<T>(&self, f: impl FnOnce(Pid) -> T) -> Option<T> {
        let pid = self.pid.lock().expect("init pid lock");
        let taken = f((*pid)?);
        self.link.zygote_lives().then_some(taken)
    }

    /// A pidfd of init, opened for the moment; `None` as [`with_pid`](Self::with_pid).
    pub fn pidfd(&self) -> Option<rustix::io::Result<OwnedFd>> {
        self.with_pid(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()))
    }

    /// SIGKILLs init, if it is still held: a signal from outside its pid namespace reaches
    /// it, and its death takes every process of the namespace along.
    pub fn kill(&self) {
        if let Some(Ok(pidfd)) = self.pidfd() {
            let _ = rustix::process::pidfd_send_signal(&pidfd, rustix::process::Signal::KILL);
        }
    }

    /// Gives init's pid up: the zygote reaps init once it has exited, after which the pid
    /// may name another process. Idempotent; blocks for a round trip to the zygote.
    pub fn release(&self) {
        let Some(pid) = self.pid.lock().expect("init pid lock").take() else {
            return;
        };
        if let Err(e) = self.link.release(pid) {
            // The zygote is gone, and its children went to another reaper with it.
            tracing::warn!(error = %e, pid = pid.as_raw_nonzero().get(), "releasing an init");
        }
    }
}

impl Drop for Init {
    fn drop(&mut self) {
        self.release();
    }
}

/// The server's handle on its zygote.
pub struct Zygote {
    link: Arc<Link>,
    child: Mutex<Child>,
}

impl Zygote {
    /// Starts `exe __zygote`. Call it from the thread that lives as long as the server
    /// (the main thread): `PDEATHSIG` fires when the *thread* that forked exits.
    pub fn spawn(exe: &Path) -> Result<Zygote, ZygoteError> {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| ZygoteError::Spawn(e.into()))?;
        let theirs_raw = theirs.as_raw_fd();
        let mut cmd = Command::new(exe);
        // Every init is a fork of the zygote and shows its command line as PID 1 inside
        // the sandbox: name it for what it is there, without the host path of the binary.
        cmd.arg0("dsec-init")
            .arg(ZYGOTE_ARG)
            .env_clear()
            .stdin(Stdio::null());
        // SAFETY: the closure runs between fork and exec, and `zygote_child` makes raw
        // system calls only.
        unsafe {
            cmd.pre_exec(move || crate::launch::zygote_child(theirs_raw, ZYGOTE_FD));
        }
        let child = cmd.spawn().map_err(ZygoteError::Spawn)?;
        drop(theirs);
        Ok(Zygote {
            link: Arc::new(Link {
                socket: ours,
                turn: Mutex::new(()),
            }),
            child: Mutex::new(child),
        })
    }

    /// Clones a sandbox. Blocking; the zygote answers in well under a millisecond.
    pub fn create(&self, spec: SandboxSpec) -> Result<Created, ZygoteError> {
        let Received {
            reply,
            fds,
            truncated,
        } = self.link.call(&Request::Create(spec))?;
        let pid = match reply {
            Reply::Created { pid } => Pid::from_raw(pid).ok_or(ZygoteError::Malformed)?,
            Reply::Failed { message } => return Err(ZygoteError::Clone(message)),
            Reply::Released => return Err(ZygoteError::Malformed),
        };
        let init = Init {
            pid: Mutex::new(Some(pid)),
            link: Arc::clone(&self.link),
        };
        match fds.into_iter().next() {
            Some(channel) if !truncated => Ok(Created { init, channel }),
            // init runs, but without a channel to it: killed, and released on drop.
            _ => {
                init.kill();
                Err(match truncated {
                    true => ZygoteError::Descriptors,
                    false => ZygoteError::Malformed,
                })
            }
        }
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        if let Ok(mut child) = self.child.lock() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The namespaces every sandbox gets at clone time: these, and a network namespace (a
/// spare, or made by the clone); the cgroup namespace follows once init has joined its
/// cgroups.
const CLONE_FLAGS: libc::c_int =
    libc::CLONE_NEWNS | libc::CLONE_NEWPID | libc::CLONE_NEWUTS | libc::CLONE_NEWIPC;

/// Spare network namespaces the zygote keeps: enough for a burst of creates one after
/// another; under a steady stream of creates each is made between two of them.
const SPARE_NETWORKS: usize = 4;

/// Network namespaces made ahead of the creates that take them (see the module
/// documentation). The zygote makes one by entering a new namespace (`unshare`), keeping a
/// descriptor of it, and going back to its own.
struct SpareNetworks {
    spares: Vec<OwnedFd>,
    /// The zygote's own network namespace, to go back to; `None` once making spares
    /// failed (every clone then makes its own).
    home: Option<OwnedFd>,
}

impl SpareNetworks {
    fn new() -> SpareNetworks {
        let home = std::fs::File::open("/proc/self/ns/net")
            .map_err(|e| eprintln!("dsec zygote: no spare network namespaces: {e}"))
            .ok();
        SpareNetworks {
            spares: Vec::new(),
            home: home.map(OwnedFd::from),
        }
    }

    /// Whether another spare is wanted.
    fn short(&self) -> bool {
        self.home.is_some() && self.spares.len() < SPARE_NETWORKS
    }

    /// Makes one spare, its loopback up; on failure stops making them.
    fn make_one(&mut self) {
        let Some(home) = &self.home else { return };
        let made = nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(std::io::Error::from)
            .and_then(|()| crate::rootfs::loopback_up())
            .and_then(|()| std::fs::File::open("/proc/self/ns/net"));
        // Back home whatever happened: an init cloned without a spare must not inherit a
        // namespace the zygote made.
        let back = nix::sched::setns(home, nix::sched::CloneFlags::CLONE_NEWNET);
        match (made, back) {
            (Ok(ns), Ok(())) => self.spares.push(ns.into()),
            // Should the way back have failed, the zygote stays in a namespace of its own
            // making; no init sees it: without spares each clone makes its own.
            (made, back) => {
                eprintln!(
                    "dsec zygote: no more spare network namespaces (making one: {:?}; going \
                     back: {back:?}); each clone makes its own",
                    made.err()
                );
                self.spares.clear();
                self.home = None;
            }
        }
    }

    fn take(&mut self) -> Option<OwnedFd> {
        self.spares.pop()
    }

    /// In a child of the zygote: closes its copies of every spare and of the zygote's own
    /// namespace, which are not its to hold (they would keep other sandboxes' namespaces
    /// alive, and hand them over to whoever could `setns`).
    fn close_in_child(&self) {
        for fd in self.spares.iter().chain(&self.home) {
            // SAFETY: the child's copies, closed here only: the child becomes init and
            // never returns, so their `OwnedFd`s are never dropped in it.
            unsafe { libc::close(fd.as_raw_fd()) };
        }
    }
}

/// The zygote's main loop, entered by `dsec __zygote`. Never returns: exits when the
/// server closes its end.
pub fn serve() -> ! {
    // SAFETY: fd 3 was placed there by `Zygote::spawn` for this process alone.
    let socket = unsafe { OwnedFd::from_raw_fd(ZYGOTE_FD) };
    let _ = rustix::io::fcntl_setfd(&socket, rustix::io::FdFlags::CLOEXEC);
    let seccomp = match SeccompProfile::docker_default() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("dsec zygote: {e}");
            std::process::exit(1)
        }
    };
    // Every sandbox descends from here, and commands keep what their parents ignore across
    // execve: every signal starts at its default, whatever the server was started with (a
    // shell's background job ignores SIGINT and SIGQUIT, nohup SIGHUP). Once per server,
    // not once per sandbox. SIGCHLD at its default also keeps an init that exits a zombie
    // until it is released and reaped here.
    // SAFETY: setting dispositions, no handler code involved. The C library refuses the
    // signals it keeps for itself, harmlessly.
    unsafe {
        for signal in 1..=libc::SIGRTMAX() {
            if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                libc::signal(signal, libc::SIG_DFL);
            }
        }
    }
    let mut buf = vec![0u8; MAX_MESSAGE];
    // Inits the server released that had not exited yet when last looked at.
    let mut released: Vec<i32> = Vec::new();
    let mut networks = SpareNetworks::new();
    loop {
        released.retain(|&pid| !reap(pid));
        // A spare is made only while no request waits.
        let timeout = if networks.short() {
            Some(&NO_WAIT)
        } else {
            (!released.is_empty()).then_some(&REAP_INTERVAL)
        };
        let mut ready = [PollFd::new(&socket, PollFlags::IN)];
        match rustix::event::poll(&mut ready, timeout) {
            Ok(0) => {
                if networks.short() {
                    networks.make_one();
                }
                continue;
            }
            Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(_) => std::process::exit(0),
        }
        let n = match rustix::net::recv(&socket, &mut buf, rustix::net::RecvFlags::empty()) {
            Ok((0, _)) => std::process::exit(0),
            Ok((n, _)) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => std::process::exit(0),
        };
        let (reply, sent) = match serde_json::from_slice::<Request>(&buf[..n]) {
            Ok(Request::Create(spec)) => {
                match clone_sandbox(&spec, &socket, &seccomp, &mut networks) {
                    Ok((pid, channel)) => (Reply::Created { pid }, Some(channel)),
                    Err(e) => (
                        Reply::Failed {
                            message: e.to_string(),
                        },
                        None,
                    ),
                }
            }
            Ok(Request::Release { pid }) => {
                released.push(pid);
                (Reply::Released, None)
            }
            Err(e) => (
                Reply::Failed {
                    message: format!("bad request: {e}"),
                },
                None,
            ),
        };
        let json = serde_json::to_vec(&reply).expect("reply serializes");
        let fds: Vec<RawFd> = sent.iter().map(AsRawFd::as_raw_fd).collect();
        let cmsgs = if fds.is_empty() {
            vec![]
        } else {
            vec![ControlMessage::ScmRights(&fds)]
        };
        if sendmsg::<()>(
            socket.as_raw_fd(),
            &[IoSlice::new(&json)],
            &cmsgs,
            MsgFlags::empty(),
            None,
        )
        .is_err()
        {
            std::process::exit(0);
        }
    }
}

/// Reaps the released init `pid` if it has exited; whether it is gone (reaped now, or no
/// child of ours).
fn reap(pid: i32) -> bool {
    !matches!(
        waitpid(nix::unistd::Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)),
        Ok(WaitStatus::StillAlive) | Err(nix::Error::EINTR)
    )
}

fn clone_sandbox(
    spec: &SandboxSpec,
    zygote_socket: &OwnedFd,
    seccomp: &SeccompProfile,
    networks: &mut SpareNetworks,
) -> std::io::Result<(i32, OwnedFd)> {
    let (edge_end, init_end) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?;
    let network = networks.take();
    let flags = match network {
        Some(_) => CLONE_FLAGS,
        None => CLONE_FLAGS | libc::CLONE_NEWNET,
    };
    match fork_into(flags)? {
        0 => {
            // SAFETY: the child's copy of the zygote's socket, closed here only: its
            // `OwnedFd` is never dropped in this child, which becomes init and never returns.
            unsafe { libc::close(zygote_socket.as_raw_fd()) };
            networks.close_in_child();
            drop(edge_end);
            crate::init::run(spec, init_end, network, seccomp)
        }
        pid => Ok((pid, edge_end)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_zygote_is_seen_gone_once_its_end_closes() {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        let link = Link {
            socket: ours,
            turn: Mutex::new(()),
        };
        assert!(link.zygote_lives());
        // A request in flight (data waiting on our end) is no hang-up.
        rustix::net::send(&theirs, b"{}", rustix::net::SendFlags::empty()).unwrap();
        assert!(link.zygote_lives());
        drop(theirs);
        assert!(!link.zygote_lives());
    }
}
