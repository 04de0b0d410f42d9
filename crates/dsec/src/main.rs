//! The `dsec` command: runs the server, and talks to one over HTTP.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use dsec_api::{
    CommandResult, CreateSandboxRequest, ErrorBody, ImageInfo, ImportEvent, ImportImageRequest,
    PruneResult, SandboxInfo, StoreInfo,
};
use dsec_server::admission::AdmissionConfig;
use dsec_server::backend::fncall::PoolConfig;
use dsec_server::backend::vm::{AccelChoice, BootMode, PauseMode, VmConfig};
use dsec_server::e2b::E2bConfig;
use dsec_server::edge::{EdgeConfig, FileLimits};
use dsec_server::sandboxfusion::SandboxFusionConfig;
use dsec_server::{HostSetup, ServerConfig};
use dsec_trajectory::{Budgets, LogConfig, SandboxLog};
use dsec_vm::assets::KernelSource;
use dsec_vm::disk::BaseFs;

mod events;
mod replay;
mod top;

#[derive(Parser)]
#[command(
    name = "dsec",
    version,
    about = "Elastic sandboxes for training and evaluating AI agents"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Args)]
struct Remote {
    /// Server URL.
    #[arg(
        long,
        env = "DSEC_URL",
        default_value = "http://127.0.0.1:7700",
        global = true
    )]
    url: String,
    /// Bearer token.
    #[arg(long, env = "DSEC_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the embedded single-node server (apiserver and edge).
    Serve(Box<ServeArgs>),
    /// Run a fleet edge: this host's sandboxes, registered in etcd for apiservers.
    Edge(Box<EdgeArgs>),
    /// Run a fleet apiserver: the `/v1` API, forwarded to the edges found in etcd.
    Apiserver(ApiserverArgs),
    /// List the fleet's live edges and their load (from an apiserver).
    Edges {
        /// Print the edges as JSON (`GET /v1/fleet/edges`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Manage projects: their tokens and quotas (with the server's admin token).
    Project {
        #[command(subcommand)]
        command: ProjectCmd,
        #[command(flatten)]
        remote: Remote,
    },
    /// Manage images.
    Image {
        #[command(subcommand)]
        command: ImageCmd,
        #[command(flatten)]
        remote: Remote,
    },
    /// Create a sandbox and print its id.
    Create {
        /// Backend: fncall, container, docker, microvm, vm.
        #[arg(long, default_value = "container")]
        backend: String,
        /// Image name.
        #[arg(long)]
        image: String,
        /// Labels, `k=v` (repeatable).
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// Hard lifetime in seconds.
        #[arg(long)]
        ttl: Option<f64>,
        #[command(flatten)]
        remote: Remote,
    },
    /// List sandboxes.
    Ps {
        /// Only sandboxes with this label, `k=v` (repeatable).
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Print the event stream (lifecycle, commands, files, limits, network, Watcher).
    Events(events::EventsArgs),
    /// A refreshing table of the sandboxes' live usage (CPU, memory, pids, disk, flags).
    Top(top::TopArgs),
    /// Run a command in a sandbox; exits with the command's status.
    Exec {
        /// Sandbox id.
        id: String,
        /// Timeout in seconds.
        #[arg(long)]
        timeout: Option<f64>,
        /// Run as this user of the sandbox (a name, a uid or uid:gid), in its home.
        #[arg(long)]
        user: Option<String>,
        /// The command and its arguments (after `--`).
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// Show a sandbox's trajectory: its recorded commands, also after it is gone.
    Log {
        /// Sandbox id.
        id: String,
        /// Print the log as JSON (`GET /v1/sandboxes/{id}/log`).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        remote: Remote,
    },
    /// Re-run a sandbox's recorded commands in a fresh sandbox from the same image and
    /// backend, and report the first step whose output differs.
    Replay {
        /// Sandbox id whose log to replay.
        id: String,
        #[command(flatten)]
        remote: Remote,
    },
    /// Stop and remove a sandbox.
    Rm {
        /// Sandbox ids.
        #[arg(required = true)]
        ids: Vec<String>,
        #[command(flatten)]
        remote: Remote,
    },
    /// The zygote (started by `dsec serve`; not for direct use).
    #[command(name = "__zygote", hide = true)]
    Zygote,
}

#[derive(Args)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7700")]
    listen: SocketAddr,
    /// State directory: images, sandboxes, logs.
    #[arg(long, default_value = "/var/lib/dsec")]
    state_dir: PathBuf,
    /// File holding the bearer token clients must send (required off loopback).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Largest request body in MiB (uploads, exec files and stdin). Given twice, the
    /// last one counts.
    #[arg(long, default_value_t = 256, overrides_with = "max_upload_mb")]
    max_upload_mb: usize,
    /// Largest file the files API reads or writes, in MiB (a write is also bounded by
    /// --max-upload-mb).
    #[arg(long, default_value_t = 1024)]
    max_file_mb: u64,
    /// Where image layers and metadata live (default: `<state-dir>/images`). May be a
    /// network filesystem (NFS, CephFS) shared by many servers, each with its own state
    /// directory: a layer is written there once and used by all. Mount it `nosuid,nodev`.
    #[arg(long)]
    layer_store: Option<PathBuf>,
    /// An OCI registry (`HOST[:PORT][/PREFIX]`) a fleet's edges share images through:
    /// every import is pushed there (the layers as they are stored), and a create of an
    /// image this server lacks pulls it from there first. Plain HTTP for loopback hosts
    /// and those in $DSEC_INSECURE_REGISTRIES, else HTTPS.
    #[arg(long, value_parser = parse_registry)]
    registry: Option<dsec_image::Registry>,
    /// A host directory beneath which a project's token may import images by path
    /// (repeatable; the admin's token imports any path). Without one a project imports
    /// from registries only: a host path would let it read whatever the server can read.
    #[arg(long = "import-root", value_name = "DIR")]
    import_roots: Vec<PathBuf>,
    /// A registry (`HOST[:PORT]` as in image references; without a port, any of the
    /// host's) a project's token may import from although its address is loopback or
    /// private (repeatable). A project's registry import otherwise connects only to public
    /// addresses (redirects and token services included), never to the server's own
    /// network; the admin's imports reach any registry.
    #[arg(long = "import-registry", value_name = "HOST")]
    import_registries: Vec<String>,
    /// A host (`HOST[:PORT]`, or a URL) no sandbox may reach, whatever its network policy
    /// allows: services of the operator's that sandboxes must not touch (repeatable). The
    /// fleet's etcd, the --registry and a PostgreSQL --trajectory-db are protected anyway.
    #[arg(long = "protect", value_name = "HOST")]
    protect: Vec<String>,
    /// Prefix of sandbox ids, naming this edge (default `e0`; `dsec edge`: the host name).
    #[arg(long, visible_alias = "name")]
    edge_name: Option<String>,
    /// Default CPU bandwidth per sandbox, in cores.
    #[arg(long, default_value_t = 1.0)]
    default_cpus: f64,
    /// Default memory limit per sandbox, in MiB.
    #[arg(long, default_value_t = 512)]
    default_memory_mb: u64,
    /// Default process limit per sandbox.
    #[arg(long, default_value_t = 512)]
    default_pids: u64,
    /// Default writable-layer size per sandbox, in MiB.
    #[arg(long, default_value_t = 256)]
    default_disk_mb: u64,
    /// Default command timeout, in seconds.
    #[arg(long, default_value_t = 600.0)]
    default_timeout_s: f64,
    /// Default bound on each of stdout and stderr, in bytes.
    #[arg(long, default_value_t = 16 << 20)]
    max_output_bytes: u64,
    /// Trajectory log commits: `normal` writes each (group) commit to the WAL without
    /// fsync, surviving a crash of the server but not of the machine; `full` also fsyncs,
    /// surviving power loss, at one fsync per commit.
    #[arg(long, default_value = "normal", value_parser = parse_sync)]
    trajectory_sync: dsec_trajectory::SyncMode,
    /// Where the trajectory log lives: a SQLite file (default `<state-dir>/trajectory.db`),
    /// or a PostgreSQL database shared by a fleet, `postgres://USER:PASSWORD@HOST:PORT/DB`
    /// (each server writes under its --edge-name, which must be its own).
    #[arg(long, value_parser = parse_trajectory_db)]
    trajectory_db: Option<dsec_trajectory::Database>,
    /// Trajectory log: bytes of each command output stream stored whole; a longer one is
    /// stored as its first and last halves of this, with its full length and digest.
    #[arg(long, default_value_t = Budgets::default().output_bytes)]
    trajectory_output_bytes: u64,
    /// Trajectory log: MiB one sandbox's log may take; its further steps are recorded
    /// without output (a live sandbox's steps are never pruned).
    #[arg(long, default_value_t = Budgets::default().sandbox_bytes >> 20)]
    trajectory_sandbox_mb: u64,
    /// Trajectory log: MiB the whole log may take on disk (database and WAL); stopped
    /// sandboxes' logs are pruned, oldest first, to stay under it.
    #[arg(long, default_value_t = Budgets::default().total_bytes >> 20, value_parser = clap::value_parser!(u64).range(1..))]
    trajectory_max_mb: u64,
    /// Events: MiB the kept event stream (<state-dir>/events/) may take on disk.
    #[arg(long, default_value_t = dsec_server::events::EventsConfig::default().max_bytes >> 20, value_parser = clap::value_parser!(u64).range(1..))]
    events_max_mb: u64,
    /// Events: record none. The usage sampler and the Watcher, which exist to make and
    /// read them, do not run; `sb.info().usage` still reads live. For hosts that want no
    /// event stream, and for measuring what it costs (bench/ab.py).
    #[arg(long)]
    no_events: bool,
    /// Events: hours an event is kept (and served) for.
    #[arg(long, default_value_t = 168.0, value_parser = parse_ratio)]
    events_max_age_h: f64,
    /// The Watcher's rules, a JSON file (see docs/SDK.md); its safe defaults (which only
    /// flag) run without one.
    #[arg(long)]
    watcher_config: Option<PathBuf>,
    /// Private IPv4 network (a /12 to /28) that sandboxes with a network get their
    /// addresses from; the first address is the bridge's (and dsec's DNS resolver's).
    /// Networking is unavailable if a host route overlaps it. Default: the first /16 of
    /// 10.208.0.0/12, from 10.209.0.0/16 on, that no host route overlaps.
    #[arg(long, value_parser = dsec_net::parse_pool)]
    net_pool: Option<(std::net::Ipv4Addr, u8)>,
    /// Admission: the memory limits of all sandboxes may add up to this many times the
    /// memory they may use together (the host's, less --host-reserve-mb). The default
    /// admits 4 × 21.2 GiB of limits on a 24 GiB host: 169 sandboxes at the default
    /// 512 MiB; raise it for many mostly idle sandboxes.
    #[arg(long, default_value_t = 4.0, value_parser = parse_ratio)]
    memory_overcommit: f64,
    /// Admission: the pids limits of all sandboxes may add up to this many times the
    /// tasks they may hold together (pid_max or threads-max, less --host-reserve-pids).
    #[arg(long, default_value_t = 8.0, value_parser = parse_ratio)]
    pids_overcommit: f64,
    /// Memory kept from all sandboxes together for the server and the host, in MiB;
    /// written as the limit of the sandboxes' parent cgroup. Default: 10% of the host's,
    /// at least 512 MiB and at most 4 GiB.
    #[arg(long)]
    host_reserve_mb: Option<u64>,
    /// Tasks kept from all sandboxes together for the server and the host. Default: 10%
    /// of the host's, at least 512 and at most 32768.
    #[arg(long)]
    host_reserve_pids: Option<u64>,
    /// fncall: warm workers kept per image (and limits) while it is in use.
    #[arg(long, default_value_t = 2)]
    fncall_min_warm: usize,
    /// fncall: most workers per image, warm or being created.
    #[arg(long, default_value_t = 64)]
    fncall_max_warm: usize,
    /// fncall: most workers over all images (each idle worker costs ~0.2 MiB).
    #[arg(long, default_value_t = 512)]
    fncall_max_total: usize,
    /// VM backends: the static guest agent (scripts/build-agent.sh builds it); by default
    /// target/x86_64-unknown-linux-gnu/release/dsec-agent beside the dsec binary's
    /// directory, else `dsec-agent` next to the dsec binary.
    #[arg(long)]
    vm_agent: Option<PathBuf>,
    /// VM backends: guest kernel image; by default the newest
    /// /boot/vmlinuz-*-cloud-amd64 (Debian's linux-image-cloud-amd64).
    #[arg(long)]
    vm_kernel: Option<PathBuf>,
    /// VM backends: the guest kernel's modules tree; by default /lib/modules/<version>.
    /// A kernel with virtio, vsock, overlay and erofs built in needs none.
    #[arg(long)]
    vm_modules: Option<PathBuf>,
    /// VM backends: filesystem of the read-only image disks, `ext4` or `erofs`.
    #[arg(long, default_value = "ext4", value_parser = parse_base_fs)]
    vm_base_fs: BaseFs,
    /// VM backends: `snapshot` restores a boot template (booted once per image and
    /// shape) for each sandbox; `cold` boots each sandbox's kernel.
    #[arg(long, default_value = "snapshot", value_parser = parse_boot)]
    vm_boot: BootMode,
    /// VM backends: what `pause` does. `stop` stops the vCPUs (the guest stays in memory);
    /// `save` also saves the guest to disk and ends its QEMU, freeing its memory (the next
    /// request restores it, its processes and channel where they were).
    #[arg(long, default_value = "stop", value_parser = parse_pause)]
    vm_pause: PauseMode,
    /// VM backends: `auto` uses KVM when a probe guest boots under it, else TCG.
    #[arg(long, default_value = "auto", value_parser = parse_accel)]
    vm_accel: AccelChoice,
    /// Also serve SandboxFusion's `POST /run_code` and `GET /v1/ping` on this address
    /// (they are on the main listener too). It takes no credentials, as SandboxFusion.
    #[arg(long)]
    sandboxfusion_listen: Option<SocketAddr>,
    /// The image `/run_code` runs programs in (scripts/make-grader-image.sh builds one).
    #[arg(long, default_value = dsec_server::sandboxfusion::DEFAULT_IMAGE)]
    sandboxfusion_image: String,
    /// An image for one language instead, as LANGUAGE=IMAGE (repeatable).
    #[arg(long = "sandboxfusion-language-image", value_parser = parse_language_image)]
    sandboxfusion_language_images: Vec<(String, String)>,
    /// Memory limit, in MiB, of `/run_code` requests that set none (`memory_limit_MB` -1).
    #[arg(long, default_value_t = dsec_server::sandboxfusion::DEFAULT_MEMORY_MB)]
    sandboxfusion_memory_mb: u64,
    /// E2B's control-plane API on this address, for the e2b SDK (`E2B_API_URL`).
    #[arg(long)]
    e2b_listen: Option<SocketAddr>,
    /// One envd-compatible endpoint for every sandbox on this address, routed by the
    /// E2b-Sandbox-Id header (`E2B_SANDBOX_URL`).
    #[arg(long)]
    e2b_envd_listen: Option<SocketAddr>,
    /// Backend of E2B templates that name none (`templateID` "IMAGE"; "BACKEND+IMAGE"
    /// picks one).
    #[arg(long, default_value = "container")]
    e2b_backend: String,
    /// The image of the sandbox answering for the e2b SDK's debug mode (E2B_DEBUG=true,
    /// sandbox id "debug_sandbox_id"), made at its first request; unauthenticated, so
    /// refused with --token-file.
    #[arg(long)]
    e2b_debug_template: Option<String>,
}

#[derive(Args)]
struct EdgeArgs {
    /// etcd endpoints, comma-separated (`http://HOST:2379,...`).
    #[arg(long, value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// The URL apiservers reach this edge's API at (default `http://<--listen>`).
    #[arg(long)]
    advertise: Option<String>,
    /// Seconds the edge's etcd lease outlives its last keep-alive: how soon apiservers
    /// notice an edge that died.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i64).range(2..=60))]
    lease_ttl: i64,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Args)]
