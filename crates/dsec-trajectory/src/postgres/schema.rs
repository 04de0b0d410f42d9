//! The PostgreSQL schema: created by the first server to connect, checked by the others.

use tokio_postgres::Client;

use super::pg_err;
use crate::budget::record_bytes;
use crate::error::LogError;
use crate::model::SandboxRecord;
use crate::row::{sql_count, sql_int};

/// The schema this build writes (`dsec_schema.version`).
const SCHEMA_VERSION: i64 = 3;

/// The same tables as SQLite's, prefixed (the database may hold others), plus what a
/// database shared by servers needs: each sandbox's edge, and each edge's share of the log.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS dsec_schema (version BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS dsec_sandboxes (
    id            TEXT PRIMARY KEY,
    trajectory_id TEXT UNIQUE,
    image         TEXT NOT NULL,
    backend       TEXT NOT NULL,
    env           TEXT NOT NULL,
    created_at    DOUBLE PRECISION NOT NULL,
    edge          TEXT NOT NULL,
    stopped_at    DOUBLE PRECISION,
    bytes         BIGINT NOT NULL DEFAULT 0,
    project       TEXT
);
CREATE INDEX IF NOT EXISTS dsec_sandboxes_by_stop ON dsec_sandboxes (stopped_at)
    WHERE stopped_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS dsec_sandboxes_running ON dsec_sandboxes (edge)
    WHERE stopped_at IS NULL;
CREATE TABLE IF NOT EXISTS dsec_steps (
    trajectory    TEXT NOT NULL,
    step          BIGINT NOT NULL,
    trajectory_id TEXT,
    sandbox_id    TEXT NOT NULL,
    argv          TEXT NOT NULL,
    env           TEXT NOT NULL,
    cwd           TEXT NOT NULL,
    stdin_sha256  TEXT,
    files         TEXT NOT NULL,
    timeout_s     DOUBLE PRECISION,
    exit_code     INTEGER,
    stdout        BYTEA NOT NULL,
    stderr        BYTEA NOT NULL,
    timed_out     BOOLEAN NOT NULL,
    truncated     BOOLEAN NOT NULL,
    oom_killed    BOOLEAN NOT NULL,
    duration_ms   DOUBLE PRECISION NOT NULL,
    started_at    DOUBLE PRECISION NOT NULL,
    finished_at   DOUBLE PRECISION NOT NULL,
    stdout_bytes  BIGINT NOT NULL,
    stdout_sha256 TEXT NOT NULL,
    stdout_elided BIGINT NOT NULL,
    stderr_bytes  BIGINT NOT NULL,
    stderr_sha256 TEXT NOT NULL,
    stderr_elided BIGINT NOT NULL,
    bytes         BIGINT NOT NULL,
    run_as        TEXT,
    kind          TEXT NOT NULL DEFAULT 'run',
    process       TEXT,
    pid           INTEGER,
    running       BOOLEAN NOT NULL DEFAULT false,
    PRIMARY KEY (trajectory, step)
);
-- Version 2: the user a step ran as (none before: root).
ALTER TABLE dsec_steps ADD COLUMN IF NOT EXISTS run_as TEXT;
-- Version 3: process steps (every step before was a run), and each sandbox's project
-- (none before: the admin's).
ALTER TABLE dsec_steps ADD COLUMN IF NOT EXISTS kind TEXT NOT NULL DEFAULT 'run';
ALTER TABLE dsec_steps ADD COLUMN IF NOT EXISTS process TEXT;
ALTER TABLE dsec_steps ADD COLUMN IF NOT EXISTS pid INTEGER;
ALTER TABLE dsec_steps ADD COLUMN IF NOT EXISTS running BOOLEAN NOT NULL DEFAULT false;
ALTER TABLE dsec_sandboxes ADD COLUMN IF NOT EXISTS project TEXT;
CREATE TABLE IF NOT EXISTS dsec_usage (edge TEXT PRIMARY KEY, bytes BIGINT NOT NULL);
";

/// Creates the schema if it is missing, under a transaction-wide advisory lock so that
/// servers starting together do not race; refuses a newer one.
pub(super) async fn migrate(client: &mut Client, db: &str) -> Result<(), LogError> {
    let err = |what| pg_err(db, what);
    let tx = client
        .transaction()
        .await
        .map_err(err("creating the schema"))?;
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('dsec-trajectory-schema', 0))",
        &[],
    )
    .await
    .map_err(err("creating the schema"))?;
    tx.batch_execute(SCHEMA)
        .await
        .map_err(err("creating the schema"))?;
    let version: Option<i64> = tx
        .query_opt("SELECT max(version) FROM dsec_schema", &[])
        .await
        .map_err(err("reading the schema version"))?
        .and_then(|r| r.get(0));
    match version {
        None => {
            tx.execute(
                "INSERT INTO dsec_schema (version) VALUES ($1)",
                &[&SCHEMA_VERSION],
            )
            .await
            .map_err(err("creating the schema"))?;
        }
        Some(found) if found > SCHEMA_VERSION => {
            return Err(LogError::Version {
                db: db.to_owned(),
                found,
                supported: SCHEMA_VERSION,
            })
        }
        Some(found) if found < SCHEMA_VERSION => {
            tx.execute("UPDATE dsec_schema SET version = $1", &[&SCHEMA_VERSION])
                .await
                .map_err(err("migrating the schema"))?;
        }
        Some(_) => {}
    }
    tx.commit().await.map_err(err("creating the schema"))
}

/// Marks stopped the sandboxes of `edge` the log holds as running: they are from an
/// earlier run of this edge, which counted their shares in memory; their rows get the
/// shares again, counted from their steps (`dsec_usage` counted them as they were written).
pub(super) async fn stop_earlier_sandboxes(
    client: &mut Client,
    db: &str,
    edge: &str,
) -> Result<(), LogError> {
    let err = |what| pg_err(db, what);
    let tx = client
        .transaction()
        .await
        .map_err(err("marking earlier sandboxes stopped"))?;
    let rows = tx
        .query(
            "SELECT id, trajectory_id, image, backend, env, project FROM dsec_sandboxes \
             WHERE edge = $1 AND stopped_at IS NULL",
            &[&edge],
        )
        .await
        .map_err(err("marking earlier sandboxes stopped"))?;
    let now = crate::unix_now();
    for r in &rows {
        let s = SandboxRecord {
            id: r.get(0),
            trajectory_id: r.get(1),
            image: r.get(2),
            backend: r.get(3),
            env: serde_json::from_str(r.get(4)).unwrap_or_default(),
            created_at: 0.0,
            project: r.get(5),
            fork_of: None,
        };
        tx.execute(
            "UPDATE dsec_sandboxes SET stopped_at = $2, bytes = $3::int8 + (SELECT \
             coalesce(sum(bytes), 0)::int8 FROM dsec_steps WHERE trajectory = $4) WHERE id = $1",
            &[&s.id, &now, &sql_int(record_bytes(&s)), &s.trajectory()],
        )
        .await
        .map_err(err("marking earlier sandboxes stopped"))?;
    }
    tx.commit()
        .await
        .map_err(err("marking earlier sandboxes stopped"))
}

/// What the whole log stores, every edge's share together.
pub(super) async fn stored_bytes(client: &Client, db: &str) -> Result<u64, LogError> {
    let total: i64 = client
        .query_one("SELECT coalesce(sum(bytes), 0)::int8 FROM dsec_usage", &[])
        .await
        .map_err(pg_err(db, "reading the log's size"))?
        .get(0);
    Ok(sql_count(total))
}
