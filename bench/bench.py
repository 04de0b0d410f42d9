#!/usr/bin/env python3
"""dsec benchmarks, side by side with runc, Docker and the raw kernel floor.

One run measures, on the same busybox root filesystem:

  create  dsec: create -> first exec of /bin/true -> stop, through the Python SDK;
          sequential p50/p99, and creations/s with 16 and 32 concurrent clients
          (AsyncClient)
  runc    `runc run` of the same rootfs running /bin/true: sequential p50/p99, and
          containers/s at the same concurrencies
  docker  `docker run --rm --network none IMAGE /bin/true` (the rootfs `docker import`ed),
          if a Docker daemon answers; else "docker: no daemon"
  dsec-docker  dsec's `backend="docker"` (the same rootfs `docker import`ed): create ->
          first exec -> stop, and exec round trips, beside the native numbers above;
          if a Docker daemon answers
  floor   bench/floor.c: clone(new ns) + private / + overlay + pivot_root + exec /bin/true,
          the cheapest container this kernel can make
  exec    round trip of `/bin/true` in one running dsec sandbox over HTTP (sync Client)
  idle    host memory per idle dsec sandbox: MemAvailable before and after creating 500
  vm      the microvm and vm backends (QEMU guests) beside the container backend, in the
          same run: create (boot-template restore) -> first exec, sequential; the same on
          a second server with `--vm-boot cold`; the template's build (cold boot + savevm);
          exec round trips of `true`; host memory per idle VM (MemAvailable drop, and the
          QEMUs' RSS); the accelerator (kvm or tcg)

Usage (as root, from the repository root):

  python3 bench/bench.py                       # everything
  python3 bench/bench.py --only floor,runc     # some parts
  python3 bench/bench.py --n 100 --idle-n 200  # smaller
  python3 bench/bench.py --only vm             # VM backends (after scripts/build-agent.sh)

dsec: uses $DSEC_URL if set (that server must see the same filesystem); otherwise starts
`target/release/dsec serve` (or --dsec-bin) on a temporary state directory and stops it at
the end. The vm part also starts a second server, with `--vm-boot cold`, and stops it when
it is done. The results are printed as markdown on stdout (progress goes to stderr); nothing
is written anywhere else. Copy the table into bench/RESULTS.md by hand.

Everything the run creates (sandboxes, the imported image, runc containers under a private
runc --root, docker containers and image, temporary directories, the servers it started and
their QEMUs) is removed at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "bench"
OUT_DIR = BENCH_DIR / "out"
PARTS = [
    "create",
    "loadgen",
    "fncall",
    "fork",
    "runc",
    "docker",
    "dsec-docker",
    "floor",
    "exec",
    "trajectory",
    "idle",
    "vm",
]
TAG = f"dsec-bench-{os.getpid()}"

# Targets from the issue.
TARGET_CREATE_P50_MS = 10.0
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


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


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


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_cmd(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, **kw)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below path, deepest first."""
    prefix = str(path.resolve())
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == prefix or mp.startswith(prefix + "/"):
                found.append(mp)
    return sorted(found, key=len, reverse=True)


def pids_with_cmdline(needle: str) -> list[int]:
    """Processes whose command line contains needle (this process excepted)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(entry.name))
    return found


def proc_status_kib(pid: int, field: str) -> int | None:
    """A `kB` field of /proc/<pid>/status (VmRSS, RssAnon, ...)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def remove_tree(path: Path) -> None:
    if not path.exists():
        return
    for mp in mounts_under(path):
        run_cmd(["umount", "-l", mp])
    if mounts_under(path):
        log(f"leaving {path}: mounts remain under it")
        return
    shutil.rmtree(path, ignore_errors=True)


def make_tempdir(what: str, registry: Cleanup | None = None) -> Path:
    d = Path(tempfile.mkdtemp(prefix=f"{TAG}-{what}-"))
    (registry or CLEANUP).push(f"temp dir {d}", lambda: remove_tree(d))
    return d


# --------------------------------------------------------------------------------------
# the rootfs
# --------------------------------------------------------------------------------------


