//! nftables: dsec's own tables (`inet dsec_<tag>`, `bridge dsec_<tag>`) and the per-sandbox
//! chains in them, applied as one `nft -f -` transaction each.
//!
//! Layout: the `forward` chain sends traffic from the bridge through a verdict map keyed
//! by source address to the sandbox's own chain `s<n>`; that chain accepts what the
//! sandbox's policy allows and ends with a counting `reject` (the refused counter). No map
//! entry means no egress at all. `input` refuses everything from the bridge except DNS to
//! dsec's resolver and connections to the proxy. In `prerouting` (NAT), a second map sends
//! each sandbox to its chain `n<n>`, which redirects ports 80 and 443 of addresses opened
//! for names to the name-checking proxy. The bridge table drops frames between bridge
//! ports, so sandboxes cannot reach each other even at layer 2 (frames from any sandbox port are
//! dropped there: a sandbox's frames can only go up to the bridge itself, i.e. the host).
//! It also stops spoofing: a sandbox port passes only IPv4 and ARP frames whose sender
//! address is the one dsec gave that port (`ports` set), so no sandbox can borrow
//! another's address — and with it that sandbox's policy (sandboxes keep `CAP_NET_RAW`).

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use crate::policy::{Policy, Rule};
use crate::NetError;

/// The named counter every refusing rule counts in: one object for the whole table, so
/// the refused metric is one read however many sandbox chains there are, and a chain
/// that goes takes nothing of the count with it.
const REFUSED: &str = "refused";

/// Prefix of the named counter of each cap: `limited_<limit>`, read back for
/// `dsec_network_limited_total{limit}`.
const LIMITED: &str = "limited_";

/// The caps the kernel enforces, each counting in its own named counter.
const LIMITS: [&str; 3] = [
    "conntrack_per_sandbox",
    "dns_udp_rate",
    "local_connection_rate",
];

/// DNS packets a second one sandbox may send (on average; bursts of twice that): a flood
/// is dropped by the kernel, before it can fill the resolver's socket, which every
/// sandbox shares. (The resolver keeps its own count per question; see `dns`.)
pub(crate) const DNS_PACKET_RATE: u32 = 100;

/// New connections a second one sandbox may open to the bridge (the proxy, DNS over TCP),
/// on average; bursts of twice that.
pub(crate) const LOCAL_CONNECTION_RATE: u32 = 100;

/// Connections (conntrack entries) one sandbox may have through the host at once: each
/// costs kernel memory, and the host's table (`nf_conntrack_max`) is shared by everything
/// on it; a sandbox spraying UDP at many ports would otherwise fill it for all.
pub(crate) const MAX_FORWARDED_PER_SANDBOX: u32 = 2048;

/// Connections one sandbox may have to the bridge itself (DNS queries, each a conntrack
/// entry for 30 s or more, and connections to the proxy).
pub(crate) const MAX_LOCAL_PER_SANDBOX: u32 = 1024;

/// Destinations DNS answers may open for one sandbox at once, per set (see `dns`): each
/// is kernel memory, and a name under an allowed wildcard can answer many addresses.
pub(crate) const MAX_OPENED_PER_SANDBOX: usize = 4096;

/// Prefix of the nflog messages of refused packets.
pub(crate) const LOG_PREFIX: &str = "dsec-refused ";

/// Names of this server's nftables objects.
#[derive(Clone, Debug)]
pub(crate) struct Names {
    pub table: String,
    pub bridge: String,
    /// Every sandbox's host-side veth starts with this.
    pub veth_prefix: String,
    /// The nflog group refused packets are logged to (see `events`).
    pub log_group: u16,
    /// Port of the name-checking proxy on the bridge address (see `proxy`).
    pub proxy_port: u16,
}

