//! Wire types of dsec's HTTP API (`/v1`), shared by the server and the CLI.
//!
//! These types are the contract `docs/API.md` describes and the Python SDK speaks; the
//! server derives `/openapi.json` from them. Field names are part of the public API: add,
//! never rename.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// An isolation backend. On the wire it is its [`name`](Self::name), a plain string, so
/// that a name this server does not know gets an error listing the ones it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// Stateless calls on pools of warm native containers.
    Fncall,
    /// dsec's native container runtime.
    Container,
    /// Containers of a Docker Engine.
    Docker,
    /// QEMU microvm guests.
    Microvm,
    /// QEMU q35 guests.
    Vm,
}

impl BackendKind {
    /// Every backend, in the order the docs list them.
    pub const ALL: [BackendKind; 5] = [
        BackendKind::Fncall,
        BackendKind::Container,
        BackendKind::Docker,
        BackendKind::Microvm,
        BackendKind::Vm,
    ];

    /// The name clients use.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Fncall => "fncall",
            BackendKind::Container => "container",
            BackendKind::Docker => "docker",
            BackendKind::Microvm => "microvm",
            BackendKind::Vm => "vm",
        }
    }

    /// The backend called `name`, or a message naming the valid ones.
    pub fn parse(name: &str) -> Result<BackendKind, String> {
        BackendKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = BackendKind::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown backend {name:?}; valid backends are: {}",
                    names.join(", ")
                )
            })
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

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
    /// A [`BackendKind`]'s name; `container` when omitted.
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

/// The most sandboxes one `POST /v1/sandboxes/batch` makes.
pub const MAX_BATCH: u32 = 10_000;

/// `POST /v1/sandboxes/batch`: `count` sandboxes made alike, in one request.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateManyRequest {
    /// How many, 1 to [`MAX_BATCH`].
    pub count: u32,
    /// What each one is made from: a `POST /v1/sandboxes` body.
    pub sandbox: CreateSandboxRequest,
}

/// The answer to `POST /v1/sandboxes/batch`: one item per sandbox asked for, in order.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct CreateManyResponse {
    /// Item `i` is the `i`-th sandbox, or why it could not be made.
    pub items: Vec<BatchItem>,
}

/// One sandbox of a batch: made, or refused with the error a single create would get.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct BatchItem {
    /// The sandbox, when it was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxInfo>,
    /// Why it was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorDetail>,
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
    /// `tcp`, `udp`, `icmp`, or the IP protocol number; `dns` for a question for a name
    /// the policy does not allow (`dst` is then dsec's resolver, `port` 53).
    pub protocol: String,
    /// The name refused: the DNS question's, or the TLS SNI or HTTP `Host` of a connection
    /// the name-checking proxy refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
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
    /// Most memory charged at once since creation (0 where the backend cannot tell).
    #[serde(default)]
    pub memory_peak_bytes: u64,
    /// Forks the pids limit refused since creation.
    #[serde(default)]
    pub pids_limit_hits: u64,
    /// Processes the memory limit killed since creation.
    #[serde(default)]
    pub oom_kills: u64,
    /// Bytes used in the writable layer, where the backend can tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_bytes: Option<u64>,
    /// Files and directories in the writable layer, where the backend can tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_inodes: Option<u64>,
    /// CPU time its CPU limit held it back (throttled) since creation.
    #[serde(default)]
    pub cpu_throttled_ms: f64,
    /// Bytes it received over its network interface (absent without a network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_rx_bytes: Option<u64>,
    /// Bytes it sent over its network interface (absent without a network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_tx_bytes: Option<u64>,
}

/// What the server says about a sandbox.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SandboxInfo {
    /// `<edge>-<random>`: names the edge that owns it.
    pub id: String,
    /// The name of the edge that owns it (`dsec serve`: the server's `--name`).
    #[serde(default)]
    pub edge: String,
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
    /// The project it belongs to (`dsec project create`); absent: the admin's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
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

