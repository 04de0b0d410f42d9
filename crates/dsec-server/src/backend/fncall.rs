//! `backend="fncall"`: stateless calls on pools of pre-warmed native containers.
//!
//! A fncall sandbox is only a handle (image + limits): every `run` takes a worker — a
//! native container created ahead of demand — from the pool of that image and limits and
//! runs the command in it, one call per worker at a time.
//!
//! Why a worker is pristine after a call: the call never runs in the worker itself. Its
//! first process is cloned into mount, pid and IPC namespaces of its own and builds its
//! own root (a fresh tmpfs writable layer over the image's layers, its own `/proc`, `/dev`
//! and `/tmp`), so every file it writes, every process it leaves behind (they die with
//! their pid namespace's PID 1) and every IPC object goes away when it exits. What the
//! worker shares with its calls — the network namespace (loopback only), the hostname
//! and the cgroups — cannot be changed without the capabilities and syscalls the call no
//! longer has. A call that timed out or hit its memory limit is not trusted to have left
//! nothing behind, and its worker is destroyed; so is a worker after
//! [`MAX_CALLS_PER_WORKER`] calls. A call that finds the pool empty waits (up to its
//! deadline) for the next worker, which costs no more than a container create.
//!
//! Each pool keeps `ready + creating` at a target that follows the call rate of the last
//! second (`rate × REFILL_HORIZON`, between the per-pool minimum and maximum), under a
//! global cap on warm workers; a pool unused for [`POOL_IDLE`] shrinks to nothing.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use dsec_api::{FileInfo, Usage};
use dsec_image::ImageStore;
use dsec_runtime::container::{Container, ContainerRuntime};
use rand::Rng;
use tokio::sync::Notify;

use super::container::{create_options, run, ContainerOutput};
use super::{
    Backend, CommandSpec, Created, ExitStatus, ImageDefaults, Output, OutputStream, Sandbox,
    SandboxRequest,
};
use crate::error::ApiError;

/// How far ahead of demand a pool warms workers: enough for this long at the current rate.
const REFILL_HORIZON: Duration = Duration::from_millis(100);
/// A pool with no call for this long releases its workers.
const POOL_IDLE: Duration = Duration::from_secs(60);
/// How often each pool re-evaluates its target.
const TICK: Duration = Duration::from_millis(20);
/// Calls one worker serves before it is replaced (hygiene: bounded page-cache charge).
const MAX_CALLS_PER_WORKER: u32 = 256;

/// Sizing of the worker pools.
#[derive(Clone, Copy, Debug)]
pub struct PoolConfig {
    /// Warm workers kept per pool while it is in use.
    pub min_warm: usize,
    /// Most workers (warm or being created) per pool.
    pub max_warm: usize,
    /// Most workers over all pools.
    pub max_total: usize,
}

/// What identifies a pool: workers are interchangeable only with the same image content
/// (re-importing a name starts a new pool) and limits.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PoolKey {
    image: String,
    image_id: String,
    millicpus: u64,
    memory_mb: u64,
    pids: u64,
    disk_mb: u64,
}

struct Pool {
    key: PoolKey,
    request: SandboxRequest,
    layers: Vec<std::path::PathBuf>,
    ready: Mutex<VecDeque<Worker>>,
    creating: AtomicUsize,
    /// Calls waiting for a worker.
    waiting: AtomicUsize,
    /// Call timestamps of the last second, for the refill target.
    recent: Mutex<VecDeque<Instant>>,
    last_call: Mutex<Instant>,
    /// Wakes waiting calls (a worker is ready) and the refill task (demand changed).
    ready_changed: Notify,
    demand_changed: Notify,
}

impl Pool {
    fn rate_per_s(&self, now: Instant) -> usize {
        let mut recent = self.recent.lock().expect("lock");
        while recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > Duration::from_secs(1))
        {
            recent.pop_front();
        }
        recent.len()
    }

    fn record_call(&self) {
        let now = Instant::now();
        self.recent.lock().expect("lock").push_back(now);
        *self.last_call.lock().expect("lock") = now;
    }

    fn take(&self) -> Option<Worker> {
        self.ready.lock().expect("lock").pop_front()
    }

    fn give_back(&self, worker: Worker) {
        self.ready.lock().expect("lock").push_back(worker);
        self.ready_changed.notify_one();
    }
}