impl Names {
    pub(crate) fn chain(n: u32) -> String {
        format!("s{n:05x}")
    }
    pub(crate) fn any_set(n: u32) -> String {
        format!("d{n:05x}")
    }
    pub(crate) fn port_set(n: u32) -> String {
        format!("p{n:05x}")
    }
    pub(crate) fn nat_chain(n: u32) -> String {
        format!("n{n:05x}")
    }
    /// A statement logging (rate-limited, per rule) to the server's nflog group: placed
    /// right before each refusing rule, it makes the refusal an event.
    pub(crate) fn log(&self) -> String {
        format!(
            "limit rate 50/second burst 50 packets log prefix \"{LOG_PREFIX}\" group {}",
            self.log_group
        )
    }

    /// The host end of sandbox `n`'s veth.
    pub(crate) fn veth(&self, n: u32) -> String {
        format!("{}{n:x}", self.veth_prefix)
    }
}

/// Runs one nft transaction.
pub(crate) fn apply(script: &str) -> Result<(), NetError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| NetError::Nft(format!("running nft: {e}")))?;
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(script.as_bytes())
        .map_err(|e| NetError::Nft(format!("writing to nft: {e}")))?;
    let out = child
        .wait_with_output()
        .map_err(|e| NetError::Nft(format!("waiting for nft: {e}")))?;
    if !out.status.success() {
        return Err(NetError::Nft(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ));
    }
    Ok(())
}

/// Scripts one transaction takes at most from the queue (a few hundred sandboxes' rules:
/// a small fraction of what one `nft -f` accepts).
const MAX_BATCH: usize = 256;

/// A script waiting for its transaction, and where its result goes.
type Job = (String, tokio::sync::oneshot::Sender<Result<(), NetError>>);

/// Applies sandboxes' scripts in shared transactions: every script submitted while one
/// runs goes into the next, so N sandboxes created or stopped at once cost one `nft`
/// process and one ruleset commit, not N (each costs ~40 ms here, and more as the
/// ruleset grows). A batch the kernel refuses is applied again script by script, so each
/// caller gets its own script's result and one bad script fails no other.
pub(crate) struct Batcher {
    queue: std::sync::mpsc::Sender<Job>,
}

impl Batcher {
    /// Starts the thread that applies the batches; it ends when the batcher is dropped.
    pub(crate) fn start() -> std::io::Result<Batcher> {
        let (queue, jobs) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("dsec-nft".into())
            .spawn(move || {
                while let Ok(first) = jobs.recv() {
                    let mut batch = vec![first];
                    batch.extend(jobs.try_iter().take(MAX_BATCH - 1));
                    apply_batch(batch);
                }
            })?;
        Ok(Batcher { queue })
    }

    /// Applies `script` in the next transaction.
    pub(crate) async fn apply(&self, script: String) -> Result<(), NetError> {
        let gone = || NetError::Nft("the nftables thread has stopped".into());
        let (done, result) = tokio::sync::oneshot::channel();
        self.queue.send((script, done)).map_err(|_| gone())?;
        result.await.unwrap_or_else(|_| Err(gone()))
    }
}

fn apply_batch(batch: Vec<Job>) {
    if batch.len() > 1 {
        let mut all = String::new();
        for (script, _) in &batch {
            all.push_str(script);
            all.push('\n');
        }
        if apply(&all).is_ok() {
            for (_, done) in batch {
                let _ = done.send(Ok(()));
            }
            return;
        }
    }
    for (script, done) in batch {
        let _ = done.send(apply(&script));
    }
}

