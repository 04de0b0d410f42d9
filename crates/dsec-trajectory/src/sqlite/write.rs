//! Writes: group commit of a batch, each write's statements, and pruning.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};

use super::sqlite_err;
use crate::budget::{record_bytes, Change, Delta, LiveSandbox, StepJson, Usage};
use crate::error::LogError;
use crate::job::{CommitCounter, Job, Write};
use crate::model::{json, SandboxRecord, Step};
use crate::row::{sql_count, COPIED_COLUMNS, STEP_COLUMNS};

/// Writes `batch` in one transaction, applies what it changed to `usage`, counts the
/// commit, and answers each job once it is committed.
pub(super) fn write_batch(
    conn: &mut Connection,
    path: &Path,
    usage: &Usage,
    commits: &CommitCounter,
    mut batch: Vec<Job>,
) {
    let mut outcomes = Vec::with_capacity(batch.len());
    let mut delta = Delta::default();
    let committed = conn.transaction().and_then(|mut tx| {
        if let [job] = &mut batch[..] {
            // A lone write needs no savepoint: if it fails, nothing else is lost with it.
            let outcome = write_one(&tx, path, usage, &delta, &mut job.write);
            let ok = outcome.is_ok();
            outcomes.push(outcome.map(|change| delta.add(change)));
            return if ok { tx.commit() } else { tx.rollback() };
        }
        for job in &mut batch {
            // Each write in a savepoint of its own, so that a failed one leaves the batch's
            // others to commit.
            let outcome = tx
                .savepoint()
                .map_err(sqlite_err(path, "writing"))
                .and_then(|sp| {
                    let change = write_one(&sp, path, usage, &delta, &mut job.write)?;
                    sp.commit().map_err(sqlite_err(path, "writing"))?;
                    Ok(change)
                });
            outcomes.push(outcome.map(|change| delta.add(change)));
        }
        tx.commit()
    });
    match &committed {
        Ok(()) => {
            usage.apply(delta);
            commits.committed(batch.len());
        }
        Err(e) => {
            tracing::error!(error = %e, path = %path.display(), "trajectory log commit failed");
        }
    }
    let mut outcomes = outcomes.into_iter();
    for job in batch {
        let outcome = match &committed {
            Ok(()) => outcomes.next().unwrap_or(Err(LogError::WriterGone)),
            Err(e) => Err(LogError::Commit {
                db: path.display().to_string(),
                message: e.to_string(),
            }),
        };
        job.answer(outcome);
    }
}

fn is_constraint(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if f.code == rusqlite::ErrorCode::ConstraintViolation)
}

/// One write's statements; what it changes in the log's usage. `batch` is what the
/// batch's earlier writes changed.
fn write_one(
    conn: &Connection,
    path: &Path,
    usage: &Usage,
    batch: &Delta,
    write: &mut Write,
) -> Result<Change, LogError> {
    match write {
        Write::Register(s) => register(conn, path, s),
        Write::Append(s) => append(conn, path, usage, batch, s),
        Write::Ended(s) => ended(conn, path, usage, batch, s),
        Write::Stopped { id, at } => {
            // The share of a sandbox of this process is written now; any other keeps the
            // share its row holds.
            let bytes = usage.live(id, batch).map(|s| s.bytes);
            conn.execute(
                "UPDATE sandboxes SET stopped_at = ?2, bytes = coalesce(?3, bytes) \
                 WHERE id = ?1 AND stopped_at IS NULL",
                params![id.as_str(), *at, bytes],
            )
            .map_err(sqlite_err(path, "recording a stop"))?;
            Ok(Change::Stopped(id.clone()))
        }
        Write::Reopened(id) => {
            let bytes: Option<i64> = conn
                .query_row(
                    "UPDATE sandboxes SET stopped_at = NULL WHERE id = ?1 RETURNING bytes",
                    params![id.as_str()],
                    |r| r.get(0),
                )
                .optional()
                .map_err(sqlite_err(path, "reopening a sandbox"))?;
            Ok(bytes.map_or(Change::None, |b| Change::Reopened {
                id: id.clone(),
                bytes: sql_count(b),
            }))
        }
    }
}

