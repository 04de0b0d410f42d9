"""The fleet's costs, side by side in one run (issue 13):

- placement decisions/s on one core with 160 edges in the table (the example
  `crates/dsec-fleet/examples/placement.rs`; target >= 20,000/s);
- create -> first exec and the exec round trip through an apiserver vs straight to the
  edge (targets: at most 1.2x, and at most +0.5 ms).

    python3 bench/fleet_bench.py [--dsec-bin target/release/dsec] [--n 40] [--exec-n 400]

It starts its own etcd, one `dsec edge` and one `dsec apiserver` on loopback
(tools/dsec_fleet.py), imports the busybox rootfs, and alternates direct and forwarded
rounds so that a busy machine hurts both alike. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "python"), str(REPO / "tools")]
import dsec  # noqa: E402
from dsec_fleet import Apiserver, Edge, Etcd  # noqa: E402
from dsec_local import make_busybox_rootfs, make_tempdir, percentile, safe_rmtree  # noqa: E402

TARGET_PLACEMENTS_PER_S = 20_000
TARGET_CREATE_RATIO = 1.2
TARGET_EXEC_EXTRA_MS = 0.5


def placement(release: bool) -> dict[str, Any]:
    argv = ["cargo", "run", "-q", "-p", "dsec-fleet", "--example", "placement"]
    if release:
        argv.insert(2, "--release")
    out = subprocess.run(
        ["taskset", "-c", "0", *argv, "--", "--edges", "160"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def create_first_exec(client: dsec.Client) -> float:
    t = time.perf_counter()
    sb = client.create(image="busybox")
    sb.run(["/bin/true"])
    ms = (time.perf_counter() - t) * 1000
    sb.stop()
    return ms


def exec_round_trips(client: dsec.Client, sid: str, n: int) -> list[float]:
    sb = client.get(sid)
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb.run(["/bin/true"])
        out.append((time.perf_counter() - t) * 1000)
    return out


def ok(met: bool) -> str:
    return "✅" if met else "❌"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsec-bin", type=Path, default=None)
    ap.add_argument("--n", type=int, default=40, help="create -> first exec rounds per side")
    ap.add_argument("--exec-n", type=int, default=400, help="exec round trips per side")
    ap.add_argument("--debug-placement", action="store_true", help="placement bench unoptimized")
    ap.add_argument("--no-placement", action="store_true", help="skip the placement bench")
    args = ap.parse_args()
    tmp = make_tempdir("dsec-fleet-bench-")
    procs: list[Any] = []
    etcd = Etcd(tmp / "etcd", log_path=tmp / "etcd.log")
    try:
        nan = float("nan")
        place = (
            {"keyless_per_s": nan, "keyed_per_s": nan}
            if args.no_placement
            else placement(release=not args.debug_placement)
        )
        etcd.start()
        kw: dict[str, Any] = {"binary": args.dsec_bin} if args.dsec_bin else {}
        edge = Edge(tmp / "edge", etcd=etcd.url, name="b1", log_path=tmp / "edge.log", **kw)
        procs.append(edge)
        edge.start()
        api = Apiserver(tmp / "api", etcd=etcd.url, log_path=tmp / "api.log", **kw)
        procs.append(api)
        api.start()
        api.wait_for_edges(["b1"])
        rootfs = make_busybox_rootfs(tmp / "rootfs")
        with edge.client() as direct, api.client() as through:
            direct.import_image(str(rootfs), name="busybox")
            create: dict[str, list[float]] = {"direct": [], "apiserver": []}
            for _ in range(3):  # warm-up: connections, image cache
                create_first_exec(direct)
                create_first_exec(through)
            for _ in range(args.n):
                create["direct"].append(create_first_exec(direct))
                create["apiserver"].append(create_first_exec(through))
            sb = direct.create(image="busybox")
            rtt: dict[str, list[float]] = {"direct": [], "apiserver": []}
            exec_round_trips(direct, sb.id, 20)
            exec_round_trips(through, sb.id, 20)
            for _ in range(args.exec_n // 50):
                rtt["direct"] += exec_round_trips(direct, sb.id, 50)
                rtt["apiserver"] += exec_round_trips(through, sb.id, 50)
            sb.stop()
        c_d, c_a = (percentile(create[k], 0.5) for k in ("direct", "apiserver"))
        e_d, e_a = (percentile(rtt[k], 0.5) for k in ("direct", "apiserver"))
        kind = "debug" if args.debug_placement else "release"
        rows = [
            ("metric", "apiserver", "direct", "ratio / diff", "target"),
            ("---",) * 5,
            (
                f"placement decisions/s, one core, 160 edges, keyless ({kind})",
                f"{place['keyless_per_s']:.0f}",
                "-",
                "-",
                f"≥ 20,000/s {ok(place['keyless_per_s'] >= TARGET_PLACEMENTS_PER_S)}",
            ),
            (
                f"placement decisions/s, keyed (rendezvous draw) ({kind})",
                f"{place['keyed_per_s']:.0f}",
                "-",
                "-",
                f"≥ 20,000/s {ok(place['keyed_per_s'] >= TARGET_PLACEMENTS_PER_S)}",
            ),
            (
                f"create → first exec p50 ms (n={args.n})",
                f"{c_a:.2f}",
                f"{c_d:.2f}",
                f"{c_a / c_d:.2f}x",
                f"≤ 1.2× {ok(c_a / c_d <= TARGET_CREATE_RATIO)}",
            ),
            (
                f"exec round trip p50 ms (n={len(rtt['direct'])})",
                f"{e_a:.3f}",
                f"{e_d:.3f}",
                f"+{e_a - e_d:.3f} ms",
                f"≤ +0.5 ms {ok(e_a - e_d <= TARGET_EXEC_EXTRA_MS)}",
            ),
            (
                "exec round trip p99 ms",
                f"{percentile(rtt['apiserver'], 0.99):.3f}",
                f"{percentile(rtt['direct'], 0.99):.3f}",
                "-",
                "",
            ),
        ]
        for r in rows:
            print("| " + " | ".join(r) + " |")
    finally:
        for p in reversed(procs):
            p.cleanup()
        etcd.stop()
        safe_rmtree(tmp)


if __name__ == "__main__":
    main()
