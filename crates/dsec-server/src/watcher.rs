//! The Watcher: rules over the event stream that act on misbehaving sandboxes.
//!
//! A rule names an event kind and a threshold — `count` matching events (or `distinct`
//! values of one of their data fields, e.g. the ports of `network.refused`: a scan)
//! within `within_s` seconds for one sandbox — and an action: `flag` (label
//! `watcher.<rule>=flagged` on the sandbox, nothing else), `pause`, `cut_network`
//! (policy off) or `stop`. Every action is a `watcher.action` event carrying the rule,
//! the action, its outcome and the evidence (the ids and kinds of the events that tripped
//! it). A rule fires at most once per sandbox per `within_s`.
//!
//! Rules come from `dsec serve --watcher-config FILE` (JSON, see docs/SDK.md) on top of
//! [`default_rules`], which only flag: safe to run anywhere.
//!
//! The Watcher reads the same broadcast as `GET /v1/events` followers; if it falls
//! behind it loses events rather than slowing the edge (counted in
//! `dsec_watcher_lost_events_total`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use tokio::sync::broadcast;

use crate::edge::Edge;
use crate::events::{kind, Event, Subject};

/// What a rule does when it trips.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Label the sandbox `watcher.<rule>=flagged`.
    Flag,
    /// Freeze it (the next request to it thaws it).
    Pause,
    /// Set its network policy to off.
    CutNetwork,
    /// Stop it.
    Stop,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::Flag => "flag",
            Action::Pause => "pause",
            Action::CutNetwork => "cut_network",
            Action::Stop => "stop",
        }
    }
}

/// One rule (see the module docs).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Names the rule in labels and events.
    pub name: String,
    /// The event kind it counts (`limit` or `limit.*` for a family).
    pub kind: String,
    /// Events needed within the window (default 1).
    #[serde(default = "one")]
    pub count: usize,
    /// Count distinct values of these `data` fields instead of events (e.g. `["dst",
    /// "port"]`).
    #[serde(default)]
    pub distinct: Vec<String>,
    /// Only events whose `data.path` starts with one of these.
    #[serde(default)]
    pub path_prefixes: Vec<String>,
    /// The window, in seconds (default 60).
    #[serde(default = "sixty")]
    pub within_s: f64,
    /// What to do.
    pub action: Action,
}

fn one() -> usize {
    1
}

fn sixty() -> f64 {
    60.0
}

/// The contents of a `--watcher-config` file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatcherConfig {
    /// Keep [`default_rules`] (those not replaced by a rule of the same name); default
    /// true.
    #[serde(default = "yes")]
    pub defaults: bool,
    /// More rules, or replacements of default ones (same name).
    #[serde(default)]
    pub rules: Vec<Rule>,
}

fn yes() -> bool {
    true
}

impl Default for WatcherConfig {
    fn default() -> WatcherConfig {
        WatcherConfig {
            defaults: true,
            rules: Vec::new(),
        }
    }
}

/// Why a watcher config was refused.
#[derive(Debug, thiserror::Error)]
pub enum WatcherConfigError {
    /// The file could not be read.
    #[error("watcher config {path}: {source}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file is not a valid config.
    #[error("watcher config {path}: {message}")]
    Invalid {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong, and where.
        message: String,
    },
}

/// Directories of an image's own programs and libraries: writes there replace them.
pub use dsec_runtime::layers::IMAGE_BINARY_DIRS as BINARY_DIRS;

