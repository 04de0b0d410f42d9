//! The trajectory log: every command a sandbox runs, with its request and its result,
//! appended in order to SQLite before the result goes back to the client.
//!
//! # Why
//!
//! RL trainers are preempted. A resumed trainer re-issues the commands it had sent, with
//! their step numbers; re-running them would break every non-idempotent step (an append,
//! `git commit`, `pip install`). The edge looks each step up here: a recorded step returns
//! its recorded result without running, a different request at a recorded step is an
//! error. The same log is the provenance of a sandbox (`dsec log`) and lets a whole
//! session be re-run into a fresh sandbox (`dsec replay`).
//!
//! # Layout
//!
//! One database, `<state-dir>/trajectory.db`, in WAL mode, with two tables:
//! - `sandboxes`: id → trajectory id, image, backend, creation time. A trajectory id names
//!   one sandbox's trajectory (`UNIQUE`): reusing it for another sandbox is refused, since
//!   replaying recorded results into a sandbox that never ran them would leave it in a
//!   state its client does not expect.
//! - `steps`: one row per finished command, keyed by `(trajectory, step)`, where
//!   `trajectory` is the sandbox's trajectory id, or its sandbox id when it has none.
//!   Stdin and uploaded files are recorded as SHA-256 digests, not content.
//!
//! # Durability (the fsync policy)
//!
//! Every caller is answered only after the commit holding its row has been written to the
//! WAL file.
//!
//! With [`SyncMode::Normal`] (the default) a commit is a `write(2)` into the WAL without fsync:
//! a result a client received survives a SIGKILL (or any crash) of the server, because the
//! kernel holds the data, but the last commits may be lost if the machine itself crashes or
//! loses power. Such a commit costs about 20–30 µs, so it is made on the caller's thread
//! (under the write connection's lock): handing it to another thread and back would cost
//! more under load. Only a step with a large output is written on tokio's blocking pool. WAL checkpoints, which do fsync, run every half second on a thread of
//! their own.
//!
//! With [`SyncMode::Full`] each commit also fsyncs the WAL, so results survive power loss too.
//! One writer thread owns the write connection: it takes every append waiting in its queue,
//! writes them in one transaction and commits (group commit), so one fsync (0.3 ms to
//! several ms on the development machine's virtual disk) serves every step the batch holds.
//!
//! Reads use their own connections and never wait on the writer.
#![warn(missing_docs)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;

use rusqlite::{params, Connection, OptionalExtension};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;
use utoipa::ToSchema;

/// Most appends written in one transaction; bounds the latency of the batch's first caller.
const MAX_BATCH: usize = 512;
/// Read connections kept open for reuse.
const MAX_IDLE_READERS: usize = 8;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS sandboxes (
    id            TEXT PRIMARY KEY,
    trajectory_id TEXT UNIQUE,
    image         TEXT NOT NULL,
    backend       TEXT NOT NULL,
    env           TEXT NOT NULL,
    created_at    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    trajectory    TEXT NOT NULL,
    step          INTEGER NOT NULL,
    trajectory_id TEXT,
    sandbox_id    TEXT NOT NULL,
    argv          TEXT NOT NULL,
    env           TEXT NOT NULL,
    cwd           TEXT NOT NULL,
    stdin_sha256  TEXT,
    files         TEXT NOT NULL,
    timeout_s     REAL,
    exit_code     INTEGER,
    stdout        TEXT NOT NULL,
    stderr        TEXT NOT NULL,
    timed_out     INTEGER NOT NULL,
    truncated     INTEGER NOT NULL,
    oom_killed    INTEGER NOT NULL,
    duration_ms   REAL NOT NULL,
    started_at    REAL NOT NULL,
    finished_at   REAL NOT NULL,
    PRIMARY KEY (trajectory, step)
);
";

const STEP_COLUMNS: &str = "step, trajectory_id, sandbox_id, argv, env, cwd, stdin_sha256, \
    files, timeout_s, exit_code, stdout, stderr, timed_out, truncated, oom_killed, \
    duration_ms, started_at, finished_at";

