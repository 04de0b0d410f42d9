"""The markdown report: the container table (dsec beside runc, docker and the floor), the VM
table, notes and the raw JSON."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
from typing import Any

from .common import (
    REPO,
    TARGET_CREATE_P50_MS,
    TARGET_CREATE_VS_FLOOR,
    TARGET_CREATIONS_PER_S,
    TARGET_EXEC_P50_MS,
    TARGET_FNCALL_P50_MS,
    TARGET_FNCALLS_PER_S,
    TARGET_FORK8_S,
    TARGET_IDLE_MIB,
    TARGET_LOG_OVERHEAD_PCT,
    TARGET_REPLAY_1000_S,
    TARGET_VM_EXEC_MS,
    TARGET_VM_FORK_MS,
    TARGET_VM_RESTORE_MS,
    run_cmd,
)
from .sdk import (
    CONCURRENCY,
    TARGET_ASYNC_CALLS_PER_S,
    TARGET_SDK_CPU_US,
    TARGET_SDK_CREATIONS_PER_S,
    TARGET_SDK_VS_LEAN,
    TARGET_SYNC_CALL_P50_MS,
)


def fmt(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def ratio(a: Any, b: Any) -> str:
    if a is None or b is None or not b or a != a or b != b:
        return "-"
    return f"{a / b:.2f}x"


def get(res: dict[str, Any], part: str, *keys: str) -> Any:
    cur: Any = res.get(part)
    for k in keys:
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    return cur


def met(value: Any, target: float, higher_is_better: bool) -> str:
    if value is None or value != value:
        return "-"
    ok = value >= target if higher_is_better else value <= target
    return "✅" if ok else "❌"


def host_description() -> str:
    cg = "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1/hybrid"
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = 0.0
    with contextlib.suppress(OSError):
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem_gib = int(line.split()[1]) / 2**20
    return (
        f"{platform.node()}: Linux {platform.release()}, {os.cpu_count()} CPUs ({cpu}), "
        f"{mem_gib:.0f} GiB, cgroup {cg}, load average {os.getloadavg()[0]:.2f} at the end"
    )


def rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def main_table(res: dict[str, Any], args: argparse.Namespace, cs: list[int]) -> list[str]:
    """The table of the container parts, with runc, docker and the floor beside."""
    out: list[str] = []
    out.append(
        "| metric | dsec | runc | docker | floor | dsec/floor | dsec/runc | dsec/docker | target |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")

    def row(
        name: str,
        key: tuple[str, ...],
        dkey: tuple[str, ...] | None = None,
        target: str = "",
        digits: int = 2,
    ) -> None:
        dv = get(res, "create", *(dkey or key))
        rv = get(res, "runc", *key)
        ov = get(res, "docker", *key)
        fv = get(res, "floor", *key)
        out.append(
            f"| {name} | {fmt(dv, digits)} | {fmt(rv, digits)} | {fmt(ov, digits)} | "
            f"{fmt(fv, digits)} | {ratio(dv, fv)} | {ratio(dv, rv)} | {ratio(dv, ov)} | {target} |"
        )

    p50 = get(res, "create", "seq", "p50_ms")
    floor_p50 = get(res, "floor", "seq", "p50_ms")
    vs_floor = p50 / floor_p50 if p50 is not None and floor_p50 else None
    row(
        "create → first exec, p50 ms ¹",
        ("seq", "p50_ms"),
        target=f"≤ {TARGET_CREATE_P50_MS:g} ms {met(p50, TARGET_CREATE_P50_MS, False)}, "
        f"≤ {TARGET_CREATE_VS_FLOOR:g}× floor {met(vs_floor, TARGET_CREATE_VS_FLOOR, False)}",
    )
    row("create → first exec, p99 ms ¹", ("seq", "p99_ms"))
    row("whole lifecycle, p50 ms ²", ("seq", "p50_ms"), dkey=("lifecycle", "p50_ms"))
    row("whole lifecycle, p99 ms ²", ("seq", "p99_ms"), dkey=("lifecycle", "p99_ms"))
    for c in cs:
        v = get(res, "create", f"c{c}", "per_s")
        row(
            f"lifecycles/s at concurrency {c} ³",
            (f"c{c}", "per_s"),
            digits=0,
            target=f"≥ {TARGET_CREATIONS_PER_S:g}/s {met(v, TARGET_CREATIONS_PER_S, True)}",
        )
    for c in cs:
        v = get(res, "create", f"create_c{c}", "per_s")
        if v is None:
            continue
        out.append(
            f"| creations/s at concurrency {c} ⁴ | {fmt(v, 0)} | | | | | | | "
            f"≥ {TARGET_CREATIONS_PER_S:g}/s {met(v, TARGET_CREATIONS_PER_S, True)} |"
        )
        out.append(
            f"| stops/s at concurrency {c} ⁴ | "
            f"{fmt(get(res, 'create', f'create_c{c}', 'stops_per_s'), 0)} | | | | | | | |"
        )

    def drow(name: str, value: Any, target: str = "") -> None:
        """A dsec-only row."""
        out.append(f"| {name} | {fmt(value)} | | | | | | | {target} |")

    for c in cs:
        lg = get(res, "loadgen", f"c{c}")
        if lg is None:
            continue
        ok = met(lg["creations_per_s"], TARGET_CREATIONS_PER_S, True)
        out.append(
            f"| creations/s at concurrency {c}, lean client ⁵ | {fmt(lg['creations_per_s'], 0)} "
            f"| | | | | | | ≥ {TARGET_CREATIONS_PER_S:g}/s {ok} |"
        )
        drow(
            f"create → first exec p50 ms at concurrency {c}, lean client ⁵",
            lg["create_exec_p50_ms"],
        )
        out.append(
            f"| stops/s at concurrency {c}, lean client ⁵ | {fmt(lg['stops_per_s'], 0)} "
            "| | | | | | | |"
        )

    if "fncall" in res:
        f = res["fncall"]
        ok = met(f["seq"]["p50_ms"], TARGET_FNCALL_P50_MS, False)
        drow(
            "fncall round trip `true`, p50 ms (SDK, ≤100 calls/s) ⁶",
            f["seq"]["p50_ms"],
            f"≤ {TARGET_FNCALL_P50_MS:g} ms {ok}",
        )
        drow("fncall round trip `true`, p99 ms (SDK) ⁶", f["seq"]["p99_ms"])
        for c in cs:
            lg = f.get(f"c{c}")
            if lg is None:
                continue
            ok = met(lg["calls_per_s"], TARGET_FNCALLS_PER_S, True)
            out.append(
                f"| fncall calls/s at concurrency {c}, lean client ⁶ | "
                f"{fmt(lg['calls_per_s'], 0)} | | | | | | | "
                f"≥ {TARGET_FNCALLS_PER_S:g}/s {ok} |"
            )
            drow(
                f"fncall call p50 ms at concurrency {c}, lean client ⁶",
                lg["call_p50_ms"],
            )
    if "fork" in res:
        fk = res["fork"]
        ok = met(fk["fork8_s"], TARGET_FORK8_S, False)
        drow(
            "fork(8) after writing 100 MB, s (median of 3)",
            fk["fork8_s"],
            f"≤ {TARGET_FORK8_S:g} s {ok}",
        )
        drow("snapshot after writing 100 MB, s", fk["snapshot_s"])
    if "exec" in res:
        e = res["exec"]
        ok = met(e["p50_ms"], TARGET_EXEC_P50_MS, False)
        drow(
            "exec round trip `/bin/true`, p50 ms",
            e["p50_ms"],
            f"≤ {TARGET_EXEC_P50_MS:g} ms {ok}",
        )
        drow("exec round trip `/bin/true`, p99 ms", e["p99_ms"])
        drow("exec, server-side duration p50 ms", e["server_p50_ms"])
    if "dsec-docker" in res:
        dd = res["dsec-docker"]

        def native(what: str, value: Any) -> str:
            return f"native {what}: {fmt(value)}" if value is not None else ""

        drow(
            'backend="docker": create → first exec, p50 ms ⁸',
            dd["seq"]["p50_ms"],
            native("p50", get(res, "create", "seq", "p50_ms")),
        )
        drow(
            'backend="docker": create → first exec, p99 ms ⁸',
            dd["seq"]["p99_ms"],
            native("p99", get(res, "create", "seq", "p99_ms")),
        )
        drow(
            'backend="docker": whole lifecycle, p50 ms ⁸',
            dd["lifecycle"]["p50_ms"],
            native("p50", get(res, "create", "lifecycle", "p50_ms")),
        )
        drow(
            'backend="docker": exec round trip `/bin/true`, p50 ms ⁸',
            dd["exec"]["p50_ms"],
            native("p50", get(res, "exec", "p50_ms")),
        )
        drow(
            'backend="docker": exec round trip `/bin/true`, p99 ms ⁸',
            dd["exec"]["p99_ms"],
            native("p99", get(res, "exec", "p99_ms")),
        )
    if "trajectory" in res:
        t = res["trajectory"]
        ok = met(t["plain_log_share_pct"], TARGET_LOG_OVERHEAD_PCT, False)
        drow(
            "exec `/bin/true` waiting on its log append, % of round trip ⁷",
            t["plain_log_share_pct"],
            f"≤ {TARGET_LOG_OVERHEAD_PCT:g}% {ok}",
        )
        drow("log append, mean ms ⁷", t["plain_append_ms"])
        drow("exec/s sequential, no trajectory id ⁷", t["plain_per_s"])
        drow("exec/s, 8 clients × own sandbox ⁷", t["c8_per_s"])
        ok = met(t["c8_log_share_pct"], TARGET_LOG_OVERHEAD_PCT, False)
        drow(
            "  … exec waiting on its log append, % of round trip ⁷",
            t["c8_log_share_pct"],
            f"≤ {TARGET_LOG_OVERHEAD_PCT:g}% {ok}",
        )

        drow("exec/s sequential, with trajectory id ⁷", t["traj_per_s"])
        drow("trajectory id vs none, % slower ⁷", t["traj_vs_plain_pct"])
        ok = met(t["replay_1000_s"], TARGET_REPLAY_1000_S, False)
        drow(
            "fast-forward of 1,000 recorded steps, s (lean client) ⁷",
            t["replay_1000_s"],
            f"≤ {TARGET_REPLAY_1000_S:g} s {ok}",
        )
        drow("  … of which in the server's exec handler, s ⁷", t["replay_1000_server_s"])
        drow("fast-forward of 1,000 recorded steps, s (SDK) ⁷", t["replay_1000_sdk_s"])
    if "trajectory-stores" in res:
        t = res["trajectory-stores"]
        drow("exec round trip, trajectory id, log on SQLite, ms ⁹", t["sqlite_rtt_ms"])
        drow("  … log append, mean ms ⁹", t["sqlite_append_ms"])
        drow("exec round trip, trajectory id, log on PostgreSQL, ms ⁹", t["postgres_rtt_ms"])
        drow("  … log append, mean ms ⁹", t["postgres_append_ms"])
        drow("  … PostgreSQL / SQLite round trip ⁹", t["postgres_vs_sqlite_rtt"])
        drow("exec/s, 8 clients × own sandbox, SQLite ⁹", t["sqlite_c8_per_s"])
        drow("exec/s, 8 clients × own sandbox, PostgreSQL ⁹", t["postgres_c8_per_s"])
        drow("  … PostgreSQL / SQLite ⁹", t["postgres_vs_sqlite_c8"])
    if "idle" in res:
        i = res["idle"]
        ok = met(i["mib_per_sandbox"], TARGET_IDLE_MIB, False)
        drow(
            f"idle sandbox, host MiB (MemAvailable Δ / {i['n']})",
            i["mib_per_sandbox"],
            f"≤ {TARGET_IDLE_MIB:g} MiB {ok}",
        )
        if i.get("cgroup_usage_mib_per_sandbox") is not None:
            drow(
                "idle sandbox, cgroup memory usage MiB",
                i["cgroup_usage_mib_per_sandbox"],
            )
        if i.get("server_rss_mib_per_sandbox") is not None:
            drow("idle sandbox, server RSS growth MiB", i["server_rss_mib_per_sandbox"])
        drow(f"{i['n']} idle sandboxes created in, s", i["create_s"])
    out.append("")
    out.append(
        "¹ dsec: `create` → first `run(['/bin/true'])` returns, via the SDK over HTTP. "
        "runc/docker/floor have no separate first exec: their number is a whole run of "
        "`/bin/true` (create, start, exit, delete): more work, so there the ratio flatters "
        "dsec; the lifecycle rows compare equal work.  "
    )
    out.append("² dsec: create → exec → stop, the same work as one runc/docker/floor run.  ")
    out.append(
        "³ create → exec `/bin/true` → stop cycles completed per second with c in flight "
        "(dsec: AsyncClient; runc/docker: c parallel command lines; floor: c worker "
        "processes).  "
    )
    out.append(
        "⁴ dsec only: create → first exec with c in flight, all sandboxes left running; then "
        "all stopped, timed apart."
    )
    out.append(
        "⁵ the same as ⁴, driven by `target/release/dsec-loadgen` (Rust) instead of the Python "
        "SDK: on 2 cores the SDK's own CPU is taken from the server, so this row is the "
        "server's capacity."
    )
    out.append(
        "⁶ fncall: every call runs in a fresh worker (a native container created ahead of "
        "demand) that is destroyed afterwards; compare with the whole-lifecycle rows above "
        "(a container created, used once, stopped) and `docker run`."
    )
    if "trajectory" in res:
        out.append(
            "⁷ trajectory: every exec is appended to the SQLite trajectory log (WAL, group "
            f"commit, --trajectory-sync {args.trajectory_sync}) before its result returns. "
            "The log's cost is the time an exec waits for its append, as a share of the "
            "round trip. Fast-forward re-issues 1,000 recorded steps one after "
            "another over one kept-alive connection; the server-side row is the sum of its "
            "exec handler's time (`dsec_exec_seconds`)."
        )
    if "dsec-docker" in res:
        out.append(
            '⁸ dsec with `backend="docker"`: the same SDK calls, each sandbox a container '
            "of the Docker daemon (the rootfs `docker import`ed), each command a docker exec; "
            "sequential, one client. The native value of the same row is in the last column."
        )
    if "trajectory-stores" in res:
        out.append(
            "⁹ trajectory-stores: two servers of the same build, one with the log in "
            "`<state>/trajectory.db`, one with `--trajectory-db` in a PostgreSQL cluster on "
            "loopback started for the run, measured in alternating rounds; "
            f"--trajectory-sync {args.trajectory_sync}."
        )
    return out


def vm_table(res: dict[str, Any]) -> list[str]:
    """The VM backends beside the container backend, all from the "vm" part."""
    out = [
        "#### VM backends",
        "",
        "| metric | container | microvm | vm | microvm/container | vm/container | target |",
        "|---|---|---|---|---|---|---|",
    ]

    def g(*keys: str) -> Any:
        return get(res, "vm", *keys)

    def row(name: str, key: tuple[str, str], target: float | None = None, c: Any = None) -> None:
        """One row of g(f"{backend}_{key[0]}", key[1]) per backend, with the ratios."""
        c = g(f"container_{key[0]}", key[1]) if c is None else c
        m = g(f"microvm_{key[0]}", key[1])
        w = g(f"vm_{key[0]}", key[1])
        goal = ""
        if target is not None:
            goal = f"≤ {target:g} ms: microvm {met(m, target, False)}, vm {met(w, target, False)}"
        # A container figure of 0 or less (noise in a MemAvailable difference) has no ratio.
        cr = c if isinstance(c, (int, float)) and c > 0 else None
        out.append(
            f"| {name} | {fmt(c)} | {fmt(m)} | {fmt(w)} | {ratio(m, cr)} | {ratio(w, cr)} "
            f"| {goal} |"
        )

    def single(name: str, c: Any = None, m: Any = None, w: Any = None) -> None:
        """A row without ratios."""
        out.append(f"| {name} | {fmt(c)} | {fmt(m)} | {fmt(w)} | | | |")

    acc = g("accelerator") or {}
    out.append(f"| accelerator | - | {acc.get('microvm') or '-'} | {acc.get('vm') or '-'} | | | |")
    cfe50 = g("container_first_exec", "p50_ms")
    cfe99 = g("container_first_exec", "p99_ms")
    row(
        "create → first exec, restore, p50 ms ᵃ",
        ("restore", "p50_ms"),
        TARGET_VM_RESTORE_MS,
        c=cfe50,
    )
    row("create → first exec, restore, p99 ms ᵃ", ("restore", "p99_ms"), c=cfe99)
    row("create → first exec, cold boot, p50 ms ᵇ", ("cold", "p50_ms"), c=cfe50)
    row("create → first exec, cold boot, p99 ms ᵇ", ("cold", "p99_ms"), c=cfe99)
    single(
        "boot template (cold boot + save), ms ᶜ",
        m=g("microvm_template_ms"),
        w=g("vm_template_ms"),
    )
    single(
        "first create of a backend (template + restore → first exec), ms ᶜ",
        m=g("microvm_first_create_ms"),
        w=g("vm_first_create_ms"),
    )
    single(
        "first VM create on a fresh server (image disk, template), ms ᶜ",
        m=g("first_vm_create_ms"),
    )
    single(
        "boot template's scratch qcow2 (copied per restore), MiB ᶜ",
        m=g("microvm_template_qcow2_mib"),
        w=g("vm_template_qcow2_mib"),
    )
    single(
        "boot template's memory file on disk (mapped copy-on-write by restores), MiB ᶜ",
        m=g("microvm_template_memory_mib"),
        w=g("vm_template_memory_mib"),
    )
    row(
        f"fork({g('microvm_fork', 'children')}) of a running sandbox → every child "
        "answers, p50 ms ᶠ",
        ("fork", "p50_ms"),
        TARGET_VM_FORK_MS,
    )
    single(
        "fork child, QEMU RssAnon MiB per child ᶠ",
        m=g("microvm_fork", "anon_mib_per_child"),
        w=g("vm_fork", "anon_mib_per_child"),
    )
    row("exec round trip `true`, p50 ms ᵈ", ("exec", "p50_ms"), TARGET_VM_EXEC_MS)
    row("exec round trip `true`, p99 ms ᵈ", ("exec", "p99_ms"))
    row("exec, server-side duration p50 ms ᵈ", ("exec", "server_p50_ms"))
    n_idle = g("microvm_idle", "n")
    row(f"idle sandbox, host MiB (MemAvailable Δ / {n_idle}) ᵉ", ("idle", "mib_per_sandbox"))
    single(
        "idle VM, QEMU VmRSS MiB per VM ᵉ",
        m=g("microvm_idle", "qemu_rss_mib_per_vm"),
        w=g("vm_idle", "qemu_rss_mib_per_vm"),
    )
    single(
        "idle VM, QEMU RssAnon MiB per VM ᵉ",
        m=g("microvm_idle", "qemu_anon_mib_per_vm"),
        w=g("vm_idle", "qemu_anon_mib_per_vm"),
    )
    n_many = g("microvm_many", "n")
    if n_many:
        single(
            f"{n_many} idle microVMs held: host MiB per VM (MemAvailable Δ) / RssAnon MiB ᵍ",
            m=f"{fmt(g('microvm_many', 'mib_per_sandbox'))} / "
            f"{fmt(g('microvm_many', 'qemu_anon_mib_per_vm'))}",
        )
        single(
            f"exec `true` in each of the {n_many} held, p50 / p99 ms (failed) ᵍ",
            m=f"{fmt(g('microvm_many', 'exec_each', 'p50_ms'))} / "
            f"{fmt(g('microvm_many', 'exec_each', 'p99_ms'))} "
            f"({g('microvm_many', 'exec_each', 'failed')})",
        )
    single(
        "idle container, cgroup memory usage MiB ᵉ",
        c=g("container_idle", "cgroup_usage_mib_per_sandbox"),
    )
    out.append("")
    out.append(
        f'ᵃ `create(backend=...)` → the first `run("true")` returns, sync SDK, sequential '
        f"(stop after each, untimed; n={g('n')} per VM backend after its first create, "
        f"{g('container_first_exec', 'n')} containers). A VM restores its backend's boot "
        "template: a copy of the template's scratch qcow2, QEMU mapping the template's "
        "memory file copy-on-write and loading its device state (`-incoming`), a fresh "
        "identity for the guest.  "
    )
    out.append(
        f"ᵇ the same against a second server started with `--vm-boot cold` (n={g('cold_n')} "
        "per backend, after one warm-up each): every VM boots its kernel. The container "
        "column repeats the container create → first exec.  "
    )
    out.append(
        "ᶜ template: a backend's first create of a shape (boots the template guest, saves it, "
        "then restores it as every later create does) minus the restore p50. The first VM "
        "create on a fresh server, made before those with another shape (256 MiB), also "
        "builds the image's disk and waits for the accelerator probe (KVM if a guest boots "
        "under it, else TCG) that the server starts at launch, if that is still running. "
        "Scratch qcow2 and memory file: what the template keeps on disk (before "
        "shared-memory templates, the qcow2 held the saved RAM too).  "
    )
    out.append(
        f'ᶠ `sb.fork(n)` of one running sandbox until each child has answered `run("true")` '
        f"in turn, then the children stopped (untimed); {g('microvm_fork', 'n')} rounds per "
        "backend. A VM fork saves the paused parent once (disk copy, RAM into a file through a "
        "receiving QEMU, device state) and restores each child from it, its RAM mapped "
        "copy-on-write; a container fork commits the writable layer. RssAnon: what each "
        "child's QEMU holds alone, read once all answered (target ≤ 40 MiB).  "
    )
    out.append(
        f"ᵍ {g('microvm_many', 'n') or '-'} microVMs created one after another and held "
        f'(create failures: {g("microvm_many", "failed")}), then one `run("true")` in each '
        "while all run (target: held, exec works in each).  "
    )
    out.append(
        'ᵈ `run("true")` (`/bin/sh -c true`) in one running sandbox, sync Client, after 10 '
        "warm-ups; server-side: the result's `duration_ms`.  "
    )
    cidle = g("container_idle") or {}
    src = (
        f"the container figure is the idle part's ({cidle.get('n')} sandboxes)"
        if cidle.get("from_idle_part")
        else f"the container figures are from {cidle.get('n')} containers made the same way"
    )
    out.append(
        "ᵉ MemAvailable (averaged over 1 s after 2 s of settling) before minus after creating "
        "the idle sandboxes one after another, over their number; other sessions on the host "
        "move MemAvailable by tens of MiB, so small figures are noise. VmRSS and RssAnon: "
        "summed over the sandboxes' QEMU processes (VmRSS also counts QEMU's shared "
        f"libraries in each), over the number of VMs; {src}."
    )
    return out


def sdk_table(res: dict[str, Any]) -> list[str]:
    """The SDK beside the lean client, all from the "sdk" part."""

    def g(*keys: str) -> Any:
        return get(res, "sdk", *keys)

    c = CONCURRENCY
    out = [
        "#### The Python SDK",
        "",
        "| metric | SDK | other client | SDK / other | target |",
        "|---|---|---|---|---|",
    ]

    def row(name: str, v: Any, other: Any = None, target: str = "", digits: int = 2) -> None:
        out.append(
            f"| {name} | {fmt(v, digits)} | {fmt(other, digits)} | {ratio(v, other)} | {target} |"
        )

    cpu_goal = f"≤ {TARGET_SDK_CPU_US:g} µs"
    clients = {
        "sdk_run": "SDK `run(['/bin/true'])`",
        "raw_run": "raw socket `POST …/exec` (the floor)",
        "sdk_info": "SDK `info()`",
        "raw_info": "raw socket `GET` + JSON (the floor)",
        "httpx_info": "httpx `GET` + JSON (the SDK's transport before)",
        "http_client_info": "http.client `GET` + JSON",
        "aiohttp_info": "aiohttp `GET` + JSON",
    }
    for mode, label in [("sync", "sync"), ("async_c1", "async, 1 in flight"),
                        (f"async_c{c}", f"async, {c} in flight")]:  # fmt: skip
        for key, name in clients.items():
            if mode != "sync":
                name = name.replace("raw socket", "raw asyncio protocol")
            mine = g("cpu", mode, "sdk_run" if key == "raw_run" else "sdk_info", "cpu_us")
            v = g("cpu", mode, key, "cpu_us")
            if v is None:
                continue
            best = g("cpu", mode, key, "cpu_us_best")
            sdk_row = key.startswith("sdk")
            row(
                f"CPU per request µs, {label}: {name} (best block {fmt(best, 0)}) ᵃ",
                v if sdk_row else mine,
                None if sdk_row else v,
                f"{cpu_goal} {met(v, TARGET_SDK_CPU_US, False)}" if sdk_row else "",
                digits=0,
            )
    sdk_c, lean_c = g("create", "sdk_per_s"), g("create", "lean_per_s")
    ok = met(sdk_c, TARGET_SDK_CREATIONS_PER_S, True)
    close = met(ratio_value(sdk_c, lean_c), TARGET_SDK_VS_LEAN, True)
    row(
        f"creations/s at concurrency {c}, AsyncClient vs dsec-loadgen ᵇ",
        sdk_c,
        lean_c,
        f"≥ {TARGET_SDK_CREATIONS_PER_S:g}/s {ok}, ≥ {TARGET_SDK_VS_LEAN:g}× lean {close}",
        digits=0,
    )
    calls, lean_calls = g("fncall", "async_calls_per_s"), g("fncall", "lean", "calls_per_s")
    row(
        f"fncall calls/s at concurrency {c}, `AsyncClient.call` vs dsec-loadgen --calls ᶜ",
        calls,
        lean_calls,
        f"≥ {TARGET_ASYNC_CALLS_PER_S:g}/s {met(calls, TARGET_ASYNC_CALLS_PER_S, True)}",
        digits=0,
    )
    p50 = g("fncall", "sync", "p50_ms")
    row(
        "fncall round trip p50 ms, sync `client.call` ᶜ",
        p50,
        g("fncall", "lean", "call_p50_ms"),
        f"≤ {TARGET_SYNC_CALL_P50_MS:g} ms {met(p50, TARGET_SYNC_CALL_P50_MS, False)}",
    )
    row("fncall round trip p99 ms, sync `client.call` ᶜ", g("fncall", "sync", "p99_ms"))
    a = g("active") or {}
    if a:
        row(
            f"{a['n']} sandboxes active at once, one AsyncClient: failures ᵈ",
            a["failed"],
            target="0 " + ("✅" if a["failed"] == 0 else "❌"),
            digits=0,
        )
        row(f"  … wall s, all {a['n']} lifecycles ᵈ", a["wall_s"])
        row("  … lifecycle p50 / p99 ms ᵈ", a["p50_ms"], a["p99_ms"], digits=0)
    out.append("")
    out.append(
        "ᵃ this process's user + system CPU time (`time.process_time`) per request, nothing "
        "subtracted: request building, the HTTP exchange (syscalls included), JSON, the "
        "result objects. Median of blocks of 100 requests, the clients taking turns block "
        "by block (best block in brackets: the cost when the host is not busy). The other "
        "clients make the same `GET /v1/sandboxes/{id}` as `info()` (the raw socket also the "
        "same exec as `run`) and parse its JSON; their rows show the SDK's figure first and "
        "theirs second. The raw socket is the least a Python client can do (one blocking "
        "socket, no timeouts, no pool), the raw asyncio protocol the least an asyncio one "
        "can (an `asyncio.Protocol` per connection in flight, a future per answer): what is "
        "left above them is the SDK's own. Where a floor is over the target, no client of "
        "its kind meets it on that host.  "
    )
    out.append(
        f"ᵇ create → first exec of `/bin/true`, {c} in flight, all left running and stopped "
        "after (bench part `create`'s creations/s), alternating with dsec-loadgen runs of "
        "the same size; means of the rounds. On a 2-core host the client's CPU is taken "
        "from the server: the ratio is what the SDK costs.  "
    )
    out.append(
        "ᶜ `client.call(['/bin/true'], image=...)`: one `POST /v1/calls` each (a fncall "
        "handle is created, used and stopped in the server). The sync round trips are "
        "paced at ≤ 100/s; the lean column is dsec-loadgen --calls at the same concurrency "
        "(its p50 is under load).  "
    )
    out.append(
        "ᵈ every sandbox at once from one `AsyncClient` (connections bounded by its "
        "`max_connections`): create, `write_file`, three `run`s checked for their output, "
        "`stop`."
    )
    return out


def ratio_value(a: Any, b: Any) -> float | None:
    if a is None or b is None or not b:
        return None
    return float(a) / float(b)


def report(res: dict[str, Any], args: argparse.Namespace, cs: list[int], notes: list[str]) -> str:
    out = []
    git = (
        run_cmd(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]).stdout.strip()
        or "uncommitted"
    )
    out.append(f"### dsec bench — {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} ({git})")
    out.append("")
    sizes = []
    if any(part not in ("vm", "e2b") for part in res):
        sizes.append(f"n={args.n} sequential; concurrent runs of max(n, 8*c)")
    if "vm" in res:
        sizes.append(
            f"VM backends: {args.vm_n} restores, {args.vm_cold_n} cold boots, "
            f"{args.vm_exec_n} exec round trips, {args.vm_idle_n} idle sandboxes, "
            f"{args.vm_fork_n} forks per backend"
        )
    cmd = " ".join(["python3", "bench/bench.py", *sys.argv[1:]])
    sized = f" {'; '.join(sizes)}." if sizes else ""
    busybox = " Rootfs: busybox." if set(res) - {"e2b"} else ""
    out.append(f"Host: {host_description()}.{busybox}{sized} Command: `{cmd}`")
    out.append("")
    if any(part not in ("vm", "sdk", "e2b") for part in res):
        out += main_table(res, args, cs)
    if "vm" in res:
        out += vm_table(res)
    if "sdk" in res:
        out += sdk_table(res)
    if "e2b" in res:
        from .e2b import table as e2b_table  # e2b imports this module

        out += ["", "#### The e2b SDK against dsec (issue 17)", ""]
        out += e2b_table(res["e2b"])
    failures = []
    for part, r in res.items():
        if isinstance(r, dict):
            if isinstance(r.get("failed"), int) and r["failed"]:
                failures.append(f"{part}: {r['failed']} failed")
            for k, v in r.items():
                if isinstance(v, dict) and v.get("failed"):
                    failures.append(f"{part}/{k}: {v['failed']} failed")
    if failures:
        notes.append("failures: " + "; ".join(failures))
    for n in notes:
        out.append("")
        out.append(f"Note: {n}")
    out.append("")
    out.append(
        "<details><summary>raw</summary>\n\n```json\n"
        + json.dumps(rounded(res), indent=1, default=str)
        + "\n```\n</details>"
    )
    return "\n".join(out)
