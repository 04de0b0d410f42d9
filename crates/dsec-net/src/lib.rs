//! Sandbox networking for the native container backend and the VM backends (whose
//! QEMU's network namespace is plugged in as a container's is; see `dsec_vm::qemu`).
//!
//! One bridge per server (`dsec<tag>`, the pool's first address), one veth pair per
//! sandbox with a network (`dv<tag><n>` on the host, `eth0` in the sandbox), NAT for
//! outbound traffic, and an egress policy per sandbox in nftables (module `nft` explains the
//! layout). Domain names in allow-lists are enforced through dsec's own resolver
//! (module `dns`), which answers only allowed names and opens the answered addresses, and by a
//! proxy (module `proxy`) that checks the name each HTTP or TLS connection to those addresses
//! carries; refusals become events (module `events`).
//!
//! Every host object carries this server's tag, and the server holds a record of the tag
//! outside its state directory while they exist (module `record`): any dsec server starting
//! on the host removes what a dead server left (SIGKILL, OOM, a crash), whatever state
//! directory either used, and never touches a live server's objects or anything not
//! dsec's. The resolver and the proxy cap what each sandbox may hold of them (module
//! `limits`), and the kernel caps its conntrack entries and opened addresses (`nft`).
#![warn(missing_docs)]

mod dns;
mod events;
mod limits;
mod netlink;
mod nft;
pub mod policy;
mod proxy;
mod record;

use std::collections::HashSet;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub use events::Refused;
pub use policy::{Policy, Rule, RuleError};

use crate::dns::{Clients, Resolver};
use crate::netlink::Rtnl;
use crate::nft::Names;
use crate::record::{Owner, Record, Registry};

/// The first default address pool: private, and unlikely to be used by anything else on
/// a host. When a host route overlaps it (another dsec server's bridge, say), a server
/// without `--net-pool` takes the next free /16 of [`DEFAULT_RANGE`].
pub const DEFAULT_POOL: &str = "10.209.0.0/16";

/// Where the default pool is chosen from: its /16s, from [`DEFAULT_POOL`] on.
pub const DEFAULT_RANGE: &str = "10.208.0.0/12";

/// The default pools in the order they are tried: 10.209, 10.210, ... 10.223, 10.208.
fn default_pools() -> impl Iterator<Item = (Ipv4Addr, u8)> {
    (1..=16u8).map(|k| (Ipv4Addr::new(10, 208 + k % 16, 0, 0), 16))
}

/// Where a sandbox's own DNS configuration is written.
pub const RESOLV_CONF: &str = "/etc/resolv.conf";

/// The host's CA bundle, offered to sandboxes with a network.
pub const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A networking operation failed.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// This host cannot give sandboxes a network; the reason says why.
    #[error("sandbox networking is unavailable on this server: {0}")]
    Unavailable(String),
    /// An allow-list entry is malformed.
    #[error(transparent)]
    Rule(#[from] RuleError),
    /// Every address of the pool is in use.
    #[error("the sandbox address pool {0} is exhausted")]
    Exhausted(String),
    /// An nftables transaction failed.
    #[error("nftables: {0}")]
    Nft(String),
    /// A netlink request failed.
    #[error("{action}: {source}")]
    Netlink {
        /// What was being done.
        action: String,
        /// The OS error.
        source: std::io::Error,
    },
}

