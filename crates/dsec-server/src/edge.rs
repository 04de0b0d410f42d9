//! The edge: owns the sandboxes of this host.
//!
//! It validates requests and fills in defaults, admits them against its budget (see
//! [`crate::admission`]), picks the backend, keeps the table of live sandboxes, enforces
//! `ttl_s` and `idle_ttl_s` with a reaper, notices sandboxes whose init died, and answers
//! every per-sandbox request after checking the sandbox's state.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use dsec_api::{
    BackendKind, Command, CreateSandboxRequest, ExecBody, FileInfo, ImageInfo, Limits, Network,
    PruneResult, SandboxInfo, SandboxState, StoreInfo,
};
use dsec_image::{ImageError, ImageStore};
use dsec_runtime::files::client::as_user;
use dsec_runtime::proto::{AsUser, RunAs};
use dsec_runtime::users::UserSpec;
use dsec_trajectory::{
    digest, FileDigest, ForkOf, SandboxLog, SandboxRecord, StepRequest, TrajectoryLog,
};
use rand::Rng;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

use crate::admission::{Admission, Grant};
use crate::backend::files::too_large_upload;
use crate::backend::{
    image_info, Backend, Backends, CommandSpec, Created, FileRead, FileWatch, FileWrite, MakeDir,
    MovePath, OutputStream, RemovePath, Sandbox, SandboxRequest, Upload,
};
use crate::error::ApiError;
use crate::events::{kind, Events, Subject};
use crate::projects::{self, Caller, QuotaHold};
use crate::trajectory::{self, Decision, Position, Replayed};

mod fleet;
mod kept;
pub mod processes;
mod usage;
pub use fleet::{batch_item, batch_item_key, check_batch, EdgeLoad};

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
    /// Bounds of the files API.
    pub files: FileLimits,
}

/// Bounds of the files API.
#[derive(Clone, Copy, Debug)]
pub struct FileLimits {
    /// Largest file `read_file` returns.
    pub max_read_bytes: u64,
    /// Largest file `write_file` accepts.
    pub max_write_bytes: u64,
}

/// File transfers (reads, writes, listings) in flight per sandbox, and on the whole server:
/// each holds up to a chunk of the server's memory while it lasts.
const FILE_TRANSFERS_PER_SANDBOX: usize = 8;
const FILE_TRANSFERS_TOTAL: usize = 64;
/// How long a file request waits for a free transfer before it is refused.
const FILE_TRANSFER_WAIT: Duration = Duration::from_secs(30);

/// Upper bounds beyond which a limit is "absurd" rather than merely large.
const MAX_DISK_MB: u64 = 1 << 20;
const MIN_PIDS: u64 = 4;
const MIN_MEMORY_MB: u64 = 8;
const MAX_TTL_S: f64 = 30.0 * 86400.0;
const MAX_OUTPUT_BYTES: u64 = 1 << 30;
const MAX_FORKS: i64 = 256;
/// How old the usage a list shows may be: two rounds of the usage sampler, which keeps it
/// current. Older (the sampler is off, or behind), a list reads it afresh.
const LISTED_USAGE_AGE: Duration = Duration::from_secs(2);
const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

struct Entry {
    info: SandboxInfo,
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
    /// Its file transfers in flight (see [`FILE_TRANSFERS_PER_SANDBOX`]).
    file_transfers: Arc<Semaphore>,
    /// Its share of the edge's budget, given back once it is stopped (or has failed).
    grant: Mutex<Option<Grant>>,
    /// The project it belongs to (`None`: the admin's).
    project: Option<Arc<str>>,
    /// Its share of its project's quotas, given back with `grant`.
    quota: Mutex<Option<QuotaHold>>,
    /// Why it failed, once it has (set once, by the first to notice).
    failure: tokio::sync::OnceCell<String>,
    /// What made it, asked what its sandboxes can do.
    backend: Arc<dyn Backend>,
    sandbox: Box<dyn Sandbox>,
    /// The edge's event stream.
    events: Arc<Events>,
    /// OOM kills its commands reported since the usage sampler last looked (see
    /// [`usage`]), so that a kill makes one `limit.oom` event, not two.
    oom_reported: std::sync::atomic::AtomicU64,
    /// Its usage as last read, and when: what a list shows (see [`Entry::listed`]).
    sampled: Mutex<Option<(Instant, dsec_api::Usage)>>,
    /// Labels the Watcher added (`watcher.<rule>`), shown with those it was created with.
    flags: Mutex<BTreeMap<String, String>>,
    /// Its spawned processes; they go with it.
    processes: processes::Processes,
    /// Paused and kept by its backend across a restart of the server ([`kept`]): a
    /// shutdown leaves it.
    kept: AtomicBool,
}

impl Entry {
    /// A running sandbox just made, holding nothing of the budget or quotas yet; its
    /// commands get `command.0` as environment and `command.1` as working directory.
    fn new(
        info: SandboxInfo,
        position: Position,
        command: (Vec<String>, String),
        request: CreateSandboxRequest,
        made: (Arc<dyn Backend>, Box<dyn Sandbox>),
        events: Arc<Events>,
    ) -> Entry {
        let ((env, workdir), (backend, sandbox)) = (command, made);
        Entry {
            info,
            env,
            workdir,
            state: Mutex::new(SandboxState::Running),
            created: Instant::now(),
            last_active: Mutex::new(Instant::now()),
            busy: AtomicUsize::new(0),
            position,
            request,
            file_transfers: Arc::new(Semaphore::new(FILE_TRANSFERS_PER_SANDBOX)),
            grant: Mutex::new(None),
            project: None,
            quota: Mutex::new(None),
            failure: tokio::sync::OnceCell::new(),
            backend,
            sandbox,
            events,
            oom_reported: Default::default(),
            sampled: Mutex::new(None),
            flags: Mutex::default(),
            processes: processes::Processes::default(),
            kept: AtomicBool::new(false),
        }
    }

    /// Its labels: those it was created with, and the Watcher's flags.
    fn labels(&self) -> BTreeMap<String, String> {
        let mut labels = self.info.labels.clone();
        labels.extend(self.flags.lock().expect("lock").clone());
        labels
    }

    /// Records an event about this sandbox.
    fn emit(&self, kind: &str, data: serde_json::Value) {
        self.events.emit(
            kind,
            Some(Subject {
                id: &self.info.id,
                labels: &self.info.labels,
                project: self.project.as_deref(),
            }),
            data,
        );
    }

    /// Records a refused read or write of the files API (`op`), unless the path was
    /// merely missing: what an operator needs to see of a sandbox that plants devices,
    /// FIFOs, kernel interfaces, links out of its root or oversized files.
    fn refused(&self, op: &str, path: &str, error: &ApiError) {
        if error.kind != dsec_api::ErrorKind::NotFound {
            self.emit(
                kind::FILE_REFUSED,
                serde_json::json!({"op": op, "path": path, "error": error.message, "status": error.kind.status()}),
            );
        }
    }