/// The rules every server runs unless its config says `"defaults": false`: each only
/// flags.
pub fn default_rules() -> Vec<Rule> {
    let rule = |name: &str, kind: &str, count: usize| Rule {
        name: name.to_owned(),
        kind: kind.to_owned(),
        count,
        distinct: Vec::new(),
        path_prefixes: Vec::new(),
        within_s: 60.0,
        action: Action::Flag,
    };
    vec![
        // A fork bomb hits the limit every second it runs.
        rule("pids-storm", kind::LIMIT_PIDS, 3),
        rule("oom-repeat", kind::LIMIT_OOM, 3),
        rule("output-flood", kind::OUTPUT_TRUNCATED, 3),
        // Held back by its CPU limit for most of a minute: a hog (a training job's
        // graders share the host's cores).
        rule("cpu-hog", kind::LIMIT_CPU, 30),
        Rule {
            distinct: vec!["dst".into(), "port".into()],
            ..rule("port-scan", kind::NETWORK_REFUSED, 10)
        },
        Rule {
            path_prefixes: BINARY_DIRS.iter().map(|d| (*d).to_owned()).collect(),
            ..rule("binary-overwrite", kind::FILE_WRITE, 1)
        },
    ]
}

impl WatcherConfig {
    /// Reads and checks a config file.
    pub fn load(path: &Path) -> Result<WatcherConfig, WatcherConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| WatcherConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let invalid = |message: String| WatcherConfigError::Invalid {
            path: path.to_owned(),
            message,
        };
        let config: WatcherConfig =
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let mut names = HashSet::new();
        for r in &config.rules {
            if r.name.is_empty()
                || !r
                    .name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(invalid(format!(
                    "rule name {:?} must be letters, digits, - and _",
                    r.name
                )));
            }
            if !names.insert(&r.name) {
                return Err(invalid(format!("two rules are named {:?}", r.name)));
            }
            if r.count == 0 {
                return Err(invalid(format!(
                    "rule {:?}: count must be at least 1",
                    r.name
                )));
            }
            if !r.within_s.is_finite() || r.within_s <= 0.0 {
                return Err(invalid(format!(
                    "rule {:?}: within_s must be a positive number of seconds",
                    r.name
                )));
            }
        }
        Ok(config)
    }

    /// The rules in force: the defaults (unless dropped or replaced), then the file's.
    pub fn rules(&self) -> Vec<Rule> {
        let mut rules: Vec<Rule> = if self.defaults {
            default_rules()
                .into_iter()
                .filter(|d| self.rules.iter().all(|r| r.name != d.name))
                .collect()
        } else {
            Vec::new()
        };
        rules.extend(self.rules.iter().cloned());
        rules
    }
}

impl Rule {
    /// Whether `event` counts for this rule.
    fn counts(&self, event: &Event) -> bool {
        let filter = crate::events::Filter {
            kinds: vec![self.kind.clone()],
            ..Default::default()
        };
        filter.matches(event)
            && (self.path_prefixes.is_empty()
                || event.data["path"]
                    .as_str()
                    .is_some_and(|p| self.path_prefixes.iter().any(|d| p.starts_with(d.as_str()))))
    }

    /// The value an event adds to a `distinct` count.
    fn key(&self, event: &Event) -> String {
        self.distinct
            .iter()
            .map(|f| event.data[f.as_str()].to_string())
            .collect::<Vec<_>>()
            .join(":")
    }
}

/// One sandbox's recent matching events for one rule.
#[derive(Default)]
struct Window {
    seen: VecDeque<(f64, u64, String)>,
    /// When the rule last fired here.
    fired: Option<f64>,
}

/// The rules' state over the stream.
pub struct Watcher {
    rules: Vec<Rule>,
    windows: HashMap<(usize, String), Window>,
}

/// What a tripped rule does: which rule, on which sandbox, with what evidence.
#[derive(Debug, PartialEq)]
pub struct Trip {
    /// Index in the rules.
    pub rule: usize,
    /// The sandbox.
    pub sandbox: String,
    /// Ids of the events in the window.
    pub evidence: Vec<u64>,
    /// Distinct values seen, when the rule counts them.
    pub distinct: Vec<String>,
}

impl Watcher {
    /// A watcher with these rules.
    pub fn new(rules: Vec<Rule>) -> Watcher {
        Watcher {
            rules,
            windows: HashMap::new(),
        }
    }

