//! A running exec's output: read as the daemon demultiplexes it, bounded per stream,
//! drained briefly after the exit, killed at its deadline, and runc's report of a command
//! it could not start turned into what the native backend answers.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bollard::container::LogOutput;
use bollard::errors::Error as DockerError;
use futures::{Stream, StreamExt};

use super::host::{exec_error, LocalView};
use super::Inner;
use crate::backend::{CommandSpec, ExitStatus, Output, OutputStream};
use crate::error::ApiError;

/// How often a running command's exec is inspected. The attach stream usually ends when
/// the command does, but background processes holding its pipes keep it open (Docker
/// then waits up to 2 s); the poll notices the exit regardless.
const EXIT_POLL: Duration = Duration::from_millis(250);
/// After the exec was seen to exit, output is read until it pauses this long (what the
/// command wrote may still be in transit through the daemon)...
const DRAIN: Duration = Duration::from_millis(50);
/// ...but not longer than this: background processes may hold its pipes forever. A
/// command none of whose output has arrived yet is read until its stream ends, up to this
/// too: on a loaded daemon its output can arrive well after the exit is seen.
const DRAIN_MAX: Duration = Duration::from_secs(2);
/// After a timeout's kill, how long to wait for the exec to be reported gone.
const KILL_GRACE: Duration = Duration::from_secs(5);

pub(super) type LogStream = Pin<Box<dyn Stream<Item = Result<LogOutput, DockerError>> + Send>>;

/// A running exec: its demultiplexed output, bounded, then its exit.
pub(super) struct DockerOutput {
    inner: Arc<Inner>,
    exec_id: String,
    output: Option<LogStream>,
    stdin_task: Option<tokio::task::JoinHandle<()>>,
    started: Instant,
    deadline: tokio::time::Instant,
    next_poll: tokio::time::Instant,
    exited_at: Option<tokio::time::Instant>,
    last_output: tokio::time::Instant,
    /// Set by a timeout: past it, the command is given up on even if it still runs (its
    /// tree could not be killed from here).
    give_up_at: Option<tokio::time::Instant>,
    max_output: u64,
    sent: [u64; 2],
    truncated: bool,
    timed_out: bool,
    done: bool,
    /// `argv[0]` and the working directory, to report a command that could not start.
    program: String,
    cwd: String,
    /// A first stdout chunk that looks like runc's "could not start" report, held until
    /// the exit code says whether it was one.
    held: Option<Vec<u8>>,
    seen_output: bool,
    queue: VecDeque<Result<Output, ApiError>>,
}

/// How runc reports, on the exec's stdout, a command it could not start.
const RUNC_LAUNCH_FAILURE: &[u8] = b"OCI runtime exec failed";

/// Why runc could not start a command, as the native backend reports it.
#[derive(Debug, PartialEq)]
enum LaunchFailure {
    /// The working directory: an `InvalidArgument` error.
    Cwd(String),
    /// The program: a message on stderr and a shell's exit code.
    Exec { code: i32, stderr: String },
}

/// Reads runc's report; `None` when it is not one dsec recognises.
fn launch_failure(report: &[u8], program: &str, cwd: &str) -> Option<LaunchFailure> {
    let text = String::from_utf8_lossy(report).to_lowercase();
    let errno = if text.contains("no such file or directory")
        || text.contains("executable file not found")
    {
        libc::ENOENT
    } else if text.contains("permission denied") {
        libc::EACCES
    } else if text.contains("not a directory") {
        libc::ENOTDIR
    } else if text.contains("exec format error") {
        libc::ENOEXEC
    } else {
        return None;
    };
    let err = std::io::Error::from_raw_os_error(errno);
    if text.contains("chdir to cwd") {
        return Some(LaunchFailure::Cwd(format!(
            "working directory {cwd:?}: {err}"
        )));
    }
    Some(LaunchFailure::Exec {
        code: if errno == libc::ENOENT { 127 } else { 126 },
        stderr: format!("dsec: cannot execute {program:?}: {err}\n"),
    })
}

