"""`trajectory`: what the trajectory log costs on the exec path, and fast-forward of 1,000
recorded steps; `trajectory-stores`: the exec round trip with the log on SQLite and on
PostgreSQL, side by side."""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from postgres_cluster import PostgresCluster, pg_bin_dir

from .common import TAG, Dsec, log


def _metric_sum_count(url: str, name: str) -> tuple[float, float]:
    """`name_sum` and `name_count` of a histogram on the server's /metrics."""
    text = httpx.get(url + "/metrics", trust_env=False, timeout=30).text
    got = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for k in got:
            if line.startswith(f"{name}_{k}"):  # summed over label sets
                got[k] += float(line.split()[-1])
    return got["sum"], got["count"]


def _raw_exec(conn: Any, sandbox: str, body: bytes) -> dict[str, Any]:
    """One `POST /exec` over a kept-alive http.client connection (far less client CPU than
    the SDK, so the rate is the server's)."""
    conn.request(
        "POST",
        f"/v1/sandboxes/{sandbox}/exec",
        body=body,
        headers={"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"exec answered {resp.status}: {data[:300]!r}")
    result: dict[str, Any] = json.loads(data)
    return result


def bench_dsec_trajectory(d: Dsec, n: int) -> dict[str, Any]:
    """What the trajectory log costs: exec rate of `/bin/true` without and with a
    trajectory id (both are logged), the time each exec waits for its log append (from the
    server's `dsec_trajectory_append_seconds`), and fast-forward of 1,000 recorded steps."""
    u = urlsplit(d.url)
    host = u.hostname or "127.0.0.1"
    conn = http.client.HTTPConnection(host, u.port or 80, timeout=60)
    plain = d.client.create(image=d.image, labels=d.labels)
    d.track(plain.id)
    traj = d.client.create(
        image=d.image, labels=d.labels, trajectory_id=f"{TAG}-{uuid.uuid4().hex[:8]}"
    )
    d.track(traj.id)
    res: dict[str, Any] = {"n": n}
    try:
        step = 0
        elapsed = {"plain": 0.0, "traj": 0.0}
        waits = {"plain": 0.0, "traj": 0.0}
        done = {"plain": 0, "traj": 0}
        rounds = 10
        for r in range(rounds + 1):  # round 0 warms up; rounds alternate to cancel drift
            for kind in ("plain", "traj"):
                sb = plain if kind == "plain" else traj
                s0, _ = _metric_sum_count(d.url, "dsec_trajectory_append_seconds")
                t0 = time.perf_counter()
                for _ in range(max(n // rounds, 10)):
                    body: dict[str, Any] = {"cmd": ["/bin/true"]}
                    if kind == "traj":
                        body["step"] = step
                        step += 1
                    _raw_exec(conn, sb.id, json.dumps(body).encode())
                    if r:
                        done[kind] += 1
                if r:
                    elapsed[kind] += time.perf_counter() - t0
                    s1, _ = _metric_sum_count(d.url, "dsec_trajectory_append_seconds")
                    waits[kind] += s1 - s0
        for kind in ("plain", "traj"):
            res[f"{kind}_per_s"] = done[kind] / elapsed[kind]
            res[f"{kind}_rtt_ms"] = elapsed[kind] / done[kind] * 1e3
            res[f"{kind}_append_ms"] = waits[kind] / done[kind] * 1e3
            # The append is on each exec's critical path: its share of the round trip is
            # what logging costs sequential throughput.
            res[f"{kind}_log_share_pct"] = 100.0 * waits[kind] / elapsed[kind]
        res["traj_vs_plain_pct"] = 100.0 * (1 - res["traj_per_s"] / res["plain_per_s"])

        # Concurrent: 8 clients, each with its own sandbox (the RL shape).
        res["c8_per_s"], res["c8_append_ms"], res["c8_log_share_pct"] = _concurrent_execs(
            d, 8, max(n // 8, 20)
        )

        # Fast-forward: a reconnected client re-issues 1,000 recorded steps.
        ff = d.client.create(
            image=d.image,
            labels=d.labels,
            trajectory_id=f"{TAG}-ff-{uuid.uuid4().hex[:8]}",
        )
        d.track(ff.id)
        try:
            bodies = [
                json.dumps({"cmd": ["/bin/echo", str(i)], "step": i}).encode() for i in range(1000)
            ]
            log("trajectory: recording 1,000 steps")
            for req in bodies:
                _raw_exec(conn, ff.id, req)
            log("trajectory: fast-forwarding 1,000 steps")
            h0, _ = _metric_sum_count(d.url, "dsec_exec_seconds")
            t0 = time.perf_counter()
            for i, req in enumerate(bodies):
                got = _raw_exec(conn, ff.id, req)
                if not got["replayed"] or got["stdout"] != f"{i}\n":
                    raise RuntimeError(f"step {i} was not replayed: {got}")
            res["replay_1000_s"] = time.perf_counter() - t0
            # The server's own time in the exec handler (the rest is HTTP and the client).
            h1, _ = _metric_sum_count(d.url, "dsec_exec_seconds")
            res["replay_1000_server_s"] = h1 - h0
            again = d.client.get(ff.id)
            t0 = time.perf_counter()
            for i in range(1000):
                again.run(["/bin/echo", str(i)])
            res["replay_1000_sdk_s"] = time.perf_counter() - t0
        finally:
            ff.stop()
            d.untrack(ff.id)
    finally:
        conn.close()
        for sb in (plain, traj):
            sb.stop()
            d.untrack(sb.id)
    return res


def _exec_loop(url: str, sandbox: str, count: int, first_step: int | None) -> None:
    """`count` sequential execs of `/bin/true` over one kept-alive connection, at steps
    from `first_step` (None: without a step)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=60)
    try:
        for i in range(count):
            body: dict[str, Any] = {"cmd": ["/bin/true"]}
            if first_step is not None:
                body["step"] = first_step + i
            _raw_exec(conn, sandbox, json.dumps(body).encode())
    finally:
        conn.close()


def _exec_rounds(d: Dsec, sandbox: str, count: int, first_step: int) -> tuple[float, float]:
    """`_exec_loop`, timed: (seconds, seconds the execs waited on their log appends)."""
    s0, _ = _metric_sum_count(d.url, "dsec_trajectory_append_seconds")
    t0 = time.perf_counter()
    _exec_loop(d.url, sandbox, count, first_step)
    wall = time.perf_counter() - t0
    s1, _ = _metric_sum_count(d.url, "dsec_trajectory_append_seconds")
    return wall, s1 - s0


def _concurrent_execs(d: Dsec, par: int, per: int) -> tuple[float, float, float]:
    """`par` clients, each with its own sandbox (no trajectory id), `per` execs each:
    exec/s, the mean append wait in ms, and the appends' share of the clients' time (%)."""
    boxes = [d.client.create(image=d.image, labels=d.labels) for _ in range(par)]
    for b in boxes:
        d.track(b.id)
    try:
        s0, c0 = _metric_sum_count(d.url, "dsec_trajectory_append_seconds")
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=_exec_loop, args=(d.url, b.id, per, None)) for b in boxes
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        s1, c1 = _metric_sum_count(d.url, "dsec_trajectory_append_seconds")
    finally:
        for b in boxes:
            b.stop()
            d.untrack(b.id)
    waited = s1 - s0
    return par * per / wall, waited / max(c1 - c0, 1) * 1e3, 100.0 * waited / (wall * par)


def bench_trajectory_stores(
    d: Dsec, args: argparse.Namespace, rootfs: Path, n: int
) -> dict[str, Any] | None:
    """`d` (its log on SQLite) beside a second server of the same build whose log is in a
    PostgreSQL cluster started here (initdb in a temporary directory, a loopback port,
    stopped by pid at the end); None where PostgreSQL is not installed."""
    if pg_bin_dir() is None:
        return None
    log("trajectory-stores: starting a PostgreSQL cluster")
    cluster = PostgresCluster().start()
    try:
        pg = Dsec(args, rootfs, server_args=["--trajectory-db", cluster.database()], name="pg")
        try:
            return _compare_stores(d, pg, n)
        finally:
            pg.close()
    finally:
        cluster.stop()


def _compare_stores(sqlite: Dsec, postgres: Dsec, n: int) -> dict[str, Any]:
    """The exec round trip of a trajectory sandbox with the log on SQLite and on
    PostgreSQL: two servers of the same build, measured in alternating rounds (so that
    drift in the machine's load falls on both), sequentially and with 8 clients."""
    stores = {"sqlite": sqlite, "postgres": postgres}
    boxes = {}
    for name, d in stores.items():
        sb = d.client.create(
            image=d.image, labels=d.labels, trajectory_id=f"{TAG}-{name}-{uuid.uuid4().hex[:8]}"
        )
        d.track(sb.id)
        boxes[name] = sb
    res: dict[str, Any] = {"n": n}
    try:
        wall = dict.fromkeys(stores, 0.0)
        waits = dict.fromkeys(stores, 0.0)
        rounds, per = 10, max(n // 10, 10)
        for r in range(rounds + 1):  # round 0 warms up
            for name, d in stores.items():
                w, a = _exec_rounds(d, boxes[name].id, per, r * per)
                if r:
                    wall[name] += w
                    waits[name] += a
        for name in stores:
            done = rounds * per
            res[f"{name}_rtt_ms"] = wall[name] / done * 1e3
            res[f"{name}_append_ms"] = waits[name] / done * 1e3
            res[f"{name}_log_share_pct"] = 100.0 * waits[name] / wall[name]
        for name, d in stores.items():
            c8 = _concurrent_execs(d, 8, max(n // 8, 20))
            res[f"{name}_c8_per_s"], res[f"{name}_c8_append_ms"], _ = c8
        res["postgres_vs_sqlite_rtt"] = res["postgres_rtt_ms"] / res["sqlite_rtt_ms"]
        res["postgres_vs_sqlite_c8"] = res["postgres_c8_per_s"] / res["sqlite_c8_per_s"]
    finally:
        for name, sb in boxes.items():
            sb.stop()
            stores[name].untrack(sb.id)
    return res
