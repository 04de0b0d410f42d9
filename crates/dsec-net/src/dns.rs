//! dsec's resolver: listens on the bridge address (UDP and TCP port 53), knows each
//! sandbox by its source address, answers only the names its policy allows (forwarding
//! to the host's resolvers), and opens the answered IPv4 addresses in that sandbox's
//! nftables sets for the record's TTL *before* the answer goes back.
//!
//! AAAA questions get an empty answer (sandboxes have IPv4 only); names not allowed get
//! NXDOMAIN; addresses that are never a legitimate destination (loopback, link-local,
//! unspecified, dsec's own pool, the host's own addresses) are not opened even when an
//! allowed name resolves to them.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use crate::events::{self, Refused};
use crate::limits::{self, Bucket, Refusals, Slots};
use crate::nft::{self, Names, MAX_OPENED_PER_SANDBOX};
use crate::policy::Policy;

/// Shortest time an answered address stays open, whatever the record's TTL says: a client
/// may use an answer a little past its TTL.
const MIN_OPEN_S: u32 = 60;
/// Longest time an answered address stays open.
const MAX_OPEN_S: u32 = 86_400;
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
const RCODE_NXDOMAIN: u8 = 3;
const RCODE_REFUSED: u8 = 5;
const RCODE_SERVFAIL: u8 = 2;
const TYPE_A: u16 = 1;
const TYPE_AAAA: u16 = 28;

/// A sandbox as the resolver sees it, under one policy (a new policy is a new `Client`,
/// so nothing opened under the old one is taken as open under the new one).
pub(crate) struct Client {
    /// Its chain number.
    pub n: u32,
    /// Its policy.
    pub policy: Policy,
    /// Destinations opened in its sets, and until when: a repeated question does not
    /// cost an nftables transaction while the answer's addresses are well within theirs.
    pub opened: Mutex<HashMap<(Ipv4Addr, Option<u16>), Instant>>,
    /// Its query rate (UDP and TCP together).
    pub rate: Mutex<Bucket>,
    /// Its rate of nftables transactions opening answered addresses (each costs the host
    /// an `nft` process: a name under an allowed wildcard whose nameserver answers fresh
    /// addresses every time must not cost a core).
    pub open_rate: Mutex<Bucket>,
}

impl Client {
    pub(crate) fn new(n: u32, policy: Policy) -> Arc<Client> {
        Arc::new(Client {
            n,
            policy,
            opened: Mutex::default(),
            rate: Mutex::new(Bucket::new(QUERY_RATE, QUERY_BURST)),
            open_rate: Mutex::new(Bucket::new(OPEN_RATE, 2.0 * OPEN_RATE)),
        })
    }
}

/// The sandboxes the resolver serves, by address.
pub(crate) type Clients = Arc<RwLock<HashMap<Ipv4Addr, Arc<Client>>>>;

/// UDP questions answered at once; more are dropped (clients retry), so a sandbox
/// flooding the resolver cannot make it spawn without bound.
const MAX_IN_FLIGHT: usize = 256;
/// UDP questions of one sandbox answered at once (an upstream may take
/// [`UPSTREAM_TIMEOUT`] per question: without this, one sandbox asking for names that
/// time out would hold every slot).
const MAX_IN_FLIGHT_PER_SANDBOX: usize = 32;
/// TCP connections open at once, over all sandboxes and per sandbox.
const MAX_TCP: usize = 128;
const MAX_TCP_PER_SANDBOX: usize = 8;
/// Longest wait for one whole TCP query (its length and its bytes), and for its answer to
/// be taken: a connection that sends nothing, or a byte now and then, is closed after it.
const TCP_TIMEOUT: Duration = Duration::from_secs(10);
/// Questions a second one sandbox may ask on average, and in a burst; more are dropped.
/// Each allowed one costs an upstream query (and the resolver must not become a way to
/// flood the host's resolvers).
const QUERY_RATE: f64 = 100.0;
const QUERY_BURST: f64 = 200.0;

/// Answers a second that may open new addresses for one sandbox (bursts of twice that);
/// more are answered SERVFAIL.
const OPEN_RATE: f64 = 20.0;

static OVER_RATE: Refusals = Refusals::new("dns_rate");
static OPEN_OVER_RATE: Refusals = Refusals::new("opened_addresses_rate");
static TCP_SILENT: Refusals = Refusals::new("dns_tcp_timeout");
static OPENED_FULL: Refusals = Refusals::new("opened_addresses_per_sandbox");

