//! Power-of-k choices: of the live edges offering the backend, k are drawn and the least
//! loaded is tried first, then the other drawn ones, then (an edge may veto at capacity)
//! the least loaded few of the rest. A create with an idempotency key draws its k by rendezvous hashing of the
//! key, so every apiserver draws the same k for a retried create and can ask them whether
//! it was already made.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::Rng;

use crate::membership::{Member, Members};

/// Fallbacks asked after the drawn edges refused: a fleet whose least loaded edges all
/// refuse is full, and asking every other edge would cost a round trip each.
pub const MAX_FALLBACKS: usize = 8;

/// The order in which edges are asked to take a create.
#[derive(Debug)]
pub struct Placement {
    /// The edges to ask, best first: the drawn ones, then fallbacks.
    pub order: Vec<Arc<Member>>,
    /// How many of `order` were drawn (the rest are fallbacks after vetoes).
    pub drawn: usize,
}

impl Placement {
    /// Keeps the [`MAX_FALLBACKS`] least loaded fallbacks, least loaded first. Called
    /// once the drawn edges refused, so that a create placed at the first try pays no
    /// sort.
    pub fn narrow_fallbacks(&mut self) {
        let mut rest: Vec<(f64, Arc<Member>)> = self
            .order
            .drain(self.drawn..)
            .map(|m| (m.score(), m))
            .collect();
        rest.sort_by(|a, b| a.0.total_cmp(&b.0));
        self.order
            .extend(rest.into_iter().take(MAX_FALLBACKS).map(|(_, m)| m));
    }
}

/// Why nothing can be placed.
#[derive(Debug, PartialEq, Eq)]
pub enum NoPlacement {
    /// The table is empty.
    NoEdges,
    /// Edges exist, none (ready) accepts the create.
    NoEdgeOffers,
}

