//! The edge's side of a native container: create, exec, files, stop.
//!
//! A [`Container`] owns its init by pid, which the zygote keeps from being reused until the
//! container releases it at stop (see [`Init`]: a recycled pid is never signalled or read
//! by mistake), its cgroups, its directory under the state dir, and the control
//! [`Channel`], over which init also serves the sandbox's files ([`crate::files`]). The
//! channel is the one descriptor the server holds for an idle sandbox.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustix::process::Pid;
use serde::{Deserialize, Serialize};

use crate::cgroup::{
    CgroupError, CgroupLayout, CgroupLimits, CgroupVersion, SandboxCgroup, SpareCgroups,
};
use crate::channel::Channel;
pub use crate::channel::{ExecEvent, ExecHandle};
use crate::files::FileError;
use crate::procfs::Stat;
use crate::proto::{ExecSpec, InitError, InitStage};
use crate::rootfs::SharedSysfs;
use crate::spec::SandboxSpec;
use crate::zygote::{Init, Zygote, ZygoteError};

/// How long [`Container::exit_status`] waits between looks at init's exit.
const POLL_INTERVAL: Duration = Duration::from_millis(10);
/// How long a sandbox may take to report ready before create gives up.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A container operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// Host filesystem work for the sandbox failed.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// Where.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A cgroup operation failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The zygote failed.
    #[error(transparent)]
    Zygote(#[from] ZygoteError),
    /// init could not build the sandbox.
    #[error("sandbox setup failed at {}: {}", .0.stage, .0.message)]
    Setup(InitError),
    /// init could not start a command.
    #[error("{}: {}", .0.stage, .0.message)]
    Exec(InitError),
    /// A file operation failed or was refused.
    #[error(transparent)]
    File(#[from] FileError),
    /// The sandbox's init is gone (killed, or the sandbox was stopped).
    #[error("the sandbox's init exited")]
    Gone,
    /// The control channel broke or misbehaved.
    #[error("control channel: {0}")]
    Channel(String),
}

impl RuntimeError {
    /// The image cannot make a root: it has a symbolic link where the root's mounts go
    /// (see `rootfs::Root`). The caller's input, not the host's failure.
    pub fn is_unusable_image(&self) -> bool {
        matches!(self, RuntimeError::Setup(e)
            if e.stage == InitStage::Rootfs && e.errno == Some(libc::ELOOP))
    }
}

fn io_err<'a>(
    action: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> RuntimeError + 'a {
    move |source| RuntimeError::Io {
        action,
        path: path.to_owned(),
        source,
    }
}

/// What the runtime writes to `<state>/sandboxes/<id>/record.json` before creating
/// anything else, so that a restart after a crash finds and removes it all.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    id: String,
    cgroup: SandboxCgroup,
}

/// How a sandbox's init ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitExit {
    /// SIGKILLed while the OOM killer was killing in init's cgroup (on v1 hosts that of
    /// all inits, so only a host-wide or all-sandboxes shortage: init is outside its
    /// sandbox's own limit there).
    OomKilled,
    /// Killed by this signal (from outside the sandbox: processes inside cannot signal
    /// their PID 1).
    Signaled(i32),
    /// Exited with this status: init exits only when its channel breaks.
    Exited(i32),
    /// Gone, but how is not known (init was released already, or did not finish exiting).
    Unknown,
}

impl std::fmt::Display for InitExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InitExit::OomKilled => write!(f, "was killed by the kernel's OOM killer"),
            InitExit::Signaled(sig) => {
                let name = nix::sys::signal::Signal::try_from(*sig)
                    .map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_owned());
                write!(f, "was killed by {name}")
            }
            InitExit::Exited(code) => write!(f, "exited with status {code}"),
            InitExit::Unknown => write!(f, "exited"),
        }
    }
}

/// Parameters of a new container.
#[derive(Clone, Debug)]
pub struct CreateOptions {
    /// Sandbox id, also its hostname.
    pub id: String,
    /// Image layer directories, topmost first.
    pub layers: Vec<PathBuf>,
    /// cgroup limits.
    pub limits: CgroupLimits,
    /// Size of the writable layer.
    pub disk_bytes: u64,
    /// A fncall worker (see [`SandboxSpec::worker`]).
    pub worker: bool,
}

