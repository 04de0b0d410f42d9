//! A fleet's projects, kept in etcd under `/dsec/projects/<name>` so that every apiserver
//! shares them (an edge's own `projects.json` serves only `dsec serve` and direct callers).
//!
//! Each apiserver watches the prefix into memory, so a request's token is checked without
//! an etcd round trip; the changes (create, add a token, delete) are etcd transactions
//! that compare the key's revision, so two apiservers changing one project at once cannot
//! lose either change. The records are [`dsec_server::projects::Project`]s: quotas and
//! the SHA-256 of each token, never a token.
//!
//! An apiserver forwards a project's request to an edge with the edge's admin token and
//! the [`ACTING_FOR`](dsec_server::projects::ACTING_FOR) header naming the project: the
//! edge then scopes it and counts its quotas as a project token's request there.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use dsec_api::Quotas;
use dsec_server::error::ApiError;
use dsec_server::projects::{self, Caller, Project};
use etcd_client::{Client, Compare, CompareOp, EventType, GetOptions, Txn, TxnOp, WatchOptions};

use crate::membership::{connect, follow_forever, FleetError, Mirror};

/// The etcd prefix projects are kept under.
pub const PROJECT_PREFIX: &str = "/dsec/projects/";

fn key(name: &str) -> String {
    format!("{PROJECT_PREFIX}{name}")
}

fn etcd_error(e: impl std::fmt::Display) -> ApiError {
    ApiError::unavailable(format!("etcd: {e}; the projects cannot be changed now"))
}

/// The fleet's projects, as this apiserver last saw them in etcd.
pub struct FleetProjects {
    client: Client,
    projects: RwLock<BTreeMap<String, Project>>,
}

impl FleetProjects {
    /// Connects (failing at once if etcd does not answer), loads the projects, and keeps
    /// them current in the background, reconnecting when the watch breaks.
    pub async fn watch(endpoints: Vec<String>) -> Result<Arc<FleetProjects>, FleetError> {
        let mut client = connect(&endpoints).await?;
        let fleet = Arc::new(FleetProjects {
            client: client.clone(),
            projects: RwLock::default(),
        });
        let revision = fleet.load(&mut client).await?;
        follow_forever(Arc::clone(&fleet), endpoints, client, revision);
        Ok(fleet)
    }

    /// The project whose token `token` is, if any.
    pub fn authenticate(&self, token: &str) -> Option<Caller> {
        projects::authenticate(self.projects.read().expect("lock").iter(), token)
    }

    /// Every project, by name.
    pub fn list(&self) -> Vec<(String, Project)> {
        let projects = self.projects.read().expect("lock");
        projects
            .iter()
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect()
    }

    /// Makes project `name`, returning its first token.
    pub async fn create(&self, name: &str, quotas: Quotas) -> Result<String, ApiError> {
        let (project, token) = Project::new(name, quotas)?;
        let value = serde_json::to_vec(&project).expect("a project serializes");
        let txn = Txn::new()
            .when([Compare::version(key(name), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(key(name), value, None)]);
        let done = self.client.clone().txn(txn).await.map_err(etcd_error)?;
        if !done.succeeded() {
            return Err(projects::exists(name));
        }
        self.seen(name, Some(project));
        Ok(token)
    }

    /// Adds a token to project `name`.
    pub async fn add_token(&self, name: &str) -> Result<(String, Quotas), ApiError> {
        let mut client = self.client.clone();
        let resp = client.get(key(name), None).await.map_err(etcd_error)?;
        let kv = resp.kvs().first().ok_or_else(|| projects::unknown(name))?;
        let (_, mut project) =
            parse(kv.key(), kv.value()).ok_or_else(|| projects::unknown(name))?;
        let token = project.add_token();
        let value = serde_json::to_vec(&project).expect("a project serializes");
        let txn = Txn::new()
            .when([Compare::mod_revision(
                key(name),
                CompareOp::Equal,
                kv.mod_revision(),
            )])
            .and_then([TxnOp::put(key(name), value, None)]);
        let done = client.txn(txn).await.map_err(etcd_error)?;
        if !done.succeeded() {
            return Err(ApiError::conflict(format!(
                "project {name:?} changed while the token was added (another apiserver \
                 changed it): try again"
            )));
        }
        let quotas = project.quotas;
        self.seen(name, Some(project));
        Ok((token, quotas))
    }

    /// Removes project `name` and its tokens.
    pub async fn delete(&self, name: &str) -> Result<(), ApiError> {
        let resp = self
            .client
            .clone()
            .delete(key(name), None)
            .await
            .map_err(etcd_error)?;
        if resp.deleted() == 0 {
            return Err(projects::unknown(name));
        }
        // Its use on the edges is nothing now (it had no sandbox left): its counters go.
        let counters = format!("{}{name}/", crate::quotas::QUOTA_PREFIX);
        if let Err(e) = self
            .client
            .clone()
            .delete(
                counters,
                Some(etcd_client::DeleteOptions::new().with_prefix()),
            )
            .await
        {
            tracing::warn!(project = name, error = %e, "etcd: its quota counters stay");
        }
        self.seen(name, None);
        Ok(())
    }

    /// Applies this apiserver's own change at once (the watch brings it again).
    fn seen(&self, name: &str, project: Option<Project>) {
        let mut projects = self.projects.write().expect("lock");
        match project {
            Some(p) => projects.insert(name.to_owned(), p),
            None => projects.remove(name),
        };
    }
}

/// A project record, or `None` (logged) for one that does not parse.
fn parse(key: &[u8], value: &[u8]) -> Option<(String, Project)> {
    let key = String::from_utf8_lossy(key);
    let name = key.strip_prefix(PROJECT_PREFIX)?.to_owned();
    match serde_json::from_slice(value) {
        Ok(project) => Some((name, project)),
        Err(e) => {
            tracing::warn!(key = %key, error = %e, "ignoring a project record that does not parse");
            None
        }
    }
}

impl Mirror for FleetProjects {
    const WHAT: &'static str = "the projects";

    async fn load(&self, client: &mut Client) -> Result<i64, FleetError> {
        let resp = client
            .get(PROJECT_PREFIX, Some(GetOptions::new().with_prefix()))
            .await?;
        let mut all = BTreeMap::new();
        for kv in resp.kvs() {
            if let Some((name, project)) = parse(kv.key(), kv.value()) {
                all.insert(name, project);
            }
        }
        *self.projects.write().expect("lock") = all;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    async fn follow(&self, mut client: Client, revision: i64) -> Result<(), FleetError> {
        let options = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let (_watcher, mut stream) = client.watch(PROJECT_PREFIX, Some(options)).await?;
        while let Some(resp) = stream.message().await? {
            if resp.canceled() {
                break;
            }
            let mut projects = self.projects.write().expect("lock");
            for event in resp.events() {
                let Some(kv) = event.kv() else { continue };
                match event.event_type() {
                    EventType::Put => {
                        if let Some((name, project)) = parse(kv.key(), kv.value()) {
                            projects.insert(name, project);
                        }
                    }
                    EventType::Delete => {
                        let key = String::from_utf8_lossy(kv.key());
                        if let Some(name) = key.strip_prefix(PROJECT_PREFIX) {
                            projects.remove(name);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
