//! One envd-compatible endpoint for every sandbox (what E2B runs inside each VM, served
//! here by dsec from outside): requests name their sandbox in `E2b-Sandbox-Id` (or in the
//! host, `49983-<id>.<domain>`), as E2B's own proxy routes them.
//!
//! - `GET /health`: 204, or 502 ("… was not found") when the sandbox is unknown, stopped
//!   or paused — the SDK's `is_running()` reads exactly that;
//! - `GET /files`, `POST /files` (multipart or octet-stream, gzip): the sandbox's files;
//! - `POST /process.Process/*`, `POST /filesystem.Filesystem/*`: the Connect services.
//!
//! Authentication as envd's: once a sandbox has an access token (every sandbox created
//! through E2B does), each request must carry it in `X-Access-Token`, except `/health`
//! and `/files`, which take a signed URL instead (`v1_` + base64 of
//! sha256("path:operation:username:token[:expiration]")). dsec's own token is accepted
//! everywhere, and is the only credential of sandboxes made through dsec's API.
//!
//! The user of a request (`Authorization: Basic base64("<user>:")`, or `username=`) is the
//! user commands and file operations run as; relative paths are that user's home's.

// The checks of a request return the reply that refuses it, once per request, straight to
// the handler: boxing it would only add an allocation to every refusal.
#![expect(clippy::result_large_err, reason = "the error is the reply itself")]

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Multipart, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::Digest;

use super::connect::{self, Code, ConnectError, MessageStream};
use super::proto::{
    Empty, EntryInfo, EntryResponse, EventType, FileType, FilesystemEvent, ListDirRequest,
    ListDirResponse, MoveRequest, PathRequest, WatchDirRequest, WatchDirResponse, WatcherRequest,
};
use super::{E2b, E2bSandbox, DEBUG_SANDBOX_ID};
use crate::backend::{FileRead, Upload};
use crate::error::ApiError;
use dsec_runtime::files::watch::{WatchEvent, WatchEventKind};

/// The envd endpoint's routes.
pub fn router(e2b: Arc<E2b>) -> Router {
    let max_upload = e2b.max_upload_bytes;
    Router::new()
        .route("/health", get(health))
        .route("/files", get(read_file).post(write_files))
        .route("/process.Process/{method}", post(super::process::rpc))
        .route("/filesystem.Filesystem/{method}", post(filesystem_rpc))
        .fallback(|| async { http_error(StatusCode::NOT_FOUND, "no such envd route in dsec") })
        .layer(axum::extract::DefaultBodyLimit::max(max_upload))
        .with_state(e2b)
}

/// envd's plain HTTP error: `{"code": <status>, "message": ...}`.
pub fn http_error(status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    if status.is_server_error() && status != StatusCode::BAD_GATEWAY {
        tracing::error!(status = %status, message = %message, "envd error");
    }
    (
        status,
        Json(serde_json::json!({"code": status.as_u16(), "message": message})),
    )
        .into_response()
}

fn api_http_error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    http_error(status, e.message)
}

/// The id of the sandbox a request names (`E2b-Sandbox-Id`, else the host), or the 400
/// saying it names none.
pub fn requested_sandbox(headers: &HeaderMap) -> Result<String, Response> {
    headers
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| sandbox_from_host(headers))
        .ok_or_else(|| {
            http_error(
                StatusCode::BAD_REQUEST,
                "no sandbox named: send the E2b-Sandbox-Id header (the e2b SDK does when \
                 E2B_SANDBOX_URL points here)",
            )
        })
}

/// The 502 E2B's proxy answers for a sandbox it cannot reach (`is_running()` reads it).
fn unreachable_sandbox(id: &str, why: &str) -> Response {
    http_error(
        StatusCode::BAD_GATEWAY,
        format!("sandbox {id:?} was not found: {why}"),
    )
}

/// The sandbox a request is for, or the 502 E2B's proxy answers for one it cannot reach.
async fn target(e2b: &E2b, headers: &HeaderMap) -> Result<E2bSandbox, Response> {
    let mut id = requested_sandbox(headers)?;
    if id == DEBUG_SANDBOX_ID {
        id = e2b.debug_sandbox().await.map_err(api_http_error)?;
    }
    let not_found = || unreachable_sandbox(&id, "it was killed, timed out, or never existed");
    let sandbox = e2b.get(&id).map_err(|_| not_found())?;
    if matches!(
        sandbox.info.state,
        dsec_api::SandboxState::Stopping | dsec_api::SandboxState::Stopped
    ) {
        return Err(not_found());
    }
    Ok(sandbox)
}

/// `<port>-<sandbox id>.<domain>`, the host form of E2B's sandbox URLs.
fn sandbox_from_host(headers: &HeaderMap) -> Option<String> {
    let host = headers.get(header::HOST)?.to_str().ok()?;
    let label = host.split('.').next()?;
    let (port, id) = label.split_once('-')?;
    (port.bytes().all(|b| b.is_ascii_digit()) && !id.is_empty()).then(|| id.to_owned())
}

/// Whether the request carries a token of the sandbox's (its own, or dsec's).
fn token_ok(e2b: &E2b, sandbox: &E2bSandbox, given: Option<&str>) -> bool {
    let tokens: Vec<&str> = [sandbox.access_token.as_deref(), e2b.token.as_deref()]
        .into_iter()
        .flatten()
        .collect();
    tokens.is_empty()
        || given.is_some_and(|g| {
            tokens
                .iter()
                .any(|t| crate::api::constant_time_eq(g.as_bytes(), t.as_bytes()))
        })
}

fn access_token(headers: &HeaderMap) -> Option<&str> {
    headers.get("x-access-token").and_then(|v| v.to_str().ok())
}

