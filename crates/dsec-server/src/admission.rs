//! Admission control: what this edge promises its sandboxes, and when it says no.
//!
//! Every sandbox is promised its limits: `memory_mb`, and `pids` for the backends whose
//! processes live on this host. The limits themselves are enforced by the kernel; what
//! admission bounds is the sum of the promises, so that one host is never sold many
//! times over. Two numbers set it:
//!
//! - the **capacity**: what all sandboxes together may actually use. It is the host's
//!   memory and task limit (`pid_max`, `threads-max`, and whatever the cgroups above the
//!   server set) less a reserve for the server and the host, and it is written on the
//!   `dsec-<tag>` parent cgroups, so the kernel holds every native sandbox to it at once;
//! - the **overcommit** ratio: sandboxes rarely use their whole limit, so the promises
//!   may add up to `overcommit × capacity`. A sandbox that would go past that is refused
//!   with `capacity` (HTTP 503) naming the budget, what is promised and what it asked:
//!   another edge may take it, or this one once sandboxes stop.
//!
//! A single sandbox never gets a limit above the capacity itself: that is bad input
//! (`invalid_argument`), not a full edge.

use std::sync::{Arc, Mutex};

use crate::error::ApiError;

/// Tasks promised to a VM sandbox on the host: its `pids` limit applies inside the guest,
/// and on the host it is one QEMU process with a handful of threads.
pub const VM_HOST_TASKS: u64 = 16;

/// How the budget is derived from the host; set by `dsec serve` flags.
#[derive(Clone, Copy, Debug)]
pub struct AdmissionConfig {
    /// Memory promised may reach this many times the memory capacity.
    pub memory_overcommit: f64,
    /// Tasks promised may reach this many times the task capacity.
    pub pids_overcommit: f64,
    /// Memory kept for the server and the host, in MiB; `None`: 10% of it, at least 512
    /// MiB and at most 4 GiB.
    pub host_reserve_mb: Option<u64>,
    /// Tasks kept for the server and the host; `None`: 10% of the host's, at least 512
    /// and at most 32768.
    pub host_reserve_pids: Option<u64>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            memory_overcommit: 4.0,
            pids_overcommit: 8.0,
            host_reserve_mb: None,
            host_reserve_pids: None,
        }
    }
}

/// What the host has, before any reserve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostResources {
    /// Memory in MiB.
    pub memory_mb: u64,
    /// Where the memory figure comes from, for messages ("MemTotal", "the server's cgroup").
    pub memory_source: &'static str,
    /// Tasks (processes and threads).
    pub pids: u64,
    /// Where the task figure comes from ("pid_max", "threads-max", "the server's cgroup").
    pub pids_source: &'static str,
}

impl HostResources {
    /// The host's memory and task limits, tightened by `inherited` (the cgroups above the
    /// server).
    pub fn detect(inherited: dsec_runtime::cgroup::InheritedLimits) -> HostResources {
        let read = |path: &str| {
            std::fs::read_to_string(path)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
        };
        let mut memory = (physical_memory_mb(), "MemTotal");
        if let Some(limit) = inherited.memory_bytes.map(|b| b >> 20) {
            if limit < memory.0 {
                memory = (limit, "the server's cgroup limit");
            }
        }
        let mut pids = (read("/proc/sys/kernel/pid_max").unwrap_or(32768), "pid_max");
        for (limit, source) in [
            (read("/proc/sys/kernel/threads-max"), "threads-max"),
            (inherited.pids, "the server's cgroup limit"),
        ] {
            if let Some(limit) = limit.filter(|l| *l < pids.0) {
                pids = (limit, source);
            }
        }
        HostResources {
            memory_mb: memory.0,
            memory_source: memory.1,
            pids: pids.0,
            pids_source: pids.1,
        }
    }
}

fn physical_memory_mb() -> u64 {
    // What sysconf(_SC_PHYS_PAGES) reads, in bytes rather than whole pages (the same
    // figure once in MiB).
    let info = rustix::system::sysinfo();
    info.totalram.saturating_mul(u64::from(info.mem_unit)) >> 20
}

/// What all sandboxes together may use: the host less its reserve. Written on the
/// `dsec-<tag>` parents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Memory in MiB.
    pub memory_mb: u64,
    /// Tasks.
    pub pids: u64,
    /// How the memory figure was reached, for messages ("MemTotal 24105 MiB less 2410
    /// MiB kept for the host").
    pub memory_why: String,
    /// How the task figure was reached, for messages.
    pub pids_why: String,
}

