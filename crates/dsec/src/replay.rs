//! `dsec replay`: a sandbox's recorded trajectory re-run in a fresh sandbox, step by step,
//! up to the first step that differs.
//!
//! A run is run again and its exit code and output compared. A spawned process is spawned
//! again at its step, and the acts on it (stdin writes, close-stdin, signals, kills,
//! resizes) are done again at theirs, interleaved with the runs as recorded; a process
//! named by the step that spawned it, since pids differ. A process whose end was recorded
//! is waited for before the first step that started after it ended (so that a run that
//! reads what the process wrote finds it), and at the end of the replay; its exit code and
//! output are compared then. A step the log holds only as digests (a run's stdin or files,
//! a stdin write longer than the log keeps whole) cannot be replayed: the replay stops
//! there and says so.

use std::collections::BTreeMap;
use std::io::BufRead;

use anyhow::{Context, Result};
use dsec_api::{CommandResult, CreateSandboxRequest, SandboxInfo};
use dsec_trajectory::{digest, SandboxLog, Step, StepKind, StepResult};

use crate::{command_text, step_text, Client};

/// The longest wait for a re-spawned process to end (the server's longest `wait`).
const MAX_WAIT_S: f64 = 3600.0;

/// Re-runs `log` in a fresh sandbox; `true` when every step matched.
pub(crate) fn replay(client: &Client, log: &SandboxLog) -> Result<bool> {
    let rec = &log.sandbox;
    let req = CreateSandboxRequest {
        backend: rec.backend.clone(),
        image: rec.image.clone(),
        cpus: None,
        memory_mb: None,
        pids: None,
        disk_mb: None,
        ttl_s: None,
        idle_ttl_s: None,
        env: rec.env.clone(),
        workdir: None,
        network: Default::default(),
        ca_bundle: None,
        labels: BTreeMap::from([("dsec.replay-of".to_owned(), rec.id.clone())]),
        trajectory_id: None,
    };
    let info: SandboxInfo = client.json(client.post("/v1/sandboxes").json(&req))?;
    eprintln!(
        "replaying {} steps of {} in {} ({}, image {})",
        log.steps.len(),
        rec.id,
        info.id,
        rec.backend,
        rec.image
    );
    let outcome = Replay {
        client,
        sandbox: &info.id,
        processes: BTreeMap::new(),
    }
    .run(&log.steps);
    let stopped = client.empty(client.delete(&format!("/v1/sandboxes/{}", info.id)));
    let matched = outcome?;
    stopped.with_context(|| format!("stopping replay sandbox {}", info.id))?;
    Ok(matched)
}

/// A recorded spawn's process, spawned again.
struct Respawned<'a> {
    pid: i32,
    recorded: &'a Step,
    /// Its end was waited for and compared.
    settled: bool,
}

impl Respawned<'_> {
    /// When the recorded process ended, if its end was recorded (not one that still ran, or
    /// that its sandbox's end cut short).
    fn ended_at(&self) -> Option<f64> {
        let r = &self.recorded.result;
        (!self.settled && !r.running && r.exit.exit_code.is_some())
            .then_some(self.recorded.finished_at)
    }
}

/// Why a replay stops: a difference, or a step that cannot be replayed (printed).
type Stop = String;

struct Replay<'a> {
    client: &'a Client,
    sandbox: &'a str,
    /// By the step that spawned them.
    processes: BTreeMap<i64, Respawned<'a>>,
}

impl<'a> Replay<'a> {
    fn run(mut self, steps: &'a [Step]) -> Result<bool> {
        for step in steps {
            let outcome = match self.settle(step.started_at)? {
                Ok(()) => self.step(step)?,
                stop => stop,
            };
            if let Err(stop) = outcome {
                println!("{stop}");
                return Ok(false);
            }
        }
        if let Err(stop) = self.settle(f64::INFINITY)? {
            println!("{stop}");
            return Ok(false);
        }
        println!("all {} steps match", steps.len());
        Ok(true)
    }

