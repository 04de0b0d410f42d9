//! Where a project's registry import may connect.
//!
//! A project names the registry it imports from, and the server fetches with its own
//! network position: without a check, an import would be a project's way to the host's
//! loopback services, the private network behind it and the cloud's metadata service (a
//! blind SSRF). Checking the reference alone is not enough: oci-client follows the
//! redirects a registry answers with and fetches the token `realm` it names, and it
//! builds its own HTTP client, so dsec cannot hook its resolver or redirect policy. What
//! it can set is a proxy, so a project's pull goes through a [`Guard`]: a proxy on
//! loopback for the length of that pull that resolves each host the client asks for and
//! connects only to a public address, or to a registry the admin trusts
//! (`--import-registry`), refusing the rest before any packet leaves. It resolves once
//! and connects to what it checked, so a name cannot be rebound in between.
//!
//! The guard reaches nothing a process on the host could not reach directly, so it needs
//! no credentials of its own. HTTPS goes through it as a `CONNECT` tunnel (it never sees
//! the plaintext); plain HTTP (loopback and `DSEC_INSECURE_REGISTRIES` registries) as one
//! request per connection, forwarded with `Connection: close` so that the client never
//! sends a second request, for another host, down a connection checked for the first.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// Largest request head the guard reads.
const MAX_HEAD: usize = 64 << 10;
/// How long the guard waits for one address to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// What a project's import may reach besides public addresses, and what it may not
/// reach even there.
#[derive(Debug, Clone, Default)]
pub struct ProjectReach {
    /// Registries (`host[:port]`, as in a reference) a project may import from whatever
    /// their address: those the admin runs for tenants on a private network.
    pub trusted: Vec<String>,
    /// Addresses no project's import may reach although they are public: the operator's
    /// protected services (`--protect`, the fleet's etcd, ...).
    pub protected: Vec<IpAddr>,
}

/// Why the guard carried no connection to a destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Blocked {
    /// The project may not reach it: the pull is not allowed.
    Refused(Refusal),
    /// It could not be reached (no such name, nothing listening): the registry's failure.
    Unreachable(String),
}

/// A destination a project's import may not reach, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    host: String,
    port: u16,
    why: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{} is {}: a project imports from registries at public addresses, and from \
             those the server trusts (--import-registry)",
            self.host, self.port, self.why
        )
    }
}

impl ProjectReach {
    /// Whether `host:port` is a registry the admin trusts.
    fn trusts(&self, host: &str, port: u16) -> bool {
        self.trusted.iter().any(|entry| {
            let (h, p) = split_authority(entry, port).unwrap_or_default();
            h.eq_ignore_ascii_case(host) && p == port
        })
    }

    /// The addresses of `host:port` a project's import may connect to, or why there are
    /// none.
    async fn addresses(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, Blocked> {
        let found: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| Blocked::Unreachable(format!("{host}:{port} does not resolve: {e}")))?
            .collect();
        if self.trusts(host, port) {
            return Ok(found);
        }
        let mut first_refused = None;
        let allowed: Vec<SocketAddr> = found
            .into_iter()
            .filter(|a| match self.unreachable(a.ip()) {
                None => true,
                Some(kind) => {
                    first_refused.get_or_insert((a.ip(), kind));
                    false
                }
            })
            .collect();
        match (allowed.is_empty(), first_refused) {
            (false, _) => Ok(allowed),
            (true, Some((ip, kind))) => Err(Blocked::Refused(Refusal {
                host: host.to_owned(),
                port,
                why: format!("{ip}, {kind}"),
            })),
            (true, None) => Err(Blocked::Unreachable(format!(
                "{host}:{port} resolves to no address"
            ))),
        }
    }

    /// What kind of address `ip` is, if a project's import may not reach it.
    fn unreachable(&self, ip: IpAddr) -> Option<&'static str> {
        if self.protected.contains(&ip) {
            return Some("a service the server protects");
        }
        if let Some(kind) = non_public(ip) {
            return Some(kind);
        }
        // One of the host's own addresses: its services listen there too.
        std::net::UdpSocket::bind((ip, 0))
            .is_ok()
            .then_some("an address of the server's own host")
    }
}

/// What kind of address `ip` is, if it is not a public unicast one.
fn non_public(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => non_public_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => non_public_v4(v4),
            None => non_public_v6(v6),
        },
    }
}

fn non_public_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    if ip.is_loopback() {
        Some("a loopback address")
    } else if ip.is_private() || (a == 100 && (64..128).contains(&b)) {
        Some("a private address")
    } else if ip.is_link_local() {
        Some("a link-local address (where clouds serve instance metadata)")
    } else if ip.is_unspecified() || a == 0 || ip.is_broadcast() || ip.is_multicast() || a >= 240 {
        Some("not a unicast address")
    } else if (a == 192 && b == 0) || (a == 198 && (18..20).contains(&b)) || ip.is_documentation() {
        Some("a reserved address")
    } else {
        None
    }
}