/// Why the log failed.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// SQLite refused an operation.
    #[error("trajectory log {path}: {what}: {source}")]
    Sqlite {
        /// The database file.
        path: PathBuf,
        /// What the log was doing.
        what: &'static str,
        /// SQLite's error.
        source: rusqlite::Error,
    },
    /// A recorded row does not decode (written by an incompatible version, or damaged).
    #[error("trajectory log {path}: step {step} of {trajectory:?} is corrupt: {source}")]
    Corrupt {
        /// The database file.
        path: PathBuf,
        /// The trajectory key.
        trajectory: String,
        /// The step.
        step: i64,
        /// The decoding error.
        source: serde_json::Error,
    },
    /// A recorded sandbox does not decode.
    #[error("trajectory log {path}: the record of sandbox {id} is corrupt: {source}")]
    CorruptSandbox {
        /// The database file.
        path: PathBuf,
        /// The sandbox id.
        id: String,
        /// The decoding error.
        source: serde_json::Error,
    },
    /// The trajectory id already names another sandbox's trajectory.
    #[error("trajectory {trajectory_id:?} already belongs to sandbox {owner}; a trajectory id names one sandbox's trajectory: pick a new one, or `dsec replay {owner}` to re-run it in a fresh sandbox")]
    TrajectoryTaken {
        /// The trajectory id asked for.
        trajectory_id: String,
        /// The sandbox that recorded it.
        owner: String,
    },
    /// The same step was appended twice (a bug in the caller's serialisation).
    #[error("step {step} of trajectory {trajectory:?} is already recorded")]
    Duplicate {
        /// The trajectory key.
        trajectory: String,
        /// The step.
        step: i64,
    },
    /// The transaction holding this write did not commit (disk full, I/O error).
    #[error("trajectory log {path}: commit failed: {message}")]
    Commit {
        /// The database file.
        path: PathBuf,
        /// SQLite's error, shared by every write of the batch.
        message: String,
    },
    /// The writer thread could not be started.
    #[error("starting the trajectory log's writer thread: {0}")]
    Thread(std::io::Error),
    /// The writer thread is gone (it panicked, or the log is shutting down).
    #[error("the trajectory log's writer has stopped")]
    WriterGone,
}

/// How hard a commit waits for the disk; see the crate docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SyncMode {
    /// fsync each group commit: survives power loss, at one fsync per batch.
    Full,
    /// No fsync on commit: survives a crash (SIGKILL) of the server, not of the machine.
    #[default]
    Normal,
}

/// A file uploaded with a command, as recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FileDigest {
    /// Absolute path inside the sandbox.
    pub path: String,
    /// `sha256:<hex>` of the content.
    pub sha256: String,
    /// Permission bits.
    pub mode: u32,
}

/// What a step asked for: enough to tell whether a re-issued request is the same one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StepRequest {
    /// The program and its arguments (a shell command is `["/bin/sh", "-c", CMD]`).
    pub argv: Vec<String>,
    /// The command's own environment (not the sandbox's or the image's).
    pub env: BTreeMap<String, String>,
    /// The working directory it ran in.
    pub cwd: String,
    /// `sha256:<hex>` of the standard input, if any was given.
    pub stdin_sha256: Option<String>,
    /// Files written before the command ran.
    pub files: Vec<FileDigest>,
    /// The timeout, in seconds, as requested (not compared on replay).
    pub timeout_s: Option<f64>,
}

impl StepRequest {
    /// Whether `other` re-issues this request. The timeout is left out: a resumed client
    /// may well give a step more time without asking for anything else.
    pub fn same_as(&self, other: &StepRequest) -> bool {
        self.argv == other.argv
            && self.env == other.env
            && self.cwd == other.cwd
            && self.stdin_sha256 == other.stdin_sha256
            && self.files == other.files
    }

    /// A one-line description for error messages: command, cwd, env and digests.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "command {} in {:?}",
            serde_json::to_string(&self.argv).unwrap_or_default(),
            self.cwd
        );
        if !self.env.is_empty() {
            s += &format!(
                ", env {}",
                serde_json::to_string(&self.env).unwrap_or_default()
            );
        }
        if let Some(d) = &self.stdin_sha256 {
            s += &format!(", stdin {d}");
        }
        for f in &self.files {
            s += &format!(", file {} {}", f.path, f.sha256);
        }
        s
    }
}

