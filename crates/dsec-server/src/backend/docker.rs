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

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::Seek;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::body::Bytes;
use bollard::container::LogOutput;
use bollard::errors::Error as DockerError;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::models::{ContainerCreateBody, HostConfig, HostConfigLogConfig};
use bollard::query_parameters::{
    ContainerArchiveInfoOptionsBuilder, CreateContainerOptionsBuilder, CreateImageOptionsBuilder,
    DownloadFromContainerOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use bollard::Docker;
use dsec_api::{FileInfo, Usage};
use dsec_runtime::cgroup::CgroupReader;
use dsec_runtime::files::{relative, FileError, FileOp, Refusal};
use dsec_runtime::procfs::pid_namespace;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};

use super::files::{upload_pieces, FILE_CHUNK};
use super::{
    Backend, CommandSpec, Created, ExitStatus, FileRead, ImageDefaults, Output, OutputStream,
    Sandbox, SandboxRequest, Upload,
};
use crate::error::ApiError;

const MIB: i64 = 1 << 20;
/// How long `create` waits for the daemon to answer a ping.
const PING_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on every other request that is not a stream.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a pull may take before `create` gives up on it.
const PULL_TIMEOUT: Duration = Duration::from_secs(300);
/// How often a running command's exec is inspected. The attach stream usually ends when
/// the command does, but background processes holding its pipes keep it open (Docker
/// then waits up to 2 s); the poll notices the exit regardless.
const EXIT_POLL: Duration = Duration::from_millis(250);
/// After the exec was seen to exit, output is read until it pauses this long (what the
/// command wrote may still be in transit through the daemon)...
const DRAIN: Duration = Duration::from_millis(50);
/// ...but not longer than this: background processes may hold its pipes forever.
const DRAIN_MAX: Duration = Duration::from_secs(2);
/// After a timeout's kill, how long to wait for the exec to be reported gone.
const KILL_GRACE: Duration = Duration::from_secs(5);
/// Symbolic links followed while resolving one path (the kernel's limit).
const MAX_LINKS: usize = 40;
/// Go's `os.FileMode` bits in the archive API's stat header.
const GO_MODE_DIR: u32 = 1 << 31;
const GO_MODE_SYMLINK: u32 = 1 << 27;
const GO_MODE_DEVICE: u32 = 1 << 26;
const GO_MODE_NAMED_PIPE: u32 = 1 << 25;
const GO_MODE_SOCKET: u32 = 1 << 24;
const GO_MODE_CHAR_DEVICE: u32 = 1 << 21;
const GO_MODE_IRREGULAR: u32 = 1 << 19;
/// The container's kernel interfaces, never handed to the daemon: (top directory, the
/// filesystem named in the refusal; none for `/dev`).
const KERNEL_DIRS: &[(&str, Option<&str>)] = &[
    ("proc", Some("procfs")),
    ("sys", Some("sysfs")),
    ("dev", None),
];
/// Bound on the archive of a directory being listed (the daemon sends contents too).
const MAX_LIST_ARCHIVE: u64 = 1 << 30;
/// Bound on the archive of a symbolic link.
const MAX_LINK_ARCHIVE: u64 = 64 << 10;
/// A file's archive beyond its size: headers, long names, padding.
const ARCHIVE_OVERHEAD: u64 = 64 << 10;