    /// Waits for the re-spawned processes whose recorded end came before `until`, in the
    /// order they ended, and compares each end.
    fn settle(&mut self, until: f64) -> Result<Result<(), Stop>> {
        loop {
            let next = self
                .processes
                .iter()
                .filter_map(|(n, p)| p.ended_at().map(|at| (at, *n)))
                .filter(|(at, _)| *at <= until)
                .min_by(|a, b| a.0.total_cmp(&b.0));
            let Some((_, n)) = next else {
                return Ok(Ok(()));
            };
            let p = self.processes.get_mut(&n).expect("found above");
            p.settled = true;
            let (pid, recorded) = (p.pid, p.recorded);
            if let Err(stop) = self.compare_end(pid, recorded)? {
                return Ok(Err(stop));
            }
        }
    }

    fn compare_end(&self, pid: i32, recorded: &Step) -> Result<Result<(), Stop>> {
        let want = &recorded.result;
        let wait = (want.exit.duration_ms / 1e3 * 2.0 + 30.0).min(MAX_WAIT_S);
        let info: serde_json::Value = self.client.json(
            self.client
                .post(&format!(
                    "/v1/sandboxes/{}/processes/{pid}/wait",
                    self.sandbox
                ))
                .query(&[("timeout", wait)]),
        )?;
        let what = format!(
            "the process of step {} ({})",
            recorded.step,
            command_text(&recorded.request.argv)
        );
        if info["running"].as_bool() != Some(false) {
            return Ok(Err(format!(
                "step {} differs: {what} still runs after {wait:.0} s; it ended after {:.0} ms \
                 when recorded",
                recorded.step, want.exit.duration_ms
            )));
        }
        let code = info["exit"]["exit_code"].as_i64();
        let mut diffs = Vec::new();
        if code != want.exit.exit_code.map(i64::from) {
            diffs.push(format!(
                "exit code {code:?} (recorded {:?})",
                want.exit.exit_code
            ));
        }
        if let Some((stdout, stderr)) = self.output(pid)? {
            diffs.extend(output_diffs(want, &stdout, &stderr));
        }
        if diffs.is_empty() {
            return Ok(Ok(()));
        }
        Ok(Err(format!(
            "step {} differs: {what} ended with {}",
            recorded.step,
            diffs.join("; ")
        )))
    }

    /// A re-spawned process's whole output (a terminal's as stdout), or `None` when the
    /// server no longer buffers all of it.
    fn output(&self, pid: i32) -> Result<Option<(String, String)>> {
        let resp = self.client.send(self.client.get(&format!(
            "/v1/sandboxes/{}/processes/{pid}/events",
            self.sandbox
        )))?;
        let (mut stdout, mut stderr) = (String::new(), String::new());
        for line in std::io::BufReader::new(resp).lines() {
            let line = line.context("reading a process's events")?;
            if line.trim().is_empty() {
                continue;
            }
            let event: serde_json::Value =
                serde_json::from_str(&line).context("reading a process's events")?;
            if event["dropped"].as_u64().unwrap_or(0) > 0 {
                return Ok(None);
            }
            let data = event["data"].as_str().unwrap_or_default();
            match event["kind"].as_str() {
                Some("stdout" | "pty") => stdout += data,
                Some("stderr") => stderr += data,
                _ => {}
            }
        }
        Ok(Some((stdout, stderr)))
    }

