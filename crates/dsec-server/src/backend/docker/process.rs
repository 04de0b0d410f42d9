//! Spawned processes of a Docker sandbox: an exec with its stdin attached (and a TTY for
//! a terminal), read to its end by [`DockerOutput`] like any exec but with no timeout
//! before the sandbox's own lifetime. Its pid inside the container comes from the host's
//! `/proc/PID/status` (`NSpid`), and signals are sent from the host to the exec's main
//! process once it is checked to be in the container's pid namespace: which needs the
//! daemon on this host, as killing a command's tree does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bollard::exec::{CreateExecOptions, ResizeExecOptions, StartExecOptions, StartExecResults};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use super::host::exec_error;
use super::output::DockerOutput;
use super::Inner;
use crate::backend::{
    CommandSpec, Output, OutputStream, ProcessControl, ProcessExit, ProcessOutput, ProcessSpec,
    ProcessStream, Spawned, WinSize,
};
use crate::error::ApiError;

/// A spawned exec's bound on its run: a sandbox lives at most 30 days, so it never fires.
const NO_TIMEOUT_MS: u64 = 30 * 86_400_000;
/// How long a new exec may take to get a pid from the daemon.
const START_WAIT: Duration = Duration::from_secs(10);
/// What a terminal reads as end-of-file at the start of a line (Ctrl-D).
const EOF_CHAR: u8 = 0x04;

/// What the stdin writer task is told: data holds its share of the queue's bound until
/// it is written.
enum Input {
    Data(Vec<u8>, OwnedSemaphorePermit),
    Close,
}

/// Spawns `spec` as an exec in `inner`'s container, as `user` (docker's `User`; the
/// container's default, root, when `None`).
pub(super) async fn spawn(
    inner: &Arc<Inner>,
    spec: ProcessSpec,
    user: Option<String>,
) -> Result<Spawned, ApiError> {
    let Some(local) = &inner.local else {
        return Err(ApiError::unavailable(
            "spawned processes of docker sandboxes need the docker daemon on this host",
        ));
    };
    let pidns = local.pidns();
    let tty = spec.pty.is_some();
    let config = CreateExecOptions {
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(tty),
        env: Some(spec.env.clone()),
        cmd: Some(spec.argv.clone()),
        working_dir: Some(spec.cwd.clone()),
        user,
        ..Default::default()
    };
    let exec = inner
        .docker
        .create_exec(&inner.id, config)
        .await
        .map_err(|e| exec_error(inner, e))?;
    let started = Instant::now();
    let opts = StartExecOptions {
        detach: false,
        tty,
        output_capacity: Some(64 << 10),
    };
    let StartExecResults::Attached { output, mut input } = inner
        .docker
        .start_exec(&exec.id, Some(opts))
        .await
        .map_err(|e| exec_error(inner, e))?
    else {
        return Err(ApiError::internal("the daemon started the exec detached"));
    };
    let cmd = CommandSpec {
        argv: spec.argv.clone(),
        env: Vec::new(),
        cwd: spec.cwd.clone(),
        stdin: Vec::new(),
        files: Vec::new(),
        timeout_ms: NO_TIMEOUT_MS,
        max_output_bytes: u64::MAX,
        run_as: None,
    };
    let mut output = DockerOutput::new(
        Arc::clone(inner),
        exec.id.clone(),
        output,
        None,
        started,
        &cmd,
    );
    let Some(host_pid) = exec_host_pid(inner, &exec.id).await? else {
        return Err(never_started(&mut output).await);
    };
    let control = DockerControl {
        inner: Arc::clone(inner),
        exec_id: exec.id.clone(),
        host_pid,
        pidns,
        input: {
            let (tx, mut rx) = mpsc::unbounded_channel();
            tokio::spawn(async move {
                while let Some(chunk) = rx.recv().await {
                    match chunk {
                        Input::Data(data, _queued) => {
                            if input.write_all(&data).await.is_err() {
                                return;
                            }
                        }
                        // Closing a terminal would hang it up: type its end-of-file.
                        Input::Close if tty => {
                            let _ = input.write_all(&[EOF_CHAR]).await;
                        }
                        Input::Close => {
                            let _ = input.shutdown().await;
                            return;
                        }
                    }
                }
            });
            tx
        },
        queued: Arc::new(Semaphore::new(dsec_runtime::proto::MAX_STDIN_QUEUED)),
    };
    // Docker's exec create takes no terminal size: it is set once the exec runs. One that
    // already ended (`id -u`) cannot be resized, and that is no error: its output and its
    // exit are still read.
    if let Some(size) = spec.pty {
        if let Err(e) = control.resize(size).await {
            tracing::debug!(error = %e.message, "the spawned process ended before its terminal was sized");
        }
    }
    Ok(Spawned {
        pid: container_pid(host_pid).unwrap_or(host_pid),
        output: Box::new(DockerProcess { output }),
        control: Box::new(control),
    })
}

