//! Projects: who a bearer token speaks for, and what that project may hold.
//!
//! The server's own token (`--token-file`) is the admin's: it sees every sandbox and
//! manages projects. Each project token sees only its project's sandboxes, images, logs
//! and events. Tokens are 256 random bits shown once; the store keeps their SHA-256 only.
//! A slow KDF (bcrypt, argon2) exists to protect low-entropy passwords from guessing; a
//! 256-bit random token cannot be guessed from its hash, so a fast hash loses nothing and
//! keeps every request's check cheap.
//!
//! The store is one JSON file in the state directory, replaced atomically (written to a
//! temporary file, synced, renamed) on every change.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use dsec_api::{ErrorKind, ProjectUsage, Quotas};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// Whose request this is.
#[derive(Clone, Debug, PartialEq)]
pub enum Caller {
    /// The server's token (or no token required): sees and manages everything.
    Admin,
    /// A project's token; its quotas as they were when the request came.
    Project {
        /// The project.
        name: Arc<str>,
        /// What its sandboxes may hold together.
        quotas: Quotas,
    },
}

impl Caller {
    /// The project that owns what this caller makes (`None`: the admin's, shared).
    pub fn project(&self) -> Option<&Arc<str>> {
        match self {
            Caller::Admin => None,
            Caller::Project { name, .. } => Some(name),
        }
    }

    /// Whether this caller may see something owned by `owner`.
    pub fn sees(&self, owner: Option<&str>) -> bool {
        match self {
            Caller::Admin => true,
            Caller::Project { name, .. } => owner == Some(&**name),
        }
    }

    /// The [`ACTING_FOR`] header value an apiserver forwards a project's request with
    /// (`None`: the admin's, forwarded as is).
    pub fn acting_for(&self) -> Option<String> {
        match self {
            Caller::Admin => None,
            Caller::Project { name, quotas } => Some(
                serde_json::to_string(&ActingFor {
                    name: name.to_string(),
                    quotas: *quotas,
                })
                .expect("a project serializes"),
            ),
        }
    }

    /// The project an [`ACTING_FOR`] header names.
    pub fn from_acting_for(value: &str) -> Result<Caller, ApiError> {
        let acting: ActingFor = serde_json::from_str(value).map_err(|e| {
            ApiError::invalid(format!(
                "header {ACTING_FOR} must be {{\"name\": ..., \"quotas\": {{...}}}}: {e}"
            ))
        })?;
        check_name(&acting.name)?;
        Ok(Caller::Project {
            name: Arc::from(acting.name),
            quotas: acting.quotas,
        })
    }

    /// Whom a request of the admin speaks for: the admin, or the project its
    /// [`ACTING_FOR`] header names (a fleet apiserver forwarding a project's request).
    pub fn admin_acting(headers: &axum::http::HeaderMap) -> Result<Caller, ApiError> {
        match headers.get(ACTING_FOR) {
            None => Ok(Caller::Admin),
            Some(v) => Caller::from_acting_for(v.to_str().unwrap_or_default()),
        }
    }

    /// Refuses a project token on an admin's route.
    pub fn require_admin(&self, what: &str) -> Result<(), ApiError> {
        match self {
            Caller::Admin => Ok(()),
            Caller::Project { name, .. } => Err(ApiError::new(
                ErrorKind::Unauthorized,
                format!("{what} needs the server's admin token; this token is project {name:?}'s"),
            )),
        }
    }
}

/// The header a fleet apiserver forwards a project's request to an edge with: the
/// project's name and quotas, as JSON. The apiserver authenticates project tokens (the
/// projects live in etcd, shared by every apiserver) and reaches edges with their admin
/// token; an edge heeds the header only from its admin, so a project cannot pose as
/// another, and then serves the request as that project's.
pub const ACTING_FOR: &str = "x-dsec-project";

#[derive(Serialize, Deserialize)]
struct ActingFor {
    name: String,
    quotas: Quotas,
}

/// What is kept of one project: in `projects.json`, or in a fleet's etcd.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Project {
    /// What its sandboxes may hold together.
    pub quotas: Quotas,
    /// Hex SHA-256 of each of its tokens.
    pub token_hashes: Vec<String>,
}

