//! Process steps: a spawn, the acts on its process and the process's end round-trip in
//! order; a stdin write is kept bounded like an output, with its digest always; the end
//! of a spawn counts against the budgets; a sandbox's project is kept.

#[macro_use]
mod common;

use common::{assert_stored, output, sandbox, step, Backing, TestLog};
use dsec_trajectory::{
    digest, Budgets, ExitStatus, OutputCapture, ProcessRequest, Step, StepKind, StepResult,
    SyncMode,
};

/// Step `n`: a spawn of `cat` (pid 42), still running.
fn spawn(n: i64) -> Step {
    let mut s = step(None, "s", n, "cat > /f");
    s.request.files.clear();
    s.request.kind = StepKind::Spawn;
    s.request.process = Some(ProcessRequest {
        tag: Some("writer".into()),
        stdin_open: true,
        ..ProcessRequest::default()
    });
    s.result = StepResult {
        pid: Some(42),
        running: true,
        ..StepResult::default()
    };
    s
}

/// Step `n`: `data` written to the stdin of the process spawned at `of`, as the log keeps
/// it under `budgets`.
fn stdin(budgets: &Budgets, n: i64, of: i64, data: &[u8]) -> Step {
    let mut s = step(None, "s", n, "cat > /f");
    s.request.files.clear();
    let mut input = OutputCapture::new(budgets.output_bytes);
    input.push(data);
    let kept = input.finish();
    s.request.kind = StepKind::Stdin;
    s.request.stdin_sha256 = Some(kept.sha256);
    s.request.process = Some(ProcessRequest {
        spawn_step: Some(of),
        input: kept.text,
        input_bytes: kept.bytes,
        input_elided: kept.elided,
        ..ProcessRequest::default()
    });
    s.result = StepResult::default();
    s
}

async fn a_process_round_trips_in_order_with_its_end(b: &Backing<'_>) {
    let budgets = Budgets::default();
    let t = TestLog::open(b, SyncMode::Normal, budgets).await;
    let mut owned = sandbox("s", None);
    owned.project = Some("team-a".into());
    t.log.register(owned.clone()).wait().await.unwrap();
    let spawned = spawn(0);
    t.log.append(spawned.clone()).wait().await.unwrap();
    let fed = stdin(&budgets, 1, 0, b"hello\n");
    t.log.append(fed.clone()).wait().await.unwrap();
    let mut closed = stdin(&budgets, 2, 0, b"");
    closed.request.kind = StepKind::CloseStdin;
    closed.request.stdin_sha256 = None;
    t.log.append(closed.clone()).wait().await.unwrap();
    t.log
        .append(step(None, "s", 3, "cat /f"))
        .wait()
        .await
        .unwrap();
    let before = t.log.sandbox_log("s", None).await.unwrap().unwrap().bytes;

    let mut ended = spawned.clone();
    ended.result = StepResult {
        pid: Some(42),
        ..output(budgets.output_bytes, b"done\n")
    };
    ended.finished_at = 3.0;
    t.log.ended(ended.clone()).wait().await.unwrap();

    let log = t.log.sandbox_log("s", None).await.unwrap().unwrap();
    assert_eq!(log.sandbox, owned, "the project is kept");
    let kinds: Vec<StepKind> = log.steps.iter().map(|s| s.request.kind).collect();
    assert_eq!(
        kinds,
        [
            StepKind::Spawn,
            StepKind::Stdin,
            StepKind::CloseStdin,
            StepKind::Run
        ]
    );
    assert_eq!(
        log.steps[0], ended,
        "the spawn step holds the process's end"
    );
    assert!(!log.steps[0].result.running);
    assert_eq!(log.steps[1], fed);
    let input = log.steps[1].request.process.as_ref().unwrap();
    assert_eq!(
        input.replayable_input(fed.request.stdin_sha256.as_deref()),
        Some(&b"hello\n"[..])
    );
    // The end grew the sandbox's share by what it added, and the log's total with it.
    assert!(log.bytes > before, "{} <= {before}", log.bytes);
    assert_stored(&t.log, log.bytes).await;

    // It all survives a restart (which stops the sandbox and recounts its share).
    let t = t.reopen().await;
    let again = t.log.sandbox_log("s", None).await.unwrap().unwrap();
    assert_eq!(again.steps, log.steps);
    assert_eq!(again.sandbox.project.as_deref(), Some("team-a"));
    assert_eq!(again.bytes, log.bytes);
}

