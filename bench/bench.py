#!/usr/bin/env python3
"""dsec benchmarks, side by side with runc, Docker and the raw kernel floor.

One run measures, on the same busybox root filesystem:

  create  dsec: create -> first exec of /bin/true -> stop, through the Python SDK;
          sequential p50/p99, and creations/s with 16 and 32 concurrent clients
          (AsyncClient)
  runc    `runc run` of the same rootfs running /bin/true: sequential p50/p99, and
          containers/s at the same concurrencies
  docker  `docker run --rm --network none IMAGE /bin/true` (the rootfs `docker import`ed),
          if a Docker daemon answers; else "docker: no daemon"
  dsec-docker  dsec's `backend="docker"` (the same rootfs `docker import`ed): create ->
          first exec -> stop, and exec round trips, beside the native numbers above;
          if a Docker daemon answers
  floor   bench/floor.c: clone(new ns) + private / + overlay + pivot_root + exec /bin/true,
          the cheapest container this kernel can make
  exec    round trip of `/bin/true` in one running dsec sandbox over HTTP (sync Client)
  trajectory-stores  the exec round trip of a trajectory sandbox with the log on SQLite
          and, on a second server, in a PostgreSQL cluster started for the run
          (--trajectory-db postgres://); if PostgreSQL is installed
  idle    host memory per idle dsec sandbox: MemAvailable before and after creating 500
  vm      the microvm and vm backends (QEMU guests) beside the container backend, in the
          same run: create (boot-template restore) -> first exec, sequential; the same on
          a second server with `--vm-boot cold`; the template's build (cold boot + save);
          exec round trips of `true`; host memory per idle VM (MemAvailable drop, and the
          QEMUs' RSS); the accelerator (kvm or tcg)
  sdk     the Python SDK beside the lean Rust client (bench/loadgen) in the same run: its
          own CPU per request (sync, asyncio; httpx, http.client, aiohttp beside it),
          creations/s and fncall calls/s at concurrency 32, the sync client.call round
          trip, and 1,000 sandboxes active at once from one AsyncClient
  e2b     (only when asked: --only e2b, or --e2b) the e2b SDK against dsec's E2B API
          beside dsec's own SDK on a server of its own: create -> run("true") -> kill,
          --e2b-n times each, step by step, with the client's CPU; the ratio (target
          <= 1.5x). Needs the e2b SDK (pip install e2b==2.63.0) and an image with bash
          (the suite's Debian rootfs, built if missing)

Usage (as root, from the repository root):

  python3 bench/bench.py                       # everything
  python3 bench/bench.py --only floor,runc     # some parts
  python3 bench/bench.py --n 100 --idle-n 200  # smaller
  python3 bench/bench.py --only vm             # VM backends (after scripts/build-agent.sh)
  python3 bench/bench.py --only sdk            # the SDK (after cargo build --release)
  python3 bench/bench.py --only e2b --e2b-n 300  # the e2b SDK's ratio (issue 17)

dsec: uses $DSEC_URL if set (that server must see the same filesystem); otherwise starts
`target/release/dsec serve` (or --dsec-bin) on a temporary state directory and stops it at
the end. The vm part also starts a second server, with `--vm-boot cold`, and stops it when
it is done. The results are printed as markdown on stdout (progress goes to stderr); nothing
is written anywhere else. Copy the table into bench/RESULTS.md by hand.

Everything the run creates (sandboxes, the imported image, runc containers under a private
runc --root, docker containers and image, temporary directories, the servers it started and
their QEMUs) is removed at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parent.parent
# This checkout's SDK and host helpers, ahead of any installed copy: the bench measures them.
sys.path[:0] = [str(REPO / "python"), str(REPO / "tools")]

from dsec_bench.common import CLEANUP, Dsec, log, prepare_rootfs  # noqa: E402
from dsec_bench.create import bench_dsec_create, bench_dsec_loadgen  # noqa: E402
from dsec_bench.e2b import bench_e2b  # noqa: E402
from dsec_bench.exec import bench_dsec_docker, bench_dsec_exec  # noqa: E402
from dsec_bench.floor import bench_floor  # noqa: E402
from dsec_bench.fncall import bench_dsec_fncall  # noqa: E402
from dsec_bench.fork import bench_dsec_fork  # noqa: E402
from dsec_bench.idle import bench_dsec_idle  # noqa: E402
from dsec_bench.report import report, rounded  # noqa: E402
from dsec_bench.runtimes import bench_docker, bench_runc  # noqa: E402
from dsec_bench.sdk import bench_sdk  # noqa: E402
from dsec_bench.trajectory import bench_dsec_trajectory, bench_trajectory_stores  # noqa: E402
from dsec_bench.vm import bench_vm  # noqa: E402

PARTS = [
    "create",
    "loadgen",
    "fncall",
    "fork",
    "runc",
    "docker",
    "dsec-docker",
    "floor",
    "exec",
    "trajectory",
    "trajectory-stores",
    "idle",
    "vm",
    "sdk",
    "e2b",
]

#: The parts run unless --only names others: e2b needs a package and an image of its own.
DEFAULT_PARTS = [p for p in PARTS if p != "e2b"]

#: The parts that need the shared dsec server (e2b starts one of its own).
DSEC_PARTS = set(PARTS) - {"runc", "docker", "floor", "e2b"}


def _sigterm(signum: int, frame: Any) -> NoReturn:
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--only",
        default=",".join(DEFAULT_PARTS),
        help=f"comma-separated parts to run, of: {','.join(PARTS)} (default: all but e2b)",
    )
    ap.add_argument("--e2b", action="store_true", help="also run the e2b part")
    ap.add_argument("--e2b-n", type=int, default=200, help="e2b: cycles of each (200)")
    ap.add_argument(
        "--n",
        type=int,
        default=200,
        help="sequential runs per measurement (default 200)",
    )
    ap.add_argument("--concurrency", default="16,32", help="concurrency levels (default 16,32)")
    ap.add_argument("--exec-n", type=int, default=500, help="exec round trips (default 500)")
    ap.add_argument("--idle-n", type=int, default=500, help="idle sandboxes (default 500)")
    ap.add_argument(
        "--active-n", type=int, default=1000, help="sdk: sandboxes active at once (1000)"
    )
    ap.add_argument("--vm-n", type=int, default=10, help="vm: restores per backend (10)")
    ap.add_argument("--vm-cold-n", type=int, default=4, help="vm: cold boots per backend (4)")
    ap.add_argument(
        "--vm-exec-n", type=int, default=100, help="vm: exec round trips per backend (100)"
    )
    ap.add_argument("--vm-idle-n", type=int, default=8, help="vm: idle VMs per backend (8)")
    ap.add_argument("--vm-fork-n", type=int, default=3, help="vm: fork(8) rounds per backend (3)")
    ap.add_argument(
        "--vm-many-n",
        type=int,
        default=100,
        help="vm: idle microVMs held at once, then one exec in each (100; 0: skip)",
    )
    ap.add_argument("--rootfs", help="use this busybox rootfs instead of building one")
    ap.add_argument(
        "--trajectory-sync",
        choices=["full", "normal"],
        default="normal",
        help="the server's trajectory log fsync policy (dsec serve --trajectory-sync)",
    )
    ap.add_argument("--dsec-bin", help="dsec binary to start (default target/release/dsec)")
    ap.add_argument(
        "--json",
        action="store_true",
        help="also print the raw results as one JSON line",
    )
    args = ap.parse_args()

    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    if args.e2b and "e2b" not in parts:
        parts.append("e2b")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {PARTS}")
    cs = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if os.geteuid() != 0:
        sys.exit("bench.py needs root (containers)")

    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    res: dict[str, Any] = {}
    notes: list[str] = []
    rc = 0
    try:
        rootfs = prepare_rootfs(args.rootfs)
        server = Dsec(args, rootfs) if DSEC_PARTS.intersection(parts) else None
        if server is not None and server.debug_build:
            notes.append("dsec ran from the DEBUG build (target/debug/dsec): not representative.")

        def d() -> Dsec:
            assert server is not None, "a dsec part without a server"
            return server

        steps: list[tuple[str, Callable[[], Any]]] = [
            ("floor", lambda: bench_floor(rootfs, args.n, cs)),
            ("runc", lambda: bench_runc(rootfs, args.n, cs)),
            ("docker", lambda: bench_docker(rootfs, args.n, cs)),
            ("create", lambda: bench_dsec_create(d(), args.n, cs)),
            (
                "dsec-docker",
                lambda: bench_dsec_docker(d(), rootfs, args.n, args.exec_n),
            ),
            ("loadgen", lambda: bench_dsec_loadgen(d(), args.n, cs)),
            ("fncall", lambda: bench_dsec_fncall(d(), args.n, cs)),
            ("fork", lambda: bench_dsec_fork(d())),
            ("exec", lambda: bench_dsec_exec(d(), args.exec_n)),
            ("trajectory", lambda: bench_dsec_trajectory(d(), args.exec_n)),
            (
                "trajectory-stores",
                lambda: bench_trajectory_stores(d(), args, rootfs, args.exec_n),
            ),
            ("idle", lambda: bench_dsec_idle(d(), args.idle_n)),
            ("vm", lambda: bench_vm(d(), args, res)),
            ("sdk", lambda: bench_sdk(d(), args.n, args.exec_n, args.active_n)),
            ("e2b", lambda: bench_e2b(args, args.e2b_n)),
        ]
        for name, fn in steps:
            if name not in parts:
                continue
            try:
                r = fn()
            except KeyboardInterrupt:
                raise
            except Exception as e:  # one part failing must not hide the others
                log(f"{name}: FAILED: {type(e).__name__}: {e}")
                notes.append(f"{name} failed: {type(e).__name__}: {e}")
                rc = 1
                continue
            if r is None:
                if name == "docker":
                    notes.append("docker: no daemon (skipped).")
                if name == "trajectory-stores":
                    notes.append("trajectory-stores: PostgreSQL is not installed (skipped).")
                if name == "e2b":
                    notes.append("e2b: the e2b SDK is not installed (skipped).")
                continue
            res[name] = r
            log(f"{name}: {json.dumps(r, default=str)}")
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
        rc = 130
    finally:
        CLEANUP.run()
    if res:
        print(report(res, args, cs, notes))
        if args.json:
            print(json.dumps(rounded(res), default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
