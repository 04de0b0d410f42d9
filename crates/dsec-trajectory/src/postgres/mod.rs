//! The log in a PostgreSQL database (`--trajectory-db postgres://…`): one database for a
//! fleet, so that a sandbox's log outlives its edge and any apiserver can read it.
//!
//! Each server writes under its edge name, which it holds for as long as it writes (a
//! session advisory lock: a second server with the same name is refused, rather than
//! marking the first one's live sandboxes stopped). A writer task takes everything queued
//! and commits it at once — the batch's steps in one multi-row insert that also counts
//! their bytes, so that a batch of appends of live sandboxes is a single statement and one
//! round trip; any other batch is one transaction — so one commit serves many appends
//! (group commit). With [`SyncMode::Normal`] its session sets
//! `synchronous_commit = off`: a commit survives a crash of dsec (PostgreSQL holds it), not
//! a crash of PostgreSQL's host; [`SyncMode::Full`] waits for PostgreSQL's WAL flush.
//!
//! The budgets are the fleet's: each server counts what it adds in `dsec_usage` (one row
//! per edge, updated once per batch), reads the total twice a second, and prunes the
//! oldest stopped sandboxes of any edge (`FOR UPDATE SKIP LOCKED`, so that pruners do not
//! queue behind one another). Outputs are `bytea`: a command may print NUL bytes, which
//! PostgreSQL's `text` cannot hold.

mod read;
mod schema;
mod write;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::config::{Host, SslMode};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Config, NoTls, Statement};

use crate::budget::Usage;
use crate::error::LogError;
use crate::job::{CommitCounter, Job, LogStats};
use crate::model::{SandboxLog, Step};
use crate::{LogConfig, SyncMode};

/// Most writes committed in one transaction.
const MAX_BATCH: usize = 512;
/// Read connections, each shared by concurrent reads (tokio-postgres pipelines them).
const READERS: usize = 4;
/// Interval between maintenance rounds: the fleet's total, and pruning when it is due.
const MAINTAIN_EVERY: Duration = Duration::from_millis(500);
/// How long a connection attempt may take unless the URL says otherwise.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long opening waits for the edge name to be free (a server with this name that is
/// shutting down still holds it).
const EDGE_LOCK_WAIT: Duration = Duration::from_secs(5);

/// The database as messages name it: the URL without its password.
fn describe_config(config: &Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .zip(config.get_ports().iter().chain(std::iter::repeat(&5432)))
        .map(|(host, port)| match host {
            Host::Tcp(h) => format!("{h}:{port}"),
            Host::Unix(p) => format!("{}:{port}", p.display()),
        })
        .collect();
    format!(
        "postgres://{}@{}/{}",
        config.get_user().unwrap_or(""),
        hosts.join(","),
        config.get_dbname().unwrap_or("")
    )
}

/// PostgreSQL's own words for `e`: the server's message (and detail) when it sent one,
/// else the client's error and its causes.
pub(crate) fn pg_detail(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut s = format!("{}: {}", db.severity(), db.message());
        if let Some(detail) = db.detail() {
            s += &format!(" ({detail})");
        }
        return s;
    }
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s += &format!(": {cause}");
        source = cause.source();
    }
    s
}

fn pg_err<'a>(
    db: &'a str,
    what: &'static str,
) -> impl FnOnce(tokio_postgres::Error) -> LogError + 'a {
    move |e| LogError::Postgres {
        db: db.to_owned(),
        what,
        detail: pg_detail(&e),
    }
}

/// Why a connection failed, in terms a user can act on.
fn connect_error(db: &str, config: &Config, e: &tokio_postgres::Error) -> LogError {
    let user = config.get_user().unwrap_or("");
    let dbname = config.get_dbname().unwrap_or(user);
    let reason = match e.code() {
        Some(c) if *c == SqlState::INVALID_PASSWORD => format!(
            "PostgreSQL refused the password of user {user:?}: check the user and password in --trajectory-db"
        ),
        Some(c) if *c == SqlState::INVALID_AUTHORIZATION_SPECIFICATION => format!(
            "PostgreSQL refused user {user:?} ({}): check the user in --trajectory-db and the server's pg_hba.conf",
            pg_detail(e)
        ),
        Some(c) if *c == SqlState::INVALID_CATALOG_NAME => format!(
            "database {dbname:?} does not exist: create it (createdb {dbname}) or name another in --trajectory-db"
        ),
        Some(_) => format!("PostgreSQL refused the connection: {}", pg_detail(e)),
        None => format!(
            "cannot reach PostgreSQL ({}): is it running there, and is the address in --trajectory-db right?",
            pg_detail(e)
        ),
    };
    LogError::Connect {
        db: db.to_owned(),
        reason,
    }
}

