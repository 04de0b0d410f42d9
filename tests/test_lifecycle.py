"""Lifecycle: TTLs, stop, server crash and restart — and that nothing is left on the host."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import dsec
import pytest
from dsec_testlib import (
    Server,
    assert_no_leftovers,
    cgroup_mounts,
    cgroup_parents,
    descendants,
    image_for,
    leftovers,
    mountinfo,
    procs_in,
    spare_cgroup_sets,
    still_running,
    wait_until,
)

MakeSandbox = Callable[..., dsec.Sandbox]


def _gone(client: dsec.Client, sandbox_id: str) -> bool:
    try:
        info = client.get(sandbox_id).info()
    except dsec.NotFound:
        return True
    return info.state in ("stopped", "failed")


def _listed(client: dsec.Client, tag: str) -> list[str]:
    return [s.id for s in client.list(labels={"t": tag})]


def test_stop_leaves_nothing(server: Server, make_sandbox: MakeSandbox, backend: str) -> None:
    sb = make_sandbox()
    sb.run("echo x > /root/x; sleep 1000 > /dev/null 2>&1 &")
    if backend == "container":
        assert leftovers(server, sb.id), "sanity: the host shows no trace of a live sandbox"
    sb.stop()
    assert_no_leftovers(server, sb.id)


def test_ttl(server: Server, client: dsec.Client, make_sandbox: MakeSandbox) -> None:
    sb = make_sandbox(ttl_s=1)
    t0 = time.monotonic()
    assert wait_until(lambda: _gone(client, sb.id), 10, 0.25), "still there 10s after ttl_s=1"
    assert time.monotonic() - t0 >= 0.5
    assert_no_leftovers(server, sb.id)
    with pytest.raises(dsec.NotFound):
        sb.run("true")


def test_ttl_ends_a_running_command(client: dsec.Client, make_sandbox: MakeSandbox) -> None:
    sb = make_sandbox(ttl_s=2)
    t0 = time.monotonic()
    try:
        r = sb.run("sleep 60", timeout=120)
        assert r.exit_code != 0
    except dsec.DsecError:
        pass  # the sandbox went away under the request: fine
    assert time.monotonic() - t0 < 20, "the ttl did not end the command"


def test_idle_ttl(server: Server, client: dsec.Client, make_sandbox: MakeSandbox) -> None:
    tag = uuid.uuid4().hex[:12]
    sb = make_sandbox(idle_ttl_s=1, labels={"t": tag})
    assert _listed(client, tag) == [sb.id]
    # Poll through list() only: a request to the sandbox itself would count as activity.
    assert wait_until(lambda: not _listed(client, tag), 10, 0.25), "still listed 10s later"
    assert_no_leftovers(server, sb.id)


def test_idle_ttl_is_reset_by_activity(make_sandbox: MakeSandbox) -> None:
    sb = make_sandbox(idle_ttl_s=2)
    for _ in range(8):
        assert sb.run("true").exit_code == 0
        time.sleep(0.5)
    # a command longer than the idle ttl is activity too
    assert sb.run("sleep 3; echo ok", timeout=10).stdout == "ok\n"
    assert sb.info().state == "running"


def test_many_sandboxes_stopped_leave_nothing(server: Server, client: dsec.Client) -> None:
    from dsec_testlib import BACKENDS

    backend = BACKENDS[0]
    sbs = [client.create(backend=backend, image=image_for(backend)) for _ in range(10)]
    for sb in sbs:
        sb.run("echo hi > /tmp/hi")
    for sb in sbs:
        sb.stop()
    for sb in sbs:
        assert_no_leftovers(server, sb.id)


def _start_inflight(sb: dsec.Sandbox) -> threading.Thread:
    def run() -> None:
        try:
            sb.run("sleep 1000", timeout=600)
        except dsec.DsecError:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _sandboxes_tmpfs(s: Server) -> list[str]:
    """The mounts on the server's `<state>/sandboxes` that are tmpfs."""
    at = str((s.state_dir / "sandboxes").resolve())
    return [line for m, line in mountinfo() if m == at and " - tmpfs " in line]


@pytest.mark.timeout(180)
def test_server_kill9_then_restart_cleans_up(
    make_server: Callable[..., Server],
) -> None:
    """...and the tmpfs of the sandboxes' records: it keeps them for the next server, which
    adopts it (no second one stacked) and unmounts it at its stop; and the spare cgroup sets
    of a v1 host, which the next server removes at its start."""
    s = make_server()
    assert len(_sandboxes_tmpfs(s)) == 1, mountinfo()
    with s.client() as c:
        sbs = [c.create(image="busybox", labels={"gen": "old"}) for _ in range(3)]
        for sb in sbs:
            sb.run("echo x > /root/x; sleep 1000 > /dev/null 2>&1 &")
        t = _start_inflight(sbs[0])
        assert wait_until(lambda: any("sleep 1000" in cmd for _, cmd in procs_in(sbs[0].id)), 10), (
            "the in-flight command never showed up"
        )
        for sb in sbs:
            assert leftovers(s, sb.id), "sanity: the host shows no trace of a live sandbox"
        for sb in sbs:
            assert (s.state_dir / "sandboxes" / sb.id / "record.json").is_file()
        parents = cgroup_parents(s, sbs[0].id)
        v1 = any(key == "memory" for _, key in cgroup_mounts())
        assert not v1 or wait_until(lambda: spare_cgroup_sets(parents), 10)
        s.kill9()
        t.join(30)
    assert len(_sandboxes_tmpfs(s)) == 1, "a killed server cannot unmount"
    s.restart()
    assert len(_sandboxes_tmpfs(s)) == 1, f"stacked: {_sandboxes_tmpfs(s)}"
    assert not spare_cgroup_sets(parents), "the spares of the killed server are left"
    for sb in sbs:
        assert_no_leftovers(s, sb.id, timeout=20)
    with s.client() as c2:
        for sb in sbs:
            assert _gone(c2, sb.id)
        for x in c2.list(labels={"gen": "old"}):
            assert x.info().state in ("stopped", "failed")
        with c2.create(image="busybox") as fresh:
            assert fresh.run("echo new").stdout == "new\n"
            assert fresh.id not in {sb.id for sb in sbs}
        assert_no_leftovers(s, fresh.id)
    assert s.stop() == 0
    assert not spare_cgroup_sets(parents), "spares outlived the server"
    assert not _sandboxes_tmpfs(s), _sandboxes_tmpfs(s)
    assert not (s.state_dir / "sandboxes.mount").exists()


@pytest.mark.timeout(120)
def test_graceful_shutdown_cleans_up(make_server: Callable[..., Server]) -> None:
    s = make_server()
    with s.client() as c:
        sbs = [c.create(image="busybox") for _ in range(2)]
        for sb in sbs:
            sb.run("sleep 1000 > /dev/null 2>&1 &")
        t = _start_inflight(sbs[0])
        time.sleep(0.5)
        old_procs = descendants(s.pid)
        rc = s.stop()
        t.join(30)
    assert rc == 0, f"dsec serve exited with {rc} on SIGTERM"
    gone = wait_until(lambda: not still_running(old_procs), 10)
    assert gone, f"processes of the server outlived it: {still_running(old_procs)}"
    for sb in sbs:
        assert not procs_in(sb.id), f"processes of {sb.id} outlived the server"
        # (its directory may wait for the next start to be removed)
        left = [x for x in leftovers(s, sb.id) if not x.startswith("directory")]
        assert not left, f"{sb.id} left behind after SIGTERM: {left}"
