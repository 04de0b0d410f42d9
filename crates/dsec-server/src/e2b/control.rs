//! E2B's control-plane REST API (`spec/openapi.yml` of e2b-dev/E2B), the part the SDK
//! uses: create (`/sandboxes`, `/v2/sandboxes`), connect (both forms), resume, info, kill,
//! timeout, refreshes, pause, list (`/v2/sandboxes` with filters and pages, and the old
//! `/sandboxes`), metrics, health.
//!
//! Every route but `/health` takes the API key in `X-API-KEY` (or `Authorization: Bearer`):
//! dsec's token (the admin's) or a project's when the server has one, else any non-empty
//! key; a project's key sees only its project's sandboxes. Errors have E2B's shape,
//! `{"code": <HTTP status>, "message": ...}`; what dsec does not offer (template builds,
//! volumes, snapshots, forks, secrets, MCP, IAM) answers 501 in that shape at once.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use base64::Engine;
use dsec_api::{Network, SandboxState};
use serde::{Deserialize, Serialize};

use super::envd::drained;
use super::{create_request, E2b, E2bSandbox, NewSandbox, OnTimeout, Template, ENVD_VERSION};
use crate::error::ApiError;
use crate::projects::Caller;

/// An error in E2B's shape.
#[derive(Debug)]
pub struct E2bError {
    status: StatusCode,
    message: String,
}

impl E2bError {
    /// An error of `status` saying `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> E2bError {
        E2bError {
            status,
            message: message.into(),
        }
    }

    fn invalid(message: impl Into<String>) -> E2bError {
        E2bError::new(StatusCode::BAD_REQUEST, message)
    }

    /// What dsec does not offer: 501, naming it.
    fn unsupported(what: &str) -> E2bError {
        E2bError::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("{what} is not supported by dsec's E2B API"),
        )
    }
}

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> E2bError {
        let status =
            StatusCode::from_u16(e.kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        E2bError::new(status, e.message)
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() && self.status != StatusCode::NOT_IMPLEMENTED {
            tracing::error!(status = %self.status, message = %self.message, "E2B API error");
        }
        let body = serde_json::json!({"code": self.status.as_u16(), "message": self.message});
        (self.status, Json(body)).into_response()
    }
}

type Result<T> = std::result::Result<T, E2bError>;

/// A JSON body whose rejections are E2B errors.
struct E2bJson<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for E2bJson<T> {
    type Rejection = E2bError;

    async fn from_request(req: Request, state: &S) -> Result<Self> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| E2bError::new(e.status(), e.body_text()))?;
        let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
            b"{}"
        } else {
            &bytes
        };
        serde_json::from_slice(bytes)
            .map(E2bJson)
            .map_err(|e| E2bError::invalid(format!("request body: {e}")))
    }
}

/// The control plane's routes.
pub fn router(e2b: Arc<E2b>) -> Router {
    // Each early answer reads the (small) request body first: one left unread closes the
    // connection under a client that would send its next request on it.
    let unsupported = |what: &'static str| {
        any(move |body: Body| async move {
            drained(body, E2bError::unsupported(what).into_response()).await
        })
    };
    Router::new()
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/metrics", get(metrics_of_many))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/logs", unsupported("sandbox logs"))
        .route("/v2/sandboxes/{id}/logs", unsupported("sandbox logs"))
        .route(
            "/sandboxes/{id}/fork",
            unsupported("forking through the E2B API (use dsec's sb.fork)"),
        )
        .route(
            "/sandboxes/{id}/snapshots",
            unsupported("snapshots through the E2B API (use dsec's sb.snapshot)"),
        )
        .route(
            "/sandboxes/{id}/network",
            unsupported("changing the network through the E2B API (use dsec's sb.set_network)"),
        )
        .route("/snapshots", unsupported("snapshots through the E2B API"))
        .route("/templates", unsupported(TEMPLATES))
        .route("/templates/{*rest}", unsupported(TEMPLATES))
        .route("/v2/templates", unsupported(TEMPLATES))
        .route("/v2/templates/{*rest}", unsupported(TEMPLATES))
        .route("/v3/templates", unsupported(TEMPLATES))
        .route("/volumes", unsupported("volumes"))
        .route("/volumes/{*rest}", unsupported("volumes"))
        .route("/secrets", unsupported("secrets"))
        .route("/secrets/{*rest}", unsupported("secrets"))
        .fallback(|body: Body| async {
            let missing = E2bError::new(StatusCode::NOT_FOUND, "no such route in dsec's E2B API");
            drained(body, missing.into_response()).await
        })
        .layer(middleware::from_fn_with_state(
            Arc::clone(&e2b),
            authenticate,
        ))
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .layer(axum::extract::DefaultBodyLimit::max(1 << 20))
        .with_state(e2b)
}

