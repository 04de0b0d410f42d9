//! The edge: owns the sandboxes of this host.
//!
//! It validates requests and fills in defaults, picks the backend, keeps the table of live
//! sandboxes, enforces `ttl_s` and `idle_ttl_s` with a reaper, and answers every
//! per-sandbox request after checking the sandbox's state.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use dsec_api::{
    Command, CreateSandboxRequest, ExecRequest, FileInfo, ImageInfo, Limits, Network, SandboxInfo,
    SandboxState,
};
use dsec_image::{Image, ImageStore};
use dsec_trajectory::{
    digest, FileDigest, ForkOf, SandboxLog, SandboxRecord, StepRequest, TrajectoryLog,
};
use rand::Rng;

use crate::backend::{
    Backends, CommandSpec, Created, FileWrite, OutputStream, Sandbox, SandboxRequest,
};
use crate::error::ApiError;
use crate::trajectory::{self, Decision, Position, Replayed};

/// Server-wide defaults and bounds, set by `dsec serve` flags.
#[derive(Clone, Debug)]
pub struct EdgeConfig {
    /// Prefix of sandbox ids: names this edge.
    pub name: String,
    /// Default CPU bandwidth in cores.
    pub cpus: f64,
    /// Default memory limit in MiB.
    pub memory_mb: u64,
    /// Default process limit.
    pub pids: u64,
    /// Default writable-layer size in MiB.
    pub disk_mb: u64,
    /// Default command timeout in seconds.
    pub timeout_s: f64,
    /// Default bound on each output stream.
    pub max_output_bytes: u64,
}

/// Upper bounds beyond which a limit is "absurd" rather than merely large.
const MAX_DISK_MB: u64 = 1 << 20;
const MAX_PIDS: u64 = 1 << 22;
const MIN_PIDS: u64 = 4;
const MIN_MEMORY_MB: u64 = 8;
const MAX_TTL_S: f64 = 30.0 * 86400.0;
const MAX_OUTPUT_BYTES: u64 = 1 << 30;
const MAX_FORKS: i64 = 256;
const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

struct Entry {
    info: SandboxInfo,
    image_layers: Vec<String>,
    env: Vec<String>,
    workdir: String,
    state: Mutex<SandboxState>,
    created: Instant,
    last_active: Mutex<Instant>,
    /// Commands in flight: a sandbox running one is not idle.
    busy: AtomicUsize,
    /// Where its next command goes in its trajectory.
    position: Position,
    /// The request it was created from, for its forks.
    request: CreateSandboxRequest,
    sandbox: Box<dyn Sandbox>,
}

impl Entry {
    fn touch(&self) {
        *self.last_active.lock().expect("lock") = Instant::now();
    }

    fn state(&self) -> SandboxState {
        *self.state.lock().expect("lock")
    }

    fn set_state(&self, state: SandboxState) {
        *self.state.lock().expect("lock") = state;
    }

    fn snapshot(&self) -> SandboxInfo {
        let mut info = self.info.clone();
        info.state = self.state();
        if matches!(info.state, SandboxState::Running | SandboxState::Paused) {
            info.usage = self.sandbox.usage();
        }
        info
    }

    fn expired(&self, now: Instant) -> bool {
        let past = |limit: Option<f64>, since: Instant| {
            limit.is_some_and(|s| now.duration_since(since) >= Duration::from_secs_f64(s))
        };
        let idle = self.busy.load(Ordering::Acquire) == 0
            && past(
                self.info.idle_ttl_s,
                *self.last_active.lock().expect("lock"),
            );
        past(self.info.ttl_s, self.created) || idle
    }
}

/// The sandboxes of this host.
pub struct Edge {
    config: EdgeConfig,
    host_cpus: f64,
    host_memory_mb: u64,
    images: ImageStore,
    backends: Backends,
    sandboxes: RwLock<HashMap<String, Arc<Entry>>>,
    log: TrajectoryLog,
}

