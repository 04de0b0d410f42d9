//! The event stream: every lifecycle change, command, file operation, limit hit, network
//! refusal and Watcher action of this edge, as one typed, ordered stream.
//!
//! Emission never blocks and never does I/O: [`Events::emit`] numbers the event, keeps it
//! in a bounded in-memory ring, hands it to live followers (a `broadcast`, where a slow
//! follower loses events, told so by an `events.lost` line, rather than slowing anyone)
//! and to the writer task through a bounded channel (a full channel drops the event from
//! the disk copy, counted in `dsec_events_dropped_total`).
//!
//! On disk: NDJSON in `<state-dir>/events/`, `current.ndjson` and the one before it,
//! `previous.ndjson`; the current file is rotated at half the size budget, and a previous
//! file older than the age budget is removed. After a restart the ring is refilled from
//! those files and numbering continues, so ids only grow. Queries read the files for what
//! is older than the ring.

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};

/// The kinds of event, as they appear on the wire (docs/SDK.md lists them).
pub mod kind {
    /// A sandbox was created.
    pub const SANDBOX_CREATED: &str = "sandbox.created";
    /// A sandbox was stopped (`data.reason`: requested, ttl, idle_ttl, shutdown, watcher).
    pub const SANDBOX_STOPPED: &str = "sandbox.stopped";
    /// A sandbox's init died on its own.
    pub const SANDBOX_FAILED: &str = "sandbox.failed";
    /// A sandbox was frozen.
    pub const SANDBOX_PAUSED: &str = "sandbox.paused";
    /// A sandbox was thawed.
    pub const SANDBOX_RESUMED: &str = "sandbox.resumed";
    /// A command started.
    pub const COMMAND_START: &str = "command.start";
    /// A command ended (or its caller went away).
    pub const COMMAND_END: &str = "command.end";
    /// A file was read through the files API.
    pub const FILE_READ: &str = "file.read";
    /// A file was written through the files API (or by a command's `files`).
    pub const FILE_WRITE: &str = "file.write";
    /// A directory was made through the files API.
    pub const FILE_MKDIR: &str = "file.mkdir";
    /// A path was renamed through the files API.
    pub const FILE_MOVE: &str = "file.move";
    /// A path was removed through the files API.
    pub const FILE_REMOVE: &str = "file.remove";
    /// A read or write through the files API was refused (a device, a FIFO, a kernel
    /// interface, a link out of the root, a file or upload over the server's limit...).
    pub const FILE_REFUSED: &str = "file.refused";
    /// The memory limit killed a process.
    pub const LIMIT_OOM: &str = "limit.oom";
    /// A fork was refused by the pids limit.
    pub const LIMIT_PIDS: &str = "limit.pids";
    /// The writable layer is full.
    pub const LIMIT_DISK: &str = "limit.disk";
    /// The CPU limit held the sandbox back for a good part of a sample.
    pub const LIMIT_CPU: &str = "limit.cpu";
    /// A command's output went past its bound and was cut.
    pub const OUTPUT_TRUNCATED: &str = "output.truncated";
    /// The network policy refused a connection.
    pub const NETWORK_REFUSED: &str = "network.refused";
    /// The Watcher acted on a sandbox.
    pub const WATCHER_ACTION: &str = "watcher.action";
    /// A follower fell behind and missed events (sent to that follower only).
    pub const EVENTS_LOST: &str = "events.lost";
}

/// One event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Event {
    /// Position in this edge's stream: grows by one per event, also across restarts.
    pub id: u64,
    /// Unix time in seconds.
    pub time: f64,
    /// What happened, e.g. `command.end` (see docs/SDK.md for the list).
    pub kind: String,
    /// The sandbox it happened to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// That sandbox's project (none: the admin's), so that a project sees only its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// That sandbox's labels, so that a label filter works after the sandbox is gone.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Kind-specific details.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub data: serde_json::Value,
}

/// Bounds of the stream (`dsec serve --events-max-mb`, `--events-max-age-h`).
#[derive(Clone, Debug)]
pub struct EventsConfig {
    /// Both files together stay below this.
    pub max_bytes: u64,
    /// Events older than this are not served, and a file holding only such is removed.
    pub max_age: Duration,
    /// Events kept in memory.
    pub ring: usize,
    /// Whether events are recorded at all (`dsec serve --no-events` turns them off, and
    /// with them the usage sampler and the Watcher, which exist to make them).
    pub enabled: bool,
}

impl Default for EventsConfig {
    /// 64 MiB, 7 days, 20,000 events in memory.
    fn default() -> EventsConfig {
        EventsConfig {
            max_bytes: 64 << 20,
            max_age: Duration::from_secs(7 * 86400),
            ring: 20_000,
            enabled: true,
        }
    }
}

