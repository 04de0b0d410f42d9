//! What the log promises its callers: steps round-trip and outlive the process, replay
//! lookups find exactly what was recorded, a trajectory id names one sandbox, and the
//! budgets bound what is stored without ever losing a live sandbox's step.

#[macro_use]
mod common;

use common::{
    assert_stored, chatty, chatty_sandbox, sandbox, step, total_budget, wait_for, Backing, TestLog,
};
use dsec_trajectory::{Budgets, ForkOf, KeptOutput, LogError, Pending, SyncMode};

async fn steps_round_trip_and_survive_reopening(b: &Backing<'_>) {
    let t = TestLog::open(b, SyncMode::Full, Budgets::default()).await;
    t.log
        .register(sandbox("s1", Some("t1")))
        .wait()
        .await
        .unwrap();
    // The last step ran as a user.
    let recorded = |n: i64| {
        let mut s = step(Some("t1"), "s1", n, &format!("echo {n}"));
        s.request.run_as = (n == 2).then(|| "alice".to_owned());
        s
    };
    for n in 0..3 {
        t.log.append(recorded(n)).wait().await.unwrap();
    }
    let live = t.log.sandbox_log("s1", None).await.unwrap().unwrap();
    assert_eq!(live.stopped_at, None);
    assert_stored(&t.log, live.bytes).await;

    let t = t.reopen().await;
    let got = t.log.step("t1", 1).await.unwrap().unwrap();
    assert_eq!(got, step(Some("t1"), "s1", 1, "echo 1"));
    assert_eq!(t.log.step("t1", 2).await.unwrap().unwrap(), recorded(2));
    assert_eq!(
        got.result.stdout_sha256,
        dsec_trajectory::digest(b"echo 1\n")
    );
    let all = t.log.sandbox_log("s1", None).await.unwrap().unwrap();
    assert_eq!(all.sandbox, sandbox("s1", Some("t1")));
    assert_eq!(
        all.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    // The sandbox belonged to the earlier run: it is stopped now, its share recounted.
    assert!(all.stopped_at.is_some());
    assert_eq!(all.bytes, live.bytes);
    assert_stored(&t.log, live.bytes).await;
}

async fn replay_lookups_find_exactly_what_was_recorded(b: &Backing<'_>) {
    let t = TestLog::open(b, SyncMode::Normal, Budgets::default()).await;
    let log = &t.log;
    log.register(sandbox("keyed", Some("t")))
        .wait()
        .await
        .unwrap();
    log.register(sandbox("plain", None)).wait().await.unwrap();
    for n in 0..4 {
        log.append(step(Some("t"), "keyed", n, &format!("k{n}")))
            .wait()
            .await
            .unwrap();
        log.append(step(None, "plain", n, &format!("p{n}")))
            .wait()
            .await
            .unwrap();
    }
    // A keyed sandbox's steps are found by its trajectory id, a plain one's by its id.
    let k2 = log.step("t", 2).await.unwrap().unwrap();
    assert_eq!(k2.request.argv[2], "k2");
    assert_eq!(k2.result.stdout, "k2\n");
    assert_eq!(
        log.step("plain", 3).await.unwrap().unwrap().request.argv[2],
        "p3"
    );
    assert!(
        log.step("keyed", 0).await.unwrap().is_none(),
        "not by the sandbox id"
    );
    assert!(
        log.step("t", 4).await.unwrap().is_none(),
        "not past the last step"
    );
    assert!(log.step("t", -1).await.unwrap().is_none());
    assert!(log.step("nobody", 0).await.unwrap().is_none());

    // A fork inherits the parent's first steps under its own trajectory id, and only those.
    let mut child = sandbox("child", Some("t.fork-0"));
    child.fork_of = Some(ForkOf {
        trajectory_id: "t".into(),
        steps: 2,
    });
    log.register(child).wait().await.unwrap();
    let inherited = log.step("t.fork-0", 1).await.unwrap().unwrap();
    assert_eq!(
        (
            inherited.request.argv[2].as_str(),
            inherited.sandbox_id.as_str()
        ),
        ("k1", "child")
    );
    assert!(log.step("t.fork-0", 2).await.unwrap().is_none());
    log.append(step(Some("t.fork-0"), "child", 2, "c2"))
        .wait()
        .await
        .unwrap();
    assert_eq!(
        log.step("t", 2).await.unwrap().unwrap().request.argv[2],
        "k2"
    );
    let fork_log = log.sandbox_log("child", None).await.unwrap().unwrap();
    assert_eq!(fork_log.steps.len(), 3);
    // The inherited steps count against the fork's share: the shares add up to the log.
    let mut shares = fork_log.bytes;
    for id in ["keyed", "plain"] {
        shares += log.sandbox_log(id, None).await.unwrap().unwrap().bytes;
    }
    assert_stored(log, shares).await;

    // A sandbox's log, filtered by trajectory id.
    let filtered = log
        .sandbox_log("keyed", Some("other".into()))
        .await
        .unwrap();
    assert!(filtered.unwrap().steps.is_empty());
    assert!(log.sandbox_log("nope", None).await.unwrap().is_none());
}

async fn a_trajectory_id_names_one_sandbox(b: &Backing<'_>) {
    let t = TestLog::open(b, SyncMode::Normal, Budgets::default()).await;
    t.log
        .register(sandbox("s1", Some("t")))
        .wait()
        .await
        .unwrap();
    t.log.register(sandbox("s2", None)).wait().await.unwrap();
    t.log.register(sandbox("s3", None)).wait().await.unwrap();
    let err = t
        .log
        .register(sandbox("s4", Some("t")))
        .wait()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, LogError::TrajectoryTaken { owner, .. } if owner == "s1"),
        "{err}"
    );
    assert!(t.log.sandbox_log("s4", None).await.unwrap().is_none());
}

