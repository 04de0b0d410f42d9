//! Starting processes: the `clone`s, and everything a child runs between its `clone` and
//! its `execve`, in one place to audit.
//!
//! Three kinds of children run this code, under different rules:
//! - the zygote between the multi-threaded server's `fork` and its `execve`
//!   ([`zygote_child`]): async-signal-safe calls only — raw system calls, no allocation, no
//!   lock;
//! - a container command's first process ([`spawn_shared`]): `clone(CLONE_VM |
//!   CLONE_VFORK)`, so it runs in init's memory while init is suspended. init is
//!   single-threaded and holds no lock, so the child may make small allocations, but it
//!   reads only what [`Launch`] converted before the clone, and it leaves by `execve` or
//!   `_exit`, never by returning or unwinding into init's frames;
//! - a fncall call's first process and each step of a stepped call ([`fork_into`]): a
//!   private copy of single-threaded init (or of the call's runner), free to run ordinary
//!   code — it builds the call's root and writes its files — and it too leaves by `execve`
//!   or `_exit` only.
//!
//! A child that fails reports why on its report pipe, which is close-on-exec so that a
//! successful `execve` closes it: a [`ChildStage`] and an errno (little-endian `u32` and
//! `i32`), then, when a call's file could not be written, that `FileError` as JSON; at most
//! [`REPORT_MAX`] bytes in all.

use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use rustix::process::Pid;

use crate::files::{FileError, SandboxRoot};
use crate::proto::{ExecSpec, InitStage};
use crate::seccomp::SeccompProfile;
use crate::steps::StepPlan;
use crate::users::Account;

/// Most bytes of a failing command child's report (stage, errno, a file error).
pub(crate) const REPORT_MAX: usize = 8 << 10;

/// `PATH` when a command's environment has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Writes all of `data` to `fd`, retrying interrupted writes; one system call per chunk
/// written, so safe in any child.
pub(crate) fn write_all_blocking(fd: impl AsFd, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        match rustix::io::write(&fd, data) {
            Ok(n) => data = &data[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// `_exit(2)`: leaves a child at once, without unwinding into the frames of the process
/// it was cloned from and without running the destructors or exit handlers of its copy.
pub(crate) fn exit_now(code: i32) -> ! {
    // SAFETY: _exit(2) takes an integer and ends the process; nothing runs after it.
    unsafe { libc::_exit(code) }
}

/// The zygote's preparation between the server's `fork` and its `execve`: its socket moved
/// to descriptor `at`, and death with the server's thread that forked it. The server is
/// multi-threaded, so this makes raw system calls only.
pub(crate) fn zygote_child(socket: RawFd, at: RawFd) -> std::io::Result<()> {
    // SAFETY: dup2(2) with integer arguments only: `socket` is open in this child
    // (inherited), and `at` is the number the zygote expects its socket at, which nothing
    // in this child owns. (rustix's dup2 needs an `OwnedFd` to replace.)
    if unsafe { libc::dup2(socket, at) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))?;
    Ok(())
}

/// `fork(2)` into new namespaces: `clone(2)` with `flags` (`CLONE_NEW*`), no `CLONE_VM`
/// and a null stack, so the child continues on a private copy of the caller. Returns 0 in
/// the child. Only for single-threaded callers (the zygote, a sandbox's init, a stepped
/// call's runner): the child runs arbitrary code.
pub(crate) fn fork_into(flags: libc::c_int) -> std::io::Result<i32> {
    // SAFETY: clone(2) without CLONE_VM and with a null stack behaves like fork(2); the
    // callers are single-threaded, so the child's copy holds no lock another thread owns.
    // No CLONE_*TID or CLONE_PIDFD flag is passed, so the kernel reads and writes none of
    // the null pointer arguments.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            clone_flags(flags | libc::SIGCHLD),
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::null_mut::<libc::c_int>(),
            std::ptr::null_mut::<libc::c_int>(),
            0 as libc::c_ulong,
        )
    };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // The kernel returns a pid_t in the system call's long.
    #[allow(clippy::cast_possible_truncation)]
    Ok(pid as i32)
}

/// clone(2)'s flags argument: the bits of `flags`, zero-extended (a flag in bit 31 must
/// not sign-extend into the upper bits, which clone3 gives other meanings).
#[allow(clippy::cast_sign_loss)]
fn clone_flags(flags: libc::c_int) -> libc::c_ulong {
    libc::c_ulong::from(flags as u32)
}

