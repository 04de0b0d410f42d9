//! `backend="docker"`: sandboxes as containers of a Docker Engine, over its HTTP API.
//!
//! The image is a reference the daemon knows (pulled when absent, if a registry answers).
//! Each sandbox is one container whose PID 1 is Docker's init (`--init`, which reaps
//! orphans) over `sleep infinity`, so it lives between commands; commands are execs.
//!
//! Ownership: every container dsec makes carries `dsec.managed=true`, `dsec.id=<sandbox>`
//! and `dsec.edge=<tag of the state directory>`. On the first contact with the daemon (at
//! start-up, before serving, or at the first `create` if the daemon came later) the backend
//! removes containers carrying this server's `dsec.edge` (leftovers of a crash); it never
//! lists, stops or removes a container without those labels.
//!
//! The daemon is pinged with a short timeout on every `create`: a server whose daemon is
//! absent starts and serves every other backend, and `create(backend="docker")` answers
//! `Unavailable` naming the address it tried.
//!
//! A sandbox learns that its container stopped from one stream of the daemon's events that
//! all of its sandboxes share ([`liveness`]), so an idle sandbox holds no connection to the
//! daemon.
//!
//! Semantics that match the native backend, and how:
//! - a timeout kills the command's whole tree. Docker runs each exec as a session leader
//!   (runc calls `setsid`), so the tree is: the exec's main process, its descendants, and
//!   every process of the container still in its session (a double fork keeps the
//!   session). They are SIGSTOPped round by round until no new member appears, then
//!   SIGKILLed — from the host, through `/proc`, which needs the daemon on this host;
//! - output is read as it comes (demultiplexed, `Tty=false`), bounded per stream, the rest
//!   discarded while the command keeps running; the exit code comes from exec inspect;
//! - files go through the archive API; each path is resolved component by component the
//!   way `openat2(RESOLVE_BENEATH)` does for the native backend: `..` above `/`, absolute
//!   symbolic links and relative ones that climb out are refused. The daemon reads and
//!   writes archives with its own (host) credentials, so the native backend's rules are
//!   applied before it is asked: nothing under the container's `/proc`, `/sys` or `/dev`,
//!   nothing but regular files and directories, sizes bounded; archives it sends are
//!   spooled to disk under a bound, and uploads streamed to it;
//! - memory, pids and CPU limits are Docker's; OOM kills and usage are read from the
//!   container's cgroup when the daemon is on this host.
//!
//! What Docker cannot do here is said, not pretended: `disk_mb` is passed as the
//! `size` storage option, which overlay2 honours only on xfs with project quotas; on other
//! daemons the writable layer is unbounded (a warning is logged once and `df /` inside
//! shows the real size). With a remote `DOCKER_HOST`, timeouts end the wait but cannot
//! kill the command's tree.

mod archive;
mod host;
mod liveness;
mod notify;
mod ops;
mod output;
mod paths;
mod process;
mod user;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use axum::body::Bytes;
use bollard::errors::Error as DockerError;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::query_parameters::UploadToContainerOptionsBuilder;
use bollard::Docker;
use dsec_api::{FileInfo, Usage};
use dsec_runtime::files::{FileError, FileOp};
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use self::archive::{
    blocking, list_tar, sized, tar_head, tar_padding, SpooledRead, ARCHIVE_OVERHEAD,
    MAX_LIST_ARCHIVE,
};
use self::host::{daemon_error, exec_error, is_paused_refusal, remove, LocalView, Unfinished};
use self::liveness::{Alive, Liveness};
use self::output::DockerOutput;
use self::paths::join;
use super::{
    Backend, CommandSpec, Created, FileRead, FileWatch, MakeDir, MovePath, OutputStream,
    ProcessSpec, RemovePath, Sandbox, SandboxRequest, Spawned, Upload,
};
use crate::error::ApiError;

/// Creates sandboxes as Docker containers.
pub struct DockerBackend {
    /// `DOCKER_HOST`, or the default socket: named in every "not reachable" message.
    host: String,
    /// Value of the `dsec.edge` label: this server's containers, and only those.
    edge: String,
    /// The connection, negotiated once the daemon first answered.
    client: tokio::sync::Mutex<Option<Docker>>,
    /// The daemon refused a `size` storage option once: it cannot limit the writable layer.
    no_storage_quota: AtomicBool,
    /// Its containers watched for their end, over one event stream (see [`liveness`]).
    liveness: Arc<Liveness>,
}

