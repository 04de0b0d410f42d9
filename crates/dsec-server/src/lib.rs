//! `dsec serve`: the embedded single-node server — apiserver and edge in one process.
//!
//! Start-up happens in two phases because of threads: [`HostSetup::prepare`] runs while the
//! process is still single-threaded (it locks the state directory, settles the cgroup
//! layout — on v2 that moves the server into a leaf cgroup — and the limits of all
//! sandboxes together, and starts the zygote), and
//! [`run`] then starts the async world: cleanup of what an earlier run left, the reaper,
//! and the HTTP API.
#![warn(missing_docs)]

pub mod admission;
pub mod api;
pub mod backend;
pub mod e2b;
pub mod edge;
pub mod error;
pub mod events;
pub mod projects;
pub mod sandboxfusion;
mod trajectory;
pub mod watcher;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsec_api::BackendKind;
use dsec_image::ImageStore;
use dsec_runtime::cgroup::{CgroupLayout, ParentLimits};
use dsec_runtime::container::ContainerRuntime;
use dsec_runtime::rootfs::SharedSysfs;
use dsec_runtime::zygote::Zygote;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

use crate::admission::{Admission, AdmissionConfig, Capacity, HostResources};
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
    /// The trajectory log's fsync policy and budgets (see `dsec_trajectory`).
    pub trajectory: dsec_trajectory::LogConfig,
    /// Where the trajectory log lives; `None`: `<state-dir>/trajectory.db`.
    pub trajectory_db: Option<dsec_trajectory::Database>,
    /// Sizing of the fncall worker pools.
    pub fncall: PoolConfig,
    /// The budget new sandboxes are admitted against.
    pub admission: AdmissionConfig,
    /// Addresses of sandboxes with a network: (network, prefix length), used only if no
    /// host route overlaps it; `None`: the first free /16 of `dsec_net::DEFAULT_RANGE`.
    pub net_pool: Option<(std::net::Ipv4Addr, u8)>,
    /// The `microvm` and `vm` backends.
    pub vm: VmConfig,
    /// The E2B control plane and envd endpoint.
    pub e2b: e2b::E2bConfig,
    /// Where image layers and metadata live, when not in the state directory: possibly a
    /// network filesystem shared by many servers.
    pub layer_store: Option<PathBuf>,
    /// The OCI registry a fleet's edges share images through (`--registry`).
    pub registry: Option<dsec_image::Registry>,
    /// Host directories beneath which a project's token may import images by path.
    pub import_roots: Vec<PathBuf>,
    /// Registries a project's token may import from although their addresses are not
    /// public (`--import-registry`).
    pub import_registries: Vec<String>,
    /// Hosts (`HOST[:PORT]` or URLs) no sandbox may reach (`--protect`), besides the
    /// services the server relies on itself.
    pub protect: Vec<String>,
    /// SandboxFusion's `/run_code`.
    pub sandboxfusion: sandboxfusion::SandboxFusionConfig,
    /// How much of the event stream is kept (in `<state-dir>/events/`).
    pub events: events::EventsConfig,
    /// The Watcher's rules (`--watcher-config`).
    pub watcher: watcher::WatcherConfig,
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
    /// The state directory belongs to another user, who could plant what the server trusts.
    #[error("state directory {path} is owned by uid {owner}, not by the server (uid {server}): its owner could plant files the server trusts; chown it or choose another --state-dir")]
    StateDirOwner {
        /// The directory.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// The server's effective uid.
        server: u32,
    },
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
    /// E2B's debug mode sends no credentials, so it cannot serve a server with a token.
    #[error("--e2b-debug-template cannot be combined with --token-file: the e2b SDK's debug mode sends no credentials")]
    E2bDebugWithToken,
    /// The event stream's files could not be opened.
    #[error("events in {path}: {source}")]
    Events {
        /// The directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The metrics recorder could not be installed.
    #[error("metrics: {0}")]
    Metrics(String),
    /// The edge could not join its fleet.
    #[error("joining the fleet: {0}")]
    Membership(String),
}