/// Paths hidden from the sandbox: the native backend's list (Docker's own lacks the kpage*
/// files).
const MASKED_PATHS: &[&str] = dsec_runtime::rootfs::MASKED_PATHS;

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
            edge,
            client: tokio::sync::Mutex::new(None),
            no_storage_quota: AtomicBool::new(false),
        }
    }

    fn unreachable(&self, why: impl std::fmt::Display) -> ApiError {
        ApiError::unavailable(format!(
            "backend \"docker\" is unavailable: the Docker daemon at {} is not reachable ({why}); \
             start dockerd or set DOCKER_HOST for the server",
            self.host
        ))
    }

    /// The connection, made (version negotiated, leftovers removed) on first use.
    async fn docker(&self) -> Result<Docker, ApiError> {
        let mut slot = self.client.lock().await;
        let docker = match slot.as_ref() {
            Some(d) => d.clone(),
            None => {
                let d = Docker::connect_with_defaults()
                    .map_err(|e| self.unreachable(e))?
                    .with_timeout(REQUEST_TIMEOUT);
                let d = tokio::time::timeout(PING_TIMEOUT, d.negotiate_version())
                    .await
                    .map_err(|_| self.unreachable("no answer within 3 s"))?
                    .map_err(|e| self.unreachable(e))?;
                self.remove_leftovers(&d).await;
                *slot = Some(d.clone());
                return Ok(d);
            }
        };
        drop(slot);
        match tokio::time::timeout(PING_TIMEOUT, docker.ping()).await {
            Ok(Ok(_)) => Ok(docker),
            Ok(Err(e)) => Err(self.unreachable(e)),
            Err(_) => Err(self.unreachable("no answer within 3 s")),
        }
    }

    /// Removes containers an earlier run of this server left (after a crash or SIGKILL);
    /// call at start-up. A daemon that is not there is not an error: the first `create`
    /// tries again.
    pub async fn clean_leftovers(&self) {
        if let Err(e) = self.docker().await {
            tracing::debug!(error = %e, "docker backend: daemon not reachable at start-up");
        }
    }

    async fn remove_leftovers(&self, docker: &Docker) {
        let filters = HashMap::from([(
            "label",
            vec![
                "dsec.managed=true".to_owned(),
                format!("dsec.edge={}", self.edge),
            ],
        )]);
        let opts = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        let containers = match docker.list_containers(Some(opts)).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "docker backend: listing leftover containers");
                return;
            }
        };
        for c in containers {
            let labels = c.labels.unwrap_or_default();
            // The daemon filtered on both labels; check again before removing anything.
            if labels.get("dsec.managed").map(String::as_str) != Some("true")
                || labels.get("dsec.edge") != Some(&self.edge)
            {
                continue;
            }
            let Some(id) = c.id else { continue };
            match remove(docker, &id).await {
                Ok(()) => tracing::info!(
                    container = %id,
                    sandbox = labels.get("dsec.id").map_or("?", String::as_str),
                    "removed a docker sandbox left by an earlier run"
                ),
                Err(e) => tracing::warn!(container = %id, error = %e, "removing leftover"),
            }
        }
    }

    /// The image's defaults, pulling it when the daemon does not have it.
    async fn image(&self, docker: &Docker, reference: &str) -> Result<ImageDefaults, ApiError> {
        let inspect = match docker.inspect_image(reference).await {
            Ok(i) => i,
            Err(e) if status(&e) == Some(404) => {
                self.pull(docker, reference).await?;
                docker
                    .inspect_image(reference)
                    .await
                    .map_err(|e| daemon_error(&self.host, "inspecting the pulled image", e))?
            }
            Err(e) => return Err(daemon_error(&self.host, "inspecting the image", e)),
        };
        let config = inspect.config.unwrap_or_default();
        Ok(ImageDefaults {
            env: config.env.unwrap_or_default(),
            workdir: config.working_dir.filter(|w| !w.is_empty()),
        })
    }

    async fn pull(&self, docker: &Docker, reference: &str) -> Result<(), ApiError> {
        tracing::info!(image = %reference, "docker backend: pulling image");
        let opts = CreateImageOptionsBuilder::new()
            .from_image(reference)
            .build();
        let mut progress = docker.create_image(Some(opts), None, None);
        let pulled = tokio::time::timeout(PULL_TIMEOUT, async {
            while let Some(step) = progress.next().await {
                step?;
            }
            Ok::<(), DockerError>(())
        })
        .await;
        let why = match pulled {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no result in {} s", PULL_TIMEOUT.as_secs()),
        };
        Err(ApiError::not_found(format!(
            "docker image {reference:?} not found: the daemon does not have it and pulling it \
             failed ({why}); load or build it into the daemon first"
        )))
    }

    fn container_config(&self, req: &SandboxRequest, quota: bool) -> ContainerCreateBody {
        let labels = HashMap::from([
            ("dsec.managed".to_owned(), "true".to_owned()),
            ("dsec.id".to_owned(), req.id.clone()),
            ("dsec.edge".to_owned(), self.edge.clone()),
        ]);
        let memory = req.memory_mb as i64 * MIB;
        let host_config = HostConfig {
            nano_cpus: Some((req.cpus * 1e9).round() as i64),
            memory: Some(memory),
            // Equal to the memory limit: no swap, so the limit is the limit.
            memory_swap: Some(memory),
            pids_limit: Some(req.pids as i64),
            network_mode: Some("none".to_owned()),
            init: Some(true),
            cap_drop: Some(vec!["ALL".to_owned()]),
            cap_add: Some(
                dsec_runtime::caps::KEPT
                    .iter()
                    .map(ToString::to_string)
                    .collect(),
            ),
            security_opt: Some(vec!["no-new-privileges".to_owned()]),
            masked_paths: Some(MASKED_PATHS.iter().map(|p| (*p).to_owned()).collect()),
            storage_opt: quota
                .then(|| HashMap::from([("size".to_owned(), format!("{}m", req.disk_mb))])),
            log_config: Some(HostConfigLogConfig {
                typ: Some("none".to_owned()),
                config: None,
            }),
            ..Default::default()
        };
        ContainerCreateBody {
            image: Some(req.image.clone()),
            hostname: Some(req.id.clone()),
            entrypoint: Some(vec!["sleep".to_owned()]),
            cmd: Some(vec!["infinity".to_owned()]),
            labels: Some(labels),
            network_disabled: Some(true),
            host_config: Some(host_config),
            ..Default::default()
        }
    }

    /// Creates the container, with a disk quota when the daemon can enforce one.
    async fn create_container(
        &self,
        docker: &Docker,
        req: &SandboxRequest,
    ) -> Result<String, ApiError> {
        let name = format!("dsec-{}", req.id);
        let opts = || Some(CreateContainerOptionsBuilder::new().name(&name).build());
        let quota = !self.no_storage_quota.load(Ordering::Relaxed);
        match docker
            .create_container(opts(), self.container_config(req, quota))
            .await
        {
            Ok(r) => Ok(r.id),
            Err(e) if quota && is_storage_opt_refusal(&e) => {
                if !self.no_storage_quota.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        error = %e,
                        "docker backend: the daemon's storage driver cannot limit a container's \
                         writable layer; disk_mb is not enforced on docker sandboxes"
                    );
                }
                docker
                    .create_container(opts(), self.container_config(req, false))
                    .await
                    .map(|r| r.id)
                    .map_err(|e| daemon_error(&self.host, "creating the container", e))
            }
            Err(e) => Err(daemon_error(&self.host, "creating the container", e)),
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
            Ok(state.pid.unwrap_or_default() as i32)
        }
        .await;
        let pid = started?;
        let local = LocalView::find(&id, pid);
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
            alive: AtomicBool::new(true),
            local,
        });
        tokio::spawn(watch(Arc::clone(&inner)));
        unfinished.id = None;
        Ok(Created {
            sandbox: Box::new(DockerSandbox(inner)),
            image,
        })
    }
}

/// A container whose sandbox was not handed over yet: dropped armed, it is removed.
struct Unfinished {
    docker: Docker,
    id: Option<String>,
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else { return };
        let docker = self.docker.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = remove(&docker, &id).await {
                    tracing::warn!(container = %id, error = %e, "removing an unfinished container");
                }
            });
        }
    }
}

