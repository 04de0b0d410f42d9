//! HTTP routes under `/v1`, plus `/healthz`, `/metrics` and `/openapi.json`.
//!
//! Handlers are thin: they parse (through [`ApiJson`], which turns every body rejection
//! into a JSON error naming the field), call the [`Edge`], and encode.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Path, Query, RawQuery, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use dsec_api::{
    CommandResult, CreateManyRequest, CreateManyResponse, CreateSandboxRequest, ErrorBody,
    ErrorDetail, ErrorKind, ExecBody, FileInfo, ImageInfo, ImportEvent, ImportImageRequest,
    MakeDirRequest, MakeDirResponse, MoveRequest, PruneResult, SandboxInfo, StoreInfo, StreamEvent,
};
use futures::StreamExt;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use utoipa::OpenApi;

mod call;
mod events;
mod processes;
mod projects;

use crate::backend::{Output, OutputStream, Upload};
use crate::edge::{Edge, Execution};
use crate::error::ApiError;
use crate::projects::Caller;

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    /// The sandboxes.
    pub edge: Arc<Edge>,
    /// Renders `/metrics`.
    pub metrics: PrometheusHandle,
    /// The admin's bearer token, when the server requires one.
    pub token: Option<Arc<str>>,
    /// The projects and their tokens.
    pub projects: Arc<crate::projects::Projects>,
    /// SandboxFusion's `/run_code`.
    pub sandboxfusion: Arc<crate::sandboxfusion::SandboxFusion>,
}

/// `Json<T>` whose rejections are dsec errors: 400 naming the field, 413 when too large.
pub struct ApiJson<T>(pub T);

fn body_error(status: StatusCode, text: String) -> ApiError {
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(
            ErrorKind::PayloadTooLarge,
            "request body exceeds the server's upload limit (dsec serve --max-upload-mb)",
        )
    } else {
        ApiError::invalid(text)
    }
}

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
            Err(rejection) => {
                let rejection: JsonRejection = rejection;
                Err(body_error(rejection.status(), rejection.body_text()))
            }
        }
    }
}

/// Builds the router.
pub fn router(state: AppState, max_upload_bytes: usize) -> Router {
    let v1 = Router::new()
        .route("/sandboxes", post(create_sandbox).get(list_sandboxes))
        .route("/sandboxes/batch", post(create_sandboxes))
        .route("/sandboxes/{id}", get(get_sandbox).delete(delete_sandbox))
        .route("/sandboxes/{id}/exec", post(exec))
        .route("/sandboxes/{id}/exec/stream", post(exec_stream))
        .route("/sandboxes/{id}/log", get(sandbox_log))
        .route(
            "/sandboxes/{id}/files",
            get(read_file).put(write_file).delete(remove_path),
        )
        .route("/sandboxes/{id}/files/list", get(list_files))
        .route("/sandboxes/{id}/files/stat", get(stat_path))
        .route("/sandboxes/{id}/files/mkdir", post(make_dir))
        .route("/sandboxes/{id}/files/move", post(move_path))
        .route("/sandboxes/{id}/files/watch", get(watch_files))
        .route("/sandboxes/{id}/pause", post(pause_sandbox))
        .route("/sandboxes/{id}/snapshot", post(snapshot_sandbox))
        .route("/sandboxes/{id}/fork", post(fork_sandbox))
        .route("/sandboxes/{id}/resume", post(resume_sandbox))
        .route("/sandboxes/{id}/network", put(set_network).get(get_network))
        .route(
            "/sandboxes/{id}/processes",
            post(processes::spawn).get(processes::list),
        )
        .route("/sandboxes/{id}/processes/{process}", get(processes::get))
        .route(
            "/sandboxes/{id}/processes/{process}/events",
            get(processes::events),
        )
        .route(
            "/sandboxes/{id}/processes/{process}/stdin",
            post(processes::stdin),
        )
        .route(
            "/sandboxes/{id}/processes/{process}/close-stdin",
            post(processes::close_stdin),
        )
        .route(
            "/sandboxes/{id}/processes/{process}/signal",
            post(processes::signal),
        )
        .route(
            "/sandboxes/{id}/processes/{process}/kill",
            post(processes::kill),
        )
        .route(
            "/sandboxes/{id}/processes/{process}/resize",
            post(processes::resize),
        )
        .route(
            "/sandboxes/{id}/processes/{process}/wait",
            post(processes::wait),
        )
        .route("/idempotency/{key}", get(sandbox_by_idempotency_key))
        .route("/images", post(import_image).get(list_images))
        .route("/images/{*name}", get(get_image).delete(delete_image))
        .route("/calls", post(call::call))
        .route("/calls/stream", post(call::call_stream))
        .route("/store", get(store_info))
        .route("/store/prune", post(prune_store))
        .route("/events", get(events::events))
        .route(
            "/projects",
            post(projects::create_project).get(projects::list_projects),
        )
        .route(
            "/projects/{name}",
            axum::routing::delete(projects::delete_project),
        )
        .route("/projects/{name}/tokens", post(projects::add_token))
        .fallback(|| async { ApiError::not_found("no such API route") });
    Router::new()
        .nest("/v1", v1)
        .merge(crate::sandboxfusion::routes())
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .route("/healthz", get(healthz))
        .layer(axum::extract::DefaultBodyLimit::max(max_upload_bytes))
        .with_state(state)
}

