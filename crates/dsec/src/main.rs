//! The `dsec` command: runs the server, and talks to one over HTTP.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use dsec_api::{
    CommandResult, CreateSandboxRequest, ErrorBody, ImageInfo, ImportImageRequest, SandboxInfo,
};
use dsec_server::backend::fncall::PoolConfig;
use dsec_server::backend::vm::{AccelChoice, BootMode, VmConfig};
use dsec_server::edge::EdgeConfig;
use dsec_server::{HostSetup, ServerConfig};
use dsec_trajectory::SandboxLog;
use dsec_vm::assets::KernelSource;
use dsec_vm::disk::BaseFs;

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
    Serve(ServeArgs),
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
    /// Run a command in a sandbox; exits with the command's status.
    Exec {
        /// Sandbox id.
        id: String,
        /// Timeout in seconds.
        #[arg(long)]
        timeout: Option<f64>,
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
    /// Largest request body in MiB (uploads, exec files and stdin).
    #[arg(long, default_value_t = 256)]
    max_upload_mb: usize,
    /// Prefix of sandbox ids, naming this edge.
    #[arg(long, default_value = "e0")]
    edge_name: String,
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
    /// Private IPv4 network (a /12 to /28) that sandboxes with a network get their
    /// addresses from; the first address is the bridge's (and dsec's DNS resolver's).
    #[arg(long, default_value = dsec_net::DEFAULT_POOL, value_parser = dsec_net::parse_pool)]
    net_pool: (std::net::Ipv4Addr, u8),
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
    /// VM backends: `auto` uses KVM when a probe guest boots under it, else TCG.
    #[arg(long, default_value = "auto", value_parser = parse_accel)]
    vm_accel: AccelChoice,
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
    /// List images.
    Ls,
    /// Delete an image.
    Rm {
        /// Image name.
        name: String,
    },
}

fn parse_sync(s: &str) -> Result<dsec_trajectory::SyncMode, String> {
    match s {
        "full" => Ok(dsec_trajectory::SyncMode::Full),
        "normal" => Ok(dsec_trajectory::SyncMode::Normal),
        _ => Err(format!("{s:?} is not full or normal")),
    }
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

fn parse_accel(s: &str) -> Result<AccelChoice, String> {
    match s {
        "auto" => Ok(AccelChoice::Auto),
        "kvm" => Ok(AccelChoice::Kvm),
        "tcg" => Ok(AccelChoice::Tcg),
        _ => Err(format!("{s:?} is not auto, kvm or tcg")),
    }
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("label {s:?} must look like key=value"))
}

fn main() {
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
        Cmd::Serve(args) => serve(args),
        Cmd::Image { command, remote } => {
            let client = Client::new(remote)?;
            match command {
                ImageCmd::Import { source, name } => {
                    let image: ImageInfo = client.json(
                        client
                            .post("/v1/images")
                            .json(&ImportImageRequest { source, name }),
                    )?;
                    println!("{} {} {}", image.name, image.id, human_size(image.size));
                }
                ImageCmd::Ls => {
                    let images: Vec<ImageInfo> = client.json(client.get("/v1/images"))?;
                    println!("{:<32} {:<20} {:>10}", "NAME", "ID", "SIZE");
                    for i in images {
                        let short = i.id.trim_start_matches("sha256:").get(..12).unwrap_or("");
                        println!("{:<32} {:<20} {:>10}", i.name, short, human_size(i.size));
                    }
                }
                ImageCmd::Rm { name } => {
                    client.empty(client.delete(&format!("/v1/images/{name}")))?;
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
            cmd,
            remote,
        } => {
            let client = Client::new(remote)?;
            let body = serde_json::json!({"cmd": cmd, "timeout_s": timeout});
            let result: CommandResult =
                client.json(client.post(&format!("/v1/sandboxes/{id}/exec")).json(&body))?;
            std::io::stdout().write_all(result.stdout.as_bytes())?;
            std::io::stderr().write_all(result.stderr.as_bytes())?;
            if result.timed_out {
                bail!("command timed out");
            }
            std::process::exit(result.exit_code.unwrap_or(1));
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
            if replay(&client, &log)? {
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
        Cmd::Zygote => unreachable!("handled before"),
    }
}

fn serve(args: ServeArgs) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let token = match &args.token_file {
        Some(path) => {
            let token = std::fs::read_to_string(path)
                .with_context(|| format!("reading token file {}", path.display()))?
                .trim()
                .to_owned();
            if token.is_empty() {
                bail!("token file {} is empty", path.display());
            }
            Some(token)
        }
        None => None,
    };
    let config = ServerConfig {
        listen: args.listen,
        state_dir: args.state_dir,
        token,
        max_upload_bytes: args.max_upload_mb << 20,
        edge: EdgeConfig {
            name: args.edge_name,
            cpus: args.default_cpus,
            memory_mb: args.default_memory_mb,
            pids: args.default_pids,
            disk_mb: args.default_disk_mb,
            timeout_s: args.default_timeout_s,
            max_output_bytes: args.max_output_bytes,
        },
        trajectory_sync: args.trajectory_sync,
        net_pool: args.net_pool,
        fncall: PoolConfig {
            min_warm: args.fncall_min_warm,
            max_warm: args.fncall_max_warm.max(1),
            max_total: args.fncall_max_total.max(1),
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
        },
    };
    // Command output lives in buffers of up to --max-output-bytes per stream. glibc would
    // raise its mmap threshold after the first such buffer is freed and keep the next ones
    // in its heaps for good; a fixed threshold keeps them in mmaps that go back to the OS
    // when the response is sent, so a burst of floods does not ratchet the server's RSS.
    // SAFETY: mallopt takes integer arguments; called before any other thread exists.
    unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20) };
    // Still single-threaded here: lock the state dir, settle cgroups, start the zygote.
    let exe = std::env::current_exe().context("locating the dsec binary")?;
    let host = HostSetup::prepare(&config, &exe)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(dsec_server::run(config, host))?;
    Ok(())
}