/// Output of `nft ARGS`, `None` when it fails.
pub(crate) fn query(args: &[&str]) -> Option<String> {
    let out = Command::new("nft").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The server-wide tables.
pub(crate) fn base(
    names: &Names,
    pool: &str,
    bridge_ip: Ipv4Addr,
    protected: &[Ipv4Addr],
) -> String {
    let (t, br, ports) = (&names.table, &names.bridge, &names.veth_prefix);
    let log = names.log();
    let proxy = names.proxy_port;
    let local = MAX_LOCAL_PER_SANDBOX;
    let (dns_rate, dns_burst) = (DNS_PACKET_RATE, 2 * DNS_PACKET_RATE);
    let (conn_rate, conn_burst) = (LOCAL_CONNECTION_RATE, 2 * LOCAL_CONNECTION_RATE);
    // The server's own services, refused before any sandbox's policy is looked at.
    let protected = if protected.is_empty() {
        String::new()
    } else {
        let list: Vec<String> = protected.iter().map(ToString::to_string).collect();
        format!(
            "iifname \"{br}\" ip daddr {{ {} }} {log}\n    iifname \"{br}\" ip daddr {{ {} }} counter name \"{REFUSED}\" reject with icmpx type admin-prohibited\n    ",
            list.join(", "),
            list.join(", ")
        )
    };
    let counters: String = std::iter::once(REFUSED.to_owned())
        .chain(LIMITS.iter().map(|l| format!("{LIMITED}{l}")))
        .map(|c| format!("\n  counter {c} {{ }}"))
        .collect();
    format!(
        "table inet {t} {{{counters}
  map sandboxes {{ type ipv4_addr : verdict; }}
  map sandboxes_nat {{ type ipv4_addr : verdict; }}
  chain prerouting {{
    type nat hook prerouting priority dstnat - 10; policy accept;
    iifname \"{br}\" ip saddr vmap @sandboxes_nat
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    oifname \"{br}\" ct state established,related accept
    oifname \"{br}\" counter drop
    {protected}iifname \"{br}\" ip saddr vmap @sandboxes
    iifname \"{br}\" counter reject with icmpx type admin-prohibited
  }}
  set local_conns {{ type ipv4_addr; size 65536; flags dynamic; }}
  set dns_rate {{ type ipv4_addr; size 65536; flags dynamic,timeout; timeout 10s; }}
  set connection_rate {{ type ipv4_addr; size 65536; flags dynamic,timeout; timeout 10s; }}
  chain limited {{
    {log}
    counter name \"{LIMITED}conntrack_per_sandbox\" reject with icmpx type admin-prohibited
  }}
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname \"{br}\" udp dport 53 add @dns_rate {{ ip saddr limit rate over {dns_rate}/second burst {dns_burst} packets }} counter name \"{LIMITED}dns_udp_rate\" drop
    iifname \"{br}\" ct state established,related accept
    iifname \"{br}\" ct state new add @local_conns {{ ip saddr ct count over {local} }} jump limited
    iifname \"{br}\" meta l4proto tcp ct state new add @connection_rate {{ ip saddr limit rate over {conn_rate}/second burst {conn_burst} packets }} counter name \"{LIMITED}local_connection_rate\" drop
    iifname \"{br}\" ip daddr {bridge_ip} meta l4proto {{ tcp, udp }} th dport 53 accept
    iifname \"{br}\" ip daddr {bridge_ip} tcp dport {proxy} accept
    iifname \"{br}\" {log}
    iifname \"{br}\" counter name \"{REFUSED}\" reject with icmpx type admin-prohibited
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat - 10; policy accept;
    ip saddr {pool} oifname != \"{br}\" masquerade
  }}
}}
table bridge {t} {{
  set ports {{ type ifname . ipv4_addr; }}
  chain prerouting {{
    type filter hook prerouting priority filter - 10; policy accept;
    iifname \"{ports}*\" ether type ip iifname . ip saddr != @ports drop
    iifname \"{ports}*\" ether type arp iifname . arp saddr ip != @ports drop
    iifname \"{ports}*\" ether type != {{ ip, arp }} drop
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname \"{ports}*\" drop
  }}
}}
"
    )
}