struct ApiserverArgs {
    /// etcd endpoints, comma-separated (`http://HOST:2379,...`).
    #[arg(long, value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7700")]
    listen: SocketAddr,
    /// File holding the bearer token clients must send (required off loopback).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// File holding the bearer token sent to edges (their --token-file).
    #[arg(long)]
    edge_token_file: Option<PathBuf>,
    /// Placement: edges drawn per create, the least loaded tried first.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=16))]
    choices: u16,
    /// Largest request body in MiB.
    #[arg(long, default_value_t = 256)]
    max_upload_mb: usize,
    /// The fleet's PostgreSQL trajectory log (the edges' --trajectory-db), read only: the
    /// log of a sandbox whose edge is gone is served from there.
    #[arg(long)]
    trajectory_db: Option<String>,
    /// E2B's control-plane API for the whole fleet on this address, for the e2b SDK's
    /// `E2B_API_URL` (forwarded to the edges' --e2b-listen).
    #[arg(long)]
    e2b_listen: Option<SocketAddr>,
    /// One envd-compatible endpoint for every sandbox of the fleet on this address, routed
    /// by the E2b-Sandbox-Id header to the sandbox's edge (`E2B_SANDBOX_URL`).
    #[arg(long)]
    e2b_envd_listen: Option<SocketAddr>,
}

