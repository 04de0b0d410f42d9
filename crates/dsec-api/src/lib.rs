//! Wire types of dsec's HTTP API (`/v1`), shared by the server and the CLI.
//!
//! These types are the contract `docs/API.md` describes and the Python SDK speaks; the
//! server derives `/openapi.json` from them. Field names are part of the public API: add,
//! never rename.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Every isolation backend a client may name, in the order the docs list them.
pub const BACKENDS: [&str; 5] = ["fncall", "container", "docker", "microvm", "vm"];

/// Resource limits of one sandbox; `None` in a request means "the server's default".
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Limits {
    /// CPU bandwidth in cores (1.5 = one and a half cores).
    pub cpus: Option<f64>,
    /// Memory limit in MiB (the writable layer's pages count here too).
    pub memory_mb: Option<i64>,
    /// Maximum number of processes and threads.
    pub pids: Option<i64>,
    /// Size limit of the writable layer in MiB.
    pub disk_mb: Option<i64>,
}

/// Network policy: `false` (loopback only), `true` (full), or an allow-list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Network {
    /// `false`: loopback only; `true`: full outbound access.
    Enabled(bool),
    /// Outbound only to the listed destinations.
    Allow {
        /// Domain names, `host:port`, IPs and CIDRs.
        allow: Vec<String>,
    },
}

impl Default for Network {
    fn default() -> Self {
        Network::Enabled(false)
    }
}

/// `POST /v1/sandboxes`.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// One of [`BACKENDS`]; `container` when omitted.
    #[serde(default = "default_backend")]
    pub backend: String,
    /// A dsec image name.
    pub image: String,
    /// See [`Limits::cpus`].
    #[serde(default)]
    pub cpus: Option<f64>,
    /// See [`Limits::memory_mb`].
    #[serde(default)]
    pub memory_mb: Option<i64>,
    /// See [`Limits::pids`].
    #[serde(default)]
    pub pids: Option<i64>,
    /// See [`Limits::disk_mb`].
    #[serde(default)]
    pub disk_mb: Option<i64>,
    /// Hard lifetime in seconds.
    #[serde(default)]
    pub ttl_s: Option<f64>,
    /// Lifetime without any request, in seconds.
    #[serde(default)]
    pub idle_ttl_s: Option<f64>,
    /// Environment every command inherits.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Default working directory of commands.
    #[serde(default)]
    pub workdir: Option<String>,
    /// Egress policy.
    #[serde(default)]
    pub network: Network,
    /// Copy the host's CA bundle into the sandbox (`/etc/ssl/certs/ca-certificates.crt`);
    /// `None` means yes when the sandbox has a network.
    #[serde(default)]
    pub ca_bundle: Option<bool>,
    /// Free-form labels, filterable in `GET /v1/sandboxes`.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Opt in to the trajectory log's fast-forward replay.
    #[serde(default)]
    pub trajectory_id: Option<String>,
}

/// A connection attempt a sandbox's network policy refused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RefusedConnection {
    /// When, in seconds since the Unix epoch.
    pub time: f64,
    /// Destination address.
    pub dst: String,
    /// Destination port (TCP and UDP).
    pub port: Option<u16>,
    /// `tcp`, `udp`, `icmp`, or the IP protocol number.
    pub protocol: String,
}

/// `GET /v1/sandboxes/{id}/network`.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct NetworkInfo {
    /// Refused connection attempts, oldest first: the last 256, logged at most 50 packets a
    /// second per rule.
    pub refused: Vec<RefusedConnection>,
}

/// `PUT /v1/sandboxes/{id}/network`.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetNetworkRequest {
    /// The new egress policy.
    pub network: Network,
}

fn default_backend() -> String {
    "container".to_owned()
}

/// Lifecycle state of a sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Being set up; not yet able to run commands.
    Creating,
    /// Ready for commands.
    Running,
    /// Frozen; resumes on the next request.
    Paused,
    /// Being torn down.
    Stopping,
    /// Torn down; everything it made is gone.
    Stopped,
    /// Died on its own (its init or VMM exited).
    Failed,
}