/// The step of the child's preparation that failed, as written to the report pipe.
#[derive(Clone, Copy)]
#[repr(u32)]
pub(crate) enum ChildStage {
    Subreaper = 1,
    Stdio = 2,
    Chdir = 3,
    Exec = 4,
    CallRoot = 5,
    Confine = 6,
    Files = 7,
    Cgroup = 8,
    SetUser = 9,
}

impl ChildStage {
    /// The stage a report names; an unknown number reads as [`ChildStage::Exec`].
    pub(crate) fn from_u32(v: u32) -> ChildStage {
        match v {
            1 => ChildStage::Subreaper,
            5 => ChildStage::CallRoot,
            6 => ChildStage::Confine,
            7 => ChildStage::Files,
            8 => ChildStage::Cgroup,
            9 => ChildStage::SetUser,
            2 => ChildStage::Stdio,
            3 => ChildStage::Chdir,
            _ => ChildStage::Exec,
        }
    }

    /// The stage init reports to the edge.
    pub(crate) fn stage(self) -> InitStage {
        match self {
            ChildStage::Subreaper => InitStage::Subreaper,
            ChildStage::CallRoot => InitStage::CallRoot,
            ChildStage::Confine => InitStage::Confine,
            ChildStage::Files => InitStage::CallFiles,
            ChildStage::Cgroup => InitStage::CommandsCgroup,
            ChildStage::SetUser => InitStage::SetUser,
            ChildStage::Stdio => InitStage::Stdio,
            ChildStage::Chdir => InitStage::Chdir,
            ChildStage::Exec => InitStage::Exec,
        }
    }
}

/// A program to exec: its argv and the paths `argv[0]` may be at.
pub(crate) struct Program {
    argv: Vec<CString>,
    candidates: Vec<CString>,
}

fn cstring(s: &str, what: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} contains a NUL byte"))
}

/// The `PATH` of a command's environment (`K=V` entries), or the usual default.
pub(crate) fn search_path(env: &[String]) -> &str {
    env.iter()
        .find_map(|e| e.strip_prefix("PATH="))
        .unwrap_or(DEFAULT_PATH)
}

