//! Writes: the writer's session, group commit of a batch (its steps in one multi-row
//! insert), and pruning.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use tokio_postgres::{Client, Config, GenericClient, Statement};

use super::{connect, pg_detail, pg_err, Store};
use crate::budget::{record_bytes, Change, Delta, PruneRound, StepJson};
use crate::error::LogError;
use crate::job::{Job, Write};
use crate::model::{json, SandboxRecord, Step};
use crate::row::{sql_count, sql_int, COPIED_COLUMNS, STEP_COLUMNS};
use crate::SyncMode;

/// The writer's connection, holding its edge name, with its prepared statements.
pub(super) struct Session {
    pub(super) client: Client,
    /// The batch insert, prepared once the schema exists.
    insert_steps: Option<Statement>,
}

impl Session {
    pub(super) async fn connect(
        config: &Config,
        db: &str,
        edge: &str,
        sync: SyncMode,
    ) -> Result<Session, LogError> {
        let client = connect(config, db).await?;
        let commit = match sync {
            SyncMode::Normal => "off",
            SyncMode::Full => "on",
        };
        client
            .batch_execute(&format!("SET synchronous_commit = {commit}"))
            .await
            .map_err(pg_err(db, "setting up the session"))?;
        tracing::debug!(db, edge, "trajectory log: writer connected");
        Ok(Session {
            client,
            insert_steps: None,
        })
    }

