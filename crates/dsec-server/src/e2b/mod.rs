//! E2B's API on dsec, so that the e2b SDK works unmodified against a dsec server.
//!
//! Two listeners, both optional (`dsec serve --e2b-listen ADDR --e2b-envd-listen ADDR2`):
//! - [`control`]: E2B's control-plane REST API (create, connect, info, list, kill, pause,
//!   timeouts, metrics), `X-API-KEY` checked against dsec's token;
//! - [`envd`]: one envd-compatible endpoint for every sandbox, routed by the
//!   `E2b-Sandbox-Id` header: the Connect services `process.Process` and
//!   `filesystem.Filesystem` ([`connect`], [`proto`]), `/files` and `/health`.
//!
//! An E2B sandbox is a dsec sandbox: `templateID` names a dsec image (see
//! [`Template`]), `metadata` becomes its labels, `envVars` its environment. What E2B adds
//! — the mutable timeout and what happens at it, the envd access token, auto-resume —
//! lives here in [`E2b`], keyed by sandbox id; sandboxes made through dsec's own API are
//! visible too, with no E2B extras. Nothing here survives a server restart, and nothing
//! needs to: a restart stops every sandbox.

pub mod connect;
pub mod control;
pub mod envd;
mod process;
pub mod proto;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dsec_api::{CreateSandboxRequest, Network, SandboxInfo, SandboxState};
use rand::Rng;

use axum::serve::ListenerExt;

use crate::edge::Edge;
use crate::error::ApiError;
use crate::projects::{Caller, Projects};

/// The envd version dsec reports to the SDK, which enables its features by version
/// (`e2b/envd/versions.py`). 0.6.4 turns on every gate the SDK knows, so the SDK sends
/// each request as it would to E2B and dsec answers it: recursive watch (0.1.4), the
/// stdin flag (0.3.0) and closing stdin (0.5.2) on dsec's process table, octet-stream
/// uploads (0.5.7), file metadata as `user.e2b.*` extended attributes (0.6.2; refused
/// with a reason where the backend or filesystem cannot keep them), the entry in watch
/// events (0.6.3); network mounts (0.6.4) are never watched, since dsec's files API
/// serves no network filesystem. A lower version would make the SDK act as user `user`
/// by default (< 0.4.0) or blame the template for what it does not send
/// (TemplateException).
pub const ENVD_VERSION: &str = "0.6.4";

/// The sandbox id the SDK uses in debug mode (`E2B_DEBUG=true`), where it makes no
/// control-plane call.
pub const DEBUG_SANDBOX_ID: &str = "debug_sandbox_id";

/// Longest E2B timeout, as dsec's longest `ttl_s`.
const MAX_TIMEOUT_S: u64 = 30 * 86400;

/// How `dsec serve` offers the E2B API.
#[derive(Clone, Debug, Default)]
pub struct E2bConfig {
    /// The control plane's address (`--e2b-listen`).
    pub listen: Option<SocketAddr>,
    /// The envd endpoint's address (`--e2b-envd-listen`).
    pub envd_listen: Option<SocketAddr>,
    /// The backend of templates that name none (`--e2b-backend`).
    pub backend: String,
    /// The template of the sandbox that answers for `debug_sandbox_id`
    /// (`--e2b-debug-template`); `None` leaves debug mode off.
    pub debug_template: Option<String>,
}

/// A `templateID`: `IMAGE` on the default backend, or `BACKEND+IMAGE` (`+` cannot occur
/// in a dsec image name), e.g. `microvm+base`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    /// A dsec backend that keeps state: container, docker, microvm or vm.
    pub backend: String,
    /// A dsec image name (a Docker reference for `docker`).
    pub image: String,
}

impl Template {
    /// Parses a `templateID`.
    pub fn parse(template_id: &str, default_backend: &str) -> Result<Template, ApiError> {
        let (backend, image) = match template_id.split_once('+') {
            Some((backend, image)) => (backend, image),
            None => (default_backend, template_id),
        };
        if image.is_empty() {
            return Err(ApiError::invalid(
                "templateID must name a dsec image: IMAGE, or BACKEND+IMAGE such as microvm+base",
            ));
        }
        match backend {
            "container" | "docker" | "microvm" | "vm" => Ok(Template {
                backend: backend.to_owned(),
                image: image.to_owned(),
            }),
            "fncall" => Err(ApiError::invalid(
                "templateID names the fncall backend, whose calls keep no state between \
                 commands: E2B sandboxes need container, docker, microvm or vm",
            )),
            other => Err(ApiError::invalid(format!(
                "templateID {template_id:?} names backend {other:?}; use IMAGE or BACKEND+IMAGE \
                 with BACKEND one of container, docker, microvm, vm"
            ))),
        }
    }

