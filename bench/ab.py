#!/usr/bin/env python3
"""A/B of two dsec binaries in one run: create -> first exec, creations/s with 16 in
flight, the exec round trip in a container sandbox, and the fncall round trip.

    python3 bench/ab.py --before /path/to/old/dsec --after target/release/dsec [--n 200]
    python3 bench/ab.py --before target/release/dsec --before-args=--no-events \
        --after target/release/dsec        # what the event stream and live usage cost

Starts one `dsec serve` per binary (temporary state directories, loopback ports, private
address pools), imports the same busybox rootfs into both, and interleaves the
measurements (one of each server in turn) so that a busy host slows both alike. Prints a
markdown table with p50/p90 per binary and the after/before ratio of the p50s. Stops both
servers (SIGTERM, by pid) and removes its temporary directories at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# This checkout's SDK and host helpers, ahead of any installed copy.
sys.path[:0] = [str(REPO / "python"), str(REPO / "tools")]

import dsec  # noqa: E402
from dsec_local import Server, make_busybox_rootfs, make_tempdir, percentile, safe_rmtree  # noqa: E402

POOLS = ("10.237.0.0/16", "10.238.0.0/16")


def create_first_exec_ms(client: dsec.Client) -> float:
    t0 = time.perf_counter()
    sb = client.create(image="busybox")
    try:
        r = sb.run(["true"])
        assert r.exit_code == 0, r.stderr
        return (time.perf_counter() - t0) * 1e3
    finally:
        sb.stop()


async def _cycles(url: str, n: int, in_flight: int) -> float:
    """create -> first exec -> stop, ``n`` times with ``in_flight`` at once: cycles/s."""
    gate = asyncio.Semaphore(in_flight)

    async def one(c: dsec.AsyncClient) -> None:
        async with gate:
            async with c.create(image="busybox") as sb:
                r = await sb.run(["true"])
                assert r.exit_code == 0, r.stderr

    async with dsec.AsyncClient(url) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for _ in range(n)))
        return n / (time.perf_counter() - t0)


def cycles_per_s(url: str, n: int, in_flight: int = 16) -> float:
    return asyncio.run(_cycles(url, n, in_flight))


def call_ms(handle: dsec.Sandbox) -> float:
    t0 = time.perf_counter()
    r = handle.run(["true"])
    assert r.exit_code == 0, r.stderr
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--before-args", default="", help="more `dsec serve` options for before")
    ap.add_argument("--after-args", default="", help="more `dsec serve` options for after")
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    tmp = make_tempdir("dsec-ab-")
    servers: list[Server] = []
    try:
        rootfs = make_busybox_rootfs(tmp / "rootfs")
        sides = zip(
            (args.before, args.after), (args.before_args, args.after_args), POOLS, strict=True
        )
        for i, (binary, more, pool) in enumerate(sides):
            s = Server(
                tmp / f"state-{i}",
                log_path=tmp / f"server-{i}.log",
                extra_args=["--net-pool", pool, *shlex.split(more)],
                binary=binary,
            )
            servers.append(s)
            s.start(60)
        clients = [s.client() for s in servers]
        for c in clients:
            c.import_image(str(rootfs), name="busybox")
        handles = [c.create(backend="fncall", image="busybox") for c in clients]
        containers = [c.create(image="busybox") for c in clients]
        for h in handles + containers:  # warm the pools and the paths
            for _ in range(10):
                call_ms(h)
        create: list[list[float]] = [[], []]
        call: list[list[float]] = [[], []]
        exec_: list[list[float]] = [[], []]
        # One measure at a time: a stopped sandbox's clean-up must not overlap the calls.
        for _ in range(args.n):
            for i in range(2):
                create[i].append(create_first_exec_ms(clients[i]))
        time.sleep(2)
        # Rounds of 32 cycles each, the servers taking turns.
        rates: list[list[float]] = [[], []]
        for _ in range(max(2, args.n // 32)):
            for i in range(2):
                rates[i].append(cycles_per_s(servers[i].url, 32))
        time.sleep(2)
        for _ in range(args.n):
            for i in range(2):
                call[i].append(call_ms(handles[i]))
        for _ in range(args.n):
            for i in range(2):
                exec_[i].append(call_ms(containers[i]))
        for h in handles + containers:
            h.stop()
        for c in clients:
            c.close()
        print(
            f"| measure (n={args.n}, interleaved) | before p50 / p90 ms | after p50 / p90 ms "
            "| after/before (p50) |"
        )
        print("|---|---|---|---|")
        for name, series in (
            ("create → first exec", create),
            ("container exec round trip", exec_),
            ("fncall round trip", call),
        ):
            b50, b90 = percentile(series[0], 0.5), percentile(series[0], 0.9)
            a50, a90 = percentile(series[1], 0.5), percentile(series[1], 0.9)
            print(f"| {name} | {b50:.2f} / {b90:.2f} | {a50:.2f} / {a90:.2f} | {a50 / b50:.2f} |")
        b, a = percentile(rates[0], 0.5), percentile(rates[1], 0.5)
        name = "creations/s, 16 in flight (median of rounds of 32)"
        print(f"| {name} | {b:.1f} | {a:.1f} | {a / b:.2f} |")
    finally:
        for s in servers:
            s.cleanup()
        safe_rmtree(tmp)


if __name__ == "__main__":
    main()