#[derive(Subcommand)]
enum ProjectCmd {
    /// Create a project and print its token (shown once; the server keeps only a hash).
    Create {
        /// Project name: a-z, 0-9, '-' and '_'.
        name: String,
        /// Most sandboxes it may run at once.
        #[arg(long)]
        max_sandboxes: Option<u64>,
        /// Most CPUs its sandboxes may ask for together.
        #[arg(long)]
        max_cpus: Option<f64>,
        /// Most memory its sandboxes may ask for together, in MB.
        #[arg(long)]
        max_memory_mb: Option<u64>,
    },
    /// List projects with their quotas and what they use now.
    List,
    /// Delete a project and its tokens (refused while it has sandboxes).
    Delete {
        /// Project name.
        name: String,
    },
    /// Add a token to a project and print it.
    Token {
        /// Project name.
        name: String,
    },
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Import a rootfs directory or tarball, a docker-save archive, an OCI layout, or a
    /// registry reference.
    Import {
        /// Path on the server's host, or registry reference.
        source: String,
        /// Image name (derived from the source when omitted).
        #[arg(long)]
        name: Option<String>,
    },
    /// List images, with the disk their layers take and the store's total.
    Ls,
    /// Delete an image.
    Rm {
        /// Image name.
        name: String,
    },
    /// Delete what no image or sandbox uses: the images of finished forks, unreferenced
    /// layers, the VM disks and boot templates of deleted images.
    Prune,
}