impl CreateOptions {
    /// The limits the sandbox's cgroups get: a fncall worker's pids limit also holds its
    /// standby's holder (of the next call's root, see `init::standby`; the standby's other
    /// process becomes the call's first), so that a call has as many processes under its
    /// `pids` as it had before the standby.
    fn cgroup_limits(&self) -> CgroupLimits {
        let mut limits = self.limits;
        if self.worker {
            limits.pids += 1;
        }
        limits
    }
}

/// A sandbox's writable layer, held by the edge for a snapshot.
#[derive(Debug)]
pub struct UpperDir(OwnedFd);

impl UpperDir {
    /// A path that names the directory for as long as this value lives.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.0.as_raw_fd()))
    }
}

impl AsFd for UpperDir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Creates containers on this host.
pub struct ContainerRuntime {
    zygote: Zygote,
    layout: CgroupLayout,
    spares: Arc<SpareCgroups>,
    sandboxes_dir: PathBuf,
    sysfs: Option<SharedSysfs>,
}

/// A running native container.
pub struct Container {
    id: String,
    /// Shared with the blocking task that releases it at stop.
    init: Arc<Init>,
    cgroup: SandboxCgroup,
    dir: PathBuf,
    /// init's descriptor of the writable layer's upper directory.
    upper_fd: RawFd,
    worker: bool,
    channel: Channel,
    oom_kills_seen: AtomicU64,
    /// The OOM kills of init's cgroup that were not init's: at creation (v1: the inits of
    /// other sandboxes), and on v2 the commands' kills reported since.
    init_oom_kills_not_init: AtomicU64,
}

impl ContainerRuntime {
    /// A runtime that clones through `zygote`, puts cgroups where `layout` says and
    /// gives its sandboxes `sysfs` (else each mounts its own).
    pub fn new(
        zygote: Zygote,
        layout: CgroupLayout,
        sandboxes_dir: PathBuf,
        sysfs: Option<SharedSysfs>,
    ) -> Self {
        ContainerRuntime {
            zygote,
            spares: Arc::new(SpareCgroups::new(layout.clone())),
            layout,
            sandboxes_dir,
            sysfs,
        }
    }

    /// Builds a container and waits until its init reports ready.
    pub async fn create(self: &Arc<Self>, opts: CreateOptions) -> Result<Container, RuntimeError> {
        let this = Arc::clone(self);
        let id = opts.id.clone();
        let worker = opts.worker;
        let (created, cgroup, dir) =
            tokio::task::spawn_blocking(move || this.create_blocking(&opts))
                .await
                .map_err(|e| RuntimeError::Channel(e.to_string()))??;
        let crate::zygote::Created { init, channel } = created;
        let opened = async {
            let stream = std::os::unix::net::UnixStream::from(channel);
            stream
                .set_nonblocking(true)
                .map_err(|e| RuntimeError::Channel(e.to_string()))?;
            let stream = tokio::net::UnixStream::from_std(stream)
                .map_err(|e| RuntimeError::Channel(e.to_string()))?;
            Channel::open(stream, READY_TIMEOUT).await
        };
        let (channel, ready) = match opened.await {
            Ok(opened) => opened,
            Err(e) => {
                init.kill();
                let _ = tokio::task::spawn_blocking(move || {
                    init.release();
                    remove_sandbox(&cgroup, &dir);
                })
                .await;
                return Err(e);
            }
        };
        // The next create's cgroups, made while this sandbox serves its first requests.
        if self.spares.short() {
            let spares = Arc::clone(&self.spares);
            tokio::task::spawn_blocking(move || spares.refill());
        }
        let init_oom_kills = cgroup.init_oom_kills();
        Ok(Container {
            id,
            init: Arc::new(init),
            cgroup,
            dir,
            upper_fd: ready.upper_fd,
            worker,
            channel,
            oom_kills_seen: AtomicU64::new(0),
            init_oom_kills_not_init: AtomicU64::new(init_oom_kills),
        })
    }