impl DockerBackend {
    /// A backend whose containers carry `dsec.edge=<edge>`; nothing is contacted yet.
    pub fn new(edge: String) -> Self {
        let host = std::env::var("DOCKER_HOST")
            .ok()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "unix:///var/run/docker.sock".to_owned());
        DockerBackend {
            host,
            liveness: Liveness::new(edge.clone()),
            edge,
            client: tokio::sync::Mutex::new(None),
            no_storage_quota: AtomicBool::new(false),
        }
    }
}

#[async_trait]
impl Backend for DockerBackend {
    async fn create(&self, req: SandboxRequest) -> Result<Created, ApiError> {
        let docker = self.docker().await?;
        let image = self.image(&docker, &req.image).await?;
        let id = self.create_container(&docker, &req).await?;
        // From here on an error, or this request being dropped, removes the container.
        let mut unfinished = Unfinished {
            docker: docker.clone(),
            id: Some(id.clone()),
        };
        let started = async {
            docker
                .start_container(&id, None)
                .await
                .map_err(|e| daemon_error(&self.host, "starting the container", e))?;
            // Watched from here on: an end after the inspect below reaches the sandbox, one
            // before it fails this create.
            let alive = self.liveness.register(&docker, &id);
            let inspect = docker
                .inspect_container(&id, None)
                .await
                .map_err(|e| daemon_error(&self.host, "inspecting the container", e))?;
            let state = inspect.state.unwrap_or_default();
            if state.running != Some(true) {
                return Err(ApiError::internal(format!(
                    "the container exited at once ({}); the image must provide `sleep`",
                    state.error.filter(|e| !e.is_empty()).unwrap_or_else(|| {
                        format!("exit code {}", state.exit_code.unwrap_or_default())
                    })
                )));
            }
            let pid = i32::try_from(state.pid.unwrap_or_default()).unwrap_or_default();
            Ok((alive, pid, inspect.graph_driver))
        }
        .await;
        let (alive, pid, driver) = started?;
        let local = LocalView::find(&id, pid, driver.as_ref());
        if local.is_none() {
            tracing::warn!(
                sandbox = %req.id,
                "docker backend: the container's processes are not visible on this host \
                 (remote daemon?): timeouts cannot kill command trees, no usage or OOM data"
            );
        }
        let inner = Arc::new(Inner {
            docker: docker.clone(),
            host: self.host.clone(),
            id,
            alive,
            local,
            watches: Arc::new(tokio::sync::Semaphore::new(
                dsec_runtime::files::watch::MAX_WATCHES,
            )),
        });
        unfinished.id = None;
        Ok(Created {
            sandbox: Box::new(DockerSandbox(inner)),
            image,
        })
    }
}

/// One sandbox's container.
struct Inner {
    docker: Docker,
    host: String,
    id: String,
    /// False once the container stopped (or the sandbox is being stopped).
    alive: Alive,
    local: Option<LocalView>,
    /// Its watches open (see [`notify`]).
    watches: Arc<tokio::sync::Semaphore>,
}

fn not_found(path: &str) -> ApiError {
    FileError::NotFound {
        path: path.to_owned(),
    }
    .into()
}

struct DockerSandbox(Arc<Inner>);

/// Docker's archive API, which the file operations use, acts as root: an operation as a
/// user (see `dsec_runtime::files::client::as_user`) is refused rather than done as root.
fn as_root_only() -> Result<(), ApiError> {
    if dsec_runtime::files::client::current_user().is_some() {
        return Err(ApiError::invalid(
            "user= on file operations is not supported on docker sandboxes (Docker's archive \
             API acts as root): run a command as the user instead (run(..., user=))",
        ));
    }
    Ok(())
}

