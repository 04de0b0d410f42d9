//! The first process of a stepped fncall call: it runs the call's commands one after
//! another in the root it built, then reads files back from that root.
//!
//! A plain call's command is PID 1 of the call's pid namespace, so its root and every
//! process it left behind go away when it exits. A call of several steps — compile, then
//! run the program just built — needs its root to outlive each command, so its PID 1 is
//! this runner instead (init's code, forked, never exec'd): for each step it forks the
//! command with that step's own output pipes, waits for it until the step's deadline, and
//! then kills everything else in the namespace (`kill(-1)` from a namespace's PID 1 reaches
//! every other process in it, double forks and new sessions included), so one step's
//! leftovers never run into the next and its pipes reach end-of-file. Then it reports the
//! step on its report pipe, as protocol frames init relays (see `init`).
//!
//! The runner is confined like any call command (capabilities, no_new_privs, seccomp) and
//! stays non-dumpable like init: a step can neither ptrace it nor open `/proc/1/fd/*`, and
//! the kernel ignores the signals it sends its namespace's PID 1. It closes every
//! descriptor it inherited from init but its pipes before a file is written, and reads
//! the fetched files without following magic links and only from the call's own tmpfs and
//! overlay filesystems, so no path can lead it to one of init's descriptors or to `/proc`.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use rustix::fs::{Mode, OFlags, ResolveFlags, SeekFrom};

use crate::launch::{write_all_blocking, Program, StepFds};
use crate::proto::{self, ExecExit, ExecSpec, FetchedFile, FrameKind};

/// `statfs` magic numbers of the filesystems a call's own files live on.
const TMPFS_MAGIC: i64 = 0x0102_1994;
const OVERLAYFS_MAGIC: i64 = 0x794c_7630;

/// What a stepped call runs, prepared by init before it forks the runner.
pub(crate) struct StepPlan {
    /// Each step and its timeout, first to last.
    steps: Vec<(Program, Option<Duration>)>,
    /// What every step reads on its standard input, from the beginning.
    stdin: Vec<u8>,
    /// Files to read back after the last step.
    fetch: Vec<String>,
    /// Bound on the fetched files together.
    fetch_max_bytes: u64,
}

impl StepPlan {
    /// The plan of a stepped call (see [`ExecSpec::is_stepped`]): `stdin` is the call's
    /// input, which the runner gives every step.
    pub(crate) fn new(spec: &ExecSpec, stdin: Vec<u8>) -> Result<StepPlan, String> {
        let path = crate::launch::search_path(&spec.env);
        Ok(StepPlan {
            steps: std::iter::once((&spec.argv, spec.timeout_ms))
                .chain(spec.then.iter().map(|s| (&s.argv, s.timeout_ms)))
                .map(|(argv, ms)| Ok((Program::new(argv, path)?, ms.map(Duration::from_millis))))
                .collect::<Result<_, String>>()?,
            stdin,
            fetch: spec.fetch.clone(),
            fetch_max_bytes: spec.fetch_max_bytes,
        })
    }

    /// What every step reads on its standard input.
    pub(crate) fn stdin(&self) -> &[u8] {
        &self.stdin
    }

    /// Runs every step, reports, and exits; never returns. Called in the confined runner
    /// with SIGCHLD blocked (inherited from init), in the call's working directory.
    pub(crate) fn run(&self, env: &[CString], fds: &StepFds<'_>) -> ! {
        let mut report = Vec::new();
        let stdin = match self.stdin_fd() {
            Ok(stdin) => stdin,
            Err(e) => {
                let msg = format!("dsec: cannot hold the call's stdin: {e}\n");
                let _ = write_all_blocking(fds.outputs[0].1, msg.as_bytes());
                let exit = ExecExit {
                    exit_code: Some(126),
                    ..ExecExit::default()
                };
                proto::encode_json(&mut report, FrameKind::Exit, 0, &exit);
                let _ = write_all_blocking(fds.reports, &report);
                // Ends the runner (and, as PID 1, its namespace).
                crate::launch::exit_now(0)
            }
        };
        let last = self.steps.len() - 1;
        for (i, (program, timeout)) in self.steps.iter().enumerate() {
            let step_stdin = stdin.as_ref().map_or(fds.devnull, |f| {
                // Back to the start: the previous step's processes are gone.
                let _ = rustix::fs::seek(f, SeekFrom::Start(0));
                f.as_fd()
            });
            let exit = run_step(program, *timeout, env, step_stdin, fds.outputs[i]);
            // Its pipes are closed now: init relays all of its output before the report.
            for fd in [fds.outputs[i].0, fds.outputs[i].1] {
                // SAFETY: closing this process's write ends of the step's pipes, used no
                // more; the `OwnedFd`s they borrow are init's, never dropped in the runner.
                unsafe { libc::close(fd.as_raw_fd()) };
            }
            let succeeded = exit.exit_code == Some(0);
            if i == last || !succeeded {
                self.fetch_files(fds.reports);
                proto::encode_json(&mut report, FrameKind::Exit, 0, &exit);
                let _ = write_all_blocking(fds.reports, &report);
                break;
            }
            proto::encode_json(&mut report, FrameKind::StepExit, 0, &exit);
            let _ = write_all_blocking(fds.reports, &report);
            report.clear();
        }
        // Ends the runner (and, as PID 1, its namespace).
        crate::launch::exit_now(0)
    }