    /// The `templateID` a sandbox reports: its image, prefixed by its backend unless that
    /// is the default.
    pub fn id_of(info: &SandboxInfo, default_backend: &str) -> String {
        if info.backend == default_backend {
            info.image.clone()
        } else {
            format!("{}+{}", info.backend, info.image)
        }
    }
}

/// What happens when an E2B sandbox's timeout passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnTimeout {
    /// Stop it (E2B's default).
    Kill,
    /// Pause it (`autoPause`).
    Pause,
}

impl OnTimeout {
    fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Kill => "kill",
            OnTimeout::Pause => "pause",
        }
    }
}

/// What E2B knows of a sandbox beyond dsec's [`SandboxInfo`].
#[derive(Clone, Debug)]
struct Record {
    /// The `templateID` it was created with.
    template_id: String,
    /// `X-Access-Token` its envd requests must carry.
    access_token: String,
    /// The timeout it was created with, which resuming it starts again.
    timeout_s: u64,
    /// When its timeout passes (Unix seconds); `None` while paused: a paused sandbox waits
    /// for `connect` (or an envd request, with auto-resume), as E2B's do.
    end_at: Option<f64>,
    on_timeout: OnTimeout,
    /// envd requests resume it when paused.
    auto_resume: bool,
    /// What the create request said of internet access.
    allow_internet_access: Option<bool>,
}

/// A sandbox as the E2B API sees it.
#[derive(Clone, Debug)]
pub struct E2bSandbox {
    /// dsec's view.
    pub info: SandboxInfo,
    /// Its `templateID`.
    pub template_id: String,
    /// The token its envd requests must carry; `None` for sandboxes not made through E2B,
    /// which take dsec's own token instead.
    pub access_token: Option<String>,
    /// When its timeout passes (Unix seconds); `None`: never (a dsec sandbox without TTL).
    pub end_at: Option<f64>,
    /// What happens then.
    pub on_timeout: OnTimeout,
    /// Whether envd requests resume it when paused.
    pub auto_resume: bool,
    /// What the create request said of internet access.
    pub allow_internet_access: Option<bool>,
}

impl E2bSandbox {
    /// Whether E2B calls it paused (anything else it calls running).
    pub fn paused(&self) -> bool {
        self.info.state == SandboxState::Paused
    }
}

/// The E2B front end's state, shared by both listeners.
pub struct E2b {
    edge: Arc<Edge>,
    config: E2bConfig,
    /// dsec's bearer token: the API key clients must present, when the server has one.
    token: Option<Arc<str>>,
    /// Project tokens are API keys too, each seeing its project's sandboxes only.
    projects: Arc<Projects>,
    /// Largest request body (uploads).
    max_upload_bytes: usize,
    records: Mutex<HashMap<String, Record>>,
    /// The sandbox answering for [`DEBUG_SANDBOX_ID`], once made.
    debug_sandbox: tokio::sync::Mutex<Option<String>>,
    /// envd's polling watchers.
    watchers: envd::Watchers,
    /// What envd's `List` reports of the processes started through it.
    process_configs: process::Configs,
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A fresh secret: 256 random bits in hex.
fn new_token() -> String {
    let mut rng = rand::rng();
    format!("{:032x}{:032x}", rng.random::<u128>(), rng.random::<u128>())
}

/// Checks an E2B timeout in seconds.
fn check_timeout(timeout: i64) -> Result<u64, ApiError> {
    u64::try_from(timeout)
        .ok()
        .filter(|t| (1..=MAX_TIMEOUT_S).contains(t))
        .ok_or_else(|| {
            ApiError::invalid(format!(
                "timeout must be 1 to {MAX_TIMEOUT_S} seconds, got {timeout}"
            ))
        })
}

/// A create, as the control plane has validated it.
pub struct NewSandbox {
    /// The `templateID`.
    pub template_id: String,
    /// Seconds until its timeout.
    pub timeout_s: i64,
    /// What happens at its timeout.
    pub on_timeout: OnTimeout,
    /// Whether envd requests resume it when paused.
    pub auto_resume: bool,
    /// dsec's request for it.
    pub request: dsec_api::CreateSandboxRequest,
    /// What the request said of internet access.
    pub allow_internet_access: Option<bool>,
}

impl E2b {
    /// The E2B front end of `edge`.
    pub fn new(
        edge: Arc<Edge>,
        config: E2bConfig,
        token: Option<Arc<str>>,
        projects: Arc<Projects>,
        max_upload_bytes: usize,
    ) -> E2b {
        E2b {
            edge,
            config,
            token,
            projects,
            max_upload_bytes,
            records: Mutex::default(),
            debug_sandbox: tokio::sync::Mutex::new(None),
            watchers: envd::Watchers::default(),
            process_configs: process::Configs::default(),
        }
    }

