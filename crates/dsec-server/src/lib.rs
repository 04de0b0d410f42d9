//! `dsec serve`: the embedded single-node server — apiserver and edge in one process.
//!
//! Start-up happens in two phases because of threads: [`HostSetup::prepare`] runs while the
//! process is still single-threaded (it locks the state directory, settles the cgroup
//! layout — on v2 that moves the server into a leaf cgroup — and starts the zygote), and
//! [`run`] then starts the async world: cleanup of what an earlier run left, the reaper,
//! and the HTTP API.
#![warn(missing_docs)]

pub mod api;
pub mod backend;
pub mod edge;
pub mod error;
mod trajectory;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsec_image::ImageStore;
use dsec_runtime::cgroup::CgroupLayout;
use dsec_runtime::container::ContainerRuntime;
use dsec_runtime::zygote::Zygote;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

use crate::backend::container::ContainerBackend;
use crate::backend::docker::DockerBackend;
use crate::backend::fncall::{FnCallBackend, PoolConfig};
use crate::backend::vm::{VmBackend, VmConfig, VmHost};
use crate::backend::Backends;
use crate::edge::{Edge, EdgeConfig};

/// Everything `dsec serve` is configured with.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Root of images, sandboxes and logs.
    pub state_dir: PathBuf,
    /// Bearer token clients must send; required off loopback.
    pub token: Option<String>,
    /// Largest request body.
    pub max_upload_bytes: usize,
    /// Defaults and names for the edge.
    pub edge: EdgeConfig,
    /// Whether each commit of the trajectory log fsyncs (see `dsec_trajectory`).
    pub trajectory_sync: dsec_trajectory::SyncMode,
    /// Sizing of the fncall worker pools.
    pub fncall: PoolConfig,
    /// Addresses of sandboxes with a network: (network, prefix length).
    pub net_pool: (std::net::Ipv4Addr, u8),
    /// The `microvm` and `vm` backends.
    pub vm: VmConfig,
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Listening off loopback without a token would expose root-level sandboxes.
    #[error("refusing to listen on {0} without --token-file: anyone who can reach it could run commands as root in sandboxes; pass --token-file or listen on 127.0.0.1")]
    InsecureListen(SocketAddr),
    /// The state directory is unusable.
    #[error("state directory {path}: {source}")]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Another server holds the state directory.
    #[error("another dsec server is using state directory {0}")]
    StateDirLocked(PathBuf),
    /// Cgroup set-up failed.
    #[error(transparent)]
    Cgroup(#[from] dsec_runtime::cgroup::CgroupError),
    /// The zygote did not start.
    #[error(transparent)]
    Zygote(#[from] dsec_runtime::zygote::ZygoteError),
    /// The image store did not open.
    #[error(transparent)]
    Images(#[from] dsec_image::ImageError),
    /// The trajectory log did not open.
    #[error(transparent)]
    Trajectory(#[from] dsec_trajectory::LogError),
    /// Binding or serving failed.
    #[error("listening on {addr}: {source}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The metrics recorder could not be installed.
    #[error("metrics: {0}")]
    Metrics(String),
}

/// What [`HostSetup::prepare`] made, handed to [`run`].
pub struct HostSetup {
    _lock: nix::fcntl::Flock<std::fs::File>,
    layout: CgroupLayout,
    zygote: Zygote,
    exe: PathBuf,
}

fn state_err(path: &Path) -> impl FnOnce(std::io::Error) -> ServeError + '_ {
    move |source| ServeError::StateDir {
        path: path.to_owned(),
        source,
    }
}

/// A short, stable tag for a state directory, so that two servers with different state
/// directories keep their cgroups apart (FNV-1a of the canonical path).
fn state_tag(state_dir: &Path) -> String {
    let hash = state_dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("{:08x}", hash as u32)
}

impl HostSetup {
    /// Single-threaded start-up. `exe` is the binary to re-exec as the zygote.
    pub fn prepare(config: &ServerConfig, exe: &Path) -> Result<HostSetup, ServeError> {
        if !config.listen.ip().is_loopback() && config.token.is_none() {
            return Err(ServeError::InsecureListen(config.listen));
        }
        let state = &config.state_dir;
        std::fs::create_dir_all(state.join("sandboxes")).map_err(state_err(state))?;
        let lock_file = std::fs::File::create(state.join("lock")).map_err(state_err(state))?;
        let lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|_| ServeError::StateDirLocked(state.clone()))?;
        let canonical = state.canonicalize().map_err(state_err(state))?;
        let layout = CgroupLayout::detect(&state_tag(&canonical))?;
        layout.prepare()?;
        let zygote = Zygote::spawn(exe)?;
        Ok(HostSetup {
            _lock: lock,
            layout,
            zygote,
            exe: exe.to_owned(),
        })
    }
}

/// Serves until SIGINT or SIGTERM, then stops every sandbox.
pub async fn run(config: ServerConfig, host: HostSetup) -> Result<(), ServeError> {
    let metrics = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            &[
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
            ],
        )
        .map_err(|e| ServeError::Metrics(e.to_string()))?
        .install_recorder()
        .map_err(|e| ServeError::Metrics(e.to_string()))?;
    let images = ImageStore::open(&config.state_dir.join("images"))?;
    let runtime = Arc::new(ContainerRuntime::new(
        host.zygote,
        host.layout,
        config.state_dir.join("sandboxes"),
    ));
    let cleaned = {
        let runtime = Arc::clone(&runtime);
        tokio::task::spawn_blocking(move || runtime.clean_leftovers())
            .await
            .unwrap_or_default()
    };
    if !cleaned.is_empty() {
        tracing::info!(
            count = cleaned.len(),
            "removed sandboxes left by an earlier run"
        );
    }
    let fncall = FnCallBackend::new(
        Arc::clone(&runtime),
        images.clone(),
        config.fncall,
        config.edge.name.clone(),
    );
    // Containers of this state directory carry its tag, so a restart finds its own.
    let docker_tag = config
        .state_dir
        .canonicalize()
        .map_or_else(|_| state_tag(&config.state_dir), |p| state_tag(&p));
    // Sandbox networking: the bridge, nftables tables and resolver carry the same tag.
    let net = Arc::new(dsec_net::Networking::start(&docker_tag, config.net_pool).await);
    let docker = Arc::new(DockerBackend::new(docker_tag));
    // Before serving, so that a server stopped right after it started still cleans up.
    docker.clean_leftovers().await;
    let vm_host = Arc::new(VmHost::new(
        &config.state_dir,
        images.clone(),
        config.vm.clone(),
        host.exe,
    ));
    let cleaned = {
        let vm_host = Arc::clone(&vm_host);
        tokio::task::spawn_blocking(move || vm_host.clean_leftovers())
            .await
            .unwrap_or_default()
    };
    if cleaned > 0 {
        tracing::info!(
            count = cleaned,
            "removed VM sandboxes left by an earlier run"
        );
    }
    // The accelerator probe boots a guest: start it now so the first VM sandbox does
    // not wait for it. Hosts that cannot run VMs learn why at their first VM create.
    {
        let vm_host = Arc::clone(&vm_host);
        tokio::spawn(async move {
            let _ = vm_host.accel().await;
        });
    }
    let backends = Backends {
        container: Arc::new(ContainerBackend::new(
            Arc::clone(&runtime),
            images.clone(),
            Arc::clone(&net),
        )),
        fncall: Arc::clone(&fncall),
        docker,
        microvm: Arc::new(VmBackend::new(
            Arc::clone(&vm_host),
            dsec_vm::qemu::Machine::Microvm,
        )),
        vm: Arc::new(VmBackend::new(vm_host, dsec_vm::qemu::Machine::Q35)),
    };
    let log = dsec_trajectory::TrajectoryLog::open(
        &config.state_dir.join("trajectory.db"),
        config.trajectory_sync,
    )?;
    let edge = Arc::new(Edge::new(config.edge.clone(), images, backends, log));
    tokio::spawn(Arc::clone(&edge).reaper());
    let state = api::AppState {
        edge: Arc::clone(&edge),
        metrics,
        token: config.token.as_deref().map(Arc::from),
    };
    let app = api::router(state, config.max_upload_bytes);
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServeError::Listen {
            addr: config.listen,
            source,
        })?;
    tracing::info!(listen = %config.listen, state_dir = %config.state_dir.display(), "dsec serving");
    // Stop the sandboxes before the HTTP server drains: requests still waiting on a
    // command then end at once instead of holding the shutdown open.
    let stopping = Arc::clone(&edge);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            tracing::info!("shutting down: stopping all sandboxes");
            stopping.stop_all().await;
        })
        .await
        .map_err(|source| ServeError::Listen {
            addr: config.listen,
            source,
        })?;
    edge.stop_all().await;
    fncall.shutdown().await;
    net.shutdown().await;
    let runtime_ = Arc::clone(&runtime);
    let _ = tokio::task::spawn_blocking(move || runtime_.release_host()).await;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_tag_is_stable_and_distinguishes_directories() {
        assert_eq!(
            state_tag(Path::new("/var/lib/dsec")),
            state_tag(Path::new("/var/lib/dsec"))
        );
        assert_ne!(
            state_tag(Path::new("/var/lib/dsec")),
            state_tag(Path::new("/tmp/x"))
        );
        assert_eq!(state_tag(Path::new("/a")).len(), 8);
    }
}
