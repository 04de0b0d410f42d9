"""`runc` and `docker`: both "run /bin/true in a fresh container" command lines, on the same
rootfs."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec_local import percentile

from .common import (
    CLEANUP,
    TAG,
    docker_available,
    docker_import,
    latency_stats,
    log,
    make_tempdir,
    run_cmd,
)


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


def run_series(
    make_cmd: Callable[[int], list[str]],
    label: str,
    n: int,
    concurrencies: list[int],
    warmup: int,
) -> dict[str, Any]:
    """`warmup` untimed runs, `n` sequential ones (p50/p99), then max(n, 8c) at each
    concurrency c (runs/s)."""
    res: dict[str, Any] = {}
    timed_runs(make_cmd, warmup, 1, f"{label} warm-up")
    log(f"{label}: {n} sequential")
    lat, failed, _ = timed_runs(make_cmd, n, 1, label)
    res["seq"] = latency_stats(lat, failed)
    for c in concurrencies:
        count = max(n, 8 * c)
        log(f"{label}: {count} at concurrency {c}")
        lat, failed, wall = timed_runs(make_cmd, count, c, label)
        res[f"c{c}"] = {
            "per_s": len(lat) / wall,
            "n": count,
            "failed": failed,
            "p50_ms": percentile(lat, 0.5),
        }
    return res


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

    return run_series(cmd, "runc", n, concurrencies, warmup=5)


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

    return run_series(cmd, "docker", n, concurrencies, warmup=3)
