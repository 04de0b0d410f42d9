#!/usr/bin/env python3
"""Image benchmarks (issue 14): EROFS layers read in place, side by side in one run with
today's alternatives, on a large Debian image (scripts/make-big-debian-image.sh).

  import    time to import the big image, and the disk it takes: dsec (EROFS blobs) vs
            the previous dsec (--baseline-bin: layers unpacked into directories at import)
            vs `docker import` of the same tree
  read      bytes read from the layer store to start a sandbox and run
            `python3 -c 'import json'` with a cold cache, over the image's size: the store
            is an ext4 on its own loop device (direct I/O), remounted before each cold
            trial, and its reads are counted at the device (/sys/block/loopN/stat)
  create    create -> first exec (`true`), cold (first sandbox after the store was
            remounted and the server restarted) and warm, big image vs busybox
  second    a second server sharing the store: from its start to its first sandbox's
            `python3 -c 'import json'`, vs the previous dsec (which must import the image
            again on each host) and `docker load` + `docker run` of a `docker save` archive
  idle      N idle sandboxes of the big image, each having run `python3 -c 'import json'`
            once: host memory per sandbox (MemAvailable drop / N), cgroup usage, server RSS
  previous  the alternative "unpack on import": import, import + first run, disk, warm
            create, on --baseline-bin
  docker    the alternative docker: `docker import`, `docker load` + `docker run` of a
            `docker save` archive, warm `docker run`; a dockerd of the bench's own (socket,
            data and exec root in its temporary directory) when none answers

Usage (as root, from the repository root):

  python3 bench/images.py --rootfs /var/tmp/dsec-image-bench/bigroot
  python3 bench/images.py --only read,create --trials 5
  python3 bench/images.py --baseline-bin /work/main/target/debug/dsec   # the old layout

Everything it starts (servers, loop device, mounts, docker images and containers,
temporary directories) is removed at the end. Results print as markdown on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "python"), str(REPO / "tools"), str(REPO / "bench")]

import dsec  # noqa: E402
import dsec_local  # noqa: E402
from dsec_bench import common  # noqa: E402  (the shared bench helpers)
from dsec_bench import report as tables  # noqa: E402
from dsec_bench.idle import settled_mem_available_kib  # noqa: E402
from dsec_local import Server, percentile, safe_rmtree  # noqa: E402

#: Parts measured on this dsec; "previous" and "docker" are the alternatives.
OURS = ["import", "read", "create", "second", "idle"]
PARTS = [*OURS, "previous", "docker"]
PY = ["python3", "-c", "import json"]


def log(msg: str) -> None:
    common.log(msg)


class BinServer(Server):
    """A server started from a given binary."""

    def __init__(self, binary: Path, state: Path, extra: list[str]) -> None:
        super().__init__(
            state, log_path=state.parent / f"{state.name}.log", extra_args=extra, binary=binary
        )


@contextlib.contextmanager
def loop_store(base: Path, size_gib: int) -> Iterator[tuple[Path, str]]:
    """An ext4 on a loop device of its own (direct I/O), mounted at base/store: its reads
    are the layer store's reads. Yields (mount point, loop device name)."""
    image = base / "store.ext4"
    mnt = base / "store"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", f"{size_gib}G", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    dev = subprocess.run(
        ["losetup", "--find", "--show", "--direct-io=on", str(image)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    try:
        subprocess.run(["mount", "-o", "nosuid,nodev", dev, str(mnt)], check=True)
        yield mnt, Path(dev).name
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
        subprocess.run(["losetup", "-d", dev], capture_output=True, check=False)
        image.unlink(missing_ok=True)


@contextlib.contextmanager
def docker_daemon(base: Path) -> Iterator[str | None]:
    """The Docker daemon to compare with: the host's if one answers, else one of our own
    (its socket, data, exec root and containerd under base; no bridge, no iptables) that is
    stopped by its pid at the end. Yields why there is none, or None."""
    if common.docker_available() or not shutil.which("dockerd"):
        yield dsec_local.docker_unavailable_reason()
        return
    root = base / "docker"
    root.mkdir()
    sock = root / "docker.sock"
    log_path = base / "dockerd.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [
                "dockerd",
                f"--host=unix://{sock}",
                f"--data-root={root / 'data'}",
                f"--exec-root={root / 'exec'}",
                f"--pidfile={root / 'dockerd.pid'}",
                "--bridge=none",
                "--iptables=false",
                "--ip6tables=false",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    old_host = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = f"unix://{sock}"
    try:
        deadline = time.monotonic() + 60
        while not common.docker_available() and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        reason = dsec_local.docker_unavailable_reason()
        if reason is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-5:]
            reason = f"our dockerd did not come up: {' / '.join(tail)}"
        else:
            log(f"started dockerd (pid {proc.pid}) on {sock}")
        yield reason
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if old_host is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = old_host
        # the overlay mounts of a daemon killed mid-way
        for m in reversed(dsec_local.mounts_under(root)):
            subprocess.run(["umount", "-l", m], capture_output=True, check=False)


