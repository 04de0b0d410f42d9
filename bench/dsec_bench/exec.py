"""`exec` and `dsec-docker`: exec round trips in one running sandbox, and the docker backend
beside the native one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import dsec_local

from .common import (
    CLEANUP,
    TAG,
    Dsec,
    docker_available,
    docker_import,
    exec_round_trips,
    latency_stats,
    log,
)


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
    CLEANUP.push("dsec-docker image", lambda: dsec_local.docker_rmi(image))
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
