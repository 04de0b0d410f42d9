"""What the files API costs, side by side for two `dsec` binaries in one run.

Since issue 20 a sandbox's files are read and written by its init over the control channel
(a round trip per chunk) instead of by the edge through /proc/<init>/root: this measures
what that costs a small file (a tight loop of `read_file`/`write_file` of 1 KiB) and a
large one (64 MiB), and what the server's RSS grows by meanwhile.

    python3 bench/files_bench.py --base /tmp/dsec-main --dsec-bin target/release/dsec

Each binary gets a server of its own (started and removed by the bench's `Dsec`), one
sandbox, the same data; runs alternate between the two so that a busy machine hurts both
alike. Prints a markdown table with the ratio new / base.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "python"), str(REPO / "tools"), str(REPO / "bench")]
from dsec_bench import common, report  # noqa: E402  (the bench's server and image handling)
from dsec_local import percentile  # noqa: E402

MIB = 1 << 20


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def rss_mib(d: common.Dsec) -> float:
    return (d.server_rss_kib() or 0) / 1024


def measure(d: common.Dsec, small_n: int, big_n: int) -> dict[str, Any]:
    sb = d.client.create(image=d.image, disk_mb=512, memory_mb=1024)
    try:
        small = os.urandom(1024)
        big = os.urandom(64 * MIB)
        sb.write_file("/tmp/small", small)
        sb.write_file("/tmp/big", big)
        for _ in range(20):  # warm-up: connections, page cache
            sb.read_file("/tmp/small")
        res: dict[str, Any] = {}
        rss0 = rss_mib(d)
        res["read_1k"] = percentile(timed(lambda: sb.read_file("/tmp/small"), small_n), 0.5)
        res["write_1k"] = percentile(
            timed(lambda: sb.write_file("/tmp/small", small), small_n), 0.5
        )
        res["write_64m"] = percentile(timed(lambda: sb.write_file("/tmp/big", big), big_n), 0.5)
        got: list[bytes] = []
        res["read_64m"] = percentile(
            timed(lambda: got.append(sb.read_file("/tmp/big")), big_n), 0.5
        )
        assert hashlib.sha256(got[-1]).digest() == hashlib.sha256(big).digest()
        res["rss_growth_mib"] = rss_mib(d) - rss0
        return res
    finally:
        sb.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the dsec binary to compare against")
    p.add_argument("--dsec-bin", default=None, help="the dsec binary under test")
    p.add_argument("--rootfs", default=None)
    p.add_argument("--small-n", type=int, default=500)
    p.add_argument("--big-n", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    rootfs = common.prepare_rootfs(args.rootfs)
    servers: dict[str, common.Dsec] = {}
    results: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
    try:
        for name, exe in (("base", args.base), ("new", args.dsec_bin)):
            ns = argparse.Namespace(dsec_bin=exe, trajectory_sync="normal")
            servers[name] = common.Dsec(ns, rootfs, ["--max-upload-mb", "80"], name=name)
        for _ in range(args.rounds):
            for name, d in servers.items():
                common.log(f"files: {name}")
                results[name].append(measure(d, args.small_n, args.big_n))
    finally:
        common.CLEANUP.run()
    rows = [
        ("read_file 1 KiB, p50 ms", "read_1k"),
        ("write_file 1 KiB, p50 ms", "write_1k"),
        ("read_file 64 MiB, p50 ms", "read_64m"),
        ("write_file 64 MiB, p50 ms", "write_64m"),
        ("server RSS growth, MiB", "rss_growth_mib"),
    ]
    print("| files API | base | new | new / base |")
    print("|---|---|---|---|")
    for label, key in rows:
        base = min(r[key] for r in results["base"])
        new = min(r[key] for r in results["new"])
        print(f"| {label} | {report.fmt(base)} | {report.fmt(new)} | {report.ratio(new, base)} |")
    for name, d in servers.items():
        print(f"{name}: {d.server.binary if d.server else d.url}")
    print(f"best of {args.rounds} rounds; host: {report.host_description()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
