//! Reads: the step a re-issued request is looked up by, and a sandbox's whole log.

use tokio_postgres::{Client, Row};

use super::{pg_err, Reader};
use crate::error::LogError;
use crate::model::{ExitStatus, SandboxLog, SandboxRecord, Step, StepResult};
use crate::row::{sql_count, RawStep, STEP_COLUMNS};

/// The lookup each read connection prepares.
pub(super) fn step_query() -> String {
    format!("SELECT {STEP_COLUMNS} FROM dsec_steps WHERE trajectory = $1 AND step = $2")
}

/// Text from a `bytea` output column: the store wrote it from a `String`.
fn text(r: &Row, i: usize) -> String {
    String::from_utf8_lossy(r.get::<_, &[u8]>(i)).into_owned()
}

fn count(r: &Row, i: usize) -> u64 {
    sql_count(r.get::<_, i64>(i))
}

/// A row of [`STEP_COLUMNS`].
fn raw_step(r: &Row) -> RawStep {
    RawStep {
        step: r.get(0),
        trajectory_id: r.get(1),
        sandbox_id: r.get(2),
        argv: r.get(3),
        env: r.get(4),
        cwd: r.get(5),
        stdin_sha256: r.get(6),
        files: r.get(7),
        timeout_s: r.get(8),
        run_as: r.get(25),
        kind: r.get(26),
        process: r.get(27),
        result: StepResult {
            exit: ExitStatus {
                exit_code: r.get(9),
                timed_out: r.get(12),
                truncated: r.get(13),
                oom_killed: r.get(14),
                duration_ms: r.get(15),
            },
            stdout: text(r, 10),
            stderr: text(r, 11),
            stdout_bytes: count(r, 18),
            stdout_sha256: r.get(19),
            stdout_elided: count(r, 20),
            stderr_bytes: count(r, 21),
            stderr_sha256: r.get(22),
            stderr_elided: count(r, 23),
            pid: r.get(28),
            running: r.get(29),
        },
        started_at: r.get(16),
        finished_at: r.get(17),
    }
}

/// Step `step` of the trajectory stored under `trajectory`, if recorded.
pub(super) async fn step(
    reader: &Reader,
    db: &str,
    trajectory: &str,
    step: i64,
) -> Result<Option<Step>, LogError> {
    let row = reader
        .client
        .query_opt(&reader.step, &[&trajectory, &step])
        .await
        .map_err(pg_err(db, "reading a step"))?;
    row.map(|r| raw_step(&r).decode(&db, trajectory))
        .transpose()
}

/// A sandbox and its steps (only those of `trajectory_id`, when given); `None` when the log
/// never saw the sandbox, or pruned it.
pub(super) async fn sandbox_log(
    client: &Client,
    db: &str,
    id: &str,
    trajectory_id: Option<&str>,
) -> Result<Option<SandboxLog>, LogError> {
    let row = client
        .query_opt(
            "SELECT id, trajectory_id, image, backend, created_at, env, stopped_at, bytes, \
             project FROM dsec_sandboxes WHERE id = $1",
            &[&id],
        )
        .await
        .map_err(pg_err(db, "reading a sandbox"))?;
    let Some(row) = row else {
        return Ok(None);
    };
    let sandbox = SandboxRecord {
        id: row.get(0),
        trajectory_id: row.get(1),
        image: row.get(2),
        backend: row.get(3),
        env: serde_json::from_str(row.get(5)).map_err(|source| LogError::CorruptSandbox {
            db: db.to_owned(),
            id: id.to_owned(),
            source,
        })?,
        created_at: row.get(4),
        project: row.get(8),
        fork_of: None,
    };
    let trajectory = sandbox.trajectory().to_owned();
    let rows = client
        .query(
            &format!(
                "SELECT {STEP_COLUMNS} FROM dsec_steps WHERE trajectory = $1 AND sandbox_id = $2 \
                 AND ($3::text IS NULL OR trajectory_id = $3) ORDER BY step"
            ),
            &[&trajectory, &id, &trajectory_id],
        )
        .await
        .map_err(pg_err(db, "reading steps"))?;
    let steps = rows
        .iter()
        .map(|r| raw_step(r).decode(&db, &trajectory))
        .collect::<Result<_, _>>()?;
    Ok(Some(SandboxLog {
        sandbox,
        steps,
        stopped_at: row.get(6),
        bytes: count(&row, 7),
    }))
}
