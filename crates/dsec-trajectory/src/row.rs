//! A step as the stores hold it: its JSON columns still encoded. Both stores read rows
//! into this and decode them here, so that a row means the same whichever store it is in.

use std::fmt::Display;

use crate::error::LogError;
use crate::model::{Step, StepRequest, StepResult};

/// A byte count as SQL's INTEGER holds it: saturating at `i64::MAX`, never wrapping.
pub(crate) fn sql_int(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A byte count read back from SQL: a negative one (never written) reads as 0.
pub(crate) fn sql_count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// The columns of a step, after `trajectory`, in the order both stores read them.
pub(crate) const STEP_COLUMNS: &str =
    "step, trajectory_id, sandbox_id, argv, env, cwd, stdin_sha256, \
    files, timeout_s, exit_code, stdout, stderr, timed_out, truncated, oom_killed, \
    duration_ms, started_at, finished_at, stdout_bytes, stdout_sha256, stdout_elided, \
    stderr_bytes, stderr_sha256, stderr_elided, bytes, run_as, kind, process, pid, running";

/// The columns a fork copies from its parent's steps, after `trajectory, step,
/// trajectory_id, sandbox_id` (which it sets).
pub(crate) const COPIED_COLUMNS: &str =
    "argv, env, cwd, stdin_sha256, files, timeout_s, exit_code, stdout, stderr, timed_out, \
    truncated, oom_killed, duration_ms, started_at, finished_at, stdout_bytes, stdout_sha256, \
    stdout_elided, stderr_bytes, stderr_sha256, stderr_elided, bytes, run_as, kind, process, \
    pid, running";

/// A `steps` row before its JSON columns (argv, env, files) are decoded.
pub(crate) struct RawStep {
    pub(crate) step: i64,
    pub(crate) trajectory_id: Option<String>,
    pub(crate) sandbox_id: String,
    pub(crate) argv: String,
    pub(crate) env: String,
    pub(crate) cwd: String,
    pub(crate) stdin_sha256: Option<String>,
    pub(crate) files: String,
    pub(crate) timeout_s: Option<f64>,
    pub(crate) run_as: Option<String>,
    pub(crate) kind: String,
    /// JSON of the [`ProcessRequest`](crate::ProcessRequest), for a process step.
    pub(crate) process: Option<String>,
    pub(crate) result: StepResult,
    pub(crate) started_at: f64,
    pub(crate) finished_at: f64,
}

impl RawStep {
    /// The step, or [`LogError::Corrupt`] naming the row of `trajectory` in `db`.
    pub(crate) fn decode(self, db: &dyn Display, trajectory: &str) -> Result<Step, LogError> {
        let corrupt = |source| LogError::Corrupt {
            db: db.to_string(),
            trajectory: trajectory.to_owned(),
            step: self.step,
            source,
        };
        let kind = serde_json::from_value(serde_json::Value::String(self.kind)).map_err(corrupt)?;
        let process = self
            .process
            .as_deref()
            .map(serde_json::from_str)
            .transpose()
            .map_err(corrupt)?;
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
                run_as: self.run_as,
                kind,
                process,
            },
            result: self.result,
            started_at: self.started_at,
            finished_at: self.finished_at,
        })
    }
}
