//! A sandbox's spawned processes: ones that outlive the request that started them.
//!
//! Each process's output is read to its end by a task of its own into a bounded replay
//! buffer ([`REPLAY_BYTES`]; older output is dropped, and a subscriber that missed some
//! learns how many bytes), from which any number of subscribers read: an `attach` replays
//! what is buffered, then follows live. The exit is kept, so a late `attach` or `wait`
//! sees it. The table holds at most [`MAX_LIVE`] running processes and remembers the last
//! [`MAX_EXITED`] that ended; a tag names one running process at a time. The table goes
//! with its sandbox: stopping the sandbox kills every process in it.
//!
//! A spawn and every act on a process (stdin, close-stdin, signal, kill, resize) is a step
//! of the sandbox's trajectory log, numbered with its runs; the process's end (exit and
//! output, bounded as a run's) is added to its spawn step when it ends (see
//! [`dsec_trajectory::StepKind`]). In a sandbox created with a trajectory id, a re-issued
//! step is fast-forwarded as a run is: an act is not done again; a spawn answers the
//! process it started if the table still has it, else the recorded end.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_trajectory::{
    ExitStatus, OutputCapture, ProcessRequest, Step, StepKind, StepRequest, StepResult,
    TrajectoryLog,
};
use serde::Serialize;
use tokio::sync::watch;

use crate::backend::{ProcessControl, ProcessExit, ProcessOutput, Spawned, WinSize};
use crate::error::ApiError;
use crate::events::{kind, Subject};
use crate::trajectory::{self, Decision};

/// Output kept per process for subscribers that come late.
pub const REPLAY_BYTES: usize = 1 << 20;
/// Running processes per sandbox.
pub const MAX_LIVE: usize = 256;
/// Ended processes per sandbox remembered for a late `attach` or `wait`.
pub const MAX_EXITED: usize = 64;

/// Which stream a chunk of output came on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
    /// The process's terminal (stdout and stderr together).
    Pty,
}

/// What a process is, as `GET /v1/sandboxes/{id}/processes` lists it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ProcessInfo {
    /// Its pid inside the sandbox.
    pub pid: i32,
    /// The name it was spawned with.
    pub tag: Option<String>,
    /// Its argv.
    pub cmd: Vec<String>,
    /// Whether it runs on a terminal.
    pub pty: bool,
    /// Unix time it was spawned at.
    pub started_at: f64,
    /// Whether it still runs.
    pub running: bool,
    /// How it ended, once it has.
    pub exit: Option<ProcessExit>,
    /// Its spawn's step in the sandbox's trajectory log.
    pub step: i64,
}

/// One event a subscriber reads.
#[derive(Debug)]
pub enum ProcessEvent {
    /// Output; `dropped` bytes before it were no longer buffered for this subscriber.
    Output {
        /// Its stream.
        stream: Stream,
        /// The bytes.
        data: Arc<[u8]>,
        /// Bytes this subscriber missed just before it.
        dropped: u64,
    },
    /// The end; last.
    Exit {
        /// How it ended.
        exit: ProcessExit,
        /// Bytes this subscriber missed just before it.
        dropped: u64,
    },
}

struct Chunk {
    stream: Stream,
    data: Arc<[u8]>,
    /// Bytes of output before it.
    offset: u64,
}

#[derive(Default)]
struct Output {
    chunks: VecDeque<Chunk>,
    /// Sequence number of `chunks[0]`.
    first_seq: u64,
    /// Bytes in `chunks`.
    buffered: usize,
    /// Bytes of output so far.
    total: u64,
    exit: Option<ProcessExit>,
    stdin_closed: bool,
}

/// One spawned process.
pub struct Process {
    pid: i32,
    tag: Option<String>,
    cmd: Vec<String>,
    cwd: String,
    pty: bool,
    /// Its spawn's step in the trajectory log, which names it there.
    spawn_step: i64,
    started_at: f64,
    control: Box<dyn ProcessControl>,
    output: Mutex<Output>,
    /// Bumped on every new chunk and on the exit.
    changed: watch::Sender<()>,
}

