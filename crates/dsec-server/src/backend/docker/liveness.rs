//! How a sandbox learns that its container stopped: one stream of the daemon's events for
//! all of this server's containers, not one request per container.
//!
//! Why: a long poll per container (`/containers/{id}/wait`) holds its own connection to the
//! daemon for the container's whole life, so a thousand idle sandboxes held a thousand
//! sockets here and as many in dockerd. Instead one task per backend (one daemon) reads
//! `/events`, which the daemon filters to this server's containers (`dsec.managed=true`,
//! `dsec.edge=<edge>`: nobody else's events reach us) and to the actions that end one
//! (`die`, `destroy`), and marks the registered container's sandbox dead. Docker's `oom`
//! is not one of them: the memory limit killing a command leaves the container running
//! (OOM kills are read from its cgroup, see `LocalView::take_oom_kill`).
//!
//! Invariants:
//! - a container is registered once started, before `create` inspects it: a death before
//!   that inspect fails the `create`, a death after it reaches the sandbox;
//! - nothing is missed across a (re)subscription: each one asks for the events since a
//!   moment before it was made (`since`, with a margin for the daemon's clock), and each is
//!   followed by a reconciliation, a listing of this server's containers in which every
//!   registered one that is not running is checked as a `die` would be. dockerd drops the
//!   events of a subscriber that falls behind, so the listing is repeated every
//!   [`RECONCILE_EVERY`] as well;
//! - a `die` is checked (inspect) before the sandbox is marked dead, as the long poll's wake
//!   was: a container started again behind dsec's back is alive. A `destroy`, a container
//!   the daemon no longer knows (404) or a daemon that fails the inspect is dead;
//! - a stream that ends or fails is made again with a backoff; a daemon that does not
//!   answer for [`DAEMON_GONE`] has its registered sandboxes marked dead, their containers
//!   being gone or out of reach;
//! - the task runs while a container is registered: the first registration starts it, and
//!   it ends once the last one is gone (stopped, found dead, or its sandbox dropped).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bollard::errors::Error as DockerError;
use bollard::models::{ContainerSummaryStateEnum, EventMessage};
use bollard::query_parameters::{EventsOptionsBuilder, ListContainersOptionsBuilder};
use bollard::Docker;
use futures::StreamExt;
use tokio::sync::Notify;
use tokio::time::{Instant, MissedTickBehavior};

use super::host::status;

/// How far before a subscription its `since` is: the daemon's clock may be behind ours.
const SINCE_MARGIN: Duration = Duration::from_secs(5);
/// How often the registered containers are checked against a listing, for events the
/// daemon dropped.
const RECONCILE_EVERY: Duration = Duration::from_secs(60);
/// How long a daemon may not answer before its sandboxes are marked dead.
const DAEMON_GONE: Duration = Duration::from_secs(10);
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The containers of one daemon that are watched for their end, and the task that
/// watches them.
pub(super) struct Liveness {
    /// Value of the `dsec.edge` label of this server's containers.
    edge: String,
    registry: Mutex<Registry>,
    /// Wakes the task when the last container left the registry.
    emptied: Notify,
}

#[derive(Default)]
struct Registry {
    /// Each registered container's flag, by container id.
    containers: HashMap<String, Arc<AtomicBool>>,
    /// Whether the task runs; only changed under the lock, with `containers`.
    following: bool,
}

/// One container's registration: whether it still runs. Dropping it unregisters it.
pub(super) struct Alive {
    flag: Arc<AtomicBool>,
    container: String,
    liveness: Arc<Liveness>,
}