const TEMPLATES: &str = "building templates (import a rootfs or image with `dsec image import` and use its name as templateID)";

/// The API key a control-plane request presents: `X-API-KEY`, else `Authorization: Bearer`.
pub fn api_key(headers: &HeaderMap) -> &str {
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .or_else(|| {
            headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
        })
        .unwrap_or_default()
}

/// Who presents API key `key` to a server whose own token is `token`: the admin (that
/// token, or any non-empty key where there is none), a project (`project(key)`), or
/// nobody. A `dsec serve` and a fleet apiserver decide alike.
pub fn key_caller(
    token: Option<&str>,
    key: &str,
    project: impl FnOnce(&str) -> Option<Caller>,
) -> Option<Caller> {
    match token {
        Some(token) if crate::api::constant_time_eq(key.as_bytes(), token.as_bytes()) => {
            Some(Caller::Admin)
        }
        Some(_) => project(key),
        None => (!key.is_empty()).then_some(Caller::Admin),
    }
}

/// The 401 for a key [`key_caller`] refused.
pub fn refused_key(has_token: bool) -> E2bError {
    let why = if has_token {
        "missing or wrong API key: set E2B_API_KEY to the dsec server's token or a \
         project's"
    } else {
        "missing API key: set E2B_API_KEY (this dsec server takes any non-empty key)"
    };
    E2bError::new(StatusCode::UNAUTHORIZED, why)
}

/// Tells who sent a request (the [`Caller`] handlers extract): the admin may act for a
/// project, as a fleet apiserver forwarding a project's request does
/// ([`crate::projects::ACTING_FOR`]).
async fn authenticate(
    State(e2b): State<Arc<E2b>>,
    headers: HeaderMap,
    mut request: Request,
    next: Next,
) -> Response {
    let caller = key_caller(e2b.token.as_deref(), api_key(&headers), |key| {
        e2b.projects.authenticate(key)
    });
    let caller = match caller {
        Some(Caller::Admin) => Caller::admin_acting(&headers).map_err(E2bError::from),
        Some(project) => Ok(project),
        None => Err(refused_key(e2b.token.is_some())),
    };
    let caller = match caller {
        Ok(caller) => caller,
        Err(refused) => return drained(request.into_body(), refused.into_response()).await,
    };
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// The `{id}` of a sandbox route, checked to be one the API key may see (see
/// [`crate::edge::Edge::check_visible`]).
struct Visible(String);

impl axum::extract::FromRequestParts<Arc<E2b>> for Visible {
    type Rejection = E2bError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        e2b: &Arc<E2b>,
    ) -> Result<Visible> {
        let Path(id) = Path::<String>::from_request_parts(parts, e2b)
            .await
            .map_err(|e| E2bError::invalid(e.body_text()))?;
        let caller = Caller::from_request_parts(parts, e2b).await?;
        e2b.edge().check_visible(&caller, &id)?;
        Ok(Visible(id))
    }
}

/// `NewSandbox` and `NewSandboxV2`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandboxBody {
    #[serde(rename = "templateID")]
    template_id: String,
    /// Seconds; the spec's default is 15.
    #[serde(default = "default_create_timeout")]
    timeout: i64,
    #[serde(default)]
    auto_pause: bool,
    #[serde(default)]
    auto_resume: Option<AutoResume>,
    #[serde(default, rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    network: Option<NetworkBody>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
    #[serde(default)]
    env_vars: BTreeMap<String, String>,
    #[serde(default)]
    mcp: Option<serde_json::Value>,
    #[serde(default)]
    iam: Option<serde_json::Value>,
    #[serde(default)]
    volume_mounts: Vec<serde_json::Value>,
}