/// A sandbox that may take requests now: authenticated, and running.
async fn authorized(e2b: &E2b, headers: &HeaderMap) -> Result<E2bSandbox, Response> {
    let sandbox = target(e2b, headers).await?;
    if !token_ok(e2b, &sandbox, access_token(headers)) {
        return Err(http_error(
            StatusCode::UNAUTHORIZED,
            "unauthorized access, please provide a valid access token (X-Access-Token: the \
             envdAccessToken the sandbox was created with)",
        ));
    }
    running(e2b, sandbox).await
}

/// A paused sandbox is resumed for the request when it has auto-resume (its timeout
/// starting again), else refused as E2B's proxy refuses it.
async fn running(e2b: &E2b, sandbox: E2bSandbox) -> Result<E2bSandbox, Response> {
    check_running(&sandbox)?;
    if sandbox.paused() {
        return e2b
            .auto_resume(&sandbox.info.id)
            .await
            .map_err(api_http_error);
    }
    Ok(sandbox)
}

fn check_running(sandbox: &E2bSandbox) -> Result<(), Response> {
    if sandbox.paused() && !sandbox.auto_resume {
        return Err(http_error(
            StatusCode::BAD_GATEWAY,
            format!(
                "sandbox {:?} was not found running: it is paused; Sandbox.connect resumes it",
                sandbox.info.id
            ),
        ));
    }
    Ok(())
}

async fn health(State(e2b): State<Arc<E2b>>, headers: HeaderMap) -> Response {
    match target(&e2b, &headers).await {
        Ok(sandbox) if sandbox.paused() => check_running(&sandbox)
            .err()
            .unwrap_or_else(|| StatusCode::NO_CONTENT.into_response()),
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(response) => response,
    }
}

// ------------------------------------------------------------------ users and paths

/// Who a request acts as, and where its relative paths start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct EnvdUser {
    pub(super) name: String,
    pub(super) home: String,
}

impl EnvdUser {
    fn root() -> EnvdUser {
        EnvdUser {
            name: "root".to_owned(),
            home: "/root".to_owned(),
        }
    }

    /// The `user` dsec's file operations run as: `None` for root.
    pub(super) fn files_as(&self) -> Option<&str> {
        Some(self.name.as_str()).filter(|n| *n != "root")
    }
}

/// The user a request names (`Authorization: Basic base64("<user>:")` or `username=`);
/// `None` for root, the default.
fn requested_user(
    headers: &HeaderMap,
    username: Option<&str>,
) -> Result<Option<String>, ConnectError> {
    let from_header = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .map(|b64| {
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .ok()
                .and_then(|raw| String::from_utf8(raw).ok())
                .map(|pair| pair.split(':').next().unwrap_or_default().to_owned())
                .ok_or_else(|| {
                    ConnectError::invalid("Authorization must be Basic base64(\"<user>:\")")
                })
        })
        .transpose()?;
    Ok(username
        .map(str::to_owned)
        .or(from_header)
        .filter(|n| !n.is_empty() && n != "root"))
}

/// The request's user, with the home its relative paths start at: another user than
/// root is looked up in the sandbox's own `/etc/passwd` (as dsec's `user=` does for the
/// commands it runs), and one that is not there is an `invalid_argument`.
async fn request_user(
    e2b: &E2b,
    sandbox: &E2bSandbox,
    headers: &HeaderMap,
    username: Option<&str>,
) -> Result<EnvdUser, ConnectError> {
    let Some(name) = requested_user(headers, username)? else {
        return Ok(EnvdUser::root());
    };
    let account = e2b
        .edge()
        .account(&sandbox.info.id, &name)
        .await
        .map_err(ConnectError::from)?;
    Ok(EnvdUser {
        name,
        home: account.home,
    })
}

/// An absolute, normalised path: `~` and relative paths start at the user's home; `.`
/// and `..` are resolved by name (the sandbox confines the result).
pub(super) fn resolve_path(path: &str, user: &EnvdUser) -> Result<String, ConnectError> {
    if path.contains('\0') {
        return Err(ConnectError::invalid("path must not contain NUL"));
    }
    let joined = if path == "~" {
        user.home.clone()
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{}/{rest}", user.home)
    } else if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("{}/{path}", user.home)
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in joined.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

// ------------------------------------------------------------------ Connect services

/// The call's body: whole for unary calls, one envelope for server streams.
async fn read_message(body: Body, streaming: bool, limit: usize) -> Result<Bytes, ConnectError> {
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|e| {
        ConnectError::new(
            Code::ResourceExhausted,
            format!("request body over {limit} bytes: {e}"),
        )
    })?;
    if !streaming {
        return Ok(bytes);
    }
    let mut decoder = connect::EnvelopeDecoder::new(limit);
    decoder.push(&bytes);
    let message = decoder
        .next_message()?
        .ok_or_else(|| ConnectError::invalid("the request stream holds no message"))?;
    decoder.finish()?;
    Ok(message)
}

/// Most of a request body read before an early error reply.
const DRAIN_LIMIT: usize = 64 << 10;

/// Reads what is left of a (small) request body before an early error reply: the e2b SDK
/// streams request bodies, and a client still sending one would see the connection
/// closed instead of the reply.
pub async fn drained(body: Body, response: Response) -> Response {
    match axum::body::to_bytes(body, DRAIN_LIMIT).await {
        Ok(_) => response,
        Err(_) => closing(response),
    }
}

