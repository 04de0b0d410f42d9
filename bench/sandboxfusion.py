#!/usr/bin/env python3
"""SandboxFusion's /run_code on dsec, beside what SandboxFusion itself does (issue 16).

One run measures, side by side:

  run_code   `print(1)` in python through dsec's POST /run_code (the dedicated listener,
             one keep-alive connection per client thread): requests/s and latency at
             concurrency 1 and 32
  bare       the same program the way SandboxFusion's default runner runs it: a fresh
             temporary directory, the file written there, `python FILE` through
             /bin/bash as an asyncio subprocess of this process, no isolation. With
             Debian's /usr/bin/python3 (the grader image's interpreter, same package)
  fncall     the same program as a dsec fncall through the Python SDK
             (`client.call(["python3", FILE], image="grader", files=...)`)
  cpp        a C++ hello world, compile + run: /run_code (`g++ -std=c++17 ... -o test`,
             `./test`) beside bare `g++` and `./test` in a fresh temporary directory

Ratios are printed against the bare subprocess. Targets: ≥ 200 requests/s at
concurrency 32 (2 cores); p50 at concurrency 1 ≤ 1.5× the bare subprocess's.

Usage (as root, from the repository root, after `cargo build --release`):

    python3 bench/sandboxfusion.py [--n 400] [--cpp-n 10]

It starts `target/release/dsec serve` ($DSEC_BIN) on $DSEC_BENCH_GRADER_STATE (default
/var/tmp/dsec-test-grader-state, the state directory tests/test_sandboxfusion.py keeps, so
the 2.5 GB grader image is imported once), imports the grader rootfs
($DSEC_TEST_GRADER_ROOTFS, built by scripts/make-grader-image.sh) if that state has none,
and stops the server at the end. The report goes to stdout as markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "python"), str(REPO / "tools")]
import dsec  # noqa: E402
from dsec_local import RELEASE_BIN, Server, free_port, percentile  # noqa: E402

DSEC_BIN = Path(os.environ.get("DSEC_BIN") or RELEASE_BIN)
STATE = Path(os.environ.get("DSEC_BENCH_GRADER_STATE", "/var/tmp/dsec-test-grader-state"))
ROOTFS = Path(os.environ.get("DSEC_TEST_GRADER_ROOTFS", "/var/tmp/dsec-test-grader-rootfs"))
PYTHON = "/usr/bin/python3"
PROGRAM = "print(1)"
CPP = '#include <iostream>\nint main() { std::cout << "hello" << std::endl; }\n'


def log(msg: str) -> None:
    print(f"[sandboxfusion-bench] {msg}", file=sys.stderr, flush=True)


def timed(one: Callable[[], float], n: int, concurrency: int) -> tuple[list[float], float]:
    """Runs `one` n times over `concurrency` threads: the latencies (ms) and the seconds.
    A request that fails ends the benchmark: a rate over the requests that succeeded would
    flatter the way that failed."""
    lat: list[float] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    left = [n]

    def worker() -> None:
        while True:
            with lock:
                if left[0] == 0 or failures:
                    return
                left[0] -= 1
            try:
                ms = one()
            except BaseException as e:  # reported by the caller's thread
                with lock:
                    failures.append(e)
                return
            with lock:
                lat.append(ms)

    started = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise SystemExit(f"a request failed ({len(failures)} in all): {failures[0]!r}")
    return lat, time.monotonic() - started


def side_by_side(
    ways: dict[str, Callable[[], float]], n: int, concurrency: int, rounds: int = 5
) -> dict[str, dict[str, float]]:
    """Each way n times at `concurrency`, in `rounds` interleaved rounds (the order rotating)
    so that a busy spell of the machine falls on all of them alike: requests/s, p50, p99."""
    for one in ways.values():
        for _ in range(min(concurrency, 8)):
            one()  # warm-up: pools, page cache
    lat: dict[str, list[float]] = {k: [] for k in ways}
    secs = dict.fromkeys(ways, 0.0)
    names = list(ways)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            got, elapsed = timed(ways[name], n // rounds, concurrency)
            lat[name] += got
            secs[name] += elapsed
    return {
        k: {
            "rps": len(lat[k]) / secs[k],
            "p50": percentile(lat[k], 0.5),
            "p99": percentile(lat[k], 0.99),
        }
        for k in ways
    }


class RunCode:
    """POSTs to /run_code over one keep-alive connection per thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.local = threading.local()

    def post(self, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = json.dumps(body).encode()
        started = time.monotonic()
        conn.request("POST", "/run_code", data, {"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
        return (time.monotonic() - started) * 1000, reply

    def python(self) -> float:
        ms, r = self.post({"code": PROGRAM, "language": "python"})
        if r["status"] != "Success" or r["run_result"]["stdout"] != "1\n":
            raise SystemExit(f"unexpected /run_code answer: {r}")
        return ms


class Bare:
    """SandboxFusion's default runner: a temporary directory, the file, `bash -c` of the
    command as an asyncio subprocess of the (single) server process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    async def _run(self, source: str, suffix: str, compile_cmd: str | None, run_cmd: str) -> float:
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"tmpbench{suffix}"
            path.write_text(source)
            for cmd in filter(None, [compile_cmd, run_cmd]):
                p = await asyncio.create_subprocess_shell(
                    cmd.format(f=path),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=tmp,
                    executable="/bin/bash",
                )
                await asyncio.wait_for(p.communicate(b""), timeout=60)
                if p.returncode != 0:
                    raise SystemExit(f"bare {cmd!r} failed: {p.returncode}")
        return (time.monotonic() - started) * 1000

    def run(self, source: str, suffix: str, compile_cmd: str | None, run_cmd: str) -> float:
        fut = asyncio.run_coroutine_threadsafe(
            self._run(source, suffix, compile_cmd, run_cmd), self.loop
        )
        return fut.result()

    def python(self) -> float:
        return self.run(PROGRAM, ".py", None, f"{PYTHON} {{f}}")


def fncall_way(client: dsec.Client) -> Callable[[], float]:
    def one() -> float:
        started = time.monotonic()
        r = client.call(
            ["python3", "/tmp/bench.py"],
            image="grader",
            files={"/tmp/bench.py": PROGRAM},
        )
        if r.stdout != "1\n":
            raise SystemExit(f"unexpected fncall result: {r}")
        return (time.monotonic() - started) * 1000

    return one


def cpp_ways(run_code: RunCode, bare: Bare) -> dict[str, Callable[[], float]]:
    def dsec_one() -> float:
        ms, r = run_code.post({"code": CPP, "language": "cpp", "compile_timeout": 60})
        if r["status"] != "Success":
            raise SystemExit(f"unexpected /run_code answer: {r}")
        return ms

    def bare_one() -> float:
        return bare.run(
            CPP, ".cpp", "g++ -std=c++17 {f} -o test -lcrypto -lssl -lpthread", "./test"
        )

    return {"dsec": dsec_one, "bare": bare_one}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=400, help="requests per concurrency-32 series")
    ap.add_argument("--n1", type=int, default=100, help="requests per concurrency-1 series")
    ap.add_argument("--cpp-n", type=int, default=10)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    if not Path(PYTHON).exists() or shutil.which("g++") is None:
        raise SystemExit(f"the bare baseline needs {PYTHON} and g++ on the host")
    sf_port = free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="dsec-sf-bench-"))
    server = Server(
        STATE,
        log_path=log_dir / "server.log",
        binary=DSEC_BIN,
        extra_args=["--sandboxfusion-listen", f"127.0.0.1:{sf_port}"],
    )
    # A restart after an interrupted import first removes its leftovers: give it time.
    server.start(timeout=300)
    res: dict[str, Any] = {}
    try:
        with server.client() as c:
            if not any(i.name == "grader" for i in c.images()):
                if not (ROOTFS / "etc/dsec-grader").exists():
                    raise SystemExit(f"no grader rootfs at {ROOTFS}: scripts/make-grader-image.sh")
                log(f"importing {ROOTFS} as grader (minutes)")
                c.import_image(str(ROOTFS), name="grader")
        run_code, bare = RunCode(sf_port), Bare()
        with server.client() as client:
            ways = {
                "bare": bare.python,
                "run_code": run_code.python,
                "fncall": fncall_way(client),
            }
            for conc in (1, 32):
                n = args.n1 if conc == 1 else args.n
                log(f"concurrency {conc}: {', '.join(ways)}, {n} each, interleaved")
                for name, r in side_by_side(ways, n, conc).items():
                    res[f"{name} c{conc}"] = r
        log(f"C++ compile + run ({args.cpp_n} each, interleaved)")
        res["cpp"] = side_by_side(cpp_ways(run_code, bare), args.cpp_n, 1)
    finally:
        server.stop(timeout=120)
        shutil.rmtree(log_dir, ignore_errors=True)
    print(report(res, args))


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    def row(label: str, key: str, base: str) -> str:
        r, b = res[key], res[base]
        return (
            f"| {label} | {r['rps']:.1f} | {r['p50']:.1f} | {r['p99']:.1f} "
            f"| {r['rps'] / b['rps']:.2f}x | {r['p50'] / b['p50']:.2f}x |"
        )

    load = os.getloadavg()[0]
    cpus = os.cpu_count()
    lines = [
        (
            f"Host: {platform.node()}: Linux {platform.release()}, {cpus} CPUs, "
            f"load average {load:.2f} at the end. n={args.n} (concurrency 32), "
            f"{args.n1} (concurrency 1), C++ {args.cpp_n}."
        ),
        "",
        (
            "| `print(1)` in python (interleaved rounds) | requests/s | p50 ms | p99 ms "
            "| req/s vs bare | p50 vs bare |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for c in (1, 32):
        lines.append(row(f"bare subprocess, concurrency {c}", f"bare c{c}", f"bare c{c}"))
        lines.append(row(f"dsec /run_code, concurrency {c}", f"run_code c{c}", f"bare c{c}"))
        lines.append(row(f"dsec fncall (SDK), concurrency {c}", f"fncall c{c}", f"bare c{c}"))
    cpp = res["cpp"]
    lines += [
        "",
        "| C++ hello, compile + run | p50 ms | p99 ms | vs bare |",
        "|---|---|---|---|",
        f"| bare `g++` + `./test` | {cpp['bare']['p50']:.1f} | {cpp['bare']['p99']:.1f} | 1.00x |",
        (
            f"| dsec /run_code | {cpp['dsec']['p50']:.1f} | {cpp['dsec']['p99']:.1f} "
            f"| {cpp['dsec']['p50'] / cpp['bare']['p50']:.2f}x |"
        ),
        "",
        (
            f"Targets: ≥ 200 requests/s at concurrency 32: "
            f"{'met' if res['run_code c32']['rps'] >= 200 else 'missed'} "
            f"({res['run_code c32']['rps']:.1f}); p50 at concurrency 1 ≤ 1.5× bare: "
            f"{'met' if res['run_code c1']['p50'] <= 1.5 * res['bare c1']['p50'] else 'missed'} "
            f"({res['run_code c1']['p50'] / res['bare c1']['p50']:.2f}x)."
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
