#!/usr/bin/env python3
"""How many idle container sandboxes one host holds, and what each costs (issue 15).

Starts its own `dsec serve` (release build unless --dsec-bin; admission opened wide, since
idle busybox sandboxes use a few MiB of the 512 MiB each is promised), then creates idle
sandboxes --batch at a time (32 concurrent creates from one AsyncClient) up to -n, and every
--every sandboxes records:

  - the creation rate over the last step (sandboxes/s)
  - host memory per sandbox: MemAvailable's drop since the start over the count, and the
    kernel's share of it (unreclaimable slab, per-cpu, kernel stacks, page tables)
  - network namespaces allocated (the `net_namespace` slab: live and not yet freed ones)
  - the server's open descriptors, and per sandbox since the start (the host's hard
    RLIMIT_NOFILE bounds an edge where the server lacks CAP_SYS_RESOURCE)
  - the exec round trip in one probe sandbox (sync SDK, `true`, p50 and p99)
  - `client.list()` and `GET /metrics` latency

then stops every sandbox and follows the host's recovery for --settle-s seconds
(namespaces and unreclaimable slab still allocated). Prints a Markdown table.

    sudo python3 bench/density.py -n 10000                 # network=False (no veth)
    sudo python3 bench/density.py -n 1000 --network        # networked sandboxes
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "bench"), str(REPO / "python"), str(REPO / "tools")]
from dsec_bench.common import CLEANUP, Dsec, log, prepare_rootfs  # noqa: E402
from dsec_bench.idle import stop_sandboxes  # noqa: E402


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0])
    return out


def slab_objects(name: str) -> int:
    """Allocated objects of one slab cache (0 when it is merged away or absent)."""
    with open("/proc/slabinfo") as f:
        for line in f:
            if line.startswith(name + " "):
                return int(line.split()[1])
    return 0


def settled_meminfo() -> dict[str, float]:
    """meminfo averaged over a second, after letting the host settle."""
    time.sleep(2)
    samples = []
    for _ in range(10):
        samples.append(meminfo())
        time.sleep(0.1)
    return {k: sum(s[k] for s in samples) / len(samples) for k in samples[0]}


KERNEL_FIELDS = ("SUnreclaim", "Percpu", "KernelStack", "PageTables")


def server_descriptors(d: Dsec) -> int:
    """The server's open descriptors (0 once it is gone)."""
    if d.server is None or not d.server.alive():
        return 0
    return len(os.listdir(f"/proc/{d.server.pid}/fd"))


def probe(d: Dsec, sb: Any, runs: int) -> dict[str, float]:
    ms = []
    for _ in range(runs):
        t = time.perf_counter()
        r = sb.run(["/bin/true"])
        ms.append((time.perf_counter() - t) * 1000)
        assert r.exit_code == 0, r
    ms.sort()
    t = time.perf_counter()
    listed = len(d.client.list())
    list_ms = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    with urllib.request.urlopen(f"{d.url}/metrics", timeout=60) as resp:
        resp.read()
    metrics_ms = (time.perf_counter() - t) * 1000
    return {
        "exec_p50_ms": statistics.median(ms),
        "exec_p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "list_ms": list_ms,
        "listed": listed,
        "metrics_ms": metrics_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-n", type=int, default=10000, help="idle sandboxes to hold (10000)")
    ap.add_argument("--batch", type=int, default=32, help="creates in flight (32)")
    ap.add_argument("--every", type=int, default=1000, help="record a row every N (1000)")
    ap.add_argument("--probe-n", type=int, default=200, help="exec round trips per row (200)")
    ap.add_argument("--network", action="store_true", help="network=True sandboxes")
    ap.add_argument("--memory-mb", type=int, default=None, help="memory_mb of each sandbox")
    ap.add_argument("--settle-s", type=int, default=60, help="follow the recovery this long")
    ap.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the host's clean page cache first (vm.drop_caches=1), so that what the\n"
        "run measures is not the kernel reclaiming other work's cache",
    )
    ap.add_argument("--dsec-bin", help="dsec binary (default target/release/dsec)")
    ap.add_argument("--rootfs", help="a busybox rootfs (default: built here)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `dsec serve` arg")
    args = ap.parse_args()
    args.trajectory_sync = "normal"
    try:
        run(args)
    finally:
        CLEANUP.run()