impl Process {
    /// Its pid inside the sandbox.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// What it is and how it stands.
    pub fn info(&self) -> ProcessInfo {
        let exit = self.output.lock().expect("lock").exit.clone();
        ProcessInfo {
            pid: self.pid,
            tag: self.tag.clone(),
            cmd: self.cmd.clone(),
            pty: self.pty,
            started_at: self.started_at,
            running: exit.is_none(),
            exit,
            step: self.spawn_step,
        }
    }

    fn push(&self, stream: Stream, data: Vec<u8>) {
        let mut out = self.output.lock().expect("lock");
        let len = data.len();
        let offset = out.total;
        out.chunks.push_back(Chunk {
            stream,
            data: data.into(),
            offset,
        });
        out.total += len as u64;
        out.buffered += len;
        while out.buffered > REPLAY_BYTES && out.chunks.len() > 1 {
            let dropped = out.chunks.pop_front().expect("more than one chunk");
            out.buffered -= dropped.data.len();
            out.first_seq += 1;
        }
        drop(out);
        self.changed.send_replace(());
    }

    fn end(&self, exit: ProcessExit) {
        self.output.lock().expect("lock").exit = Some(exit);
        self.changed.send_replace(());
    }

    /// Refuses input and signals to a process that ended: it cannot take them.
    fn running(&self, what: &str) -> Result<(), ApiError> {
        match &self.output.lock().expect("lock").exit {
            Some(_) => Err(ApiError::conflict(format!(
                "process {} has exited: it cannot take {what}",
                self.pid
            ))),
            None => Ok(()),
        }
    }

    /// Appends `data` to its standard input. A write that waits for the process to read
    /// what is queued (backpressure) ends when the process does.
    pub async fn send_stdin(&self, data: &[u8]) -> Result<(), ApiError> {
        self.running("input")?;
        if self.output.lock().expect("lock").stdin_closed {
            return Err(ApiError::conflict(format!(
                "process {}'s standard input is closed",
                self.pid
            )));
        }
        tokio::select! {
            sent = self.control.send_stdin(data) => sent,
            _ = self.wait(None) => self.running("input"),
        }
    }

    /// Ends its standard input (idempotent).
    pub async fn close_stdin(&self) -> Result<(), ApiError> {
        self.running("input")?;
        let already = std::mem::replace(&mut self.output.lock().expect("lock").stdin_closed, true);
        if already {
            return Ok(());
        }
        self.control.close_stdin().await
    }

    /// Sends it signal number `signal`.
    pub async fn signal(&self, signal: i32) -> Result<(), ApiError> {
        self.running("signals")?;
        self.control.signal(signal).await
    }

    /// Kills it and everything it started.
    pub async fn kill(&self) -> Result<(), ApiError> {
        self.running("signals")?;
        self.control.kill().await
    }

    /// Resizes its terminal.
    pub async fn resize(&self, size: WinSize) -> Result<(), ApiError> {
        if !self.pty {
            return Err(ApiError::invalid(format!(
                "process {} has no terminal to resize: spawn it with pty",
                self.pid
            )));
        }
        self.running("a resize")?;
        self.control.resize(size).await
    }

    /// Its exit, waiting up to `timeout` (forever when `None`) for it; `None` if it still
    /// runs then.
    pub async fn wait(&self, timeout: Option<Duration>) -> Option<ProcessExit> {
        let mut changed = self.changed.subscribe();
        let ended = async {
            loop {
                changed.borrow_and_update();
                if let Some(exit) = &self.output.lock().expect("lock").exit {
                    return exit.clone();
                }
                // The sender lives as long as `self`.
                let _ = changed.changed().await;
            }
        };
        match timeout {
            Some(t) => tokio::time::timeout(t, ended).await.ok(),
            None => Some(ended.await),
        }
    }

    /// Its events from the oldest still buffered, then live, to its exit.
    pub fn subscribe(self: &Arc<Self>) -> Subscription {
        Subscription {
            changed: self.changed.subscribe(),
            process: Arc::clone(self),
            next_seq: 0,
            seen: 0,
            done: false,
        }
    }
}

