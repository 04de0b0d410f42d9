"""A PostgreSQL cluster of one's own, for tests and benchmarks of ``dsec serve
--trajectory-db postgres://…``: ``initdb`` in a temporary directory, ``postgres`` on a free
loopback port, databases made on demand, stopped (``pg_ctl stop``, by the pid in its
``postmaster.pid``) and removed by :meth:`PostgresCluster.stop`.

Run as root, the server runs as the ``postgres`` user (PostgreSQL refuses root); otherwise
as the caller. Debian's ``postgresql`` package provides the programs
(``scripts/setup.sh`` installs it); ``$DSEC_PG_BIN`` names another directory of them.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from dsec_local import free_port, wait_until

#: The superuser the cluster is made with, and its password.
USER = "dsec"
PASSWORD = "dsec-test-password"

__all__ = ["PASSWORD", "USER", "PostgresCluster", "pg_bin_dir"]


def pg_bin_dir() -> Path | None:
    """The newest PostgreSQL's programs (``$DSEC_PG_BIN``, else
    ``/usr/lib/postgresql/*/bin``); None when there is no ``initdb`` there."""
    env = os.environ.get("DSEC_PG_BIN")
    if env:
        return Path(env) if (Path(env) / "initdb").exists() else None
    found = []
    for d in Path("/usr/lib/postgresql").glob("*/bin"):
        if (d / "initdb").exists() and d.parent.name.isdigit():
            found.append((int(d.parent.name), d))
    return max(found)[1] if found else None


class PostgresCluster:
    """One ``postgres`` server this process started (and only ever signals by pid)."""

    def __init__(self, base: Path | None = None) -> None:
        """A cluster in a new directory under ``base`` (default: the system's temporary
        directory; run as root, the ``postgres`` user must be able to reach it)."""
        bin_dir = pg_bin_dir()
        if bin_dir is None:
            raise FileNotFoundError(
                "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): "
                "scripts/setup.sh installs it (apt-get install postgresql)"
            )
        self.bin = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="dsec-pg-", dir=base))
        self.data = self.dir / "data"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._user: str | None = None
        if os.geteuid() == 0:
            self._user = "postgres"
            pw = pwd.getpwnam(self._user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._databases = 0

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, user=self._user, capture_output=True, text=True, check=False, timeout=120
        )

    def start(self) -> PostgresCluster:
        """initdb, then the server; on any failure (or an interrupt) what was started and
        made is removed again."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> PostgresCluster:
        pwfile = self.dir / "pw"
        pwfile.write_text(PASSWORD)
        if self._user is not None:
            pw = pwd.getpwnam(self._user)
            os.chown(pwfile, pw.pw_uid, pw.pw_gid)
        r = self._run(
            str(self.bin / "initdb"),
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "-U",
            USER,
            f"--pwfile={pwfile}",
            "-D",
            str(self.data),
        )
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed: {r.stderr}")
        log = open(self.dir / "server.log", "ab")  # the child keeps it
        self.proc = subprocess.Popen(
            [
                str(self.bin / "postgres"),
                "-D",
                str(self.data),
                "-p",
                str(self.port),
                "-k",
                str(self.dir),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=300",
            ],
            user=self._user,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        if not wait_until(self._ready, 60):
            raise RuntimeError("PostgreSQL did not start:\n" + self.log_tail())
        return self

    def _ready(self) -> bool:
        isready = str(self.bin / "pg_isready")
        return self._run(isready, "-h", "127.0.0.1", "-p", str(self.port)).returncode == 0

    def url(self, db: str, password: str = PASSWORD) -> str:
        return f"postgres://{USER}:{password}@127.0.0.1:{self.port}/{db}"

    def database(self, prefix: str = "log") -> str:
        """A new, empty database; its URL."""
        self._databases += 1
        name = f"{prefix}{self._databases}"
        r = subprocess.run(
            [str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, name],
            env=dict(os.environ, PGPASSWORD=PASSWORD),
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        if r.returncode != 0:
            raise RuntimeError(f"createdb {name} failed: {r.stderr}")
        return self.url(name)

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = (self.dir / "server.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        """Fast shutdown of this cluster's server, then its directory is removed."""
        if self.proc is not None and self.proc.poll() is None:
            self._run(str(self.bin / "pg_ctl"), "stop", "-m", "fast", "-w", "-D", str(self.data))
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