    /// Takes the edge name for this session, waiting up to `wait` for a server that is
    /// shutting down to release it.
    pub(super) async fn lock_edge(
        &mut self,
        db: &str,
        edge: &str,
        wait: Duration,
    ) -> Result<(), LogError> {
        let deadline = Instant::now() + wait;
        loop {
            let locked: bool = self
                .client
                .query_one(
                    "SELECT pg_try_advisory_lock(hashtextextended('dsec-trajectory-edge:' || $1, 0))",
                    &[&edge],
                )
                .await
                .map_err(pg_err(db, "taking the edge name"))?
                .get(0);
            if locked {
                break;
            }
            if Instant::now() >= deadline {
                return Err(LogError::EdgeTaken {
                    db: db.to_owned(),
                    edge: edge.to_owned(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let insert = self
            .client
            .prepare(&format!(
                "WITH inserted AS (INSERT INTO dsec_steps (trajectory, {STEP_COLUMNS}) \
                 SELECT * FROM unnest(\
                 $1::text[], $2::int8[], $3::text[], $4::text[], $5::text[], $6::text[], \
                 $7::text[], $8::text[], $9::text[], $10::float8[], $11::int4[], \
                 $12::bytea[], $13::bytea[], $14::bool[], $15::bool[], $16::bool[], \
                 $17::float8[], $18::float8[], $19::float8[], $20::int8[], $21::text[], \
                 $22::int8[], $23::int8[], $24::text[], $25::int8[], $26::int8[], \
                 $27::text[], $28::text[], $29::text[], $30::int4[], $31::bool[]) \
                 ON CONFLICT DO NOTHING RETURNING trajectory, step, bytes), \
                 counted AS (INSERT INTO dsec_usage (edge, bytes) \
                 SELECT $32::text, sum(bytes) FROM inserted HAVING count(*) > 0 \
                 ON CONFLICT (edge) DO UPDATE SET bytes = dsec_usage.bytes + EXCLUDED.bytes) \
                 SELECT trajectory, step FROM inserted"
            ))
            .await
            .map_err(pg_err(db, "preparing the writes"))?;
        self.insert_steps = Some(insert);
        Ok(())
    }
}

/// An append admitted to the batch, waiting for the batch's insert.
struct Admitted {
    /// Its job's index in the batch.
    job: usize,
    /// Its row's bytes.
    bytes: u64,
    /// Its sandbox is live (this server's, running): its share is counted in memory.
    live: bool,
    over_budget: bool,
}

/// Writes `batch` atomically, applies what it changed to the store's usage, counts the
/// commit, and answers each job once it is committed. A batch of appends of this server's
/// live sandboxes (the common case) is one statement, committed on its own: one round trip;
/// any other batch is one transaction.
pub(super) async fn write_batch(s: &mut Session, store: &Store, mut batch: Vec<Job>) {
    let mut outcomes: Vec<Option<Result<(), LogError>>> = batch.iter().map(|_| None).collect();
    let mut delta = Delta::default();
    let Session {
        client,
        insert_steps: Some(insert),
    } = s
    else {
        unreachable!("a writer session holds its edge name, and its insert, before writing");
    };
    let one_statement = batch.iter().all(|job| match &job.write {
        Write::Append(step) => store
            .usage
            .live(&step.sandbox_id, &Delta::default())
            .is_some(),
        _ => false,
    });
    let committed = async {
        let mut writes = BatchWrite::new(store, insert, &mut batch, &mut outcomes, &mut delta);
        if one_statement {
            return writes.write(&*client).await;
        }
        let tx = client.transaction().await.map_err(|e| pg_detail(&e))?;
        writes.write(&tx).await?;
        tx.commit().await.map_err(|e| pg_detail(&e))
    }
    .await;
    if let Err(message) = &committed {
        tracing::error!(db = %store.db, error = %message, "trajectory log commit failed");
    } else {
        store.usage.apply(delta);
        store.commits.committed(batch.len());
    }
    for (job, outcome) in batch.into_iter().zip(outcomes) {
        let outcome = match &committed {
            Ok(()) => outcome.unwrap_or(Err(LogError::WriterGone)),
            Err(message) => Err(LogError::Commit {
                db: store.db.clone(),
                message: message.clone(),
            }),
        };
        job.answer(outcome);
    }
}

/// The writes of one batch, in order, on a transaction or (for appends of live sandboxes
/// only) on the connection itself.
struct BatchWrite<'a> {
    store: &'a Store,
    insert: &'a Statement,
    batch: &'a mut [Job],
    outcomes: &'a mut [Option<Result<(), LogError>>],
    /// What the committed writes change.
    delta: &'a mut Delta,
    /// What budget decisions see: the batch's admitted writes, confirmed or not yet.
    admitted_delta: Delta,
    /// Appends admitted and not yet inserted.
    admitted: Vec<Admitted>,
    /// Bytes of the steps inserted, which the insert itself added to `dsec_usage`.
    counted: u64,
}

impl<'a> BatchWrite<'a> {
    fn new(
        store: &'a Store,
        insert: &'a Statement,
        batch: &'a mut [Job],
        outcomes: &'a mut [Option<Result<(), LogError>>],
        delta: &'a mut Delta,
    ) -> BatchWrite<'a> {
        BatchWrite {
            store,
            insert,
            batch,
            outcomes,
            delta,
            admitted_delta: Delta::default(),
            admitted: Vec::new(),
            counted: 0,
        }
    }

    async fn write<C: GenericClient + Sync>(&mut self, c: &C) -> Result<(), String> {
        let store = self.store;
        for i in 0..self.batch.len() {
            if let Write::Append(step) = &mut self.batch[i].write {
                let Some(a) = admit(c, store, &self.admitted_delta, step).await? else {
                    self.outcomes[i] = Some(Ok(()));
                    continue;
                };
                self.admitted_delta.add(change_of(step, &a));
                self.admitted.push(Admitted { job: i, ..a });
                continue;
            }
            // Earlier steps first: a fork copies its parent's steps, a stop counts them.
            self.insert_admitted(c).await?;
            let outcome = match &mut self.batch[i].write {
                Write::Register(r) => register(c, &store.db, &store.edge, r).await?,
                Write::Stopped { id, at } => {
                    let share = store
                        .usage
                        .live(id, &self.admitted_delta)
                        .map(|l| sql_int(l.bytes));
                    c.execute(
                        "UPDATE dsec_sandboxes SET stopped_at = $2, bytes = coalesce($3, bytes) \
                         WHERE id = $1 AND stopped_at IS NULL",
                        &[id, at, &share],
                    )
                    .await
                    .map_err(|e| pg_detail(&e))?;
                    Ok(Change::Stopped(id.clone()))
                }
                Write::Reopened(id) => {
                    let row = c
                        .query_opt(
                            "UPDATE dsec_sandboxes SET stopped_at = NULL WHERE id = $1 \
                             RETURNING bytes",
                            &[id],
                        )
                        .await
                        .map_err(|e| pg_detail(&e))?;
                    Ok(row.map_or(Change::None, |r| Change::Reopened {
                        id: id.clone(),
                        bytes: sql_count(r.get::<_, i64>(0)),
                    }))
                }
                Write::Ended(step) => ended(c, store, &self.admitted_delta, step).await?,
                Write::Append(_) => unreachable!("appends are admitted above"),
            };
            self.outcomes[i] = Some(outcome.map(|change| {
                self.admitted_delta.add(change.clone());
                self.delta.add(change);
            }));
        }
        self.insert_admitted(c).await?;
        // What the inserts did not count: registrations and forks' copied steps.
        let uncounted = self.delta.bytes - self.counted;
        if uncounted > 0 {
            c.execute(
                "INSERT INTO dsec_usage (edge, bytes) VALUES ($1, $2) \
                 ON CONFLICT (edge) DO UPDATE SET bytes = dsec_usage.bytes + EXCLUDED.bytes",
                &[&store.edge, &sql_int(uncounted)],
            )
            .await
            .map_err(|e| pg_detail(&e))?;
        }
        Ok(())
    }

    async fn insert_admitted<C: GenericClient + Sync>(&mut self, c: &C) -> Result<(), String> {
        self.counted += insert_steps(
            c,
            self.insert,
            &self.store.edge,
            self.batch,
            &mut self.admitted,
            self.outcomes,
            self.delta,
        )
        .await?;
        Ok(())
    }
}

fn change_of(step: &Step, a: &Admitted) -> Change {
    Change::Grew {
        id: step.sandbox_id.clone(),
        bytes: a.bytes,
        live: a.live,
        over_budget: a.over_budget,
    }
}

/// Bounds an append by the budgets; `None` when its sandbox is not in the log (its log
/// was pruned after it stopped): nothing to store.
async fn admit<C: GenericClient + Sync>(
    tx: &C,
    store: &Store,
    batch: &Delta,
    step: &mut Step,
) -> Result<Option<Admitted>, String> {
    let live = store.usage.live(&step.sandbox_id, batch);
    let share = match live {
        Some(l) => l.bytes,
        None => {
            let row = tx
                .query_opt(
                    "SELECT bytes FROM dsec_sandboxes WHERE id = $1",
                    &[&step.sandbox_id],
                )
                .await
                .map_err(|e| pg_detail(&e))?;
            let Some(row) = row else {
                tracing::debug!(sandbox = %step.sandbox_id, step = step.step, "trajectory log: step of a sandbox it does not hold (pruned after it stopped) not stored");
                return Ok(None);
            };
            sql_count(row.get::<_, i64>(0))
        }
    };
    let mut row = StepJson::new(step);
    let (bytes, over_budget) = store.usage.admit(step, &mut row, share, live, batch);
    Ok(Some(Admitted {
        job: 0,
        bytes,
        live: live.is_some(),
        over_budget,
    }))
}

/// Puts a spawned process's end in its spawn step's row; the row's growth counts against
/// the budgets as an append does (`dsec_usage` gets it with the batch's other uncounted
/// bytes).
async fn ended<C: GenericClient + Sync>(
    c: &C,
    store: &Store,
    batch: &Delta,
    step: &mut Step,
) -> Result<Result<Change, LogError>, String> {
    let old = c
        .query_opt(
            "SELECT bytes FROM dsec_steps WHERE trajectory = $1 AND step = $2",
            &[&step.trajectory(), &step.step],
        )
        .await
        .map_err(|e| pg_detail(&e))?;
    let Some(old) = old.map(|r| sql_count(r.get::<_, i64>(0))) else {
        return Ok(Ok(Change::None));
    };
    let Some(mut a) = admit(c, store, batch, step).await? else {
        return Ok(Ok(Change::None));
    };
    let r = &step.result;
    c.execute(
        "UPDATE dsec_steps SET exit_code = $3, stdout = $4, stderr = $5, timed_out = $6, \
         truncated = $7, oom_killed = $8, duration_ms = $9, finished_at = $10, \
         stdout_bytes = $11, stdout_sha256 = $12, stdout_elided = $13, stderr_bytes = $14, \
         stderr_sha256 = $15, stderr_elided = $16, bytes = $17, pid = $18, running = $19 \
         WHERE trajectory = $1 AND step = $2",
        &[
            &step.trajectory(),
            &step.step,
            &r.exit.exit_code,
            &r.stdout.as_bytes(),
            &r.stderr.as_bytes(),
            &r.exit.timed_out,
            &r.exit.truncated,
            &r.exit.oom_killed,
            &r.exit.duration_ms,
            &step.finished_at,
            &sql_int(r.stdout_bytes),
            &r.stdout_sha256,
            &sql_int(r.stdout_elided),
            &sql_int(r.stderr_bytes),
            &r.stderr_sha256,
            &sql_int(r.stderr_elided),
            &sql_int(a.bytes),
            &r.pid,
            &r.running,
        ],
    )
    .await
    .map_err(|e| pg_detail(&e))?;
    a.bytes = a.bytes.saturating_sub(old);
    if !a.live {
        c.execute(
            "UPDATE dsec_sandboxes SET bytes = bytes + $2 WHERE id = $1",
            &[&step.sandbox_id, &sql_int(a.bytes)],
        )
        .await
        .map_err(|e| pg_detail(&e))?;
    }
    Ok(Ok(change_of(step, &a)))
}

/// Inserts the admitted steps in one statement, which also adds their bytes to the edge's
/// row of `dsec_usage`, and settles their jobs: inserted, or a duplicate of a recorded
/// step (or of an earlier one in the batch). The bytes inserted.
async fn insert_steps<C: GenericClient + Sync>(
    tx: &C,
    insert: &Statement,
    edge: &str,
    batch: &mut [Job],
    admitted: &mut Vec<Admitted>,
    outcomes: &mut [Option<Result<(), LogError>>],
    delta: &mut Delta,
) -> Result<u64, String> {
    if admitted.is_empty() {
        return Ok(0);
    }
    let steps: Vec<(&Step, StepJson)> = admitted
        .iter()
        .map(|a| match &batch[a.job].write {
            Write::Append(s) => (s.as_ref(), StepJson::new(s)),
            _ => unreachable!("only appends are admitted"),
        })
        .collect();
    let col = |f: fn(&Step) -> &str| steps.iter().map(|(s, _)| f(s)).collect::<Vec<_>>();
    let trajectory = col(Step::trajectory);
    let step_no: Vec<i64> = steps.iter().map(|(s, _)| s.step).collect();
    let trajectory_id: Vec<Option<&str>> = steps
        .iter()
        .map(|(s, _)| s.trajectory_id.as_deref())
        .collect();
    let sandbox_id = col(|s| &s.sandbox_id);
    let argv: Vec<&str> = steps.iter().map(|(_, j)| j.argv.as_str()).collect();
    let env: Vec<&str> = steps.iter().map(|(_, j)| j.env.as_str()).collect();
    let cwd = col(|s| &s.request.cwd);
    let stdin: Vec<Option<&str>> = steps
        .iter()
        .map(|(s, _)| s.request.stdin_sha256.as_deref())
        .collect();
    let files: Vec<&str> = steps.iter().map(|(_, j)| j.files.as_str()).collect();
    let timeout: Vec<Option<f64>> = steps.iter().map(|(s, _)| s.request.timeout_s).collect();
    let run_as: Vec<Option<&str>> = steps
        .iter()
        .map(|(s, _)| s.request.run_as.as_deref())
        .collect();
    let kind = col(|s| s.request.kind.as_str());
    let process: Vec<Option<&str>> = steps.iter().map(|(_, j)| j.process.as_deref()).collect();
    let pid: Vec<Option<i32>> = steps.iter().map(|(s, _)| s.result.pid).collect();
    let exit_code: Vec<Option<i32>> = steps.iter().map(|(s, _)| s.result.exit.exit_code).collect();
    let stdout: Vec<&[u8]> = steps
        .iter()
        .map(|(s, _)| s.result.stdout.as_bytes())
        .collect();
    let stderr: Vec<&[u8]> = steps
        .iter()
        .map(|(s, _)| s.result.stderr.as_bytes())
        .collect();
    let flag = |f: fn(&Step) -> bool| steps.iter().map(|(s, _)| f(s)).collect::<Vec<_>>();
    let float = |f: fn(&Step) -> f64| steps.iter().map(|(s, _)| f(s)).collect::<Vec<_>>();
    let int = |f: fn(&Step) -> u64| steps.iter().map(|(s, _)| sql_int(f(s))).collect::<Vec<_>>();
    let bytes: Vec<i64> = admitted.iter().map(|a| sql_int(a.bytes)).collect();
    let rows = tx
        .query(
            insert,
            &[
                &trajectory,
                &step_no,
                &trajectory_id,
                &sandbox_id,
                &argv,
                &env,
                &cwd,
                &stdin,
                &files,
                &timeout,
                &exit_code,
                &stdout,
                &stderr,
                &flag(|s| s.result.exit.timed_out),
                &flag(|s| s.result.exit.truncated),
                &flag(|s| s.result.exit.oom_killed),
                &float(|s| s.result.exit.duration_ms),
                &float(|s| s.started_at),
                &float(|s| s.finished_at),
                &int(|s| s.result.stdout_bytes),
                &col(|s| &s.result.stdout_sha256),
                &int(|s| s.result.stdout_elided),
                &int(|s| s.result.stderr_bytes),
                &col(|s| &s.result.stderr_sha256),
                &int(|s| s.result.stderr_elided),
                &bytes,
                &run_as,
                &kind,
                &process,
                &pid,
                &flag(|s| s.result.running),
                &edge,
            ],
        )
        .await
        .map_err(|e| pg_detail(&e))?;
    let mut inserted: HashSet<(String, i64)> = rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        .collect();
    drop(steps);
    let mut inserted_bytes = 0;
    for a in admitted.drain(..) {
        let Write::Append(s) = &batch[a.job].write else {
            continue;
        };
        // The first of a key's appends is the one inserted; the others are duplicates.
        if !inserted.remove(&(s.trajectory().to_owned(), s.step)) {
            outcomes[a.job] = Some(Err(LogError::Duplicate {
                trajectory: s.trajectory().to_owned(),
                step: s.step,
            }));
            continue;
        }
        if !a.live {
            // A stopped sandbox's step: its row carries its share.
            tx.execute(
                "UPDATE dsec_sandboxes SET bytes = bytes + $2 WHERE id = $1",
                &[&s.sandbox_id, &sql_int(a.bytes)],
            )
            .await
            .map_err(|e| pg_detail(&e))?;
        }
        inserted_bytes += a.bytes;
        delta.add(change_of(s, &a));
        outcomes[a.job] = Some(Ok(()));
    }
    Ok(inserted_bytes)
}

/// Records a sandbox (and a fork's inherited steps); a trajectory id that is taken is the
/// write's own failure, not the batch's.
async fn register<C: GenericClient + Sync>(
    tx: &C,
    db: &str,
    edge: &str,
    s: &SandboxRecord,
) -> Result<Result<Change, LogError>, String> {
    let own = record_bytes(s);
    let inserted = tx
        .query_opt(
            "INSERT INTO dsec_sandboxes (id, trajectory_id, image, backend, env, created_at, \
             edge, bytes, project) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT DO NOTHING RETURNING id",
            &[
                &s.id,
                &s.trajectory_id,
                &s.image,
                &s.backend,
                &json(&s.env),
                &s.created_at,
                &edge,
                &sql_int(own),
                &s.project,
            ],
        )
        .await
        .map_err(|e| pg_detail(&e))?;
    if inserted.is_none() {
        let owner = match &s.trajectory_id {
            Some(t) => tx
                .query_opt(
                    "SELECT id FROM dsec_sandboxes WHERE trajectory_id = $1",
                    &[t],
                )
                .await
                .map_err(|e| pg_detail(&e))?
                .map(|r| r.get::<_, String>(0)),
            None => None,
        };
        return Ok(Err(match owner {
            Some(owner) => LogError::TrajectoryTaken {
                trajectory_id: s.trajectory_id.clone().unwrap_or_default(),
                owner,
            },
            None => LogError::Postgres {
                db: db.to_owned(),
                what: "recording a sandbox",
                detail: format!("sandbox {} is already recorded", s.id),
            },
        }));
    }
    let copied = match (&s.fork_of, &s.trajectory_id) {
        (Some(fork), Some(child)) => {
            tx.execute(
                &format!(
                    "INSERT INTO dsec_steps (trajectory, {STEP_COLUMNS}) \
                     SELECT $1, step, $1, $2, {COPIED_COLUMNS} FROM dsec_steps WHERE trajectory = $3 AND step < $4"
                ),
                &[child, &s.id, &fork.trajectory_id, &fork.steps],
            )
            .await
            .map_err(|e| pg_detail(&e))?;
            tx.query_one(
                "SELECT coalesce(sum(bytes), 0)::int8 FROM dsec_steps WHERE trajectory = $1",
                &[child],
            )
            .await
            .map_err(|e| pg_detail(&e))?
            .get::<_, i64>(0)
        }
        _ => 0,
    };
    Ok(Ok(Change::Grew {
        id: s.id.clone(),
        bytes: own + sql_count(copied),
        live: true,
        over_budget: false,
    }))
}

/// Deletes the logs of stopped sandboxes of any edge, oldest stop first, until the log is
/// down to its pruning target; one sandbox per transaction.
pub(super) async fn prune(client: &mut Client, store: &Store) {
    let (mut round, mut exhausted) = (PruneRound::new(&store.usage), false);
    while round.more() {
        match prune_oldest(client).await {
            Ok(Some((id, freed))) => round.deleted(&id, freed),
            Ok(None) => {
                exhausted = true;
                break;
            }
            Err(e) => {
                tracing::error!(db = %store.db, error = %pg_detail(&e), "trajectory log: pruning failed");
                break;
            }
        }
    }
    round.end(exhausted);
}

/// Deletes the log of the sandbox that stopped first (skipping one another pruner holds):
/// its id and the bytes freed, or `None` when no sandbox has stopped.
async fn prune_oldest(client: &mut Client) -> Result<Option<(String, u64)>, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let row = tx
        .query_opt(
            "DELETE FROM dsec_sandboxes WHERE id = (SELECT id FROM dsec_sandboxes \
             WHERE stopped_at IS NOT NULL ORDER BY stopped_at, id LIMIT 1 \
             FOR UPDATE SKIP LOCKED) RETURNING id, coalesce(trajectory_id, id), bytes, edge",
            &[],
        )
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let (id, trajectory, bytes, edge): (String, String, i64, String) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    tx.execute(
        "DELETE FROM dsec_steps WHERE trajectory = $1",
        &[&trajectory],
    )
    .await?;
    tx.execute(
        "UPDATE dsec_usage SET bytes = bytes - $2 WHERE edge = $1",
        &[&edge, &bytes],
    )
    .await?;
    tx.commit().await?;
    Ok(Some((id, sql_count(bytes))))
}