def prepare_rootfs(arg: str | None) -> Path:
    if arg:
        p = Path(arg).resolve()
        if not (p / "bin" / "true").exists() and not (p / "bin" / "true").is_symlink():
            sys.exit(f"--rootfs {p}: no bin/true in it")
        return p
    d = make_tempdir("rootfs") / "rootfs"
    script = REPO / "scripts" / "make-busybox-rootfs.sh"
    if script.exists():
        log(f"building the busybox rootfs with {script.relative_to(REPO)}")
        r = run_cmd(["bash", str(script), str(d)])
        if r.returncode == 0 and (
            (d / "bin" / "true").exists() or (d / "bin" / "true").is_symlink()
        ):
            return d
        log(f"{script.name} failed ({r.returncode}): {r.stderr.strip()[-300:]}; building it here")
        remove_tree(d)
    busybox = shutil.which("busybox") or "/bin/busybox"
    if not os.path.exists(busybox):
        sys.exit("busybox not found: apt-get install busybox-static (or run scripts/setup.sh)")
    log("building the busybox rootfs (busybox --install -s)")
    for sub in [
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "proc",
        "sys",
        "dev",
        "tmp",
        "etc",
        "root",
    ]:
        (d / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, d / "bin" / "busybox")
    r = run_cmd(["chroot", str(d), "/bin/busybox", "--install", "-s"])
    if r.returncode != 0:
        sys.exit(f"busybox --install failed: {r.stderr}")
    (d / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (d / "etc" / "group").write_text("root:x:0:\n")
    return d


# --------------------------------------------------------------------------------------
# floor
# --------------------------------------------------------------------------------------


def build_floor() -> Path:
    src = BENCH_DIR / "floor.c"
    exe = OUT_DIR / "floor"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        log("gcc -O2 bench/floor.c -> bench/out/floor")
        r = run_cmd(["gcc", "-O2", "-Wall", "-Wextra", "-o", str(exe), str(src)])
        if r.returncode != 0:
            raise RuntimeError(f"gcc failed:\n{r.stderr}")
    return exe


def bench_floor(rootfs: Path, n: int, concurrencies: list[int]) -> dict[str, Any]:
    exe = build_floor()
    scratch = make_tempdir("floor")
    res: dict[str, Any] = {}

    def go(p: int, count: int) -> dict[str, Any]:
        r = run_cmd(
            [
                str(exe),
                "-r",
                str(rootfs),
                "-n",
                str(count),
                "-p",
                str(p),
                "-d",
                str(scratch),
            ]
        )
        if not r.stdout.strip():
            raise RuntimeError(f"floor failed ({r.returncode}): {r.stderr.strip()}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        if out["failed"]:
            log(f"floor: {out['failed']} of {count} failed: {r.stderr.strip()[:300]}")
        return out

    log(f"floor: {n} sequential")
    seq = go(1, n)
    res["seq"] = {
        "n": seq["n"],
        "failed": seq["failed"],
        "p50_ms": seq["p50_ms"],
        "p99_ms": seq["p99_ms"],
        "mean_ms": seq["mean_ms"],
    }
    for c in concurrencies:
        count = max(n, 8 * c)
        log(f"floor: {count} at concurrency {c}")
        out = go(c, count)
        res[f"c{c}"] = {
            "per_s": out["per_s"],
            "n": out["n"],
            "failed": out["failed"],
            "p50_ms": out["p50_ms"],
        }
    return res


# --------------------------------------------------------------------------------------
# runc and docker: both "run /bin/true in a fresh container" command lines
# --------------------------------------------------------------------------------------


def timed_runs(
    make_cmd: Callable[[int], list[str]], n: int, concurrency: int, label: str
) -> tuple[list[float], int, float]:
    """Run make_cmd(i) for i in range(n), `concurrency` at a time.

    Returns (latencies in ms of the successful runs, failures, wall seconds)."""
    lat: list[float] = []
    failed = 0
    first_err: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        nonlocal failed
        t0 = time.perf_counter()
        r = subprocess.run(
            make_cmd(i),
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        dt = (time.perf_counter() - t0) * 1e3
        with lock:
            if r.returncode == 0:
                lat.append(dt)
            else:
                failed += 1
                if not first_err:
                    first_err.append(r.stderr.strip()[:400])

    t0 = time.perf_counter()
    if concurrency <= 1:
        for i in range(n):
            one(i)
    else:
        ex = concurrent.futures.ThreadPoolExecutor(concurrency)
        try:
            for f in [ex.submit(one, i) for i in range(n)]:
                f.result()
        finally:
            # On Ctrl-C, drop what has not started instead of running it all.
            ex.shutdown(wait=True, cancel_futures=True)
    wall = time.perf_counter() - t0
    if first_err:
        log(f"{label}: {failed}/{n} failed; first error: {first_err[0]}")
    return lat, failed, wall


def bench_runc(rootfs: Path, n: int, concurrencies: list[int]) -> dict[str, Any]:
    runc = shutil.which("runc")
    if not runc:
        raise RuntimeError("runc not found (apt-get install runc)")
    base = make_tempdir("runc")
    state = base / "state"  # a private runc --root: only our containers live there
    bundle = base / "bundle"
    state.mkdir()
    bundle.mkdir()

    def cleanup_runc() -> None:
        r = run_cmd([runc, "--root", str(state), "list", "-q"])
        for cid in r.stdout.split():
            if cid.startswith(TAG):
                run_cmd([runc, "--root", str(state), "delete", "--force", cid])

    CLEANUP.push("runc containers", cleanup_runc)

    r = run_cmd([runc, "spec"], cwd=bundle)
    if r.returncode != 0:
        raise RuntimeError(f"runc spec failed: {r.stderr}")
    cfg_path = bundle / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["process"]["terminal"] = False
    cfg["process"]["args"] = ["/bin/true"]
    cfg["root"] = {"path": str(rootfs), "readonly": True}
    cfg["hostname"] = "bench"
    cfg_path.write_text(json.dumps(cfg, indent=2))

    counter = iter(range(10**9))
    counter_lock = threading.Lock()

    def cmd(_i: int) -> list[str]:
        with counter_lock:
            k = next(counter)
        return [
            runc,
            "--root",
            str(state),
            "run",
            "--bundle",
            str(bundle),
            f"{TAG}-{k}",
        ]

    res: dict[str, Any] = {}
    timed_runs(cmd, 5, 1, "runc warm-up")
    log(f"runc: {n} sequential")
    lat, failed, _ = timed_runs(cmd, n, 1, "runc")
    res["seq"] = latency_stats(lat, failed)
    for c in concurrencies:
        count = max(n, 8 * c)
        log(f"runc: {count} at concurrency {c}")
        lat, failed, wall = timed_runs(cmd, count, c, "runc")
        res[f"c{c}"] = {
            "per_s": len(lat) / wall,
            "n": count,
            "failed": failed,
            "p50_ms": percentile(lat, 0.5),
        }
    return res


def docker_available() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return run_cmd(["docker", "info"], timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def docker_import(rootfs: Path, image: str) -> None:
    """Makes a Docker image of the rootfs (no registry is reachable here)."""
    log(f"docker import {rootfs} -> {image}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    r = subprocess.run(
        ["docker", "import", "-", image],
        stdin=tar.stdout,
        check=False,
        capture_output=True,
        text=True,
    )
    tar.wait()
    if r.returncode != 0:
        raise RuntimeError(f"docker import failed: {r.stderr}")


def bench_docker(rootfs: Path, n: int, concurrencies: list[int]) -> dict[str, Any] | None:
    if not docker_available():
        print("docker: no daemon", flush=True)
        log("docker: no daemon, skipped")
        return None
    image = f"{TAG}:latest"
    docker_import(rootfs, image)
    names: list[str] = []
    names_lock = threading.Lock()

    def cleanup_docker() -> None:
        with names_lock:
            todo = list(names)
        existing = set(
            run_cmd(
                [
                    "docker",
                    "ps",
                    "-aq",
                    "--filter",
                    f"name={TAG}",
                    "--format",
                    "{{.Names}}",
                ]
            ).stdout.split()
        )
        for name in todo:
            if name in existing:
                run_cmd(["docker", "rm", "-f", name])
        run_cmd(["docker", "rmi", "-f", image])

    CLEANUP.push("docker containers and image", cleanup_docker)
    counter = iter(range(10**9))

    def cmd(_i: int) -> list[str]:
        with names_lock:
            name = f"{TAG}-{next(counter)}"
            names.append(name)
        return [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            "--name",
            name,
            image,
            "/bin/true",
        ]

    res: dict[str, Any] = {}
    timed_runs(cmd, 3, 1, "docker warm-up")
    log(f"docker: {n} sequential")
    lat, failed, _ = timed_runs(cmd, n, 1, "docker")
    res["seq"] = latency_stats(lat, failed)
    for c in concurrencies:
        count = max(n, 8 * c)
        log(f"docker: {count} at concurrency {c}")
        lat, failed, wall = timed_runs(cmd, count, c, "docker")
        res[f"c{c}"] = {
            "per_s": len(lat) / wall,
            "n": count,
            "failed": failed,
            "p50_ms": percentile(lat, 0.5),
        }
    return res


# --------------------------------------------------------------------------------------
# dsec
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
        if importlib.util.find_spec("dsec") is None:
            sys.exit("the dsec Python SDK is not installed: python3 -m pip install -e python/")
        self.args = args
        self.rootfs = rootfs
        self.name = name
        self.server_args = list(server_args or [])
        self.proc: subprocess.Popen | None = None
        self.state: Path | None = None  # the state directory of a server started here
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

    def close(self) -> None:
        self.cleanup.run()

    def _client(self) -> Any:
        import dsec

        return dsec.Client(url=self.url, token=os.environ.get("DSEC_TOKEN"))

    def async_client(self) -> Any:
        import dsec

        return dsec.AsyncClient(url=self.url, token=os.environ.get("DSEC_TOKEN"))

    def _start_server(self) -> str:
        exe = (
            Path(self.args.dsec_bin) if self.args.dsec_bin else REPO / "target" / "release" / "dsec"
        )
        if not exe.exists():
            debug = REPO / "target" / "debug" / "dsec"
            if self.args.dsec_bin or not debug.exists():
                sys.exit(f"{exe} not found: cargo build --release (or set DSEC_URL / --dsec-bin)")
            log("WARNING: no target/release/dsec, using the DEBUG build: not representative")
            exe = debug
        self.server_exe = exe
        state = make_tempdir(self.name, self.cleanup)
        self.state = state
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        logf = open(state.parent / f"{state.name}.log", "wb")  # closed at cleanup
        self.server_log = Path(logf.name)
        self.cleanup.push("server log", lambda: self.server_log.unlink(missing_ok=True))
        opts = "".join(f" {a}" for a in self.server_args)
        log(f"starting {exe} serve{opts} on {url}, state {state}")
        self.proc = subprocess.Popen(
            [
                str(exe),
                "serve",
                "--listen",
                f"127.0.0.1:{port}",
                "--state-dir",
                str(state),
                "--trajectory-sync",
                self.args.trajectory_sync,
                *self.server_args,
            ],
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # our Ctrl-C must not kill it before it cleans up
        )
        self.cleanup.push("dsec server", lambda: self._stop_server(logf))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"dsec serve exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{url}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return url
            except OSError:
                time.sleep(0.05)
        sys.exit(f"dsec serve did not answer /healthz within 60 s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return self.server_log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def _stop_server(self, logf: Any) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                log("dsec serve did not stop within 60 s after SIGTERM: killing it")
                self.proc.kill()
                self.proc.wait()
        logf.close()
        # The QEMUs of VM sandboxes are the server's children; should any outlive it, they
        # are ours to end: their command lines name this server's state directory.
        if self.state is not None:
            for pid in pids_with_cmdline(f"{self.state}/vm/"):
                log(f"dsec ({self.name}): killing leftover process {pid}")
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def server_rss_kib(self) -> int | None:
        if not self.proc:
            return None
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return None

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


async def _aclose(client: Any) -> None:
    for name in ("aclose", "close"):
        fn = getattr(client, name, None)
        if fn is not None:
            r = fn()
            if asyncio.iscoroutine(r):
                await r
            return


def bench_dsec_create(d: Dsec, n: int, concurrencies: list[int]) -> dict[str, Any]:
    client = d.client
    first_exec: list[float] = []
    lifecycle: list[float] = []
    stop_ms: list[float] = []
    failed = 0
    first_err = ""

    def once(record: bool) -> None:
        nonlocal failed, first_err
        t0 = time.perf_counter()
        sb = None
        try:
            sb = client.create(image=d.image, labels=d.labels)
            d.track(sb.id)
            r = sb.run(["/bin/true"])
            t1 = time.perf_counter()
            if r.exit_code != 0:
                raise RuntimeError(f"exit code {r.exit_code}: {r.stderr[:200]}")
            sb.stop()
            d.untrack(sb.id)
            t2 = time.perf_counter()
            if record:
                first_exec.append((t1 - t0) * 1e3)
                stop_ms.append((t2 - t1) * 1e3)
                lifecycle.append((t2 - t0) * 1e3)
        except Exception as e:  # counted and reported
            failed += 1
            first_err = first_err or f"{type(e).__name__}: {e}"
            if sb is not None:
                with contextlib.suppress(Exception):
                    sb.stop()
                d.untrack(sb.id)

    for _ in range(5):
        once(False)
    log(f"dsec: {n} sequential create -> exec -> stop")
    for _ in range(n):
        once(True)
    if failed:
        log(f"dsec create: {failed} failed; first: {first_err}")
    res: dict[str, Any] = {
        "seq": latency_stats(first_exec, failed),
        "lifecycle": latency_stats(lifecycle),
        "stop": latency_stats(stop_ms),
    }
    if not first_exec:
        raise RuntimeError(f"every dsec create failed: {first_err}")

    async def concurrent_run(c: int, count: int) -> dict[str, Any]:
        aclient = d.async_client()
        sem = asyncio.Semaphore(c)
        lat: list[float] = []
        errors: list[str] = []

        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                sb = None
                try:
                    sb = await aclient.create(image=d.image, labels=d.labels)
                    d.track(sb.id)
                    r = await sb.run(["/bin/true"])
                    if r.exit_code != 0:
                        raise RuntimeError(f"exit code {r.exit_code}")
                    lat.append((time.perf_counter() - t0) * 1e3)
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")
                finally:
                    if sb is not None:
                        with contextlib.suppress(Exception):
                            await sb.stop()
                        d.untrack(sb.id)

        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(count)))
            wall = time.perf_counter() - t0
        finally:
            await _aclose(aclient)
        if errors:
            log(f"dsec c={c}: {len(errors)}/{count} failed; first: {errors[0]}")
        return {
            "per_s": len(lat) / wall,
            "n": count,
            "failed": len(errors),
            "p50_ms": percentile(lat, 0.5),
        }

    async def create_then_stop(c: int, count: int) -> dict[str, Any]:
        """Creations/s: `count` create -> first exec with c in flight; the stops come after,
        timed apart."""
        aclient = d.async_client()
        sem = asyncio.Semaphore(c)
        lat: list[float] = []
        made: list[Any] = []
        errors: list[str] = []

        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                try:
                    sb = await aclient.create(image=d.image, labels=d.labels)
                    d.track(sb.id)
                    made.append(sb)
                    r = await sb.run(["/bin/true"])
                    if r.exit_code != 0:
                        raise RuntimeError(f"exit code {r.exit_code}")
                    lat.append((time.perf_counter() - t0) * 1e3)
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")

        async def stop(sb: Any) -> None:
            async with sem:
                with contextlib.suppress(Exception):
                    await sb.stop()
                d.untrack(sb.id)

        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(count)))
            wall = time.perf_counter() - t0
            t1 = time.perf_counter()
            await asyncio.gather(*(stop(sb) for sb in made))
            stop_wall = time.perf_counter() - t1
        finally:
            await _aclose(aclient)
        if errors:
            log(f"dsec create c={c}: {len(errors)}/{count} failed; first: {errors[0]}")
        return {
            "per_s": len(lat) / wall,
            "n": count,
            "failed": len(errors),
            "p50_ms": percentile(lat, 0.5),
            "stops_per_s": len(made) / stop_wall if stop_wall > 0 else None,
        }

    for c in concurrencies:
        count = max(n, 8 * c)
        log(f"dsec: {count} create -> exec -> stop at concurrency {c} (AsyncClient)")
        res[f"c{c}"] = asyncio.run(concurrent_run(c, count))
        log(f"dsec: {count} create -> exec at concurrency {c}, then the stops")
        res[f"create_c{c}"] = asyncio.run(create_then_stop(c, count))
    return res


def bench_dsec_loadgen(d: Dsec, n: int, concurrencies: list[int]) -> dict[str, Any]:
    """Creations/s with a lean Rust client (bench/loadgen): the server's own capacity.

    The Python SDK spends milliseconds of CPU per request, and on a 2-core machine those
    are taken from the server under test; dsec-loadgen costs a fraction of that.
    """
    exe = REPO / "target" / "release" / "dsec-loadgen"
    if not exe.exists():
        raise RuntimeError(f"{exe} missing: cargo build --release -p dsec-loadgen")
    out: dict[str, Any] = {}
    for c in concurrencies:
        cmd = [str(exe), "--url", d.url, "--image", d.image]
        cmd += ["--n", str(max(n, 16 * c)), "--concurrency", str(c)]
        log(f"loadgen: {' '.join(cmd)}")
        r = run_cmd(cmd)
        if r.returncode != 0:
            raise RuntimeError(f"dsec-loadgen failed: {r.stderr.strip()[-500:]}")
        out[f"c{c}"] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


def bench_dsec_fncall(d: Dsec, n: int, concurrencies: list[int]) -> dict[str, Any]:
    """fncall round trips of `true` (SDK, sequential) and calls/s (lean client)."""
    sb = d.client.create(backend="fncall", image=d.image, labels=d.labels)
    d.track(sb.id)
    try:
        for _ in range(10):
            sb.run(["/bin/true"])
        time.sleep(0.5)  # let the pool warm up again
        rtt: list[float] = []
        failed = 0
        for _ in range(n):
            t0 = time.perf_counter()
            r = sb.run(["/bin/true"])
            if r.exit_code == 0:
                rtt.append((time.perf_counter() - t0) * 1e3)
            else:
                failed += 1
            time.sleep(0.01)  # a steady 100 calls/s or less, not a burst
        res: dict[str, Any] = {"seq": latency_stats(rtt, failed)}
    finally:
        sb.stop()
        d.untrack(sb.id)
    exe = REPO / "target" / "release" / "dsec-loadgen"
    if exe.exists():
        for c in concurrencies:
            cmd = [str(exe), "--url", d.url, "--image", d.image, "--fncall"]
            cmd += ["--n", str(max(n, 16 * c)), "--concurrency", str(c)]
            log(f"fncall: {' '.join(cmd)}")
            r = run_cmd(cmd)
            if r.returncode != 0:
                raise RuntimeError(f"dsec-loadgen failed: {r.stderr.strip()[-500:]}")
            res[f"c{c}"] = json.loads(r.stdout.strip().splitlines()[-1])
    return res


def bench_dsec_fork(d: Dsec, trials: int = 3) -> dict[str, Any]:
    """fork(8) of a container that has written 100 MB, and a snapshot of it."""
    sb = d.client.create(image=d.image, labels=d.labels, memory_mb=1024, disk_mb=512)
    d.track(sb.id)
    fork_s: list[float] = []
    try:
        r = sb.run("head -c 100m /dev/urandom > /root/big", timeout=300)
        if r.exit_code != 0:
            raise RuntimeError(f"writing 100 MB failed: {r.stderr}")
        for _ in range(trials):
            t0 = time.perf_counter()
            kids = sb.fork(8)
            fork_s.append(time.perf_counter() - t0)
            for k in kids:
                k.stop()
            for img in d.client.images():
                if img.name.startswith(f"{sb.id}-fork-"):
                    d.client.delete_image(img.name)
        t0 = time.perf_counter()
        snap = sb.snapshot(f"{TAG}-snap")
        snap_s = time.perf_counter() - t0
        d.client.delete_image(snap.name)
    finally:
        sb.stop()
        d.untrack(sb.id)
    return {
        "fork8_s": sorted(fork_s)[len(fork_s) // 2],
        "fork8_all_s": fork_s,
        "snapshot_s": snap_s,
    }


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


def bench_dsec_exec(d: Dsec, n: int) -> dict[str, Any]:
    sb = d.client.create(image=d.image, labels=d.labels)
    d.track(sb.id)
    try:
        return exec_round_trips(sb, ["/bin/true"], n, 20, "dsec")
    finally:
        sb.stop()
        d.untrack(sb.id)


def bench_dsec_docker(d: Dsec, rootfs: Path, n: int, exec_n: int) -> dict[str, Any] | None:
    """dsec's docker backend: create -> first exec -> stop, and exec round trips."""
    if not docker_available():
        log("dsec-docker: no daemon, skipped")
        return None
    image = f"{TAG}-dsec:latest"
    docker_import(rootfs, image)
    CLEANUP.push("dsec-docker image", lambda: run_cmd(["docker", "rmi", "-f", image]))
    client = d.client
    first_exec: list[float] = []
    lifecycle: list[float] = []
    failed = 0
    for i in range(n + 3):
        t0 = time.perf_counter()
        sb = client.create(backend="docker", image=image, labels=d.labels)
        d.track(sb.id)
        try:
            ok = sb.run(["/bin/true"]).exit_code == 0
            t1 = time.perf_counter()
        finally:
            sb.stop()
            d.untrack(sb.id)
        t2 = time.perf_counter()
        if i < 3:  # warm-up
            continue
        if not ok:
            failed += 1
            continue
        first_exec.append((t1 - t0) * 1e3)
        lifecycle.append((t2 - t0) * 1e3)
    res: dict[str, Any] = {
        "seq": latency_stats(first_exec, failed),
        "lifecycle": latency_stats(lifecycle),
    }
    sb = client.create(backend="docker", image=image, labels=d.labels)
    d.track(sb.id)
    try:
        res["exec"] = exec_round_trips(sb, ["/bin/true"], exec_n, 10, "dsec-docker")
    finally:
        sb.stop()
        d.untrack(sb.id)
    return res


def _metric_sum_count(url: str, name: str) -> tuple[float, float]:
    """`name_sum` and `name_count` of a histogram on the server's /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", trust_env=False, timeout=30).text
    got = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for k in got:
            if line.startswith(f"{name}_{k}"):  # summed over label sets
                got[k] += float(line.split()[-1])
    return got["sum"], got["count"]


def _raw_exec(conn: Any, sandbox: str, body: bytes) -> dict[str, Any]:
    """One `POST /exec` over a kept-alive http.client connection (far less client CPU than
    the SDK, so the rate is the server's)."""
    conn.request(
        "POST",
        f"/v1/sandboxes/{sandbox}/exec",
        body=body,
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"exec answered {resp.status}: {data[:300]!r}")
    return json.loads(data)


def bench_dsec_trajectory(d: Dsec, n: int) -> dict[str, Any]:
    """What the trajectory log costs: exec rate of `/bin/true` without and with a
    trajectory id (both are logged), the time each exec waits for its log append (from the
    server's `dsec_trajectory_append_seconds`), and fast-forward of 1,000 recorded steps."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(d.url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=60)
    plain = d.client.create(image=d.image, labels=d.labels)
    d.track(plain.id)
    traj = d.client.create(
        image=d.image, labels=d.labels, trajectory_id=f"{TAG}-{uuid.uuid4().hex[:8]}"
    )
    d.track(traj.id)
    res: dict[str, Any] = {"n": n}
    try:
        step = 0
        elapsed = {"plain": 0.0, "traj": 0.0}
        waits = {"plain": 0.0, "traj": 0.0}
        done = {"plain": 0, "traj": 0}
        rounds = 10
        for r in range(rounds + 1):  # round 0 warms up; rounds alternate to cancel drift
            for kind in ("plain", "traj"):
                sb = plain if kind == "plain" else traj
                s0, _ = _metric_sum_count(d.url, "dsec_trajectory_append_seconds")
                t0 = time.perf_counter()
                for _ in range(max(n // rounds, 10)):
                    body = {"cmd": ["/bin/true"]}
                    if kind == "traj":
                        body["step"] = step
                        step += 1
                    _raw_exec(conn, sb.id, json.dumps(body).encode())
                    if r:
                        done[kind] += 1
                if r:
                    elapsed[kind] += time.perf_counter() - t0
                    s1, _ = _metric_sum_count(d.url, "dsec_trajectory_append_seconds")
                    waits[kind] += s1 - s0
        for kind in ("plain", "traj"):
            res[f"{kind}_per_s"] = done[kind] / elapsed[kind]
            res[f"{kind}_rtt_ms"] = elapsed[kind] / done[kind] * 1e3
            res[f"{kind}_append_ms"] = waits[kind] / done[kind] * 1e3
            # The append is on each exec's critical path: its share of the round trip is
            # what logging costs sequential throughput.
            res[f"{kind}_log_share_pct"] = 100.0 * waits[kind] / elapsed[kind]
        res["traj_vs_plain_pct"] = 100.0 * (1 - res["traj_per_s"] / res["plain_per_s"])

        # Concurrent: 8 clients, each with its own sandbox (the RL shape).
        par = 8
        boxes = [d.client.create(image=d.image, labels=d.labels) for _ in range(par)]
        for b in boxes:
            d.track(b.id)
        try:

            def client_loop(box_id: str, count: int) -> None:
                c = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=60)
                body = json.dumps({"cmd": ["/bin/true"]}).encode()
                for _ in range(count):
                    _raw_exec(c, box_id, body)
                c.close()

            per = max(n // par, 20)
            s0, c0 = _metric_sum_count(d.url, "dsec_trajectory_append_seconds")
            t0 = time.perf_counter()
            threads = [threading.Thread(target=client_loop, args=(b.id, per)) for b in boxes]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            s1, c1 = _metric_sum_count(d.url, "dsec_trajectory_append_seconds")
            res["c8_per_s"] = par * per / wall
            res["c8_append_ms"] = (s1 - s0) / max(c1 - c0, 1) * 1e3
            res["c8_log_share_pct"] = 100.0 * (s1 - s0) / (wall * par)
        finally:
            for b in boxes:
                b.stop()
                d.untrack(b.id)

        # Fast-forward: a reconnected client re-issues 1,000 recorded steps.
        ff = d.client.create(
            image=d.image,
            labels=d.labels,
            trajectory_id=f"{TAG}-ff-{uuid.uuid4().hex[:8]}",
        )
        d.track(ff.id)
        try:
            bodies = [
                json.dumps({"cmd": ["/bin/echo", str(i)], "step": i}).encode() for i in range(1000)
            ]
            log("trajectory: recording 1,000 steps")
            for b in bodies:
                _raw_exec(conn, ff.id, b)
            log("trajectory: fast-forwarding 1,000 steps")
            h0, _ = _metric_sum_count(d.url, "dsec_exec_seconds")
            t0 = time.perf_counter()
            for i, b in enumerate(bodies):
                r = _raw_exec(conn, ff.id, b)
                if not r["replayed"] or r["stdout"] != f"{i}\n":
                    raise RuntimeError(f"step {i} was not replayed: {r}")
            res["replay_1000_s"] = time.perf_counter() - t0
            # The server's own time in the exec handler (the rest is HTTP and the client).
            h1, _ = _metric_sum_count(d.url, "dsec_exec_seconds")
            res["replay_1000_server_s"] = h1 - h0
            again = d.client.get(ff.id)
            t0 = time.perf_counter()
            for i in range(1000):
                again.run(["/bin/echo", str(i)])
            res["replay_1000_sdk_s"] = time.perf_counter() - t0
        finally:
            ff.stop()
            d.untrack(ff.id)
    finally:
        conn.close()
        for sb in (plain, traj):
            sb.stop()
            d.untrack(sb.id)
    return res


def mem_available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def settled_mem_available_kib() -> float:
    """MemAvailable averaged over a second, after letting the system settle."""
    time.sleep(2)
    samples = []
    for _ in range(10):
        samples.append(mem_available_kib())
        time.sleep(0.1)
    return sum(samples) / len(samples)


def bench_dsec_idle(d: Dsec, count: int) -> dict[str, Any]:
    rss0 = d.server_rss_kib()
    before = settled_mem_available_kib()
    log(f"dsec: creating {count} idle sandboxes")

    async def create_all() -> tuple[list[str], list[str]]:
        aclient = d.async_client()
        sem = asyncio.Semaphore(16)
        ids: list[str] = []
        errors: list[str] = []

        async def one() -> None:
            async with sem:
                try:
                    sb = await aclient.create(image=d.image, labels=d.labels)
                    d.track(sb.id)
                    ids.append(sb.id)
                except Exception as e:
                    errors.append(f"{type(e).__name__}: {e}")

        try:
            await asyncio.gather(*(one() for _ in range(count)))
        finally:
            await _aclose(aclient)
        return ids, errors

    t0 = time.perf_counter()
    ids, errors = asyncio.run(create_all())
    create_s = time.perf_counter() - t0
    if errors:
        log(f"dsec idle: {len(errors)}/{count} creations failed; first: {errors[0]}")
    if not ids:
        raise RuntimeError(f"no idle sandbox could be created: {errors[:1]}")
    after = settled_mem_available_kib()
    rss1 = d.server_rss_kib()
    usage_sum = 0
    with contextlib.suppress(Exception):
        for sb in d.client.list():
            if sb.id in ids:
                info = sb.info()
                usage = getattr(info, "usage", None) or {}
                mb = (
                    usage.get("memory_bytes")
                    if isinstance(usage, dict)
                    else getattr(usage, "memory_bytes", None)
                )
                usage_sum += int(mb or 0)
    res = {
        "n": len(ids),
        "failed": len(errors),
        "create_s": create_s,
        "mib_per_sandbox": (before - after) / len(ids) / 1024,
        "cgroup_usage_mib_per_sandbox": usage_sum / len(ids) / 2**20 if usage_sum else None,
        "server_rss_mib_per_sandbox": (rss1 - rss0) / len(ids) / 1024 if rss0 and rss1 else None,
    }
    log(f"dsec: stopping {len(ids)} idle sandboxes")

    async def stop_all() -> None:
        aclient = d.async_client()
        sem = asyncio.Semaphore(16)

        async def one(sid: str) -> None:
            async with sem:
                with contextlib.suppress(Exception):
                    sb = await aclient.get(sid)
                    await sb.stop()
                d.untrack(sid)

        try:
            await asyncio.gather(*(one(s) for s in ids))
        finally:
            await _aclose(aclient)

    asyncio.run(stop_all())
    return res


# --------------------------------------------------------------------------------------
# VM backends
# --------------------------------------------------------------------------------------

VM_BACKENDS = ("microvm", "vm")


def _stop_sandbox(d: Dsec, sb: Any) -> None:
    try:
        sb.stop()
        d.untrack(sb.id)
    except Exception as e:  # still tracked: stopped again at the end
        log(f"stopping {sb.id} failed: {type(e).__name__}: {e}")


def _create_first_exec(d: Dsec, backend: str, **kw: Any) -> float:
    """ms from create(backend=...) until the first run("true") returns; the sandbox is
    stopped afterwards, untimed."""
    t0 = time.perf_counter()
    sb = d.client.create(backend=backend, image=d.image, labels=d.labels, **kw)
    d.track(sb.id)
    try:
        r = sb.run("true")
        dt = (time.perf_counter() - t0) * 1e3
        if r.exit_code != 0:
            raise RuntimeError(f"`true` exited {r.exit_code}: {r.stderr[:200]}")
        return dt
    finally:
        _stop_sandbox(d, sb)


def _first_exec_series(d: Dsec, backend: str, n: int, label: str) -> dict[str, Any]:
    lat: list[float] = []
    failed = 0
    first_err = ""
    log(f"{label}: {n} sequential create -> first exec")
    for _ in range(n):
        try:
            lat.append(_create_first_exec(d, backend))
        except Exception as e:  # counted and reported
            failed += 1
            first_err = first_err or f"{type(e).__name__}: {e}"
    res = latency_stats(lat, failed)
    if failed:
        log(f"{label}: {failed}/{n} failed; first: {first_err}")
        res["first_error"] = first_err
    return res


def _exec_series(d: Dsec, backend: str, n: int) -> dict[str, Any]:
    """Round trips of run("true") in one running sandbox, and its accelerator."""
    sb = d.client.create(backend=backend, image=d.image, labels=d.labels)
    d.track(sb.id)
    try:
        res = exec_round_trips(sb, "true", n, 10, backend)
        res["accelerator"] = sb.info().accelerator
        return res
    finally:
        _stop_sandbox(d, sb)


def _idle_memory(d: Dsec, backend: str, count: int) -> dict[str, Any]:
    """Host memory per idle sandbox: the MemAvailable drop after creating `count` (one
    after another), divided by count; for VMs also the QEMUs' VmRSS and RssAnon."""
    before = settled_mem_available_kib()
    log(f"{backend}: creating {count} idle sandboxes")
    made: list[Any] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    try:
        for _ in range(count):
            try:
                sb = d.client.create(backend=backend, image=d.image, labels=d.labels)
                d.track(sb.id)
                made.append(sb)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
        create_s = time.perf_counter() - t0
        if errors:
            log(f"{backend} idle: {len(errors)}/{count} creations failed; first: {errors[0]}")
        if not made:
            raise RuntimeError(f"no idle {backend} sandbox could be created: {errors[:1]}")
        after = settled_mem_available_kib()
        k = len(made)
        res: dict[str, Any] = {
            "n": k,
            "failed": len(errors),
            "create_s": create_s,
            "mib_per_sandbox": (before - after) / k / 1024,
        }
        if backend in VM_BACKENDS:
            pids = []
            for sb in made:
                for pid in pids_with_cmdline(f"/vm/sandboxes/{sb.id}/"):
                    with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
                        if f.read().startswith("qemu"):
                            pids.append(pid)
            rss = [proc_status_kib(pid, "VmRSS") or 0 for pid in pids]
            anon = [proc_status_kib(pid, "RssAnon") or 0 for pid in pids]
            res["qemu_processes"] = len(pids)
            res["qemu_rss_mib_per_vm"] = sum(rss) / k / 1024
            res["qemu_anon_mib_per_vm"] = sum(anon) / k / 1024
        else:
            usage = 0
            with contextlib.suppress(Exception):
                for sb in made:
                    usage += int(sb.info().usage.memory_bytes or 0)
            res["cgroup_usage_mib_per_sandbox"] = usage / k / 2**20 if usage else None
        return res
    finally:
        log(f"{backend}: stopping {len(made)} idle sandboxes")
        for sb in made:
            _stop_sandbox(d, sb)


def _template_snapshots(d: Dsec) -> dict[str, int]:
    """Sizes of the boot templates' scratch qcow2 files (with the saved VM state) of a server
    started here: each restore copies one."""
    if d.state is None:
        return {}
    found = {}
    for f in (d.state / "vm" / "templates").glob("*/scratch.qcow2"):
        with contextlib.suppress(OSError):
            found[str(f)] = f.stat().st_size
    return found


def bench_vm(d: Dsec, args: argparse.Namespace, res_so_far: dict[str, Any]) -> dict[str, Any]:
    """microvm and vm beside the container backend: restore -> first exec, cold boot ->
    first exec (a second server with --vm-boot cold), exec round trips, idle memory."""
    res: dict[str, Any] = {"n": args.vm_n, "cold_n": args.vm_cold_n}

    # The first VM create on a server builds the image's disk (both backends share it) and
    # waits for the accelerator probe the server started at launch, if still running; a
    # sandbox of another shape (memory) takes those costs here, so that each backend's
    # first create below costs its template and no more.
    log("vm: first VM create on this server (image disk, a template)")
    res["first_vm_create_ms"] = _create_first_exec(d, "microvm", memory_mb=256)

    _first_exec_series(d, "container", 3, "container warm-up")
    res["container_first_exec"] = _first_exec_series(
        d, "container", max(args.vm_n, 50), "container"
    )
    res["container_exec"] = _exec_series(d, "container", args.vm_exec_n)
    for b in VM_BACKENDS:
        log(f"{b}: first create (builds the boot template)")
        known = _template_snapshots(d)
        res[f"{b}_first_create_ms"] = _create_first_exec(d, b)
        new = [size for f, size in _template_snapshots(d).items() if f not in known]
        res[f"{b}_template_qcow2_mib"] = new[0] / 2**20 if len(new) == 1 else None
        restore = _first_exec_series(d, b, args.vm_n, f"{b} restore")
        res[f"{b}_restore"] = restore
        # The first create = template (cold boot + savevm) + one restore -> first exec.
        res[f"{b}_template_ms"] = (
            res[f"{b}_first_create_ms"] - restore["p50_ms"] if restore["n"] else None
        )
        res[f"{b}_exec"] = _exec_series(d, b, args.vm_exec_n)
    res["accelerator"] = {b: res[f"{b}_exec"]["accelerator"] for b in VM_BACKENDS}

    idle = res_so_far.get("idle")
    if idle:
        res["container_idle"] = {
            "n": idle["n"],
            "mib_per_sandbox": idle["mib_per_sandbox"],
            "cgroup_usage_mib_per_sandbox": idle.get("cgroup_usage_mib_per_sandbox"),
            "from_idle_part": True,
        }
    else:
        res["container_idle"] = _idle_memory(d, "container", args.vm_idle_n)
    for b in VM_BACKENDS:
        res[f"{b}_idle"] = _idle_memory(d, b, args.vm_idle_n)

    log("vm: a second server with --vm-boot cold")
    try:
        cold = Dsec(args, d.rootfs, server_args=["--vm-boot", "cold"], name="cold")
    except SystemExit as e:
        raise RuntimeError(f"starting the --vm-boot cold server: {e}") from None
    try:
        # Its first create also probes the accelerator and builds the image disk.
        res["cold_first_vm_create_ms"] = _create_first_exec(cold, "microvm")
        for b in VM_BACKENDS:
            if b != "microvm":
                _create_first_exec(cold, b)  # warm-up
            res[f"{b}_cold"] = _first_exec_series(cold, b, args.vm_cold_n, f"{b} cold boot")
    finally:
        cold.close()
    return res


# --------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------


def fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def ratio(a: Any, b: Any) -> str:
    if a is None or b is None or not b or a != a or b != b:
        return "-"
    return f"{a / b:.2f}x"


def get(res: dict[str, Any], part: str, *keys: str) -> Any:
    cur: Any = res.get(part)
    for k in keys:
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    return cur


def met(value: Any, target: float, higher_is_better: bool) -> str:
    if value is None or value != value:
        return "-"
    ok = value >= target if higher_is_better else value <= target
    return "✅" if ok else "❌"


def host_description() -> str:
    cg = "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1/hybrid"
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = 0.0
    with contextlib.suppress(OSError):
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    return (
        f"{platform.node()}: Linux {platform.release()}, {os.cpu_count()} CPUs ({cpu}), "
        f"{mem_gib:.0f} GiB, cgroup {cg}, load average {os.getloadavg()[0]:.2f} at the end"
    )


def rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def main_table(res: dict[str, Any], args: argparse.Namespace, cs: list[int]) -> list[str]:
    """The table of the container parts, with runc, docker and the floor beside."""
    out: list[str] = []
    out.append(
        "| metric | dsec | runc | docker | floor | dsec/floor | dsec/runc | dsec/docker | target |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")

    def row(
        name: str,
        key: tuple[str, ...],
        dkey: tuple[str, ...] | None = None,
        target: str = "",
        digits: int = 2,
    ) -> None:
        dv = get(res, "create", *(dkey or key))
        rv = get(res, "runc", *key)
        ov = get(res, "docker", *key)
        fv = get(res, "floor", *key)
        out.append(
            f"| {name} | {fmt(dv, digits)} | {fmt(rv, digits)} | {fmt(ov, digits)} | "
            f"{fmt(fv, digits)} | {ratio(dv, fv)} | {ratio(dv, rv)} | {ratio(dv, ov)} | {target} |"
        )

    p50 = get(res, "create", "seq", "p50_ms")
    row(
        "create → first exec, p50 ms ¹",
        ("seq", "p50_ms"),
        target=f"≤ {TARGET_CREATE_P50_MS:g} ms {met(p50, TARGET_CREATE_P50_MS, False)}",
    )
    row("create → first exec, p99 ms ¹", ("seq", "p99_ms"))
    row("whole lifecycle, p50 ms ²", ("seq", "p50_ms"), dkey=("lifecycle", "p50_ms"))
    row("whole lifecycle, p99 ms ²", ("seq", "p99_ms"), dkey=("lifecycle", "p99_ms"))
    for c in cs:
        v = get(res, "create", f"c{c}", "per_s")
        row(
            f"lifecycles/s at concurrency {c} ³",
            (f"c{c}", "per_s"),
            digits=0,
            target=f"≥ {TARGET_CREATIONS_PER_S:g}/s {met(v, TARGET_CREATIONS_PER_S, True)}",
        )
    for c in cs:
        v = get(res, "create", f"create_c{c}", "per_s")
        if v is None:
            continue
        out.append(
            f"| creations/s at concurrency {c} ⁴ | {fmt(v, 0)} | | | | | | | "
            f"≥ {TARGET_CREATIONS_PER_S:g}/s {met(v, TARGET_CREATIONS_PER_S, True)} |"
        )
        out.append(
            f"| stops/s at concurrency {c} ⁴ | "
            f"{fmt(get(res, 'create', f'create_c{c}', 'stops_per_s'), 0)} | | | | | | | |"
        )

    def drow(name: str, value: Any, target: str = "") -> None:
        """A dsec-only row."""
        out.append(f"| {name} | {fmt(value)} | | | | | | | {target} |")

    for c in cs:
        lg = get(res, "loadgen", f"c{c}")
        if lg is None:
            continue
        ok = met(lg["creations_per_s"], TARGET_CREATIONS_PER_S, True)
        out.append(
            f"| creations/s at concurrency {c}, lean client ⁵ | {fmt(lg['creations_per_s'], 0)} "
            f"| | | | | | | ≥ {TARGET_CREATIONS_PER_S:g}/s {ok} |"
        )
        drow(
            f"create → first exec p50 ms at concurrency {c}, lean client ⁵",
            lg["create_exec_p50_ms"],
        )
        out.append(
            f"| stops/s at concurrency {c}, lean client ⁵ | {fmt(lg['stops_per_s'], 0)} "
            "| | | | | | | |"
        )

    if "fncall" in res:
        f = res["fncall"]
        ok = met(f["seq"]["p50_ms"], TARGET_FNCALL_P50_MS, False)
        drow(
            "fncall round trip `true`, p50 ms (SDK, ≤100 calls/s) ⁶",
            f["seq"]["p50_ms"],
            f"≤ {TARGET_FNCALL_P50_MS:g} ms {ok}",
        )
        drow("fncall round trip `true`, p99 ms (SDK) ⁶", f["seq"]["p99_ms"])
        for c in cs:
            lg = f.get(f"c{c}")
            if lg is None:
                continue
            ok = met(lg["calls_per_s"], TARGET_FNCALLS_PER_S, True)
            out.append(
                f"| fncall calls/s at concurrency {c}, lean client ⁶ | "
                f"{fmt(lg['calls_per_s'], 0)} | | | | | | | "
                f"≥ {TARGET_FNCALLS_PER_S:g}/s {ok} |"
            )
            drow(
                f"fncall call p50 ms at concurrency {c}, lean client ⁶",
                lg["call_p50_ms"],
            )
    if "fork" in res:
        fk = res["fork"]
        ok = met(fk["fork8_s"], TARGET_FORK8_S, False)
        drow(
            "fork(8) after writing 100 MB, s (median of 3)",
            fk["fork8_s"],
            f"≤ {TARGET_FORK8_S:g} s {ok}",
        )
        drow("snapshot after writing 100 MB, s", fk["snapshot_s"])
    if "exec" in res:
        e = res["exec"]
        ok = met(e["p50_ms"], TARGET_EXEC_P50_MS, False)
        drow(
            "exec round trip `/bin/true`, p50 ms",
            e["p50_ms"],
            f"≤ {TARGET_EXEC_P50_MS:g} ms {ok}",
        )
        drow("exec round trip `/bin/true`, p99 ms", e["p99_ms"])
        drow("exec, server-side duration p50 ms", e["server_p50_ms"])
    if "dsec-docker" in res:
        dd = res["dsec-docker"]

        def native(what: str, value: Any) -> str:
            return f"native {what}: {fmt(value)}" if value is not None else ""

        drow(
            'backend="docker": create → first exec, p50 ms ⁸',
            dd["seq"]["p50_ms"],
            native("p50", get(res, "create", "seq", "p50_ms")),
        )
        drow(
            'backend="docker": create → first exec, p99 ms ⁸',
            dd["seq"]["p99_ms"],
            native("p99", get(res, "create", "seq", "p99_ms")),
        )
        drow(
            'backend="docker": whole lifecycle, p50 ms ⁸',
            dd["lifecycle"]["p50_ms"],
            native("p50", get(res, "create", "lifecycle", "p50_ms")),
        )
        drow(
            'backend="docker": exec round trip `/bin/true`, p50 ms ⁸',
            dd["exec"]["p50_ms"],
            native("p50", get(res, "exec", "p50_ms")),
        )
        drow(
            'backend="docker": exec round trip `/bin/true`, p99 ms ⁸',
            dd["exec"]["p99_ms"],
            native("p99", get(res, "exec", "p99_ms")),
        )
    if "trajectory" in res:
        t = res["trajectory"]
        ok = met(t["plain_log_share_pct"], TARGET_LOG_OVERHEAD_PCT, False)
        drow(
            "exec `/bin/true` waiting on its log append, % of round trip ⁷",
            t["plain_log_share_pct"],
            f"≤ {TARGET_LOG_OVERHEAD_PCT:g}% {ok}",
        )
        drow("log append, mean ms ⁷", t["plain_append_ms"])
        drow("exec/s sequential, no trajectory id ⁷", t["plain_per_s"])
        drow("exec/s, 8 clients × own sandbox ⁷", t["c8_per_s"])
        drow(
            "  … exec waiting on its log append, % of round trip ⁷",
            t["c8_log_share_pct"],
            f"≤ {TARGET_LOG_OVERHEAD_PCT:g}% {met(t['c8_log_share_pct'], TARGET_LOG_OVERHEAD_PCT, False)}",
        )

        drow("exec/s sequential, with trajectory id ⁷", t["traj_per_s"])
        drow("trajectory id vs none, % slower ⁷", t["traj_vs_plain_pct"])
        ok = met(t["replay_1000_s"], TARGET_REPLAY_1000_S, False)
        drow(
            "fast-forward of 1,000 recorded steps, s (lean client) ⁷",
            t["replay_1000_s"],
            f"≤ {TARGET_REPLAY_1000_S:g} s {ok}",
        )
        drow("  … of which in the server's exec handler, s ⁷", t["replay_1000_server_s"])
        drow("fast-forward of 1,000 recorded steps, s (SDK) ⁷", t["replay_1000_sdk_s"])
    if "idle" in res:
        i = res["idle"]
        ok = met(i["mib_per_sandbox"], TARGET_IDLE_MIB, False)
        drow(
            f"idle sandbox, host MiB (MemAvailable Δ / {i['n']})",
            i["mib_per_sandbox"],
            f"≤ {TARGET_IDLE_MIB:g} MiB {ok}",
        )
        if i.get("cgroup_usage_mib_per_sandbox") is not None:
            drow(
                "idle sandbox, cgroup memory usage MiB",
                i["cgroup_usage_mib_per_sandbox"],
            )
        if i.get("server_rss_mib_per_sandbox") is not None:
            drow("idle sandbox, server RSS growth MiB", i["server_rss_mib_per_sandbox"])
        drow(f"{i['n']} idle sandboxes created in, s", i["create_s"])
    out.append("")
    out.append(
        "¹ dsec: `create` → first `run(['/bin/true'])` returns, via the SDK over HTTP. "
        "runc/docker/floor have no separate first exec: their number is a whole run of "
        "`/bin/true` (create, start, exit, delete): more work, so there the ratio flatters "
        "dsec; the lifecycle rows compare equal work.  "
    )
    out.append("² dsec: create → exec → stop, the same work as one runc/docker/floor run.  ")
    out.append(
        "³ create → exec `/bin/true` → stop cycles completed per second with c in flight "
        "(dsec: AsyncClient; runc/docker: c parallel command lines; floor: c worker "
        "processes).  "
    )
    out.append(
        "⁴ dsec only: create → first exec with c in flight, all sandboxes left running; then "
        "all stopped, timed apart."
    )
    out.append(
        "⁵ the same as ⁴, driven by `target/release/dsec-loadgen` (Rust) instead of the Python "
        "SDK: on 2 cores the SDK's own CPU is taken from the server, so this row is the "
        "server's capacity."
    )
    out.append(
        "⁶ fncall: every call runs in a fresh worker (a native container created ahead of "
        "demand) that is destroyed afterwards; compare with the whole-lifecycle rows above "
        "(a container created, used once, stopped) and `docker run`."
    )
    if "trajectory" in res:
        out.append(
            "⁷ trajectory: every exec is appended to the SQLite trajectory log (WAL, group "
            f"commit, --trajectory-sync {args.trajectory_sync}) before its result returns. "
            "The log's cost is the time an exec waits for its append, as a share of the "
            "round trip. Fast-forward re-issues 1,000 recorded steps one after "
            "another over one kept-alive connection; the server-side row is the sum of its "
            "exec handler's time (`dsec_exec_seconds`)."
        )
    if "dsec-docker" in res:
        out.append(
            '⁸ dsec with `backend="docker"`: the same SDK calls, each sandbox a container '
            "of the Docker daemon (the rootfs `docker import`ed), each command a docker exec; "
            "sequential, one client. The native value of the same row is in the last column."
        )
    return out


def vm_table(res: dict[str, Any]) -> list[str]:
    """The VM backends beside the container backend, all from the "vm" part."""
    out = [
        "#### VM backends",
        "",
        "| metric | container | microvm | vm | microvm/container | vm/container | target |",
        "|---|---|---|---|---|---|---|",
    ]

    def g(*keys: str) -> Any:
        return get(res, "vm", *keys)

    def row(name: str, key: tuple[str, str], target: float | None = None, c: Any = None) -> None:
        """One row of g(f"{backend}_{key[0]}", key[1]) per backend, with the ratios."""
        c = g(f"container_{key[0]}", key[1]) if c is None else c
        m = g(f"microvm_{key[0]}", key[1])
        w = g(f"vm_{key[0]}", key[1])
        goal = ""
        if target is not None:
            goal = f"≤ {target:g} ms: microvm {met(m, target, False)}, vm {met(w, target, False)}"
        # A container figure of 0 or less (noise in a MemAvailable difference) has no ratio.
        cr = c if isinstance(c, (int, float)) and c > 0 else None
        out.append(
            f"| {name} | {fmt(c)} | {fmt(m)} | {fmt(w)} | {ratio(m, cr)} | {ratio(w, cr)} "
            f"| {goal} |"
        )

    def single(name: str, c: Any = None, m: Any = None, w: Any = None) -> None:
        """A row without ratios."""
        out.append(f"| {name} | {fmt(c)} | {fmt(m)} | {fmt(w)} | | | |")

    acc = g("accelerator") or {}
    out.append(f"| accelerator | - | {acc.get('microvm') or '-'} | {acc.get('vm') or '-'} | | | |")
    cfe50 = g("container_first_exec", "p50_ms")
    cfe99 = g("container_first_exec", "p99_ms")
    row(
        "create → first exec, restore, p50 ms ᵃ",
        ("restore", "p50_ms"),
        TARGET_VM_RESTORE_MS,
        c=cfe50,
    )
    row("create → first exec, restore, p99 ms ᵃ", ("restore", "p99_ms"), c=cfe99)
    row("create → first exec, cold boot, p50 ms ᵇ", ("cold", "p50_ms"), c=cfe50)
    row("create → first exec, cold boot, p99 ms ᵇ", ("cold", "p99_ms"), c=cfe99)
    single(
        "boot template (cold boot + savevm), ms ᶜ",
        m=g("microvm_template_ms"),
        w=g("vm_template_ms"),
    )
    single(
        "first create of a backend (template + restore → first exec), ms ᶜ",
        m=g("microvm_first_create_ms"),
        w=g("vm_first_create_ms"),
    )
    single(
        "first VM create on a fresh server (image disk, template), ms ᶜ",
        m=g("first_vm_create_ms"),
    )
    single(
        "boot snapshot (template qcow2, copied per restore), MiB ᶜ",
        m=g("microvm_template_qcow2_mib"),
        w=g("vm_template_qcow2_mib"),
    )
    row("exec round trip `true`, p50 ms ᵈ", ("exec", "p50_ms"), TARGET_VM_EXEC_MS)
    row("exec round trip `true`, p99 ms ᵈ", ("exec", "p99_ms"))
    row("exec, server-side duration p50 ms ᵈ", ("exec", "server_p50_ms"))
    n_idle = g("microvm_idle", "n")
    row(f"idle sandbox, host MiB (MemAvailable Δ / {n_idle}) ᵉ", ("idle", "mib_per_sandbox"))
    single(
        "idle VM, QEMU VmRSS MiB per VM ᵉ",
        m=g("microvm_idle", "qemu_rss_mib_per_vm"),
        w=g("vm_idle", "qemu_rss_mib_per_vm"),
    )
    single(
        "idle VM, QEMU RssAnon MiB per VM ᵉ",
        m=g("microvm_idle", "qemu_anon_mib_per_vm"),
        w=g("vm_idle", "qemu_anon_mib_per_vm"),
    )
    single(
        "idle container, cgroup memory usage MiB ᵉ",
        c=g("container_idle", "cgroup_usage_mib_per_sandbox"),
    )
    out.append("")
    out.append(
        f'ᵃ `create(backend=...)` → the first `run("true")` returns, sync SDK, sequential '
        f"(stop after each, untimed; n={g('n')} per VM backend after its first create, "
        f"{g('container_first_exec', 'n')} containers). A VM restores its backend's boot "
        "template: a copy of the template's scratch qcow2 (the boot snapshot row), "
        "`qemu -loadvm`, a fresh identity for the guest.  "
    )
    out.append(
        f"ᵇ the same against a second server started with `--vm-boot cold` (n={g('cold_n')} "
        "per backend, after one warm-up each): every VM boots its kernel. The container "
        "column repeats the container create → first exec.  "
    )
    out.append(
        "ᶜ template: a backend's first create of a shape (boots the template guest, savevm, "
        "then restores it as every later create does) minus the restore p50. The first VM "
        "create on a fresh server, made before those with another shape (256 MiB), also "
        "builds the image's disk and waits for the accelerator probe (KVM if a guest boots "
        "under it, else TCG) that the server starts at launch, if that is still running. "
        "Boot snapshot: the template's scratch qcow2 with the saved VM state in it.  "
    )
    out.append(
        'ᵈ `run("true")` (`/bin/sh -c true`) in one running sandbox, sync Client, after 10 '
        "warm-ups; server-side: the result's `duration_ms`.  "
    )
    cidle = g("container_idle") or {}
    src = (
        f"the container figure is the idle part's ({cidle.get('n')} sandboxes)"
        if cidle.get("from_idle_part")
        else f"the container figures are from {cidle.get('n')} containers made the same way"
    )
    out.append(
        "ᵉ MemAvailable (averaged over 1 s after 2 s of settling) before minus after creating "
        "the idle sandboxes one after another, over their number; other sessions on the host "
        "move MemAvailable by tens of MiB, so small figures are noise. VmRSS and RssAnon: "
        "summed over the sandboxes' QEMU processes (VmRSS also counts QEMU's shared "
        f"libraries in each), over the number of VMs; {src}."
    )
    return out


def report(res: dict[str, Any], args: argparse.Namespace, cs: list[int], notes: list[str]) -> str:
    out = []
    git = (
        run_cmd(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]).stdout.strip()
        or "uncommitted"
    )
    out.append(f"### dsec bench — {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} ({git})")
    out.append("")
    sizes = []
    if any(part != "vm" for part in res):
        sizes.append(f"n={args.n} sequential; concurrent runs of max(n, 8*c)")
    if "vm" in res:
        sizes.append(
            f"VM backends: {args.vm_n} restores, {args.vm_cold_n} cold boots, "
            f"{args.vm_exec_n} exec round trips, {args.vm_idle_n} idle sandboxes per backend"
        )
    cmd = " ".join(["python3", "bench/bench.py", *sys.argv[1:]])
    out.append(f"Host: {host_description()}. Rootfs: busybox. {'; '.join(sizes)}. Command: `{cmd}`")
    out.append("")
    if any(part != "vm" for part in res):
        out += main_table(res, args, cs)
    if "vm" in res:
        out += vm_table(res)
    failures = []
    for part, r in res.items():
        if isinstance(r, dict):
            if isinstance(r.get("failed"), int) and r["failed"]:
                failures.append(f"{part}: {r['failed']} failed")
            for k, v in r.items():
                if isinstance(v, dict) and v.get("failed"):
                    failures.append(f"{part}/{k}: {v['failed']} failed")
    if failures:
        notes.append("failures: " + "; ".join(failures))
    for n in notes:
        out.append("")
        out.append(f"Note: {n}")
    out.append("")
    out.append(
        "<details><summary>raw</summary>\n\n```json\n"
        + json.dumps(rounded(res), indent=1, default=str)
        + "\n```\n</details>"
    )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"comma-separated parts to run, of: {','.join(PARTS)} (default: all)",
    )
    ap.add_argument(
        "--n",
        type=int,
        default=200,
        help="sequential runs per measurement (default 200)",
    )
    ap.add_argument("--concurrency", default="16,32", help="concurrency levels (default 16,32)")
    ap.add_argument("--exec-n", type=int, default=500, help="exec round trips (default 500)")
    ap.add_argument("--idle-n", type=int, default=500, help="idle sandboxes (default 500)")
    ap.add_argument("--vm-n", type=int, default=10, help="vm: restores per backend (10)")
    ap.add_argument("--vm-cold-n", type=int, default=4, help="vm: cold boots per backend (4)")
    ap.add_argument(
        "--vm-exec-n", type=int, default=100, help="vm: exec round trips per backend (100)"
    )
    ap.add_argument("--vm-idle-n", type=int, default=8, help="vm: idle VMs per backend (8)")
    ap.add_argument("--rootfs", help="use this busybox rootfs instead of building one")
    ap.add_argument(
        "--trajectory-sync",
        choices=["full", "normal"],
        default="normal",
        help="the server's trajectory log fsync policy (dsec serve --trajectory-sync)",
    )
    ap.add_argument("--dsec-bin", help="dsec binary to start (default target/release/dsec)")
    ap.add_argument(
        "--json",
        action="store_true",
        help="also print the raw results as one JSON line",
    )
    args = ap.parse_args()

    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {PARTS}")
    cs = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if os.geteuid() != 0:
        sys.exit("bench.py needs root (containers)")

    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    res: dict[str, Any] = {}
    notes: list[str] = []
    rc = 0
    try:
        rootfs = prepare_rootfs(args.rootfs)
        dsec_parts = [
            p
            for p in parts
            if p
            in (
                "create",
                "loadgen",
                "fncall",
                "fork",
                "dsec-docker",
                "exec",
                "trajectory",
                "idle",
                "vm",
            )
        ]
        d = Dsec(args, rootfs) if dsec_parts else None
        if d is not None and getattr(d, "server_exe", None) and "debug" in str(d.server_exe):
            notes.append("dsec ran from the DEBUG build (target/debug/dsec): not representative.")
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("floor", lambda: bench_floor(rootfs, args.n, cs)),
            ("runc", lambda: bench_runc(rootfs, args.n, cs)),
            ("docker", lambda: bench_docker(rootfs, args.n, cs)),
            ("create", lambda: bench_dsec_create(d, args.n, cs)),
            (
                "dsec-docker",
                lambda: bench_dsec_docker(d, rootfs, args.n, args.exec_n),
            ),
            ("loadgen", lambda: bench_dsec_loadgen(d, args.n, cs)),
            ("fncall", lambda: bench_dsec_fncall(d, args.n, cs)),
            ("fork", lambda: bench_dsec_fork(d)),
            ("exec", lambda: bench_dsec_exec(d, args.exec_n)),
            ("trajectory", lambda: bench_dsec_trajectory(d, args.exec_n)),
            ("idle", lambda: bench_dsec_idle(d, args.idle_n)),
            ("vm", lambda: bench_vm(d, args, res)),
        ]
        for name, fn in steps:
            if name not in parts:
                continue
            try:
                r = fn()
            except KeyboardInterrupt:
                raise
            except Exception as e:  # one part failing must not hide the others
                log(f"{name}: FAILED: {type(e).__name__}: {e}")
                notes.append(f"{name} failed: {type(e).__name__}: {e}")
                rc = 1
                continue
            if r is None:
                if name == "docker":
                    notes.append("docker: no daemon (skipped).")
                continue
            res[name] = r
            log(f"{name}: {json.dumps(r, default=str)}")
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
        rc = 130
    finally:
        CLEANUP.run()
    if res:
        print(report(res, args, cs, notes))
        if args.json:
            print(json.dumps(rounded(res), default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