fn parse_trajectory_db(s: &str) -> Result<dsec_trajectory::Database, String> {
    if s.is_empty() {
        return Err("empty: give a SQLite file or a postgres:// URL".into());
    }
    Ok(dsec_trajectory::Database::parse(s))
}

fn parse_sync(s: &str) -> Result<dsec_trajectory::SyncMode, String> {
    match s {
        "full" => Ok(dsec_trajectory::SyncMode::Full),
        "normal" => Ok(dsec_trajectory::SyncMode::Normal),
        _ => Err(format!("{s:?} is not full or normal")),
    }
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

fn parse_registry(s: &str) -> Result<dsec_image::Registry, String> {
    dsec_image::Registry::parse(s).map_err(|e| e.to_string())
}

fn parse_base_fs(s: &str) -> Result<BaseFs, String> {
    match s {
        "ext4" => Ok(BaseFs::Ext4),
        "erofs" => Ok(BaseFs::Erofs),
        _ => Err(format!("{s:?} is not ext4 or erofs")),
    }
}

fn parse_boot(s: &str) -> Result<BootMode, String> {
    match s {
        "snapshot" => Ok(BootMode::Snapshot),
        "cold" => Ok(BootMode::Cold),
        _ => Err(format!("{s:?} is not snapshot or cold")),
    }
}

fn parse_pause(s: &str) -> Result<PauseMode, String> {
    match s {
        "stop" => Ok(PauseMode::Stop),
        "save" => Ok(PauseMode::Save),
        _ => Err(format!("{s:?} is not stop or save")),
    }
}

fn parse_accel(s: &str) -> Result<AccelChoice, String> {
    match s {
        "auto" => Ok(AccelChoice::Auto),
        "kvm" => Ok(AccelChoice::Kvm),
        "tcg" => Ok(AccelChoice::Tcg),
        _ => Err(format!("{s:?} is not auto, kvm or tcg")),
    }
}

fn parse_language_image(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(lang, image)| !lang.is_empty() && !image.is_empty())
        .map(|(lang, image)| (lang.to_owned(), image.to_owned()))
        .ok_or_else(|| format!("{s:?} must look like LANGUAGE=IMAGE, e.g. julia=julia-grader"))
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("label {s:?} must look like key=value"))
}

fn main() {
    // Before anything else runs (and the zygote is this binary too): nothing the launcher
    // left open may reach a sandbox.
    if let Err(e) = dsec_runtime::fds::close_on_exec_above_stdio() {
        eprintln!("dsec: marking inherited descriptors close-on-exec: {e}");
        std::process::exit(1);
    }
    let cli = Cli::parse();
    if let Cmd::Zygote = cli.command {
        dsec_runtime::zygote::serve();
    }
    if let Err(e) = run(cli.command) {
        eprintln!("dsec: {e:#}");
        std::process::exit(1);
    }
}

