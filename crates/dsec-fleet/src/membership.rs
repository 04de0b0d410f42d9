//! Membership in etcd: the edge's side (register with a lease, keep it alive, publish the
//! load, leave) and the apiserver's (watch the prefix into memory).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dsec_server::edge::{Edge, EdgeLoad};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, Txn, TxnOp, WatchOptions,
};
use serde::{Deserialize, Serialize};

use crate::EDGE_PREFIX;

/// Why the fleet could not be joined or watched.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    /// No etcd answered.
    #[error("etcd at {endpoints} is unreachable: {reason} (check --etcd: comma-separated URLs such as http://127.0.0.1:2379)")]
    Unreachable {
        /// The endpoints tried.
        endpoints: String,
        /// What failed.
        reason: String,
    },
    /// Another edge holds the name.
    #[error("edge name {name:?} is already in use by the edge at {url}; choose another --name (a stopped edge's name is free once its lease expires, within {ttl_s} s)")]
    NameInUse {
        /// The name.
        name: String,
        /// The holder's address.
        url: String,
        /// The lease TTL.
        ttl_s: i64,
    },
    /// The name cannot prefix sandbox ids.
    #[error("edge name {0:?} must be 1 to 63 letters, digits, '-', '_' or '.', starting with a letter or digit")]
    BadName(String),
    /// etcd refused a request (boxed: etcd's error is large, and rare).
    #[error("etcd: {0}")]
    Etcd(Box<etcd_client::Error>),
}

impl From<etcd_client::Error> for FleetError {
    fn from(e: etcd_client::Error) -> FleetError {
        FleetError::Etcd(Box::new(e))
    }
}

/// What an edge publishes under `/dsec/edges/<name>`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EdgeRecord {
    /// The edge's name: the prefix of its sandbox ids.
    pub name: String,
    /// Where apiservers reach its API.
    pub url: String,
    /// Serving: false between registration and the API listening.
    pub ready: bool,
    /// Its load when published.
    pub load: EdgeLoad,
    /// When published, seconds since the Unix epoch.
    pub updated_at: f64,
    /// Its E2B listeners, where it serves them (`--e2b-listen`, `--e2b-envd-listen`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2b: Option<EdgeE2b>,
}

/// Where an edge serves E2B's API, for apiservers to forward the e2b SDK's requests to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EdgeE2b {
    /// Its control plane (`--e2b-listen`), as a URL.
    pub api_url: String,
    /// Its envd endpoint (`--e2b-envd-listen`), as a URL.
    pub envd_url: String,
    /// The backend of its templates that name none (`--e2b-backend`).
    pub backend: String,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A local copy of what etcd holds under a prefix, kept current by a watch.
pub(crate) trait Mirror: Send + Sync + 'static {
    /// What is copied, for the log.
    const WHAT: &'static str;
    /// Reads the whole prefix into the copy; returns the revision to watch from.
    fn load(&self, client: &mut Client) -> impl Future<Output = Result<i64, FleetError>> + Send;
    /// Applies the prefix's changes after `revision` until the watch ends.
    fn follow(
        &self,
        client: Client,
        revision: i64,
    ) -> impl Future<Output = Result<(), FleetError>> + Send;
}

/// Keeps `mirror` current in the background from `revision` on, reconnecting to
/// `endpoints` and reloading it whenever the watch breaks (meanwhile the copy it has is
/// what is used).
pub(crate) fn follow_forever<M: Mirror>(
    mirror: Arc<M>,
    endpoints: Vec<String>,
    client: Client,
    revision: i64,
) {
    tokio::spawn(async move {
        let mut next = Some((client, revision));
        loop {
            if let Some((client, revision)) = next.take() {
                if let Err(e) = mirror.follow(client, revision).await {
                    tracing::warn!(error = %e, "etcd: the watch on {} broke; reconnecting", M::WHAT);
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            let reconnected = async {
                let mut client = connect(&endpoints).await?;
                let revision = mirror.load(&mut client).await?;
                Ok::<_, FleetError>((client, revision))
            };
            match reconnected.await {
                Ok(c) => next = Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "etcd: still unreachable; using the copy of {} kept so far", M::WHAT)
                }
            }
        }
    });
}