impl Capacity {
    /// The host less the reserve (never less than a quarter of the host, so a reserve
    /// larger than a small host leaves it usable).
    pub fn new(host: &HostResources, config: &AdmissionConfig) -> Capacity {
        let reserve_mb = config
            .host_reserve_mb
            .unwrap_or((host.memory_mb / 10).clamp(512, 4096));
        let reserve_pids = config
            .host_reserve_pids
            .unwrap_or((host.pids / 10).clamp(512, 32768));
        let memory_mb = host
            .memory_mb
            .saturating_sub(reserve_mb)
            .max(host.memory_mb / 4);
        let pids = host.pids.saturating_sub(reserve_pids).max(host.pids / 4);
        Capacity {
            memory_mb,
            pids,
            memory_why: format!(
                "{} {} MiB less {} MiB kept for the host",
                host.memory_source,
                host.memory_mb,
                host.memory_mb - memory_mb
            ),
            pids_why: format!(
                "{} {} less {} kept for the host",
                host.pids_source,
                host.pids,
                host.pids - pids
            ),
        }
    }
}

#[derive(Debug, Default)]
struct Promised {
    memory_mb: u64,
    pids: u64,
    sandboxes: u64,
}

/// The edge's budget and what it has promised so far.
#[derive(Debug)]
pub struct Admission {
    capacity: Capacity,
    config: AdmissionConfig,
    memory_budget_mb: u64,
    pids_budget: u64,
    promised: Mutex<Promised>,
}

/// A sandbox's promise; dropping it (the sandbox is gone) gives the budget back.
#[derive(Debug)]
pub struct Grant {
    admission: Arc<Admission>,
    memory_mb: u64,
    pids: u64,
}

impl Drop for Grant {
    fn drop(&mut self) {
        let mut p = self.admission.promised.lock().expect("lock");
        p.memory_mb -= self.memory_mb;
        p.pids -= self.pids;
        p.sandboxes -= 1;
    }
}

impl Admission {
    /// A budget of `config`'s overcommit times `capacity`, nothing promised yet.
    pub fn new(capacity: Capacity, config: AdmissionConfig) -> Arc<Admission> {
        // A positive ratio of a capacity: `as` from f64 saturates.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let budget = |capacity: u64, ratio: f64| (capacity as f64 * ratio).floor() as u64;
        Arc::new(Admission {
            memory_budget_mb: budget(capacity.memory_mb, config.memory_overcommit),
            pids_budget: budget(capacity.pids, config.pids_overcommit),
            capacity,
            config,
            promised: Mutex::default(),
        })
    }

    /// What all sandboxes together may use.
    pub fn capacity(&self) -> &Capacity {
        &self.capacity
    }

    /// Memory promised to sandboxes and the budget it is admitted against, in MiB.
    pub fn memory_promised(&self) -> (u64, u64) {
        let p = self.promised.lock().expect("lock");
        (p.memory_mb, self.memory_budget_mb)
    }

    /// Promises `memory_mb` and `pids` to a new sandbox of `backend`, or refuses with
    /// `capacity` (logged and counted) when that would go past the budget.
    pub fn admit(
        self: &Arc<Self>,
        backend: &str,
        memory_mb: u64,
        pids: u64,
    ) -> Result<Grant, ApiError> {
        let mut p = self.promised.lock().expect("lock");
        let refusal = if p.memory_mb + memory_mb > self.memory_budget_mb {
            Some((
                "memory",
                format!(
                    "its memory budget is {} MiB (--memory-overcommit {} × the {} MiB all its \
                     sandboxes may use: {}), {} MiB of it is promised to {} sandboxes, and \
                     this one asks for {memory_mb} MiB",
                    self.memory_budget_mb,
                    self.config.memory_overcommit,
                    self.capacity.memory_mb,
                    self.capacity.memory_why,
                    p.memory_mb,
                    p.sandboxes,
                ),
                "--memory-overcommit",
            ))
        } else if p.pids + pids > self.pids_budget {
            Some((
                "pids",
                format!(
                    "its process budget is {} tasks (--pids-overcommit {} × the {} all its \
                     sandboxes may hold: {}), {} of them are promised to {} sandboxes, and \
                     this one asks for {pids}",
                    self.pids_budget,
                    self.config.pids_overcommit,
                    self.capacity.pids,
                    self.capacity.pids_why,
                    p.pids,
                    p.sandboxes,
                ),
                "--pids-overcommit",
            ))
        } else {
            None
        };
        if let Some((resource, why, flag)) = refusal {
            drop(p);
            metrics::counter!("dsec_admission_refused_total", "resource" => resource, "backend" => backend.to_owned())
                .increment(1);
            tracing::warn!(
                backend,
                resource,
                memory_mb,
                pids,
                "admission refused: {why}"
            );
            return Err(ApiError::capacity(format!(
                "this edge cannot take another sandbox: {why}; try another edge, stop \
                 sandboxes, or ask for smaller limits (the operator can raise {flag})"
            )));
        }
        Ok(self.promise(&mut p, memory_mb, pids))
    }

