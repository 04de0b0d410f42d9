//! Paused sandboxes that outlive the server.
//!
//! A backend that can keep a paused sandbox across a restart of the server (the VM
//! backends, whose `--vm-pause save` writes the guest to disk and ends its QEMU) is handed
//! the edge's record of it at each pause ([`Sandbox::keep`]): what the API shows of it,
//! the environment its commands get, where its trajectory goes on, when it was last used.
//! A shutdown lets kept sandboxes go instead of stopping them, and the next server adopts
//! them before it serves ([`Edge::adopt_kept`]): the same id, project, labels, limits,
//! lifetimes (`ttl_s` and `idle_ttl_s` count from the same instants, the time the server
//! was down included) and trajectory, paused; the next request resumes it as any paused
//! sandbox. Each counts in the edge's budget and its project's usage as before the
//! restart, without being refused: it exists already. Its spawned processes' streams were
//! the old server's: the processes run on in the guest, unfollowed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_api::{CreateSandboxRequest, Quotas, SandboxInfo, SandboxState};
use serde::{Deserialize, Serialize};

use super::{unix_now, unsigned, Edge, Entry};
use crate::backend::{Adopted, Backend, Sandbox};
use crate::trajectory::Position;

/// What the edge keeps of a paused sandbox for the next server.
#[derive(Serialize, Deserialize)]
struct Record {
    /// As the API shows it (its state and usage aside).
    info: SandboxInfo,
    /// The Watcher's flags.
    flags: BTreeMap<String, String>,
    /// Its commands' environment and working directory.
    env: Vec<String>,
    workdir: String,
    /// The request it was made from (its forks'), as it was given.
    request: CreateSandboxRequest,
    /// The step of its trajectory its next command takes.
    next_step: i64,
    /// When it last served a request, in unix seconds.
    last_active_at: f64,
}

/// Has `entry`'s backend keep it (just paused) across a restart, if it can; it is marked
/// kept when it is. A sandbox that cannot be kept goes with the server, as before.
pub(super) async fn keep(entry: &Entry) {
    let next_step = entry.position.next().await;
    let idle = entry.last_active.lock().expect("lock").elapsed();
    let flags = entry.flags.lock().expect("lock").clone();
    let record = Record {
        info: entry.info.clone(),
        flags,
        env: entry.env.clone(),
        workdir: entry.workdir.clone(),
        request: entry.request.clone(),
        next_step,
        last_active_at: unix_now() - idle.as_secs_f64(),
    };
    let record = serde_json::to_value(&record).expect("record serializes");
    let kept = match entry.sandbox.keep(&record).await {
        Ok(kept) => kept,
        Err(e) => {
            tracing::warn!(sandbox = %entry.info.id, error = %e, "cannot keep a paused sandbox across a restart; it goes with the server");
            false
        }
    };
    entry.kept.store(kept, Ordering::SeqCst);
}

/// The instant `seconds` before now (now, if the clock does not reach that far back).
fn seconds_ago(seconds: f64) -> Instant {
    let ago = Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or_default();
    Instant::now().checked_sub(ago).unwrap_or_else(Instant::now)
}

impl Edge {
    /// Adopts the paused sandboxes an earlier run of the server kept: call once, before
    /// serving. Returns how many.
    pub async fn adopt_kept(&self) -> usize {
        let mut adopted = 0;
        for backend in self.backends.all() {
            for Adopted { sandbox, edge } in backend.adopt().await {
                match serde_json::from_value::<Record>(edge) {
                    Ok(record) => {
                        self.adopt(Arc::clone(backend), sandbox, record);
                        adopted += 1;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "a kept sandbox's record is unreadable; removing it");
                        sandbox.stop().await;
                    }
                }
            }
        }
        adopted
    }

    /// Enters kept sandbox `sandbox` in the table, paused, as `record` describes it.
    fn adopt(&self, backend: Arc<dyn Backend>, sandbox: Box<dyn Sandbox>, record: Record) {
        let mut info = record.info;
        info.state = SandboxState::Paused;
        let memory_mb = unsigned(info.limits.memory_mb.unwrap_or_default());
        let pids = unsigned(info.limits.pids.unwrap_or_default());
        let cpus = info.limits.cpus.unwrap_or_default();
        let grant = backend
            .admitted_per_sandbox()
            .then(|| self.admission.readmit(memory_mb, backend.host_tasks(pids)));
        let project: Option<Arc<str>> = info.project.as_deref().map(Arc::from);
        // Counted, never refused: a quota lowered since only refuses new sandboxes.
        let quota = project.as_ref().and_then(|p| {
            self.project_usage
                .reserve(p, &Quotas::default(), cpus, memory_mb)
                .ok()
        });
        // Marked stopped when the log opened: live again, its steps go on.
        drop(self.log.reopen(&info.id));
        tracing::info!(sandbox = %info.id, backend = %info.backend, "adopted a paused sandbox kept by an earlier run");
        let entry = Entry {
            state: Mutex::new(SandboxState::Paused),
            created: seconds_ago(unix_now() - info.created_at),
            last_active: Mutex::new(seconds_ago(unix_now() - record.last_active_at)),
            grant: Mutex::new(grant),
            project,
            quota: Mutex::new(quota),
            flags: Mutex::new(record.flags),
            kept: AtomicBool::new(true),
            ..Entry::new(
                info.clone(),
                Position::new(info.trajectory_id, record.next_step),
                (record.env, record.workdir),
                record.request,
                (backend, sandbox),
                Arc::clone(&self.events),
            )
        };
        self.sandboxes
            .write()
            .expect("lock")
            .insert(entry.info.id.clone(), Arc::new(entry));
    }
}
