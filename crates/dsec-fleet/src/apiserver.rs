//! `dsec apiserver`: the `/v1` API the SDK speaks, and SandboxFusion's `/run_code`, for a
//! whole fleet. Stateless: it keeps only the edge table (watched from etcd) and forwards
//! every request to the edge that owns the sandbox, named by the sandbox id. Authentication
//! happens here: the apiserver's own token is the admin's, and the tokens of the projects
//! kept in etcd ([`crate::projects`]) are forwarded as the edge's admin token acting for
//! the project ([`ACTING_FOR`]), so every edge scopes them as its own project tokens.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, RawQuery, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use dsec_api::{
    BackendKind, CreateManyRequest, CreateManyResponse, CreateProjectRequest, ErrorBody, ErrorKind,
    ProjectInfo, ProjectToken, ProjectUsage, Quotas, SandboxInfo, SandboxState,
};
use dsec_server::api::{
    check_bearer, constant_time_eq, idempotency_key, presented_token, ApiJson, IDEMPOTENCY_KEY,
};
use dsec_server::e2b::serve as e2b_serve;
use dsec_server::edge::{batch_item, batch_item_key, check_batch};
use dsec_server::error::ApiError;
use dsec_server::projects::{Caller, ACTING_FOR};
use dsec_trajectory::TrajectoryLog;
use futures::future::join_all;
use futures::StreamExt;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::membership::{EdgeRecord, EdgeTable, Member};
use crate::placement::{place_where, NoPlacement};
use crate::projects::FleetProjects;

mod e2b;

/// Everything `dsec apiserver` is configured with.
#[derive(Clone, Debug)]
pub struct ApiserverConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// Bearer token clients must send.
    pub token: Option<String>,
    /// Bearer token sent to edges (their `--token-file`).
    pub edge_token: Option<String>,
    /// Choices per placement.
    pub choices: usize,
    /// Largest request body.
    pub max_upload_bytes: usize,
    /// The fleet's PostgreSQL trajectory log, read for sandboxes whose edge is gone.
    pub trajectory_db: Option<String>,
    /// E2B's control plane on this address, forwarded to the edges' (`--e2b-listen`).
    pub e2b_listen: Option<SocketAddr>,
    /// One envd endpoint for every sandbox of the fleet (`--e2b-envd-listen`).
    pub e2b_envd_listen: Option<SocketAddr>,
}

/// What every handler shares.
#[derive(Clone)]
pub struct Fleet {
    table: Arc<EdgeTable>,
    http: reqwest::Client,
    token: Option<Arc<str>>,
    edge_token: Option<Arc<str>>,
    choices: usize,
    metrics: Option<PrometheusHandle>,
    log: Option<TrajectoryLog>,
    projects: Option<Arc<FleetProjects>>,
}

/// Headers a forwarded request keeps; everything else (hop-by-hop, the client's token)
/// stays here. [`ACTING_FOR`] is the apiserver's own, set by [`authenticate`].
static FORWARDED_HEADERS: [header::HeaderName; 5] = [
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    header::ACCEPT,
    header::HeaderName::from_static(IDEMPOTENCY_KEY),
    header::HeaderName::from_static(ACTING_FOR),
];

/// Headers of an edge's answer passed back to the client.
static ANSWER_HEADERS: [header::HeaderName; 3] = [
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    header::CACHE_CONTROL,
];

/// The E2B API key sent to edges that have no token (any non-empty key is their admin's).
const TOKENLESS_EDGE_KEY: &str = "dsec-apiserver";

/// envd's header for a sandbox's access token.
const ACCESS_TOKEN: &str = "x-access-token";

/// Headers a forwarded envd request keeps: its body's form, the Connect protocol's, the
/// user (`Authorization: Basic`) and the sandbox named; the access token is handled apart.
static ENVD_HEADERS: [header::HeaderName; 11] = [
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    header::CONTENT_ENCODING,
    header::ACCEPT,
    header::ACCEPT_ENCODING,
    header::AUTHORIZATION,
    header::HeaderName::from_static("e2b-sandbox-id"),
    header::HeaderName::from_static("connect-protocol-version"),
    header::HeaderName::from_static("connect-timeout-ms"),
    header::HeaderName::from_static("connect-content-encoding"),
    header::HeaderName::from_static("keepalive-ping-interval"),
];

/// Headers of an envd answer passed back: a download's and a Connect stream's.
static ENVD_ANSWER_HEADERS: [header::HeaderName; 6] = [
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    header::CONTENT_ENCODING,
    header::CONTENT_DISPOSITION,
    header::CACHE_CONTROL,
    header::VARY,
];

/// Which of an edge's listeners a request goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Listener {
    /// dsec's API (`/v1`, `/run_code`), the edge token sent as the bearer token.
    Api,
    /// E2B's control plane, the edge token sent as the API key.
    E2b,
    /// The envd endpoint: the sandbox's own credentials, passed on.
    Envd,
}

impl Listener {
    /// Where `member` serves it.
    fn url(self, member: &Member) -> Result<&str, ApiError> {
        let record = &member.record;
        match (self, &record.e2b) {
            (Listener::Api, _) => Ok(&record.url),
            (Listener::E2b, Some(e2b)) => Ok(&e2b.api_url),
            (Listener::Envd, Some(e2b)) => Ok(&e2b.envd_url),
            (_, None) => Err(ApiError::unavailable(format!(
                "edge {:?} serves no E2B API (start it with --e2b-listen and --e2b-envd-listen)",
                record.name
            ))),
        }
    }

