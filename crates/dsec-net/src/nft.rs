//! nftables: dsec's own tables (`inet dsec_<tag>`, `bridge dsec_<tag>`) and the per-sandbox
//! chains in them, applied as one `nft -f -` transaction each.
//!
//! Layout: the `forward` chain sends traffic from the bridge through a verdict map keyed
//! by source address to the sandbox's own chain `s<n>`; that chain accepts what the
//! sandbox's policy allows and ends with a counting `reject` (the refused counter). No map
//! entry means no egress at all. `input` refuses everything from the bridge except DNS to
//! dsec's resolver. The bridge table drops frames between bridge ports, so sandboxes cannot
//! reach each other even at layer 2 (frames from any sandbox port are
//! dropped there: a sandbox's frames can only go up to the bridge itself, i.e. the host).

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use crate::policy::{Policy, Rule};
use crate::NetError;

/// Comment on every rule that refuses: the counters read back for the refused metric.
const REFUSED: &str = "dsec-refused";

/// Names of this server's nftables objects.
#[derive(Clone, Debug)]
pub(crate) struct Names {
    pub table: String,
    pub bridge: String,
    /// Every sandbox's host-side veth starts with this.
    pub veth_prefix: String,
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

/// Output of `nft ARGS`, `None` when it fails.
pub(crate) fn query(args: &[&str]) -> Option<String> {
    let out = Command::new("nft").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The server-wide tables.
pub(crate) fn base(names: &Names, pool: &str, bridge_ip: Ipv4Addr) -> String {
    let (t, br, ports) = (&names.table, &names.bridge, &names.veth_prefix);
    format!(
        "table inet {t} {{
  map sandboxes {{ type ipv4_addr : verdict; }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    oifname \"{br}\" ct state established,related accept
    oifname \"{br}\" counter drop
    iifname \"{br}\" ip saddr vmap @sandboxes
    iifname \"{br}\" counter reject with icmpx type admin-prohibited
  }}
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname \"{br}\" ct state established,related accept
    iifname \"{br}\" ip daddr {bridge_ip} meta l4proto {{ tcp, udp }} th dport 53 accept
    iifname \"{br}\" counter reject with icmpx type admin-prohibited comment \"{REFUSED}\"
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat - 10; policy accept;
    ip saddr {pool} oifname != \"{br}\" masquerade
  }}
}}
table bridge {t} {{
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname \"{ports}*\" drop
  }}
}}
"
    )
}