/// `sha256:<hex>` of `data`, the form digests take in the log.
pub fn digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// How a step ended, as the client was told.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StepResult {
    /// Exit status; `null` after a timeout.
    pub exit_code: Option<i32>,
    /// Standard output (UTF-8, invalid bytes replaced).
    pub stdout: String,
    /// Standard error, likewise.
    pub stderr: String,
    /// The timeout fired.
    pub timed_out: bool,
    /// Output beyond the bound was discarded.
    pub truncated: bool,
    /// The memory limit killed a process of the command.
    pub oom_killed: bool,
    /// Wall time of the command.
    pub duration_ms: f64,
}

/// One recorded command.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Step {
    /// Position in the trajectory, from 0.
    pub step: i64,
    /// The trajectory id the sandbox was created with; `null` when it had none (the
    /// server then numbers its commands in the order they arrive).
    pub trajectory_id: Option<String>,
    /// The sandbox that ran it.
    pub sandbox_id: String,
    /// What was asked.
    pub request: StepRequest,
    /// What came back.
    pub result: StepResult,
    /// Unix time the command started, in seconds.
    pub started_at: f64,
    /// Unix time its result was recorded, in seconds.
    pub finished_at: f64,
}

impl Step {
    /// The key its trajectory is stored under.
    fn trajectory(&self) -> &str {
        self.trajectory_id.as_deref().unwrap_or(&self.sandbox_id)
    }
}

/// A sandbox as the log remembers it, after it is gone too.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SandboxRecord {
    /// Sandbox id.
    pub id: String,
    /// Its trajectory id, if it was created with one.
    pub trajectory_id: Option<String>,
    /// The image it was created from.
    pub image: String,
    /// Its backend.
    pub backend: String,
    /// The environment it was created with (what `dsec replay` recreates it with).
    pub env: BTreeMap<String, String>,
    /// Unix time of creation, in seconds.
    pub created_at: f64,
    /// A fork's parent trajectory: its first steps are copied into this sandbox's
    /// trajectory when the sandbox is recorded, so the fork continues from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_of: Option<ForkOf>,
}

/// Where a forked sandbox's trajectory branches off.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ForkOf {
    /// The parent's trajectory id.
    pub trajectory_id: String,
    /// How many of its steps (0 to `steps - 1`) the fork inherits.
    pub steps: i64,
}

/// `GET /v1/sandboxes/{id}/log`: a sandbox and the steps it recorded, in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SandboxLog {
    /// The sandbox.
    pub sandbox: SandboxRecord,
    /// Its steps, by step number.
    pub steps: Vec<Step>,
}

enum Job {
    Register(SandboxRecord, oneshot::Sender<Result<(), LogError>>),
    Append(Box<Step>, oneshot::Sender<Result<(), LogError>>),
}

impl Job {
    /// Bytes of command output the job writes.
    fn output_bytes(&self) -> usize {
        match self {
            Job::Register(..) => 0,
            Job::Append(s, _) => s.result.stdout.len() + s.result.stderr.len(),
        }
    }
}

/// A write that the writer thread will answer once it is durable (or failed).
#[must_use = "a write is durable only once wait() returns Ok"]
pub struct Pending(oneshot::Receiver<Result<(), LogError>>);

impl Pending {
    /// Waits until the write is committed under the log's [`SyncMode`] policy.
    pub async fn wait(self) -> Result<(), LogError> {
        self.0.await.unwrap_or(Err(LogError::WriterGone))
    }
}

/// Output (stdout and stderr) beyond which an append is written off the caller's thread.
const MAX_INLINE_OUTPUT: usize = 64 << 10;

/// Where writes go: how a commit is made durable decides which is cheaper.
enum Writer {
    /// [`SyncMode::Normal`]: a commit is a `write(2)` of tens of microseconds, cheaper on the
    /// caller's thread than the two thread hops to a writer thread and back.
    Inline(Mutex<Connection>),
    /// [`SyncMode::Full`]: the writer thread, so one fsync serves every append queued meanwhile.
    Thread(Mutex<mpsc::Sender<Job>>),
}

