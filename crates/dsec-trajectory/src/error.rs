//! Why the log failed.
//!
//! `db` in a variant names the database as a user can find it: the SQLite file's path, or
//! the PostgreSQL URL without its password.

use std::path::PathBuf;

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
    /// `--trajectory-db` is not a database the log can use.
    #[error("trajectory log {db}: {reason}")]
    Config {
        /// The database as given.
        db: String,
        /// What is wrong with it, and what to do.
        reason: String,
    },
    /// PostgreSQL could not be reached, or refused the connection.
    #[error("trajectory log {db}: {reason}")]
    Connect {
        /// The database.
        db: String,
        /// Why, in a user's words (unreachable, credentials refused, no such database).
        reason: String,
    },
    /// PostgreSQL refused an operation.
    #[error("trajectory log {db}: {what}: {detail}")]
    Postgres {
        /// The database.
        db: String,
        /// What the log was doing.
        what: &'static str,
        /// PostgreSQL's error, with its message.
        detail: String,
    },
    /// Another server writes to the database under the same edge name.
    #[error("trajectory log {db}: edge name {edge:?} is in use by another server writing to this database; give each server its own --edge-name")]
    EdgeTaken {
        /// The database.
        db: String,
        /// The edge name.
        edge: String,
    },
    /// A recorded row does not decode (written by an incompatible version, or damaged).
    #[error("trajectory log {db}: step {step} of {trajectory:?} is corrupt: {source}")]
    Corrupt {
        /// The database.
        db: String,
        /// The trajectory key.
        trajectory: String,
        /// The step.
        step: i64,
        /// The decoding error.
        source: serde_json::Error,
    },
    /// A recorded sandbox does not decode.
    #[error("trajectory log {db}: the record of sandbox {id} is corrupt: {source}")]
    CorruptSandbox {
        /// The database.
        db: String,
        /// The sandbox id.
        id: String,
        /// The decoding error.
        source: serde_json::Error,
    },
    /// The database was written by a newer dsec.
    #[error("trajectory log {db} has schema version {found}; this dsec reads up to {supported}: run the newer dsec, or give it a new database")]
    Version {
        /// The database.
        db: String,
        /// Its schema version.
        found: i64,
        /// The newest this build reads.
        supported: i64,
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
    /// The transaction holding this write did not commit (disk full, I/O error, the
    /// database gone).
    #[error("trajectory log {db}: commit failed: {message}")]
    Commit {
        /// The database.
        db: String,
        /// The database's error, shared by every write of the batch.
        message: String,
    },
    /// The writer thread could not be started.
    #[error("starting the trajectory log's writer thread: {0}")]
    Thread(std::io::Error),
    /// The writer is gone (it panicked, or the log is shutting down).
    #[error("the trajectory log's writer has stopped")]
    WriterGone,
}
