//! A PostgreSQL cluster of the tests' own: `initdb` in a temporary directory, `postgres`
//! on a free loopback port, stopped (by its pid, through `pg_ctl`) and removed when the
//! cluster is dropped. Run as root, the server runs as the `postgres` user (PostgreSQL
//! refuses root); otherwise as the tests' user.

use std::net::TcpListener;
use std::os::unix::fs::chown;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The password of the cluster's superuser `dsec`.
pub const PASSWORD: &str = "dsec-test-password";

/// A running cluster.
pub struct Cluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    owner: Option<nix::unistd::User>,
    server: Child,
    pub port: u16,
}

/// The newest PostgreSQL's programs: `$DSEC_PG_BIN`, else `/usr/lib/postgresql/*/bin`.
fn pg_bin() -> PathBuf {
    if let Some(dir) = std::env::var_os("DSEC_PG_BIN") {
        return dir.into();
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, bin)| bin).unwrap_or_else(|| {
        panic!(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): \
             scripts/setup.sh installs it (apt-get install postgresql), or set DSEC_PG_BIN"
        )
    })
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Cluster {
    /// Starts a cluster; panics with what is missing when PostgreSQL is not installed.
    pub async fn start() -> Cluster {
        let bin = pg_bin();
        let owner = nix::unistd::geteuid().is_root().then(|| {
            nix::unistd::User::from_name("postgres")
                .unwrap()
                .expect("running as root, PostgreSQL needs its `postgres` user")
        });
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let pwfile = dir.path().join("pw");
        std::fs::write(&pwfile, PASSWORD).unwrap();
        if let Some(u) = &owner {
            for p in [dir.path(), &pwfile] {
                chown(p, Some(u.uid.as_raw()), Some(u.gid.as_raw())).unwrap();
            }
        }
        let out = as_owner(&owner, Command::new(bin.join("initdb")))
            .args([
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "-U",
                "dsec",
            ])
            .arg(format!("--pwfile={}", pwfile.display()))
            .arg("-D")
            .arg(&data)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port();
        let server = as_owner(&owner, Command::new(bin.join("postgres")))
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-k"])
            .arg(dir.path())
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .args(["-c", "max_connections=300"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("server.log")).unwrap())
            .spawn()
            .unwrap();
        let cluster = Cluster {
            dir,
            bin,
            owner,
            server,
            port,
        };
        cluster.wait_ready().await;
        cluster
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let url = self.url("postgres");
            match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                Ok(_) => return,
                Err(e) if Instant::now() > deadline => {
                    panic!("PostgreSQL did not start: {e}\n{}", self.log())
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// The server's log, for a failure message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// The URL of database `db` as the superuser.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://dsec:{PASSWORD}@127.0.0.1:{}/{db}", self.port)
    }

    /// A new, empty database; its URL.
    pub async fn database(&self, name: &str) -> String {
        let (client, conn) = tokio_postgres::connect(&self.url("postgres"), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        client
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .await
            .unwrap();
        self.url(name)
    }
}

fn as_owner(owner: &Option<nix::unistd::User>, mut cmd: Command) -> Command {
    if let Some(u) = owner {
        cmd.uid(u.uid.as_raw()).gid(u.gid.as_raw());
    }
    cmd
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // A fast shutdown of our server, by the pid in its postmaster.pid, waited for.
        let stopped = as_owner(&self.owner, Command::new(self.bin.join("pg_ctl")))
            .args(["stop", "-m", "fast", "-w", "-D"])
            .arg(self.dir.path().join("data"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !stopped {
            let _ = self.server.kill();
        }
        let _ = self.server.wait();
    }
}