/// A command started by [`Edge::exec`].
pub struct Execution {
    /// Its events.
    pub stream: Box<dyn OutputStream>,
    /// Served from the trajectory log: nothing ran.
    pub replayed: bool,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn host_memory_mb() -> u64 {
    // SAFETY: sysconf takes an integer and returns an integer.
    let (pages, page_size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages.max(0) as u64 * page_size.max(0) as u64) >> 20
}

fn host_cpus() -> f64 {
    // SAFETY: sysconf takes an integer and returns an integer.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    n.max(1) as f64
}

fn check_range<T: PartialOrd + std::fmt::Display + Copy>(
    name: &str,
    value: T,
    min: T,
    max: T,
    why_max: &str,
) -> Result<T, ApiError> {
    if value < min || value > max {
        return Err(ApiError::invalid(format!(
            "{name} must be between {min} and {max}{why_max}, got {value}"
        )));
    }
    Ok(value)
}

fn check_duration(name: &str, value: Option<f64>) -> Result<Option<f64>, ApiError> {
    match value {
        Some(v) if !v.is_finite() || v <= 0.0 || v > MAX_TTL_S => Err(ApiError::invalid(format!(
            "{name} must be a positive number of seconds up to {MAX_TTL_S}, got {v}"
        ))),
        other => Ok(other),
    }
}

fn check_absolute(name: &str, path: &str) -> Result<(), ApiError> {
    if !path.starts_with('/') || path.contains('\0') {
        return Err(ApiError::invalid(format!(
            "{name} must be an absolute path inside the sandbox, got {path:?}"
        )));
    }
    Ok(())
}

fn env_pairs(env: &BTreeMap<String, String>, what: &str) -> Result<Vec<String>, ApiError> {
    env.iter()
        .map(|(k, v)| {
            if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                Err(ApiError::invalid(format!(
                    "{what} variable {k:?} is invalid: names must be non-empty without '=' or NUL"
                )))
            } else {
                Ok(format!("{k}={v}"))
            }
        })
        .collect()
}

/// Later entries override earlier ones with the same name.
fn merge_env(layers: &[&[String]]) -> Vec<String> {
    let mut merged: Vec<String> = Vec::new();
    for entry in layers.iter().flat_map(|l| l.iter()) {
        let key = entry.split('=').next().unwrap_or_default();
        merged.retain(|e| e.split('=').next() != Some(key));
        merged.push(entry.clone());
    }
    merged
}

fn decode_b64(field: &str, data: &str) -> Result<Vec<u8>, ApiError> {
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| ApiError::invalid(format!("{field} is not valid base64: {e}")))
}

/// The policy a `network` field asks for: `InvalidArgument` naming a malformed rule, and
/// `Unavailable` for a network on a backend that cannot give one.
fn network_policy(backend: &str, network: &Network) -> Result<dsec_net::Policy, ApiError> {
    let policy = match network {
        Network::Enabled(false) => dsec_net::Policy::Off,
        Network::Enabled(true) => dsec_net::Policy::Full,
        Network::Allow { allow } => {
            dsec_net::Policy::allow(allow).map_err(|e| ApiError::invalid(e.to_string()))?
        }
    };
    if !policy.is_off() && backend != "container" {
        return Err(ApiError::unavailable(format!(
            "backend {backend:?} has no sandbox networking yet: only \"container\" sandboxes \
             take network=True or an allow-list"
        )));
    }
    Ok(policy)
}

/// `true` when the sandbox has every one of `labels`.
fn has_labels(info: &SandboxInfo, labels: &[(String, String)]) -> bool {
    labels
        .iter()
        .all(|(k, v)| info.labels.get(k).is_some_and(|x| x == v))
}