async fn a_duplicate_step_fails_alone_and_adds_nothing(b: &Backing<'_>) {
    for sync in [SyncMode::Normal, SyncMode::Full] {
        let t = TestLog::open(b, sync, Budgets::default()).await;
        t.log.register(sandbox("s", None)).wait().await.unwrap();
        let mut pending: Vec<Pending> = (0..3)
            .map(|n| t.log.append(step(None, "s", n, "true")))
            .collect();
        pending.push(t.log.append(step(None, "s", 1, "again")));
        pending.push(t.log.append(step(None, "s", 3, "true")));
        let mut results = Vec::new();
        for p in pending {
            results.push(p.wait().await);
        }
        assert!(
            matches!(results[3], Err(LogError::Duplicate { step: 1, .. })),
            "{:?}",
            results[3]
        );
        assert!(results.iter().enumerate().all(|(i, r)| i == 3 || r.is_ok()));
        let got = t.log.sandbox_log("s", None).await.unwrap().unwrap();
        assert_eq!(got.steps.len(), 4);
        assert_eq!(got.steps[1].request.argv[2], "true");
        assert_stored(&t.log, got.bytes).await;
    }
}

async fn large_outputs_are_written_off_the_async_workers_and_read_back(b: &Backing<'_>) {
    let budgets = Budgets {
        output_bytes: 1 << 20,
        ..Budgets::default()
    };
    let t = TestLog::open(b, SyncMode::Normal, budgets).await;
    t.log.register(sandbox("s", None)).wait().await.unwrap();
    let big = chatty(&budgets, "s", 0, 512 << 10);
    assert_eq!(big.result.stdout_elided, 0);
    t.log.append(big.clone()).wait().await.unwrap();
    t.log
        .append(step(None, "s", 1, "small"))
        .wait()
        .await
        .unwrap();
    assert_eq!(t.log.step("s", 0).await.unwrap(), Some(big));
    assert!(t.log.step("s", 1).await.unwrap().is_some());
}

async fn a_sandbox_over_its_budget_keeps_recording_without_output(b: &Backing<'_>) {
    let budgets = Budgets {
        output_bytes: 4096,
        sandbox_bytes: 20_000,
        total_bytes: 1 << 30,
    };
    let t = TestLog::open(b, SyncMode::Normal, budgets).await;
    t.log
        .register(sandbox("s", Some("t")))
        .wait()
        .await
        .unwrap();
    for n in 0..10 {
        let mut s = chatty(&budgets, "s", n, 1 << 20);
        s.trajectory_id = Some("t".into());
        t.log.append(s).wait().await.unwrap();
    }
    let got = t.log.sandbox_log("s", None).await.unwrap().unwrap();
    assert_eq!(got.steps.len(), 10, "every step is recorded");
    let kept: Vec<bool> = got
        .steps
        .iter()
        .map(|s| s.result.stdout_elided < s.result.stdout_bytes)
        .collect();
    // 4 KiB of output per step and a 20,000-byte budget: four steps fit.
    assert_eq!(
        kept,
        [true, true, true, true, false, false, false, false, false, false]
    );
    assert!(got.bytes < 20_000 + 10 * 600, "{}", got.bytes);
    let dropped = &t.log.step("t", 9).await.unwrap().unwrap().result;
    assert_eq!(dropped.stdout, KeptOutput::marker(1 << 20));
    assert_eq!(dropped.stdout_bytes, 1 << 20);
    assert_eq!(
        dropped.stdout_sha256,
        dsec_trajectory::digest(&b"y\n".repeat(1 << 19))
    );
    assert!(dropped.elided());
}

