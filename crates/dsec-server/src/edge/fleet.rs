//! What a fleet asks of an edge beyond the `/v1` API: its load, published for placement;
//! creates made at most once per idempotency key, so that a create retried after a lost
//! reply (through any apiserver) returns the sandbox already made; and batches of creates.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use dsec_api::{BatchItem, CreateManyRequest, CreateSandboxRequest, SandboxInfo, MAX_BATCH};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::Edge;
use crate::error::ApiError;
use crate::projects::Caller;

/// The load an edge publishes about twice a second; apiservers place by it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EdgeLoad {
    /// Backends this edge runs.
    pub backends: Vec<String>,
    /// Live sandboxes per backend.
    pub sandboxes: BTreeMap<String, u64>,
    /// Live sandboxes in all.
    pub sandbox_count: u64,
    /// Creations in flight.
    pub creating: u64,
    /// The memory budget sandbox limits are admitted against, in MiB.
    pub memory_budget_mb: u64,
    /// How much of it is promised, in MiB.
    pub memory_promised_mb: u64,
    /// The registry its images are shared through (`--registry`), if any: apiservers
    /// send an import to one edge when all share one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry: Option<String>,
    /// The host's available memory (`MemAvailable`), in MiB.
    pub free_memory_mb: u64,
    /// The 1-minute load average per CPU.
    pub cpu_load: f64,
}

impl EdgeLoad {
    /// One number to compare edges by (lower is less loaded): the share of the memory
    /// budget promised, with creations in flight weighed as sandboxes of the mean size.
    pub fn score(&self) -> f64 {
        self.score_with(0)
    }

    /// [`score`](Self::score) with `more` creations on their way besides (what an
    /// apiserver placed here since this load was published).
    pub fn score_with(&self, more: u64) -> f64 {
        let budget = self.memory_budget_mb.max(1) as f64;
        let per_sandbox = if self.sandbox_count > 0 {
            self.memory_promised_mb as f64 / self.sandbox_count as f64
        } else {
            512.0
        };
        let creating = (self.creating + more) as f64;
        (self.memory_promised_mb as f64 + creating * per_sandbox) / budget
    }
}

/// Counts one creation in flight while alive.
pub(super) struct InFlight<'a>(&'a AtomicUsize);

impl<'a> InFlight<'a> {
    pub(super) fn enter(counter: &'a AtomicUsize) -> InFlight<'a> {
        counter.fetch_add(1, Ordering::Relaxed);
        InFlight(counter)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Idempotency key → the id of the sandbox made for it, once made. A key whose create
/// failed stays unset, so a retry creates again.
#[derive(Default)]
pub(super) struct IdempotencyKeys {
    keys: Mutex<HashMap<String, Arc<tokio::sync::OnceCell<String>>>>,
    /// The table's size that starts the next pruning: twice what the last one kept (at
    /// least [`KEYS_BEFORE_PRUNE`]), so that a host with many live sandboxes does not scan
    /// them all on each create.
    prune_at: AtomicUsize,
}

/// Keys are dropped once their sandbox is gone, looked at when the table grows past this.
const KEYS_BEFORE_PRUNE: usize = 1024;

/// Where `key` lives in the table: each project has its own keys, so that one project's
/// retry can never return, or reveal, another's sandbox.
fn scoped_key(caller: &Caller, key: &str) -> String {
    match caller.project() {
        None => key.to_owned(),
        // A NUL cannot occur in a checked key: the two spaces never meet.
        Some(project) => format!("{project}\0{key}"),
    }
}

fn check_key(key: &str) -> Result<(), ApiError> {
    if key.is_empty() || key.len() > 128 || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ApiError::invalid(format!(
            "Idempotency-Key must be 1 to 128 printable ASCII characters, got {key:?}"
        )));
    }
    Ok(())
}

/// How many creates of one batch an edge runs at once: enough to keep the backends busy,
/// few enough that one large batch does not hold every create slot of the host.
const BATCH_CONCURRENCY: usize = 32;

/// The idempotency key of item `index` of a batch sent with `key`: a retried batch makes
/// only the items it did not make before, wherever they were placed.
pub fn batch_item_key(key: &str, index: u32) -> String {
    format!("{key}/{index}")
}

/// Refuses a batch size outside 1..=[`MAX_BATCH`].
pub fn check_batch(count: u32) -> Result<(), ApiError> {
    if (1..=MAX_BATCH).contains(&count) {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "count must be 1 to {MAX_BATCH} sandboxes per batch, got {count}"
        )))
    }
}

/// A batch's item for one create's outcome.
pub fn batch_item(made: Result<SandboxInfo, ApiError>) -> BatchItem {
    match made {
        Ok(info) => BatchItem {
            sandbox: Some(info),
            error: None,
        },
        Err(e) => BatchItem {
            sandbox: None,
            error: Some(e.into()),
        },
    }
}

