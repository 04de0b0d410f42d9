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
use tokio::net::{TcpListener, UdpSocket};

use crate::nft::{self, Names};
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
}

impl Client {
    pub(crate) fn new(n: u32, policy: Policy) -> Arc<Client> {
        Arc::new(Client {
            n,
            policy,
            opened: Mutex::default(),
        })
    }
}

/// The sandboxes the resolver serves, by address.
pub(crate) type Clients = Arc<RwLock<HashMap<Ipv4Addr, Arc<Client>>>>;

/// Questions answered at once; more are dropped (clients retry), so a sandbox flooding
/// the resolver cannot make it spawn without bound.
const MAX_IN_FLIGHT: usize = 256;

/// What the resolver needs; shared by its UDP and TCP tasks.
pub(crate) struct Resolver {
    pub clients: Clients,
    pub upstream: Vec<SocketAddr>,
    pub names: Names,
    /// Addresses never opened from a DNS answer: dsec's pool (network, prefix).
    pub pool: (Ipv4Addr, u8),
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
                let script = nft::open(&self.names, client.n, &wanted, ttl);
                let opened = tokio::task::spawn_blocking(move || nft::apply(&script)).await;
                if !matches!(opened, Ok(Ok(()))) {
                    tracing::warn!(name = %qname, ?opened, "opening answered addresses failed");
                    return Some(empty_reply(query, qend, RCODE_SERVFAIL));
                }
                let until = now + Duration::from_secs(u64::from(ttl));
                let mut cache = client.opened.lock().expect("lock");
                cache.retain(|_, t| *t > now);
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
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
        let mut buf = vec![0u8; 4096];
        loop {
            let Ok((n, src)) = sock.recv_from(&mut buf).await else {
                continue;
            };
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                continue;
            };
            let (this, sock, query) = (Arc::clone(&self), Arc::clone(&sock), buf[..n].to_vec());
            tokio::spawn(async move {
                let _slot = slot;
                if let Some(reply) = this.answer(&query, src.ip()).await {
                    let _ = sock.send_to(&reply, src).await;
                }
            });
        }
    }

    /// Serves TCP queries (length-prefixed) on `listener` forever.
    pub(crate) async fn serve_tcp(self: Arc<Self>, listener: TcpListener) {
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT / 4));
        loop {
            let Ok((mut conn, src)) = listener.accept().await else {
                continue;
            };
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                continue; // dropping `conn` closes it
            };
            let this = Arc::clone(&self);
            tokio::spawn(async move {
                let _slot = slot;
                loop {
                    let mut len = [0u8; 2];
                    let read =
                        tokio::time::timeout(UPSTREAM_TIMEOUT * 3, conn.read_exact(&mut len));
                    if !matches!(read.await, Ok(Ok(_))) {
                        return;
                    }
                    let mut query = vec![0u8; u16::from_be_bytes(len) as usize];
                    if conn.read_exact(&mut query).await.is_err() {
                        return;
                    }
                    let Some(reply) = this.answer(&query, src.ip()).await else {
                        return;
                    };
                    let mut out = (reply.len() as u16).to_be_bytes().to_vec();
                    out.extend_from_slice(&reply);
                    if conn.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            q.push(l.len() as u8);
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
