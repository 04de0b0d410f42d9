//! What the log records: sandboxes, their steps, each step's request and result. These
//! are the JSON of `GET /v1/sandboxes/{id}/log` too.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use utoipa::ToSchema;

use crate::capture::KeptOutput;

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
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
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
    /// The user it ran as, as requested (`user=`); `None` for root, the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as: Option<String>,
    /// A command run to its end (`run`, the default), or an act on a spawned process.
    #[serde(default, skip_serializing_if = "StepKind::is_run")]
    pub kind: StepKind,
    /// The process a process step acts on, and what it did to it; `None` for a run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessRequest>,
}

/// What a step was: a command run to its end, or one act on a spawned process (which
/// outlives the request that started it; see [`ProcessRequest`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// `exec`/`run`: a command, its result its exit and output.
    #[default]
    Run,
    /// A spawn: the request is the command's; the result is the process's end (its exit
    /// and output, bounded like a run's), recorded when it ends; `running` until then.
    Spawn,
    /// A write to a process's standard input: `stdin_sha256` is its digest, `process.input`
    /// its bytes as kept.
    Stdin,
    /// The end of a process's standard input.
    CloseStdin,
    /// A signal (`process.signal`).
    Signal,
    /// A kill of a process and everything it started.
    Kill,
    /// A new terminal size (`process.pty`).
    Resize,
}

impl StepKind {
    /// Whether it is a run (left out of the JSON: logs written before processes were
    /// recorded hold only runs).
    pub fn is_run(&self) -> bool {
        *self == StepKind::Run
    }

    /// Its name, as stored and in the JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Run => "run",
            StepKind::Spawn => "spawn",
            StepKind::Stdin => "stdin",
            StepKind::CloseStdin => "close_stdin",
            StepKind::Signal => "signal",
            StepKind::Kill => "kill",
            StepKind::Resize => "resize",
        }
    }
}

/// What a step on a spawned process asked for, beyond a run's request. A process is named
/// by the step that spawned it, not by its pid, so that a replay into another sandbox
/// (where the pids differ) finds it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ProcessRequest {
    /// The step that spawned the process this step acts on; `None` for a spawn (the
    /// process is its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spawn_step: Option<i64>,
    /// A spawn's tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// A spawn's terminal, or a resize's new size, as `[cols, rows]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<[u16; 2]>,
    /// A spawn: whether its standard input was kept open for writes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stdin_open: bool,
    /// A signal's number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// A stdin write's bytes as the log keeps them, like an output: whole up to
    /// [`Budgets::output_bytes`](crate::Budgets::output_bytes), else its head, a marker
    /// line and its tail (UTF-8, invalid bytes replaced). Not compared on replay: the
    /// request's `stdin_sha256` is.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub input: String,
    /// Length of the whole write in bytes.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub input_bytes: u64,
    /// Bytes of it the log did not keep (0: `input` is all of it).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub input_elided: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl ProcessRequest {
    /// Whether `other` asks the same of the same process (the input as kept is left out:
    /// its digest is compared).
    pub fn same_as(&self, other: &ProcessRequest) -> bool {
        self.spawn_step == other.spawn_step
            && self.tag == other.tag
            && self.pty == other.pty
            && self.stdin_open == other.stdin_open
            && self.signal == other.signal
    }

    /// The input as sent, when the log kept all of it exactly (valid UTF-8, not elided):
    /// what a replay can send again.
    pub fn replayable_input(&self, sha256: Option<&str>) -> Option<&[u8]> {
        let bytes = self.input.as_bytes();
        (self.input_elided == 0
            && bytes.len() as u64 == self.input_bytes
            && sha256 == Some(digest(bytes).as_str()))
        .then_some(bytes)
    }
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
            && self.run_as == other.run_as
            && self.kind == other.kind
            && match (&self.process, &other.process) {
                (Some(a), Some(b)) => a.same_as(b),
                (a, b) => a.is_none() && b.is_none(),
            }
    }

    /// A one-line description for error messages: command, cwd, env and digests.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        if let Some(p) = &self.process {
            s += &match p.spawn_step {
                None => "spawn of ".to_owned(),
                Some(n) => format!("{} to the process of step {n}, ", self.kind.as_str()),
            };
            if let Some(tag) = &p.tag {
                s += &format!("tag {tag:?}, ");
            }
            if let Some([cols, rows]) = p.pty {
                s += &format!("terminal {cols}x{rows}, ");
            }
            if let Some(signal) = p.signal {
                s += &format!("signal {signal}, ");
            }
        }
        s += &format!(
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
        if let Some(user) = &self.run_as {
            s += &format!(", as user {user:?}");
        }
        s
    }
}

/// `sha256:<hex>` of `data`, the form digests take in the log.
pub fn digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// How a command ended, as its client was told (the API's own type: `truncated` is what
/// the client was told; the log's own cuts are a step's `stdout_elided` and
/// `stderr_elided`).
pub use dsec_api::ExitStatus;

/// How a step ended, and its output as the log keeps it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StepResult {
    /// How it ended.
    #[serde(flatten)]
    pub exit: ExitStatus,
    /// Standard output as kept: the whole of it, or, when `stdout_elided` > 0, its head,
    /// a marker line and its tail (UTF-8, invalid bytes replaced).
    pub stdout: String,
    /// Standard error, likewise.
    pub stderr: String,
    /// Length of the whole standard output in bytes, as the client received it.
    #[serde(default)]
    pub stdout_bytes: u64,
    /// `sha256:<hex>` of the whole standard output.
    #[serde(default)]
    pub stdout_sha256: String,
    /// Bytes of standard output the log did not keep (0: `stdout` is all of it).
    #[serde(default)]
    pub stdout_elided: u64,
    /// As `stdout_bytes`, for standard error.
    #[serde(default)]
    pub stderr_bytes: u64,
    /// As `stdout_sha256`, for standard error.
    #[serde(default)]
    pub stderr_sha256: String,
    /// As `stdout_elided`, for standard error.
    #[serde(default)]
    pub stderr_elided: u64,
    /// A spawn's pid in the sandbox that recorded it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    /// A spawn whose process had not ended (its end not recorded yet: the process still
    /// runs, or the server stopped before it ended).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub running: bool,
}