async fn a_long_stdin_write_is_kept_bounded_with_its_digest(b: &Backing<'_>) {
    let budgets = Budgets {
        output_bytes: 1024,
        ..Budgets::default()
    };
    let t = TestLog::open(b, SyncMode::Normal, budgets).await;
    t.log.register(sandbox("s", None)).wait().await.unwrap();
    t.log.append(spawn(0)).wait().await.unwrap();
    let data = b"0123456789".repeat(1000);
    t.log
        .append(stdin(&budgets, 1, 0, &data))
        .wait()
        .await
        .unwrap();
    let got = t.log.step("s", 1).await.unwrap().unwrap();
    let p = got.request.process.as_ref().unwrap();
    assert_eq!(got.request.stdin_sha256, Some(digest(&data)));
    assert_eq!(p.input_bytes, 10_000);
    assert_eq!(p.input_elided, 10_000 - 1024);
    assert!(
        p.input.len() < 1200 && p.input.contains("not kept"),
        "{}",
        p.input
    );
    assert_eq!(
        p.replayable_input(got.request.stdin_sha256.as_deref()),
        None
    );
}

async fn a_sandbox_over_its_budget_keeps_its_stdin_as_a_digest(b: &Backing<'_>) {
    let budgets = Budgets {
        output_bytes: 64 << 10,
        sandbox_bytes: 16 << 10,
        total_bytes: 1 << 30,
    };
    let t = TestLog::open(b, SyncMode::Normal, budgets).await;
    t.log.register(sandbox("s", None)).wait().await.unwrap();
    t.log.append(spawn(0)).wait().await.unwrap();
    let data = vec![b'x'; 32 << 10];
    t.log
        .append(stdin(&budgets, 1, 0, &data))
        .wait()
        .await
        .unwrap();
    let got = t.log.step("s", 1).await.unwrap().unwrap();
    let p = got.request.process.as_ref().unwrap();
    assert_eq!((p.input_bytes, p.input_elided), (32 << 10, 32 << 10));
    assert_eq!(got.request.stdin_sha256, Some(digest(&data)));
    let log = t.log.sandbox_log("s", None).await.unwrap().unwrap();
    assert!(log.bytes < 16 << 10, "{}", log.bytes);
    // The process's end, over the budget too, keeps its exit without its output.
    let mut ended = spawn(0);
    ended.result = StepResult {
        pid: Some(42),
        ..output(budgets.output_bytes, &vec![b'y'; 32 << 10])
    };
    ended.result.exit = ExitStatus {
        exit_code: Some(3),
        ..ExitStatus::default()
    };
    t.log.ended(ended).wait().await.unwrap();
    let got = t.log.step("s", 0).await.unwrap().unwrap();
    assert_eq!(got.result.exit.exit_code, Some(3));
    assert_eq!(got.result.stdout_elided, 32 << 10);
    assert!(!got.result.running);
}

async fn the_end_of_a_spawn_the_log_does_not_hold_is_not_stored(b: &Backing<'_>) {
    let t = TestLog::open(b, SyncMode::Normal, Budgets::default()).await;
    t.log.register(sandbox("s", None)).wait().await.unwrap();
    t.log.ended(spawn(5)).wait().await.unwrap();
    assert!(t.log.step("s", 5).await.unwrap().is_none());
}

on_both_stores! {
    a_process_round_trips_in_order_with_its_end,
    a_long_stdin_write_is_kept_bounded_with_its_digest,
    a_sandbox_over_its_budget_keeps_its_stdin_as_a_digest,
    the_end_of_a_spawn_the_log_does_not_hold_is_not_stored,
}