struct Inner {
    path: PathBuf,
    writer: Writer,
    readers: Mutex<Vec<Connection>>,
}

impl Inner {
    /// Writes `job` on this thread ([`Writer::Inline`] only).
    fn write_inline(&self, job: Job) {
        if let Writer::Inline(conn) = &self.writer {
            write_batch(&mut conn.lock().expect("lock"), &self.path, vec![job]);
        }
    }
}

/// The trajectory log of one state directory. Cheap to clone.
#[derive(Clone)]
pub struct TrajectoryLog {
    inner: Arc<Inner>,
}

fn sqlite_err<'a>(
    path: &'a Path,
    what: &'static str,
) -> impl FnOnce(rusqlite::Error) -> LogError + 'a {
    move |source| LogError::Sqlite {
        path: path.to_owned(),
        what,
        source,
    }
}

fn open_connection(path: &Path, sync: SyncMode) -> Result<Connection, LogError> {
    let conn = Connection::open(path).map_err(sqlite_err(path, "opening"))?;
    let sync = match sync {
        SyncMode::Full => "FULL",
        SyncMode::Normal => "NORMAL",
    };
    conn.execute_batch(&format!(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = {sync}; PRAGMA busy_timeout = 10000;"
    ))
    .map_err(sqlite_err(path, "setting WAL mode"))?;
    Ok(conn)
}

impl TrajectoryLog {
    /// Opens (creating if needed) the log at `path` and starts its writer thread.
    pub fn open(path: &Path, sync: SyncMode) -> Result<TrajectoryLog, LogError> {
        let conn = open_connection(path, sync)?;
        conn.execute_batch(SCHEMA)
            .map_err(sqlite_err(path, "creating the schema"))?;
        let writer = match sync {
            SyncMode::Normal => {
                // Checkpoints (which fsync) run on a thread of their own, not in a request.
                conn.execute_batch("PRAGMA wal_autocheckpoint = 0;")
                    .map_err(sqlite_err(path, "setting WAL mode"))?;
                Writer::Inline(Mutex::new(conn))
            }
            SyncMode::Full => {
                let (tx, rx) = mpsc::channel();
                let writer_path = path.to_owned();
                thread::Builder::new()
                    .name("dsec-trajectory".into())
                    .spawn(move || writer(conn, &writer_path, rx))
                    .map_err(LogError::Thread)?;
                Writer::Thread(Mutex::new(tx))
            }
        };
        let inner = Arc::new(Inner {
            path: path.to_owned(),
            writer,
            readers: Mutex::default(),
        });
        if sync == SyncMode::Normal {
            let checkpointer = open_connection(path, sync)?;
            let weak = Arc::downgrade(&inner);
            thread::Builder::new()
                .name("dsec-traj-ckpt".into())
                .spawn(move || checkpoints(checkpointer, weak))
                .map_err(LogError::Thread)?;
        }
        Ok(TrajectoryLog { inner })
    }

    fn send(&self, job: impl FnOnce(oneshot::Sender<Result<(), LogError>>) -> Job) -> Pending {
        let (tx, rx) = oneshot::channel();
        let job = job(tx);
        match &self.inner.writer {
            Writer::Inline(_) => match tokio::runtime::Handle::try_current() {
                // A large output takes milliseconds to write: not on an async worker.
                Ok(runtime) if job.output_bytes() > MAX_INLINE_OUTPUT => {
                    let inner = Arc::clone(&self.inner);
                    drop(runtime.spawn_blocking(move || inner.write_inline(job)));
                }
                _ => self.inner.write_inline(job),
            },
            Writer::Thread(jobs) => {
                // A send fails only when the writer is gone; the receiver then says so.
                let _ = jobs.lock().expect("lock").send(job);
            }
        }
        Pending(rx)
    }

    /// Records a new sandbox. Fails with [`LogError::TrajectoryTaken`] when its trajectory
    /// id belongs to another sandbox. Appends for the sandbox queued after this are
    /// committed with it or later, so a caller that need not check the trajectory id may
    /// drop the [`Pending`].
    pub fn register(&self, sandbox: SandboxRecord) -> Pending {
        self.send(|tx| Job::Register(sandbox, tx))
    }