impl Program {
    /// `argv[0]` is looked up in `path` (a `PATH` value) when it has no `/`.
    pub(crate) fn new(argv: &[String], path: &str) -> Result<Program, String> {
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

    /// `argv[0]`, for messages.
    pub(crate) fn name(&self) -> String {
        self.argv
            .first()
            .map(|a| a.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// How a fncall worker's commands are set up (see [`crate::spec::SandboxSpec::worker`]).
pub(crate) struct CallSetup {
    pub(crate) layer_count: usize,
    pub(crate) disk_bytes: u64,
    pub(crate) seccomp: SeccompProfile,
}

impl CallSetup {
    /// Confines a call's first process once its root is built: the default capabilities,
    /// then no_new_privs and seccomp. Returns the errno of what failed.
    pub(crate) fn confine(&self) -> Result<(), i32> {
        crate::caps::drop_to_default().map_err(|_| libc::EPERM)?;
        self.seccomp.apply().map_err(|_| last_errno())
    }
}

/// Where a fncall call's first process stands when it sets its command up.
pub(crate) enum CallRoot<'a> {
    /// Cloned for the call into mount, pid and IPC namespaces of its own: it builds the
    /// call's root and confines itself.
    Build(&'a CallSetup),
    /// A worker's standby (see `init::standby`): its root was built and it was confined
    /// before the call came.
    Built,
}

/// A stepped call's runner's descriptors, inherited from init: the runner is a fork of
/// init, so init's descriptors they borrow are open in it too.
pub(crate) struct StepFds<'a> {
    /// Write ends of each step's (stdout, stderr) pipes.
    pub(crate) outputs: Vec<(BorrowedFd<'a>, BorrowedFd<'a>)>,
    /// Where the runner reports each step's end and the fetched files.
    pub(crate) reports: BorrowedFd<'a>,
    /// `/dev/null`: the standard input of steps when the call has none.
    pub(crate) devnull: BorrowedFd<'a>,
}

impl StepFds<'_> {
    /// Every descriptor the runner needs: the report pipe, `/dev/null`, then each step's
    /// stdout and stderr.
    pub(crate) fn all(&self) -> Vec<RawFd> {
        let mut fds = vec![self.reports.as_raw_fd(), self.devnull.as_raw_fd()];
        for (out, err) in &self.outputs {
            fds.extend([out.as_raw_fd(), err.as_raw_fd()]);
        }
        fds
    }
}

/// The descriptors a command's first process starts from, all open in init (and so in
/// its forks and clones; a standby's first process receives them, see `init::standby`).
pub(crate) struct ChildFds<'a> {
    pub(crate) stdin: BorrowedFd<'a>,
    pub(crate) stdout: BorrowedFd<'a>,
    pub(crate) stderr: BorrowedFd<'a>,
    pub(crate) report: BorrowedFd<'a>,
    /// The file the child writes `0` to, to enter the commands' cgroup (see
    /// `Prepared::commands_cgroup` in [`crate::init`]).
    pub(crate) join_cgroup: Option<BorrowedFd<'a>>,
    /// A stepped call's runner: every step's pipes and the report pipe.
    pub(crate) steps: Option<StepFds<'a>>,
    /// stdin is a terminal's slave side, to become the command's controlling terminal.
    pub(crate) controlling_tty: bool,
    /// Where a child sharing init's memory ([`spawn_shared`]) also leaves its failing
    /// stage and errno: a write to the report pipe needs a page,
    /// charged to the commands' memory cgroup, and fails when that cgroup is full of what
    /// nothing can free, and a command that could not start must still say why.
    pub(crate) failure: &'a AtomicU64,
}

/// A failing stage and errno as a child sharing init's memory leaves them in
/// [`ChildFds::failure`]; zero is no failure (stages count from 1).
fn pack_failure(stage: ChildStage, errno: i32) -> u64 {
    (u64::from(stage as u32) << 32) | u64::from(errno.cast_unsigned())
}

/// The report a child left in [`ChildFds::failure`], as the report pipe would carry it
/// (stage, then errno); `None` if it left none.
pub(crate) fn failure_report(packed: u64) -> Option<[u8; 8]> {
    (packed != 0).then(|| packed.rotate_left(32).to_le_bytes())
}

/// Everything the child needs, converted before `fork` so that the child only makes
/// syscalls.
pub(crate) struct Launch {
    program: Program,
    env: Vec<CString>,
    cwd: CString,
    /// Files to write in the command's root first: (path, mode, contents).
    files: Vec<(String, u32, Vec<u8>)>,
    /// The user to become, when it is not init's root.
    ids: Option<Ids>,
}

/// A user's ids, as the command's first process takes them.
struct Ids {
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
}

impl Ids {
    /// Becomes the user: supplementary groups, then the gid, then the uid (which needs the
    /// capabilities the first two use), all three of real, effective and saved ids. Raw
    /// system calls: the C library's wrappers would try to change every thread of a
    /// process, and a vfork child shares init's memory. Leaving uid 0 clears the
    /// permitted, effective and ambient capabilities (keep-caps is off: it is cleared
    /// here, and no secure bit keeps them); that is checked before the `execve`.
    fn take(&self) -> Result<(), i32> {
        // SAFETY: prctl(2) and the set*id(2) calls take integers; setgroups(2) reads
        // `groups.len()` ids from a buffer that outlives the call.
        let ok = unsafe {
            libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0) == 0
                && libc::syscall(libc::SYS_setgroups, self.groups.len(), self.groups.as_ptr()) == 0
                && libc::syscall(libc::SYS_setresgid, self.gid, self.gid, self.gid) == 0
                && libc::syscall(libc::SYS_setresuid, self.uid, self.uid, self.uid) == 0
        };
        if !ok {
            return Err(last_errno());
        }
        if self.uid != 0 && has_capabilities()? {
            return Err(libc::EPERM);
        }
        Ok(())
    }
}

/// Whether this process holds any permitted or effective capability (capget(2), version 3).
fn has_capabilities() -> Result<bool, i32> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget(2) reads the header and writes two data structs (version 3), both
    // owned here and laid out as the kernel's.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr()) };
    if rc != 0 {
        return Err(last_errno());
    }
    Ok(data.iter().any(|d| d.effective != 0 || d.permitted != 0))
}

