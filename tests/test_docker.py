"""The docker backend: ownership of its containers, a daemon that is not there, hardening
as Docker applies it, and `docker://` image import. The SDK conformance suite runs on it too
(DSEC_TEST_BACKENDS=container,docker).

Containers are found through Docker's labels: dsec marks its own with dsec.managed=true,
dsec.id=<sandbox> and dsec.edge=<state-dir tag>.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dsec
import pytest
from dsec_testlib import (
    Server,
    docker_containers,
    wait_until,
)

#: Fails without a daemon where scripts/setup.sh installed Docker; skips where it did not.
pytestmark = pytest.mark.usefixtures("docker_daemon")


def containers_of(sandbox_id: str) -> list[str]:
    return docker_containers(f"label=dsec.id={sandbox_id}")


def inspect(container: str) -> dict[str, Any]:
    r = subprocess.run(
        ["docker", "inspect", container], capture_output=True, text=True, check=True
    )
    info: dict[str, Any] = json.loads(r.stdout)[0]
    return info


def running(container: str) -> bool:
    r = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Running}}", container],
        capture_output=True,
        text=True,
    )
    return r.returncode == 0 and r.stdout.strip() == "true"


def docker_socket() -> str:
    """The path of the Docker daemon's unix socket the servers under test use."""
    host = os.environ.get("DOCKER_HOST", "")
    return host.removeprefix("unix://") if host.startswith("unix://") else "/var/run/docker.sock"


def docker_connections(pid: int) -> int:
    """How many unix sockets process ``pid`` holds connected to the Docker daemon's socket:
    its descriptors' socket inodes, each looked up in `ss -x` for the peer's address."""
    mine = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            mine.add(target.removeprefix("socket:[").removesuffix("]"))
    # Netid State Recv-Q Send-Q Local-Address Inode Peer-Address Peer-Inode
    rows = [
        row
        for row in (
            line.split()
            for line in subprocess.run(
                ["ss", "-xH"], capture_output=True, text=True, check=True
            ).stdout.splitlines()
        )
        if len(row) == 8
    ]
    address = {row[5]: row[4] for row in rows}
    socket = docker_socket()
    return sum(1 for row in rows if row[5] in mine and address.get(row[7]) == socket)


def kill_and_wait_failed(sb: dsec.Sandbox) -> dsec.SandboxFailed:
    """`docker kill`s the sandbox's container behind dsec's back; the sandbox's commands
    must then fail with SandboxFailed within a few seconds."""
    (cid,) = containers_of(sb.id)
    subprocess.run(["docker", "kill", cid], capture_output=True, check=True)

    def failed() -> dsec.SandboxFailed | None:
        try:
            sb.run("true", timeout=10)
        except dsec.SandboxFailed as e:
            return e
        except dsec.Conflict:  # the exec refused before the sandbox is marked failed
            pass
        return None

    err = wait_until(failed, 10)
    assert err is not None, "a sandbox whose container was killed still runs commands"
    assert (err.status, err.kind) == (409, "sandbox_failed")
    assert sb.info().state == "failed"
    return err


@pytest.fixture
def foreign(docker_image: str) -> Iterator[list[str]]:
    """Two containers dsec did not create: one unlabelled, one labelled as another dsec
    server's. Everything dsec does must leave both running."""
    tag = uuid.uuid4().hex[:8]
    names = [f"dsec-test-foreign-{tag}", f"dsec-test-other-edge-{tag}"]
    labels = [[], ["--label", "dsec.managed=true", "--label", "dsec.edge=someone-else"]]
    for name, extra in zip(names, labels, strict=True):
        subprocess.run(
            ["docker", "run", "-d", "--name", name, "--network", "none", *extra,
             docker_image, "sleep", "600"],
            capture_output=True,
            check=True,
        )
    yield names
    for name in names:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def test_container_is_labelled_limited_and_hardened(
    client: dsec.Client, docker_image: str
) -> None:
    with client.create(
        backend="docker", image=docker_image, cpus=0.5, memory_mb=96, pids=50
    ) as sb:
        (cid,) = containers_of(sb.id)
        c = inspect(cid)
        labels = c["Config"]["Labels"]
        assert labels["dsec.managed"] == "true" and labels["dsec.id"] == sb.id
        assert labels["dsec.edge"]
        hc = c["HostConfig"]
        assert hc["NetworkMode"] == "none"
        assert hc["NanoCpus"] == 500_000_000
        assert hc["Memory"] == 96 * 1024 * 1024
        assert hc["MemorySwap"] == hc["Memory"]
        assert hc["PidsLimit"] == 50
        assert hc["CapDrop"] == ["ALL"]
        assert "CAP_MKNOD" not in hc["CapAdd"]
        assert "no-new-privileges" in hc["SecurityOpt"]
        assert hc["Init"] is True
        assert "/proc/kpagecgroup" in hc["MaskedPaths"]
        assert c["Config"]["Hostname"] == sb.id
        # the limits are the ones the sandbox reports
        assert sb.info().limits.memory_mb == 96


