//! `backend="container"`: dsec's native runtime.

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use dsec_api::{FileInfo, ImageInfo, Usage};
use dsec_image::{Image, ImageStore};
use dsec_net::{Attachment, NetError, Networking, Policy};
use dsec_runtime::cgroup::CgroupLimits;
use dsec_runtime::container::{Container, ContainerRuntime, CreateOptions, ExecEvent, ExecHandle};
use dsec_runtime::proto::{ExecFile, ExecSpec};

use super::{
    file_info, Backend, CommandSpec, Created, ExitStatus, FileWrite, ImageDefaults, Output,
    OutputStream, Sandbox, SandboxRequest,
};
use crate::error::ApiError;

const MIB: u64 = 1 << 20;

/// Creates native containers.
pub struct ContainerBackend {
    runtime: Arc<ContainerRuntime>,
    images: ImageStore,
    net: Arc<Networking>,
}

impl ContainerBackend {
    /// A backend over `runtime`, taking image layers from `images` and giving networks
    /// through `net`.
    pub fn new(runtime: Arc<ContainerRuntime>, images: ImageStore, net: Arc<Networking>) -> Self {
        ContainerBackend {
            runtime,
            images,
            net,
        }
    }

    /// Packets refused by sandbox network policies so far (for `/metrics`).
    pub async fn network_refused(&self) -> u64 {
        self.net.refused_total().await
    }
}

impl From<NetError> for ApiError {
    fn from(e: NetError) -> ApiError {
        match e {
            NetError::Unavailable(_) => ApiError::unavailable(e.to_string()),
            NetError::Rule(_) => ApiError::invalid(e.to_string()),
            _ => ApiError::internal(format!("sandbox network: {e}")),
        }
    }
}

