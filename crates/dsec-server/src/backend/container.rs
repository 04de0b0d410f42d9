//! `backend="container"`: dsec's native runtime.

use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use dsec_api::{FileInfo, ImageInfo, Usage};
use dsec_image::{Image, ImageStore, MountedImage};
use dsec_net::{Attachment, NetError, Networking, Policy};
use dsec_runtime::cgroup::CgroupLimits;
use dsec_runtime::container::{
    Container, ContainerRuntime, CreateOptions, ExecEvent, ExecHandle, InitExit, RuntimeError,
};
use dsec_runtime::proto::{ExecExit, ExecFile, ExecSpec};

use super::files::{list_served, read_served, watch_served, write_served, FileWatch};
use super::{file_info, MakeDir, MovePath, RemovePath};
use super::{
    Backend, CommandSpec, Created, ExitStatus, Failure, FileRead, FileWrite, ImageDefaults, Output,
    OutputStream, ProcessSpec, Sandbox, SandboxRequest, Spawned, Upload,
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
/// of the sandbox can use them. The files are written by init, with the files API's
/// checks: whatever the agent planted at those paths (a FIFO, a link to a device) is
/// refused, never opened.
async fn plug(
    container: &Arc<Container>,
    attachment: &Attachment,
    ca_bundle: bool,
) -> Result<(), ApiError> {
    let netns = container.open_netns()?;
    attachment.plug(netns).await?;
    super::write_network_files(container.channel(), attachment, ca_bundle).await
}

#[async_trait]
impl Backend for ContainerBackend {
    fn has_networking(&self) -> bool {
        true
    }

    async fn network_refused_total(&self) -> u64 {
        self.net.refused_total().await
    }

    async fn create(&self, req: SandboxRequest) -> Result<Created, ApiError> {
        let image = self.images.resolve(&req.image).await?;
        let layers = self.images.mount(&image).await?;
        let opts = create_options(&req, layers.dirs.clone());
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
                    Err(e) => Some(creating_failed(&req.image, &e)),
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
                layers,
                image: image.clone(),
                images: self.images.clone(),
                net: Arc::clone(&self.net),
                attachment: tokio::sync::Mutex::new(attachment),
                ca_bundle: req.ca_bundle,
            }),
            image: ImageDefaults {
                env: image.config.env,
                workdir: image.config.workdir,
            },
        })
    }
}

struct ContainerSandbox {
    container: Arc<Container>,
    /// Its image's layers, held (and mounted) for as long as it exists.
    layers: MountedImage,
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
            Ok(ExecEvent::Exit(exit)) => Ok(Output::Exit(exit_status(&exit, &self.container))),
            Ok(ExecEvent::StepExit(_) | ExecEvent::Fetched { .. } | ExecEvent::Started(_)) => {
                Err(super::not_plain())
            }
            Err(e) => Err(e.into()),
        })
    }
}

/// How a command of `container` ended.
pub(crate) fn exit_status(exit: &ExecExit, container: &Container) -> ExitStatus {
    // The killed process may be a child (the shell then exits 137 itself): ask the
    // cgroup, not the exit status.
    super::exec_exit_status(exit, container.take_oom_kill())
}