impl Edge {
    /// An edge with no sandboxes yet.
    pub fn new(
        config: EdgeConfig,
        images: ImageStore,
        backends: Backends,
        log: TrajectoryLog,
    ) -> Edge {
        Edge {
            config,
            host_cpus: host_cpus(),
            host_memory_mb: host_memory_mb(),
            images,
            backends,
            sandboxes: RwLock::default(),
            log,
        }
    }

    fn entry(&self, id: &str) -> Result<Arc<Entry>, ApiError> {
        let entry = self
            .sandboxes
            .read()
            .expect("lock")
            .get(id)
            .cloned()
            .ok_or_else(|| {
                ApiError::not_found(format!(
                    "sandbox {id:?} not found: it was stopped, expired, or never existed"
                ))
            })?;
        entry.touch();
        Ok(entry)
    }

    /// An entry that can take requests now; a paused sandbox is resumed transparently.
    async fn live_entry(&self, id: &str) -> Result<Arc<Entry>, ApiError> {
        let entry = self.entry(id)?;
        match entry.state() {
            SandboxState::Running => Ok(entry),
            SandboxState::Paused => {
                self.resume(id).await?;
                Ok(entry)
            }
            SandboxState::Failed => Err(ApiError::conflict(format!(
                "sandbox {id:?} has failed (its init exited); stop it and create a new one"
            ))),
            other => Err(ApiError::conflict(format!(
                "sandbox {id:?} is {}",
                other.as_str()
            ))),
        }
    }

    fn validate(&self, req: &CreateSandboxRequest) -> Result<(f64, u64, u64, u64), ApiError> {
        let cpus = req.cpus.unwrap_or(self.config.cpus);
        if !cpus.is_finite() {
            return Err(ApiError::invalid("cpus must be a finite number"));
        }
        let cpus = check_range("cpus", cpus, 0.01, self.host_cpus, " (this host's CPUs)")?;
        let mem = req.memory_mb.unwrap_or(self.config.memory_mb as i64);
        let mem = check_range(
            "memory_mb",
            mem,
            MIN_MEMORY_MB as i64,
            self.host_memory_mb as i64,
            " (this host's memory)",
        )?;
        let pids = req.pids.unwrap_or(self.config.pids as i64);
        let pids = check_range("pids", pids, MIN_PIDS as i64, MAX_PIDS as i64, "")?;
        let disk = req.disk_mb.unwrap_or(self.config.disk_mb as i64);
        let disk = check_range("disk_mb", disk, 1, MAX_DISK_MB as i64, "")?;
        Ok((cpus, mem as u64, pids as u64, disk as u64))
    }

    /// Creates a sandbox.
    pub async fn create(&self, req: CreateSandboxRequest) -> Result<SandboxInfo, ApiError> {
        self.create_from(req, None).await
    }