    /// Gives back what it holds of the edge's budget and its project's quotas.
    fn release(&self) {
        self.grant.lock().expect("lock").take();
        self.quota.lock().expect("lock").take();
    }

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
        self.with_usage(None)
    }

    /// The snapshot a list shows: its usage as the usage sampler last read it, if that is
    /// recent, since reading every sandbox's cgroup files on each list would take seconds
    /// on an edge of ten thousand.
    fn listed(&self) -> SandboxInfo {
        self.with_usage(Some(LISTED_USAGE_AGE))
    }

    fn with_usage(&self, max_age: Option<Duration>) -> SandboxInfo {
        let mut info = self.brief();
        if matches!(info.state, SandboxState::Running | SandboxState::Paused) {
            let cached = max_age.and_then(|age| {
                self.sampled
                    .lock()
                    .expect("lock")
                    .as_ref()
                    .filter(|(at, _)| at.elapsed() <= age)
                    .map(|(_, usage)| *usage)
            });
            info.usage = cached.unwrap_or_else(|| {
                let usage = self.sandbox.usage();
                self.sampled_now(&usage);
                usage
            });
        }
        info
    }

    /// Keeps `usage` as read now.
    fn sampled_now(&self, usage: &dsec_api::Usage) {
        *self.sampled.lock().expect("lock") = Some((Instant::now(), *usage));
    }

    /// Marks the usage last read as still current: the sampler saw no CPU time spent since.
    fn still_current(&self) {
        if let Some((at, _)) = self.sampled.lock().expect("lock").as_mut() {
            *at = Instant::now();
        }
    }

    /// The snapshot without the usage, which reads the sandbox's cgroup files.
    fn brief(&self) -> SandboxInfo {
        let mut info = self.info.clone();
        info.labels = self.labels();
        info.state = self.state();
        info
    }

    /// Why a sandbox in this state cannot serve a request (`what`: " and cannot …").
    fn state_error(&self, what: &str) -> ApiError {
        let id = &self.info.id;
        match self.state() {
            SandboxState::Failed => failed(
                id,
                self.failure.get().map_or("its init exited", String::as_str),
            ),
            other => ApiError::conflict(format!("sandbox {id:?} is {}{what}", other.as_str())),
        }
    }

    /// Marks a sandbox whose init died as failed: asks the backend how, logs and counts
    /// it, removes what it held and gives its budget back. Whoever notices first (the
    /// reaper, a request) does the work, the others wait for it; all return the error
    /// requests to the sandbox get.
    async fn fail(&self) -> ApiError {
        // Its init went because it is being stopped (TTL, a stop request, shutdown): a
        // request that saw the channel close meanwhile gets "stopping", not a failure.
        if matches!(self.state(), SandboxState::Stopping | SandboxState::Stopped) {
            return self.state_error("");
        }
        self.failure
            .get_or_init(|| async {
                let failure = self.sandbox.failure().await;
                tracing::warn!(
                    sandbox = %self.info.id,
                    backend = %self.info.backend,
                    cause = failure.cause,
                    "sandbox failed: {}",
                    failure.detail
                );
                metrics::counter!("dsec_sandbox_failures_total", "backend" => self.info.backend.clone(), "cause" => failure.cause)
                    .increment(1);
                self.set_state(SandboxState::Failed);
                self.emit(
                    kind::SANDBOX_FAILED,
                    serde_json::json!({"cause": failure.cause, "detail": failure.detail}),
                );
                self.sandbox.stop().await;
                self.release();
                failure.detail
            })
            .await;
        self.state_error("")
    }

    /// `result`, unless it says the sandbox's init is gone: then the sandbox is marked
    /// failed now (not at the reaper's next round) and the error says why.
    async fn or_failed<T>(&self, result: Result<T, ApiError>) -> Result<T, ApiError> {
        match result {
            Err(e) if e.kind == dsec_api::ErrorKind::SandboxFailed => Err(self.fail().await),
            other => other,
        }
    }

    /// Which lifetime is over, if one is: `ttl` or `idle_ttl`.
    fn expired(&self, now: Instant) -> Option<&'static str> {
        let past = |limit: Option<f64>, since: Instant| {
            limit.is_some_and(|s| now.duration_since(since) >= Duration::from_secs_f64(s))
        };
        let idle = self.busy.load(Ordering::Acquire) == 0
            && past(
                self.info.idle_ttl_s,
                *self.last_active.lock().expect("lock"),
            );
        if past(self.info.ttl_s, self.created) {
            Some("ttl")
        } else if idle {
            Some("idle_ttl")
        } else {
            None
        }
    }
}

/// The sandboxes of this host.
pub struct Edge {
    config: EdgeConfig,
    host_cpus: f64,
    admission: Arc<Admission>,
    images: ImageStore,
    backends: Backends,
    sandboxes: RwLock<HashMap<String, Arc<Entry>>>,
    log: TrajectoryLog,
    /// The server's file transfers in flight (see [`FILE_TRANSFERS_TOTAL`]).
    file_transfers: Arc<Semaphore>,
    /// Images of forks whose children are still being created: not garbage yet.
    forking: Mutex<HashSet<String>>,
    /// What happens here, for `GET /v1/events`.
    events: Arc<Events>,
    /// Creations in flight (published as the edge's load in a fleet).
    creating: AtomicUsize,
    /// Sandboxes made for an idempotency key (see [`Edge::create_once`]).
    idempotent: fleet::IdempotencyKeys,
    /// What each project's sandboxes hold, against its quotas.
    project_usage: projects::Usage,
    /// Projects whose gauges were published: one that holds nothing any more is set to 0.
    gauged_projects: Mutex<HashSet<Arc<str>>>,
    /// A fleet's quotas over all its edges, when this edge is one.
    shared_quotas: std::sync::OnceLock<Arc<dyn projects::SharedQuotas>>,
}

/// Marks a fork's image as being forked from, until dropped.
struct Forking<'a> {
    set: &'a Mutex<HashSet<String>>,
    name: String,
}