/// A failed create of a container from `image`: the caller's error when the image cannot
/// make a root, the host's otherwise.
pub(crate) fn creating_failed(image: &str, e: &RuntimeError) -> ApiError {
    match e.is_unusable_image() {
        true => ApiError::invalid(format!("image {image:?} cannot be a sandbox's root: {e}")),
        false => ApiError::internal(format!("creating the container: {e}")),
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
    let (carried, contents) = if container.is_worker() {
        carry(cmd.files)
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
        run_as: cmd.run_as,
        files: carried,
        ..ExecSpec::default()
    };
    let data: Vec<&[u8]> = contents.iter().map(Vec::as_slice).collect();
    let handle = container.exec(&spec, &cmd.stdin, &data).await?;
    Ok(ContainerOutput {
        handle,
        container: Arc::clone(container),
    })
}

/// Files that travel in an exec frame, for init to write in the command's own root: their
/// headers and their contents, in order.
pub(crate) fn carry(files: Vec<FileWrite>) -> (Vec<ExecFile>, Vec<Vec<u8>>) {
    files
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
}

async fn write_files(container: &Arc<Container>, files: Vec<FileWrite>) -> Result<(), ApiError> {
    for f in files {
        write_served(container.channel(), &f.path, f.mode, Upload::whole(f.data)).await?;
    }
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

    async fn read_file(&self, path: &str, max_bytes: u64) -> Result<Box<dyn FileRead>, ApiError> {
        read_served(self.container.channel(), path, max_bytes).await
    }

    async fn spawn(&self, spec: ProcessSpec) -> Result<Spawned, ApiError> {
        super::spawn_served(self.container.channel(), spec).await
    }

    async fn write_file(&self, path: &str, mode: u32, data: Upload) -> Result<(), ApiError> {
        write_served(self.container.channel(), path, mode, data).await
    }

    async fn list_files(&self, path: &str, depth: u32) -> Result<Vec<FileInfo>, ApiError> {
        list_served(self.container.channel(), path, depth).await
    }

    async fn stat(&self, path: &str) -> Result<FileInfo, ApiError> {
        Ok(file_info(self.container.channel().stat(path).await?))
    }

    async fn make_dir(&self, req: &MakeDir) -> Result<bool, ApiError> {
        Ok(self.container.channel().make_dir(req).await?)
    }

    async fn move_path(&self, req: &MovePath) -> Result<(), ApiError> {
        Ok(self.container.channel().move_path(req).await?)
    }

    async fn remove_path(&self, req: &RemovePath) -> Result<(), ApiError> {
        Ok(self.container.channel().remove_path(req).await?)
    }

    async fn watch(&self, path: &str, recursive: bool) -> Result<Box<dyn FileWatch>, ApiError> {
        watch_served(self.container.channel(), path, recursive).await
    }

    async fn pause(&self) -> Result<(), ApiError> {
        self.set_frozen(true).await
    }

    async fn resume(&self) -> Result<(), ApiError> {
        self.set_frozen(false).await
    }

    async fn snapshot(&self, name: &str, project: Option<&str>) -> Result<ImageInfo, ApiError> {
        let upper = self.container.upper_dir()?;
        let image = self
            .images
            .commit_upper(&self.image, &upper.path(), name, project)
            .await?;
        Ok(super::image_info(&self.images, image))
    }

    fn usage(&self) -> Usage {
        let cgroup = self.container.cgroup();
        let u = cgroup.usage();
        // The writable layer is a tmpfs of its own: its used blocks are the disk used.
        let layer = self
            .container
            .upper_dir()
            .ok()
            .and_then(|upper| rustix::fs::statvfs(upper.path()).ok());
        let disk_bytes = layer
            .as_ref()
            .map(|st| st.f_blocks.saturating_sub(st.f_bfree) * st.f_frsize);
        let disk_inodes = layer
            .as_ref()
            .map(|st| st.f_files.saturating_sub(st.f_ffree));
        // Unknown for this sample while a network change holds the attachment.
        let traffic = self
            .attachment
            .try_lock()
            .ok()
            .and_then(|a| a.as_ref()?.traffic());
        Usage {
            memory_bytes: u.memory_bytes,
            pids: u.pids,
            cpu_ms: u.cpu_ns as f64 / 1e6,
            memory_peak_bytes: u.memory_peak_bytes,
            pids_limit_hits: u.pids_limit_hits,
            oom_kills: cgroup.oom_kills(),
            disk_bytes,
            disk_inodes,
            cpu_throttled_ms: u.cpu_throttled_ns as f64 / 1e6,
            network_rx_bytes: traffic.map(|t| t.rx_bytes),
            network_tx_bytes: traffic.map(|t| t.tx_bytes),
        }
    }

    fn cpu_ns(&self) -> Option<u64> {
        Some(self.container.cgroup().cpu_ns())
    }

    fn replaced_image_files(&self, dirs: &[&str]) -> Vec<String> {
        let Ok(upper) = self.container.upper_dir() else {
            return Vec::new();
        };
        let lowers = dsec_runtime::layers::open_layers(&self.layers.dirs);
        dsec_runtime::layers::replaced_image_files(upper.as_fd(), &lowers, dirs)
    }

    fn is_alive(&self) -> bool {
        self.container.is_alive()
    }

    async fn failure(&self) -> Failure {
        let c = Arc::clone(&self.container);
        let exit = tokio::task::spawn_blocking(move || c.exit_reason())
            .await
            .unwrap_or(InitExit::Unknown);
        Failure {
            cause: match exit {
                InitExit::OomKilled => "oom",
                InitExit::Signaled(_) => "signal",
                InitExit::Exited(_) => "exit",
                InitExit::Unknown => "unknown",
            },
            detail: format!("its init {exit}"),
        }
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
