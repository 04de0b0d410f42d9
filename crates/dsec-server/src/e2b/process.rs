//! envd's `process.Process` service on dsec's process table ([`crate::edge::processes`]):
//! every command the SDK starts is a spawned dsec process, so it outlives its stream as
//! envd's do. What envd's semantics add:
//!
//! - `Start`'s deadline (`Connect-Timeout-Ms`, the SDK's `timeout`) ends the process it
//!   started, and the stream with `deadline_exceeded`; a client that goes away does not
//!   (background commands survive a disconnect);
//! - an ended process is gone for `List`, `SendInput`, `SendSignal`, `CloseStdin` and
//!   `Update` (`not_found`), while `Connect` still replays what dsec kept of it;
//! - `List` reports each process's config as it was started ([`Configs`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::Response;
use dsec_api::Command;
use futures::StreamExt;
use tokio::time::Instant;

use super::connect::{self, Code, ConnectError, EnvelopeDecoder, MessageStream};
use super::envd::{self, Call, EnvdUser};
use super::proto::{
    DataEvent, Empty, EndEvent, ListResponse, ProcessConfig, ProcessEvent, ProcessInfo,
    ProcessInput, ProcessSelector, ProcessStreamMessage, PtySize, SelectorRequest,
    SendInputRequest, SendSignalRequest, StartRequest, StreamInputRequest, UpdateRequest,
};
use super::E2b;
use crate::backend::ProcessExit;
use crate::edge::processes::{self, Act, Process, SpawnRequest, Stream, Subscription};
use crate::error::ApiError;
use dsec_api::ErrorKind;

/// `POST /process.Process/{method}`.
pub(super) async fn rpc(
    State(e2b): State<Arc<E2b>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if method == "StreamInput" {
        return stream_input(&e2b, &headers, body).await;
    }
    let streaming = matches!(method.as_str(), "Start" | "Connect");
    let (call, message) = match envd::call(&e2b, &headers, body, streaming).await {
        Ok(c) => c,
        Err(response) => return response,
    };
    let e2b = &*e2b;
    let call = &call;
    match method.as_str() {
        "Start" => {
            streamed(call, async {
                start(e2b, call, connect::decode("StartRequest", &message)?).await
            })
            .await
        }
        "Connect" => {
            streamed(call, async {
                let req: SelectorRequest = connect::decode("ConnectRequest", &message)?;
                let process = find(e2b, call, req.process)?;
                Ok(events(&process, None))
            })
            .await
        }
        "List" => envd::unary(call.deadline, async { list(e2b, call) }).await,
        "SendInput" => {
            envd::unary(call.deadline, async {
                let req: SendInputRequest = connect::decode("SendInputRequest", &message)?;
                let process = running(e2b, call, req.process)?;
                write_input(e2b, call, &process, req.input).await
            })
            .await
        }
        "SendSignal" => {
            envd::unary(call.deadline, async {
                let req: SendSignalRequest = connect::decode("SendSignalRequest", &message)?;
                send_signal(e2b, call, req).await
            })
            .await
        }
        "CloseStdin" => {
            envd::unary(call.deadline, async {
                let req: SelectorRequest = connect::decode("CloseStdinRequest", &message)?;
                let process = running(e2b, call, req.process)?;
                steered(&process, act(e2b, call, &process, Act::CloseStdin).await)
            })
            .await
        }
        "Update" => {
            envd::unary(call.deadline, async {
                let req: UpdateRequest = connect::decode("UpdateRequest", &message)?;
                let process = running(e2b, call, req.process)?;
                match req.pty {
                    Some(pty) => {
                        let size = win_size(pty.size)?.checked()?;
                        steered(&process, act(e2b, call, &process, Act::Resize(size)).await)
                    }
                    None => Ok(Empty {}),
                }
            })
            .await
        }
        other => envd::unknown_method("process.Process", other, streaming),
    }
}

/// A server-stream reply of process events, with the call's deadline and keep-alives.
async fn streamed(
    call: &Call,
    events: impl std::future::Future<Output = Result<MessageStream<ProcessStreamMessage>, ConnectError>>,
) -> Response {
    match events.await {
        Ok(events) => connect::stream_response(
            events,
            call.deadline,
            call.keepalive
                .map(|every| (every, ProcessStreamMessage::keepalive)),
        ),
        Err(e) => connect::stream_error(&e),
    }
}