fn default_create_timeout() -> i64 {
    15
}

#[derive(Deserialize)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetworkBody {
    #[serde(default)]
    allow_out: Vec<String>,
    #[serde(default)]
    deny_out: Vec<String>,
    #[serde(default)]
    rules: Option<serde_json::Value>,
    #[serde(default)]
    egress_proxy: Option<serde_json::Value>,
    #[serde(default)]
    mask_request_host: Option<String>,
}

/// dsec's egress policy for E2B's network fields. dsec's policy is an allow-list: `allowOut`
/// with everything else denied; without it, `allow_internet_access` says all or nothing
/// (absent: nothing, dsec's default — E2B's is all).
fn network_policy(
    allow_internet_access: Option<bool>,
    network: Option<NetworkBody>,
) -> Result<Network> {
    let Some(network) = network else {
        return Ok(Network::Enabled(allow_internet_access == Some(true)));
    };
    if network.rules.as_ref().is_some_and(|r| !r.is_null())
        || network.egress_proxy.as_ref().is_some_and(|p| !p.is_null())
        || network.mask_request_host.is_some()
    {
        return Err(E2bError::unsupported(
            "network rules, egress proxies and host masks",
        ));
    }
    let deny_all = |d: &String| d == "0.0.0.0/0" || d == "::/0";
    if !network.deny_out.iter().all(deny_all) {
        return Err(E2bError::invalid(
            "denyOut other than 0.0.0.0/0 is not supported: dsec's egress policy is an \
             allow-list; list what may be reached in allowOut",
        ));
    }
    if !network.allow_out.is_empty() {
        return Ok(Network::Allow {
            allow: network.allow_out,
        });
    }
    let open = network.deny_out.is_empty() && allow_internet_access == Some(true);
    Ok(Network::Enabled(open))
}

/// The `Sandbox` reply of create and connect.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SandboxBody {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    alias: String,
    #[serde(rename = "clientID")]
    client_id: String,
    envd_version: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    traffic_access_token: Option<String>,
    domain: Option<String>,
}

impl SandboxBody {
    fn of(s: E2bSandbox) -> SandboxBody {
        SandboxBody {
            alias: s.info.image.clone(),
            client_id: client_id(&s),
            sandbox_id: s.info.id,
            template_id: s.template_id,
            envd_version: ENVD_VERSION,
            envd_access_token: s.access_token,
            traffic_access_token: None,
            domain: None,
        }
    }
}

/// `clientID` (deprecated, required): the edge that owns it, the id's prefix.
fn client_id(s: &E2bSandbox) -> String {
    s.info
        .id
        .rsplit_once('-')
        .map_or("dsec", |(edge, _)| edge)
        .to_owned()
}

/// `ListedSandbox`, and `SandboxDetail` with the optional fields filled.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DetailBody {
    #[serde(rename = "templateID")]
    template_id: String,
    alias: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: String,
    started_at: String,
    end_at: String,
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: i64,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: i64,
    metadata: BTreeMap<String, String>,
    state: &'static str,
    envd_version: &'static str,
    volume_mounts: [(); 0],
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    allow_internet_access: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lifecycle: Option<Lifecycle>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Lifecycle {
    auto_resume: bool,
    on_timeout: &'static str,
}

/// CPUs as E2B counts them: whole, at least one.
// A small positive count (the edge checks it); `as` from f64 saturates.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn whole_cpus(cpus: f64) -> u32 {
    cpus.ceil().max(1.0) as u32
}

/// The whole seconds of Unix time `unix`.
// `as` from f64 saturates; a Unix time is far inside i64.
#[allow(clippy::cast_possible_truncation)]
fn unix_secs(unix: f64) -> i64 {
    unix as i64
}

/// A sandbox that never times out reports this end.
const NEVER: &str = "9999-12-31T23:59:59Z";

