//! The log in one SQLite database, `<state-dir>/trajectory.db`, in WAL mode: the embedded
//! default, for one server.
//!
//! One write connection, behind a lock: with [`SyncMode::Normal`] each write commits on its
//! caller's thread (a `write(2)` of tens of microseconds, cheaper than two thread hops);
//! with [`SyncMode::Full`] a writer thread takes everything queued and commits it in one
//! transaction (group commit: one fsync per batch). A maintenance thread checkpoints the
//! WAL (Normal) and prunes stopped sandboxes when the log is over its budget. Reads use
//! connections of their own and never wait for the writer.

mod read;
mod schema;
mod write;

use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Condvar, Mutex, Weak};
use std::thread;
use std::time::Duration;

use rusqlite::Connection;

use crate::budget::{PruneRound, Usage};
use crate::error::LogError;
use crate::job::{CommitCounter, Job, LogStats};
use crate::model::{SandboxLog, Step};
use crate::{LogConfig, SyncMode};

/// Output (stdout and stderr) beyond which an append is written off the caller's thread.
const MAX_INLINE_OUTPUT: usize = 64 << 10;
/// Most appends written in one transaction; bounds the latency of the batch's first caller.
const MAX_BATCH: usize = 512;
/// Read connections kept open for reuse.
const MAX_IDLE_READERS: usize = 8;
/// Interval between maintenance rounds: WAL checkpoints of a [`SyncMode::Normal`] log, and
/// pruning when it is due (or sooner, when a write wakes the thread).
const MAINTAIN_EVERY: Duration = Duration::from_millis(500);

pub(crate) fn sqlite_err<'a>(
    path: &'a Path,
    what: &'static str,
) -> impl FnOnce(rusqlite::Error) -> LogError + 'a {
    move |source| LogError::Sqlite {
        path: path.to_owned(),
        what,
        source,
    }
}

/// How writes reach the write connection: how a commit is made durable decides which is
/// cheaper.
enum Writer {
    /// [`SyncMode::Normal`]: on the caller's thread.
    Inline,
    /// [`SyncMode::Full`]: the writer thread, so one fsync serves every write queued
    /// meanwhile.
    Thread(Mutex<mpsc::Sender<Job>>),
}

/// Wakes the maintenance thread before its next tick.
#[derive(Default)]
struct Wake {
    due: Mutex<bool>,
    cond: Condvar,
}

impl Wake {
    fn notify(&self) {
        *self.due.lock().expect("lock") = true;
        self.cond.notify_one();
    }

    fn wait(&self, timeout: Duration) {
        let due = self.due.lock().expect("lock");
        let (mut due, _) = self
            .cond
            .wait_timeout_while(due, timeout, |due| !*due)
            .expect("lock");
        *due = false;
    }
}

/// The SQLite store.
pub(crate) struct Store {
    path: PathBuf,
    conn: Mutex<Connection>,
    writer: Writer,
    readers: Mutex<Vec<Connection>>,
    pub(crate) usage: Usage,
    commits: CommitCounter,
    wake: Arc<Wake>,
}

fn open_connection(path: &Path, sync: SyncMode, wal_bytes: u64) -> Result<Connection, LogError> {
    let conn = Connection::open(path).map_err(sqlite_err(path, "opening"))?;
    let sync = match sync {
        SyncMode::Full => "FULL",
        SyncMode::Normal => "NORMAL",
    };
    // The WAL, once it grew (a burst of writes while a reader held it), shrinks back to
    // its bound at the next checkpoint.
    conn.execute_batch(&format!(
        "PRAGMA journal_mode = WAL; PRAGMA synchronous = {sync}; PRAGMA busy_timeout = 10000;
         PRAGMA journal_size_limit = {wal_bytes};"
    ))
    .map_err(sqlite_err(path, "setting WAL mode"))?;
    Ok(conn)
}

impl Store {
    /// Opens (creating or upgrading) the database at `path` and starts its threads.
    pub(crate) fn open(path: &Path, config: LogConfig) -> Result<Arc<Store>, LogError> {
        let wal_bytes = config.budgets.wal_bytes();
        let mut conn = open_connection(path, config.sync, wal_bytes)?;
        schema::migrate(&mut conn, path)?;
        let stored = schema::stop_earlier_sandboxes(&mut conn, path)?;
        let autocheckpoint = match config.sync {
            // Checkpoints (which fsync) run on the maintenance thread, not in a request.
            SyncMode::Normal => 0,
            // The writer thread checkpoints when the WAL holds half its bound.
            SyncMode::Full => (wal_bytes / 2 / 4096).clamp(16, 1000),
        };
        conn.pragma_update(
            None,
            "wal_autocheckpoint",
            crate::row::sql_int(autocheckpoint),
        )
        .map_err(sqlite_err(path, "setting WAL mode"))?;
        let (jobs, writer) = match config.sync {
            SyncMode::Normal => (None, Writer::Inline),
            SyncMode::Full => {
                let (tx, rx) = mpsc::channel();
                (Some(rx), Writer::Thread(Mutex::new(tx)))
            }
        };
        let wake = Arc::new(Wake::default());
        let store = Arc::new(Store {
            path: path.to_owned(),
            conn: Mutex::new(conn),
            writer,
            readers: Mutex::default(),
            usage: Usage::new(config.budgets, stored),
            commits: CommitCounter::default(),
            wake: Arc::clone(&wake),
        });
        if let Some(jobs) = jobs {
            let weak = Arc::downgrade(&store);
            thread::Builder::new()
                .name("dsec-trajectory".into())
                .spawn(move || group_commit(&weak, &jobs))
                .map_err(LogError::Thread)?;
        }
        let checkpointer = match config.sync {
            SyncMode::Normal => Some(open_connection(path, config.sync, wal_bytes)?),
            SyncMode::Full => None,
        };
        let weak = Arc::downgrade(&store);
        thread::Builder::new()
            .name("dsec-traj-maint".into())
            .spawn(move || maintain(checkpointer, &wake, &weak))
            .map_err(LogError::Thread)?;
        if store.usage.prune_due() {
            store.wake.notify();
        }
        Ok(store)
    }