fn print_log(log: &SandboxLog) {
    let s = &log.sandbox;
    println!(
        "sandbox {}  backend {}  image {}  trajectory {}",
        s.id,
        s.backend,
        s.image,
        s.trajectory_id.as_deref().unwrap_or("-")
    );
    println!("{:>6} {:>6} {:>10}  COMMAND", "STEP", "EXIT", "DURATION");
    for step in &log.steps {
        let r = &step.result;
        let exit = match (r.exit_code, r.timed_out) {
            (_, true) => "timeout".to_owned(),
            (Some(c), _) => c.to_string(),
            (None, _) => "-".to_owned(),
        };
        println!(
            "{:>6} {:>6} {:>8.1}ms  {}",
            step.step,
            exit,
            r.duration_ms,
            command_text(&step.request.argv)
        );
    }
}

/// A recorded argv as the user most likely typed it.
fn command_text(argv: &[String]) -> String {
    match argv {
        [sh, c, cmd] if sh == "/bin/sh" && c == "-c" => cmd.clone(),
        _ => serde_json::to_string(argv).unwrap_or_default(),
    }
}

/// Re-runs `log` in a fresh sandbox; `true` when every step's output matched.
fn replay(client: &Client, log: &SandboxLog) -> Result<bool> {
    let rec = &log.sandbox;
    let req = CreateSandboxRequest {
        backend: rec.backend.clone(),
        image: rec.image.clone(),
        cpus: None,
        memory_mb: None,
        pids: None,
        disk_mb: None,
        ttl_s: None,
        idle_ttl_s: None,
        env: rec.env.clone(),
        workdir: None,
        network: Default::default(),
        ca_bundle: None,
        labels: BTreeMap::from([("dsec.replay-of".to_owned(), rec.id.clone())]),
        trajectory_id: None,
    };
    let info: SandboxInfo = client.json(client.post("/v1/sandboxes").json(&req))?;
    eprintln!(
        "replaying {} steps of {} in {} ({}, image {})",
        log.steps.len(),
        rec.id,
        info.id,
        rec.backend,
        rec.image
    );
    let outcome = replay_steps(client, &info.id, &log.steps);
    let stopped = client.empty(client.delete(&format!("/v1/sandboxes/{}", info.id)));
    let matched = outcome?;
    stopped.with_context(|| format!("stopping replay sandbox {}", info.id))?;
    Ok(matched)
}

fn replay_steps(client: &Client, sandbox: &str, steps: &[dsec_trajectory::Step]) -> Result<bool> {
    for step in steps {
        let req = &step.request;
        if req.stdin_sha256.is_some() || !req.files.is_empty() {
            println!(
                "step {}: cannot be replayed: its stdin and files were recorded as digests                  only; the {} steps before it match",
                step.step, step.step
            );
            return Ok(false);
        }
        let body = serde_json::json!({
            "cmd": req.argv, "env": req.env, "cwd": req.cwd, "timeout_s": req.timeout_s,
        });
        let got: CommandResult = client.json(
            client
                .post(&format!("/v1/sandboxes/{sandbox}/exec"))
                .json(&body),
        )?;
        let want = &step.result;
        let mut diffs = Vec::new();
        if got.exit_code != want.exit_code {
            diffs.push(format!(
                "exit code {:?} (recorded {:?})",
                got.exit_code, want.exit_code
            ));
        }
        for (name, got, want) in [
            ("stdout", &got.stdout, &want.stdout),
            ("stderr", &got.stderr, &want.stderr),
        ] {
            if got != want {
                diffs.push(format!("{name} {got:?} (recorded {want:?})"));
            }
        }
        if !diffs.is_empty() {
            println!(
                "step {} differs: {}
  command: {}",
                step.step,
                diffs.join("; "),
                command_text(&req.argv)
            );
            return Ok(false);
        }
    }
    println!("all {} steps match", steps.len());
    Ok(true)
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
