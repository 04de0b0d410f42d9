#!/usr/bin/env python3
"""dsec demo: grade N small programs, each in its own sandbox, concurrently.

    pip install -e python/ rich
    python3 demo/demo.py --n 300

Uses the server at $DSEC_URL (default http://127.0.0.1:7700) when it answers; otherwise
starts `dsec serve` itself ($DSEC_BIN, else target/release/dsec, else target/debug/dsec)
with a temporary state directory, and stops it at the end. If the image named by --image
does not exist, a busybox rootfs is built with scripts/make-busybox-rootfs.sh and imported
under that name. Each sandbox gets a program (a shell script; a Python program when the
image has python3), runs it, and its output is compared with the answer computed here.
Exits non-zero if any sandbox failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# This checkout's SDK and host helpers, ahead of any installed copy.
sys.path[:0] = [str(REPO / "python"), str(REPO / "tools")]

import dsec  # noqa: E402
import dsec_local  # noqa: E402

try:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Table

    HAVE_RICH = True
except ImportError:  # plain output; `pip install rich` for the progress bar and table
    HAVE_RICH = False


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the programs


SHELL_PROGRAM = r"""#!/bin/sh
# usage: prog.sh N SEED FIZZ
n=$1; c=$2; fz=$3
s=0; q=0; i=1
while [ $i -le $n ]; do s=$((s + i)); q=$((q + i * i)); i=$((i + 1)); done
echo "sum=$s"
echo "squares=$q"
steps=0
while [ $c -ne 1 ]; do
  if [ $((c % 2)) -eq 0 ]; then c=$((c / 2)); else c=$((3 * c + 1)); fi
  steps=$((steps + 1))
done
echo "collatz=$steps"
i=1; line=""
while [ $i -le $fz ]; do
  if [ $((i % 15)) -eq 0 ]; then w=FizzBuzz
  elif [ $((i % 3)) -eq 0 ]; then w=Fizz
  elif [ $((i % 5)) -eq 0 ]; then w=Buzz
  else w=$i; fi
  line="$line$w "
  i=$((i + 1))
done
echo "fizzbuzz=${line% }"
"""

PYTHON_PROGRAM = r"""import sys
n, c, fz = (int(a) for a in sys.argv[1:4])
print(f"sum={sum(range(1, n + 1))}")
print(f"squares={sum(i * i for i in range(1, n + 1))}")
steps = 0
while c != 1:
    c = c // 2 if c % 2 == 0 else 3 * c + 1
    steps += 1
print(f"collatz={steps}")
words = ["FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0 else "Buzz" if i % 5 == 0
         else str(i) for i in range(1, fz + 1)]
print("fizzbuzz=" + " ".join(words))
"""


def task_args(i: int) -> tuple[int, int, int]:
    return 50 + (i * 7) % 200, 27 + i, 15 + i % 30


def expected_output(n: int, seed: int, fz: int) -> str:
    steps, c = 0, seed
    while c != 1:
        c = c // 2 if c % 2 == 0 else 3 * c + 1
        steps += 1
    words = []
    for i in range(1, fz + 1):
        if i % 15 == 0:
            words.append("FizzBuzz")
        elif i % 3 == 0:
            words.append("Fizz")
        elif i % 5 == 0:
            words.append("Buzz")
        else:
            words.append(str(i))
    return (
        f"sum={n * (n + 1) // 2}\n"
        f"squares={n * (n + 1) * (2 * n + 1) // 6}\n"
        f"collatz={steps}\n"
        f"fizzbuzz={' '.join(words)}\n"
    )


# ------------------------------------------------------------------ the server


def find_binary() -> Path:
    if os.environ.get("DSEC_BIN"):
        return Path(os.environ["DSEC_BIN"])
    debug = REPO / "target/debug/dsec"
    if dsec_local.RELEASE_BIN.exists():
        return dsec_local.RELEASE_BIN
    if debug.exists():
        say(f"note: {dsec_local.RELEASE_BIN} not built; using the debug build {debug}")
        return debug
    sys.exit(
        "no dsec server running and no binary: build it (cargo build --release) or set DSEC_BIN"
    )


def start_local_server(binary: Path) -> dsec_local.Server:
    """A `dsec serve` of this demo's own, on a temporary state directory."""
    tmp = dsec_local.make_tempdir("dsec-demo-")
    server = dsec_local.Server(tmp / "state", log_path=tmp / "server.log", binary=binary)
    say(f"starting {' '.join(server.argv())}")
    try:
        return server.start(timeout=60)
    except dsec_local.ServerError as e:
        stop_local_server(server)
        sys.exit(f"dsec serve did not start: {e}")


def stop_local_server(server: dsec_local.Server) -> None:
    server.cleanup()
    dsec_local.safe_rmtree(server.state_dir.parent)


def ensure_image(client: dsec.Client, name: str) -> None:
    try:
        img = client.get_image(name)
        say(f"using image {name} ({img.size / 1e6:.1f} MB)")
        return
    except dsec.NotFound:
        pass
    tmp = dsec_local.make_tempdir("dsec-demo-rootfs-")
    try:
        rootfs = dsec_local.make_busybox_rootfs(tmp / "rootfs")
        img = client.import_image(str(rootfs), name=name)
    finally:
        dsec_local.safe_rmtree(tmp)
    say(f"imported busybox rootfs as image {img.name} ({img.size / 1e6:.1f} MB)")


# ------------------------------------------------------------------ the run


@dataclass
class Stats:
    create_ms: list[float] = field(default_factory=list)
    write_ms: list[float] = field(default_factory=list)
    exec_ms: list[float] = field(default_factory=list)
    stop_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


