"""`vm`: the microvm and vm backends (QEMU guests) beside the container backend, in one run."""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

import dsec_local

from .common import (
    Dsec,
    exec_round_trips,
    latency_stats,
    log,
    stop_sandbox,
)
from .idle import settled_mem_available_kib

VM_BACKENDS = ("microvm", "vm")

#: Children per fork in the fork measurement (the issue's fork(8)).
FORK_CHILDREN = 8


def _create_first_exec(d: Dsec, backend: str, **kw: Any) -> float:
    """ms from create(backend=...) until the first run("true") returns; the sandbox is
    stopped afterwards, untimed."""
    t0 = time.perf_counter()
    sb = d.client.create(backend=backend, image=d.image, labels=d.labels, **kw)
    d.track(sb.id)
    try:
        r = sb.run("true")
        dt = (time.perf_counter() - t0) * 1e3
        if r.exit_code != 0:
            raise RuntimeError(f"`true` exited {r.exit_code}: {r.stderr[:200]}")
        return dt
    finally:
        stop_sandbox(d, sb)


def _first_exec_series(d: Dsec, backend: str, n: int, label: str) -> dict[str, Any]:
    lat: list[float] = []
    failed = 0
    first_err = ""
    log(f"{label}: {n} sequential create -> first exec")
    for _ in range(n):
        try:
            lat.append(_create_first_exec(d, backend))
        except Exception as e:  # counted and reported
            failed += 1
            first_err = first_err or f"{type(e).__name__}: {e}"
    res = latency_stats(lat, failed)
    if failed:
        log(f"{label}: {failed}/{n} failed; first: {first_err}")
        res["first_error"] = first_err
    return res


def _exec_series(d: Dsec, backend: str, n: int) -> dict[str, Any]:
    """Round trips of run("true") in one running sandbox, and its accelerator."""
    sb = d.client.create(backend=backend, image=d.image, labels=d.labels)
    d.track(sb.id)
    try:
        res = exec_round_trips(sb, "true", n, 10, backend)
        res["accelerator"] = sb.info().accelerator
        return res
    finally:
        stop_sandbox(d, sb)


def _idle_memory(d: Dsec, backend: str, count: int, exec_each: bool = False) -> dict[str, Any]:
    """Host memory per idle sandbox: the MemAvailable drop after creating `count` (one
    after another), divided by count; for VMs also the QEMUs' VmRSS and RssAnon. With
    `exec_each`, then one run("true") in each while all are held."""
    before = settled_mem_available_kib()
    log(f"{backend}: creating {count} idle sandboxes")
    made: list[Any] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    try:
        for _ in range(count):
            try:
                sb = d.client.create(backend=backend, image=d.image, labels=d.labels)
                d.track(sb.id)
                made.append(sb)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
        create_s = time.perf_counter() - t0
        if errors:
            log(f"{backend} idle: {len(errors)}/{count} creations failed; first: {errors[0]}")
        if not made:
            raise RuntimeError(f"no idle {backend} sandbox could be created: {errors[:1]}")
        after = settled_mem_available_kib()
        k = len(made)
        res: dict[str, Any] = {
            "n": k,
            "failed": len(errors),
            "create_s": create_s,
            "mib_per_sandbox": (before - after) / k / 1024,
        }
        if exec_each:
            lat: list[float] = []
            failed = 0
            for sb in made:
                t = time.perf_counter()
                try:
                    ok = sb.run("true").exit_code == 0
                except Exception:
                    ok = False
                if ok:
                    lat.append((time.perf_counter() - t) * 1e3)
                else:
                    failed += 1
            res["exec_each"] = latency_stats(lat, failed)
        if backend in VM_BACKENDS:
            pids = [pid for sb in made for pid, _ in dsec_local.qemu_procs(sb.id)]
            rss = [dsec_local.proc_status_kib(pid, "VmRSS") or 0 for pid in pids]
            anon = [dsec_local.proc_status_kib(pid, "RssAnon") or 0 for pid in pids]
            res["qemu_processes"] = len(pids)
            res["qemu_rss_mib_per_vm"] = sum(rss) / k / 1024
            res["qemu_anon_mib_per_vm"] = sum(anon) / k / 1024
        else:
            usage = 0
            with contextlib.suppress(Exception):
                for sb in made:
                    usage += int(sb.info().usage.memory_bytes or 0)
            res["cgroup_usage_mib_per_sandbox"] = usage / k / 2**20 if usage else None
        return res
    finally:
        log(f"{backend}: stopping {len(made)} idle sandboxes")
        for sb in made:
            stop_sandbox(d, sb)