impl SandboxState {
    /// Every state, for metrics that must report zero counts too.
    pub const ALL: [SandboxState; 6] = [
        SandboxState::Creating,
        SandboxState::Running,
        SandboxState::Paused,
        SandboxState::Stopping,
        SandboxState::Stopped,
        SandboxState::Failed,
    ];

    /// The name used on the wire and in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Stopping => "stopping",
            SandboxState::Stopped => "stopped",
            SandboxState::Failed => "failed",
        }
    }
}

/// Resource usage, read from the sandbox's cgroups.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    /// Memory charged to the sandbox, writable layer included.
    pub memory_bytes: u64,
    /// Live processes and threads.
    pub pids: u64,
    /// CPU time consumed.
    pub cpu_ms: f64,
}

/// What the server says about a sandbox.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SandboxInfo {
    /// `<edge>-<random>`: names the edge that owns it.
    pub id: String,
    /// The backend it runs on.
    pub backend: String,
    /// The image it was created from.
    pub image: String,
    /// Current lifecycle state.
    pub state: SandboxState,
    /// Unix time of creation, in seconds.
    pub created_at: f64,
    /// Effective limits (defaults filled in).
    pub limits: Limits,
    /// Hard lifetime, if any.
    pub ttl_s: Option<f64>,
    /// Idle lifetime, if any.
    pub idle_ttl_s: Option<f64>,
    /// Labels given at creation.
    pub labels: BTreeMap<String, String>,
    /// Trajectory this sandbox records into, if any.
    pub trajectory_id: Option<String>,
    /// The step its trajectory continues from; set on the sandboxes `fork` returns, whose
    /// trajectories inherit the parent's steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_step: Option<i64>,
    /// The hardware accelerator of a `microvm` or `vm` sandbox: `kvm`, or `tcg` where KVM
    /// is missing or does not boot guests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<String>,
    /// Resource usage now.
    pub usage: Usage,
}

/// A command: a string for `/bin/sh -c`, or an argv.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Command {
    /// Run by `/bin/sh -c`.
    Shell(String),
    /// Executed directly, no shell.
    Argv(Vec<String>),
}

/// A file written into the sandbox before a command runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FileUpload {
    /// Absolute path inside the sandbox.
    pub path: String,
    /// Content, base64.
    pub data_b64: String,
    /// Permission bits; 0644 when omitted.
    #[serde(default)]
    pub mode: Option<u32>,
}

/// `POST /v1/sandboxes/{id}/exec` and `/exec/stream`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// What to run.
    pub cmd: Command,
    /// Extra environment for this command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; the sandbox's workdir when omitted.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Standard input, base64.
    #[serde(default)]
    pub stdin_b64: Option<String>,
    /// Files written before the command starts.
    #[serde(default)]
    pub files: Vec<FileUpload>,
    /// Kill the whole process tree after this many seconds.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Bound on each of stdout and stderr; beyond it output is discarded.
    #[serde(default)]
    pub max_output_bytes: Option<i64>,
    /// Trajectory step.
    #[serde(default)]
    pub step: Option<i64>,
}

/// The outcome of one command.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CommandResult {
    /// Exit status; `128 + N` when killed by signal N; `null` after a timeout.
    pub exit_code: Option<i32>,
    /// Standard output, UTF-8 with invalid bytes replaced.
    pub stdout: String,
    /// Standard error, likewise.
    pub stderr: String,
    /// The timeout fired and the process tree was killed.
    pub timed_out: bool,
    /// Output beyond the bound was discarded.
    pub truncated: bool,
    /// The sandbox's memory limit killed a process of this command.
    pub oom_killed: bool,
    /// Wall time from start to exit.
    pub duration_ms: f64,
    /// Served from the trajectory log without running.
    pub replayed: bool,
}