    /// The headers of a request passed on, and of its answer passed back.
    fn headers(self) -> (&'static [header::HeaderName], &'static [header::HeaderName]) {
        match self {
            Listener::Api | Listener::E2b => (&FORWARDED_HEADERS, &ANSWER_HEADERS),
            Listener::Envd => (&ENVD_HEADERS, &ENVD_ANSWER_HEADERS),
        }
    }
}

/// The edges' lists, merged.
enum Lists {
    /// Every item of the edges that answered, and each one's answer headers.
    Merged {
        items: Vec<serde_json::Value>,
        heads: Vec<HeaderMap>,
    },
    /// An edge's refusal, passed on.
    Refused(Response),
}

/// An edge's answer, read whole.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    /// The answer as this apiserver's, its content type kept.
    fn into_response(self) -> Response {
        let mut response = (self.status, self.body).into_response();
        if let Some(v) = self.headers.get(header::CONTENT_TYPE) {
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, v.clone());
        }
        response
    }
}

impl Fleet {
    /// A fleet front over `table`.
    pub fn new(
        table: Arc<EdgeTable>,
        config: &ApiserverConfig,
        metrics: Option<PrometheusHandle>,
    ) -> Fleet {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .pool_idle_timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            .build()
            .expect("an HTTP client builds");
        Fleet {
            table,
            http,
            token: config.token.as_deref().map(Arc::from),
            edge_token: config.edge_token.as_deref().map(Arc::from),
            choices: config.choices.max(1),
            metrics,
            log: None,
            projects: None,
        }
    }

    /// Takes the tokens of `projects` besides its own.
    pub fn with_projects(mut self, projects: Arc<FleetProjects>) -> Fleet {
        self.projects = Some(projects);
        self
    }

    /// Who sent `headers`: the admin (this apiserver's token, or none required), a
    /// project (one of its tokens), or nobody known (`Unauthorized`).
    fn caller(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let refused = match check_bearer(self.token.as_deref(), headers) {
            Ok(()) => return Ok(Caller::Admin),
            Err(e) => e,
        };
        self.projects
            .as_ref()
            .zip(presented_token(headers))
            .and_then(|(projects, token)| projects.authenticate(&token))
            .ok_or(refused)
    }

    /// The projects, where this apiserver can keep them.
    fn projects(&self) -> Result<&FleetProjects, ApiError> {
        match (&self.token, &self.projects) {
            (Some(_), Some(projects)) => Ok(projects),
            (None, _) => Err(ApiError::conflict(
                "projects need the apiserver to require a token: restart dsec apiserver \
                 with --token-file (that token becomes the admin's)",
            )),
            (Some(_), None) => Err(ApiError::unavailable(
                "this apiserver keeps no projects: it watches no etcd",
            )),
        }
    }

    /// What each project's sandboxes hold now, over every edge that answers.
    async fn usage(&self) -> Result<std::collections::HashMap<String, ProjectUsage>, ApiError> {
        let answer = list(State(self.clone()), RawQuery(None), HeaderMap::new()).await?;
        let body = axum::body::to_bytes(answer.into_body(), usize::MAX)
            .await
            .map_err(|e| ApiError::internal(format!("reading the edges' lists: {e}")))?;
        let sandboxes: Vec<SandboxInfo> = serde_json::from_slice(&body).map_err(|e| {
            ApiError::internal(format!("the edges' lists do not parse as sandboxes: {e}"))
        })?;
        let mut usage = std::collections::HashMap::<String, ProjectUsage>::new();
        for s in sandboxes {
            let Some(project) = s.project else { continue };
            if matches!(s.state, SandboxState::Stopped | SandboxState::Failed) {
                continue;
            }
            let u = usage.entry(project).or_default();
            u.sandboxes += 1;
            u.cpus += s.limits.cpus.unwrap_or_default();
            u.memory_mb += s
                .limits
                .memory_mb
                .and_then(|m| u64::try_from(m).ok())
                .unwrap_or_default();
        }
        Ok(usage)
    }

    /// Serves the logs of sandboxes whose edge is gone from `log` (read only).
    pub fn with_log(mut self, log: TrajectoryLog) -> Fleet {
        self.log = Some(log);
        self
    }

