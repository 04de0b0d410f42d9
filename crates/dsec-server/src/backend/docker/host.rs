//! The daemon and the host around it: the connection (negotiated once, pinged on every
//! `create`), images and containers as the Engine API makes them, the mapping of its
//! errors to the API's, and the container's processes and cgroup as this host sees them
//! (what a timeout kills and what usage is read from).

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bollard::errors::Error as DockerError;
use bollard::models::{ContainerCreateBody, DriverData, HostConfig, HostConfigLogConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, CreateImageOptionsBuilder, ListContainersOptionsBuilder,
    RemoveContainerOptionsBuilder,
};
use bollard::Docker;
use dsec_api::Usage;
use dsec_runtime::cgroup::CgroupReader;
use dsec_runtime::procfs::pid_namespace;
use futures::StreamExt;
use rustix::fs::{Mode, OFlags};

use super::{DockerBackend, Inner};
use crate::backend::{ImageDefaults, SandboxRequest};
use crate::error::ApiError;

const MIB: i64 = 1 << 20;
/// How long `create` waits for the daemon to answer a ping.
const PING_TIMEOUT: Duration = Duration::from_secs(3);
/// Bound on every other request that is not a stream.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a pull may take before `create` gives up on it.
const PULL_TIMEOUT: Duration = Duration::from_secs(300);
/// Paths hidden from the sandbox: the native backend's list (Docker's own lacks the kpage*
/// files).
const MASKED_PATHS: &[&str] = dsec_runtime::rootfs::MASKED_PATHS;

impl DockerBackend {
    fn unreachable(&self, why: impl std::fmt::Display) -> ApiError {
        ApiError::unavailable(format!(
            "backend \"docker\" is unavailable: the Docker daemon at {} is not reachable ({why}); \
             start dockerd or set DOCKER_HOST for the server",
            self.host
        ))
    }

