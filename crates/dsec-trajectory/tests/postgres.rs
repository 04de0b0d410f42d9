//! What only a PostgreSQL log does: clear errors at start for a database that is not
//! there or refuses us, one writer per edge name, and one log shared by servers — a
//! sandbox's log outlives its edge and is read from another server, and the budget is the
//! fleet's.

mod common;

use std::time::Duration;

use common::postgres::{Cluster, PASSWORD};
use common::{chatty, sandbox, step, total_budget, wait_for};
use dsec_trajectory::{LogConfig, LogError, ProcessRequest, StepKind, SyncMode, TrajectoryLog};

async fn connect(url: &str, edge: &str) -> Result<TrajectoryLog, LogError> {
    TrajectoryLog::connect(url, edge, LogConfig::default()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(postgres_installed),
    ignore = "PostgreSQL is not installed: apt-get install postgresql (scripts/setup.sh), or set DSEC_PG_BIN"
)]
async fn bad_databases_are_refused_at_start_with_what_to_fix() {
    let cluster = Cluster::start().await;
    let url = cluster.database("bad_input").await;

    let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = unused.local_addr().unwrap().port();
    drop(unused);
    let cases = [
        (
            format!("postgres://dsec:{PASSWORD}@127.0.0.1:{port}/bad_input"),
            "cannot reach PostgreSQL",
        ),
        (
            format!("postgres://dsec:wrong@127.0.0.1:{}/bad_input", cluster.port),
            "refused the password of user \"dsec\"",
        ),
        (
            format!("postgres://nobody:x@127.0.0.1:{}/bad_input", cluster.port),
            "refused",
        ),
        (
            format!(
                "postgres://dsec:{PASSWORD}@127.0.0.1:{}/missing",
                cluster.port
            ),
            "database \"missing\" does not exist: create it (createdb missing)",
        ),
        (
            format!("{url}?sslmode=require"),
            "TLS to PostgreSQL (sslmode=require) is not supported",
        ),
        (
            "postgres://dsec@127.0.0.1:notaport/x".to_owned(),
            "not a PostgreSQL URL",
        ),
    ];
    for (bad, want) in cases {
        let err = connect(&bad, "e0").await.err().unwrap();
        let msg = err.to_string();
        eprintln!("{msg}");
        assert!(msg.contains(want), "{bad}: {msg}");
        assert!(
            !msg.contains(PASSWORD) && !msg.contains(":wrong@"),
            "password shown: {msg}"
        );
    }

    // A database written by a newer dsec.
    let newer = cluster.database("newer").await;
    connect(&newer, "e0").await.unwrap().close().await;
    let (client, conn) = tokio_postgres::connect(&newer, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute("UPDATE dsec_schema SET version = 99")
        .await
        .unwrap();
    let err = connect(&newer, "e0").await.err().unwrap();
    assert!(matches!(err, LogError::Version { found: 99, .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(postgres_installed),
    ignore = "PostgreSQL is not installed: apt-get install postgresql (scripts/setup.sh), or set DSEC_PG_BIN"
)]
async fn an_edge_name_has_one_writer() {
    let cluster = Cluster::start().await;
    let url = cluster.database("edges").await;
    let first = connect(&url, "e0").await.unwrap();
    first.register(sandbox("e0-1", None)).wait().await.unwrap();
    let err = connect(&url, "e0").await.err().unwrap();
    assert!(matches!(err, LogError::EdgeTaken { .. }), "{err}");
    assert!(err.to_string().contains("--edge-name"), "{err}");
    // The first edge's sandbox was not marked stopped by the refused second one.
    let log = first.sandbox_log("e0-1", None).await.unwrap().unwrap();
    assert_eq!(log.stopped_at, None);
    // Another name writes beside it; once the first closes, its name is free again.
    let other = connect(&url, "e1").await.unwrap();
    first.close().await;
    assert!(matches!(
        first.register(sandbox("e0-2", None)).wait().await,
        Err(LogError::WriterGone)
    ));
    let again = connect(&url, "e0").await.unwrap();
    let log = again.sandbox_log("e0-1", None).await.unwrap().unwrap();
    assert!(
        log.stopped_at.is_some(),
        "its earlier run's sandbox is stopped"
    );
    again.close().await;
    other.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(postgres_installed),
    ignore = "PostgreSQL is not installed: apt-get install postgresql (scripts/setup.sh), or set DSEC_PG_BIN"
)]
async fn a_sandboxs_log_outlives_its_edge_and_the_budget_is_the_fleets() {
    let cluster = Cluster::start().await;
    let url = cluster.database("fleet").await;
    let budgets = total_budget(2 << 20);
    let config = LogConfig {
        sync: SyncMode::Normal,
        budgets,
    };
    let a = TrajectoryLog::connect(&url, "a", config).await.unwrap();
    let b = TrajectoryLog::connect(&url, "b", config).await.unwrap();

    // Edge a records a trajectory with a NUL byte in its output, and goes away.
    a.register(sandbox("a-1", Some("t-a")))
        .wait()
        .await
        .unwrap();
    let mut s = step(Some("t-a"), "a-1", 0, "printf");
    s.result = common::output(64 << 10, b"before\0after\n");
    a.append(s.clone()).wait().await.unwrap();
    a.close().await;
    drop(a);
    // Any server reads it: a replay lookup, and the whole log.
    assert_eq!(b.step("t-a", 0).await.unwrap(), Some(s));
    let log = b.sandbox_log("a-1", None).await.unwrap().unwrap();
    assert_eq!(log.steps[0].result.stdout, "before\0after\n");

    // Edge b fills the fleet's log with its own stopped sandboxes: the oldest stopped
    // sandboxes of any edge are pruned (a's restarted edge marks a-1 stopped first).
    let a = TrajectoryLog::connect(&url, "a", config).await.unwrap();
    for i in 0..40 {
        let id = format!("b-{i:02}");
        b.register(sandbox(&id, None)).wait().await.unwrap();
        b.append(chatty(&budgets, &id, 0, 1 << 20))
            .wait()
            .await
            .unwrap();
        b.stopped(&id).wait().await.unwrap();
    }
    let pruned = wait_for(|| b.stored_bytes() <= budgets.total_bytes / 8 * 5).await;
    assert!(pruned, "{} stored", b.stored_bytes());
    assert!(
        b.sandbox_log("a-1", None).await.unwrap().is_none(),
        "a-1 stopped first"
    );
    assert!(b.sandbox_log("b-39", None).await.unwrap().is_some());
    // Edge a sees the fleet's total too, within a maintenance round.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(
        a.stored_bytes() <= budgets.total_bytes,
        "{}",
        a.stored_bytes()
    );
    assert!(
        a.stored_bytes() > budgets.total_bytes / 4,
        "{}",
        a.stored_bytes()
    );
    a.close().await;
    b.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(postgres_installed),
    ignore = "PostgreSQL is not installed: apt-get install postgresql (scripts/setup.sh), or set DSEC_PG_BIN"
)]
async fn writes_resume_after_postgresql_drops_the_connection() {
    let cluster = Cluster::start().await;
    let url = cluster.database("reconnect").await;
    let log = TrajectoryLog::connect(&url, "e0", LogConfig::default())
        .await
        .unwrap();
    log.register(sandbox("s", None)).wait().await.unwrap();
    log.append(step(None, "s", 0, "one")).wait().await.unwrap();
    // The database ends every session of the log (an administrator, a failover).
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = 'dsec-edge-e0'",
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The first write may fail with the lost session; the next ones reconnect.
    let _ = log.append(step(None, "s", 1, "two")).wait().await;
    let mut written = false;
    for n in 2..20 {
        if log.append(step(None, "s", n, "three")).wait().await.is_ok() {
            written = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(written, "the writer did not reconnect");
    assert!(
        log.sandbox_log("s", None)
            .await
            .unwrap()
            .unwrap()
            .steps
            .len()
            >= 2
    );
    log.close().await;
}

/// The schema version 2 of dsec wrote, as it wrote it.
const V2_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS dsec_schema (version BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS dsec_sandboxes (
    id            TEXT PRIMARY KEY,
    trajectory_id TEXT UNIQUE,
    image         TEXT NOT NULL,
    backend       TEXT NOT NULL,
    env           TEXT NOT NULL,
    created_at    DOUBLE PRECISION NOT NULL,
    edge          TEXT NOT NULL,
    stopped_at    DOUBLE PRECISION,
    bytes         BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS dsec_sandboxes_by_stop ON dsec_sandboxes (stopped_at)
    WHERE stopped_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS dsec_sandboxes_running ON dsec_sandboxes (edge)
    WHERE stopped_at IS NULL;
CREATE TABLE IF NOT EXISTS dsec_steps (
    trajectory    TEXT NOT NULL,
    step          BIGINT NOT NULL,
    trajectory_id TEXT,
    sandbox_id    TEXT NOT NULL,
    argv          TEXT NOT NULL,
    env           TEXT NOT NULL,
    cwd           TEXT NOT NULL,
    stdin_sha256  TEXT,
    files         TEXT NOT NULL,
    timeout_s     DOUBLE PRECISION,
    exit_code     INTEGER,
    stdout        BYTEA NOT NULL,
    stderr        BYTEA NOT NULL,
    timed_out     BOOLEAN NOT NULL,
    truncated     BOOLEAN NOT NULL,
    oom_killed    BOOLEAN NOT NULL,
    duration_ms   DOUBLE PRECISION NOT NULL,
    started_at    DOUBLE PRECISION NOT NULL,
    finished_at   DOUBLE PRECISION NOT NULL,
    stdout_bytes  BIGINT NOT NULL,
    stdout_sha256 TEXT NOT NULL,
    stdout_elided BIGINT NOT NULL,
    stderr_bytes  BIGINT NOT NULL,
    stderr_sha256 TEXT NOT NULL,
    stderr_elided BIGINT NOT NULL,
    bytes         BIGINT NOT NULL,
    run_as        TEXT,
    PRIMARY KEY (trajectory, step)
);
-- Version 2: the user a step ran as (none before: root).
ALTER TABLE dsec_steps ADD COLUMN IF NOT EXISTS run_as TEXT;
CREATE TABLE IF NOT EXISTS dsec_usage (edge TEXT PRIMARY KEY, bytes BIGINT NOT NULL);
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(postgres_installed),
    ignore = "PostgreSQL is not installed: apt-get install postgresql (scripts/setup.sh), or set DSEC_PG_BIN"
)]
async fn a_log_of_version_2_is_upgraded_and_keeps_its_steps() {
    let cluster = Cluster::start().await;
    let url = cluster.database("v2").await;
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client.batch_execute(V2_SCHEMA).await.unwrap();
    client
        .batch_execute(
            "INSERT INTO dsec_schema (version) VALUES (2);
             INSERT INTO dsec_sandboxes (id, trajectory_id, image, backend, env, created_at,
                 edge, stopped_at, bytes)
             VALUES ('old', 't', 'busybox', 'container', '{}', 1.0, 'e9', 5.0, 500);
             INSERT INTO dsec_steps VALUES ('t', 0, 't', 'old', '[\"id\"]', '{}', '/', NULL,
                 '[]', NULL, 0, 'uid=1000\n', '', false, false, false, 1.0, 2.0, 3.0, 9,
                 'sha256:x', 0, 0, '', 0, 200, 'alice');
             INSERT INTO dsec_usage VALUES ('e9', 700);",
        )
        .await
        .unwrap();
    let log = connect(&url, "e0").await.unwrap();
    let old = log.sandbox_log("old", None).await.unwrap().unwrap();
    let s = &old.steps[0];
    assert_eq!(
        (s.result.stdout.as_str(), s.request.run_as.as_deref()),
        ("uid=1000\n", Some("alice"))
    );
    assert_eq!(s.request.kind, StepKind::Run);
    assert_eq!(old.sandbox.project, None);
    assert_eq!((old.stopped_at, old.bytes), (Some(5.0), 500));
    let version: i64 = client
        .query_one("SELECT max(version) FROM dsec_schema", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, 3);
    // The upgraded log takes process steps and projects.
    let mut owned = sandbox("new", Some("u"));
    owned.project = Some("team-a".into());
    log.register(owned).wait().await.unwrap();
    let mut spawn = step(Some("u"), "new", 0, "sleep 1");
    spawn.request.kind = StepKind::Spawn;
    spawn.request.process = Some(ProcessRequest::default());
    log.append(spawn.clone()).wait().await.unwrap();
    assert_eq!(log.step("u", 0).await.unwrap().unwrap(), spawn);
    let new = log.sandbox_log("new", None).await.unwrap().unwrap();
    assert_eq!(new.sandbox.project.as_deref(), Some("team-a"));
    log.close().await;
}