fn non_public_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let first = ip.segments()[0];
    if ip.is_loopback() {
        Some("a loopback address")
    } else if first & 0xfe00 == 0xfc00 {
        Some("a private (unique local) address")
    } else if first & 0xffc0 == 0xfe80 {
        Some("a link-local address")
    } else if ip.is_unspecified() || ip.is_multicast() {
        Some("not a unicast address")
    } else if first == 0x64 || first == 0x2002 || ip.segments()[..2] == [0x2001, 0xdb8] {
        // NAT64 and 6to4 embed an IPv4 address that may be a private one.
        Some("a translated or reserved address")
    } else {
        None
    }
}

/// `host[:port]` or `[v6][:port]` split, with `default` for a missing port.
fn split_authority(authority: &str, default: u16) -> Option<(String, u16)> {
    let (host, port) = match authority.strip_prefix('[') {
        Some(rest) => {
            let (host, after) = rest.split_once(']')?;
            (host, after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') => (host, Some(port)),
            _ => (authority, None),
        },
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default,
    };
    (!host.is_empty()).then(|| (host.to_owned(), port))
}

/// A proxy on loopback that lets a project's pull reach only what [`ProjectReach`]
/// allows; it stops, with every connection through it, when dropped.
pub(crate) struct Guard {
    url: String,
    blocked: Arc<Mutex<Option<Blocked>>>,
    serving: tokio::task::JoinHandle<()>,
}

impl Guard {
    /// Starts a guard for one pull.
    pub(crate) async fn start(reach: Arc<ProjectReach>) -> io::Result<Guard> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let blocked = Arc::new(Mutex::new(None));
        let serving = tokio::spawn(serve(listener, reach, Arc::clone(&blocked)));
        Ok(Guard {
            url,
            blocked,
            serving,
        })
    }

    /// The proxy URL to give the client.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Why the guard carried no connection, if it did not for one: the first refusal, else
    /// the last destination it could not reach. Why the pull failed.
    pub(crate) fn blocked(&self) -> Option<Blocked> {
        self.blocked.lock().expect("lock").clone()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.serving.abort();
    }
}

async fn serve(
    listener: TcpListener,
    reach: Arc<ProjectReach>,
    blocked: Arc<Mutex<Option<Blocked>>>,
) {
    // Held here, so that aborting this task ends every connection with it.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let conn = match accepted {
                    Ok((conn, _)) => conn,
                    Err(e) => {
                        // Out of descriptors, say: the pull's requests wait, or time out.
                        tracing::warn!(error = %e, "a project's import: the guard cannot accept");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let reach = Arc::clone(&reach);
                let blocked = Arc::clone(&blocked);
                connections.spawn(async move {
                    if let Err(e) = carry(conn, &reach, &blocked).await {
                        tracing::debug!(error = %e, "a project's import: proxied connection ended");
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Serves one client connection: a `CONNECT` tunnel, or one plain HTTP request.
async fn carry(
    mut client: TcpStream,
    reach: &ProjectReach,
    blocked: &Mutex<Option<Blocked>>,
) -> io::Result<()> {
    let (mut buf, end) = read_head(&mut client).await?;
    let head = std::str::from_utf8(&buf[..end])
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "request head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let mut request = lines.next().unwrap_or_default().split(' ');
    let (Some(method), Some(target), Some(version), None) = (
        request.next(),
        request.next(),
        request.next(),
        request.next(),
    ) else {
        return answer(&mut client, "400 Bad Request").await;
    };
    let tunnel = method == "CONNECT";
    let (authority, path) = if tunnel {
        (target, "")
    } else if let Some(rest) = target.strip_prefix("http://") {
        rest.split_at(rest.find('/').unwrap_or(rest.len()))
    } else {
        return answer(&mut client, "400 Bad Request").await;
    };
    let Some((host, port)) = split_authority(authority, if tunnel { 443 } else { 80 }) else {
        return answer(&mut client, "400 Bad Request").await;
    };
    let connected = match reach.addresses(&host, port).await {
        Ok(addrs) => connect(&addrs)
            .await
            .map_err(|e| Blocked::Unreachable(format!("cannot connect to {host}:{port}: {e}"))),
        Err(why) => Err(why),
    };
    let mut upstream = match connected {
        Ok(upstream) => upstream,
        Err(why) => {
            let status = match &why {
                Blocked::Refused(refusal) => {
                    tracing::warn!(%refusal, "a project's import was refused a connection");
                    "403 Forbidden"
                }
                Blocked::Unreachable(_) => "502 Bad Gateway",
            };
            record(blocked, why);
            return answer(&mut client, status).await;
        }
    };
    if tunnel {
        client
            .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
            .await?;
    } else {
        let mut forwarded = format!(
            "{method} {} {version}\r\n",
            if path.is_empty() { "/" } else { path }
        );
        for line in lines.filter(|l| !l.is_empty()) {
            let name = line
                .split(':')
                .next()
                .unwrap_or_default()
                .to_ascii_lowercase();
            if !(name.starts_with("proxy-") || name == "connection" || name == "keep-alive") {
                forwarded.push_str(line);
                forwarded.push_str("\r\n");
            }
        }
        forwarded.push_str("Connection: close\r\n\r\n");
        upstream.write_all(forwarded.as_bytes()).await?;
    }
    // What the client sent after its head (a body, or the TLS hello of a tunnel).
    upstream.write_all(&buf.split_off(end + 4)).await?;
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await?;
    Ok(())
}

/// Keeps `why` as the pull's failure: a refusal is what the project must hear, so a host
/// that did not answer only stands until one comes.
fn record(blocked: &Mutex<Option<Blocked>>, why: Blocked) {
    let mut slot = blocked.lock().expect("lock");
    if !matches!(*slot, Some(Blocked::Refused(_))) {
        *slot = Some(why);
    }
}

/// Reads up to the end of the request head; returns what was read and where the head
/// ends (before its blank line).
async fn read_head(conn: &mut TcpStream) -> io::Result<(Vec<u8>, usize)> {
    let mut buf = Vec::with_capacity(4096);
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Ok((buf, end));
        }
        if buf.len() >= MAX_HEAD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "request head too long",
            ));
        }
        let mut chunk = [0; 4096];
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Connects to the first of `addrs` that accepts.
async fn connect(addrs: &[SocketAddr]) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for addr in addrs {
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(e)) => last = e,
            Err(_) => last = io::ErrorKind::TimedOut.into(),
        }
    }
    Err(last)
}

