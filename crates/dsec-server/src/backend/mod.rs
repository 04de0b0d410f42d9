//! Isolation backends behind one trait.
//!
//! The edge validates a request, fills in defaults and resolves the image; a [`Backend`]
//! turns that into a running [`Sandbox`]. Everything the API offers on a sandbox (exec,
//! streamed exec, files, usage, stop) is a method here, and what a backend can do (a
//! network, how it is admitted) is asked of it, never decided by its name: a new backend
//! is one module implementing these two traits and one [`Backends::register`] line.

pub mod container;
pub mod docker;
pub mod files;
pub mod fncall;
pub mod vm;

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use dsec_api::{BackendKind, FileInfo, FileKind, ImageInfo, Usage};
use dsec_image::{Image, ImageStore};
use dsec_runtime::channel::{Channel, ExecControl, ExecEvent, ExecHandle};
use dsec_runtime::files::{Entry, EntryKind};
use dsec_runtime::proto::ExecSpec;
pub use dsec_runtime::proto::{MakeDir, MovePath, RemovePath};

pub use self::files::{FileRead, FileWatch, Upload};
use crate::error::ApiError;

/// A validated request for a new sandbox, defaults filled in.
#[derive(Clone, Debug)]
pub struct SandboxRequest {
    /// The new sandbox's id.
    pub id: String,
    /// The image as the client named it; each backend resolves it in its own store
    /// (`NotFound` naming it when absent).
    pub image: String,
    /// CPU bandwidth in cores.
    pub cpus: f64,
    /// Memory limit in MiB.
    pub memory_mb: u64,
    /// Process limit.
    pub pids: u64,
    /// Writable layer size in MiB.
    pub disk_mb: u64,
    /// Egress policy (the edge refuses anything but `Off` for backends without networking).
    pub network: dsec_net::Policy,
    /// Copy the host's CA bundle in when the sandbox has a network.
    pub ca_bundle: bool,
}

/// What the edge needs to know of a sandbox's image.
#[derive(Clone, Debug, Default)]
pub struct ImageDefaults {
    /// `K=V` environment the image sets.
    pub env: Vec<String>,
    /// The image's working directory, if it sets one.
    pub workdir: Option<String>,
}

/// A sandbox a backend made, with its image's defaults.
pub struct Created {
    /// The running sandbox.
    pub sandbox: Box<dyn Sandbox>,
    /// The image's defaults.
    pub image: ImageDefaults,
}

/// A command, ready to run: argv, complete environment, working directory.
#[derive(Clone, Debug)]
pub struct CommandSpec {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// `K=V` pairs: the image's, the sandbox's, then the command's.
    pub env: Vec<String>,
    /// Absolute working directory.
    pub cwd: String,
    /// Standard input.
    pub stdin: Vec<u8>,
    /// Files written (parents created) right before the command starts, in the same
    /// sandbox or worker that runs it.
    pub files: Vec<FileWrite>,
    /// Kill the tree after this many milliseconds.
    pub timeout_ms: u64,
    /// Bound on each output stream.
    pub max_output_bytes: u64,
    /// The user it runs as; `None`: root.
    pub run_as: Option<RunAs>,
}

pub use dsec_runtime::proto::RunAs;

/// The account `user` (a name, `uid` or `uid:gid`) names in `sandbox`'s own `/etc/passwd`
/// and `/etc/group`, read through its file API: what a command run as that user gets,
/// for callers that need it outside the sandbox (the docker backend's exec, E2B's home
/// directories). `InvalidArgument` for a user the files do not have, in init's words.
pub async fn account<S: Sandbox + ?Sized>(
    sandbox: &S,
    user: &str,
) -> Result<dsec_runtime::users::Account, ApiError> {
    use dsec_runtime::users::{self, GROUP, PASSWD};
    let invalid = |e: users::UserError| ApiError::invalid(e.to_string());
    users::UserSpec::parse(user).map_err(invalid)?;
    let passwd = small_file(sandbox, user, PASSWD).await?;
    let group = small_file(sandbox, user, GROUP).await?;
    users::resolve(user, passwd.as_deref(), group.as_deref()).map_err(invalid)
}