/// A reader of one process's events (see [`Process::subscribe`]).
pub struct Subscription {
    process: Arc<Process>,
    changed: watch::Receiver<()>,
    next_seq: u64,
    /// Bytes of output up to where this subscriber is.
    seen: u64,
    done: bool,
}

impl Subscription {
    /// The next event; `None` after the exit.
    pub async fn next(&mut self) -> Option<ProcessEvent> {
        while !self.done {
            self.changed.borrow_and_update();
            if let Some(event) = self.take() {
                return Some(event);
            }
            // The sender lives as long as the process this holds.
            let _ = self.changed.changed().await;
        }
        None
    }

    fn take(&mut self) -> Option<ProcessEvent> {
        let out = self.process.output.lock().expect("lock");
        self.next_seq = self.next_seq.max(out.first_seq);
        let index = usize::try_from(self.next_seq - out.first_seq).unwrap_or(usize::MAX);
        if let Some(chunk) = out.chunks.get(index) {
            let dropped = chunk.offset - self.seen;
            self.seen = chunk.offset + chunk.data.len() as u64;
            self.next_seq += 1;
            return Some(ProcessEvent::Output {
                stream: chunk.stream,
                data: Arc::clone(&chunk.data),
                dropped,
            });
        }
        let exit = out.exit.clone()?;
        self.done = true;
        Some(ProcessEvent::Exit {
            exit,
            dropped: out.total - self.seen,
        })
    }
}

/// A new process's identity, checked against the table before it is spawned.
pub struct NewProcess {
    /// Its name, unique among running processes.
    pub tag: Option<String>,
    /// Its argv.
    pub cmd: Vec<String>,
    /// Its working directory.
    pub cwd: String,
    /// Whether it runs on a terminal.
    pub pty: bool,
    /// Unix time now.
    pub started_at: f64,
}

#[derive(Default)]
struct Table {
    by_pid: BTreeMap<i32, Arc<Process>>,
    /// Ended processes' pids, oldest first.
    exited: VecDeque<i32>,
    /// Spawns admitted and not yet in `by_pid`.
    starting: usize,
    /// Tags of those spawns.
    starting_tags: Vec<String>,
}

impl Table {
    fn live(&self) -> impl Iterator<Item = &Arc<Process>> {
        self.by_pid.values().filter(|p| p.info().running)
    }
}

/// One sandbox's spawned processes.
#[derive(Default)]
pub struct Processes {
    table: Arc<Mutex<Table>>,
}

impl Processes {
    /// What a re-issued spawn answers: the process it started, if the table still has it;
    /// else the process as `recorded`, ended (with its recorded end, or an error saying
    /// its end went unrecorded).
    fn replayed(&self, recorded: &Step) -> ProcessInfo {
        let live = recorded
            .result
            .pid
            .and_then(|pid| self.by_pid(pid))
            .filter(|p| p.spawn_step == recorded.step);
        if let Some(p) = live {
            return p.info();
        }
        let (r, process) = (&recorded.result, recorded.request.process.as_ref());
        ProcessInfo {
            pid: r.pid.unwrap_or_default(),
            tag: process.and_then(|p| p.tag.clone()),
            cmd: recorded.request.argv.clone(),
            pty: process.is_some_and(|p| p.pty.is_some()),
            started_at: recorded.started_at,
            running: false,
            exit: Some(ProcessExit {
                exit_code: r.exit.exit_code,
                signal: None,
                oom_killed: r.exit.oom_killed,
                duration_ms: r.exit.duration_ms,
                error: r.running.then(|| {
                    "the process is gone and its end was not recorded (the sandbox's server \
                     stopped before it ended)"
                        .to_owned()
                }),
            }),
            step: recorded.step,
        }
    }