/// The body of `POST /v1/sandboxes/{id}/exec` and `/exec/stream`: an [`ExecRequest`] and
/// the user it runs as. Kept apart from [`ExecRequest`], which other front ends (E2B's
/// envd, fncall calls) build for the edge: they run as root unless they say otherwise
/// (`From<ExecRequest>`).
#[derive(Clone, Debug, PartialEq, Serialize, ToSchema)]
pub struct ExecBody {
    /// The command.
    #[serde(flatten)]
    pub exec: ExecRequest,
    /// The user of the sandbox to run as: a name, a uid or `uid:gid`, looked up in the
    /// sandbox's own `/etc/passwd` and `/etc/group`; root when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

impl From<ExecRequest> for ExecBody {
    fn from(exec: ExecRequest) -> ExecBody {
        ExecBody { exec, user: None }
    }
}

/// By hand: `user` is taken out, then the rest is an [`ExecRequest`], whose unknown
/// fields stay errors (serde's `flatten` would ignore them).
impl<'de> Deserialize<'de> for ExecBody {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ExecBody, D::Error> {
        use serde::de::Error;
        let mut fields = serde_json::Map::deserialize(d)?;
        let user = match fields.remove("user") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(user)) => Some(user),
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "user must be a string (a name, a uid or uid:gid), got {other}"
                )))
            }
        };
        // The path names the field at fault ("cmd: ..."), as axum's own extractor does.
        let exec = serde_path_to_error::deserialize(serde_json::Value::Object(fields))
            .map_err(D::Error::custom)?;
        Ok(ExecBody { exec, user })
    }
}

/// How a command ended: the fields every command result carries — [`CommandResult`], the
/// stream's [`StreamEvent::Exit`], a backend's exit event, a trajectory step's result —
/// declared once and flattened into each, so their JSON is unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ExitStatus {
    /// Exit status; `128 + N` when killed by signal N; `null` after a timeout.
    pub exit_code: Option<i32>,
    /// The timeout fired and the process tree was killed.
    pub timed_out: bool,
    /// Output beyond the bound (the command's `max_output_bytes`) was discarded.
    pub truncated: bool,
    /// The sandbox's memory limit killed a process of this command.
    pub oom_killed: bool,
    /// Wall time from start to exit.
    pub duration_ms: f64,
}

/// The outcome of one command.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CommandResult {
    /// How it ended.
    #[serde(flatten)]
    pub exit: ExitStatus,
    /// Standard output, UTF-8 with invalid bytes replaced.
    pub stdout: String,
    /// Standard error, likewise.
    pub stderr: String,
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
        /// How it ended.
        #[serde(flatten)]
        exit: ExitStatus,
        /// As in [`CommandResult::replayed`].
        #[serde(default)]
        replayed: bool,
    },
    /// The command could not be run or followed to its end (a user the sandbox does not
    /// have, a sandbox that failed under it): the error `/exec` would answer; last, in
    /// place of `exit`.
    Error {
        /// The error.
        error: ErrorDetail,
    },
}

/// What a [`FileInfo`] describes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    /// A regular file.
    #[default]
    File,
    /// A directory.
    Dir,
    /// A symbolic link (listings and `stat` never follow one).
    Symlink,
    /// A FIFO, a socket or a device.
    Other,
}

/// An entry of `GET /v1/sandboxes/{id}/files/list`, or the answer of
/// `GET /v1/sandboxes/{id}/files/stat`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FileInfo {
    /// Entry name (not a path).
    pub name: String,
    /// Path relative to the listed directory (the name, at depth 1); for `stat`, the
    /// path asked.
    #[serde(default)]
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Whether it is a directory.
    pub is_dir: bool,
    /// Permission bits.
    pub mode: u32,
    /// What it is.
    #[serde(default)]
    pub kind: FileKind,
    /// Last modification, seconds since the epoch.
    #[serde(default)]
    pub mtime: i64,
    /// Owner's uid, where the backend knows it.
    #[serde(default)]
    pub uid: Option<u32>,
    /// Group's gid, where the backend knows it.
    #[serde(default)]
    pub gid: Option<u32>,
    /// A symbolic link's target.
    #[serde(default)]
    pub link: Option<String>,
    /// A file's or directory's metadata: its `user.e2b.*` extended attributes, the key
    /// after the prefix (what E2B's `X-Metadata-*` upload headers set).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// `POST /v1/sandboxes/{id}/files/mkdir`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MakeDirRequest {
    /// Absolute path inside the sandbox.
    pub path: String,
    /// Make missing parent directories too (default true).
    #[serde(default = "yes")]
    pub parents: bool,
    /// An existing directory is no error (default true).
    #[serde(default = "yes")]
    pub exist_ok: bool,
    /// Permission bits (default 0755).
    #[serde(default)]
    pub mode: Option<u32>,
    /// Make it as this user of the sandbox (as a command's `user`; default root).
    #[serde(default)]
    pub user: Option<String>,
}

