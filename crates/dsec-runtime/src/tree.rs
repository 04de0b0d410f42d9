//! Killing a command's whole process tree: the one way every backend does it.
//!
//! A command's tree is its main process, every descendant, and — when the main process
//! leads its own session, as init's commands and Docker's execs do — every process still in
//! that session (a double fork leaves the tree but keeps the session). SIGTERM is not
//! enough (it can be ignored) and a single SIGKILL pass races with forks, so the tree is
//! stopped in rounds: each round SIGSTOPs the members found so far (a stopped process
//! cannot fork), waits until they have stopped, and rescans `/proc`, until a round finds no
//! new member; then all are SIGKILLed. The wait matters: a process the SIGSTOP finds inside
//! `fork` finishes it before it stops, and its child shows in `/proc` only then.
//!
//! Every member is signalled through a pidfd taken when it was found to belong, never by
//! pid: a process that exited and whose pid was reused is not hit.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use rustix::process::Signal;

use crate::pidfd::open_if;
use crate::procfs::{self, pid_namespace};

/// Rounds after which the tree is killed even if it is still growing (a fork bomb outruns
/// any scan; the members stopped so far no longer fork, so this only bounds the time).
const MAX_ROUNDS: usize = 64;
/// How long one kill waits, over all its rounds, for members to stop before it scans
/// anyway: a process in an uninterruptible sleep (or a `vfork` parent, until its child
/// execs) stops only when it wakes, and a tree of such must not hold the killer for long.
const STOP_WAIT: Duration = Duration::from_millis(100);

/// Kills the tree of `main` (see the module documentation).
///
/// `namespace` is the inode of the pid namespace every member must be in, for a caller that
/// sees more than the sandbox's processes (the host, killing a Docker exec); `None` for a
/// caller whose `/proc` lists only the sandbox's own (init), where that check would only
/// fail for commands running as another user.
pub fn kill_tree(main: i32, namespace: Option<u64>) {
    let belongs = |pid: i32| namespace.is_none_or(|ns| pid_namespace(pid) == Some(ns));
    let Some(main_fd) = (main > 0).then(|| open_if(main, belongs)).flatten() else {
        return;
    };
    let own_session = procfs::Stat::read(main).is_some_and(|s| s.session == main);
    let mut members: Vec<(i32, OwnedFd)> = vec![(main, main_fd)];
    let stop_deadline = Instant::now() + STOP_WAIT;
    for _ in 0..MAX_ROUNDS {
        signal(&members, Signal::STOP);
        wait_stopped(&members, stop_deadline);
        let before = members.len();
        let procs: Vec<(i32, procfs::Stat)> = procfs::pids()
            .into_iter()
            .filter_map(|pid| Some((pid, procfs::Stat::read(pid)?)))
            .collect();
        // Repeated until nothing joins, so a whole subtree of this snapshot joins at once.
        loop {
            let found = members.len();
            for (pid, stat) in &procs {
                if members.iter().any(|(p, _)| p == pid) {
                    continue;
                }
                let related = members.iter().any(|(p, _)| *p == stat.ppid)
                    || (own_session && stat.session == main);
                if let Some(fd) = related.then(|| open_if(*pid, belongs)).flatten() {
                    members.push((*pid, fd));
                }
            }
            if members.len() == found {
                break;
            }
        }
        if members.len() == before {
            break;
        }
    }
    signal(&members, Signal::KILL);
}

/// Kills one process by pid: the main process of a command that is PID 1 of its own pid
/// namespace, whose death makes the kernel kill the rest.
pub fn kill_namespace_init(pid: i32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(pid, Signal::KILL);
    }
}

/// Waits until every member is stopped or dead, or `deadline` passes.
fn wait_stopped(members: &[(i32, OwnedFd)], deadline: Instant) {
    for (pid, _) in members {
        while procfs::Stat::read(*pid).is_some_and(|s| !matches!(s.state, 'T' | 't' | 'Z' | 'X')) {
            if Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

fn signal(members: &[(i32, OwnedFd)], signal: Signal) {
    for (_, fd) in members {
        let _ = rustix::process::pidfd_send_signal(fd, signal);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;

    use super::*;

    /// Whether `pid` is gone or a zombie (killed, not yet reaped by its parent).
    fn dead(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
    }

    #[test]
    fn a_double_forked_grandchild_in_the_session_dies_with_the_tree() {
        // A session leader whose grandchild leaves the tree (its parent exits at once, so
        // it is reparented away) but keeps the session, and writes its pid for the test.
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("grandchild");
        let script = format!("(sleep 60 & echo $! > {}) & sleep 60", pidfile.display());
        let mut child = std::process::Command::new("setsid")
            .args(["sh", "-c", &script])
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let grandchild: i32 = loop {
            if let Some(pid) = std::fs::read_to_string(&pidfile)
                .ok()
                .and_then(|s| s.trim().parse().ok())
            {
                break pid;
            }
            assert!(Instant::now() < deadline, "the test's tree did not start");
            std::thread::sleep(Duration::from_millis(10));
        };
        let main = i32::try_from(child.id()).unwrap();
        kill_tree(main, pid_namespace(main));
        child.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !dead(grandchild) {
            assert!(
                Instant::now() < deadline,
                "the grandchild outlived the kill"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The live (not zombie) processes of process group `pgrp`.
    fn live_in_group(pgrp: i32) -> Vec<i32> {
        procfs::pids()
            .into_iter()
            .filter(|&pid| {
                procfs::Stat::read(pid).is_some_and(|s| s.pgrp == pgrp && !s.is_zombie())
            })
            .collect()
    }

    #[test]
    fn a_child_forked_while_the_tree_is_stopped_dies_with_it() {
        // A shell killed about when it forks its one child, not a session leader (so only
        // the parent link counts): a kill that finds it inside fork must still find the
        // child. Its own process group names every process it made, orphans included.
        for attempt in 0..400u64 {
            let mut child = std::process::Command::new("sh")
                .args(["-c", "sleep 60 & wait"])
                .process_group(0)
                .spawn()
                .unwrap();
            let main = i32::try_from(child.id()).unwrap();
            std::thread::sleep(Duration::from_micros(attempt * 5));
            kill_tree(main, None);
            child.wait().unwrap();
            // The killed die on their own time: give them a moment before counting.
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut left = live_in_group(main);
            while !left.is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
                left = live_in_group(main);
            }
            if !left.is_empty() {
                let _ = rustix::process::kill_process_group(
                    rustix::process::Pid::from_raw(main).unwrap(),
                    Signal::KILL,
                );
                panic!(
                    "a kill {} µs after the start left the tree's child alive",
                    attempt * 5
                );
            }
        }
    }

    #[test]
    fn a_process_of_another_namespace_is_left_alone() {
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        kill_tree(pid, Some(0));
        assert!(!dead(pid));
        kill_tree(pid, None);
        child.wait().unwrap();
    }
}