fn nl_err(action: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetError {
    let action = action.into();
    move |source| NetError::Netlink { action, source }
}

/// Parses `a.b.c.d/len` with a prefix of 12 to 28 bits into (network, prefix).
pub fn parse_pool(pool: &str) -> Result<(Ipv4Addr, u8), String> {
    let bad = || format!("{pool:?} is not an IPv4 network with a /12 to /28 prefix");
    let (addr, prefix) = pool.split_once('/').ok_or_else(bad)?;
    let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
    let prefix: u8 = prefix.parse().map_err(|_| bad())?;
    if !(12..=28).contains(&prefix) {
        return Err(bad());
    }
    let mask = u32::MAX << (32 - prefix);
    Ok((Ipv4Addr::from(u32::from(addr) & mask), prefix))
}

/// The server's networking: running, or the reason it could not start.
pub struct Networking {
    state: Result<Arc<Active>, String>,
    tag: String,
    /// This server's record (module `record`), held while objects of its tag may exist.
    record: Mutex<Option<Record>>,
}

struct Active {
    names: Names,
    /// Applies the sandboxes' rules, many in one transaction.
    nft: nft::Batcher,
    bridge_index: i32,
    gateway: Ipv4Addr,
    pool: (Ipv4Addr, u8),
    clients: Clients,
    used: Mutex<(HashSet<u32>, u32)>,
    /// Source of policy generations (conntrack marks; see `nft::rules`).
    generation: AtomicU32,
    /// Connections the name-checking proxy refused.
    refused_by_proxy: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Refused-connection events by chain number.
    refused: events::Log,
    /// Tells the event reader to stop.
    stop: Arc<AtomicBool>,
}

/// One sandbox's place on the network: its address, veth and policy.
pub struct Attachment {
    active: Arc<Active>,
    n: u32,
    ip: Ipv4Addr,
    veth: String,
}

fn bridge_name(tag: &str) -> String {
    format!("dsec{tag}")
}

fn veth_prefix(tag: &str) -> String {
    format!("dv{tag}")
}

/// The first nflog group tried for server `tag`'s refused-packet events (`0x6400`-`0x64ff`).
fn log_group(tag: &str) -> u16 {
    0x6400 | (u32::from_str_radix(tag, 16).unwrap_or(0) & 0xff) as u16
}

fn table_name(tag: &str) -> String {
    format!("dsec_{tag}")
}

/// `iptables` chains that may hold our accept rules (see [`allow_through_iptables`]).
const IPTABLES_CHAINS: [&str; 2] = ["DOCKER-USER", "FORWARD"];

fn iptables(args: &[&str]) -> Option<String> {
    let out = Command::new("iptables")
        .arg("-w")
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A host whose iptables `FORWARD` policy is DROP (Docker sets that) would drop every
/// forwarded sandbox packet whatever dsec's own table allows. dsec then adds two accept
/// rules, commented with its table name, to `DOCKER-USER` (Docker's place for them) or
/// else `FORWARD`; its own forward chain has already refused what the policies refuse.
fn allow_through_iptables(bridge: &str, table: &str) -> Result<(), String> {
    let Some(forward) = iptables(&["-S", "FORWARD"]) else {
        return Ok(());
    };
    if !forward.lines().any(|l| l.trim() == "-P FORWARD DROP") {
        return Ok(());
    }
    let chain = if iptables(&["-S", "DOCKER-USER"]).is_some() {
        "DOCKER-USER"
    } else {
        "FORWARD"
    };
    let rules: [&[&str]; 2] = [
        &["-i", bridge],
        &[
            "-o",
            bridge,
            "-m",
            "conntrack",
            "--ctstate",
            "RELATED,ESTABLISHED",
        ],
    ];
    for rule in rules {
        let mut args = vec!["-I", chain, "1"];
        args.extend_from_slice(rule);
        args.extend_from_slice(&["-m", "comment", "--comment", table, "-j", "ACCEPT"]);
        iptables(&args).ok_or_else(|| {
            format!("the host's iptables FORWARD policy is DROP and adding an accept rule to {chain} failed")
        })?;
    }
    Ok(())
}

/// Removes everything of server `tag` from the host, by name only: veths, the bridge, the
/// nftables tables, the iptables rules carrying its comment.
fn remove_host_state(tag: &str) {
    let (bridge, prefix, table) = (bridge_name(tag), veth_prefix(tag), table_name(tag));
    if let Ok(mut rtnl) = Rtnl::open() {
        let links: Vec<String> = rtnl
            .link_names()
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n.starts_with(&prefix) || *n == bridge)
            .collect();
        for link in links {
            if let Ok(i) = netlink::index(&link) {
                if let Err(e) = rtnl.delete(i) {
                    tracing::warn!(link, error = %e, "removing interface");
                }
            }
        }
    }
    let tables = nft::query(&["list", "tables"]).unwrap_or_default();
    for family in ["inet", "bridge"] {
        if tables
            .lines()
            .any(|l| l.trim() == format!("table {family} {table}"))
        {
            if let Err(e) = nft::apply(&format!("delete table {family} {table}\n")) {
                tracing::warn!(error = %e, "removing nftables table");
            }
        }
    }
    for chain in IPTABLES_CHAINS {
        let Some(rules) = iptables(&["-S", chain]) else {
            continue;
        };
        for rule in rules
            .lines()
            .filter(|l| l.starts_with("-A ") && l.split_whitespace().any(|w| w == table.as_str()))
        {
            let mut args: Vec<&str> = rule.split_whitespace().collect();
            args[0] = "-D";
            iptables(&args);
        }
    }
}

/// A route of the host.
struct Route {
    net: Ipv4Addr,
    prefix: u32,
    dev: String,
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} on {}", self.net, self.prefix, self.dev)
    }
}