    /// Creates a sandbox; a fork's trajectory starts with its parent's first steps.
    async fn create_from(
        &self,
        req: CreateSandboxRequest,
        fork_of: Option<ForkOf>,
    ) -> Result<SandboxInfo, ApiError> {
        let request = req.clone();
        let backend = self.backends.get(&req.backend)?;
        let (cpus, memory_mb, pids, disk_mb) = self.validate(&req)?;
        let ttl_s = check_duration("ttl_s", req.ttl_s)?;
        let idle_ttl_s = check_duration("idle_ttl_s", req.idle_ttl_s)?;
        let network = network_policy(&req.backend, &req.network)?;
        if let Some(w) = &req.workdir {
            check_absolute("workdir", w)?;
        }
        if let Some(t) = &req.trajectory_id {
            if t.is_empty() || t.len() > 256 || t.contains('\0') {
                return Err(ApiError::invalid(format!(
                    "trajectory_id must be 1 to 256 characters without NUL, got {t:?}"
                )));
            }
        }
        let sandbox_env = env_pairs(&req.env, "environment")?;
        let id = format!(
            "{}-{:012x}",
            self.config.name,
            rand::rng().random::<u64>() & 0xffff_ffff_ffff
        );
        let started = Instant::now();
        let Created { sandbox, image } = backend
            .create(SandboxRequest {
                id: id.clone(),
                image: req.image.clone(),
                cpus,
                memory_mb,
                pids,
                disk_mb,
                ca_bundle: req.ca_bundle.unwrap_or(true),
                network,
            })
            .await?;
        metrics::histogram!("dsec_create_seconds", "backend" => req.backend.clone())
            .record(started.elapsed().as_secs_f64());
        metrics::counter!("dsec_sandboxes_created_total", "backend" => req.backend.clone())
            .increment(1);
        let image_env = if image.env.iter().any(|e| e.starts_with("PATH=")) {
            image.env.clone()
        } else {
            let mut env = vec![DEFAULT_PATH.to_owned()];
            env.extend(image.env.iter().cloned());
            env
        };
        let base_env = ["HOME=/root".to_owned(), format!("HOSTNAME={id}")];
        let workdir = req
            .workdir
            .clone()
            .or_else(|| image.workdir.clone().filter(|w| w.starts_with('/')))
            .unwrap_or_else(|| "/".to_owned());
        let info = SandboxInfo {
            id: id.clone(),
            backend: req.backend,
            image: req.image,
            state: SandboxState::Running,
            created_at: unix_now(),
            limits: Limits {
                cpus: Some(cpus),
                memory_mb: Some(memory_mb as i64),
                pids: Some(pids as i64),
                disk_mb: Some(disk_mb as i64),
            },
            ttl_s,
            idle_ttl_s,
            labels: req.labels,
            trajectory_id: req.trajectory_id,
            next_step: None,
            accelerator: sandbox.accelerator().map(str::to_owned),
            usage: Default::default(),
        };
        let registered = self.log.register(SandboxRecord {
            id: info.id.clone(),
            trajectory_id: info.trajectory_id.clone(),
            image: info.image.clone(),
            backend: info.backend.clone(),
            env: req.env.clone(),
            created_at: info.created_at,
            fork_of: fork_of.clone(),
        });
        // Only a trajectory id can be refused; otherwise the record commits with (or
        // before) the sandbox's first step, and nothing need wait for it.
        if info.trajectory_id.is_some() {
            if let Err(e) = registered.wait().await {
                sandbox.stop().await;
                return Err(e.into());
            }
        }
        let entry = Arc::new(Entry {
            position: Position::new(
                info.trajectory_id.clone(),
                fork_of.as_ref().map_or(0, |f| f.steps),
            ),
            info: info.clone(),
            image_layers: image.layers,
            env: merge_env(&[&base_env, &image_env, &sandbox_env]),
            workdir,
            state: Mutex::new(SandboxState::Running),
            created: Instant::now(),
            last_active: Mutex::new(Instant::now()),
            busy: AtomicUsize::new(0),
            request,
            sandbox,
        });
        self.sandboxes.write().expect("lock").insert(id, entry);
        Ok(info)
    }

    /// One sandbox's info.
    pub fn get(&self, id: &str) -> Result<SandboxInfo, ApiError> {
        Ok(self.entry(id)?.snapshot())
    }

    /// Sandboxes having all of `labels`, oldest first.
    pub fn list(&self, labels: &[(String, String)]) -> Vec<SandboxInfo> {
        let entries: Vec<Arc<Entry>> = self
            .sandboxes
            .read()
            .expect("lock")
            .values()
            .filter(|e| has_labels(&e.info, labels))
            .cloned()
            .collect();
        let mut infos: Vec<SandboxInfo> = entries.iter().map(|e| e.snapshot()).collect();
        infos.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        infos
    }