/// The rules of sandbox `n`'s chain for `policy`.
fn rules(names: &Names, n: u32, policy: &Policy) -> String {
    let (t, c) = (&names.table, Names::chain(n));
    let mut s = String::new();
    let mut rule = |body: &str| {
        let _ = writeln!(s, "add rule inet {t} {c} {body}");
    };
    match policy {
        Policy::Off => {}
        Policy::Full => {
            rule(&format!(
                "ip daddr 169.254.0.0/16 counter reject with icmpx type admin-prohibited comment \"{REFUSED}\""
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
    rule(&format!(
        "counter reject with icmpx type admin-prohibited comment \"{REFUSED}\""
    ));
    s
}

/// Creates sandbox `n`'s chain and sets, and routes its traffic there.
pub(crate) fn attach(names: &Names, n: u32, ip: Ipv4Addr, policy: &Policy) -> String {
    let t = &names.table;
    let (c, d, p) = (Names::chain(n), Names::any_set(n), Names::port_set(n));
    let mut s = format!(
        "add chain inet {t} {c}\n\
         add set inet {t} {d} {{ type ipv4_addr; flags timeout; }}\n\
         add set inet {t} {p} {{ type ipv4_addr . inet_service; flags timeout; }}\n\
         flush chain inet {t} {c}\nflush set inet {t} {d}\nflush set inet {t} {p}\n"
    );
    s += &rules(names, n, policy);
    let _ = writeln!(s, "add element inet {t} sandboxes {{ {ip} : jump {c} }}");
    s
}

/// Replaces sandbox `n`'s rules (and forgets the addresses its resolver answers opened).
pub(crate) fn replace(names: &Names, n: u32, policy: &Policy) -> String {
    let t = &names.table;
    let (c, d, p) = (Names::chain(n), Names::any_set(n), Names::port_set(n));
    let mut s =
        format!("flush chain inet {t} {c}\nflush set inet {t} {d}\nflush set inet {t} {p}\n");
    s += &rules(names, n, policy);
    s
}

/// Removes sandbox `n`'s map entry, chain and sets.
pub(crate) fn detach(names: &Names, n: u32, ip: Ipv4Addr) -> String {
    let t = &names.table;
    let (c, d, p) = (Names::chain(n), Names::any_set(n), Names::port_set(n));
    format!(
        "delete element inet {t} sandboxes {{ {ip} }}\n\
         delete chain inet {t} {c}\ndelete set inet {t} {d}\ndelete set inet {t} {p}\n"
    )
}

/// Opens `ips` (with `ports`, or every port) for sandbox `n` for `ttl` seconds. An
/// element already present is deleted and re-added, so its timeout restarts.
pub(crate) fn open(
    names: &Names,
    n: u32,
    ips: &[Ipv4Addr],
    ports: Option<&[u16]>,
    ttl: u32,
) -> String {
    let t = &names.table;
    let mut elems = Vec::new();
    let set = match ports {
        None => {
            elems.extend(ips.iter().map(|ip| ip.to_string()));
            Names::any_set(n)
        }
        Some(ports) => {
            for ip in ips {
                elems.extend(ports.iter().map(|p| format!("{ip} . {p}")));
            }
            Names::port_set(n)
        }
    };
    let mut s = String::new();
    for e in &elems {
        let _ = write!(
            s,
            "add element inet {t} {set} {{ {e} timeout 1s }}\n\
             delete element inet {t} {set} {{ {e} }}\n\
             add element inet {t} {set} {{ {e} timeout {ttl}s }}\n"
        );
    }
    s
}

/// Packets refused so far, per sandbox chain number, plus those refused by `input`
/// (under `None`), from the counters of the rules commented [`REFUSED`].
pub(crate) fn refused(names: &Names) -> Vec<(Option<u32>, u64)> {
    let Some(json) = query(&["-j", "list", "table", "inet", &names.table]) else {
        return Vec::new();
    };
    let Ok(doc) = serde_json::from_str::<serde_json::Value>(&json) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for item in doc["nftables"].as_array().into_iter().flatten() {
        let rule = &item["rule"];
        if rule["comment"].as_str() != Some(REFUSED) {
            continue;
        }
        let packets = rule["expr"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|e| e["counter"]["packets"].as_u64())
            .unwrap_or(0);
        let chain = rule["chain"].as_str().unwrap_or_default();
        let n = chain
            .strip_prefix('s')
            .and_then(|h| u32::from_str_radix(h, 16).ok());
        out.push((n, packets));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_lists_end_in_a_counted_reject() {
        let names = Names {
            table: "dsec_t".into(),
            bridge: "dsect".into(),
            veth_prefix: "dvt".into(),
        };
        let p = Policy::allow(&["10.0.0.0/8", "1.2.3.4:443", "pypi.org"]).unwrap();
        let s = attach(&names, 5, Ipv4Addr::new(10, 209, 0, 5), &p);
        assert!(s.contains("add rule inet dsec_t s00005 ip daddr 10.0.0.0/8 accept"));
        assert!(s.contains("ip daddr 1.2.3.4/32 meta l4proto { tcp, udp } th dport 443 accept"));
        assert!(s.contains("ip daddr @d00005 accept"));
        assert!(s.trim_end().ends_with("{ 10.209.0.5 : jump s00005 }"));
        let last_rule = s
            .lines()
            .filter(|l| l.starts_with("add rule"))
            .last()
            .unwrap();
        assert!(last_rule.contains("reject") && last_rule.contains(REFUSED));
    }
}