/// A route of the host that overlaps `pool`.
fn overlapping_route(pool: (Ipv4Addr, u8)) -> Option<Route> {
    let table = std::fs::read_to_string("/proc/net/route").ok()?;
    let pool_lo = u32::from(pool.0);
    let pool_hi = pool_lo | !(u32::MAX << (32 - pool.1));
    for line in table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 {
            continue;
        }
        // The kernel prints the address's bytes as a host-order number.
        let hex = |s: &str| {
            u32::from_str_radix(s, 16)
                .ok()
                .map(|v| u32::from(Ipv4Addr::from(v.to_ne_bytes())))
        };
        let (Some(dst), Some(mask)) = (hex(f[1]), hex(f[7])) else {
            continue;
        };
        if mask == 0 {
            continue; // the default route overlaps everything by design
        }
        let lo = dst & mask;
        let hi = lo | !mask;
        if lo <= pool_hi && pool_lo <= hi {
            return Some(Route {
                net: Ipv4Addr::from(lo),
                prefix: mask.count_ones(),
                dev: f[0].to_owned(),
            });
        }
    }
    None
}

/// Who owns `route`, when it is another dsec server's bridge, for messages.
fn route_owner(route: &Route, registry: &Registry) -> String {
    let Some(tag) = route.dev.strip_prefix("dsec").filter(|t| record::is_tag(t)) else {
        return String::new();
    };
    match registry.live().into_iter().find(|l| l.tag == tag) {
        Some(live) => format!(
            " (the bridge of a live dsec server: {})",
            record::describe(live.owner.as_ref())
        ),
        None => format!(
            " (a dsec bridge that no live server on this host has recorded: one of an older \
             dsec, or of a server in another mount namespace; if none uses it, \
             `ip link del {}` removes it)",
            route.dev
        ),
    }
}

/// The pool to use: `explicit` if no host route overlaps it, else the first free default.
fn choose_pool(
    explicit: Option<(Ipv4Addr, u8)>,
    registry: &Registry,
) -> Result<(Ipv4Addr, u8), String> {
    let text = |p: (Ipv4Addr, u8)| format!("{}/{}", p.0, p.1);
    if let Some(pool) = explicit {
        return match overlapping_route(pool) {
            None => Ok(pool),
            Some(route) => Err(format!(
                "the address pool {} overlaps the host's route {route}{}; choose another with \
                 --net-pool, or leave it out to get a free one",
                text(pool),
                route_owner(&route, registry)
            )),
        };
    }
    let mut taken = Vec::new();
    for pool in default_pools() {
        match overlapping_route(pool) {
            None => {
                if let Some(first) = taken.first() {
                    tracing::info!(pool = %text(pool), taken = %first,
                        "the default address pool is taken: using the next free one");
                }
                return Ok(pool);
            }
            Some(route) => taken.push(format!(
                "{} ({route}{})",
                text(pool),
                route_owner(&route, registry)
            )),
        }
    }
    Err(format!(
        "every /16 of the default range {DEFAULT_RANGE} overlaps a host route (first: {}); \
         choose a pool with --net-pool",
        taken.first().map_or("", String::as_str)
    ))
}