    /// Freezes a running sandbox: it uses no CPU until resumed (explicitly, or by the next
    /// request to it).
    pub async fn pause(&self, id: &str) -> Result<SandboxInfo, ApiError> {
        let entry = self.entry(id)?;
        match entry.state() {
            SandboxState::Paused => return Ok(entry.snapshot()),
            SandboxState::Running => {}
            other => {
                return Err(ApiError::conflict(format!(
                    "sandbox {id:?} is {} and cannot be paused",
                    other.as_str()
                )))
            }
        }
        if entry.busy.load(Ordering::Acquire) > 0 {
            return Err(ApiError::conflict(format!(
                "sandbox {id:?} is running a command; pause it between commands"
            )));
        }
        entry.sandbox.pause().await?;
        entry.set_state(SandboxState::Paused);
        Ok(entry.snapshot())
    }

    /// Thaws a paused sandbox; resuming a running one is harmless.
    pub async fn resume(&self, id: &str) -> Result<SandboxInfo, ApiError> {
        let entry = self.entry(id)?;
        if entry.state() == SandboxState::Paused {
            entry.sandbox.resume().await?;
            entry.set_state(SandboxState::Running);
        }
        Ok(entry.snapshot())
    }

    /// Stores a sandbox's filesystem as image `name` (default `<id>-snap-<random>`). The
    /// sandbox is frozen for the copy, a running command included: the image is one
    /// consistent point in time, and only the writable layer is copied.
    pub async fn snapshot(&self, id: &str, name: Option<String>) -> Result<ImageInfo, ApiError> {
        let entry = self.entry(id)?;
        let running = match entry.state() {
            SandboxState::Running => true,
            SandboxState::Paused => false,
            other => {
                return Err(ApiError::conflict(format!(
                    "sandbox {id:?} is {} and cannot be snapshotted",
                    other.as_str()
                )))
            }
        };
        let name = name.unwrap_or_else(|| format!("{id}-snap-{:08x}", rand::rng().random::<u32>()));
        if running {
            entry.sandbox.pause().await?;
        }
        let image = entry.sandbox.snapshot(&name).await;
        if running {
            entry.sandbox.resume().await?;
        }
        image
    }

    /// `n` new sandboxes from a sandbox's current filesystem, with its settings: the
    /// parent is snapshotted once (image `<id>-fork-<random>`, listed with the others so
    /// it can be deleted once the forks are done) and each child starts from it.
    pub async fn fork(&self, id: &str, n: i64) -> Result<Vec<SandboxInfo>, ApiError> {
        let n = check_range("n", n, 1, MAX_FORKS, "")? as usize;
        let parent = self.entry(id)?;
        // Holding the parent's trajectory position keeps its next step out until the fork
        // is done: the snapshot and the inherited steps describe the same point.
        let position = parent.position.hold().await;
        let name = format!("{id}-fork-{:08x}", rand::rng().random::<u32>());
        let image = self.snapshot(id, Some(name)).await?;
        let fork_of = match (&parent.request.trajectory_id, &position) {
            (Some(t), Some(next)) => Some(ForkOf {
                trajectory_id: t.clone(),
                steps: **next,
            }),
            _ => None,
        };
        let suffix = rand::rng().random::<u32>();
        let created = futures::future::join_all((0..n).map(|i| {
            let child = CreateSandboxRequest {
                image: image.name.clone(),
                trajectory_id: fork_of
                    .as_ref()
                    .map(|f| format!("{}.fork-{suffix:08x}-{i}", f.trajectory_id)),
                ..parent.request.clone()
            };
            self.create_from(child, fork_of.clone())
        }))
        .await;
        drop(position);
        let (ok, failed): (Vec<_>, Vec<_>) = created.into_iter().partition(Result::is_ok);
        let mut children: Vec<SandboxInfo> = ok.into_iter().flatten().collect();
        for c in &mut children {
            c.next_step = fork_of.as_ref().map(|f| f.steps);
        }
        if let Some(Err(e)) = failed.into_iter().next() {
            for c in &children {
                let _ = self.stop(&c.id).await;
            }
            // No child uses the fork's image now: it must not outlive the failed fork.
            let _ = self.delete_image(&image.name);
            return Err(e);
        }
        Ok(children)
    }

