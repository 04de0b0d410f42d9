//! What the log may store and what it stores: the budgets, how a row is counted against
//! them, and the decisions they lead to (a step recorded without output, a prune due).
//! The store writes; this module decides.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::model::{json, SandboxRecord, Step};

/// What a row costs beyond its text columns: SQLite's record header, numeric columns, the
/// primary-key index entry and page slack (measured on this schema: the database file is
/// within a few percent of what the budgets count).
const ROW_OVERHEAD: u64 = 96;

/// What the log may store; see "Bounds" in the crate docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budgets {
    /// Bytes of each output stream kept whole; a longer stream keeps its first and last
    /// halves of this.
    pub output_bytes: u64,
    /// Bytes one sandbox's log may take; steps past it are recorded without output.
    pub sandbox_bytes: u64,
    /// Bytes the whole log may take on disk (database and WAL).
    pub total_bytes: u64,
}

impl Default for Budgets {
    /// 64 KiB per output (more than an agent's context usefully holds), 32 MiB per
    /// sandbox, 4 GiB in all.
    fn default() -> Budgets {
        Budgets {
            output_bytes: 64 << 10,
            sandbox_bytes: 32 << 20,
            total_bytes: 4 << 30,
        }
    }
}

impl Budgets {
    /// Above this, stopped sandboxes' logs are pruned.
    pub(crate) fn prune_above(&self) -> u64 {
        self.total_bytes / 8 * 5
    }

    /// Pruning stops here, so that it does not run again at the next step.
    pub(crate) fn prune_to(&self) -> u64 {
        self.total_bytes / 2
    }

    /// A step that would take the log past this is recorded without output.
    pub(crate) fn output_cap(&self) -> u64 {
        self.total_bytes / 4 * 3
    }

    /// The WAL is checkpointed before it holds this much.
    pub(crate) fn wal_bytes(&self) -> u64 {
        (self.total_bytes / 8).min(64 << 20)
    }
}

/// A step's JSON columns, encoded once for both its size and its insert.
pub(crate) struct StepJson {
    pub(crate) argv: String,
    pub(crate) env: String,
    pub(crate) files: String,
    /// A process step's [`ProcessRequest`](crate::ProcessRequest); `None` for a run.
    pub(crate) process: Option<String>,
}

impl StepJson {
    pub(crate) fn new(step: &Step) -> StepJson {
        StepJson {
            argv: json(&step.request.argv),
            env: json(&step.request.env),
            files: json(&step.request.files),
            process: step.request.process.as_ref().map(json),
        }
    }

    /// What `step`'s row costs, as the budgets count it: its text plus [`ROW_OVERHEAD`].
    pub(crate) fn row_bytes(&self, s: &Step) -> u64 {
        let r = &s.result;
        let text = [
            s.trajectory(),
            s.trajectory_id.as_deref().unwrap_or(""),
            &s.sandbox_id,
            &self.argv,
            &self.env,
            &s.request.cwd,
            s.request.stdin_sha256.as_deref().unwrap_or(""),
            &self.files,
            s.request.run_as.as_deref().unwrap_or(""),
            s.request.kind.as_str(),
            self.process.as_deref().unwrap_or(""),
            &r.stdout,
            &r.stderr,
            &r.stdout_sha256,
            &r.stderr_sha256,
        ];
        ROW_OVERHEAD + text.iter().map(|t| t.len() as u64).sum::<u64>()
    }
}

/// What a sandbox's own record costs, as the budgets count it.
pub(crate) fn record_bytes(s: &SandboxRecord) -> u64 {
    ROW_OVERHEAD
        + (s.id.len()
            + s.trajectory_id.as_deref().map_or(0, str::len)
            + s.image.len()
            + s.backend.len()
            + s.project.as_deref().map_or(0, str::len)
            + json(&s.env).len()) as u64
}

/// What the log stores, against its budgets.
pub(crate) struct Usage {
    pub(crate) budgets: Budgets,
    /// Bytes stored, as [`StepJson::row_bytes`] and [`record_bytes`] count them.
    stored: AtomicU64,
    /// Bytes committed since the last checkpoint: about what the WAL holds.
    unchecked: AtomicU64,
    /// Bytes committed since a refresh from the database began (see [`Usage::refresh`]).
    since_refresh: AtomicU64,
    /// The sandboxes registered by this process and not yet stopped, with what their logs
    /// take. This process is their only writer, so the count lives here, not in a row
    /// every append would update; a sandbox's row gets it when the sandbox stops (and,
    /// after a crash, a recount when the log opens).
    live: Mutex<HashMap<String, LiveSandbox>>,
    /// The whole log is over its cap with nothing left to prune (logged once).
    full: AtomicBool,
}

/// A live sandbox's share of the log.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LiveSandbox {
    pub(crate) bytes: u64,
    /// Already reported over its budget (logged once).
    over_budget: bool,
}