const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// Makes the host forward IPv4, which sandbox traffic needs, as dockerd does when it
/// starts. When dsec is the one to switch it on, it first sets the iptables `FORWARD`
/// policy to DROP (dockerd does that too), so the host does not start routing between
/// its other interfaces; dsec's bridge then passes by the accept rules
/// [`allow_through_iptables`] adds. Forwarding stays on after dsec stops: other software
/// that started meanwhile (dockerd) may rely on it, as it would on dockerd's.
fn ensure_forwarding() -> Result<(), String> {
    let now =
        std::fs::read_to_string(IP_FORWARD).map_err(|e| format!("reading {IP_FORWARD}: {e}"))?;
    if now.trim() == "1" {
        return Ok(());
    }
    let dropping = iptables(&["-P", "FORWARD", "DROP"]).is_some();
    std::fs::write(IP_FORWARD, "1").map_err(|e| {
        format!("IP forwarding is off on this host (net.ipv4.ip_forward=0) and switching it on failed: {e}")
    })?;
    if dropping {
        tracing::info!(
            "switched IP forwarding on (net.ipv4.ip_forward=1) for sandbox networking, \
            as dockerd does, after setting the iptables FORWARD policy to DROP; it stays on"
        );
    } else {
        tracing::warn!(
            "switched IP forwarding on (net.ipv4.ip_forward=1) for sandbox networking, \
            but could not set the iptables FORWARD policy to DROP (is iptables installed?): \
            this host now also routes between its other interfaces"
        );
    }
    Ok(())
}

/// What start-up made on the host: handed from its blocking part to the async one.
struct Made {
    record: Record,
    bridge_index: i32,
    names: Names,
    pool: (Ipv4Addr, u8),
    proxy: std::net::TcpListener,
}

/// Claims `tag`, removes what this server and dead ones left, and makes the bridge and the
/// tables, all under the records lock. On failure nothing of `tag` is left; `Err` says
/// why.
fn make_host_state(
    tag: &str,
    explicit: Option<(Ipv4Addr, u8)>,
    state_dir: &str,
    mut names: Names,
    protected: &[Ipv4Addr],
) -> Result<Made, String> {
    let registry = Registry::lock(Path::new(record::DIR))
        .map_err(|e| format!("locking {}: {e}", record::DIR))?;
    let mut owner = Owner {
        pid: std::process::id(),
        netns: record::netns_id(),
        state_dir: state_dir.to_owned(),
        pool: None,
    };
    let record = registry.claim(tag, &owner)?;
    remove_host_state(tag);
    for (dead, was, left) in registry.dead(&owner.netns) {
        remove_host_state(&dead);
        left.remove(&registry);
        tracing::info!(tag = %dead, owner = %record::describe(was.as_ref()),
            "removed the networking a dead dsec server left");
    }
    let made = (|| {
        if nft::query(&["--version"]).is_none() {
            return Err("the nft command (nftables) is not installed".to_owned());
        }
        ensure_forwarding()?;
        let pool = choose_pool(explicit, &registry)?;
        let gateway = Ipv4Addr::from(u32::from(pool.0) + 1);
        let mut rtnl = Rtnl::open().map_err(|e| format!("netlink: {e}"))?;
        rtnl.add_bridge(&names.bridge)
            .map_err(|e| format!("creating bridge {}: {e}", names.bridge))?;
        let index = netlink::index(&names.bridge).map_err(|e| format!("bridge index: {e}"))?;
        rtnl.add_addr(index, gateway, pool.1)
            .map_err(|e| format!("addressing bridge {}: {e}", names.bridge))?;
        // The proxy's port goes into the rules, so it is bound first.
        let proxy = std::net::TcpListener::bind((gateway, 0))
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| format!("name-checking proxy on {gateway}: {e}"))?;
        names.proxy_port = proxy.local_addr().map_err(|e| e.to_string())?.port();
        nft::apply(&nft::base(
            &names,
            &format!("{}/{}", pool.0, pool.1),
            gateway,
            protected,
        ))
        .map_err(|e| format!("installing nftables rules: {e}"))?;
        allow_through_iptables(&names.bridge, &names.table)?;
        Ok((index, pool, proxy))
    })();
    match made {
        Ok((bridge_index, pool, proxy)) => {
            owner.pool = Some(pool);
            if let Err(e) = record.write(&owner) {
                tracing::warn!(error = %e, "updating the networking record");
            }
            Ok(Made {
                record,
                bridge_index,
                names,
                pool,
                proxy,
            })
        }
        Err(reason) => {
            remove_host_state(tag);
            record.remove(&registry);
            Err(reason)
        }
    }
}