/// A fleet the edge belongs to (`dsec edge`; crates/dsec-fleet): it registers the edge,
/// publishes its load while it serves, and leaves when it stops.
#[async_trait::async_trait]
pub trait Membership: Send + Sync {
    /// Joins, before anything is set up on the host: an error fails the start.
    async fn join(&self) -> Result<(), String>;
    /// Publishes `edge`'s load until `stop` turns true, then leaves the fleet: called
    /// once the API listens; on shutdown awaited before the sandboxes stop.
    async fn serve(&self, edge: Arc<Edge>, stop: tokio::sync::watch::Receiver<bool>);
    /// The services membership talks to (URLs or `host[:port]`): sandboxes may not reach
    /// them.
    fn services(&self) -> Vec<String>;
    /// The fleet's quotas over all its edges, which this edge's projects count in.
    fn quotas(&self) -> Option<Arc<dyn projects::SharedQuotas>> {
        None
    }
}

/// The state directory's `flock(2)`, held while the server runs. Released explicitly on
/// drop: a forked child holding a copy of the descriptor must not keep it.
struct StateLock(std::fs::File);

impl StateLock {
    /// Takes the lock on `file` without waiting.
    fn take(file: std::fs::File) -> rustix::io::Result<StateLock> {
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)?;
        Ok(StateLock(file))
    }
}

impl Drop for StateLock {
    fn drop(&mut self) {
        let _ = rustix::fs::flock(&self.0, rustix::fs::FlockOperation::Unlock);
    }
}

/// What [`HostSetup::prepare`] made, handed to [`run`].
pub struct HostSetup {
    _lock: StateLock,
    layout: CgroupLayout,
    capacity: Capacity,
    zygote: Zygote,
    exe: PathBuf,
    /// The image store's `nosuid,nodev` mount, held until the server stops.
    seal: Option<dsec_image::seal::Seal>,
    /// The tmpfs of the container runtime's per-sandbox state, held until the server stops.
    sandboxes_tmpfs: Option<dsec_image::seal::Seal>,
    /// The sysfs every container sandbox binds (`/run/dsec/sysfs/<tag>`).
    sysfs: Option<SharedSysfs>,
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
    // The low 32 bits of the hash name the directory.
    format!("{:08x}", hash & 0xffff_ffff)
}