    /// Admits a spawn: `Conflict` over [`MAX_LIVE`] or for a tag a running process has.
    /// The admission holds its place until [`Processes::insert`] or its drop.
    pub fn admit(&self, new: NewProcess) -> Result<Admitted, ApiError> {
        let mut table = self.table.lock().expect("lock");
        if table.live().count() + table.starting >= MAX_LIVE {
            return Err(ApiError::conflict(format!(
                "the sandbox already runs {MAX_LIVE} spawned processes: wait for or kill one"
            )));
        }
        if let Some(tag) = &new.tag {
            if table.starting_tags.contains(tag)
                || table.live().any(|p| p.tag.as_ref() == Some(tag))
            {
                return Err(ApiError::conflict(format!(
                    "a running process is already tagged {tag:?}"
                )));
            }
            table.starting_tags.push(tag.clone());
        }
        table.starting += 1;
        Ok(Admitted {
            table: Arc::clone(&self.table),
            tag: new.tag.clone(),
            new: Some(new),
        })
    }

    /// Running and remembered processes, by pid.
    pub fn list(&self) -> Vec<ProcessInfo> {
        let table = self.table.lock().expect("lock");
        table.by_pid.values().map(|p| p.info()).collect()
    }

    /// The process with pid `pid`, running or remembered.
    fn by_pid(&self, pid: i32) -> Option<Arc<Process>> {
        self.table.lock().expect("lock").by_pid.get(&pid).cloned()
    }

    /// The process `pid_or_tag` names: a pid, or a tag (the running process with it, else
    /// the last that ended).
    pub fn get(&self, pid_or_tag: &str) -> Result<Arc<Process>, ApiError> {
        let table = self.table.lock().expect("lock");
        let found = match pid_or_tag.parse::<i32>() {
            Ok(pid) => table.by_pid.get(&pid).cloned(),
            Err(_) => table
                .live()
                .find(|p| p.tag.as_deref() == Some(pid_or_tag))
                .or_else(|| {
                    table
                        .exited
                        .iter()
                        .rev()
                        .filter_map(|pid| table.by_pid.get(pid))
                        .find(|p| p.tag.as_deref() == Some(pid_or_tag))
                })
                .cloned(),
        };
        found.ok_or_else(|| {
            ApiError::not_found(format!(
                "no process {pid_or_tag:?} in this sandbox (processes(): what runs)"
            ))
        })
    }
}

/// A spawn admitted into the table (see [`Processes::admit`]).
pub struct Admitted {
    table: Arc<Mutex<Table>>,
    tag: Option<String>,
    new: Option<NewProcess>,
}

impl Admitted {
    /// Enters the spawned process, recorded at `end`'s step, in the table and starts
    /// reading its output.
    pub fn insert(mut self, spawned: Spawned, end: EndRecord) -> Arc<Process> {
        let new = self.new.take().expect("inserted once");
        let (changed, _) = watch::channel(());
        let process = Arc::new(Process {
            pid: spawned.pid,
            tag: new.tag,
            cmd: new.cmd,
            cwd: new.cwd,
            pty: new.pty,
            spawn_step: end.step.step,
            started_at: new.started_at,
            control: spawned.control,
            output: Mutex::default(),
            changed,
        });
        {
            let mut table = self.table.lock().expect("lock");
            // A pid the sandbox reuses replaces the ended process that had it.
            if table
                .by_pid
                .insert(process.pid, Arc::clone(&process))
                .is_some()
            {
                table.exited.retain(|pid| *pid != process.pid);
            }
        }
        tokio::spawn(relay(
            Arc::downgrade(&self.table),
            Arc::clone(&process),
            spawned.output,
            end,
        ));
        process
    }
}

impl Drop for Admitted {
    /// Inserted or not, the spawn no longer holds a place or reserves its tag.
    fn drop(&mut self) {
        let mut table = self.table.lock().expect("lock");
        table.starting -= 1;
        if let Some(tag) = &self.tag {
            if let Some(i) = table.starting_tags.iter().position(|t| t == tag) {
                table.starting_tags.swap_remove(i);
            }
        }
    }
}

/// What records a process's end in its spawn step: the step as appended, and the
/// process's output as the log keeps it (bounded as a run's); and the `command.end`
/// event it makes.
pub struct EndRecord {
    log: TrajectoryLog,
    step: Step,
    stdout: OutputCapture,
    stderr: OutputCapture,
    announce: Announce,
}