impl Project {
    /// A new project with one new token, returned beside it.
    pub fn new(name: &str, quotas: Quotas) -> Result<(Project, String), ApiError> {
        check_name(name)?;
        check_quotas(&quotas)?;
        let token = new_token();
        let project = Project {
            quotas,
            token_hashes: vec![hash(&token)],
        };
        Ok((project, token))
    }

    /// Adds a new token, returned.
    pub fn add_token(&mut self) -> String {
        let token = new_token();
        self.token_hashes.push(hash(&token));
        token
    }

    /// How many tokens it has.
    pub fn tokens(&self) -> u64 {
        u64::try_from(self.token_hashes.len()).unwrap_or(u64::MAX)
    }
}

/// The project of `projects` whose token `token` is, if any. Every stored hash is
/// compared, in constant time, so timing tells nothing about which matched.
pub fn authenticate<'a>(
    projects: impl IntoIterator<Item = (&'a String, &'a Project)>,
    token: &str,
) -> Option<Caller> {
    let given = hash(token);
    let mut found = None;
    for (name, project) in projects {
        for stored in &project.token_hashes {
            if crate::api::constant_time_eq(stored.as_bytes(), given.as_bytes()) {
                found = Some(Caller::Project {
                    name: Arc::from(name.as_str()),
                    quotas: project.quotas,
                });
            }
        }
    }
    found
}

/// The error for a project that does not exist.
pub fn unknown(name: &str) -> ApiError {
    ApiError::not_found(format!("project {name:?} not found"))
}

/// The error for a project name that exists.
pub fn exists(name: &str) -> ApiError {
    ApiError::conflict(format!(
        "project {name:?} already exists: delete it first, or add a token with \
         POST /v1/projects/{name}/tokens"
    ))
}

/// The projects, persisted in `projects.json`.
pub struct Projects {
    path: PathBuf,
    projects: Mutex<BTreeMap<String, Project>>,
}

fn hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

fn check_name(name: &str) -> Result<(), ApiError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && name.as_bytes()[0].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "project name must be 1 to 64 characters of a-z, 0-9, '-' and '_', starting with \
             a letter or digit, got {name:?}"
        )))
    }
}

fn check_quotas(q: &Quotas) -> Result<(), ApiError> {
    if let Some(c) = q.max_cpus {
        if !c.is_finite() || c < 0.0 {
            return Err(ApiError::invalid(format!(
                "max_cpus must be a non-negative number, got {c}"
            )));
        }
    }
    Ok(())
}

impl Projects {
    /// The store at `state_dir/projects.json` (empty if absent).
    pub fn open(state_dir: &std::path::Path) -> std::io::Result<Projects> {
        let path = state_dir.join("projects.json");
        let projects = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} is not a projects file: {e}", path.display()),
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => return Err(e),
        };
        Ok(Projects {
            path,
            projects: Mutex::new(projects),
        })
    }

    fn save(&self, projects: &BTreeMap<String, Project>) -> Result<(), ApiError> {
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let tmp = self.path.with_extension("json.tmp");
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(&serde_json::to_vec_pretty(projects)?)?;
            file.sync_all()?;
            std::fs::rename(&tmp, &self.path)
        };
        write()
            .map_err(|e| ApiError::internal(format!("cannot write {}: {e}", self.path.display())))
    }

    /// The project whose token `token` is, if any (see [`authenticate`]).
    pub fn authenticate(&self, token: &str) -> Option<Caller> {
        authenticate(self.projects.lock().expect("lock").iter(), token)
    }

    /// Makes project `name`, returning its first token.
    pub fn create(&self, name: &str, quotas: Quotas) -> Result<String, ApiError> {
        let (project, token) = Project::new(name, quotas)?;
        let mut projects = self.projects.lock().expect("lock");
        if projects.contains_key(name) {
            return Err(exists(name));
        }
        let mut next = projects.clone();
        next.insert(name.to_owned(), project);
        self.save(&next)?;
        *projects = next;
        Ok(token)
    }

    /// Adds a token to project `name`.
    pub fn add_token(&self, name: &str) -> Result<(String, Quotas), ApiError> {
        let mut projects = self.projects.lock().expect("lock");
        let mut next = projects.clone();
        let project = next.get_mut(name).ok_or_else(|| unknown(name))?;
        let token = project.add_token();
        let quotas = project.quotas;
        self.save(&next)?;
        *projects = next;
        Ok((token, quotas))
    }

    /// Removes project `name` and its tokens.
    pub fn delete(&self, name: &str) -> Result<(), ApiError> {
        let mut projects = self.projects.lock().expect("lock");
        let mut next = projects.clone();
        next.remove(name).ok_or_else(|| unknown(name))?;
        self.save(&next)?;
        *projects = next;
        Ok(())
    }

    /// Every project: name, quotas, how many tokens.
    pub fn list(&self) -> Vec<(String, Quotas, u64)> {
        let projects = self.projects.lock().expect("lock");
        projects
            .iter()
            .map(|(n, p)| (n.clone(), p.quotas, p.tokens()))
            .collect()
    }
}