// Whole seconds of a Unix time, and a fraction's nanoseconds in 0..1e9: `as` from f64
// saturates, and chrono rejects what is out of its range.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn rfc3339(unix: f64) -> String {
    let secs = unix.floor() as i64;
    let nanos = ((unix - unix.floor()) * 1e9) as u32;
    chrono::DateTime::from_timestamp(secs, nanos).map_or_else(
        || NEVER.to_owned(),
        |t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    )
}

/// The whole milliseconds of Unix time `unix`: a listed sandbox's `startedAt`, and the
/// first part of the key lists are ordered and paged by, so that a page's end can be named
/// from what was listed (an apiserver merging edges' lists does).
// `as` from f64 saturates; a Unix time is far inside i64.
#[allow(clippy::cast_possible_truncation)]
fn started_ms(unix: f64) -> i64 {
    (unix * 1000.0).floor() as i64
}

fn rfc3339_ms(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms).map_or_else(
        || NEVER.to_owned(),
        |t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    )
}

/// The key a listed sandbox (`ListedSandbox` JSON) is ordered and paged by: its
/// `startedAt` in milliseconds and its `sandboxID`.
pub fn listed_key(sandbox: &serde_json::Value) -> Option<(i64, &str)> {
    let started = sandbox.get("startedAt")?.as_str()?;
    let started = chrono::DateTime::parse_from_rfc3339(started).ok()?;
    Some((
        started.timestamp_millis(),
        sandbox.get("sandboxID")?.as_str()?,
    ))
}

impl DetailBody {
    fn of(s: E2bSandbox, detail: bool) -> DetailBody {
        let limits = s.info.limits;
        DetailBody {
            alias: s.info.image.clone(),
            client_id: client_id(&s),
            started_at: rfc3339_ms(started_ms(s.info.created_at)),
            end_at: s.end_at.map_or_else(|| NEVER.to_owned(), rfc3339),
            cpu_count: limits.cpus.map_or(1, whole_cpus),
            memory_mb: limits.memory_mb.unwrap_or_default(),
            disk_size_mb: limits.disk_mb.unwrap_or_default(),
            metadata: s.info.labels.clone(),
            state: if s.paused() { "paused" } else { "running" },
            envd_version: ENVD_VERSION,
            volume_mounts: [],
            allow_internet_access: if detail {
                s.allow_internet_access
            } else {
                None
            },
            lifecycle: detail.then_some(Lifecycle {
                auto_resume: s.auto_resume,
                on_timeout: s.on_timeout.as_str(),
            }),
            envd_access_token: if detail { s.access_token } else { None },
            sandbox_id: s.info.id,
            template_id: s.template_id,
        }
    }
}

async fn create(
    State(e2b): State<Arc<E2b>>,
    caller: Caller,
    E2bJson(body): E2bJson<NewSandboxBody>,
) -> Result<(StatusCode, Json<SandboxBody>)> {
    if body.mcp.as_ref().is_some_and(|m| !m.is_null()) {
        return Err(E2bError::unsupported("MCP"));
    }
    if body.iam.as_ref().is_some_and(|m| !m.is_null()) {
        return Err(E2bError::unsupported("workload identity (iam)"));
    }
    if !body.volume_mounts.is_empty() {
        return Err(E2bError::unsupported("volumes"));
    }
    let template = Template::parse(&body.template_id, &e2b.config().backend)?;
    let network = network_policy(body.allow_internet_access, body.network)?;
    let request = create_request(template, body.env_vars, body.metadata, network);
    let sandbox = e2b
        .create(
            NewSandbox {
                template_id: body.template_id,
                timeout_s: body.timeout,
                on_timeout: if body.auto_pause {
                    OnTimeout::Pause
                } else {
                    OnTimeout::Kill
                },
                auto_resume: body.auto_resume.is_some_and(|a| a.enabled),
                request,
                allow_internet_access: body.allow_internet_access,
            },
            &caller,
        )
        .await?;
    Ok((StatusCode::CREATED, Json(SandboxBody::of(sandbox))))
}