    fn create_blocking(
        &self,
        opts: &CreateOptions,
    ) -> Result<(crate::zygote::Created, SandboxCgroup, PathBuf), RuntimeError> {
        let dir = self.sandboxes_dir.join(&opts.id);
        let cgroup = self.layout.sandbox(&opts.id);
        let result = (|| {
            std::fs::create_dir(&dir).map_err(io_err("create", &dir))?;
            for sub in ["rootfs", "rw"] {
                let p = dir.join(sub);
                std::fs::create_dir(&p).map_err(io_err("create", &p))?;
            }
            let record = Record {
                id: opts.id.clone(),
                cgroup: cgroup.clone(),
            };
            let record_path = dir.join("record.json");
            std::fs::write(
                &record_path,
                serde_json::to_vec(&record).expect("serializes"),
            )
            .map_err(io_err("write", &record_path))?;
            match self.spares.take_as(&cgroup) {
                true => cgroup.set_limits(&opts.cgroup_limits())?,
                false => cgroup.create(&opts.cgroup_limits())?,
            }
            let spec = SandboxSpec {
                id: opts.id.clone(),
                dir: dir.clone(),
                layers: opts.layers.clone(),
                disk_bytes: opts.disk_bytes,
                init_cgroups: cgroup.init_joins(),
                init_memory_home: cgroup.init_memory_home(),
                commands_cgroup: cgroup.commands_join(),
                worker: opts.worker,
                sysfs: self.sysfs.as_ref().map(|s| s.path().to_owned()),
            };
            Ok(self.zygote.create(spec)?)
        })();
        match result {
            Ok(created) => Ok((created, cgroup, dir)),
            Err(e) => {
                remove_sandbox(&cgroup, &dir);
                Err(e)
            }
        }
    }

    /// Removes the spare cgroup sets and this server's empty cgroup parents; call after
    /// every sandbox has stopped.
    pub fn release_host(&self) {
        self.spares.close();
        self.layout.remove_parents();
    }

    /// Removes what an earlier run of the server left: the processes, cgroups and
    /// directories of every sandbox recorded under the state dir, and cgroups in this
    /// server's own `dsec-<tag>` parents (spare sets included). Returns the ids of the
    /// sandboxes cleaned.
    pub fn clean_leftovers(&self) -> Vec<String> {
        self.layout.remove_spares();
        let mut cleaned = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&self.sandboxes_dir) {
            for entry in entries.flatten() {
                let dir = entry.path();
                let record: Option<Record> = std::fs::read(dir.join("record.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok());
                let id = entry.file_name().to_string_lossy().into_owned();
                let cgroup = record.map_or_else(|| self.layout.sandbox(&id), |r| r.cgroup);
                remove_sandbox(&cgroup, &dir);
                cleaned.push(id);
            }
        }
        for id in self.layout.existing_sandboxes() {
            let _ = self.layout.sandbox(&id).destroy();
            if !cleaned.contains(&id) {
                cleaned.push(id);
            }
        }
        cleaned
    }
}

/// Kills and removes everything of a sandbox that the host can see. Mounts need no
/// work: they lived in the sandbox's mount namespace, which died with its processes.
fn remove_sandbox(cgroup: &SandboxCgroup, dir: &Path) {
    if let Err(e) = cgroup.destroy() {
        tracing::warn!(error = %e, "removing sandbox cgroup");
    }
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(error = %e, dir = %dir.display(), "removing sandbox directory");
        }
    }
}

impl Container {
    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The sandbox's network namespace, opened through init (networking plugs a veth
    /// into it), by pid while [`Init`] keeps the pid init's.
    pub fn open_netns(&self) -> Result<OwnedFd, RuntimeError> {
        let netns = |pid: Pid| {
            let path = PathBuf::from(format!("/proc/{}/ns/net", pid.as_raw_nonzero()));
            match std::fs::File::open(&path) {
                Ok(file) => Ok(file.into()),
                // A zombie init has no namespaces left.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(RuntimeError::Gone),
                Err(e) => Err(io_err("open", &path)(e)),
            }
        };
        self.init.with_pid(netns).unwrap_or(Err(RuntimeError::Gone))
    }

    /// Whether init is still there.
    pub fn is_alive(&self) -> bool {
        self.channel.is_alive()
    }

