//! The usage sampler: reads every live sandbox's usage once a [`SAMPLE_EVERY`] and turns
//! what changed into events — forks the pids limit refused (`limit.pids`), OOM kills no
//! command reported (`limit.oom`), a full writable layer (`limit.disk`), a sandbox its
//! CPU limit held back for a tenth of the sample or more (`limit.cpu`), and the
//! connections the network policy refused (`network.refused`, one event per destination
//! and sample, with a count).
//!
//! Counters are compared with the previous sample of the same sandbox (zero before its
//! first: a new sandbox's counters start at zero), so an event carries what happened
//! since then.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dsec_api::{SandboxState, Usage};

use super::{Edge, Entry};
use crate::events::kind;

/// How often usage is read.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// A writable layer this full counts as full (tmpfs keeps a little for itself).
const DISK_FULL: f64 = 0.98;
/// ... and it counts as full again only after dropping below this.
const DISK_REARM: f64 = 0.90;
/// A sample in which the CPU limit held the sandbox back this long is a `limit.cpu`: it
/// wants more than its share. Less is the noise of a burst meeting a quota period.
const CPU_THROTTLED: Duration = Duration::from_millis(100);

/// What the previous sample of one sandbox saw.
#[derive(Default)]
struct Seen {
    /// Its CPU time at the previous round (see [`crate::backend::Sandbox::cpu_ns`]).
    cpu_ns: Option<u64>,
    usage: Usage,
    disk_full: bool,
    /// Time of the newest refused connection already reported.
    refused_until: f64,
    /// Changed files in the image's binary directories already reported.
    binaries: HashSet<String>,
}

/// The sampler's memory of every sandbox it has seen.
#[derive(Default)]
pub(crate) struct Sampler {
    seen: HashMap<String, Seen>,
}

impl Sampler {
    /// One round over `entries`; forgets sandboxes that are gone.
    pub(crate) async fn sample(&mut self, entries: &[Arc<Entry>]) {
        let mut seen = HashMap::with_capacity(entries.len());
        for entry in entries {
            if entry.state() != SandboxState::Running {
                if let Some(prev) = self.seen.remove(&entry.info.id) {
                    seen.insert(entry.info.id.clone(), prev);
                }
                continue;
            }
            let mut prev = self.seen.remove(&entry.info.id).unwrap_or_default();
            let cpu_ns = entry.sandbox.cpu_ns();
            if cpu_ns.is_some() && cpu_ns == prev.cpu_ns {
                entry.still_current();
                seen.insert(entry.info.id.clone(), prev);
                continue;
            }
            prev.cpu_ns = cpu_ns;
            let usage = entry.sandbox.usage();
            entry.sampled_now(&usage);
            limits(entry, &prev.usage, &usage);
            prev.disk_full = disk(entry, prev.disk_full, &usage);
            binaries(entry, &mut prev.binaries);
            if entry.backend.has_networking() {
                prev.refused_until = refused(entry, prev.refused_until).await;
            }
            prev.usage = usage;
            seen.insert(entry.info.id.clone(), prev);
        }
        self.seen = seen;
    }
}

/// `limit.pids`, `limit.cpu` and the `limit.oom` no command reported.
fn limits(entry: &Entry, prev: &Usage, now: &Usage) {
    let throttled_ms = now.cpu_throttled_ms - prev.cpu_throttled_ms;
    if throttled_ms >= CPU_THROTTLED.as_secs_f64() * 1e3 {
        entry.emit(
            kind::LIMIT_CPU,
            serde_json::json!({
                "throttled_ms": throttled_ms,
                "throttled_total_ms": now.cpu_throttled_ms,
                "cpu_ms": now.cpu_ms - prev.cpu_ms,
                "cpus": entry.info.limits.cpus,
            }),
        );
    }
    let refused = now.pids_limit_hits.saturating_sub(prev.pids_limit_hits);
    if refused > 0 {
        entry.emit(
            kind::LIMIT_PIDS,
            serde_json::json!({
                "refused_forks": refused,
                "refused_total": now.pids_limit_hits,
                "pids": now.pids,
                "limit": entry.info.limits.pids,
            }),
        );
    }
    let killed = now.oom_kills.saturating_sub(prev.oom_kills);
    let reported = entry.oom_reported.swap(0, Ordering::AcqRel);
    if killed > reported {
        entry.emit(
            kind::LIMIT_OOM,
            serde_json::json!({
                "by": "process",
                "killed": killed - reported,
                "memory_peak_bytes": now.memory_peak_bytes,
                "memory_mb": entry.info.limits.memory_mb,
            }),
        );
    }
}

