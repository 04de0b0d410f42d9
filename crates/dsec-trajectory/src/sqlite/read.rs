//! Reads: the step a re-issued request is looked up by, and a sandbox's whole log.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};

use super::sqlite_err;
use crate::error::LogError;
use crate::model::{ExitStatus, SandboxLog, SandboxRecord, Step, StepResult};
use crate::row::{sql_count, RawStep, STEP_COLUMNS};

/// The row's [`STEP_COLUMNS`], from column `at` on.
pub(super) fn raw_step(r: &rusqlite::Row<'_>, at: usize) -> rusqlite::Result<RawStep> {
    Ok(RawStep {
        step: r.get(at)?,
        trajectory_id: r.get(at + 1)?,
        sandbox_id: r.get(at + 2)?,
        argv: r.get(at + 3)?,
        env: r.get(at + 4)?,
        cwd: r.get(at + 5)?,
        stdin_sha256: r.get(at + 6)?,
        files: r.get(at + 7)?,
        timeout_s: r.get(at + 8)?,
        run_as: r.get(at + 25)?,
        kind: r.get(at + 26)?,
        process: r.get(at + 27)?,
        result: StepResult {
            exit: ExitStatus {
                exit_code: r.get(at + 9)?,
                timed_out: r.get(at + 12)?,
                truncated: r.get(at + 13)?,
                oom_killed: r.get(at + 14)?,
                duration_ms: r.get(at + 15)?,
            },
            stdout: r.get(at + 10)?,
            stderr: r.get(at + 11)?,
            stdout_bytes: r.get(at + 18)?,
            stdout_sha256: r.get(at + 19)?,
            stdout_elided: r.get(at + 20)?,
            stderr_bytes: r.get(at + 21)?,
            stderr_sha256: r.get(at + 22)?,
            stderr_elided: r.get(at + 23)?,
            pid: r.get(at + 28)?,
            running: r.get(at + 29)?,
        },
        started_at: r.get(at + 16)?,
        finished_at: r.get(at + 17)?,
    })
}

/// Step `step` of the trajectory stored under `trajectory`, if recorded.
pub(super) fn step(
    conn: &Connection,
    path: &Path,
    trajectory: &str,
    step: i64,
) -> Result<Option<Step>, LogError> {
    let mut stmt = conn
        .prepare_cached(&format!(
            "SELECT {STEP_COLUMNS} FROM steps WHERE trajectory = ?1 AND step = ?2"
        ))
        .map_err(sqlite_err(path, "reading a step"))?;
    let raw = stmt
        .query_row(params![trajectory, step], |r| raw_step(r, 0))
        .optional()
        .map_err(sqlite_err(path, "reading a step"))?;
    raw.map(|r| r.decode(&path.display(), trajectory))
        .transpose()
}

/// A sandbox and its steps (only those of `trajectory_id`, when given); `None` when the log
/// never saw the sandbox, or pruned it.
pub(super) fn sandbox_log(
    conn: &Connection,
    path: &Path,
    id: &str,
    trajectory_id: Option<&str>,
) -> Result<Option<SandboxLog>, LogError> {
    let sandbox = conn
        .query_row(
            "SELECT id, trajectory_id, image, backend, created_at, env, stopped_at, bytes, \
             project FROM sandboxes WHERE id = ?1",
            params![id],
            |r| {
                let record = SandboxRecord {
                    id: r.get(0)?,
                    trajectory_id: r.get(1)?,
                    image: r.get(2)?,
                    backend: r.get(3)?,
                    env: Default::default(),
                    created_at: r.get(4)?,
                    project: r.get(8)?,
                    fork_of: None,
                };
                Ok((
                    record,
                    r.get::<_, String>(5)?,
                    r.get::<_, Option<f64>>(6)?,
                    r.get::<_, i64>(7)?,
                ))
            },
        )
        .optional()
        .map_err(sqlite_err(path, "reading a sandbox"))?;
    let Some((mut sandbox, env, stopped_at, bytes)) = sandbox else {
        return Ok(None);
    };
    sandbox.env = serde_json::from_str(&env).map_err(|source| LogError::CorruptSandbox {
        db: path.display().to_string(),
        id: sandbox.id.clone(),
        source,
    })?;
    let mut stmt = conn
        .prepare_cached(&format!(
            "SELECT {STEP_COLUMNS} FROM steps WHERE trajectory = ?1 AND sandbox_id = ?2 \
             AND (?3 IS NULL OR trajectory_id = ?3) ORDER BY step"
        ))
        .map_err(sqlite_err(path, "reading steps"))?;
    // A sandbox's steps are those of its trajectory (a trajectory belongs to one sandbox),
    // so the primary key serves this and no second index slows appends.
    let trajectory = sandbox.trajectory().to_owned();
    let rows = stmt
        .query_map(params![trajectory, id, trajectory_id], |r| raw_step(r, 0))
        .map_err(sqlite_err(path, "reading steps"))?;
    let mut steps = Vec::new();
    for row in rows {
        let raw = row.map_err(sqlite_err(path, "reading steps"))?;
        steps.push(raw.decode(&path.display(), &trajectory)?);
    }
    Ok(Some(SandboxLog {
        sandbox,
        steps,
        stopped_at,
        bytes: sql_count(bytes),
    }))
}
