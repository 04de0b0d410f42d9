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
//! Requests travel over a `SOCK_SEQPACKET` socketpair (one JSON [`SandboxSpec`] per
//! message); each reply carries the init's host pid and, as `SCM_RIGHTS`, the edge's end of
//! the new sandbox's control channel and a pidfd of init made by the clone itself
//! (`CLONE_PIDFD`): init may die and its pid be reused before the edge sees the reply, the
//! pidfd still names init. The zygote dies with the server (`PDEATHSIG`), and each init
//! dies with the zygote, so a killed server takes its sandboxes along.
//!
//! The zygote starts with an empty environment: every init is a fork of it, and what init
//! holds a sandbox can try to read (`/proc/1/environ`); none of the server's variables
//! (tokens, credentials of the operator's shell) may be there.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags,
    SockFlag, SockType,
};
use serde::{Deserialize, Serialize};

use crate::launch::{fork_with_pidfd, Forked};
use crate::seccomp::SeccompProfile;
use crate::spec::SandboxSpec;

/// The hidden argument that turns the `dsec` binary into a zygote.
pub const ZYGOTE_ARG: &str = "__zygote";

/// The descriptor number the zygote finds its socket at.
const ZYGOTE_FD: RawFd = 3;

/// Largest request or reply.
const MAX_MESSAGE: usize = 1 << 20;

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
    /// The reply's descriptors did not fit: the kernel truncates `SCM_RIGHTS` when the
    /// receiver is at its limit of open files.
    #[error("the server is out of file descriptors (RLIMIT_NOFILE) and cannot take the sandbox's")]
    Descriptors,
}

/// A sandbox's init, as the zygote cloned it.
#[derive(Debug)]
pub struct Created {
    /// Host pid (for `/proc/<pid>/ns/*`, always checked against the pidfd).
    pub pid: i32,
    /// The edge's end of the control channel.
    pub channel: OwnedFd,
    /// A pidfd of init, made by the clone.
    pub pidfd: OwnedFd,
}

#[derive(Serialize, Deserialize)]
enum Reply {
    Created { pid: i32 },
    Failed { message: String },
}

/// The server's handle on its zygote.
pub struct Zygote {
    socket: Mutex<OwnedFd>,
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
            socket: Mutex::new(ours),
            child: Mutex::new(child),
        })
    }

    /// Clones a sandbox. Blocking; the zygote answers in well under a millisecond.
    pub fn create(&self, spec: &SandboxSpec) -> Result<Created, ZygoteError> {
        let request = serde_json::to_vec(spec).expect("spec serializes");
        let socket = self.socket.lock().expect("zygote lock");
        sendmsg::<()>(
            socket.as_raw_fd(),
            &[IoSlice::new(&request)],
            &[],
            MsgFlags::empty(),
            None,
        )
        .map_err(ZygoteError::Channel)?;
        let mut buf = vec![0u8; 4096];
        let mut cmsg = nix::cmsg_space!([RawFd; 2]);
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
        for c in msg.cmsgs().map_err(|_| ZygoteError::Descriptors)? {
            if let ControlMessageOwned::ScmRights(received) = c {
                // SAFETY: SCM_RIGHTS installed these descriptors in this process for us.
                fds.extend(received.iter().map(|f| unsafe { OwnedFd::from_raw_fd(*f) }));
            }
        }
        let len = msg.bytes;
        if len == 0 {
            return Err(ZygoteError::Channel(nix::Error::EPIPE));
        }
        match serde_json::from_slice(&buf[..len]).map_err(|_| ZygoteError::Malformed)? {
            Reply::Created { pid } => {
                let mut fds = fds.into_iter();
                match (fds.next(), fds.next()) {
                    (Some(channel), Some(pidfd)) => Ok(Created {
                        pid,
                        channel,
                        pidfd,
                    }),
                    _ => Err(ZygoteError::Malformed),
                }
            }
            Reply::Failed { message } => Err(ZygoteError::Clone(message)),
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

/// The namespaces every sandbox gets at clone time; the cgroup namespace follows once
/// init has joined its cgroups.
const CLONE_FLAGS: libc::c_int = libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWNET;

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
    // not once per sandbox. Inits are reaped by the kernel (SIGCHLD ignored): the edge
    // learns of their end from the channel.
    // SAFETY: setting dispositions, no handler code involved. The C library refuses the
    // signals it keeps for itself, harmlessly.
    unsafe {
        for signal in 1..=libc::SIGRTMAX() {
            if signal != libc::SIGKILL && signal != libc::SIGSTOP {
                libc::signal(signal, libc::SIG_DFL);
            }
        }
        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
    }
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let n = match rustix::net::recv(&socket, &mut buf, rustix::net::RecvFlags::empty()) {
            Ok((0, _)) => std::process::exit(0),
            Ok((n, _)) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => std::process::exit(0),
        };
        let (reply, sent) = match serde_json::from_slice::<SandboxSpec>(&buf[..n]) {
            Ok(spec) => match clone_sandbox(&spec, &socket, &seccomp) {
                Ok((pid, channel, pidfd)) => (Reply::Created { pid }, vec![channel, pidfd]),
                Err(e) => (
                    Reply::Failed {
                        message: e.to_string(),
                    },
                    Vec::new(),
                ),
            },
            Err(e) => (
                Reply::Failed {
                    message: format!("bad request: {e}"),
                },
                Vec::new(),
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

fn clone_sandbox(
    spec: &SandboxSpec,
    zygote_socket: &OwnedFd,
    seccomp: &SeccompProfile,
) -> std::io::Result<(i32, OwnedFd, OwnedFd)> {
    let (edge_end, init_end) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?;
    match fork_with_pidfd(CLONE_FLAGS)? {
        Forked::Child => {
            // SAFETY: the child's copy of the zygote's socket, closed here only: its
            // `OwnedFd` is never dropped in this child, which becomes init and never returns.
            unsafe { libc::close(zygote_socket.as_raw_fd()) };
            drop(edge_end);
            crate::init::run(spec, init_end, seccomp)
        }
        Forked::Parent { pid, pidfd } => Ok((pid, edge_end, pidfd)),
    }
}