/// A connection, its task driving the socket running on tokio.
async fn connect(config: &Config, db: &str) -> Result<Client, LogError> {
    let (client, connection) = config
        .connect(NoTls)
        .await
        .map_err(|e| connect_error(db, config, &e))?;
    let db = db.to_owned();
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(db = %db, error = %pg_detail(&e), "trajectory log: PostgreSQL connection lost");
        }
    });
    Ok(client)
}

/// A read connection and its prepared lookup.
pub(crate) struct Reader {
    client: Client,
    step: Statement,
}

/// The PostgreSQL store.
pub(crate) struct Store {
    db: String,
    config: Config,
    edge: String,
    sync: SyncMode,
    /// `None` once closed.
    jobs: Mutex<Option<mpsc::UnboundedSender<Job>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    readers: Vec<tokio::sync::Mutex<Option<Arc<Reader>>>>,
    next_reader: AtomicUsize,
    pub(crate) usage: Usage,
    pub(super) commits: CommitCounter,
}

impl Store {
    /// Connects to the database at `url`, creating or checking its schema, and starts the
    /// writer and maintenance tasks. Sandboxes of `edge` it holds as running are from an
    /// earlier run of that edge: they are marked stopped.
    pub(crate) async fn connect(
        url: &str,
        edge: &str,
        config: LogConfig,
    ) -> Result<Arc<Store>, LogError> {
        let (pg, db) = parse_url(url, &format!("dsec-edge-{edge}"))?;
        let mut session = write::Session::connect(&pg, &db, edge, config.sync).await?;
        schema::migrate(&mut session.client, &db).await?;
        session.lock_edge(&db, edge, EDGE_LOCK_WAIT).await?;
        schema::stop_earlier_sandboxes(&mut session.client, &db, edge).await?;
        let stored = schema::stored_bytes(&session.client, &db).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let store = Arc::new(Store::new(pg, db, edge, config, Some(tx), stored));
        // A reader now, so that a database that refuses reads fails here, not later.
        store.reader().await?;
        let writer = tokio::spawn(group_commit(Arc::downgrade(&store), rx, session));
        *store.writer.lock().expect("lock") = Some(writer);
        tokio::spawn(maintain(Arc::downgrade(&store)));
        Ok(store)
    }

    /// Connects to the database at `url` to read it only (an apiserver serving the logs
    /// of sandboxes whose edge is gone): no edge name is taken, nothing is written or
    /// pruned, and writes fail with [`LogError::WriterGone`].
    pub(crate) async fn connect_reader(url: &str) -> Result<Arc<Store>, LogError> {
        let (pg, db) = parse_url(url, "dsec-apiserver")?;
        let store = Arc::new(Store::new(pg, db, "", LogConfig::default(), None, 0));
        store.reader().await?;
        Ok(store)
    }

    fn new(
        config: Config,
        db: String,
        edge: &str,
        log: LogConfig,
        jobs: Option<mpsc::UnboundedSender<Job>>,
        stored: u64,
    ) -> Store {
        Store {
            db,
            config,
            edge: edge.to_owned(),
            sync: log.sync,
            jobs: Mutex::new(jobs),
            writer: Mutex::new(None),
            readers: (0..READERS)
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            next_reader: AtomicUsize::new(0),
            usage: Usage::new(log.budgets, stored),
            commits: CommitCounter::default(),
        }
    }
}

/// The connection settings of `url` (connect timeout set when it sets none), and the
/// database as messages name it.
fn parse_url(url: &str, application: &str) -> Result<(Config, String), LogError> {
    let mut pg: Config = url
        .parse()
        .map_err(|e: tokio_postgres::Error| LogError::Config {
            db: redact(url),
            reason: format!(
                "not a PostgreSQL URL ({}): postgres://USER:PASSWORD@HOST:PORT/DATABASE",
                pg_detail(&e)
            ),
        })?;
    let db = describe_config(&pg);
    if pg.get_ssl_mode() == SslMode::Require {
        return Err(LogError::Config {
            db,
            reason: "TLS to PostgreSQL (sslmode=require) is not supported: connect over a private network or a local TLS proxy, with sslmode=disable or prefer".into(),
        });
    }
    if pg.get_connect_timeout().is_none() {
        pg.connect_timeout(CONNECT_TIMEOUT);
    }
    pg.application_name(application);
    Ok((pg, db))
}

