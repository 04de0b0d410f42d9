#!/usr/bin/env python3
"""Create → first exec with sandbox networking off, on, and with an allow-list (issue 7),
on the container backend or (`--backend microvm|vm`, issue 19) a VM backend, whose creates
are boot-template restores.

Starts its own `dsec serve` (release build by default; $DSEC_BIN) on a scratch state dir
with an address pool no host route overlaps, imports a busybox rootfs, then times about N
sequential `create` → `run(['/bin/true'])` for each setting, in rounds of 10 per setting
(rotating order); sandboxes are stopped between rounds, never between timed creates (a
network namespace's teardown is asynchronous and would land in the next create). Prints
a Markdown table, stop latency included.

    sudo python3 bench/net_bench.py [-n 200] [--backend container|microvm|vm]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
import dsec  # noqa: E402

SETTINGS: dict[str, bool | dict[str, list[str]]] = {
    "network=False": False,
    "network=True": True,
    "allow-list (IP, CIDR:port, 2 names)": {
        "allow": ["192.0.2.10", "198.51.100.0/24:443", "pypi.org", "*.pythonhosted.org"]
    },
}


def free_pool() -> str:
    routes = json.loads(
        subprocess.run(["ip", "-j", "-4", "route"], capture_output=True, text=True).stdout
    )
    nets = [
        ipaddress.ip_network(r["dst"], strict=False)
        for r in routes
        if r.get("dst") not in (None, "default")
    ]
    for second in range(200, 250):
        net = ipaddress.ip_network(f"10.{second}.0.0/16")
        if not any(net.overlaps(n) for n in nets):
            return str(net)
    raise SystemExit("no free 10.x.0.0/16 for the pool")


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--backend", default="container")
    args = ap.parse_args()
    exe = os.environ.get("DSEC_BIN", str(REPO / "target/release/dsec"))
    tmp = Path(tempfile.mkdtemp(prefix="dsec-netbench-"))
    rootfs = tmp / "rootfs"
    subprocess.run(
        [str(REPO / "scripts/make-busybox-rootfs.sh"), str(rootfs)], check=True, capture_output=True
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp / "server.log", "wb")
    server = subprocess.Popen(
        [
            exe,
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--state-dir",
            str(tmp / "state"),
            "--net-pool",
            free_pool(),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        client = dsec.Client(f"http://127.0.0.1:{port}")
        for _ in range(100):
            try:
                client.images()
                break
            except Exception:
                time.sleep(0.1)
        client.import_image(str(rootfs), name="busybox")
        times: dict[str, list[float]] = {k: [] for k in SETTINGS}
        stops: dict[str, list[float]] = {k: [] for k in SETTINGS}
        # Rounds of `batch` creations per setting, in rotating order; each round's
        # sandboxes are stopped only after the round, so a stop (and the kernel's
        # asynchronous teardown of a network namespace) never lands inside a timed create.
        batch = min(10, args.n)
        for rnd in range(args.n // batch + 1):
            order = list(SETTINGS.items())
            k = rnd % len(order)
            for name, network in order[k:] + order[:k]:
                made = []
                for _ in range(batch):
                    t0 = time.perf_counter()
                    sb = client.create(image="busybox", backend=args.backend, network=network)
                    sb.run(["/bin/true"])
                    dt = (time.perf_counter() - t0) * 1000
                    made.append(sb)
                    if rnd > 0:  # the first round warms up
                        times[name].append(dt)
                for sb in made:
                    t0 = time.perf_counter()
                    sb.stop()
                    stops[name].append((time.perf_counter() - t0) * 1000)
                time.sleep(0.5)  # let the kernel finish tearing namespaces down
        base = statistics.median(times["network=False"])
        print(
            f"{args.backend}: create → first exec, {len(times['network=False'])} sequential "
            "runs each\n"
        )
        print("| setting | p50 ms | p99 ms | p50 vs network=False | stop p50 ms |")
        print("|---|---|---|---|---|")
        for name, ms in times.items():
            print(
                f"| {name} | {statistics.median(ms):.2f} | {pct(ms, 0.99):.2f} | "
                f"{statistics.median(ms) / base:.2f}x | {statistics.median(stops[name]):.2f} |"
            )
    finally:
        os.kill(server.pid, signal.SIGTERM)
        server.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
