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
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use rustix::fs::{Mode, OFlags, ResolveFlags};

use crate::init::write_all_blocking;
use crate::proto::{self, ExecExit, FetchedFile, FrameKind};

/// `statfs` magic numbers of the filesystems a call's own files live on.
const TMPFS_MAGIC: i64 = 0x0102_1994;
const OVERLAYFS_MAGIC: i64 = 0x794c_7630;

/// A program to exec: its argv and the paths `argv[0]` may be at.
pub(crate) struct Program {
    pub(crate) argv: Vec<CString>,
    pub(crate) candidates: Vec<CString>,
}

impl Program {
    /// `argv[0]` is looked up in `path` (a `PATH` value) when it has no `/`.
    pub(crate) fn new(argv: &[String], path: &str) -> Result<Program, String> {
        let cstring = |s: &str, what: &str| {
            CString::new(s).map_err(|_| format!("{what} contains a NUL byte"))
        };
        let program = argv.first().ok_or("empty command")?;
        let candidates = if program.contains('/') {
            vec![cstring(program, "program")?]
        } else {
            path.split(':')
                .filter(|d| !d.is_empty())
                .map(|d| cstring(&format!("{d}/{program}"), "program"))
                .collect::<Result<Vec<_>, _>>()?
        };
        Ok(Program {
            argv: argv
                .iter()
                .map(|a| cstring(a, "argument"))
                .collect::<Result<_, _>>()?,
            candidates,
        })
    }