def device_read_bytes(dev: str) -> int:
    return int(Path(f"/sys/block/{dev}/stat").read_text().split()[2]) * 512


def remount(mnt: Path, dev: str) -> None:
    """Drops every cache of the store's filesystem (and nothing of anyone else's)."""
    subprocess.run(["umount", str(mnt)], check=True)
    subprocess.run(["mount", "-o", "nosuid,nodev", f"/dev/{dev}", str(mnt)], check=True)


def tree_bytes(path: Path) -> int:
    out = subprocess.run(
        ["du", "-sb", "--one-file-system", str(path)], capture_output=True, text=True
    )
    return int(out.stdout.split()[0]) if out.returncode == 0 else 0


def first_exec_ms(client: dsec.Client, image: str, cmd: Any = "true") -> float:
    t0 = time.perf_counter()
    sb = client.create(image=image)
    try:
        r = sb.run(cmd)
        assert r.exit_code == 0, r.stderr
        return (time.perf_counter() - t0) * 1000
    finally:
        sb.stop()


#: Admission is not under test: N idle sandboxes of 64 MiB limits each go past the default
#: budget (4 × the host's memory), as in dsec_bench. (The previous dsec has no such flags.)
ADMISSION = ["--memory-overcommit", "64", "--pids-overcommit", "64"]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rootfs", default="/var/tmp/dsec-image-bench/bigroot")
    ap.add_argument("--dsec-bin", default=str(REPO / "target/debug/dsec"))
    ap.add_argument(
        "--baseline-bin",
        default="/work/main/target/debug/dsec",
        help="a dsec from before EROFS layers (unpack on import); '' skips it",
    )
    ap.add_argument("--only", default=",".join(PARTS))
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--idle-n", type=int, default=1000)
    ap.add_argument("--store-gib", type=int, default=12)
    args = ap.parse_args()
    parts = set(args.only.split(","))
    unknown = parts - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    rootfs = Path(args.rootfs)
    if not (rootfs / "usr/bin/python3").exists():
        subprocess.run([str(REPO / "scripts/make-big-debian-image.sh"), str(rootfs)], check=True)
    baseline = Path(args.baseline_bin) if args.baseline_bin else None
    base = Path(tempfile.mkdtemp(prefix="dsec-images-bench-", dir="/var/tmp"))
    res: dict[str, Any] = {
        "image_tree_bytes": tree_bytes(rootfs),
        "load_start": os.getloadavg()[0],
    }
    notes: list[str] = []
    servers: list[Server] = []

    def start(binary: Path, name: str, extra: list[str]) -> Server:
        s = BinServer(binary, base / name, extra)
        servers.append(s)
        return s.start(timeout=120)

    def stop_all() -> None:
        while servers:
            with contextlib.suppress(Exception):
                servers.pop().cleanup()

    try:
        bb = base / "busybox"
        subprocess.run(
            [str(REPO / "scripts/make-busybox-rootfs.sh"), str(bb)],
            check=True,
            capture_output=True,
        )
        if set(OURS) & parts:
            with loop_store(base, args.store_gib) as (store, dev):
                try:
                    ours(args, parts, res, rootfs, bb, store, dev, start)
                finally:
                    stop_all()  # their mounts of the store's blobs go before the store does
        if "previous" in parts and baseline is not None and baseline.exists():
            try:
                previous(
                    args, res, rootfs, start(baseline, "state-old", ["--net-pool", "10.244.0.0/16"])
                )
            finally:
                stop_all()
                safe_rmtree(base / "state-old")  # room for docker's copies
        elif "previous" in parts:
            notes.append(f"no baseline binary at {baseline}")
        if "docker" in parts:
            with docker_daemon(base) as why_not:
                if why_not is None:
                    res.update(docker(rootfs, base))
                else:
                    notes.append(f"docker: {why_not}")
    finally:
        stop_all()
        safe_rmtree(base)
        print(json.dumps(res, indent=1, default=str), file=sys.stderr)  # even after a failure
    print(report(res, args, notes))
    return 0


