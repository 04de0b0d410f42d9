"""A dsec fleet on this host: a real etcd, ``dsec edge`` and ``dsec apiserver`` processes.

Used by the fleet tests (``tests/test_fleet.py``) and benchmarks (``bench/``). etcd runs with
a temporary data directory on loopback ports; every process here is started in a session
of its own and only ever signalled by its pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from dsec_local import Server, ServerError, free_port, wait_until

__all__ = [
    "ETCD_BIN",
    "REGISTRY_BIN",
    "Apiserver",
    "Edge",
    "Etcd",
    "OciRegistry",
    "edge_of",
    "etcd_unavailable_reason",
    "start_edges",
]

#: The etcd server binary: $DSEC_ETCD_BIN, else `etcd` on PATH (Debian's etcd-server).
ETCD_BIN = os.environ.get("DSEC_ETCD_BIN") or shutil.which("etcd") or "etcd"
#: The OCI registry binary (Debian's docker-registry, the CNCF distribution registry).
REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"


def edge_of(sandbox_id: str) -> str:
    """The edge a sandbox id names: ids are ``<edge>-<12 hex digits>``."""
    return sandbox_id.rsplit("-", 1)[0]


def etcd_unavailable_reason() -> str | None:
    """Why no etcd can be started here (None: it can)."""
    if shutil.which(ETCD_BIN) is None and not Path(ETCD_BIN).exists():
        return f"no etcd binary ({ETCD_BIN!r}; Debian's etcd-server, see scripts/setup.sh)"
    return None


class _Service:
    """A helper process of the fleet (etcd, a registry): started in a session of its own,
    logging to ``log_path``, healthy once ``health_url`` answers 2xx, stopped by its pid."""

    what = "service"

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self, argv: Sequence[str], health_url: str, timeout: float) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = self.proc

        def healthy() -> bool:
            if proc.poll() is not None:
                raise ServerError(f"{self.what} exited with {proc.returncode}; see {self.log_path}")
            try:
                return httpx.get(health_url, timeout=1, trust_env=False).is_success
            except httpx.TransportError:
                return False

        if not wait_until(healthy, timeout):
            self.stop()
            raise ServerError(f"{self.what} not healthy after {timeout}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class Etcd(_Service):
    """One etcd member on loopback ports with its own data directory."""

    what = "etcd"

    def __init__(self, data_dir: Path, *, log_path: Path) -> None:
        super().__init__(log_path)
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30.0) -> Etcd:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            ETCD_BIN,
            "--name", "dsec-test",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"dsec-test={peer}",
        ]  # fmt: skip
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._spawn(argv, self.url + "/health", timeout)
        return self


class OciRegistry(_Service):
    """One OCI registry (docker-registry) on a loopback port, storing in ``data_dir``."""

    what = "the registry"

    def __init__(self, data_dir: Path, *, log_path: Path) -> None:
        super().__init__(log_path)
        self.data_dir = data_dir
        self.port = free_port()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> OciRegistry:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {self.data_dir / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n"
        )
        self._spawn([REGISTRY_BIN, "serve", str(config)], f"http://{self.host}/v2/", timeout)
        return self


class Edge(Server):
    """A ``dsec edge`` registered in ``etcd`` under ``name``."""

    def __init__(
        self,
        state_dir: Path,
        *,
        etcd: str,
        name: str,
        lease_ttl: int = 3,
        extra_args: Sequence[str] = (),
        **kw: Any,
    ) -> None:
        super().__init__(state_dir, extra_args=extra_args, **kw)
        self.etcd = etcd
        self.name = name
        self.lease_ttl = lease_ttl

    def argv(self) -> list[str]:
        argv = [str(self.binary), "edge", "--etcd", self.etcd, "--name", self.name]
        argv += ["--lease-ttl", str(self.lease_ttl)]
        argv += ["--listen", f"{self.host}:{self.port}", "--state-dir", str(self.state_dir)]
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        return argv + self.extra_args


class Apiserver(Server):
    """A ``dsec apiserver`` watching ``etcd``; it keeps no state (``state_dir`` stays empty)."""

    def __init__(self, state_dir: Path, *, etcd: str, **kw: Any) -> None:
        super().__init__(state_dir, **kw)
        self.etcd = etcd

    def argv(self) -> list[str]:
        argv = [str(self.binary), "apiserver", "--etcd", self.etcd]
        argv += ["--listen", f"{self.host}:{self.port}"]
        if self.token_file is not None:
            argv += ["--token-file", str(self.token_file)]
        return argv + self.extra_args

    def cleanup(self) -> None:
        """Stop it; a killed apiserver left nothing behind to clean."""
        self.dirty = False
        super().cleanup()

    def edges(self) -> list[dict[str, Any]]:
        token = self.token_file.read_text().strip() if self.token_file else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        r = httpx.get(self.url + "/v1/fleet/edges", timeout=5, trust_env=False, headers=headers)
        r.raise_for_status()
        edges: list[dict[str, Any]] = r.json()
        return edges

    def wait_for_edges(self, names: Sequence[str], timeout: float = 30.0) -> None:
        """Until exactly ``names`` are live and ready in this apiserver's table."""

        def seen() -> bool:
            live = sorted(e["name"] for e in self.edges() if e["ready"])
            return live == sorted(names)

        if not wait_until(seen, timeout):
            raise AssertionError(f"apiserver sees {self.edges()}, not {sorted(names)}")


def start_edges(
    tmp: Path,
    etcd: str,
    names: Sequence[str],
    started: list[Any],
    *,
    args_of: Callable[[str], Sequence[str]] = lambda name: (),
    **kw: Any,
) -> dict[str, Edge]:
    """Start an edge per name on ``etcd``, its state directory and log under ``tmp``, its
    extra arguments ``args_of(name)``; each is appended to ``started`` before it starts, so
    that the caller stops it even if a later one fails to start."""
    edges = {}
    for name in names:
        e = Edge(
            tmp / name,
            etcd=etcd,
            name=name,
            extra_args=args_of(name),
            log_path=tmp / f"{name}.log",
            **kw,
        )
        started.append(e)
        e.start()
        edges[name] = e
    return edges
