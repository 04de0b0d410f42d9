"""The e2b SDK against dsec beside dsec's own SDK, in one run on one server.

    python3 bench/e2b_bench.py [--dsec-bin target/release/dsec] [--n 30]

One `dsec serve --e2b-listen --e2b-envd-listen`, one image; each iteration times, through
the real e2b SDK (`pip install e2b==2.63.0`), `Sandbox.create(image)` →
`commands.run("true")` → `kill()`, and through dsec's SDK `client.create(image=...)` →
`sb.run("true")` → `sb.stop()`, alternating so that a busy machine hurts both alike.
Prints p50/p90 of each and the ratio e2b / dsec (target ≤ 1.5).

The e2b SDK runs every command as `/bin/bash -l -c CMD` (a login shell reading
/etc/profile), where dsec's `sb.run("true")` runs `/bin/sh -c true`: a third cycle runs
dsec's SDK with the e2b SDK's argv, to tell what the protocol costs from what the shell
does. The image needs bash: by default the suite's Debian test image
(scripts/make-debian-rootfs.sh, $DSEC_TEST_DEBIAN_ROOTFS), built if missing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "python"), str(REPO / "tools"), str(REPO / "bench")]
from dsec_bench import common, report  # noqa: E402  (the bench's server and image handling)
from dsec_local import free_port, percentile  # noqa: E402

DEBIAN_ROOTFS = Path(os.environ.get("DSEC_TEST_DEBIAN_ROOTFS", "/var/tmp/dsec-test-debian-rootfs"))


def debian_rootfs() -> Path:
    if not (DEBIAN_ROOTFS / "bin/bash").exists():
        common.log(f"building {DEBIAN_ROOTFS} with scripts/make-debian-rootfs.sh")
        subprocess.run(
            [str(REPO / "scripts/make-debian-rootfs.sh"), str(DEBIAN_ROOTFS)], check=True
        )
    return DEBIAN_ROOTFS


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dsec-bin", default=None, help="the dsec binary [target/release/dsec]")
    p.add_argument("--rootfs", default=None, help="a root filesystem with bash [Debian's]")
    p.add_argument("--n", type=int, default=30, help="iterations of each [30]")
    args = p.parse_args()
    try:
        from e2b import Sandbox
    except ImportError:
        sys.exit("the e2b SDK is not installed: pip install e2b==2.63.0")
    rootfs = Path(args.rootfs) if args.rootfs else debian_rootfs()
    api_port, envd_port = free_port(), free_port()
    e2b_opts: dict[str, Any] = {
        "api_url": f"http://127.0.0.1:{api_port}",
        "sandbox_url": f"http://127.0.0.1:{envd_port}",
        "api_key": "e2b_" + "0" * 40,
    }
    times: dict[str, list[float]] = {"e2b": [], "dsec": [], "dsec_bash": []}
    try:
        ns = argparse.Namespace(dsec_bin=args.dsec_bin, trajectory_sync="normal")
        server_args = ["--e2b-listen", f"127.0.0.1:{api_port}"]
        server_args += ["--e2b-envd-listen", f"127.0.0.1:{envd_port}"]
        d = common.Dsec(ns, rootfs, server_args, name="e2b")

        def e2b_cycle() -> None:
            sb = Sandbox.create(d.image, timeout=120, metadata=d.labels, **e2b_opts)
            sb.commands.run("true")
            sb.kill()

        def dsec_cycle(cmd: str | list[str]) -> None:
            sb = d.client.create(image=d.image, labels=d.labels)
            d.track(sb.id)
            sb.run(cmd)
            common.stop_sandbox(d, sb)

        cycles: dict[str, Callable[[], None]] = {
            "e2b": e2b_cycle,
            "dsec": lambda: dsec_cycle("true"),
            "dsec_bash": lambda: dsec_cycle(["/bin/bash", "-l", "-c", "true"]),
        }
        for fn in cycles.values():  # warm-up: connections, the image's first mount
            fn()
        for i in range(args.n):
            for name, fn in cycles.items():
                t = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t) * 1000)
            if i % 10 == 9:
                common.log(f"e2b bench: {i + 1}/{args.n}")
        binary = d.server.binary if d.server else d.url
    finally:
        common.CLEANUP.run()
    p50 = {k: percentile(v, 0.5) for k, v in times.items()}
    p90 = {k: percentile(v, 0.9) for k, v in times.items()}
    rows = [
        ("e2b SDK (2.63.0) against dsec", "e2b"),
        ('dsec SDK, `sb.run("true")`', "dsec"),
        ('dsec SDK, `sb.run(["/bin/bash", "-l", "-c", "true"])`', "dsec_bash"),
    ]
    print('| create → run("true") → kill | p50 ms | p90 ms | e2b / this, p50 |')
    print("|---|---|---|---|")
    for label, key in rows:
        ratio = report.ratio(p50["e2b"], p50[key])
        print(f"| {label} | {report.fmt(p50[key])} | {report.fmt(p90[key])} | {ratio} |")
    print(
        f"n={args.n} each, alternating; {binary}; image {rootfs}; host: {report.host_description()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