    /// Appends a finished step; durable once the returned [`Pending`] says so.
    pub fn append(&self, step: Step) -> Pending {
        self.send(|tx| Job::Append(Box::new(step), tx))
    }

    fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection, &Path) -> Result<T, LogError> + Send + 'static,
    ) -> impl std::future::Future<Output = Result<T, LogError>> {
        let inner = Arc::clone(&self.inner);
        async move {
            tokio::task::spawn_blocking(move || {
                let conn = inner.readers.lock().expect("lock").pop();
                let conn = match conn {
                    Some(c) => c,
                    None => open_connection(&inner.path, SyncMode::Normal)?,
                };
                let out = f(&conn, &inner.path);
                let mut idle = inner.readers.lock().expect("lock");
                if idle.len() < MAX_IDLE_READERS {
                    idle.push(conn);
                }
                out
            })
            .await
            .unwrap_or(Err(LogError::WriterGone))
        }
    }

    /// Step `step` of the trajectory stored under `trajectory` (a trajectory id, or the
    /// sandbox id of a sandbox without one), if recorded.
    pub async fn step(&self, trajectory: &str, step: i64) -> Result<Option<Step>, LogError> {
        let trajectory = trajectory.to_owned();
        self.read(move |conn, path| {
            let mut stmt = conn
                .prepare_cached(&format!(
                    "SELECT {STEP_COLUMNS} FROM steps WHERE trajectory = ?1 AND step = ?2"
                ))
                .map_err(sqlite_err(path, "reading a step"))?;
            let raw = stmt
                .query_row(params![trajectory, step], RawStep::from_row)
                .optional()
                .map_err(sqlite_err(path, "reading a step"))?;
            raw.map(|r| r.decode(path, &trajectory)).transpose()
        })
        .await
    }

    /// A sandbox and its steps (only those of `trajectory_id`, when given); `None` when the
    /// log never saw the sandbox.
    pub async fn sandbox_log(
        &self,
        sandbox_id: &str,
        trajectory_id: Option<String>,
    ) -> Result<Option<SandboxLog>, LogError> {
        let id = sandbox_id.to_owned();
        self.read(move |conn, path| {
            let sandbox = conn
                .query_row(
                    "SELECT id, trajectory_id, image, backend, created_at, env FROM sandboxes \
                     WHERE id = ?1",
                    params![id],
                    |r| {
                        let record = SandboxRecord {
                            id: r.get(0)?,
                            trajectory_id: r.get(1)?,
                            image: r.get(2)?,
                            backend: r.get(3)?,
                            env: BTreeMap::new(),
                            created_at: r.get(4)?,
                            fork_of: None,
                        };
                        Ok((record, r.get::<_, String>(5)?))
                    },
                )
                .optional()
                .map_err(sqlite_err(path, "reading a sandbox"))?;
            let Some((mut sandbox, env)) = sandbox else {
                return Ok(None);
            };
            sandbox.env =
                serde_json::from_str(&env).map_err(|source| LogError::CorruptSandbox {
                    path: path.to_owned(),
                    id: sandbox.id.clone(),
                    source,
                })?;
            let mut stmt = conn
                .prepare_cached(&format!(
                    "SELECT {STEP_COLUMNS} FROM steps WHERE trajectory = ?1 AND sandbox_id = ?2 \
                     AND (?3 IS NULL OR trajectory_id = ?3) ORDER BY step"
                ))
                .map_err(sqlite_err(path, "reading steps"))?;
            // A sandbox's steps are those of its trajectory (a trajectory belongs to one
            // sandbox), so the primary key serves this and no second index slows appends.
            let trajectory = sandbox.trajectory_id.clone().unwrap_or_else(|| id.clone());
            let rows = stmt
                .query_map(params![trajectory, id, trajectory_id], RawStep::from_row)
                .map_err(sqlite_err(path, "reading steps"))?;
            let mut steps = Vec::new();
            for row in rows {
                let raw = row.map_err(sqlite_err(path, "reading steps"))?;
                steps.push(raw.decode(path, &trajectory)?);
            }
            Ok(Some(SandboxLog { sandbox, steps }))
        })
        .await
    }
}

