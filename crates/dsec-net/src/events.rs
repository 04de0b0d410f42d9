//! Refused connections as events: each refusing nftables rule is preceded by a
//! rate-limited `log group G` rule; a reader thread bound to group G turns each logged
//! packet into a [`Refused`] of the sandbox that sent it (found by source address).
//!
//! The name-checking proxy files the connections it refuses, and the resolver the
//! questions for names a sandbox's policy does not allow (with the name: what a sandbox
//! looking for a package mirror or a site to fetch code from asked for).
//!
//! Bounded: at most 50 logged packets a second per rule (nftables `limit`), and the last
//! [`KEEP`] events per sandbox. The refused *counter* (`dsec_network_refused_total`) counts
//! every packet, limited or not.

use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::netlink::{Logged, NfLog};
use crate::nft::LOG_PREFIX;

/// Events kept per sandbox (older ones are dropped first).
const KEEP: usize = 256;

/// A packet a sandbox's policy refused.
#[derive(Clone, Debug, PartialEq)]
pub struct Refused {
    /// When (seconds since the Unix epoch, as the server received the log message).
    pub time: f64,
    /// Destination address.
    pub dst: Ipv4Addr,
    /// Destination port (TCP and UDP).
    pub port: Option<u16>,
    /// `tcp`, `udp`, `icmp` or the IP protocol number; `dns` for a question the resolver
    /// refused (`dst` is then the resolver, and `port` 53).
    pub protocol: String,
    /// The name refused: a DNS question's, or the TLS SNI or HTTP `Host` of a connection
    /// the proxy refused (none for a refused packet).
    pub name: Option<String>,
}

impl Refused {
    /// A refusal made now by dsec's own resolver or proxy.
    pub(crate) fn now(dst: Ipv4Addr, port: u16, protocol: &str, name: Option<String>) -> Refused {
        Refused {
            time: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            dst,
            port: Some(port),
            protocol: protocol.to_owned(),
            name,
        }
    }
}

/// Refused events by sandbox chain number.
pub(crate) type Log = Arc<Mutex<HashMap<u32, VecDeque<Refused>>>>;

/// Files `event` under sandbox chain `n`, dropping its oldest beyond [`KEEP`]; an event of
/// a chain with no sandbox now (one just released) is dropped, so the log holds entries
/// only for sandboxes that exist.
pub(crate) fn record(log: &Log, n: u32, event: Refused) {
    let mut log = log.lock().expect("lock");
    let Some(events) = log.get_mut(&n) else {
        return;
    };
    if events.len() == KEEP {
        events.pop_front();
    }
    events.push_back(event);
}

/// The source address and the event of a logged packet, if it is dsec's and IPv4.
fn parse(logged: &Logged, time: f64) -> Option<(Ipv4Addr, Refused)> {
    if !logged.prefix.starts_with(LOG_PREFIX.trim_end()) {
        return None;
    }
    let p = &logged.payload;
    if p.len() < 20 || p[0] >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(p[0] & 0x0f) * 4;
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
    let port = match p[9] {
        6 | 17 if p.len() >= ihl + 4 => Some(u16::from_be_bytes([p[ihl + 2], p[ihl + 3]])),
        _ => None,
    };
    let protocol = match p[9] {
        6 => "tcp".to_owned(),
        17 => "udp".to_owned(),
        1 => "icmp".to_owned(),
        other => other.to_string(),
    };
    Some((
        src,
        Refused {
            time,
            dst,
            port,
            protocol,
            name: None,
        },
    ))
}

/// Binds the first free nflog group from `first` on (within `0x6400`-`0x64ff`: another
/// dsec server, or anything else, may hold some), returning it and its number; on failure,
/// the error and `first`.
///
/// The kernel answers a bind of a group another socket holds with `EPERM` (not `EBUSY`,
/// which is its answer to a second bind by the same socket), the answer it also gives a
/// process without `CAP_NET_ADMIN`: both mean "try the next"; if every group says so,
/// the error says which it may be.
pub(crate) fn bind(first: u16) -> (std::io::Result<NfLog>, u16) {
    for k in 0..256u16 {
        let group = 0x6400 | ((first.wrapping_add(k)) & 0xff);
        match NfLog::bind(group, 64, Duration::from_secs(1)) {
            Ok(nflog) => return (Ok(nflog), group),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::EBUSY)) => {}
            Err(e) => return (Err(e), first),
        }
    }
    let taken = std::io::Error::other(
        "every nflog group 0x6400-0x64ff is another socket's, or this process lacks CAP_NET_ADMIN",
    );
    (Err(taken), first)
}

/// Reads `nflog` on a thread of its own and files events under the chain number of their
/// source address in `pool`, until `stop` is set.
pub(crate) fn start(
    nflog: NfLog,
    pool: (Ipv4Addr, u8),
    log: Log,
    stop: Arc<AtomicBool>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("dsec-net-refused".into())
        .spawn(move || {
            let mask = u32::MAX << (32 - pool.1);
            while !stop.load(Ordering::Relaxed) {
                for logged in nflog.recv() {
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0.0, |d| d.as_secs_f64());
                    let Some((src, event)) = parse(&logged, now) else {
                        continue;
                    };
                    if u32::from(src) & mask != u32::from(pool.0) {
                        continue;
                    }
                    tracing::debug!(%src, dst = %event.dst, port = ?event.port, "refused");
                    record(&log, u32::from(src) - u32::from(pool.0), event);
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_destination_and_port_of_a_logged_packet() {
        let mut p = vec![0x45, 0, 0, 40, 0, 0, 0, 0, 64, 6, 0, 0];
        p.extend_from_slice(&[10, 209, 0, 7, 192, 0, 2, 10]);
        p.extend_from_slice(&[0x9c, 0x40, 0x01, 0xbb]);
        let logged = Logged {
            prefix: LOG_PREFIX.to_owned(),
            payload: p,
        };
        let (src, ev) = parse(&logged, 1.0).unwrap();
        assert_eq!(src, Ipv4Addr::new(10, 209, 0, 7));
        assert_eq!(ev.dst, Ipv4Addr::new(192, 0, 2, 10));
        assert_eq!(ev.port, Some(443));
        assert_eq!(ev.protocol, "tcp");
        let other = Logged {
            prefix: "someone else".into(),
            payload: logged.payload.clone(),
        };
        assert!(parse(&other, 1.0).is_none());
    }

    #[test]
    fn keeps_the_last_events_of_attached_sandboxes_only() {
        let log = Log::default();
        let event = |port| Refused {
            time: 0.0,
            dst: Ipv4Addr::new(192, 0, 2, 1),
            port: Some(port),
            protocol: "udp".into(),
            name: None,
        };
        record(&log, 7, event(1));
        assert!(log.lock().unwrap().is_empty(), "no sandbox 7: dropped");
        log.lock().unwrap().insert(7, VecDeque::new());
        for port in 0..(u16::try_from(KEEP).unwrap() + 10) {
            record(&log, 7, event(port));
        }
        let kept = &log.lock().unwrap()[&7];
        assert_eq!(kept.len(), KEEP);
        assert_eq!(kept.front().unwrap().port, Some(10));
    }
}
