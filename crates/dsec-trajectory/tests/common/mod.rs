//! What the trajectory log's tests share: logs in temporary directories, and the sandboxes
//! and steps they record.
#![allow(dead_code)] // each test file uses its own part

pub mod postgres;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dsec_trajectory::{
    digest, Budgets, Database, ExitStatus, FileDigest, LogConfig, OutputCapture, SandboxRecord,
    Step, StepKind, StepRequest, StepResult, SyncMode, TrajectoryLog,
};

/// The store a test runs on.
pub enum Backing<'a> {
    /// A SQLite file in a temporary directory.
    Sqlite,
    /// A new database of this cluster.
    Postgres(&'a postgres::Cluster),
}

/// A log of its own, on a test's store.
pub struct TestLog {
    pub log: TrajectoryLog,
    pub config: LogConfig,
    pub db: Database,
    pub dir: tempfile::TempDir,
}

/// Databases made so far by this test process (each log gets a new one).
static DATABASES: AtomicUsize = AtomicUsize::new(0);

/// The edge name test logs write under.
pub const EDGE: &str = "e0";

impl TestLog {
    pub async fn open(backing: &Backing<'_>, sync: SyncMode, budgets: Budgets) -> TestLog {
        let dir = tempfile::tempdir().unwrap();
        let db = match backing {
            Backing::Sqlite => Database::Sqlite(dir.path().join("trajectory.db")),
            Backing::Postgres(cluster) => {
                let n = DATABASES.fetch_add(1, Ordering::Relaxed);
                Database::Postgres(cluster.database(&format!("log{n}")).await)
            }
        };
        TestLog::open_in(db, LogConfig { sync, budgets }, dir).await
    }

    async fn open_in(db: Database, config: LogConfig, dir: tempfile::TempDir) -> TestLog {
        let log = TrajectoryLog::open_database(&db, EDGE, config)
            .await
            .unwrap();
        TestLog {
            log,
            config,
            db,
            dir,
        }
    }

    /// The same log opened again, as a restarted server opens it (the old one closed).
    pub async fn reopen(self) -> TestLog {
        self.log.close().await;
        let TestLog {
            log,
            config,
            db,
            dir,
        } = self;
        drop(log);
        TestLog::open_in(db, config, dir).await
    }

    /// The log keeps within `budget`: for SQLite, its files (database and WAL); for
    /// PostgreSQL, whose files are its own business, what the log stores.
    pub fn assert_files_within(&self, budget: u64) {
        let Database::Sqlite(path) = &self.db else {
            assert!(
                self.log.stored_bytes() <= budget,
                "{} stored",
                self.log.stored_bytes()
            );
            return;
        };
        let size = |p: PathBuf| std::fs::metadata(p).map_or(0, |m| m.len());
        let (db, wal) = (size(path.clone()), size(path.with_extension("db-wal")));
        assert!(
            db + wal <= budget,
            "{db} bytes in the database and {wal} in the WAL; {} stored",
            self.log.stored_bytes()
        );
    }
}

/// Declares each `case` (an `async fn(&Backing)`) as a test on SQLite, and runs them all
/// on one PostgreSQL cluster in one test (ignored, saying why, where PostgreSQL is not
/// installed: see `build.rs`).
#[allow(unused_macros)]
macro_rules! on_both_stores {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(&$crate::common::Backing::Sqlite).await
                }
            )*
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
            not(postgres_installed),
            ignore = "PostgreSQL is not installed: apt-get install postgresql (scripts/setup.sh), or set DSEC_PG_BIN"
        )]
        async fn postgres() {
            let cluster = $crate::common::postgres::Cluster::start().await;
            let backing = $crate::common::Backing::Postgres(&cluster);
            $(
                eprintln!("postgres: {}", stringify!($case));
                $case(&backing).await;
            )*
        }
    };
}

/// Budgets that bound only the total, at `total_bytes`.
pub fn total_budget(total_bytes: u64) -> Budgets {
    Budgets {
        output_bytes: 64 << 10,
        sandbox_bytes: 1 << 30,
        total_bytes,
    }
}

pub fn sandbox(id: &str, trajectory_id: Option<&str>) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        trajectory_id: trajectory_id.map(str::to_owned),
        image: "busybox".into(),
        backend: "container".into(),
        env: BTreeMap::from([("K".into(), "V".into())]),
        created_at: 1.0,
        project: None,
        fork_of: None,
    }
}

/// What a command's output is once `keep` bounds it.
pub fn output(keep: u64, data: &[u8]) -> StepResult {
    let mut out = OutputCapture::new(keep);
    out.push(data);
    StepResult::new(
        ExitStatus {
            exit_code: Some(0),
            duration_ms: 1.0,
            ..ExitStatus::default()
        },
        out.finish(),
        OutputCapture::new(keep).finish(),
    )
}

/// Step `n` of a sandbox: `cmd` that printed `cmd\n`.
pub fn step(trajectory_id: Option<&str>, sandbox: &str, n: i64, cmd: &str) -> Step {
    Step {
        step: n,
        trajectory_id: trajectory_id.map(str::to_owned),
        sandbox_id: sandbox.to_owned(),
        request: StepRequest {
            argv: vec!["/bin/sh".into(), "-c".into(), cmd.into()],
            env: BTreeMap::new(),
            cwd: "/".into(),
            stdin_sha256: None,
            files: vec![FileDigest {
                path: "/a".into(),
                sha256: digest(b"x"),
                mode: 0o644,
            }],
            timeout_s: Some(5.0),
            run_as: None,
            kind: StepKind::Run,
            process: None,
        },
        result: output(64 << 10, format!("{cmd}\n").as_bytes()),
        started_at: 1.0,
        finished_at: 2.0,
    }
}

/// Step `n` of a sandbox without a trajectory id, whose stdout was `bytes` bytes of `y\n`,
/// bounded by `budgets`.
pub fn chatty(budgets: &Budgets, sandbox: &str, n: i64, bytes: usize) -> Step {
    let mut s = step(None, sandbox, n, "yes");
    s.result = output(budgets.output_bytes, &b"y\n".repeat(bytes / 2));
    s
}

/// Registers sandbox `id` (no trajectory id) and appends one step that printed 1 MiB.
pub async fn chatty_sandbox(log: &TrajectoryLog, budgets: &Budgets, id: &str) {
    log.register(sandbox(id, None)).wait().await.unwrap();
    log.append(chatty(budgets, id, 0, 1 << 20))
        .wait()
        .await
        .unwrap();
}

/// The log comes to store `bytes` (at once for SQLite; for PostgreSQL, whose total is
/// read from the database twice a second, within a read or two).
pub async fn assert_stored(log: &TrajectoryLog, bytes: u64) {
    wait_for(|| log.stored_bytes() == bytes).await;
    assert_eq!(log.stored_bytes(), bytes, "what the log stores");
}

/// Polls `done` for up to five seconds.
pub async fn wait_for(mut done: impl FnMut() -> bool) -> bool {
    for _ in 0..100 {
        if done() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    done()
}
