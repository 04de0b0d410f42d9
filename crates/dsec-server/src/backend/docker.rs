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
//!   symbolic links and relative ones that climb out are refused;
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
use dsec_runtime::files::{relative, FileError};
use futures::{Stream, StreamExt};
use tokio::io::AsyncWriteExt;

use super::{
    Backend, CommandSpec, Created, ExitStatus, ImageDefaults, Output, OutputStream, Sandbox,
    SandboxRequest,
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
            layers: Vec::new(),
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
    memory: Option<PathBuf>,
    pids: Option<PathBuf>,
    cpuacct: Option<PathBuf>,
    /// cgroup v2 keeps every controller in one directory.
    unified: bool,
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
        let pidns = pidns_of(pid)?;
        if Some(pidns) == pidns_of(std::process::id() as i32) {
            return None;
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let (mut memory, mut pids, mut cpuacct, mut unified) = (None, None, None, false);
        for line in cgroups.lines() {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = match (parts.next(), parts.next(), parts.next()) {
                (Some(a), Some(b), Some(c)) => (a, b, c),
                _ => continue,
            };
            let path = path.trim_start_matches('/');
            if controllers.is_empty() {
                if let Some(mnt) = cgroup_mount(&mounts, None) {
                    let dir = mnt.join(path);
                    if memory.is_none() && dir.join("memory.current").exists() {
                        unified = true;
                        memory = Some(dir.clone());
                        pids = Some(dir.clone());
                        cpuacct = Some(dir);
                    }
                }
                continue;
            }
            for ctl in controllers.split(',') {
                let slot = match ctl {
                    "memory" => &mut memory,
                    "pids" => &mut pids,
                    "cpuacct" => &mut cpuacct,
                    _ => continue,
                };
                if let Some(mnt) = cgroup_mount(&mounts, Some(ctl)) {
                    *slot = Some(mnt.join(path));
                    unified = false;
                }
            }
        }
        let view = LocalView {
            pidns,
            memory,
            pids,
            cpuacct,
            unified,
            oom_seen: AtomicU64::new(0),
        };
        view.oom_seen.store(view.oom_kills(), Ordering::Relaxed);
        Some(view)
    }

    fn oom_kills(&self) -> u64 {
        let Some(dir) = &self.memory else { return 0 };
        let file = if self.unified {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        std::fs::read_to_string(dir.join(file))
            .ok()
            .and_then(|s| field(&s, "oom_kill"))
            .unwrap_or(0)
    }

    /// Whether the memory limit killed something since the last call.
    fn take_oom_kill(&self) -> bool {
        let now = self.oom_kills();
        self.oom_seen.swap(now, Ordering::AcqRel) < now
    }

    fn usage(&self) -> Usage {
        let num = |dir: &Option<PathBuf>, file: &str| -> u64 {
            dir.as_ref()
                .and_then(|d| std::fs::read_to_string(d.join(file)).ok())
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0)
        };
        let (memory_bytes, cpu_ns) = if self.unified {
            let cpu_us = self
                .cpuacct
                .as_ref()
                .and_then(|d| std::fs::read_to_string(d.join("cpu.stat")).ok())
                .and_then(|s| field(&s, "usage_usec"))
                .unwrap_or(0);
            (num(&self.memory, "memory.current"), cpu_us * 1000)
        } else {
            (
                num(&self.memory, "memory.usage_in_bytes"),
                num(&self.cpuacct, "cpuacct.usage"),
            )
        };
        Usage {
            memory_bytes,
            pids: num(&self.pids, "pids.current"),
            cpu_ms: cpu_ns as f64 / 1e6,
        }
    }
}

/// The mount point of the v1 hierarchy holding `controller`, or of cgroup2 for `None`.
fn cgroup_mount(mountinfo: &str, controller: Option<&str>) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        let mount_point = pre.split_whitespace().nth(4)?;
        let mut post = post.split_whitespace();
        let fstype = post.next()?;
        let options = post.nth(1).unwrap_or_default();
        let found = match controller {
            None => fstype == "cgroup2",
            Some(c) => fstype == "cgroup" && options.split(',').any(|o| o == c),
        };
        found.then(|| PathBuf::from(mount_point))
    })
}