async fn info(State(e2b): State<Arc<E2b>>, Visible(id): Visible) -> Result<Json<DetailBody>> {
    Ok(Json(DetailBody::of(e2b.get(&id)?, true)))
}

async fn kill(State(e2b): State<Arc<E2b>>, Visible(id): Visible) -> Result<StatusCode> {
    e2b.kill(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: i64,
}

async fn set_timeout(
    State(e2b): State<Arc<E2b>>,
    Visible(id): Visible,
    E2bJson(body): E2bJson<TimeoutBody>,
) -> Result<StatusCode> {
    e2b.set_timeout(&id, body.timeout, false)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct RefreshBody {
    #[serde(default)]
    duration: Option<i64>,
}

/// Keeps a sandbox alive `duration` seconds more (at most an hour; default E2B's 15).
async fn refresh(
    State(e2b): State<Arc<E2b>>,
    Visible(id): Visible,
    E2bJson(body): E2bJson<RefreshBody>,
) -> Result<StatusCode> {
    let duration = body.duration.unwrap_or(15);
    if !(0..=3600).contains(&duration) {
        return Err(E2bError::invalid(format!(
            "duration must be 0 to 3600 seconds, got {duration}"
        )));
    }
    if duration > 0 {
        e2b.set_timeout(&id, duration, true)?;
    }
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct ConnectBody {
    /// Seconds; E2B's default when absent.
    #[serde(default = "default_connect_timeout")]
    timeout: i64,
}

fn default_connect_timeout() -> i64 {
    300
}

/// Connects to a sandbox, resuming it if paused: 201 when it was resumed, else 200.
async fn connect(
    State(e2b): State<Arc<E2b>>,
    Visible(id): Visible,
    E2bJson(body): E2bJson<ConnectBody>,
) -> Result<(StatusCode, Json<SandboxBody>)> {
    let (resumed, sandbox) = e2b.connect(&id, body.timeout).await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(SandboxBody::of(sandbox))))
}

/// The old resume: 409 unless the sandbox is paused.
async fn resume(
    State(e2b): State<Arc<E2b>>,
    Visible(id): Visible,
    E2bJson(body): E2bJson<ConnectBody>,
) -> Result<(StatusCode, Json<SandboxBody>)> {
    if !e2b.get(&id)?.paused() {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id:?} is already running"),
        ));
    }
    let (_, sandbox) = e2b.connect(&id, body.timeout).await?;
    Ok((StatusCode::CREATED, Json(SandboxBody::of(sandbox))))
}

async fn pause(State(e2b): State<Arc<E2b>>, Visible(id): Visible) -> Result<StatusCode> {
    e2b.pause(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The filters and page of a list request.
#[derive(Debug, Default, PartialEq)]
pub struct ListQuery {
    metadata: Vec<(String, String)>,
    running: bool,
    paused: bool,
    newest_first: bool,
    started_after: Option<f64>,
    template: Option<String>,
    after: Option<Cursor>,
    limit: usize,
}

/// Where a page ends: the last sandbox's start time (whole milliseconds, as listed) and
/// id (the list's order).
#[derive(Clone, Debug, PartialEq)]
struct Cursor {
    started_ms: i64,
    id: String,
}

impl Cursor {
    fn encode(&self) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(format!("{}/{}", self.started_ms, self.id))
    }

    fn decode(token: &str) -> Option<Cursor> {
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(token)
            .ok()?;
        let (started, id) = std::str::from_utf8(&raw).ok()?.split_once('/')?;
        Some(Cursor {
            started_ms: started.parse().ok()?,
            id: id.to_owned(),
        })
    }
}

fn form_pairs(query: &str) -> impl Iterator<Item = (String, String)> + '_ {
    form_urlencoded::parse(query.as_bytes()).map(|(k, v)| (k.into_owned(), v.into_owned()))
}