/// `limit.disk` when the writable layer fills up, with bytes or with files; whether it
/// is full now.
fn disk(entry: &Entry, was_full: bool, now: &Usage) -> bool {
    let (Some(used), Some(limit_mb)) = (now.disk_bytes, entry.info.limits.disk_mb) else {
        return was_full;
    };
    let limit_bytes =
        u64::try_from(limit_mb.max(1)).map_or(u64::MAX, |mb| mb.saturating_mul(1 << 20));
    let inodes = dsec_runtime::rootfs::layer_inodes(limit_bytes);
    let inodes_used = now.disk_inodes.unwrap_or(0);
    let fill = (used as f64 / limit_bytes as f64).max(inodes_used as f64 / inodes as f64);
    if !was_full && fill >= DISK_FULL {
        entry.emit(
            kind::LIMIT_DISK,
            serde_json::json!({
                "used_bytes": used,
                "disk_mb": limit_mb,
                "inodes_used": inodes_used,
                "inodes": inodes,
            }),
        );
        return true;
    }
    was_full && fill >= DISK_REARM
}

/// The most replaced image files reported per sandbox: the first ones trip the Watcher,
/// and a VM guest names its own (a hostile one could name new ones every second).
const MAX_BINARIES_REPORTED: usize = 1024;

/// `file.write` (`by: layer`) for each of the image's files in its binary directories that
/// the sandbox overwrote or removed (seen in its writable layer), once, up to
/// [`MAX_BINARIES_REPORTED`].
fn binaries(entry: &Entry, reported: &mut HashSet<String>) {
    if reported.len() >= MAX_BINARIES_REPORTED {
        return;
    }
    let dirs: Vec<&str> = crate::watcher::BINARY_DIRS
        .iter()
        .map(|d| d.trim_end_matches('/'))
        .collect();
    for path in entry.sandbox.replaced_image_files(&dirs) {
        if reported.len() >= MAX_BINARIES_REPORTED {
            break;
        }
        if reported.insert(path.clone()) {
            entry.emit(
                kind::FILE_WRITE,
                serde_json::json!({"path": path, "size": null, "by": "layer"}),
            );
        }
    }
}

/// `network.refused` for the refusals newer than `until`; the newest one's time.
async fn refused(entry: &Entry, until: f64) -> f64 {
    let refused = entry.sandbox.network_refused().await;
    type Destination = (String, Option<u16>, String, Option<String>);
    let mut by_destination: BTreeMap<Destination, (u64, f64)> = BTreeMap::new();
    let mut newest = until;
    for r in refused.into_iter().filter(|r| r.time > until) {
        newest = newest.max(r.time);
        let slot = by_destination
            .entry((r.dst.to_string(), r.port, r.protocol, r.name))
            .or_insert((0, r.time));
        slot.0 += 1;
    }
    for ((dst, port, protocol, name), (count, first)) in by_destination {
        let mut data = serde_json::json!({
            "dst": dst,
            "port": port,
            "protocol": protocol,
            "count": count,
            "first_time": first,
        });
        if let Some(name) = name {
            data["name"] = name.into();
        }
        entry.emit(kind::NETWORK_REFUSED, data);
    }
    newest
}

impl Edge {
    /// Runs the usage sampler forever (see the module docs).
    pub async fn usage_sampler(self: Arc<Self>) {
        let mut sampler = Sampler::default();
        let mut tick = tokio::time::interval(SAMPLE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            sampler.sample(&self.entries()).await;
        }
    }
}