/// The environment envd gives a process: who it runs as, then the request's variables.
fn process_env(user: &EnvdUser, envs: BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut env = BTreeMap::from([
        ("HOME".to_owned(), user.home.clone()),
        ("USER".to_owned(), user.name.clone()),
        ("LOGNAME".to_owned(), user.name.clone()),
    ]);
    env.extend(envs);
    env
}

/// A terminal size as dsec takes it (at most 65535 cells each way; zero is refused there).
fn win_size(size: PtySize) -> Result<processes::PtySize, ConnectError> {
    let cells = |n: u32, what: &str| {
        u16::try_from(n).map_err(|_| {
            ConnectError::invalid(format!("a terminal has at most 65535 {what}, got {n}"))
        })
    };
    Ok(processes::PtySize {
        cols: cells(size.cols, "columns")?,
        rows: cells(size.rows, "rows")?,
    })
}

/// `Start`: spawns the process in dsec's table, then streams it as `Connect` does.
async fn start(
    e2b: &E2b,
    call: &Call,
    req: StartRequest,
) -> Result<MessageStream<ProcessStreamMessage>, ConnectError> {
    let config = req.process;
    if config.cmd.is_empty() {
        return Err(ConnectError::invalid("process.cmd must not be empty"));
    }
    let cwd = match &config.cwd {
        Some(cwd) if !cwd.is_empty() => envd::resolve_path(cwd, &call.user)?,
        _ => call.user.home.clone(),
    };
    let pty = req.pty.map(|p| win_size(p.size)).transpose()?;
    let argv = std::iter::once(config.cmd.clone())
        .chain(config.args.iter().cloned())
        .collect();
    let sandbox = &call.sandbox.info.id;
    let spawned = e2b
        .edge()
        .spawn(
            sandbox,
            SpawnRequest {
                cmd: Command::Argv(argv),
                env: process_env(&call.user, config.envs.clone()),
                cwd: Some(cwd),
                stdin: req.stdin.unwrap_or(true),
                pty,
                tag: req.tag,
                user: (call.user.name != "root").then(|| call.user.name.clone()),
                step: None,
            },
        )
        .await?;
    let process = e2b.edge().process(sandbox, &spawned.pid.to_string())?;
    e2b.process_configs
        .record(sandbox, &process, config, call.deadline);
    Ok(events(&process, call.deadline))
}

/// A process's events as envd streams them: `start`, its output (replayed from what
/// dsec buffered, then live), `end`. When `deadline` has passed by the end, the process
/// was ended for it, and the stream ends with `deadline_exceeded` instead.
fn events(
    process: &Arc<Process>,
    deadline: Option<Instant>,
) -> MessageStream<ProcessStreamMessage> {
    let pid = pid_of(process);
    let started = futures::stream::once(async move {
        Ok(ProcessStreamMessage {
            event: ProcessEvent::Start { pid },
        })
    });
    let rest = futures::stream::unfold(process.subscribe(), |mut s: Subscription| async move {
        let event = s.next().await?;
        Some((event, s))
    })
    .map(move |event| {
        let event = match event {
            processes::ProcessEvent::Output { stream, data, .. } => {
                ProcessEvent::Data(match stream {
                    Stream::Stdout => DataEvent::Stdout(data),
                    Stream::Stderr => DataEvent::Stderr(data),
                    Stream::Pty => DataEvent::Pty(data),
                })
            }
            processes::ProcessEvent::Exit { .. }
                if deadline.is_some_and(|d| Instant::now() >= d) =>
            {
                return Err(deadline_passed());
            }
            processes::ProcessEvent::Exit { exit, .. } => ProcessEvent::End(end_event(&exit)),
        };
        Ok(ProcessStreamMessage { event })
    });
    Box::pin(started.chain(rest))
}