impl ListQuery {
    /// Parses the query of `GET /v2/sandboxes`.
    pub fn parse(query: &str) -> Result<ListQuery> {
        let mut q = ListQuery {
            newest_first: true,
            limit: 100,
            ..ListQuery::default()
        };
        let mut states = Vec::new();
        for (key, value) in form_pairs(query) {
            match key.as_str() {
                // The value is itself a query string: "user=abc&app=prod".
                "metadata" => q.metadata.extend(form_pairs(&value)),
                "state" => states.extend(value.split(',').map(str::to_owned)),
                "order" => {
                    q.newest_first = match value.as_str() {
                        "desc" => true,
                        "asc" => false,
                        other => {
                            return Err(E2bError::invalid(format!(
                                "order must be asc or desc, got {other:?}"
                            )))
                        }
                    }
                }
                "startedAfter" => {
                    let t = chrono::DateTime::parse_from_rfc3339(&value).map_err(|e| {
                        E2bError::invalid(format!(
                            "startedAfter must be RFC 3339 ({e}), got {value:?}"
                        ))
                    })?;
                    q.started_after = Some(t.timestamp_micros() as f64 / 1e6);
                }
                "template" => q.template = Some(value),
                "nextToken" => {
                    q.after = Some(Cursor::decode(&value).ok_or_else(|| {
                        E2bError::invalid(format!(
                            "nextToken {value:?} is not one this server gave"
                        ))
                    })?)
                }
                "limit" => {
                    q.limit = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=100).contains(n))
                        .ok_or_else(|| {
                            E2bError::invalid(format!("limit must be 1 to 100, got {value:?}"))
                        })?
                }
                _ => {}
            }
        }
        for state in &states {
            match state.as_str() {
                "running" => q.running = true,
                "paused" => q.paused = true,
                "" => {}
                other => {
                    return Err(E2bError::invalid(format!(
                        "state must be running or paused, got {other:?}"
                    )))
                }
            }
        }
        if !q.running && !q.paused {
            (q.running, q.paused) = (true, true);
        }
        Ok(q)
    }

    fn matches(&self, s: &E2bSandbox) -> bool {
        let state_ok = if s.paused() {
            self.paused
        } else {
            self.running
        };
        let live = !matches!(s.info.state, SandboxState::Stopping | SandboxState::Stopped);
        live && state_ok
            && self.started_after.is_none_or(|t| s.info.created_at >= t)
            && self
                .template
                .as_ref()
                .is_none_or(|t| *t == s.template_id || *t == s.info.image)
    }

    /// The query of the old `GET /sandboxes`: running sandboxes only, no pages.
    pub fn parse_v1(query: &str) -> Result<ListQuery> {
        let mut q = ListQuery::parse(query)?;
        (q.running, q.paused, q.limit, q.after) = (true, false, usize::MAX, None);
        Ok(q)
    }

    /// Whether running sandboxes were asked for (the answer then counts them).
    pub fn counts_running(&self) -> bool {
        self.running
    }

    /// The page of `items` this query asks for, each keyed by its start time in whole
    /// milliseconds and its id (they are ordered by that), and the `nextToken` of the
    /// page after it, if there are more.
    pub fn page<T>(
        &self,
        mut items: Vec<T>,
        key: impl Fn(&T) -> (i64, &str),
    ) -> (Vec<T>, Option<String>) {
        items.sort_by(|a, b| key(a).cmp(&key(b)));
        if self.newest_first {
            items.reverse();
        }
        if let Some(c) = &self.after {
            let cursor = (c.started_ms, c.id.as_str());
            items.retain(|s| {
                let ord = key(s).cmp(&cursor);
                if self.newest_first {
                    ord.is_lt()
                } else {
                    ord.is_gt()
                }
            });
        }
        let more = items.len() > self.limit;
        items.truncate(self.limit);
        let next = more.then(|| {
            let (started_ms, id) = key(items.last().expect("a full page"));
            Cursor {
                started_ms,
                id: id.to_owned(),
            }
            .encode()
        });
        (items, next)
    }
}