/// Removes everything of `tag` from the host, then its record.
fn release_host_state(tag: &str, record: Record) {
    match Registry::lock(Path::new(record::DIR)) {
        Ok(registry) => {
            remove_host_state(tag);
            record.remove(&registry);
        }
        // The record stays, unlocked: the next server to start finds it dead and removes it.
        Err(e) => {
            tracing::warn!(error = %e, "locking {}", record::DIR);
            remove_host_state(tag);
        }
    }
}

impl Networking {
    /// Claims tag `tag` for this server (module `record`), removes what an earlier run of
    /// it and any dead dsec server left in this network namespace, switches IP forwarding
    /// on if it is off, then sets up the bridge, the nftables tables, the resolver and the
    /// proxy. `pool`: the address pool, used only if free; `None`: the first free /16 of
    /// [`DEFAULT_RANGE`]. `state_dir` is recorded for people. Never fails: a host that
    /// cannot do it gets a `Networking` whose every attach is `Unavailable` with the
    /// reason.
    ///
    /// `protected` are the addresses of the services the server itself relies on (a
    /// fleet's etcd, its registry, its trajectory database): no sandbox reaches them,
    /// whatever its policy allows, so that an agent cannot rewrite the fleet's membership
    /// or the images other sandboxes run.
    pub async fn start(
        tag: &str,
        pool: Option<(Ipv4Addr, u8)>,
        state_dir: &Path,
        protected: Vec<Ipv4Addr>,
    ) -> Networking {
        let state_dir = state_dir.display().to_string();
        let (state, record) = match Self::setup(tag, pool, &state_dir, protected).await {
            Ok((active, record)) => {
                tracing::info!(bridge = %active.names.bridge,
                    pool = %format!("{}/{}", active.pool.0, active.pool.1), "sandbox networking ready");
                (Ok(Arc::new(active)), Some(record))
            }
            Err(reason) => {
                tracing::warn!(%reason, "sandbox networking unavailable");
                (Err(reason), None)
            }
        };
        Networking {
            state,
            tag: tag.to_owned(),
            record: Mutex::new(record),
        }
    }