/// `dsecp_` and 256 random bits in hex.
fn new_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("dsecp_{}", hex::encode(bytes))
}

/// What each project's sandboxes hold, reserved before a create starts so that
/// concurrent creates cannot together pass a quota. Clones share it.
#[derive(Clone, Default)]
pub struct Usage {
    held: Arc<Mutex<HashMap<Arc<str>, ProjectUsage>>>,
}

impl Usage {
    /// What each project holding something holds now.
    pub fn all(&self) -> Vec<(Arc<str>, ProjectUsage)> {
        let held = self.held.lock().expect("lock");
        held.iter().map(|(p, u)| (Arc::clone(p), *u)).collect()
    }

    /// Reserves one sandbox of `cpus` and `memory_mb` for `project`, or refuses naming
    /// the quota it would pass, its limit and the use now.
    pub fn reserve(
        &self,
        project: &Arc<str>,
        quotas: &Quotas,
        cpus: f64,
        memory_mb: u64,
    ) -> Result<QuotaHold, ApiError> {
        let mut held = self.held.lock().expect("lock");
        let now = held.get(project).copied().unwrap_or_default();
        admit(project, quotas, now, cpus, memory_mb, "")?;
        let entry = held.entry(Arc::clone(project)).or_default();
        entry.sandboxes += 1;
        entry.cpus += cpus;
        entry.memory_mb += memory_mb;
        Ok(QuotaHold {
            held: Arc::clone(&self.held),
            project: Arc::clone(project),
            cpus,
            memory_mb,
            shared: None,
        })
    }

    /// What `project` holds now.
    pub fn of(&self, project: &str) -> ProjectUsage {
        let held = self.held.lock().expect("lock");
        held.get(project).copied().unwrap_or_default()
    }
}

/// Refuses one more sandbox of `cpus` and `memory_mb` for `project` when `now` (its use,
/// `where_` it is counted: "" for this server, " over the fleet") would pass a quota,
/// naming the quota, its limit and the use.
pub fn admit(
    project: &str,
    quotas: &Quotas,
    now: ProjectUsage,
    cpus: f64,
    memory_mb: u64,
    where_: &str,
) -> Result<(), ApiError> {
    let refuse = |quota: &str, limit: String, used: String, asked: String| {
        Err(ApiError::new(
            ErrorKind::QuotaExceeded,
            format!(
                "project {project:?} is at its {quota} quota: limit {limit}, in use{where_} \
                 {used}, this sandbox asks {asked}; stop some of its sandboxes or raise the quota"
            ),
        ))
    };
    if let Some(max) = quotas.max_sandboxes {
        if now.sandboxes + 1 > max {
            return refuse(
                "max_sandboxes",
                max.to_string(),
                now.sandboxes.to_string(),
                "1".into(),
            );
        }
    }
    if let Some(max) = quotas.max_cpus {
        // A small tolerance: sums of decimal fractions are not exact in binary.
        if now.cpus + cpus > max + 1e-9 {
            return refuse(
                "max_cpus",
                max.to_string(),
                now.cpus.to_string(),
                cpus.to_string(),
            );
        }
    }
    if let Some(max) = quotas.max_memory_mb {
        if now.memory_mb + memory_mb > max {
            return refuse(
                "max_memory_mb",
                format!("{max} MB"),
                format!("{} MB", now.memory_mb),
                format!("{memory_mb} MB"),
            );
        }
    }
    Ok(())
}