/// A `steps` row before its JSON columns are decoded.
struct RawStep {
    step: i64,
    trajectory_id: Option<String>,
    sandbox_id: String,
    argv: String,
    env: String,
    cwd: String,
    stdin_sha256: Option<String>,
    files: String,
    timeout_s: Option<f64>,
    result: StepResult,
    started_at: f64,
    finished_at: f64,
}

impl RawStep {
    fn from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RawStep> {
        Ok(RawStep {
            step: r.get(0)?,
            trajectory_id: r.get(1)?,
            sandbox_id: r.get(2)?,
            argv: r.get(3)?,
            env: r.get(4)?,
            cwd: r.get(5)?,
            stdin_sha256: r.get(6)?,
            files: r.get(7)?,
            timeout_s: r.get(8)?,
            result: StepResult {
                exit_code: r.get(9)?,
                stdout: r.get(10)?,
                stderr: r.get(11)?,
                timed_out: r.get(12)?,
                truncated: r.get(13)?,
                oom_killed: r.get(14)?,
                duration_ms: r.get(15)?,
            },
            started_at: r.get(16)?,
            finished_at: r.get(17)?,
        })
    }

    fn decode(self, path: &Path, trajectory: &str) -> Result<Step, LogError> {
        let corrupt = |source| LogError::Corrupt {
            path: path.to_owned(),
            trajectory: trajectory.to_owned(),
            step: self.step,
            source,
        };
        Ok(Step {
            step: self.step,
            trajectory_id: self.trajectory_id,
            sandbox_id: self.sandbox_id,
            request: StepRequest {
                argv: serde_json::from_str(&self.argv).map_err(corrupt)?,
                env: serde_json::from_str(&self.env).map_err(corrupt)?,
                cwd: self.cwd,
                stdin_sha256: self.stdin_sha256,
                files: serde_json::from_str(&self.files).map_err(corrupt)?,
                timeout_s: self.timeout_s,
            },
            result: self.result,
            started_at: self.started_at,
            finished_at: self.finished_at,
        })
    }
}

/// Interval between the WAL checkpoints of a [`SyncMode::Normal`] log.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// Copies the WAL back into the database now and then, while the log is open. Passive: it
/// never blocks a writer or a reader.
fn checkpoints(conn: Connection, log: std::sync::Weak<Inner>) {
    loop {
        thread::sleep(CHECKPOINT_EVERY);
        let Some(inner) = log.upgrade() else {
            return;
        };
        if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            tracing::warn!(error = %e, path = %inner.path.display(), "trajectory log checkpoint failed");
        }
    }
}

/// The writer thread: group commit of everything queued, then answers.
fn writer(mut conn: Connection, path: &Path, jobs: mpsc::Receiver<Job>) {
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        write_batch(&mut conn, path, batch);
    }
}

/// Writes `batch` in one transaction and answers each job once it is committed.
fn write_batch(conn: &mut Connection, path: &Path, batch: Vec<Job>) {
    let mut outcomes = Vec::with_capacity(batch.len());
    let committed = conn.transaction().and_then(|tx| {
        for job in &batch {
            outcomes.push(write_job(&tx, path, job));
        }
        tx.commit()
    });
    if let Err(e) = &committed {
        tracing::error!(error = %e, path = %path.display(), "trajectory log commit failed");
    }
    let mut outcomes = outcomes.into_iter();
    for job in batch {
        let outcome = match &committed {
            Ok(()) => outcomes.next().unwrap_or(Err(LogError::WriterGone)),
            Err(e) => Err(LogError::Commit {
                path: path.to_owned(),
                message: e.to_string(),
            }),
        };
        if let Err(e @ (LogError::Sqlite { .. } | LogError::Duplicate { .. })) = &outcome {
            tracing::warn!(error = %e, "trajectory log write failed");
        }
        let reply = match job {
            Job::Register(_, reply) | Job::Append(_, reply) => reply,
        };
        let _ = reply.send(outcome);
    }
}

fn is_constraint(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if f.code == rusqlite::ErrorCode::ConstraintViolation)
}

