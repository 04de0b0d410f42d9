//! The trajectory log: every command a sandbox runs, with its request and its result,
//! appended in order to SQLite (or to a PostgreSQL database a fleet shares: see the
//! `postgres` module) before the result goes back to the client.
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
//! One database, `<state-dir>/trajectory.db`, in WAL mode (on PostgreSQL the same tables,
//! `dsec_` prefixed, with each sandbox's edge), with two tables:
//! - `sandboxes`: id → trajectory id, image, backend, creation time, when it stopped, the
//!   bytes its log takes, and the project that owns it (a project's token reads only its
//!   own sandboxes' logs, also once they stopped). A trajectory id names one sandbox's
//!   trajectory (`UNIQUE`):
//!   reusing it for another sandbox is refused, since replaying recorded results into a
//!   sandbox that never ran them would leave it in a state its client does not expect.
//! - `steps`: one row per finished command, keyed by `(trajectory, step)`, where
//!   `trajectory` is the sandbox's trajectory id, or its sandbox id when it has none.
//!   A run's stdin and uploaded files are recorded as SHA-256 digests, not content.
//!
//! Schema version 3 (version 2 and older logs are upgraded in place when they open).
//!
//! # Spawned processes
//!
//! A spawned process and every act on it are steps too, numbered with the runs
//! ([`StepKind`]): its spawn, each write to its standard input (its digest always, its
//! bytes bounded like an output: [`ProcessRequest::input`]), close-stdin, signals, kills
//! and resizes. A process is named by the step that spawned it
//! ([`ProcessRequest::spawn_step`]): pids differ between sandboxes. Its end (exit status,
//! output captured as a run's) becomes its spawn step's result when it ends
//! ([`TrajectoryLog::ended`]); until then the result is `running`. An end updates a row
//! instead of taking a step number so that a keyed trajectory's numbers stay the client's.
//!
//! Replay treats them as it treats runs. Fast-forward: a re-issued act with the same
//! request is not done again; a re-issued spawn answers the process it started while the
//! sandbox remembers it, else the process as recorded, ended; a different request is
//! diverged. `dsec replay` re-spawns each process at its step and re-does the acts at
//! theirs, waits for a process before the first step that started after its recorded end,
//! and compares its exit and output then; a stdin write the log did not keep whole cannot
//! be replayed, and the replay stops there.
//!
//! # Bounds (what an agent's output can cost the host's disk)
//!
//! The agent decides what its commands print, so nothing it prints is stored unbounded
//! ([`Budgets`]):
//! - each output stream is kept whole up to [`Budgets::output_bytes`]; a longer one keeps
//!   its first and last halves of that around a marker line, plus the full length and the
//!   SHA-256 of the whole ([`OutputCapture`]);
//! - a step that would take its sandbox past [`Budgets::sandbox_bytes`] is recorded
//!   without output (request, exit status, lengths and digests only): a live sandbox's
//!   steps are never removed, since replay needs them;
//! - when the log as a whole passes 5/8 of [`Budgets::total_bytes`], the logs of stopped
//!   sandboxes are deleted, oldest stop first, down to 1/2; if only live sandboxes are
//!   left, steps that would take it past 3/4 are recorded without output. The WAL is
//!   checkpointed before it passes 1/8, and the rest is headroom, so that the files
//!   (database and WAL) stay under the budget.
//!
//! Requests are always stored whole: replay compares them.
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
//! more under load. Only a step with a large output is written on tokio's blocking pool.
//! WAL checkpoints, which do fsync, run every half second on a thread of their own.
//!
//! With [`SyncMode::Full`] each commit also fsyncs the WAL, so results survive power loss too.
//! One writer thread takes every append waiting in its queue, writes them in one
//! transaction and commits (group commit), so one fsync (0.3 ms to several ms on the
//! development machine's virtual disk) serves every step the batch holds.
//!
//! Reads use their own connections and never wait on the writer.
//!
//! # Modules
//!
//! - `model`: what is recorded (the JSON of `GET /log` too);
//! - `capture`: bounding one output stream as it is produced;
//! - `budget`: the budgets, how rows count against them, and what they decide;
//! - `sqlite`, `postgres`: the two stores, each with its schema, its writes (group commit,
//!   pruning) and its reads; `row`: a stored step, as both read it.
#![warn(missing_docs)]

