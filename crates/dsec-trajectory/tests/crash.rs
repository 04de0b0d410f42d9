//! Crash recovery: a process that appends steps is SIGKILLed in the middle of its writes.
//! The log it leaves opens, holds every step the process was told was durable, with the
//! output it had, and nothing half-written: each trajectory's steps run 0, 1, 2, … with
//! no gap, and every row decodes.
//!
//! The appender is this test itself, run again by the test in a child process (the
//! environment variable below tells it which part it plays).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::postgres::Cluster;
use common::{output, sandbox, step, EDGE};
use dsec_trajectory::{digest, Budgets, Database, LogConfig, SyncMode, TrajectoryLog};

const APPENDER: &str = "DSEC_TRAJECTORY_TEST_APPENDER";
const CLIENTS: usize = 4;

fn config(sync: &str) -> LogConfig {
    LogConfig {
        sync: if sync == "full" {
            SyncMode::Full
        } else {
            SyncMode::Normal
        },
        budgets: Budgets {
            output_bytes: 256 << 10,
            ..Budgets::default()
        },
    }
}

/// Step `n`'s output: every other one large, so that writes take a while and the kill
/// lands inside one.
fn output_of(client: usize, n: i64) -> Vec<u8> {
    let size = if n % 2 == 0 { 1 << 10 } else { 200 << 10 };
    format!("{client}:{n}:").into_bytes().repeat(size / 8)
}

#[test]
fn appends_acknowledged_before_a_sigkill_survive_it() {
    if let Ok(spec) = std::env::var(APPENDER) {
        return append_until_killed(&spec);
    }
    for sync in ["normal", "full"] {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::Sqlite(dir.path().join("trajectory.db"));
        kill_and_check(
            "appends_acknowledged_before_a_sigkill_survive_it",
            sync,
            &db,
        );
    }
}

#[test]
#[cfg_attr(
    not(postgres_installed),
    ignore = "PostgreSQL is not installed: apt-get install postgresql (scripts/setup.sh), or set DSEC_PG_BIN"
)]
fn postgres_appends_acknowledged_before_a_sigkill_survive_it() {
    if let Ok(spec) = std::env::var(APPENDER) {
        return append_until_killed(&spec);
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cluster = rt.block_on(Cluster::start());
    for sync in ["normal", "full"] {
        let db = Database::Postgres(rt.block_on(cluster.database(&format!("crash_{sync}"))));
        kill_and_check(
            "postgres_appends_acknowledged_before_a_sigkill_survive_it",
            sync,
            &db,
        );
    }
}

/// Runs test `name` as the appender on `db`, SIGKILLs it once it has acknowledged 300
/// steps, and checks what the log kept.
fn kill_and_check(name: &str, sync: &str, db: &Database) {
    let spec = match db {
        Database::Sqlite(path) => format!("{sync} {}", path.display()),
        Database::Postgres(url) => format!("{sync} {url}"),
    };
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            name,
            "--include-ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(APPENDER, spec)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut acked = Vec::new();
    while acked.len() < 300 {
        let line = lines.next().expect("the appender ended by itself").unwrap();
        if let Some(ack) = line.strip_prefix("acked ") {
            acked.push(ack.to_owned());
        }
    }
    child.kill().unwrap(); // SIGKILL, by the child's pid
    child.wait().unwrap();
    // Acknowledgements written before the kill that were still in the pipe.
    acked.extend(
        lines
            .map_while(Result::ok)
            .filter_map(|l| l.strip_prefix("acked ").map(str::to_owned)),
    );

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let log = TrajectoryLog::open_database(db, EDGE, config(sync))
            .await
            .unwrap();
        for ack in &acked {
            let (key, n) = ack.split_once(' ').unwrap();
            let (client, n): (usize, i64) = (key[1..].parse().unwrap(), n.parse().unwrap());
            let got = log.step(key, n).await.unwrap();
            let got = got.unwrap_or_else(|| panic!("{sync}: acknowledged step {ack} lost"));
            assert_eq!(
                got.result.stdout_sha256,
                digest(&output_of(client, n)),
                "{sync}: step {ack}"
            );
        }
        let mut shares = 0;
        for client in 0..CLIENTS {
            let log = log
                .sandbox_log(&format!("s{client}"), None)
                .await
                .unwrap()
                .unwrap();
            let steps: Vec<i64> = log.steps.iter().map(|s| s.step).collect();
            assert_eq!(
                steps,
                (0..i64::try_from(steps.len()).unwrap()).collect::<Vec<_>>(),
                "{sync}"
            );
            assert!(log.stopped_at.is_some(), "{sync}: not marked stopped");
            shares += log.bytes;
        }
        common::assert_stored(&log, shares).await;
        log.close().await;
    });
}

/// The child: `CLIENTS` sandboxes appending steps as fast as they can, each
/// acknowledgement printed once the step is durable, until the parent kills it.
fn append_until_killed(spec: &str) {
    let (sync, db) = spec.split_once(' ').unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let log = TrajectoryLog::open_database(&Database::parse(db), EDGE, config(sync))
            .await
            .unwrap();
        let clients: Vec<_> = (0..CLIENTS)
            .map(|client| {
                let log = log.clone();
                tokio::spawn(async move {
                    let (id, key) = (format!("s{client}"), format!("t{client}"));
                    log.register(sandbox(&id, Some(&key))).wait().await.unwrap();
                    for n in 0.. {
                        let mut s = step(Some(&key), &id, n, "print");
                        s.result = output(256 << 10, &output_of(client, n));
                        log.append(s).wait().await.unwrap();
                        println!("acked {key} {n}");
                    }
                })
            })
            .collect();
        for c in clients {
            c.await.unwrap();
        }
    });
}
