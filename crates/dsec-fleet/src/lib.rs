//! A dsec fleet: many edges (one per host) and stateless apiservers, joined through etcd.
//!
//! - [`membership`]: an edge registers under `/dsec/edges/<name>` with a lease kept alive
//!   and publishes its load; apiservers watch the prefix into an in-memory [`EdgeTable`].
//! - [`placement`]: power-of-k choices over the live edges that offer a backend.
//! - [`apiserver`]: the `/v1` API, authenticated, each request forwarded to the edge its
//!   sandbox id names (streams as streams), creates placed and retried past vetoes; and
//!   E2B's control plane and envd endpoint, forwarded alike to the edges' own.
//! - [`projects`]: the projects and their token hashes in etcd, shared by every apiserver.
//! - [`quotas`]: each edge's use of each project in etcd, so that quotas hold over the fleet.
//!
//! `dsec serve` (crates/dsec-server) stays the one-process default and knows none of this.
#![warn(missing_docs)]

pub mod apiserver;
pub mod membership;
pub mod placement;
pub mod projects;
pub mod quotas;

pub use membership::{EdgeE2b, EdgeMembership, EdgeRecord, EdgeTable, FleetError};

/// The etcd prefix edges register under.
pub const EDGE_PREFIX: &str = "/dsec/edges/";

/// The edge a sandbox id names: ids are `<edge>-<12 hex digits>`.
pub fn edge_of(sandbox_id: &str) -> Option<&str> {
    let (edge, tail) = sandbox_id.rsplit_once('-')?;
    (!edge.is_empty() && tail.len() == 12 && tail.bytes().all(|b| b.is_ascii_hexdigit()))
        .then_some(edge)
}

/// Refuses edge names that could not prefix a sandbox id or an etcd key plainly.
pub fn check_edge_name(name: &str) -> Result<(), FleetError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && name.as_bytes()[0].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(FleetError::BadName(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids_name_their_edge() {
        assert_eq!(edge_of("e1-0123456789ab"), Some("e1"));
        assert_eq!(edge_of("host-a-0123456789ab"), Some("host-a"));
        assert_eq!(edge_of("e1-xyz"), None);
        assert_eq!(edge_of("-0123456789ab"), None);
        assert_eq!(edge_of("nodash"), None);
    }

    #[test]
    fn edge_names() {
        assert!(check_edge_name("edge-1.rack_2").is_ok());
        for bad in ["", "-a", "a/b", "a b", &"x".repeat(64)] {
            assert!(check_edge_name(bad).is_err(), "{bad:?}");
        }
    }
}