/// A passwd or group file of a sandbox, whole; `None` when it does not exist.
async fn small_file<S: Sandbox + ?Sized>(
    sandbox: &S,
    user: &str,
    path: &'static str,
) -> Result<Option<String>, ApiError> {
    use dsec_runtime::users::{UserError, MAX_FILE_BYTES};
    let unreadable = |reason: String| {
        ApiError::invalid(
            UserError::Unreadable {
                user: user.to_owned(),
                file: path,
                reason,
            }
            .to_string(),
        )
    };
    let mut read = match sandbox.read_file(path, MAX_FILE_BYTES).await {
        Ok(read) => read,
        Err(e) if e.kind == dsec_api::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(unreadable(e.message)),
    };
    let mut data = Vec::new();
    while let Some(chunk) = read.next().await {
        data.extend_from_slice(&chunk.map_err(|e| unreadable(e.message))?);
    }
    String::from_utf8(data)
        .map(Some)
        .map_err(|_| unreadable("it is not UTF-8".into()))
}

/// A file to write before a command.
#[derive(Clone, Debug)]
pub struct FileWrite {
    /// Absolute path inside the sandbox.
    pub path: String,
    /// Content.
    pub data: Vec<u8>,
    /// Permission bits.
    pub mode: u32,
}

/// One event of a running command.
#[derive(Debug)]
pub enum Output {
    /// A chunk of standard output.
    Stdout(Vec<u8>),
    /// A chunk of standard error.
    Stderr(Vec<u8>),
    /// The end; always last.
    Exit(ExitStatus),
}

pub use dsec_api::ExitStatus;

/// How a command that init (or a VM guest's agent) ran ended, as the API says it;
/// `oom_killed` is the backend's to know (a container's cgroup, a guest's own count).
pub(crate) fn exec_exit_status(
    exit: &dsec_runtime::proto::ExecExit,
    oom_killed: bool,
) -> ExitStatus {
    ExitStatus {
        exit_code: exit.exit_code,
        timed_out: exit.timed_out,
        truncated: exit.truncated,
        oom_killed,
        duration_ms: exit.duration_us as f64 / 1000.0,
    }
}

/// How a sandbox died on its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// A metric label: `oom`, `signal`, `exit` or `unknown`.
    pub cause: &'static str,
    /// What happened, for its users ("its init was killed by SIGKILL").
    pub detail: String,
}

/// The events of one running command. Dropping it before the end kills the command.
#[async_trait]
pub trait OutputStream: Send {
    /// The next event; `None` after [`Output::Exit`].
    async fn next(&mut self) -> Option<Result<Output, ApiError>>;
}

/// A process to spawn: one that outlives the request that started it (see
/// [`crate::edge::processes`]).
#[derive(Clone, Debug)]
pub struct ProcessSpec {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// `K=V` pairs: the image's, the sandbox's, then the process's.
    pub env: Vec<String>,
    /// Absolute working directory.
    pub cwd: String,
    /// Run on a new terminal of this size (stdin, stdout and stderr all the terminal).
    pub pty: Option<WinSize>,
    /// The user it runs as; `None`: root.
    pub run_as: Option<RunAs>,
}

pub use dsec_runtime::proto::WinSize;

/// A spawned process, as its backend started it.
pub struct Spawned {
    /// Its pid inside the sandbox.
    pub pid: i32,
    /// Its output and its end.
    pub output: Box<dyn ProcessStream>,
    /// What steers it.
    pub control: Box<dyn ProcessControl>,
}

/// One event of a spawned process.
#[derive(Debug)]
pub enum ProcessOutput {
    /// A chunk of standard output (or of its terminal).
    Stdout(Vec<u8>),
    /// A chunk of standard error.
    Stderr(Vec<u8>),
    /// The end; always last.
    Exit(ProcessExit),
}