    /// Sends a request to `member`'s `listener` and passes its answer back as a stream.
    async fn forward(
        &self,
        member: &Member,
        listener: Listener,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: reqwest::Body,
    ) -> Result<Response, ApiError> {
        let started = Instant::now();
        let base = listener.url(member)?;
        let url = format!("{}{path_and_query}", base.trim_end_matches('/'));
        let mut request = self.http.request(method, &url).body(body);
        let (passed, answered) = listener.headers();
        for name in passed {
            if let Some(v) = headers.get(name) {
                request = request.header(name, v);
            }
        }
        request = match listener {
            Listener::Api => match &self.edge_token {
                Some(token) => request.bearer_auth(token),
                None => request,
            },
            // An edge without a token takes any non-empty key as its admin's; the client's
            // own key stays here.
            Listener::E2b => request.header(
                "x-api-key",
                self.edge_token.as_deref().unwrap_or(TOKENLESS_EDGE_KEY),
            ),
            // The sandbox's own access token goes through; this apiserver's token, dsec's
            // own credential for every sandbox, becomes the edge's.
            Listener::Envd => match headers.get(ACCESS_TOKEN) {
                Some(given)
                    if self
                        .token
                        .as_deref()
                        .is_some_and(|t| constant_time_eq(given.as_bytes(), t.as_bytes())) =>
                {
                    match &self.edge_token {
                        Some(token) => request.header(ACCESS_TOKEN, token.as_ref()),
                        None => request,
                    }
                }
                Some(given) => request.header(ACCESS_TOKEN, given),
                None => request,
            },
        };
        let answer = request.send().await.map_err(|e| {
            metrics::counter!("dsec_fleet_edge_unreachable_total").increment(1);
            let name = &member.record.name;
            ApiError::unavailable(if member.lapsed {
                self.table.forget_lapsed(name);
                format!("edge {name:?} has left the fleet (its etcd lease expired or it stopped) and does not answer at {base}: {e}")
            } else {
                format!("edge {name:?} at {base} is unreachable: {e}")
            })
        })?;
        metrics::histogram!("dsec_fleet_forward_seconds").record(started.elapsed().as_secs_f64());
        let mut response = Response::builder().status(answer.status().as_u16());
        for name in answered {
            if let Some(v) = answer.headers().get(name) {
                response = response.header(name, v);
            }
        }
        Ok(response
            .body(Body::from_stream(answer.bytes_stream()))
            .expect("a response builds"))
    }