/// Marks the sandbox dead once its container stops.
async fn watch(inner: Arc<Inner>) {
    let mut wait = inner.docker.wait_container(&inner.id, None);
    loop {
        // Errors include "exited non-zero": ask the daemon what state it is in.
        let _ = wait.next().await;
        match inner.docker.inspect_container(&inner.id, None).await {
            Ok(c) if c.state.as_ref().and_then(|s| s.running) == Some(true) => {
                wait = inner.docker.wait_container(&inner.id, None);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Ok(_) => break,
            Err(e) if status(&e).is_some() => break,
            // The daemon went away: its containers are gone or unusable.
            Err(_) => break,
        }
    }
    inner.alive.store(false, Ordering::Release);
}

/// The container's cgroup and pid namespace as this host sees them; `None` when the daemon
/// runs elsewhere.
#[derive(Debug)]
struct LocalView {
    /// Inode of the container's pid namespace: every process killed must be in it.
    pidns: u64,
    /// Where usage and OOM kills are read; `None` when its memory controller is not
    /// mounted here.
    cgroup: Option<CgroupReader>,
    oom_seen: AtomicU64,
}

impl LocalView {
    fn find(container_id: &str, pid: i32) -> Option<LocalView> {
        if pid <= 0 {
            return None;
        }
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        if !cgroups.contains(container_id) {
            return None;
        }
        let pidns = pid_namespace(pid)?;
        if Some(pidns) == pid_namespace(std::process::id() as i32) {
            return None;
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let view = LocalView {
            pidns,
            cgroup: CgroupReader::from_proc(&mounts, &cgroups),
            oom_seen: AtomicU64::new(0),
        };
        view.oom_seen.store(view.oom_kills(), Ordering::Relaxed);
        Some(view)
    }

    fn oom_kills(&self) -> u64 {
        self.cgroup.as_ref().map_or(0, CgroupReader::oom_kills)
    }

    /// Whether the memory limit killed something since the last call.
    fn take_oom_kill(&self) -> bool {
        let now = self.oom_kills();
        self.oom_seen.swap(now, Ordering::AcqRel) < now
    }

    fn usage(&self) -> Usage {
        let usage = self
            .cgroup
            .as_ref()
            .map(CgroupReader::usage)
            .unwrap_or_default();
        Usage {
            memory_bytes: usage.memory_bytes,
            pids: usage.pids,
            cpu_ms: usage.cpu_ns as f64 / 1e6,
            memory_peak_bytes: usage.memory_peak_bytes,
            pids_limit_hits: usage.pids_limit_hits,
            oom_kills: self.oom_kills(),
            ..Usage::default()
        }
    }
}

/// One sandbox's container.
struct Inner {
    docker: Docker,
    host: String,
    id: String,
    alive: AtomicBool,
    local: Option<LocalView>,
}

impl Inner {
    /// Unpauses the container and checks that Docker agrees: its state can be flipped back
    /// to paused by a late event of the pause, so the unpause is repeated until it sticks.
    async fn unpause(&self) -> Result<(), ApiError> {
        for _ in 0..20 {
            match self.docker.unpause_container(&self.id).await {
                Ok(()) => {}
                Err(DockerError::DockerResponseServerError { message, .. })
                    if message.contains("is not paused") => {}
                Err(e) => return Err(daemon_error(&self.host, "resuming the container", e)),
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            let state = self
                .docker
                .inspect_container(&self.id, None)
                .await
                .map_err(|e| daemon_error(&self.host, "inspecting the container", e))?
                .state
                .unwrap_or_default();
            if state.paused != Some(true) {
                return Ok(());
            }
        }
        Err(ApiError::internal(
            "the docker daemon keeps reporting the container paused after unpause",
        ))
    }

    /// Kills the tree of exec `exec_id` (a no-op when the daemon is not on this host).
    async fn kill_exec(&self, exec_id: &str) {
        let Some(local) = &self.local else { return };
        let Ok(info) = self.docker.inspect_exec(exec_id).await else {
            return;
        };
        if info.running != Some(true) {
            return;
        }
        let (pid, ns) = (info.pid.unwrap_or_default() as i32, local.pidns);
        let _ =
            tokio::task::spawn_blocking(move || dsec_runtime::tree::kill_tree(pid, Some(ns))).await;
    }

    async fn stat(&self, path: &str) -> Result<Option<Stat>, ApiError> {
        let opts = ContainerArchiveInfoOptionsBuilder::new().path(path).build();
        match self
            .docker
            .get_container_archive_info(&self.id, Some(opts))
            .await
        {
            Ok(s) => Ok(Some(Stat {
                dir: s.file_mode & GO_MODE_DIR != 0,
                symlink: s.file_mode & GO_MODE_SYMLINK != 0,
                go_mode: s.file_mode,
                size: s.size.max(0) as u64,
            })),
            Err(e) if status(&e) == Some(404) => Ok(None),
            Err(e) => Err(daemon_error(&self.host, "reading the file's status", e)),
        }
    }

    /// The archive of `path` (a resolved path), spooled to an anonymous file; `None` when
    /// it is larger than `limit`.
    async fn download(&self, path: &str, limit: u64) -> Result<Option<File>, ApiError> {
        let opts = DownloadFromContainerOptionsBuilder::new()
            .path(path)
            .build();
        let stream = self.docker.download_from_container(&self.id, Some(opts));
        spool(stream, limit)
            .await
            .map_err(|e| daemon_error(&self.host, "reading from the container", e))
    }

    /// The raw target of the symbolic link at `path`, read from its one-entry archive.
    async fn link_target(&self, path: &str) -> Result<String, ApiError> {
        let tar = self
            .download(path, MAX_LINK_ARCHIVE)
            .await?
            .ok_or_else(|| ApiError::internal("the archive of a symbolic link is too large"))?;
        blocking(move || {
            let mut archive = tar::Archive::new(tar);
            let mut entries = archive.entries().map_err(io_internal)?;
            let entry = entries
                .next()
                .ok_or_else(|| ApiError::internal("empty archive for a symbolic link"))?
                .map_err(io_internal)?;
            let target = entry
                .link_name()
                .map_err(io_internal)?
                .ok_or_else(|| ApiError::internal("symbolic link without a target"))?;
            Ok(target.to_string_lossy().into_owned())
        })
        .await
    }

    /// Resolves `path` inside the container the way the native backend's
    /// `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` does: every symbolic link is
    /// followed only while it stays beneath `/` (absolute targets are refused). Returns the
    /// resolved existing components, the components that do not exist, and the status of
    /// the last existing one.
    async fn resolve(&self, path: &str) -> Result<Resolved, ApiError> {
        let rel = relative(path)?;
        let mut todo: VecDeque<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let mut done: Vec<String> = Vec::new();
        let mut last = Stat::DIR;
        let mut links = 0;
        while let Some(comp) = todo.pop_front() {
            match comp.as_str() {
                "" | "." => continue,
                ".." => {
                    if done.pop().is_none() {
                        return Err(FileError::Escapes {
                            path: path.to_owned(),
                        }
                        .into());
                    }
                    last = Stat::DIR;
                    continue;
                }
                _ => {}
            }
            if !last.dir {
                return Err(FileError::WrongType {
                    path: path.to_owned(),
                    reason: "has a parent that is not a directory".into(),
                }
                .into());
            }
            let candidate = join(&done, Some(&comp));
            let Some(stat) = self.stat(&candidate).await? else {
                todo.push_front(comp);
                return Ok(Resolved {
                    existing: done,
                    missing: todo.into(),
                    last,
                });
            };
            if stat.symlink {
                links += 1;
                let target = self.link_target(&candidate).await?;
                if links > MAX_LINKS || target.starts_with('/') {
                    return Err(FileError::Escapes {
                        path: path.to_owned(),
                    }
                    .into());
                }
                for c in target.rsplit('/') {
                    todo.push_front(c.to_owned());
                }
                continue;
            }
            done.push(comp);
            last = stat;
        }
        Ok(Resolved {
            existing: done,
            missing: Vec::new(),
            last,
        })
    }
}

#[derive(Clone, Copy, Debug)]
struct Stat {
    dir: bool,
    symlink: bool,
    /// Go's `os.FileMode` of the path.
    go_mode: u32,
    size: u64,
}

impl Stat {
    /// The root, or a directory reached through `..`.
    const DIR: Stat = Stat {
        dir: true,
        symlink: false,
        go_mode: GO_MODE_DIR,
        size: 0,
    };

    /// Why this is neither a regular file nor a directory, if it is not.
    fn refusal(&self) -> Option<Refusal> {
        let m = self.go_mode;
        Some(if m & GO_MODE_NAMED_PIPE != 0 {
            Refusal::Fifo
        } else if m & GO_MODE_SOCKET != 0 {
            Refusal::Socket
        } else if m & GO_MODE_CHAR_DEVICE != 0 {
            Refusal::CharDevice
        } else if m & GO_MODE_DEVICE != 0 {
            Refusal::BlockDevice
        } else if m & GO_MODE_IRREGULAR != 0 {
            Refusal::Filesystem {
                name: "an irregular file".into(),
            }
        } else {
            return None;
        })
    }
}

struct Resolved {
    existing: Vec<String>,
    missing: Vec<String>,
    last: Stat,
}

impl Resolved {
    /// Refuses a path that is (or would be created) under the container's kernel
    /// interfaces, or that is neither a regular file nor a directory.
    fn check(&self, path: &str, op: FileOp) -> Result<(), FileError> {
        let refused = |refusal| FileError::Refused {
            path: path.to_owned(),
            op,
            refusal,
            link: None,
        };
        let top = self.existing.first().or(self.missing.first());
        let kernel = KERNEL_DIRS
            .iter()
            .find(|(dir, _)| top.is_some_and(|t| t == dir));
        if let Some((_, fs)) = kernel {
            return Err(refused(match fs {
                None => Refusal::SandboxDev,
                Some(name) => Refusal::Filesystem {
                    name: (*name).to_owned(),
                },
            }));
        }
        match self.last.refusal() {
            Some(r) if self.missing.is_empty() => Err(refused(r)),
            _ => Ok(()),
        }
    }
}

/// `/a/b` (plus `next`) from components.
fn join(components: &[String], next: Option<&str>) -> String {
    let mut out = String::from("/");
    out.push_str(&components.join("/"));
    if let Some(n) = next {
        if !components.is_empty() {
            out.push('/');
        }
        out.push_str(n);
    }
    out
}

fn not_found(path: &str) -> ApiError {
    FileError::NotFound {
        path: path.to_owned(),
    }
    .into()
}

fn io_internal(e: std::io::Error) -> ApiError {
    ApiError::internal(format!("reading the container's archive: {e}"))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
}

/// Writes a byte stream to an anonymous temporary file, rewound: memory stays bounded
/// whatever the size, and the disk by `limit` (`None` beyond it).
async fn spool<B: AsRef<[u8]>>(
    stream: impl Stream<Item = Result<B, DockerError>>,
    limit: u64,
) -> Result<Option<File>, DockerError> {
    let mut stream = std::pin::pin!(stream);
    let file = tempfile::tempfile().map_err(|err| DockerError::IOError { err })?;
    let mut out = tokio::fs::File::from_std(file);
    let mut written = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        written += chunk.as_ref().len() as u64;
        if written > limit {
            return Ok(None);
        }
        out.write_all(chunk.as_ref())
            .await
            .map_err(|err| DockerError::IOError { err })?;
    }
    let mut file = out.into_std().await;
    file.rewind().map_err(|err| DockerError::IOError { err })?;
    Ok(Some(file))
}

/// Removes a container and its anonymous volumes; a container already gone is success.
async fn remove(docker: &Docker, id: &str) -> Result<(), DockerError> {
    let opts = RemoveContainerOptionsBuilder::new()
        .force(true)
        .v(true)
        .build();
    match docker.remove_container(id, Some(opts)).await {
        Err(e) if matches!(status(&e), Some(404) | Some(409)) => Ok(()),
        other => other,
    }
}

fn status(e: &DockerError) -> Option<u16> {
    match e {
        DockerError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

fn is_paused_refusal(e: &DockerError) -> bool {
    matches!(e, DockerError::DockerResponseServerError { status_code: 409, message }
        if message.contains("is paused"))
}

fn is_storage_opt_refusal(e: &DockerError) -> bool {
    matches!(e, DockerError::DockerResponseServerError { message, .. }
        if message.contains("storage-opt") || message.contains("storage opt")
            || message.contains("StorageOpt"))
}

/// A daemon failure as the API reports it: its own answers by status, a lost daemon as
/// `Unavailable`.
fn daemon_error(host: &str, what: &str, e: DockerError) -> ApiError {
    match &e {
        DockerError::DockerResponseServerError {
            status_code,
            message,
        } => match status_code {
            404 => ApiError::not_found(format!("{what}: {message}")),
            409 => ApiError::conflict(format!("{what}: {message}")),
            400 => ApiError::invalid(format!("{what}: {message}")),
            _ => ApiError::internal(format!(
                "{what}: the docker daemon answered {status_code}: {message}"
            )),
        },
        _ => ApiError::unavailable(format!(
            "{what}: the Docker daemon at {host} is not reachable: {e}"
        )),
    }
}

struct DockerSandbox(Arc<Inner>);

#[async_trait]
impl Sandbox for DockerSandbox {
    async fn exec(&self, cmd: CommandSpec) -> Result<Box<dyn OutputStream>, ApiError> {
        for f in cmd.files {
            self.write_file(&f.path, f.mode, Upload::whole(f.data))
                .await?;
        }
        let inner = &self.0;
        let attach_stdin = !cmd.stdin.is_empty();
        let program = cmd.argv.first().cloned().unwrap_or_default();
        let cwd = cmd.cwd.clone();
        let config = CreateExecOptions {
            attach_stdin: Some(attach_stdin),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(false),
            env: Some(cmd.env),
            cmd: Some(cmd.argv),
            working_dir: Some(cmd.cwd),
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
        let stdin = cmd.stdin;
        let stdin_task = attach_stdin.then(|| {
            tokio::spawn(async move {
                let _ = input.write_all(&stdin).await;
                let _ = input.shutdown().await;
            })
        });
        Ok(Box::new(DockerOutput {
            inner: Arc::clone(inner),
            exec_id: exec.id,
            output: Some(output),
            stdin_task,
            started,
            deadline: tokio::time::Instant::from_std(
                started + Duration::from_millis(cmd.timeout_ms),
            ),
            next_poll: tokio::time::Instant::from_std(started + EXIT_POLL),
            exited_at: None,
            last_output: tokio::time::Instant::from_std(started),
            give_up_at: None,
            max_output: cmd.max_output_bytes,
            sent: [0, 0],
            truncated: false,
            timed_out: false,
            done: false,
            program,
            cwd,
            held: None,
            seen_output: false,
            queue: VecDeque::new(),
        }))
    }

    async fn read_file(&self, path: &str, max_bytes: u64) -> Result<Box<dyn FileRead>, ApiError> {
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
        let path = path.to_owned();
        let (tar, start, size) = blocking(move || {
            let (start, size) = {
                let mut archive = tar::Archive::new(&tar);
                let mut entries = archive.entries().map_err(io_internal)?;
                let entry = entries
                    .next()
                    .ok_or_else(|| ApiError::internal("the daemon sent an empty archive"))?
                    .map_err(io_internal)?;
                if !entry.header().entry_type().is_file() {
                    return Err(FileError::WrongType {
                        path,
                        reason: "is not a regular file".into(),
                    }
                    .into());
                }
                (entry.raw_file_position(), entry.size())
            };
            Ok((tar, start, size))
        })
        .await?;
        let mut file = tokio::fs::File::from_std(tar);
        file.seek(std::io::SeekFrom::Start(start))
            .await
            .map_err(io_internal)?;
        Ok(Box::new(SpooledRead { file, left: size }))
    }

    async fn write_file(&self, path: &str, mode: u32, data: Upload) -> Result<(), ApiError> {
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
            _ => daemon_error(&inner.host, &format!("writing {path:?}"), e),
        })
    }

    async fn list_files(&self, path: &str) -> Result<Vec<FileInfo>, ApiError> {
        let inner = &self.0;
        let resolved = inner.resolve(path).await?;
        resolved.check(path, FileOp::List)?;
        if !resolved.missing.is_empty() {
            return Err(not_found(path));
        }
        if !resolved.last.dir {
            return Err(FileError::WrongType {
                path: path.to_owned(),
                reason: "is not a directory".into(),
            }
            .into());
        }
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
        blocking(move || list_tar(tar)).await
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

    fn is_alive(&self) -> bool {
        self.0.alive.load(Ordering::Acquire)
    }

    async fn stop(&self) {
        let inner = &self.0;
        if let Err(e) = remove(&inner.docker, &inner.id).await {
            tracing::warn!(container = %inner.id, error = %e, "removing the container");
        }
        inner.alive.store(false, Ordering::Release);
    }
}

impl Drop for DockerSandbox {
    /// A sandbox dropped without `stop` (the edge failed to register it) must not leave
    /// its container running.
    fn drop(&mut self) {
        if !self.0.alive.load(Ordering::Acquire) {
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

fn exec_error(inner: &Inner, e: DockerError) -> ApiError {
    match status(&e) {
        Some(409) => ApiError::conflict(format!("the container is not running: {e}")),
        _ => daemon_error(&inner.host, "starting the command", e),
    }
}

/// A tar holding the missing parent directories (mode 0755) and the file.
fn tar_head(names: &[String], size: u64, mode: u32) -> Result<Bytes, ApiError> {
    let mtime = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut builder = tar::Builder::new(Vec::with_capacity(4096));
    let err = |e: std::io::Error| ApiError::internal(format!("building the upload: {e}"));
    let (file, dirs) = names
        .split_last()
        .ok_or_else(|| ApiError::invalid("empty path"))?;
    let mut prefix = PathBuf::new();
    for d in dirs {
        prefix.push(d);
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        h.set_mtime(mtime);
        builder
            .append_data(&mut h, &prefix, std::io::empty())
            .map_err(err)?;
    }
    prefix.push(file);
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(mode & 0o7777);
    h.set_size(size);
    h.set_mtime(mtime);
    // The header (and a long name's extra entry) only: the contents follow as they come.
    builder
        .append_data(&mut h, &prefix, std::io::empty())
        .map_err(err)?;
    Ok(Bytes::from(std::mem::take(builder.get_mut())))
}

/// Zero bytes that complete the last 512-byte block of a `size`-byte entry.
fn tar_padding(size: u64) -> usize {
    ((512 - size % 512) % 512) as usize
}

/// A file's contents inside a spooled archive, read a chunk at a time.
struct SpooledRead {
    file: tokio::fs::File,
    left: u64,
}

#[async_trait]
impl FileRead for SpooledRead {
    async fn next(&mut self) -> Option<Result<Bytes, ApiError>> {
        if self.left == 0 {
            return None;
        }
        let mut chunk = vec![0; self.left.min(FILE_CHUNK as u64) as usize];
        let read = self.file.read_exact(&mut chunk).await;
        self.left = match read {
            Ok(_) => self.left - chunk.len() as u64,
            Err(_) => 0,
        };
        Some(read.map(|_| Bytes::from(chunk)).map_err(io_internal))
    }

    fn finished(&self) -> bool {
        self.left == 0
    }
}

/// The upload's contents and their exact length, which the archive's header needs first:
/// as they arrive when the client announced the length, else spooled to an anonymous
/// file.
async fn sized(
    mut data: Upload,
    path: &str,
) -> Result<(u64, BoxStream<'static, Result<Bytes, ApiError>>), ApiError> {
    if let Some(len) = data.declared_len() {
        return Ok((len, upload_pieces(data, path.to_owned()).boxed()));
    }
    let mut spool = tokio::fs::File::from_std(
        tempfile::tempfile().map_err(|e| ApiError::internal(format!("temporary file: {e}")))?,
    );
    let mut size = 0;
    loop {
        let (pieces, more) = data.chunk(path).await?;
        for piece in pieces {
            size += piece.len() as u64;
            spool.write_all(&piece).await.map_err(io_internal)?;
        }
        if !more {
            break;
        }
    }
    spool.rewind().await.map_err(io_internal)?;
    let chunks = tokio_util::io::ReaderStream::with_capacity(spool, FILE_CHUNK)
        .map(|r| r.map_err(io_internal));
    Ok((size, chunks.boxed()))
}

/// The direct children of the archived directory, sorted by name.
fn list_tar(tar: File) -> Result<Vec<FileInfo>, ApiError> {
    let mut archive = tar::Archive::new(tar);
    let mut base: Option<Vec<String>> = None;
    let mut out = Vec::new();
    for entry in archive.entries().map_err(io_internal)? {
        let entry = entry.map_err(io_internal)?;
        let path = entry.path().map_err(io_internal)?;
        let comps: Vec<String> = path
            .components()
            .filter_map(|c| match c {
                std::path::Component::Normal(n) => Some(n.to_string_lossy().into_owned()),
                _ => None,
            })
            .collect();
        // The first entry is the directory itself.
        let Some(base) = &base else {
            base = Some(comps);
            continue;
        };
        if comps.len() != base.len() + 1 || !comps.starts_with(base) {
            continue;
        }
        let header = entry.header();
        let kind = header.entry_type();
        let size = if kind.is_symlink() {
            entry
                .link_name()
                .ok()
                .flatten()
                .map_or(0, |l| l.as_os_str().len() as u64)
        } else {
            header.size().unwrap_or(0)
        };
        out.push(FileInfo {
            name: comps[comps.len() - 1].clone(),
            size,
            is_dir: kind.is_dir(),
            mode: header.mode().unwrap_or(0) & 0o7777,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

type LogStream = Pin<Box<dyn Stream<Item = Result<LogOutput, DockerError>> + Send>>;

/// A running exec: its demultiplexed output, bounded, then its exit.
struct DockerOutput {
    inner: Arc<Inner>,
    exec_id: String,
    output: Option<LogStream>,
    stdin_task: Option<tokio::task::JoinHandle<()>>,
    started: Instant,
    deadline: tokio::time::Instant,
    next_poll: tokio::time::Instant,
    exited_at: Option<tokio::time::Instant>,
    last_output: tokio::time::Instant,
    /// Set by a timeout: past it, the command is given up on even if it still runs (its
    /// tree could not be killed from here).
    give_up_at: Option<tokio::time::Instant>,
    max_output: u64,
    sent: [u64; 2],
    truncated: bool,
    timed_out: bool,
    done: bool,
    /// `argv[0]` and the working directory, to report a command that could not start.
    program: String,
    cwd: String,
    /// A first stdout chunk that looks like runc's "could not start" report, held until
    /// the exit code says whether it was one.
    held: Option<Vec<u8>>,
    seen_output: bool,
    queue: VecDeque<Result<Output, ApiError>>,
}

/// How runc reports, on the exec's stdout, a command it could not start.
const RUNC_LAUNCH_FAILURE: &[u8] = b"OCI runtime exec failed";

/// Why runc could not start a command, as the native backend reports it.
#[derive(Debug, PartialEq)]
enum LaunchFailure {
    /// The working directory: an `InvalidArgument` error.
    Cwd(String),
    /// The program: a message on stderr and a shell's exit code.
    Exec { code: i32, stderr: String },
}

/// Reads runc's report; `None` when it is not one dsec recognises.
fn launch_failure(report: &[u8], program: &str, cwd: &str) -> Option<LaunchFailure> {
    let text = String::from_utf8_lossy(report).to_lowercase();
    let errno = if text.contains("no such file or directory")
        || text.contains("executable file not found")
    {
        libc::ENOENT
    } else if text.contains("permission denied") {
        libc::EACCES
    } else if text.contains("not a directory") {
        libc::ENOTDIR
    } else if text.contains("exec format error") {
        libc::ENOEXEC
    } else {
        return None;
    };
    let err = std::io::Error::from_raw_os_error(errno);
    if text.contains("chdir to cwd") {
        return Some(LaunchFailure::Cwd(format!(
            "working directory {cwd:?}: {err}"
        )));
    }
    Some(LaunchFailure::Exec {
        code: if errno == libc::ENOENT { 127 } else { 126 },
        stderr: format!("dsec: cannot execute {program:?}: {err}\n"),
    })
}

impl DockerOutput {
    /// Queues a chunk of output, within its stream's bound.
    fn push(&mut self, stream: usize, data: &[u8]) {
        if let Some(chunk) = self.bound(stream, data) {
            self.queue.push_back(Ok(if stream == 0 {
                Output::Stdout(chunk)
            } else {
                Output::Stderr(chunk)
            }));
        }
    }

    /// Output as it arrives; a first chunk that may be runc's launch failure waits.
    fn take_output(&mut self, stream: usize, data: &[u8]) {
        self.last_output = tokio::time::Instant::now();
        if !self.seen_output && stream == 0 && data.starts_with(RUNC_LAUNCH_FAILURE) {
            self.seen_output = true;
            self.held = Some(data.to_vec());
            return;
        }
        self.seen_output = true;
        if let Some(held) = self.held.take() {
            self.push(0, &held);
        }
        self.push(stream, data);
    }

    /// Queues the end: the exit, or what runc's launch failure means.
    fn take_exit(&mut self, exit: Result<Output, ApiError>) {
        let Some(held) = self.held.take() else {
            self.queue.push_back(exit);
            return;
        };
        if let Ok(Output::Exit(mut status)) = exit {
            if matches!(status.exit_code, Some(126 | 127)) {
                match launch_failure(&held, &self.program, &self.cwd) {
                    Some(LaunchFailure::Cwd(message)) => {
                        self.queue.push_back(Err(ApiError::invalid(message)));
                        return;
                    }
                    Some(LaunchFailure::Exec { code, stderr }) => {
                        self.push(1, stderr.as_bytes());
                        status.exit_code = Some(code);
                        self.queue.push_back(Ok(Output::Exit(status)));
                        return;
                    }
                    None => {}
                }
            }
            self.push(0, &held);
            self.queue.push_back(Ok(Output::Exit(status)));
            return;
        }
        self.push(0, &held);
        self.queue.push_back(exit);
    }

    /// Keeps what fits under the stream's bound; the rest is dropped and flagged.
    fn bound(&mut self, stream: usize, data: &[u8]) -> Option<Vec<u8>> {
        let room = self.max_output.saturating_sub(self.sent[stream]) as usize;
        let n = room.min(data.len());
        if n < data.len() {
            self.truncated = true;
        }
        self.sent[stream] += n as u64;
        (n > 0).then(|| data[..n].to_vec())
    }

    async fn time_out(&mut self) {
        self.timed_out = true;
        self.give_up_at = Some(tokio::time::Instant::now() + KILL_GRACE);
        self.inner.kill_exec(&self.exec_id).await;
    }

    /// The exit code, once the daemon reports the exec gone.
    async fn finish(&mut self) -> Result<Output, ApiError> {
        let mut wait = Duration::from_millis(2);
        let exit_code = loop {
            let info = self
                .inner
                .docker
                .inspect_exec(&self.exec_id)
                .await
                .map_err(|e| exec_error(&self.inner, e))?;
            if info.running != Some(true) {
                break info.exit_code.map(|c| c as i32);
            }
            let now = tokio::time::Instant::now();
            if !self.timed_out && now >= self.deadline {
                self.time_out().await;
            }
            if self.give_up_at.is_some_and(|t| now >= t) {
                tracing::warn!(exec = %self.exec_id, "a timed-out command is still running");
                break None;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(EXIT_POLL);
        };
        if let Some(task) = self.stdin_task.take() {
            task.abort();
        }
        self.done = true;
        let oom_killed = self
            .inner
            .local
            .as_ref()
            .is_some_and(LocalView::take_oom_kill);
        Ok(Output::Exit(ExitStatus {
            exit_code: if self.timed_out { None } else { exit_code },
            timed_out: self.timed_out,
            truncated: self.truncated,
            oom_killed,
            duration_ms: self.started.elapsed().as_secs_f64() * 1000.0,
        }))
    }
}

#[async_trait]
impl OutputStream for DockerOutput {
    async fn next(&mut self) -> Option<Result<Output, ApiError>> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Some(event);
            }
            if self.done {
                return None;
            }
            let Some(output) = self.output.as_mut() else {
                let exit = self.finish().await;
                self.done = true;
                self.take_exit(exit);
                continue;
            };
            // Output stops being read shortly after the exit, or when a timed-out command
            // outlives its grace.
            let drained = self
                .exited_at
                .map(|t| (self.last_output.max(t) + DRAIN).min(t + DRAIN_MAX));
            let stop_reading = match (drained, self.give_up_at) {
                (Some(d), Some(g)) => Some(d.min(g)),
                (d, g) => d.or(g),
            };
            tokio::select! {
                biased;
                item = output.next() => match item {
                    Some(Ok(LogOutput::StdOut { message })) => self.take_output(0, &message),
                    Some(Ok(LogOutput::StdErr { message })) => self.take_output(1, &message),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "docker exec output ended with an error");
                        self.output = None;
                    }
                    None => self.output = None,
                },
                _ = tokio::time::sleep_until(self.deadline), if !self.timed_out => {
                    self.time_out().await;
                }
                _ = tokio::time::sleep_until(self.next_poll), if self.exited_at.is_none() => {
                    match self.inner.docker.inspect_exec(&self.exec_id).await {
                        Ok(info) if info.running == Some(false) => {
                            self.exited_at = Some(tokio::time::Instant::now());
                        }
                        _ => self.next_poll = tokio::time::Instant::now() + EXIT_POLL,
                    }
                }
                _ = tokio::time::sleep_until(stop_reading.unwrap_or(self.deadline)), if stop_reading.is_some() => {
                    self.output = None;
                }
            }
        }
    }
}

impl Drop for DockerOutput {
    /// A caller that stops listening (a client that went away mid-stream) must not leave
    /// the command running.
    fn drop(&mut self) {
        if let Some(task) = self.stdin_task.take() {
            task.abort();
        }
        if self.done {
            return;
        }
        let (inner, exec_id) = (Arc::clone(&self.inner), self.exec_id.clone());
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move { inner.kill_exec(&exec_id).await });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn runc_launch_failures_read_like_the_native_ones() {
        let not_found = b"OCI runtime exec failed: exec failed: unable to start container \
            process: exec: \"/no/such\": stat /no/such: no such file or directory: unknown\r\n";
        assert_eq!(
            launch_failure(not_found, "/no/such", "/"),
            Some(LaunchFailure::Exec {
                code: 127,
                stderr: "dsec: cannot execute \"/no/such\": No such file or directory \
                         (os error 2)\n"
                    .into()
            })
        );
        let cwd = b"OCI runtime exec failed: exec failed: unable to start container process: \
            chdir to cwd (\"/no/dir\") set in config.json failed: no such file or directory";
        assert_eq!(
            launch_failure(cwd, "pwd", "/no/dir"),
            Some(LaunchFailure::Cwd(
                "working directory \"/no/dir\": No such file or directory (os error 2)".into()
            ))
        );
        assert_eq!(
            launch_failure(b"OCI runtime exec failed: other", "x", "/"),
            None
        );
    }

    #[test]
    fn join_makes_absolute_paths() {
        assert_eq!(join(&[], None), "/");
        assert_eq!(join(&[], Some("a")), "/a");
        assert_eq!(join(&["a".into(), "b".into()], Some("c")), "/a/b/c");
    }

    #[test]
    fn upload_tar_holds_missing_parents_then_the_file() {
        let long = "n".repeat(150);
        for name in ["f.txt", long.as_str()] {
            let names = ["a".to_owned(), "b".to_owned(), name.to_owned()];
            let contents = vec![7u8; 700];
            // As the upload streams it: the head, the contents, the padding and the end.
            let mut tar = tar_head(&names, contents.len() as u64, 0o640)
                .unwrap()
                .to_vec();
            tar.extend_from_slice(&contents);
            tar.resize(tar.len() + tar_padding(contents.len() as u64) + 1024, 0);
            assert_eq!(tar.len() % 512, 0);
            let mut archive = tar::Archive::new(&tar[..]);
            let entries: Vec<(String, u32, bool, Vec<u8>)> = archive
                .entries()
                .unwrap()
                .map(|e| {
                    let mut e = e.unwrap();
                    let mut data = Vec::new();
                    std::io::Read::read_to_end(&mut e, &mut data).unwrap();
                    (
                        e.path().unwrap().to_string_lossy().into_owned(),
                        e.header().mode().unwrap(),
                        e.header().entry_type().is_dir(),
                        data,
                    )
                })
                .collect();
            assert_eq!(
                entries,
                vec![
                    ("a".into(), 0o755, true, vec![]),
                    ("a/b".into(), 0o755, true, vec![]),
                    (format!("a/b/{name}"), 0o640, false, contents),
                ]
            );
        }
    }

    #[test]
    fn listing_keeps_direct_children_only() {
        let mut builder = tar::Builder::new(Vec::new());
        for (path, dir) in [("ls", true), ("ls/a.txt", false), ("ls/sub", true)] {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(if dir {
                tar::EntryType::Directory
            } else {
                tar::EntryType::Regular
            });
            h.set_mode(if dir { 0o755 } else { 0o640 });
            h.set_size(if dir { 0 } else { 3 });
            let data: &[u8] = if dir { b"" } else { b"abc" };
            builder.append_data(&mut h, path, data).unwrap();
        }
        let mut h = tar::Header::new_gnu();
        h.set_size(0);
        h.set_mode(0o644);
        builder
            .append_data(&mut h, "ls/sub/deep", &b""[..])
            .unwrap();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&builder.into_inner().unwrap()).unwrap();
        file.rewind().unwrap();
        let list = list_tar(file).unwrap();
        let names: Vec<(&str, u64, bool, u32)> = list
            .iter()
            .map(|f| (f.name.as_str(), f.size, f.is_dir, f.mode))
            .collect();
        assert_eq!(
            names,
            vec![("a.txt", 3, false, 0o640), ("sub", 0, true, 0o755)]
        );
    }
}