/// Tells who sent a request (the [`Caller`] its handlers extract), or answers `401`. On
/// the main listener and on SandboxFusion's own.
pub(crate) async fn authenticate(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let caller = match caller(&state, request.headers()) {
        Ok(caller) => caller,
        Err(e) => return e.into_response(),
    };
    let path = request.uri().path();
    if !path.starts_with("/v1/") && path != "/run_code" {
        // /metrics and /openapi.json are not scoped to a project.
        if let Err(e) = caller.require_admin(path) {
            return e.into_response();
        }
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// Who sent `headers`: the admin (the server's token, or none required), a project (one
/// of its tokens, or the admin acting for it), or nobody known (`Unauthorized`).
fn caller(state: &AppState, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let refused = match check_bearer(state.token.as_deref(), headers) {
        // The admin may act for a project: a fleet apiserver forwarding its request.
        Ok(()) => return Caller::admin_acting(headers),
        Err(e) => e,
    };
    presented_token(headers)
        .and_then(|token| state.projects.authenticate(&token))
        .ok_or(refused)
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Caller, ApiError> {
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .ok_or_else(|| ApiError::internal("route outside authentication"))
    }
}

/// The `{id}` of a sandbox route, checked to be a sandbox the caller may see (see
/// [`Edge::check_visible`]).
pub struct Visible(pub String);

impl axum::extract::FromRequestParts<AppState> for Visible {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Visible, ApiError> {
        let Path(id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::invalid(e.body_text()))?;
        let caller = Caller::from_request_parts(parts, state).await?;
        state.edge.check_visible(&caller, &id)?;
        Ok(Visible(id))
    }
}

/// The `{id}` and `{process}` of a process route, the sandbox checked as [`Visible`]'s.
pub struct VisibleProcess(pub String, pub String);

impl axum::extract::FromRequestParts<AppState> for VisibleProcess {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<VisibleProcess, ApiError> {
        let Path((id, process)) = Path::<(String, String)>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::invalid(e.body_text()))?;
        let caller = Caller::from_request_parts(parts, state).await?;
        state.edge.check_visible(&caller, &id)?;
        Ok(VisibleProcess(id, process))
    }
}

/// The token a request presents: `Authorization: Bearer TOKEN`, or Basic credentials
/// whose password is the token. Basic is what an HTTP client sends for a URL such as
/// `http://dsec:TOKEN@host/run_code`, so clients configured by a URL alone
/// (SandboxFusion's) can authenticate unmodified.
pub fn presented_token(headers: &HeaderMap) -> Option<std::borrow::Cow<'_, str>> {
    use base64::Engine;
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    if let Some(token) = value.strip_prefix("Bearer ") {
        return Some(token.into());
    }
    let encoded = value.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let pair = String::from_utf8(decoded).ok()?;
    let (_, password) = pair.split_once(':')?;
    Some(password.to_owned().into())
}

/// Refuses a request whose bearer token is not `token` (none required: every request
/// passes); the one check of dsec's API, on an edge and on an apiserver.
pub fn check_bearer(token: Option<&str>, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = token else {
        return Ok(());
    };
    let given = presented_token(headers).unwrap_or_default();
    if constant_time_eq(given.as_bytes(), token.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorKind::Unauthorized,
            "missing or wrong bearer token (set DSEC_TOKEN or pass token=)",
        ))
    }
}