/// How a spawned process ended.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct ProcessExit {
    /// Exit status, or `128 + signal`; `null` when it was never seen to end (`error`).
    pub exit_code: Option<i32>,
    /// The signal that killed it, if one did.
    pub signal: Option<i32>,
    /// The kernel's OOM killer struck (VM guests report it).
    pub oom_killed: bool,
    /// Wall time from start to exit.
    pub duration_ms: f64,
    /// Why its end is unknown: the sandbox stopped or failed under it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The events of a spawned process. Unlike [`OutputStream`], dropping it does not kill
/// the process: the edge's process table reads it to the end.
#[async_trait]
pub trait ProcessStream: Send {
    /// The next event; `None` after [`ProcessOutput::Exit`].
    async fn next(&mut self) -> Option<Result<ProcessOutput, ApiError>>;
}

/// Steers a spawned process. Calls for one that ended are ignored.
#[async_trait]
pub trait ProcessControl: Send + Sync {
    /// Appends `data` to its standard input (its terminal's input).
    async fn send_stdin(&self, data: &[u8]) -> Result<(), ApiError>;
    /// Ends its standard input once what was sent is written (on a terminal: types
    /// end-of-file).
    async fn close_stdin(&self) -> Result<(), ApiError>;
    /// Sends signal number `signal` to its main process.
    async fn signal(&self, signal: i32) -> Result<(), ApiError>;
    /// Resizes its terminal.
    async fn resize(&self, size: WinSize) -> Result<(), ApiError>;
    /// Kills it and everything it started.
    async fn kill(&self) -> Result<(), ApiError>;
}

/// A process spawned through a sandbox's init (a container) or a VM guest's agent: the
/// same protocol, so one implementation.
struct ServedProcess {
    handle: ExecHandle,
}

#[async_trait]
impl ProcessStream for ServedProcess {
    async fn next(&mut self) -> Option<Result<ProcessOutput, ApiError>> {
        Some(match self.handle.next().await? {
            Ok(ExecEvent::Stdout(data)) => Ok(ProcessOutput::Stdout(data)),
            Ok(ExecEvent::Stderr(data)) => Ok(ProcessOutput::Stderr(data)),
            Ok(ExecEvent::Exit(exit)) => Ok(ProcessOutput::Exit(ProcessExit {
                exit_code: exit.exit_code,
                signal: exit.signal,
                oom_killed: exit.oom_killed,
                duration_ms: exit.duration_us as f64 / 1000.0,
                error: None,
            })),
            Ok(_) => Err(not_plain()),
            Err(e) => Err(e.into()),
        })
    }
}

#[async_trait]
impl ProcessControl for ExecControl {
    async fn send_stdin(&self, data: &[u8]) -> Result<(), ApiError> {
        Ok(ExecControl::send_stdin(self, data).await?)
    }
    async fn close_stdin(&self) -> Result<(), ApiError> {
        Ok(ExecControl::close_stdin(self).await?)
    }
    async fn signal(&self, signal: i32) -> Result<(), ApiError> {
        Ok(ExecControl::signal(self, signal).await?)
    }
    async fn resize(&self, size: WinSize) -> Result<(), ApiError> {
        Ok(ExecControl::resize(self, size).await?)
    }
    async fn kill(&self) -> Result<(), ApiError> {
        Ok(ExecControl::kill(self).await?)
    }
}