#[async_trait]
impl Sandbox for DockerSandbox {
    async fn exec(&self, mut cmd: CommandSpec) -> Result<Box<dyn OutputStream>, ApiError> {
        for f in std::mem::take(&mut cmd.files) {
            self.write_file(&f.path, f.mode, Upload::whole(f.data))
                .await?;
        }
        let user = match cmd.run_as.take() {
            Some(run_as) => Some(self.user(&run_as, &mut cmd.env, &mut cmd.cwd).await?),
            None => None,
        };
        let inner = &self.0;
        let attach_stdin = !cmd.stdin.is_empty();
        let config = CreateExecOptions {
            attach_stdin: Some(attach_stdin),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            env: Some(std::mem::take(&mut cmd.env)),
            cmd: Some(cmd.argv.clone()),
            working_dir: Some(cmd.cwd.clone()),
            user,
            ..Default::default()
        };
        let exec = match inner.docker.create_exec(&inner.id, config.clone()).await {
            // A paused event the daemon processed after our unpause marks the container
            // paused again (a race inside Docker): the edge knows it is running.
            Err(e) if is_paused_refusal(&e) => {
                inner.unpause().await?;
                inner.docker.create_exec(&inner.id, config).await
            }
            other => other,
        }
        .map_err(|e| exec_error(inner, e))?;
        let started = Instant::now();
        let opts = StartExecOptions {
            detach: false,
            tty: false,
            output_capacity: Some(64 << 10),
        };
        let StartExecResults::Attached { output, mut input } = inner
            .docker
            .start_exec(&exec.id, Some(opts))
            .await
            .map_err(|e| exec_error(inner, e))?
        else {
            return Err(ApiError::internal("the daemon started the exec detached"));
        };
        // Stdin is written beside the reading, so a command that answers before it has
        // read everything cannot dead-lock with us; closing it is the command's EOF.
        let stdin = std::mem::take(&mut cmd.stdin);
        let stdin_task = attach_stdin.then(|| {
            tokio::spawn(async move {
                let _ = input.write_all(&stdin).await;
                let _ = input.shutdown().await;
            })
        });
        Ok(Box::new(DockerOutput::new(
            Arc::clone(inner),
            exec.id,
            output,
            stdin_task,
            started,
            &cmd,
        )))
    }

    async fn spawn(&self, mut spec: ProcessSpec) -> Result<Spawned, ApiError> {
        let user = match spec.run_as.take() {
            Some(run_as) => Some(self.user(&run_as, &mut spec.env, &mut spec.cwd).await?),
            None => None,
        };
        process::spawn(&self.0, spec, user).await
    }

    async fn read_file(&self, path: &str, max_bytes: u64) -> Result<Box<dyn FileRead>, ApiError> {
        as_root_only()?;
        let inner = &self.0;
        let resolved = inner.resolve(path).await?;
        resolved.check(path, FileOp::Read)?;
        if !resolved.missing.is_empty() {
            return Err(not_found(path));
        }
        if resolved.last.dir {
            return Err(FileError::WrongType {
                path: path.to_owned(),
                reason: "is a directory; use list_files".into(),
            }
            .into());
        }
        let too_large = || {
            ApiError::from(FileError::TooLarge {
                path: path.to_owned(),
                op: FileOp::Read,
                what: format!(
                    "is over the server's limit of {} MiB for a file read \
                     (dsec serve --max-file-mb)",
                    max_bytes >> 20
                ),
            })
        };
        if resolved.last.size > max_bytes {
            return Err(too_large());
        }
        let tar = inner
            .download(
                &join(&resolved.existing, None),
                max_bytes + ARCHIVE_OVERHEAD,
            )
            .await?
            .ok_or_else(too_large)?;
        Ok(Box::new(SpooledRead::open(tar, path.to_owned()).await?))
    }

