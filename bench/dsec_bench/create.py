"""`create` and `loadgen`: create -> first exec -> stop through the Python SDK (sequential and
concurrent), and creations/s from the lean Rust client (bench/loadgen)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import dsec
from dsec_local import percentile

from .common import REPO, Dsec, latency_stats, log, run_cmd

#: The lean Rust client (bench/loadgen): far less client CPU per request than the SDK.
LOADGEN = REPO / "target" / "release" / "dsec-loadgen"


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

    for c in concurrencies:
        count = max(n, 8 * c)
        log(f"dsec: {count} create -> exec -> stop at concurrency {c} (AsyncClient)")
        res[f"c{c}"] = asyncio.run(concurrent_creates(d, c, count, stop_each=True))
        log(f"dsec: {count} create -> exec at concurrency {c}, then the stops")
        res[f"create_c{c}"] = asyncio.run(concurrent_creates(d, c, count, stop_each=False))
    return res


async def concurrent_creates(d: Dsec, c: int, count: int, *, stop_each: bool) -> dict[str, Any]:
    """`count` create -> first exec of /bin/true through one AsyncClient, c in flight.

    ``stop_each``: each sandbox is stopped in its slot (lifecycles/s). Otherwise all are left
    running and stopped afterwards, c at a time, timed apart (creations/s, then stops/s).
    """
    sem = asyncio.Semaphore(c)
    lat: list[float] = []
    made: list[dsec.AsyncSandbox] = []
    errors: list[str] = []

    async def stop(sb: dsec.AsyncSandbox) -> None:
        with contextlib.suppress(Exception):
            await sb.stop()
        d.untrack(sb.id)

    async with d.async_client() as aclient:

        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                sb = None
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
                finally:
                    if stop_each and sb is not None:
                        await stop(sb)

        async def stop_in_slot(sb: dsec.AsyncSandbox) -> None:
            async with sem:
                await stop(sb)

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(count)))
        wall = time.perf_counter() - t0
        res: dict[str, Any] = {
            "per_s": len(lat) / wall,
            "n": count,
            "failed": len(errors),
            "p50_ms": percentile(lat, 0.5),
        }
        if not stop_each:
            t1 = time.perf_counter()
            await asyncio.gather(*(stop_in_slot(sb) for sb in made))
            stop_wall = time.perf_counter() - t1
            res["stops_per_s"] = len(made) / stop_wall if stop_wall > 0 else None
    if errors:
        log(f"dsec c={c}: {len(errors)}/{count} failed; first: {errors[0]}")
    return res


def bench_dsec_loadgen(d: Dsec, n: int, concurrencies: list[int]) -> dict[str, Any]:
    """Creations/s with a lean Rust client (bench/loadgen): the server's own capacity.

    The Python SDK spends milliseconds of CPU per request, and on a 2-core machine those
    are taken from the server under test; dsec-loadgen costs a fraction of that.
    """
    return {f"c{c}": run_loadgen(d, max(n, 16 * c), c) for c in concurrencies}


def run_loadgen(d: Dsec, n: int, c: int, *extra: str) -> dict[str, Any]:
    """One run of `target/release/dsec-loadgen` (`n` operations, `c` in flight): its JSON."""
    if not LOADGEN.exists():
        raise RuntimeError(f"{LOADGEN} missing: cargo build --release -p dsec-loadgen")
    cmd = [str(LOADGEN), "--url", d.url, "--image", d.image, *extra]
    cmd += ["--n", str(n), "--concurrency", str(c)]
    log(f"loadgen: {' '.join(cmd)}")
    r = run_cmd(cmd)
    if r.returncode != 0:
        raise RuntimeError(f"dsec-loadgen failed: {r.stderr.strip()[-500:]}")
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return out