/// Marks a reply after which the request body is left unread: the connection then closes,
/// and the client must know not to send its next request on it.
pub(super) fn closing(mut response: Response) -> Response {
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

/// What every Connect call shares: the checked sandbox, user and deadline.
pub(super) struct Call {
    pub(super) sandbox: E2bSandbox,
    pub(super) user: EnvdUser,
    pub(super) deadline: Option<tokio::time::Instant>,
    pub(super) keepalive: Option<std::time::Duration>,
}

/// A failure in the call's own form: a stream's end frame, or a unary error.
pub(super) fn call_error(e: &ConnectError, streaming: bool) -> Response {
    if streaming {
        connect::stream_error(e)
    } else {
        e.clone().into_response()
    }
}

/// A Connect call's checked sandbox, user and deadline; else the reply refusing it (its
/// request body left for the caller to drain).
pub(super) async fn checked_call(
    e2b: &E2b,
    headers: &HeaderMap,
    streaming: bool,
) -> Result<Call, Response> {
    let fail = |e: ConnectError| call_error(&e, streaming);
    connect::check_content_type(headers, streaming)?;
    let sandbox = authorized(e2b, headers).await?;
    let user = request_user(e2b, &sandbox, headers, None)
        .await
        .map_err(fail)?;
    let deadline = connect::deadline(headers).map_err(fail)?;
    Ok(Call {
        sandbox,
        user,
        deadline,
        keepalive: connect::keepalive_interval(headers),
    })
}

/// A Connect call's checked sandbox, user and deadline, and its request message (one,
/// whole); else the reply refusing it, in the call's own form.
pub(super) async fn call(
    e2b: &E2b,
    headers: &HeaderMap,
    body: Body,
    streaming: bool,
) -> Result<(Call, Bytes), Response> {
    let call = match checked_call(e2b, headers, streaming).await {
        Ok(call) => call,
        Err(response) => return Err(drained(body, response).await),
    };
    let message = read_message(body, streaming, e2b.max_upload_bytes)
        .await
        .map_err(|e| call_error(&e, streaming))?;
    Ok((call, message))
}

/// A unary call with its deadline applied.
pub(super) async fn unary<M: Serialize>(
    deadline: Option<tokio::time::Instant>,
    work: impl std::future::Future<Output = Result<M, ConnectError>>,
) -> Response {
    let result = match deadline {
        Some(d) => tokio::time::timeout_at(d, work).await.unwrap_or_else(|_| {
            Err(ConnectError::new(
                Code::DeadlineExceeded,
                "the call's deadline (Connect-Timeout-Ms) passed",
            ))
        }),
        None => work.await,
    };
    match result {
        Ok(message) => connect::unary_response(&message),
        Err(e) => e.into_response(),
    }
}

pub(super) fn unknown_method(service: &str, method: &str, streaming: bool) -> Response {
    let e = ConnectError::unimplemented(format!("{service}/{method} is not a method of envd"));
    if streaming {
        connect::stream_error(&e)
    } else {
        e.into_response()
    }
}

async fn filesystem_rpc(
    State(e2b): State<Arc<E2b>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let streaming = method == "WatchDir";
    let (call, message) = match call(&e2b, &headers, body, streaming).await {
        Ok(c) => c,
        Err(response) => return response,
    };
    match method.as_str() {
        "ListDir" => {
            unary(call.deadline, async {
                let req: ListDirRequest = connect::decode("ListDirRequest", &message)?;
                list_dir(&e2b, &call, req).await
            })
            .await
        }
        "Stat" => {
            unary(call.deadline, async {
                let req: PathRequest = connect::decode("PathRequest", &message)?;
                stat(&e2b, &call, req).await
            })
            .await
        }
        "MakeDir" => {
            unary(call.deadline, async {
                let req: PathRequest = connect::decode("MakeDirRequest", &message)?;
                make_dir(&e2b, &call, req).await
            })
            .await
        }
        "Move" => {
            unary(call.deadline, async {
                let req: MoveRequest = connect::decode("MoveRequest", &message)?;
                move_path(&e2b, &call, req).await
            })
            .await
        }
        "Remove" => {
            unary(call.deadline, async {
                let req: PathRequest = connect::decode("RemoveRequest", &message)?;
                remove(&e2b, &call, req).await
            })
            .await
        }
        "WatchDir" => {
            let req: WatchDirRequest = match connect::decode("WatchDirRequest", &message) {
                Ok(r) => r,
                Err(e) => return connect::stream_error(&e),
            };
            match watch_dir(&e2b, &call, req).await {
                Ok(events) => connect::stream_response(
                    events,
                    call.deadline,
                    call.keepalive
                        .map(|every| (every, || WatchDirResponse::Keepalive(Empty {}))),
                ),
                Err(e) => connect::stream_error(&e),
            }
        }
        "CreateWatcher" => {
            unary(call.deadline, async {
                let req: WatchDirRequest = connect::decode("CreateWatcherRequest", &message)?;
                create_watcher(&e2b, &call, req).await
            })
            .await
        }
        "GetWatcherEvents" => {
            unary(call.deadline, async {
                let req: WatcherRequest = connect::decode("GetWatcherEventsRequest", &message)?;
                e2b.watchers
                    .take_events(&call.sandbox.info.id, &req.watcher_id)
            })
            .await
        }
        "RemoveWatcher" => {
            unary(call.deadline, async {
                let req: WatcherRequest = connect::decode("RemoveWatcherRequest", &message)?;
                e2b.watchers.remove(&call.sandbox.info.id, &req.watcher_id)
            })
            .await
        }
        other => unknown_method("filesystem.Filesystem", other, streaming),
    }
}

/// A dsec watch event as envd names it: the path relative to the watched directory;
/// `None` for what envd has no type for (an overflow).
fn filesystem_event(dir: &str, ev: WatchEvent) -> Option<FilesystemEvent> {
    let event_type = match ev.kind {
        WatchEventKind::Create => EventType::Create,
        WatchEventKind::Write => EventType::Write,
        WatchEventKind::Remove => EventType::Remove,
        WatchEventKind::Rename => EventType::Rename,
        WatchEventKind::Chmod => EventType::Chmod,
        WatchEventKind::Overflow => return None,
    };
    let prefix = format!("{}/", dir.trim_end_matches('/'));
    let name = ev.path.strip_prefix(&prefix).unwrap_or(&ev.path).to_owned();
    Some(FilesystemEvent {
        name,
        event_type,
        entry: None,
    })
}

/// How a watch's events are told: relative to `dir`, and with `entries`, each with its
/// path's entry (`include_entry`).
#[derive(Clone)]
struct WatchEvents {
    dir: String,
    entries: Option<EntryLookup>,
}

/// Looks up the entries of a watch's events, in the watch's sandbox, as its user.
#[derive(Clone)]
struct EntryLookup {
    e2b: Arc<E2b>,
    sandbox: String,
    user: Option<String>,
}

impl WatchEvents {
    fn new(e2b: &Arc<E2b>, call: &Call, dir: String, req: &WatchDirRequest) -> WatchEvents {
        let entries = req.include_entry.then(|| EntryLookup {
            e2b: Arc::clone(e2b),
            sandbox: call.sandbox.info.id.clone(),
            user: call.user.files_as().map(str::to_owned),
        });
        WatchEvents { dir, entries }
    }

    /// A batch as envd sends it: with entries asked, each event's path is looked up as
    /// the event is handled (as envd stats it), so a path removed or moved away, or gone
    /// by then, has none.
    async fn tell(&self, batch: Vec<WatchEvent>) -> Vec<FilesystemEvent> {
        let mut told = Vec::with_capacity(batch.len());
        for ev in batch {
            let path = ev.path.clone();
            let Some(mut event) = filesystem_event(&self.dir, ev) else {
                continue;
            };
            if let Some(lookup) = &self.entries {
                if !matches!(event.event_type, EventType::Remove | EventType::Rename) {
                    event.entry = lookup
                        .e2b
                        .edge()
                        .stat(&lookup.sandbox, &path, lookup.user.as_deref())
                        .await
                        .ok()
                        .map(|f| Box::new(entry_info(path, f)));
                }
            }
            told.push(event);
        }
        told
    }
}

/// `WatchDir`: dsec's watch as a stream, `start` first once it is armed.
///
/// `allow_network_mounts` changes nothing: envd refuses a directory on a network
/// filesystem unless it is set, and dsec's files API never serves one (NFS, CIFS, FUSE...
/// are not among `dsec_runtime::files::ALLOWED_FILESYSTEMS`), so such a watch is refused
/// either way, saying which filesystem it is on.
async fn watch_dir(
    e2b: &Arc<E2b>,
    call: &Call,
    req: WatchDirRequest,
) -> Result<MessageStream<WatchDirResponse>, ConnectError> {
    let dir = resolve_path(&req.path, &call.user)?;
    let watch = e2b
        .edge()
        .watch(&call.sandbox.info.id, &dir, req.recursive)
        .await?;
    let told = WatchEvents::new(e2b, call, dir, &req);
    let started = futures::stream::once(async { Ok(WatchDirResponse::Start(Empty {})) });
    let events = futures::stream::unfold(watch, |mut watch| async move {
        let batch = watch.next().await?;
        Some((batch, watch))
    })
    .then(move |batch| {
        let told = told.clone();
        async move {
            let messages: Vec<Result<WatchDirResponse, ConnectError>> = match batch {
                Ok(events) => told
                    .tell(events)
                    .await
                    .into_iter()
                    .map(|ev| Ok(WatchDirResponse::Filesystem(ev)))
                    .collect(),
                Err(e) => vec![Err(e.into())],
            };
            futures::stream::iter(messages)
        }
    })
    .flatten();
    Ok(Box::pin(started.chain(events)))
}

/// `CreateWatcher`: dsec's watch, its events gathered until `GetWatcherEvents` takes them.
async fn create_watcher(
    e2b: &Arc<E2b>,
    call: &Call,
    req: WatchDirRequest,
) -> Result<serde_json::Value, ConnectError> {
    let dir = resolve_path(&req.path, &call.user)?;
    let sandbox = call.sandbox.info.id.clone();
    let watch = e2b.edge().watch(&sandbox, &dir, req.recursive).await?;
    let told = WatchEvents::new(e2b, call, dir, &req);
    let id = e2b.watchers.add(sandbox, told, watch);
    Ok(serde_json::json!({ "watcherId": id }))
}

/// Events a polling watcher keeps between two `GetWatcherEvents`; older ones are dropped.
const MAX_WATCHER_EVENTS: usize = 10_000;

type EventQueue = Arc<std::sync::Mutex<std::collections::VecDeque<FilesystemEvent>>>;

/// The polling watchers (`CreateWatcher`), by id.
#[derive(Default)]
pub(super) struct Watchers(std::sync::Mutex<std::collections::HashMap<String, Watcher>>);

struct Watcher {
    sandbox: String,
    events: EventQueue,
    /// Gathers the watch's events; aborted (ending the watch) when the watcher goes.
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Watchers {
    fn add(
        &self,
        sandbox: String,
        told: WatchEvents,
        mut watch: Box<dyn crate::backend::FileWatch>,
    ) -> String {
        let events = EventQueue::default();
        let gathered = Arc::clone(&events);
        let task = tokio::spawn(async move {
            while let Some(Ok(batch)) = watch.next().await {
                let batch = told.tell(batch).await;
                let mut queue = gathered.lock().expect("watcher lock");
                queue.extend(batch);
                while queue.len() > MAX_WATCHER_EVENTS {
                    queue.pop_front();
                }
            }
        });
        let id = super::new_token();
        let mut all = self.0.lock().expect("watchers lock");
        // Watchers whose watch ended (their sandbox went) and whose events were taken are
        // forgotten.
        all.retain(|_, w| {
            !w.task.is_finished() || !w.events.lock().expect("watcher lock").is_empty()
        });
        all.insert(
            id.clone(),
            Watcher {
                sandbox,
                events,
                task,
            },
        );
        id
    }

    fn take_events(&self, sandbox: &str, id: &str) -> Result<serde_json::Value, ConnectError> {
        let all = self.0.lock().expect("watchers lock");
        let watcher = all
            .get(id)
            .filter(|w| w.sandbox == sandbox)
            .ok_or_else(|| ConnectError::new(Code::NotFound, format!("no watcher {id:?}")))?;
        let events: Vec<FilesystemEvent> = watcher
            .events
            .lock()
            .expect("watcher lock")
            .drain(..)
            .collect();
        Ok(serde_json::json!({ "events": events }))
    }

    fn remove(&self, sandbox: &str, id: &str) -> Result<serde_json::Value, ConnectError> {
        let mut all = self.0.lock().expect("watchers lock");
        match all.get(id) {
            Some(w) if w.sandbox == sandbox => {
                all.remove(id);
                Ok(serde_json::json!({}))
            }
            _ => Err(ConnectError::new(
                Code::NotFound,
                format!("no watcher {id:?}"),
            )),
        }
    }
}

/// `ls -l`'s permission string, e.g. `drwxr-xr-x`.
fn permissions(file_type: FileType, mode: u32) -> String {
    let kind = match file_type {
        FileType::Directory => 'd',
        FileType::Symlink => 'L',
        FileType::File | FileType::Unspecified => '-',
    };
    let mut s = String::from(kind);
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// The entry at `path` (absolute), from dsec's listing or stat of it.
fn entry_info(path: String, file: dsec_api::FileInfo) -> EntryInfo {
    let file_type = match file.kind {
        dsec_api::FileKind::Dir => FileType::Directory,
        dsec_api::FileKind::Symlink => FileType::Symlink,
        dsec_api::FileKind::File | dsec_api::FileKind::Other => FileType::File,
    };
    let mode = file.mode & 0o777;
    EntryInfo {
        path,
        name: file.name,
        file_type,
        size: i64::try_from(file.size).unwrap_or(i64::MAX),
        mode,
        permissions: permissions(file_type, mode),
        owner: String::new(),
        group: String::new(),
        modified_time: chrono::DateTime::from_timestamp(file.mtime, 0)
            .filter(|_| file.mtime != 0)
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
        symlink_target: file.link,
        metadata: file.metadata,
    }
}

/// `path/name`, for the entries of a listing of `dir`.
fn child_path(dir: &str, rel: &str) -> String {
    format!("{}/{rel}", dir.trim_end_matches('/'))
}

/// The entry of an absolute path, through dsec's stat.
async fn stat_entry(e2b: &E2b, call: &Call, path: &str) -> Result<EntryInfo, ConnectError> {
    let mut file = e2b
        .edge()
        .stat(&call.sandbox.info.id, path, call.user.files_as())
        .await?;
    if file.name.is_empty() {
        file.name = "/".to_owned();
    }
    Ok(entry_info(path.to_owned(), file))
}

/// `MakeDir`: with its parents, as `os.MkdirAll`; an existing directory is
/// `already_exists`, anything else there `invalid_argument`.
async fn make_dir(e2b: &E2b, call: &Call, req: PathRequest) -> Result<EntryResponse, ConnectError> {
    let path = resolve_path(&req.path, &call.user)?;
    let mkdir = crate::backend::MakeDir {
        path: path.clone(),
        mode: 0o755,
        parents: true,
        exist_ok: false,
    };
    let as_user = call.user.files_as();
    match e2b
        .edge()
        .make_dir(&call.sandbox.info.id, mkdir, as_user)
        .await
    {
        Ok(_) => {}
        Err(e) if e.kind == dsec_api::ErrorKind::Conflict => {
            let is_dir = matches!(
                e2b.edge().stat(&call.sandbox.info.id, &path, as_user).await,
                Ok(f) if f.is_dir
            );
            let code = if is_dir {
                Code::AlreadyExists
            } else {
                Code::InvalidArgument
            };
            return Err(ConnectError::new(code, e.message));
        }
        Err(e) => return Err(e.into()),
    }
    Ok(EntryResponse {
        entry: stat_entry(e2b, call, &path).await?,
    })
}

/// `Move`: as `os.Rename` after making the destination's parents (a file there is
/// replaced).
async fn move_path(
    e2b: &E2b,
    call: &Call,
    req: MoveRequest,
) -> Result<EntryResponse, ConnectError> {
    let src = resolve_path(&req.source, &call.user)?;
    let dst = resolve_path(&req.destination, &call.user)?;
    let id = &call.sandbox.info.id;
    if let Some((parent, _)) = dst.rsplit_once('/').filter(|(p, _)| !p.is_empty()) {
        let mkdir = crate::backend::MakeDir {
            path: parent.to_owned(),
            mode: 0o755,
            parents: true,
            exist_ok: true,
        };
        e2b.edge().make_dir(id, mkdir, call.user.files_as()).await?;
    }
    let mv = crate::backend::MovePath {
        src,
        dst: dst.clone(),
        overwrite: true,
    };
    e2b.edge().move_path(id, mv, call.user.files_as()).await?;
    Ok(EntryResponse {
        entry: stat_entry(e2b, call, &dst).await?,
    })
}

/// `Remove`: as `os.RemoveAll`, but a missing path is `not_found`.
async fn remove(
    e2b: &E2b,
    call: &Call,
    req: PathRequest,
) -> Result<serde_json::Value, ConnectError> {
    let path = resolve_path(&req.path, &call.user)?;
    let rm = crate::backend::RemovePath {
        path,
        recursive: true,
    };
    e2b.edge()
        .remove_path(&call.sandbox.info.id, rm, call.user.files_as())
        .await?;
    Ok(serde_json::json!({}))
}

/// `ListDir`, `depth` levels deep (0 is 1).
async fn list_dir(
    e2b: &E2b,
    call: &Call,
    req: ListDirRequest,
) -> Result<ListDirResponse, ConnectError> {
    let dir = resolve_path(&req.path, &call.user)?;
    let files = e2b
        .edge()
        .list_files(
            &call.sandbox.info.id,
            &dir,
            req.depth.max(1),
            call.user.files_as(),
        )
        .await?;
    let entries = files
        .into_iter()
        .map(|f| entry_info(child_path(&dir, &f.path), f))
        .collect();
    Ok(ListDirResponse { entries })
}

/// `Stat`: a symbolic link is reported, not followed.
async fn stat(e2b: &E2b, call: &Call, req: PathRequest) -> Result<EntryResponse, ConnectError> {
    let path = resolve_path(&req.path, &call.user)?;
    Ok(EntryResponse {
        entry: stat_entry(e2b, call, &path).await?,
    })
}

// ------------------------------------------------------------------ /files

#[derive(Deserialize)]
struct FilesQuery {
    path: Option<String>,
    username: Option<String>,
    signature: Option<String>,
    signature_expiration: Option<i64>,
}

/// envd's URL signature: `v1_` + unpadded base64 of
/// sha256("path:operation:username:token[:expiration]").
fn signature(
    path: &str,
    operation: &str,
    username: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let mut text = format!("{path}:{operation}:{username}:{token}");
    if let Some(exp) = expiration {
        text.push_str(&format!(":{exp}"));
    }
    let digest = sha2::Sha256::digest(text.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// `/files` takes the access token, or a signature of the request made with it.
fn files_authorized(
    e2b: &E2b,
    sandbox: &E2bSandbox,
    headers: &HeaderMap,
    q: &FilesQuery,
    operation: &str,
) -> Result<(), Response> {
    let unauthorized = |why: &str| Err(http_error(StatusCode::UNAUTHORIZED, why.to_owned()));
    if let Some(given) = access_token(headers) {
        return if token_ok(e2b, sandbox, Some(given)) {
            Ok(())
        } else {
            unauthorized("access token present in header but does not match")
        };
    }
    let Some(token) = sandbox.access_token.as_deref().or(e2b.token.as_deref()) else {
        return Ok(());
    };
    let Some(given) = &q.signature else {
        return unauthorized("missing X-Access-Token header or signature query parameter");
    };
    let path = q.path.as_deref().unwrap_or_default();
    let username = q.username.as_deref().unwrap_or_default();
    let expected = signature(path, operation, username, token, q.signature_expiration);
    if !crate::api::constant_time_eq(expected.as_bytes(), given.as_bytes()) {
        return unauthorized("invalid signature");
    }
    if q.signature_expiration
        .is_some_and(|exp| (exp as f64) < super::unix_now())
    {
        return unauthorized("signature is already expired");
    }
    Ok(())
}

/// The sandbox, user and absolute path of a `/files` request.
async fn files_target(
    e2b: &E2b,
    headers: &HeaderMap,
    q: &FilesQuery,
    operation: &str,
) -> Result<(E2bSandbox, EnvdUser), Response> {
    let sandbox = target(e2b, headers).await?;
    files_authorized(e2b, &sandbox, headers, q, operation)?;
    let sandbox = running(e2b, sandbox).await?;
    let user = request_user(e2b, &sandbox, headers, q.username.as_deref())
        .await
        .map_err(|e| http_error(StatusCode::BAD_REQUEST, e.message))?;
    Ok((sandbox, user))
}

fn wants_gzip(headers: &HeaderMap) -> Result<bool, Response> {
    let Some(accept) = headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
    else {
        return Ok(false);
    };
    let codings: Vec<&str> = accept
        .split(',')
        .map(|c| c.split(';').next().unwrap_or_default().trim())
        .collect();
    if codings.iter().any(|c| c.eq_ignore_ascii_case("gzip")) {
        return Ok(true);
    }
    if codings.is_empty()
        || codings
            .iter()
            .any(|c| c.eq_ignore_ascii_case("identity") || *c == "*" || c.is_empty())
    {
        return Ok(false);
    }
    Err(http_error(
        StatusCode::NOT_ACCEPTABLE,
        format!("unsupported Accept-Encoding {accept:?}: this server sends gzip or identity"),
    ))
}

/// `GET /files?path=`: the file's bytes, streamed (gzip-compressed on the way when asked).
async fn read_file(
    State(e2b): State<Arc<E2b>>,
    headers: HeaderMap,
    Query(q): Query<FilesQuery>,
) -> Response {
    let (sandbox, user) = match files_target(&e2b, &headers, &q, "read").await {
        Ok(t) => t,
        Err(response) => return response,
    };
    let gzip = match wants_gzip(&headers) {
        Ok(g) => g,
        Err(response) => return response,
    };
    let path = match resolve_path(q.path.as_deref().unwrap_or_default(), &user) {
        Ok(p) => p,
        Err(e) => return http_error(StatusCode::BAD_REQUEST, e.message),
    };
    let file = match e2b
        .edge()
        .read_file(&sandbox.info.id, &path, user.files_as())
        .await
    {
        Ok(f) => f,
        Err(e) => return api_http_error(e),
    };
    let chunks = file_chunks(file);
    let name = path.rsplit('/').next().unwrap_or_default().replace('"', "");
    let disposition = format!("inline; filename=\"{name}\"");
    let mut response = if gzip {
        Body::from_stream(gzip_stream(chunks)).into_response()
    } else {
        Body::from_stream(chunks).into_response()
    };
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        "application/octet-stream".parse().expect("valid"),
    );
    h.insert(header::VARY, "Accept-Encoding".parse().expect("valid"));
    if let Ok(v) = disposition.parse() {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    if gzip {
        h.insert(header::CONTENT_ENCODING, "gzip".parse().expect("valid"));
    }
    response
}

/// A file's chunks as a body stream, pulled from the sandbox as the client takes them.
fn file_chunks(
    file: Box<dyn FileRead>,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    futures::stream::unfold(file, |mut file| async move {
        let chunk = file.next().await?;
        Some((chunk.map_err(|e| std::io::Error::other(e.message)), file))
    })
}

/// Compresses a byte stream chunk by chunk, holding one chunk's output at a time.
fn gzip_stream(
    chunks: impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    let encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    futures::stream::unfold(
        (Box::pin(chunks), Some(encoder)),
        |(mut chunks, encoder)| async move {
            let mut encoder = encoder?;
            match chunks.next().await {
                Some(Ok(chunk)) => {
                    let out = encoder
                        .write_all(&chunk)
                        .map(|()| Bytes::from(std::mem::take(encoder.get_mut())));
                    Some((out, (chunks, Some(encoder))))
                }
                Some(Err(e)) => Some((Err(e), (chunks, None))),
                None => Some((encoder.finish().map(Bytes::from), (chunks, None))),
            }
        },
    )
}

/// An entry of `POST /files`' reply.
#[derive(Serialize)]
struct WriteInfo {
    path: String,
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    /// What the file keeps, read back after the write, as envd answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<BTreeMap<String, String>>,
}

/// envd's metadata headers: `X-Metadata-<key>: <value>`, the key lowercased (the first
/// of repeated headers wins), checked against envd's limits
/// (`dsec_runtime::files::metadata`).
fn upload_metadata(headers: &HeaderMap) -> Result<BTreeMap<String, String>, Response> {
    let bad = |m: String| http_error(StatusCode::BAD_REQUEST, format!("invalid metadata: {m}"));
    let mut metadata = BTreeMap::new();
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else {
            continue;
        };
        if key.is_empty() || metadata.contains_key(key) {
            continue;
        }
        let value = value
            .to_str()
            .map_err(|_| bad(format!("the value of {name} is not printable ASCII")))?;
        metadata.insert(key.to_owned(), value.to_owned());
    }
    dsec_runtime::files::metadata::validate(&metadata).map_err(bad)?;
    Ok(metadata)
}

/// `POST /files`: multipart (field `file`, the filename the destination unless `?path=`
/// names it) or `application/octet-stream` (`?path=` required, `Content-Encoding: gzip`
/// accepted). Parents are created. Each file's metadata becomes what the
/// `X-Metadata-*` headers say (none: the file keeps none), as envd does it.
async fn write_files(
    State(e2b): State<Arc<E2b>>,
    headers: HeaderMap,
    Query(q): Query<FilesQuery>,
    request: Request,
) -> Response {
    let (sandbox, user) = match files_target(&e2b, &headers, &q, "write").await {
        Ok(t) => t,
        Err(response) => return drained(request.into_body(), response).await,
    };
    let metadata = match upload_metadata(&headers) {
        Ok(m) => m,
        Err(refused) => return drained(request.into_body(), refused).await,
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();
    let files = if content_type.starts_with("multipart/form-data") {
        multipart_files(request, &q, &user).await
    } else if content_type.starts_with("application/octet-stream") {
        octet_stream_file(request, &headers, &q, &user, e2b.max_upload_bytes).await
    } else {
        let refused = http_error(
            StatusCode::BAD_REQUEST,
            format!(
                "POST /files takes multipart/form-data or application/octet-stream, got {content_type:?}"
            ),
        );
        Err(drained(request.into_body(), refused).await)
    };
    let files = match files {
        Ok(f) => f,
        Err(response) => return closing(response),
    };
    let mut written = Vec::with_capacity(files.len());
    for (path, upload) in files {
        let upload = upload.with_metadata(metadata.clone());
        if let Err(e) = e2b
            .edge()
            .write_file(&sandbox.info.id, &path, upload, 0o644, user.files_as())
            .await
        {
            return closing(api_http_error(e));
        }
        // Without metadata asked the file keeps none: nothing to read back.
        let kept = match metadata.is_empty() {
            true => None,
            false => e2b
                .edge()
                .stat(&sandbox.info.id, &path, user.files_as())
                .await
                .ok()
                .map(|f| f.metadata)
                .filter(|m| !m.is_empty()),
        };
        written.push(WriteInfo {
            name: path.rsplit('/').next().unwrap_or_default().to_owned(),
            path,
            kind: "file",
            metadata: kept,
        });
    }
    Json(written).into_response()
}

/// A multipart upload's files (field `file`), each read whole: a field borrows the
/// request, so it cannot be streamed into the sandbox while the next is parsed.
async fn multipart_files(
    request: Request,
    q: &FilesQuery,
    user: &EnvdUser,
) -> Result<Vec<(String, Upload)>, Response> {
    let bad = |m: String| http_error(StatusCode::BAD_REQUEST, m);
    let mut multipart = Multipart::from_request(request, &())
        .await
        .map_err(|e| bad(format!("multipart body: {}", e.body_text())))?;
    let mut files = Vec::new();
    while let Some(field) = multipart
        .next_field()
        .await
        .map_err(|e| http_error(e.status(), format!("multipart body: {}", e.body_text())))?
    {
        if field.name() != Some("file") {
            continue;
        }
        let name = field.file_name().map(str::to_owned);
        let data = field
            .bytes()
            .await
            .map_err(|e| http_error(e.status(), format!("multipart body: {}", e.body_text())))?;
        files.push((name, data.to_vec()));
    }
    if files.is_empty() {
        return Err(bad(
            "the multipart body has no field named \"file\"".to_owned()
        ));
    }
    if q.path.is_some() && files.len() > 1 {
        return Err(bad(
            "?path= names one destination, but the body holds several files: name each \
             in its filename"
                .to_owned(),
        ));
    }
    files
        .into_iter()
        .map(|(name, data)| {
            let dest = q
                .path
                .clone()
                .or(name)
                .filter(|p| !p.is_empty())
                .ok_or_else(|| {
                    bad("a file has no destination: give ?path= or a filename".to_owned())
                })?;
            let path = resolve_path(&dest, user).map_err(|e| bad(e.message))?;
            Ok((path, Upload::whole(data)))
        })
        .collect()
}

/// An `application/octet-stream` upload: streamed into the sandbox as it arrives (the
/// edge bounds it), or, gzip-compressed, decompressed here within `limit`.
async fn octet_stream_file(
    request: Request,
    headers: &HeaderMap,
    q: &FilesQuery,
    user: &EnvdUser,
    limit: usize,
) -> Result<Vec<(String, Upload)>, Response> {
    let bad = |m: String| http_error(StatusCode::BAD_REQUEST, m);
    let dest = q
        .path
        .as_deref()
        .filter(|p| !p.is_empty())
        .ok_or_else(|| bad("an application/octet-stream upload needs ?path=".to_owned()))?;
    let path = resolve_path(dest, user).map_err(|e| bad(e.message))?;
    let encoding = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("identity")
        .trim()
        .to_ascii_lowercase();
    let upload = match encoding.as_str() {
        "identity" | "" => {
            let declared = headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok());
            Upload::new(request.into_body().into_data_stream(), declared)
        }
        "gzip" => {
            let body = axum::body::to_bytes(request.into_body(), limit)
                .await
                .map_err(|e| {
                    http_error(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("upload over the server's limit of {limit} bytes: {e}"),
                    )
                })?;
            Upload::whole(gunzip(&body, limit).map_err(bad)?)
        }
        other => {
            let refused = http_error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("unsupported Content-Encoding {other:?}: send gzip or identity"),
            );
            return Err(drained(request.into_body(), refused).await);
        }
    };
    Ok(vec![(path, upload)])
}

/// Decompresses at most `limit` bytes: a small body must not inflate without bound.
fn gunzip(data: &[u8], limit: usize) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(data)
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| format!("the gzip body does not decompress: {e}"))?;
    if out.len() > limit {
        return Err(format!(
            "the gzip body decompresses to more than the server's limit of {limit} bytes"
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> EnvdUser {
        EnvdUser::root()
    }

    #[test]
    fn paths_resolve_against_the_home() {
        let u = root();
        assert_eq!(resolve_path("a.txt", &u).unwrap(), "/root/a.txt");
        assert_eq!(resolve_path("~/x/../y", &u).unwrap(), "/root/y");
        assert_eq!(resolve_path("~", &u).unwrap(), "/root");
        assert_eq!(
            resolve_path("/../../etc/./passwd", &u).unwrap(),
            "/etc/passwd"
        );
        assert_eq!(resolve_path("", &u).unwrap(), "/root");
        assert!(resolve_path("a\0b", &u).is_err());
    }

    #[test]
    fn users_come_from_basic_auth_or_the_query() {
        let mut h = HeaderMap::new();
        assert_eq!(requested_user(&h, None).unwrap(), None);
        h.insert(header::AUTHORIZATION, "Basic cm9vdDo=".parse().unwrap()); // "root:"
        assert_eq!(requested_user(&h, None).unwrap(), None);
        h.insert(header::AUTHORIZATION, "Basic dXNlcjo=".parse().unwrap()); // "user:"
        assert_eq!(requested_user(&h, None).unwrap().as_deref(), Some("user"));
        assert_eq!(requested_user(&h, Some("root")).unwrap(), None);
        assert_eq!(
            requested_user(&h, Some("alice")).unwrap().as_deref(),
            Some("alice")
        );
        h.insert(header::AUTHORIZATION, "Basic !!!".parse().unwrap());
        assert_eq!(
            requested_user(&h, None).unwrap_err().code,
            Code::InvalidArgument
        );
    }

    #[test]
    fn signatures_match_the_sdks() {
        // e2b/sandbox/signature.py: sha256 of "path:operation:username:token", unpadded.
        let s = signature("/home/user/a.txt", "read", "", "tok", None);
        let digest = sha2::Sha256::digest(b"/home/user/a.txt:read::tok");
        assert_eq!(
            s,
            format!(
                "v1_{}",
                base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
            )
        );
        assert_ne!(s, signature("/home/user/a.txt", "read", "", "tok", Some(1)));
    }

    #[test]
    fn hosts_name_sandboxes() {
        let mut h = HeaderMap::new();
        h.insert(
            header::HOST,
            "49983-e0-0123456789ab.example.test".parse().unwrap(),
        );
        assert_eq!(sandbox_from_host(&h).as_deref(), Some("e0-0123456789ab"));
        h.insert(header::HOST, "127.0.0.1:49983".parse().unwrap());
        assert_eq!(sandbox_from_host(&h), None);
    }

    #[test]
    fn gzip_is_bounded() {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        enc.write_all(&vec![0u8; 100_000]).unwrap();
        let small = enc.finish().unwrap();
        assert_eq!(gunzip(&small, 100_000).unwrap().len(), 100_000);
        assert!(gunzip(&small, 99_999).is_err());
        assert!(gunzip(b"not gzip", 10).is_err());
    }

    #[tokio::test]
    async fn gzip_streams_decompress_to_the_input() {
        let chunks = futures::stream::iter(
            [b"hello ".as_slice(), b"world"].map(|c| Ok(Bytes::from_static(c))),
        );
        let compressed: Vec<u8> = gzip_stream(chunks)
            .map(|c| c.unwrap().to_vec())
            .concat()
            .await;
        assert_eq!(gunzip(&compressed, 100).unwrap(), b"hello world");
    }

    #[test]
    fn metadata_headers_are_envds() {
        let mut h = HeaderMap::new();
        assert!(upload_metadata(&h).unwrap().is_empty());
        // Header names arrive lowercased, whatever the client sent.
        let owner = header::HeaderName::from_bytes(b"X-Metadata-Owner").unwrap();
        h.insert(owner, "ann".parse().unwrap());
        h.append("x-metadata-owner", "bob".parse().unwrap());
        h.insert("x-metadata-", "nameless".parse().unwrap());
        h.insert("x-other", "no".parse().unwrap());
        let m = upload_metadata(&h).unwrap();
        assert_eq!(m, BTreeMap::from([("owner".to_owned(), "ann".to_owned())]));
        h.insert("x-metadata-big", "v".repeat(5000).parse().unwrap());
        assert_eq!(
            upload_metadata(&h).unwrap_err().status(),
            StatusCode::BAD_REQUEST
        );
    }

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions(FileType::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FileType::Directory, 0o755), "drwxr-xr-x");
    }
}
