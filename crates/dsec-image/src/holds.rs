//! Layers something relies on: an import in flight, a sandbox built on them.
//!
//! Garbage collection never removes a held layer. Other edges sharing the layer store
//! learn what this edge holds from its lease, `leases/<edge>.json`, rewritten whenever
//! the held set grows (and refreshed by the sweep), always before the layer is used: a
//! prune on any edge runs under the store's exclusive `gc.lock`, a lease update under the
//! shared one, so a prune either sees the new lease or runs entirely before the holder
//! checks that its layer exists.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustix::fs::FlockOperation;
use serde::{Deserialize, Serialize};

use crate::error::ImageError;
use crate::store::Inner;

/// A lease not refreshed for this long belongs to an edge that is gone.
pub(crate) const LEASE_TTL: Duration = Duration::from_secs(120);

/// What one edge holds, as other edges read it.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Lease {
    pub(crate) edge: String,
    /// Unix seconds of the last refresh.
    pub(crate) updated: f64,
    pub(crate) layers: BTreeSet<String>,
}

/// Hold counts of one edge, by diff id; its lock also orders this edge's commits
/// against its garbage collection.
#[derive(Debug, Default)]
pub(crate) struct HoldCounts {
    counts: Mutex<HashMap<String, usize>>,
    /// What the lease file says now.
    leased: Mutex<BTreeSet<String>>,
}

impl HoldCounts {
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Layers held until this is dropped.
#[derive(Debug)]
pub struct Held {
    inner: Arc<Inner>,
    layers: Mutex<Vec<String>>,
}

impl Held {
    pub(crate) fn new(inner: Arc<Inner>) -> Held {
        Held {
            inner,
            layers: Mutex::default(),
        }
    }

    /// Holds `layer`, and publishes the hold in this edge's lease before returning.
    pub(crate) fn hold(&self, layer: &str) {
        self.hold_all(std::slice::from_ref(&layer.to_owned()))
    }

    /// Holds each of `layers` (see [`Held::hold`]). A lease that cannot be written (a
    /// read-only or unreachable store) is logged, not fatal: whoever then needs the store
    /// gets its own error, and a store no edge can write is a store no edge prunes.
    pub(crate) fn hold_all(&self, layers: &[String]) {
        {
            let mut counts = self.inner.holds.lock();
            for layer in layers {
                *counts.entry(layer.clone()).or_default() += 1;
            }
        }
        self.layers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(layers.iter().cloned());
        let grown = {
            let leased = self
                .inner
                .holds
                .leased
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            layers.iter().any(|l| !leased.contains(l))
        };
        if grown {
            if let Err(e) = self.inner.write_lease(false) {
                tracing::warn!(error = %e, "cannot publish this edge's lease on the layer store");
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let layers = std::mem::take(
            self.layers
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let mut counts = self.inner.holds.lock();
        for layer in layers {
            if let Some(count) = counts.get_mut(&layer) {
                *count -= 1;
                if *count == 0 {
                    counts.remove(&layer);
                }
            }
        }
    }
}

/// The store-wide lock that orders prunes (exclusive) against lease updates (shared),
/// across every edge of a shared store. Filesystems without locks (an NFS mount with
/// `nolock`) get no ordering, and a warning.
pub(crate) struct StoreLock(Option<File>);

impl StoreLock {
    pub(crate) fn take(root: &Path, exclusive: bool) -> io::Result<StoreLock> {
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(root.join("gc.lock"))?;
        let op = if exclusive {
            FlockOperation::LockExclusive
        } else {
            FlockOperation::LockShared
        };
        match rustix::fs::flock(&file, op) {
            Ok(()) => Ok(StoreLock(Some(file))),
            Err(rustix::io::Errno::NOLCK | rustix::io::Errno::OPNOTSUPP) => {
                tracing::warn!(store = %root.display(), "the layer store has no file locks: a prune on another edge may race this edge's new layers");
                Ok(StoreLock(None))
            }
            Err(e) => Err(e.into()),
        }
    }
}

impl Drop for StoreLock {
    fn drop(&mut self) {
        if let Some(file) = &self.0 {
            let _ = rustix::fs::flock(file, FlockOperation::Unlock);
        }
    }
}

impl Inner {
    /// Rewrites this edge's lease with everything it holds or has mounted; `refresh`
    /// also writes an unchanged set (so the lease stays fresh).
    pub(crate) fn write_lease(&self, refresh: bool) -> Result<(), ImageError> {
        let _lock = StoreLock::take(&self.root, false).map_err(self.store_err("lock the store"))?;
        let mut layers: BTreeSet<String> = self.holds.lock().keys().cloned().collect();
        layers.extend(self.mounts.layers());
        let mut leased = self
            .holds
            .leased
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !refresh && layers.is_subset(&leased) {
            return Ok(());
        }
        let lease = Lease {
            edge: self.edge.clone(),
            updated: unix_now(),
            layers,
        };
        let path = self.lease_path(&self.edge);
        let tmp = path.with_extension("json.tmp");
        let bytes = serde_json::to_vec(&lease).unwrap_or_default();
        fs::write(&tmp, bytes)
            .and_then(|()| fs::rename(&tmp, &path))
            .map_err(self.store_err("write this edge's lease"))?;
        *leased = lease.layers;
        Ok(())
    }

    /// Layers other edges' fresh leases hold.
    pub(crate) fn leased_by_others(&self) -> Result<BTreeSet<String>, ImageError> {
        let dir = self.leases_dir();
        let mut layers = BTreeSet::new();
        let entries = fs::read_dir(&dir).map_err(self.store_err("list the leases"))?;
        for entry in entries {
            let path: PathBuf = entry.map_err(self.store_err("list the leases"))?.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let Ok(bytes) = fs::read(&path) else { continue };
            let Ok(lease) = serde_json::from_slice::<Lease>(&bytes) else {
                tracing::warn!(path = %path.display(), "unreadable lease ignored");
                continue;
            };
            let age = unix_now() - lease.updated;
            if lease.edge == self.edge || age > LEASE_TTL.as_secs_f64() {
                continue;
            }
            layers.extend(lease.layers);
        }
        Ok(layers)
    }
}

pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