def run(args: argparse.Namespace) -> None:
    rootfs = prepare_rootfs(args.rootfs)
    if args.drop_caches:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    # Admission is not what is measured: 10,000 promises of 512 MiB on a 24 GiB host need
    # a ratio of ~240 (README, "Admission control").
    server_args = ["--memory-overcommit", "400", "--pids-overcommit", "400", *args.server_arg]
    d = Dsec(args, rootfs, server_args=server_args, name="density")
    labels = {**d.labels, "density": "1"}
    create_args: dict[str, Any] = {"image": d.image, "labels": labels, "network": args.network}
    if args.memory_mb:
        create_args["memory_mb"] = args.memory_mb
    quiet = d.client.create(image=d.image, labels=d.labels)
    d.track(quiet.id)
    probe(d, quiet, 20)  # warm the path
    base = settled_meminfo()
    base_netns = slab_objects("net_namespace")
    base_fds = server_descriptors(d)
    rows: list[dict[str, Any]] = [
        {
            "count": 0,
            "rate": None,
            **probe(d, quiet, args.probe_n),
            "netns": base_netns,
            "fds": base_fds,
        }
    ]
    ids: list[str] = []
    failure: str | None = None

    async def create_step(todo: int) -> None:
        nonlocal failure
        aclient = d.async_client()
        sem = asyncio.Semaphore(args.batch)

        async def one() -> None:
            nonlocal failure
            async with sem:
                if failure:
                    return
                try:
                    sb = await aclient.create(**create_args)
                except Exception as e:
                    failure = failure or f"{type(e).__name__}: {e}"
                    return
                d.track(sb.id)
                ids.append(sb.id)

        try:
            await asyncio.gather(*(one() for _ in range(todo)))
        finally:
            await aclient.close()

    started = time.perf_counter()
    while len(ids) < args.n and not failure:
        step = min(args.every, args.n - len(ids))
        before = len(ids)
        t0 = time.perf_counter()
        asyncio.run(create_step(step))
        rate = (len(ids) - before) / (time.perf_counter() - t0)
        mem = settled_meminfo()
        row = {
            "count": len(ids),
            "rate": rate,
            "mib_each": (base["MemAvailable"] - mem["MemAvailable"]) / 1024 / max(1, len(ids)),
            "kernel_mib_each": sum(mem[k] - base[k] for k in KERNEL_FIELDS)
            / 1024
            / max(1, len(ids)),
            "sunreclaim_mib": mem["SUnreclaim"] / 1024,
            "netns": slab_objects("net_namespace"),
            "server_rss_mib": (d.server_rss_kib() or 0) / 1024,
            "fds": (fds := server_descriptors(d)),
            "fds_each": (fds - base_fds) / max(1, len(ids)),
            **probe(d, quiet, args.probe_n),
        }
        rows.append(row)
        log(
            f"{row['count']} idle: {rate:.0f}/s, {row['mib_each']:.2f} MiB each "
            f"(kernel {row['kernel_mib_each']:.2f}), netns {row['netns']}, "
            f"server fds {row['fds']} ({row['fds_each']:.2f} each), "
            f"exec p50 {row['exec_p50_ms']:.2f} ms, list {row['list_ms']:.0f} ms, "
            f"/metrics {row['metrics_ms']:.0f} ms"
        )
    held_s = time.perf_counter() - started
    if failure:
        log(f"creation stopped at {len(ids)}: {failure}")

    log(f"stopping {len(ids)} sandboxes")
    t0 = time.perf_counter()

    stop_sandboxes(d, ids, args.batch)
    stop_s = time.perf_counter() - t0
    settle: list[tuple[float, int, float]] = []
    t0 = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - t0
        settle.append((elapsed, slab_objects("net_namespace"), meminfo()["SUnreclaim"] / 1024))
        if elapsed >= args.settle_s or settle[-1][1] <= base_netns + 1:
            break
        time.sleep(2)
    report(args, rows, held_s, stop_s, settle, base, failure, len(ids))


def report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    held_s: float,
    stop_s: float,
    settle: list[tuple[float, int, float]],
    base: dict[str, float],
    failure: str | None,
    made: int,
) -> None:
    kind = "network=True" if args.network else "network=False"
    print(f"\n### {made} idle container sandboxes, {kind}, created {args.batch} at a time\n")
    print(
        "| held | creates/s (step) | host MiB each | kernel MiB each | netns allocated "
        "| server RSS MiB | server fds (each) | exec p50 / p99 ms | list() ms | /metrics ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = f"{r['rate']:.0f}" if r["rate"] else "-"
        each = f"{r['mib_each']:.2f}" if "mib_each" in r else "-"
        kern = f"{r['kernel_mib_each']:.2f}" if "kernel_mib_each" in r else "-"
        rss = f"{r['server_rss_mib']:.0f}" if "server_rss_mib" in r else "-"
        fds = f"{r['fds']} ({r['fds_each']:.2f})" if "fds_each" in r else str(r["fds"])
        print(
            f"| {r['count']} | {rate} | {each} | {kern} | {r['netns']} | {rss} | {fds} "
            f"| {r['exec_p50_ms']:.2f} / {r['exec_p99_ms']:.2f} | {r['list_ms']:.0f} "
            f"| {r['metrics_ms']:.0f} |"
        )
    print(f"\ncreated and held in {held_s:.0f} s; stopped in {stop_s:.0f} s")
    if failure:
        print(f"creation stopped at {made}: {failure}")
    first, last = settle[0], settle[-1]
    print(
        f"after the stop: netns allocated {first[1]} → {last[1]} in {last[0]:.0f} s; "
        f"unreclaimable slab {first[2]:.0f} → {last[2]:.0f} MiB "
        f"(before the run {base['SUnreclaim'] / 1024:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