impl Usage {
    /// The usage of a log that stores `stored` bytes.
    pub(crate) fn new(budgets: Budgets, stored: u64) -> Usage {
        let usage = Usage {
            budgets,
            stored: AtomicU64::new(0),
            unchecked: AtomicU64::new(0),
            since_refresh: AtomicU64::new(0),
            live: Mutex::default(),
            full: AtomicBool::new(false),
        };
        usage.add(stored);
        usage
    }

    /// Bytes stored.
    pub(crate) fn stored(&self) -> u64 {
        self.stored.load(Ordering::Acquire)
    }

    /// A read of what the database stores is starting (several servers write to one
    /// PostgreSQL database, and each sees the others' writes only so).
    pub(crate) fn refreshing(&self) {
        self.since_refresh.store(0, Ordering::Release);
    }

    /// The database stores `stored` bytes, as read since [`refreshing`](Self::refreshing):
    /// what this server committed meanwhile is added, so that the count never falls
    /// behind (a commit the read saw too is counted twice until the next read).
    pub(crate) fn refresh(&self, stored: u64) {
        let now = stored + self.since_refresh.load(Ordering::Acquire);
        self.stored.store(now, Ordering::Release);
        metrics::gauge!("dsec_trajectory_bytes").set(now as f64);
    }

    fn add(&self, bytes: u64) {
        self.since_refresh.fetch_add(bytes, Ordering::AcqRel);
        let now = self.stored.fetch_add(bytes, Ordering::AcqRel) + bytes;
        metrics::gauge!("dsec_trajectory_bytes").set(now as f64);
    }

    /// Whether pruning (or a checkpoint) is due.
    pub(crate) fn maintenance_due(&self) -> bool {
        self.stored() > self.budgets.prune_above()
            || self.unchecked.load(Ordering::Acquire) > self.budgets.wal_bytes() / 2
    }

    /// Whether the log is above the level at which stopped sandboxes are pruned.
    pub(crate) fn prune_due(&self) -> bool {
        self.stored() > self.budgets.prune_above()
    }

    /// Whether pruning has brought the log down far enough.
    pub(crate) fn pruned_enough(&self) -> bool {
        self.stored() <= self.budgets.prune_to()
    }

    /// A checkpoint is starting: what the WAL holds is counted from here.
    pub(crate) fn checkpointing(&self) {
        self.unchecked.store(0, Ordering::Release);
    }

    /// A live sandbox's share, counting what `batch` has added so far; `None` for a
    /// sandbox this process did not register or that has stopped.
    pub(crate) fn live(&self, id: &str, batch: &Delta) -> Option<LiveSandbox> {
        if batch.stopped.iter().any(|s| s == id) {
            return None;
        }
        let known = self.live.lock().expect("lock").get(id).copied();
        match (known, batch.sandboxes.get(id)) {
            (Some(mut s), Some(d)) => {
                s.bytes += d.bytes;
                s.over_budget |= d.over_budget;
                Some(s)
            }
            (known, d) => known.or(d.copied()),
        }
    }

    /// Bounds `step` by the budgets before it is stored: past its sandbox's budget
    /// (`share` is what the sandbox's log takes; `live` its entry, if it is live), or past
    /// the log's cap, it keeps no output (nor stdin input; `row` is encoded again then).
    /// The bytes its row takes, and whether it went over its sandbox's budget.
    pub(crate) fn admit(
        &self,
        step: &mut Step,
        row: &mut StepJson,
        share: u64,
        live: Option<LiveSandbox>,
        batch: &Delta,
    ) -> (u64, bool) {
        let whole = row.row_bytes(step);
        let over_sandbox = share + whole > self.budgets.sandbox_bytes;
        let over_total = self.stored() + batch.bytes + whole > self.budgets.output_cap();
        let mut over_budget = false;
        if (over_sandbox || over_total) && step.kept_bytes() > 0 {
            step.drop_output();
            *row = StepJson::new(step);
            let budget = if over_sandbox { "sandbox" } else { "total" };
            metrics::counter!("dsec_trajectory_over_budget_steps_total", "budget" => budget)
                .increment(1);
            over_budget = over_sandbox;
            if over_sandbox && live.is_some_and(|l| !l.over_budget) {
                tracing::warn!(
                    sandbox = %step.sandbox_id,
                    step = step.step,
                    budget = self.budgets.sandbox_bytes,
                    "trajectory log: sandbox over its budget; its further steps are recorded without output"
                );
            }
        }
        let elided = step.result.stdout_elided + step.result.stderr_elided;
        if elided > 0 {
            metrics::counter!("dsec_trajectory_elided_bytes_total").increment(elided);
        }
        (row.row_bytes(step), over_budget)
    }

    /// Applies a committed batch.
    pub(crate) fn apply(&self, delta: Delta) {
        {
            let mut live = self.live.lock().expect("lock");
            for (id, d) in delta.sandboxes {
                let s = live.entry(id).or_default();
                s.bytes += d.bytes;
                s.over_budget |= d.over_budget;
            }
            for id in &delta.stopped {
                live.remove(id);
            }
        }
        if delta.bytes > 0 {
            self.add(delta.bytes);
            self.unchecked.fetch_add(delta.bytes, Ordering::AcqRel);
        }
    }