    /// Tries every candidate; returns only when none could be executed, with the errno a
    /// shell would report (the last error that was not "no such file").
    pub(crate) fn exec(&self, env: &[CString]) -> i32 {
        let mut argv: Vec<*const libc::c_char> = self.argv.iter().map(|a| a.as_ptr()).collect();
        argv.push(std::ptr::null());
        let mut envp: Vec<*const libc::c_char> = env.iter().map(|e| e.as_ptr()).collect();
        envp.push(std::ptr::null());
        let mut errno = libc::ENOENT;
        for path in &self.candidates {
            // SAFETY: path, argv and envp are NUL-terminated and outlive the call.
            unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::ENOENT);
            if e != libc::ENOENT && e != libc::ENOTDIR {
                errno = e;
            }
        }
        errno
    }

    fn name(&self) -> String {
        self.argv
            .first()
            .map(|a| a.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// What a stepped call runs, prepared by init before it forks the runner.
pub(crate) struct StepPlan {
    /// Each step and its timeout, first to last.
    pub(crate) steps: Vec<(Program, Option<Duration>)>,
    /// What every step reads on its standard input, from the beginning.
    pub(crate) stdin: Vec<u8>,
    /// Files to read back after the last step.
    pub(crate) fetch: Vec<String>,
    /// Bound on the fetched files together.
    pub(crate) fetch_max_bytes: u64,
}

/// The runner's descriptors, inherited from init.
pub(crate) struct StepFds {
    /// Write ends of each step's (stdout, stderr) pipes.
    pub(crate) outputs: Vec<(RawFd, RawFd)>,
    /// Where the runner reports each step's end and the fetched files.
    pub(crate) reports: RawFd,
    /// `/dev/null`: the standard input of steps when the call has none.
    pub(crate) devnull: RawFd,
}

impl StepFds {
    /// Every descriptor the runner needs.
    pub(crate) fn all(&self) -> Vec<RawFd> {
        let mut fds = vec![self.reports, self.devnull];
        for (out, err) in &self.outputs {
            fds.extend([*out, *err]);
        }
        fds
    }
}

/// Closes every descriptor but the standard ones and `keep`. Runs in the call's root,
/// whose `/proc` is the call's own.
pub(crate) fn close_other_fds(keep: &[RawFd]) -> std::io::Result<()> {
    let open: Vec<RawFd> = std::fs::read_dir("/proc/self/fd")?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    for fd in open {
        if fd > 2 && !keep.contains(&fd) {
            // SAFETY: closing a descriptor of this process that nothing here uses; the
            // directory stream that listed it is already closed (its fd fails harmlessly).
            unsafe { libc::close(fd) };
        }
    }
    Ok(())
}

impl StepPlan {
    /// Runs every step, reports, and exits; never returns. Called in the confined runner
    /// with SIGCHLD blocked (inherited from init), in the call's working directory.
    pub(crate) fn run(&self, env: &[CString], fds: &StepFds) -> ! {
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
                // SAFETY: _exit(2) ends the runner (and, as PID 1, its namespace).
                unsafe { libc::_exit(0) }
            }
        };
        let last = self.steps.len() - 1;
        for (i, (program, timeout)) in self.steps.iter().enumerate() {
            let step_stdin = stdin.as_ref().map_or(fds.devnull, |f| {
                // SAFETY: lseek on our own memfd; the previous step's processes are gone.
                unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_SET) };
                f.as_raw_fd()
            });
            let exit = run_step(program, *timeout, env, step_stdin, fds.outputs[i]);
            // Its pipes are closed now: init relays all of its output before the report.
            for fd in [fds.outputs[i].0, fds.outputs[i].1] {
                // SAFETY: closing our write ends of this step's pipes, used no more.
                unsafe { libc::close(fd) };
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
        // SAFETY: _exit(2) ends the runner (and, as PID 1, its namespace).
        unsafe { libc::_exit(0) }
    }

    /// A memfd holding the call's stdin (every step rereads it), or `None` for none.
    fn stdin_fd(&self) -> std::io::Result<Option<OwnedFd>> {
        if self.stdin.is_empty() {
            return Ok(None);
        }
        let fd = rustix::fs::memfd_create("stdin", rustix::fs::MemfdFlags::CLOEXEC)?;
        write_all_blocking(fd.as_raw_fd(), &self.stdin)?;
        Ok(Some(fd))
    }

    /// Sends each fetched file that is a regular file of the call's own filesystems.
    /// They share one byte budget: the file that exceeds it is sent cut short (marked
    /// truncated) and the rest are not read.
    fn fetch_files(&self, reports: RawFd) {
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
    stdin: RawFd,
    (stdout, stderr): (RawFd, RawFd),
) -> ExecExit {
    let started = Instant::now();
    let pid = match crate::zygote::fork_into(0) {
        Ok(0) => exec_step(program, env, [stdin, stdout, stderr]),
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
    let duration_us = started.elapsed().as_micros() as u64;
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
        tv_sec: t.as_secs() as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
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

/// The step's process: standard descriptors wired, signals and OOM score reset, exec.
fn exec_step(program: &Program, env: &[CString], stdio: [RawFd; 3]) -> ! {
    let _ = nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&SigSet::empty()),
        None,
    );
    // SAFETY: restoring the default disposition before exec.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // The runner is exempt from the OOM killer (inherited from init); its steps are not.
    let _ = std::fs::write("/proc/self/oom_score_adj", "0");
    for (to, from) in stdio.into_iter().enumerate() {
        // SAFETY: dup2 between descriptors this process owns.
        unsafe { libc::dup2(from, to as RawFd) };
    }
    // Nothing of the runner's but stdio reaches the step (see `crate::fds`).
    let errno = match crate::fds::close_on_exec_above_stdio() {
        Ok(()) => program.exec(env),
        Err(e) => e.raw_os_error().unwrap_or(libc::EIO),
    };
    let msg = format!(
        "dsec: cannot execute {:?}: {}\n",
        program.name(),
        std::io::Error::from_raw_os_error(errno)
    );
    let _ = write_all_blocking(2, msg.as_bytes());
    let code = if errno == libc::ENOENT { 127 } else { 126 };
    // SAFETY: leaving the forked child without unwinding.
    unsafe { libc::_exit(code) }
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
    std::io::Read::read_to_end(&mut std::io::Read::take(&file, max + 1), &mut data).ok()?;
    let truncated = data.len() as u64 > max;
    data.truncate(max as usize);
    Some((data, truncated))
}
