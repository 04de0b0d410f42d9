//! Isolation backends behind one trait.
//!
//! The edge validates a request, fills in defaults and resolves the image; a [`Backend`]
//! turns that into a running [`Sandbox`]. Everything the API offers on a sandbox (exec,
//! streamed exec, files, usage, stop) is a method here, so a new backend is one module
//! implementing these two traits and one arm in [`Backends::get`].

pub mod container;
pub mod docker;
pub mod fncall;
pub mod vm;

use std::fs::File;
use std::sync::Arc;

use async_trait::async_trait;
use dsec_api::{FileInfo, ImageInfo, Usage};
use dsec_runtime::files::Entry;

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
    /// Layer digests in dsec's store that must outlive the sandbox (empty for images the
    /// store does not hold).
    pub layers: Vec<String>,
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

/// How a command ended.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExitStatus {
    /// Exit code, `128 + signal`, or `None` after a timeout.
    pub exit_code: Option<i32>,
    /// The timeout fired.
    pub timed_out: bool,
    /// Output was discarded beyond the bound.
    pub truncated: bool,
    /// The memory limit killed a process of this command.
    pub oom_killed: bool,
    /// Wall time of the command.
    pub duration_ms: f64,
}

/// The events of one running command. Dropping it before the end kills the command.
#[async_trait]
pub trait OutputStream: Send {
    /// The next event; `None` after [`Output::Exit`].
    async fn next(&mut self) -> Option<Result<Output, ApiError>>;
}

/// A running sandbox of any backend.
#[async_trait]
pub trait Sandbox: Send + Sync {
    /// Starts a command.
    async fn exec(&self, cmd: CommandSpec) -> Result<Box<dyn OutputStream>, ApiError>;
    /// Opens a file for reading.
    async fn read_file(&self, path: &str) -> Result<File, ApiError>;
    /// Writes a file, creating parent directories.
    async fn write_file(&self, path: &str, data: Vec<u8>, mode: u32) -> Result<(), ApiError>;
    /// Lists a directory.
    async fn list_files(&self, path: &str) -> Result<Vec<FileInfo>, ApiError>;
    /// Freezes every process of the sandbox.
    async fn pause(&self) -> Result<(), ApiError> {
        Err(ApiError::unavailable("this backend cannot pause sandboxes"))
    }
    /// Thaws a paused sandbox.
    async fn resume(&self) -> Result<(), ApiError> {
        Err(ApiError::unavailable(
            "this backend cannot resume sandboxes",
        ))
    }
    /// Stores the sandbox's filesystem as a new image `name`. The edge freezes the
    /// sandbox around the call, so the picture is consistent.
    async fn snapshot(&self, name: &str) -> Result<ImageInfo, ApiError> {
        let _ = name;
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
    /// The hardware accelerator a VM sandbox runs on (`kvm`, `tcg`); `None` elsewhere.
    fn accelerator(&self) -> Option<&'static str> {
        None
    }
    /// False once the sandbox died on its own.
    fn is_alive(&self) -> bool;
    /// Kills it and removes everything it made; idempotent.
    async fn stop(&self);
}

/// A directory entry as the API reports it; containers and VM guests list alike.
pub(crate) fn file_info(e: Entry) -> FileInfo {
    FileInfo {
        name: e.name,
        size: e.size,
        is_dir: e.is_dir,
        mode: e.mode,
    }
}

/// A way of making sandboxes.
#[async_trait]
pub trait Backend: Send + Sync {
    /// Creates and starts a sandbox.
    async fn create(&self, req: SandboxRequest) -> Result<Created, ApiError>;
}

/// The backends this server can run, by name.
pub struct Backends {
    /// The native container runtime.
    pub container: Arc<container::ContainerBackend>,
    /// Stateless calls on pools of warm native containers.
    pub fncall: Arc<fncall::FnCallBackend>,
    /// Containers of a Docker Engine.
    pub docker: Arc<docker::DockerBackend>,
    /// QEMU microvm guests.
    pub microvm: Arc<vm::VmBackend>,
    /// QEMU q35 guests.
    pub vm: Arc<vm::VmBackend>,
}

impl Backends {
    /// The backend called `name`: `InvalidArgument` for names dsec does not know,
    /// `Unavailable` (with the reason) for known ones this server cannot run.
    pub fn get(&self, name: &str) -> Result<Arc<dyn Backend>, ApiError> {
        match name {
            "container" => Ok(self.container.clone()),
            "fncall" => Ok(self.fncall.clone()),
            "docker" => Ok(self.docker.clone()),
            "microvm" => Ok(self.microvm.clone()),
            "vm" => Ok(self.vm.clone()),
            _ => Err(ApiError::invalid(format!(
                "unknown backend {name:?}; valid backends are: {}",
                dsec_api::BACKENDS.join(", ")
            ))),
        }
    }
}