impl Launch {
    /// `contents` are those of `spec.files`, in order. With `user` (the account and the
    /// directory to start in), the command runs as that user, with `HOME`, `USER` and
    /// `LOGNAME` set where the environment lacks them.
    pub(crate) fn new(
        spec: &ExecSpec,
        contents: Vec<Vec<u8>>,
        user: Option<(&Account, &str)>,
    ) -> Result<Launch, String> {
        let mut filled;
        let (env, cwd) = match user {
            Some((account, cwd)) => {
                filled = spec.env.clone();
                account.fill_env(&mut filled);
                (&filled, cwd)
            }
            None => (&spec.env, spec.cwd.as_str()),
        };
        let ids = user.map(|(account, _)| Ids {
            uid: account.uid,
            gid: account.gid,
            groups: account.groups.clone(),
        });
        Ok(Launch {
            program: Program::new(&spec.argv, search_path(env))?,
            env: env
                .iter()
                .map(|e| cstring(e, "environment"))
                .collect::<Result<Vec<_>, _>>()?,
            cwd: cstring(cwd, "working directory")?,
            ids,
            files: spec
                .files
                .iter()
                .zip(contents)
                .map(|(f, data)| (f.path.clone(), f.mode, data))
                .collect(),
        })
    }

    /// The contents of a call's files, in order.
    pub(crate) fn file_contents(&self) -> impl Iterator<Item = &[u8]> {
        self.files.iter().map(|(_, _, data)| data.as_slice())
    }

    /// Runs in the command's first process: enters the commands' cgroup, becomes a
    /// subreaper (or, a fncall call's, builds the call's root and confines itself unless a
    /// standby did, `call`; other commands inherit capabilities, no_new_privs and seccomp
    /// from init), wires stdio, enters the working directory, and execs. Reports a failing
    /// step through the report pipe and exits.
    pub(crate) fn exec_child(&self, fds: &ChildFds<'_>, call: Option<&CallRoot<'_>>) -> ! {
        self.set_up(fds, call);
        if crate::fds::close_on_exec_above_stdio().is_err() {
            fail(fds, ChildStage::Stdio, last_errno());
        }
        fail(fds, ChildStage::Exec, self.program.exec(&self.env))
    }

    /// Runs a fncall call in its first process: a stepped call's steps (`plan`), or its
    /// one command.
    pub(crate) fn run_call(
        &self,
        plan: Option<&StepPlan>,
        fds: &ChildFds<'_>,
        call: &CallRoot<'_>,
    ) -> ! {
        match (plan, &fds.steps) {
            (Some(plan), Some(step_fds)) => {
                self.become_runner(fds, call);
                plan.run(&self.env, step_fds)
            }
            _ => self.exec_child(fds, Some(call)),
        }
    }