    /// Feeds one event; the rules it trips.
    pub fn observe(&mut self, event: &Event) -> Vec<Trip> {
        let Some(sandbox) = &event.sandbox else {
            return Vec::new();
        };
        if event.kind == kind::WATCHER_ACTION {
            return Vec::new();
        }
        if event.kind == kind::SANDBOX_STOPPED || event.kind == kind::SANDBOX_FAILED {
            self.windows.retain(|(_, s), _| s != sandbox);
            return Vec::new();
        }
        let mut trips = Vec::new();
        for (i, rule) in self.rules.iter().enumerate() {
            if !rule.counts(event) {
                continue;
            }
            let window = self.windows.entry((i, sandbox.clone())).or_default();
            let start = event.time - rule.within_s;
            while window.seen.front().is_some_and(|(t, _, _)| *t < start) {
                window.seen.pop_front();
            }
            window
                .seen
                .push_back((event.time, event.id, rule.key(event)));
            if window.fired.is_some_and(|t| t >= start) {
                continue;
            }
            let distinct: HashSet<&str> = window.seen.iter().map(|(_, _, k)| k.as_str()).collect();
            let reached = if rule.distinct.is_empty() {
                window.seen.len()
            } else {
                distinct.len()
            };
            if reached >= rule.count {
                window.fired = Some(event.time);
                let mut values: Vec<String> = if rule.distinct.is_empty() {
                    Vec::new()
                } else {
                    distinct.into_iter().map(str::to_owned).collect()
                };
                values.sort();
                trips.push(Trip {
                    rule: i,
                    sandbox: sandbox.clone(),
                    evidence: window.seen.iter().map(|(_, id, _)| *id).collect(),
                    distinct: values,
                });
            }
        }
        trips
    }