/// What the resolver needs; shared by its UDP and TCP tasks.
pub(crate) struct Resolver {
    pub clients: Clients,
    pub upstream: Vec<SocketAddr>,
    pub names: Names,
    /// Addresses never opened from a DNS answer: dsec's pool (network, prefix).
    pub pool: (Ipv4Addr, u8),
    /// Where questions for names a policy does not allow are filed, as refusals.
    refused: events::Log,
    udp_slots: Arc<Slots>,
    tcp_slots: Arc<Slots>,
}

/// The host's resolvers, from `/etc/resolv.conf`.
pub(crate) fn host_resolvers() -> Vec<SocketAddr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().split('%').next()?.parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .collect()
}

/// The question of a query: name, type, and where the question section ends.
fn question(msg: &[u8]) -> Option<(String, u16, usize)> {
    if msg.len() < 12 || u16::from_be_bytes([msg[4], msg[5]]) != 1 {
        return None;
    }
    let mut name = String::new();
    let mut i = 12;
    loop {
        let len = *msg.get(i)? as usize;
        i += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
        let label = msg.get(i..i + len)?;
        if !name.is_empty() {
            name.push('.');
        }
        name.push_str(&String::from_utf8_lossy(label).to_ascii_lowercase());
        i += len;
    }
    let qtype = u16::from_be_bytes([*msg.get(i)?, *msg.get(i + 1)?]);
    Some((name, qtype, i + 4))
}

/// A reply to `query` with no answers and `rcode`.
fn empty_reply(query: &[u8], qend: usize, rcode: u8) -> Vec<u8> {
    let mut r = query[..qend.min(query.len())].to_vec();
    r[2] = 0x80 | (query[2] & 0x01); // QR, keep RD
    r[3] = 0x80 | rcode; // RA
    r[6..12].fill(0);
    r
}

fn skip_name(msg: &[u8], mut i: usize) -> Option<usize> {
    loop {
        let len = *msg.get(i)?;
        if len & 0xc0 == 0xc0 {
            return Some(i + 2);
        }
        if len == 0 {
            return Some(i + 1);
        }
        i += 1 + len as usize;
    }
}

/// The A records of a reply, with the smallest TTL among them.
fn a_records(msg: &[u8]) -> (Vec<Ipv4Addr>, u32) {
    let parse = || -> Option<(Vec<Ipv4Addr>, u32)> {
        let qd = u16::from_be_bytes([msg[4], msg[5]]);
        let an = u16::from_be_bytes([msg[6], msg[7]]);
        let mut i = 12;
        for _ in 0..qd {
            i = skip_name(msg, i)? + 4;
        }
        let (mut ips, mut ttl) = (Vec::new(), u32::MAX);
        for _ in 0..an {
            i = skip_name(msg, i)?;
            let h = msg.get(i..i + 10)?;
            let kind = u16::from_be_bytes([h[0], h[1]]);
            let t = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
            let len = u16::from_be_bytes([h[8], h[9]]) as usize;
            let data = msg.get(i + 10..i + 10 + len)?;
            if kind == TYPE_A && len == 4 {
                ips.push(Ipv4Addr::new(data[0], data[1], data[2], data[3]));
                ttl = ttl.min(t);
            }
            i += 10 + len;
        }
        Some((ips, ttl))
    };
    if msg.len() < 12 {
        return (Vec::new(), 0);
    }
    parse().unwrap_or_default()
}

impl Resolver {
    pub(crate) fn new(
        clients: Clients,
        upstream: Vec<SocketAddr>,
        names: Names,
        pool: (Ipv4Addr, u8),
        refused: events::Log,
    ) -> Resolver {
        Resolver {
            clients,
            upstream,
            names,
            pool,
            refused,
            udp_slots: Slots::new(
                "dns_queries",
                MAX_IN_FLIGHT_PER_SANDBOX,
                MAX_IN_FLIGHT,
                ("dns_queries_per_sandbox", "dns_queries"),
            ),
            tcp_slots: Slots::new(
                "dns_tcp_connections",
                MAX_TCP_PER_SANDBOX,
                MAX_TCP,
                ("dns_tcp_connections_per_sandbox", "dns_tcp_connections"),
            ),
        }
    }

    /// Whether the sandbox at `src` may ask another question now (sources that are no
    /// sandbox are answered REFUSED, cheaply, by [`Resolver::answer`]).
    fn within_rate(&self, src: Ipv4Addr) -> bool {
        let client = self.clients.read().expect("lock").get(&src).cloned();
        let Some(client) = client else {
            return true;
        };
        let allowed = client.rate.lock().expect("lock").take();
        if !allowed {
            OVER_RATE.refuse(
                src,
                &format!("a sandbox asks dsec's resolver more than {QUERY_RATE} questions a second: dropped"),
            );
        }
        allowed
    }