/// Connects to etcd and checks that it answers, so that a wrong URL fails at start.
pub async fn connect(endpoints: &[String]) -> Result<Client, FleetError> {
    let unreachable = |reason: String| FleetError::Unreachable {
        endpoints: endpoints.join(","),
        reason,
    };
    if endpoints.is_empty() {
        return Err(unreachable("no endpoints given".into()));
    }
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(3))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
    let attempt = async {
        let mut client = Client::connect(endpoints, Some(options)).await?;
        client.status().await?;
        Ok::<_, etcd_client::Error>(client)
    };
    match tokio::time::timeout(Duration::from_secs(5), attempt).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(unreachable(e.to_string())),
        Err(_) => Err(unreachable("no answer within 5 s".into())),
    }
}

/// The edge's membership: `dsec edge` hands it to [`dsec_server::run_with`].
pub struct EdgeMembership {
    endpoints: Vec<String>,
    name: String,
    url: String,
    ttl_s: i64,
    e2b: Option<EdgeE2b>,
    joined: Mutex<Option<(Client, i64)>>,
}

/// How often the load is published.
const PUBLISH_EVERY: Duration = Duration::from_millis(500);

impl EdgeMembership {
    /// A membership for edge `name`, reached at `url`, with a lease of `ttl_s` seconds.
    pub fn new(endpoints: Vec<String>, name: String, url: String, ttl_s: i64) -> EdgeMembership {
        EdgeMembership {
            endpoints,
            name,
            url,
            ttl_s,
            e2b: None,
            joined: Mutex::new(None),
        }
    }

    /// Publishes the edge's E2B listeners too.
    pub fn with_e2b(mut self, e2b: EdgeE2b) -> EdgeMembership {
        self.e2b = Some(e2b);
        self
    }

    fn key(&self) -> String {
        format!("{EDGE_PREFIX}{}", self.name)
    }

    fn record(&self, ready: bool, load: EdgeLoad) -> Vec<u8> {
        let record = EdgeRecord {
            name: self.name.clone(),
            url: self.url.clone(),
            ready,
            load,
            updated_at: unix_now(),
            e2b: self.e2b.clone(),
        };
        serde_json::to_vec(&record).expect("records serialize")
    }

    /// Registers the name under a new lease with the record `ready` and `load` (an edge
    /// that rejoins while serving is ready at once: lists and placement need not wait
    /// for its next publication), unless another edge holds it.
    async fn register(&self, ready: bool, load: EdgeLoad) -> Result<(Client, i64), FleetError> {
        crate::check_edge_name(&self.name)?;
        let mut client = connect(&self.endpoints).await?;
        let lease = client.lease_grant(self.ttl_s, None).await?.id();
        let key = self.key();
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.clone(),
                self.record(ready, load),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        if client.txn(txn).await?.succeeded() {
            return Ok((client, lease));
        }
        let _ = client.lease_revoke(lease).await;
        let holder = client.get(key, None).await?;
        let url = holder
            .kvs()
            .first()
            .and_then(|kv| serde_json::from_slice::<EdgeRecord>(kv.value()).ok())
            .map_or_else(|| "an unknown address".to_owned(), |r| r.url);
        Err(FleetError::NameInUse {
            name: self.name.clone(),
            url,
            ttl_s: self.ttl_s,
        })
    }