    async fn setup(
        tag: &str,
        pool: Option<(Ipv4Addr, u8)>,
        state_dir: &str,
        protected: Vec<Ipv4Addr>,
    ) -> Result<(Active, Record), String> {
        let nft =
            nft::Batcher::start().map_err(|e| format!("starting the nftables thread: {e}"))?;
        // The event reader's nflog group must be bound before the rules name it.
        let (nflog, log_group) = events::bind(log_group(tag));
        let names = Names {
            table: table_name(tag),
            bridge: bridge_name(tag),
            veth_prefix: veth_prefix(tag),
            log_group,
            proxy_port: 0,
        };
        let (t, sd) = (tag.to_owned(), state_dir.to_owned());
        let made =
            tokio::task::spawn_blocking(move || make_host_state(&t, pool, &sd, names, &protected))
                .await
                .map_err(|e| e.to_string())??;
        let record = made.record;
        let (names, pool) = (made.names, made.pool);
        let gateway = Ipv4Addr::from(u32::from(pool.0) + 1);
        let serving = async {
            let proxy = tokio::net::TcpListener::from_std(made.proxy).map_err(|e| e.to_string())?;
            let listen = SocketAddr::from((gateway, 53));
            let udp = tokio::net::UdpSocket::bind(listen)
                .await
                .map_err(|e| format!("DNS resolver on {listen}/udp: {e}"))?;
            let tcp = tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|e| format!("DNS resolver on {listen}/tcp: {e}"))?;
            Ok::<_, String>((proxy, udp, tcp))
        };
        let (proxy, udp, tcp) = match serving.await {
            Ok(sockets) => sockets,
            Err(reason) => {
                let t = tag.to_owned();
                let _ = tokio::task::spawn_blocking(move || release_host_state(&t, record)).await;
                return Err(reason);
            }
        };
        let clients: Clients = Arc::default();
        let upstream = dns::host_resolvers();
        if upstream.is_empty() {
            tracing::warn!("no nameserver in /etc/resolv.conf: sandboxes will resolve nothing");
        }
        let refused = events::Log::default();
        let resolver = Arc::new(Resolver::new(
            Arc::clone(&clients),
            upstream,
            names.clone(),
            pool,
            Arc::clone(&refused),
        ));
        let refused_by_proxy = Arc::new(AtomicU64::new(0));
        let proxy_task = Arc::new(proxy::Proxy::new(
            Arc::clone(&clients),
            pool,
            Arc::clone(&refused),
            Arc::clone(&refused_by_proxy),
        ));
        let tasks = vec![
            tokio::spawn(Arc::clone(&resolver).serve_udp(udp)),
            tokio::spawn(resolver.serve_tcp(tcp)),
            tokio::spawn(proxy_task.serve(proxy)),
        ];
        let stop = Arc::new(AtomicBool::new(false));
        match nflog {
            Ok(nflog) => {
                if let Err(e) = events::start(nflog, pool, Arc::clone(&refused), Arc::clone(&stop))
                {
                    tracing::warn!(error = %e, "no refused-connection events (starting their reader failed)");
                }
            }
            Err(e) => tracing::warn!(error = %e,
                "no refused-connection events (no free nflog group); the counter still works"),
        }
        let active = Active {
            names,
            nft,
            bridge_index: made.bridge_index,
            gateway,
            pool,
            clients,
            used: Mutex::new((HashSet::new(), 2)),
            generation: AtomicU32::new(0x6473_0000 | (std::process::id() & 0xffff)),
            refused_by_proxy,
            tasks,
            refused,
            stop,
        };
        Ok((active, record))
    }

    /// Why networking is unavailable, if it is.
    pub fn unavailable(&self) -> Option<&str> {
        self.state.as_ref().err().map(String::as_str)
    }

    /// Gives a new sandbox an address and installs its policy. The sandbox has no route
    /// until [`Attachment::plug`]; call this while its container is being built.
    pub async fn reserve(&self, policy: &Policy) -> Result<Attachment, NetError> {
        self.reserve_preferring(policy, None).await
    }

    /// [`reserve`](Self::reserve), for a sandbox that had `address` under an earlier run
    /// of the server (a paused VM kept across the restart): it gets that address again
    /// when it is in this pool and free, another otherwise.
    pub async fn reserve_again(
        &self,
        policy: &Policy,
        address: Ipv4Addr,
    ) -> Result<Attachment, NetError> {
        self.reserve_preferring(policy, Some(address)).await
    }

    async fn reserve_preferring(
        &self,
        policy: &Policy,
        address: Option<Ipv4Addr>,
    ) -> Result<Attachment, NetError> {
        let active = self
            .state
            .as_ref()
            .map_err(|r| NetError::Unavailable(r.clone()))?;
        let n = active.allocate(address)?;
        let ip = Ipv4Addr::from(u32::from(active.pool.0) + n);
        active
            .refused
            .lock()
            .expect("lock")
            .insert(n, Default::default());
        let script = nft::attach(&active.names, n, ip, policy, active.next_generation());
        let attachment = Attachment {
            active: Arc::clone(active),
            n,
            ip,
            veth: active.names.veth(n),
        };
        active
            .clients
            .write()
            .expect("lock")
            .insert(ip, dns::Client::new(n, policy.clone()));
        match active.nft.apply(script).await {
            Ok(()) => Ok(attachment),
            Err(e) => {
                attachment.release().await;
                Err(e)
            }
        }
    }

    /// Packets refused so far by every sandbox's policy and by the bridge's input rules.
    /// (Also publishes `dsec_network_limited_total` for the caps the kernel enforces,
    /// whose named counters are read in the same netlink dump.)
    pub async fn refused_total(&self) -> u64 {
        let Ok(active) = &self.state else {
            return 0;
        };
        let names = active.names.clone();
        let counters = tokio::task::spawn_blocking(move || nft::counters(&names))
            .await
            .unwrap_or_default();
        // Read in the same dump: what the kernel-side caps refused.
        for (limit, packets) in counters.by_limit {
            metrics::counter!("dsec_network_limited_total", "limit" => limit).absolute(packets);
        }
        counters.refused + active.refused_by_proxy.load(Ordering::Relaxed)
    }

    /// Tears everything down (server shutdown); attachments still held are gone after.
    pub async fn shutdown(&self) {
        if let Ok(active) = &self.state {
            for t in &active.tasks {
                t.abort();
            }
            active.stop.store(true, Ordering::Relaxed);
        }
        let record = self.record.lock().expect("lock").take();
        if let Some(record) = record {
            let tag = self.tag.clone();
            let _ = tokio::task::spawn_blocking(move || release_host_state(&tag, record)).await;
        }
    }
}