fn deadline_passed() -> ConnectError {
    ConnectError::new(
        Code::DeadlineExceeded,
        "the call's deadline (Connect-Timeout-Ms, the SDK's timeout) passed; a command \
         started with it was killed",
    )
}

fn pid_of(process: &Process) -> u32 {
    u32::try_from(process.pid()).unwrap_or_default()
}

/// How a process ended, in the words of Go's `ProcessState` (envd's): exit code -1 and
/// `signal: <name>` for a signal, `exit status N` otherwise; `error` as `cmd.Wait()`'s.
fn end_event(exit: &ProcessExit) -> EndEvent {
    let (exit_code, exited, status) = match (exit.signal, exit.exit_code) {
        (Some(signal), _) => (-1, false, format!("signal: {}", signal_name(signal))),
        (None, Some(code)) => (code, true, format!("exit status {code}")),
        (None, None) => (-1, false, "unknown".to_owned()),
    };
    let error = exit
        .error
        .clone()
        .or_else(|| (exit_code != 0).then(|| status.clone()));
    EndEvent {
        exit_code,
        exited,
        status,
        error,
    }
}

/// A signal's name as Go's `syscall.Signal.String` gives it.
fn signal_name(signal: i32) -> String {
    let name = match signal {
        1 => "hangup",
        2 => "interrupt",
        3 => "quit",
        4 => "illegal instruction",
        6 => "aborted",
        7 => "bus error",
        8 => "floating point exception",
        9 => "killed",
        10 => "user defined signal 1",
        11 => "segmentation fault",
        12 => "user defined signal 2",
        13 => "broken pipe",
        14 => "alarm clock",
        15 => "terminated",
        other => return format!("signal {other}"),
    };
    name.to_owned()
}

/// The process a selector names, running or lately ended.
fn find(
    e2b: &E2b,
    call: &Call,
    selector: Option<ProcessSelector>,
) -> Result<Arc<Process>, ConnectError> {
    let key = match selector {
        Some(ProcessSelector::Pid(pid)) => pid.to_string(),
        Some(ProcessSelector::Tag(tag)) => tag,
        None => {
            return Err(ConnectError::invalid(
                "process must name a pid or a tag, e.g. {\"process\":{\"pid\":123}}",
            ))
        }
    };
    e2b.edge()
        .process(&call.sandbox.info.id, &key)
        .map_err(|e| match e.kind {
            ErrorKind::NotFound => not_found(&key),
            _ => e.into(),
        })
}

fn not_found(key: &str) -> ConnectError {
    ConnectError::new(
        Code::NotFound,
        format!("no running process {key} in this sandbox (commands.list() shows what runs)"),
    )
}

/// The running process a selector names: an ended one is gone, as in envd.
fn running(
    e2b: &E2b,
    call: &Call,
    selector: Option<ProcessSelector>,
) -> Result<Arc<Process>, ConnectError> {
    let process = find(e2b, call, selector)?;
    if !process.info().running {
        return Err(not_found(&process.pid().to_string()));
    }
    Ok(process)
}

/// Does `what` to `process` as the sandbox's next trajectory step: recorded in its log
/// like the same call through dsec's own API.
async fn act(e2b: &E2b, call: &Call, process: &Process, what: Act) -> Result<(), ApiError> {
    let pid = process.pid().to_string();
    e2b.edge()
        .act(&call.sandbox.info.id, &pid, None, what)
        .await
}

/// What steering a process answered: a failure because it ended meanwhile is `not_found`.
fn steered(process: &Process, result: Result<(), ApiError>) -> Result<Empty, ConnectError> {
    match result {
        Ok(()) => Ok(Empty {}),
        Err(_) if !process.info().running => Err(not_found(&process.pid().to_string())),
        Err(e) => Err(e.into()),
    }
}

