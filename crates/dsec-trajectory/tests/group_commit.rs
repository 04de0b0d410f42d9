//! Group commit: with `SyncMode::Full`, writes queued while a commit (and its fsync) is
//! under way are committed together, each caller answered only once its batch is durable.

#[macro_use]
mod common;

use common::{sandbox, step, Backing, TestLog};
use dsec_trajectory::{Budgets, LogError, SyncMode};

async fn concurrent_appends_share_commits(b: &Backing<'_>) {
    let t = TestLog::open(b, SyncMode::Full, Budgets::default()).await;
    for s in 0..8 {
        t.log
            .register(sandbox(&format!("s{s}"), None))
            .wait()
            .await
            .unwrap();
    }
    let before = t.log.stats();
    // Eight clients, fifty steps each, all in flight at once.
    let tasks: Vec<_> = (0..8)
        .map(|s| {
            let log = t.log.clone();
            tokio::spawn(async move {
                let pending: Vec<_> = (0..50)
                    .map(|n| log.append(step(None, &format!("s{s}"), n, "true")))
                    .collect();
                for p in pending {
                    p.wait().await.unwrap();
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let stats = t.log.stats();
    let (writes, commits) = (stats.writes - before.writes, stats.commits - before.commits);
    assert_eq!(writes, 400);
    assert!(
        commits * 4 <= writes,
        "{commits} commits for {writes} writes: no group commit"
    );
    // Every acknowledged step is there, after the process's log is closed and reopened.
    let t = t.reopen().await;
    for s in 0..8 {
        let got = t
            .log
            .sandbox_log(&format!("s{s}"), None)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got.steps.len(), 50);
    }
}

async fn a_failed_write_fails_alone_in_its_batch(b: &Backing<'_>) {
    let t = TestLog::open(b, SyncMode::Full, Budgets::default()).await;
    t.log
        .register(sandbox("a", Some("t")))
        .wait()
        .await
        .unwrap();
    // Queued together: a trajectory id already taken, and steps around it.
    let first = t.log.append(step(Some("t"), "a", 0, "one"));
    let taken = t.log.register(sandbox("b", Some("t")));
    let second = t.log.append(step(Some("t"), "a", 1, "two"));
    first.wait().await.unwrap();
    assert!(matches!(
        taken.wait().await,
        Err(LogError::TrajectoryTaken { .. })
    ));
    second.wait().await.unwrap();
    assert_eq!(
        t.log
            .sandbox_log("a", None)
            .await
            .unwrap()
            .unwrap()
            .steps
            .len(),
        2
    );
    assert!(t.log.sandbox_log("b", None).await.unwrap().is_none());
}

/// SQLite only: without fsync, a commit is cheaper on the caller's thread than a hop to
/// the writer thread (PostgreSQL's writer always batches).
#[tokio::test]
async fn sqlite_without_fsync_commits_each_write_on_its_own() {
    let t = TestLog::open(&Backing::Sqlite, SyncMode::Normal, Budgets::default()).await;
    t.log.register(sandbox("s", None)).wait().await.unwrap();
    for n in 0..10 {
        t.log
            .append(step(None, "s", n, "true"))
            .wait()
            .await
            .unwrap();
    }
    let stats = t.log.stats();
    assert_eq!((stats.writes, stats.commits), (11, 11));
}

on_both_stores! {
    concurrent_appends_share_commits,
    a_failed_write_fails_alone_in_its_batch,
}
