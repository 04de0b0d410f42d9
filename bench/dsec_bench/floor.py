"""`floor`: bench/floor.c, the cheapest container this kernel can make: clone(new namespaces)
+ private / + overlay on tmpfs + pivot_root + exec /bin/true."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .common import BENCH_DIR, OUT_DIR, log, make_tempdir, run_cmd


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
        out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
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