/// Emits a spawned process's `command.end` (its sandbox's events, taken at spawn: the
/// process table holds its sandbox only weakly).
type Announce = Box<dyn FnOnce(&ProcessExit) + Send>;

/// The `command.end` of a process spawned in `entry` as pid `pid` (`tag`), at `step`.
fn announcer(entry: &super::Entry, pid: i32, tag: Option<String>, step: i64) -> Announce {
    let events = Arc::clone(&entry.events);
    let (sandbox, labels, project) = (
        entry.info.id.clone(),
        entry.info.labels.clone(),
        entry.project.clone(),
    );
    Box::new(move |exit: &ProcessExit| {
        let mut data = serde_json::json!({
            "spawned": true,
            "pid": pid,
            "tag": tag,
            "step": step,
            "exit_code": exit.exit_code,
            "signal": exit.signal,
            "oom_killed": exit.oom_killed,
            "duration_ms": exit.duration_ms,
        });
        if let Some(error) = &exit.error {
            data["error"] = error.clone().into();
        }
        let subject = Subject {
            id: &sandbox,
            labels: &labels,
            project: project.as_deref(),
        };
        events.emit(kind::COMMAND_END, Some(subject), data);
    })
}

impl EndRecord {
    /// The end of the process spawned at `step` (as recorded), for `log`, announced by
    /// `announce`.
    pub fn new(log: &TrajectoryLog, step: Step, announce: Announce) -> EndRecord {
        EndRecord {
            stdout: log.capture(),
            stderr: log.capture(),
            log: log.clone(),
            step,
            announce,
        }
    }

    /// Records the end; waits until it is durable, so that a client that saw the exit
    /// finds it in the log.
    async fn record(mut self, exit: &ProcessExit) {
        (self.announce)(exit);
        let status = ExitStatus {
            exit_code: exit.exit_code,
            oom_killed: exit.oom_killed,
            duration_ms: exit.duration_ms,
            ..ExitStatus::default()
        };
        self.step.result = StepResult {
            pid: self.step.result.pid,
            ..StepResult::new(status, self.stdout.finish(), self.stderr.finish())
        };
        self.step.finished_at = super::unix_now();
        let (sandbox, step) = (self.step.sandbox_id.clone(), self.step.step);
        if let Err(e) = self.log.ended(self.step).wait().await {
            tracing::warn!(%sandbox, step, error = %e, "trajectory log: a process's end could not be recorded");
        }
    }
}

/// Reads a process's output into its buffer to the end, records its end in the log, then
/// moves it to the ended ones (forgetting the oldest past [`MAX_EXITED`]). Holds the table
/// weakly: a stopped sandbox's table goes, and so does the rest of its processes' output.
async fn relay(
    table: std::sync::Weak<Mutex<Table>>,
    process: Arc<Process>,
    mut output: Box<dyn crate::backend::ProcessStream>,
    mut end: EndRecord,
) {
    let stream = if process.pty {
        Stream::Pty
    } else {
        Stream::Stdout
    };
    let exit = loop {
        match output.next().await {
            Some(Ok(ProcessOutput::Stdout(data))) => {
                end.stdout.push(&data);
                process.push(stream, data);
            }
            Some(Ok(ProcessOutput::Stderr(data))) => {
                end.stderr.push(&data);
                process.push(Stream::Stderr, data);
            }
            Some(Ok(ProcessOutput::Exit(exit))) => break exit,
            Some(Err(e)) => {
                break ProcessExit {
                    error: Some(e.message),
                    ..ProcessExit::default()
                }
            }
            None => {
                break ProcessExit {
                    error: Some("the sandbox ended before the process".into()),
                    ..ProcessExit::default()
                }
            }
        }
    };
    end.record(&exit).await;
    process.end(exit);
    let Some(table) = table.upgrade() else {
        return;
    };
    let mut table = table.lock().expect("lock");
    table.exited.push_back(process.pid);
    while table.exited.len() > MAX_EXITED {
        if let Some(pid) = table.exited.pop_front() {
            table.by_pid.remove(&pid);
        }
    }
}