/// Compares without an early exit, so response timing does not reveal the token.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[utoipa::path(get, path = "/healthz", responses((status = 200, description = "The server is up")))]
async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    state.edge.publish_gauges();
    state.edge.publish_network_metrics().await;
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}

async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandboxRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "a create retried with the same key returns the sandbox already made (200)")),
    responses((status = 201, body = SandboxInfo), (status = 200, body = SandboxInfo),
              (status = 400, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn create_sandbox(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateSandboxRequest>,
) -> Result<(StatusCode, Json<SandboxInfo>), ApiError> {
    match idempotency_key(&headers)? {
        Some(key) => {
            let (info, made) = state.edge.create_once(key, req, &caller).await?;
            let status = if made {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            Ok((status, Json(info)))
        }
        None => Ok((
            StatusCode::CREATED,
            Json(state.edge.create(req, &caller).await?),
        )),
    }
}

#[utoipa::path(post, path = "/v1/sandboxes/batch", request_body = CreateManyRequest,
    responses((status = 200, body = CreateManyResponse, description = "one item per sandbox, made or refused"),
        (status = 400, body = ErrorBody)))]
async fn create_sandboxes(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateManyRequest>,
) -> Result<Json<CreateManyResponse>, ApiError> {
    let key = idempotency_key(&headers)?;
    Ok(Json(CreateManyResponse {
        items: state.edge.create_many(key, req, &caller).await?,
    }))
}

/// The `Idempotency-Key` header of a create: a retried create with the same key returns
/// the sandbox already made (200) instead of making another.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    headers
        .get(IDEMPOTENCY_KEY)
        .map(|v| {
            v.to_str()
                .map_err(|_| ApiError::invalid("Idempotency-Key must be printable ASCII"))
        })
        .transpose()
}

/// The header naming a create's idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

#[utoipa::path(get, path = "/v1/idempotency/{key}",
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorBody)))]
async fn sandbox_by_idempotency_key(
    State(state): State<AppState>,
    caller: Caller,
    Path(key): Path<String>,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(state.edge.by_idempotency_key(&key, &caller)?))
}

#[utoipa::path(get, path = "/v1/sandboxes",
    params(("label" = Option<Vec<String>>, Query, description = "k=v; repeatable; all must match")),
    responses((status = 200, body = [SandboxInfo])))]
async fn list_sandboxes(
    State(state): State<AppState>,
    caller: Caller,
    RawQuery(query): RawQuery,
) -> Result<Json<Vec<SandboxInfo>>, ApiError> {
    let mut labels = Vec::new();
    for (key, value) in form_pairs(query.as_deref().unwrap_or_default()) {
        if key != "label" {
            continue;
        }
        let (k, v) = value.split_once('=').ok_or_else(|| {
            ApiError::invalid(format!("label filter {value:?} must look like key=value"))
        })?;
        labels.push((k.to_owned(), v.to_owned()));
    }
    Ok(Json(state.edge.list(&labels, &caller)))
}

/// Decodes `a=1&b=2`, keeping repeated keys.
fn form_pairs(query: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(query.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}",
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorBody)))]
async fn get_sandbox(
    State(state): State<AppState>,
    Visible(id): Visible,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(state.edge.get(&id)?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}",
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn delete_sandbox(
    State(state): State<AppState>,
    Visible(id): Visible,
) -> Result<StatusCode, ApiError> {
    state.edge.stop(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause",
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)))]
async fn pause_sandbox(
    State(state): State<AppState>,
    Visible(id): Visible,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(state.edge.pause(&id).await?))
}

/// `POST /v1/sandboxes/{id}/snapshot`.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct SnapshotRequest {
    /// Name of the new image; `<id>-snap-<random>` when omitted.
    #[serde(default)]
    name: Option<String>,
}

/// `POST /v1/sandboxes/{id}/fork`.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ForkRequest {
    /// How many children.
    n: i64,
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshot", request_body = SnapshotRequest,
    responses((status = 201, body = ImageInfo), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)))]