async fn stopped_sandboxes_are_pruned_oldest_first_and_live_ones_never(b: &Backing<'_>) {
    for sync in [SyncMode::Normal, SyncMode::Full] {
        let budgets = total_budget(2 << 20);
        let t = TestLog::open(b, sync, budgets).await;
        let log = &t.log;
        log.register(sandbox("live", Some("t-live")))
            .wait()
            .await
            .unwrap();
        let mut live = chatty(&budgets, "live", 0, 1 << 20);
        live.trajectory_id = Some("t-live".into());
        log.append(live).wait().await.unwrap();
        log.register(sandbox("old", Some("t-old")))
            .wait()
            .await
            .unwrap();
        log.stopped("old").wait().await.unwrap();
        // Each stopped sandbox takes ~64 KiB; 40 of them are more than the 1.25 MiB above
        // which pruning starts.
        for i in 0..40 {
            let id = format!("s{i:02}");
            chatty_sandbox(log, &budgets, &id).await;
            log.stopped(&id).wait().await.unwrap();
        }
        let pruned_down = wait_for(|| log.stored_bytes() <= 5 * (budgets.total_bytes / 8)).await;
        assert!(pruned_down, "stored {} after pruning", log.stored_bytes());
        let mut present = Vec::new();
        for i in 0..40 {
            let id = format!("s{i:02}");
            present.push(log.sandbox_log(&id, None).await.unwrap().is_some());
        }
        let first_kept = present.iter().position(|p| *p).unwrap();
        assert!(first_kept > 0, "nothing was pruned");
        assert!(
            present[first_kept..].iter().all(|p| *p),
            "not oldest first: {present:?}"
        );
        assert!(log.step("s00", 0).await.unwrap().is_none());
        let live = log.sandbox_log("live", None).await.unwrap().unwrap();
        assert_eq!(live.steps.len(), 1);
        t.assert_files_within(budgets.total_bytes);

        // A pruned sandbox's late step is not stored, and its trajectory id is free again.
        log.append(chatty(&budgets, "s00", 1, 100))
            .wait()
            .await
            .unwrap();
        assert!(log.step("s00", 1).await.unwrap().is_none());
        assert!(log.sandbox_log("old", None).await.unwrap().is_none());
        log.register(sandbox("new", Some("t-old")))
            .wait()
            .await
            .unwrap();
    }
}

async fn a_stopped_sandboxs_late_step_is_still_recorded_and_counted(b: &Backing<'_>) {
    let t = TestLog::open(b, SyncMode::Normal, Budgets::default()).await;
    t.log.register(sandbox("s", None)).wait().await.unwrap();
    t.log.stopped("s").wait().await.unwrap();
    let before = t.log.sandbox_log("s", None).await.unwrap().unwrap().bytes;
    // The command that was running when the sandbox stopped ends now.
    t.log
        .append(step(None, "s", 0, "killed"))
        .wait()
        .await
        .unwrap();
    let got = t.log.sandbox_log("s", None).await.unwrap().unwrap();
    assert_eq!(got.steps.len(), 1);
    assert!(got.stopped_at.is_some());
    assert!(got.bytes > before);
    assert_stored(&t.log, got.bytes).await;
}

async fn live_sandboxes_alone_over_the_budget_record_without_output(b: &Backing<'_>) {
    let budgets = total_budget(1 << 20);
    let t = TestLog::open(b, SyncMode::Normal, budgets).await;
    for i in 0..30 {
        chatty_sandbox(&t.log, &budgets, &format!("s{i:02}")).await;
    }
    assert!(
        t.log.stored_bytes() <= budgets.total_bytes / 4 * 3,
        "{}",
        t.log.stored_bytes()
    );
    let last = t.log.step("s29", 0).await.unwrap().unwrap();
    assert_eq!(
        last.result.stdout_elided,
        1 << 20,
        "recorded without output"
    );
    let first = t.log.step("s00", 0).await.unwrap().unwrap();
    assert!(
        first.result.stdout_elided < 1 << 20,
        "recorded with its output"
    );
    t.assert_files_within(budgets.total_bytes);
}

async fn a_step_of_a_sandbox_the_log_does_not_hold_is_not_stored(b: &Backing<'_>) {
    let t = TestLog::open(b, SyncMode::Normal, Budgets::default()).await;
    t.log
        .append(step(None, "gone", 0, "echo"))
        .wait()
        .await
        .unwrap();
    assert!(t.log.step("gone", 0).await.unwrap().is_none());
    assert_stored(&t.log, 0).await;
}

on_both_stores! {
    steps_round_trip_and_survive_reopening,
    replay_lookups_find_exactly_what_was_recorded,
    a_trajectory_id_names_one_sandbox,
    a_duplicate_step_fails_alone_and_adds_nothing,
    large_outputs_are_written_off_the_async_workers_and_read_back,
    a_sandbox_over_its_budget_keeps_recording_without_output,
    stopped_sandboxes_are_pruned_oldest_first_and_live_ones_never,
    a_stopped_sandboxs_late_step_is_still_recorded_and_counted,
    live_sandboxes_alone_over_the_budget_record_without_output,
    a_step_of_a_sandbox_the_log_does_not_hold_is_not_stored,
}