fn run(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Serve(args) => serve(*args, None),
        Cmd::Edge(args) => edge(*args),
        Cmd::Apiserver(args) => apiserver(args),
        Cmd::Edges { json, remote } => {
            let client = Client::new(remote)?;
            let edges: Vec<dsec_fleet::EdgeRecord> = client.json(client.get("/v1/fleet/edges"))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&edges)?);
                return Ok(());
            }
            print_edges(&edges);
            Ok(())
        }
        Cmd::Project { command, remote } => project(&Client::new(remote)?, command),
        Cmd::Image { command, remote } => {
            let client = Client::new(remote)?;
            match command {
                ImageCmd::Import { source, name } => {
                    let image = import_with_progress(&client, ImportImageRequest { source, name })?;
                    println!("{} {} {}", image.name, image.id, human_size(image.size));
                }
                ImageCmd::Ls => {
                    let images: Vec<ImageInfo> = client.json(client.get("/v1/images"))?;
                    let store: StoreInfo = client.json(client.get("/v1/store"))?;
                    println!(
                        "{:<32} {:<14} {:>7} {:>10} {:>10}",
                        "NAME", "ID", "LAYERS", "SIZE", "DISK"
                    );
                    for i in images {
                        let short = i.id.trim_start_matches("sha256:").get(..12).unwrap_or("");
                        println!(
                            "{:<32} {:<14} {:>7} {:>10} {:>10}",
                            i.name,
                            short,
                            i.layers.len(),
                            human_size(i.size),
                            human_size(i.disk_bytes)
                        );
                    }
                    println!(
                        "store {}: {} images, {} layers, {} on disk (shared layers once), {} mounted here",
                        store.root,
                        store.images,
                        store.layers,
                        human_size(store.layer_bytes),
                        store.mounted
                    );
                }
                ImageCmd::Rm { name } => {
                    client.empty(client.delete(&format!("/v1/images/{name}")))?;
                }
                ImageCmd::Prune => {
                    let pruned: PruneResult = client.json(client.post("/v1/store/prune"))?;
                    for image in &pruned.images {
                        println!("removed fork image {image}");
                    }
                    println!(
                        "removed {} layers ({}), {} of VM disks and templates",
                        pruned.layers,
                        human_size(pruned.layer_bytes),
                        human_size(pruned.other_bytes)
                    );
                }
            }
            Ok(())
        }
        Cmd::Create {
            backend,
            image,
            labels,
            ttl,
            remote,
        } => {
            let client = Client::new(remote)?;
            let req = CreateSandboxRequest {
                backend,
                image,
                cpus: None,
                memory_mb: None,
                pids: None,
                disk_mb: None,
                ttl_s: ttl,
                idle_ttl_s: None,
                env: BTreeMap::new(),
                workdir: None,
                network: Default::default(),
                ca_bundle: None,
                labels: labels.into_iter().collect(),
                trajectory_id: None,
            };
            let info: SandboxInfo = client.json(client.post("/v1/sandboxes").json(&req))?;
            println!("{}", info.id);
            Ok(())
        }
        Cmd::Ps { labels, remote } => {
            let client = Client::new(remote)?;
            let query: Vec<(&str, String)> = labels
                .iter()
                .map(|(k, v)| ("label", format!("{k}={v}")))
                .collect();
            let list: Vec<SandboxInfo> = client.json(client.get("/v1/sandboxes").query(&query))?;
            println!(
                "{:<20} {:<10} {:<20} {:<8} {:>10}",
                "ID", "BACKEND", "IMAGE", "STATE", "MEMORY"
            );
            for s in list {
                println!(
                    "{:<20} {:<10} {:<20} {:<8} {:>10}",
                    s.id,
                    s.backend,
                    s.image,
                    s.state.as_str(),
                    human_size(s.usage.memory_bytes)
                );
            }
            Ok(())
        }
        Cmd::Exec {
            id,
            timeout,
            user,
            cmd,
            remote,
        } => {
            let client = Client::new(remote)?;
            let body = serde_json::json!({"cmd": cmd, "timeout_s": timeout, "user": user});
            let result: CommandResult =
                client.json(client.post(&format!("/v1/sandboxes/{id}/exec")).json(&body))?;
            std::io::stdout().write_all(result.stdout.as_bytes())?;
            std::io::stderr().write_all(result.stderr.as_bytes())?;
            if result.exit.timed_out {
                bail!("command timed out");
            }
            std::process::exit(result.exit.exit_code.unwrap_or(1));
        }
        Cmd::Log { id, json, remote } => {
            let client = Client::new(remote)?;
            let path = format!("/v1/sandboxes/{id}/log");
            if json {
                let log: serde_json::Value = client.json(client.get(&path))?;
                println!("{}", serde_json::to_string_pretty(&log)?);
                return Ok(());
            }
            let log: SandboxLog = client.json(client.get(&path))?;
            print_log(&log);
            Ok(())
        }
        Cmd::Replay { id, remote } => {
            let client = Client::new(remote)?;
            let log: SandboxLog = client.json(client.get(&format!("/v1/sandboxes/{id}/log")))?;
            if replay::replay(&client, &log)? {
                Ok(())
            } else {
                std::process::exit(1);
            }
        }
        Cmd::Rm { ids, remote } => {
            let client = Client::new(remote)?;
            for id in ids {
                client.empty(client.delete(&format!("/v1/sandboxes/{id}")))?;
            }
            Ok(())
        }
        Cmd::Events(args) => events::run(args),
        Cmd::Top(args) => top::run(args),
        Cmd::Zygote => unreachable!("handled before"),
    }
}

fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

fn read_token(path: Option<&PathBuf>) -> Result<Option<String>> {
    let Some(path) = path else { return Ok(None) };
    let token = std::fs::read_to_string(path)
        .with_context(|| format!("reading token file {}", path.display()))?
        .trim()
        .to_owned();
    if token.is_empty() {
        bail!("token file {} is empty", path.display());
    }
    Ok(Some(token))
}