async fn snapshot_sandbox(
    State(state): State<AppState>,
    caller: Caller,
    Visible(id): Visible,
    ApiJson(req): ApiJson<SnapshotRequest>,
) -> Result<(StatusCode, Json<ImageInfo>), ApiError> {
    Ok((
        StatusCode::CREATED,
        Json(state.edge.snapshot(&id, req.name, &caller).await?),
    ))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", request_body = ForkRequest,
    responses((status = 201, body = [SandboxInfo]), (status = 400, body = ErrorBody),
              (status = 404, body = ErrorBody)))]
async fn fork_sandbox(
    State(state): State<AppState>,
    caller: Caller,
    Visible(id): Visible,
    ApiJson(req): ApiJson<ForkRequest>,
) -> Result<(StatusCode, Json<Vec<SandboxInfo>>), ApiError> {
    Ok((
        StatusCode::CREATED,
        Json(state.edge.fork(&id, req.n, &caller).await?),
    ))
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", request_body = dsec_api::SetNetworkRequest,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 503, body = ErrorBody)))]
async fn set_network(
    State(state): State<AppState>,
    Visible(id): Visible,
    ApiJson(req): ApiJson<dsec_api::SetNetworkRequest>,
) -> Result<StatusCode, ApiError> {
    state.edge.set_network(&id, &req.network).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/network",
    responses((status = 200, body = dsec_api::NetworkInfo), (status = 404, body = ErrorBody)))]
