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
//! global cap on warm workers; a pool unused for [`POOL_IDLE`] shrinks to nothing. Each
//! worker is a sandbox of the host and takes its limits from the edge's budget
//! ([`crate::admission`]); when the budget is promised, the pool stops growing and a
//! call that finds no worker fails at once with `capacity`.
//!
//! Calls of one worker share its network namespace, and that is by measurement: a
//! namespace of their own costs each call ~2.1 ms of kernel work on a 2-core host (its
//! set-up runs every network subsystem's per-namespace init; its teardown is deferred,
//! so namespaces pile up under load), against 0.28 ms for the rest of a fork and a
//! loopback connection; at the 500 calls/s a pool is meant to sustain that is a whole
//! core. What a call could leave in the shared namespace is its sockets, and those die
//! with its processes, except TCP connections it closed first, which the kernel keeps in
//! TIME_WAIT for 60 s: the worker's init sets `net.ipv4.tcp_max_tw_buckets = 0` in its
//! namespace, so they are closed at once. (Abstract unix sockets are named per network
//! namespace and die with their processes too.) What remains shared is the namespace's
//! counters — `lo`'s packet and byte counts, `/proc/net/snmp` — which a call can read
//! and so learn how much traffic the previous call on the worker made.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use dsec_api::{ErrorKind, FileInfo, Usage};
use dsec_image::ImageStore;
use dsec_runtime::container::{Container, ContainerRuntime, ExecEvent};
use dsec_runtime::proto::{ExecSpec, ExecStep};
use rand::Rng;
use tokio::sync::Notify;

use super::container::{carry, create_options, creating_failed, exit_status, run, ContainerOutput};
use super::{
    Backend, CommandSpec, Created, ExitStatus, FileRead, FileWatch, FileWrite, ImageDefaults,
    MakeDir, MovePath, Output, OutputStream, RemovePath, Sandbox, SandboxRequest, Upload,
};
use crate::admission::{Admission, Grant};
use crate::error::ApiError;

/// How far ahead of demand a pool warms workers: enough for this long at the current rate.
const REFILL_HORIZON: Duration = Duration::from_millis(100);
/// A pool with no call for this long releases its workers.
const POOL_IDLE: Duration = Duration::from_secs(60);
/// How often each pool re-evaluates its target.
const TICK: Duration = Duration::from_millis(20);
/// Calls one worker serves before it is replaced (hygiene: bounded page-cache charge).
const MAX_CALLS_PER_WORKER: u32 = 256;
/// How long a pool keeps ready workers beyond its target before it destroys them. Under a
/// steady load the number of ready workers swings with every burst of calls (those in use
/// are not ready); a worker destroyed on a swing is one to create again moments later,
/// at the cost of a container create, so only a lasting surplus is given back.
const SHRINK_AFTER: Duration = Duration::from_secs(2);
/// How long a pool waits after the edge's budget refused it a worker.
const REFUSED_BACKOFF: Duration = Duration::from_millis(250);

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
    /// The image's layers, mounted and held while the pool exists.
    layers: dsec_image::MountedImage,
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
    /// The budget's last refusal and when it came, while the pool cannot grow.
    refused: Mutex<Option<(Instant, ApiError)>>,
    /// The last worker's create that failed for a reason another try cannot mend (the
    /// image cannot make a root), and when: calls waiting then get it, not a timeout.
    unusable: Mutex<Option<(Instant, ApiError)>>,
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

    /// Why no worker can be made, if a create after `since` said so.
    fn unusable_since(&self, since: Instant) -> Option<ApiError> {
        let unusable = self.unusable.lock().expect("lock");
        let (at, error) = unusable.as_ref()?;
        (*at >= since).then(|| error.clone())
    }

    /// The budget's refusal, if one came after `since` and no worker is on its way.
    fn refused_since(&self, since: Instant) -> Option<ApiError> {
        let refused = self.refused.lock().expect("lock");
        let (at, error) = refused.as_ref()?;
        (*at >= since && self.creating.load(Ordering::Acquire) == 0).then(|| error.clone())
    }
}