/// A page of sandboxes: `X-Next-Token` when there are more, `X-Total-Running` when running
/// ones were asked for.
fn list(e2b: &E2b, q: &ListQuery, caller: &Caller) -> Response {
    let all: Vec<E2bSandbox> = e2b
        .list(&q.metadata, caller)
        .into_iter()
        .filter(|s| q.matches(s))
        .collect();
    let running = all.iter().filter(|s| !s.paused()).count();
    let (page, next) = q.page(all, |s| (started_ms(s.info.created_at), s.info.id.as_str()));
    let body: Vec<DetailBody> = page.into_iter().map(|s| DetailBody::of(s, false)).collect();
    list_response(&body, next, q.running.then_some(running))
}

/// A list's answer: the page, `X-Next-Token` when there are more, `X-Total-Running` when
/// counted.
pub fn list_response<T: Serialize>(
    page: &[T],
    next: Option<String>,
    running: Option<usize>,
) -> Response {
    let mut response = Json(page).into_response();
    let headers = response.headers_mut();
    if let Some(token) = next.and_then(|t| HeaderValue::from_str(&t).ok()) {
        headers.insert(NEXT_TOKEN, token);
    }
    if let Some(running) = running {
        headers.insert(TOTAL_RUNNING, HeaderValue::from(running));
    }
    response
}

/// The header naming the next page of a list.
pub const NEXT_TOKEN: &str = "x-next-token";
/// The header counting a list's running sandboxes (over every page).
pub const TOTAL_RUNNING: &str = "x-total-running";

async fn list_v2(
    State(e2b): State<Arc<E2b>>,
    caller: Caller,
    RawQuery(query): RawQuery,
) -> Result<Response> {
    let q = ListQuery::parse(query.as_deref().unwrap_or_default())?;
    Ok(list(&e2b, &q, &caller))
}

/// The old list: running sandboxes only, no pages.
async fn list_v1(
    State(e2b): State<Arc<E2b>>,
    caller: Caller,
    RawQuery(query): RawQuery,
) -> Result<Response> {
    let q = ListQuery::parse_v1(query.as_deref().unwrap_or_default())?;
    Ok(list(&e2b, &q, &caller))
}

/// `SandboxMetric`: one sample, now.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Metric {
    timestamp: String,
    timestamp_unix: i64,
    cpu_count: u32,
    cpu_used_pct: f64,
    mem_used: u64,
    mem_total: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

impl Metric {
    /// CPU use is the average since the sandbox started (dsec keeps the total CPU time).
    fn of(s: &E2bSandbox) -> Metric {
        let now = super::unix_now();
        let limits = s.info.limits;
        let cpus = limits.cpus.unwrap_or(1.0).max(0.01);
        let elapsed_ms = ((now - s.info.created_at) * 1000.0).max(1.0);
        Metric {
            timestamp: rfc3339(now),
            timestamp_unix: unix_secs(now),
            cpu_count: whole_cpus(cpus),
            cpu_used_pct: (s.info.usage.cpu_ms / elapsed_ms / cpus * 100.0).clamp(0.0, 100.0),
            mem_used: s.info.usage.memory_bytes,
            mem_total: limits
                .memory_mb
                .map_or(0, |m| u64::try_from(m).unwrap_or(0))
                << 20,
            mem_cache: 0,
            disk_used: 0,
            disk_total: limits.disk_mb.map_or(0, |m| u64::try_from(m).unwrap_or(0)) << 20,
        }
    }
}