/// Why an exec ended before it had a pid (runc could not start its program): what it
/// reported, as an `InvalidArgument`.
async fn never_started(output: &mut DockerOutput) -> ApiError {
    let mut said = Vec::new();
    while let Some(event) = output.next().await {
        match event {
            Ok(Output::Stdout(d) | Output::Stderr(d)) => said.extend_from_slice(&d),
            Ok(Output::Exit(_)) => break,
            Err(e) => return e,
        }
    }
    let said = String::from_utf8_lossy(&said);
    ApiError::invalid(match said.trim() {
        "" => "the process exited before the docker daemon gave it a pid".to_owned(),
        text => text.to_owned(),
    })
}

/// The exec's main process on the host, once the daemon reports it; `None` when the
/// exec ended without one.
async fn exec_host_pid(inner: &Inner, exec_id: &str) -> Result<Option<i32>, ApiError> {
    let deadline = Instant::now() + START_WAIT;
    loop {
        let info = inner
            .docker
            .inspect_exec(exec_id)
            .await
            .map_err(|e| exec_error(inner, e))?;
        if let Some(pid) = info.pid.and_then(|p| i32::try_from(p).ok()) {
            if pid > 0 {
                return Ok(Some(pid));
            }
        }
        if info.running == Some(false) {
            return Ok(None);
        }
        if Instant::now() >= deadline {
            return Err(ApiError::internal(
                "the docker daemon did not report the spawned exec's pid",
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `host_pid` as its own pid namespace numbers it: the last `NSpid` of its status.
fn container_pid(host_pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{host_pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// A spawned exec's events, as the native backends report them. Docker says only the
/// exit code: `signal` stays unknown.
struct DockerProcess {
    output: DockerOutput,
}

#[async_trait]
impl ProcessStream for DockerProcess {
    async fn next(&mut self) -> Option<Result<ProcessOutput, ApiError>> {
        Some(match self.output.next().await? {
            Ok(Output::Stdout(data)) => Ok(ProcessOutput::Stdout(data)),
            Ok(Output::Stderr(data)) => Ok(ProcessOutput::Stderr(data)),
            Ok(Output::Exit(status)) => Ok(ProcessOutput::Exit(ProcessExit {
                exit_code: status.exit_code,
                signal: None,
                oom_killed: status.oom_killed,
                duration_ms: status.duration_ms,
                error: None,
            })),
            Err(e) => Err(e),
        })
    }
}

struct DockerControl {
    inner: Arc<Inner>,
    exec_id: String,
    host_pid: i32,
    /// The container's pid namespace: a signal goes to `host_pid` only while it is there.
    pidns: u64,
    input: mpsc::UnboundedSender<Input>,
    /// Bytes of input the writer task may hold before `send_stdin` waits (as init bounds
    /// a native process's: [`dsec_runtime::proto::MAX_STDIN_QUEUED`]).
    queued: Arc<Semaphore>,
}

#[async_trait]
impl ProcessControl for DockerControl {
    async fn send_stdin(&self, data: &[u8]) -> Result<(), ApiError> {
        // A write larger than the bound takes all of it: it waits for an empty queue.
        let share = data.len().min(dsec_runtime::proto::MAX_STDIN_QUEUED);
        let permit = Arc::clone(&self.queued)
            .acquire_many_owned(u32::try_from(share).unwrap_or(u32::MAX))
            .await
            .map_err(|_| ApiError::internal("the stdin queue is closed"))?;
        let _ = self.input.send(Input::Data(data.to_vec(), permit));
        Ok(())
    }

    async fn close_stdin(&self) -> Result<(), ApiError> {
        let _ = self.input.send(Input::Close);
        Ok(())
    }

    async fn signal(&self, signal: i32) -> Result<(), ApiError> {
        if dsec_runtime::procfs::pid_namespace(self.host_pid) != Some(self.pidns) {
            return Ok(()); // It ended; the pid may be another process's by now.
        }
        let sig = rustix::process::Signal::from_named_raw(signal)
            .ok_or_else(|| ApiError::invalid(format!("unknown signal {signal}")))?;
        let pid = rustix::process::Pid::from_raw(self.host_pid)
            .ok_or_else(|| ApiError::internal("the exec's pid is not a pid"))?;
        let _ = rustix::process::kill_process(pid, sig);
        Ok(())
    }

    async fn resize(&self, size: WinSize) -> Result<(), ApiError> {
        let opts = ResizeExecOptions {
            height: size.rows,
            width: size.cols,
        };
        self.inner
            .docker
            .resize_exec(&self.exec_id, opts)
            .await
            .map_err(|e| exec_error(&self.inner, e))
    }

    async fn kill(&self) -> Result<(), ApiError> {
        self.inner.kill_exec(&self.exec_id).await;
        Ok(())
    }
}