    async fn write_file(&self, path: &str, mode: u32, mut data: Upload) -> Result<(), ApiError> {
        as_root_only()?;
        if data.take_metadata().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::invalid(
                "file metadata is not supported on docker sandboxes (Docker's archive API \
                 carries no extended attributes): use the container backend, or keep the \
                 metadata beside the file",
            ));
        }
        let inner = &self.0;
        let resolved = inner.resolve(path).await?;
        resolved.check(path, FileOp::Write)?;
        let (dir, names) = if resolved.missing.is_empty() {
            if resolved.last.dir {
                return Err(FileError::WrongType {
                    path: path.to_owned(),
                    reason: "is a directory".into(),
                }
                .into());
            }
            let mut existing = resolved.existing;
            let name = existing.pop().ok_or_else(|| FileError::InvalidPath {
                path: path.to_owned(),
                reason: "names a directory".into(),
            })?;
            (existing, vec![name])
        } else {
            (resolved.existing, resolved.missing)
        };
        if names.iter().any(|n| n == "." || n == "..") {
            return Err(FileError::Escapes {
                path: path.to_owned(),
            }
            .into());
        }
        let (size, contents) = sized(data, path).await?;
        let head = tar_head(&names, size, mode)?;
        // The archive is streamed: its head, the contents as they arrive, the padding and
        // the end. A failure of the contents is kept to answer with, rather than the
        // daemon's complaint about a cut archive.
        let failure = Arc::new(std::sync::Mutex::new(None::<ApiError>));
        let failed = Arc::clone(&failure);
        let tail = Bytes::from(vec![0u8; tar_padding(size) + 1024]);
        let contents = contents.map(move |chunk| {
            chunk.map_err(|e| {
                let io = std::io::Error::other(e.message.clone());
                *failed.lock().expect("lock") = Some(e);
                io
            })
        });
        let archive = futures::stream::once(async { Ok(head) })
            .chain(contents)
            .chain(futures::stream::once(async { Ok(tail) }));
        let opts = UploadToContainerOptionsBuilder::new()
            .path(&join(&dir, None))
            .no_overwrite_dir_non_dir("true")
            .build();
        let uploaded = inner
            .docker
            .upload_to_container(&inner.id, Some(opts), bollard::body_try_stream(archive))
            .await;
        if let Some(e) = failure.lock().expect("lock").take() {
            return Err(e);
        }
        uploaded.map_err(|e| match &e {
            DockerError::DockerResponseServerError { message, .. }
                if message.contains("no space left") || message.contains("quota") =>
            {
                ApiError::from(FileError::NoSpace {
                    path: path.to_owned(),
                })
            }
            DockerError::DockerResponseServerError { message, .. }
                if archive::changed_under_the_daemon(message) =>
            {
                ApiError::conflict(format!(
                    "writing {path:?}: the path changed in the sandbox while it was written \
                     ({message})"
                ))
            }
            _ => daemon_error(&inner.host, &format!("writing {path:?}"), e),
        })
    }

    async fn list_files(&self, path: &str, depth: u32) -> Result<Vec<FileInfo>, ApiError> {
        as_root_only()?;
        let inner = &self.0;
        let resolved = inner.resolve_dir(path, FileOp::List).await?;
        // The archive of a directory is its whole subtree; only the headers are read.
        let dir = join(&resolved.existing, None);
        let archive_path = if dir == "/" { "/.".to_owned() } else { dir };
        let tar = inner
            .download(&archive_path, MAX_LIST_ARCHIVE)
            .await?
            .ok_or_else(|| {
                ApiError::from(FileError::TooLarge {
                    path: path.to_owned(),
                    op: FileOp::List,
                    what: format!(
                        "holds more than {} MiB, the most the Docker daemon's archive of a \
                         directory may be to list it; list a subdirectory",
                        MAX_LIST_ARCHIVE >> 20
                    ),
                })
            })?;
        blocking(move || list_tar(tar, depth)).await
    }

    async fn stat(&self, path: &str) -> Result<FileInfo, ApiError> {
        as_root_only()?;
        self.0.stat_path(path).await
    }

    async fn make_dir(&self, req: &MakeDir) -> Result<bool, ApiError> {
        as_root_only()?;
        self.0.make_dir(req).await
    }

    async fn move_path(&self, req: &MovePath) -> Result<(), ApiError> {
        as_root_only()?;
        self.0.move_path(req).await
    }

    async fn remove_path(&self, req: &RemovePath) -> Result<(), ApiError> {
        as_root_only()?;
        self.0.remove_path(req).await
    }

    async fn watch(&self, path: &str, recursive: bool) -> Result<Box<dyn FileWatch>, ApiError> {
        self.0.watch(path, recursive).await
    }

    async fn pause(&self) -> Result<(), ApiError> {
        let inner = &self.0;
        inner
            .docker
            .pause_container(&inner.id)
            .await
            .map_err(|e| daemon_error(&inner.host, "pausing the container", e))
    }

    async fn resume(&self) -> Result<(), ApiError> {
        self.0.unpause().await
    }

    fn usage(&self) -> Usage {
        self.0
            .local
            .as_ref()
            .map(LocalView::usage)
            .unwrap_or_default()
    }

    fn cpu_ns(&self) -> Option<u64> {
        self.0.local.as_ref()?.cpu_ns()
    }

    fn replaced_image_files(&self, dirs: &[&str]) -> Vec<String> {
        self.0
            .local
            .as_ref()
            .map(|l| l.replaced_image_files(dirs))
            .unwrap_or_default()
    }

    fn is_alive(&self) -> bool {
        self.0.alive.get()
    }

    async fn stop(&self) {
        let inner = &self.0;
        // Unregistered first: the removal's own `die` and `destroy` need no check.
        inner.alive.end();
        if let Err(e) = remove(&inner.docker, &inner.id).await {
            tracing::warn!(container = %inner.id, error = %e, "removing the container");
        }
    }
}

impl Drop for DockerSandbox {
    /// A sandbox dropped without `stop` (the edge failed to register it) must not leave
    /// its container running.
    fn drop(&mut self) {
        if !self.0.alive.get() {
            return;
        }
        let inner = Arc::clone(&self.0);
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = remove(&inner.docker, &inner.id).await;
            });
        }
    }
}