async fn get_network(
    State(state): State<AppState>,
    Visible(id): Visible,
) -> Result<Json<dsec_api::NetworkInfo>, ApiError> {
    Ok(Json(state.edge.network_info(&id).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume",
    responses((status = 200, body = SandboxInfo), (status = 404, body = ErrorBody)))]
async fn resume_sandbox(
    State(state): State<AppState>,
    Visible(id): Visible,
) -> Result<Json<SandboxInfo>, ApiError> {
    Ok(Json(state.edge.resume(&id).await?))
}

/// Output as text without a second copy when it is valid UTF-8 (the common case).
fn utf8_lossy(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// Turns output chunks into UTF-8 text without splitting a character across chunks.
#[derive(Default)]
struct Utf8Decoder {
    pending: Vec<u8>,
}

impl Utf8Decoder {
    fn push(&mut self, data: &[u8]) -> String {
        self.pending.extend_from_slice(data);
        let keep = incomplete_tail(&self.pending);
        let rest = self.pending.split_off(self.pending.len() - keep);
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending = rest;
        text
    }

    fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

/// Length of a trailing, possibly incomplete UTF-8 sequence.
fn incomplete_tail(bytes: &[u8]) -> usize {
    for back in 1..=3.min(bytes.len()) {
        let b = bytes[bytes.len() - back];
        if b & 0xC0 != 0x80 {
            let need = match b {
                0xC0..=0xDF => 2,
                0xE0..=0xEF => 3,
                0xF0..=0xF7 => 4,
                _ => 1,
            };
            return if need > back { back } else { 0 };
        }
    }
    0
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", request_body = ExecBody,
    responses((status = 200, body = CommandResult), (status = 400, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 413, body = ErrorBody)))]
async fn exec(
    State(state): State<AppState>,
    Visible(id): Visible,
    ApiJson(req): ApiJson<ExecBody>,
) -> Result<Json<CommandResult>, ApiError> {
    let started = Instant::now();
    let Execution {
        mut stream,
        replayed,
    } = state.edge.exec(&id, req).await?;
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut result = CommandResult {
        replayed,
        ..Default::default()
    };
    while let Some(event) = stream.next().await {
        match event? {
            Output::Stdout(d) => stdout.extend_from_slice(&d),
            Output::Stderr(d) => stderr.extend_from_slice(&d),
            Output::Exit(exit) => result.exit = exit,
        }
    }
    result.stdout = utf8_lossy(stdout);
    result.stderr = utf8_lossy(stderr);
    state.edge.record_exec(&id, started.elapsed().as_secs_f64());
    Ok(Json(result))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/stream", request_body = ExecBody,
    responses((status = 200, description = "NDJSON (or SSE) of StreamEvent", body = StreamEvent),
              (status = 404, body = ErrorBody)))]
async fn exec_stream(
    State(state): State<AppState>,
    Visible(id): Visible,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ExecBody>,
) -> Result<Response, ApiError> {
    let sse = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/event-stream"));
    let Execution { stream, replayed } = state.edge.exec(&id, req).await?;
    let decoders = (Utf8Decoder::default(), Utf8Decoder::default());
    let events = futures::stream::unfold(
        (Some(stream), decoders),
        |(stream, mut dec): (Option<Box<dyn OutputStream>>, (Utf8Decoder, Utf8Decoder))| async move {
            let mut stream = stream?;
            let event = match stream.next().await? {
                Ok(Output::Stdout(d)) => StreamEvent::Stdout { data: dec.0.push(&d) },
                Ok(Output::Stderr(d)) => StreamEvent::Stderr { data: dec.1.push(&d) },
                Ok(Output::Exit(exit)) => {
                    let mut tail = Vec::new();
                    for (text, is_out) in [(dec.0.finish(), true), (dec.1.finish(), false)] {
                        if !text.is_empty() {
                            tail.push(if is_out {
                                StreamEvent::Stdout { data: text }
                            } else {
                                StreamEvent::Stderr { data: text }
                            });
                        }
                    }
                    tail.push(StreamEvent::Exit {
                        exit,
                        replayed: false,
                    });
                    return Some((tail, (None, dec)));
                }
                Err(e) => {
                    let error = ErrorDetail {
                        kind: e.kind,
                        message: e.message,
                    };
                    return Some((vec![StreamEvent::Error { error }], (None, dec)));
                }
            };
            Some((vec![event], (Some(stream), dec)))
        },
    )
    .flat_map(futures::stream::iter)
    .map(move |mut event| {
        if let StreamEvent::Exit { replayed: r, .. } = &mut event {
            *r = replayed;
        }
        let json = serde_json::to_string(&event).expect("events serialize");
        let line = if sse {
            format!("data: {json}\n\n")
        } else {
            format!("{json}\n")
        };
        Ok::<_, Infallible>(Bytes::from(line))
    });
    Ok(streamed(sse, Body::from_stream(events)))
}

/// A streamed answer: server-sent events when the client asked for them, else NDJSON;
/// never cached.
fn streamed(sse: bool, body: Body) -> Response {
    let content_type = if sse {
        "text/event-stream"
    } else {
        "application/x-ndjson"
    };
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

#[derive(Deserialize, utoipa::IntoParams)]
struct LogQuery {
    /// Only the steps of this trajectory.
    trajectory_id: Option<String>,
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/log", params(LogQuery),
    responses((status = 200, description = "The sandbox and its recorded commands, in order",
               body = dsec_trajectory::SandboxLog),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn sandbox_log(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    query: Result<Query<LogQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<dsec_trajectory::SandboxLog>, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    Ok(Json(
        state
            .edge
            .sandbox_log(&caller, &id, q.trajectory_id)
            .await?,
    ))
}

#[derive(Deserialize, utoipa::IntoParams)]
struct PathQuery {
    /// Absolute path inside the sandbox.
    path: String,
    /// Permission bits for a written file (decimal, e.g. 420 for 0644).
    mode: Option<u32>,
    /// Do it as this user of the sandbox (as a command's `user`; default root).
    user: Option<String>,
}

#[derive(Deserialize, utoipa::IntoParams)]
struct ListQuery {
    /// Absolute path of a directory inside the sandbox.
    path: String,
    /// Levels listed (default 1: the directory's own entries).
    depth: Option<u32>,
    /// Do it as this user of the sandbox (as a command's `user`; default root).
    user: Option<String>,
}

#[derive(Deserialize, utoipa::IntoParams)]
struct RemoveQuery {
    /// Absolute path inside the sandbox.
    path: String,
    /// Remove a directory with everything in it (default false).
    recursive: Option<bool>,
    /// Do it as this user of the sandbox (as a command's `user`; default root).
    user: Option<String>,
}

#[derive(Deserialize, utoipa::IntoParams)]
struct WatchQuery {
    /// Absolute path of a directory inside the sandbox.
    path: String,
    /// Watch the directories below it too, and those made later (default false).
    recursive: Option<bool>,
}

/// How often an idle watch stream gets a blank line: a client that went away is noticed
/// by the next one, and its watch ended in the sandbox.
const WATCH_HEARTBEAT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Deserialize, utoipa::IntoParams)]
struct StatQuery {
    /// Absolute path inside the sandbox.
    path: String,
    /// Do it as this user of the sandbox (as a command's `user`; default root).
    user: Option<String>,
}

fn path_query<Q>(
    query: Result<Query<Q>, axum::extract::rejection::QueryRejection>,
) -> Result<Q, ApiError> {
    query
        .map(|Query(q)| q)
        .map_err(|e| ApiError::invalid(e.body_text()))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", params(PathQuery),
    responses((status = 200, description = "The file's bytes", content_type = "application/octet-stream"),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 503, body = ErrorBody)))]