/// Writes input to a process: `stdin` to its standard input, `pty` to its terminal.
async fn write_input(
    e2b: &E2b,
    call: &Call,
    process: &Process,
    input: Option<ProcessInput>,
) -> Result<Empty, ConnectError> {
    let pid = process.pid();
    let has_pty = process.info().pty;
    let data = match input {
        Some(ProcessInput::Stdin(data)) if !has_pty => data,
        Some(ProcessInput::Pty(data)) if has_pty => data,
        Some(ProcessInput::Stdin(_)) => {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!("process {pid} runs on a terminal: send its input as pty (pty.send_stdin)"),
            ))
        }
        Some(ProcessInput::Pty(_)) => {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!(
                    "process {pid} has no terminal: send its input as stdin (commands.send_stdin)"
                ),
            ))
        }
        None => return Err(ConnectError::invalid("input must hold stdin or pty bytes")),
    };
    steered(process, act(e2b, call, process, Act::Stdin(data)).await)
}

/// `SendSignal`: SIGKILL kills the process and what it started; SIGTERM is sent to it.
async fn send_signal(
    e2b: &E2b,
    call: &Call,
    req: SendSignalRequest,
) -> Result<Empty, ConnectError> {
    use super::proto::SignalValue::{Name, Number};
    let kill = match &req.signal {
        Some(Number(9)) => true,
        Some(Number(15)) => false,
        Some(Name(name)) if name == "SIGNAL_SIGKILL" => true,
        Some(Name(name)) if name == "SIGNAL_SIGTERM" => false,
        other => {
            return Err(ConnectError::invalid(format!(
                "signal must be SIGNAL_SIGTERM or SIGNAL_SIGKILL, got {other:?}"
            )))
        }
    };
    let process = running(e2b, call, req.process)?;
    let what = if kill { Act::Kill } else { Act::Signal(15) };
    steered(&process, act(e2b, call, &process, what).await)
}

/// `List`: the running processes, each with the config it was started with.
fn list(e2b: &E2b, call: &Call) -> Result<ListResponse, ConnectError> {
    let sandbox = &call.sandbox.info.id;
    let processes = e2b
        .edge()
        .processes(sandbox)?
        .into_iter()
        .filter(|p| p.running)
        .map(|p| ProcessInfo {
            config: e2b.process_configs.get(sandbox, &p).unwrap_or_else(|| {
                // Spawned through dsec's own API: its argv is all there is.
                let mut argv = p.cmd.clone().into_iter();
                ProcessConfig {
                    cmd: argv.next().unwrap_or_default(),
                    args: argv.collect(),
                    ..ProcessConfig::default()
                }
            }),
            pid: u32::try_from(p.pid).unwrap_or_default(),
            tag: p.tag,
        })
        .collect();
    Ok(ListResponse { processes })
}

/// `StreamInput`: a client stream (`start{process}` first, then `data{input}` and
/// `keepalive` messages), each input written as it arrives; answered, once the request
/// stream ends, with one empty message.
async fn stream_input(e2b: &E2b, headers: &HeaderMap, body: Body) -> Response {
    let call = match envd::checked_call(e2b, headers, true).await {
        Ok(call) => call,
        Err(response) => return envd::drained(body, response).await,
    };
    let fed = feed_input(e2b, &call, body);
    let result = match call.deadline {
        Some(d) => tokio::time::timeout_at(d, fed).await.unwrap_or_else(|_| {
            Err(ConnectError::new(
                Code::DeadlineExceeded,
                "the call's deadline (Connect-Timeout-Ms) passed before the input stream ended",
            ))
        }),
        None => fed.await,
    };
    match result {
        Ok(()) => connect::stream_response(
            Box::pin(futures::stream::once(async { Ok(Empty {}) })),
            None,
            None::<(std::time::Duration, fn() -> Empty)>,
        ),
        // The rest of the request stream is left unread.
        Err(e) => envd::closing(connect::stream_error(&e)),
    }
}