    /// Runs in a stepped call's first process, which becomes the call's runner instead of
    /// exec'ing (see [`crate::steps`]): set up as [`Launch::exec_child`] would, but keeping
    /// its stdio and only the descriptors of `fds.steps`; then, with SIGCHLD blocked as
    /// init keeps it, it returns for the caller to run the steps.
    fn become_runner(&self, fds: &ChildFds<'_>, call: &CallRoot<'_>) {
        self.set_up(fds, Some(call));
        // Set up: init stops waiting for a failure report when this closes.
        // SAFETY: closing this process's copy of the report pipe, used no more: the
        // `OwnedFd` it borrows is init's, never dropped here (the runner only exits).
        unsafe { libc::close(fds.report.as_raw_fd()) };
        // The runner waits for its steps with SIGCHLD blocked, as init keeps it.
        let mut chld = SigSet::empty();
        chld.add(Signal::SIGCHLD);
        let _ = nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&chld), None);
    }

    /// Everything before the `execve` (or the runner's first step).
    fn set_up(&self, fds: &ChildFds<'_>, call: Option<&CallRoot<'_>>) {
        let _ = nix::sys::signal::pthread_sigmask(
            SigmaskHow::SIG_SETMASK,
            Some(&SigSet::empty()),
            None,
        );
        // SAFETY: restoring the default disposition before exec.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let _ = rustix::process::setsid();
        // Into the commands' cgroup first: everything the command makes from here on is
        // charged under the sandbox's limit, and none of it to init.
        if let Some(file) = fds.join_cgroup {
            if let Err(e) = rustix::io::write(file, b"0") {
                fail(fds, ChildStage::Cgroup, e.raw_os_error());
            }
        }
        match call {
            // A call's root, then its confinement, before anything of the call is written:
            // a standby's first process gets there before the call comes.
            Some(CallRoot::Build(setup)) => {
                if let Err(e) = crate::rootfs::setup_call(setup.layer_count, setup.disk_bytes) {
                    fail(fds, ChildStage::CallRoot, e.errno());
                }
                if let Err(errno) = setup.confine() {
                    fail(fds, ChildStage::Confine, errno);
                }
            }
            Some(CallRoot::Built) => {}
            // Any pid sets the flag (rustix passes it as prctl's non-zero argument).
            None => {
                if let Err(e) = rustix::process::set_child_subreaper(Some(Pid::INIT)) {
                    fail(fds, ChildStage::Subreaper, e.raw_os_error());
                }
            }
        }
        match &fds.steps {
            // The runner keeps only its own descriptors, and stays exempt from the OOM
            // killer like init (its steps are not).
            Some(step_fds) => {
                let mut keep = step_fds.all();
                keep.push(fds.report.as_raw_fd());
                if let Err(e) = close_other_fds(&keep) {
                    fail(
                        fds,
                        ChildStage::CallRoot,
                        e.raw_os_error().unwrap_or(libc::EIO),
                    );
                }
            }
            // init is exempt from the OOM killer where the host allows it; its commands
            // must not be (see `protect_from_oom_killer` in `crate::init`). Not through
            // the shared memory: the kernel gives a vfork child its own score.
            None => {
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
                let _ = rustix::io::write(fds.report, &msg);
                exit_now(127)
            }
        }
        if fds.steps.is_none() {
            if let Err(e) = dup2_stdio([fds.stdin, fds.stdout, fds.stderr]) {
                fail(fds, ChildStage::Stdio, e.raw_os_error());
            }
            // A session leader (setsid above) without a terminal takes the one on fd 0.
            if fds.controlling_tty {
                if let Err(e) = rustix::process::ioctl_tiocsctty(rustix::stdio::stdin()) {
                    fail(fds, ChildStage::Stdio, e.raw_os_error());
                }
            }
        }
        // The user's own identity before its working directory: one it may not enter is
        // an error, as it is for the user's own shell.
        if let Some(ids) = &self.ids {
            if let Err(errno) = ids.take() {
                fail(fds, ChildStage::SetUser, errno);
            }
        }
        if let Err(e) = rustix::process::chdir(self.cwd.as_c_str()) {
            fail(fds, ChildStage::Chdir, e.raw_os_error());
        }
    }
}

/// Reports a failing step of a command's first process on its report pipe, and exits.
fn fail(fds: &ChildFds<'_>, stage: ChildStage, errno: i32) -> ! {
    fds.failure
        .store(pack_failure(stage, errno), Ordering::Relaxed);
    let mut msg = [0u8; 8];
    msg[..4].copy_from_slice(&(stage as u32).to_le_bytes());
    msg[4..].copy_from_slice(&errno.to_le_bytes());
    let _ = rustix::io::write(fds.report, &msg);
    exit_now(127)
}