fn register(conn: &Connection, path: &Path, s: &SandboxRecord) -> Result<Change, LogError> {
    let own = record_bytes(s);
    let inserted = conn
        .prepare_cached(
            "INSERT INTO sandboxes (id, trajectory_id, image, backend, env, created_at, bytes, \
             project) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        )
        .and_then(|mut st| {
            st.execute(params![
                s.id,
                s.trajectory_id,
                s.image,
                s.backend,
                json(&s.env),
                s.created_at,
                own,
                s.project,
            ])
        });
    match inserted {
        Ok(_) => {}
        Err(e) if is_constraint(&e) && s.trajectory_id.is_some() => {
            let owner = conn
                .query_row(
                    "SELECT id FROM sandboxes WHERE trajectory_id = ?1",
                    params![s.trajectory_id],
                    |r| r.get(0),
                )
                .unwrap_or_else(|_| "?".to_owned());
            return Err(LogError::TrajectoryTaken {
                trajectory_id: s.trajectory_id.clone().unwrap_or_default(),
                owner,
            });
        }
        Err(e) => return Err(sqlite_err(path, "recording a sandbox")(e)),
    }
    let copied = match (&s.fork_of, &s.trajectory_id) {
        (Some(fork), Some(child)) => conn
            .prepare_cached(&format!(
                "INSERT INTO steps (trajectory, {STEP_COLUMNS}) \
                 SELECT ?1, step, ?1, ?2, {COPIED_COLUMNS} \
                 FROM steps WHERE trajectory = ?3 AND step < ?4"
            ))
            .and_then(|mut st| st.execute(params![child, s.id, fork.trajectory_id, fork.steps]))
            .and_then(|_| {
                conn.query_row(
                    "SELECT coalesce(sum(bytes), 0) FROM steps WHERE trajectory = ?1",
                    params![child],
                    |r| r.get::<_, i64>(0),
                )
            })
            .map_err(sqlite_err(path, "forking a trajectory"))?,
        _ => 0,
    };
    Ok(Change::Grew {
        id: s.id.clone(),
        bytes: own + sql_count(copied),
        live: true,
        over_budget: false,
    })
}

/// What the log of `s`'s sandbox takes, and its live entry if it is live; `None` when
/// the log does not hold the sandbox (its log was pruned after it stopped).
fn share(
    conn: &Connection,
    path: &Path,
    usage: &Usage,
    batch: &Delta,
    s: &Step,
) -> Result<Option<(u64, Option<LiveSandbox>)>, LogError> {
    let live = usage.live(&s.sandbox_id, batch);
    if let Some(l) = live {
        return Ok(Some((l.bytes, live)));
    }
    // Not a live sandbox of this process: one that stopped with this command still
    // running, whose row may be gone (pruned) by now.
    let bytes: Option<i64> = conn
        .prepare_cached("SELECT bytes FROM sandboxes WHERE id = ?1")
        .and_then(|mut st| st.query_row(params![s.sandbox_id], |r| r.get(0)).optional())
        .map_err(sqlite_err(path, "appending a step"))?;
    if bytes.is_none() {
        tracing::debug!(sandbox = %s.sandbox_id, step = s.step, "trajectory log: step of a sandbox it does not hold (pruned after it stopped) not stored");
    }
    Ok(bytes.map(|b| (sql_count(b), None)))
}

fn append(
    conn: &Connection,
    path: &Path,
    usage: &Usage,
    batch: &Delta,
    s: &mut Step,
) -> Result<Change, LogError> {
    let Some((share, live)) = share(conn, path, usage, batch, s)? else {
        return Ok(Change::None);
    };
    let mut row = StepJson::new(s);
    let (bytes, over_budget) = usage.admit(s, &mut row, share, live, batch);
    let inserted = conn
        .prepare_cached(&format!(
            "INSERT INTO steps (trajectory, {STEP_COLUMNS}) VALUES \
             (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, \
              ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28, ?29, ?30, ?31)"
        ))
        .and_then(|mut st| {
            let r = &s.result;
            st.execute(params![
                s.trajectory(),
                s.step,
                s.trajectory_id,
                s.sandbox_id,
                row.argv,
                row.env,
                s.request.cwd,
                s.request.stdin_sha256,
                row.files,
                s.request.timeout_s,
                r.exit.exit_code,
                r.stdout,
                r.stderr,
                r.exit.timed_out,
                r.exit.truncated,
                r.exit.oom_killed,
                r.exit.duration_ms,
                s.started_at,
                s.finished_at,
                r.stdout_bytes,
                r.stdout_sha256,
                r.stdout_elided,
                r.stderr_bytes,
                r.stderr_sha256,
                r.stderr_elided,
                bytes,
                s.request.run_as,
                s.request.kind.as_str(),
                row.process,
                r.pid,
                r.running,
            ])
        });
    match inserted {
        Ok(_) => {}
        Err(e) if is_constraint(&e) => {
            return Err(LogError::Duplicate {
                trajectory: s.trajectory().to_owned(),
                step: s.step,
            })
        }
        Err(e) => return Err(sqlite_err(path, "appending a step")(e)),
    }
    if live.is_none() {
        conn.prepare_cached("UPDATE sandboxes SET bytes = bytes + ?2 WHERE id = ?1")
            .and_then(|mut st| st.execute(params![s.sandbox_id, bytes]))
            .map_err(sqlite_err(path, "appending a step"))?;
    }
    Ok(Change::Grew {
        id: s.sandbox_id.clone(),
        bytes,
        live: live.is_some(),
        over_budget,
    })
}

/// Puts a spawned process's end in its spawn step's row; the row's growth counts against
/// the budgets as an append does.
fn ended(
    conn: &Connection,
    path: &Path,
    usage: &Usage,
    batch: &Delta,
    s: &mut Step,
) -> Result<Change, LogError> {
    let err = sqlite_err(path, "recording a process's end");
    let old: Option<i64> = conn
        .prepare_cached("SELECT bytes FROM steps WHERE trajectory = ?1 AND step = ?2")
        .and_then(|mut st| {
            st.query_row(params![s.trajectory(), s.step], |r| r.get(0))
                .optional()
        })
        .map_err(sqlite_err(path, "recording a process's end"))?;
    let Some(old) = old.map(sql_count) else {
        return Ok(Change::None);
    };
    let Some((share, live)) = share(conn, path, usage, batch, s)? else {
        return Ok(Change::None);
    };
    let mut row = StepJson::new(s);
    let (bytes, over_budget) = usage.admit(s, &mut row, share.saturating_sub(old), live, batch);
    let r = &s.result;
    conn.prepare_cached(
        "UPDATE steps SET exit_code = ?3, stdout = ?4, stderr = ?5, timed_out = ?6, \
         truncated = ?7, oom_killed = ?8, duration_ms = ?9, finished_at = ?10, \
         stdout_bytes = ?11, stdout_sha256 = ?12, stdout_elided = ?13, stderr_bytes = ?14, \
         stderr_sha256 = ?15, stderr_elided = ?16, bytes = ?17, pid = ?18, running = ?19 \
         WHERE trajectory = ?1 AND step = ?2",
    )
    .and_then(|mut st| {
        st.execute(params![
            s.trajectory(),
            s.step,
            r.exit.exit_code,
            r.stdout,
            r.stderr,
            r.exit.timed_out,
            r.exit.truncated,
            r.exit.oom_killed,
            r.exit.duration_ms,
            s.finished_at,
            r.stdout_bytes,
            r.stdout_sha256,
            r.stdout_elided,
            r.stderr_bytes,
            r.stderr_sha256,
            r.stderr_elided,
            bytes,
            r.pid,
            r.running,
        ])
    })
    .map_err(err)?;
    let grew = bytes.saturating_sub(old);
    if live.is_none() {
        conn.prepare_cached("UPDATE sandboxes SET bytes = bytes + ?2 WHERE id = ?1")
            .and_then(|mut st| st.execute(params![s.sandbox_id, grew]))
            .map_err(sqlite_err(path, "recording a process's end"))?;
    }
    Ok(Change::Grew {
        id: s.sandbox_id.clone(),
        bytes: grew,
        live: live.is_some(),
        over_budget,
    })
}

/// Deletes the log of the sandbox that stopped first: its id and the bytes freed, or
/// `None` when no sandbox has stopped.
pub(super) fn prune_oldest(conn: &mut Connection) -> rusqlite::Result<Option<(String, u64)>> {
    let tx = conn.transaction()?;
    let oldest: Option<(String, Option<String>, i64)> = tx
        .query_row(
            "SELECT id, trajectory_id, bytes FROM sandboxes WHERE stopped_at IS NOT NULL \
             ORDER BY stopped_at, id LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    let Some((id, trajectory_id, bytes)) = oldest else {
        return Ok(None);
    };
    tx.execute(
        "DELETE FROM steps WHERE trajectory = ?1",
        params![trajectory_id.as_deref().unwrap_or(&id)],
    )?;
    tx.execute("DELETE FROM sandboxes WHERE id = ?1", params![id])?;
    tx.commit()?;
    Ok(Some((id, sql_count(bytes))))
}
