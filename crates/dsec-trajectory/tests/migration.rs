//! A log written by an older dsec is upgraded in place; one written by a newer dsec is
//! refused rather than misread.

mod common;

use dsec_trajectory::{digest, LogConfig, LogError, ProcessRequest, StepKind, TrajectoryLog};
use rusqlite::Connection;

/// The schema of the first trajectory log (before outputs were bounded).
const FIRST_SCHEMA: &str = "
CREATE TABLE sandboxes (id TEXT PRIMARY KEY, trajectory_id TEXT UNIQUE, image TEXT NOT NULL,
    backend TEXT NOT NULL, env TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE steps (trajectory TEXT NOT NULL, step INTEGER NOT NULL, trajectory_id TEXT,
    sandbox_id TEXT NOT NULL, argv TEXT NOT NULL, env TEXT NOT NULL, cwd TEXT NOT NULL,
    stdin_sha256 TEXT, files TEXT NOT NULL, timeout_s REAL, exit_code INTEGER,
    stdout TEXT NOT NULL, stderr TEXT NOT NULL, timed_out INTEGER NOT NULL,
    truncated INTEGER NOT NULL, oom_killed INTEGER NOT NULL, duration_ms REAL NOT NULL,
    started_at REAL NOT NULL, finished_at REAL NOT NULL, PRIMARY KEY (trajectory, step));
INSERT INTO sandboxes VALUES ('old', 't', 'busybox', 'container', '{\"K\":\"V\"}', 1.0);
INSERT INTO steps VALUES ('t', 0, 't', 'old', '[\"echo\",\"hi\"]', '{}', '/', NULL, '[]',
    NULL, 0, 'hi\n', '', 0, 0, 0, 1.5, 1.0, 2.0);
";

#[tokio::test]
async fn a_log_of_the_first_schema_is_upgraded_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trajectory.db");
    Connection::open(&path)
        .unwrap()
        .execute_batch(FIRST_SCHEMA)
        .unwrap();
    let log = TrajectoryLog::open(&path, LogConfig::default()).unwrap();
    let got = log.sandbox_log("old", None).await.unwrap().unwrap();
    assert_eq!(got.sandbox.env["K"], "V");
    let r = &got.steps[0].result;
    assert_eq!(
        (r.stdout.as_str(), r.stdout_bytes, r.stdout_elided),
        ("hi\n", 3, 0)
    );
    assert_eq!(r.stdout_sha256, digest(b"hi\n"));
    assert_eq!(r.exit.duration_ms, 1.5);
    assert!(
        got.stopped_at.is_some(),
        "a sandbox of an earlier run is stopped"
    );
    assert!(got.bytes > 0 && got.bytes == log.stored_bytes());
    // The trajectory id still names its sandbox.
    let err = log
        .register(common::sandbox("new", Some("t")))
        .wait()
        .await
        .unwrap_err();
    assert!(matches!(err, LogError::TrajectoryTaken { .. }), "{err}");
    drop(log);
    let log = TrajectoryLog::open(&path, LogConfig::default()).unwrap();
    assert_eq!(
        log.step("t", 0).await.unwrap().unwrap().result.stdout,
        "hi\n"
    );
}

#[tokio::test]
async fn a_log_of_version_1_gains_the_user_of_each_step() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trajectory.db");
    // Version 1: the first schema with the bounded outputs' columns, before `run_as`.
    let conn = Connection::open(&path).unwrap();
    conn.execute_batch(FIRST_SCHEMA).unwrap();
    conn.execute_batch(V1_COLUMNS).unwrap();
    conn.pragma_update(None, "user_version", 1).unwrap();
    drop(conn);
    let log = TrajectoryLog::open(&path, LogConfig::default()).unwrap();
    // A step written before users ran as root.
    let old = log.step("t", 0).await.unwrap().unwrap();
    assert_eq!(
        (old.result.stdout.as_str(), old.request.run_as),
        ("hi\n", None)
    );
    log.register(common::sandbox("new", Some("u")))
        .wait()
        .await
        .unwrap();
    let mut step = common::step(Some("u"), "new", 0, "id -u");
    step.request.run_as = Some("alice".into());
    log.append(step).wait().await.unwrap();
    drop(log);
    let log = TrajectoryLog::open(&path, LogConfig::default()).unwrap();
    let got = log.step("u", 0).await.unwrap().unwrap();
    assert_eq!(got.request.run_as.as_deref(), Some("alice"));
}