/// Makes `stdio` this process's standard input, output and error.
fn dup2_stdio([stdin, stdout, stderr]: [BorrowedFd<'_>; 3]) -> rustix::io::Result<()> {
    rustix::stdio::dup2_stdin(stdin)?;
    rustix::stdio::dup2_stdout(stdout)?;
    rustix::stdio::dup2_stderr(stderr)
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Starts a command the way `posix_spawn` does: `clone(CLONE_VM | CLONE_VFORK)` onto a
/// stack of its own. The child shares init's memory until its `execve` while init is
/// suspended, so nothing is copied — no page tables, no copy-on-write faults afterwards.
/// That is a large share of an exec's cost in a VM guest under binary translation (and
/// free to save in a container). The child makes syscalls and small allocations only,
/// which is safe: init is single-threaded and waits, holding no lock.
pub(crate) fn spawn_shared(
    launch: &Launch,
    fds: &ChildFds<'_>,
    stack: &mut [u8],
) -> std::io::Result<i32> {
    struct Args<'a> {
        launch: &'a Launch,
        fds: &'a ChildFds<'a>,
    }
    extern "C" fn entry(arg: *mut libc::c_void) -> libc::c_int {
        // SAFETY: `arg` points to the `Args` below, on the stack of the parent, which is
        // suspended (CLONE_VFORK) until this child execs or exits.
        let args = unsafe { &*(arg as *const Args<'_>) };
        args.launch.exec_child(args.fds, None)
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

/// Closes every descriptor but the standard ones and `keep`. Runs in the call's root,
/// whose `/proc` is the call's own.
fn close_other_fds(keep: &[RawFd]) -> std::io::Result<()> {
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

/// The least room the kernel gives `execve`'s arguments and environment (`ARG_MAX` in
/// `fs/exec.c`: the stack limit's quarter, never below this), counting each string, its
/// NUL and its pointer.
const EXEC_ARG_FLOOR: usize = 128 * 1024;

/// The room `execve` needs for strings of these lengths, as the kernel counts it.
pub(crate) fn exec_arg_bytes(lengths: impl Iterator<Item = usize>) -> usize {
    lengths.map(|len| len + 1 + size_of::<usize>()).sum()
}

/// What a command's first process says on stderr when its `execve` fails.
///
/// `execve` says E2BIG ("Argument list too long") also when a page to copy the arguments
/// into cannot be had: in a sandbox whose memory cgroup is full of what nothing can free,
/// that is the cause, and the user is told so rather than sent to shorten a short command.
pub(crate) fn exec_failure_message(program: &str, errno: i32, arg_bytes: usize) -> String {
    if errno == libc::E2BIG && arg_bytes < EXEC_ARG_FLOOR {
        return format!(
            "dsec: cannot execute {program:?}: {} (the kernel said \"{}\", but the arguments \
             and environment take {arg_bytes} bytes of the {EXEC_ARG_FLOOR} it always allows: \
             the pages to copy them into could not be charged to the sandbox's full memory \
             limit)\n",
            std::io::Error::from_raw_os_error(libc::ENOMEM),
            std::io::Error::from_raw_os_error(libc::E2BIG),
        );
    }
    format!(
        "dsec: cannot execute {program:?}: {}\n",
        std::io::Error::from_raw_os_error(errno)
    )
}

/// A stepped call's step, forked by its runner: standard descriptors wired, signals and
/// OOM score reset, exec.
pub(crate) fn exec_step(program: &Program, env: &[CString], stdio: [BorrowedFd<'_>; 3]) -> ! {
    let _ =
        nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
    // SAFETY: restoring the default disposition before exec.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // The runner is exempt from the OOM killer (inherited from init); its steps are not.
    let _ = std::fs::write("/proc/self/oom_score_adj", "0");
    let _ = dup2_stdio(stdio);
    // Nothing of the runner's but stdio reaches the step (see `crate::fds`).
    let errno = match crate::fds::close_on_exec_above_stdio() {
        Ok(()) => program.exec(env),
        Err(e) => e.raw_os_error().unwrap_or(libc::EIO),
    };
    let arg_bytes = exec_arg_bytes(program.argv.iter().chain(env).map(|s| s.as_bytes().len()));
    let msg = exec_failure_message(&program.name(), errno, arg_bytes);
    let _ = write_all_blocking(rustix::stdio::stderr(), msg.as_bytes());
    exit_now(if errno == libc::ENOENT { 127 } else { 126 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2big_for_a_short_command_is_blamed_on_memory() {
        let bytes = exec_arg_bytes(
            ["/bin/sh", "-c", "echo alive", "PATH=/bin"]
                .map(str::len)
                .into_iter(),
        );
        assert_eq!(bytes, 8 + 3 + 11 + 10 + 4 * size_of::<usize>());
        let msg = exec_failure_message("/bin/sh", libc::E2BIG, bytes);
        assert!(msg.contains("Cannot allocate memory"), "{msg}");
        assert!(msg.contains("memory limit"), "{msg}");
    }

    #[test]
    fn e2big_for_long_arguments_stays_argument_list_too_long() {
        let msg = exec_failure_message("/bin/echo", libc::E2BIG, 3 << 20);
        assert!(msg.contains("Argument list too long"), "{msg}");
        assert!(!msg.contains("memory"), "{msg}");
        let msg = exec_failure_message("/no/such", libc::ENOENT, 10);
        assert_eq!(
            msg,
            "dsec: cannot execute \"/no/such\": No such file or directory (os error 2)\n"
        );
    }
}