def _fork_series(d: Dsec, backend: str, children: int, rounds: int) -> dict[str, Any]:
    """fork(children) of a running sandbox until every child has answered run("true"),
    `rounds` times from one parent; and, for VMs, the children QEMUs' RssAnon (what each
    holds alone: the parent's memory it only reads is the saved guest's file, shared)."""
    parent = d.client.create(backend=backend, image=d.image, labels=d.labels)
    d.track(parent.id)
    lat: list[float] = []
    anon: list[float] = []
    try:
        parent.run("echo parent > /root/state")
        log(f"{backend}: {rounds} x fork({children}) -> every child answers")
        for _ in range(rounds):
            t0 = time.perf_counter()
            kids = parent.fork(children)
            for k in kids:
                d.track(k.id)
            try:
                for k in kids:
                    if k.run("true").exit_code != 0:
                        raise RuntimeError(f"a child of {backend} fork failed `true`")
                lat.append((time.perf_counter() - t0) * 1e3)
                if backend in VM_BACKENDS:
                    pids = [pid for k in kids for pid, _ in dsec_local.qemu_procs(k.id)]
                    kib = [dsec_local.proc_status_kib(pid, "RssAnon") or 0 for pid in pids]
                    anon.append(sum(kib) / len(kids) / 1024)
            finally:
                for k in kids:
                    stop_sandbox(d, k)
        res = latency_stats(lat, 0)
        res["children"] = children
        res["anon_mib_per_child"] = sum(anon) / len(anon) if anon else None
        return res
    finally:
        stop_sandbox(d, parent)


def _template_snapshots(d: Dsec) -> dict[str, tuple[int, int | None]]:
    """Per boot template of a server started here: the size of its scratch qcow2 (each
    restore copies it; dsec before the shared-memory templates kept the saved RAM in it) and
    the disk its memory file takes (restores map it copy-on-write; None without one)."""
    if d.state is None:
        return {}
    found = {}
    for f in (d.state / "vm" / "templates").glob("*/scratch.qcow2"):
        with contextlib.suppress(OSError):
            memory = f.with_name("memory")
            found[str(f)] = (
                f.stat().st_size,
                memory.stat().st_blocks * 512 if memory.exists() else None,
            )
    return found


def bench_vm(d: Dsec, args: argparse.Namespace, res_so_far: dict[str, Any]) -> dict[str, Any]:
    """microvm and vm beside the container backend: restore -> first exec, cold boot ->
    first exec (a second server with --vm-boot cold), exec round trips, idle memory."""
    res: dict[str, Any] = {"n": args.vm_n, "cold_n": args.vm_cold_n}

    # The first VM create on a server builds the image's disk (both backends share it) and
    # waits for the accelerator probe the server started at launch, if still running; a
    # sandbox of another shape (memory) takes those costs here, so that each backend's
    # first create below costs its template and no more.
    log("vm: first VM create on this server (image disk, a template)")
    res["first_vm_create_ms"] = _create_first_exec(d, "microvm", memory_mb=256)

    _first_exec_series(d, "container", 3, "container warm-up")
    res["container_first_exec"] = _first_exec_series(
        d, "container", max(args.vm_n, 50), "container"
    )
    res["container_exec"] = _exec_series(d, "container", args.vm_exec_n)
    for b in VM_BACKENDS:
        log(f"{b}: first create (builds the boot template)")
        known = _template_snapshots(d)
        res[f"{b}_first_create_ms"] = _create_first_exec(d, b)
        new = [sizes for f, sizes in _template_snapshots(d).items() if f not in known]
        qcow2, memory = new[0] if len(new) == 1 else (None, None)
        res[f"{b}_template_qcow2_mib"] = qcow2 / 2**20 if qcow2 is not None else None
        res[f"{b}_template_memory_mib"] = memory / 2**20 if memory is not None else None
        restore = _first_exec_series(d, b, args.vm_n, f"{b} restore")
        res[f"{b}_restore"] = restore
        # The first create = template (cold boot + save) + one restore -> first exec.
        res[f"{b}_template_ms"] = (
            res[f"{b}_first_create_ms"] - restore["p50_ms"] if restore["n"] else None
        )
        res[f"{b}_exec"] = _exec_series(d, b, args.vm_exec_n)
    for b in ("container", *VM_BACKENDS):
        res[f"{b}_fork"] = _fork_series(d, b, FORK_CHILDREN, args.vm_fork_n)
    res["accelerator"] = {b: res[f"{b}_exec"]["accelerator"] for b in VM_BACKENDS}

    idle = res_so_far.get("idle")
    if idle:
        res["container_idle"] = {
            "n": idle["n"],
            "mib_per_sandbox": idle["mib_per_sandbox"],
            "cgroup_usage_mib_per_sandbox": idle.get("cgroup_usage_mib_per_sandbox"),
            "from_idle_part": True,
        }
    else:
        res["container_idle"] = _idle_memory(d, "container", args.vm_idle_n)
    for b in VM_BACKENDS:
        res[f"{b}_idle"] = _idle_memory(d, b, args.vm_idle_n)
    if args.vm_many_n:
        res["microvm_many"] = _idle_memory(d, "microvm", args.vm_many_n, exec_each=True)

    log("vm: a second server with --vm-boot cold")
    try:
        cold = Dsec(args, d.rootfs, server_args=["--vm-boot", "cold"], name="cold")
    except SystemExit as e:
        raise RuntimeError(f"starting the --vm-boot cold server: {e}") from None
    try:
        # Its first create also probes the accelerator and builds the image disk.
        res["cold_first_vm_create_ms"] = _create_first_exec(cold, "microvm")
        for b in VM_BACKENDS:
            if b != "microvm":
                _create_first_exec(cold, b)  # warm-up
            res[f"{b}_cold"] = _first_exec_series(cold, b, args.vm_cold_n, f"{b} cold boot")
    finally:
        cold.close()
    return res