/// One line of `/exec/stream`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum StreamEvent {
    /// A chunk of standard output.
    Stdout {
        /// The chunk.
        data: String,
    },
    /// A chunk of standard error.
    Stderr {
        /// The chunk.
        data: String,
    },
    /// The command ended; always the last event.
    Exit {
        /// As in [`CommandResult::exit_code`].
        exit_code: Option<i32>,
        /// As in [`CommandResult::timed_out`].
        timed_out: bool,
        /// As in [`CommandResult::truncated`].
        truncated: bool,
        /// As in [`CommandResult::oom_killed`].
        oom_killed: bool,
        /// As in [`CommandResult::duration_ms`].
        duration_ms: f64,
        /// As in [`CommandResult::replayed`].
        #[serde(default)]
        replayed: bool,
    },
}

/// An entry of `GET /v1/sandboxes/{id}/files/list`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FileInfo {
    /// Entry name (not a path).
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Whether it is a directory.
    pub is_dir: bool,
    /// Permission bits.
    pub mode: u32,
}

/// `POST /v1/images`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ImportImageRequest {
    /// A path on the server's host or an OCI registry reference.
    pub source: String,
    /// Image name; derived from the source when omitted.
    #[serde(default)]
    pub name: Option<String>,
}

/// An image in the server's store.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ImageInfo {
    /// Name sandboxes refer to it by.
    pub name: String,
    /// `sha256:` digest identifying the content.
    pub id: String,
    /// Bytes of its unpacked layers.
    pub size: u64,
    /// Layer digests, bottom first.
    pub layers: Vec<String>,
    /// Unix time of import.
    pub created_at: f64,
}

/// Machine-readable class of an error; the SDK maps it to an exception.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Bad input (400).
    InvalidArgument,
    /// Missing or wrong token (401).
    Unauthorized,
    /// No such sandbox or image (404).
    NotFound,
    /// Wrong state for the request (409).
    Conflict,
    /// A replayed step differs from the recorded one (409).
    TrajectoryDiverged,
    /// Request body over the server's limit (413).
    PayloadTooLarge,
    /// The backend cannot run here (503).
    Unavailable,
    /// A bug or a host failure (500).
    Internal,
}

impl ErrorKind {
    /// The HTTP status code for this kind.
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidArgument => 400,
            ErrorKind::Unauthorized => 401,
            ErrorKind::NotFound => 404,
            ErrorKind::Conflict | ErrorKind::TrajectoryDiverged => 409,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::Unavailable => 503,
            ErrorKind::Internal => 500,
        }
    }

    /// The name used on the wire and in metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Conflict => "conflict",
            ErrorKind::TrajectoryDiverged => "trajectory_diverged",
            ErrorKind::PayloadTooLarge => "payload_too_large",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Internal => "internal",
        }
    }
}

/// The `error` object of every error response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Class of the error.
    pub kind: ErrorKind,
    /// What went wrong and what to do about it.
    pub message: String,
}

/// Body of every error response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_accepts_bool_and_allow_list() {
        let off: Network = serde_json::from_str("false").unwrap();
        assert_eq!(off, Network::Enabled(false));
        let allow: Network = serde_json::from_str(r#"{"allow": ["pypi.org"]}"#).unwrap();
        assert_eq!(
            allow,
            Network::Allow {
                allow: vec!["pypi.org".into()]
            }
        );
    }

    #[test]
    fn command_is_string_or_argv() {
        let sh: Command = serde_json::from_str(r#""echo hi""#).unwrap();
        assert_eq!(sh, Command::Shell("echo hi".into()));
        let argv: Command = serde_json::from_str(r#"["ls", "-l"]"#).unwrap();
        assert_eq!(argv, Command::Argv(vec!["ls".into(), "-l".into()]));
    }

    #[test]
    fn create_request_needs_only_an_image() {
        let req: CreateSandboxRequest = serde_json::from_str(r#"{"image": "busybox"}"#).unwrap();
        assert_eq!(req.backend, "container");
        assert_eq!(req.network, Network::Enabled(false));
        let err = serde_json::from_str::<CreateSandboxRequest>(r#"{"image": "x", "cpu": 1}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `cpu`"), "{err}");
    }

    #[test]
    fn stream_events_are_tagged_by_kind() {
        let ev = StreamEvent::Stdout { data: "hi".into() };
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"kind":"stdout","data":"hi"}"#
        );
    }
}