async fn read_file(
    State(state): State<AppState>,
    Visible(id): Visible,
    query: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = path_query(query)?;
    let mut file = state
        .edge
        .read_file(&id, &q.path, q.user.as_deref())
        .await?;
    // The first chunk comes with the open. A file it holds whole is sent with its length;
    // a larger one is streamed chunked, each chunk asked of the sandbox when the client
    // took the last (the sandbox may be rewriting the file: its size is no promise).
    let first = file.next().await.transpose()?.unwrap_or_default();
    let body = if file.finished() {
        Body::from(first)
    } else {
        let rest = futures::stream::unfold(file, |mut file| async move {
            let chunk = file.next().await?;
            Some((chunk.map_err(|e| std::io::Error::other(e.message)), file))
        });
        Body::from_stream(futures::stream::once(async { Ok(first) }).chain(rest))
    };
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response())
}

#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", params(PathQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 413, body = ErrorBody),
              (status = 503, body = ErrorBody)))]
async fn write_file(
    State(state): State<AppState>,
    Visible(id): Visible,
    query: Result<Query<PathQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let q = path_query(query)?;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    let upload = Upload::new(body.into_data_stream(), declared);
    match state
        .edge
        .write_file(
            &id,
            &q.path,
            upload,
            q.mode.unwrap_or(0o644),
            q.user.as_deref(),
        )
        .await
    {
        Ok(()) => Ok(StatusCode::NO_CONTENT.into_response()),
        Err(e) => Ok(closing(e.into_response())),
    }
}

/// A refused upload's answer says `Connection: close`. Part of the body may still be on
/// its way; hyper closes the connection rather than read it, and without the header a
/// client that keeps the connection would lose the next request it sends on it.
fn closing(mut response: Response) -> Response {
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", params(ListQuery),
    responses((status = 200, body = [FileInfo]), (status = 404, body = ErrorBody)))]
async fn list_files(
    State(state): State<AppState>,
    Visible(id): Visible,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<FileInfo>>, ApiError> {
    let q = path_query(query)?;
    let depth = q.depth.unwrap_or(1);
    Ok(Json(
        state
            .edge
            .list_files(&id, &q.path, depth, q.user.as_deref())
            .await?,
    ))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", params(StatQuery),
    responses((status = 200, body = FileInfo), (status = 400, body = ErrorBody),
              (status = 404, body = ErrorBody)))]
