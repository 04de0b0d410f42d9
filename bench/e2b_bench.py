"""The e2b SDK against dsec beside dsec's own SDK, in one run on one server: the `e2b` part
of bench/bench.py alone (see bench/dsec_bench/e2b.py).

    python3 bench/e2b_bench.py [--dsec-bin target/release/dsec] [--n 100]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "python"), str(REPO / "tools"), str(REPO / "bench")]
from dsec_bench import common, report  # noqa: E402
from dsec_bench.e2b import bench_e2b, table  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dsec-bin", default=None, help="the dsec binary [target/release/dsec]")
    p.add_argument("--rootfs", default=None, help="a root filesystem with bash [Debian's]")
    p.add_argument("--n", type=int, default=100, help="iterations of each [100]")
    args = p.parse_args()
    args.trajectory_sync = "normal"
    try:
        r = bench_e2b(args, args.n, Path(args.rootfs) if args.rootfs else None)
    finally:
        common.CLEANUP.run()
    if r is None:
        sys.exit("the e2b SDK is not installed: pip install e2b==2.63.0")
    print("\n".join(table(r)))
    print(f"host: {report.host_description()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