async fn feed_input(e2b: &E2b, call: &Call, body: Body) -> Result<(), ConnectError> {
    let mut chunks = body.into_data_stream();
    let mut decoder = EnvelopeDecoder::new(e2b.max_upload_bytes);
    let mut process = None;
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| {
            ConnectError::new(Code::Canceled, format!("the request stream broke off: {e}"))
        })?;
        decoder.push(&chunk);
        while let Some(message) = decoder.next_message()? {
            match (connect::decode("StreamInputRequest", &message)?, &process) {
                (StreamInputRequest::Start(req), None) => {
                    process = Some(running(e2b, call, req.process)?);
                }
                (StreamInputRequest::Start(_), Some(_)) => {
                    return Err(ConnectError::invalid(
                        "an input stream names its process once, in its first message",
                    ))
                }
                (StreamInputRequest::Data(req), Some(p)) => {
                    write_input(e2b, call, p, req.input).await?;
                }
                (StreamInputRequest::Data(_), None) => {
                    return Err(ConnectError::invalid(
                        "an input stream's first message must be start{process}",
                    ))
                }
                (StreamInputRequest::Keepalive(_), _) => {}
            }
        }
    }
    decoder.finish()?;
    if process.is_none() {
        return Err(ConnectError::invalid(
            "the input stream named no process: its first message must be start{process}",
        ));
    }
    Ok(())
}

/// The configs processes were started with through envd, for `List` (dsec's table keeps
/// only the argv), by sandbox and pid; an entry goes when its process ends. An entry
/// counts only for the process it was made for (same start time): pids are reused.
#[derive(Clone, Default)]
pub(super) struct Configs(Arc<Mutex<HashMap<(String, i32), Started>>>);

/// A process started through envd, as it was started.
struct Started {
    /// Its start time in dsec's table, telling it from a later process with its pid.
    at: f64,
    config: ProcessConfig,
}

impl Configs {
    /// Keeps a started process's config until it ends, ending it at `deadline` (envd's:
    /// the call's deadline bounds the process it started, whoever still listens).
    fn record(
        &self,
        sandbox: &str,
        process: &Arc<Process>,
        config: ProcessConfig,
        deadline: Option<Instant>,
    ) {
        let info = process.info();
        let key = (sandbox.to_owned(), info.pid);
        self.0.lock().expect("configs lock").insert(
            key.clone(),
            Started {
                at: info.started_at,
                config,
            },
        );
        let configs = self.clone();
        let process = Arc::clone(process);
        tokio::spawn(async move {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if process.wait(left).await.is_none() {
                if let Err(e) = process.kill().await {
                    tracing::warn!(pid = info.pid, error = %e.message, "envd: killing a process at its deadline failed");
                }
            }
            let mut all = configs.0.lock().expect("configs lock");
            if all.get(&key).is_some_and(|s| s.at == info.started_at) {
                all.remove(&key);
            }
        });
    }

    fn get(&self, sandbox: &str, info: &processes::ProcessInfo) -> Option<ProcessConfig> {
        let all = self.0.lock().expect("configs lock");
        let started = all.get(&(sandbox.to_owned(), info.pid))?;
        (started.at == info.started_at).then(|| started.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_read_like_gos_process_state() {
        let exited = |code| ProcessExit {
            exit_code: Some(code),
            ..ProcessExit::default()
        };
        assert_eq!(
            end_event(&exited(0)),
            EndEvent {
                exit_code: 0,
                exited: true,
                status: "exit status 0".into(),
                error: None,
            }
        );
        let failed = end_event(&exited(3));
        assert_eq!(
            (failed.exit_code, failed.error.as_deref()),
            (3, Some("exit status 3"))
        );
        let killed = end_event(&ProcessExit {
            exit_code: Some(137),
            signal: Some(9),
            ..ProcessExit::default()
        });
        assert_eq!(
            (killed.exit_code, killed.exited, killed.status.as_str()),
            (-1, false, "signal: killed")
        );
        let lost = end_event(&ProcessExit {
            error: Some("the sandbox ended before the process".into()),
            ..ProcessExit::default()
        });
        assert_eq!(lost.exit_code, -1);
        assert_eq!(
            lost.error.as_deref(),
            Some("the sandbox ended before the process")
        );
        assert_eq!(signal_name(15), "terminated");
        assert_eq!(signal_name(40), "signal 40");
    }

    #[test]
    fn terminal_sizes_fit_dsecs() {
        let size = win_size(PtySize { cols: 80, rows: 24 }).unwrap();
        assert_eq!((size.cols, size.rows), (80, 24));
        assert_eq!(
            win_size(PtySize {
                cols: 70_000,
                rows: 24
            })
            .unwrap_err()
            .code,
            Code::InvalidArgument
        );
    }
}