/// The rules of sandbox `n`'s chain for `policy`, generation `generation`.
///
/// Connections the policy accepted carry the generation in their conntrack mark and pass
/// on that alone, so a long download outlives the DNS timeout that let it start. A new
/// policy gets a new generation: every open connection is then judged again by the new
/// rules, packet by packet, so a narrower policy cuts what it no longer allows.
fn rules(names: &Names, n: u32, policy: &Policy, generation: u32) -> String {
    let (t, c) = (&names.table, Names::chain(n));
    let mut s = String::new();
    if !policy.is_off() {
        let _ = writeln!(
            s,
            "add rule inet {t} {c} ct state established,related ct mark {generation:#x} accept"
        );
        let _ = writeln!(
            s,
            "add rule inet {t} {c} ct state new ct count over {MAX_FORWARDED_PER_SANDBOX} jump limited"
        );
    }
    let mut rule = |body: &str| {
        let body = match body.strip_suffix(" accept") {
            Some(head) => format!("{head} ct mark set {generation:#x} accept"),
            None if body == "accept" => format!("ct mark set {generation:#x} accept"),
            None => body.to_owned(),
        };
        let _ = writeln!(s, "add rule inet {t} {c} {body}");
    };
    match policy {
        Policy::Off => {}
        Policy::Full => {
            rule(&format!("ip daddr 169.254.0.0/16 {}", names.log()));
            rule(&format!(
                "ip daddr 169.254.0.0/16 counter name \"{REFUSED}\" reject with icmpx type admin-prohibited"
            ));
            rule("accept");
        }
        Policy::Allow(list) => {
            for r in list {
                if let Rule::Net { addr, prefix, port } = r {
                    match port {
                        None => rule(&format!("ip daddr {addr}/{prefix} accept")),
                        Some(p) => rule(&format!(
                            "ip daddr {addr}/{prefix} meta l4proto {{ tcp, udp }} th dport {p} accept"
                        )),
                    }
                }
            }
            rule(&format!("ip daddr @{} accept", Names::any_set(n)));
            rule(&format!(
                "meta l4proto {{ tcp, udp }} ip daddr . th dport @{} accept",
                Names::port_set(n)
            ));
        }
    }
    rule(&names.log());
    rule(&format!(
        "counter name \"{REFUSED}\" reject with icmpx type admin-prohibited"
    ));
    s
}

/// The rules of sandbox `n`'s NAT chain: HTTP and TLS connections to addresses opened
/// for domain names go to the name-checking proxy (addresses an IP or CIDR rule allows
/// are left alone).
fn nat_rules(names: &Names, n: u32, policy: &Policy) -> String {
    let (t, c) = (&names.table, Names::nat_chain(n));
    let mut s = String::new();
    let Policy::Allow(list) = policy else {
        return s;
    };
    for r in list {
        if let Rule::Net { addr, prefix, port } = r {
            let port = port.map(|p| format!(" tcp dport {p}")).unwrap_or_default();
            let _ = writeln!(
                s,
                "add rule inet {t} {c} ip daddr {addr}/{prefix}{port} accept"
            );
        }
    }
    let proxy = names.proxy_port;
    let _ = writeln!(
        s,
        "add rule inet {t} {c} tcp dport {{ 80, 443 }} ip daddr @{} redirect to :{proxy}",
        Names::any_set(n)
    );
    let _ = writeln!(
        s,
        "add rule inet {t} {c} tcp dport {{ 80, 443 }} ip daddr . tcp dport @{} redirect to :{proxy}",
        Names::port_set(n)
    );
    s
}

/// Creates sandbox `n`'s chain and sets, and routes its traffic there.
pub(crate) fn attach(
    names: &Names,
    n: u32,
    ip: Ipv4Addr,
    policy: &Policy,
    generation: u32,
) -> String {
    let t = &names.table;
    let (c, d, p) = (Names::chain(n), Names::any_set(n), Names::port_set(n));
    let nc = Names::nat_chain(n);
    // Room past the resolver's own count of what it opened, which it checks first.
    let size = MAX_OPENED_PER_SANDBOX + 64;
    let mut s = format!(
        "add chain inet {t} {c}\nadd chain inet {t} {nc}\n\
         add set inet {t} {d} {{ type ipv4_addr; flags timeout; size {size}; }}\n\
         add set inet {t} {p} {{ type ipv4_addr . inet_service; flags timeout; size {size}; }}\n\
         flush chain inet {t} {c}\nflush chain inet {t} {nc}\n\
         flush set inet {t} {d}\nflush set inet {t} {p}\n"
    );
    s += &rules(names, n, policy, generation);
    s += &nat_rules(names, n, policy);
    let _ = writeln!(s, "add element inet {t} sandboxes {{ {ip} : jump {c} }}");
    let _ = writeln!(
        s,
        "add element inet {t} sandboxes_nat {{ {ip} : jump {nc} }}"
    );
    let _ = writeln!(
        s,
        "add element bridge {t} ports {{ \"{}\" . {ip} }}",
        names.veth(n)
    );
    s
}