impl<'a> Forking<'a> {
    fn start(set: &'a Mutex<HashSet<String>>, name: &str) -> Forking<'a> {
        set.lock().expect("lock").insert(name.to_owned());
        Forking {
            set,
            name: name.to_owned(),
        }
    }
}

impl Drop for Forking<'_> {
    fn drop(&mut self) {
        self.set.lock().expect("lock").remove(&self.name);
    }
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

fn host_cpus() -> f64 {
    // SAFETY: sysconf takes an integer and returns an integer.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    n.max(1) as f64
}

/// Whole milliseconds, rounded up, of a timeout checked to be positive and at most
/// `MAX_TTL_S`.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // bounded as said
fn timeout_ms(timeout_s: f64) -> u64 {
    (timeout_s * 1000.0).ceil() as u64
}

/// A limit as the API's signed field holds it (a `u64` past `i64::MAX` saturates).
fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A limit that [`check_range`] bounded below by zero, as a `u64`.
fn unsigned(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
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

/// The argv a request's `cmd` stands for: a string runs under `/bin/sh -c`.
fn argv_of(cmd: Command) -> Result<Vec<String>, ApiError> {
    let argv = match cmd {
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
    Ok(argv)
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

/// A command's environment: the sandbox's (image, defaults, `env=` at create), then the
/// command's own. For a command run as a user, `HOME`, `USER` and `LOGNAME` of the
/// sandbox's are left out: the sandbox fills them in from the user, unless the command's
/// own environment sets them.
fn command_env(sandbox: &[String], command: &[String], as_user: bool) -> Vec<String> {
    if !as_user {
        return merge_env(&[sandbox, command]);
    }
    let identity = |e: &&String| {
        let key = e.split('=').next().unwrap_or_default();
        !matches!(key, "HOME" | "USER" | "LOGNAME")
    };
    let sandbox: Vec<String> = sandbox.iter().filter(identity).cloned().collect();
    merge_env(&[&sandbox, command])
}

/// Who a command runs as: `None` for root, named or by default, which runs as init
/// itself does at no cost; otherwise the user, checked to be well formed (the sandbox
/// looks it up). `cwd_given`: the request named a working directory, so the command does
/// not start in the user's home.
fn run_as(user: Option<&str>, cwd_given: bool) -> Result<Option<RunAs>, ApiError> {
    let Some(user) = not_root(user) else {
        return Ok(None);
    };
    UserSpec::parse(user).map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(Some(RunAs {
        user: user.to_owned(),
        home_cwd: !cwd_given,
    }))
}

/// `user` unless it names root (`"root"`, `"0"`, `"0:0"`), which is the default.
fn not_root(user: Option<&str>) -> Option<&str> {
    user.filter(|u| !matches!(*u, "root" | "0" | "0:0"))
}

/// Who a file operation runs as: `None` for root, named or by default; otherwise the
/// ids `user` has in the sandbox's own `/etc/passwd` and `/etc/group`, looked up for each
/// operation as for a command (`InvalidArgument` for a user the sandbox does not have).
async fn file_user(entry: &Entry, user: Option<&str>) -> Result<Option<AsUser>, ApiError> {
    let Some(user) = not_root(user) else {
        return Ok(None);
    };
    let account = crate::backend::account(&*entry.sandbox, user).await;
    let account = entry.or_failed(account).await?;
    Ok(Some(AsUser {
        uid: account.uid,
        gid: account.gid,
        groups: account.groups,
    }))
}

/// A file event's `data`, with the `user` the operation ran as unless that was root.
fn with_user(mut data: serde_json::Value, user: Option<&str>) -> serde_json::Value {
    if let (Some(user), Some(fields)) = (not_root(user), data.as_object_mut()) {
        fields.insert("user".to_owned(), user.into());
    }
    data
}

fn decode_b64(field: &str, data: &str) -> Result<Vec<u8>, ApiError> {
    base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| ApiError::invalid(format!("{field} is not valid base64: {e}")))
}

/// The policy a `network` field asks for: `InvalidArgument` naming a malformed rule, and
/// `Unavailable` for a network on a backend that cannot give one.
fn network_policy(
    name: &str,
    backend: &dyn Backend,
    network: &Network,
) -> Result<dsec_net::Policy, ApiError> {
    let policy = match network {
        Network::Enabled(false) => dsec_net::Policy::Off,
        Network::Enabled(true) => dsec_net::Policy::Full,
        Network::Allow { allow } => {
            dsec_net::Policy::allow(allow).map_err(|e| ApiError::invalid(e.to_string()))?
        }
    };
    if !policy.is_off() && !backend.has_networking() {
        return Err(ApiError::unavailable(format!(
            "backend {name:?} has no sandbox networking yet: only \"container\", \"microvm\" \
             and \"vm\" sandboxes take network=True or an allow-list"
        )));
    }
    Ok(policy)
}

/// Whether `caller` sees `image`: a fork's image holds its parent's filesystem, so only the
/// admin sees it (the fork's children are made from it inside the edge); every other image
/// is the admin's, shared by all projects.
fn shown(caller: &Caller, image: &ImageInfo) -> bool {
    match (caller.project(), &image.project) {
        (None, _) => true,
        (Some(p), Some(owner)) => **p == **owner,
        // The admin's images are shared, but a fork's is the forked sandbox's filesystem.
        (Some(_), None) => image.fork_of.is_none(),
    }
}

/// The error for a sandbox id this edge does not have (or the caller may not see).
fn no_such_sandbox(id: &str) -> ApiError {
    ApiError::not_found(format!(
        "sandbox {id:?} not found: it was stopped, expired, or never existed"
    ))
}

/// The error for a request to a sandbox whose init died.
fn failed(id: &str, why: &str) -> ApiError {
    ApiError::sandbox_failed(format!(
        "sandbox {id:?} has failed: {why}; stop it and create a new one"
    ))
}

/// `true` when the sandbox has every one of `labels`.
fn has_labels(entry: &Entry, labels: &[(String, String)]) -> bool {
    if labels.is_empty() {
        return true;
    }
    let have = entry.labels();
    labels
        .iter()
        .all(|(k, v)| have.get(k).is_some_and(|x| x == v))
}

impl Edge {
    /// An edge with no sandboxes yet, admitting them against `admission`.
    pub fn new(
        config: EdgeConfig,
        admission: Arc<Admission>,
        images: ImageStore,
        backends: Backends,
        log: TrajectoryLog,
        events: Arc<Events>,
    ) -> Edge {
        Edge {
            events,
            config,
            host_cpus: host_cpus(),
            admission,
            images,
            backends,
            sandboxes: RwLock::default(),
            log,
            file_transfers: Arc::new(Semaphore::new(FILE_TRANSFERS_TOTAL)),
            forking: Mutex::default(),
            creating: AtomicUsize::new(0),
            idempotent: fleet::IdempotencyKeys::default(),
            project_usage: projects::Usage::default(),
            gauged_projects: Mutex::default(),
            shared_quotas: std::sync::OnceLock::new(),
        }
    }

    /// The event stream.
    pub fn events(&self) -> &Arc<Events> {
        &self.events
    }

    /// The sandbox `id`, a request to it (its idle time starts again).
    fn entry(&self, id: &str) -> Result<Arc<Entry>, ApiError> {
        let entry = self.lookup(id)?;
        entry.touch();
        Ok(entry)
    }

    /// Counts as a request to sandbox `id` (its idle time starts again), if it exists: a
    /// client following one of its processes is using it.
    pub fn touch(&self, id: &str) {
        if let Ok(entry) = self.lookup(id) {
            entry.touch();
        }
    }

    /// The sandbox `id`, without counting as a request to it.
    fn lookup(&self, id: &str) -> Result<Arc<Entry>, ApiError> {
        self.sandboxes
            .read()
            .expect("lock")
            .get(id)
            .cloned()
            .ok_or_else(|| no_such_sandbox(id))
    }

    /// Refuses a project's token any sandbox but a live one of its own, with the error of
    /// an unknown id, so that a project cannot tell another's sandboxes from none. The
    /// admin passes: each route answers an unknown id its own way.
    pub fn check_visible(&self, caller: &Caller, id: &str) -> Result<(), ApiError> {
        if *caller == Caller::Admin {
            return Ok(());
        }
        let entry = self.lookup(id)?;
        if caller.sees(entry.project.as_deref()) {
            Ok(())
        } else {
            Err(no_such_sandbox(id))
        }
    }

    /// How many sandboxes project `name` has here: being created, live, or failed and not
    /// yet stopped (which hold no quota but are still its).
    pub fn project_sandboxes(&self, name: &str) -> u64 {
        let in_table = self
            .sandboxes
            .read()
            .expect("lock")
            .values()
            .filter(|e| e.project.as_deref() == Some(name))
            .count();
        let in_table = u64::try_from(in_table).unwrap_or(u64::MAX);
        in_table.max(self.project_usage.of(name).sandboxes)
    }

    /// What project `name`'s sandboxes hold now.
    pub fn project_usage(&self, name: &str) -> dsec_api::ProjectUsage {
        self.project_usage.of(name)
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
            _ => Err(entry.state_error("")),
        }
    }

    fn validate(&self, req: &CreateSandboxRequest) -> Result<(f64, u64, u64, u64), ApiError> {
        let cpus = req.cpus.unwrap_or(self.config.cpus);
        if !cpus.is_finite() {
            return Err(ApiError::invalid("cpus must be a finite number"));
        }
        let cpus = check_range("cpus", cpus, 0.01, self.host_cpus, " (this host's CPUs)")?;
        let capacity = self.admission.capacity();
        let mem = req.memory_mb.unwrap_or(signed(self.config.memory_mb));
        let mem = check_range(
            "memory_mb",
            mem,
            signed(MIN_MEMORY_MB),
            signed(capacity.memory_mb),
            &format!(
                " (what all sandboxes of this host may use together: {})",
                capacity.memory_why
            ),
        )?;
        // Refused rather than clamped: a sandbox must get the limit it asked for, and
        // one above the host's task limit could never be reached anyway.
        let pids = req.pids.unwrap_or(signed(self.config.pids));
        let pids = check_range(
            "pids",
            pids,
            signed(MIN_PIDS),
            signed(capacity.pids),
            &format!(
                " (the tasks all sandboxes of this host may hold together: {})",
                capacity.pids_why
            ),
        )?;
        let disk = req.disk_mb.unwrap_or(signed(self.config.disk_mb));
        let disk = check_range("disk_mb", disk, 1, signed(MAX_DISK_MB), "")?;
        Ok((cpus, unsigned(mem), unsigned(pids), unsigned(disk)))
    }

    /// Reserves one sandbox of `cpus` and `memory_mb` against `caller`'s project quotas
    /// (the admin has none), on this edge and, in a fleet, over all its edges; held until
    /// the returned hold drops.
    pub async fn reserve_quota(
        &self,
        caller: &Caller,
        cpus: f64,
        memory_mb: u64,
    ) -> Result<Option<QuotaHold>, ApiError> {
        let Caller::Project { name, quotas } = caller else {
            return Ok(None);
        };
        let mut hold = self.project_usage.reserve(name, quotas, cpus, memory_mb)?;
        let limited = quotas.max_sandboxes.is_some()
            || quotas.max_cpus.is_some()
            || quotas.max_memory_mb.is_some();
        if let Some(shared) = self.shared_quotas.get().filter(|_| limited) {
            shared
                .reserve(name, quotas, &self.project_usage, cpus, memory_mb)
                .await?;
            hold.share(Arc::clone(shared));
        }
        Ok(Some(hold))
    }

    /// Makes this edge count its projects' quotas over the fleet (see
    /// [`projects::SharedQuotas`]); set once, before it serves.
    pub fn share_quotas(&self, shared: Arc<dyn projects::SharedQuotas>) {
        let _ = self.shared_quotas.set(shared);
    }

    /// Creates a sandbox for `caller`'s project.
    pub async fn create(
        &self,
        req: CreateSandboxRequest,
        caller: &Caller,
    ) -> Result<SandboxInfo, ApiError> {
        let _in_flight = fleet::InFlight::enter(&self.creating);
        let (kind, _) = self.backends.get(&req.backend)?;
        let mut req = req;
        // Docker's images are its own references, not the store's.
        let own = match kind {
            BackendKind::Docker => None,
            _ => self.own_image(&req.image, caller).await,
        };
        let image = match own {
            Some(own) => {
                req.image.clone_from(&own.name);
                Ok(own)
            }
            None => self.images.get(&req.image),
        };
        if let Ok(image) = image {
            // A fork's children, made from the saved guest by its own backend, need no check.
            if let Some(guest) = &image.guest {
                if guest.backend != kind.name() {
                    return Err(ApiError::invalid(format!(
                        "image {} is a snapshot of a running {} guest (its memory and disk, \
                         not layers): create it with backend=\"{}\"",
                        req.image, guest.backend, guest.backend
                    )));
                }
            }
            if image.disk.is_some() && kind.name() != "vm" {
                return Err(ImageError::BootableDisk { name: req.image }.into());
            }
            if !shown(caller, &image_info(&self.images, image)) {
                return Err(ImageError::NotFound { name: req.image }.into());
            }
        }
        self.create_from(req, None, caller).await
    }

    /// Creates a sandbox; a fork's trajectory starts with its parent's first steps.
    async fn create_from(
        &self,
        req: CreateSandboxRequest,
        fork_of: Option<ForkOf>,
        caller: &Caller,
    ) -> Result<SandboxInfo, ApiError> {
        let request = req.clone();
        let (kind, backend) = self.backends.get(&req.backend)?;
        let (cpus, memory_mb, pids, disk_mb) = self.validate(&req)?;
        let ttl_s = check_duration("ttl_s", req.ttl_s)?;
        let idle_ttl_s = check_duration("idle_ttl_s", req.idle_ttl_s)?;
        let network = network_policy(kind.name(), backend.as_ref(), &req.network)?;
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
        let quota = self.reserve_quota(caller, cpus, memory_mb).await?;
        let id = format!(
            "{}-{:012x}",
            self.config.name,
            rand::rng().random::<u64>() & 0xffff_ffff_ffff
        );
        let grant = match backend.admitted_per_sandbox() {
            true => Some(
                self.admission
                    .admit(kind.name(), memory_mb, backend.host_tasks(pids))?,
            ),
            false => None,
        };
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
            edge: self.config.name.clone(),
            backend: req.backend,
            image: req.image,
            state: SandboxState::Running,
            created_at: unix_now(),
            limits: Limits {
                cpus: Some(cpus),
                memory_mb: Some(signed(memory_mb)),
                pids: Some(signed(pids)),
                disk_mb: Some(signed(disk_mb)),
            },
            ttl_s,
            idle_ttl_s,
            labels: req.labels,
            trajectory_id: req.trajectory_id,
            next_step: None,
            accelerator: sandbox.accelerator().map(str::to_owned),
            project: caller.project().map(|p| p.to_string()),
            usage: Default::default(),
        };
        let registered = self.log.register(SandboxRecord {
            id: info.id.clone(),
            trajectory_id: info.trajectory_id.clone(),
            image: info.image.clone(),
            backend: info.backend.clone(),
            env: req.env.clone(),
            created_at: info.created_at,
            project: info.project.clone(),
            fork_of: fork_of.clone(),
        });
        // Only a trajectory id can be refused; otherwise the record commits with (or
        // before) the sandbox's first step, and nothing need wait for it.
        if info.trajectory_id.is_some() {
            if let Err(e) = registered.wait().await {
                sandbox.stop().await;
                return Err(match e {
                    // Its message names the sandbox that has the trajectory: maybe another
                    // project's.
                    dsec_trajectory::LogError::TrajectoryTaken { trajectory_id, .. }
                        if *caller != Caller::Admin =>
                    {
                        ApiError::conflict(format!(
                            "trajectory_id {trajectory_id:?} already names another sandbox's \
                             trajectory: pick a new one"
                        ))
                    }
                    e => e.into(),
                });
            }
        }
        let entry = Arc::new(Entry {
            grant: Mutex::new(grant),
            project: caller.project().cloned(),
            quota: Mutex::new(quota),
            ..Entry::new(
                info.clone(),
                Position::new(
                    info.trajectory_id.clone(),
                    fork_of.as_ref().map_or(0, |f| f.steps),
                ),
                (merge_env(&[&base_env, &image_env, &sandbox_env]), workdir),
                request,
                (backend, sandbox),
                Arc::clone(&self.events),
            )
        });
        entry.emit(
            kind::SANDBOX_CREATED,
            serde_json::json!({
                "backend": info.backend,
                "image": info.image,
                "limits": info.limits,
                "trajectory_id": info.trajectory_id,
                "create_ms": started.elapsed().as_secs_f64() * 1000.0,
            }),
        );
        self.sandboxes.write().expect("lock").insert(id, entry);
        Ok(info)
    }

    /// One sandbox's info.
    pub fn get(&self, id: &str) -> Result<SandboxInfo, ApiError> {
        Ok(self.entry(id)?.snapshot())
    }

    /// What [`get`](Self::get) says but the usage (left zero): for the lookup that routes
    /// each request of a front end (E2B's), which a read of cgroup files would slow.
    pub fn get_brief(&self, id: &str) -> Result<SandboxInfo, ApiError> {
        Ok(self.entry(id)?.brief())
    }

    /// The sandboxes now in the table (a copy: the lock is not held while they are used).
    fn entries(&self) -> Vec<Arc<Entry>> {
        self.sandboxes
            .read()
            .expect("lock")
            .values()
            .cloned()
            .collect()
    }

    /// `caller`'s sandboxes having all of `labels`, oldest first.
    pub fn list(&self, labels: &[(String, String)], caller: &Caller) -> Vec<SandboxInfo> {
        let entries: Vec<Arc<Entry>> = self
            .sandboxes
            .read()
            .expect("lock")
            .values()
            .filter(|e| caller.sees(e.project.as_deref()) && has_labels(e, labels))
            .cloned()
            .collect();
        let mut infos: Vec<SandboxInfo> = entries.iter().map(|e| e.listed()).collect();
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
            _ => return Err(entry.state_error(" and cannot be paused")),
        }
        if entry.busy.load(Ordering::Acquire) > 0 {
            return Err(ApiError::conflict(format!(
                "sandbox {id:?} is running a command or a file transfer; pause it between them"
            )));
        }
        entry.sandbox.pause().await?;
        entry.set_state(SandboxState::Paused);
        kept::keep(&entry).await;
        entry.emit(kind::SANDBOX_PAUSED, serde_json::Value::Null);
        Ok(entry.snapshot())
    }