impl Alive {
    /// False once the container stopped, or [`end`](Self::end) was called.
    pub(super) fn get(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Marks it dead and unregisters it (the sandbox is being stopped: its container's
    /// events are of no interest any more).
    pub(super) fn end(&self) {
        self.liveness.unregister(&self.container);
        self.flag.store(false, Ordering::Release);
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.liveness.unregister(&self.container);
    }
}

impl Liveness {
    pub(super) fn new(edge: String) -> Arc<Liveness> {
        Arc::new(Liveness {
            edge,
            registry: Mutex::new(Registry::default()),
            emptied: Notify::new(),
        })
    }

    /// Watches a started container for its end, starting the task if it is not running.
    pub(super) fn register(self: &Arc<Self>, docker: &Docker, container: &str) -> Alive {
        let flag = Arc::new(AtomicBool::new(true));
        let mut registry = self.registry.lock().expect("lock");
        registry
            .containers
            .insert(container.to_owned(), Arc::clone(&flag));
        if !registry.following {
            registry.following = true;
            tokio::spawn(Arc::clone(self).run(docker.clone()));
        }
        Alive {
            flag,
            container: container.to_owned(),
            liveness: Arc::clone(self),
        }
    }

    fn unregister(&self, container: &str) {
        let mut registry = self.registry.lock().expect("lock");
        if registry.containers.remove(container).is_some() && registry.containers.is_empty() {
            self.emptied.notify_one();
        }
    }

    /// Marks a registered container's sandbox dead, and forgets the container.
    fn mark_dead(&self, container: &str) {
        let mut registry = self.registry.lock().expect("lock");
        let Some(flag) = registry.containers.remove(container) else {
            return;
        };
        flag.store(false, Ordering::Release);
        tracing::debug!(container, "docker backend: container stopped");
        if registry.containers.is_empty() {
            self.emptied.notify_one();
        }
    }

    fn registered(&self) -> Vec<String> {
        let registry = self.registry.lock().expect("lock");
        registry.containers.keys().cloned().collect()
    }

    fn is_registered(&self, container: &str) -> bool {
        let registry = self.registry.lock().expect("lock");
        registry.containers.contains_key(container)
    }

    /// The task: follows the daemon's events until no container is registered.
    async fn run(self: Arc<Self>, docker: Docker) {
        tokio::select! {
            () = self.until_idle() => {}
            () = self.follow(docker) => {}
        }
    }

    /// Returns once no container is registered, the task having been marked stopped (a
    /// later registration starts another).
    async fn until_idle(&self) {
        loop {
            self.emptied.notified().await;
            let mut registry = self.registry.lock().expect("lock");
            if registry.containers.is_empty() {
                registry.following = false;
                return;
            }
        }
    }

    /// Subscribes to the events again and again, with a backoff while the daemon fails.
    async fn follow(&self, docker: Docker) {
        // The stream's response starts with its first event, which may be hours away: the
        // client's bound on waiting for a response must not apply to it (a `Duration` this
        // long means none).
        let streaming = docker.clone().with_timeout(Duration::MAX);
        let mut backoff = FIRST_BACKOFF;
        let mut unanswered_since: Option<Instant> = None;
        loop {
            let (answered, why) = self.subscription(&docker, &streaming).await;
            if answered {
                backoff = FIRST_BACKOFF;
                unanswered_since = None;
            }
            let since = *unanswered_since.get_or_insert_with(Instant::now);
            tracing::debug!(error = %why, "docker backend: the daemon's event stream ended");
            if since.elapsed() >= DAEMON_GONE {
                tracing::warn!(
                    error = %why,
                    "docker backend: the daemon has not answered for {} s; its sandboxes are \
                     marked dead",
                    DAEMON_GONE.as_secs()
                );
                for container in self.registered() {
                    self.mark_dead(&container);
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One subscription, until it ends: whether the daemon answered a reconciliation
    /// meanwhile, and why it ended.
    async fn subscription(&self, docker: &Docker, streaming: &Docker) -> (bool, String) {
        let since = SystemTime::now()
            .checked_sub(SINCE_MARGIN)
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .unwrap_or_default();
        let since = format!("{}.{:09}", since.as_secs(), since.subsec_nanos());
        let filters = HashMap::from([
            ("type", vec!["container".to_owned()]),
            ("event", vec!["die".to_owned(), "destroy".to_owned()]),
            ("label", self.labels()),
        ]);
        let opts = EventsOptionsBuilder::new()
            .since(&since)
            .filters(&filters)
            .build();
        let mut events = streaming.events(Some(opts));
        // Its first tick is at once: the reconciliation after subscribing.
        let mut reconcile = tokio::time::interval(RECONCILE_EVERY);
        reconcile.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut answered = false;
        loop {
            tokio::select! {
                event = events.next() => match event {
                    Some(Ok(event)) => self.on_event(docker, event).await,
                    Some(Err(e)) => return (answered, e.to_string()),
                    None => return (answered, "the daemon closed it".to_owned()),
                },
                _ = reconcile.tick() => match self.reconcile(docker).await {
                    Ok(()) => answered = true,
                    Err(e) => return (answered, e.to_string()),
                },
            }
        }
    }

    fn labels(&self) -> Vec<String> {
        vec![
            "dsec.managed=true".to_owned(),
            format!("dsec.edge={}", self.edge),
        ]
    }

    async fn on_event(&self, docker: &Docker, event: EventMessage) {
        let Some(container) = event.actor.and_then(|a| a.id) else {
            return;
        };
        if !self.is_registered(&container) {
            return;
        }
        match event.action.as_deref() {
            Some("destroy") => self.mark_dead(&container),
            _ => self.check(docker, &container).await,
        }
    }

    /// Marks the container dead unless the daemon says it runs (paused counts as running).
    async fn check(&self, docker: &Docker, container: &str) {
        match docker.inspect_container(container, None).await {
            Ok(c) if c.state.as_ref().and_then(|s| s.running) == Some(true) => {}
            Ok(_) => self.mark_dead(container),
            Err(e) => {
                // Gone (404) or a daemon that fails: either way the container is no more.
                tracing::debug!(container, status = ?status(&e), error = %e, "inspect");
                self.mark_dead(container);
            }
        }
    }

    /// Checks each registered container that a listing of this server's does not show
    /// running. The registered ones are taken before the listing: one registered after it
    /// was started after this subscription's `since`, so its end is an event.
    async fn reconcile(&self, docker: &Docker) -> Result<(), DockerError> {
        let registered = self.registered();
        let filters = HashMap::from([("label", self.labels())]);
        let opts = ListContainersOptionsBuilder::new()
            .all(true)
            .filters(&filters)
            .build();
        let running: HashSet<String> = docker
            .list_containers(Some(opts))
            .await?
            .into_iter()
            .filter(|c| {
                matches!(
                    c.state,
                    Some(
                        ContainerSummaryStateEnum::RUNNING
                            | ContainerSummaryStateEnum::PAUSED
                            | ContainerSummaryStateEnum::RESTARTING
                    )
                )
            })
            .filter_map(|c| c.id)
            .collect();
        for container in registered {
            if !running.contains(&container) && self.is_registered(&container) {
                self.check(docker, &container).await;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client of a daemon that is not there: its socket is, but nothing listens on it
    /// (as after dockerd died), so each connection is refused. Keep the directory.
    fn absent_daemon() -> (tempfile::TempDir, Docker) {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("docker.sock");
        drop(std::os::unix::net::UnixListener::bind(&socket).expect("bind"));
        let docker = Docker::connect_with_unix(
            socket.to_str().expect("utf-8"),
            5,
            bollard::API_DEFAULT_VERSION,
        )
        .expect("client");
        (dir, docker)
    }

    fn following(liveness: &Liveness) -> bool {
        liveness.registry.lock().expect("lock").following
    }

    #[tokio::test(start_paused = true)]
    async fn a_daemon_that_does_not_answer_has_its_sandboxes_marked_dead() {
        let liveness = Liveness::new("test".to_owned());
        let (_dir, docker) = absent_daemon();
        let alive = [
            liveness.register(&docker, "a"),
            liveness.register(&docker, "b"),
        ];
        tokio::time::sleep(DAEMON_GONE / 2).await;
        assert!(alive.iter().all(Alive::get), "dead before {DAEMON_GONE:?}");
        tokio::time::sleep(DAEMON_GONE).await;
        assert!(!alive.iter().any(Alive::get));
        assert!(!following(&liveness), "the task outlived its containers");
    }

    #[tokio::test(start_paused = true)]
    async fn the_task_ends_with_the_last_registration_and_the_next_starts_one() {
        let liveness = Liveness::new("test".to_owned());
        let (_dir, docker) = absent_daemon();
        let first = liveness.register(&docker, "a");
        let second = liveness.register(&docker, "b");
        second.end();
        assert!(!second.get() && first.get());
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(following(&liveness));
        drop(first);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(!following(&liveness));
        let again = liveness.register(&docker, "c");
        assert!(following(&liveness) && again.get());
    }
}