impl StepResult {
    /// A result of `exit` with the output as captured.
    pub fn new(exit: ExitStatus, stdout: KeptOutput, stderr: KeptOutput) -> StepResult {
        StepResult {
            exit,
            stdout: stdout.text,
            stdout_bytes: stdout.bytes,
            stdout_sha256: stdout.sha256,
            stdout_elided: stdout.elided,
            stderr: stderr.text,
            stderr_bytes: stderr.bytes,
            stderr_sha256: stderr.sha256,
            stderr_elided: stderr.elided,
            pid: None,
            running: false,
        }
    }

    /// Whether the log kept less than the whole output.
    pub fn elided(&self) -> bool {
        self.stdout_elided > 0 || self.stderr_elided > 0
    }

    /// Keeps only the lengths and digests of the output (a step over a budget).
    pub(crate) fn drop_output(&mut self) {
        for (text, bytes, elided) in [
            (&mut self.stdout, self.stdout_bytes, &mut self.stdout_elided),
            (&mut self.stderr, self.stderr_bytes, &mut self.stderr_elided),
        ] {
            if bytes > 0 {
                *text = KeptOutput::marker(bytes);
                *elided = bytes;
            }
        }
    }
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
    pub(crate) fn trajectory(&self) -> &str {
        self.trajectory_id.as_deref().unwrap_or(&self.sandbox_id)
    }

    /// Keeps only the lengths and digests of its output and input (a step over a budget).
    pub(crate) fn drop_output(&mut self) {
        self.result.drop_output();
        if let Some(p) = &mut self.request.process {
            if p.input_bytes > 0 {
                p.input = KeptOutput::marker(p.input_bytes);
                p.input_elided = p.input_bytes;
            }
        }
    }

    /// Bytes of output and input it holds as kept.
    pub(crate) fn kept_bytes(&self) -> u64 {
        let input = self.request.process.as_ref().map_or(0, |p| p.input_bytes);
        self.result.stdout_bytes + self.result.stderr_bytes + input
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
    /// The project whose token created it; `None` for the admin's. A project's token
    /// reads the logs of its own sandboxes only, also once they stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// A fork's parent trajectory: its first steps are copied into this sandbox's
    /// trajectory when the sandbox is recorded, so the fork continues from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_of: Option<ForkOf>,
}

impl SandboxRecord {
    /// The key its trajectory is stored under.
    pub(crate) fn trajectory(&self) -> &str {
        self.trajectory_id.as_deref().unwrap_or(&self.id)
    }
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
    /// Unix time the sandbox stopped; `null` while it runs. Stopped sandboxes' logs are
    /// pruned, oldest first, when the log reaches its budget.
    #[serde(default)]
    pub stopped_at: Option<f64>,
    /// Bytes its log takes, as the budgets count them.
    #[serde(default)]
    pub bytes: u64,
}

/// A value as stored in a JSON column.
pub(crate) fn json<T: Serialize + ?Sized>(value: &T) -> String {
    serde_json::to_string(value).expect("plain data serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(cmd: &str) -> StepRequest {
        serde_json::from_value(serde_json::json!({
            "argv": ["/bin/sh", "-c", cmd], "env": {}, "cwd": "/", "stdin_sha256": null,
            "files": [{"path": "/a", "sha256": digest(b"x"), "mode": 0o644}], "timeout_s": 5.0,
        }))
        .unwrap()
    }

    #[test]
    fn requests_compare_without_the_timeout() {
        let a = request("echo");
        let mut b = a.clone();
        b.timeout_s = None;
        assert!(a.same_as(&b));
        b.cwd = "/tmp".into();
        assert!(!a.same_as(&b));
        assert!(b.describe().contains("\"/tmp\""), "{}", b.describe());
        assert!(b.describe().contains("file /a sha256:"), "{}", b.describe());
        // A step run as another user is another step; logs written before users read as
        // root's.
        let mut c = a.clone();
        c.run_as = Some("alice".into());
        assert!(!a.same_as(&c));
        assert!(
            c.describe().contains("as user \"alice\""),
            "{}",
            c.describe()
        );
        assert_eq!(a.run_as, None);
    }

    #[test]
    fn a_result_keeps_its_json_flat() {
        let result = StepResult {
            exit: ExitStatus {
                exit_code: Some(3),
                duration_ms: 1.5,
                ..ExitStatus::default()
            },
            stdout: "hi\n".into(),
            ..StepResult::default()
        };
        let value = serde_json::to_value(&result).unwrap();
        assert_eq!(value["exit_code"], 3);
        assert_eq!(value["duration_ms"], 1.5);
        assert_eq!(value["timed_out"], false);
        assert!(value.get("exit").is_none(), "{value}");
        // What an older server wrote (no output digests) still reads.
        let old = serde_json::json!({
            "exit_code": 0, "stdout": "x", "stderr": "", "timed_out": false,
            "truncated": true, "oom_killed": false, "duration_ms": 2.0
        });
        let read: StepResult = serde_json::from_value(old).unwrap();
        assert!(read.exit.truncated && read.stdout_bytes == 0);
    }
}
