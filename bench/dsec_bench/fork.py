"""`fork`: fork(8) and a snapshot of a container that has written 100 MB."""

from __future__ import annotations

import time
from typing import Any

from .common import TAG, Dsec


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