    /// A memfd holding the call's stdin (every step rereads it), or `None` for none.
    fn stdin_fd(&self) -> std::io::Result<Option<OwnedFd>> {
        if self.stdin.is_empty() {
            return Ok(None);
        }
        let fd = rustix::fs::memfd_create("stdin", rustix::fs::MemfdFlags::CLOEXEC)?;
        write_all_blocking(&fd, &self.stdin)?;
        Ok(Some(fd))
    }

    /// Sends each fetched file that is a regular file of the call's own filesystems.
    /// They share one byte budget: the file that exceeds it is sent cut short (marked
    /// truncated) and the rest are not read.
    fn fetch_files(&self, reports: BorrowedFd<'_>) {
        let mut budget = self.fetch_max_bytes;
        for path in &self.fetch {
            let Some((data, truncated)) = read_own_file(path, budget) else {
                continue;
            };
            budget -= data.len() as u64;
            let header = FetchedFile {
                path: path.clone(),
                truncated,
            };
            let mut frame = Vec::new();
            proto::encode(
                &mut frame,
                FrameKind::Fetched,
                0,
                &proto::encode_with_header(&header, &data),
            );
            let _ = write_all_blocking(reports, &frame);
            if truncated {
                break;
            }
        }
    }
}

/// Forks one step, waits for it until its deadline, then kills everything else in the
/// namespace and reaps it all.
fn run_step(
    program: &Program,
    timeout: Option<Duration>,
    env: &[CString],
    stdin: BorrowedFd<'_>,
    (stdout, stderr): (BorrowedFd<'_>, BorrowedFd<'_>),
) -> ExecExit {
    let started = Instant::now();
    let pid = match crate::launch::fork_into(0) {
        Ok(0) => crate::launch::exec_step(program, env, [stdin, stdout, stderr]),
        Ok(pid) => pid,
        Err(e) => {
            let msg = format!("dsec: cannot start {:?}: {e}\n", program.name());
            let _ = write_all_blocking(stderr, msg.as_bytes());
            return ExecExit {
                exit_code: Some(126),
                ..ExecExit::default()
            };
        }
    };
    let deadline = timeout.map(|t| started + t);
    let mut chld = SigSet::empty();
    chld.add(Signal::SIGCHLD);
    let mut status = None;
    let mut timed_out = false;
    while status.is_none() {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(s) if s.pid() == Some(Pid::from_raw(pid)) => {
                status = Some(s);
                continue;
            }
            Ok(_) => continue, // an orphan of the step, reparented to us
            Err(_) => break,
        }
        let remaining = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if remaining == Some(Duration::ZERO) {
            timed_out = true;
            break;
        }
        wait_signal(&chld, remaining);
    }
    let duration_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    // SAFETY: kill(2) with integer arguments: from PID 1 of the call's namespace, -1 is
    // every other process in it.
    unsafe { libc::kill(-1, libc::SIGKILL) };
    while waitpid(Pid::from_raw(-1), None).is_ok() {}
    let (exit_code, signal) = match status {
        Some(WaitStatus::Exited(_, code)) => (Some(code), None),
        Some(WaitStatus::Signaled(_, sig, _)) => (Some(128 + sig as i32), Some(sig as i32)),
        _ => (None, None),
    };
    ExecExit {
        exit_code: if timed_out { None } else { exit_code },
        signal: if timed_out { None } else { signal },
        timed_out,
        truncated: false,
        duration_us,
        oom_killed: false,
    }
}

/// Waits for a signal of `set` (blocked) for at most `timeout` (forever for `None`).
fn wait_signal(set: &SigSet, timeout: Option<Duration>) {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(t.subsec_nanos()),
    });
    // SAFETY: the set and the optional timespec are valid for the call; the siginfo
    // pointer may be null.
    unsafe {
        libc::sigtimedwait(
            set.as_ref(),
            std::ptr::null_mut(),
            ts.as_ref().map_or(std::ptr::null(), |t| t as *const _),
        )
    };
}

/// Opens `path` for reading without following magic links, if it is a regular file on a
/// tmpfs or overlay filesystem (the call's root, its /tmp, /dev/shm), and reads at most
/// `max` bytes of it; `None` otherwise.
fn read_own_file(path: &str, max: u64) -> Option<(Vec<u8>, bool)> {
    let fd = rustix::fs::openat2(
        rustix::fs::CWD,
        path,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::NO_MAGICLINKS,
    )
    .ok()?;
    let stat = rustix::fs::fstat(&fd).ok()?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
        return None;
    }
    let fs_type = rustix::fs::fstatfs(&fd).ok()?.f_type as i64;
    if fs_type != TMPFS_MAGIC && fs_type != OVERLAYFS_MAGIC {
        return None;
    }
    let mut data = Vec::new();
    let file = std::fs::File::from(fd);
    std::io::Read::read_to_end(
        &mut std::io::Read::take(&file, max.saturating_add(1)),
        &mut data,
    )
    .ok()?;
    let truncated = data.len() as u64 > max;
    data.truncate(usize::try_from(max).unwrap_or(usize::MAX));
    Some((data, truncated))
}