/// Replaces sandbox `n`'s rules (and forgets the addresses its resolver answers opened).
pub(crate) fn replace(names: &Names, n: u32, policy: &Policy, generation: u32) -> String {
    let t = &names.table;
    let (c, d, p) = (Names::chain(n), Names::any_set(n), Names::port_set(n));
    let nc = Names::nat_chain(n);
    let mut s = format!(
        "flush chain inet {t} {c}\nflush chain inet {t} {nc}\n\
         flush set inet {t} {d}\nflush set inet {t} {p}\n"
    );
    s += &rules(names, n, policy, generation);
    s += &nat_rules(names, n, policy);
    s
}

/// Removes sandbox `n`'s map entry, chain and sets.
pub(crate) fn detach(names: &Names, n: u32, ip: Ipv4Addr) -> String {
    let t = &names.table;
    let (c, d, p) = (Names::chain(n), Names::any_set(n), Names::port_set(n));
    format!(
        "delete element inet {t} sandboxes {{ {ip} }}\n\
         delete element inet {t} sandboxes_nat {{ {ip} }}\n\
         delete chain inet {t} {c}\ndelete chain inet {t} {}\n\
         delete set inet {t} {d}\ndelete set inet {t} {p}\n\
         delete element bridge {t} ports {{ \"{}\" . {ip} }}\n",
        Names::nat_chain(n),
        names.veth(n)
    )
}

/// Opens destinations for sandbox `n` for `ttl` seconds: `(ip, None)` on every port,
/// `(ip, Some(port))` on that port. An element already present is deleted and re-added,
/// so its timeout restarts.
pub(crate) fn open(names: &Names, n: u32, dests: &[(Ipv4Addr, Option<u16>)], ttl: u32) -> String {
    let t = &names.table;
    let mut s = String::new();
    for (ip, port) in dests {
        let (set, e) = match port {
            None => (Names::any_set(n), ip.to_string()),
            Some(p) => (Names::port_set(n), format!("{ip} . {p}")),
        };
        let _ = write!(
            s,
            "add element inet {t} {set} {{ {e} timeout 1s }}\n\
             delete element inet {t} {set} {{ {e} }}\n\
             add element inet {t} {set} {{ {e} timeout {ttl}s }}\n"
        );
    }
    s
}

/// What the named counters say: packets refused by any policy or by the bridge's input
/// rules, and packets refused by each cap.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub refused: u64,
    pub by_limit: Vec<(String, u64)>,
}

