"""`fncall`: round trips through the SDK, and calls/s from the lean client."""

from __future__ import annotations

import time
from typing import Any

from .common import Dsec, latency_stats
from .create import LOADGEN, run_loadgen


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
    if LOADGEN.exists():
        for c in concurrencies:
            res[f"c{c}"] = run_loadgen(d, max(n, 16 * c), c, "--fncall")
    return res