impl DockerOutput {
    /// Reads exec `exec_id` of `cmd`, started at `started`, from its attached `output`.
    pub(super) fn new(
        inner: Arc<Inner>,
        exec_id: String,
        output: LogStream,
        stdin_task: Option<tokio::task::JoinHandle<()>>,
        started: Instant,
        cmd: &CommandSpec,
    ) -> Self {
        DockerOutput {
            inner,
            exec_id,
            output: Some(output),
            stdin_task,
            started,
            deadline: tokio::time::Instant::from_std(
                started + Duration::from_millis(cmd.timeout_ms),
            ),
            next_poll: tokio::time::Instant::from_std(started + EXIT_POLL),
            exited_at: None,
            last_output: tokio::time::Instant::from_std(started),
            give_up_at: None,
            max_output: cmd.max_output_bytes,
            sent: [0, 0],
            truncated: false,
            timed_out: false,
            done: false,
            program: cmd.argv.first().cloned().unwrap_or_default(),
            cwd: cmd.cwd.clone(),
            held: None,
            seen_output: false,
            queue: VecDeque::new(),
        }
    }

    /// Queues a chunk of output, within its stream's bound.
    fn push(&mut self, stream: usize, data: &[u8]) {
        if let Some(chunk) = self.bound(stream, data) {
            self.queue.push_back(Ok(if stream == 0 {
                Output::Stdout(chunk)
            } else {
                Output::Stderr(chunk)
            }));
        }
    }

    /// Output as it arrives; a first chunk that may be runc's launch failure waits.
    fn take_output(&mut self, stream: usize, data: &[u8]) {
        self.last_output = tokio::time::Instant::now();
        if !self.seen_output && stream == 0 && data.starts_with(RUNC_LAUNCH_FAILURE) {
            self.seen_output = true;
            self.held = Some(data.to_vec());
            return;
        }
        self.seen_output = true;
        if let Some(held) = self.held.take() {
            self.push(0, &held);
        }
        self.push(stream, data);
    }

    /// Queues the end: the exit, or what runc's launch failure means.
    fn take_exit(&mut self, exit: Result<Output, ApiError>) {
        let Some(held) = self.held.take() else {
            self.queue.push_back(exit);
            return;
        };
        if let Ok(Output::Exit(mut status)) = exit {
            if matches!(status.exit_code, Some(126 | 127)) {
                match launch_failure(&held, &self.program, &self.cwd) {
                    Some(LaunchFailure::Cwd(message)) => {
                        self.queue.push_back(Err(ApiError::invalid(message)));
                        return;
                    }
                    Some(LaunchFailure::Exec { code, stderr }) => {
                        self.push(1, stderr.as_bytes());
                        status.exit_code = Some(code);
                        self.queue.push_back(Ok(Output::Exit(status)));
                        return;
                    }
                    None => {}
                }
            }
            self.push(0, &held);
            self.queue.push_back(Ok(Output::Exit(status)));
            return;
        }
        self.push(0, &held);
        self.queue.push_back(exit);
    }

    /// Keeps what fits under the stream's bound; the rest is dropped and flagged.
    fn bound(&mut self, stream: usize, data: &[u8]) -> Option<Vec<u8>> {
        let room = usize::try_from(self.max_output.saturating_sub(self.sent[stream]))
            .unwrap_or(usize::MAX);
        let n = room.min(data.len());
        if n < data.len() {
            self.truncated = true;
        }
        self.sent[stream] += n as u64;
        (n > 0).then(|| data[..n].to_vec())
    }

    async fn time_out(&mut self) {
        self.timed_out = true;
        self.give_up_at = Some(tokio::time::Instant::now() + KILL_GRACE);
        self.inner.kill_exec(&self.exec_id).await;
    }

