//! The name-checking proxy: HTTP (port 80) and TLS (port 443) connections from a sandbox
//! to an address its resolver opened for a domain name are redirected here (nftables
//! `redirect`), and pass only if the name the connection itself carries — the TLS SNI, or
//! the HTTP `Host` — is allowed by that sandbox's policy. This closes the shared-address
//! hole: a CDN address opened for `pypi.org` does not carry a connection that names
//! another site. The proxy reads only the first bytes (never decrypts), then connects to
//! the original destination and copies both ways.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::dns::Clients;
use crate::events::{self, Refused};
use crate::limits::{self, Refusals, Slots};

/// Longest wait for the first bytes naming the destination (all of them, however they
/// trickle in), and for the upstream connect.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes read before the name must be known (a TLS record is at most 16 KiB + 5).
const HEAD_MAX: usize = 16 * 1024 + 5;
/// Connections handled at once (each costs two descriptors), over all sandboxes and per
/// sandbox: one sandbox cannot hold what the others need.
const MAX_CONNECTIONS: usize = 2048;
const MAX_CONNECTIONS_PER_SANDBOX: usize = 128;
/// A relayed connection with no byte either way for this long is closed.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

static HEAD_SILENT: Refusals = Refusals::new("proxy_head_timeout");

/// What the proxy needs.
pub(crate) struct Proxy {
    pub clients: Clients,
    pub pool: (Ipv4Addr, u8),
    pub refused: events::Log,
    /// Connections refused here by name (they never reach the nftables counters).
    pub refused_count: Arc<AtomicU64>,
    slots: Arc<Slots>,
}

/// The destination a connection had before `redirect` (`SO_ORIGINAL_DST`).
fn original_dst(conn: &TcpStream) -> std::io::Result<SocketAddrV4> {
    Ok(rustix::net::sockopt::ip_original_dst(conn)?)
}

/// The server name of a TLS ClientHello: `Some(Some(name))`, `Some(None)` when the hello
/// has none (or is not TLS), `None` when more bytes are needed.
pub(crate) fn sni(buf: &[u8]) -> Option<Option<String>> {
    if buf.len() < 5 {
        return None;
    }
    if buf[0] != 0x16 {
        return Some(None);
    }
    let rec_len = usize::from(u16::from_be_bytes([buf[3], buf[4]]));
    if buf.len() < 5 + rec_len {
        return None;
    }
    let h = &buf[5..5 + rec_len];
    let parse = || -> Option<String> {
        if *h.first()? != 1 {
            return None;
        }
        let mut i = 4 + 2 + 32; // handshake header, version, random
        i += 1 + usize::from(*h.get(i)?); // session id
        i += 2 + usize::from(u16::from_be_bytes([*h.get(i)?, *h.get(i + 1)?])); // suites
        i += 1 + usize::from(*h.get(i)?); // compression
        let ext_end = i + 2 + usize::from(u16::from_be_bytes([*h.get(i)?, *h.get(i + 1)?]));
        i += 2;
        while i + 4 <= ext_end.min(h.len()) {
            let kind = u16::from_be_bytes([h[i], h[i + 1]]);
            let len = usize::from(u16::from_be_bytes([h[i + 2], h[i + 3]]));
            let data = h.get(i + 4..i + 4 + len)?;
            if kind == 0 {
                // server_name_list: length, then (type 0 = host_name, length, name)
                let name_len = usize::from(u16::from_be_bytes([*data.get(3)?, *data.get(4)?]));
                let name = data.get(5..5 + name_len)?;
                return Some(String::from_utf8_lossy(name).to_ascii_lowercase());
            }
            i += 4 + len;
        }
        None
    };
    Some(parse())
}

/// The `Host` of an HTTP request head (port removed), with the same three outcomes as
/// [`sni`].
pub(crate) fn http_host(buf: &[u8]) -> Option<Option<String>> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return (buf.len() >= HEAD_MAX).then_some(None);
    };
    let head = String::from_utf8_lossy(&buf[..end]);
    Some(head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case("host").then(|| {
            let v = v.trim();
            v.rsplit_once(':')
                .map_or(v, |(h, p)| {
                    if p.bytes().all(|b| b.is_ascii_digit()) {
                        h
                    } else {
                        v
                    }
                })
                .to_ascii_lowercase()
        })
    }))
}

/// Where a request head ends (`\r\n\r\n`), searching only bytes from `from` on (minus
/// the three a terminator split across reads may have there), so a head that trickles in
/// byte by byte costs linear, not quadratic, time.
fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    let start = from.saturating_sub(3);
    buf[start..]
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| start + i)
}

/// Why a relay ended early.
#[derive(Debug, PartialEq)]
enum RelayEnd {
    /// Neither side sent a byte for the idle timeout.
    Idle,
    /// A read or write failed (a reset, typically).
    Failed,
}