/// `POST /v1/sandboxes/{id}/processes`.
#[derive(Clone, Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SpawnRequest {
    /// A string for `/bin/sh -c`, or an argv.
    pub cmd: dsec_api::Command,
    /// Environment added to the image's and the sandbox's.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; the image's by default.
    pub cwd: Option<String>,
    /// Keep standard input open for `stdin` requests (else it is closed at once).
    #[serde(default = "yes")]
    pub stdin: bool,
    /// Run on a new terminal of this size.
    pub pty: Option<PtySize>,
    /// A name for the process, unique among the sandbox's running processes.
    pub tag: Option<String>,
    /// The user of the sandbox to run as: a name, a uid or `uid:gid`, looked up in the
    /// sandbox's own `/etc/passwd` and `/etc/group`; root when omitted.
    pub user: Option<String>,
    /// Its step in the sandbox's trajectory (see `exec`'s `step`).
    pub step: Option<i64>,
}

/// An act on a spawned process, recorded as a step of its sandbox's trajectory.
pub enum Act {
    /// Bytes for its standard input.
    Stdin(Vec<u8>),
    /// The end of its standard input.
    CloseStdin,
    /// A signal, by number.
    Signal(i32),
    /// A kill of it and everything it started.
    Kill,
    /// A new terminal size.
    Resize(WinSize),
}

/// A terminal's size in character cells, as requests give it.
#[derive(Clone, Copy, Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    /// Columns, at least 1.
    pub cols: u16,
    /// Rows, at least 1.
    pub rows: u16,
}

impl PtySize {
    /// The size, checked: `InvalidArgument` for an empty terminal.
    pub fn checked(self) -> Result<WinSize, ApiError> {
        if self.cols == 0 || self.rows == 0 {
            return Err(ApiError::invalid(format!(
                "a terminal needs at least one column and one row, got cols={} rows={}",
                self.cols, self.rows
            )));
        }
        Ok(WinSize {
            cols: self.cols,
            rows: self.rows,
        })
    }
}

fn yes() -> bool {
    true
}

/// Longest tag.
const MAX_TAG: usize = 128;

impl super::Edge {
    /// Spawns a process that outlives the request; it joins the sandbox's table.
    pub async fn spawn(&self, id: &str, req: SpawnRequest) -> Result<ProcessInfo, ApiError> {
        let entry = self.live_entry(id).await?;
        let argv = super::argv_of(req.cmd)?;
        if let Some(tag) = &req.tag {
            if tag.is_empty() || tag.len() > MAX_TAG || tag.parse::<i32>().is_ok() {
                return Err(ApiError::invalid(format!(
                    "tag must be 1 to {MAX_TAG} bytes and not a number (numbers name pids), \
                     got {tag:?}"
                )));
            }
        }
        let run_as = super::run_as(req.user.as_deref(), req.cwd.is_some())?;
        let pty = req.pty.map(PtySize::checked).transpose()?;
        let cwd = req.cwd.unwrap_or_else(|| entry.workdir.clone());
        super::check_absolute("cwd", &cwd)?;
        let env = super::command_env(
            &entry.env,
            &super::env_pairs(&req.env, "environment")?,
            run_as.is_some(),
        );
        let request = StepRequest {
            argv: argv.clone(),
            env: req.env.clone(),
            cwd: cwd.clone(),
            run_as: run_as.as_ref().map(|r| r.user.clone()),
            kind: StepKind::Spawn,
            process: Some(ProcessRequest {
                tag: req.tag.clone(),
                pty: pty.map(|p| [p.cols, p.rows]),
                stdin_open: req.stdin,
                ..ProcessRequest::default()
            }),
            ..StepRequest::default()
        };
        let recorder =
            match trajectory::decide(&self.log, id, &entry.position, req.step, request).await? {
                Decision::Replay(step) => return Ok(entry.processes.replayed(&step)),
                Decision::Run(recorder) => recorder,
            };
        let admitted = entry.processes.admit(NewProcess {
            tag: req.tag.clone(),
            cmd: argv.clone(),
            cwd: cwd.clone(),
            pty: pty.is_some(),
            started_at: super::unix_now(),
        })?;
        entry.emit(
            kind::COMMAND_START,
            serde_json::json!({
                "cmd": super::command_summary(&argv),
                "cwd": cwd,
                "spawned": true,
                "tag": req.tag,
                "user": run_as.as_ref().map(|r| &r.user),
            }),
        );
        let spawned = entry
            .sandbox
            .spawn(crate::backend::ProcessSpec {
                argv,
                env,
                cwd,
                pty,
                run_as,
            })
            .await;
        let spawned = match entry.or_failed(spawned).await {
            Ok(spawned) => spawned,
            Err(e) => {
                entry.emit(
                    kind::COMMAND_END,
                    serde_json::json!({"spawned": true, "tag": req.tag, "error": e.message, "duration_ms": 0.0}),
                );
                return Err(e);
            }
        };
        let started = StepResult {
            pid: Some(spawned.pid),
            running: true,
            ..StepResult::default()
        };
        let step = match recorder.record_now(started).await {
            Ok(step) => step,
            Err(e) => {
                // Unrecorded, it would be a process no replay knows of.
                let _ = spawned.control.kill().await;
                return Err(e);
            }
        };
        let announce = announcer(&entry, spawned.pid, req.tag.clone(), step.step);
        let process = admitted.insert(spawned, EndRecord::new(&self.log, step, announce));
        if !req.stdin {
            process.close_stdin().await?;
        }
        Ok(process.info())
    }