async def run_one(
    client: dsec.AsyncClient,
    i: int,
    args: argparse.Namespace,
    use_python: bool,
    tag: str,
    stats: Stats,
    sem: asyncio.Semaphore,
) -> None:
    n, seed, fz = task_args(i)
    async with sem:
        sb = None
        try:
            t0 = time.perf_counter()
            sb = await client.create(backend=args.backend, image=args.image, labels={"demo": tag})
            t1 = time.perf_counter()
            stats.create_ms.append((t1 - t0) * 1e3)
            prog, interp = ("/work/prog.py", "python3") if use_python else ("/work/prog.sh", "sh")
            await sb.write_file(prog, PYTHON_PROGRAM if use_python else SHELL_PROGRAM)
            t2 = time.perf_counter()
            stats.write_ms.append((t2 - t1) * 1e3)
            r = await sb.run([interp, prog, str(n), str(seed), str(fz)], timeout=60)
            stats.exec_ms.append((time.perf_counter() - t2) * 1e3)
            want = expected_output(n, seed, fz)
            if r.exit_code != 0:
                stats.failures.append(f"#{i} {sb.id}: exit {r.exit_code}: {r.stderr[-200:]!r}")
            elif r.stdout != want:
                stats.failures.append(f"#{i} {sb.id}: wrong output {r.stdout[-200:]!r}")
        except dsec.DsecError as e:
            stats.failures.append(f"#{i}: {type(e).__name__}: {e}")
        finally:
            if sb is not None:
                t3 = time.perf_counter()
                try:
                    await sb.stop()
                    stats.stop_ms.append((time.perf_counter() - t3) * 1e3)
                except dsec.DsecError as e:
                    stats.failures.append(f"#{i} {sb.id}: stop: {e}")


async def run_all(url: str, args: argparse.Namespace) -> tuple[Stats, float, bool]:
    stats = Stats()
    tag = uuid.uuid4().hex[:10]
    async with dsec.AsyncClient(url) as client:
        async with client.create(backend=args.backend, image=args.image) as probe:
            use_python = (await probe.run("command -v python3")).exit_code == 0
        say(f"image {args.image}: {'python3' if use_python else 'no python3: shell'} programs")
        sem = asyncio.Semaphore(args.concurrency)
        tasks = [
            asyncio.ensure_future(run_one(client, i, args, use_python, tag, stats, sem))
            for i in range(args.n)
        ]
        t0 = time.perf_counter()
        if HAVE_RICH:
            with Progress(
                TextColumn("[bold]sandboxes"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("failed: {task.fields[failed]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            ) as bar:
                tid = bar.add_task("run", total=args.n, failed=0)
                for fut in asyncio.as_completed(tasks):
                    await fut
                    bar.update(tid, advance=1, failed=len(stats.failures))
        else:
            for done, fut in enumerate(asyncio.as_completed(tasks), 1):
                await fut
                if done % max(1, args.n // 10) == 0 or done == args.n:
                    say(f"{done}/{args.n} done, {len(stats.failures)} failed")
        wall = time.perf_counter() - t0
        leftover = await client.list(labels={"demo": tag})
        if leftover:
            stats.failures.append(f"{len(leftover)} sandboxes still listed after the run")
    return stats, wall, use_python


def report(args: argparse.Namespace, stats: Stats, wall: float) -> None:
    rows: list[tuple[str, str]] = [
        ("backend / image", f"{args.backend} / {args.image}"),
        ("sandboxes", str(args.n)),
        ("concurrency", str(args.concurrency)),
        ("wall time", f"{wall:.2f} s"),
        ("sandboxes/s", f"{args.n / wall:.1f}"),
    ]
    for label, xs in (
        ("create", stats.create_ms),
        ("write_file", stats.write_ms),
        ("exec", stats.exec_ms),
        ("stop", stats.stop_ms),
    ):
        p50, p99 = dsec_local.percentile(xs, 0.5), dsec_local.percentile(xs, 0.99)
        rows.append((f"{label} p50 / p99", f"{p50:.1f} / {p99:.1f} ms"))
    rows.append(("failures", str(len(stats.failures))))
    if HAVE_RICH:
        table = Table(title="dsec demo")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for k, v in rows:
            table.add_row(k, v, style="red" if k == "failures" and stats.failures else None)
        Console().print(table)
    else:
        for k, v in rows:
            print(f"{k:>20}  {v}")
    for f in stats.failures[:20]:
        print("FAIL", f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300, help="number of sandboxes (300)")
    ap.add_argument("--concurrency", type=int, default=64, help="sandboxes at once (64)")
    ap.add_argument("--image", default="busybox", help="image name (busybox; built if missing)")
    ap.add_argument("--backend", default="container")
    ap.add_argument("--url", default=None, help="server URL (default $DSEC_URL or :7700)")
    args = ap.parse_args(argv)

    dsec_local.raise_open_file_limit()  # one connection per concurrent request

    url = (args.url or os.environ.get("DSEC_URL") or "http://127.0.0.1:7700").rstrip("/")
    server: dsec_local.Server | None = None
    if not dsec_local.answers(url, timeout=2.0):
        if args.url or os.environ.get("DSEC_URL"):
            say(f"{url} does not answer; starting a local server instead")
        server = start_local_server(find_binary())
        url = server.url
    else:
        say(f"using the dsec server at {url}")
    try:
        with dsec.Client(url) as c:
            if args.backend != "docker":
                ensure_image(c, args.image)
        stats, wall, _ = asyncio.run(run_all(url, args))
    finally:
        if server is not None:
            stop_local_server(server)
    report(args, stats, wall)
    return 1 if stats.failures else 0


if __name__ == "__main__":
    sys.exit(main())