/// Which events a reader wants.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// Only this sandbox's.
    pub sandbox: Option<String>,
    /// Only events of sandboxes with all these labels.
    pub labels: Vec<(String, String)>,
    /// Only these kinds; `limit` or `limit.*` stands for every `limit.…` kind.
    pub kinds: Vec<String>,
    /// Only events at or after this Unix time.
    pub since: Option<f64>,
    /// Only events with a larger id (to resume a stream).
    pub after: Option<u64>,
    /// Only this project's events (set from a project's token, never from the query).
    pub project: Option<String>,
}

impl Filter {
    /// Whether `event` passes.
    pub fn matches(&self, event: &Event) -> bool {
        self.sandbox
            .as_ref()
            .is_none_or(|s| event.sandbox.as_ref() == Some(s))
            && self
                .labels
                .iter()
                .all(|(k, v)| event.labels.get(k) == Some(v))
            && (self.kinds.is_empty() || self.kinds.iter().any(|k| kind_matches(k, &event.kind)))
            && self.since.is_none_or(|t| event.time >= t)
            && self.after.is_none_or(|id| event.id > id)
            && self
                .project
                .as_ref()
                .is_none_or(|p| event.project.as_ref() == Some(p))
    }
}

fn kind_matches(pattern: &str, kind: &str) -> bool {
    let family = pattern.strip_suffix(".*").unwrap_or(pattern);
    kind == pattern
        || (!pattern.contains('.') || pattern.ends_with(".*"))
            && kind
                .strip_prefix(family)
                .is_some_and(|rest| rest.starts_with('.'))
}

/// The sandbox an event is about.
#[derive(Clone, Copy)]
pub struct Subject<'a> {
    /// Its id.
    pub id: &'a str,
    /// Its labels.
    pub labels: &'a BTreeMap<String, String>,
    /// Its project, if not the admin's.
    pub project: Option<&'a str>,
}

struct Ring {
    next_id: u64,
    events: VecDeque<Arc<Event>>,
}

/// The stream of one edge (see the module docs).
pub struct Events {
    ring: Mutex<Ring>,
    capacity: usize,
    max_age: Duration,
    enabled: bool,
    live: broadcast::Sender<Arc<Event>>,
    disk: mpsc::Sender<ToDisk>,
    dir: PathBuf,
}

/// What the writer task is sent.
enum ToDisk {
    Event(Arc<Event>),
    /// Answered once everything before it is written.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// Events a follower may lag behind before it loses some.
const FOLLOW_BACKLOG: usize = 4096;
/// Events waiting for the writer before new ones skip the disk.
const DISK_BACKLOG: usize = 8192;
const CURRENT: &str = "current.ndjson";
const PREVIOUS: &str = "previous.ndjson";

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The events of one file, oldest first; lines that do not parse (a torn last line after
/// a crash) are skipped.
fn read_file(path: &Path) -> Vec<Event> {
    let Ok(file) = std::fs::File::open(path) else {
        return Vec::new();
    };
    std::io::BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| serde_json::from_str(&line).ok())
        .collect()
}

impl Events {
    /// Opens the stream in `dir` (created if missing), refilling the ring from its files,
    /// and starts the writer task. Blocking: reads the files.
    pub fn open(dir: &Path, config: EventsConfig) -> std::io::Result<Arc<Events>> {
        std::fs::create_dir_all(dir)?;
        let cutoff = unix_now() - config.max_age.as_secs_f64();
        let mut recent: VecDeque<Arc<Event>> = VecDeque::with_capacity(config.ring.min(4096));
        let mut next_id = 1;
        for name in [PREVIOUS, CURRENT] {
            for event in read_file(&dir.join(name)) {
                next_id = next_id.max(event.id + 1);
                if event.time < cutoff {
                    continue;
                }
                if recent.len() == config.ring {
                    recent.pop_front();
                }
                recent.push_back(Arc::new(event));
            }
        }
        let (live, _) = broadcast::channel(FOLLOW_BACKLOG);
        let (disk, queue) = mpsc::channel(DISK_BACKLOG);
        let writer = Writer::open(dir, &config)?;
        // A thread of its own, not `block_in_place`: that turns the calling runtime
        // worker into a blocking-pool thread, which exits when idle — and a QEMU forked
        // from it gets its parent-death SIGKILL then (see dsec_vm::qemu).
        std::thread::Builder::new()
            .name("dsec-events".to_owned())
            .spawn(move || writer.run(queue))?;
        Ok(Arc::new(Events {
            ring: Mutex::new(Ring {
                next_id,
                events: recent,
            }),
            capacity: config.ring.max(1),
            enabled: config.enabled,
            max_age: config.max_age,
            live,
            disk,
            dir: dir.to_owned(),
        }))
    }

