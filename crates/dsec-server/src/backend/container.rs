//! `backend="container"`: dsec's native runtime.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use dsec_api::{FileInfo, ImageInfo, Usage};
use dsec_image::{Image, ImageStore};
use dsec_runtime::cgroup::CgroupLimits;
use dsec_runtime::container::{Container, ContainerRuntime, CreateOptions, ExecEvent, ExecHandle};
use dsec_runtime::proto::ExecSpec;

use super::{
    Backend, CommandSpec, Created, ExitStatus, ImageDefaults, Output, OutputStream, Sandbox,
    SandboxRequest,
};
use crate::error::ApiError;

const MIB: u64 = 1 << 20;

/// Creates native containers.
pub struct ContainerBackend {
    runtime: Arc<ContainerRuntime>,
    images: ImageStore,
}

impl ContainerBackend {
    /// A backend over `runtime`, taking image layers from `images`.
    pub fn new(runtime: Arc<ContainerRuntime>, images: ImageStore) -> Self {
        ContainerBackend { runtime, images }
    }
}

#[async_trait]
impl Backend for ContainerBackend {
    async fn create(&self, req: SandboxRequest) -> Result<Created, ApiError> {
        let image = self.images.get(&req.image)?;
        let opts = create_options(&req, self.images.layer_dirs(&image));
        let container = self
            .runtime
            .create(opts)
            .await
            .map_err(|e| ApiError::internal(format!("creating the container: {e}")))?;
        Ok(Created {
            sandbox: Box::new(ContainerSandbox {
                container: Arc::new(container),
                image: image.clone(),
                images: self.images.clone(),
            }),
            image: ImageDefaults {
                env: image.config.env,
                workdir: image.config.workdir,
                layers: image.layers,
            },
        })
    }
}

struct ContainerSandbox {
    container: Arc<Container>,
    /// The image it was created from: the base of its snapshots.
    image: Image,
    images: ImageStore,
}

/// The output of a command in a native container.
pub(crate) struct ContainerOutput {
    handle: ExecHandle,
    container: Arc<Container>,
}

#[async_trait]
impl OutputStream for ContainerOutput {
    async fn next(&mut self) -> Option<Result<Output, ApiError>> {
        let event = self.handle.next().await?;
        Some(match event {
            Ok(ExecEvent::Stdout(data)) => Ok(Output::Stdout(data)),
            Ok(ExecEvent::Stderr(data)) => Ok(Output::Stderr(data)),
            Ok(ExecEvent::Exit(exit)) => {
                Ok(Output::Exit(ExitStatus {
                    exit_code: exit.exit_code,
                    timed_out: exit.timed_out,
                    truncated: exit.truncated,
                    // The killed process may be a child (the shell then exits 137 itself):
                    // ask the cgroup, not the exit status.
                    oom_killed: self.container.take_oom_kill(),
                    duration_ms: exit.duration_us as f64 / 1000.0,
                }))
            }
            Err(e) => Err(e.into()),
        })
    }
}

/// The runtime's options for a sandbox request.
pub(crate) fn create_options(req: &SandboxRequest, layers: Vec<PathBuf>) -> CreateOptions {
    CreateOptions {
        id: req.id.clone(),
        layers,
        limits: CgroupLimits {
            cpus: req.cpus,
            memory_bytes: req.memory_mb * MIB,
            pids: req.pids,
        },
        disk_bytes: req.disk_mb * MIB,
    }
}

/// Writes a command's files into `container`, then starts the command.
pub(crate) async fn run(
    container: &Arc<Container>,
    cmd: CommandSpec,
) -> Result<ContainerOutput, ApiError> {
    if !cmd.files.is_empty() {
        let (c, files) = (Arc::clone(container), cmd.files);
        tokio::task::spawn_blocking(move || {
            files
                .iter()
                .try_for_each(|f| c.root().write(&f.path, &f.data, f.mode))
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
    }
    let spec = ExecSpec {
        argv: cmd.argv,
        env: cmd.env,
        cwd: cmd.cwd,
        timeout_ms: Some(cmd.timeout_ms),
        max_output_bytes: cmd.max_output_bytes,
    };
    let handle = container.exec(&spec, &cmd.stdin).await?;
    Ok(ContainerOutput {
        handle,
        container: Arc::clone(container),
    })
}

impl ContainerSandbox {
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Container) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let c = Arc::clone(&self.container);
        tokio::task::spawn_blocking(move || f(&c))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
    }
}

#[async_trait]
impl Sandbox for ContainerSandbox {
    async fn exec(&self, cmd: CommandSpec) -> Result<Box<dyn OutputStream>, ApiError> {
        Ok(Box::new(run(&self.container, cmd).await?))
    }

    async fn read_file(&self, path: &str) -> Result<File, ApiError> {
        let path = path.to_owned();
        self.blocking(move |c| Ok(c.root().open_read(&path)?)).await
    }

    async fn write_file(&self, path: &str, data: Vec<u8>, mode: u32) -> Result<(), ApiError> {
        let path = path.to_owned();
        self.blocking(move |c| Ok(c.root().write(&path, &data, mode)?))
            .await
    }

    async fn list_files(&self, path: &str) -> Result<Vec<FileInfo>, ApiError> {
        let path = path.to_owned();
        self.blocking(move |c| {
            Ok(c.root()
                .list(&path)?
                .into_iter()
                .map(|e| FileInfo {
                    name: e.name,
                    size: e.size,
                    is_dir: e.is_dir,
                    mode: e.mode,
                })
                .collect())
        })
        .await
    }

    async fn pause(&self) -> Result<(), ApiError> {
        self.blocking(|c| {
            c.cgroup()
                .set_frozen(true)
                .map_err(|e| ApiError::internal(format!("pausing: {e}")))
        })
        .await
    }

    async fn resume(&self) -> Result<(), ApiError> {
        self.blocking(|c| {
            c.cgroup()
                .set_frozen(false)
                .map_err(|e| ApiError::internal(format!("resuming: {e}")))
        })
        .await
    }

    async fn snapshot(&self, name: &str) -> Result<ImageInfo, ApiError> {
        let image = self
            .images
            .commit_upper(&self.image, self.container.upper_dir(), name)
            .await?;
        Ok(crate::edge::image_info(image))
    }

    fn usage(&self) -> Usage {
        let u = self.container.cgroup().usage();
        Usage {
            memory_bytes: u.memory_bytes,
            pids: u.pids,
            cpu_ms: u.cpu_ns as f64 / 1e6,
        }
    }

    fn is_alive(&self) -> bool {
        self.container.is_alive()
    }

    async fn stop(&self) {
        self.container.stop().await;
    }
}