    /// The control channel: commands, and the sandbox's files as init serves them.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// How init ended; call once [`is_alive`](Self::is_alive) is false, before
    /// [`stop`](Self::stop) removes the cgroups. Blocks up to 100 ms while the kernel
    /// finishes the exit (the channel closes before init is reaped).
    pub fn exit_reason(&self) -> InitExit {
        match self.exit_status() {
            InitExit::Signaled(libc::SIGKILL)
                if self.cgroup.init_oom_kills()
                    > self.init_oom_kills_not_init.load(Ordering::Acquire) =>
            {
                InitExit::OomKilled
            }
            other => other,
        }
    }

    /// How init ended, as the kernel shows it for init's zombie (which the zygote keeps
    /// until init is released): its wait status in `/proc/<pid>/stat`.
    fn exit_status(&self) -> InitExit {
        for _ in 0..10 {
            let status = self.init.with_pid(|pid| {
                Stat::read(pid.as_raw_nonzero().get())
                    .and_then(|stat| stat.is_zombie().then_some(stat.exit_code))
            });
            match status {
                None => return InitExit::Unknown,
                Some(Some(status)) if libc::WIFSIGNALED(status) => {
                    return InitExit::Signaled(libc::WTERMSIG(status))
                }
                Some(Some(status)) => return InitExit::Exited(libc::WEXITSTATUS(status)),
                // Still exiting: the channel closes before init becomes a zombie.
                Some(None) => std::thread::sleep(POLL_INTERVAL),
            }
        }
        InitExit::Unknown
    }

    /// Whether this is a fncall worker (each command in a root of its own).
    pub fn is_worker(&self) -> bool {
        self.worker
    }

    /// The writable layer's upper directory (overlayfs format: whiteouts are 0:0 character
    /// devices, opaque directories carry `trusted.overlay.opaque`), taken from init with
    /// `pidfd_getfd` through a pidfd opened for the moment, while [`Init`] keeps the pid
    /// init's: never from another process that reused the pid. Read it only while the
    /// sandbox is frozen to get a consistent picture.
    pub fn upper_dir(&self) -> Result<UpperDir, RuntimeError> {
        if self.upper_fd < 0 {
            return Err(RuntimeError::Channel(
                "this sandbox has no writable layer of its own".into(),
            ));
        }
        let pidfd = self.init.pidfd().ok_or(RuntimeError::Gone)?;
        pidfd
            .and_then(|pidfd| {
                rustix::process::pidfd_getfd(
                    &pidfd,
                    self.upper_fd,
                    rustix::process::PidfdGetfdFlags::empty(),
                )
            })
            .map(UpperDir)
            .map_err(|e| match e {
                // init has exited: a zombie has no descriptors left.
                rustix::io::Errno::SRCH | rustix::io::Errno::BADF => RuntimeError::Gone,
                e => RuntimeError::Channel(format!("pidfd_getfd of the upper directory: {e}")),
            })
    }

    /// The sandbox's cgroups (usage, freezing).
    pub fn cgroup(&self) -> &SandboxCgroup {
        &self.cgroup
    }

    /// Starts a command; `files` are the contents of `spec.files`.
    pub async fn exec(
        &self,
        spec: &ExecSpec,
        stdin: &[u8],
        files: &[&[u8]],
    ) -> Result<ExecHandle, RuntimeError> {
        self.channel.exec(spec, stdin, files).await
    }

    /// Whether the memory limit killed something since the last call.
    pub fn take_oom_kill(&self) -> bool {
        let now = self.cgroup.oom_kills();
        if self.cgroup.version() == CgroupVersion::V2 {
            // There init shares the commands' cgroup: these kills were not init's.
            self.init_oom_kills_not_init.store(now, Ordering::Release);
        }
        self.oom_kills_seen.swap(now, Ordering::AcqRel) < now
    }

    /// Kills everything in the sandbox and removes all it made. Idempotent.
    pub async fn stop(&self) {
        self.init.kill();
        // A paused sandbox's init dies only once thawed (see `thaw_for_kill`).
        self.cgroup.thaw_for_kill();
        // The channel closes when init's descriptors do, i.e. once it has exited.
        self.channel.wait_closed(Duration::from_secs(5)).await;
        let (init, cgroup, dir) = (
            Arc::clone(&self.init),
            self.cgroup.clone(),
            self.dir.clone(),
        );
        let _ = tokio::task::spawn_blocking(move || {
            init.release();
            remove_sandbox(&cgroup, &dir);
        })
        .await;
    }
}