async fn stat_path(
    State(state): State<AppState>,
    Visible(id): Visible,
    query: Result<Query<StatQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<FileInfo>, ApiError> {
    let q = path_query(query)?;
    Ok(Json(
        state.edge.stat(&id, &q.path, q.user.as_deref()).await?,
    ))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", request_body = MakeDirRequest,
    responses((status = 200, body = MakeDirResponse), (status = 400, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn make_dir(
    State(state): State<AppState>,
    Visible(id): Visible,
    ApiJson(req): ApiJson<MakeDirRequest>,
) -> Result<Json<MakeDirResponse>, ApiError> {
    let user = req.user;
    let req = crate::backend::MakeDir {
        path: req.path,
        mode: req.mode.unwrap_or(0o755) & 0o7777,
        parents: req.parents,
        exist_ok: req.exist_ok,
    };
    let created = state.edge.make_dir(&id, req, user.as_deref()).await?;
    Ok(Json(MakeDirResponse { created }))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/move", request_body = MoveRequest,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)))]
async fn move_path(
    State(state): State<AppState>,
    Visible(id): Visible,
    ApiJson(req): ApiJson<MoveRequest>,
) -> Result<StatusCode, ApiError> {
    let user = req.user;
    let req = crate::backend::MovePath {
        src: req.src,
        dst: req.dst,
        overwrite: req.overwrite,
    };
    state.edge.move_path(&id, req, user.as_deref()).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Watches a directory: NDJSON, a first line `{"kind": "watching", "path": ...}` once the
/// watch is armed, then one line per event `{"kind", "path", "is_dir"}`; the answer ends
/// when the directory goes away.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/watch", params(WatchQuery),
    responses((status = 200, description = "NDJSON watch events", content_type = "application/x-ndjson"),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)))]
async fn watch_files(
    State(state): State<AppState>,
    Visible(id): Visible,
    query: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = path_query(query)?;
    let watch = state
        .edge
        .watch(&id, &q.path, q.recursive.unwrap_or(false))
        .await?;
    let armed = serde_json::json!({"kind": "watching", "path": q.path, "is_dir": true});
    let mut armed = serde_json::to_vec(&armed).expect("JSON serializes");
    armed.push(b'\n');
    let events = futures::stream::unfold(Some(watch), |watch| async move {
        let mut watch = watch?;
        match tokio::time::timeout(WATCH_HEARTBEAT, watch.next()).await {
            Err(_) => Some((Ok(axum::body::Bytes::from_static(b"\n")), Some(watch))),
            Ok(Some(Ok(batch))) => {
                let mut lines = Vec::new();
                for event in batch {
                    lines.extend(serde_json::to_vec(&event).expect("an event serializes"));
                    lines.push(b'\n');
                }
                Some((Ok(axum::body::Bytes::from(lines)), Some(watch)))
            }
            Ok(Some(Err(e))) => Some((Err(std::io::Error::other(e.message)), None)),
            Ok(None) => None,
        }
    });
    let first = futures::stream::once(async move { Ok(axum::body::Bytes::from(armed)) });
    let body = Body::from_stream(first.chain(events));
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response())
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", params(RemoveQuery),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn remove_path(
    State(state): State<AppState>,
    Visible(id): Visible,
    query: Result<Query<RemoveQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<StatusCode, ApiError> {
    let q = path_query(query)?;
    let req = crate::backend::RemovePath {
        path: q.path,
        recursive: q.recursive.unwrap_or(false),
    };
    state.edge.remove_path(&id, req, q.user.as_deref()).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Imports an image. A client that accepts `application/x-ndjson` gets the progress as
/// it happens, one [`ImportEvent`] per line, ending with `done` or `error`.
#[utoipa::path(post, path = "/v1/images", request_body = ImportImageRequest,
    responses((status = 201, body = ImageInfo), (status = 400, body = ErrorBody)))]
async fn import_image(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ImportImageRequest>,
) -> Result<Response, ApiError> {
    let progress = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/x-ndjson"));
    if !progress {
        let image = state
            .edge
            .import_image(&req.source, req.name.as_deref(), &caller, Arc::new(|_| {}))
            .await?;
        return Ok((StatusCode::CREATED, Json(image)).into_response());
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let events = tx.clone();
    let report = Arc::new(move |p: dsec_image::ImportProgress| {
        let event = match p {
            dsec_image::ImportProgress::Layers(total) => ImportEvent::Layers { total },
            dsec_image::ImportProgress::LayerDone {
                diff_id,
                size,
                reused,
            } => ImportEvent::Layer {
                diff_id,
                size,
                reused,
            },
        };
        let _ = events.send(event);
    });
    tokio::spawn(async move {
        let end = match state
            .edge
            .import_image(&req.source, req.name.as_deref(), &caller, report)
            .await
        {
            Ok(image) => ImportEvent::Done { image },
            Err(e) => ImportEvent::Error {
                error: ErrorDetail {
                    kind: e.kind,
                    message: e.message,
                },
            },
        };
        let _ = tx.send(end);
    });
    let lines = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(|event| {
        let json = serde_json::to_string(&event).expect("events serialize");
        Ok::<_, Infallible>(Bytes::from(format!("{json}\n")))
    });
    Ok((
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(lines),
    )
        .into_response())
}

#[utoipa::path(get, path = "/v1/store", responses((status = 200, body = StoreInfo)))]
async fn store_info(State(state): State<AppState>) -> Result<Json<StoreInfo>, ApiError> {
    Ok(Json(state.edge.store_info().await?))
}

/// Collects image garbage now (the server also does it every minute).
#[utoipa::path(post, path = "/v1/store/prune", responses((status = 200, body = PruneResult)))]
async fn prune_store(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<PruneResult>, ApiError> {
    caller.require_admin("pruning the image store")?;
    Ok(Json(state.edge.prune_images().await?))
}

#[utoipa::path(get, path = "/v1/images", responses((status = 200, body = [ImageInfo])))]
async fn list_images(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<Vec<ImageInfo>>, ApiError> {
    Ok(Json(state.edge.images(&caller)?))
}

#[utoipa::path(get, path = "/v1/images/{name}",
    responses((status = 200, body = ImageInfo), (status = 404, body = ErrorBody)))]
async fn get_image(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Json<ImageInfo>, ApiError> {
    Ok(Json(state.edge.image(&name, &caller).await?))
}

#[utoipa::path(delete, path = "/v1/images/{name}",
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn delete_image(
    State(state): State<AppState>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.edge.delete_image(&name, &caller).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "dsec",
        description = "Elastic sandboxes for training and evaluating AI agents"
    ),
    paths(
        healthz,
        pause_sandbox,
        resume_sandbox,
        set_network,
        get_network,
        snapshot_sandbox,
        fork_sandbox,
        create_sandbox,
        create_sandboxes,
        list_sandboxes,
        get_sandbox,
        sandbox_by_idempotency_key,
        delete_sandbox,
        exec,
        exec_stream,
        sandbox_log,
        read_file,
        write_file,
        list_files,
        stat_path,
        make_dir,
        move_path,
        remove_path,
        watch_files,
        import_image,
        list_images,
        get_image,
        delete_image,
        store_info,
        prune_store,
        call::call,
        call::call_stream,
        events::events,
        projects::create_project,
        projects::list_projects,
        projects::delete_project,
        projects::add_token,
        processes::spawn,
        processes::list,
        processes::get,
        processes::events,
        processes::stdin,
        processes::close_stdin,
        processes::signal,
        processes::kill,
        processes::resize,
        processes::wait
    ),
    components(schemas(crate::events::Event))
)]
struct ApiDoc;

/// The OpenAPI document, for `dsec` tooling and tests.
pub fn openapi_json() -> String {
    ApiDoc::openapi()
        .to_pretty_json()
        .expect("openapi serializes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_decoder_never_splits_a_character() {
        let text = "héllo wörld €";
        let bytes = text.as_bytes();
        for cut in 0..bytes.len() {
            let mut d = Utf8Decoder::default();
            let joined = d.push(&bytes[..cut]) + &d.push(&bytes[cut..]) + &d.finish();
            assert_eq!(joined, text, "cut at {cut}");
        }
    }

    #[test]
    fn query_pairs_keep_repeats_and_decode() {
        assert_eq!(
            form_pairs("label=a%3D1&label=b=2&x"),
            vec![
                ("label".into(), "a=1".into()),
                ("label".into(), "b=2".into()),
                ("x".into(), "".into())
            ]
        );
    }

    #[test]
    fn openapi_lists_every_route() {
        let doc = openapi_json();
        for route in [
            "/v1/sandboxes/{id}/exec/stream",
            "/v1/sandboxes/batch",
            "/v1/sandboxes/{id}/network",
            "/v1/sandboxes/{id}/log",
            "/v1/sandboxes/{id}/processes/{process}/events",
            "/v1/images/{name}",
            "/v1/projects/{name}/tokens",
            "/healthz",
        ] {
            assert!(doc.contains(route), "{route} missing");
        }
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }

    #[test]
    fn tokens_come_as_bearer_or_as_a_urls_password() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::AUTHORIZATION, value.parse().unwrap());
            presented_token(&headers).map(|t| t.into_owned())
        };
        assert_eq!(with("Bearer t0k").as_deref(), Some("t0k"));
        // `http://dsec:t0k@host/` as requests and aiohttp send it.
        assert_eq!(with("Basic ZHNlYzp0MGs=").as_deref(), Some("t0k"));
        // A password may hold colons; the user name may not (RFC 7617).
        assert_eq!(with("Basic dTphOmI=").as_deref(), Some("a:b"));
        assert_eq!(with("Basic not-base64!"), None);
        assert_eq!(with("Digest x"), None);
        assert_eq!(presented_token(&HeaderMap::new()), None);
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, "Basic ZHNlYzp0MGs=".parse().unwrap());
        assert!(check_bearer(Some("t0k"), &headers).is_ok());
        assert!(check_bearer(Some("other"), &headers).is_err());
    }
}
