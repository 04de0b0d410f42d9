"""The real e2b SDK (PyPI `e2b`, as in test_e2b.py) against a fleet on real etcd: two edges
serving E2B (`dsec edge --e2b-listen --e2b-envd-listen`) and one apiserver
(`dsec apiserver --e2b-listen --e2b-envd-listen`), the SDK pointed at the apiserver only.

Creates are placed over both edges; commands (streamed as they run, in the background,
with a timeout), files, pause/connect, kill and lists (merged over the edges, paged as one
list) go through the apiserver to the sandbox's edge; the API key is the apiserver's token
or a fleet project's, never an edge's; an id naming no sandbox, and a sandbox whose edge
died, answer at once in E2B's shape.

The template "base" is the suite's busybox image with `/bin/bash` a shell script running
busybox's sh (the SDK runs every command as `/bin/bash -l -c CMD`): a Debian image would
cost a minute to build, and nothing here needs more than a POSIX shell.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from dsec_fleet import Apiserver, Edge, Etcd, edge_of, etcd_unavailable_reason, start_edges
from dsec_local import free_port, safe_rmtree
from dsec_testlib import make_tempdir, point_e2b_sdk, require, wait_until

e2b = pytest.importorskip("e2b", reason="the e2b SDK (pip install e2b==2.63.0)")
from e2b import (  # noqa: E402
    CommandExitException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

ADMIN = "admin-token-of-the-fleet-e2b-test"
EDGE_TOKEN = "edge-token-of-the-fleet-e2b-test"
EDGES = ("x1", "x2")
#: No test here waits for an edge's lease to expire; a short one, on a host busy with the
#: rest of the suite, can lapse between keep-alives (etcd's fsyncs stall) and drop an edge
#: from the fleet's lists for a moment.
LEASE_TTL = 10


@dataclass
class E2bFleet:
    edges: dict[str, Edge]
    api: Apiserver
    api_url: str
    sandbox_url: str


def e2b_listeners() -> tuple[list[str], str, str]:
    api, envd = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    return ["--e2b-listen", api, "--e2b-envd-listen", envd], f"http://{api}", f"http://{envd}"


@pytest.fixture(scope="module")
def fleet(busybox_rootfs: Path) -> Iterator[E2bFleet]:
    require("etcd", etcd_unavailable_reason())
    tmp = make_tempdir("dsec-fleet-e2b-")
    (tmp / "admin").write_text(ADMIN + "\n")
    (tmp / "edge").write_text(EDGE_TOKEN + "\n")
    rootfs = tmp / "rootfs"
    shutil.copytree(busybox_rootfs, rootfs, symlinks=True)
    (rootfs / "bin" / "bash").write_text('#!/bin/sh\nexec /bin/sh "$@"\n')
    (rootfs / "bin" / "bash").chmod(0o755)
    etcd = Etcd(tmp / "etcd", log_path=tmp / "etcd.log").start()
    started: list[Edge | Apiserver] = []
    try:
        edges = start_edges(
            tmp,
            etcd.url,
            EDGES,
            started,
            args_of=lambda name: e2b_listeners()[0],
            lease_ttl=LEASE_TTL,
            token_file=tmp / "edge",
        )
        args, api_url, sandbox_url = e2b_listeners()
        api = Apiserver(
            tmp / "api",
            etcd=etcd.url,
            token_file=tmp / "admin",
            extra_args=["--edge-token-file", str(tmp / "edge"), *args],
            log_path=tmp / "api.log",
        )
        started.append(api)
        api.start()
        api.wait_for_edges(EDGES)
        with api.client(token=ADMIN) as c:
            c.import_image(str(rootfs), name="base")
        yield E2bFleet(edges, api, api_url, sandbox_url)
    finally:
        for s in reversed(started):
            s.cleanup()
        etcd.stop()
        safe_rmtree(tmp)


@pytest.fixture(autouse=True)
def e2b_env(fleet: E2bFleet, monkeypatch: pytest.MonkeyPatch) -> None:
    """The e2b SDK pointed at the apiserver, with its token as the API key."""
    point_e2b_sdk(monkeypatch, fleet.api_url, fleet.sandbox_url, ADMIN)


def listed(**query: object) -> list[str]:
    """Every sandbox id the apiserver lists for `query`, a page of one at a time."""
    found: list[str] = []
    paginator = Sandbox.list(query=SandboxQuery(**query), limit=1)  # type: ignore[arg-type]
    while paginator.has_next:
        found += [s.sandbox_id for s in paginator.next_items()]
    return found


def test_creates_spread_over_the_edges_and_lists_merge(fleet: E2bFleet) -> None:
    made = [Sandbox.create("base", metadata={"t": "spread"}, timeout=120) for _ in range(3)]
    try:
        assert {edge_of(sb.sandbox_id) for sb in made} == set(EDGES)
        # Pages of one, over both edges: each sandbox once, newest first.
        ids = listed(metadata={"t": "spread"})
        assert ids == [sb.sandbox_id for sb in reversed(made)]
        one, *_ = Sandbox.list(query=SandboxQuery(metadata={"t": "spread"})).next_items()
        assert (one.template_id, one.metadata) == ("base", {"t": "spread"})
        made[0].pause()
        assert listed(metadata={"t": "spread"}, state=[SandboxState.PAUSED]) == [made[0].sandbox_id]
        # The old list: running ones only.
        r = httpx.get(fleet.api_url + "/sandboxes", headers={"X-API-KEY": ADMIN}, timeout=10)
        old = {s["sandboxID"] for s in r.json()}
        assert {sb.sandbox_id for sb in made[1:]} <= old and made[0].sandbox_id not in old
        metrics = made[1].get_metrics()
        assert metrics and metrics[0].cpu_count >= 1
        wanted = ",".join(sb.sandbox_id for sb in made) + ",nowhere-0123456789ab"
        r = httpx.get(
            fleet.api_url + "/sandboxes/metrics",
            params={"sandbox_ids": wanted},
            headers={"X-API-KEY": ADMIN},
            timeout=10,
        )
        assert set(r.json()["sandboxes"]) >= {sb.sandbox_id for sb in made[1:]}, r.text
    finally:
        for sb in made:
            assert sb.kill() is True
    assert not made[0].is_running()
    assert listed(metadata={"t": "spread"}) == []


def test_commands_stream_run_in_the_background_and_time_out(fleet: E2bFleet) -> None:
    sb = Sandbox.create("base", timeout=120)
    try:
        r = sb.commands.run("echo out; echo err >&2; echo $GREETING", envs={"GREETING": "hi"})
        assert (r.stdout, r.stderr, r.exit_code) == ("out\nhi\n", "err\n", 0)
        # Output comes through the apiserver as it is written, not when the command ends.
        seen: list[tuple[float, str]] = []
        t0 = time.monotonic()
        sb.commands.run(
            "echo first; sleep 1.5; echo second",
            on_stdout=lambda s: seen.append((time.monotonic() - t0, s)),
        )
        end = time.monotonic() - t0
        assert "".join(s for _, s in seen) == "first\nsecond\n"
        assert seen[0][0] < end - 1.0, (seen, end)
        with pytest.raises(CommandExitException) as exc:
            sb.commands.run("echo partial; exit 3")
        assert (exc.value.exit_code, exc.value.stdout) == (3, "partial\n")
        handle = sb.commands.run("cat", background=True, stdin=True)
        sb.commands.send_stdin(handle.pid, "typed\n")
        sb.commands.stream_input(handle.pid, ["str", b"eamed\n"])  # a client stream
        assert handle.pid in [p.pid for p in sb.commands.list()]
        sb.commands.close_stdin(handle.pid)
        assert handle.wait().stdout == "typed\nstreamed\n"
        t0 = time.monotonic()
        with pytest.raises(TimeoutException):
            sb.commands.run("sleep 30", timeout=1)
        assert time.monotonic() - t0 < 10
    finally:
        sb.kill()


def test_files_and_pause_connect(fleet: E2bFleet) -> None:
    sb = Sandbox.create("base", timeout=120)
    try:
        payload = bytes(range(256)) * 1000
        sb.files.write("/tmp/f/a.bin", payload)
        sb.files.write("/tmp/f/b.txt", "text", use_octet_stream=True)
        assert sb.files.read("/tmp/f/a.bin", format="bytes") == payload
        assert sb.files.read("/tmp/f/a.bin", format="bytes", gzip=True) == payload
        assert sorted(e.name for e in sb.files.list("/tmp/f")) == ["a.bin", "b.txt"]
        assert sb.commands.run("cat /tmp/f/b.txt").stdout == "text"
        assert sb.pause() is True
        assert sb.get_info().state == SandboxState.PAUSED
        assert not sb.is_running()
        same = Sandbox.connect(sb.sandbox_id)
        assert same.is_running()
        assert same.files.read("/tmp/f/b.txt") == "text"
    finally:
        sb.kill()


def test_a_project_key_sees_its_own_sandboxes_only(
    fleet: E2bFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fleet.api.client(token=ADMIN) as c:
        token = c.create_project("e2b-team")["token"]
    admins = Sandbox.create("base", metadata={"t": "project"}, timeout=120)
    try:
        monkeypatch.setenv("E2B_API_KEY", token)
        mine = Sandbox.create("base", metadata={"t": "project"}, timeout=120)
        try:
            assert mine.commands.run("echo mine").stdout == "mine\n"
            assert listed(metadata={"t": "project"}) == [mine.sandbox_id]
            with pytest.raises(SandboxNotFoundException):
                Sandbox.connect(admins.sandbox_id)
            assert Sandbox.kill(admins.sandbox_id) is False
        finally:
            mine.kill()
        # An edge's token is not an API key of the apiserver.
        monkeypatch.setenv("E2B_API_KEY", EDGE_TOKEN)
        with pytest.raises(e2b.AuthenticationException):
            Sandbox.list().next_items()
    finally:
        admins.kill()
        with fleet.api.client(token=ADMIN) as c:
            c.delete_project("e2b-team")


def test_unknown_sandboxes_answer_not_found_at_once(fleet: E2bFleet) -> None:
    t0 = time.monotonic()
    for sid in ("x1-0123456789ab", "nowhere-0123456789ab", "not-an-id"):
        with pytest.raises(SandboxNotFoundException):
            Sandbox.connect(sid)
        assert Sandbox.kill(sid) is False
        health = httpx.get(
            fleet.sandbox_url + "/health", headers={"E2b-Sandbox-Id": sid}, timeout=10
        )
        assert health.status_code == 502, health.text
        assert sid in health.json()["message"]
    unsupported = httpx.get(fleet.api_url + "/templates", headers={"X-API-KEY": ADMIN})
    assert unsupported.status_code == 501 and "templates" in unsupported.json()["message"]
    assert time.monotonic() - t0 < 10


def test_a_dead_edge_s_sandbox_fails_at_once_saying_so(fleet: E2bFleet) -> None:
    """Last in this module: it kills an edge."""
    made = [Sandbox.create("base", timeout=120)]
    while edge_of(made[-1].sandbox_id) != "x2" and len(made) < 6:
        made.append(Sandbox.create("base", timeout=120))
    sb = made[-1]
    assert edge_of(sb.sandbox_id) == "x2", [s.sandbox_id for s in made]
    fleet.edges["x2"].kill9()
    try:
        t0 = time.monotonic()
        with pytest.raises(SandboxException, match="x2"):
            sb.commands.run("true")
        assert not sb.is_running()
        with pytest.raises(SandboxException, match='edge "x2"'):
            sb.get_info()
        assert time.monotonic() - t0 < 10
    finally:
        # Once its lease is gone, the apiserver says the edge left.
        assert wait_until(lambda: "x2" not in {e["name"] for e in fleet.api.edges()}, 10)
    with pytest.raises(SandboxException, match="left the fleet"):
        sb.get_info()
    # The live edge takes every create now, and a list leaves the dead one out.
    other = Sandbox.create("base", timeout=120)
    assert edge_of(other.sandbox_id) == "x1"
    assert sb.sandbox_id not in listed()
    for s in (*made, other):
        if edge_of(s.sandbox_id) == "x1":
            s.kill()