impl HostSetup {
    /// Single-threaded start-up. `exe` is the binary to re-exec as the zygote.
    pub fn prepare(config: &ServerConfig, exe: &Path) -> Result<HostSetup, ServeError> {
        let listeners = [
            Some(config.listen),
            config.e2b.listen,
            config.e2b.envd_listen,
        ];
        for addr in listeners.into_iter().flatten() {
            if !addr.ip().is_loopback() && config.token.is_none() {
                return Err(ServeError::InsecureListen(addr));
            }
        }
        if config.e2b.debug_template.is_some() && config.token.is_some() {
            return Err(ServeError::E2bDebugWithToken);
        }
        let state = &config.state_dir;
        private_state_dir(state)?;
        std::fs::create_dir_all(state.join("sandboxes")).map_err(state_err(state))?;
        let lock_file = std::fs::File::create(state.join("lock")).map_err(state_err(state))?;
        let lock =
            StateLock::take(lock_file).map_err(|_| ServeError::StateDirLocked(state.clone()))?;
        let canonical = state.canonicalize().map_err(state_err(state))?;
        let images = state.join("images");
        std::fs::create_dir_all(&images).map_err(state_err(state))?;
        let seal = match dsec_image::seal::Seal::apply(&images, &state.join("images.mount")) {
            Ok(seal) => Some(seal),
            Err(e) => {
                tracing::warn!(dir = %images.display(), error = %e, "cannot mount the image store nosuid,nodev; only the state directory's permissions keep its setuid files from host users");
                None
            }
        };
        let layout = CgroupLayout::detect(&state_tag(&canonical))?;
        let host = HostResources::detect(layout.inherited_limits());
        let capacity = Capacity::new(&host, &config.admission);
        layout.prepare(&ParentLimits {
            memory_bytes: capacity.memory_mb << 20,
            pids: capacity.pids,
        })?;
        // Each container sandbox's mount points and record, made on its create path: on
        // a tmpfs, not the state directory's disk (they mean nothing after a reboot).
        let sandboxes = state.join("sandboxes");
        let sandboxes_tmpfs = dsec_image::seal::Seal::tmpfs(&sandboxes, &state.join("sandboxes.mount"))
            .inspect_err(|e| tracing::warn!(dir = %sandboxes.display(), error = %e, "cannot mount a tmpfs for the sandboxes' state; it stays on the state directory's filesystem"))
            .ok();
        let zygote = Zygote::spawn(exe)?;
        raise_descriptor_limit();
        // Under /run, not the state directory: a live sysfs there would be walked by
        // whatever reads the state directory whole (a backup, `du`, a test).
        let sysfs = SharedSysfs::mount(&Path::new("/run/dsec/sysfs").join(state_tag(&canonical)))
            .inspect_err(
                |e| tracing::warn!(error = %e, "no shared sysfs: each sandbox mounts its own"),
            )
            .ok();
        Ok(HostSetup {
            _lock: lock,
            layout,
            capacity,
            zygote,
            exe: exe.to_owned(),
            seal,
            sandboxes_tmpfs,
            sysfs,
        })
    }
}

/// How many descriptors the server asks to hold: an edge keeps one per container sandbox
/// (its control channel) and more per request, stream and VM.
const WANTED_DESCRIPTORS: u64 = 1 << 20;

/// Raises the server's own limit on open descriptors to [`WANTED_DESCRIPTORS`] (bounded by
/// `fs.nr_open`), or, without `CAP_SYS_RESOURCE`, its soft limit to its hard one: a host's
/// usual 1,024, or the 20,000 of some images, stops an edge short of the sandboxes its
/// memory holds. Called after the zygote started, so sandboxes keep the limit the server
/// was started with.
fn raise_descriptor_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let before = getrlimit(Resource::Nofile);
    let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(WANTED_DESCRIPTORS);
    let wanted = before
        .maximum
        .unwrap_or(u64::MAX)
        .max(WANTED_DESCRIPTORS.min(nr_open));
    let at = |limit: Option<u64>| Rlimit {
        current: limit,
        maximum: limit,
    };
    if setrlimit(Resource::Nofile, at(Some(wanted))).is_err() {
        let _ = setrlimit(Resource::Nofile, at(before.maximum));
    }
    let after = getrlimit(Resource::Nofile).current;
    if after.is_some_and(|n| n < wanted) {
        tracing::warn!(
            limit = ?after,
            "the descriptor limit is below {wanted} and cannot be raised (no CAP_SYS_RESOURCE): \
             at one per sandbox it bounds how many this server holds"
        );
    }
}

