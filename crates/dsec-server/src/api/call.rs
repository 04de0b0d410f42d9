//! `POST /v1/calls` and `/v1/calls/stream`: one fncall in one request.
//!
//! A call is what `client.call` did in three requests: create a `fncall` handle on the
//! image's worker pool, run one command on it, stop the handle. Here the three happen in
//! the server, through the same edge operations and the same exec handlers, so a call has
//! the semantics, errors, metrics and trajectory record of the three requests it replaces,
//! without two of their round trips.
//!
//! The handle is stopped when the handler ends, whichever way it ends (a client that goes
//! away mid-call included). Stopping a `fncall` handle only removes it from the edge's
//! table: the running command lives in its worker, which its output stream owns, so a
//! streamed call's handle can go as soon as the command has started.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Json;
use dsec_api::{
    Command, CommandResult, CreateSandboxRequest, ErrorBody, ExecRequest, FileUpload, Network,
};
use serde::Deserialize;
use utoipa::ToSchema;

use super::{ApiJson, AppState, Visible};
use crate::edge::Edge;
use crate::error::ApiError;
use crate::projects::Caller;

/// `POST /v1/calls` and `/v1/calls/stream`: a command for a fresh worker of an image's
/// `fncall` pool, with the worker's limits.
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CallRequest {
    /// A dsec image name.
    pub image: String,
    /// What to run: a string for `/bin/sh -c`, or an argv.
    pub cmd: Command,
    /// Extra environment for the command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; the image's when omitted.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Standard input, base64.
    #[serde(default)]
    pub stdin_b64: Option<String>,
    /// Files written before the command starts.
    #[serde(default)]
    pub files: Vec<FileUpload>,
    /// Kill the whole process tree after this many seconds.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Bound on each of stdout and stderr; beyond it output is discarded.
    #[serde(default)]
    pub max_output_bytes: Option<i64>,
    /// The worker's CPU bandwidth, in cores; the server's default when omitted.
    #[serde(default)]
    pub cpus: Option<f64>,
    /// The worker's memory limit, in MiB.
    #[serde(default)]
    pub memory_mb: Option<i64>,
    /// The worker's process limit.
    #[serde(default)]
    pub pids: Option<i64>,
    /// The call's writable layer, in MiB.
    #[serde(default)]
    pub disk_mb: Option<i64>,
}

impl CallRequest {
    /// The create and the exec this call stands for.
    fn split(self) -> (CreateSandboxRequest, ExecRequest) {
        let create = CreateSandboxRequest {
            backend: "fncall".to_owned(),
            image: self.image,
            cpus: self.cpus,
            memory_mb: self.memory_mb,
            pids: self.pids,
            disk_mb: self.disk_mb,
            ttl_s: None,
            idle_ttl_s: None,
            env: BTreeMap::new(),
            workdir: None,
            network: Network::default(),
            ca_bundle: None,
            labels: BTreeMap::new(),
            trajectory_id: None,
        };
        let exec = ExecRequest {
            cmd: self.cmd,
            env: self.env,
            cwd: self.cwd,
            stdin_b64: self.stdin_b64,
            files: self.files,
            timeout_s: self.timeout_s,
            max_output_bytes: self.max_output_bytes,
            step: None,
        };
        (create, exec)
    }
}

/// Stops the call's handle when dropped: at the end of the handler, or when the client
/// went away and the handler was dropped mid-call.
struct StopOnDrop {
    edge: Arc<Edge>,
    id: String,
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let (edge, id) = (Arc::clone(&self.edge), std::mem::take(&mut self.id));
        tokio::spawn(async move {
            if let Err(e) = edge.stop(&id).await {
                tracing::warn!(sandbox = %id, error = %e.message, "stopping a call's fncall handle");
            }
        });
    }
}

/// Creates the call's handle; it is stopped when the returned guard drops.
async fn handle(
    state: &AppState,
    caller: &Caller,
    create: CreateSandboxRequest,
) -> Result<StopOnDrop, ApiError> {
    let info = state.edge.create(create, caller).await?;
    Ok(StopOnDrop {
        edge: Arc::clone(&state.edge),
        id: info.id,
    })
}

#[utoipa::path(post, path = "/v1/calls", request_body = CallRequest,
    responses((status = 200, body = CommandResult), (status = 400, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 413, body = ErrorBody),
              (status = 503, body = ErrorBody)))]
pub(super) async fn call(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(req): ApiJson<CallRequest>,
) -> Result<Json<CommandResult>, ApiError> {
    let (create, exec) = req.split();
    let handle = handle(&state, &caller, create).await?;
    let id = handle.id.clone();
    super::exec(State(state), Visible(id), ApiJson(exec.into())).await
}

#[utoipa::path(post, path = "/v1/calls/stream", request_body = CallRequest,
    responses((status = 200, description = "NDJSON (or SSE) of StreamEvent, as exec/stream"),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 503, body = ErrorBody)))]
pub(super) async fn call_stream(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CallRequest>,
) -> Result<Response, ApiError> {
    let (create, exec) = req.split();
    let handle = handle(&state, &caller, create).await?;
    let id = handle.id.clone();
    // The command has started when this returns: its stream owns the worker, and the
    // handle goes with `handle` here.
    super::exec_stream(State(state), Visible(id), headers, ApiJson(exec.into())).await
}
