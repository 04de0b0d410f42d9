//! The SQLite schema, and how an older one is brought up to date.

use std::path::Path;

use rusqlite::{params, Connection, Transaction};

use super::read::raw_step;
use super::sqlite_err;
use crate::budget::{record_bytes, StepJson};
use crate::error::LogError;
use crate::model::{digest, SandboxRecord};
use crate::row::{sql_count, STEP_COLUMNS};

/// The schema this build writes (`PRAGMA user_version`).
pub(super) const SCHEMA_VERSION: i64 = 3;

const SCHEMA: &str = "
CREATE TABLE sandboxes (
    id            TEXT PRIMARY KEY,
    trajectory_id TEXT UNIQUE,
    image         TEXT NOT NULL,
    backend       TEXT NOT NULL,
    env           TEXT NOT NULL,
    created_at    REAL NOT NULL,
    stopped_at    REAL,
    bytes         INTEGER NOT NULL DEFAULT 0,
    project       TEXT
);
CREATE TABLE steps (
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
    stdout_bytes  INTEGER NOT NULL DEFAULT 0,
    stdout_sha256 TEXT NOT NULL DEFAULT '',
    stdout_elided INTEGER NOT NULL DEFAULT 0,
    stderr_bytes  INTEGER NOT NULL DEFAULT 0,
    stderr_sha256 TEXT NOT NULL DEFAULT '',
    stderr_elided INTEGER NOT NULL DEFAULT 0,
    bytes         INTEGER NOT NULL DEFAULT 0,
    run_as        TEXT,
    kind          TEXT NOT NULL DEFAULT 'run',
    process       TEXT,
    pid           INTEGER,
    running       INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (trajectory, step)
);
";

/// Upgrades a log written before version 1 (unbounded outputs, no accounting): the new
/// columns, then each row's lengths, digests and bytes (computed in Rust, the one place
/// that knows how).
const MIGRATE_V0: &str = "
ALTER TABLE sandboxes ADD COLUMN stopped_at REAL;
ALTER TABLE sandboxes ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN stdout_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN stdout_sha256 TEXT NOT NULL DEFAULT '';
ALTER TABLE steps ADD COLUMN stdout_elided INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN stderr_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN stderr_sha256 TEXT NOT NULL DEFAULT '';
ALTER TABLE steps ADD COLUMN stderr_elided INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
";

/// Upgrades a log written before version 2: the user a step ran as (none before: root).
const MIGRATE_V1: &str = "ALTER TABLE steps ADD COLUMN run_as TEXT;";

/// Upgrades a log written before version 3: process steps (every step before was a run),
/// and the project that owns each sandbox (none before: the admin's).
const MIGRATE_V2: &str = "
ALTER TABLE steps ADD COLUMN kind TEXT NOT NULL DEFAULT 'run';
ALTER TABLE steps ADD COLUMN process TEXT;
ALTER TABLE steps ADD COLUMN pid INTEGER;
ALTER TABLE steps ADD COLUMN running INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sandboxes ADD COLUMN project TEXT;
";

/// Serves pruning: the stopped sandboxes, oldest stop first.
const INDEXES: &str = "
CREATE INDEX IF NOT EXISTS sandboxes_by_stop ON sandboxes (stopped_at)
    WHERE stopped_at IS NOT NULL;
";