/// Quotas that the edges of a fleet enforce together: what a project holds on every edge
/// counts, not only on this one (a fleet's etcd: `dsec_fleet::quotas`).
#[async_trait::async_trait]
pub trait SharedQuotas: Send + Sync {
    /// Publishes this edge's use of `project` as `here` holds it now (one more sandbox of
    /// `cpus` and `memory_mb` already in it), unless the fleet's sum would then pass
    /// `quotas` (`QuotaExceeded`, naming it).
    async fn reserve(
        &self,
        project: &str,
        quotas: &Quotas,
        here: &Usage,
        cpus: f64,
        memory_mb: u64,
    ) -> Result<(), ApiError>;
    /// Publishes this edge's use of `project` as `here` holds it now, after a sandbox
    /// gave its share back.
    async fn release(&self, project: &str, here: &Usage);
}

/// One sandbox's share of its project's quotas, given back when dropped.
pub struct QuotaHold {
    held: Arc<Mutex<HashMap<Arc<str>, ProjectUsage>>>,
    project: Arc<str>,
    cpus: f64,
    memory_mb: u64,
    /// The fleet's quotas it counts in too, told when it is given back.
    shared: Option<Arc<dyn SharedQuotas>>,
}

impl QuotaHold {
    /// Counts the hold in the fleet's quotas too (it is there already: see
    /// [`SharedQuotas::reserve`]), so that giving it back tells them.
    pub fn share(&mut self, shared: Arc<dyn SharedQuotas>) {
        self.shared = Some(shared);
    }
}

impl Drop for QuotaHold {
    fn drop(&mut self) {
        {
            let mut held = self.held.lock().expect("lock");
            if let Some(u) = held.get_mut(&self.project) {
                u.sandboxes = u.sandboxes.saturating_sub(1);
                u.cpus = (u.cpus - self.cpus).max(0.0);
                u.memory_mb = u.memory_mb.saturating_sub(self.memory_mb);
                if u.sandboxes == 0 {
                    held.remove(&self.project);
                }
            }
        }
        let (Some(shared), Ok(runtime)) =
            (self.shared.take(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let (here, project) = (
            Usage {
                held: Arc::clone(&self.held),
            },
            Arc::clone(&self.project),
        );
        runtime.spawn(async move { shared.release(&project, &here).await });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_stored_hashed_and_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let projects = Projects::open(dir.path()).unwrap();
        let token = projects.create("a", Quotas::default()).unwrap();
        let stored = std::fs::read_to_string(dir.path().join("projects.json")).unwrap();
        assert!(!stored.contains(&token));
        let reopened = Projects::open(dir.path()).unwrap();
        let caller = reopened.authenticate(&token).unwrap();
        assert_eq!(caller.project().map(|p| &**p), Some("a"));
        assert_eq!(reopened.authenticate("dsecp_wrong"), None);
    }

    #[test]
    fn an_apiserver_names_the_project_it_acts_for() {
        let caller = Caller::Project {
            name: Arc::from("team-a"),
            quotas: Quotas {
                max_sandboxes: Some(2),
                ..Quotas::default()
            },
        };
        let header = caller.acting_for().unwrap();
        assert_eq!(Caller::from_acting_for(&header).unwrap(), caller);
        assert_eq!(Caller::Admin.acting_for(), None);
        let bad = Caller::from_acting_for(r#"{"name": "Bad Name", "quotas": {}}"#);
        assert!(bad.unwrap_err().message.contains("project name must be"));
        let garbled = Caller::from_acting_for("team-a").unwrap_err();
        assert!(garbled.message.contains(ACTING_FOR), "{}", garbled.message);
    }

    #[test]
    fn a_hold_counts_until_dropped() {
        let usage = Usage::default();
        let p: Arc<str> = Arc::from("p");
        let quotas = Quotas {
            max_sandboxes: Some(1),
            ..Quotas::default()
        };
        let hold = usage.reserve(&p, &quotas, 1.0, 64).unwrap();
        let refused = usage.reserve(&p, &quotas, 1.0, 64).err().unwrap();
        assert_eq!(refused.kind, ErrorKind::QuotaExceeded);
        assert!(
            refused.message.contains("max_sandboxes"),
            "{}",
            refused.message
        );
        drop(hold);
        assert_eq!(usage.of("p"), ProjectUsage::default());
        usage.reserve(&p, &quotas, 1.0, 64).unwrap();
    }
}