/// Spawns a process through `channel` (a container's init, a VM guest's agent) and
/// waits for its pid.
pub(crate) async fn spawn_served(
    channel: &Channel,
    spec: ProcessSpec,
) -> Result<Spawned, ApiError> {
    let exec = ExecSpec {
        argv: spec.argv,
        env: spec.env,
        cwd: spec.cwd,
        timeout_ms: None,
        max_output_bytes: u64::MAX,
        interactive: true,
        pty: spec.pty,
        run_as: spec.run_as,
        ..ExecSpec::default()
    };
    let mut handle = channel.exec(&exec, &[], &[]).await?;
    let pid = match handle.next().await {
        Some(Ok(ExecEvent::Started(pid))) => pid,
        Some(Err(e)) => return Err(e.into()),
        _ => {
            return Err(ApiError::internal(
                "the sandbox did not report the spawned process's pid",
            ))
        }
    };
    Ok(Spawned {
        pid,
        control: Box::new(handle.control()),
        output: Box::new(ServedProcess { handle }),
    })
}

/// A running sandbox of any backend.
#[async_trait]
pub trait Sandbox: Send + Sync {
    /// Starts a command.
    async fn exec(&self, cmd: CommandSpec) -> Result<Box<dyn OutputStream>, ApiError>;
    /// Opens a regular file for reading; refuses one larger than `max_bytes`.
    async fn read_file(&self, path: &str, max_bytes: u64) -> Result<Box<dyn FileRead>, ApiError>;
    /// Writes a regular file (created with `mode`, or truncated) from `data`, creating
    /// parent directories.
    async fn write_file(&self, path: &str, mode: u32, data: Upload) -> Result<(), ApiError>;
    /// Lists a directory `depth` levels deep (1: its own entries).
    async fn list_files(&self, path: &str, depth: u32) -> Result<Vec<FileInfo>, ApiError>;
    /// The status of a path, a symbolic link in its last component not followed.
    async fn stat(&self, path: &str) -> Result<FileInfo, ApiError>;
    /// Makes a directory; whether it was made (false: it existed and `exist_ok`).
    async fn make_dir(&self, req: &MakeDir) -> Result<bool, ApiError>;
    /// Renames a path within the sandbox.
    async fn move_path(&self, req: &MovePath) -> Result<(), ApiError>;
    /// Removes a file, a link or a directory.
    async fn remove_path(&self, req: &RemovePath) -> Result<(), ApiError>;
    /// Watches a directory (with `recursive`, what is below too); returns once armed.
    async fn watch(&self, path: &str, recursive: bool) -> Result<Box<dyn FileWatch>, ApiError>;
    /// Starts a process that outlives the request.
    async fn spawn(&self, spec: ProcessSpec) -> Result<Spawned, ApiError> {
        let _ = spec;
        Err(ApiError::unavailable(
            "this backend cannot spawn long-lived processes",
        ))
    }
    /// Freezes every process of the sandbox.
    async fn pause(&self) -> Result<(), ApiError> {
        Err(ApiError::unavailable("this backend cannot pause sandboxes"))
    }
    /// Makes a paused sandbox outlive this server where the backend can (a VM guest saved
    /// to disk), keeping `edge` with it: the edge's record of the sandbox, which a
    /// restarted server's edge serves it again from ([`Backend::adopt`]). Until it resumes
    /// or stops, a server shutdown leaves it where it is. `false`: it cannot be kept, and
    /// goes with the server as every other sandbox does.
    async fn keep(&self, edge: &serde_json::Value) -> Result<bool, ApiError> {
        let _ = edge;
        Ok(false)
    }
    /// Thaws a paused sandbox.
    async fn resume(&self) -> Result<(), ApiError> {
        Err(ApiError::unavailable(
            "this backend cannot resume sandboxes",
        ))
    }
    /// Stores the sandbox's filesystem as a new image `name` of `project` (`None`: the
    /// admin's; see [`dsec_image::owned_name`]). The edge freezes the sandbox around the
    /// call, so the picture is consistent.
    async fn snapshot(&self, name: &str, project: Option<&str>) -> Result<ImageInfo, ApiError> {
        let _ = (name, project);
        Err(ApiError::unavailable(
            "this backend cannot snapshot sandboxes",
        ))
    }
    /// Replaces the egress policy of the running sandbox.
    async fn set_network(&self, policy: dsec_net::Policy) -> Result<(), ApiError> {
        let _ = policy;
        Err(ApiError::unavailable(
            "this backend cannot change a sandbox's network",
        ))
    }
    /// Connection attempts its network policy refused lately, oldest first.
    async fn network_refused(&self) -> Vec<dsec_net::Refused> {
        Vec::new()
    }
    /// Resource usage now.
    fn usage(&self) -> Usage;
    /// Its CPU time so far, read more cheaply than [`usage`](Self::usage), where the
    /// backend can tell: a sandbox whose CPU time has not moved since the usage sampler's
    /// previous round ran nothing, so nothing it samples can have changed, and it is not
    /// read again (most sandboxes of a dense host sit idle).
    fn cpu_ns(&self) -> Option<u64> {
        None
    }
    /// The image's own files directly in `dirs` (absolute, e.g. `/usr/bin`) that the
    /// sandbox overwrote or removed, where the backend can tell from its writable layer
    /// (the Watcher's `binary-overwrite`); files it added are not listed. Empty elsewhere.
    fn replaced_image_files(&self, _dirs: &[&str]) -> Vec<String> {
        Vec::new()
    }
    /// The hardware accelerator a VM sandbox runs on (`kvm`, `tcg`); `None` elsewhere.
    fn accelerator(&self) -> Option<&'static str> {
        None
    }
    /// False once the sandbox died on its own.
    fn is_alive(&self) -> bool;
    /// How it died, asked once [`is_alive`](Self::is_alive) is false and before
    /// [`stop`](Self::stop).
    async fn failure(&self) -> Failure {
        Failure {
            cause: "unknown",
            detail: "it exited on its own".to_owned(),
        }
    }
    /// Kills it and removes everything it made; idempotent.
    async fn stop(&self);
}