    /// Every one of `members`' list at `path` (a JSON array), merged; the first that
    /// refuses is the answer instead. An edge that cannot be reached is left out.
    async fn lists(
        &self,
        members: &[Arc<Member>],
        listener: Listener,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<Lists, ApiError> {
        let answers = self
            .ask_all(
                members,
                listener,
                &Method::GET,
                |_| path.to_owned(),
                headers,
                &Bytes::new(),
            )
            .await;
        let mut items = Vec::new();
        let mut heads = Vec::new();
        for (member, answer) in members.iter().zip(answers) {
            match answer {
                Ok(answer) if answer.status.is_success() => {
                    let some: Vec<serde_json::Value> = serde_json::from_slice(&answer.body)
                        .map_err(|e| {
                            ApiError::internal(format!(
                                "edge {:?} answered a list that does not parse: {e}",
                                member.record.name
                            ))
                        })?;
                    items.extend(some);
                    heads.push(answer.headers);
                }
                Ok(answer) => return Ok(Lists::Refused(answer.into_response())),
                Err(e) => {
                    tracing::warn!(edge = %member.record.name, error = %e, "list: leaving out an edge that does not answer")
                }
            }
        }
        Ok(Lists::Merged { items, heads })
    }

    /// Sends one request to each of `members` at once (`path` for each), and reads each
    /// answer whole; an edge that cannot be reached answers its error.
    async fn ask_all(
        &self,
        members: &[Arc<Member>],
        listener: Listener,
        method: &Method,
        path: impl Fn(&Member) -> String,
        headers: &HeaderMap,
        body: &Bytes,
    ) -> Vec<Result<Answer, ApiError>> {
        join_all(members.iter().map(|m| async {
            let response = self
                .forward(
                    m,
                    listener,
                    method.clone(),
                    &path(m),
                    headers,
                    reqwest::Body::from(body.clone()),
                )
                .await?;
            let status = response.status();
            let headers = response.headers().clone();
            let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                .await
                .map_err(|e| ApiError::unavailable(format!("edge {:?}: {e}", m.record.name)))?;
            Ok(Answer {
                status,
                headers,
                body,
            })
        }))
        .await
    }

    /// The edge called `name`, live or lapsed (see [`LAPSE_GRACE`]), or why a request for
    /// its sandbox cannot be served.
    ///
    /// [`LAPSE_GRACE`]: crate::membership::LAPSE_GRACE
    fn member(&self, name: &str, sandbox: &str) -> Result<Arc<Member>, ApiError> {
        if let Some(m) = self.table.members().get(name) {
            return Ok(Arc::clone(m));
        }
        if let Some(m) = self.table.lapsed_member(name) {
            return Ok(m);
        }
        let why = if self.table.departed(name) {
            "has left the fleet (its etcd lease expired or it stopped)"
        } else {
            "is not in the fleet (it left, or never joined)"
        };
        Err(ApiError::unavailable(format!(
            "sandbox {sandbox:?} is on edge {name:?}, which {why}: the sandbox is lost"
        )))
    }

    /// The live edge sandbox `id` names, or why a request for it cannot be served.
    fn edge_of_sandbox(&self, id: &str) -> Result<Arc<Member>, ApiError> {
        let edge = crate::edge_of(id).ok_or_else(|| {
            ApiError::not_found(format!(
                "sandbox {id:?} not found: a sandbox id is <edge>-<12 hex digits>"
            ))
        })?;
        self.member(edge, id)
    }

    fn ready_members(&self) -> Vec<Arc<Member>> {
        self.table
            .members()
            .list
            .iter()
            .filter(|m| m.record.ready)
            .cloned()
            .collect()
    }

    /// The edges a list asks: the ready ones and those that lapsed lately (an edge that
    /// does not answer is left out of the list).
    fn listed_members(&self) -> Vec<Arc<Member>> {
        let mut members = self.ready_members();
        members.extend(self.table.lapsed().into_iter().filter(|m| m.record.ready));
        members
    }

    fn no_edges(&self) -> ApiError {
        ApiError::unavailable(format!(
            "no edges in the fleet: none is registered in etcd at {} (start `dsec edge --etcd {}` on each host)",
            self.table.endpoints, self.table.endpoints
        ))
    }
}

/// Serves the fleet's API, and E2B's where configured, until SIGINT or SIGTERM.
pub async fn serve(config: ApiserverConfig, fleet: Fleet) -> anyhow::Result<()> {
    let listens = [
        Some(config.listen),
        config.e2b_listen,
        config.e2b_envd_listen,
    ];
    if let Some(open) = listens
        .into_iter()
        .flatten()
        .find(|a| !a.ip().is_loopback())
        .filter(|_| config.token.is_none())
    {
        anyhow::bail!(
            "refusing to listen on {open} without --token-file: anyone who can reach it could run commands as root in sandboxes; pass --token-file or listen on 127.0.0.1",
        );
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| anyhow::anyhow!("listening on {}: {e}", config.listen))?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut e2b_servers = Vec::new();
    if let Some(addr) = config.e2b_listen {
        let app = e2b::control_router(fleet.clone());
        e2b_servers.push(e2b_serve(addr, app, "E2B control plane", stopped.clone()).await?);
    }
    if let Some(addr) = config.e2b_envd_listen {
        let app = e2b::envd_router(fleet.clone());
        e2b_servers.push(e2b_serve(addr, app, "E2B envd endpoint", stopped.clone()).await?);
    }
    tracing::info!(listen = %config.listen, etcd = %fleet.table.endpoints, "dsec apiserver serving");
    axum::serve(listener, router(fleet, config.max_upload_bytes))
        .with_graceful_shutdown(async move {
            shutdown_signal().await;
            let _ = stop.send(true);
        })
        .await?;
    join_all(e2b_servers).await;
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Builds the router.
pub fn router(fleet: Fleet, max_upload_bytes: usize) -> Router {
    // Full paths, not a nested `/v1` router: handlers forward the URI they got, which a
    // nested router would have stripped of its prefix.
    Router::new()
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/sandboxes/batch", post(create_many))
        .route("/v1/sandboxes/{id}", any(by_id))
        .route("/v1/sandboxes/{id}/log", get(sandbox_log))
        .route("/v1/sandboxes/{id}/{*rest}", any(by_id))
        .route("/v1/images", post(import).get(from_any))
        .route("/v1/images/{*name}", get(from_any).delete(broadcast))
        .route("/v1/store", get(from_any))
        .route("/v1/store/prune", post(broadcast))
        .route("/v1/calls", post(call))
        .route("/v1/calls/stream", post(call))
        .route("/run_code", post(call))
        .route("/v1/ping", get(from_any))
        .route("/v1/fleet/edges", get(edges))
        .route("/v1/projects", post(create_project).get(list_projects))
        .route("/v1/projects/{name}", axum::routing::delete(delete_project))
        .route("/v1/projects/{name}/tokens", post(add_token))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .fallback(|| async { ApiError::not_found("no such API route") })
        .layer(middleware::from_fn_with_state(fleet.clone(), authenticate))
        .route("/healthz", get(healthz))
        .layer(axum::extract::DefaultBodyLimit::max(max_upload_bytes))
        .with_state(fleet)
}

/// Tells who sent a request (the [`Caller`] handlers extract) and, for a project, names it
/// to the edges in [`ACTING_FOR`] (a client's own such header is dropped); `401` for an
/// unknown token, and for a project on the fleet's admin routes.
async fn authenticate(State(fleet): State<Fleet>, mut request: Request, next: Next) -> Response {
    let caller = match fleet.caller(request.headers()) {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    let path = request.uri().path();
    if (!path.starts_with("/v1/") && path != "/run_code") || path == "/v1/fleet/edges" {
        if let Err(e) = caller.require_admin(path) {
            return e.into_response();
        }
    }
    if let Err(e) = act_for(request.headers_mut(), &caller) {
        return e.into_response();
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// Names `caller`'s project to the edges in [`ACTING_FOR`], dropping a client's own such
/// header: the edges take it from their admin only, which this apiserver is to them.
fn act_for(headers: &mut HeaderMap, caller: &Caller) -> Result<(), ApiError> {
    headers.remove(ACTING_FOR);
    if let Some(acting) = caller.acting_for() {
        let v = HeaderValue::from_str(&acting)
            .map_err(|e| ApiError::internal(format!("{ACTING_FOR}: {e}")))?;
        headers.insert(ACTING_FOR, v);
    }
    Ok(())
}

async fn create_project(
    State(fleet): State<Fleet>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateProjectRequest>,
) -> Result<(StatusCode, Json<ProjectToken>), ApiError> {
    caller.require_admin("creating a project")?;
    let quotas = Quotas {
        max_sandboxes: req.max_sandboxes,
        max_cpus: req.max_cpus,
        max_memory_mb: req.max_memory_mb,
    };
    let token = fleet.projects()?.create(&req.name, quotas).await?;
    Ok((
        StatusCode::CREATED,
        Json(ProjectToken {
            name: req.name,
            token,
            quotas,
        }),
    ))
}

/// The admin gets every project, a project's token its own; usage is summed over the
/// edges.
async fn list_projects(
    State(fleet): State<Fleet>,
    caller: Caller,
) -> Result<Json<Vec<ProjectInfo>>, ApiError> {
    let Some(projects) = &fleet.projects else {
        return Ok(Json(Vec::new()));
    };
    let mut usage = fleet.usage().await?;
    Ok(Json(
        projects
            .list()
            .into_iter()
            .filter(|(name, _)| caller.sees(Some(name)))
            .map(|(name, project)| ProjectInfo {
                usage: usage.remove(&name).unwrap_or_default(),
                tokens: project.tokens(),
                quotas: project.quotas,
                name,
            })
            .collect(),
    ))
}

async fn delete_project(
    State(fleet): State<Fleet>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.require_admin("deleting a project")?;
    let projects = fleet.projects()?;
    let n = fleet.usage().await?.get(&name).map_or(0, |u| u.sandboxes);
    if n > 0 {
        return Err(ApiError::conflict(format!(
            "project {name:?} still has {n} sandbox(es) in the fleet: stop them first (its \
             token can list them), then delete it"
        )));
    }
    projects.delete(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn add_token(
    State(fleet): State<Fleet>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<(StatusCode, Json<ProjectToken>), ApiError> {
    caller.require_admin("adding a project token")?;
    let (token, quotas) = fleet.projects()?.add_token(&name).await?;
    Ok((
        StatusCode::CREATED,
        Json(ProjectToken {
            name,
            token,
            quotas,
        }),
    ))
}

async fn healthz(State(fleet): State<Fleet>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "status": "ok",
        "role": "apiserver",
        "edges": fleet.table.members().list.len(),
    }))
}

async fn metrics(State(fleet): State<Fleet>) -> Response {
    metrics::gauge!("dsec_fleet_edges").set(fleet.table.members().list.len() as f64);
    let text = fleet
        .metrics
        .as_ref()
        .map(|m| m.render())
        .unwrap_or_default();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        dsec_server::api::openapi_json(),
    )
        .into_response()
}

/// The edges as this apiserver sees them (`dsec edges`).
async fn edges(State(fleet): State<Fleet>) -> Json<Vec<EdgeRecord>> {
    Json(
        fleet
            .table
            .members()
            .list
            .iter()
            .map(|m| m.record.clone())
            .collect(),
    )
}

/// A request body to pass on to an edge: streamed, or empty where the client sent none (a
/// stream of unknown length would go out chunked, even under a `GET`).
fn passed_on(body: Body) -> reqwest::Body {
    use axum::body::HttpBody;
    if body.is_end_stream() {
        reqwest::Body::from("")
    } else {
        reqwest::Body::wrap_stream(body.into_data_stream())
    }
}

fn path_and_query(request: &Request) -> String {
    request.uri().path_and_query().map_or_else(
        || request.uri().path().to_owned(),
        |p| p.as_str().to_owned(),
    )
}

/// The sandbox id of a route `{prefix}{id}[/...]`.
fn sandbox_in(path: &str, prefix: &str) -> String {
    path.trim_start_matches(prefix)
        .split('/')
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Forwards `request`, about sandbox `id`, to `member`'s `listener`, streamed both ways.
async fn about_sandbox(
    fleet: &Fleet,
    member: &Member,
    listener: Listener,
    id: &str,
    request: Request,
) -> Result<Response, ApiError> {
    let target = path_and_query(&request);
    let (parts, body) = request.into_parts();
    fleet
        .forward(
            member,
            listener,
            parts.method,
            &target,
            &parts.headers,
            passed_on(body),
        )
        .await
        .map_err(|e| {
            ApiError::unavailable(format!("sandbox {id:?} cannot be reached: {}", e.message))
        })
}

/// Every request about one sandbox: to the edge its id names, streamed both ways.
async fn by_id(State(fleet): State<Fleet>, request: Request) -> Result<Response, ApiError> {
    let id = sandbox_in(request.uri().path(), "/v1/sandboxes/");
    let member = fleet.edge_of_sandbox(&id)?;
    about_sandbox(&fleet, &member, Listener::Api, &id, request).await
}

/// The query of `GET /v1/sandboxes/{id}/log`.
#[derive(serde::Deserialize)]
struct LogQuery {
    trajectory_id: Option<String>,
}

/// `GET /v1/sandboxes/{id}/log`: from the edge that owns the sandbox while it is in the
/// fleet (its live usage counted); once that edge is gone, from the fleet's PostgreSQL
/// log, when this apiserver reads it (`--trajectory-db`) — a log outlives its edge.
async fn sandbox_log(
    State(fleet): State<Fleet>,
    caller: Caller,
    Path(id): Path<String>,
    query: Result<Query<LogQuery>, QueryRejection>,
    request: Request,
) -> Result<Response, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    // An edge that is not live (even one that lapsed lately) is read from the shared log,
    // which holds what it wrote.
    let gone = crate::edge_of(&id).is_some_and(|edge| fleet.table.members().get(edge).is_none());
    let Some(log) = fleet.log.as_ref().filter(|_| gone) else {
        return by_id(State(fleet), request).await;
    };
    // A project's token reads its own sandboxes' logs, as on an edge; another's is not
    // found, as an unknown id is.
    let found = log.sandbox_log(&id, query.trajectory_id).await?;
    let found = found
        .filter(|l| caller.sees(l.sandbox.project.as_deref()))
        .ok_or_else(|| {
            ApiError::not_found(format!(
            "sandbox {id:?} not found in the fleet's trajectory log: its edge is gone, and the \
             log never held it or pruned it (the oldest stopped sandboxes' logs go first)"
        ))
        })?;
    Ok(Json(found).into_response())
}

/// The backend a create or call asks for, checked here so a typo is a 400, not a 503.
fn requested_backend(body: &Bytes, default: &str) -> Result<String, ApiError> {
    let value: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("request body is not valid JSON: {e}")))?;
    let backend = match value.get("backend") {
        None | Some(serde_json::Value::Null) => default.to_owned(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "backend must be a string, got {other}"
            )))
        }
    };
    BackendKind::parse(&backend).map_err(ApiError::invalid)?;
    Ok(backend)
}

