//! Append throughput of the trajectory log on each store, side by side in one run:
//! SQLite (in a temporary directory) and PostgreSQL (a cluster of its own, as the tests
//! start one), each with `--trajectory-sync normal` and `full`, one appender and many.
//!
//! `cargo run --release -p dsec-trajectory --example append_throughput [APPENDS]`
//! (as root, PostgreSQL runs as the `postgres` user). Each append is a step shaped like a
//! short command's: a few bytes of output, its request and digests, ~0.6 KiB stored.

#[path = "../tests/common/postgres.rs"]
mod postgres;

use std::collections::BTreeMap;
use std::time::Instant;

use dsec_trajectory::{
    digest, Database, ExitStatus, FileDigest, LogConfig, OutputCapture, SandboxRecord, Step,
    StepKind, StepRequest, StepResult, SyncMode, TrajectoryLog,
};

/// Concurrent appenders, each its sandbox's only client (the RL shape).
const CONCURRENCY: [usize; 3] = [1, 8, 64];

fn record(id: &str) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        trajectory_id: Some(format!("t-{id}")),
        image: "busybox".into(),
        backend: "container".into(),
        env: BTreeMap::new(),
        created_at: 1.0,
        project: None,
        fork_of: None,
    }
}

fn step(id: &str, n: i64) -> Step {
    let mut out = OutputCapture::new(64 << 10);
    out.push(format!("step {n}\n").as_bytes());
    Step {
        step: n,
        trajectory_id: Some(format!("t-{id}")),
        sandbox_id: id.into(),
        request: StepRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), format!("echo step {n}")],
            env: BTreeMap::new(),
            cwd: "/".into(),
            stdin_sha256: None,
            files: vec![FileDigest {
                path: "/task".into(),
                sha256: digest(b"task"),
                mode: 0o644,
            }],
            timeout_s: Some(60.0),
            run_as: None,
            kind: StepKind::Run,
            process: None,
        },
        result: StepResult::new(
            ExitStatus {
                exit_code: Some(0),
                duration_ms: 1.0,
                ..ExitStatus::default()
            },
            out.finish(),
            OutputCapture::new(64 << 10).finish(),
        ),
        started_at: 1.0,
        finished_at: 2.0,
    }
}

/// Appends per second with `clients` appenders sharing `appends`, and appends per commit.
async fn measure(db: &Database, sync: SyncMode, clients: usize, appends: usize) -> (f64, f64) {
    let config = LogConfig {
        sync,
        ..LogConfig::default()
    };
    let log = TrajectoryLog::open_database(db, "bench", config)
        .await
        .unwrap();
    let run = format!("{sync:?}-{clients}");
    for c in 0..clients {
        log.register(record(&format!("{run}-{c}")))
            .wait()
            .await
            .unwrap();
    }
    let per = appends / clients;
    let before = log.stats();
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (log, id) = (log.clone(), format!("{run}-{c}"));
            tokio::spawn(async move {
                for n in 0..i64::try_from(per).expect("a step count fits i64") {
                    log.append(step(&id, n)).wait().await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    let after = log.stats();
    log.close().await;
    let commits = (after.commits - before.commits).max(1);
    let writes = after.writes - before.writes;
    (
        (per * clients) as f64 / secs,
        writes as f64 / commits as f64,
    )
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let appends: usize = std::env::args()
        .nth(1)
        .map_or(6400, |a| a.parse().expect("APPENDS: a number"));
    let dir = tempfile::tempdir().unwrap();
    let cluster = postgres::Cluster::start().await;
    let stores = [
        ("sqlite", Database::Sqlite(dir.path().join("trajectory.db"))),
        (
            "postgres",
            Database::Postgres(cluster.database("bench").await),
        ),
    ];
    println!("| sync | appenders | SQLite appends/s (per commit) | PostgreSQL appends/s (per commit) | PostgreSQL / SQLite |");
    println!("|---|---|---|---|---|");
    for sync in [SyncMode::Normal, SyncMode::Full] {
        for clients in CONCURRENCY {
            let mut row = Vec::new();
            for (_, db) in &stores {
                row.push(measure(db, sync, clients, appends).await);
            }
            println!(
                "| {sync:?} | {clients} | {:.0} ({:.1}) | {:.0} ({:.1}) | {:.2} |",
                row[0].0,
                row[0].1,
                row[1].0,
                row[1].1,
                row[1].0 / row[0].0
            );
        }
    }
}