/// A warm container, how many calls it has served, and its share of the edge's budget.
struct Worker {
    container: Arc<Container>,
    calls: u32,
    grant: Grant,
}

impl Worker {
    /// Stops it in the background, then frees its slot under the global cap and its
    /// budget.
    fn destroy(self, total: Arc<AtomicUsize>) {
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                self.container.stop().await;
                total.fetch_sub(1, Ordering::AcqRel);
                drop(self.grant);
            });
        }
    }
}

/// The fncall backend: pools of warm workers, keyed by image and limits.
pub struct FnCallBackend {
    runtime: Arc<ContainerRuntime>,
    admission: Arc<Admission>,
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
    /// A backend whose workers are native containers from `runtime`, admitted against
    /// `admission`.
    pub fn new(
        runtime: Arc<ContainerRuntime>,
        admission: Arc<Admission>,
        images: ImageStore,
        config: PoolConfig,
        edge_name: String,
    ) -> Arc<Self> {
        Arc::new_cyclic(|me| FnCallBackend {
            runtime,
            admission,
            images,
            config,
            edge_name,
            pools: Mutex::default(),
            total: Arc::default(),
            me: me.clone(),
            closing: AtomicBool::new(false),
        })
    }

    async fn pool(&self, req: &SandboxRequest) -> Result<Arc<Pool>, ApiError> {
        let image = self.images.resolve(&req.image).await?;
        // CPUs the edge checked to a small positive number; `as` from f64 saturates.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let millicpus = (req.cpus * 1000.0).round() as u64;
        let key = PoolKey {
            image: req.image.clone(),
            image_id: image.id.clone(),
            millicpus,
            memory_mb: req.memory_mb,
            pids: req.pids,
            disk_mb: req.disk_mb,
        };
        if let Some(pool) = self.pools.lock().expect("lock").get(&key) {
            return Ok(Arc::clone(pool));
        }
        let layers = self.images.mount(&image).await?;
        let mut pools = self.pools.lock().expect("lock");
        if let Some(pool) = pools.get(&key) {
            return Ok(Arc::clone(pool));
        }
        let pool = Arc::new(Pool {
            key: key.clone(),
            request: req.clone(),
            layers,
            ready: Mutex::default(),
            creating: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            recent: Mutex::default(),
            last_call: Mutex::new(Instant::now()),
            ready_changed: Notify::new(),
            demand_changed: Notify::new(),
            refused: Mutex::new(None),
            unusable: Mutex::new(None),
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
        // Since when the pool has had more ready workers than its target.
        let mut surplus_since: Option<Instant> = None;
        while !self.closing.load(Ordering::Acquire) {
            let now = Instant::now();
            let idle = now.duration_since(*pool.last_call.lock().expect("lock")) > POOL_IDLE;
            let ready = pool.ready.lock().expect("lock").len();
            let creating = pool.creating.load(Ordering::Acquire);
            let target = if idle {
                0
            } else {
                // A non-negative count of creates; `as` from f64 saturates.
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
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
            if ready <= target {
                surplus_since = None;
            } else if idle || now.duration_since(*surplus_since.get_or_insert(now)) >= SHRINK_AFTER
            {
                surplus_since = None;
                let extra: Vec<Worker> = {
                    let mut q = pool.ready.lock().expect("lock");
                    let n = q.len().saturating_sub(target);
                    q.drain(..n).collect()
                };
                for worker in extra {
                    worker.destroy(Arc::clone(&self.total));
                }
            }
            let mut deficit = target.saturating_sub(ready + creating);
            let mut refused = false;
            while deficit > 0 && self.reserve_slot() {
                let request = &pool.request;
                match self
                    .admission
                    .admit("fncall", request.memory_mb, request.pids)
                {
                    Ok(grant) => {
                        pool.refused.lock().expect("lock").take();
                        deficit -= 1;
                        pool.creating.fetch_add(1, Ordering::AcqRel);
                        tokio::spawn(Arc::clone(&self).create_worker(Arc::clone(&pool), grant));
                    }
                    Err(e) => {
                        self.total.fetch_sub(1, Ordering::AcqRel);
                        *pool.refused.lock().expect("lock") = Some((Instant::now(), e));
                        // Calls waiting for a worker learn that none is coming.
                        pool.ready_changed.notify_waiters();
                        refused = true;
                        break;
                    }
                }
            }
            // Refused: try again when a call asks, or after a while (budget frees as
            // sandboxes stop), not every tick.
            let pause = if refused { REFUSED_BACKOFF } else { TICK };
            tokio::select! {
                _ = pool.demand_changed.notified() => {}
                _ = tokio::time::sleep(pause) => {}
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

    async fn create_worker(self: Arc<Self>, pool: Arc<Pool>, grant: Grant) {
        let mut opts = create_options(&pool.request, pool.layers.dirs.clone());
        opts.id = self.worker_id();
        opts.worker = true;
        let created = self.runtime.create(opts).await;
        pool.creating.fetch_sub(1, Ordering::AcqRel);
        metrics::counter!("dsec_fncall_workers_created_total", "image" => pool.key.image.clone())
            .increment(1);
        match created {
            Ok(worker) if self.closing.load(Ordering::Acquire) => {
                worker.stop().await;
                self.total.fetch_sub(1, Ordering::AcqRel);
            }
            Ok(container) => {
                pool.give_back(Worker {
                    container: Arc::new(container),
                    calls: 0,
                    grant,
                });
            }
            Err(e) => {
                self.total.fetch_sub(1, Ordering::AcqRel);
                tracing::warn!(image = %pool.key.image, error = %e, "creating a fncall worker");
                if e.is_unusable_image() {
                    let error = creating_failed(&pool.key.image, &e);
                    *pool.unusable.lock().expect("lock") = Some((Instant::now(), error));
                    pool.ready_changed.notify_waiters();
                }
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
        drop(workers);
    }
}

#[async_trait]
impl Backend for FnCallBackend {
    /// Each worker is admitted as the pool makes it; a handle on a call holds nothing.
    fn admitted_per_sandbox(&self) -> bool {
        false
    }

    async fn create(&self, req: SandboxRequest) -> Result<Created, ApiError> {
        let pool = self.pool(&req).await?;
        pool.record_call();
        pool.demand_changed.notify_one();
        let image = self.images.resolve(&req.image).await?;
        Ok(Created {
            sandbox: Box::new(FnCallSandbox {
                total: Arc::clone(&self.total),
                pool,
            }),
            image: ImageDefaults {
                env: image.config.env,
                workdir: image.config.workdir,
            },
        })
    }
}

/// One command of a [`StepCall`].
#[derive(Clone, Debug)]
pub struct Step {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Its tree is killed this long after the step started.
    pub timeout: Duration,
}

/// A call of several commands in one fresh root — compile, then run what was compiled —
/// each run only if the one before it exited 0, each with a wall-clock timeout of its own
/// counted from its own start (waiting for a worker is not counted), each with its whole
/// process tree killed when it ends; then files read back from that root. Every step
/// reads `stdin` from its beginning.
#[derive(Clone, Debug)]
pub struct StepCall {
    /// The commands, first to last.
    pub steps: Vec<Step>,
    /// The complete environment, `K=V`.
    pub env: Vec<String>,
    /// Absolute working directory of every step.
    pub cwd: String,
    /// What every step reads on its standard input.
    pub stdin: Vec<u8>,
    /// Files written before the first step.
    pub files: Vec<FileWrite>,
    /// Files read back after the last step that ran (absolute, or relative to `cwd`);
    /// missing ones are left out.
    pub fetch: Vec<String>,
    /// Bound on each step's stdout and stderr.
    pub max_output_bytes: u64,
    /// Bound on the fetched files together (see `ExecSpec::fetch_max_bytes`).
    pub fetch_max_bytes: u64,
    /// How long the call may wait for a worker; it waits through the edge's budget
    /// refusing the pool one (others' sandboxes may stop meanwhile) rather than failing
    /// at once, as a plain call does.
    pub queue_timeout: Duration,
}

/// How one step of a [`StepCall`] ended, with its output.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Its end.
    pub exit: ExitStatus,
    /// The signal that killed its main process, if one did.
    pub signal: Option<i32>,
    /// Its standard output, up to the bound.
    pub stdout: Vec<u8>,
    /// Its standard error, up to the bound.
    pub stderr: Vec<u8>,
}

/// A file read back after a [`StepCall`].
#[derive(Debug)]
pub struct Fetched {
    /// The path as the call asked for it.
    pub path: String,
    /// Its contents, up to the bound.
    pub data: Vec<u8>,
    /// The file was longer than the bound.
    pub truncated: bool,
}

/// What a [`StepCall`] did.
#[derive(Debug, Default)]
pub struct StepCallOutcome {
    /// The steps that ran, in order: all of them, or up to the first that failed.
    pub steps: Vec<StepOutcome>,
    /// The files read back.
    pub fetched: Vec<Fetched>,
}

impl FnCallBackend {
    /// Runs a [`StepCall`] in a worker of the pool for `req`'s image and limits.
    pub async fn call_steps(
        &self,
        req: &SandboxRequest,
        call: StepCall,
    ) -> Result<StepCallOutcome, ApiError> {
        let Some((first, later)) = call.steps.split_first() else {
            return Err(ApiError::invalid("a stepped call needs a step"));
        };
        let handle = FnCallSandbox {
            total: Arc::clone(&self.total),
            pool: self.pool(req).await?,
        };
        let mut lease = handle.lease(call.queue_timeout, Refusal::Wait).await?;
        let (files, contents) = carry(call.files);
        let spec = ExecSpec {
            argv: first.argv.clone(),
            env: call.env,
            cwd: call.cwd,
            timeout_ms: Some(millis(first.timeout)),
            max_output_bytes: call.max_output_bytes,
            files,
            then: later
                .iter()
                .map(|s| ExecStep {
                    argv: s.argv.clone(),
                    timeout_ms: Some(millis(s.timeout)),
                })
                .collect(),
            fetch: call.fetch,
            fetch_max_bytes: call.fetch_max_bytes,
            ..ExecSpec::default()
        };
        let data: Vec<&[u8]> = contents.iter().map(Vec::as_slice).collect();
        let mut events = lease
            .container()
            .exec(&spec, &call.stdin, &data)
            .await
            .map_err(|e| lease.failed(e.into()))?;
        let mut outcome = StepCallOutcome::default();
        let mut step = StepOutcome::default();
        loop {
            match events.next().await {
                Some(Ok(ExecEvent::Stdout(d))) => step.stdout.extend_from_slice(&d),
                Some(Ok(ExecEvent::Stderr(d))) => step.stderr.extend_from_slice(&d),
                Some(Ok(ExecEvent::StepExit(exit))) => {
                    (step.exit, step.signal) = (exit_status(&exit, lease.container()), exit.signal);
                    outcome.steps.push(std::mem::take(&mut step));
                }
                Some(Ok(ExecEvent::Fetched {
                    path,
                    data,
                    truncated,
                })) => outcome.fetched.push(Fetched {
                    path,
                    data,
                    truncated,
                }),
                Some(Ok(ExecEvent::Exit(exit))) => {
                    (step.exit, step.signal) = (exit_status(&exit, lease.container()), exit.signal);
                    break;
                }
                Some(Err(e)) => match lease.died_at_memory_limit() {
                    Some(exit) => {
                        (step.exit, step.signal) = (exit, Some(libc::SIGKILL));
                        break;
                    }
                    None => return Err(lease.failed(e.into())),
                },
                Some(Ok(ExecEvent::Started(_))) => return Err(super::not_plain()),
                None => return Err(ApiError::internal("a stepped call's events ended early")),
            }
        }
        outcome.steps.push(step);
        lease.ended(outcome.steps.iter().map(|s| &s.exit));
        Ok(outcome)
    }
}

fn millis(d: Duration) -> u64 {
    d.as_millis().try_into().unwrap_or(u64::MAX)
}

/// What a call that finds no worker does when the edge's budget refuses its pool one.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// Fails at once with the refusal (`capacity`): the caller may try another edge.
    Fail,
    /// Waits on, until its deadline, for a worker to come back or the budget to free.
    Wait,
}

/// A handle on a pool: each command runs in a worker of its own.
struct FnCallSandbox {
    total: Arc<AtomicUsize>,
    pool: Arc<Pool>,
}

impl FnCallSandbox {
    /// A worker for one call, waiting up to `wait` for one when the pool is empty.
    async fn lease(&self, wait: Duration, refusal: Refusal) -> Result<Lease, ApiError> {
        self.pool.record_call();
        let started = Instant::now();
        let worker = self.worker(started + wait, refusal).await?;
        // Replacement starts now, not when the old worker is gone.
        self.pool.demand_changed.notify_one();
        Ok(Lease {
            worker: Some(worker),
            reusable: false,
            pool: Arc::clone(&self.pool),
            total: Arc::clone(&self.total),
            started,
        })
    }

    /// A warm worker, waiting for one until `deadline` when the pool is empty.
    async fn worker(&self, deadline: Instant, on_refusal: Refusal) -> Result<Worker, ApiError> {
        let started = Instant::now();
        let image = self.pool.key.image.clone();
        if let Some(w) = self.pool.take() {
            metrics::counter!("dsec_fncall_pool_hits_total", "image" => image).increment(1);
            return Ok(w);
        }
        metrics::counter!("dsec_fncall_pool_misses_total", "image" => image.clone()).increment(1);
        self.pool.waiting.fetch_add(1, Ordering::AcqRel);
        self.pool.demand_changed.notify_one();
        let worker = loop {
            let ready = self.pool.ready_changed.notified();
            if let Some(w) = self.pool.take() {
                break Ok(w);
            }
            if let Some(error) = self.pool.unusable_since(started) {
                break Err(error);
            }
            let refused = self.pool.refused_since(started);
            if on_refusal == Refusal::Fail {
                if let Some(refusal) = refused {
                    break Err(refusal);
                }
            }
            if tokio::time::timeout_at(deadline.into(), ready)
                .await
                .is_err()
            {
                break self.pool.take().ok_or_else(|| match refused {
                    Some(refusal) => refusal,
                    None => ApiError::unavailable(format!(
                        "no fncall worker for image {image:?} became ready within {:.1} s",
                        (deadline - started).as_secs_f64()
                    )),
                });
            }
        };
        self.pool.waiting.fetch_sub(1, Ordering::AcqRel);
        metrics::histogram!("dsec_fncall_queue_wait_seconds", "image" => image)
            .record(started.elapsed().as_secs_f64());
        worker
    }
}

/// A worker taken for one call: when the call ends it goes back to its pool, or is
/// destroyed if the call timed out, hit its memory limit, failed or was abandoned by its
/// caller.
struct Lease {
    worker: Option<Worker>,
    /// The call ended cleanly: its worker may serve another.
    reusable: bool,
    pool: Arc<Pool>,
    total: Arc<AtomicUsize>,
    started: Instant,
}

impl Lease {
    fn container(&self) -> &Arc<Container> {
        &self
            .worker
            .as_ref()
            .expect("a lease holds its worker")
            .container
    }

    /// The worker's cgroup is the call's cgroup: if the worker died while the memory limit
    /// was firing, the call hit its limit, and that is its result.
    fn died_at_memory_limit(&self) -> Option<ExitStatus> {
        let c = self.container();
        if c.is_alive() || !c.take_oom_kill() {
            return None;
        }
        tracing::warn!(image = %self.pool.key.image, "fncall worker died at its memory limit");
        Some(ExitStatus {
            exit_code: Some(128 + libc::SIGKILL),
            oom_killed: true,
            duration_ms: self.started.elapsed().as_secs_f64() * 1000.0,
            ..ExitStatus::default()
        })
    }

    /// The error a call reports for `e`: the worker is gone, not the handle, so a worker
    /// that died makes a call that can be retried (another call gets another worker).
    fn failed(&self, e: ApiError) -> ApiError {
        match e.kind {
            ErrorKind::SandboxFailed => ApiError::unavailable(format!(
                "the fncall worker (image {:?}) serving this call died; the call can be \
                 retried",
                self.pool.key.image
            )),
            _ => e,
        }
    }

    /// Records the call's end: its worker may serve another if none of `exits` timed out
    /// or hit the memory limit.
    fn ended<'a>(&mut self, exits: impl IntoIterator<Item = &'a ExitStatus>) {
        self.reusable = exits.into_iter().all(|e| !e.timed_out && !e.oom_killed);
        metrics::histogram!("dsec_fncall_call_seconds", "image" => self.pool.key.image.clone())
            .record(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(mut worker) = self.worker.take() else {
            return;
        };
        worker.calls += 1;
        if self.reusable && worker.calls < MAX_CALLS_PER_WORKER && worker.container.is_alive() {
            self.pool.give_back(worker);
            return;
        }
        worker.destroy(Arc::clone(&self.total));
    }
}

/// A call's output; its worker's lease ends with it.
struct CallOutput {
    inner: ContainerOutput,
    lease: Lease,
}

#[async_trait]
impl OutputStream for CallOutput {
    async fn next(&mut self) -> Option<Result<Output, ApiError>> {
        let mut event = self.inner.next().await;
        if let Some(Err(e)) = event {
            event = Some(match self.lease.died_at_memory_limit() {
                Some(exit) => Ok(Output::Exit(exit)),
                None => Err(self.lease.failed(e)),
            });
        }
        if let Some(Ok(Output::Exit(exit))) = &event {
            self.lease.ended([exit]);
        }
        event
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
        if let Some(run_as) = &cmd.run_as {
            return Err(ApiError::invalid(format!(
                "user {:?}: fncall calls run as root only (each call gets a fresh root of \
                 the image, with no users added to it)",
                run_as.user
            )));
        }
        let lease = self
            .lease(Duration::from_millis(cmd.timeout_ms), Refusal::Fail)
            .await?;
        let inner = run(lease.container(), cmd)
            .await
            .map_err(|e| lease.failed(e))?;
        Ok(Box::new(CallOutput { inner, lease }))
    }

    async fn read_file(&self, _path: &str, _max: u64) -> Result<Box<dyn FileRead>, ApiError> {
        Err(stateless("read_file"))
    }

    async fn write_file(&self, _path: &str, _mode: u32, _data: Upload) -> Result<(), ApiError> {
        Err(stateless("write_file"))
    }

    async fn list_files(&self, _path: &str, _depth: u32) -> Result<Vec<FileInfo>, ApiError> {
        Err(stateless("list_files"))
    }

    async fn stat(&self, _path: &str) -> Result<FileInfo, ApiError> {
        Err(stateless("stat"))
    }

    async fn make_dir(&self, _req: &MakeDir) -> Result<bool, ApiError> {
        Err(stateless("mkdir"))
    }

    async fn move_path(&self, _req: &MovePath) -> Result<(), ApiError> {
        Err(stateless("move"))
    }

    async fn remove_path(&self, _req: &RemovePath) -> Result<(), ApiError> {
        Err(stateless("remove"))
    }

    async fn watch(&self, _path: &str, _recursive: bool) -> Result<Box<dyn FileWatch>, ApiError> {
        Err(stateless("watch"))
    }

    fn usage(&self) -> Usage {
        Usage::default()
    }

    fn is_alive(&self) -> bool {
        true
    }

    async fn stop(&self) {}
}