    /// Thaws a paused sandbox; resuming a running one is harmless.
    pub async fn resume(&self, id: &str) -> Result<SandboxInfo, ApiError> {
        let entry = self.entry(id)?;
        if entry.state() == SandboxState::Paused {
            // Running on, it no longer outlives the server, even if it cannot resume.
            entry.kept.store(false, Ordering::SeqCst);
            entry.sandbox.resume().await?;
            entry.set_state(SandboxState::Running);
            entry.emit(kind::SANDBOX_RESUMED, serde_json::Value::Null);
        }
        Ok(entry.snapshot())
    }

    /// Stores a sandbox's filesystem as image `name` (default `<id>-snap-<random>`). The
    /// sandbox is frozen for the copy, a running command included: the image is one
    /// consistent point in time, and only the writable layer is copied.
    pub async fn snapshot(
        &self,
        id: &str,
        name: Option<String>,
        caller: &Caller,
    ) -> Result<ImageInfo, ApiError> {
        let entry = self.entry(id)?;
        let running = match entry.state() {
            SandboxState::Running => true,
            SandboxState::Paused => false,
            _ => return Err(entry.state_error(" and cannot be snapshotted")),
        };
        let name = name.unwrap_or_else(|| format!("{id}-snap-{:08x}", rand::rng().random::<u32>()));
        if running {
            entry.sandbox.pause().await?;
        }
        let image = entry
            .sandbox
            .snapshot(&name, caller.project().map(|p| &**p))
            .await;
        if running {
            entry.sandbox.resume().await?;
        } else {
            // A guest saved to disk is snapshotted from memory: kept no longer.
            kept::keep(&entry).await;
        }
        image
    }