    /// Runs the rules over `edge`'s stream forever, acting on what trips.
    pub async fn run(mut self, edge: Arc<Edge>) {
        if self.rules.is_empty() {
            return;
        }
        let mut events = edge.events().subscribe();
        loop {
            let event = match events.recv().await {
                Ok(event) => event,
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    metrics::counter!("dsec_watcher_lost_events_total").increment(n);
                    tracing::warn!(missed = n, "the Watcher fell behind the event stream");
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            for trip in self.observe(&event) {
                let rule = self.rules[trip.rule].clone();
                let edge = Arc::clone(&edge);
                let labels = event.labels.clone();
                let project = event.project.clone();
                tokio::spawn(
                    async move { act(&edge, &rule, trip, &labels, project.as_deref()).await },
                );
            }
        }
    }
}

/// Carries out a tripped rule's action and records it.
async fn act(
    edge: &Edge,
    rule: &Rule,
    trip: Trip,
    labels: &std::collections::BTreeMap<String, String>,
    project: Option<&str>,
) {
    let id = trip.sandbox.as_str();
    let outcome = match rule.action {
        Action::Flag => edge.flag(id, &format!("watcher.{}", rule.name), "flagged"),
        Action::Pause => edge.pause(id).await.map(|_| ()),
        Action::CutNetwork => {
            edge.set_network(id, &dsec_api::Network::Enabled(false))
                .await
        }
        Action::Stop => edge.stop_because(id, "watcher").await,
    };
    let (ok, error) = match &outcome {
        Ok(()) => (true, None),
        Err(e) => (false, Some(e.message.clone())),
    };
    tracing::warn!(sandbox = %id, rule = %rule.name, action = rule.action.name(), ok, "Watcher acted");
    metrics::counter!("dsec_watcher_actions_total", "rule" => rule.name.clone(), "action" => rule.action.name())
        .increment(1);
    edge.events().emit(
        kind::WATCHER_ACTION,
        Some(Subject {
            id,
            labels,
            project,
        }),
        serde_json::json!({
            "rule": rule.name,
            "action": rule.action.name(),
            "ok": ok,
            "error": error,
            "evidence": {
                "kind": rule.kind,
                "events": trip.evidence,
                "distinct": trip.distinct,
                "threshold": rule.count,
                "within_s": rule.within_s,
            },
        }),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: u64, time: f64, kind: &str, data: serde_json::Value) -> Event {
        Event {
            id,
            time,
            kind: kind.into(),
            sandbox: Some("sb".into()),
            labels: Default::default(),
            project: None,
            data,
        }
    }

    #[test]
    fn a_scan_trips_on_distinct_ports_once_per_window() {
        let mut w = Watcher::new(default_rules());
        let mut trips = Vec::new();
        for port in 0..12u64 {
            let e = event(
                port + 1,
                100.0 + port as f64 * 0.1,
                kind::NETWORK_REFUSED,
                serde_json::json!({"dst": "10.0.0.1", "port": port}),
            );
            trips.extend(w.observe(&e));
        }
        assert_eq!(trips.len(), 1, "{trips:?}");
        assert_eq!(trips[0].evidence, (1..=10).collect::<Vec<_>>());
        assert_eq!(trips[0].distinct.len(), 10);
        // The same port again and again is no scan.
        let mut w = Watcher::new(default_rules());
        for i in 0..30 {
            let e = event(
                i + 1,
                100.0 + i as f64,
                kind::NETWORK_REFUSED,
                serde_json::json!({"dst": "10.0.0.1", "port": 80}),
            );
            assert!(w.observe(&e).is_empty());
        }
    }

    #[test]
    fn counts_age_out_of_the_window() {
        let mut w = Watcher::new(default_rules());
        let pids = |id, t| event(id, t, kind::LIMIT_PIDS, serde_json::Value::Null);
        assert!(w.observe(&pids(1, 0.0)).is_empty());
        assert!(w.observe(&pids(2, 61.0)).is_empty());
        assert!(w.observe(&pids(3, 122.0)).is_empty());
        assert!(w.observe(&pids(4, 123.0)).is_empty());
        assert_eq!(w.observe(&pids(5, 124.0)).len(), 1);
    }

    #[test]
    fn binary_writes_trip_and_others_do_not() {
        let mut w = Watcher::new(default_rules());
        let write =
            |id, path: &str| event(id, 1.0, kind::FILE_WRITE, serde_json::json!({"path": path}));
        assert!(w.observe(&write(1, "/tmp/bash")).is_empty());
        assert_eq!(w.observe(&write(2, "/usr/bin/bash")).len(), 1);
    }

    #[test]
    fn configs_replace_defaults_by_name_and_bad_ones_say_why() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w.json");
        std::fs::write(
            &path,
            r#"{"rules": [{"name": "port-scan", "kind": "network.refused", "count": 3,
                "distinct": ["port"], "action": "cut_network"}]}"#,
        )
        .expect("write");
        let rules = WatcherConfig::load(&path).expect("loads").rules();
        let scan: Vec<&Rule> = rules.iter().filter(|r| r.name == "port-scan").collect();
        assert_eq!(scan.len(), 1);
        assert_eq!(scan[0].action, Action::CutNetwork);
        assert_eq!(rules.len(), default_rules().len());
        for (text, says) in [
            (
                r#"{"rules": [{"name": "x", "kind": "a", "action": "nuke"}]}"#,
                "unknown variant",
            ),
            (
                r#"{"rules": [{"name": "x y", "kind": "a", "action": "flag"}]}"#,
                "rule name",
            ),
            (
                r#"{"rules": [{"name": "x", "kind": "a", "count": 0, "action": "flag"}]}"#,
                "count",
            ),
            (r#"{"rule": []}"#, "unknown field"),
        ] {
            std::fs::write(&path, text).expect("write");
            let e = WatcherConfig::load(&path).expect_err(text).to_string();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