fn edge(args: EdgeArgs) -> Result<()> {
    let name = match &args.serve.edge_name {
        Some(name) => name.clone(),
        None => hostname(),
    };
    dsec_fleet::check_edge_name(&name)?;
    let advertise = args
        .advertise
        .clone()
        .unwrap_or_else(|| format!("http://{}", args.serve.listen));
    if !(advertise.starts_with("http://") || advertise.starts_with("https://")) {
        bail!("--advertise {advertise:?} must be an http:// or https:// URL");
    }
    let e2b = edge_e2b(&args.serve, &advertise)?;
    let mut membership =
        dsec_fleet::EdgeMembership::new(args.etcd, name.clone(), advertise, args.lease_ttl);
    if let Some(e2b) = e2b {
        membership = membership.with_e2b(e2b);
    }
    let mut serve_args = args.serve;
    serve_args.edge_name = Some(name);
    serve(serve_args, Some(std::sync::Arc::new(membership)))
}

/// Where an edge's E2B listeners are reached, for its etcd record: each listener's address,
/// its host taken from `--advertise` when it listens on every interface. Both or neither:
/// apiservers forward the e2b SDK's control-plane and envd requests alike.
fn edge_e2b(args: &ServeArgs, advertise: &str) -> Result<Option<dsec_fleet::EdgeE2b>> {
    let (api, envd) = match (args.e2b_listen, args.e2b_envd_listen) {
        (None, None) => return Ok(None),
        (Some(api), Some(envd)) => (api, envd),
        _ => bail!(
            "dsec edge serves E2B with both --e2b-listen and --e2b-envd-listen, or neither: \
             apiservers forward the e2b SDK's control-plane and envd requests to its edge"
        ),
    };
    let advertised =
        reqwest::Url::parse(advertise).with_context(|| format!("--advertise {advertise:?}"))?;
    let url = |addr: SocketAddr| match advertised.host_str() {
        Some(host) if addr.ip().is_unspecified() => format!("http://{host}:{}", addr.port()),
        _ => format!("http://{addr}"),
    };
    Ok(Some(dsec_fleet::EdgeE2b {
        api_url: url(api),
        envd_url: url(envd),
        backend: args.e2b_backend.clone(),
    }))
}

/// The host name, as gethostname(2) reads it (the kernel's `uname` node name).
fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

fn apiserver(args: ApiserverArgs) -> Result<()> {
    init_logging();
    let config = dsec_fleet::apiserver::ApiserverConfig {
        listen: args.listen,
        token: read_token(args.token_file.as_ref())?,
        edge_token: read_token(args.edge_token_file.as_ref())?,
        choices: args.choices.into(),
        max_upload_bytes: args.max_upload_mb << 20,
        trajectory_db: args.trajectory_db,
        e2b_listen: args.e2b_listen,
        e2b_envd_listen: args.e2b_envd_listen,
    };
    if let Some(db) = &config.trajectory_db {
        if !db.starts_with("postgres://") && !db.starts_with("postgresql://") {
            bail!("--trajectory-db of an apiserver must be the fleet's PostgreSQL log (postgres://…), got {db:?}");
        }
    }
    let runtime = server_runtime()?;
    runtime.block_on(async {
        let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .context("installing the metrics recorder")?;
        let table = dsec_fleet::EdgeTable::watch(args.etcd.clone()).await?;
        let projects = dsec_fleet::projects::FleetProjects::watch(args.etcd).await?;
        let mut fleet = dsec_fleet::apiserver::Fleet::new(table, &config, Some(metrics))
            .with_projects(projects);
        if let Some(db) = &config.trajectory_db {
            fleet = fleet.with_log(dsec_trajectory::TrajectoryLog::read_only(db).await?);
        }
        dsec_fleet::apiserver::serve(config, fleet).await
    })
}

fn print_edges(edges: &[dsec_fleet::EdgeRecord]) {
    println!(
        "{:<16} {:<28} {:<36} {:>9} {:>8} {:>15} {:>9} {:>5}",
        "NAME", "ADDRESS", "BACKENDS", "SANDBOXES", "CREATING", "MEMORY MiB", "FREE MiB", "CPU"
    );
    for e in edges {
        let l = &e.load;
        println!(
            "{:<16} {:<28} {:<36} {:>9} {:>8} {:>15} {:>9} {:>5.2}{}",
            e.name,
            e.url,
            l.backends.join(","),
            l.sandbox_count,
            l.creating,
            format!("{}/{}", l.memory_promised_mb, l.memory_budget_mb),
            l.free_memory_mb,
            l.cpu_load,
            if e.ready { "" } else { "  (starting)" }
        );
    }
}