    /// Replaces the egress policy of a running sandbox.
    pub async fn set_network(&self, id: &str, network: &Network) -> Result<(), ApiError> {
        let entry = self.live_entry(id).await?;
        let policy = network_policy(&entry.info.backend, network)?;
        if policy.is_off() && entry.info.backend != "container" {
            return Ok(()); // other backends never have a network: nothing to take away
        }
        entry.sandbox.set_network(policy).await
    }

    /// A sandbox's network events: the connection attempts its policy refused lately.
    pub async fn network_info(&self, id: &str) -> Result<dsec_api::NetworkInfo, ApiError> {
        let refused = self.entry(id)?.sandbox.network_refused().await;
        Ok(dsec_api::NetworkInfo {
            refused: refused
                .into_iter()
                .map(|r| dsec_api::RefusedConnection {
                    time: r.time,
                    dst: r.dst.to_string(),
                    port: r.port,
                    protocol: r.protocol,
                })
                .collect(),
        })
    }

    /// Publishes `dsec_network_refused_total` (called before each metrics scrape): the
    /// refused-packet counters of the nftables rules, read now.
    pub async fn publish_network_metrics(&self) {
        let refused = self.backends.container.network_refused().await;
        metrics::counter!("dsec_network_refused_total").absolute(refused);
    }

    /// Stops and removes a sandbox.
    pub async fn stop(&self, id: &str) -> Result<(), ApiError> {
        let entry = self
            .sandboxes
            .write()
            .expect("lock")
            .remove(id)
            .ok_or_else(|| ApiError::not_found(format!("sandbox {id:?} not found")))?;
        entry.set_state(SandboxState::Stopping);
        entry.sandbox.stop().await;
        entry.set_state(SandboxState::Stopped);
        Ok(())
    }

    /// Stops every sandbox (server shutdown).
    pub async fn stop_all(&self) {
        let ids: Vec<String> = self
            .sandboxes
            .read()
            .expect("lock")
            .keys()
            .cloned()
            .collect();
        futures::future::join_all(ids.iter().map(|id| self.stop(id))).await;
    }