/// FNV-1a of the key and the edge name, for rendezvous hashing.
fn rendezvous(key: &str, edge: &str) -> u64 {
    let bytes = key.bytes().chain([0]).chain(edge.bytes());
    let h = bytes.fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    // A final mix: FNV's low bits alone spread short keys poorly.
    let h = (h ^ (h >> 33)).wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

/// Places a create of `backend` over `members` with `k` choices.
pub fn place(
    members: &Members,
    backend: &str,
    k: usize,
    key: Option<&str>,
    rng: &mut impl Rng,
) -> Result<Placement, NoPlacement> {
    place_where(members, |m| m.offers(backend), k, key, rng)
}

/// Places a create over the `members` that `accept` it, with `k` choices.
pub fn place_where(
    members: &Members,
    accept: impl Fn(&Member) -> bool,
    k: usize,
    key: Option<&str>,
    rng: &mut impl Rng,
) -> Result<Placement, NoPlacement> {
    if members.list.is_empty() {
        return Err(NoPlacement::NoEdges);
    }
    let mut order: Vec<Arc<Member>> = members.list.iter().filter(|m| accept(m)).cloned().collect();
    if order.is_empty() {
        return Err(NoPlacement::NoEdgeOffers);
    }
    let drawn = k.clamp(1, order.len());
    match key {
        Some(key) => {
            // The k with the highest rendezvous weight first, the rest after in the same
            // (deterministic) order.
            order.sort_by_cached_key(|m| std::cmp::Reverse(rendezvous(key, &m.record.name)));
        }
        None => {
            let n = order.len();
            for i in 0..drawn {
                let j = rng.random_range(i..n);
                order.swap(i, j);
            }
            order[drawn..].shuffle(rng);
        }
    }
    order[..drawn].sort_by(|a, b| a.score().total_cmp(&b.score()));
    order[0].placed.fetch_add(1, Ordering::Relaxed);
    Ok(Placement { order, drawn })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::EdgeRecord;
    use dsec_server::edge::EdgeLoad;

    fn edge(name: &str, promised: u64, backends: &[&str]) -> EdgeRecord {
        EdgeRecord {
            name: name.into(),
            url: format!("http://{name}"),
            ready: true,
            load: EdgeLoad {
                backends: backends.iter().map(|b| b.to_string()).collect(),
                memory_budget_mb: 1000,
                memory_promised_mb: promised,
                sandbox_count: promised / 100,
                ..Default::default()
            },
            updated_at: 0.0,
            e2b: None,
        }
    }

    #[test]
    fn the_less_loaded_of_the_two_drawn_goes_first() {
        let mut rng = rand::rng();
        for _ in 0..20 {
            let members =
                Members::new([edge("a", 900, &["container"]), edge("b", 0, &["container"])]);
            let p = place(&members, "container", 2, None, &mut rng).unwrap();
            assert_eq!(p.order[0].record.name, "b");
            assert_eq!(p.order.len(), 2);
        }
        // What was placed counts until the edge publishes again: b (0.512 per sandbox
        // placed) passes a (0.9) after two.
        let members = Members::new([edge("a", 900, &["container"]), edge("b", 0, &["container"])]);
        let firsts: Vec<String> = (0..3)
            .map(|_| {
                place(&members, "container", 2, None, &mut rng)
                    .unwrap()
                    .order[0]
                    .record
                    .name
                    .clone()
            })
            .collect();
        assert_eq!(firsts, ["b", "b", "a"]);
    }

    #[test]
    fn only_edges_offering_the_backend_and_ready() {
        let mut not_ready = edge("c", 0, &["container"]);
        not_ready.ready = false;
        let members = Members::new([
            edge("a", 0, &["fncall"]),
            edge("b", 500, &["container"]),
            not_ready,
        ]);
        let p = place(&members, "container", 2, None, &mut rand::rng()).unwrap();
        let names: Vec<_> = p.order.iter().map(|m| m.record.name.as_str()).collect();
        assert_eq!(names, ["b"]);
        assert_eq!(
            place(&members, "vm", 2, None, &mut rand::rng()).unwrap_err(),
            NoPlacement::NoEdgeOffers
        );
        assert_eq!(
            place(&Members::default(), "vm", 2, None, &mut rand::rng()).unwrap_err(),
            NoPlacement::NoEdges
        );
    }

    #[test]
    fn a_key_draws_the_same_edges_everywhere() {
        let records: Vec<_> = (0..20)
            .map(|i| edge(&format!("e{i}"), 0, &["container"]))
            .collect();
        let first = Members::new(records.clone());
        let second = Members::new(records.into_iter().rev());
        let drawn = |m: &Members| {
            let p = place(m, "container", 2, Some("key-1"), &mut rand::rng()).unwrap();
            let mut names: Vec<String> = p.order[..p.drawn]
                .iter()
                .map(|m| m.record.name.clone())
                .collect();
            names.sort();
            names
        };
        assert_eq!(drawn(&first), drawn(&second));
    }

    #[test]
    fn after_vetoes_the_least_loaded_few_are_asked() {
        let records: Vec<_> = (0..20)
            .map(|i| edge(&format!("e{i:02}"), 50 * i, &["container"]))
            .collect();
        let members = Members::new(records);
        let mut p = place(&members, "container", 2, None, &mut rand::rng()).unwrap();
        let drawn: Vec<String> = p.order[..2].iter().map(|m| m.record.name.clone()).collect();
        p.narrow_fallbacks();
        assert_eq!(p.order.len(), 2 + MAX_FALLBACKS);
        let fallbacks: Vec<u64> = p.order[2..]
            .iter()
            .map(|m| m.record.load.memory_promised_mb)
            .collect();
        let mut sorted = fallbacks.clone();
        sorted.sort_unstable();
        assert_eq!(fallbacks, sorted);
        // The least loaded edges not drawn.
        let expected: Vec<u64> = (0..20u64)
            .map(|i| 50 * i)
            .filter(|mb| !drawn.contains(&format!("e{:02}", mb / 50)))
            .take(MAX_FALLBACKS)
            .collect();
        assert_eq!(fallbacks, expected);
    }

    #[test]
    fn placements_spread_and_count_what_was_placed() {
        let records: Vec<_> = (0..4)
            .map(|i| edge(&format!("e{i}"), 0, &["container"]))
            .collect();
        let members = Members::new(records);
        let mut rng = rand::rng();
        for _ in 0..400 {
            place(&members, "container", 2, None, &mut rng).unwrap();
        }
        for m in &members.list {
            let placed = m.placed.load(Ordering::Relaxed);
            assert!((80..=120).contains(&placed), "{}: {placed}", m.record.name);
        }
    }
}
