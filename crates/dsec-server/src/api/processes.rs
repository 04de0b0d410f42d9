//! `/v1/sandboxes/{id}/processes`: spawned processes, which outlive the request that
//! started them (see [`crate::edge::processes`]).

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use dsec_api::ErrorBody;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use super::{streamed, ApiJson, AppState, Utf8Decoder, Visible, VisibleProcess};
use crate::backend::ProcessExit;
use crate::edge::processes::{
    Act, ProcessEvent, ProcessInfo, PtySize, SpawnRequest, Stream, Subscription,
};
use crate::error::ApiError;

/// How often a quiet event stream sends a blank line, so clients and proxies keep it.
const HEARTBEAT: Duration = Duration::from_secs(15);
/// How often a client following a process counts as a request to its sandbox.
const TOUCH_EVERY: Duration = Duration::from_secs(1);
/// The longest `wait`.
const MAX_WAIT_S: f64 = 3600.0;

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes", request_body = SpawnRequest,
    responses((status = 200, body = ProcessInfo), (status = 400, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub(super) async fn spawn(
    State(state): State<AppState>,
    Visible(id): Visible,
    ApiJson(req): ApiJson<SpawnRequest>,
) -> Result<Json<ProcessInfo>, ApiError> {
    Ok(Json(state.edge.spawn(&id, req).await?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes",
    responses((status = 200, body = [ProcessInfo]), (status = 404, body = ErrorBody)))]
pub(super) async fn list(
    State(state): State<AppState>,
    Visible(id): Visible,
) -> Result<Json<Vec<ProcessInfo>>, ApiError> {
    Ok(Json(state.edge.processes(&id)?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{process}",
    responses((status = 200, body = ProcessInfo), (status = 404, body = ErrorBody)))]
pub(super) async fn get(
    State(state): State<AppState>,
    VisibleProcess(id, process): VisibleProcess,
) -> Result<Json<ProcessInfo>, ApiError> {
    Ok(Json(state.edge.process(&id, &process)?.info()))
}

/// One line of a process's event stream.
#[derive(Serialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub(super) enum EventLine {
    /// Standard output.
    Stdout {
        /// UTF-8, invalid bytes replaced.
        data: String,
        /// Bytes of output before this one no longer buffered for this reader.
        #[serde(skip_serializing_if = "is_zero")]
        dropped: u64,
    },
    /// Standard error.
    Stderr {
        /// As `stdout`'s.
        data: String,
        /// As `stdout`'s.
        #[serde(skip_serializing_if = "is_zero")]
        dropped: u64,
    },
    /// The process's terminal.
    Pty {
        /// As `stdout`'s.
        data: String,
        /// As `stdout`'s.
        #[serde(skip_serializing_if = "is_zero")]
        dropped: u64,
    },
    /// The end; last.
    Exit {
        /// How it ended.
        #[serde(flatten)]
        exit: ProcessExit,
        /// As `stdout`'s.
        #[serde(skip_serializing_if = "is_zero")]
        dropped: u64,
    },
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A reader of one process, with a text decoder per stream. While it reads, its sandbox
/// is not idle (`idle_ttl_s`): each line and heartbeat counts as a request.
struct Reader {
    events: Subscription,
    decoders: [Utf8Decoder; 3],
    state: AppState,
    sandbox: String,
}

impl Reader {
    /// The next lines: output, the decoders' tails and the exit at the end, or a blank
    /// heartbeat after [`HEARTBEAT`] of quiet; `None` after the exit.
    async fn next(&mut self) -> Option<Vec<Option<EventLine>>> {
        let quiet_until = tokio::time::Instant::now() + HEARTBEAT;
        let event = loop {
            self.state.edge.touch(&self.sandbox);
            let left = quiet_until.saturating_duration_since(tokio::time::Instant::now());
            // `next` keeps its place when cancelled: it only moves in a synchronous step.
            match tokio::time::timeout(left.min(TOUCH_EVERY), self.events.next()).await {
                Ok(event) => break event?,
                Err(_) if left <= TOUCH_EVERY => return Some(vec![None]),
                Err(_) => {}
            }
        };
        Some(match event {
            ProcessEvent::Output {
                stream,
                data,
                dropped,
            } => {
                let text = self.decoders[stream as usize].push(&data);
                vec![Some(line(stream, text, dropped))]
            }
            ProcessEvent::Exit { exit, dropped } => {
                let mut lines = Vec::new();
                for stream in [Stream::Stdout, Stream::Stderr, Stream::Pty] {
                    let tail = self.decoders[stream as usize].finish();
                    if !tail.is_empty() {
                        lines.push(Some(line(stream, tail, 0)));
                    }
                }
                lines.push(Some(EventLine::Exit { exit, dropped }));
                lines
            }
        })
    }
}

fn line(stream: Stream, data: String, dropped: u64) -> EventLine {
    match stream {
        Stream::Stdout => EventLine::Stdout { data, dropped },
        Stream::Stderr => EventLine::Stderr { data, dropped },
        Stream::Pty => EventLine::Pty { data, dropped },
    }
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{process}/events",
    responses((status = 200,
               description = "NDJSON: buffered output, then live output, then the exit",
               body = EventLine),
              (status = 404, body = ErrorBody)))]
pub(super) async fn events(
    State(state): State<AppState>,
    VisibleProcess(id, process): VisibleProcess,
) -> Result<Response, ApiError> {
    let reader = Reader {
        events: state.edge.process(&id, &process)?.subscribe(),
        decoders: Default::default(),
        state,
        sandbox: id,
    };
    let lines = futures::stream::unfold(reader, |mut reader| async move {
        let lines = reader.next().await?;
        Some((lines, reader))
    })
    .flat_map(futures::stream::iter)
    .map(|line| {
        let text = match line {
            Some(line) => serde_json::to_string(&line).expect("events serialize") + "\n",
            None => "\n".to_owned(),
        };
        Ok::<_, Infallible>(Bytes::from(text))
    });
    Ok(streamed(false, Body::from_stream(lines)))
}

/// The query of the routes that act on a process: each act is a step of the sandbox's
/// trajectory.
#[derive(Deserialize, utoipa::IntoParams)]
pub(super) struct StepQuery {
    /// Its step in the sandbox's trajectory, as `exec`'s `step` (the next one if omitted).
    step: Option<i64>,
}

type StepParam = Result<Query<StepQuery>, axum::extract::rejection::QueryRejection>;

/// Does `act` to the process as the query's step.
async fn act(
    state: &AppState,
    (id, process): (String, String),
    query: StepParam,
    act: Act,
) -> Result<StatusCode, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    state.edge.act(&id, &process, q.step, act).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/stdin", params(StepQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub(super) async fn stdin(
    State(state): State<AppState>,
    VisibleProcess(id, process): VisibleProcess,
    query: StepParam,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    act(&state, (id, process), query, Act::Stdin(body.to_vec())).await
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/close-stdin",
    params(StepQuery),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub(super) async fn close_stdin(
    State(state): State<AppState>,
    VisibleProcess(id, process): VisibleProcess,
    query: StepParam,
) -> Result<StatusCode, ApiError> {
    act(&state, (id, process), query, Act::CloseStdin).await
}

/// A signal by name (`TERM`, `SIGTERM`) or number.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub(super) enum SignalName {
    /// Its number.
    Number(i64),
    /// Its name, with or without `SIG`.
    Name(String),
}

/// `POST .../signal`.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SignalRequest {
    /// The signal.
    signal: SignalName,
}

/// The standard signals Linux numbers alike on every architecture dsec runs on.
const SIGNALS: [(&str, i32); 30] = [
    ("HUP", libc::SIGHUP),
    ("INT", libc::SIGINT),
    ("QUIT", libc::SIGQUIT),
    ("ILL", libc::SIGILL),
    ("TRAP", libc::SIGTRAP),
    ("ABRT", libc::SIGABRT),
    ("BUS", libc::SIGBUS),
    ("FPE", libc::SIGFPE),
    ("KILL", libc::SIGKILL),
    ("USR1", libc::SIGUSR1),
    ("SEGV", libc::SIGSEGV),
    ("USR2", libc::SIGUSR2),
    ("PIPE", libc::SIGPIPE),
    ("ALRM", libc::SIGALRM),
    ("TERM", libc::SIGTERM),
    ("STKFLT", libc::SIGSTKFLT),
    ("CHLD", libc::SIGCHLD),
    ("CONT", libc::SIGCONT),
    ("STOP", libc::SIGSTOP),
    ("TSTP", libc::SIGTSTP),
    ("TTIN", libc::SIGTTIN),
    ("TTOU", libc::SIGTTOU),
    ("URG", libc::SIGURG),
    ("XCPU", libc::SIGXCPU),
    ("XFSZ", libc::SIGXFSZ),
    ("VTALRM", libc::SIGVTALRM),
    ("PROF", libc::SIGPROF),
    ("WINCH", libc::SIGWINCH),
    ("IO", libc::SIGIO),
    ("SYS", libc::SIGSYS),
];

/// The number of a signal: `InvalidArgument` naming the valid ones otherwise.
fn signal_number(signal: &SignalName) -> Result<i32, ApiError> {
    let found = match signal {
        SignalName::Number(n) => SIGNALS
            .iter()
            .map(|(_, v)| *v)
            .find(|v| i64::from(*v) == *n),
        SignalName::Name(name) => {
            let upper = name.to_ascii_uppercase();
            let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
            SIGNALS.iter().find(|(n, _)| *n == bare).map(|(_, v)| *v)
        }
    };
    found.ok_or_else(|| {
        let what = match signal {
            SignalName::Number(n) => n.to_string(),
            SignalName::Name(name) => format!("{name:?}"),
        };
        ApiError::invalid(format!(
            "unknown signal {what}: give a name such as \"TERM\", \"INT\", \"KILL\", \"HUP\" \
             or a number from 1 to 31"
        ))
    })
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/signal",
    params(StepQuery), request_body = SignalRequest,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)))]