/// Copies both ways until both sides are done, or neither has sent a byte for `idle`.
/// Each side's end is passed on as a half-close, as `copy_bidirectional` does.
async fn relay(a: &mut TcpStream, b: &mut TcpStream, idle: Duration) -> Result<(), RelayEnd> {
    let start = tokio::time::Instant::now();
    // Milliseconds from `start` to the last byte either way.
    let last = AtomicU64::new(0);
    let (mut ar, mut aw) = a.split();
    let (mut br, mut bw) = b.split();
    tokio::try_join!(
        pump(&mut ar, &mut bw, idle, start, &last),
        pump(&mut br, &mut aw, idle, start, &last)
    )
    .map(|_| ())
}

/// One direction of [`relay`].
async fn pump(
    r: &mut (impl AsyncReadExt + Unpin),
    w: &mut (impl AsyncWriteExt + Unpin),
    idle: Duration,
    start: tokio::time::Instant,
    last: &AtomicU64,
) -> Result<(), RelayEnd> {
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let mut buf = vec![0u8; 8 * 1024];
    loop {
        let quiet = ms(start.elapsed()).saturating_sub(last.load(Ordering::Relaxed));
        if quiet >= ms(idle) {
            return Err(RelayEnd::Idle);
        }
        let wait = idle - Duration::from_millis(quiet);
        match tokio::time::timeout(wait, r.read(&mut buf)).await {
            Ok(Ok(0)) => {
                let _ = w.shutdown().await;
                return Ok(());
            }
            Ok(Ok(n)) => {
                w.write_all(&buf[..n]).await.map_err(|_| RelayEnd::Failed)?;
                last.store(ms(start.elapsed()), Ordering::Relaxed);
            }
            Ok(Err(_)) => return Err(RelayEnd::Failed),
            // Quiet this way: the end only if the other way was quiet too (checked above).
            Err(_) => {}
        }
    }
}

impl Proxy {
    pub(crate) fn new(
        clients: Clients,
        pool: (Ipv4Addr, u8),
        refused: events::Log,
        refused_count: Arc<AtomicU64>,
    ) -> Proxy {
        Proxy {
            clients,
            pool,
            refused,
            refused_count,
            slots: Slots::new(
                "proxy_connections",
                MAX_CONNECTIONS_PER_SANDBOX,
                MAX_CONNECTIONS,
                ("proxy_connections_per_sandbox", "proxy_connections"),
            ),
        }
    }

    /// Serves redirected connections on `listener` forever.
    pub(crate) async fn serve(self: Arc<Self>, listener: TcpListener) {
        loop {
            let (conn, peer, slot) = limits::accept(&listener, &self.slots).await;
            let Some(slot) = slot else {
                if let Ok(dst) = original_dst(&conn) {
                    self.record(*peer.ip(), dst, None);
                }
                continue; // dropping `conn` closes it
            };
            let this = Arc::clone(&self);
            tokio::spawn(async move {
                let _slot = slot;
                this.handle(conn, peer).await;
            });
        }
    }