    /// The edge underneath.
    pub fn edge(&self) -> &Edge {
        &self.edge
    }

    /// The configuration.
    pub fn config(&self) -> &E2bConfig {
        &self.config
    }

    /// Creates a sandbox with its E2B record.
    pub async fn create(&self, new: NewSandbox, caller: &Caller) -> Result<E2bSandbox, ApiError> {
        let timeout = check_timeout(new.timeout_s)?;
        let info = self.edge.create(new.request, caller).await?;
        let record = Record {
            template_id: new.template_id,
            access_token: new_token(),
            timeout_s: timeout,
            end_at: Some(unix_now() + timeout as f64),
            on_timeout: new.on_timeout,
            auto_resume: new.auto_resume,
            allow_internet_access: new.allow_internet_access,
        };
        self.records
            .lock()
            .expect("lock")
            .insert(info.id.clone(), record.clone());
        Ok(self.view(info, Some(record)))
    }

    fn view(&self, info: SandboxInfo, record: Option<Record>) -> E2bSandbox {
        match record {
            Some(r) => E2bSandbox {
                info,
                template_id: r.template_id,
                access_token: Some(r.access_token),
                end_at: r.end_at,
                on_timeout: r.on_timeout,
                auto_resume: r.auto_resume,
                allow_internet_access: r.allow_internet_access,
            },
            None => E2bSandbox {
                template_id: Template::id_of(&info, &self.config.backend),
                end_at: info.ttl_s.map(|ttl| info.created_at + ttl),
                info,
                access_token: None,
                on_timeout: OnTimeout::Kill,
                auto_resume: true,
                allow_internet_access: None,
            },
        }
    }

    /// One sandbox, its usage left zero (it is read for [`with_usage`](Self::with_usage)
    /// only: every request looks its sandbox up); `NotFound` once it is gone.
    pub fn get(&self, id: &str) -> Result<E2bSandbox, ApiError> {
        self.lookup(id, Edge::get_brief)
    }

    /// One sandbox with its resource usage now; `NotFound` once it is gone.
    pub fn with_usage(&self, id: &str) -> Result<E2bSandbox, ApiError> {
        self.lookup(id, Edge::get)
    }

    fn lookup(
        &self,
        id: &str,
        info: impl FnOnce(&Edge, &str) -> Result<SandboxInfo, ApiError>,
    ) -> Result<E2bSandbox, ApiError> {
        let info = match info(&self.edge, id) {
            Ok(info) => info,
            Err(e) => {
                self.records.lock().expect("lock").remove(id);
                return Err(e);
            }
        };
        let record = self.records.lock().expect("lock").get(id).cloned();
        Ok(self.view(info, record))
    }

    /// Every sandbox having all of `labels`, oldest first.
    pub fn list(&self, labels: &[(String, String)], caller: &Caller) -> Vec<E2bSandbox> {
        let infos = self.edge.list(labels, caller);
        let records = self.records.lock().expect("lock");
        let views: Vec<(SandboxInfo, Option<Record>)> = infos
            .into_iter()
            .map(|info| {
                let record = records.get(&info.id).cloned();
                (info, record)
            })
            .collect();
        drop(records);
        views
            .into_iter()
            .map(|(info, record)| self.view(info, record))
            .collect()
    }

    /// Stops a sandbox, paused or not (the edge thaws what it stops).
    pub async fn kill(&self, id: &str) -> Result<(), ApiError> {
        let stopped = self.edge.stop(id).await;
        self.records.lock().expect("lock").remove(id);
        stopped
    }

