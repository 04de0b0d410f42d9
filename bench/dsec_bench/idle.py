"""`idle`: host memory per idle sandbox (MemAvailable before and after creating many)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from .common import Dsec, log


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
            await aclient.close()
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
    mine = set(ids)
    with contextlib.suppress(Exception):
        for sb in d.client.list():
            if sb.id in mine:
                usage_sum += int(sb.info().usage.memory_bytes or 0)
    res = {
        "n": len(ids),
        "failed": len(errors),
        "create_s": create_s,
        "mib_per_sandbox": (before - after) / len(ids) / 1024,
        "cgroup_usage_mib_per_sandbox": usage_sum / len(ids) / 2**20 if usage_sum else None,
        "server_rss_mib_per_sandbox": (rss1 - rss0) / len(ids) / 1024 if rss0 and rss1 else None,
    }
    log(f"dsec: stopping {len(ids)} idle sandboxes")
    stop_sandboxes(d, ids)
    return res


def stop_sandboxes(d: Dsec, ids: list[str], concurrency: int = 16) -> None:
    """Stops `ids` from one AsyncClient, `concurrency` at a time (best effort)."""

    async def stop_all() -> None:
        aclient = d.async_client()
        sem = asyncio.Semaphore(concurrency)

        async def one(sid: str) -> None:
            async with sem:
                with contextlib.suppress(Exception):
                    sb = await aclient.get(sid)
                    await sb.stop()
                d.untrack(sid)

        try:
            await asyncio.gather(*(one(s) for s in ids))
        finally:
            await aclient.close()

    asyncio.run(stop_all())