    /// Does `act` to the process `pid_or_tag` names in sandbox `id`, as step `step` of its
    /// trajectory (the next one when `None`): not again when the trajectory recorded it.
    pub async fn act(
        &self,
        id: &str,
        pid_or_tag: &str,
        step: Option<i64>,
        act: Act,
    ) -> Result<(), ApiError> {
        let entry = self.live_entry(id).await?;
        let process = entry.processes.get(pid_or_tag)?;
        let mut target = ProcessRequest {
            spawn_step: Some(process.spawn_step),
            ..ProcessRequest::default()
        };
        let mut stdin_sha256 = None;
        let kind = match &act {
            Act::Stdin(data) => {
                let mut input = self.log.capture();
                input.push(data);
                let kept = input.finish();
                stdin_sha256 = Some(kept.sha256);
                (target.input, target.input_bytes, target.input_elided) =
                    (kept.text, kept.bytes, kept.elided);
                StepKind::Stdin
            }
            Act::CloseStdin => StepKind::CloseStdin,
            Act::Signal(n) => {
                target.signal = Some(*n);
                StepKind::Signal
            }
            Act::Kill => StepKind::Kill,
            Act::Resize(size) => {
                target.pty = Some([size.cols, size.rows]);
                StepKind::Resize
            }
        };
        let request = StepRequest {
            argv: process.cmd.clone(),
            cwd: process.cwd.clone(),
            stdin_sha256,
            kind,
            process: Some(target),
            ..StepRequest::default()
        };
        let recorder =
            match trajectory::decide(&self.log, id, &entry.position, step, request).await? {
                Decision::Replay(_) => return Ok(()),
                Decision::Run(recorder) => recorder,
            };
        let started = Instant::now();
        match act {
            Act::Stdin(data) => process.send_stdin(&data).await?,
            Act::CloseStdin => process.close_stdin().await?,
            Act::Signal(n) => process.signal(n).await?,
            Act::Kill => process.kill().await?,
            Act::Resize(size) => process.resize(size).await?,
        }
        let done = StepResult {
            exit: ExitStatus {
                duration_ms: started.elapsed().as_secs_f64() * 1e3,
                ..ExitStatus::default()
            },
            ..StepResult::default()
        };
        recorder.record_now(done).await.map(drop)
    }

    /// The sandbox's processes: running ones and those that ended lately.
    pub fn processes(&self, id: &str) -> Result<Vec<ProcessInfo>, ApiError> {
        Ok(self.entry(id)?.processes.list())
    }

    /// The process `pid_or_tag` names in sandbox `id`.
    pub fn process(&self, id: &str, pid_or_tag: &str) -> Result<Arc<Process>, ApiError> {
        self.entry(id)?.processes.get(pid_or_tag)
    }
}