def test_stop_removes_the_container(client: dsec.Client, docker_image: str) -> None:
    sb = client.create(backend="docker", image=docker_image)
    sb.run("sleep 1000 > /dev/null 2>&1 &")
    (cid,) = containers_of(sb.id)
    assert running(cid)
    sb.stop()
    assert containers_of(sb.id) == []
    sb.stop()  # harmless


def test_ttl_removes_the_container(client: dsec.Client, docker_image: str) -> None:
    sb = client.create(backend="docker", image=docker_image, ttl_s=1)
    assert containers_of(sb.id)
    assert wait_until(lambda: not containers_of(sb.id), 15, 0.25), (
        "container still there 15 s after ttl_s=1"
    )
    with pytest.raises(dsec.NotFound):
        sb.run("true")


def test_usage_and_oom_come_from_the_container(
    client: dsec.Client, docker_image: str
) -> None:
    with client.create(backend="docker", image=docker_image, memory_mb=64) as sb:
        sb.run("sleep 30 > /dev/null 2>&1 &")
        usage = sb.info().usage
        assert (usage.memory_bytes or 0) > 0 and (usage.pids or 0) >= 2
        r = sb.run("head -c 300m /dev/zero | tail", timeout=60)
        assert (r.exit_code, r.oom_killed) == (137, True)
        assert sb.run("echo alive").stdout == "alive\n"
        assert sb.run("true").oom_killed is False


def test_container_killed_behind_dsecs_back_fails_its_sandbox(
    client: dsec.Client, docker_image: str
) -> None:
    with client.create(backend="docker", image=docker_image) as quiet:
        sb = client.create(backend="docker", image=docker_image)
        kill_and_wait_failed(sb)
        with pytest.raises(dsec.SandboxFailed):
            sb.read_file("/etc/hostname")
        assert quiet.run("echo ok").stdout == "ok\n"
        sb.stop()
        assert containers_of(sb.id) == []