/// Creates the state directory `0700`, or tightens it to that: it holds images with the
/// setuid files and device nodes of sandboxes, their trajectories (commands, outputs) and
/// VM disks, none of which another host user may reach. A directory owned by someone
/// else is refused: its owner could rename or plant entries under the server's feet.
fn private_state_dir(state: &Path) -> Result<(), ServeError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state)
        .map_err(state_err(state))?;
    let meta = std::fs::metadata(state).map_err(state_err(state))?;
    let server = rustix::process::geteuid().as_raw();
    if meta.uid() != server {
        return Err(ServeError::StateDirOwner {
            path: state.to_owned(),
            owner: meta.uid(),
            server,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode != 0o700 {
        std::fs::set_permissions(state, std::fs::Permissions::from_mode(0o700))
            .map_err(state_err(state))?;
        tracing::warn!(dir = %state.display(), was = format!("{mode:04o}"), "state directory was reachable by other users; tightened to 0700");
    }
    Ok(())
}

/// Serves until SIGINT or SIGTERM, then stops every sandbox.
pub async fn run(config: ServerConfig, host: HostSetup) -> Result<(), ServeError> {
    run_with(config, host, None).await
}

/// [`run`], as a member of a fleet when `membership` is given.
pub async fn run_with(
    config: ServerConfig,
    host: HostSetup,
    membership: Option<Arc<dyn Membership>>,
) -> Result<(), ServeError> {
    // Dropped last: the store stays sealed, and the sandboxes' tmpfs mounted, until every
    // sandbox has stopped.
    let _seal = host.seal;
    let _sandboxes_tmpfs = host.sandboxes_tmpfs;
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
    if let Some(m) = &membership {
        m.join().await.map_err(ServeError::Membership)?;
    }
    // First: a trajectory database that is unreachable or refuses us fails the start
    // before anything is set up on the host.
    let trajectory_db = config.trajectory_db.clone().unwrap_or_else(|| {
        dsec_trajectory::Database::Sqlite(config.state_dir.join("trajectory.db"))
    });
    let log = dsec_trajectory::TrajectoryLog::open_database(
        &trajectory_db,
        &config.edge.name,
        config.trajectory,
    )
    .await?;
    // Containers of this state directory carry its tag, so a restart finds its own.
    let docker_tag = config
        .state_dir
        .canonicalize()
        .map_or_else(|_| state_tag(&config.state_dir), |p| state_tag(&p));
    // Sandboxes, and projects' registry imports, never reach these.
    let protected = protected_services(&config, membership.as_deref()).await;
    let images = open_images(&config, &docker_tag, &protected)?;
    let admission = Admission::new(host.capacity, config.admission);
    {
        let c = admission.capacity();
        tracing::info!(
            memory_mb = c.memory_mb,
            pids = c.pids,
            memory_overcommit = config.admission.memory_overcommit,
            pids_overcommit = config.admission.pids_overcommit,
            "all sandboxes together may use {} MiB ({}) and {} tasks ({}); their limits may \
             add up to the overcommit times that",
            c.memory_mb,
            c.memory_why,
            c.pids,
            c.pids_why
        );
    }
    if !dsec_runtime::caps::can_lower_oom_scores() {
        tracing::warn!(
            "no CAP_SYS_RESOURCE: sandbox inits cannot leave the OOM killer's reach; they \
             are kept outside their sandboxes' memory limits instead, so only a host-wide \
             shortage can choose them"
        );
    }
    let runtime = Arc::new(ContainerRuntime::new(
        host.zygote,
        host.layout,
        config.state_dir.join("sandboxes"),
        host.sysfs,
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
        Arc::clone(&admission),
        images.clone(),
        config.fncall,
        config.edge.name.clone(),
    );
    // Sandbox networking: the bridge, nftables tables and resolver carry the same tag.
    let net = Arc::new(
        dsec_net::Networking::start(&docker_tag, config.net_pool, &config.state_dir, protected)
            .await,
    );
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
    let backends = Backends::default()
        .register(BackendKind::Fncall, fncall.clone())
        .register(
            BackendKind::Container,
            Arc::new(ContainerBackend::new(
                Arc::clone(&runtime),
                images.clone(),
                Arc::clone(&net),
            )),
        )
        .register(BackendKind::Docker, docker)
        .register(
            BackendKind::Microvm,
            Arc::new(VmBackend::new(
                Arc::clone(&vm_host),
                dsec_vm::qemu::Machine::Microvm,
                Arc::clone(&net),
            )),
        )
        .register(
            BackendKind::Vm,
            Arc::new(VmBackend::new(
                vm_host,
                dsec_vm::qemu::Machine::Q35,
                Arc::clone(&net),
            )),
        );
    let sandboxfusion = Arc::new(sandboxfusion::SandboxFusion::new(
        Arc::clone(&fncall),
        images.clone(),
        config.sandboxfusion.clone(),
        &config.edge,
        admission.capacity().memory_mb,
    ));
    let events_dir = config.state_dir.join("events");
    let events = {
        let (dir, budget) = (events_dir.clone(), config.events.clone());
        tokio::task::spawn_blocking(move || events::Events::open(&dir, budget))
            .await
            .map_err(|e| ServeError::Events {
                path: events_dir.clone(),
                source: std::io::Error::other(e),
            })?
            .map_err(|source| ServeError::Events {
                path: events_dir,
                source,
            })?
    };
    let edge = Arc::new(Edge::new(
        config.edge.clone(),
        admission,
        images,
        backends,
        log.clone(),
        Arc::clone(&events),
    ));
    if let Some(shared) = membership.as_ref().and_then(|m| m.quotas()) {
        edge.share_quotas(shared);
    }
    let adopted = edge.adopt_kept().await;
    if adopted > 0 {
        tracing::info!(
            count = adopted,
            "adopted paused sandboxes kept by an earlier run"
        );
    }
    tokio::spawn(Arc::clone(&edge).reaper());
    if config.events.enabled {
        tokio::spawn(Arc::clone(&edge).usage_sampler());
        tokio::spawn(watcher::Watcher::new(config.watcher.rules()).run(Arc::clone(&edge)));
    }
    tokio::spawn(Arc::clone(&edge).image_collector());
    let projects = Arc::new(
        projects::Projects::open(&config.state_dir).map_err(|source| ServeError::StateDir {
            path: config.state_dir.join("projects.json"),
            source,
        })?,
    );
    let state = api::AppState {
        edge: Arc::clone(&edge),
        metrics,
        token: config.token.as_deref().map(Arc::from),
        projects: Arc::clone(&projects),
        sandboxfusion,
    };
    let app = api::router(state.clone(), config.max_upload_bytes);
    let listener = bind(config.listen).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let sandboxfusion_server = match config.sandboxfusion.listen {
        Some(addr) => {
            let listener = bind(addr).await?;
            if !addr.ip().is_loopback() && config.token.is_none() {
                tracing::warn!(listen = %addr, "/run_code takes no credentials without --token-file (as SandboxFusion): anyone who reaches this address can run programs in graders");
            }
            tracing::info!(listen = %addr, image = %config.sandboxfusion.image, "SandboxFusion /run_code serving");
            Some(sandboxfusion::serve(
                listener,
                state,
                config.max_upload_bytes,
                stopped.clone(),
            ))
        }
        None => None,
    };
    let e2b = Arc::new(e2b::E2b::new(
        Arc::clone(&edge),
        config.e2b.clone(),
        config.token.as_deref().map(Arc::from),
        projects,
        config.max_upload_bytes,
    ));
    let e2b_servers = e2b::start(e2b, stopped).await?;
    tracing::info!(listen = %config.listen, state_dir = %config.state_dir.display(), "dsec serving");
    let member = membership.map(|m| {
        let (edge, stop) = (Arc::clone(&edge), stop.subscribe());
        tokio::spawn(async move { m.serve(edge, stop).await })
    });
    // Stop the sandboxes before the HTTP server drains: requests still waiting on a
    // command then end at once instead of holding the shutdown open.
    let stopping = Arc::clone(&edge);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            tracing::info!("shutting down: stopping all sandboxes");
            let _ = stop.send(true);
            // Out of the fleet first, so that no apiserver places another sandbox here.
            if let Some(member) = member {
                let _ = member.await;
            }
            stopping.stop_all().await;
        })
        .await
        .map_err(|source| ServeError::Listen {
            addr: config.listen,
            source,
        })?;
    if let Some(server) = sandboxfusion_server {
        let _ = server.await;
    }
    futures::future::join_all(e2b_servers).await;
    edge.stop_all().await;
    fncall.shutdown().await;
    net.shutdown().await;
    // What the stops recorded is committed before the process ends.
    log.close().await;
    events.flush().await;
    let runtime_ = Arc::clone(&runtime);
    let _ = tokio::task::spawn_blocking(move || runtime_.release_host()).await;
    Ok(())
}

/// Opens the image store: layers and metadata in `--layer-store` (else the state
/// directory's `images/`), staging and mounts in `images/`. The edge is known to others
/// sharing the store as `<hostname>-<tag>`.
fn open_images(
    config: &ServerConfig,
    tag: &str,
    protected: &[std::net::Ipv4Addr],
) -> Result<ImageStore, ServeError> {
    let local = config.state_dir.join("images");
    let root = config.layer_store.clone().unwrap_or_else(|| local.clone());
    if config.layer_store.is_some() {
        std::fs::create_dir_all(&root).map_err(state_err(&root))?;
        match dsec_image::seal::is_inert(&root) {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(store = %root.display(), "the layer store is not mounted nosuid,nodev: a staging layer's setuid files are powerless only while its directory stays 0700; mount it with nosuid,nodev")
            }
            Err(e) => {
                tracing::warn!(store = %root.display(), error = %e, "cannot inspect the layer store's mount")
            }
        }
    }
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned();
    let store = ImageStore::open(&root, &local, &format!("{host}-{tag}"))?;
    if let Some(registry) = &config.registry {
        store.share_through(registry.clone());
    }
    store.allow_project_imports_under(&config.import_roots)?;
    store.set_project_reach(dsec_image::ProjectReach {
        trusted: config.import_registries.clone(),
        protected: protected.iter().copied().map(Into::into).collect(),
    });
    Ok(store)
}