impl Active {
    /// A conntrack mark no earlier policy of this server process used (they start at
    /// `0x6473xxxx`, from the pid, away from the small marks other software tends to use).
    fn next_generation(&self) -> u32 {
        self.generation.fetch_add(1, Ordering::Relaxed)
    }

    /// A free host number of the pool: `address`'s when it is one, else the next free.
    fn allocate(&self, address: Option<Ipv4Addr>) -> Result<u32, NetError> {
        let size = 1u32 << (32 - self.pool.1);
        let mut used = self.used.lock().expect("lock");
        let (set, next) = &mut *used;
        let wanted = address
            .and_then(|a| u32::from(a).checked_sub(u32::from(self.pool.0)))
            .filter(|n| (2..size - 1).contains(n));
        if let Some(n) = wanted.filter(|n| set.insert(*n)) {
            return Ok(n);
        }
        // Round-robin from the last one given, so a freed address rests before reuse.
        for k in 0..size {
            let n = 2 + (*next - 2 + k) % (size - 3);
            if set.insert(n) {
                *next = n + 1;
                return Ok(n);
            }
        }
        Err(NetError::Exhausted(format!(
            "{}/{}",
            self.pool.0, self.pool.1
        )))
    }
}

/// Bytes through a sandbox's interface, as the sandbox sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes it received.
    pub rx_bytes: u64,
    /// Bytes it sent.
    pub tx_bytes: u64,
}

impl Attachment {
    /// What went through the sandbox's interface since it was plugged: the counters of
    /// the host's end of its veth, the other way round (what the host end sends, the
    /// sandbox receives). `None` while it is not plugged.
    pub fn traffic(&self) -> Option<Traffic> {
        let counter = |name: &str| -> Option<u64> {
            let path = format!("/sys/class/net/{}/statistics/{name}", self.veth);
            std::fs::read_to_string(path).ok()?.trim().parse().ok()
        };
        Some(Traffic {
            rx_bytes: counter("tx_bytes")?,
            tx_bytes: counter("rx_bytes")?,
        })
    }