fn serve(
    args: ServeArgs,
    membership: Option<std::sync::Arc<dyn dsec_server::Membership>>,
) -> Result<()> {
    init_logging();
    let token = read_token(args.token_file.as_ref())?;
    let config = ServerConfig {
        listen: args.listen,
        state_dir: args.state_dir,
        token,
        max_upload_bytes: args.max_upload_mb << 20,
        edge: EdgeConfig {
            name: args.edge_name.unwrap_or_else(|| "e0".to_owned()),
            cpus: args.default_cpus,
            memory_mb: args.default_memory_mb,
            pids: args.default_pids,
            disk_mb: args.default_disk_mb,
            timeout_s: args.default_timeout_s,
            max_output_bytes: args.max_output_bytes,
            files: FileLimits {
                max_read_bytes: args.max_file_mb << 20,
                max_write_bytes: (args.max_file_mb << 20).min((args.max_upload_mb as u64) << 20),
            },
        },
        trajectory_db: args.trajectory_db,
        trajectory: LogConfig {
            sync: args.trajectory_sync,
            budgets: Budgets {
                output_bytes: args.trajectory_output_bytes,
                sandbox_bytes: args.trajectory_sandbox_mb << 20,
                total_bytes: args.trajectory_max_mb << 20,
            },
        },
        net_pool: args.net_pool,
        watcher: match &args.watcher_config {
            Some(path) => dsec_server::watcher::WatcherConfig::load(path)?,
            None => Default::default(),
        },
        events: dsec_server::events::EventsConfig {
            max_bytes: args.events_max_mb << 20,
            max_age: std::time::Duration::from_secs_f64(args.events_max_age_h * 3600.0),
            enabled: !args.no_events,
            ..Default::default()
        },
        fncall: PoolConfig {
            min_warm: args.fncall_min_warm,
            max_warm: args.fncall_max_warm.max(1),
            max_total: args.fncall_max_total.max(1),
        },
        admission: AdmissionConfig {
            memory_overcommit: args.memory_overcommit,
            pids_overcommit: args.pids_overcommit,
            host_reserve_mb: args.host_reserve_mb,
            host_reserve_pids: args.host_reserve_pids,
        },
        vm: VmConfig {
            agent: args.vm_agent,
            kernel: KernelSource {
                kernel: args.vm_kernel,
                modules: args.vm_modules,
            },
            base_fs: args.vm_base_fs,
            boot: args.vm_boot,
            accel: args.vm_accel,
            pause: args.vm_pause,
        },
        e2b: E2bConfig {
            listen: args.e2b_listen,
            envd_listen: args.e2b_envd_listen,
            backend: args.e2b_backend,
            debug_template: args.e2b_debug_template,
        },
        layer_store: args.layer_store,
        registry: args.registry,
        import_roots: args.import_roots,
        import_registries: args.import_registries,
        protect: args.protect,
        sandboxfusion: SandboxFusionConfig {
            listen: args.sandboxfusion_listen,
            image: args.sandboxfusion_image,
            language_images: args.sandboxfusion_language_images.into_iter().collect(),
            default_memory_mb: args.sandboxfusion_memory_mb,
        },
    };
    if let Err(e) = config.sandboxfusion.validate() {
        bail!("--sandboxfusion-language-image: {e}");
    }
    // Command output lives in buffers of up to --max-output-bytes per stream. glibc would
    // raise its mmap threshold after the first such buffer is freed and keep the next ones
    // in its heaps for good; a fixed threshold keeps them in mmaps that go back to the OS
    // when the response is sent, so a burst of floods does not ratchet the server's RSS.
    // SAFETY: mallopt takes integer arguments; called before any other thread exists.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20) };
    // Still single-threaded here: lock the state dir, settle cgroups, start the zygote.
    let exe = std::env::current_exe().context("locating the dsec binary")?;
    let host = HostSetup::prepare(&config, &exe)?;
    let runtime = server_runtime()?;
    runtime.block_on(dsec_server::run_with(config, host, membership))?;
    Ok(())
}

fn print_log(log: &SandboxLog) {
    let s = &log.sandbox;
    println!(
        "sandbox {}  backend {}  image {}  trajectory {}  log {}",
        s.id,
        s.backend,
        s.image,
        s.trajectory_id.as_deref().unwrap_or("-"),
        human_size(log.bytes)
    );
    println!(
        "{:>6} {:>6} {:>10} {:>10}  COMMAND",
        "STEP", "EXIT", "DURATION", "OUTPUT"
    );
    for step in &log.steps {
        let r = &step.result;
        let exit = match (r.exit.exit_code, r.exit.timed_out) {
            _ if r.running => "running".to_owned(),
            (_, true) => "timeout".to_owned(),
            (Some(c), _) => c.to_string(),
            (None, _) => "-".to_owned(),
        };
        println!(
            "{:>6} {:>6} {:>8.1}ms {:>10}  {}",
            step.step,
            exit,
            r.exit.duration_ms,
            human_size(r.stdout_bytes + r.stderr_bytes),
            step_text(step)
        );
        for (name, bytes, elided, sha256) in [
            ("stdout", r.stdout_bytes, r.stdout_elided, &r.stdout_sha256),
            ("stderr", r.stderr_bytes, r.stderr_elided, &r.stderr_sha256),
        ] {
            if elided > 0 {
                println!(
                    "{:>25}  {name}: {bytes} bytes, {elided} not kept by the log ({sha256})",
                    ""
                );
            }
        }
    }
}

/// What a step did, in a line: a run's command, or what a process step did to which
/// process (named by the step that spawned it).
fn step_text(step: &dsec_trajectory::Step) -> String {
    use dsec_trajectory::StepKind;
    let req = &step.request;
    let p = req.process.clone().unwrap_or_default();
    let of = p
        .spawn_step
        .map_or_else(String::new, |n| format!("process of step {n}"));
    match req.kind {
        StepKind::Run => command_text(&req.argv),
        StepKind::Spawn => {
            let tag = p.tag.map_or_else(String::new, |t| format!(" [{t}]"));
            let pid = step.result.pid.unwrap_or_default();
            format!("spawn{tag} (pid {pid}): {}", command_text(&req.argv))
        }
        StepKind::Stdin => {
            let mut input: String = p.input.chars().take(40).collect();
            if input.len() < p.input.len() || p.input_elided > 0 {
                input += "...";
            }
            format!("stdin to {of}: {} bytes {input:?}", p.input_bytes)
        }
        StepKind::CloseStdin => format!("close stdin of {of}"),
        StepKind::Signal => format!("signal {} to {of}", p.signal.unwrap_or_default()),
        StepKind::Kill => format!("kill {of}"),
        StepKind::Resize => {
            let [cols, rows] = p.pty.unwrap_or_default();
            format!("resize {of} to {cols}x{rows}")
        }
    }
}

/// A recorded argv as the user most likely typed it.
fn command_text(argv: &[String]) -> String {
    match argv {
        [sh, c, cmd] if sh == "/bin/sh" && c == "-c" => cmd.clone(),
        _ => serde_json::to_string(argv).unwrap_or_default(),
    }
}