/// The addresses of the services this server relies on — a fleet's etcd, the registry
/// images are shared through, a PostgreSQL trajectory log — which no sandbox may reach.
async fn protected_services(
    config: &ServerConfig,
    membership: Option<&dyn Membership>,
) -> Vec<std::net::Ipv4Addr> {
    let mut services = config.protect.clone();
    services.extend(membership.map(Membership::services).unwrap_or_default());
    if let Some(registry) = &config.registry {
        services.push(registry.host().to_owned());
    }
    if let Some(dsec_trajectory::Database::Postgres(url)) = &config.trajectory_db {
        services.push(url.clone());
    }
    let mut addrs = Vec::new();
    for authority in services.iter().flat_map(|s| authorities(s)) {
        match tokio::net::lookup_host(&authority).await {
            Ok(found) => addrs.extend(found.filter_map(|a| match a.ip() {
                std::net::IpAddr::V4(ip) => Some(ip),
                std::net::IpAddr::V6(_) => None,
            })),
            Err(e) => {
                tracing::warn!(service = %authority, error = %e, "cannot resolve a service of this server: sandboxes are not kept from its address")
            }
        }
    }
    addrs.sort_unstable();
    addrs.dedup();
    addrs
}

/// The `host:port` parts of a URL or `host[:port]` (a PostgreSQL URL may name several
/// hosts); port 0 where none is given, for the resolver.
fn authorities(service: &str) -> Vec<String> {
    let rest = service.split_once("://").map_or(service, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    let hosts = authority
        .rsplit_once('@')
        .map_or(authority, |(_, hosts)| hosts);
    hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| {
            if h.contains(':') {
                h.to_owned()
            } else {
                format!("{h}:0")
            }
        })
        .collect()
}

async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, ServeError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Listen { addr, source })
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
    fn service_authorities() {
        assert_eq!(authorities("http://10.0.0.1:2379"), ["10.0.0.1:2379"]);
        assert_eq!(authorities("dsec-etcd:2379"), ["dsec-etcd:2379"]);
        assert_eq!(authorities("registry.lan"), ["registry.lan:0"]);
        assert_eq!(
            authorities("postgres://u:p@db1:5432,db2/fleet?sslmode=disable"),
            ["db1:5432", "db2:0"]
        );
    }

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