    /// Hands `job` to the writer: written now on this thread, on tokio's blocking pool
    /// (a large output takes milliseconds: not on an async worker), or by the writer
    /// thread.
    pub(crate) fn send(self: &Arc<Self>, job: Job) {
        match &self.writer {
            Writer::Inline => match tokio::runtime::Handle::try_current() {
                Ok(runtime) if job.write.output_bytes() > MAX_INLINE_OUTPUT => {
                    let store = Arc::clone(self);
                    drop(runtime.spawn_blocking(move || store.write(vec![job])));
                }
                _ => self.write(vec![job]),
            },
            Writer::Thread(jobs) => {
                // A send fails only when the writer is gone; the job's caller then hears so.
                let _ = jobs.lock().expect("lock").send(job);
            }
        }
    }

    /// Writes `batch` in one transaction on this thread.
    fn write(&self, batch: Vec<Job>) {
        write::write_batch(
            &mut self.conn.lock().expect("lock"),
            &self.path,
            &self.usage,
            &self.commits,
            batch,
        );
        if self.usage.maintenance_due() {
            self.wake.notify();
        }
    }

    /// Deletes the logs of stopped sandboxes, oldest stop first, until the log is down to
    /// its pruning target; one sandbox per transaction, so that a writer waits at most
    /// for one.
    fn prune(&self) {
        let (mut round, mut exhausted) = (PruneRound::new(&self.usage), false);
        while round.more() {
            let pruned = write::prune_oldest(&mut self.conn.lock().expect("lock"));
            match pruned {
                Ok(Some((id, freed))) => round.deleted(&id, freed),
                Ok(None) => {
                    exhausted = true;
                    break;
                }
                Err(e) => {
                    tracing::error!(error = %e, path = %self.path.display(), "trajectory log: pruning failed");
                    break;
                }
            }
        }
        round.end(exhausted);
    }

    /// How writes have been committed.
    pub(crate) fn stats(&self) -> LogStats {
        self.commits.stats()
    }

    /// Step `step` of the trajectory stored under `trajectory`, if recorded.
    pub(crate) async fn step(
        self: &Arc<Self>,
        trajectory: String,
        step: i64,
    ) -> Result<Option<Step>, LogError> {
        self.read(move |conn, path| read::step(conn, path, &trajectory, step))
            .await
    }

    /// A sandbox and its steps (only those of `trajectory_id`, when given).
    pub(crate) async fn sandbox_log(
        self: &Arc<Self>,
        id: String,
        trajectory_id: Option<String>,
    ) -> Result<Option<SandboxLog>, LogError> {
        self.read(move |conn, path| read::sandbox_log(conn, path, &id, trajectory_id.as_deref()))
            .await
    }

    /// Runs `f` on an idle read connection, on tokio's blocking pool.
    async fn read<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Connection, &Path) -> Result<T, LogError> + Send + 'static,
    ) -> Result<T, LogError> {
        let store = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let conn = store.readers.lock().expect("lock").pop();
            let conn = match conn {
                Some(c) => c,
                None => open_connection(
                    &store.path,
                    SyncMode::Normal,
                    store.usage.budgets.wal_bytes(),
                )?,
            };
            let out = f(&conn, &store.path);
            let mut idle = store.readers.lock().expect("lock");
            if idle.len() < MAX_IDLE_READERS {
                idle.push(conn);
            }
            out
        })
        .await
        .unwrap_or(Err(LogError::WriterGone))
    }
}

/// Checkpoints the WAL now and then (passive: it never blocks a writer or a reader), and
/// prunes when the log is over its budget, while the store is open.
fn maintain(checkpointer: Option<Connection>, wake: &Wake, store: &Weak<Store>) {
    loop {
        wake.wait(MAINTAIN_EVERY);
        let Some(store) = store.upgrade() else {
            return;
        };
        if let Some(conn) = &checkpointer {
            store.usage.checkpointing();
            if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                tracing::warn!(error = %e, path = %store.path.display(), "trajectory log checkpoint failed");
            }
        }
        if store.usage.prune_due() {
            store.prune();
        }
    }
}

/// The writer thread: everything queued in one transaction, then the answers.
fn group_commit(store: &Weak<Store>, jobs: &mpsc::Receiver<Job>) {
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let Some(store) = store.upgrade() else {
            return;
        };
        store.write(batch);
    }
}
