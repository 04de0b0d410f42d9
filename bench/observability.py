"""What watching many sandboxes costs (issue 18), in one run:

- `dsec top` on N idle sandboxes: the time of one refresh (`GET /v1/sandboxes` with every
  sandbox's live usage, parsed and rendered by the CLI), target within a second at 1,000;
- the list request alone (p50 of repeated `GET /v1/sandboxes`);
- the server's CPU while the N sandboxes sit idle: the usage sampler reads each one's
  cgroups and writable layer once a second (share of one core, and per sandbox);
- the exec round trip in one more sandbox while the N are idle, beside the same with
  none (the sampler's and the table's cost on the request path).

    python3 bench/observability.py [--dsec-bin target/release/dsec] [--n 1000]

It starts its own `dsec serve` (tools/dsec_local.py) on loopback, imports the busybox
rootfs, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "python"), str(REPO / "tools")]
import dsec  # noqa: E402
from dsec_local import (  # noqa: E402
    DSEC_BIN,
    Server,
    make_busybox_rootfs,
    make_tempdir,
    percentile,
    raise_open_file_limit,
    safe_rmtree,
)

TARGET_TOP_REFRESH_S = 1.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def exec_p50(sb: dsec.Sandbox, n: int) -> float:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        sb.run(["/bin/true"])
        out.append((time.perf_counter() - t) * 1000)
    return percentile(out, 0.5)


async def create_idle(url: str, n: int) -> list[str]:
    async with dsec.AsyncClient(url, max_connections=32) as ac:
        sem = asyncio.Semaphore(32)

        async def one() -> str:
            async with sem:
                sb = await ac.create(image="busybox", memory_mb=64, pids=32, ttl_s=3600)
                return sb.id

        return list(await asyncio.gather(*(one() for _ in range(n))))


def top_refresh_s(binary: Path, url: str, interval: float) -> float:
    """Wall time of `dsec top --once` (two list requests `interval` apart and a render),
    less the interval, halved: one refresh."""
    t = time.perf_counter()
    out = subprocess.run(
        [str(binary), "top", "--once", "--interval", str(interval), "--url", url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    wall = time.perf_counter() - t
    assert out.startswith("ID"), out[:200]
    return (wall - interval) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsec-bin", type=Path, default=None)
    ap.add_argument("--n", type=int, default=1000, help="idle sandboxes")
    ap.add_argument("--exec-n", type=int, default=300, help="exec round trips per side")
    ap.add_argument("--idle-s", type=float, default=10.0, help="seconds of idle CPU measured")
    args = ap.parse_args()
    raise_open_file_limit()
    binary = args.dsec_bin or DSEC_BIN
    tmp = make_tempdir("dsec-obs-bench-")
    server = Server(tmp / "state", log_path=tmp / "server.log", binary=binary)
    try:
        server.start()
        rootfs = make_busybox_rootfs(tmp / "rootfs")
        with server.client() as c:
            c.import_image(str(rootfs), name="busybox")
            probe = c.create(image="busybox")
            exec_p50(probe, 30)
            alone = exec_p50(probe, args.exec_n)
            t = time.perf_counter()
            asyncio.run(create_idle(server.url, args.n))
            created_s = time.perf_counter() - t
            time.sleep(2)  # let the creates' own work settle
            before, t = cpu_seconds(server.pid), time.perf_counter()
            time.sleep(args.idle_s)
            idle_cpu = (cpu_seconds(server.pid) - before) / (time.perf_counter() - t)
            with_idle = exec_p50(probe, args.exec_n)
            lists = []
            for _ in range(20):
                t = time.perf_counter()
                listed = c.list()
                lists.append((time.perf_counter() - t) * 1000)
            assert len(listed) == args.n + 1, len(listed)
            refresh = min(top_refresh_s(binary, server.url, 0.5) for _ in range(3))
        ok = "✅" if refresh <= TARGET_TOP_REFRESH_S else "❌"
        rows: list[tuple[Any, ...]] = [
            ("metric", f"{args.n} idle", "none idle", "ratio", "target"),
            ("---",) * 5,
            (
                "`dsec top` refresh, s (list + parse + render; best of 3)",
                f"{refresh:.3f}",
                "-",
                "-",
                f"≤ {TARGET_TOP_REFRESH_S:.0f} s {ok}",
            ),
            (
                "`GET /v1/sandboxes` through the SDK, p50 ms (n=20)",
                f"{percentile(lists, 0.5):.1f}",
                "-",
                "-",
                "",
            ),
            (
                f"server CPU while idle, % of a core ({args.idle_s:.0f} s)",
                f"{idle_cpu * 100:.1f}",
                "-",
                "-",
                "",
            ),
            (
                "… per idle sandbox, µs of CPU per second",
                f"{idle_cpu * 1e6 / args.n:.1f}",
                "-",
                "-",
                "",
            ),
            (
                f"exec round trip in another sandbox, p50 ms (n={args.exec_n})",
                f"{with_idle:.2f}",
                f"{alone:.2f}",
                f"{with_idle / alone:.2f}x",
                "",
            ),
        ]
        print(
            f"Host: {os.uname().nodename}, {os.cpu_count()} CPUs, load average "
            f"{os.getloadavg()[0]:.2f}; {args.n} idle busybox sandboxes created in "
            f"{created_s:.1f} s; binary {binary}\n"
        )
        for row in rows:
            print("| " + " | ".join(str(x) for x in row) + " |")
    finally:
        server.stop()
        server.cleanup()
        safe_rmtree(tmp)


if __name__ == "__main__":
    main()