    /// Starts a command after writing its files.
    pub async fn exec(&self, id: &str, req: ExecRequest) -> Result<Execution, ApiError> {
        let entry = self.live_entry(id).await?;
        let argv = match req.cmd {
            Command::Shell(s) if s.is_empty() => {
                return Err(ApiError::invalid("cmd must not be empty"))
            }
            Command::Shell(s) => vec!["/bin/sh".to_owned(), "-c".to_owned(), s],
            Command::Argv(v) if v.is_empty() => {
                return Err(ApiError::invalid("cmd must not be an empty list"))
            }
            Command::Argv(v) => v,
        };
        if argv.iter().any(|a| a.contains('\0')) {
            return Err(ApiError::invalid("cmd must not contain NUL bytes"));
        }
        let timeout_s = req.timeout_s.unwrap_or(self.config.timeout_s);
        if !timeout_s.is_finite() || timeout_s <= 0.0 || timeout_s > MAX_TTL_S {
            return Err(ApiError::invalid(format!(
                "timeout_s must be a positive number of seconds up to {MAX_TTL_S}, got {timeout_s}"
            )));
        }
        let max_output = match req.max_output_bytes {
            None => self.config.max_output_bytes,
            Some(n) => check_range("max_output_bytes", n, 0, MAX_OUTPUT_BYTES as i64, "")? as u64,
        };
        let cwd = req.cwd.unwrap_or_else(|| entry.workdir.clone());
        check_absolute("cwd", &cwd)?;
        let stdin = match &req.stdin_b64 {
            Some(s) => decode_b64("stdin_b64", s)?,
            None => Vec::new(),
        };
        let cmd_env = env_pairs(&req.env, "environment")?;
        let mut files = Vec::with_capacity(req.files.len());
        for f in &req.files {
            check_absolute("files[].path", &f.path)?;
            files.push(FileWrite {
                path: f.path.clone(),
                data: decode_b64("files[].data_b64", &f.data_b64)?,
                mode: f.mode.unwrap_or(0o644) & 0o7777,
            });
        }
        let request = StepRequest {
            argv: argv.clone(),
            env: req.env.clone(),
            cwd: cwd.clone(),
            stdin_sha256: req.stdin_b64.as_ref().map(|_| digest(&stdin)),
            files: files
                .iter()
                .map(|f| FileDigest {
                    path: f.path.clone(),
                    sha256: digest(&f.data),
                    mode: f.mode,
                })
                .collect(),
            timeout_s: req.timeout_s,
        };
        let recorder =
            match trajectory::decide(&self.log, id, &entry.position, req.step, request).await? {
                Decision::Replay(result) => {
                    return Ok(Execution {
                        stream: Box::new(Replayed::new(result)),
                        replayed: true,
                    })
                }
                Decision::Run(recorder) => recorder,
            };
        let started = Instant::now();
        let stream = entry
            .sandbox
            .exec(CommandSpec {
                argv,
                env: merge_env(&[&entry.env, &cmd_env]),
                cwd,
                stdin,
                files,
                timeout_ms: (timeout_s * 1000.0).ceil() as u64,
                max_output_bytes: max_output,
            })
            .await;
        metrics::histogram!("dsec_exec_start_seconds", "backend" => entry.info.backend.clone())
            .record(started.elapsed().as_secs_f64());
        let inner = stream?;
        entry.busy.fetch_add(1, Ordering::AcqRel);
        Ok(Execution {
            stream: recorder.wrap(Box::new(Busy { inner, entry })),
            replayed: false,
        })
    }

    /// A sandbox's recorded commands (only those of `trajectory_id`, when given), from the
    /// trajectory log: readable after the sandbox is gone, and after a server restart.
    pub async fn sandbox_log(
        &self,
        id: &str,
        trajectory_id: Option<String>,
    ) -> Result<SandboxLog, ApiError> {
        self.log
            .sandbox_log(id, trajectory_id)
            .await?
            .ok_or_else(|| {
                ApiError::not_found(format!(
                    "sandbox {id:?} not found in the trajectory log: it never existed here"
                ))
            })
    }

    /// Records a finished command's latency.
    pub fn record_exec(&self, id: &str, seconds: f64) {
        let backend = self
            .sandboxes
            .read()
            .expect("lock")
            .get(id)
            .map_or_else(|| "unknown".to_owned(), |e| e.info.backend.clone());
        metrics::histogram!("dsec_exec_seconds", "backend" => backend).record(seconds);
    }

    /// Opens a file of a sandbox for reading.
    pub async fn read_file(&self, id: &str, path: &str) -> Result<File, ApiError> {
        self.live_entry(id).await?.sandbox.read_file(path).await
    }