/// A directory entry as the API reports it; containers and VM guests list alike.
pub(crate) fn file_info(e: Entry) -> FileInfo {
    FileInfo {
        name: e.name,
        path: e.path,
        size: e.size,
        is_dir: e.is_dir,
        mode: e.mode,
        kind: match e.kind {
            EntryKind::File => FileKind::File,
            EntryKind::Dir => FileKind::Dir,
            EntryKind::Symlink => FileKind::Symlink,
            EntryKind::Other => FileKind::Other,
        },
        mtime: e.mtime,
        uid: Some(e.uid),
        gid: Some(e.gid),
        link: e.link,
        metadata: e.metadata,
    }
}

/// What a plain command's stream answers if its sandbox reports steps of a stepped call
/// (only fncall's stepped calls ask for them).
pub(crate) fn not_plain() -> ApiError {
    ApiError::internal("the sandbox reported steps or fetched files for a plain command")
}

/// A way of making sandboxes.
///
/// A backend holds what its sandboxes need of dsec's image store (mounted layers, layer
/// blobs) for as long as each sandbox lives, so image garbage collection never removes
/// them from under it.
#[async_trait]
pub trait Backend: Send + Sync {
    /// Creates and starts a sandbox.
    async fn create(&self, req: SandboxRequest) -> Result<Created, ApiError>;
    /// Deletes what the backend keeps of images that no longer exist (`live`: the ids of
    /// those that do), such as VM disks and boot templates; returns the bytes freed.
    async fn prune_images(&self, live: &HashSet<String>) -> u64 {
        let _ = live;
        0
    }
    /// Whether its sandboxes can have a network (`network=True`, allow-lists).
    fn has_networking(&self) -> bool {
        false
    }
    /// Whether the edge admits each sandbox against its budget: `false` for a backend
    /// that admits the processes it makes itself (fncall's pool, worker by worker).
    fn admitted_per_sandbox(&self) -> bool {
        true
    }
    /// Tasks on this host a sandbox with a `pids` limit may take (its processes; a VM's
    /// are inside the guest, its QEMU's threads on the host).
    fn host_tasks(&self, pids: u64) -> u64 {
        pids
    }
    /// Packets the egress policies of its sandboxes refused so far (for `/metrics`).
    async fn network_refused_total(&self) -> u64 {
        0
    }
    /// The paused sandboxes an earlier run of the server kept ([`Sandbox::keep`]), each
    /// ready to resume here, with the edge's record of it. Called once, before serving.
    async fn adopt(&self) -> Vec<Adopted> {
        Vec::new()
    }
}