pub(super) async fn signal(
    State(state): State<AppState>,
    VisibleProcess(id, process): VisibleProcess,
    query: StepParam,
    ApiJson(req): ApiJson<SignalRequest>,
) -> Result<StatusCode, ApiError> {
    let signal = signal_number(&req.signal)?;
    act(&state, (id, process), query, Act::Signal(signal)).await
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/kill", params(StepQuery),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub(super) async fn kill(
    State(state): State<AppState>,
    VisibleProcess(id, process): VisibleProcess,
    query: StepParam,
) -> Result<StatusCode, ApiError> {
    act(&state, (id, process), query, Act::Kill).await
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/resize",
    params(StepQuery), request_body = PtySize,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)))]
pub(super) async fn resize(
    State(state): State<AppState>,
    VisibleProcess(id, process): VisibleProcess,
    query: StepParam,
    ApiJson(size): ApiJson<PtySize>,
) -> Result<StatusCode, ApiError> {
    let size = size.checked()?;
    act(&state, (id, process), query, Act::Resize(size)).await
}

#[derive(Deserialize, utoipa::IntoParams)]
pub(super) struct WaitQuery {
    /// Seconds to wait at most (up to 3600); the answer says `running` if it still runs.
    timeout: Option<f64>,
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/wait", params(WaitQuery),
    responses((status = 200, description = "The process, ended unless the timeout passed",
               body = ProcessInfo),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn wait(
    State(state): State<AppState>,
    VisibleProcess(id, process): VisibleProcess,
    query: Result<Query<WaitQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<ProcessInfo>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let timeout = match query.timeout {
        Some(t) if !t.is_finite() || !(0.0..=MAX_WAIT_S).contains(&t) => {
            return Err(ApiError::invalid(format!(
                "timeout must be between 0 and {MAX_WAIT_S} seconds, got {t}"
            )))
        }
        Some(t) => Duration::from_secs_f64(t),
        None => Duration::from_secs_f64(MAX_WAIT_S),
    };
    let process = state.edge.process(&id, &process)?;
    // A waiting client is using the sandbox: its idle time starts again as it waits.
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if process.wait(Some(left.min(TOUCH_EVERY))).await.is_some() || left <= TOUCH_EVERY {
            break;
        }
        state.edge.touch(&id);
    }
    Ok(Json(process.info()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_by_name_or_number_and_nothing_else() {
        let name = |s: &str| signal_number(&SignalName::Name(s.into())).ok();
        assert_eq!(name("TERM"), Some(libc::SIGTERM));
        assert_eq!(name("sigkill"), Some(libc::SIGKILL));
        assert_eq!(name("NOPE"), None);
        assert_eq!(
            signal_number(&SignalName::Number(2)).ok(),
            Some(libc::SIGINT)
        );
        assert!(signal_number(&SignalName::Number(0)).is_err());
        assert!(signal_number(&SignalName::Number(99)).is_err());
    }
}