    /// Records an event about `subject` (or the server, for `None`). Never blocks.
    pub fn emit(&self, kind: &str, subject: Option<Subject<'_>>, data: serde_json::Value) {
        if !self.enabled {
            return;
        }
        let mut ring = self.ring.lock().expect("lock");
        let event = Arc::new(Event {
            id: ring.next_id,
            time: unix_now(),
            kind: kind.to_owned(),
            sandbox: subject.map(|s| s.id.to_owned()),
            project: subject.and_then(|s| s.project.map(str::to_owned)),
            labels: subject.map(|s| s.labels.clone()).unwrap_or_default(),
            data,
        });
        ring.next_id += 1;
        if ring.events.len() == self.capacity {
            ring.events.pop_front();
        }
        ring.events.push_back(Arc::clone(&event));
        // Sent under the lock, so that followers see the ids in order.
        let _ = self.live.send(Arc::clone(&event));
        drop(ring);
        metrics::counter!("dsec_events_total", "kind" => kind.to_owned()).increment(1);
        if self.disk.try_send(ToDisk::Event(event)).is_err() {
            metrics::counter!("dsec_events_dropped_total").increment(1);
        }
    }

    /// Events passing `filter`, oldest first, at most `limit` (the newest ones); read from
    /// the files as well when the ring does not reach back far enough. Blocking.
    pub fn history(&self, filter: &Filter, limit: usize) -> Vec<Arc<Event>> {
        let cutoff = unix_now() - self.max_age.as_secs_f64();
        let (in_ring, oldest, oldest_time, whole_sandbox) = {
            let ring = self.ring.lock().expect("lock");
            let oldest = ring.events.front().map_or(ring.next_id, |e| e.id);
            let oldest_time = ring.events.front().map_or(f64::INFINITY, |e| e.time);
            let found: Vec<Arc<Event>> = ring
                .events
                .iter()
                .filter(|e| e.time >= cutoff && filter.matches(e))
                .cloned()
                .collect();
            // A sandbox's stream starts with its `sandbox.created`: with that in the ring,
            // so is the rest of it.
            let whole_sandbox = filter.sandbox.as_ref().is_some_and(|s| {
                ring.events
                    .iter()
                    .any(|e| e.kind == kind::SANDBOX_CREATED && e.sandbox.as_ref() == Some(s))
            });
            (found, oldest, oldest_time, whole_sandbox)
        };
        let reaches_back = filter.after.is_some_and(|a| a + 1 >= oldest)
            || filter.since.is_some_and(|t| t > oldest_time)
            || oldest <= 1
            || whole_sandbox
            || in_ring.len() >= limit;
        let mut found = Vec::new();
        if !reaches_back {
            for name in [PREVIOUS, CURRENT] {
                found.extend(
                    read_file(&self.dir.join(name))
                        .into_iter()
                        .filter(|e| e.id < oldest && e.time >= cutoff && filter.matches(e))
                        .map(Arc::new),
                );
            }
        }
        found.extend(in_ring);
        let skip = found.len().saturating_sub(limit);
        found.split_off(skip)
    }

    /// Waits until every event emitted so far is on disk (server shutdown).
    pub async fn flush(&self) {
        let (done, written) = tokio::sync::oneshot::channel();
        if self.disk.send(ToDisk::Flush(done)).await.is_ok() {
            let _ = written.await;
        }
    }

    /// New events from now on (see [`FOLLOW_BACKLOG`]).
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Event>> {
        self.live.subscribe()
    }
}

/// Appends events to the current file, rotating it at half the size budget.
struct Writer {
    dir: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    written: u64,
    rotate_at: u64,
    max_age: Duration,
}

impl Writer {
    fn open(dir: &Path, config: &EventsConfig) -> std::io::Result<Writer> {
        let path = dir.join(CURRENT);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?;
        let written = file.metadata()?.len();
        Ok(Writer {
            dir: dir.to_owned(),
            file: std::io::BufWriter::new(file),
            written,
            rotate_at: (config.max_bytes / 2).max(4096),
            max_age: config.max_age,
        })
    }

    /// Writes what arrives, in batches of what has queued up, flushing after each; stops
    /// when every sender is gone.
    fn run(mut self, mut queue: mpsc::Receiver<ToDisk>) {
        let mut batch = Vec::new();
        while let Some(first) = queue.blocking_recv() {
            batch.push(first);
            while batch.len() < 256 {
                match queue.try_recv() {
                    Ok(message) => batch.push(message),
                    Err(_) => break,
                }
            }
            if let Err(e) = self.write(&mut batch) {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot write events");
            }
            batch.clear();
        }
    }