    /// A stopped sandbox's log of `bytes` was deleted.
    fn pruned_one(&self, id: &str, bytes: u64) {
        tracing::debug!(sandbox = %id, bytes, "trajectory log pruned a stopped sandbox");
        // Saturating: a refresh from the database may have counted the prune already.
        let before = self
            .stored
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                Some(v.saturating_sub(bytes))
            })
            .unwrap_or_default();
        metrics::gauge!("dsec_trajectory_bytes").set(before.saturating_sub(bytes) as f64);
    }

    /// A round of pruning ended: `sandboxes` logs of `bytes` in all were deleted, and
    /// `exhausted` says whether it ran out of stopped sandboxes to delete.
    fn pruned(&self, sandboxes: u64, bytes: u64, exhausted: bool) {
        if exhausted && !self.pruned_enough() && !self.full.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                stored = self.stored(),
                budget = self.budgets.total_bytes,
                "trajectory log: live sandboxes alone fill its budget; steps past 3/4 of it are recorded without output until sandboxes stop"
            );
        }
        if self.pruned_enough() {
            self.full.store(false, Ordering::Release);
        }
        if sandboxes > 0 {
            metrics::counter!("dsec_trajectory_pruned_sandboxes_total").increment(sandboxes);
            metrics::counter!("dsec_trajectory_pruned_bytes_total").increment(bytes);
            tracing::info!(
                sandboxes,
                bytes,
                stored = self.stored(),
                budget = self.budgets.total_bytes,
                "trajectory log pruned the logs of the oldest stopped sandboxes"
            );
        }
    }
}

/// A round of pruning, as each store runs it: stopped sandboxes' logs deleted one at a
/// time, oldest stop first, while [`more`](Self::more) says so.
pub(crate) struct PruneRound<'a> {
    usage: &'a Usage,
    sandboxes: u64,
    bytes: u64,
}

impl<'a> PruneRound<'a> {
    pub(crate) fn new(usage: &'a Usage) -> PruneRound<'a> {
        PruneRound {
            usage,
            sandboxes: 0,
            bytes: 0,
        }
    }

    /// Whether to delete another: the log is not down to its pruning target yet.
    pub(crate) fn more(&self) -> bool {
        !self.usage.pruned_enough()
    }

    /// The log of stopped sandbox `id`, of `bytes`, was deleted.
    pub(crate) fn deleted(&mut self, id: &str, bytes: u64) {
        self.usage.pruned_one(id, bytes);
        self.sandboxes += 1;
        self.bytes += bytes;
    }

    /// The round ended; `exhausted`: no stopped sandbox was left to delete.
    pub(crate) fn end(self, exhausted: bool) {
        self.usage.pruned(self.sandboxes, self.bytes, exhausted);
    }
}

/// What the writes of one batch changed, applied to [`Usage`] once the batch commits.
#[derive(Default)]
pub(crate) struct Delta {
    /// Bytes added to the log.
    pub(crate) bytes: u64,
    /// Live sandboxes' added shares (sandboxes registered in the batch included).
    sandboxes: HashMap<String, LiveSandbox>,
    /// Sandboxes that stopped.
    stopped: Vec<String>,
}

/// One write's part of a [`Delta`].
#[derive(Clone)]
pub(crate) enum Change {
    /// Nothing stored.
    None,
    /// A sandbox's log grew by `bytes`: a live one's share, or a stopped one's row.
    Grew {
        id: String,
        bytes: u64,
        live: bool,
        over_budget: bool,
    },
    /// A sandbox stopped.
    Stopped(String),
    /// A stopped sandbox whose row holds `bytes` is live again: its share, already
    /// counted in what the log stores.
    Reopened { id: String, bytes: u64 },
}

impl Delta {
    /// Counts one committed write.
    pub(crate) fn add(&mut self, change: Change) {
        match change {
            Change::None => {}
            Change::Grew {
                id,
                bytes,
                live,
                over_budget,
            } => {
                self.bytes += bytes;
                if live {
                    let s = self.sandboxes.entry(id).or_default();
                    s.bytes += bytes;
                    s.over_budget |= over_budget;
                }
            }
            Change::Stopped(id) => self.stopped.push(id),
            Change::Reopened { id, bytes } => {
                self.stopped.retain(|s| *s != id);
                self.sandboxes.entry(id).or_default().bytes += bytes;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_thresholds_leave_an_eighth_for_the_wal_and_an_eighth_of_headroom() {
        let b = Budgets {
            total_bytes: 8 << 20,
            ..Budgets::default()
        };
        assert_eq!(
            (b.prune_to(), b.prune_above(), b.output_cap(), b.wal_bytes()),
            (4 << 20, 5 << 20, 6 << 20, 1 << 20)
        );
        assert_eq!(Budgets::default().wal_bytes(), 64 << 20);
    }
}
