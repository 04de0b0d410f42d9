"""What every part of the benchmark shares: logging, the clean-up registry, statistics, the
busybox rootfs, and :class:`Dsec`, the server under test with its test image."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dsec
import dsec_local
from dsec_local import percentile

REPO = dsec_local.REPO
BENCH_DIR = REPO / "bench"
OUT_DIR = BENCH_DIR / "out"
TAG = f"dsec-bench-{os.getpid()}"

# Targets from the issues.
TARGET_CREATE_P50_MS = 5.0
TARGET_CREATE_VS_FLOOR = 3.0
TARGET_CREATIONS_PER_S = 300.0
TARGET_EXEC_P50_MS = 2.0
TARGET_IDLE_MIB = 2.0
TARGET_FORK8_S = 0.3
TARGET_LOG_OVERHEAD_PCT = 5.0
TARGET_REPLAY_1000_S = 0.2
TARGET_FNCALL_P50_MS = 3.0
TARGET_FNCALLS_PER_S = 500.0
TARGET_VM_RESTORE_MS = 1000.0  # microvm/vm: create (snapshot restore) -> first exec, TCG
TARGET_VM_EXEC_MS = 5.0  # microvm/vm: exec round trip
TARGET_VM_FORK_MS = 2000.0  # microvm/vm: fork(8) of a running guest -> every child answers


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_cmd(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)


def latency_stats(ms: list[float], failed: int = 0) -> dict[str, Any]:
    return {
        "n": len(ms),
        "failed": failed,
        "p50_ms": percentile(ms, 0.50),
        "p99_ms": percentile(ms, 0.99),
        "mean_ms": sum(ms) / len(ms) if ms else float("nan"),
    }


# --------------------------------------------------------------------------------------
# cleanup registry: runs in reverse order at exit, also after Ctrl-C / SIGTERM
# --------------------------------------------------------------------------------------


class Cleanup:
    def __init__(self) -> None:
        self._items: list[tuple[str, Callable[[], None]]] = []
        self._lock = threading.Lock()

    def push(self, what: str, fn: Callable[[], None]) -> None:
        with self._lock:
            self._items.append((what, fn))

    def run(self) -> None:
        # A second Ctrl-C during clean-up would leave things behind: ignore it.
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            while True:
                with self._lock:
                    if not self._items:
                        break
                    what, fn = self._items.pop()
                try:
                    fn()
                except Exception as e:  # clean-up is best effort
                    log(f"cleanup of {what} failed: {e}")
        finally:
            signal.signal(signal.SIGINT, old)


CLEANUP = Cleanup()


def make_tempdir(what: str, registry: Cleanup | None = None) -> Path:
    """A temporary directory, removed (never through a mount) by the clean-up."""
    d = dsec_local.make_tempdir(f"{TAG}-{what}-")
    (registry or CLEANUP).push(f"temp dir {d}", lambda: dsec_local.safe_rmtree(d))
    return d


def prepare_rootfs(arg: str | None) -> Path:
    """The busybox rootfs every part uses: ``--rootfs``, else one built here."""
    if arg:
        p = Path(arg).resolve()
        if not os.path.lexists(p / "bin" / "true"):
            sys.exit(f"--rootfs {p}: no bin/true in it")
        return p
    d = make_tempdir("rootfs") / "rootfs"
    log(f"building the busybox rootfs with {dsec_local.MAKE_BUSYBOX_ROOTFS.relative_to(REPO)}")
    try:
        return dsec_local.make_busybox_rootfs(d)
    except RuntimeError as e:
        sys.exit(str(e))


def docker_available() -> bool:
    return dsec_local.docker_unavailable_reason() is None


def docker_import(rootfs: Path, image: str) -> None:
    """Makes a Docker image of the rootfs (no registry is reachable here)."""
    log(f"docker import {rootfs} -> {image}")
    dsec_local.docker_import_rootfs(rootfs, image)


# --------------------------------------------------------------------------------------
# the dsec server under test
# --------------------------------------------------------------------------------------


class Dsec:
    """The server under test (started here unless $DSEC_URL is set) and the test image.

    With server_args (extra `dsec serve` options) a server is always started here, even if
    $DSEC_URL is set. close() stops its sandboxes and the server it started and removes its
    state directory before the end of the run (else that happens at the end)."""

    def __init__(
        self,
        args: argparse.Namespace,
        rootfs: Path,
        server_args: list[str] | None = None,
        name: str = "state",
    ) -> None:
        self.args = args
        self.rootfs = rootfs
        self.name = name
        self.server_args = list(server_args or [])
        self.server: dsec_local.Server | None = None
        self.cleanup = Cleanup()  # this server's own clean-up: by close(), else at the end
        CLEANUP.push(f"dsec ({name})", self.cleanup.run)
        env_url = None if self.server_args else os.environ.get("DSEC_URL")
        self.url = env_url or self._start_server()
        self.image = f"{TAG}-busybox"
        self.labels = {"dsec-bench": TAG}  # finds sandboxes whose create was interrupted
        self.live: set[str] = set()  # sandboxes created and not yet stopped
        self.live_lock = threading.Lock()
        self.client = self._client()
        self.cleanup.push("dsec sandboxes", self._stop_leftovers)
        log(f"dsec: importing {rootfs} as image {self.image}")
        self.client.import_image(str(rootfs), name=self.image)
        self.cleanup.push("dsec image", self._delete_image)

    @property
    def state(self) -> Path | None:
        """The state directory of a server started here."""
        return self.server.state_dir if self.server is not None else None

    @property
    def debug_build(self) -> bool:
        return self.server is not None and "debug" in str(self.server.binary)

    def close(self) -> None:
        self.cleanup.run()

    def _client(self) -> dsec.Client:
        return dsec.Client(url=self.url, token=os.environ.get("DSEC_TOKEN"))

    def async_client(self) -> dsec.AsyncClient:
        return dsec.AsyncClient(url=self.url, token=os.environ.get("DSEC_TOKEN"))

    def _start_server(self) -> str:
        exe = Path(self.args.dsec_bin) if self.args.dsec_bin else dsec_local.RELEASE_BIN
        if not exe.exists():
            debug = REPO / "target" / "debug" / "dsec"
            if self.args.dsec_bin or not debug.exists():
                sys.exit(f"{exe} not found: cargo build --release (or set DSEC_URL / --dsec-bin)")
            log("WARNING: no target/release/dsec, using the DEBUG build: not representative")
            exe = debug
        state = make_tempdir(self.name, self.cleanup)
        log_path = state.parent / f"{state.name}.log"
        self.cleanup.push("server log", lambda: log_path.unlink(missing_ok=True))
        # Admission is not under test: the parts keep hundreds to a thousand busybox
        # sandboxes of the default 512 MiB open at once (a few MiB used each), past the
        # default budget of 4 × a small host's memory.
        # A part that needs more says so in its server_args.
        admission = [
            arg
            for flag, ratio in (("--memory-overcommit", "64"), ("--pids-overcommit", "64"))
            if flag not in self.server_args
            for arg in (flag, ratio)
        ]
        server = dsec_local.Server(
            state,
            log_path=log_path,
            binary=exe,
            extra_args=[
                "--trajectory-sync",
                self.args.trajectory_sync,
                *admission,
                *self.server_args,
            ],
        )
        opts = "".join(f" {a}" for a in server.extra_args)
        log(f"starting {exe} serve{opts} on {server.url}, state {state}")
        self.cleanup.push("dsec server", self._stop_server)
        self.server = server
        try:
            server.start(timeout=60)
        except dsec_local.ServerError as e:
            sys.exit(str(e))
        return server.url

    def _stop_server(self) -> None:
        assert self.server is not None
        if self.server.alive():
            try:
                self.server.stop(timeout=60)
            except AssertionError as e:
                log(f"{e}: killed it")
        # The QEMUs of VM sandboxes are the server's children; should any outlive it, they
        # are ours to end: their command lines name this server's state directory.
        for pid in self.server.kill_leftover_qemus():
            log(f"dsec ({self.name}): killed leftover process {pid}")

    def server_rss_kib(self) -> int | None:
        if self.server is None or not self.server.alive():
            return None
        return dsec_local.proc_status_kib(self.server.pid, "VmRSS")

    def track(self, sid: str) -> None:
        with self.live_lock:
            self.live.add(sid)

    def untrack(self, sid: str) -> None:
        with self.live_lock:
            self.live.discard(sid)

    def _stop_leftovers(self) -> None:
        with self.live_lock:
            todo = list(self.live)
        if todo:
            log(f"dsec: stopping {len(todo)} leftover sandboxes")
        client = self._client()
        for sid in todo:
            with contextlib.suppress(Exception):
                client.get(sid).stop()
            self.untrack(sid)
        with contextlib.suppress(Exception):
            for sb in client.list(labels=self.labels):
                with contextlib.suppress(Exception):
                    sb.stop()

    def _delete_image(self) -> None:
        with contextlib.suppress(Exception):
            self.client.delete_image(self.image)


def stop_sandbox(d: Dsec, sb: Any) -> None:
    """Stop a sandbox the bench tracks; one that fails to stop is stopped again at the end."""
    try:
        sb.stop()
        d.untrack(sb.id)
    except Exception as e:  # still tracked: stopped again at the end
        log(f"stopping {sb.id} failed: {type(e).__name__}: {e}")


def exec_round_trips(sb: Any, cmd: Any, n: int, warmup: int, label: str) -> dict[str, Any]:
    """Latency of `n` sequential `sb.run(cmd)` after `warmup` untimed ones, and the
    server-side `duration_ms` p50."""
    for _ in range(warmup):
        sb.run(cmd)
    log(f"{label}: {n} exec round trips")
    rtt: list[float] = []
    server: list[float] = []
    failed = 0
    for _ in range(n):
        t0 = time.perf_counter()
        r = sb.run(cmd)
        dt = (time.perf_counter() - t0) * 1e3
        if r.exit_code == 0:
            rtt.append(dt)
            server.append(float(r.duration_ms))
        else:
            failed += 1
    res = latency_stats(rtt, failed)
    res["server_p50_ms"] = percentile(server, 0.5)
    return res
