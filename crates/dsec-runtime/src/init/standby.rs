//! A fncall worker's next call root, built before the call comes.
//!
//! A call's root costs its first process about 3 ms, most of it waiting: the detach of
//! the old root after the pivot waits for an RCU grace period, and so does the teardown
//! of the call's mounts when it exits, before its parent learns of the exit. A worker
//! serves one call at a time, so between calls init forks a standby process into mount and
//! IPC namespaces of its own (an IPC namespace, too, costs a filesystem of its own to make
//! and to tear down), which builds the next call's root
//! ([`crate::rootfs::prepare_call_root`]) and waits. The next call's first process enters
//! those namespaces through the standby's pidfd and only mounts its own `/proc`
//! ([`crate::rootfs::enter_call_root`]); once the call has ended, init releases the
//! standby, whose exit tears the namespaces down, off the call's path. A call that finds
//! no standby ready builds its root itself, as before.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use rustix::io::Errno;
use rustix::pipe::{pipe_with, PipeFlags};

use crate::launch::{self, exit_now, CallSetup};

/// The standby's nice value: it builds what only a later call needs.
const STANDBY_NICE: i32 = 10;

/// A standby process and the root it builds or holds.
pub(super) struct Standby {
    pidfd: OwnedFd,
    /// One byte once the root is built; end-of-file if building it failed. Non-blocking.
    ready: OwnedFd,
    built: bool,
    /// The standby exits when this closes (dropped with the `Standby`); init reaps it with
    /// its other children.
    _release: OwnedFd,
}

/// Where a standby's root is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum State {
    Building,
    Ready,
    Failed,
}

impl Standby {
    /// Forks a standby process that builds a root for `call`.
    pub(super) fn start(call: &CallSetup) -> std::io::Result<Standby> {
        let (ready_r, ready_w) = pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK)?;
        let (release_r, release_w) = pipe_with(PipeFlags::CLOEXEC)?;
        let pid = launch::fork_into(libc::CLONE_NEWNS | libc::CLONE_NEWIPC)?;
        if pid == 0 {
            hold(call, ready_w.as_fd(), release_r.as_fd());
        }
        drop((ready_w, release_r));
        // Dropping `release_w` on an error here lets the standby go.
        let pid = rustix::process::Pid::from_raw(pid).ok_or(Errno::SRCH)?;
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?;
        Ok(Standby {
            pidfd,
            ready: ready_r,
            built: false,
            _release: release_w,
        })
    }

    /// Whether the root is built, without waiting.
    pub(super) fn state(&mut self) -> State {
        if self.built {
            return State::Ready;
        }
        let mut byte = [0u8];
        match rustix::io::read(&self.ready, &mut byte) {
            Ok(1) => {
                self.built = true;
                State::Ready
            }
            Err(Errno::AGAIN | Errno::INTR) => State::Building,
            Ok(_) | Err(_) => State::Failed,
        }
    }

    /// The standby's pidfd, for the call's first process to enter its mount namespace.
    pub(super) fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }
}

/// The standby process: builds the root in the mount namespace it was cloned into, says
/// so on `ready`, and holds the namespace until `release` closes.
fn hold(call: &CallSetup, ready: BorrowedFd<'_>, release: BorrowedFd<'_>) -> ! {
    // SAFETY: this process only builds the root, waits and exits; it never touches what
    // owned init's other descriptors.
    if unsafe { crate::fds::close_all_but(&[ready.as_raw_fd(), release.as_raw_fd()]) }.is_err() {
        exit_now(1)
    }
    // The root is built while the last call's result travels to its caller: the edge,
    // and the caller on the same host, go first.
    let _ = rustix::process::setpriority_process(None, STANDBY_NICE);
    if crate::rootfs::prepare_call_root(call.layer_count, call.disk_bytes).is_err()
        || rustix::io::write(ready, &[1]) != Ok(1)
    {
        exit_now(1)
    }
    let mut byte = [0u8];
    while rustix::io::read(release, &mut byte) == Err(Errno::INTR) {}
    exit_now(0)
}