/// `POST /v1/images` with a progress bar of its layers (on a terminal; plain lines
/// otherwise), from the server's `application/x-ndjson` events.
fn import_with_progress(client: &Client, req: ImportImageRequest) -> Result<ImageInfo> {
    use std::io::BufRead;
    let resp = client.send(
        client
            .post("/v1/images")
            .header(reqwest::header::ACCEPT, "application/x-ndjson")
            .json(&req),
    )?;
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} layers {pos}/{len} [{bar:30}] {msg} ({elapsed})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let (mut bytes, mut reused) = (0u64, 0usize);
    for line in std::io::BufReader::new(resp).lines() {
        let line = line.context("reading the import's progress")?;
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<ImportEvent>(&line)
            .with_context(|| format!("unexpected progress line {line:?}"))?
        {
            ImportEvent::Layers { total } => bar.set_length(total as u64),
            ImportEvent::Layer {
                size,
                reused: was_stored,
                ..
            } => {
                bytes += size;
                reused += usize::from(was_stored);
                bar.set_message(format!("{} ({reused} already stored)", human_size(bytes)));
                bar.inc(1);
            }
            ImportEvent::Done { image } => {
                bar.finish_and_clear();
                return Ok(image);
            }
            ImportEvent::Error { error } => {
                bar.abandon();
                bail!("{} ({})", error.message, error.kind.as_str());
            }
        }
    }
    bar.abandon();
    bail!("the server ended the import without a result")
}

fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn project(client: &Client, command: ProjectCmd) -> Result<()> {
    match command {
        ProjectCmd::Create {
            name,
            max_sandboxes,
            max_cpus,
            max_memory_mb,
        } => {
            let req = dsec_api::CreateProjectRequest {
                name,
                max_sandboxes,
                max_cpus,
                max_memory_mb,
            };
            let made: dsec_api::ProjectToken =
                client.json(client.post("/v1/projects").json(&req))?;
            println!("{}", made.token);
        }
        ProjectCmd::Token { name } => {
            let made: dsec_api::ProjectToken =
                client.json(client.post(&format!("/v1/projects/{name}/tokens")))?;
            println!("{}", made.token);
        }
        ProjectCmd::List => {
            let projects: Vec<dsec_api::ProjectInfo> = client.json(client.get("/v1/projects"))?;
            let limit = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
            println!(
                "{:<24} {:>12} {:>14} {:>18} {:>6}",
                "NAME", "SANDBOXES", "CPUS", "MEMORY_MB", "TOKENS"
            );
            for p in projects {
                let q = p.quotas;
                println!(
                    "{:<24} {:>12} {:>14} {:>18} {:>6}",
                    p.name,
                    format!(
                        "{}/{}",
                        p.usage.sandboxes,
                        limit(q.max_sandboxes.map(|v| v.to_string()))
                    ),
                    format!(
                        "{}/{}",
                        p.usage.cpus,
                        limit(q.max_cpus.map(|v| v.to_string()))
                    ),
                    format!(
                        "{}/{}",
                        p.usage.memory_mb,
                        limit(q.max_memory_mb.map(|v| v.to_string()))
                    ),
                    p.tokens
                );
            }
        }
        ProjectCmd::Delete { name } => {
            client.empty(client.delete(&format!("/v1/projects/{name}")))?;
        }
    }
    Ok(())
}

/// A thin blocking HTTP client for the CLI.
struct Client {
    http: reqwest::blocking::Client,
    base: String,
    token: Option<String>,
}

impl Client {
    fn new(remote: Remote) -> Result<Client> {
        Ok(Client {
            http: reqwest::blocking::Client::builder()
                .timeout(None)
                .build()
                .context("building the HTTP client")?,
            base: remote.url.trim_end_matches('/').to_owned(),
            token: remote.token,
        })
    }

    fn with_auth(
        &self,
        rb: reqwest::blocking::RequestBuilder,
    ) -> reqwest::blocking::RequestBuilder {
        match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        }
    }

    fn get(&self, path: &str) -> reqwest::blocking::RequestBuilder {
        self.with_auth(self.http.get(format!("{}{path}", self.base)))
    }

    fn post(&self, path: &str) -> reqwest::blocking::RequestBuilder {
        self.with_auth(self.http.post(format!("{}{path}", self.base)))
    }

    fn delete(&self, path: &str) -> reqwest::blocking::RequestBuilder {
        self.with_auth(self.http.delete(format!("{}{path}", self.base)))
    }

    fn send(&self, rb: reqwest::blocking::RequestBuilder) -> Result<reqwest::blocking::Response> {
        let resp = rb
            .send()
            .with_context(|| format!("cannot reach the dsec server at {}", self.base))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let text = resp.text().unwrap_or_default();
        match serde_json::from_str::<ErrorBody>(&text) {
            Ok(body) => bail!("{} ({})", body.error.message, body.error.kind.as_str()),
            Err(_) => bail!("server answered {status}: {text}"),
        }
    }

    fn json<T: serde::de::DeserializeOwned>(
        &self,
        rb: reqwest::blocking::RequestBuilder,
    ) -> Result<T> {
        Ok(self.send(rb)?.json()?)
    }

    fn empty(&self, rb: reqwest::blocking::RequestBuilder) -> Result<()> {
        self.send(rb)?;
        Ok(())
    }
}

/// Stack of each async worker thread. Tokio's 2 MiB default is too little for an
/// unoptimized build: a VM create's future (boot, agent handshake, inside the edge's and
/// the handler's) overflowed it. Only touched pages cost memory.
const WORKER_STACK_BYTES: usize = 8 << 20;

/// The multi-threaded runtime the server roles run on.
fn server_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(WORKER_STACK_BYTES)
        .build()
        .context("starting the async runtime")
}
