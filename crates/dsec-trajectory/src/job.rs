//! The writes a store takes, and how their callers wait for them.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::oneshot;

use crate::error::LogError;
use crate::model::{SandboxRecord, Step};

/// A write the log makes.
pub(crate) enum Write {
    Register(SandboxRecord),
    Append(Box<Step>),
    /// A spawn step again, with its process's end as its result.
    Ended(Box<Step>),
    Stopped {
        id: String,
        at: f64,
    },
    /// A stopped sandbox is live again: kept by an earlier run of the server, adopted by
    /// this one.
    Reopened(String),
}

impl Write {
    /// Bytes of command output the write holds.
    pub(crate) fn output_bytes(&self) -> usize {
        match self {
            Write::Append(s) | Write::Ended(s) => s.result.stdout.len() + s.result.stderr.len(),
            Write::Register(_) | Write::Stopped { .. } | Write::Reopened(_) => 0,
        }
    }
}

/// A write and who waits for it.
pub(crate) struct Job {
    pub(crate) write: Write,
    pub(crate) reply: oneshot::Sender<Result<(), LogError>>,
}

impl Job {
    /// A job for `write` and the [`Pending`] its caller waits on.
    pub(crate) fn new(write: Write) -> (Job, Pending) {
        let (reply, rx) = oneshot::channel();
        (Job { write, reply }, Pending(rx))
    }

    /// Answers the caller.
    pub(crate) fn answer(self, outcome: Result<(), LogError>) {
        if let Err(e @ (LogError::Sqlite { .. } | LogError::Duplicate { .. })) = &outcome {
            tracing::warn!(error = %e, "trajectory log write failed");
        }
        // The caller may have stopped waiting: nothing to tell then.
        let _ = self.reply.send(outcome);
    }
}

/// A write that the store will answer once it is durable (or failed).
#[must_use = "a write is durable only once wait() returns Ok"]
pub struct Pending(oneshot::Receiver<Result<(), LogError>>);

impl Pending {
    /// Waits until the write is committed under the log's [`SyncMode`](crate::SyncMode)
    /// policy.
    pub async fn wait(self) -> Result<(), LogError> {
        self.0.await.unwrap_or(Err(LogError::WriterGone))
    }
}

/// How the log's writes have been committed, for group commit to be seen at work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogStats {
    /// Writes committed (registrations, steps, stops), failed ones included.
    pub writes: u64,
    /// Transactions that committed them.
    pub commits: u64,
}

/// Counts commits and the writes they carried.
#[derive(Default)]
pub(crate) struct CommitCounter {
    writes: AtomicU64,
    commits: AtomicU64,
}

impl CommitCounter {
    /// One transaction of `writes` writes committed.
    pub(crate) fn committed(&self, writes: usize) {
        self.writes.fetch_add(writes as u64, Ordering::Relaxed);
        self.commits.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("dsec_trajectory_commits_total").increment(1);
    }

    pub(crate) fn stats(&self) -> LogStats {
        LogStats {
            writes: self.writes.load(Ordering::Relaxed),
            commits: self.commits.load(Ordering::Relaxed),
        }
    }
}
