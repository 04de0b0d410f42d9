"""The e2b SDK against dsec beside dsec's own SDK, in one run on one server (issue 17).

One `dsec serve --e2b-listen --e2b-envd-listen` of its own, on an image with bash (the
suite's Debian test image by default); each iteration times, through the real e2b SDK
(`pip install e2b==2.63.0`), `Sandbox.create(image)` → `commands.run("true")` → `kill()`,
and through dsec's SDK `client.create(image=...)` → `sb.run("true")` → `sb.stop()`,
alternating so that a busy machine hurts both alike. The ratio e2b / dsec is the target
(≤ 1.5).

The e2b SDK runs every command as `/bin/bash -l -c CMD` (a login shell reading
/etc/profile), where dsec's `sb.run("true")` runs `/bin/sh -c true`: a third cycle runs
dsec's SDK with the e2b SDK's argv, to tell what the protocol costs from what the shell
does. Each cycle is also timed step by step (create, run, kill/stop) and its client CPU
(`time.process_time`) kept, and a fourth cycle sends the e2b SDK's own three requests
(POST /v2/sandboxes, the Connect stream process.Process/Start, DELETE /sandboxes/{id}) by
hand over two kept-alive `http.client` connections: dsec's E2B endpoints without the SDK,
so what the SDK spends in Python is told from what the server takes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec_local import free_port, percentile

from . import common, report

DEBIAN_ROOTFS = Path(os.environ.get("DSEC_TEST_DEBIAN_ROOTFS", "/var/tmp/dsec-test-debian-rootfs"))

#: The cycles, in the order they run and are reported.
CYCLES = {
    "e2b": "e2b SDK (2.63.0) against dsec",
    "e2b_raw": "E2B's protocol by hand (`http.client`), the SDK's requests",
    "dsec": 'dsec SDK, `sb.run("true")`',
    "dsec_bash": 'dsec SDK, `sb.run(["/bin/bash", "-l", "-c", "true"])`',
}
STEPS = ("create", "run", "stop")


def debian_rootfs() -> Path:
    if not (DEBIAN_ROOTFS / "bin/bash").exists():
        common.log(f"building {DEBIAN_ROOTFS} with scripts/make-debian-rootfs.sh")
        subprocess.run(
            [str(common.REPO / "scripts/make-debian-rootfs.sh"), str(DEBIAN_ROOTFS)], check=True
        )
    return DEBIAN_ROOTFS


def bench_e2b(
    args: argparse.Namespace, n: int, rootfs: Path | None = None
) -> dict[str, Any] | None:
    """The three cycles `n` times each on a server of their own (closed at the end);
    None when the e2b SDK is not installed."""
    try:
        from e2b import Sandbox
    except ImportError:
        common.log("e2b: the e2b SDK is not installed (pip install e2b==2.63.0): skipped")
        return None
    rootfs = rootfs or debian_rootfs()
    api_port, envd_port = free_port(), free_port()
    e2b_opts: dict[str, Any] = {
        "api_url": f"http://127.0.0.1:{api_port}",
        "sandbox_url": f"http://127.0.0.1:{envd_port}",
        "api_key": "e2b_" + "0" * 40,
    }
    server_args = ["--e2b-listen", f"127.0.0.1:{api_port}"]
    server_args += ["--e2b-envd-listen", f"127.0.0.1:{envd_port}"]
    ns = argparse.Namespace(dsec_bin=args.dsec_bin, trajectory_sync=args.trajectory_sync)
    d = common.Dsec(ns, rootfs, server_args, name="e2b")
    steps: dict[str, dict[str, list[float]]] = {c: {s: [] for s in STEPS} for c in CYCLES}
    total: dict[str, list[float]] = {c: [] for c in CYCLES}
    cpu: dict[str, list[float]] = {c: [] for c in CYCLES}

    def timed(cycle: str, step: str, fn: Callable[[], Any]) -> Any:
        t = time.perf_counter()
        out = fn()
        steps[cycle][step].append((time.perf_counter() - t) * 1000)
        return out

    def e2b_cycle() -> None:
        sb = timed(
            "e2b",
            "create",
            lambda: Sandbox.create(d.image, timeout=120, metadata=d.labels, **e2b_opts),
        )
        timed("e2b", "run", lambda: sb.commands.run("true"))
        timed("e2b", "stop", sb.kill)

    api = http.client.HTTPConnection("127.0.0.1", api_port)
    envd = http.client.HTTPConnection("127.0.0.1", envd_port)

    def call(conn: http.client.HTTPConnection, method: str, path: str, **kw: Any) -> bytes:
        conn.request(method, path, **kw)
        resp = conn.getresponse()
        body = resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"{method} {path}: {resp.status} {body[:200]!r}")
        return body

    def raw_cycle() -> None:
        key = {"X-API-KEY": e2b_opts["api_key"], "Content-Type": "application/json"}
        create = {"templateID": d.image, "timeout": 120, "metadata": d.labels}
        made = timed(
            "e2b_raw",
            "create",
            lambda: call(api, "POST", "/v2/sandboxes", body=json.dumps(create), headers=key),
        )
        sb = json.loads(made)
        start = json.dumps(
            {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"]}, "stdin": False}
        ).encode()
        headers = {
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
            "E2b-Sandbox-Id": sb["sandboxID"],
            "X-Access-Token": sb.get("envdAccessToken") or "",
        }
        envelope = b"\x00" + struct.pack(">I", len(start)) + start
        out = timed(
            "e2b_raw",
            "run",
            lambda: call(envd, "POST", "/process.Process/Start", body=envelope, headers=headers),
        )
        if b'"end"' not in out:
            raise RuntimeError(f"Start ended without an end event: {out[-200:]!r}")
        timed(
            "e2b_raw",
            "stop",
            lambda: call(api, "DELETE", f"/sandboxes/{sb['sandboxID']}", headers=key),
        )

    def dsec_cycle(name: str, cmd: str | list[str]) -> None:
        sb = timed(name, "create", lambda: d.client.create(image=d.image, labels=d.labels))
        d.track(sb.id)
        timed(name, "run", lambda: sb.run(cmd))
        timed(name, "stop", lambda: common.stop_sandbox(d, sb))

    cycles: dict[str, Callable[[], None]] = {
        "e2b": e2b_cycle,
        "e2b_raw": raw_cycle,
        "dsec": lambda: dsec_cycle("dsec", "true"),
        "dsec_bash": lambda: dsec_cycle("dsec_bash", ["/bin/bash", "-l", "-c", "true"]),
    }
    try:
        for fn in cycles.values():  # warm-up: connections, the image's first mount
            fn()
        for s in steps.values():
            for v in s.values():
                v.clear()
        for i in range(n):
            for name, fn in cycles.items():
                t, c = time.perf_counter(), time.process_time()
                fn()
                total[name].append((time.perf_counter() - t) * 1000)
                cpu[name].append((time.process_time() - c) * 1000)
            if i % 20 == 19:
                common.log(f"e2b: {i + 1}/{n}")
        binary = str(d.server.binary) if d.server else d.url
    finally:
        api.close()
        envd.close()
        d.close()
    return {
        "n": n,
        "binary": binary,
        "rootfs": str(rootfs),
        "cycles": {
            name: {
                "p50_ms": percentile(total[name], 0.5),
                "p90_ms": percentile(total[name], 0.9),
                "client_cpu_p50_ms": percentile(cpu[name], 0.5),
                **{f"{s}_p50_ms": percentile(steps[name][s], 0.5) for s in STEPS},
            }
            for name in CYCLES
        },
    }


def table(r: dict[str, Any]) -> list[str]:
    """The markdown table of a result of :func:`bench_e2b`."""
    c = r["cycles"]
    out = [
        '| create → run("true") → kill | p50 ms | p90 ms | create / run / kill p50 ms '
        "| client CPU p50 ms | e2b / this, p50 |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in CYCLES.items():
        row = c[key]
        split = " / ".join(report.fmt(row[f"{s}_p50_ms"], 1) for s in STEPS)
        ratio = report.ratio(c["e2b"]["p50_ms"], row["p50_ms"])
        if key == "dsec":
            value = report.ratio_value(c["e2b"]["p50_ms"], row["p50_ms"])
            ratio += " ✅" if value is not None and value <= 1.5 else " ❌ (target ≤ 1.5×)"
        out.append(
            f"| {label} | {report.fmt(row['p50_ms'])} | {report.fmt(row['p90_ms'])} | {split} "
            f"| {report.fmt(row['client_cpu_p50_ms'], 1)} | {ratio} |"
        )
    out.append("")
    out.append(f"n={r['n']} each, alternating; {r['binary']}; image {r['rootfs']}")
    return out