    fn openable(&self, ip: Ipv4Addr) -> bool {
        let (net, prefix) = self.pool;
        let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
        !(ip.is_loopback()
            || ip.is_link_local()
            || ip.is_unspecified()
            || ip.is_broadcast()
            || ip.is_multicast()
            || u32::from(ip) & mask == u32::from(net)
            // One of the host's own addresses: its services stay out of reach (and the
            // name-checking proxy, which connects from the host, must never be led there).
            || std::net::UdpSocket::bind((ip, 0)).is_ok())
    }

    /// Answers one query from `src`.
    async fn answer(&self, query: &[u8], src: IpAddr) -> Option<Vec<u8>> {
        let (qname, qtype, qend) = question(query)?;
        let client = match src {
            IpAddr::V4(ip) => self.clients.read().expect("lock").get(&ip).cloned(),
            IpAddr::V6(_) => None,
        };
        let Some(client) = client else {
            return Some(empty_reply(query, qend, RCODE_REFUSED));
        };
        let Some(ports) = client.policy.domain_ports(&qname) else {
            tracing::debug!(%src, name = %qname, "DNS name not allowed");
            // The resolver is the bridge's address, the pool's first.
            let resolver = Ipv4Addr::from(u32::from(self.pool.0).wrapping_add(1));
            let refusal = Refused::now(resolver, 53, "dns", Some(qname));
            events::record(&self.refused, client.n, refusal);
            return Some(empty_reply(query, qend, RCODE_NXDOMAIN));
        };
        if qtype == TYPE_AAAA {
            return Some(empty_reply(query, qend, 0));
        }
        let Some(reply) = self.forward(query).await else {
            return Some(empty_reply(query, qend, RCODE_SERVFAIL));
        };
        if qtype == TYPE_A && matches!(client.policy, Policy::Allow(_)) {
            let (ips, ttl) = a_records(&reply);
            let ttl = ttl.clamp(MIN_OPEN_S, MAX_OPEN_S);
            let now = Instant::now();
            let fresh_until = now + Duration::from_secs(u64::from(MIN_OPEN_S / 2));
            let wanted: Vec<(Ipv4Addr, Option<u16>)> = {
                let opened = client.opened.lock().expect("lock");
                ips.into_iter()
                    .filter(|ip| self.openable(*ip))
                    .flat_map(|ip| match &ports {
                        None => vec![(ip, None)],
                        Some(ps) => ps.iter().map(|p| (ip, Some(*p))).collect(),
                    })
                    .filter(|d| opened.get(d).is_none_or(|until| *until < fresh_until))
                    .collect()
            };
            if !wanted.is_empty() {
                let open_after = {
                    let mut cache = client.opened.lock().expect("lock");
                    cache.retain(|_, t| *t > now);
                    cache.len() + wanted.iter().filter(|d| !cache.contains_key(d)).count()
                };
                let refusal = if open_after > MAX_OPENED_PER_SANDBOX {
                    Some((&OPENED_FULL, format!(
                        "a sandbox's DNS answers opened {MAX_OPENED_PER_SANDBOX} destinations: answering SERVFAIL until some expire"
                    )))
                } else if !client.open_rate.lock().expect("lock").take() {
                    Some((&OPEN_OVER_RATE, format!(
                        "a sandbox's DNS answers open new addresses more than {OPEN_RATE} times a second: answering SERVFAIL"
                    )))
                } else {
                    None
                };
                if let Some((refusals, why)) = refusal {
                    if let IpAddr::V4(ip) = src {
                        refusals.refuse(ip, &why);
                    }
                    return Some(empty_reply(query, qend, RCODE_SERVFAIL));
                }
                let script = nft::open(&self.names, client.n, &wanted, ttl);
                let opened = tokio::task::spawn_blocking(move || nft::apply(&script)).await;
                if !matches!(opened, Ok(Ok(()))) {
                    tracing::warn!(name = %qname, ?opened, "opening answered addresses failed");
                    return Some(empty_reply(query, qend, RCODE_SERVFAIL));
                }
                let until = now + Duration::from_secs(u64::from(ttl));
                let mut cache = client.opened.lock().expect("lock");
                cache.extend(wanted.into_iter().map(|d| (d, until)));
            }
        }
        Some(reply)
    }

    async fn forward(&self, query: &[u8]) -> Option<Vec<u8>> {
        for up in &self.upstream {
            let bind: SocketAddr = if up.is_ipv4() {
                "0.0.0.0:0".parse().expect("addr")
            } else {
                "[::]:0".parse().expect("addr")
            };
            let Ok(sock) = UdpSocket::bind(bind).await else {
                continue;
            };
            if sock.send_to(query, up).await.is_err() {
                continue;
            }
            let mut buf = vec![0u8; 4096];
            let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
            while let Ok(Ok((n, from))) =
                tokio::time::timeout_at(deadline, sock.recv_from(&mut buf)).await
            {
                if from == *up && n >= 12 && buf[..2] == query[..2] {
                    buf.truncate(n);
                    return Some(buf);
                }
            }
        }
        None
    }