impl Edge {
    /// Makes `req.count` sandboxes alike, [`BATCH_CONCURRENCY`] at a time. Each item
    /// succeeds or fails on its own, with the error a single create would get; with a
    /// `key`, item `i` is made at most once for [`batch_item_key`]`(key, i)`.
    pub async fn create_many(
        &self,
        key: Option<&str>,
        req: CreateManyRequest,
        caller: &Caller,
    ) -> Result<Vec<BatchItem>, ApiError> {
        check_batch(req.count)?;
        if let Some(key) = key {
            check_key(&batch_item_key(key, req.count - 1))?;
        }
        let sandbox = &req.sandbox;
        Ok(futures::stream::iter(0..req.count)
            .map(|index| async move {
                let made = match key {
                    Some(key) => self
                        .create_once(&batch_item_key(key, index), sandbox.clone(), caller)
                        .await
                        .map(|(info, _)| info),
                    None => Box::pin(self.create(sandbox.clone(), caller)).await,
                };
                batch_item(made)
            })
            .buffered(BATCH_CONCURRENCY)
            .collect()
            .await)
    }

    /// This edge's load now.
    pub fn load(&self) -> EdgeLoad {
        let mut sandboxes = BTreeMap::new();
        let mut count = 0;
        for entry in self.sandboxes.read().expect("lock").values() {
            *sandboxes.entry(entry.info.backend.clone()).or_default() += 1;
            count += 1;
        }
        let (memory_promised_mb, memory_budget_mb) = self.admission.memory_promised();
        EdgeLoad {
            backends: self.backends.names(),
            sandboxes,
            sandbox_count: count,
            creating: self.creating.load(Ordering::Relaxed) as u64,
            memory_budget_mb,
            memory_promised_mb,
            registry: self.images.registry().map(ToString::to_string),
            free_memory_mb: mem_available_mb().unwrap_or(0),
            cpu_load: load_average().unwrap_or(0.0) / self.host_cpus.max(1.0),
        }
    }

    /// Creates a sandbox for `key` unless one was made for it: then returns that one
    /// (`false`: nothing new was made). Concurrent creates with one key make one sandbox.
    pub async fn create_once(
        &self,
        key: &str,
        req: CreateSandboxRequest,
        caller: &Caller,
    ) -> Result<(SandboxInfo, bool), ApiError> {
        check_key(key)?;
        let scoped = scoped_key(caller, key);
        let cell = {
            let mut keys = self.idempotent.keys.lock().expect("lock");
            let prune_at = &self.idempotent.prune_at;
            if keys.len() > prune_at.load(Ordering::Relaxed).max(KEYS_BEFORE_PRUNE) {
                let live = self.sandboxes.read().expect("lock");
                keys.retain(|_, cell| cell.get().is_none_or(|id| live.contains_key(id)));
                prune_at.store(keys.len() * 2, Ordering::Relaxed);
            }
            Arc::clone(keys.entry(scoped).or_default())
        };
        let mut made = None;
        let id = cell
            .get_or_try_init(|| async {
                // Boxed: a create's future is large (a VM's boot among its states), and
                // nested inline in the cell's it overflowed a worker's stack in debug builds.
                let info = Box::pin(self.create(req, caller)).await?;
                let id = info.id.clone();
                made = Some(info);
                Ok::<_, ApiError>(id)
            })
            .await?
            .clone();
        match made {
            Some(info) => Ok((info, true)),
            None => Ok((self.created_for(key, &id)?, false)),
        }
    }

    /// The sandbox made for idempotency key `key`.
    pub fn by_idempotency_key(&self, key: &str, caller: &Caller) -> Result<SandboxInfo, ApiError> {
        check_key(key)?;
        let id = self
            .idempotent
            .keys
            .lock()
            .expect("lock")
            .get(&scoped_key(caller, key))
            .and_then(|cell| cell.get().cloned())
            .ok_or_else(|| {
                ApiError::not_found(format!("no sandbox was made for idempotency key {key:?}"))
            })?;
        self.created_for(key, &id)
    }

    fn created_for(&self, key: &str, id: &str) -> Result<SandboxInfo, ApiError> {
        self.get(id).map_err(|_| {
            ApiError::not_found(format!(
                "sandbox {id:?}, made for idempotency key {key:?}, has stopped"
            ))
        })
    }
}

fn mem_available_mb() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib >> 10)
}

fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_bounded_printable_ascii() {
        assert!(check_key("abc-123_x").is_ok());
        assert!(check_key("").is_err());
        assert!(check_key("a b").is_err());
        assert!(check_key(&"k".repeat(129)).is_err());
    }

    #[test]
    fn score_grows_with_promised_memory_and_creations() {
        let idle = EdgeLoad {
            memory_budget_mb: 1000,
            ..Default::default()
        };
        let busy = EdgeLoad {
            memory_budget_mb: 1000,
            memory_promised_mb: 500,
            sandbox_count: 1,
            ..Default::default()
        };
        let creating = EdgeLoad {
            creating: 2,
            ..busy.clone()
        };
        assert!(idle.score() < busy.score());
        assert!(busy.score() < creating.score());
    }

    #[test]
    fn host_readings_parse() {
        assert!(mem_available_mb().is_some());
        assert!(load_average().is_some());
    }
}