/// A warm container and how many calls it has served.
struct Worker {
    container: Arc<Container>,
    calls: u32,
}

/// The fncall backend: pools of warm workers, keyed by image and limits.
pub struct FnCallBackend {
    runtime: Arc<ContainerRuntime>,
    images: ImageStore,
    config: PoolConfig,
    edge_name: String,
    pools: Mutex<HashMap<PoolKey, Arc<Pool>>>,
    total: Arc<AtomicUsize>,
    /// The backend's own `Arc`, for the refill tasks it spawns.
    me: Weak<FnCallBackend>,
    /// Set at shutdown: refills stop and workers still being created are discarded.
    closing: AtomicBool,
}

impl FnCallBackend {
    /// A backend whose workers are native containers from `runtime`.
    pub fn new(
        runtime: Arc<ContainerRuntime>,
        images: ImageStore,
        config: PoolConfig,
        edge_name: String,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| FnCallBackend {
            runtime,
            images,
            config,
            edge_name,
            pools: Mutex::default(),
            total: Arc::default(),
            me: me.clone(),
            closing: AtomicBool::new(false),
        })
    }

    fn pool(&self, req: &SandboxRequest) -> Result<Arc<Pool>, ApiError> {
        let image = self.images.get(&req.image)?;
        let key = PoolKey {
            image: req.image.clone(),
            image_id: image.id.clone(),
            millicpus: (req.cpus * 1000.0).round() as u64,
            memory_mb: req.memory_mb,
            pids: req.pids,
            disk_mb: req.disk_mb,
        };
        let mut pools = self.pools.lock().expect("lock");
        if let Some(pool) = pools.get(&key) {
            return Ok(Arc::clone(pool));
        }
        let pool = Arc::new(Pool {
            key: key.clone(),
            request: req.clone(),
            layers: self.images.layer_dirs(&image),
            ready: Mutex::default(),
            creating: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            recent: Mutex::default(),
            last_call: Mutex::new(Instant::now()),
            ready_changed: Notify::new(),
            demand_changed: Notify::new(),
        });
        pools.insert(key, Arc::clone(&pool));
        if let Some(me) = self.me.upgrade() {
            tokio::spawn(me.refill(Arc::clone(&pool)));
        }
        Ok(pool)
    }

    fn worker_id(&self) -> String {
        format!(
            "{}-w{:011x}",
            self.edge_name,
            rand::rng().random::<u64>() & 0x7ff_ffff_ffff
        )
    }

    /// Keeps one pool at its target until it has been idle for [`POOL_IDLE`].
    async fn refill(self: Arc<Self>, pool: Arc<Pool>) {
        while !self.closing.load(Ordering::Acquire) {
            let now = Instant::now();
            let idle = now.duration_since(*pool.last_call.lock().expect("lock")) > POOL_IDLE;
            let ready = pool.ready.lock().expect("lock").len();
            let creating = pool.creating.load(Ordering::Acquire);
            let target = if idle {
                0
            } else {
                let by_rate =
                    (pool.rate_per_s(now) as f64 * REFILL_HORIZON.as_secs_f64()).ceil() as usize;
                (by_rate + pool.waiting.load(Ordering::Acquire))
                    .clamp(self.config.min_warm, self.config.max_warm)
            };
            metrics::gauge!("dsec_fncall_pool_ready", "image" => pool.key.image.clone())
                .set(ready as f64);
            if idle && ready == 0 && creating == 0 {
                let mut pools = self.pools.lock().expect("lock");
                // A call may have revived the pool between the check and the lock.
                if now.duration_since(*pool.last_call.lock().expect("lock")) > POOL_IDLE {
                    pools.remove(&pool.key);
                    return;
                }
            }
            if ready > target {
                let extra: Vec<Worker> = {
                    let mut q = pool.ready.lock().expect("lock");
                    let n = q.len().saturating_sub(target);
                    q.drain(..n).collect()
                };
                self.total.fetch_sub(extra.len(), Ordering::AcqRel);
                for worker in extra {
                    tokio::spawn(async move { worker.container.stop().await });
                }
            }
            let mut deficit = target.saturating_sub(ready + creating);
            while deficit > 0 && self.reserve_slot() {
                deficit -= 1;
                pool.creating.fetch_add(1, Ordering::AcqRel);
                tokio::spawn(Arc::clone(&self).create_worker(Arc::clone(&pool)));
            }
            tokio::select! {
                _ = pool.demand_changed.notified() => {}
                _ = tokio::time::sleep(TICK) => {}
            }
        }
    }

    /// Takes one slot under the global cap.
    fn reserve_slot(&self) -> bool {
        self.total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.config.max_total).then_some(n + 1)
            })
            .is_ok()
    }

    async fn create_worker(self: Arc<Self>, pool: Arc<Pool>) {
        let mut opts = create_options(&pool.request, pool.layers.clone());
        opts.id = self.worker_id();
        opts.worker = true;
        let created = self.runtime.create(opts).await;
        pool.creating.fetch_sub(1, Ordering::AcqRel);
        match created {
            Ok(worker) if self.closing.load(Ordering::Acquire) => {
                worker.stop().await;
                self.total.fetch_sub(1, Ordering::AcqRel);
            }
            Ok(container) => pool.give_back(Worker {
                container: Arc::new(container),
                calls: 0,
            }),
            Err(e) => {
                self.total.fetch_sub(1, Ordering::AcqRel);
                tracing::warn!(image = %pool.key.image, error = %e, "creating a fncall worker");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// Destroys every worker (server shutdown), waiting for those still being created.
    pub async fn shutdown(&self) {
        self.closing.store(true, Ordering::Release);
        let pools: Vec<Arc<Pool>> = self.pools.lock().expect("lock").values().cloned().collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        while pools.iter().any(|p| p.creating.load(Ordering::Acquire) > 0)
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut workers = Vec::new();
        for pool in pools {
            workers.extend(pool.ready.lock().expect("lock").drain(..));
        }
        futures::future::join_all(workers.iter().map(|w| w.container.stop())).await;
    }
}

#[async_trait]
impl Backend for FnCallBackend {
    async fn create(&self, req: SandboxRequest) -> Result<Created, ApiError> {
        let pool = self.pool(&req)?;
        pool.record_call();
        pool.demand_changed.notify_one();
        let image = self.images.get(&req.image)?;
        Ok(Created {
            sandbox: Box::new(FnCallSandbox {
                total: Arc::clone(&self.total),
                pool,
            }),
            image: ImageDefaults {
                env: image.config.env,
                workdir: image.config.workdir,
                layers: image.layers,
            },
        })
    }
}

/// A handle on a pool: each command runs in a worker of its own.
struct FnCallSandbox {
    total: Arc<AtomicUsize>,
    pool: Arc<Pool>,
}

impl FnCallSandbox {
    /// A warm worker, waiting for one until `deadline` when the pool is empty.
    async fn worker(&self, deadline: Instant) -> Option<Worker> {
        let started = Instant::now();
        let image = self.pool.key.image.clone();
        if let Some(w) = self.pool.take() {
            metrics::counter!("dsec_fncall_pool_hits_total", "image" => image).increment(1);
            return Some(w);
        }
        metrics::counter!("dsec_fncall_pool_misses_total", "image" => image.clone()).increment(1);
        self.pool.waiting.fetch_add(1, Ordering::AcqRel);
        self.pool.demand_changed.notify_one();
        let worker = loop {
            let ready = self.pool.ready_changed.notified();
            if let Some(w) = self.pool.take() {
                break Some(w);
            }
            if tokio::time::timeout_at(deadline.into(), ready)
                .await
                .is_err()
            {
                break self.pool.take();
            }
        };
        self.pool.waiting.fetch_sub(1, Ordering::AcqRel);
        metrics::histogram!("dsec_fncall_queue_wait_seconds", "image" => image)
            .record(started.elapsed().as_secs_f64());
        worker
    }
}

/// A call's output; when the call ends the worker goes back to its pool, or is destroyed
/// if the call timed out, hit its memory limit or was abandoned by its caller.
struct CallOutput {
    inner: ContainerOutput,
    worker: Option<Worker>,
    /// The call ended cleanly: its worker may serve another.
    reusable: bool,
    pool: Arc<Pool>,
    total: Arc<AtomicUsize>,
    started: Instant,
}

#[async_trait]
impl OutputStream for CallOutput {
    async fn next(&mut self) -> Option<Result<Output, ApiError>> {
        let mut event = self.inner.next().await;
        // The worker's cgroup is the call's cgroup: if the worker died while the memory
        // limit was firing, the call hit its limit, and that is its result.
        if matches!(event, Some(Err(_))) {
            let worker = self.worker.as_ref().map(|w| &w.container);
            if worker.is_some_and(|c| !c.is_alive() && c.take_oom_kill()) {
                tracing::warn!(image = %self.pool.key.image, "fncall worker died at its memory limit");
                event = Some(Ok(Output::Exit(ExitStatus {
                    exit_code: Some(128 + libc::SIGKILL),
                    oom_killed: true,
                    duration_ms: self.started.elapsed().as_secs_f64() * 1000.0,
                    ..ExitStatus::default()
                })));
            }
        }
        if let Some(Ok(Output::Exit(exit))) = &event {
            self.reusable = !exit.timed_out && !exit.oom_killed;
            metrics::histogram!("dsec_fncall_call_seconds", "image" => self.pool.key.image.clone())
                .record(self.started.elapsed().as_secs_f64());
        }
        event
    }
}

impl Drop for CallOutput {
    fn drop(&mut self) {
        let Some(mut worker) = self.worker.take() else {
            return;
        };
        worker.calls += 1;
        if self.reusable && worker.calls < MAX_CALLS_PER_WORKER && worker.container.is_alive() {
            self.pool.give_back(worker);
            return;
        }
        destroy(worker.container, Arc::clone(&self.total));
    }
}

/// Stops a worker in the background and frees its slot under the global cap.
fn destroy(container: Arc<Container>, total: Arc<AtomicUsize>) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(async move {
            container.stop().await;
            total.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

fn stateless(what: &str) -> ApiError {
    ApiError::invalid(format!(
        "fncall sandboxes keep no state between calls, so {what} has nothing to act on: pass \
         files= to run() (or client.call()) instead"
    ))
}

#[async_trait]
impl Sandbox for FnCallSandbox {
    async fn exec(&self, cmd: CommandSpec) -> Result<Box<dyn OutputStream>, ApiError> {
        self.pool.record_call();
        let started = Instant::now();
        let deadline = started + Duration::from_millis(cmd.timeout_ms);
        let Some(worker) = self.worker(deadline).await else {
            return Err(ApiError::unavailable(format!(
                "no fncall worker for image {:?} became ready within the call's timeout",
                self.pool.key.image
            )));
        };
        let total = Arc::clone(&self.total);
        let inner = match run(&worker.container, cmd).await {
            Ok(inner) => inner,
            Err(e) => {
                destroy(worker.container, total);
                return Err(e);
            }
        };
        let output = CallOutput {
            inner,
            worker: Some(worker),
            reusable: false,
            pool: Arc::clone(&self.pool),
            total,
            started,
        };
        // Replacement starts now, not when the old worker is gone.
        self.pool.demand_changed.notify_one();
        Ok(Box::new(output))
    }

    async fn read_file(&self, _path: &str) -> Result<File, ApiError> {
        Err(stateless("read_file"))
    }

    async fn write_file(&self, _path: &str, _data: Vec<u8>, _mode: u32) -> Result<(), ApiError> {
        Err(stateless("write_file"))
    }

    async fn list_files(&self, _path: &str) -> Result<Vec<FileInfo>, ApiError> {
        Err(stateless("list_files"))
    }

    fn usage(&self) -> Usage {
        Usage::default()
    }

    fn is_alive(&self) -> bool {
        true
    }

    async fn stop(&self) {}
}