/// The answer of `POST /v1/sandboxes/{id}/files/mkdir`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MakeDirResponse {
    /// Whether the directory was made (false: it existed).
    pub created: bool,
}

/// `POST /v1/sandboxes/{id}/files/move`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    /// Absolute path of what is moved (a symbolic link is moved itself).
    pub src: String,
    /// Absolute path it gets; its parent must exist.
    pub dst: String,
    /// Replace an existing `dst` (a file or link, or an empty directory by a directory).
    #[serde(default)]
    pub overwrite: bool,
    /// Move it as this user of the sandbox (as a command's `user`; default root).
    #[serde(default)]
    pub user: Option<String>,
}

fn yes() -> bool {
    true
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
    /// Bytes its layer blobs take in the layer store (a layer shared with other images
    /// counts in each of them; [`StoreInfo`] counts it once).
    #[serde(default)]
    pub disk_bytes: u64,
    /// Set on the image a fork made: the sandbox that was forked. Such an image is
    /// removed automatically once no sandbox of it is left.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fork_of: Option<String>,
    /// The project that owns it (its name is under `<project>/`); absent: the admin's,
    /// which every project may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// Set on a bootable disk image (a qcow2 or raw disk imported as it is, with its own
    /// bootloader and kernel): only `backend="vm"` starts it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskImageInfo>,
}

/// A bootable disk image's disk ([`ImageInfo::disk`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DiskImageInfo {
    /// How the stored disk is laid out: `qcow2` (imports are converted to it).
    pub format: String,
    /// The size of the disk its guest sees, in bytes.
    pub virtual_size: u64,
}

/// `GET /v1/store`: what the image store holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StoreInfo {
    /// The layer store's directory on the server's host.
    pub root: String,
    /// Images recorded.
    pub images: usize,
    /// Layer blobs stored.
    pub layers: usize,
    /// Bytes the layer blobs take, each counted once.
    pub layer_bytes: u64,
    /// Layers this server has mounted.
    pub mounted: usize,
}

/// `POST /v1/store/prune`: what a garbage collection removed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PruneResult {
    /// Images of forks whose sandboxes are all gone.
    pub images: Vec<String>,
    /// Layer blobs no image referenced and nothing held.
    pub layers: usize,
    /// Bytes freed in the layer store.
    pub layer_bytes: u64,
    /// Bytes freed elsewhere: VM disks and boot templates of deleted images.
    pub other_bytes: u64,
}

/// One line of the `application/x-ndjson` answer to `POST /v1/images` (progress of an
/// import, for a client that asked for it with `Accept`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ImportEvent {
    /// The image has `total` layers to bring in.
    Layers {
        /// Layer count.
        total: usize,
    },
    /// One more layer is stored.
    Layer {
        /// Its diff id.
        diff_id: String,
        /// Bytes of its content.
        size: u64,
        /// It was stored already.
        reused: bool,
    },
    /// The import is done.
    Done {
        /// The image.
        image: ImageInfo,
    },
    /// The import failed.
    Error {
        /// Why.
        error: ErrorDetail,
    },
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
    /// This edge has promised all the memory or processes its budget allows (503): the
    /// same request may succeed on another edge, or here once sandboxes stop.
    Capacity,
    /// The sandbox's init died (killed from outside, by the OOM killer, or crashed), so
    /// the sandbox can serve nothing more (409).
    SandboxFailed,
    /// A project's quota would be exceeded by the create (409).
    QuotaExceeded,
    /// The user a file operation runs as may not do it (403): what the same operation by a
    /// command as that user would get (`EACCES`, `EPERM`).
    PermissionDenied,
    /// A bug or a host failure (500).
    Internal,
}