/// Version 1's additions to the first schema (the bounded outputs' columns).
const V1_COLUMNS: &str = "
ALTER TABLE sandboxes ADD COLUMN stopped_at REAL;
ALTER TABLE sandboxes ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN stdout_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN stdout_sha256 TEXT NOT NULL DEFAULT '';
ALTER TABLE steps ADD COLUMN stdout_elided INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN stderr_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN stderr_sha256 TEXT NOT NULL DEFAULT '';
ALTER TABLE steps ADD COLUMN stderr_elided INTEGER NOT NULL DEFAULT 0;
ALTER TABLE steps ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
";

#[tokio::test]
async fn a_log_of_version_2_gains_process_steps_and_projects_and_keeps_its_steps() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trajectory.db");
    // Version 2, as that dsec left it: a step that ran as a user, a stopped sandbox.
    let conn = Connection::open(&path).unwrap();
    conn.execute_batch(FIRST_SCHEMA).unwrap();
    conn.execute_batch(V1_COLUMNS).unwrap();
    conn.execute_batch(
        "ALTER TABLE steps ADD COLUMN run_as TEXT;
         INSERT INTO steps (trajectory, step, trajectory_id, sandbox_id, argv, env, cwd,
             files, exit_code, stdout, stderr, timed_out, truncated, oom_killed, duration_ms,
             started_at, finished_at, stdout_bytes, stdout_sha256, bytes, run_as)
         VALUES ('t', 1, 't', 'old', '[\"id\"]', '{}', '/', '[]', 0, 'uid=1000\n', '', 0,
             0, 0, 1.0, 2.0, 3.0, 9, 'sha256:x', 200, 'alice');
         UPDATE sandboxes SET stopped_at = 5.0, bytes = 500;",
    )
    .unwrap();
    conn.pragma_update(None, "user_version", 2).unwrap();
    drop(conn);
    let log = TrajectoryLog::open(&path, LogConfig::default()).unwrap();
    let old = log.sandbox_log("old", None).await.unwrap().unwrap();
    assert_eq!(old.steps.len(), 2, "{old:?}");
    assert_eq!(old.steps[0].result.stdout, "hi\n");
    assert_eq!(old.steps[1].request.run_as.as_deref(), Some("alice"));
    assert!(old
        .steps
        .iter()
        .all(|s| s.request.kind == StepKind::Run && s.request.process.is_none()));
    assert_eq!((old.stopped_at, old.bytes), (Some(5.0), 500));
    assert_eq!(old.sandbox.project, None, "an older sandbox is the admin's");
    // The upgraded log takes process steps and projects.
    let mut owned = common::sandbox("new", Some("u"));
    owned.project = Some("team-a".into());
    log.register(owned).wait().await.unwrap();
    let mut spawn = common::step(Some("u"), "new", 0, "sleep 1");
    spawn.request.kind = StepKind::Spawn;
    spawn.request.process = Some(ProcessRequest {
        tag: Some("t".into()),
        ..ProcessRequest::default()
    });
    log.append(spawn.clone()).wait().await.unwrap();
    drop(log);
    let conn = Connection::open(&path).unwrap();
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, 3);
    drop(conn);
    let log = TrajectoryLog::open(&path, LogConfig::default()).unwrap();
    assert_eq!(log.step("u", 0).await.unwrap().unwrap(), spawn);
    let new = log.sandbox_log("new", None).await.unwrap().unwrap();
    assert_eq!(new.sandbox.project.as_deref(), Some("team-a"));
    assert_eq!(
        log.sandbox_log("old", None).await.unwrap().unwrap().steps,
        old.steps
    );
}

#[test]
fn a_log_of_a_newer_dsec_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trajectory.db");
    Connection::open(&path)
        .unwrap()
        .pragma_update(None, "user_version", 99)
        .unwrap();
    let err = TrajectoryLog::open(&path, LogConfig::default())
        .err()
        .unwrap();
    assert!(matches!(err, LogError::Version { found: 99, .. }), "{err}");
    assert!(err.to_string().contains("newer dsec"), "{err}");
}