    /// `n` new sandboxes from a sandbox's current filesystem, with its settings: the
    /// parent is snapshotted once (image `<id>-fork-<random>`, listed with the others so
    /// it can be deleted once the forks are done) and each child starts from it.
    pub async fn fork(
        &self,
        id: &str,
        n: i64,
        caller: &Caller,
    ) -> Result<Vec<SandboxInfo>, ApiError> {
        let n = usize::try_from(check_range("n", n, 1, MAX_FORKS, "")?).unwrap_or_default();
        let parent = self.entry(id)?;
        // Holding the parent's trajectory position keeps its next step out until the fork
        // is done: the snapshot and the inherited steps describe the same point.
        let position = parent.position.hold().await;
        let name = format!("{id}-fork-{:08x}", rand::rng().random::<u32>());
        let _forking = Forking::start(&self.forking, &name);
        let image = self.snapshot(id, Some(name), caller).await?;
        let fork = dsec_image::Fork {
            edge: self.images.edge().to_owned(),
            parent: id.to_owned(),
        };
        if let Err(e) = self.images.mark_fork(&image.name, fork) {
            let _ = self.remove_image(&image.name).await;
            return Err(e.into());
        }
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
            self.create_from(child, fork_of.clone(), caller)
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
            let _ = self.remove_image(&image.name).await;
            return Err(e);
        }
        Ok(children)
    }

    /// Replaces the egress policy of a running sandbox.
    pub async fn set_network(&self, id: &str, network: &Network) -> Result<(), ApiError> {
        let entry = self.live_entry(id).await?;
        let policy = network_policy(&entry.info.backend, entry.backend.as_ref(), network)?;
        if policy.is_off() && !entry.backend.has_networking() {
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
                    name: r.name,
                })
                .collect(),
        })
    }

    /// Publishes `dsec_network_refused_total` (called before each metrics scrape): the
    /// refused-packet counters of the nftables rules, read now.
    pub async fn publish_network_metrics(&self) {
        let refused = self.backends.network_refused_total().await;
        metrics::counter!("dsec_network_refused_total").absolute(refused);
    }

    /// Adds label `key=value` to a running sandbox (the Watcher's flag).
    /// Not a request to the sandbox: its idle time goes on.
    pub(crate) fn flag(&self, id: &str, key: &str, value: &str) -> Result<(), ApiError> {
        let entry = self.lookup(id)?;
        entry
            .flags
            .lock()
            .expect("lock")
            .insert(key.to_owned(), value.to_owned());
        Ok(())
    }

    /// Stops and removes a sandbox.
    pub async fn stop(&self, id: &str) -> Result<(), ApiError> {
        self.stop_because(id, "requested").await
    }

    /// Stops and removes a sandbox; `reason` goes into its `sandbox.stopped` event.
    pub(crate) async fn stop_because(&self, id: &str, reason: &str) -> Result<(), ApiError> {
        let entry = self
            .sandboxes
            .write()
            .expect("lock")
            .remove(id)
            .ok_or_else(|| ApiError::not_found(format!("sandbox {id:?} not found")))?;
        entry.set_state(SandboxState::Stopping);
        entry.sandbox.stop().await;
        entry.set_state(SandboxState::Stopped);
        entry.emit(
            kind::SANDBOX_STOPPED,
            serde_json::json!({
                "reason": reason,
                "lifetime_s": entry.created.elapsed().as_secs_f64(),
            }),
        );
        // From now on its log may be pruned; nothing need wait for that.
        drop(self.log.stopped(id));
        entry.release();
        Ok(())
    }

    /// Stops every sandbox (server shutdown) but those kept across the restart, which are
    /// only let go (see [`kept`]).
    pub async fn stop_all(&self) {
        let ids: Vec<String> = {
            let mut table = self.sandboxes.write().expect("lock");
            table.retain(|_, e| !e.kept.load(Ordering::SeqCst));
            table.keys().cloned().collect()
        };
        futures::future::join_all(ids.iter().map(|id| self.stop_because(id, "shutdown"))).await;
    }

    /// Starts a command after writing its files; as root unless `req` names a user.
    pub async fn exec(&self, id: &str, req: impl Into<ExecBody>) -> Result<Execution, ApiError> {
        let ExecBody { exec: req, user } = req.into();
        let run_as = run_as(user.as_deref(), req.cwd.is_some())?;
        let entry = self.live_entry(id).await?;
        let argv = argv_of(req.cmd)?;
        let timeout_s = req.timeout_s.unwrap_or(self.config.timeout_s);
        if !timeout_s.is_finite() || timeout_s <= 0.0 || timeout_s > MAX_TTL_S {
            return Err(ApiError::invalid(format!(
                "timeout_s must be a positive number of seconds up to {MAX_TTL_S}, got {timeout_s}"
            )));
        }
        let max_output = match req.max_output_bytes {
            None => self.config.max_output_bytes,
            Some(n) => unsigned(check_range(
                "max_output_bytes",
                n,
                0,
                signed(MAX_OUTPUT_BYTES),
                "",
            )?),
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
            run_as: run_as.as_ref().map(|r| r.user.clone()),
            ..StepRequest::default()
        };
        let recorder =
            match trajectory::decide(&self.log, id, &entry.position, req.step, request).await? {
                Decision::Replay(step) => {
                    return Ok(Execution {
                        stream: Box::new(Replayed::new(step.result)),
                        replayed: true,
                    })
                }
                Decision::Run(recorder) => recorder,
            };
        let started = Instant::now();
        entry.emit(
            kind::COMMAND_START,
            serde_json::json!({
                "cmd": command_summary(&argv),
                "cwd": cwd,
                "step": req.step,
                "timeout_s": timeout_s,
                "user": run_as.as_ref().map(|r| &r.user),
            }),
        );
        for f in &files {
            entry.emit(
                kind::FILE_WRITE,
                serde_json::json!({"path": f.path, "size": f.data.len(), "mode": f.mode, "by": "exec"}),
            );
        }
        let stream = entry
            .sandbox
            .exec(CommandSpec {
                argv,
                env: command_env(&entry.env, &cmd_env, run_as.is_some()),
                cwd,
                stdin,
                files,
                timeout_ms: timeout_ms(timeout_s),
                max_output_bytes: max_output,
                run_as,
            })
            .await;
        metrics::histogram!("dsec_exec_start_seconds", "backend" => entry.info.backend.clone())
            .record(started.elapsed().as_secs_f64());
        let inner = match entry.or_failed(stream).await {
            Ok(inner) => inner,
            Err(e) => {
                entry.emit(
                    kind::COMMAND_END,
                    serde_json::json!({"error": e.message, "duration_ms": 0.0}),
                );
                return Err(e);
            }
        };
        Ok(Execution {
            stream: recorder.wrap(Box::new(Busy {
                inner,
                busy: BusyGuard::new(entry),
                started,
                ended: false,
            })),
            replayed: false,
        })
    }

    /// A sandbox's recorded commands (only those of `trajectory_id`, when given), from the
    /// trajectory log: readable after the sandbox is gone, and after a server restart.
    /// A project's token reads its own sandboxes' logs only, also once they stopped (the
    /// log records each sandbox's project); another's answers as an unknown id does.
    pub async fn sandbox_log(
        &self,
        caller: &Caller,
        id: &str,
        trajectory_id: Option<String>,
    ) -> Result<SandboxLog, ApiError> {
        match self.log.sandbox_log(id, trajectory_id).await? {
            Some(log) if caller.sees(log.sandbox.project.as_deref()) => Ok(log),
            _ if *caller != Caller::Admin => Err(no_such_sandbox(id)),
            _ => Err(ApiError::not_found(format!(
                "sandbox {id:?} not found in the trajectory log: it never existed here, \
                 or it stopped and its log was pruned (the oldest stopped sandboxes' \
                 logs go first when the log reaches its budget, --trajectory-max-mb)"
            ))),
        }
    }

    /// The account `user` names in sandbox `id`'s own `/etc/passwd` and `/etc/group`
    /// (see [`crate::backend::account`]).
    pub async fn account(
        &self,
        id: &str,
        user: &str,
    ) -> Result<dsec_runtime::users::Account, ApiError> {
        let entry = self.live_entry(id).await?;
        let account = crate::backend::account(&*entry.sandbox, user).await;
        entry.or_failed(account).await
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

    /// Opens a file of a sandbox for reading: its chunks, as the caller takes them.
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
        user: Option<&str>,
    ) -> Result<Box<dyn FileRead>, ApiError> {
        let span = file_span(id, path, "read");
        async {
            let (entry, slot) = self.file_transfer(id, path).await?;
            let user = file_user(&entry, user).await?;
            let read = entry
                .sandbox
                .read_file(path, self.config.files.max_read_bytes);
            let result = as_user(user, read).await;
            let inner = entry.or_failed(result).await.inspect_err(|e| {
                entry.refused("read", path, e);
            })?;
            let transfer = Transfer {
                inner,
                span: tracing::Span::current(),
                path: path.to_owned(),
                sent: 0,
                slot,
            };
            Ok(Box::new(transfer) as Box<dyn FileRead>)
        }
        .instrument(span)
        .await
    }

    /// Writes a file into a sandbox, from an upload streamed as it arrives.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        mut data: Upload,
        mode: u32,
        user: Option<&str>,
    ) -> Result<(), ApiError> {
        check_absolute("path", path)?;
        let limit = self.config.files.max_write_bytes;
        if let Some(len) = data.declared_len().filter(|n| *n > limit) {
            data.discard(limit).await;
            let err: ApiError = too_large_upload(path, Some(len), limit).into();
            if let Ok(entry) = self.lookup(id) {
                entry.refused("write", path, &err);
            }
            return Err(err);
        }
        data.set_limit(limit);
        let declared = data.declared_len();
        async {
            let (entry, _slot) = self.file_transfer(id, path).await?;
            let who = file_user(&entry, user).await?;
            let result = as_user(who, entry.sandbox.write_file(path, mode & 0o7777, data)).await;
            let written = entry.or_failed(result).await;
            match &written {
                Ok(()) => entry.emit(
                    kind::FILE_WRITE,
                    with_user(serde_json::json!({"path": path, "size": declared, "mode": mode & 0o7777, "by": "files"}), user),
                ),
                Err(e) => entry.refused("write", path, e),
            }
            written
        }
        .instrument(file_span(id, path, "write"))
        .await
    }

    /// Lists a directory of a sandbox.
    pub async fn list_files(
        &self,
        id: &str,
        path: &str,
        depth: u32,
        user: Option<&str>,
    ) -> Result<Vec<FileInfo>, ApiError> {
        if depth == 0 {
            return Err(ApiError::invalid(
                "depth must be at least 1 (1 lists the directory's own entries)",
            ));
        }
        async {
            let (entry, _slot) = self.file_transfer(id, path).await?;
            let user = file_user(&entry, user).await?;
            let result = as_user(user, entry.sandbox.list_files(path, depth)).await;
            entry.or_failed(result).await
        }
        .instrument(file_span(id, path, "list"))
        .await
    }

    /// The status of a path in a sandbox, a symbolic link in its last component not
    /// followed.
    pub async fn stat(
        &self,
        id: &str,
        path: &str,
        user: Option<&str>,
    ) -> Result<FileInfo, ApiError> {
        async {
            let (entry, _slot) = self.file_transfer(id, path).await?;
            let user = file_user(&entry, user).await?;
            let result = as_user(user, entry.sandbox.stat(path)).await;
            entry.or_failed(result).await
        }
        .instrument(file_span(id, path, "stat"))
        .await
    }

    /// Makes a directory in a sandbox; whether it was made.
    pub async fn make_dir(
        &self,
        id: &str,
        req: MakeDir,
        user: Option<&str>,
    ) -> Result<bool, ApiError> {
        async {
            let (entry, _slot) = self.file_transfer(id, &req.path).await?;
            let who = file_user(&entry, user).await?;
            let result = as_user(who, entry.sandbox.make_dir(&req)).await;
            let made = entry.or_failed(result).await?;
            if made {
                let data = with_user(
                    serde_json::json!({"path": req.path, "mode": req.mode}),
                    user,
                );
                entry.emit(kind::FILE_MKDIR, data);
            }
            Ok(made)
        }
        .instrument(file_span(id, &req.path, "mkdir"))
        .await
    }

    /// Renames a path within a sandbox.
    pub async fn move_path(
        &self,
        id: &str,
        req: MovePath,
        user: Option<&str>,
    ) -> Result<(), ApiError> {
        async {
            let (entry, _slot) = self.file_transfer(id, &req.src).await?;
            let who = file_user(&entry, user).await?;
            let result = as_user(who, entry.sandbox.move_path(&req)).await;
            entry.or_failed(result).await?;
            let data = with_user(
                serde_json::json!({"src": req.src, "dst": req.dst, "overwrite": req.overwrite}),
                user,
            );
            entry.emit(kind::FILE_MOVE, data);
            Ok(())
        }
        .instrument(file_span(id, &req.src, "move"))
        .await
    }

    /// Watches a directory of a sandbox; returns once the watch is armed. A watch holds
    /// no transfer slot: the sandbox bounds its watches itself.
    pub async fn watch(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<Box<dyn FileWatch>, ApiError> {
        check_absolute("path", path)?;
        async {
            let entry = self.live_entry(id).await?;
            let result = entry.sandbox.watch(path, recursive).await;
            entry.or_failed(result).await
        }
        .instrument(file_span(id, path, "watch"))
        .await
    }

    /// Removes a file, a link or a directory of a sandbox.
    pub async fn remove_path(
        &self,
        id: &str,
        req: RemovePath,
        user: Option<&str>,
    ) -> Result<(), ApiError> {
        async {
            let (entry, _slot) = self.file_transfer(id, &req.path).await?;
            let who = file_user(&entry, user).await?;
            let result = as_user(who, entry.sandbox.remove_path(&req)).await;
            entry.or_failed(result).await?;
            let data = with_user(
                serde_json::json!({"path": req.path, "recursive": req.recursive}),
                user,
            );
            entry.emit(kind::FILE_REMOVE, data);
            Ok(())
        }
        .instrument(file_span(id, &req.path, "remove"))
        .await
    }

    /// A live sandbox and a transfer slot on it and on the server; waits up to
    /// [`FILE_TRANSFER_WAIT`] for one to free up.
    async fn file_transfer(
        &self,
        id: &str,
        path: &str,
    ) -> Result<(Arc<Entry>, TransferSlot), ApiError> {
        let entry = self.live_entry(id).await?;
        let sandbox = take_slot(&entry.file_transfers, "sandbox", || {
            format!(
                "sandbox {id:?} has {FILE_TRANSFERS_PER_SANDBOX} file transfers in flight, \
                 the most one sandbox may have; {path:?} waited {FILE_TRANSFER_WAIT:?} for one \
                 to end"
            )
        })
        .await?;
        let server = take_slot(&self.file_transfers, "server", || {
            format!(
                "the server has {FILE_TRANSFERS_TOTAL} file transfers in flight, the most it \
                 serves at once; {path:?} waited {FILE_TRANSFER_WAIT:?} for one to end"
            )
        })
        .await?;
        let slot = TransferSlot {
            _sandbox: sandbox,
            _server: server,
            _busy: BusyGuard::new(Arc::clone(&entry)),
        };
        Ok((entry, slot))
    }

    /// Stops sandboxes past their TTL or idle TTL, and marks failed those whose init died.
    pub async fn reap_once(&self) {
        let now = Instant::now();
        for entry in self.entries() {
            let id = &entry.info.id;
            if let Some(which) = entry.expired(now) {
                tracing::info!(sandbox = %id, "lifetime over; stopping");
                let _ = self.stop_because(id, which).await;
            } else if entry.state() == SandboxState::Running && !entry.sandbox.is_alive() {
                entry.fail().await;
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

    /// Publishes the sandbox and admission gauges (called before each metrics scrape).
    pub fn publish_gauges(&self) {
        self.admission.publish_gauges();
        let mut counts: HashMap<(String, SandboxState), u64> = HashMap::new();
        for e in self.sandboxes.read().expect("lock").values() {
            *counts
                .entry((e.info.backend.clone(), e.state()))
                .or_default() += 1;
        }
        for backend in BackendKind::ALL.map(BackendKind::name) {
            for state in SandboxState::ALL {
                let n = counts
                    .get(&(backend.to_owned(), state))
                    .copied()
                    .unwrap_or(0);
                metrics::gauge!("dsec_sandboxes", "backend" => backend, "state" => state.as_str())
                    .set(n as f64);
            }
        }
        // By project: one series per project, never per sandbox.
        let now = self.project_usage.all();
        let mut gauged = self.gauged_projects.lock().expect("lock");
        for gone in gauged.iter() {
            if !now.iter().any(|(p, _)| p == gone) {
                publish_project(gone, dsec_api::ProjectUsage::default());
            }
        }
        gauged.clear();
        for (project, usage) in now {
            publish_project(&project, usage);
            gauged.insert(project);
        }
    }

    /// Imports an image for `caller` (a project's is its own, named under `<project>/`),
    /// telling `progress` about each layer.
    pub async fn import_image(
        &self,
        source: &str,
        name: Option<&str>,
        caller: &Caller,
        progress: Arc<dyn Fn(dsec_image::ImportProgress) + Send + Sync>,
    ) -> Result<ImageInfo, ApiError> {
        let project = caller.project().map(|p| &**p);
        let image = self
            .images
            .import_with(source, name, project, progress)
            .await?;
        Ok(image_info(&self.images, image))
    }

    /// The image of `caller`'s own that `name` means, if it has one: a project's
    /// own image shadows the admin's of the same name, for that project only.
    async fn own_image(&self, name: &str, caller: &Caller) -> Option<dsec_image::Image> {
        let own = dsec_image::owned_name(Some(caller.project()?), name);
        match self.images.resolve(&own).await {
            Ok(image) if image.project.as_deref() == caller.project().map(|p| &**p) => Some(image),
            _ => None,
        }
    }

    /// All images `caller` may see.
    pub fn images(&self, caller: &Caller) -> Result<Vec<ImageInfo>, ApiError> {
        let images = self.images.list()?;
        Ok(images
            .into_iter()
            .map(|i| image_info(&self.images, i))
            .filter(|i| shown(caller, i))
            .collect())
    }

    /// One image, as `caller` means `name` (its own first).
    pub async fn image(&self, name: &str, caller: &Caller) -> Result<ImageInfo, ApiError> {
        let image = match self.own_image(name, caller).await {
            Some(own) => own,
            None => self.images.get(name)?,
        };
        let info = image_info(&self.images, image);
        if shown(caller, &info) {
            Ok(info)
        } else {
            Err(ImageError::NotFound {
                name: name.to_owned(),
            }
            .into())
        }
    }

    /// Deletes an image `caller` owns (the admin: any image); layers that live sandboxes
    /// use stay until those stop.
    pub async fn delete_image(&self, name: &str, caller: &Caller) -> Result<(), ApiError> {
        let info = self.image(name, caller).await?;
        if info.project.is_none() {
            caller.require_admin("deleting an image of the admin's")?;
        }
        self.remove_image(&info.name).await
    }

    /// Deletes every image of a project that is gone (nobody else may use them).
    pub async fn delete_project_images(&self, project: &str) -> Result<(), ApiError> {
        for image in self.images.list()? {
            if image.project.as_deref() == Some(project) {
                self.remove_image(&image.name).await?;
            }
        }
        Ok(())
    }

    /// Removes image `name` from the store.
    async fn remove_image(&self, name: &str) -> Result<(), ApiError> {
        let (images, name) = (self.images.clone(), name.to_owned());
        tokio::task::spawn_blocking(move || images.remove(&name))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??;
        Ok(())
    }

    /// What the image store holds.
    pub async fn store_info(&self) -> Result<StoreInfo, ApiError> {
        let images = self.images.clone();
        let usage = tokio::task::spawn_blocking(move || images.usage())
            .await
            .map_err(|e| ApiError::internal(e.to_string()))??;
        Ok(StoreInfo {
            root: self.images.root().display().to_string(),
            images: usage.images,
            layers: usage.layers,
            layer_bytes: usage.layer_bytes,
            mounted: usage.mounted,
        })
    }

    /// Collects image garbage: the images of this edge's forks once none of their
    /// sandboxes is left (a fork still starting its children keeps its image), then
    /// layers nothing references or holds, then what the backends keep of images that
    /// are gone (VM disks, boot templates).
    pub async fn prune_images(&self) -> Result<PruneResult, ApiError> {
        let mut in_use: HashSet<String> = self
            .sandboxes
            .read()
            .expect("lock")
            .values()
            .map(|e| e.info.image.clone())
            .collect();
        in_use.extend(self.forking.lock().expect("lock").iter().cloned());
        let images = self.images.clone();
        let edge = images.edge().to_owned();
        let (swept, pruned, live) = tokio::task::spawn_blocking(move || {
            let mut swept = Vec::new();
            for image in images.list()? {
                let ours = image.fork.as_ref().is_some_and(|f| f.edge == edge);
                if ours && !in_use.contains(&image.name) {
                    match images.remove(&image.name) {
                        Ok(()) => swept.push(image.name),
                        Err(e) => tracing::warn!(image = %image.name, error = %e, "cannot remove a fork's image"),
                    }
                }
            }
            let pruned = images.prune()?;
            let live: HashSet<String> = images.list()?.into_iter().map(|i| i.id).collect();
            Ok::<_, dsec_image::ImageError>((swept, pruned, live))
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
        let other_bytes = self.backends.prune_images(&live).await;
        if !swept.is_empty() || pruned.layers > 0 || other_bytes > 0 {
            tracing::info!(
                fork_images = swept.len(),
                layers = pruned.layers,
                layer_bytes = pruned.bytes,
                other_bytes,
                "collected image garbage"
            );
        }
        Ok(PruneResult {
            images: swept,
            layers: pruned.layers,
            layer_bytes: pruned.bytes,
            other_bytes,
        })
    }

    /// Runs the image collector forever: this edge's lease on the shared layer store is
    /// refreshed every [`LEASE_REFRESH`], garbage collected every [`GC_INTERVAL`].
    pub async fn image_collector(self: Arc<Self>) {
        let mut tick = tokio::time::interval(LEASE_REFRESH);
        let mut last_gc = Instant::now();
        loop {
            tick.tick().await;
            let images = self.images.clone();
            match tokio::task::spawn_blocking(move || images.refresh_lease()).await {
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot refresh this edge's lease on the layer store")
                }
                Err(e) => tracing::warn!(error = %e, "lease refresh failed"),
                Ok(Ok(())) => {}
            }
            if last_gc.elapsed() >= GC_INTERVAL {
                last_gc = Instant::now();
                if let Err(e) = self.prune_images().await {
                    tracing::warn!(error = %e.message, "image garbage collection failed");
                }
            }
        }
    }
}

/// How often an edge proves to others sharing its layer store that it is alive.
const LEASE_REFRESH: Duration = Duration::from_secs(30);
/// How often image garbage is collected on its own.
const GC_INTERVAL: Duration = Duration::from_secs(60);

/// Counts a sandbox as busy (not idle, not to be paused) while it lives.
struct BusyGuard(Arc<Entry>);

impl BusyGuard {
    fn new(entry: Arc<Entry>) -> BusyGuard {
        entry.busy.fetch_add(1, Ordering::AcqRel);
        BusyGuard(entry)
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.touch();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Wraps a running command's output so that the sandbox counts as busy until the command
/// ends or its caller goes away, and records how it ended as events.
struct Busy {
    inner: Box<dyn OutputStream>,
    busy: BusyGuard,
    started: Instant,
    /// Its `command.end` was emitted.
    ended: bool,
}

impl Busy {
    /// Emits `command.end`, and the limit events its status shows.
    fn ended(&mut self, exit: Option<&crate::backend::ExitStatus>, error: Option<&str>) {
        self.ended = true;
        let entry = &self.busy.0;
        let wall_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        let Some(exit) = exit else {
            entry.emit(
                kind::COMMAND_END,
                serde_json::json!({
                    "duration_ms": wall_ms,
                    "error": error,
                    "abandoned": error.is_none(),
                }),
            );
            return;
        };
        entry.emit(
            kind::COMMAND_END,
            serde_json::json!({
                "exit_code": exit.exit_code,
                "duration_ms": exit.duration_ms,
                "timed_out": exit.timed_out,
                "truncated": exit.truncated,
                "oom_killed": exit.oom_killed,
            }),
        );
        if exit.truncated {
            entry.emit(kind::OUTPUT_TRUNCATED, serde_json::json!({"by": "command"}));
        }
        if exit.oom_killed {
            entry.oom_reported.fetch_add(1, Ordering::AcqRel);
            entry.emit(
                kind::LIMIT_OOM,
                serde_json::json!({"by": "command", "memory_mb": entry.info.limits.memory_mb}),
            );
        }
    }
}

#[async_trait::async_trait]
impl OutputStream for Busy {
    async fn next(&mut self) -> Option<Result<crate::backend::Output, ApiError>> {
        // init may die while a command runs: the error then says why, as later ones do.
        let event = match self.inner.next().await {
            Some(result) => Some(self.busy.0.or_failed(result).await),
            None => None,
        };
        match &event {
            Some(Ok(crate::backend::Output::Exit(exit))) => self.ended(Some(exit), None),
            Some(Err(e)) if !self.ended => self.ended(None, Some(&e.message)),
            _ => {}
        }
        event
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if !self.ended {
            self.ended(None, None);
        }
    }
}

/// A command as an event shows it: its shell text or argv, cut at 1 KiB.
fn command_summary(argv: &[String]) -> String {
    const MAX: usize = 1024;
    let mut text = match argv {
        [sh, c, cmd] if sh == "/bin/sh" && c == "-c" => cmd.clone(),
        _ => serde_json::to_string(argv).unwrap_or_default(),
    };
    if text.len() > MAX {
        let mut cut = MAX;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
}

/// A file transfer's places in its sandbox's and the server's limits; the sandbox is busy
/// while it lasts.
struct TransferSlot {
    _sandbox: OwnedSemaphorePermit,
    _server: OwnedSemaphorePermit,
    _busy: BusyGuard,
}

/// The span of one file request: its log lines name the sandbox and the path.
fn file_span(id: &str, path: &str, op: &'static str) -> tracing::Span {
    tracing::info_span!("file", sandbox = %id, path = %path, op)
}

/// The gauges of what `project`'s sandboxes hold on this edge.
fn publish_project(project: &str, usage: dsec_api::ProjectUsage) {
    let project = project.to_owned();
    metrics::gauge!("dsec_project_sandboxes", "project" => project.clone())
        .set(usage.sandboxes as f64);
    metrics::gauge!("dsec_project_cpus", "project" => project.clone()).set(usage.cpus);
    metrics::gauge!("dsec_project_memory_mb", "project" => project).set(usage.memory_mb as f64);
}

/// A permit of `slots`, waiting for one up to [`FILE_TRANSFER_WAIT`]; a wait is counted
/// (`dsec_file_limit_hits_total{limit}`), a wait in vain refused and counted as such.
async fn take_slot(
    slots: &Arc<Semaphore>,
    limit: &'static str,
    refusal: impl FnOnce() -> String,
) -> Result<OwnedSemaphorePermit, ApiError> {
    if let Ok(permit) = Arc::clone(slots).try_acquire_owned() {
        return Ok(permit);
    }
    metrics::counter!("dsec_file_limit_hits_total", "limit" => limit).increment(1);
    tracing::info!(limit, "file transfer waits for a free slot");
    match tokio::time::timeout(FILE_TRANSFER_WAIT, Arc::clone(slots).acquire_owned()).await {
        Ok(Ok(permit)) => Ok(permit),
        _ => {
            let message = refusal();
            metrics::counter!("dsec_file_refused_total", "reason" => "busy").increment(1);
            tracing::warn!(limit, %message, "file request refused");
            Err(ApiError::unavailable(message))
        }
    }
}

/// A file read in progress, holding its slot until it is dropped (then its `file.read`
/// event says how much was sent).
struct Transfer {
    inner: Box<dyn FileRead>,
    span: tracing::Span,
    path: String,
    sent: u64,
    slot: TransferSlot,
}

impl Drop for Transfer {
    fn drop(&mut self) {
        self.slot._busy.0.emit(
            kind::FILE_READ,
            serde_json::json!({"path": self.path, "size": self.sent, "complete": self.inner.finished()}),
        );
    }
}

#[async_trait::async_trait]
impl FileRead for Transfer {
    async fn next(&mut self) -> Option<Result<axum::body::Bytes, ApiError>> {
        let chunk = self.inner.next().instrument(self.span.clone()).await;
        match &chunk {
            Some(Ok(bytes)) => self.sent += bytes.len() as u64,
            Some(Err(e)) => {
                let _entered = self.span.enter();
                tracing::warn!(error = %e, "file read broke off");
            }
            None => {}
        }
        chunk
    }

    fn finished(&self) -> bool {
        self.inner.finished()
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