mod budget;
mod capture;
mod error;
mod job;
mod model;
mod postgres;
mod row;
mod sqlite;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use budget::Budgets;
pub use capture::{KeptOutput, OutputCapture};
pub use error::LogError;
pub use job::{LogStats, Pending};
pub use model::{
    digest, ExitStatus, FileDigest, ForkOf, ProcessRequest, SandboxLog, SandboxRecord, Step,
    StepKind, StepRequest, StepResult,
};

use crate::budget::Delta;
use crate::job::{Job, Write};

/// How hard a commit waits for the disk; see the crate docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SyncMode {
    /// fsync each group commit: survives power loss, at one fsync per batch.
    Full,
    /// No fsync on commit: survives a crash (SIGKILL) of the server, not of the machine.
    #[default]
    Normal,
}

/// How [`TrajectoryLog::open`] sets the log up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogConfig {
    /// The fsync policy.
    pub sync: SyncMode,
    /// What the log may store.
    pub budgets: Budgets,
}

/// Where the log lives: `--trajectory-db`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Database {
    /// A SQLite file of this host (the embedded default, `<state-dir>/trajectory.db`).
    Sqlite(PathBuf),
    /// A PostgreSQL database shared by a fleet: `postgres://USER:PASSWORD@HOST:PORT/DB`.
    Postgres(String),
}

impl Database {
    /// A `postgres://` (or `postgresql://`) URL, else the path of a SQLite file.
    pub fn parse(s: &str) -> Database {
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            Database::Postgres(s.to_owned())
        } else {
            Database::Sqlite(PathBuf::from(s))
        }
    }
}

/// The store behind the log.
enum Store {
    Sqlite(Arc<sqlite::Store>),
    Postgres(Arc<postgres::Store>),
}

/// The trajectory log. Cheap to clone.
#[derive(Clone)]
pub struct TrajectoryLog {
    store: Arc<Store>,
}

impl TrajectoryLog {
    /// Opens (creating or upgrading) the SQLite log at `path` and starts its threads.
    /// Sandboxes the log holds as running are from an earlier run of the server
    /// (sandboxes do not survive one): they are marked stopped, so that their logs can be
    /// pruned.
    pub fn open(path: &Path, config: LogConfig) -> Result<TrajectoryLog, LogError> {
        let store = sqlite::Store::open(path, config)?;
        Ok(TrajectoryLog {
            store: Arc::new(Store::Sqlite(store)),
        })
    }

    /// Connects to the PostgreSQL log at `url` (creating its schema if it has none) as
    /// edge `edge`, which no other server writing there may be using; sandboxes of `edge`
    /// the log holds as running are from an earlier run of it and are marked stopped.
    /// Fails at once, with what to fix, when the database is unreachable, refuses the
    /// credentials, or does not exist.
    pub async fn connect(
        url: &str,
        edge: &str,
        config: LogConfig,
    ) -> Result<TrajectoryLog, LogError> {
        let store = postgres::Store::connect(url, edge, config).await?;
        Ok(TrajectoryLog {
            store: Arc::new(Store::Postgres(store)),
        })
    }

    /// Connects to the PostgreSQL log at `url` to read it only: the logs of every edge's
    /// sandboxes, also of edges that are gone (an apiserver's `--trajectory-db`). Takes no
    /// edge name; writes fail with [`LogError::WriterGone`].
    pub async fn read_only(url: &str) -> Result<TrajectoryLog, LogError> {
        let store = postgres::Store::connect_reader(url).await?;
        Ok(TrajectoryLog {
            store: Arc::new(Store::Postgres(store)),
        })
    }