/// `key value` lines, as in `memory.events` or `cpu.stat`.
fn field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

fn pidns_of(pid: i32) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/pid"))
        .ok()
        .map(|m| m.ino())
}

/// (parent, session) of a process, from `/proc/<pid>/stat`.
fn parent_and_session(pid: i32) -> Option<(i32, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: parse after the last ')'.
    let mut rest = stat.rsplit_once(')')?.1.split_whitespace();
    let ppid = rest.nth(1)?.parse().ok()?;
    let session = rest.nth(1)?.parse().ok()?;
    Some((ppid, session))
}

/// Kills an exec's process tree: its main process (host pid `main`), the descendants, and
/// — when the main process leads its own session — every process still in that session.
/// Only processes in the container's pid namespace are ever signalled.
fn kill_exec_tree(main: i32, pidns: u64) {
    if main <= 0 || pidns_of(main) != Some(pidns) {
        return;
    }
    let own_session = parent_and_session(main).is_some_and(|(_, sid)| sid == main);
    let mut members = vec![main];
    for _ in 0..64 {
        for pid in &members {
            // SAFETY: kill(2) with integer arguments, on a process of this command.
            unsafe { libc::kill(*pid, libc::SIGSTOP) };
        }
        let before = members.len();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            break;
        };
        let procs: Vec<(i32, i32, i32)> = dir
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter_map(|pid| parent_and_session(pid).map(|(pp, sid)| (pid, pp, sid)))
            .collect();
        // Children found in one pass let their own children join in the next one.
        for (pid, ppid, sid) in procs {
            if members.contains(&pid) {
                continue;
            }
            let related = members.contains(&ppid) || (own_session && sid == main);
            if related && pidns_of(pid) == Some(pidns) {
                members.push(pid);
            }
        }
        if members.len() == before {
            break;
        }
    }
    for pid in &members {
        // SAFETY: kill(2) with integer arguments, on a process of this command.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
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
        let _ = tokio::task::spawn_blocking(move || kill_exec_tree(pid, ns)).await;
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
            })),
            Err(e) if status(&e) == Some(404) => Ok(None),
            Err(e) => Err(daemon_error(&self.host, "reading the file's status", e)),
        }
    }

    /// The archive of `path` (a resolved path), spooled to an anonymous file.
    async fn download(&self, path: &str) -> Result<File, ApiError> {
        let opts = DownloadFromContainerOptionsBuilder::new()
            .path(path)
            .build();
        let stream = self.docker.download_from_container(&self.id, Some(opts));
        spool(stream)
            .await
            .map_err(|e| daemon_error(&self.host, "reading from the container", e))
    }

    /// The raw target of the symbolic link at `path`, read from its one-entry archive.
    async fn link_target(&self, path: &str) -> Result<String, ApiError> {
        let tar = self.download(path).await?;
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
        let mut last = Stat {
            dir: true,
            symlink: false,
        };
        let mut links = 0;
        while let Some(comp) = todo.pop_front() {
            match comp.as_str() {
                "" | "." => continue,
                ".." => {
                    if done.pop().is_none() {
                        return Err(FileError::Escapes(path.to_owned()).into());
                    }
                    last = Stat {
                        dir: true,
                        symlink: false,
                    };
                    continue;
                }
                _ => {}
            }
            if !last.dir {
                return Err(FileError::WrongType {
                    path: path.to_owned(),
                    reason: "a parent is not a directory".into(),
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
                    return Err(FileError::Escapes(path.to_owned()).into());
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
}

struct Resolved {
    existing: Vec<String>,
    missing: Vec<String>,
    last: Stat,
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
/// whatever the size.
async fn spool<B: AsRef<[u8]>>(
    stream: impl Stream<Item = Result<B, DockerError>>,
) -> Result<File, DockerError> {
    let mut stream = std::pin::pin!(stream);
    let file = tempfile::tempfile().map_err(|err| DockerError::IOError { err })?;
    let mut out = tokio::fs::File::from_std(file);
    while let Some(chunk) = stream.next().await {
        out.write_all(chunk?.as_ref())
            .await
            .map_err(|err| DockerError::IOError { err })?;
    }
    let mut file = out.into_std().await;
    file.rewind().map_err(|err| DockerError::IOError { err })?;
    Ok(file)
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
            self.write_file(&f.path, f.data, f.mode).await?;
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

    async fn read_file(&self, path: &str) -> Result<File, ApiError> {
        let inner = &self.0;
        let resolved = inner.resolve(path).await?;
        if !resolved.missing.is_empty() {
            return Err(FileError::NotFound(path.to_owned()).into());
        }
        if resolved.last.dir {
            return Err(FileError::WrongType {
                path: path.to_owned(),
                reason: "is a directory; use list_files".into(),
            }
            .into());
        }
        let tar = inner.download(&join(&resolved.existing, None)).await?;
        let path = path.to_owned();
        blocking(move || {
            let mut archive = tar::Archive::new(tar);
            let mut entries = archive.entries().map_err(io_internal)?;
            let mut entry = entries
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
            let mut out = tempfile::tempfile()
                .map_err(|e| ApiError::internal(format!("temporary file: {e}")))?;
            std::io::copy(&mut entry, &mut out).map_err(io_internal)?;
            out.rewind().map_err(io_internal)?;
            Ok(out)
        })
        .await
    }

    async fn write_file(&self, path: &str, data: Vec<u8>, mode: u32) -> Result<(), ApiError> {
        let inner = &self.0;
        let resolved = inner.resolve(path).await?;
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
            return Err(FileError::Escapes(path.to_owned()).into());
        }
        let tar = blocking(move || build_tar(&names, &data, mode)).await?;
        let opts = UploadToContainerOptionsBuilder::new()
            .path(&join(&dir, None))
            .no_overwrite_dir_non_dir("true")
            .build();
        inner
            .docker
            .upload_to_container(&inner.id, Some(opts), bollard::body_full(tar.into()))
            .await
            .map_err(|e| match &e {
                DockerError::DockerResponseServerError { message, .. }
                    if message.contains("no space left") || message.contains("quota") =>
                {
                    ApiError::from(FileError::NoSpace(path.to_owned()))
                }
                _ => daemon_error(&inner.host, &format!("writing {path:?}"), e),
            })
    }

    async fn list_files(&self, path: &str) -> Result<Vec<FileInfo>, ApiError> {
        let inner = &self.0;
        let resolved = inner.resolve(path).await?;
        if !resolved.missing.is_empty() {
            return Err(FileError::NotFound(path.to_owned()).into());
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
        let tar = inner.download(&archive_path).await?;
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
fn build_tar(names: &[String], data: &[u8], mode: u32) -> Result<Vec<u8>, ApiError> {
    let mtime = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut builder = tar::Builder::new(Vec::with_capacity(data.len() + 2048));
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
    h.set_size(data.len() as u64);
    h.set_mtime(mtime);
    builder.append_data(&mut h, &prefix, data).map_err(err)?;
    builder.into_inner().map_err(err)
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
        let names = ["a".to_owned(), "b".to_owned(), "f.txt".to_owned()];
        let tar = build_tar(&names, b"hi", 0o640).unwrap();
        let mut archive = tar::Archive::new(&tar[..]);
        let entries: Vec<(String, u32, bool)> = archive
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.path().unwrap().to_string_lossy().into_owned(),
                    e.header().mode().unwrap(),
                    e.header().entry_type().is_dir(),
                )
            })
            .collect();
        assert_eq!(
            entries,
            vec![
                ("a".into(), 0o755, true),
                ("a/b".into(), 0o755, true),
                ("a/b/f.txt".into(), 0o640, false),
            ]
        );
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

    #[test]
    fn cgroup_mounts_are_found_by_controller() {
        let mounts = "30 25 0:26 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n\
                      31 25 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup_mount(mounts, Some("memory")),
            Some(PathBuf::from("/sys/fs/cgroup/memory"))
        );
        assert_eq!(
            cgroup_mount(mounts, None),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(cgroup_mount(mounts, Some("pids")), None);
        assert_eq!(field("oom 0\noom_kill 3\n", "oom_kill"), Some(3));
    }
}