    /// Keeps the lease alive and publishes the load until `stop`; then revokes the lease.
    ///
    /// etcd may go away and come back meanwhile: a broken keep-alive stream is opened
    /// again, and a lease that expired while this edge could not reach etcd is replaced by
    /// registering anew, so the edge rejoins the fleet without a restart.
    async fn publish(
        &self,
        mut client: Client,
        mut lease: i64,
        edge: Arc<Edge>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let key = self.key();
        let keep_every =
            Duration::from_millis((u64::try_from(self.ttl_s).unwrap_or(0) * 1000 / 3).max(200));
        let mut keeper = None;
        let mut reachable = true;
        let mut publish = tokio::time::interval(PUBLISH_EVERY);
        let mut keep = tokio::time::interval(keep_every);
        loop {
            tokio::select! {
                _ = stop.changed() => break,
                _ = keep.tick() => {
                    let state = tokio::time::timeout(
                        keep_every,
                        keep_lease(&mut client, lease, &mut keeper),
                    )
                    .await
                    .unwrap_or_else(|_| Err("no answer in time".to_owned()));
                    match state {
                        Ok(LeaseState::Alive) => {
                            if !reachable {
                                tracing::info!(edge = %self.name, "etcd: reachable again; the lease held");
                            }
                            reachable = true;
                        }
                        Ok(LeaseState::Expired) => {
                            tracing::warn!(edge = %self.name, lease, "etcd: the edge's lease expired while etcd was out of reach; registering again");
                            match self.register(true, edge.load()).await {
                                Ok((c, l)) => {
                                    (client, lease, keeper, reachable) = (c, l, None, true);
                                    tracing::info!(edge = %self.name, lease, "rejoined the fleet");
                                }
                                Err(e) => tracing::error!(edge = %self.name, error = %e, "etcd: cannot rejoin the fleet; retrying"),
                            }
                        }
                        Err(why) => {
                            keeper = None;
                            if reachable {
                                tracing::warn!(edge = %self.name, error = %why, "etcd: cannot keep the edge's lease alive; sandboxes keep running, retrying");
                            }
                            reachable = false;
                        }
                    }
                }
                _ = publish.tick(), if reachable => {
                    let value = self.record(true, edge.load());
                    let put = client.put(key.clone(), value, Some(PutOptions::new().with_lease(lease)));
                    if let Err(e) = put.await {
                        tracing::debug!(error = %e, "etcd: publishing the edge's load failed");
                    }
                }
            }
        }
        match client.lease_revoke(lease).await {
            Ok(_) => tracing::info!(edge = %self.name, "left the fleet (lease revoked)"),
            Err(e) => {
                tracing::warn!(error = %e, "etcd: revoking the lease failed; it expires by itself")
            }
        }
    }
}

/// What a keep-alive found.
enum LeaseState {
    Alive,
    /// etcd answered: the lease is gone (and the edge's key with it).
    Expired,
}

