//! Caps on what one sandbox can hold of the host's shared network services (the
//! resolver and the name-checking proxy), so that no sandbox can use up what every other
//! sandbox's egress needs; and the reporting of every refusal: the counter
//! `dsec_network_limited_total{limit}` and a warning, at most one per limit every
//! [`LOG_EVERY`] (a flood must not become a log flood), with the number refused since.
//!
//! The kernel-side caps (conntrack entries per sandbox, addresses its answers opened) are
//! nftables rules; see `nft`.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Shortest time between two warnings about one limit.
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(10);

/// One limit's refusals: counted, and logged at a bounded rate.
pub(crate) struct Refusals {
    limit: &'static str,
    /// When the last warning went out, and how many refusals came since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Refusals {
    pub(crate) const fn new(limit: &'static str) -> Refusals {
        Refusals {
            limit,
            state: Mutex::new((None, 0)),
        }
    }

    /// Counts one refusal of `sandbox` (its address); `why` completes the warning.
    pub(crate) fn refuse(&self, sandbox: Ipv4Addr, why: &str) {
        metrics::counter!("dsec_network_limited_total", "limit" => self.limit).increment(1);
        let mut state = self.state.lock().expect("lock");
        let (last, since) = &mut *state;
        *since += 1;
        if last.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
            tracing::warn!(limit = self.limit, %sandbox, refused = *since, "{why}");
            *last = Some(Instant::now());
            *since = 0;
        }
    }
}

/// Slots of one shared service: at most `per_sandbox` held by each sandbox, at most
/// `total` by all of them.
pub(crate) struct Slots {
    name: &'static str,
    per_sandbox: usize,
    total: Arc<Semaphore>,
    held: Mutex<HashMap<Ipv4Addr, usize>>,
    sandbox_full: Refusals,
    all_full: Refusals,
}

/// A slot held; given back when dropped.
pub(crate) struct Slot {
    slots: Arc<Slots>,
    sandbox: Ipv4Addr,
    _permit: OwnedSemaphorePermit,
}

impl Slots {
    /// `name` labels the gauge `dsec_network_slots_in_use{service}` and the limits
    /// `<name>_per_sandbox` and `<name>` of `dsec_network_limited_total`.
    pub(crate) fn new(
        name: &'static str,
        per_sandbox: usize,
        total: usize,
        limits: (&'static str, &'static str),
    ) -> Arc<Slots> {
        Arc::new(Slots {
            name,
            per_sandbox,
            total: Arc::new(Semaphore::new(total)),
            held: Mutex::default(),
            sandbox_full: Refusals::new(limits.0),
            all_full: Refusals::new(limits.1),
        })
    }

    /// A slot for `sandbox`, or `None` (counted and logged) when it holds its share or
    /// every slot is taken.
    pub(crate) fn try_take(self: &Arc<Self>, sandbox: Ipv4Addr) -> Option<Slot> {
        let mut held = self.held.lock().expect("lock");
        let mine = held.get(&sandbox).copied().unwrap_or(0);
        if mine >= self.per_sandbox {
            drop(held);
            self.sandbox_full.refuse(
                sandbox,
                &format!(
                    "a sandbox holds all {} of its {} slots: refused",
                    self.per_sandbox, self.name
                ),
            );
            return None;
        }
        let Ok(permit) = Arc::clone(&self.total).try_acquire_owned() else {
            drop(held);
            self.all_full.refuse(
                sandbox,
                &format!("every {} slot of this server is taken: refused", self.name),
            );
            return None;
        };
        held.insert(sandbox, mine + 1);
        metrics::gauge!("dsec_network_slots_in_use", "service" => self.name).increment(1.0);
        Some(Slot {
            slots: Arc::clone(self),
            sandbox,
            _permit: permit,
        })
    }

    /// Slots `sandbox` holds now.
    #[cfg(test)]
    fn held_by(&self, sandbox: Ipv4Addr) -> usize {
        self.held
            .lock()
            .expect("lock")
            .get(&sandbox)
            .copied()
            .unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().expect("lock");
        if let Some(n) = held.get_mut(&self.sandbox) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.sandbox);
            }
        }
        metrics::gauge!("dsec_network_slots_in_use", "service" => self.slots.name).decrement(1.0);
    }
}

/// The next connection on `listener` from an IPv4 peer, with a slot of `slots` for it, or
/// `None` for the slot when its sandbox holds its share or every slot is taken (counted
/// and logged; dropping the connection closes it).
pub(crate) async fn accept(
    listener: &TcpListener,
    slots: &Arc<Slots>,
) -> (TcpStream, SocketAddrV4, Option<Slot>) {
    static FAILED: Refusals = Refusals::new("accept_failed");
    loop {
        match listener.accept().await {
            Ok((conn, SocketAddr::V4(peer))) => {
                let slot = slots.try_take(*peer.ip());
                return (conn, peer, slot);
            }
            Ok(_) => {}
            // With descriptors exhausted (EMFILE) accept fails at once, again and again:
            // retrying without a pause would spin a core.
            Err(e) => {
                FAILED.refuse(
                    Ipv4Addr::UNSPECIFIED,
                    &format!("{}: accept failed: {e}", slots.name),
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// A token bucket: `rate` events a second on average, bursts of up to `burst`.
pub(crate) struct Bucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl Bucket {
    pub(crate) fn new(rate: f64, burst: f64) -> Bucket {
        Bucket {
            rate,
            burst,
            tokens: burst,
            at: Instant::now(),
        }
    }

    /// Takes a token if one is there.
    pub(crate) fn take(&mut self) -> bool {
        let now = Instant::now();
        let earned = now.duration_since(self.at).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + earned).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_sandbox_cannot_take_another_ones_share() {
        let slots = Slots::new("test", 2, 3, ("t_per_sandbox", "t"));
        let (a, b) = (Ipv4Addr::new(10, 0, 0, 2), Ipv4Addr::new(10, 0, 0, 3));
        let a1 = slots.try_take(a).unwrap();
        let _a2 = slots.try_take(a).unwrap();
        assert!(slots.try_take(a).is_none(), "a holds its share");
        let b1 = slots.try_take(b).unwrap();
        assert!(slots.try_take(b).is_none(), "every slot is taken");
        drop(a1);
        assert_eq!(slots.held_by(a), 1);
        let _b2 = slots.try_take(b).unwrap();
        drop(b1);
        assert_eq!(slots.held_by(b), 1);
    }

    #[test]
    fn a_bucket_allows_its_burst_then_its_rate() {
        let mut bucket = Bucket::new(1000.0, 5.0);
        assert_eq!((0..5).filter(|_| bucket.take()).count(), 5);
        assert!(!bucket.take());
        std::thread::sleep(Duration::from_millis(20));
        assert!(bucket.take());
    }
}