/// Connects a new or running container to the network: veth, then `/etc/resolv.conf`
/// naming dsec's resolver and, when asked, the host's CA bundle, all before any command
/// of the sandbox can use them.
async fn plug(
    container: &Arc<Container>,
    attachment: &Attachment,
    ca_bundle: bool,
) -> Result<(), ApiError> {
    let netns = container.open_netns()?;
    attachment.plug(netns).await?;
    let c = Arc::clone(container);
    let resolv = attachment.resolv_conf();
    tokio::task::spawn_blocking(move || -> Result<(), ApiError> {
        c.root()
            .write(dsec_net::RESOLV_CONF, resolv.as_bytes(), 0o644)?;
        if ca_bundle {
            match std::fs::read(dsec_net::CA_BUNDLE) {
                Ok(pem) => c.root().write(dsec_net::CA_BUNDLE, &pem, 0o644)?,
                Err(e) => tracing::warn!(error = %e, "host CA bundle unreadable; not copied"),
            }
        }
        Ok(())
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
}

#[async_trait]
impl Backend for ContainerBackend {
    async fn create(&self, req: SandboxRequest) -> Result<Created, ApiError> {
        let image = self.images.get(&req.image)?;
        let opts = create_options(&req, self.images.layer_dirs(&image));
        // The address and the nftables rules are set up while the container is built.
        let reserve = async {
            match req.network.is_off() {
                true => Ok(None),
                false => self.net.reserve(&req.network).await.map(Some),
            }
        };
        let (container, attachment) = tokio::join!(self.runtime.create(opts), reserve);
        let (container, attachment) = match (container, attachment) {
            (Ok(c), Ok(a)) => (Arc::new(c), a),
            (c, a) => {
                let failed = match c {
                    Ok(c) => {
                        c.stop().await;
                        None
                    }
                    Err(e) => Some(ApiError::internal(format!("creating the container: {e}"))),
                };
                let net_failed = match a {
                    Ok(Some(a)) => {
                        a.release().await;
                        None
                    }
                    Ok(None) => None,
                    Err(e) => Some(ApiError::from(e)),
                };
                return Err(net_failed.or(failed).expect("one of the two failed"));
            }
        };
        if let Some(a) = &attachment {
            if let Err(e) = plug(&container, a, req.ca_bundle).await {
                container.stop().await;
                if let Some(a) = attachment {
                    a.release().await;
                }
                return Err(e);
            }
        }
        Ok(Created {
            sandbox: Box::new(ContainerSandbox {
                container,
                image: image.clone(),
                images: self.images.clone(),
                net: Arc::clone(&self.net),
                attachment: tokio::sync::Mutex::new(attachment),
                ca_bundle: req.ca_bundle,
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
    net: Arc<Networking>,
    /// Its place on the network; `None` while it has never had one.
    attachment: tokio::sync::Mutex<Option<Attachment>>,
    /// Whether a network given later brings the host's CA bundle.
    ca_bundle: bool,
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
        worker: false,
    }
}

/// Writes a command's files into `container`, then starts the command.
pub(crate) async fn run(
    container: &Arc<Container>,
    cmd: CommandSpec,
) -> Result<ContainerOutput, ApiError> {
    // A fncall worker's command builds a root of its own: its files travel with it and
    // init writes them there. A container's files go straight into its root.
    let (carried, contents): (Vec<ExecFile>, Vec<Vec<u8>>) = if container.is_worker() {
        cmd.files
            .into_iter()
            .map(|f| {
                let spec = ExecFile {
                    path: f.path,
                    mode: f.mode,
                    len: f.data.len() as u64,
                };
                (spec, f.data)
            })
            .unzip()
    } else {
        if !cmd.files.is_empty() {
            write_files(container, cmd.files).await?;
        }
        (Vec::new(), Vec::new())
    };
    let spec = ExecSpec {
        argv: cmd.argv,
        env: cmd.env,
        cwd: cmd.cwd,
        timeout_ms: Some(cmd.timeout_ms),
        max_output_bytes: cmd.max_output_bytes,
        files: carried,
    };
    let data: Vec<&[u8]> = contents.iter().map(Vec::as_slice).collect();
    let handle = container.exec(&spec, &cmd.stdin, &data).await?;
    Ok(ContainerOutput {
        handle,
        container: Arc::clone(container),
    })
}

async fn write_files(container: &Arc<Container>, files: Vec<FileWrite>) -> Result<(), ApiError> {
    let c = Arc::clone(container);
    tokio::task::spawn_blocking(move || {
        files
            .iter()
            .try_for_each(|f| c.root().write(&f.path, &f.data, f.mode))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    Ok(())
}

impl ContainerSandbox {
    async fn set_frozen(&self, frozen: bool) -> Result<(), ApiError> {
        self.blocking(move |c| {
            c.cgroup().set_frozen(frozen).map_err(|e| {
                let what = if frozen { "pausing" } else { "resuming" };
                ApiError::internal(format!("{what}: {e}"))
            })
        })
        .await
    }

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
        self.blocking(move |c| Ok(c.root().list(&path)?.into_iter().map(file_info).collect()))
            .await
    }

    async fn pause(&self) -> Result<(), ApiError> {
        self.set_frozen(true).await
    }

    async fn resume(&self) -> Result<(), ApiError> {
        self.set_frozen(false).await
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

    async fn set_network(&self, policy: Policy) -> Result<(), ApiError> {
        let mut attachment = self.attachment.lock().await;
        match &*attachment {
            Some(a) => Ok(a.set_policy(&policy).await?),
            None if policy.is_off() => Ok(()),
            None => {
                let a = self.net.reserve(&policy).await?;
                if let Err(e) = plug(&self.container, &a, self.ca_bundle).await {
                    a.release().await;
                    return Err(e);
                }
                *attachment = Some(a);
                Ok(())
            }
        }
    }

    async fn network_refused(&self) -> Vec<dsec_net::Refused> {
        self.attachment
            .lock()
            .await
            .as_ref()
            .map(Attachment::refused)
            .unwrap_or_default()
    }

    async fn stop(&self) {
        self.container.stop().await;
        if let Some(a) = self.attachment.lock().await.take() {
            a.release().await;
        }
    }
}