/// Renews `lease` once, opening the keep-alive stream first when there is none; when the
/// stream is broken, asks etcd whether the lease still exists. `Err`: etcd is out of reach.
async fn keep_lease(
    client: &mut Client,
    lease: i64,
    keeper: &mut Option<(LeaseKeeper, LeaseKeepAliveStream)>,
) -> Result<LeaseState, String> {
    if keeper.is_none() {
        *keeper = Some(
            client
                .lease_keep_alive(lease)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let (k, responses) = keeper.as_mut().expect("opened above");
    let kept = async {
        k.keep_alive().await?;
        responses.message().await
    };
    match kept.await {
        Ok(Some(r)) if r.ttl() > 0 => return Ok(LeaseState::Alive),
        Ok(Some(_)) => return Ok(LeaseState::Expired),
        Ok(None) | Err(_) => *keeper = None,
    }
    let ttl = client
        .lease_time_to_live(lease, None)
        .await
        .map_err(|e| e.to_string())?
        .ttl();
    Ok(if ttl > 0 {
        LeaseState::Alive
    } else {
        LeaseState::Expired
    })
}

#[async_trait::async_trait]
impl dsec_server::Membership for EdgeMembership {
    fn services(&self) -> Vec<String> {
        self.endpoints.clone()
    }

    fn quotas(&self) -> Option<Arc<dyn dsec_server::projects::SharedQuotas>> {
        Some(Arc::new(crate::quotas::EtcdQuotas::new(
            self.endpoints.clone(),
            self.name.clone(),
        )))
    }

    async fn join(&self) -> Result<(), String> {
        let joined = self
            .register(false, EdgeLoad::default())
            .await
            .map_err(|e| e.to_string())?;
        tracing::info!(edge = %self.name, url = %self.url, lease_ttl_s = self.ttl_s, "joined the fleet");
        *self.joined.lock().expect("lock") = Some(joined);
        Ok(())
    }

    async fn serve(&self, edge: Arc<Edge>, stop: tokio::sync::watch::Receiver<bool>) {
        let Some((client, lease)) = self.joined.lock().expect("lock").take() else {
            return;
        };
        self.publish(client, lease, edge, stop).await;
    }
}

/// How long an apiserver still asks an edge whose record left etcd for its sandboxes
/// (it never places new ones there): a lease that lapsed because etcd stalled, or because
/// a busy edge missed its keep-alives, must not hide a live edge's sandboxes from lists
/// and requests until it registers again. An edge that stopped does not answer, and a
/// request for its sandbox fails at once, saying it left.
pub const LAPSE_GRACE: Duration = Duration::from_secs(30);

/// A live edge as an apiserver keeps it.
#[derive(Debug)]
pub struct Member {
    /// What the edge last published.
    pub record: EdgeRecord,
    /// Sandboxes this apiserver placed there since that record: the published load is up
    /// to half a second old, and placement must not pile onto one edge meanwhile.
    pub placed: AtomicU64,
    /// Its record left etcd, less than [`LAPSE_GRACE`] ago: this is its last record.
    pub lapsed: bool,
}

impl Member {
    fn new(record: EdgeRecord) -> Arc<Member> {
        Arc::new(Member {
            record,
            placed: AtomicU64::new(0),
            lapsed: false,
        })
    }

    /// Lower is less loaded: the published score plus what was placed since.
    pub fn score(&self) -> f64 {
        self.record
            .load
            .score_with(self.placed.load(Ordering::Relaxed))
    }

    /// Whether it serves E2B's API and runs `backend` there (`None`: the backend of its
    /// templates that name none).
    pub fn offers_e2b(&self, backend: Option<&str>) -> bool {
        self.record
            .e2b
            .as_ref()
            .is_some_and(|e| self.offers(backend.unwrap_or(&e.backend)))
    }

    /// Whether it serves and runs `backend`.
    pub fn offers(&self, backend: &str) -> bool {
        self.record.ready && self.record.load.backends.iter().any(|b| b == backend)
    }
}

/// The live edges, in name order.
#[derive(Debug, Default)]
pub struct Members {
    /// The edges.
    pub list: Vec<Arc<Member>>,
    index: HashMap<String, usize>,
}

impl Members {
    /// Builds the table from records.
    pub fn new(records: impl IntoIterator<Item = EdgeRecord>) -> Members {
        Members::of(records.into_iter().map(Member::new).collect())
    }

    fn of(mut list: Vec<Arc<Member>>) -> Members {
        list.sort_by(|a, b| a.record.name.cmp(&b.record.name));
        let index = list
            .iter()
            .enumerate()
            .map(|(i, m)| (m.record.name.clone(), i))
            .collect();
        Members { list, index }
    }

    /// The edge called `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<Member>> {
        self.index.get(name).map(|&i| &self.list[i])
    }
}

/// The apiserver's view of the fleet, kept current by a watch on the prefix: no etcd
/// round trip on a request's path.
#[derive(Default)]
pub struct EdgeTable {
    members: RwLock<Arc<Members>>,
    /// Edges whose record left etcd lately, as last seen, and since when: asked for their
    /// sandboxes for [`LAPSE_GRACE`].
    lapsed: Mutex<HashMap<String, (Arc<Member>, Instant)>>,
    /// Edges that left while this apiserver watched, so errors can say so.
    departed: Mutex<HashSet<String>>,
    /// The etcd endpoints, for messages.
    pub endpoints: String,
}

impl EdgeTable {
    /// The live edges now.
    pub fn members(&self) -> Arc<Members> {
        Arc::clone(&self.members.read().expect("lock"))
    }

    /// Whether `name` was seen leaving.
    pub fn departed(&self, name: &str) -> bool {
        self.departed.lock().expect("lock").contains(name)
    }

    /// The edges whose record left etcd less than [`LAPSE_GRACE`] ago, in name order:
    /// still asked for their sandboxes, never given new ones.
    pub fn lapsed(&self) -> Vec<Arc<Member>> {
        let mut lapsed = self.lapsed.lock().expect("lock");
        lapsed.retain(|_, (_, since)| since.elapsed() < LAPSE_GRACE);
        let mut list: Vec<Arc<Member>> = lapsed.values().map(|(m, _)| Arc::clone(m)).collect();
        list.sort_by(|a, b| a.record.name.cmp(&b.record.name));
        list
    }

    /// The edge `name` if it lapsed less than [`LAPSE_GRACE`] ago.
    pub fn lapsed_member(&self, name: &str) -> Option<Arc<Member>> {
        let lapsed = self.lapsed.lock().expect("lock");
        let (member, since) = lapsed.get(name)?;
        (since.elapsed() < LAPSE_GRACE).then(|| Arc::clone(member))
    }

    /// Stops asking the lapsed edge `name`: it did not answer, so it is gone rather than
    /// cut off from etcd, and later requests need not wait on it again.
    pub fn forget_lapsed(&self, name: &str) {
        if self.lapsed.lock().expect("lock").remove(name).is_some() {
            tracing::info!(edge = %name, "an edge whose lease lapsed does not answer: forgotten");
        }
    }

    /// A table holding `records` (tests and benchmarks).
    pub fn fixed(records: impl IntoIterator<Item = EdgeRecord>) -> EdgeTable {
        EdgeTable {
            members: RwLock::new(Arc::new(Members::new(records))),
            ..Default::default()
        }
    }

    /// Applies what a watch reported: records put (an edge joined or published its load:
    /// its placed count starts again from zero) and edges deleted (left the fleet).
    pub fn apply(&self, upserts: Vec<EdgeRecord>, deletes: Vec<String>) {
        let mut members = self.members.write().expect("lock");
        let mut records: HashMap<String, Arc<Member>> = members
            .list
            .iter()
            .map(|m| (m.record.name.clone(), Arc::clone(m)))
            .collect();
        let mut departed = self.departed.lock().expect("lock");
        let mut lapsed = self.lapsed.lock().expect("lock");
        for name in deletes {
            if let Some(gone) = records.remove(&name) {
                tracing::info!(edge = %name, "edge left the fleet");
                let last = Arc::new(Member {
                    record: gone.record.clone(),
                    placed: AtomicU64::new(0),
                    lapsed: true,
                });
                lapsed.insert(name.clone(), (last, Instant::now()));
            }
            departed.insert(name);
        }
        for record in upserts {
            departed.remove(&record.name);
            lapsed.remove(&record.name);
            if !records.contains_key(&record.name) {
                tracing::info!(edge = %record.name, url = %record.url, "edge joined the fleet");
            }
            records.insert(record.name.clone(), Member::new(record));
        }
        *members = Arc::new(Members::of(records.into_values().collect()));
        metrics::gauge!("dsec_fleet_edges").set(members.list.len() as f64);
    }

    fn replace(&self, records: Vec<EdgeRecord>) {
        let names: HashSet<String> = records.iter().map(|r| r.name.clone()).collect();
        let gone: Vec<String> = self
            .members()
            .list
            .iter()
            .map(|m| m.record.name.clone())
            .filter(|n| !names.contains(n))
            .collect();
        self.apply(records, gone);
    }

    /// Connects (failing at once if etcd does not answer), loads the table, and keeps it
    /// current in the background, reconnecting when the watch breaks (the table kept
    /// meanwhile is the cached membership).
    pub async fn watch(endpoints: Vec<String>) -> Result<Arc<EdgeTable>, FleetError> {
        let mut client = connect(&endpoints).await?;
        let table = Arc::new(EdgeTable {
            endpoints: endpoints.join(","),
            ..Default::default()
        });
        let revision = table.load(&mut client).await?;
        follow_forever(Arc::clone(&table), endpoints, client, revision);
        Ok(table)
    }
}

impl Mirror for EdgeTable {
    const WHAT: &'static str = "the edges";

    async fn load(&self, client: &mut Client) -> Result<i64, FleetError> {
        let resp = client
            .get(EDGE_PREFIX, Some(GetOptions::new().with_prefix()))
            .await?;
        let records = resp
            .kvs()
            .iter()
            .filter_map(|kv| serde_json::from_slice(kv.value()).ok())
            .collect();
        self.replace(records);
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    async fn follow(&self, mut client: Client, revision: i64) -> Result<(), FleetError> {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let (_watcher, mut stream) = client.watch(EDGE_PREFIX, Some(options)).await?;
        while let Some(resp) = stream.message().await? {
            if resp.canceled() {
                break;
            }
            let (mut upserts, mut deletes) = (Vec::new(), Vec::new());
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                match event.event_type() {
                    EventType::Put => match serde_json::from_slice::<EdgeRecord>(kv.value()) {
                        Ok(r) => upserts.push(r),
                        Err(e) => {
                            tracing::warn!(key = %String::from_utf8_lossy(kv.key()), error = %e, "ignoring an edge record that does not parse")
                        }
                    },
                    EventType::Delete => {
                        let key = String::from_utf8_lossy(kv.key());
                        if let Some(name) = key.strip_prefix(EDGE_PREFIX) {
                            deletes.push(name.to_owned());
                        }
                    }
                }
            }
            self.apply(upserts, deletes);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(e2b: Option<EdgeE2b>) -> EdgeRecord {
        EdgeRecord {
            name: "e1".into(),
            url: "http://127.0.0.1:7700".into(),
            ready: true,
            load: EdgeLoad {
                backends: vec!["container".into(), "docker".into()],
                ..Default::default()
            },
            updated_at: 0.0,
            e2b,
        }
    }

    #[test]
    fn an_edge_that_left_is_kept_as_lapsed_until_it_returns() {
        let table = EdgeTable::fixed([record(None)]);
        table.apply(Vec::new(), vec!["e1".into()]);
        assert!(table.members().get("e1").is_none() && table.departed("e1"));
        let lapsed = table.lapsed();
        assert_eq!(lapsed.len(), 1);
        assert!(lapsed[0].lapsed && lapsed[0].record.url == "http://127.0.0.1:7700");
        assert!(table.lapsed_member("e1").is_some() && table.lapsed_member("e2").is_none());
        table.apply(vec![record(None)], Vec::new());
        assert!(table.lapsed().is_empty() && !table.departed("e1"));
        assert!(!table.members().get("e1").unwrap().lapsed);
        // One that lapsed and then did not answer is forgotten; it still departed.
        table.apply(Vec::new(), vec!["e1".into()]);
        table.forget_lapsed("e1");
        assert!(table.lapsed().is_empty() && table.departed("e1"));
    }

    #[test]
    fn edges_offer_e2b_only_where_they_serve_it() {
        let plain = Member::new(record(None));
        assert!(!plain.offers_e2b(None) && !plain.offers_e2b(Some("container")));
        let e2b = Member::new(record(Some(EdgeE2b {
            api_url: "http://127.0.0.1:3000".into(),
            envd_url: "http://127.0.0.1:49983".into(),
            backend: "docker".into(),
        })));
        assert!(e2b.offers_e2b(None) && e2b.offers_e2b(Some("container")));
        assert!(!e2b.offers_e2b(Some("vm")));
        // A record from an edge that knows no E2B field still parses.
        let mut old = serde_json::to_value(record(None)).unwrap();
        assert!(old.get("e2b").is_none());
        old.as_object_mut().unwrap().remove("e2b");
        let parsed: EdgeRecord = serde_json::from_value(old).unwrap();
        assert_eq!(parsed.e2b, None);
    }
}
