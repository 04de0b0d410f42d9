"""Projects on a fleet, on real etcd: 2 edges, 2 apiservers (tools/dsec_fleet.py).

The projects live in etcd, so a project made through one apiserver is known to the other
at once; a project's token sees and touches only its own sandboxes on every edge (the
apiserver forwards it as the edge's admin token acting for the project), and cannot
pose as another project.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dsec
import httpx
import pytest
from dsec_fleet import Apiserver, Edge, Etcd, etcd_unavailable_reason, start_edges
from dsec_local import safe_rmtree
from dsec_testlib import make_tempdir, require, wait_until

ADMIN = "admin-token-of-the-fleet-projects-test"
EDGE_TOKEN = "edge-token-of-the-fleet-projects-test"
EDGES = ("pe1", "pe2")


@dataclass
class Fleet:
    edges: dict[str, Edge]
    a: Apiserver
    b: Apiserver


@pytest.fixture(scope="module")
def fleet(busybox_rootfs: Path) -> Iterator[Fleet]:
    require("etcd", etcd_unavailable_reason())
    tmp = make_tempdir("dsec-fleet-projects-")
    (tmp / "admin").write_text(ADMIN + "\n")
    (tmp / "edge").write_text(EDGE_TOKEN + "\n")
    etcd = Etcd(tmp / "etcd", log_path=tmp / "etcd.log").start()
    started: list[Edge | Apiserver] = []
    try:
        edges = start_edges(tmp, etcd.url, EDGES, started, token_file=tmp / "edge")
        a, b = (
            Apiserver(
                tmp / f"api-{x}",
                etcd=etcd.url,
                token_file=tmp / "admin",
                extra_args=["--edge-token-file", str(tmp / "edge")],
                log_path=tmp / f"api-{x}.log",
            )
            for x in "ab"
        )
        started += [a, b]
        a.start()
        b.start()
        a.wait_for_edges(EDGES)
        b.wait_for_edges(EDGES)
        with a.client(token=ADMIN) as c:
            c.import_image(str(busybox_rootfs), name="busybox")
        yield Fleet(edges, a, b)
    finally:
        for s in reversed(started):
            s.cleanup()
        etcd.stop()
        safe_rmtree(tmp)


def test_a_project_sees_only_its_own_on_every_edge(fleet: Fleet) -> None:
    with fleet.a.client(token=ADMIN) as admin:
        ta = admin.create_project("fleet-a")["token"]
        tb = admin.create_project("fleet-b", max_memory_mb=128)["token"]
        # The other apiserver knows them from etcd within its watch's delay.
        assert wait_until(
            lambda: (
                httpx.get(
                    fleet.b.url + "/v1/projects", headers={"Authorization": f"Bearer {ta}"}
                ).status_code
                == 200
            ),
            timeout=10,
        )
        with fleet.b.client(token=ta) as ca, fleet.b.client(token=tb) as cb:
            mine = [ca.create(image="busybox", memory_mb=64) for _ in range(4)]
            try:
                theirs = cb.create(image="busybox", memory_mb=64)
                assert {s.id for s in ca.list()} == {s.id for s in mine}
                assert [s.id for s in cb.list()] == [theirs.id]
                assert mine[0].run("echo hi").stdout == "hi\n"
                # Another project's sandbox, on whichever edge, is an unknown id.
                other = cb.get(theirs.id)
                for s in mine:
                    with pytest.raises(dsec.NotFound, match="not found"):
                        cb.get(s.id)
                    other.id = s.id  # b's client, aimed at a's sandbox
                    with pytest.raises(dsec.NotFound):
                        other.run("true")
                with pytest.raises(dsec.NotFound):
                    ca.get(theirs.id)
                owners = {s.id: s.info().project for s in admin.list()}
                assert {owners[s.id] for s in mine} == {"fleet-a"}
                assert owners[theirs.id] == "fleet-b"
                # Quotas apply on the edge the create is placed on (this one passes its
                # quota on any edge).
                with pytest.raises(dsec.QuotaExceeded, match="max_memory_mb"):
                    cb.create(image="busybox", memory_mb=256)
                # Usage is summed over the edges; a project lists only itself.
                (pa,) = ca.projects()
                assert pa["name"] == "fleet-a" and pa["usage"]["sandboxes"] == 4, pa
                assert pa["usage"]["memory_mb"] == 256
                assert {"fleet-a", "fleet-b"} <= {p["name"] for p in admin.projects()}
                # A project cannot pose as another with the edges' header.
                r = httpx.get(
                    fleet.b.url + "/v1/sandboxes",
                    headers={
                        "Authorization": f"Bearer {tb}",
                        "x-dsec-project": '{"name": "fleet-a", "quotas": {}}',
                    },
                )
                assert [s["id"] for s in r.json()] == [theirs.id], r.text
                # Nor reach an edge itself: the fleet's projects are the apiservers'.
                edge = next(iter(fleet.edges.values()))
                r = httpx.get(edge.url + "/v1/sandboxes", headers={"Authorization": f"Bearer {ta}"})
                assert r.status_code == 401, r.text
                # Fleet administration stays the admin's.
                for path in ("/v1/fleet/edges", "/metrics"):
                    r = httpx.get(fleet.b.url + path, headers={"Authorization": f"Bearer {ta}"})
                    assert r.status_code == 401, (path, r.text)
                with pytest.raises(dsec.Unauthorized):
                    ca.create_project("sneaky")
                with pytest.raises(dsec.Conflict, match="still has 4 sandbox"):
                    admin.delete_project("fleet-a")
            finally:
                for s in [*mine, *cb.list()]:
                    admin.get(s.id).stop()
        admin.delete_project("fleet-a")
        admin.delete_project("fleet-b")
        assert wait_until(
            lambda: (
                httpx.get(
                    fleet.b.url + "/v1/sandboxes", headers={"Authorization": f"Bearer {ta}"}
                ).status_code
                == 401
            ),
            timeout=10,
        )


def test_a_project_reads_its_stopped_sandboxes_logs_through_the_fleet(fleet: Fleet) -> None:
    with fleet.a.client(token=ADMIN) as admin:
        ta = admin.create_project("fleet-log-a")["token"]
        tb = admin.create_project("fleet-log-b")["token"]
    try:
        with fleet.b.client(token=ta) as ca, fleet.a.client(token=tb) as cb:
            sb = ca.create(image="busybox")
            sb.run("echo kept")
            sb.stop()
            log = ca.log(sb.id)
            assert log["sandbox"]["project"] == "fleet-log-a" and log["stopped_at"]
            assert [s["result"]["stdout"] for s in log["steps"]] == ["kept\n"]
            with pytest.raises(dsec.NotFound, match="not found"):
                cb.log(sb.id)
    finally:
        with fleet.a.client(token=ADMIN) as admin:
            admin.delete_project("fleet-log-a")
            admin.delete_project("fleet-log-b")


def test_project_changes_through_either_apiserver(fleet: Fleet) -> None:
    with fleet.a.client(token=ADMIN) as a, fleet.b.client(token=ADMIN) as b:
        a.create_project("twice")
        with pytest.raises(dsec.Conflict, match="already exists"):
            b.create_project("twice")
        r = httpx.post(
            fleet.b.url + "/v1/projects/twice/tokens", headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert r.status_code == 201, r.text
        token = r.json()["token"]
        with fleet.a.client(token=token) as c:
            assert wait_until(lambda: _ok(c), timeout=10)
            assert [p["tokens"] for p in c.projects()] == [2]
        with pytest.raises(dsec.InvalidArgument, match="project name must be"):
            a.create_project("Bad Name")
        b.delete_project("twice")
        with pytest.raises(dsec.NotFound, match="not found"):
            a.delete_project("twice")


def _ok(c: dsec.Client) -> bool:
    try:
        c.projects()
    except dsec.Unauthorized:
        return False
    return True


def test_quotas_hold_over_the_whole_fleet(fleet: Fleet) -> None:
    """What a project holds on every edge counts against its quotas: two sandboxes on
    each edge pass a max_sandboxes of 3 nowhere, and concurrent creates through both
    apiservers never overshoot it."""
    quotas = {"max_sandboxes": 3}
    acting = json.dumps({"name": "fleet-q", "quotas": quotas})
    edge_auth = {"Authorization": f"Bearer {EDGE_TOKEN}", "x-dsec-project": acting}

    def on_edge(name: str) -> httpx.Response:
        # What an apiserver sends an edge for the project: placed here by hand.
        return httpx.post(
            fleet.edges[name].url + "/v1/sandboxes",
            json={"image": "busybox", "memory_mb": 64},
            headers=edge_auth,
            timeout=60,
        )

    with fleet.a.client(token=ADMIN) as admin:
        token = admin.create_project("fleet-q", max_sandboxes=3)["token"]
        made: list[str] = []
        try:
            for name in ("pe1", "pe1", "pe2"):
                r = on_edge(name)
                assert r.status_code == 201, r.text
                made.append(r.json()["id"])
            refused = on_edge("pe2")
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"]["kind"] == "quota_exceeded"
            assert "max_sandboxes" in refused.text and "over the fleet" in refused.text
            # Given back on one edge, the room is usable on the other.
            admin.get(made.pop(0)).stop()
            assert wait_until(lambda: on_edge("pe2").status_code == 201, timeout=10)
        finally:
            for s in admin.list():
                if s.info().project == "fleet-q":
                    s.stop()
        # Concurrent creates through both apiservers: exactly the quota's worth succeed.
        assert wait_until(lambda: _ok(fleet.b.client(token=token)), timeout=10)
        results: list[str] = []

        def create(api: Apiserver) -> None:
            with api.client(token=token) as c:
                try:
                    results.append(c.create(image="busybox", memory_mb=64).id)
                except dsec.QuotaExceeded:
                    results.append("refused")

        threads = [
            threading.Thread(target=create, args=(api,)) for api in [fleet.a, fleet.b] * 4
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        try:
            assert sorted(r == "refused" for r in results) == [False] * 3 + [True] * 5, results
        finally:
            for made_id in results:
                if made_id != "refused":
                    admin.get(made_id).stop()
        admin.delete_project("fleet-q")