    /// Serves UDP queries on `sock` forever.
    pub(crate) async fn serve_udp(self: Arc<Self>, sock: UdpSocket) {
        let sock = Arc::new(sock);
        let mut buf = vec![0u8; 4096];
        loop {
            let Ok((n, src)) = sock.recv_from(&mut buf).await else {
                continue;
            };
            let SocketAddr::V4(src) = src else { continue };
            if !self.within_rate(*src.ip()) {
                continue;
            }
            let Some(slot) = self.udp_slots.try_take(*src.ip()) else {
                continue;
            };
            let (this, sock, query) = (Arc::clone(&self), Arc::clone(&sock), buf[..n].to_vec());
            tokio::spawn(async move {
                let _slot = slot;
                if let Some(reply) = this.answer(&query, IpAddr::V4(*src.ip())).await {
                    let _ = sock.send_to(&reply, src).await;
                }
            });
        }
    }

    /// Serves TCP queries (length-prefixed) on `listener` forever.
    pub(crate) async fn serve_tcp(self: Arc<Self>, listener: TcpListener) {
        loop {
            let (conn, src, slot) = limits::accept(&listener, &self.tcp_slots).await;
            let Some(slot) = slot else {
                continue; // dropping `conn` closes it
            };
            let this = Arc::clone(&self);
            tokio::spawn(async move {
                let _slot = slot;
                this.serve_tcp_connection(conn, *src.ip()).await;
            });
        }
    }

    /// Answers the queries of one TCP connection until it ends, stalls or misbehaves.
    async fn serve_tcp_connection(&self, mut conn: TcpStream, src: Ipv4Addr) {
        let mut answered = 0u64;
        loop {
            let read = tokio::time::timeout(TCP_TIMEOUT, async {
                let mut len = [0u8; 2];
                conn.read_exact(&mut len).await?;
                let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
                conn.read_exact(&mut query).await?;
                Ok::<_, std::io::Error>(query)
            })
            .await;
            let query = match read {
                Ok(Ok(query)) => query,
                Ok(Err(_)) => return, // closed (or reset)
                Err(_) if answered == 0 => {
                    TCP_SILENT.refuse(
                        src,
                        &format!("a TCP connection to dsec's resolver sent no whole query in {TCP_TIMEOUT:?}: closed"),
                    );
                    return;
                }
                Err(_) => return, // idle after its answers: a client keeping it open
            };
            if !self.within_rate(src) {
                return;
            }
            let Some(reply) = self.answer(&query, IpAddr::V4(src)).await else {
                return;
            };
            // DNS over TCP prefixes a message with its 16-bit length.
            let Ok(len) = u16::try_from(reply.len()) else {
                return;
            };
            let mut out = len.to_be_bytes().to_vec();
            out.extend_from_slice(&reply);
            if !matches!(
                tokio::time::timeout(TCP_TIMEOUT, conn.write_all(&out)).await,
                Ok(Ok(()))
            ) {
                return;
            }
            answered += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            q.push(u8::try_from(l.len()).unwrap());
            q.extend_from_slice(l.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&1u16.to_be_bytes());
        q
    }

    #[test]
    fn reads_the_question_and_the_a_records() {
        let q = query("PyPI.org", TYPE_A);
        let (name, qtype, end) = question(&q).unwrap();
        assert_eq!((name.as_str(), qtype, end), ("pypi.org", TYPE_A, q.len()));
        let mut r = q.clone();
        r[2] = 0x81;
        r[7] = 2;
        for (ip, ttl) in [([1, 2, 3, 4], 300u32), ([5, 6, 7, 8], 30)] {
            r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1]);
            r.extend_from_slice(&ttl.to_be_bytes());
            r.extend_from_slice(&[0, 4]);
            r.extend_from_slice(&ip);
        }
        let (ips, ttl) = a_records(&r);
        assert_eq!(
            ips,
            vec![Ipv4Addr::new(1, 2, 3, 4), Ipv4Addr::new(5, 6, 7, 8)]
        );
        assert_eq!(ttl, 30);
        let e = empty_reply(&q, end, RCODE_NXDOMAIN);
        assert_eq!(e[3] & 0x0f, RCODE_NXDOMAIN);
        assert_eq!(&e[6..12], &[0; 6]);
    }
}