/// One job's statements. A failed statement rolls back only itself (SQLite's statement
/// atomicity), so the batch's other jobs still commit.
fn write_job(conn: &Connection, path: &Path, job: &Job) -> Result<(), LogError> {
    match job {
        Job::Register(s, _) => {
            let inserted = conn
                .prepare_cached(
                    "INSERT INTO sandboxes (id, trajectory_id, image, backend, env, created_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                )
                .and_then(|mut st| {
                    st.execute(params![
                        s.id,
                        s.trajectory_id,
                        s.image,
                        s.backend,
                        json(&s.env),
                        s.created_at
                    ])
                });
            match inserted {
                Ok(_) => match (&s.fork_of, &s.trajectory_id) {
                    (Some(fork), Some(child)) => conn
                        .prepare_cached(&format!(
                            "INSERT INTO steps (trajectory, {STEP_COLUMNS}) \
                             SELECT ?1, step, ?1, ?2, argv, env, cwd, stdin_sha256, files, \
                             timeout_s, exit_code, stdout, stderr, timed_out, truncated, \
                             oom_killed, duration_ms, started_at, finished_at \
                             FROM steps WHERE trajectory = ?3 AND step < ?4"
                        ))
                        .and_then(|mut st| {
                            st.execute(params![child, s.id, fork.trajectory_id, fork.steps])
                        })
                        .map(|_| ())
                        .map_err(sqlite_err(path, "forking a trajectory")),
                    _ => Ok(()),
                },
                Err(e) if is_constraint(&e) && s.trajectory_id.is_some() => {
                    let owner = conn
                        .query_row(
                            "SELECT id FROM sandboxes WHERE trajectory_id = ?1",
                            params![s.trajectory_id],
                            |r| r.get(0),
                        )
                        .unwrap_or_else(|_| "?".to_owned());
                    Err(LogError::TrajectoryTaken {
                        trajectory_id: s.trajectory_id.clone().unwrap_or_default(),
                        owner,
                    })
                }
                Err(e) => Err(sqlite_err(path, "recording a sandbox")(e)),
            }
        }
        Job::Append(s, _) => {
            let inserted = conn
                .prepare_cached(&format!(
                    "INSERT INTO steps (trajectory, {STEP_COLUMNS}) VALUES \
                     (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, \
                      ?17, ?18, ?19)"
                ))
                .and_then(|mut st| {
                    let r = &s.result;
                    st.execute(params![
                        s.trajectory(),
                        s.step,
                        s.trajectory_id,
                        s.sandbox_id,
                        json(&s.request.argv),
                        json(&s.request.env),
                        s.request.cwd,
                        s.request.stdin_sha256,
                        json(&s.request.files),
                        s.request.timeout_s,
                        r.exit_code,
                        r.stdout,
                        r.stderr,
                        r.timed_out,
                        r.truncated,
                        r.oom_killed,
                        r.duration_ms,
                        s.started_at,
                        s.finished_at,
                    ])
                });
            match inserted {
                Ok(_) => Ok(()),
                Err(e) if is_constraint(&e) => Err(LogError::Duplicate {
                    trajectory: s.trajectory().to_owned(),
                    step: s.step,
                }),
                Err(e) => Err(sqlite_err(path, "appending a step")(e)),
            }
        }
    }
}

/// A value as stored in a JSON column.
fn json<T: Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string(value).expect("plain data serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(trajectory_id: Option<&str>, sandbox: &str, n: i64, cmd: &str) -> Step {
        Step {
            step: n,
            trajectory_id: trajectory_id.map(str::to_owned),
            sandbox_id: sandbox.to_owned(),
            request: StepRequest {
                argv: vec!["/bin/sh".into(), "-c".into(), cmd.into()],
                env: BTreeMap::new(),
                cwd: "/".into(),
                stdin_sha256: None,
                files: vec![FileDigest {
                    path: "/a".into(),
                    sha256: digest(b"x"),
                    mode: 0o644,
                }],
                timeout_s: Some(5.0),
            },
            result: StepResult {
                exit_code: Some(0),
                stdout: format!("{cmd}\n"),
                ..Default::default()
            },
            started_at: 1.0,
            finished_at: 2.0,
        }
    }

    fn sandbox(id: &str, trajectory_id: Option<&str>) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            trajectory_id: trajectory_id.map(str::to_owned),
            image: "busybox".into(),
            backend: "container".into(),
            env: BTreeMap::from([("K".into(), "V".into())]),
            created_at: 1.0,
            fork_of: None,
        }
    }

    #[tokio::test]
    async fn steps_round_trip_and_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trajectory.db");
        {
            let log = TrajectoryLog::open(&path, SyncMode::Full).unwrap();
            log.register(sandbox("s1", Some("t1")))
                .wait()
                .await
                .unwrap();
            for n in 0..3 {
                log.append(step(Some("t1"), "s1", n, &format!("echo {n}")))
                    .wait()
                    .await
                    .unwrap();
            }
            assert!(log.step("t1", 2).await.unwrap().is_some());
        }
        let log = TrajectoryLog::open(&path, SyncMode::Full).unwrap();
        let got = log.step("t1", 1).await.unwrap().unwrap();
        assert_eq!(got, step(Some("t1"), "s1", 1, "echo 1"));
        assert!(log.step("t1", 3).await.unwrap().is_none());
        let all = log.sandbox_log("s1", None).await.unwrap().unwrap();
        assert_eq!(all.sandbox, sandbox("s1", Some("t1")));
        assert_eq!(
            all.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        assert!(log.sandbox_log("nope", None).await.unwrap().is_none());
        let filtered = log.sandbox_log("s1", Some("other".into())).await.unwrap();
        assert!(filtered.unwrap().steps.is_empty());
    }

    #[tokio::test]
    async fn a_trajectory_id_names_one_sandbox() {
        let dir = tempfile::tempdir().unwrap();
        let log = TrajectoryLog::open(&dir.path().join("t.db"), SyncMode::Normal).unwrap();
        log.register(sandbox("s1", Some("t"))).wait().await.unwrap();
        log.register(sandbox("s2", None)).wait().await.unwrap();
        log.register(sandbox("s3", None)).wait().await.unwrap();
        let err = log
            .register(sandbox("s4", Some("t")))
            .wait()
            .await
            .unwrap_err();
        assert!(
            matches!(&err, LogError::TrajectoryTaken { owner, .. } if owner == "s1"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn concurrent_appends_share_commits_and_a_duplicate_fails_alone() {
        let dir = tempfile::tempdir().unwrap();
        let log = TrajectoryLog::open(&dir.path().join("t.db"), SyncMode::Full).unwrap();
        let mut pending: Vec<Pending> = (0..200)
            .map(|n| log.append(step(None, &format!("s{}", n % 4), n / 4, "true")))
            .collect();
        pending.push(log.append(step(None, "s0", 0, "again")));
        let mut results = Vec::new();
        for p in pending {
            results.push(p.wait().await);
        }
        assert!(results[..200].iter().all(Result::is_ok));
        assert!(matches!(
            results[200],
            Err(LogError::Duplicate { step: 0, .. })
        ));
        for n in 0..4 {
            let id = format!("s{n}");
            log.register(sandbox(&id, None)).wait().await.unwrap();
            let got = log.sandbox_log(&id, None).await.unwrap().unwrap();
            assert_eq!(got.steps.len(), 50);
        }
    }

    #[tokio::test]
    async fn large_outputs_are_written_off_the_async_workers_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let log = TrajectoryLog::open(&dir.path().join("t.db"), SyncMode::Normal).unwrap();
        let mut big = step(None, "s", 0, "yes");
        big.result.stdout = "y\n".repeat(MAX_INLINE_OUTPUT);
        log.append(big.clone()).wait().await.unwrap();
        log.append(step(None, "s", 1, "small"))
            .wait()
            .await
            .unwrap();
        assert_eq!(log.step("s", 0).await.unwrap(), Some(big));
        assert!(log.step("s", 1).await.unwrap().is_some());
    }

    #[test]
    fn requests_compare_without_the_timeout() {
        let a = step(None, "s", 0, "echo").request;
        let mut b = a.clone();
        b.timeout_s = None;
        assert!(a.same_as(&b));
        b.cwd = "/tmp".into();
        assert!(!a.same_as(&b));
        assert!(b.describe().contains("\"/tmp\""), "{}", b.describe());
        assert!(b.describe().contains("file /a sha256:"), "{}", b.describe());
    }
}