def ours(
    args: argparse.Namespace,
    parts: set[str],
    res: dict[str, Any],
    rootfs: Path,
    busybox: Path,
    store: Path,
    dev: str,
    start: Callable[[Path, str, list[str]], Server],
) -> None:
    """The parts measured on this dsec, with its layer store on the loop device."""
    dsec_bin = Path(args.dsec_bin)
    a = start(dsec_bin, "state-a", [*ADMISSION, "--layer-store", str(store), "--edge-name", "ea"])
    ca = a.client()
    ca.import_image(str(busybox), name="busybox")
    log(f"importing {rootfs} ({res['image_tree_bytes'] / 2**30:.2f} GiB of files)")
    t0 = time.perf_counter()
    big = ca.import_image(str(rootfs), name="big")
    res["import_s"] = time.perf_counter() - t0
    res["image_bytes"] = big.size
    res["blob_bytes"] = big.raw["disk_bytes"]
    log(f"imported in {res['import_s']:.1f} s: {res['blob_bytes'] / 2**30:.2f} GiB of blobs")

    if {"read", "create"} & parts:
        cold_ms, read_bytes = [], []
        for i in range(args.trials):
            a.stop()
            remount(store, dev)
            a.restart(timeout=120)
            ca = a.client()
            before = device_read_bytes(dev)
            if i % 2 == 0:
                sb = ca.create(image="big")
                r = sb.run(PY)
                assert r.exit_code == 0, r.stderr
                sb.stop()
                read_bytes.append(device_read_bytes(dev) - before)
                log(f"cold trial {i}: read {read_bytes[-1] / 2**20:.1f} MiB")
            else:
                cold_ms.append(first_exec_ms(ca, "big"))
                log(f"cold trial {i}: first exec {cold_ms[-1]:.0f} ms")
        res["cold_read_bytes"] = percentile([float(b) for b in read_bytes], 0.5)
        res["cold_read_all"] = read_bytes
        res["cold_first_exec"] = common.latency_stats(cold_ms)
        for image in ("busybox", "big"):
            first_exec_ms(ca, image)
            res[f"warm_{image}"] = common.latency_stats(
                [first_exec_ms(ca, image) for _ in range(args.warm)]
            )

    if "second" in parts:
        log("second server on the same store")
        b = start(
            dsec_bin, "state-b", [*ADMISSION, "--layer-store", str(store), "--edge-name", "eb"]
        )
        t0 = time.perf_counter()
        with b.client() as cb:
            first_exec_ms(cb, "big", PY)
        res["second_s"] = time.perf_counter() - t0
        b.stop()

    if "idle" in parts:
        res["idle"] = idle(a, "big", args.idle_n)