    /// Moves a sandbox's timeout to `timeout_s` from now (`only_extend`: never earlier).
    pub fn set_timeout(&self, id: &str, timeout_s: i64, only_extend: bool) -> Result<(), ApiError> {
        let timeout = check_timeout(timeout_s)?;
        let sandbox = self.get(id)?;
        let mut records = self.records.lock().expect("lock");
        let Some(record) = records.get_mut(id) else {
            return Err(ApiError::conflict(format!(
                "sandbox {id:?} was not created through the E2B API: its lifetime is dsec's \
                 ttl_s ({}), which cannot change",
                sandbox
                    .info
                    .ttl_s
                    .map_or_else(|| "none".to_owned(), |t| format!("{t} s"))
            )));
        };
        let end_at = unix_now() + timeout as f64;
        if !only_extend || record.end_at.is_some_and(|e| end_at > e) {
            record.end_at = Some(end_at);
        }
        Ok(())
    }

    /// Pauses a running sandbox; `Conflict` when it is paused already.
    pub async fn pause(&self, id: &str) -> Result<(), ApiError> {
        if self.get(id)?.paused() {
            return Err(ApiError::conflict(format!(
                "sandbox {id:?} is already paused"
            )));
        }
        self.edge.pause(id).await?;
        self.stop_clock(id);
        Ok(())
    }

    /// A paused sandbox does not time out.
    fn stop_clock(&self, id: &str) {
        if let Some(record) = self.records.lock().expect("lock").get_mut(id) {
            record.end_at = None;
        }
    }

    /// Resumes a sandbox if paused, starting its timeout again at `timeout_s`, else only
    /// extends its timeout to `timeout_s`; `true` when it was paused.
    pub async fn connect(&self, id: &str, timeout_s: i64) -> Result<(bool, E2bSandbox), ApiError> {
        let was_paused = self.get(id)?.paused();
        if was_paused {
            self.edge.resume(id).await?;
        }
        match self.set_timeout(id, timeout_s, !was_paused) {
            Ok(()) => {}
            // A dsec sandbox keeps its own lifetime; connecting to it is still fine.
            Err(e) if e.kind == dsec_api::ErrorKind::Conflict => {}
            Err(e) => return Err(e),
        }
        Ok((was_paused, self.get(id)?))
    }

    /// Resumes a paused sandbox for an envd request (auto-resume), starting its timeout
    /// again as E2B does.
    pub async fn auto_resume(&self, id: &str) -> Result<E2bSandbox, ApiError> {
        let timeout = self
            .records
            .lock()
            .expect("lock")
            .get(id)
            .map(|r| r.timeout_s);
        match timeout {
            Some(t) => Ok(self
                .connect(id, i64::try_from(t).unwrap_or(i64::MAX))
                .await?
                .1),
            None => {
                self.edge.resume(id).await?;
                self.get(id)
            }
        }
    }

    /// The sandbox answering for [`DEBUG_SANDBOX_ID`], made on first use from
    /// `--e2b-debug-template` and made again if it was stopped.
    pub async fn debug_sandbox(&self) -> Result<String, ApiError> {
        let Some(template) = &self.config.debug_template else {
            return Err(ApiError::not_found(
                "debug_sandbox_id is the e2b SDK's debug mode (E2B_DEBUG=true); start dsec with \
                 --e2b-debug-template IMAGE to give it a sandbox",
            ));
        };
        let mut current = self.debug_sandbox.lock().await;
        if let Some(id) = current.as_ref() {
            if self.edge.get(id).is_ok() {
                return Ok(id.clone());
            }
        }
        let template = Template::parse(template, &self.config.backend)?;
        let mut labels = BTreeMap::new();
        labels.insert("e2b.debug".to_owned(), "true".to_owned());
        let request = create_request(template, BTreeMap::new(), labels, Network::default());
        let info = self.edge.create(request, &Caller::Admin).await?;
        tracing::info!(sandbox = %info.id, "E2B debug sandbox created");
        *current = Some(info.id.clone());
        Ok(info.id)
    }