async fn answer(client: &mut TcpStream, status: &str) -> io::Result<()> {
    let response = format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    client.write_all(response.as_bytes()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reach(trusted: &[&str]) -> ProjectReach {
        ProjectReach {
            trusted: trusted.iter().map(|s| (*s).to_owned()).collect(),
            protected: vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7))],
        }
    }

    #[test]
    fn only_public_unicast_addresses_are_reachable() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "169.254.169.254",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "fd00::1",
            "fe80::1",
            "::ffff:10.0.0.1",
            "64:ff9b::a00:1",
        ] {
            assert!(non_public(ip.parse().unwrap()).is_some(), "{ip}");
        }
        for ip in ["1.1.1.1", "151.101.0.223", "2a04:4e42::223"] {
            assert_eq!(non_public(ip.parse().unwrap()), None, "{ip}");
        }
        let protected = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 7));
        assert_eq!(
            reach(&[]).unreachable(protected),
            Some("a service the server protects")
        );
    }

    #[test]
    fn authorities_split_with_default_ports() {
        assert_eq!(
            split_authority("reg.example:5000", 443),
            Some(("reg.example".into(), 5000))
        );
        assert_eq!(
            split_authority("reg.example", 80),
            Some(("reg.example".into(), 80))
        );
        assert_eq!(
            split_authority("[::1]:5000", 443),
            Some(("::1".into(), 5000))
        );
        assert_eq!(split_authority("[::1]", 443), Some(("::1".into(), 443)));
        assert_eq!(split_authority("host:port", 443), None);
        assert_eq!(split_authority(":80", 443), None);
    }

    #[tokio::test]
    async fn trusted_registries_match_host_and_port() {
        let r = reach(&["127.0.0.1:5000", "localhost"]);
        assert!(r.addresses("127.0.0.1", 5000).await.is_ok());
        assert!(r.addresses("localhost", 443).await.is_ok());
        let refused = |blocked| match blocked {
            Blocked::Refused(refusal) => refusal.to_string(),
            Blocked::Unreachable(why) => panic!("not refused: {why}"),
        };
        let why = refused(r.addresses("127.0.0.1", 5001).await.unwrap_err());
        assert!(
            why.starts_with("127.0.0.1:5001 is 127.0.0.1, a loopback address"),
            "{why}"
        );
        let why = refused(r.addresses("10.0.0.1", 443).await.unwrap_err());
        assert!(
            why.starts_with("10.0.0.1:443 is 10.0.0.1, a private address"),
            "{why}"
        );
        let why = refused(r.addresses("169.254.169.254", 80).await.unwrap_err());
        assert!(why.contains("a link-local address"), "{why}");
    }
}
