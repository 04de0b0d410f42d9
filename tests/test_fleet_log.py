"""The fleet's trajectory log on PostgreSQL: a sandbox's log outlives its edge (the
apiserver reads it from the database once the edge is gone) and `dsec replay` re-runs it on
another edge. Real etcd, PostgreSQL and edges; the first edge is SIGKILLed."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import dsec
import dsec_local
import pytest
from dsec_fleet import Apiserver, Etcd, etcd_unavailable_reason, start_edges
from dsec_testlib import DSEC_BIN, make_tempdir, require, safe_rmtree
from postgres_cluster import PostgresCluster, pg_bin_dir

LEASE_TTL = 3


@pytest.fixture
def tmp() -> Iterator[Path]:
    require("etcd", etcd_unavailable_reason())
    require("postgres", None if pg_bin_dir() else "no initdb in /usr/lib/postgresql/*/bin")
    d = make_tempdir("dsec-fleet-log-")
    yield d
    safe_rmtree(d)


@pytest.mark.timeout(300)
def test_a_log_outlives_its_edge_and_its_trajectory_replays_elsewhere(
    tmp: Path, busybox_rootfs: Path
) -> None:
    cluster = PostgresCluster().start()
    etcd = Etcd(tmp / "etcd", log_path=tmp / "etcd.log").start()
    started: list[dsec_local.Server] = []
    try:
        db = cluster.database("fleet")
        edges = start_edges(
            tmp,
            etcd.url,
            ("l1", "l2"),
            started,
            args_of=lambda name: ["--trajectory-db", db],
            lease_ttl=LEASE_TTL,
        )
        api = Apiserver(
            tmp / "api", etcd=etcd.url, extra_args=["--trajectory-db", db], log_path=tmp / "a.log"
        )
        started.append(api)
        api.start()
        api.wait_for_edges(list(edges))
        tid = f"t-{uuid.uuid4().hex[:8]}"
        commands = ["echo one", "echo two >&2; exit 3", "echo three"]
        with api.client() as c:
            c.import_image(str(busybox_rootfs), name="busybox")
            # A sandbox on l1, the edge that will die.
            sb = None
            while sb is None:
                candidate = c.create(image="busybox", trajectory_id=tid)
                if candidate.info().edge == "l1":
                    sb = candidate
                else:
                    candidate.stop()
                    tid = f"t-{uuid.uuid4().hex[:8]}"
            first = [sb.run(cmd) for cmd in commands]
            assert [r.exit_code for r in first] == [0, 3, 0]
            sandbox_id = sb.id
            edges["l1"].kill9()
            api.wait_for_edges(["l2"], timeout=LEASE_TTL + 5)
            # Requests to the sandbox say its edge is gone; its log is still there.
            with pytest.raises(dsec.Unavailable, match="l1"):
                c.get(sandbox_id).run("true")
            log = c.log(sandbox_id)
            assert log["sandbox"]["id"] == sandbox_id
            steps = log["steps"]
            assert [s["request"]["argv"][-1] for s in steps] == commands
            assert [s["result"]["exit_code"] for s in steps] == [0, 3, 0]
            assert c.log(sandbox_id, trajectory_id=tid)["steps"] == steps
            with pytest.raises(dsec.NotFound, match="fleet's trajectory log"):
                c.log("l1-0123456789ab")
        # `dsec replay` through the apiserver re-runs the recorded steps on the edge that
        # is left, from the log of an edge that is gone, and finds they match.
        replay = subprocess.run(
            [str(DSEC_BIN), "replay", sandbox_id, "--url", api.url],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert replay.returncode == 0, replay.stdout + replay.stderr
        assert "replaying 3 steps" in replay.stderr, replay.stderr
    finally:
        for s in reversed(started):
            s.cleanup()
        etcd.stop()
        cluster.stop()