def previous(args: argparse.Namespace, res: dict[str, Any], rootfs: Path, old: Server) -> None:
    """The previous dsec (layers unpacked into directories at import) on the same image."""
    log("the previous dsec: unpack on import")
    t0 = time.perf_counter()
    with old.client() as co:
        co.import_image(str(rootfs), name="big")
        res["old_import_s"] = time.perf_counter() - t0
        first_exec_ms(co, "big", PY)
        res["old_second_s"] = time.perf_counter() - t0
        res["old_store_bytes"] = tree_bytes(old.state_dir / "images/layers")
        first_exec_ms(co, "big")
        res["old_warm_big"] = common.latency_stats(
            [first_exec_ms(co, "big") for _ in range(args.warm)]
        )


def idle(server: Server, image: str, n: int) -> dict[str, Any]:
    log(f"{n} idle sandboxes of {image}, each after one `python3 -c 'import json'`")
    client = server.client()
    rss0 = server.rss_kib()
    before = settled_mem_available_kib()
    ids: list[str] = []
    errors: list[str] = []

    async def create_all() -> None:
        ac = dsec.AsyncClient(client.url)
        sem = asyncio.Semaphore(8)

        async def one() -> None:
            async with sem:
                try:
                    sb = await ac.create(image=image, memory_mb=64)
                    ids.append(sb.id)
                    r = await sb.run(PY)
                    if r.exit_code != 0:
                        errors.append(f"exit {r.exit_code}: {r.stderr[-200:]}")
                except Exception as e:  # counted and reported; the others go on
                    errors.append(f"{type(e).__name__}: {e}")

        try:
            await asyncio.gather(*(one() for _ in range(n)))
        finally:
            await ac.close()

    async def stop_all() -> None:
        ac = dsec.AsyncClient(client.url)
        sem = asyncio.Semaphore(16)

        async def one(sid: str) -> None:
            async with sem:
                with contextlib.suppress(dsec.NotFound):
                    await (await ac.get(sid)).stop()

        try:
            await asyncio.gather(*(one(s) for s in ids))
        finally:
            await ac.close()

    t0 = time.perf_counter()
    try:
        asyncio.run(create_all())
        created_s = time.perf_counter() - t0
        if errors:
            log(f"idle: {len(errors)}/{n} failed; first: {errors[0]}")
        if not ids:
            raise RuntimeError(f"no idle sandbox could be created: {errors[:1]}")
        after = settled_mem_available_kib()
        rss1 = server.rss_kib()
        mine = set(ids)
        usage = [s.info().usage for s in client.list() if s.id in mine]
        cgroup = sum(int(getattr(u, "memory_bytes", 0) or 0) for u in usage)
    finally:
        log(f"stopping {len(ids)} idle sandboxes")
        asyncio.run(stop_all())
    return {
        "n": len(ids),
        "failed": len(errors),
        "create_s": created_s,
        "host_mib_per_sandbox": (before - after) / len(ids) / 1024,
        "cgroup_mib_per_sandbox": cgroup / len(ids) / 2**20,
        "server_rss_mib_per_sandbox": (rss1 - rss0) / len(ids) / 1024,
    }


def docker(rootfs: Path, base: Path) -> dict[str, Any]:
    if not common.docker_available():
        return {"docker": "no daemon"}
    ref = "dsec-bench/big:latest"
    out: dict[str, Any] = {}
    log("docker: import, save, then load + run")
    try:
        t0 = time.perf_counter()
        common.docker_import(rootfs, ref)
        out["docker_import_s"] = time.perf_counter() - t0
        archive = base / "big.docker.tar"
        subprocess.run(["docker", "save", "-o", str(archive), ref], check=True)
        subprocess.run(["docker", "rmi", "-f", ref], check=True, capture_output=True)
        t0 = time.perf_counter()
        subprocess.run(["docker", "load", "-i", str(archive)], check=True, capture_output=True)
        subprocess.run(["docker", "run", "--rm", "--network", "none", ref, *PY], check=True)
        out["docker_load_run_s"] = time.perf_counter() - t0
        archive.unlink()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            subprocess.run(["docker", "run", "--rm", "--network", "none", ref, "true"], check=True)
            runs.append((time.perf_counter() - t0) * 1000)
        out["docker_warm"] = common.latency_stats(runs)
    finally:
        subprocess.run(["docker", "rmi", "-f", ref], capture_output=True, check=False)
    return out