    /// Acts on sandboxes whose timeout passed: stops them, or pauses those with
    /// `autoPause`; forgets records of sandboxes that are gone.
    pub async fn reap_once(&self) {
        let now = unix_now();
        let due: Vec<(String, OnTimeout)> = {
            let records = self.records.lock().expect("lock");
            records
                .iter()
                .filter(|(_, r)| r.end_at.is_some_and(|end| end <= now))
                .map(|(id, r)| (id.clone(), r.on_timeout))
                .collect()
        };
        for (id, on_timeout) in due {
            let Ok(sandbox) = self.get(&id) else {
                continue;
            };
            match on_timeout {
                OnTimeout::Kill => {
                    tracing::info!(sandbox = %id, "E2B timeout passed; stopping");
                    let _ = self.kill(&id).await;
                }
                OnTimeout::Pause if !sandbox.paused() => {
                    tracing::info!(sandbox = %id, "E2B timeout passed; pausing (autoPause)");
                    match self.edge.pause(&id).await {
                        Ok(_) => self.stop_clock(&id),
                        Err(e) => {
                            tracing::warn!(sandbox = %id, error = %e, "autoPause failed; stopping");
                            let _ = self.kill(&id).await;
                        }
                    }
                }
                OnTimeout::Pause => self.stop_clock(&id),
            }
        }
    }

    /// Runs [`reap_once`](Self::reap_once) until the server stops.
    pub async fn reaper(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            self.reap_once().await;
        }
    }
}

/// dsec's create request for a sandbox of `template`, with dsec's defaults otherwise.
pub fn create_request(
    template: Template,
    env: BTreeMap<String, String>,
    labels: BTreeMap<String, String>,
    network: Network,
) -> CreateSandboxRequest {
    CreateSandboxRequest {
        backend: template.backend,
        image: template.image,
        cpus: None,
        memory_mb: None,
        pids: None,
        disk_mb: None,
        ttl_s: None,
        idle_ttl_s: None,
        env,
        workdir: None,
        network,
        ca_bundle: None,
        labels,
        trajectory_id: None,
    }
}

/// Starts the configured listeners and the timeout reaper; each serves until `stop` turns
/// true. Binding errors come back before anything is served.
pub async fn start(
    e2b: Arc<E2b>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Result<Vec<tokio::task::JoinHandle<()>>, crate::ServeError> {
    let mut servers = Vec::new();
    if let Some(addr) = e2b.config.listen {
        let app = control::router(Arc::clone(&e2b));
        servers.push(serve(addr, app, "E2B control plane", stop.clone()).await?);
    }
    if let Some(addr) = e2b.config.envd_listen {
        let app = envd::router(Arc::clone(&e2b));
        servers.push(serve(addr, app, "E2B envd endpoint", stop.clone()).await?);
    }
    if !servers.is_empty() {
        let reaper = tokio::spawn(Arc::clone(&e2b).reaper());
        let mut stop = stop;
        servers.push(tokio::spawn(async move {
            let _ = stop.wait_for(|s| *s).await;
            reaper.abort();
        }));
    }
    Ok(servers)
}

/// Serves `app` as `what` on `addr` until `stop` turns true: the E2B listeners' server
/// (TCP_NODELAY on, for Connect streams), for `dsec serve` and a fleet apiserver alike.
/// A binding error comes back before anything is served.
pub async fn serve(
    addr: SocketAddr,
    app: axum::Router,
    what: &'static str,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<()>, crate::ServeError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| crate::ServeError::Listen { addr, source })?
        // A Connect stream is several small writes (start, output, end): with Nagle's
        // algorithm each after the first waits for the client's delayed ACK (~40 ms).
        .tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "TCP_NODELAY");
            }
        });
    tracing::info!(listen = %addr, "{what} serving");
    Ok(tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(listen = %addr, error = %e, "{what} failed");
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_name_an_image_and_maybe_a_backend() {
        let t = Template::parse("base", "container").unwrap();
        assert_eq!(
            (t.backend.as_str(), t.image.as_str()),
            ("container", "base")
        );
        let t = Template::parse("microvm+base", "container").unwrap();
        assert_eq!((t.backend.as_str(), t.image.as_str()), ("microvm", "base"));
        let t = Template::parse("docker+python:3.12-slim", "container").unwrap();
        assert_eq!(t.image, "python:3.12-slim");
        assert!(Template::parse("fncall+base", "container").is_err());
        assert!(Template::parse("k8s+base", "container").is_err());
        assert!(Template::parse("vm+", "container").is_err());
    }

    #[test]
    fn timeouts_are_bounded() {
        assert_eq!(check_timeout(300).unwrap(), 300);
        assert!(check_timeout(0).is_err());
        assert!(check_timeout(-5).is_err());
        assert!(check_timeout(i64::try_from(MAX_TIMEOUT_S).unwrap() + 1).is_err());
    }

    #[test]
    fn tokens_are_fresh_and_long() {
        let (a, b) = (new_token(), new_token());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }
}