    async fn handle(&self, mut conn: TcpStream, peer: SocketAddrV4) {
        let Ok(dst) = original_dst(&conn) else { return };
        let client = self.clients.read().expect("lock").get(peer.ip()).cloned();
        let Some(client) = client else { return };
        let mut head = Vec::new();
        let name = tokio::time::timeout(HEAD_TIMEOUT, async {
            let mut chunk = [0u8; 4096];
            let mut scanned = 0;
            loop {
                let parsed = if dst.port() == 443 {
                    sni(&head)
                } else if head_end(&head, scanned).is_some() || head.len() >= HEAD_MAX {
                    http_host(&head)
                } else {
                    None
                };
                scanned = head.len();
                if let Some(name) = parsed {
                    return name;
                }
                match conn.read(&mut chunk).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => head.extend_from_slice(&chunk[..n]),
                }
                if head.len() > HEAD_MAX {
                    return None;
                }
            }
        })
        .await;
        let Ok(name) = name else {
            HEAD_SILENT.refuse(
                *peer.ip(),
                &format!("a connection through the name-checking proxy named no destination in {HEAD_TIMEOUT:?}: closed"),
            );
            return;
        };
        let allowed = name.as_deref().and_then(|n| client.policy.domain_ports(n));
        let allowed = match allowed {
            Some(None) => true,
            Some(Some(ports)) => ports.contains(&dst.port()),
            None => false,
        };
        // Never toward the host itself (the resolver does not open such addresses anyway).
        let allowed = allowed && std::net::UdpSocket::bind((*dst.ip(), 0)).is_err();
        if !allowed {
            tracing::debug!(%peer, %dst, ?name, "connection refused by name");
            self.refused_count.fetch_add(1, Ordering::Relaxed);
            self.record(*peer.ip(), dst, name);
            return;
        }
        let upstream = tokio::time::timeout(HEAD_TIMEOUT, TcpStream::connect(dst)).await;
        let Ok(Ok(mut upstream)) = upstream else {
            return;
        };
        if upstream.write_all(&head).await.is_err() {
            return;
        }
        if relay(&mut conn, &mut upstream, IDLE_TIMEOUT).await == Err(RelayEnd::Idle) {
            metrics::counter!("dsec_network_limited_total", "limit" => "proxy_idle_timeout")
                .increment(1);
            tracing::debug!(%peer, %dst, "idle proxied connection closed");
        }
    }

    /// Files a refused connection from `src` to `dst` (naming `name`) as an event of its
    /// sandbox.
    fn record(&self, src: Ipv4Addr, dst: SocketAddrV4, name: Option<String>) {
        let Some(n) = u32::from(src).checked_sub(u32::from(self.pool.0)) else {
            return;
        };
        events::record(
            &self.refused,
            n,
            Refused::now(*dst.ip(), dst.port(), "tcp", name),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client_hello(name: &str) -> Vec<u8> {
        let be16 = |n: usize| u16::try_from(n).unwrap().to_be_bytes();
        let mut sni_ext = Vec::new();
        let n = name.as_bytes();
        sni_ext.extend_from_slice(&be16(n.len() + 3));
        sni_ext.push(0);
        sni_ext.extend_from_slice(&be16(n.len()));
        sni_ext.extend_from_slice(n);
        let mut exts = vec![0, 0];
        exts.extend_from_slice(&be16(sni_ext.len()));
        exts.extend_from_slice(&sni_ext);
        let mut body = vec![3, 3];
        body.extend_from_slice(&[0; 32]);
        body.push(0); // session id
        body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one suite
        body.extend_from_slice(&[1, 0]); // null compression
        body.extend_from_slice(&be16(exts.len()));
        body.extend_from_slice(&exts);
        let mut hs = vec![1];
        hs.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 3, 1];
        rec.extend_from_slice(&be16(hs.len()));
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn reads_the_sni_of_a_client_hello() {
        let hello = client_hello("PyPI.org");
        assert_eq!(sni(&hello), Some(Some("pypi.org".into())));
        assert_eq!(sni(&hello[..hello.len() - 1]), None);
        assert_eq!(sni(b"GET / HTTP/1.1\r\n"), Some(None));
    }

    #[test]
    fn finds_a_head_end_split_across_reads() {
        let head = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n";
        let split = head.len() - 2;
        assert_eq!(head_end(&head[..split], 0), None);
        assert_eq!(head_end(head, split), Some(head.len() - 4));
    }

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        (c, l.accept().await.unwrap().0)
    }

    /// A relay passes bytes and half-closes both ways, and ends when both sides are quiet
    /// for the idle time; bytes one way keep it open.
    #[tokio::test]
    async fn relays_until_both_sides_are_quiet() {
        let idle = Duration::from_millis(300);
        let (mut client, mut inner) = pair().await;
        let (mut outer, mut server) = pair().await;
        let relayed = tokio::spawn(async move { relay(&mut inner, &mut outer, idle).await });
        let started = tokio::time::Instant::now();
        for _ in 0..4 {
            tokio::time::sleep(idle / 2).await;
            client.write_all(b"x").await.unwrap();
            let mut b = [0u8; 1];
            server.read_exact(&mut b).await.unwrap();
        }
        assert!(!relayed.is_finished(), "bytes one way keep the relay open");
        assert_eq!(relayed.await.unwrap(), Err(RelayEnd::Idle));
        assert!(started.elapsed() >= idle * 2 + idle);
        let mut rest = Vec::new();
        server.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());

        let (mut client, mut inner) = pair().await;
        let (mut outer, mut server) = pair().await;
        let relayed = tokio::spawn(async move { relay(&mut inner, &mut outer, idle * 10).await });
        client.write_all(b"ping").await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"ping");
        server.write_all(b"pong").await.unwrap();
        drop(server);
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"pong");
        assert_eq!(relayed.await.unwrap(), Ok(()));
    }

    #[test]
    fn reads_the_host_of_an_http_request() {
        let req = b"GET / HTTP/1.1\r\nUser-Agent: x\r\nHOST: Files.example.org:8080\r\n\r\n";
        assert_eq!(http_host(req), Some(Some("files.example.org".into())));
        assert_eq!(http_host(&req[..20]), None);
        assert_eq!(http_host(b"GET / HTTP/1.0\r\n\r\n"), Some(None));
    }
}