/// Reads the named counters of the server's table (zero when it cannot be read).
pub(crate) fn counters(names: &Names) -> Counters {
    let mut out = Counters::default();
    let read = crate::netlink::named_counters(&names.table).unwrap_or_else(|e| {
        tracing::debug!(error = %e, "reading the nftables counters");
        Vec::new()
    });
    for (name, packets) in read {
        if name == REFUSED {
            out.refused = packets;
        } else if let Some(limit) = name.strip_prefix(LIMITED) {
            out.by_limit.push((limit.to_owned(), packets));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[ignore = "needs root and nft"]
    fn a_script_the_kernel_refuses_fails_alone_in_its_batch() {
        let table = format!("dsec_batch_test_{}", std::process::id());
        apply(&format!("add table inet {table}\n")).unwrap();
        let batcher = Batcher::start().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let results = rt.block_on(async {
            tokio::join!(
                batcher.apply(format!("add chain inet {table} a\n")),
                batcher.apply(format!("add rule inet {table} missing accept\n")),
                batcher.apply(format!("add chain inet {table} b\n")),
            )
        });
        let listed = query(&["list", "table", "inet", &table]).unwrap_or_default();
        apply(&format!("delete table inet {table}\n")).unwrap();
        assert!(results.0.is_ok() && results.2.is_ok(), "{results:?}");
        assert!(results.1.is_err(), "{results:?}");
        assert!(
            listed.contains("chain a") && listed.contains("chain b"),
            "{listed}"
        );
    }

    fn names() -> Names {
        Names {
            table: "dsec_t".into(),
            bridge: "dsect".into(),
            veth_prefix: "dvt".into(),
            log_group: 9,
            proxy_port: 4242,
        }
    }

    #[test]
    fn allow_lists_end_in_a_counted_reject() {
        let names = names();
        let p = Policy::allow(&["10.0.0.0/8", "1.2.3.4:443", "pypi.org"]).unwrap();
        let s = attach(&names, 5, Ipv4Addr::new(10, 209, 0, 5), &p, 7);
        assert!(s.contains("s00005 ct state established,related ct mark 0x7 accept"));
        assert!(s.contains("s00005 ip daddr 10.0.0.0/8 ct mark set 0x7 accept"));
        assert!(s.contains(
            "ip daddr 1.2.3.4/32 meta l4proto { tcp, udp } th dport 443 ct mark set 0x7 accept"
        ));
        assert!(s.contains("ip daddr @d00005 ct mark set 0x7 accept"));
        assert!(s.contains("add element inet dsec_t sandboxes { 10.209.0.5 : jump s00005 }"));
        assert!(s.contains("add element bridge dsec_t ports { \"dvt5\" . 10.209.0.5 }"));
        let last_rule = s
            .lines()
            .rfind(|l| l.starts_with("add rule inet dsec_t s00005"))
            .unwrap();
        assert!(last_rule.contains("reject") && last_rule.contains(REFUSED));
        assert!(s.contains("n00005 tcp dport { 80, 443 } ip daddr @d00005 redirect to :4242"));
        assert!(s.contains("n00005 ip daddr 10.0.0.0/8 accept"));
        // The conntrack cap comes right after the established-connection shortcut, before
        // anything the policy accepts.
        let chain: Vec<&str> = s
            .lines()
            .filter(|l| l.starts_with("add rule inet dsec_t s00005"))
            .collect();
        assert!(chain[1].ends_with(&format!(
            "ct state new ct count over {MAX_FORWARDED_PER_SANDBOX} jump limited"
        )));
        assert!(s.contains(&format!("size {}", MAX_OPENED_PER_SANDBOX + 64)));
    }

    #[test]
    fn the_base_tables_limit_each_sandbox_before_accepting() {
        let s = base(&names(), "10.209.0.0/16", Ipv4Addr::new(10, 209, 0, 1), &[]);
        let input: Vec<&str> = s
            .split("chain input {")
            .nth(1)
            .unwrap()
            .lines()
            .map(str::trim)
            .collect();
        let at = |needle: &str| input.iter().position(|l| l.contains(needle)).unwrap();
        // The DNS rate comes before the established shortcut (a UDP flood from one port is
        // "established" after the first answer); the caps before what input accepts.
        assert!(at("limited_dns_udp_rate") < at("ct state established,related accept"));
        assert!(at("ct count over") < at("th dport 53 accept"));
        assert!(at("limited_local_connection_rate") < at("tcp dport 4242 accept"));
    }

    #[test]
    fn protected_addresses_are_refused_before_any_sandbox_policy() {
        let protected = [Ipv4Addr::new(10, 0, 0, 7), Ipv4Addr::new(10, 0, 0, 8)];
        let s = base(
            &names(),
            "10.209.0.0/16",
            Ipv4Addr::new(10, 209, 0, 1),
            &protected,
        );
        let forward: Vec<&str> = s.split("chain forward {").nth(1).unwrap().lines().collect();
        let at = |needle: &str| forward.iter().position(|l| l.contains(needle)).unwrap();
        assert!(
            at("ip daddr { 10.0.0.7, 10.0.0.8 } counter name \"refused\" reject")
                < at("vmap @sandboxes")
        );
        let none = base(&names(), "10.209.0.0/16", Ipv4Addr::new(10, 209, 0, 1), &[]);
        assert!(!none.contains("ip daddr {"));
    }
}
