//! Fast-forward replay and recording of commands, between the edge and the trajectory log.
//!
//! Every command that finishes is appended to the log before its result (or, streamed, its
//! exit event) reaches the client. A sandbox created with a `trajectory_id` also
//! fast-forwards: its commands are serialised (one step at a time, in step order), a
//! re-issued step returns its recorded result, and a command of such a sandbox runs to its
//! end and is recorded even if the client that asked for it goes away, so a re-issued step
//! finds it instead of running it twice. A sandbox without one numbers its commands in the
//! order they arrive, runs them concurrently, and a client that disconnects kills its
//! command as before.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use dsec_api::ErrorKind;
use dsec_trajectory::{OutputCapture, Step, StepRequest, StepResult, TrajectoryLog};
use tokio::sync::{mpsc, Mutex, OwnedMutexGuard};

use crate::backend::{ExitStatus, Output, OutputStream};
use crate::error::ApiError;

/// Where a sandbox's next command goes in its trajectory.
pub(crate) enum Position {
    /// Created with a trajectory id: steps are numbered by the client and serialised by
    /// this lock, which holds the next step the trajectory expects.
    Keyed {
        /// The trajectory id.
        id: String,
        /// The next step; held for the whole of a step.
        next: Arc<Mutex<i64>>,
    },
    /// No trajectory id: commands are numbered in the order they arrive.
    Unkeyed(AtomicI64),
}

impl Position {
    /// The position of a sandbox whose trajectory continues at `next` (0 for a new
    /// sandbox but a fork's child, which continues its parent's).
    pub(crate) fn new(trajectory_id: Option<String>, next: i64) -> Position {
        match trajectory_id {
            Some(id) => Position::Keyed {
                id,
                next: Arc::new(Mutex::new(next)),
            },
            None => Position::Unkeyed(AtomicI64::new(next)),
        }
    }

    /// The step the next command takes (once the step in progress, if any, is done).
    pub(crate) async fn next(&self) -> i64 {
        match self {
            Position::Keyed { next, .. } => *next.lock().await,
            Position::Unkeyed(next) => next.load(Ordering::Acquire),
        }
    }

    /// Waits for the step in progress (if any) and keeps the next one out while the
    /// guard lives; yields the next step. `None` for a sandbox without a trajectory id.
    pub(crate) async fn hold(&self) -> Option<OwnedMutexGuard<i64>> {
        match self {
            Position::Keyed { next, .. } => Some(Arc::clone(next).lock_owned().await),
            Position::Unkeyed(_) => None,
        }
    }
}

/// What deciding a command's step led to.
pub(crate) enum Decision {
    /// Run it; [`Recorder::wrap`] records its result.
    Run(Box<Recorder>),
    /// Already recorded with the same request: here is the step as recorded.
    Replay(Box<Step>),
}

/// Decides whether a command runs, replays, or is refused. For a keyed trajectory the
/// returned [`Recorder`] holds the trajectory's lock until the command's result is
/// recorded, so the next step waits for it.
pub(crate) async fn decide(
    log: &TrajectoryLog,
    sandbox_id: &str,
    position: &Position,
    step: Option<i64>,
    request: StepRequest,
) -> Result<Decision, ApiError> {
    if let Some(s) = step.filter(|s| *s < 0) {
        return Err(ApiError::invalid(format!(
            "step must be 0 or more, got {s}"
        )));
    }
    let recorder = |step, trajectory_id, guard| {
        Box::new(Recorder {
            log: log.clone(),
            sandbox_id: sandbox_id.to_owned(),
            trajectory_id,
            step,
            request: request.clone(),
            started_at: unix_now(),
            guard,
        })
    };
    let (id, next) = match position {
        Position::Unkeyed(next) => {
            return Ok(Decision::Run(recorder(
                next.fetch_add(1, Ordering::AcqRel),
                None,
                None,
            )))
        }
        Position::Keyed { id, next } => (id, next),
    };
    let guard = Arc::clone(next).lock_owned().await;
    let expected = *guard;
    let step = step.unwrap_or(expected);
    if step > expected {
        return Err(ApiError::invalid(format!(
            "step {step} skips ahead in trajectory {id:?}: the next step is {expected} \
             (steps are 0, 1, 2, ... with no gaps)"
        )));
    }
    if step == expected {
        return Ok(Decision::Run(recorder(step, Some(id.clone()), Some(guard))));
    }
    drop(guard);
    let recorded = log.step(id, step).await?.ok_or_else(|| {
        ApiError::internal(format!(
            "step {step} of trajectory {id:?} is below the next step {expected} but is \
             not in the log"
        ))
    })?;
    if !recorded.request.same_as(&request) {
        return Err(ApiError::new(
            ErrorKind::TrajectoryDiverged,
            format!(
                "trajectory {id:?} diverged at step {step}: recorded {}; now {}",
                recorded.request.describe(),
                request.describe()
            ),
        ));
    }
    metrics::counter!("dsec_trajectory_replayed_total").increment(1);
    Ok(Decision::Replay(Box::new(recorded)))
}

/// Records one running command's result when it ends.
pub(crate) struct Recorder {
    log: TrajectoryLog,
    sandbox_id: String,
    trajectory_id: Option<String>,
    step: i64,
    request: StepRequest,
    started_at: f64,
    guard: Option<OwnedMutexGuard<i64>>,
}