    /// Opens the log in `db` for edge `edge` (a SQLite log belongs to one server: it needs
    /// no edge name).
    pub async fn open_database(
        db: &Database,
        edge: &str,
        config: LogConfig,
    ) -> Result<TrajectoryLog, LogError> {
        match db {
            Database::Sqlite(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || TrajectoryLog::open(&path, config))
                    .await
                    .unwrap_or(Err(LogError::WriterGone))
            }
            Database::Postgres(url) => TrajectoryLog::connect(url, edge, config).await,
        }
    }

    /// Commits what is queued and stops writing: later writes fail with
    /// [`LogError::WriterGone`]; a PostgreSQL log releases its edge name. Reads go on.
    /// A SQLite log commits each write as it comes: closing it only ends its writes when
    /// the last handle is dropped.
    pub async fn close(&self) {
        if let Store::Postgres(s) = self.store.as_ref() {
            s.close().await;
        }
    }

    fn usage(&self) -> &budget::Usage {
        match self.store.as_ref() {
            Store::Sqlite(s) => &s.usage,
            Store::Postgres(s) => &s.usage,
        }
    }

    fn send(&self, write: Write) -> Pending {
        let (job, pending) = Job::new(write);
        match self.store.as_ref() {
            Store::Sqlite(s) => s.send(job),
            Store::Postgres(s) => s.send(job),
        }
        pending
    }

    /// Records a new sandbox. Fails with [`LogError::TrajectoryTaken`] when its trajectory
    /// id belongs to another sandbox. Appends for the sandbox queued after this are
    /// committed with it or later, so a caller that need not check the trajectory id may
    /// drop the [`Pending`].
    pub fn register(&self, sandbox: SandboxRecord) -> Pending {
        self.send(Write::Register(sandbox))
    }

    /// Appends a finished step of a registered sandbox; durable once the returned
    /// [`Pending`] says so. Its output is stored as given (bound it with
    /// [`capture`](Self::capture)), or without output when that would take its sandbox
    /// or the log past a budget. A step of a sandbox the log does not hold (its log was
    /// pruned after it stopped) is not stored.
    pub fn append(&self, step: Step) -> Pending {
        self.send(Write::Append(Box::new(step)))
    }

    /// Records the end of a spawned process: `step` is its spawn step, appended before,
    /// now with the process's exit and output as its result (bounded by the budgets as an
    /// append's). A spawn step the log no longer holds is not stored.
    pub fn ended(&self, step: Step) -> Pending {
        self.send(Write::Ended(Box::new(step)))
    }

    /// Records that a sandbox stopped: from now on its log may be pruned.
    pub fn stopped(&self, sandbox_id: &str) -> Pending {
        self.send(Write::Stopped {
            id: sandbox_id.to_owned(),
            at: unix_now(),
        })
    }

    /// Records that a sandbox the log marked stopped when it opened (it holds every
    /// sandbox of an earlier run as stopped) lives on: an earlier run of the server kept it
    /// across the restart and this one serves it again. Its log is no longer pruned, and
    /// this process counts its share as a live sandbox's. A sandbox whose log was pruned
    /// meanwhile stays without one.
    pub fn reopen(&self, sandbox_id: &str) -> Pending {
        self.send(Write::Reopened(sandbox_id.to_owned()))
    }

    /// A capture that bounds one output stream as this log keeps it.
    pub fn capture(&self) -> OutputCapture {
        OutputCapture::new(self.usage().budgets.output_bytes)
    }

    /// Bytes the log stores, as its budgets count them (for a PostgreSQL log: every
    /// edge's, as this server last read the total, plus what it wrote since).
    pub fn stored_bytes(&self) -> u64 {
        self.usage().stored()
    }

    /// How the log's writes have been committed so far.
    pub fn stats(&self) -> LogStats {
        match self.store.as_ref() {
            Store::Sqlite(s) => s.stats(),
            Store::Postgres(s) => s.stats(),
        }
    }

    /// Step `step` of the trajectory stored under `trajectory` (a trajectory id, or the
    /// sandbox id of a sandbox without one), if recorded.
    pub async fn step(&self, trajectory: &str, step: i64) -> Result<Option<Step>, LogError> {
        let trajectory = trajectory.to_owned();
        match self.store.as_ref() {
            Store::Sqlite(s) => s.step(trajectory, step).await,
            Store::Postgres(s) => s.step(trajectory, step).await,
        }
    }

    /// A sandbox and its steps (only those of `trajectory_id`, when given); `None` when the
    /// log never saw the sandbox, or pruned it.
    pub async fn sandbox_log(
        &self,
        sandbox_id: &str,
        trajectory_id: Option<String>,
    ) -> Result<Option<SandboxLog>, LogError> {
        let id = sandbox_id.to_owned();
        let mut log = match self.store.as_ref() {
            Store::Sqlite(s) => s.sandbox_log(id, trajectory_id).await?,
            Store::Postgres(s) => s.sandbox_log(id, trajectory_id).await?,
        };
        if let Some(log) = &mut log {
            // A live sandbox's share is counted in memory, not in its row.
            if let Some(live) = self.usage().live(&log.sandbox.id, &Delta::default()) {
                log.bytes = live.bytes;
            }
        }
        Ok(log)
    }
}

/// Now, in Unix seconds.
pub(crate) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