@pytest.mark.timeout(240)
def test_idle_sandboxes_share_one_daemon_connection(
    make_server: Callable[..., Server], docker_image: str
) -> None:
    """How a sandbox learns that its container stopped must not hold a connection to the
    daemon per sandbox (it once was a long poll each): a handful at most, whatever their
    number, none once the last one is gone, and a container killed is still noticed."""
    s = make_server(import_busybox=False)
    n = 20
    with s.client() as c:
        sbs = [c.create(backend="docker", image=docker_image) for _ in range(n)]
        assert wait_until(lambda: docker_connections(s.pid) <= 4, 5), (
            f"{docker_connections(s.pid)} connections to the Docker daemon for {n} idle "
            "sandboxes"
        )
        kill_and_wait_failed(sbs[n // 2])
        assert all(sb.run("echo ok").stdout == "ok\n" for sb in sbs if sb is not sbs[n // 2])
        for sb in sbs:
            sb.stop()
        assert wait_until(lambda: docker_connections(s.pid) == 0, 10), (
            f"{docker_connections(s.pid)} connections to the daemon left after the last "
            "docker sandbox stopped"
        )
        # The next sandbox is watched again.
        with c.create(backend="docker", image=docker_image) as again:
            kill_and_wait_failed(again)
    s.stop()


@pytest.mark.timeout(180)
def test_kill9_restart_removes_own_containers_only(
    make_server: Callable[..., Server], docker_image: str, foreign: list[str]
) -> None:
    s = make_server()
    with s.client() as c:
        sbs = [c.create(backend="docker", image=docker_image) for _ in range(2)]
        for sb in sbs:
            sb.run("sleep 1000 > /dev/null 2>&1 &")
        stopped = c.create(backend="docker", image=docker_image)
        stopped.stop()
        ttl = c.create(backend="docker", image=docker_image, ttl_s=1)
        assert wait_until(lambda: not containers_of(ttl.id), 15, 0.25)
    ids = [cid for sb in sbs for cid in containers_of(sb.id)]
    assert len(ids) == 2
    s.kill9()
    assert all(running(cid) for cid in ids), "sanity: a SIGKILLed server stops nothing"
    s.restart()
    assert wait_until(lambda: not any(containers_of(sb.id) for sb in sbs), 20, 0.25), (
        "the restarted server did not remove the containers of the killed one"
    )
    with s.client() as c, c.create(backend="docker", image=docker_image) as fresh:
        assert fresh.run("echo new").stdout == "new\n"
    s.stop()
    assert containers_of(fresh.id) == []
    for name in foreign:
        assert running(name), f"dsec touched {name}, which it did not create"


def test_graceful_shutdown_removes_containers(
    make_server: Callable[..., Server], docker_image: str, foreign: list[str]
) -> None:
    s = make_server()
    with s.client() as c:
        sbs = [c.create(backend="docker", image=docker_image) for _ in range(2)]
    assert all(containers_of(sb.id) for sb in sbs)
    assert s.stop() == 0
    assert not any(containers_of(sb.id) for sb in sbs)
    for name in foreign:
        assert running(name)


def test_no_daemon_is_unavailable_and_the_rest_works(
    make_server: Callable[..., Server],
    monkeypatch: pytest.MonkeyPatch,
    docker_image: str,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent-dsec-test.sock")
    s = make_server()
    monkeypatch.undo()
    with s.client() as c:
        t0 = time.monotonic()
        with pytest.raises(dsec.Unavailable) as e:
            c.create(backend="docker", image=docker_image)
        assert time.monotonic() - t0 < 10
        assert "nonexistent-dsec-test.sock" in str(e.value)
        assert "docker" in str(e.value).lower()
        with pytest.raises(dsec.Unavailable):
            c.import_image("docker://" + docker_image, name="from-docker")
        with c.create(backend="container", image="busybox") as sb:
            assert sb.run("echo fine").stdout == "fine\n"


def test_unknown_image_is_not_found(client: dsec.Client, docker_image: str) -> None:
    with pytest.raises(dsec.NotFound) as e:
        client.create(backend="docker", image="dsec-test/no-such-image:nope")
    assert "dsec-test/no-such-image:nope" in str(e.value)


def test_import_from_docker_runs_on_the_native_backend(
    client: dsec.Client, docker_image: str
) -> None:
    name = "from-docker-" + uuid.uuid4().hex[:8]
    img = client.import_image("docker://" + docker_image, name=name)
    try:
        assert img.name == name and img.size > 1_000_000
        with client.create(backend="container", image=name) as sb:
            assert sb.run("busybox echo same image").stdout == "same image\n"
    finally:
        client.delete_image(name)
    with pytest.raises(dsec.InvalidArgument):
        client.import_image("docker://dsec-test/no-such-image:nope")



def test_all_output_arrives_even_with_pipes_held_open(
    client: dsec.Client, docker_image: str
) -> None:
    """The exec's end is noticed by polling when a background process keeps its pipes open;
    output still in transit through the daemon at that moment must not be lost."""
    with client.create(backend="docker", image=docker_image) as sb:
        r = sb.run(
            "head -c 20000000 /dev/zero | tr '\\0' x", max_output_bytes=32 << 20
        )
        assert (r.exit_code, len(r.stdout), r.truncated) == (0, 20_000_000, False)
        t0 = time.monotonic()
        r = sb.run(
            "sleep 30 & head -c 5000000 /dev/zero | tr '\\0' y; echo end >&2",
            max_output_bytes=32 << 20,
        )
        assert (r.exit_code, len(r.stdout), r.stderr) == (0, 5_000_000, "end\n")
        assert time.monotonic() - t0 < 10, "the held pipe delayed the result"