impl Recorder {
    /// `stream`, recorded at its exit event. A keyed trajectory's command is detached from
    /// its caller: it runs to its end and is recorded even when nobody reads it any more.
    pub(crate) fn wrap(self: Box<Self>, stream: Box<dyn OutputStream>) -> Box<dyn OutputStream> {
        let detach = self.guard.is_some();
        let recording = Box::new(Recording {
            inner: stream,
            stdout: self.log.capture(),
            stderr: self.log.capture(),
            recorder: Some(*self),
        });
        if detach {
            detached(recording)
        } else {
            recording
        }
    }
}

/// A command's events on their way to the client, its output captured as the log keeps
/// it (bounded: the client gets all of it, the log its head and tail).
struct Recording {
    inner: Box<dyn OutputStream>,
    recorder: Option<Recorder>,
    stdout: OutputCapture,
    stderr: OutputCapture,
}

#[async_trait]
impl OutputStream for Recording {
    async fn next(&mut self) -> Option<Result<Output, ApiError>> {
        let event = self.inner.next().await?;
        match &event {
            Ok(Output::Stdout(d)) => self.stdout.push(d),
            Ok(Output::Stderr(d)) => self.stderr.push(d),
            Ok(Output::Exit(exit)) => {
                if let Some(recorder) = self.recorder.take() {
                    let stdout = std::mem::replace(&mut self.stdout, OutputCapture::new(0));
                    let stderr = std::mem::replace(&mut self.stderr, OutputCapture::new(0));
                    if let Err(e) = recorder.record(exit, stdout, stderr).await {
                        return Some(Err(e));
                    }
                }
            }
            Err(_) => {}
        }
        Some(event)
    }
}

impl Recorder {
    /// Records a step that is done when its request is (an act on a spawned process, or
    /// a spawn, whose end [`TrajectoryLog::ended`] adds later) with `result`, and waits
    /// until it is durable; the step as recorded.
    pub(crate) async fn record_now(
        mut self: Box<Self>,
        result: StepResult,
    ) -> Result<Step, ApiError> {
        let step = self.step_of(result);
        self.commit(step.clone()).await?;
        Ok(step)
    }

    /// Appends the step and waits until it is durable; only then does a keyed trajectory
    /// move on to the next step.
    async fn record(
        mut self,
        exit: &ExitStatus,
        stdout: OutputCapture,
        stderr: OutputCapture,
    ) -> Result<(), ApiError> {
        let step = self.step_of(StepResult::new(*exit, stdout.finish(), stderr.finish()));
        self.commit(step).await
    }

    fn step_of(&mut self, result: StepResult) -> Step {
        Step {
            step: self.step,
            trajectory_id: self.trajectory_id.take(),
            sandbox_id: std::mem::take(&mut self.sandbox_id),
            request: std::mem::take(&mut self.request),
            result,
            started_at: self.started_at,
            finished_at: unix_now(),
        }
    }

    async fn commit(mut self, step: Step) -> Result<(), ApiError> {
        let n = step.step;
        let appending = Instant::now();
        let appended = self.log.append(step).wait().await;
        // What logging adds to each command's latency (`bench/bench.py --only trajectory`).
        metrics::histogram!("dsec_trajectory_append_seconds")
            .record(appending.elapsed().as_secs_f64());
        appended.map_err(|e| {
            ApiError::internal(format!(
                "the command ran, but its result could not be recorded (so it was not \
                 returned): {e}"
            ))
        })?;
        if let Some(mut next) = self.guard.take() {
            *next = n + 1;
        }
        Ok(())
    }
}

/// Drives `stream` to its end in a task of its own and hands its events to the returned
/// stream while someone reads it.
fn detached(mut stream: Box<dyn OutputStream>) -> Box<dyn OutputStream> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let mut tx = Some(tx);
        while let Some(event) = stream.next().await {
            if let Some(t) = &tx {
                if t.send(event).await.is_err() {
                    tx = None;
                }
            }
        }
    });
    Box::new(Detached(rx))
}

struct Detached(mpsc::Receiver<Result<Output, ApiError>>);

#[async_trait]
impl OutputStream for Detached {
    async fn next(&mut self) -> Option<Result<Output, ApiError>> {
        self.0.recv().await
    }
}

/// A recorded result played back as the events of a command.
pub(crate) struct Replayed(VecDeque<Output>);

impl Replayed {
    /// The events that reproduce `result`.
    pub(crate) fn new(result: StepResult) -> Replayed {
        let elided = result.elided();
        let mut events = VecDeque::with_capacity(3);
        if !result.stdout.is_empty() {
            events.push_back(Output::Stdout(result.stdout.into_bytes()));
        }
        if !result.stderr.is_empty() {
            events.push_back(Output::Stderr(result.stderr.into_bytes()));
        }
        // Output the log did not keep is output discarded beyond a bound, as far as the
        // client can tell: `truncated` says so (and the log's `*_elided` fields by how much).
        let exit = result.exit;
        events.push_back(Output::Exit(ExitStatus {
            truncated: exit.truncated || elided,
            ..exit
        }));
        Replayed(events)
    }
}

#[async_trait]
impl OutputStream for Replayed {
    async fn next(&mut self) -> Option<Result<Output, ApiError>> {
        self.0.pop_front().map(Ok)
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