    /// Promises `memory_mb` and `pids` to a sandbox an earlier run of the server admitted
    /// and kept across its restart (see [`crate::edge`]), with no check: it exists already,
    /// and a budget made smaller since only refuses the next new ones.
    pub fn readmit(self: &Arc<Self>, memory_mb: u64, pids: u64) -> Grant {
        let mut p = self.promised.lock().expect("lock");
        self.promise(&mut p, memory_mb, pids)
    }

    fn promise(self: &Arc<Self>, p: &mut Promised, memory_mb: u64, pids: u64) -> Grant {
        p.memory_mb += memory_mb;
        p.pids += pids;
        p.sandboxes += 1;
        Grant {
            admission: Arc::clone(self),
            memory_mb,
            pids,
        }
    }

    /// Publishes `dsec_admission_{budget,promised,capacity}{resource}` (before each
    /// metrics scrape).
    pub fn publish_gauges(&self) {
        let p = self.promised.lock().expect("lock");
        for (resource, budget, promised, capacity) in [
            (
                "memory_mb",
                self.memory_budget_mb,
                p.memory_mb,
                self.capacity.memory_mb,
            ),
            ("pids", self.pids_budget, p.pids, self.capacity.pids),
        ] {
            metrics::gauge!("dsec_admission_budget", "resource" => resource).set(budget as f64);
            metrics::gauge!("dsec_admission_promised", "resource" => resource).set(promised as f64);
            metrics::gauge!("dsec_admission_capacity", "resource" => resource).set(capacity as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> HostResources {
        HostResources {
            memory_mb: 24_000,
            memory_source: "MemTotal",
            pids: 32_768,
            pids_source: "pid_max",
        }
    }

    fn on_host(config: AdmissionConfig) -> Arc<Admission> {
        Admission::new(Capacity::new(&host(), &config), config)
    }

    #[test]
    fn default_reserve_is_a_tenth_within_bounds() {
        let c = Capacity::new(&host(), &AdmissionConfig::default());
        assert_eq!(c.memory_mb, 24_000 - 2_400);
        assert_eq!(c.pids, 32_768 - 3_276);
        let small = HostResources {
            memory_mb: 1_000,
            pids: 1_000,
            ..host()
        };
        let c = Capacity::new(&small, &AdmissionConfig::default());
        // 512 MiB and 512 tasks kept, never more than three quarters.
        assert_eq!((c.memory_mb, c.pids), (488, 488));
    }

    #[test]
    fn promises_fit_the_overcommitted_budget_and_come_back() {
        let config = AdmissionConfig {
            memory_overcommit: 2.0,
            host_reserve_mb: Some(0),
            ..AdmissionConfig::default()
        };
        let admission = on_host(config);
        let grants: Vec<Grant> = (0..3)
            .map(|_| admission.admit("container", 16_000, 10).unwrap())
            .collect();
        let err = admission.admit("container", 1, 1).unwrap_err();
        assert_eq!(err.kind, dsec_api::ErrorKind::Capacity);
        for needle in [
            "budget is 48000 MiB",
            "2 × the 24000 MiB",
            "MemTotal 24000 MiB less 0 MiB",
            "promised to 3 sandboxes",
            "asks for 1 MiB",
        ] {
            assert!(err.message.contains(needle), "{needle}: {}", err.message);
        }
        drop(grants);
        admission.admit("container", 48_000, 10).unwrap();
    }

    #[test]
    fn pids_have_their_own_budget() {
        let config = AdmissionConfig {
            pids_overcommit: 1.0,
            host_reserve_pids: Some(768),
            ..AdmissionConfig::default()
        };
        let admission = on_host(config);
        let _all = admission.admit("container", 1, 32_000).unwrap();
        let err = admission.admit("container", 1, 1).unwrap_err();
        assert!(
            err.message.contains("process budget is 32000"),
            "{}",
            err.message
        );
        assert!(err.message.contains("--pids-overcommit"), "{}", err.message);
    }
}