    /// The connection, made (version negotiated, leftovers removed) on first use.
    pub(super) async fn docker(&self) -> Result<Docker, ApiError> {
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
    pub(super) async fn image(
        &self,
        docker: &Docker,
        reference: &str,
    ) -> Result<ImageDefaults, ApiError> {
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
        let memory = i64::try_from(req.memory_mb).map_or(i64::MAX, |mb| mb.saturating_mul(MIB));
        // CPUs the edge checked to a small positive number; `as` from f64 saturates regardless.
        #[allow(clippy::cast_possible_truncation)]
        let nano_cpus = (req.cpus * 1e9).round() as i64;
        let host_config = HostConfig {
            nano_cpus: Some(nano_cpus),
            memory: Some(memory),
            // Equal to the memory limit: no swap, so the limit is the limit.
            memory_swap: Some(memory),
            pids_limit: Some(i64::try_from(req.pids).unwrap_or(i64::MAX)),
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
    pub(super) async fn create_container(
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

/// A container whose sandbox was not handed over yet: dropped armed, it is removed.
pub(super) struct Unfinished {
    pub(super) docker: Docker,
    pub(super) id: Option<String>,
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

/// The container's cgroup and pid namespace as this host sees them; `None` when the daemon
/// runs elsewhere.
#[derive(Debug)]
pub(super) struct LocalView {
    /// Inode of the container's pid namespace: every process killed must be in it.
    pidns: u64,
    /// Where usage and OOM kills are read; `None` when its memory controller is not
    /// mounted here.
    cgroup: Option<CgroupReader>,
    oom_seen: AtomicU64,
    /// Its `overlay2` layers on this host, where what it changed of its image is read;
    /// `None` with another storage driver.
    layers: Option<OverlayLayers>,
}

/// A container's `overlay2` directories, as the daemon reports them.
#[derive(Debug)]
struct OverlayLayers {
    /// Its writable layer.
    upper: PathBuf,
    /// The image's layers (and Docker's own init layer), topmost first.
    lowers: Vec<PathBuf>,
}

impl OverlayLayers {
    fn from_driver(driver: Option<&DriverData>) -> Option<OverlayLayers> {
        let driver = driver.filter(|d| d.name == "overlay2")?;
        let upper = PathBuf::from(driver.data.get("UpperDir")?);
        let lowers = driver
            .data
            .get("LowerDir")
            .map(|l| l.split(':').map(PathBuf::from).collect())
            .unwrap_or_default();
        upper.is_dir().then_some(OverlayLayers { upper, lowers })
    }
}

impl LocalView {
    pub(super) fn find(
        container_id: &str,
        pid: i32,
        driver: Option<&DriverData>,
    ) -> Option<LocalView> {
        if pid <= 0 {
            return None;
        }
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        if !cgroups.contains(container_id) {
            return None;
        }
        let pidns = pid_namespace(pid)?;
        if Some(pidns)
            == i32::try_from(std::process::id())
                .ok()
                .and_then(pid_namespace)
        {
            return None;
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let view = LocalView {
            pidns,
            cgroup: CgroupReader::from_proc(&mounts, &cgroups),
            oom_seen: AtomicU64::new(0),
            layers: OverlayLayers::from_driver(driver),
        };
        view.oom_seen.store(view.oom_kills(), Ordering::Relaxed);
        Some(view)
    }

    /// Inode of the container's pid namespace.
    pub(super) fn pidns(&self) -> u64 {
        self.pidns
    }

    fn oom_kills(&self) -> u64 {
        self.cgroup.as_ref().map_or(0, CgroupReader::oom_kills)
    }

    /// Whether the memory limit killed something since the last call.
    pub(super) fn take_oom_kill(&self) -> bool {
        let now = self.oom_kills();
        self.oom_seen.swap(now, Ordering::AcqRel) < now
    }

    /// The image's files under `dirs` that the container overwrote or removed (see
    /// [`dsec_runtime::layers::replaced_image_files`]).
    pub(super) fn replaced_image_files(&self, dirs: &[&str]) -> Vec<String> {
        let Some(layers) = &self.layers else {
            return Vec::new();
        };
        match rustix::fs::open(
            &layers.upper,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(upper) => {
                let lowers = dsec_runtime::layers::open_layers(&layers.lowers);
                dsec_runtime::layers::replaced_image_files(upper.as_fd(), &lowers, dirs)
            }
            Err(_) => Vec::new(),
        }
    }

    /// The container's CPU time, alone (see [`CgroupReader::cpu_ns`]).
    pub(super) fn cpu_ns(&self) -> Option<u64> {
        Some(self.cgroup.as_ref()?.cpu_ns())
    }

    pub(super) fn usage(&self) -> Usage {
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
            cpu_throttled_ms: usage.cpu_throttled_ns as f64 / 1e6,
            ..Usage::default()
        }
    }
}

impl Inner {
    /// Unpauses the container and checks that Docker agrees: its state can be flipped back
    /// to paused by a late event of the pause, so the unpause is repeated until it sticks.
    pub(super) async fn unpause(&self) -> Result<(), ApiError> {
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
    pub(super) async fn kill_exec(&self, exec_id: &str) {
        let Some(local) = &self.local else { return };
        let Ok(info) = self.docker.inspect_exec(exec_id).await else {
            return;
        };
        if info.running != Some(true) {
            return;
        }
        let Ok(pid) = i32::try_from(info.pid.unwrap_or_default()) else {
            return;
        };
        let ns = local.pidns;
        let _ =
            tokio::task::spawn_blocking(move || dsec_runtime::tree::kill_tree(pid, Some(ns))).await;
    }
}

/// Removes a container and its anonymous volumes; a container already gone is success.
pub(super) async fn remove(docker: &Docker, id: &str) -> Result<(), DockerError> {
    let opts = RemoveContainerOptionsBuilder::new()
        .force(true)
        .v(true)
        .build();
    match docker.remove_container(id, Some(opts)).await {
        Err(e) if matches!(status(&e), Some(404) | Some(409)) => Ok(()),
        other => other,
    }
}

pub(super) fn status(e: &DockerError) -> Option<u16> {
    match e {
        DockerError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

pub(super) fn is_paused_refusal(e: &DockerError) -> bool {
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
pub(super) fn daemon_error(host: &str, what: &str, e: DockerError) -> ApiError {
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

pub(super) fn exec_error(inner: &Inner, e: DockerError) -> ApiError {
    match status(&e) {
        Some(409) => ApiError::conflict(format!("the container is not running: {e}")),
        _ => daemon_error(&inner.host, "starting the command", e),
    }
}