    /// The exit code, once the daemon reports the exec gone.
    async fn finish(&mut self) -> Result<Output, ApiError> {
        let mut wait = Duration::from_millis(2);
        let exit_code = loop {
            let info = self
                .inner
                .docker
                .inspect_exec(&self.exec_id)
                .await
                .map_err(|e| exec_error(&self.inner, e))?;
            if info.running != Some(true) {
                break info.exit_code.and_then(|c| i32::try_from(c).ok());
            }
            let now = tokio::time::Instant::now();
            if !self.timed_out && now >= self.deadline {
                self.time_out().await;
            }
            if self.give_up_at.is_some_and(|t| now >= t) {
                tracing::warn!(exec = %self.exec_id, "a timed-out command is still running");
                break None;
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(EXIT_POLL);
        };
        if let Some(task) = self.stdin_task.take() {
            task.abort();
        }
        self.done = true;
        let oom_killed = self
            .inner
            .local
            .as_ref()
            .is_some_and(LocalView::take_oom_kill);
        Ok(Output::Exit(ExitStatus {
            exit_code: if self.timed_out { None } else { exit_code },
            timed_out: self.timed_out,
            truncated: self.truncated,
            oom_killed,
            duration_ms: self.started.elapsed().as_secs_f64() * 1000.0,
        }))
    }
}

#[async_trait]
impl OutputStream for DockerOutput {
    async fn next(&mut self) -> Option<Result<Output, ApiError>> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Some(event);
            }
            if self.done {
                return None;
            }
            let Some(output) = self.output.as_mut() else {
                let exit = self.finish().await;
                self.done = true;
                self.take_exit(exit);
                continue;
            };
            // Output stops being read shortly after the exit, or when a timed-out command
            // outlives its grace.
            let drained = self.exited_at.map(|t| {
                let quiet = if self.seen_output {
                    self.last_output.max(t) + DRAIN
                } else {
                    t + DRAIN_MAX
                };
                quiet.min(t + DRAIN_MAX)
            });
            let stop_reading = match (drained, self.give_up_at) {
                (Some(d), Some(g)) => Some(d.min(g)),
                (d, g) => d.or(g),
            };
            tokio::select! {
                biased;
                item = output.next() => match item {
                    Some(Ok(LogOutput::StdOut { message })) => self.take_output(0, &message),
                    Some(Ok(LogOutput::StdErr { message })) => self.take_output(1, &message),
                    // A TTY's one stream (spawned processes on a terminal).
                    Some(Ok(LogOutput::Console { message })) => self.take_output(0, &message),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "docker exec output ended with an error");
                        self.output = None;
                    }
                    None => self.output = None,
                },
                _ = tokio::time::sleep_until(self.deadline), if !self.timed_out => {
                    self.time_out().await;
                }
                _ = tokio::time::sleep_until(self.next_poll), if self.exited_at.is_none() => {
                    match self.inner.docker.inspect_exec(&self.exec_id).await {
                        Ok(info) if info.running == Some(false) => {
                            self.exited_at = Some(tokio::time::Instant::now());
                        }
                        _ => self.next_poll = tokio::time::Instant::now() + EXIT_POLL,
                    }
                }
                _ = tokio::time::sleep_until(stop_reading.unwrap_or(self.deadline)), if stop_reading.is_some() => {
                    self.output = None;
                }
            }
        }
    }
}

impl Drop for DockerOutput {
    /// A caller that stops listening (a client that went away mid-stream) must not leave
    /// the command running.
    fn drop(&mut self) {
        if let Some(task) = self.stdin_task.take() {
            task.abort();
        }
        if self.done {
            return;
        }
        let (inner, exec_id) = (Arc::clone(&self.inner), self.exec_id.clone());
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move { inner.kill_exec(&exec_id).await });
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runc_launch_failures_read_like_the_native_ones() {
        let not_found = b"OCI runtime exec failed: exec failed: unable to start container \
            process: exec: \"/no/such\": stat /no/such: no such file or directory: unknown\r\n";
        assert_eq!(
            launch_failure(not_found, "/no/such", "/"),
            Some(LaunchFailure::Exec {
                code: 127,
                stderr: "dsec: cannot execute \"/no/such\": No such file or directory \
                         (os error 2)\n"
                    .into()
            })
        );
        let cwd = b"OCI runtime exec failed: exec failed: unable to start container process: \
            chdir to cwd (\"/no/dir\") set in config.json failed: no such file or directory";
        assert_eq!(
            launch_failure(cwd, "pwd", "/no/dir"),
            Some(LaunchFailure::Cwd(
                "working directory \"/no/dir\": No such file or directory (os error 2)".into()
            ))
        );
        assert_eq!(
            launch_failure(b"OCI runtime exec failed: other", "x", "/"),
            None
        );
    }
}