async fn metrics(State(e2b): State<Arc<E2b>>, Visible(id): Visible) -> Result<Json<Vec<Metric>>> {
    Ok(Json(vec![Metric::of(&e2b.with_usage(&id)?)]))
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the latest sample of each.
async fn metrics_of_many(
    State(e2b): State<Arc<E2b>>,
    caller: Caller,
    RawQuery(query): RawQuery,
) -> Result<Json<serde_json::Value>> {
    let mut sandboxes = serde_json::Map::new();
    for (key, value) in form_pairs(query.as_deref().unwrap_or_default()) {
        if key != "sandbox_ids" {
            continue;
        }
        for id in value.split(',').filter(|id| !id.is_empty()) {
            if e2b.edge().check_visible(&caller, id).is_err() {
                continue;
            }
            if let Ok(s) = e2b.with_usage(id) {
                let metric = serde_json::to_value(Metric::of(&s)).expect("metrics serialize");
                sandboxes.insert(id.to_owned(), metric);
            }
        }
    }
    Ok(Json(serde_json::json!({ "sandboxes": sandboxes })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_queries_parse_as_the_sdk_sends_them() {
        let q = ListQuery::parse(
            "metadata=sandbox_test_id%3Dabc%26app%3Dprod&state=running,paused&limit=2&order=asc",
        )
        .unwrap();
        assert_eq!(
            q.metadata,
            vec![
                ("sandbox_test_id".to_owned(), "abc".to_owned()),
                ("app".to_owned(), "prod".to_owned())
            ]
        );
        assert!(q.running && q.paused && !q.newest_first);
        assert_eq!(q.limit, 2);
        let q = ListQuery::parse("state=paused").unwrap();
        assert!(q.paused && !q.running);
        for bad in [
            "limit=0",
            "limit=101",
            "state=dead",
            "order=up",
            "nextToken=zz",
            "startedAfter=yesterday",
        ] {
            assert!(ListQuery::parse(bad).is_err(), "{bad}");
        }
        let q = ListQuery::parse("startedAfter=2024-01-01T00:00:00Z").unwrap();
        assert_eq!(q.started_after, Some(1_704_067_200.0));
    }

    #[test]
    fn pages_follow_the_listed_order_whoever_merges_them() {
        let listed =
            |ms: i64, id: &str| serde_json::json!({"startedAt": rfc3339_ms(ms), "sandboxID": id});
        // Two edges' sandboxes, merged: a page token from one page names the place in the
        // whole list, so the next page is right over any set of edges.
        let all = vec![
            listed(1_000, "e1-000000000001"),
            listed(3_000, "e2-000000000001"),
            listed(2_000, "e1-000000000002"),
            listed(2_000, "e2-000000000002"),
        ];
        fn key(v: &serde_json::Value) -> (i64, &str) {
            listed_key(v).unwrap()
        }
        let mut seen = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let query = match &token {
                Some(t) => format!("limit=1&nextToken={t}"),
                None => "limit=1".to_owned(),
            };
            let q = ListQuery::parse(&query).unwrap();
            let (page, next) = q.page(all.clone(), key);
            seen.extend(
                page.iter()
                    .map(|v| v["sandboxID"].as_str().unwrap().to_owned()),
            );
            match next {
                Some(t) => token = Some(t),
                None => break,
            }
        }
        assert_eq!(
            seen,
            [
                "e2-000000000001",
                "e2-000000000002",
                "e1-000000000002",
                "e1-000000000001"
            ]
        );
        assert_eq!(started_ms(1_700_000_000.250_9), 1_700_000_000_250);
        assert_eq!(
            key(&listed(1_700_000_000_250, "a-1")),
            (1_700_000_000_250, "a-1")
        );
    }

    #[test]
    fn cursors_round_trip() {
        let c = Cursor {
            started_ms: 1_700_000_000_250,
            id: "e0-0123456789ab".into(),
        };
        assert_eq!(Cursor::decode(&c.encode()), Some(c));
    }

    #[test]
    fn network_fields_map_to_dsec_policies() {
        assert_eq!(network_policy(None, None).unwrap(), Network::Enabled(false));
        assert_eq!(
            network_policy(Some(true), None).unwrap(),
            Network::Enabled(true)
        );
        let allow = NetworkBody {
            allow_out: vec!["pypi.org".into()],
            deny_out: vec!["0.0.0.0/0".into()],
            rules: None,
            egress_proxy: None,
            mask_request_host: None,
        };
        assert_eq!(
            network_policy(None, Some(allow)).unwrap(),
            Network::Allow {
                allow: vec!["pypi.org".into()]
            }
        );
        let deny_some = NetworkBody {
            allow_out: vec![],
            deny_out: vec!["10.0.0.0/8".into()],
            rules: None,
            egress_proxy: None,
            mask_request_host: None,
        };
        assert_eq!(
            network_policy(None, Some(deny_some)).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(1_704_067_200.5), "2024-01-01T00:00:00.500Z");
    }
}