    fn write(&mut self, batch: &mut Vec<ToDisk>) -> std::io::Result<()> {
        let mut flushed = Vec::new();
        for message in batch.drain(..) {
            let event = match message {
                ToDisk::Event(event) => event,
                ToDisk::Flush(done) => {
                    flushed.push(done);
                    continue;
                }
            };
            let mut line = serde_json::to_vec(event.as_ref()).map_err(std::io::Error::other)?;
            line.push(b'\n');
            self.file.write_all(&line)?;
            self.written += line.len() as u64;
            if self.written >= self.rotate_at {
                self.rotate()?;
            }
        }
        self.file.flush()?;
        self.expire_previous();
        for done in flushed {
            let _ = done.send(());
        }
        Ok(())
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        self.file.flush()?;
        std::fs::rename(self.dir.join(CURRENT), self.dir.join(PREVIOUS))?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(CURRENT))?;
        self.file = std::io::BufWriter::new(file);
        self.written = 0;
        Ok(())
    }

    /// Removes the previous file once its newest event is past the age budget.
    fn expire_previous(&self) {
        let path = self.dir.join(PREVIOUS);
        let old = std::fs::metadata(&path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > self.max_age);
        if old {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: u64, kind: &str, sandbox: Option<&str>) -> Event {
        Event {
            id,
            time: 100.0,
            kind: kind.into(),
            sandbox: sandbox.map(str::to_owned),
            labels: BTreeMap::from([("team".to_owned(), "a".to_owned())]),
            project: None,
            data: serde_json::Value::Null,
        }
    }

    #[test]
    fn kind_families_match_their_members_only() {
        assert!(kind_matches("limit", "limit.oom"));
        assert!(kind_matches("limit.*", "limit.pids"));
        assert!(kind_matches("limit.oom", "limit.oom"));
        assert!(!kind_matches("limit.oom", "limit.pids"));
        assert!(!kind_matches("limit", "limits.x"));
        assert!(!kind_matches("command.e", "command.end"));
    }

    #[test]
    fn filters_combine() {
        let e = event(5, "command.end", Some("sb-1"));
        assert!(Filter::default().matches(&e));
        let f = Filter {
            sandbox: Some("sb-1".into()),
            labels: vec![("team".into(), "a".into())],
            project: None,
            kinds: vec!["command".into()],
            since: Some(99.0),
            after: Some(4),
        };
        assert!(f.matches(&e));
        assert!(!Filter {
            after: Some(5),
            ..f.clone()
        }
        .matches(&e));
        assert!(!Filter {
            labels: vec![("team".into(), "b".into())],
            ..f.clone()
        }
        .matches(&e));
        assert!(!Filter {
            since: Some(101.0),
            ..f
        }
        .matches(&e));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn events_survive_a_reopen_and_rotation_keeps_the_budget() {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = EventsConfig {
            max_bytes: 16 << 10,
            ring: 50,
            ..EventsConfig::default()
        };
        let dir = dir.path().join("events");
        let events = Events::open(&dir, config.clone()).expect("open");
        let labels = BTreeMap::new();
        for i in 0..400 {
            let subject = Subject {
                id: if i % 2 == 0 { "even" } else { "odd" },
                labels: &labels,
                project: None,
            };
            events.emit(
                kind::COMMAND_END,
                Some(subject),
                serde_json::json!({"i": i}),
            );
        }
        // The writer drains asynchronously; wait for the last event to reach the disk.
        for _ in 0..200 {
            let on_disk: Vec<Event> = [PREVIOUS, CURRENT]
                .iter()
                .flat_map(|n| read_file(&dir.join(n)))
                .collect();
            if on_disk.last().is_some_and(|e| e.id == 400) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let size: u64 = [PREVIOUS, CURRENT]
            .iter()
            .filter_map(|n| std::fs::metadata(dir.join(n)).ok())
            .map(|m| m.len())
            .sum();
        assert!(size <= config.max_bytes + 1024, "{size} bytes on disk");
        drop(events);
        let reopened = Events::open(&dir, config.clone()).expect("reopen");
        let all = reopened.history(&Filter::default(), usize::MAX);
        assert_eq!(all.last().map(|e| e.id), Some(400));
        // More than the ring holds: the older ones came from the files.
        assert!(all.len() > 50, "{} events", all.len());
        assert!(all.windows(2).all(|w| w[0].id < w[1].id));
        let odd = Filter {
            sandbox: Some("odd".into()),
            ..Filter::default()
        };
        assert!(reopened.history(&odd, 10).iter().all(|e| e.id % 2 == 0));
        assert_eq!(reopened.history(&odd, 10).len(), 10);
        reopened.emit(kind::SANDBOX_CREATED, None, serde_json::Value::Null);
        let last = reopened.history(&Filter::default(), 1);
        assert_eq!(last[0].id, 401, "numbering continues after a reopen");
    }
}