impl ErrorKind {
    /// The HTTP status code for this kind.
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::InvalidArgument => 400,
            ErrorKind::Unauthorized => 401,
            ErrorKind::PermissionDenied => 403,
            ErrorKind::NotFound => 404,
            ErrorKind::Conflict
            | ErrorKind::TrajectoryDiverged
            | ErrorKind::SandboxFailed
            | ErrorKind::QuotaExceeded => 409,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::Unavailable | ErrorKind::Capacity => 503,
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
            ErrorKind::Capacity => "capacity",
            ErrorKind::SandboxFailed => "sandbox_failed",
            ErrorKind::QuotaExceeded => "quota_exceeded",
            ErrorKind::PermissionDenied => "permission_denied",
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
    fn an_exec_body_takes_the_user_and_keeps_unknown_fields_errors() {
        let body: ExecBody = serde_json::from_str(r#"{"cmd": "id", "user": "alice"}"#).unwrap();
        assert_eq!(body.user.as_deref(), Some("alice"));
        assert_eq!(body.exec.cmd, Command::Shell("id".into()));
        let root: ExecBody = serde_json::from_str(r#"{"cmd": "id", "user": null}"#).unwrap();
        assert_eq!(root.user, None);
        let typo = serde_json::from_str::<ExecBody>(r#"{"cmd": "id", "usr": "alice"}"#);
        assert!(typo.unwrap_err().to_string().contains("usr"));
        let number = serde_json::from_str::<ExecBody>(r#"{"cmd": "id", "user": 1000}"#);
        assert!(number
            .unwrap_err()
            .to_string()
            .contains("user must be a string"));
        let bad_cmd = serde_json::from_str::<ExecBody>(r#"{"cmd": 5}"#);
        assert!(bad_cmd.unwrap_err().to_string().starts_with("cmd"));
    }

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

    #[test]
    fn exit_status_flattens_into_the_same_json_as_before() {
        let exit = ExitStatus {
            exit_code: Some(0),
            timed_out: false,
            truncated: false,
            oom_killed: false,
            duration_ms: 1.9,
        };
        let result = CommandResult {
            exit,
            stdout: "hi\n".into(),
            stderr: String::new(),
            replayed: false,
        };
        // The docs/API.md example, key for key.
        let documented: serde_json::Value = serde_json::from_str(
            r#"{"exit_code": 0, "stdout": "hi\n", "stderr": "", "timed_out": false,
                "truncated": false, "oom_killed": false, "duration_ms": 1.9, "replayed": false}"#,
        )
        .unwrap();
        assert_eq!(serde_json::to_value(&result).unwrap(), documented);
        assert_eq!(
            serde_json::from_value::<CommandResult>(documented).unwrap(),
            result
        );
        let event = StreamEvent::Exit {
            exit: ExitStatus {
                exit_code: None,
                timed_out: true,
                ..exit
            },
            replayed: true,
        };
        assert_eq!(
            serde_json::to_string(&event).unwrap(),
            r#"{"kind":"exit","exit_code":null,"timed_out":true,"truncated":false,"oom_killed":false,"duration_ms":1.9,"replayed":true}"#
        );
        let old: StreamEvent = serde_json::from_str(
            r#"{"kind":"exit","exit_code":1,"timed_out":false,"truncated":true,"oom_killed":false,"duration_ms":2.0}"#,
        )
        .unwrap();
        let StreamEvent::Exit { exit, replayed } = old else {
            panic!("not an exit: {old:?}")
        };
        assert_eq!(
            (exit.exit_code, exit.truncated, replayed),
            (Some(1), true, false)
        );
    }
}

/// A project's limits; an absent one is unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Quotas {
    /// Sandboxes running at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u64>,
    /// Sum of the running sandboxes' `cpus`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cpus: Option<f64>,
    /// Sum of the running sandboxes' `memory_mb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory_mb: Option<u64>,
}

/// What a project's sandboxes hold now, counted against its [`Quotas`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProjectUsage {
    /// Sandboxes running (or being created).
    pub sandboxes: u64,
    /// Sum of their `cpus`.
    pub cpus: f64,
    /// Sum of their `memory_mb`.
    pub memory_mb: u64,
}

/// Body of `POST /v1/projects`.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateProjectRequest {
    /// 1 to 64 characters of `[a-z0-9_-]`, starting with a letter or digit.
    pub name: String,
    /// Sandboxes running at once (absent: unlimited).
    #[serde(default)]
    pub max_sandboxes: Option<u64>,
    /// Sum of the running sandboxes' `cpus`.
    #[serde(default)]
    pub max_cpus: Option<f64>,
    /// Sum of the running sandboxes' `memory_mb`.
    #[serde(default)]
    pub max_memory_mb: Option<u64>,
}

/// A project, as `GET /v1/projects` lists it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProjectInfo {
    /// Its name.
    pub name: String,
    /// Its limits.
    pub quotas: Quotas,
    /// What it holds now.
    pub usage: ProjectUsage,
    /// How many tokens it has.
    pub tokens: u64,
}

/// A new token: shown once, stored only as a hash.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProjectToken {
    /// The project.
    pub name: String,
    /// The bearer token for it.
    pub token: String,
    /// Its limits.
    pub quotas: Quotas,
}