    /// Writes a file into a sandbox.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        data: Vec<u8>,
        mode: u32,
    ) -> Result<(), ApiError> {
        check_absolute("path", path)?;
        self.live_entry(id)
            .await?
            .sandbox
            .write_file(path, data, mode & 0o7777)
            .await
    }

    /// Lists a directory of a sandbox.
    pub async fn list_files(&self, id: &str, path: &str) -> Result<Vec<FileInfo>, ApiError> {
        self.live_entry(id).await?.sandbox.list_files(path).await
    }

    /// Stops sandboxes past their TTL or idle TTL, and marks failed those whose init died.
    pub async fn reap_once(&self) {
        let now = Instant::now();
        let entries: Vec<Arc<Entry>> = self
            .sandboxes
            .read()
            .expect("lock")
            .values()
            .cloned()
            .collect();
        for entry in entries {
            let id = &entry.info.id;
            if entry.expired(now) {
                tracing::info!(sandbox = %id, "lifetime over; stopping");
                let _ = self.stop(id).await;
            } else if entry.state() == SandboxState::Running && !entry.sandbox.is_alive() {
                tracing::warn!(sandbox = %id, "init exited; sandbox failed");
                entry.set_state(SandboxState::Failed);
                entry.sandbox.stop().await;
            }
        }
    }

    /// Runs [`reap_once`](Self::reap_once) forever.
    pub async fn reaper(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        loop {
            tick.tick().await;
            self.reap_once().await;
        }
    }

    /// Publishes the sandbox gauges (called before each metrics scrape).
    pub fn publish_gauges(&self) {
        let mut counts: HashMap<(String, SandboxState), u64> = HashMap::new();
        for e in self.sandboxes.read().expect("lock").values() {
            *counts
                .entry((e.info.backend.clone(), e.state()))
                .or_default() += 1;
        }
        for backend in dsec_api::BACKENDS {
            for state in SandboxState::ALL {
                let n = counts
                    .get(&(backend.to_owned(), state))
                    .copied()
                    .unwrap_or(0);
                metrics::gauge!("dsec_sandboxes", "backend" => backend, "state" => state.as_str())
                    .set(n as f64);
            }
        }
    }

    /// Imports an image.
    pub async fn import_image(
        &self,
        source: &str,
        name: Option<&str>,
    ) -> Result<ImageInfo, ApiError> {
        Ok(image_info(self.images.import(source, name).await?))
    }

    /// All images.
    pub fn images(&self) -> Result<Vec<ImageInfo>, ApiError> {
        Ok(self.images.list()?.into_iter().map(image_info).collect())
    }

    /// One image.
    pub fn image(&self, name: &str) -> Result<ImageInfo, ApiError> {
        Ok(image_info(self.images.get(name)?))
    }

    /// Deletes an image; layers that live sandboxes use stay until those stop.
    pub fn delete_image(&self, name: &str) -> Result<(), ApiError> {
        let in_use: HashSet<String> = self
            .sandboxes
            .read()
            .expect("lock")
            .values()
            .flat_map(|e| e.image_layers.iter().cloned())
            .collect();
        Ok(self.images.remove(name, &in_use)?)
    }
}

/// Wraps a running command's output so that the sandbox counts as busy (not idle) until
/// the command ends or its caller goes away.
struct Busy {
    inner: Box<dyn OutputStream>,
    entry: Arc<Entry>,
}

#[async_trait::async_trait]
impl OutputStream for Busy {
    async fn next(&mut self) -> Option<Result<crate::backend::Output, ApiError>> {
        self.inner.next().await
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.entry.touch();
        self.entry.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The API's view of a stored image.
pub(crate) fn image_info(image: Image) -> ImageInfo {
    ImageInfo {
        name: image.name,
        id: image.id,
        size: image.size,
        layers: image.layers,
        created_at: image.created_at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_merge_lets_later_layers_win() {
        let image = vec!["PATH=/bin".to_owned(), "A=1".to_owned()];
        let cmd = vec!["A=2".to_owned()];
        assert_eq!(merge_env(&[&image, &cmd]), vec!["PATH=/bin", "A=2"]);
    }

    #[test]
    fn ranges_name_the_field_and_the_bound() {
        let err = check_range("pids", 0, 4, 10, "").unwrap_err();
        assert_eq!(err.kind, dsec_api::ErrorKind::InvalidArgument);
        assert!(
            err.message.contains("pids must be between 4 and 10"),
            "{}",
            err.message
        );
    }

    #[test]
    fn env_names_with_equals_are_refused() {
        let mut env = BTreeMap::new();
        env.insert("A=B".to_owned(), "x".to_owned());
        assert!(env_pairs(&env, "environment").is_err());
    }
}