/// Percent-encodes a key for a URL path segment.
fn path_segment(key: &str) -> String {
    key.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An edge's refusal that another edge may not share: at capacity, or the backend cannot
/// run on that host.
async fn refusal(response: Response) -> Result<ApiError, Response> {
    if response.status() != StatusCode::SERVICE_UNAVAILABLE {
        return Err(response);
    }
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    Ok(edge_error(&body))
}

/// What an edge's error body says: dsec's shape, or E2B's (`{"code", "message"}`).
fn edge_error(body: &[u8]) -> ApiError {
    #[derive(serde::Deserialize)]
    struct E2bBody {
        message: String,
    }
    if let Ok(b) = serde_json::from_slice::<ErrorBody>(body) {
        return ApiError::new(b.error.kind, b.error.message);
    }
    match serde_json::from_slice::<E2bBody>(body) {
        Ok(b) => ApiError::unavailable(b.message),
        Err(_) => ApiError::unavailable(String::from_utf8_lossy(body).into_owned()),
    }
}

/// What a placed request asks of an edge.
#[derive(Clone, Copy, Debug)]
enum Wanted<'a> {
    /// dsec's API, on an edge that runs this backend.
    Backend(&'a str),
    /// E2B's control plane, on an edge serving it that runs this backend (`None`: the
    /// backend of the edge's templates that name none).
    E2b(Option<&'a str>),
}

impl Wanted<'_> {
    fn accepts(self, m: &Member) -> bool {
        match self {
            Wanted::Backend(backend) => m.offers(backend),
            Wanted::E2b(backend) => m.offers_e2b(backend),
        }
    }

    fn listener(self) -> Listener {
        match self {
            Wanted::Backend(_) => Listener::Api,
            Wanted::E2b(_) => Listener::E2b,
        }
    }

    /// What is made, for messages.
    fn what(self) -> String {
        match self {
            Wanted::Backend(backend) => format!("a {backend:?} sandbox"),
            Wanted::E2b(Some(backend)) => format!("an E2B sandbox on backend {backend:?}"),
            Wanted::E2b(None) => "an E2B sandbox".to_owned(),
        }
    }

    /// Which edges could make it, for messages.
    fn offered_by(self) -> String {
        match self {
            Wanted::Backend(backend) => format!("runs backend {backend:?}"),
            Wanted::E2b(Some(backend)) => {
                format!("serves E2B (--e2b-listen, --e2b-envd-listen) and runs backend {backend:?}")
            }
            Wanted::E2b(None) => {
                "serves E2B (--e2b-listen, --e2b-envd-listen) and runs its --e2b-backend".to_owned()
            }
        }
    }
}

/// Places a create (or a call) as `wanted` says: the drawn edges first, then the others; an
/// edge that vetoes (capacity), cannot run the backend or cannot be reached hands the
/// request on. A keyed create first asks the drawn edges whether it was made already.
async fn placed(
    fleet: &Fleet,
    wanted: Wanted<'_>,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
    key: Option<&str>,
) -> Result<Response, ApiError> {
    let members = fleet.table.members();
    let placement = place_where(
        &members,
        |m| wanted.accepts(m),
        fleet.choices,
        key,
        &mut rand::rng(),
    )
    .map_err(|why| match why {
        NoPlacement::NoEdges => fleet.no_edges(),
        NoPlacement::NoEdgeOffers => ApiError::unavailable(format!(
            "no live edge {} (edges: {})",
            wanted.offered_by(),
            members
                .list
                .iter()
                .map(|m| format!("{} [{}]", m.record.name, m.record.load.backends.join(",")))
                .collect::<Vec<_>>()
                .join("; ")
        )),
    })?;
    if let Some(key) = key {
        let lookup = format!("/v1/idempotency/{}", path_segment(key));
        let no_headers = HeaderMap::new();
        let found = join_all(placement.order[..placement.drawn].iter().map(|m| {
            fleet.forward(
                m,
                Listener::Api,
                Method::GET,
                &lookup,
                &no_headers,
                reqwest::Body::from(""),
            )
        }))
        .await;
        if let Some(existing) = found
            .into_iter()
            .flatten()
            .find(|r| r.status() == StatusCode::OK)
        {
            return Ok(existing);
        }
    }
    let mut placement = placement;
    let mut refusals = Vec::new();
    let mut all_full = true;
    let mut next = 0;
    while next < placement.order.len() {
        if next == placement.drawn {
            placement.narrow_fallbacks();
        }
        let member = Arc::clone(&placement.order[next]);
        next += 1;
        let answer = fleet
            .forward(
                &member,
                wanted.listener(),
                Method::POST,
                path,
                headers,
                reqwest::Body::from(body.clone()),
            )
            .await;
        let refused = match answer {
            Ok(response) => match refusal(response).await {
                Err(response) => return Ok(response),
                Ok(refused) => refused,
            },
            Err(unreachable) => unreachable,
        };
        metrics::counter!("dsec_fleet_placement_refused_total", "kind" => refused.kind.as_str())
            .increment(1);
        tracing::debug!(edge = %member.record.name, refused = %refused, "placement: next candidate");
        all_full &= refused.kind == ErrorKind::Capacity;
        refusals.push(format!("{}: {}", member.record.name, refused.message));
    }
    let message = format!(
        "no edge could take {} ({} tried: the drawn and the least loaded others): {}",
        wanted.what(),
        placement.order.len(),
        refusals.join("; ")
    );
    Err(if all_full {
        ApiError::capacity(message)
    } else {
        ApiError::unavailable(message)
    })
}

async fn create(
    State(fleet): State<Fleet>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let backend = requested_backend(&body, "container")?;
    let key = idempotency_key(&headers)?.map(str::to_owned);
    metrics::counter!("dsec_fleet_creates_total", "backend" => backend.clone()).increment(1);
    placed(
        &fleet,
        Wanted::Backend(&backend),
        "/v1/sandboxes",
        &headers,
        body,
        key.as_deref(),
    )
    .await
}

/// How many items of one batch an apiserver has out to edges at once.
const BATCH_IN_FLIGHT: usize = 64;

/// `POST /v1/sandboxes/batch`: every item placed as a create of its own, so a batch
/// spreads over the fleet by load and an edge's veto hands an item on; the answer has one
/// item per sandbox, made or refused. Item `i` of a keyed batch is keyed
/// [`batch_item_key`]`(key, i)`: a retried batch makes only what it did not make before.
async fn create_many(
    State(fleet): State<Fleet>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateManyRequest>,
) -> Result<Json<CreateManyResponse>, ApiError> {
    check_batch(req.count)?;
    let backend = req.sandbox.backend.as_str();
    BackendKind::parse(backend).map_err(ApiError::invalid)?;
    let key = idempotency_key(&headers)?;
    metrics::counter!("dsec_fleet_creates_total", "backend" => backend.to_owned())
        .increment(u64::from(req.count));
    let body = Bytes::from(serde_json::to_vec(&req.sandbox).expect("a create request serializes"));
    let fleet = &fleet;
    let items = futures::stream::iter(0..req.count)
        .map(|index| {
            let item_key = key.map(|k| batch_item_key(k, index));
            let body = body.clone();
            async move {
                let mut headers = HeaderMap::new();
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                if let Some(k) = &item_key {
                    let value = HeaderValue::from_str(k)
                        .map_err(|_| ApiError::invalid("Idempotency-Key must be printable ASCII"));
                    match value {
                        Ok(v) => headers.insert(IDEMPOTENCY_KEY, v),
                        Err(e) => return batch_item(Err(e)),
                    };
                }
                let placed = placed(
                    fleet,
                    Wanted::Backend(backend),
                    "/v1/sandboxes",
                    &headers,
                    body,
                    item_key.as_deref(),
                )
                .await;
                batch_item(match placed {
                    Ok(answer) => created(answer).await,
                    Err(e) => Err(e),
                })
            }
        })
        .buffered(BATCH_IN_FLIGHT)
        .collect()
        .await;
    Ok(Json(CreateManyResponse { items }))
}

/// The sandbox an edge's answer to a create describes, or the error it answered.
async fn created(answer: Response) -> Result<SandboxInfo, ApiError> {
    let status = answer.status();
    let body = axum::body::to_bytes(answer.into_body(), 16 << 20)
        .await
        .map_err(|e| ApiError::unavailable(format!("reading an edge's answer to a create: {e}")))?;
    if status.is_success() {
        return serde_json::from_slice(&body).map_err(|e| {
            ApiError::internal(format!(
                "an edge answered a create that does not parse: {e}"
            ))
        });
    }
    Err(match serde_json::from_slice::<ErrorBody>(&body) {
        Ok(b) => ApiError::new(b.error.kind, b.error.message),
        Err(_) => ApiError::unavailable(format!(
            "an edge answered a create with {status}: {}",
            String::from_utf8_lossy(&body)
        )),
    })
}

/// `POST /v1/calls[/stream]` and SandboxFusion's `POST /run_code`: one-shot fncalls,
/// placed like a create.
async fn call(
    State(fleet): State<Fleet>,
    headers: HeaderMap,
    request: Request,
) -> Result<Response, ApiError> {
    let path = path_and_query(&request);
    let body = axum::body::to_bytes(request.into_body(), usize::MAX)
        .await
        .map_err(|e| ApiError::invalid(format!("reading the request body: {e}")))?;
    placed(
        &fleet,
        Wanted::Backend("fncall"),
        &path,
        &headers,
        body,
        None,
    )
    .await
}

/// `GET /v1/sandboxes`: every edge's list, merged oldest first.
async fn list(
    State(fleet): State<Fleet>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let path = match query {
        Some(q) => format!("/v1/sandboxes?{q}"),
        None => "/v1/sandboxes".to_owned(),
    };
    let mut all = match fleet
        .lists(&fleet.listed_members(), Listener::Api, &path, &headers)
        .await?
    {
        Lists::Merged { items, .. } => items,
        Lists::Refused(answer) => return Ok(answer),
    };
    let created =
        |v: &serde_json::Value| v.get("created_at").and_then(|c| c.as_f64()).unwrap_or(0.0);
    all.sort_by(|a, b| created(a).total_cmp(&created(b)));
    Ok(Json(all).into_response())
}

/// Reads that any edge answers the same (images, the store): the first live one.
async fn from_any(State(fleet): State<Fleet>, request: Request) -> Result<Response, ApiError> {
    let path = path_and_query(&request);
    let members = fleet.ready_members();
    let member = members.first().ok_or_else(|| fleet.no_edges())?;
    let (parts, _) = request.into_parts();
    fleet
        .forward(
            member,
            Listener::Api,
            parts.method,
            &path,
            &parts.headers,
            reqwest::Body::from(""),
        )
        .await
}

/// `POST /v1/images`: when every live edge shares images through one registry, one
/// edge imports (and pushes) and the others pull on first use; the importing edge is the
/// first by name, the one [`from_any`] reads images from. Otherwise every edge imports.
async fn import(State(fleet): State<Fleet>, request: Request) -> Result<Response, ApiError> {
    let members = fleet.ready_members();
    let first = members.first().ok_or_else(|| fleet.no_edges())?;
    let shared = first.record.load.registry.is_some()
        && members
            .iter()
            .all(|m| m.record.load.registry == first.record.load.registry);
    if !shared {
        return broadcast(State(fleet), request).await;
    }
    let path = path_and_query(&request);
    let (parts, body) = request.into_parts();
    let body = passed_on(body);
    fleet
        .forward(
            first,
            Listener::Api,
            parts.method,
            &path,
            &parts.headers,
            body,
        )
        .await
}

/// Image changes go to every live edge (imports, without a shared registry; removals, of
/// each edge's copy): the first failure is the answer, else the first edge's.
async fn broadcast(State(fleet): State<Fleet>, request: Request) -> Result<Response, ApiError> {
    let path = path_and_query(&request);
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .map_err(|e| ApiError::invalid(format!("reading the request body: {e}")))?;
    let members = fleet.ready_members();
    if members.is_empty() {
        return Err(fleet.no_edges());
    }
    let answers = fleet
        .ask_all(
            &members,
            Listener::Api,
            &parts.method,
            |_| path.clone(),
            &parts.headers,
            &body,
        )
        .await;
    let mut first = None;
    for answer in answers {
        let answer = answer?;
        // A progress stream reports a failure in its last line, under a success status.
        let failed = !answer.status.is_success()
            || answer
                .body
                .split(|b| *b == b'\n')
                .rev()
                .find(|l| !l.is_empty())
                .and_then(|l| serde_json::from_slice::<serde_json::Value>(l).ok())
                .is_some_and(|v| v.get("kind").and_then(|k| k.as_str()) == Some("error"));
        let response = answer.into_response();
        if failed {
            return Ok(response);
        }
        first.get_or_insert(response);
    }
    Ok(first.expect("at least one edge answered"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edge_errors_are_read_in_either_shape() {
        let dsec = br#"{"error":{"kind":"capacity","message":"full"}}"#;
        let e = edge_error(dsec);
        assert_eq!((e.kind, e.message.as_str()), (ErrorKind::Capacity, "full"));
        let e = edge_error(br#"{"code":503,"message":"no room"}"#);
        assert_eq!(
            (e.kind, e.message.as_str()),
            (ErrorKind::Unavailable, "no room")
        );
        assert_eq!(edge_error(b"bad gateway").message, "bad gateway");
    }

    #[test]
    fn keys_are_encoded_for_a_path() {
        assert_eq!(path_segment("a-b_c.1~"), "a-b_c.1~");
        assert_eq!(path_segment("a/b?c"), "a%2Fb%3Fc");
    }

    #[test]
    fn the_backend_is_checked_before_placement() {
        assert_eq!(
            requested_backend(&Bytes::from("{}"), "container").unwrap(),
            "container"
        );
        assert_eq!(
            requested_backend(&Bytes::from(r#"{"backend":"fncall"}"#), "container").unwrap(),
            "fncall"
        );
        let e = requested_backend(&Bytes::from(r#"{"backend":"nope"}"#), "container").unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        let e = requested_backend(&Bytes::from("not json"), "container").unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
    }
}