/// A paused sandbox kept across a restart of the server, adopted by this one.
pub struct Adopted {
    /// The sandbox, paused; its next request resumes it.
    pub sandbox: Box<dyn Sandbox>,
    /// What the edge kept of it ([`Sandbox::keep`]).
    pub edge: serde_json::Value,
}

/// The backends this server runs, by kind.
#[derive(Default)]
pub struct Backends {
    registered: Vec<(BackendKind, Arc<dyn Backend>)>,
}

impl Backends {
    /// Adds the backend of `kind`.
    pub fn register(mut self, kind: BackendKind, backend: Arc<dyn Backend>) -> Backends {
        self.registered.push((kind, backend));
        self
    }

    /// The names of the registered backends.
    pub fn names(&self) -> Vec<String> {
        self.registered
            .iter()
            .map(|(k, _)| k.name().to_owned())
            .collect()
    }

    /// Every registered backend.
    pub fn all(&self) -> impl Iterator<Item = &Arc<dyn Backend>> {
        self.registered.iter().map(|(_, b)| b)
    }

    /// Lets every backend drop what it keeps of deleted images; returns the bytes freed.
    pub async fn prune_images(&self, live: &HashSet<String>) -> u64 {
        let mut freed = 0;
        for backend in self.all() {
            freed += backend.prune_images(live).await;
        }
        freed
    }

    /// Refused packets of every backend's sandboxes (for `/metrics`).
    pub async fn network_refused_total(&self) -> u64 {
        let mut total = 0;
        for backend in self.all() {
            total += backend.network_refused_total().await;
        }
        total
    }

    /// The backend called `name`: `InvalidArgument` for names dsec does not know,
    /// `Unavailable` for a known one this server does not run.
    pub fn get(&self, name: &str) -> Result<(BackendKind, Arc<dyn Backend>), ApiError> {
        let kind = BackendKind::parse(name).map_err(ApiError::invalid)?;
        self.registered
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(k, b)| (*k, Arc::clone(b)))
            .ok_or_else(|| {
                ApiError::unavailable(format!("backend {name:?} is not run by this server"))
            })
    }
}

/// The API's view of a stored image.
pub(crate) fn image_info(images: &ImageStore, image: Image) -> ImageInfo {
    ImageInfo {
        disk_bytes: images.disk_bytes(&image),
        fork_of: image.fork.map(|f| f.parent),
        project: image.project,
        disk: image.disk.map(|d| dsec_api::DiskImageInfo {
            format: d.format,
            virtual_size: d.virtual_size,
        }),
        name: image.name,
        id: image.id,
        size: image.size,
        layers: image.layers,
        created_at: image.created_at,
    }
}

/// Writes what a sandbox just given a network needs, through its init or guest agent:
/// `/etc/resolv.conf` naming dsec's resolver and, when asked, the host's CA bundle.
pub(crate) async fn write_network_files(
    channel: &dsec_runtime::channel::Channel,
    attachment: &dsec_net::Attachment,
    ca_bundle: bool,
) -> Result<(), ApiError> {
    let resolv = attachment.resolv_conf().into_bytes();
    files::write_served(channel, dsec_net::RESOLV_CONF, 0o644, Upload::whole(resolv)).await?;
    if ca_bundle {
        match tokio::fs::read(dsec_net::CA_BUNDLE).await {
            Ok(pem) => {
                files::write_served(channel, dsec_net::CA_BUNDLE, 0o644, Upload::whole(pem)).await?
            }
            Err(e) => tracing::warn!(error = %e, "host CA bundle unreadable; not copied"),
        }
    }
    Ok(())
}