/// Creates the schema, or brings an older one up to [`SCHEMA_VERSION`].
pub(super) fn migrate(conn: &mut Connection, path: &Path) -> Result<(), LogError> {
    let err = |what| sqlite_err(path, what);
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(err("reading the schema version"))?;
    if version > SCHEMA_VERSION {
        return Err(LogError::Version {
            db: path.display().to_string(),
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    let tx = conn.transaction().map_err(err("migrating the schema"))?;
    if version == 0 {
        let has_steps: bool = tx
            .query_row(
                "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'steps'",
                [],
                |r| r.get(0),
            )
            .map_err(err("reading the schema"))?;
        if has_steps {
            tx.execute_batch(MIGRATE_V0)
                .and_then(|()| tx.execute_batch(MIGRATE_V1))
                .and_then(|()| tx.execute_batch(MIGRATE_V2))
                .map_err(err("migrating the schema"))?;
            account_v0_rows(&tx, path)?;
        } else {
            tx.execute_batch(SCHEMA)
                .map_err(err("creating the schema"))?;
        }
    } else if version < SCHEMA_VERSION {
        let steps = [MIGRATE_V1, MIGRATE_V2];
        for migration in &steps[usize::try_from(version - 1).unwrap_or(0)..] {
            tx.execute_batch(migration)
                .map_err(err("migrating the schema"))?;
        }
    }
    tx.execute_batch(INDEXES)
        .and_then(|()| tx.pragma_update(None, "user_version", SCHEMA_VERSION))
        .and_then(|()| tx.commit())
        .map_err(err("migrating the schema"))
}

/// Fills in the lengths, digests and byte counts of steps written before version 1 (their
/// sandboxes, all of earlier runs, are counted when the log opens). Their outputs stay
/// whole: pruning removes them first.
fn account_v0_rows(tx: &Transaction<'_>, path: &Path) -> Result<(), LogError> {
    let err = |what| sqlite_err(path, what);
    let rowids: Vec<i64> = tx
        .prepare("SELECT rowid FROM steps")
        .and_then(|mut st| st.query_map([], |r| r.get(0))?.collect())
        .map_err(err("migrating steps"))?;
    for rowid in rowids {
        let (trajectory, raw) = tx
            .query_row(
                &format!("SELECT trajectory, {STEP_COLUMNS} FROM steps WHERE rowid = ?1"),
                params![rowid],
                |r| Ok((r.get::<_, String>(0)?, raw_step(r, 1)?)),
            )
            .map_err(err("migrating steps"))?;
        let mut step = raw.decode(&path.display(), &trajectory)?;
        let r = &mut step.result;
        r.stdout_bytes = r.stdout.len() as u64;
        r.stdout_sha256 = digest(r.stdout.as_bytes());
        r.stderr_bytes = r.stderr.len() as u64;
        r.stderr_sha256 = digest(r.stderr.as_bytes());
        let bytes = StepJson::new(&step).row_bytes(&step);
        let r = &step.result;
        tx.execute(
            "UPDATE steps SET stdout_bytes = ?2, stdout_sha256 = ?3, stderr_bytes = ?4, \
             stderr_sha256 = ?5, bytes = ?6 WHERE rowid = ?1",
            params![
                rowid,
                r.stdout_bytes,
                r.stdout_sha256,
                r.stderr_bytes,
                r.stderr_sha256,
                bytes
            ],
        )
        .map_err(err("migrating steps"))?;
    }
    Ok(())
}

/// Marks stopped the sandboxes the log holds as running: they are from an earlier run of
/// the server (sandboxes do not survive one), which counted their shares in memory; they
/// are counted again from their rows. What the log stores, in bytes.
pub(super) fn stop_earlier_sandboxes(conn: &mut Connection, path: &Path) -> Result<u64, LogError> {
    let err = |what| sqlite_err(path, what);
    let tx = conn
        .transaction()
        .map_err(err("marking earlier sandboxes stopped"))?;
    let earlier: Vec<SandboxRecord> = tx
        .prepare(
            "SELECT id, trajectory_id, image, backend, env, created_at, project FROM sandboxes \
             WHERE stopped_at IS NULL",
        )
        .and_then(|mut st| st.query_map([], sandbox_record)?.collect())
        .map_err(err("marking earlier sandboxes stopped"))?;
    let now = crate::unix_now();
    for s in &earlier {
        tx.execute(
            "UPDATE sandboxes SET stopped_at = ?2, bytes = ?3 + (SELECT coalesce(sum(bytes), 0) \
             FROM steps WHERE trajectory = ?4) WHERE id = ?1",
            params![s.id, now, record_bytes(s), s.trajectory()],
        )
        .map_err(err("marking earlier sandboxes stopped"))?;
    }
    let stored: i64 = tx
        .query_row("SELECT coalesce(sum(bytes), 0) FROM sandboxes", [], |r| {
            r.get(0)
        })
        .map_err(err("reading the log's size"))?;
    tx.commit()
        .map_err(err("marking earlier sandboxes stopped"))?;
    Ok(sql_count(stored))
}

/// A `sandboxes` row of `id, trajectory_id, image, backend, env, created_at, project` (an `env`
/// that does not decode reads as empty: the record only sizes the row).
fn sandbox_record(r: &rusqlite::Row<'_>) -> rusqlite::Result<SandboxRecord> {
    Ok(SandboxRecord {
        id: r.get(0)?,
        trajectory_id: r.get(1)?,
        image: r.get(2)?,
        backend: r.get(3)?,
        env: serde_json::from_str(&r.get::<_, String>(4)?).unwrap_or_default(),
        created_at: r.get(5)?,
        project: r.get(6)?,
        fork_of: None,
    })
}