    /// Replays one step.
    fn step(&mut self, step: &'a Step) -> Result<Result<(), Stop>> {
        let req = &step.request;
        if req.kind == StepKind::Run {
            return self.run_step(step);
        }
        let process = req.process.clone().unwrap_or_default();
        let base = format!("/v1/sandboxes/{}/processes", self.sandbox);
        if req.kind == StepKind::Spawn {
            let mut body = serde_json::json!({
                "cmd": req.argv, "env": req.env, "cwd": req.cwd, "stdin": process.stdin_open,
                "tag": process.tag, "user": req.run_as,
            });
            if let Some([cols, rows]) = process.pty {
                body["pty"] = serde_json::json!({"cols": cols, "rows": rows});
            }
            let spawned: Result<serde_json::Value> =
                self.client.json(self.client.post(&base).json(&body));
            let pid = match spawned {
                Ok(info) => info["pid"].as_i64().unwrap_or_default(),
                Err(e) => {
                    return Ok(Err(format!(
                        "step {} differs: {} failed: {e:#}",
                        step.step,
                        step_text(step)
                    )))
                }
            };
            self.processes.insert(
                step.step,
                Respawned {
                    pid: i32::try_from(pid).unwrap_or_default(),
                    recorded: step,
                    settled: false,
                },
            );
            return Ok(Ok(()));
        }
        let Some(target) = process
            .spawn_step
            .and_then(|n| self.processes.get(&n))
            .map(|p| p.pid)
        else {
            return Ok(Err(format!(
                "step {}: cannot be replayed: it acts on a process this replay did not spawn \
                 ({})",
                step.step,
                step_text(step)
            )));
        };
        let url = format!("{base}/{target}");
        let rb = match req.kind {
            StepKind::Stdin => {
                let Some(input) = process.replayable_input(req.stdin_sha256.as_deref()) else {
                    return Ok(Err(format!(
                        "step {}: cannot be replayed: the log kept its stdin write of {} bytes \
                         as a digest only ({}); the {} steps before it match",
                        step.step,
                        process.input_bytes,
                        req.stdin_sha256.as_deref().unwrap_or("-"),
                        step.step
                    )));
                };
                self.client
                    .post(&format!("{url}/stdin"))
                    .body(input.to_vec())
            }
            StepKind::CloseStdin => self.client.post(&format!("{url}/close-stdin")),
            StepKind::Signal => self
                .client
                .post(&format!("{url}/signal"))
                .json(&serde_json::json!({"signal": process.signal})),
            StepKind::Kill => self.client.post(&format!("{url}/kill")),
            StepKind::Resize => {
                let [cols, rows] = process.pty.unwrap_or_default();
                self.client
                    .post(&format!("{url}/resize"))
                    .json(&serde_json::json!({"cols": cols, "rows": rows}))
            }
            StepKind::Run | StepKind::Spawn => unreachable!("handled above"),
        };
        Ok(self.client.empty(rb).map_err(|e| {
            format!(
                "step {} differs: {} failed: {e:#} (it succeeded when recorded)",
                step.step,
                step_text(step)
            )
        }))
    }

    fn run_step(&self, step: &Step) -> Result<Result<(), Stop>> {
        let req = &step.request;
        if req.stdin_sha256.is_some() || !req.files.is_empty() {
            return Ok(Err(format!(
                "step {}: cannot be replayed: its stdin and files were recorded as digests \
                 only; the {} steps before it match",
                step.step, step.step
            )));
        }
        let body = serde_json::json!({
            "cmd": req.argv, "env": req.env, "cwd": req.cwd, "timeout_s": req.timeout_s,
            "user": req.run_as,
        });
        let got: CommandResult = self.client.json(
            self.client
                .post(&format!("/v1/sandboxes/{}/exec", self.sandbox))
                .json(&body),
        )?;
        let want = &step.result;
        let mut diffs = Vec::new();
        if got.exit.exit_code != want.exit.exit_code {
            diffs.push(format!(
                "exit code {:?} (recorded {:?})",
                got.exit.exit_code, want.exit.exit_code
            ));
        }
        diffs.extend(output_diffs(want, &got.stdout, &got.stderr));
        if diffs.is_empty() {
            return Ok(Ok(()));
        }
        Ok(Err(format!(
            "step {} differs: {}\n  command: {}",
            step.step,
            diffs.join("; "),
            command_text(&req.argv)
        )))
    }
}

/// How output `stdout` and `stderr` differ from `want`'s: by text where the log kept all
/// of it, else by length and digest.
fn output_diffs(want: &StepResult, stdout: &str, stderr: &str) -> Vec<String> {
    let mut diffs = Vec::new();
    for (name, got, want, elided, bytes, sha256) in [
        (
            "stdout",
            stdout,
            &want.stdout,
            want.stdout_elided,
            want.stdout_bytes,
            &want.stdout_sha256,
        ),
        (
            "stderr",
            stderr,
            &want.stderr,
            want.stderr_elided,
            want.stderr_bytes,
            &want.stderr_sha256,
        ),
    ] {
        if elided == 0 {
            if got != want {
                diffs.push(format!("{name} {got:?} (recorded {want:?})"));
            }
            continue;
        }
        let got_sha256 = digest(got.as_bytes());
        if got.len() as u64 != bytes || &got_sha256 != sha256 {
            diffs.push(format!(
                "{name} {} bytes {got_sha256} (recorded {bytes} bytes {sha256})",
                got.len()
            ));
        }
    }
    diffs
}