    /// The sandbox's address.
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }

    /// The connections its policies refused lately, oldest first (at most 256; logging
    /// is rate-limited to 50 packets a second per rule).
    pub fn refused(&self) -> Vec<Refused> {
        self.active
            .refused
            .lock()
            .expect("lock")
            .get(&self.n)
            .map(|e| e.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// What the sandbox's `/etc/resolv.conf` must say: dsec's resolver.
    pub fn resolv_conf(&self) -> String {
        format!("nameserver {}\noptions edns0\n", self.active.gateway)
    }

    /// Connects the network namespace `netns` (the sandbox's, e.g. `/proc/<init>/ns/net`)
    /// to the bridge: `eth0` with the sandbox's address and a default route.
    pub async fn plug(&self, netns: OwnedFd) -> Result<(), NetError> {
        let (veth, master, ip) = (self.veth.clone(), self.active.bridge_index, self.ip);
        let (gateway, prefix) = (self.active.gateway, self.active.pool.1);
        tokio::task::spawn_blocking(move || {
            let mut rtnl = Rtnl::open().map_err(nl_err("netlink socket"))?;
            rtnl.add_veth(&veth, master, "eth0", &netns)
                .map_err(nl_err(format!("creating veth {veth}")))?;
            netlink::in_netns(&netns, || {
                let mut inner = Rtnl::open()?;
                let eth0 = netlink::index("eth0")?;
                inner.add_addr(eth0, ip, prefix)?;
                inner.set_up(eth0)?;
                inner.add_default_route(eth0, gateway)
            })
            .map_err(nl_err("configuring eth0 in the sandbox"))
        })
        .await
        .map_err(|e| NetError::Nft(e.to_string()))?
    }

    /// Replaces the policy of a running sandbox; addresses its earlier answers opened are
    /// closed. `Policy::Off` keeps the interface but refuses everything.
    pub async fn set_policy(&self, policy: &Policy) -> Result<(), NetError> {
        let active = Arc::clone(&self.active);
        let script = nft::replace(&active.names, self.n, policy, active.next_generation());
        active.nft.apply(script).await?;
        self.active
            .clients
            .write()
            .expect("lock")
            .insert(self.ip, dns::Client::new(self.n, policy.clone()));
        Ok(())
    }

    /// Removes the sandbox's veth, keeping its address and policy, before the network
    /// namespace it was plugged into goes (a VM guest saved to disk ends its QEMU, whose
    /// namespace it is): the next [`Attachment::plug`] makes it anew. The kernel would
    /// remove it with the namespace, but later, and the name must be free for the next.
    pub async fn unplug(&self) {
        let veth = self.veth.clone();
        let _ = tokio::task::spawn_blocking(move || delete_link(&veth)).await;
    }

    /// Removes the sandbox's veth (if its namespace has not taken it already), rules and
    /// address. Call after the sandbox's processes are gone. Runs to the end in a task of
    /// its own, even if the caller's future is dropped (a client that went away mid-stop):
    /// an address given back halfway would stay taken until a restart.
    pub async fn release(self) {
        let _ = tokio::spawn(async move {
            self.active.clients.write().expect("lock").remove(&self.ip);
            let veth = self.veth.clone();
            let _ = tokio::task::spawn_blocking(move || delete_link(&veth)).await;
            let active = &self.active;
            let script = nft::detach(&active.names, self.n, self.ip);
            if let Err(e) = active.nft.apply(script).await {
                tracing::warn!(error = %e, "removing a sandbox's nftables rules");
            }
            active.refused.lock().expect("lock").remove(&self.n);
            // Free for another sandbox only now that its rules are gone.
            active.used.lock().expect("lock").0.remove(&self.n);
        })
        .await;
    }
}

/// Deletes host interface `name` if it exists (a veth's peer goes with it).
fn delete_link(name: &str) {
    if let (Ok(mut rtnl), Ok(i)) = (Rtnl::open(), netlink::index(name)) {
        let _ = rtnl.delete(i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_are_checked_and_normalised() {
        assert_eq!(
            parse_pool("10.209.3.4/16").unwrap(),
            (Ipv4Addr::new(10, 209, 0, 0), 16)
        );
        assert!(parse_pool("10.209.0.0/8").is_err());
        assert!(parse_pool("10.209.0.0").is_err());
        assert!(parse_pool("x/16").is_err());
    }

    #[test]
    fn default_pools_are_the_range_from_the_default_on() {
        let pools: Vec<String> = default_pools().map(|(n, p)| format!("{n}/{p}")).collect();
        assert_eq!(pools.first().map(String::as_str), Some(DEFAULT_POOL));
        assert_eq!(pools.len(), 16);
        let range = parse_pool(DEFAULT_RANGE).unwrap();
        let mask = u32::MAX << (32 - range.1);
        for (net, _) in default_pools() {
            assert_eq!(u32::from(net) & mask, u32::from(range.0));
        }
        assert_eq!(pools.iter().collect::<HashSet<_>>().len(), 16);
    }

    #[test]
    fn names_fit_the_kernel_limit() {
        let tag = "0123abcd";
        assert!(bridge_name(tag).len() <= 15);
        assert!(format!("{}{:x}", veth_prefix(tag), (1u32 << 20) - 1).len() <= 15);
    }
}