def report(res: dict[str, Any], args: argparse.Namespace, notes: list[str]) -> str:
    f, r, met = tables.fmt, tables.ratio, tables.met

    def g(*keys: str) -> Any:
        return tables.get({"r": res}, "r", *keys)

    def gib(b: Any) -> str:
        return f(b / 2**30 if b else None)

    read, blobs = g("cold_read_bytes"), g("blob_bytes")
    share = read / blobs * 100 if read and blobs else None
    cold, warm, bb = (g(k, "p50_ms") for k in ("cold_first_exec", "warm_big", "warm_busybox"))
    warm_ratio = warm / bb if warm and bb else None
    rows = [
        (
            "import, s",
            f(g("import_s")),
            f(g("old_import_s")),
            f(g("docker_import_s")),
            f"{r(g('import_s'), g('old_import_s'))} of unpack",
            "",
        ),
        (
            "layer store on disk, GiB",
            gib(blobs),
            gib(g("old_store_bytes")),
            "-",
            r(blobs, g("old_store_bytes")),
            "",
        ),
        (
            "read from the store: start + `import json`, cold, MiB",
            f"{f(read / 2**20 if read else None)} ({f(share)} % of the image)",
            "-",
            "-",
            "",
            f"≤ 5 %: {met(share, 5, False)}",
        ),
        (
            "create → first exec, cold, p50 ms",
            f(cold),
            "-",
            "-",
            "",
            f"≤ 100 ms: {met(cold, 100, False)}",
        ),
        (
            f"create → first exec, warm, p50 ms (busybox {f(bb)})",
            f(warm),
            f(g("old_warm_big", "p50_ms")),
            f(g("docker_warm", "p50_ms")),
            f"{f(warm_ratio)} x busybox",
            f"≤ 1.5 x: {met(warm_ratio, 1.5, False)}",
        ),
        (
            "second server: ready → first `import json`, s",
            f(g("second_s")),
            f"{f(g('old_second_s'))} (import + run)",
            f"{f(g('docker_load_run_s'))} (load + run)",
            f"unpack {r(g('old_second_s'), g('second_s'))}, docker "
            f"{r(g('docker_load_run_s'), g('second_s'))}",
            "",
        ),
        (
            f"{g('idle', 'n')} idle sandboxes ({g('idle', 'failed')} failed), host MiB each "
            "(cgroup, server RSS)",
            f"{f(g('idle', 'host_mib_per_sandbox'))} ({f(g('idle', 'cgroup_mib_per_sandbox'))}, "
            f"{f(g('idle', 'server_rss_mib_per_sandbox'))})",
            "-",
            "-",
            "",
            "",
        ),
    ]
    lines = [
        f"Host: {tables.host_description()}. Image: {args.rootfs}, "
        f"{gib(g('image_tree_bytes'))} GiB of files. dsec: `{args.dsec_bin}`, previous: "
        f"`{args.baseline_bin}`. Load average {f(g('load_start'))} at the start.",
        f"Command: `python3 bench/images.py {' '.join(sys.argv[1:])}`",
        "",
        "| metric | dsec (EROFS) | previous dsec (unpack) | docker | ratio | target |",
        "|---|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines + [f"- {n}" for n in notes])


if __name__ == "__main__":
    sys.exit(main())