impl Store {
    /// Queues `job` for the writer task.
    pub(crate) fn send(&self, job: Job) {
        let jobs = self.jobs.lock().expect("lock");
        match jobs.as_ref() {
            // A send fails only when the writer is gone; the job's caller then hears so.
            Some(jobs) => drop(jobs.send(job)),
            None => job.answer(Err(LogError::WriterGone)),
        }
    }

    /// Commits what is queued, stops the writer and releases the edge name.
    pub(crate) async fn close(&self) {
        drop(self.jobs.lock().expect("lock").take());
        let writer = self.writer.lock().expect("lock").take();
        if let Some(writer) = writer {
            let _ = writer.await;
        }
    }

    pub(crate) fn stats(&self) -> LogStats {
        self.commits.stats()
    }

    /// A read connection, (re)connected when it has none or lost it.
    async fn reader(&self) -> Result<Arc<Reader>, LogError> {
        let slot = &self.readers[self.next_reader.fetch_add(1, Ordering::Relaxed) % READERS];
        let mut slot = slot.lock().await;
        if let Some(r) = slot.as_ref().filter(|r| !r.client.is_closed()) {
            return Ok(Arc::clone(r));
        }
        let client = connect(&self.config, &self.db).await?;
        let step = client
            .prepare(&read::step_query())
            .await
            .map_err(pg_err(&self.db, "preparing a read"))?;
        let reader = Arc::new(Reader { client, step });
        *slot = Some(Arc::clone(&reader));
        Ok(reader)
    }

    pub(crate) async fn step(
        &self,
        trajectory: String,
        step: i64,
    ) -> Result<Option<Step>, LogError> {
        let reader = self.reader().await?;
        read::step(&reader, &self.db, &trajectory, step).await
    }

    pub(crate) async fn sandbox_log(
        &self,
        id: String,
        trajectory_id: Option<String>,
    ) -> Result<Option<SandboxLog>, LogError> {
        let reader = self.reader().await?;
        read::sandbox_log(&reader.client, &self.db, &id, trajectory_id.as_deref()).await
    }
}

/// `url` for a message when it does not even parse: no password shown.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://…{}", &url[..scheme], &url[at..]),
        _ => url.to_owned(),
    }
}

/// The writer task: everything queued in one transaction, then the answers; it ends when
/// the store closes (or goes), after what was queued.
async fn group_commit(
    store: Weak<Store>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    session: write::Session,
) {
    let mut session = Some(session);
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while jobs.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let batch = std::mem::take(&mut batch);
        let Some(store) = store.upgrade() else {
            for job in batch {
                job.answer(Err(LogError::WriterGone));
            }
            return;
        };
        if session.as_ref().is_none_or(|s| s.client.is_closed()) {
            session = match reconnect(&store).await {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::error!(db = %store.db, error = %e, "trajectory log: cannot write");
                    for job in batch {
                        job.answer(Err(LogError::Commit {
                            db: store.db.clone(),
                            message: e.to_string(),
                        }));
                    }
                    continue;
                }
            };
        }
        let Some(s) = session.as_mut() else {
            continue;
        };
        write::write_batch(s, &store, batch).await;
    }
}

/// A new write session after the old one was lost (PostgreSQL restarted, the network
/// dropped): the edge name is taken again first.
async fn reconnect(store: &Store) -> Result<write::Session, LogError> {
    let mut session =
        write::Session::connect(&store.config, &store.db, &store.edge, store.sync).await?;
    session
        .lock_edge(&store.db, &store.edge, EDGE_LOCK_WAIT)
        .await?;
    tracing::info!(db = %store.db, "trajectory log: reconnected to PostgreSQL");
    Ok(session)
}

/// Reads the fleet's total twice a second and prunes when it is over the budget, while
/// the store is open.
async fn maintain(store: Weak<Store>) {
    let mut client: Option<Client> = None;
    let mut tick = tokio::time::interval(MAINTAIN_EVERY);
    loop {
        tick.tick().await;
        let Some(store) = store.upgrade() else {
            return;
        };
        if store.jobs.lock().expect("lock").is_none() {
            return;
        }
        if client.as_ref().is_none_or(Client::is_closed) {
            client = connect(&store.config, &store.db).await.ok();
        }
        let Some(c) = client.as_mut() else {
            continue;
        };
        store.usage.refreshing();
        match schema::stored_bytes(c, &store.db).await {
            Ok(total) => store.usage.refresh(total),
            Err(e) => {
                tracing::warn!(error = %e, "trajectory log: reading the fleet's total failed");
                continue;
            }
        }
        if store.usage.prune_due() {
            write::prune(c, &store).await;
        }
    }
}
