//! Project quotas over a whole fleet: each edge publishes what each project holds on it
//! under `/dsec/quota/<project>/<edge>`, and a create is admitted only if the sum over
//! the live edges stays within the project's quotas.
//!
//! # Why this way
//!
//! An edge stays the authority on what it holds (its own [`dsec_server::projects::Usage`],
//! reserved before a create starts and given back when the sandbox stops, expires or
//! fails, whichever apiserver or TTL caused it): it publishes that figure, never a delta,
//! so a lost or repeated write cannot skew the sum. Two edges admitting at once must not
//! both see room for one sandbox: every admission also rewrites the project's
//! `/dsec/quota/<project>/~seq` key in an etcd transaction that holds only if that key is
//! unchanged since the sums were read, so admissions of one project are serialized over
//! the fleet and a loser reads again. Giving back needs no such check (it cannot pass a
//! quota). The entries of an edge that is no longer registered (its lease expired: it
//! died with its sandboxes) are not counted, and a starting edge clears its own.
//!
//! Each admission costs two reads and a transaction against etcd (about a millisecond on
//! loopback), only for projects with a quota.

use std::collections::HashSet;

use dsec_api::{ProjectUsage, Quotas};
use dsec_server::error::ApiError;
use dsec_server::projects::{admit, SharedQuotas, Usage};
use etcd_client::{Client, Compare, CompareOp, GetOptions, Txn, TxnOp};
use tokio::sync::{Mutex, OnceCell};

use crate::membership::connect;
use crate::EDGE_PREFIX;

/// The etcd prefix of the per-edge use of each project.
pub const QUOTA_PREFIX: &str = "/dsec/quota/";
/// Admission attempts before a create is refused as `Unavailable` (others kept winning).
const ATTEMPTS: usize = 32;

/// One edge's side of the fleet's quotas (see the module docs).
pub struct EtcdQuotas {
    endpoints: Vec<String>,
    edge: String,
    /// Connected on first use, this edge's stale entries cleared then.
    client: OnceCell<Client>,
    /// One write at a time from this edge, each of the figure as it is then: the last
    /// write is always the current one.
    writing: Mutex<()>,
}

impl EtcdQuotas {
    /// The quotas of the fleet whose etcd is at `endpoints`, for edge `edge`.
    pub fn new(endpoints: Vec<String>, edge: String) -> EtcdQuotas {
        EtcdQuotas {
            endpoints,
            edge,
            client: OnceCell::new(),
            writing: Mutex::new(()),
        }
    }

    async fn client(&self) -> Result<Client, ApiError> {
        self.client
            .get_or_try_init(|| async {
                let mut client = connect(&self.endpoints).await.map_err(unreachable)?;
                // What an earlier run of this edge published is gone with its sandboxes.
                let all = client
                    .get(
                        QUOTA_PREFIX,
                        Some(GetOptions::new().with_prefix().with_keys_only()),
                    )
                    .await
                    .map_err(unreachable)?;
                let own = format!("/{}", self.edge);
                for kv in all.kvs() {
                    if kv.key_str().is_ok_and(|k| k.ends_with(&own)) {
                        client.delete(kv.key(), None).await.map_err(unreachable)?;
                    }
                }
                Ok(client)
            })
            .await
            .cloned()
    }

    fn key(&self, project: &str) -> String {
        format!("{QUOTA_PREFIX}{project}/{}", self.edge)
    }
}

fn unreachable(e: impl std::fmt::Display) -> ApiError {
    ApiError::unavailable(format!(
        "the fleet's etcd, which counts project quotas over the edges, is unreachable: {e}"
    ))
}

fn encode(usage: ProjectUsage) -> Vec<u8> {
    serde_json::to_vec(&usage).expect("usage serializes")
}

#[async_trait::async_trait]
impl SharedQuotas for EtcdQuotas {
    async fn reserve(
        &self,
        project: &str,
        quotas: &Quotas,
        here: &Usage,
        cpus: f64,
        memory_mb: u64,
    ) -> Result<(), ApiError> {
        let mut client = self.client().await?;
        let _writing = self.writing.lock().await;
        let prefix = format!("{QUOTA_PREFIX}{project}/");
        let seq = format!("{prefix}~seq");
        let own = self.key(project);
        for _ in 0..ATTEMPTS {
            let live: HashSet<String> = client
                .get(
                    EDGE_PREFIX,
                    Some(GetOptions::new().with_prefix().with_keys_only()),
                )
                .await
                .map_err(unreachable)?
                .kvs()
                .iter()
                .filter_map(|kv| {
                    kv.key_str()
                        .ok()?
                        .strip_prefix(EDGE_PREFIX)
                        .map(str::to_owned)
                })
                .collect();
            let entries = client
                .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
                .await
                .map_err(unreachable)?;
            let mut seq_revision = 0;
            let mut elsewhere = ProjectUsage::default();
            for kv in entries.kvs() {
                let Ok(key) = kv.key_str() else { continue };
                let Some(edge) = key.strip_prefix(prefix.as_str()) else {
                    continue;
                };
                if key == seq {
                    seq_revision = kv.mod_revision();
                } else if edge != self.edge && live.contains(edge) {
                    if let Ok(u) = serde_json::from_slice::<ProjectUsage>(kv.value()) {
                        elsewhere.sandboxes += u.sandboxes;
                        elsewhere.cpus += u.cpus;
                        elsewhere.memory_mb += u.memory_mb;
                    }
                }
            }
            // `here` already holds the new sandbox: what the fleet held before it is
            // `elsewhere` plus this edge's figure less it.
            let mine = here.of(project);
            let before = ProjectUsage {
                sandboxes: elsewhere.sandboxes + mine.sandboxes.saturating_sub(1),
                cpus: elsewhere.cpus + (mine.cpus - cpus).max(0.0),
                memory_mb: elsewhere.memory_mb + mine.memory_mb.saturating_sub(memory_mb),
            };
            admit(project, quotas, before, cpus, memory_mb, " over the fleet")?;
            let unchanged = if seq_revision == 0 {
                Compare::create_revision(seq.as_str(), CompareOp::Equal, 0)
            } else {
                Compare::mod_revision(seq.as_str(), CompareOp::Equal, seq_revision)
            };
            let txn = Txn::new().when([unchanged]).and_then([
                TxnOp::put(seq.as_str(), Vec::new(), None),
                TxnOp::put(own.as_str(), encode(mine), None),
            ]);
            if client.txn(txn).await.map_err(unreachable)?.succeeded() {
                return Ok(());
            }
        }
        Err(ApiError::unavailable(format!(
            "project {project:?}: {ATTEMPTS} admissions in a row lost to other edges' creates; \
             try again"
        )))
    }

    async fn release(&self, project: &str, here: &Usage) {
        let Ok(mut client) = self.client().await else {
            return;
        };
        let _writing = self.writing.lock().await;
        let mine = here.of(project);
        let own = self.key(project);
        let written = if mine.sandboxes == 0 {
            client.delete(own, None).await.map(drop)
        } else {
            client.put(own, encode(mine), None).await.map(drop)
        };
        if let Err(e) = written {
            tracing::warn!(project, error = %e, "etcd: cannot publish a project's use after a release; the fleet counts it until the next change");
        }
    }
}
