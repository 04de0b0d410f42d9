"""What only VM sandboxes (`microvm`, `vm`) have: a guest of their own, restored from a
boot snapshot with a fresh identity, and a QEMU process whose death fails the sandbox
promptly. Runs against real QEMU guests (TCG here when KVM does not boot guests)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

import dsec
import httpx
import pytest
from dsec_testlib import (
    VM_BACKENDS,
    Server,
    assert_no_leftovers,
    leftovers,
    qemu_procs,
    require,
    wait_until,
)

_UNAVAILABLE: dict[str, str | None] = {}


@pytest.fixture(params=sorted(VM_BACKENDS))
def vm_backend(request: pytest.FixtureRequest, client: dsec.Client, busybox_image: str) -> str:
    """A VM backend this server can run. Where it cannot (no QEMU, no guest kernel, no
    static agent) the test fails with the server's reason if scripts/setup.sh set VMs up,
    and skips if it did not."""
    name = str(request.param)
    if name not in _UNAVAILABLE:
        try:
            client.create(backend=name, image=busybox_image).stop()
            _UNAVAILABLE[name] = None
        except dsec.Unavailable as e:
            _UNAVAILABLE[name] = str(e)
    require("vm", _UNAVAILABLE[name] and f"backend {name}: {_UNAVAILABLE[name]}")
    return name


def test_info_reports_the_accelerator(
    client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    with client.create(backend=vm_backend, image=busybox_image) as sb:
        info = sb.info()
        assert info.backend == vm_backend
        assert info.accelerator in ("kvm", "tcg")
        # The guest runs a kernel of its own (Debian's cloud kernel), not the host's.
        assert sb.run("uname -r").stdout.strip() != os.uname().release


def test_restored_guests_get_fresh_identities(
    client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    a = client.create(backend=vm_backend, image=busybox_image)
    b = client.create(backend=vm_backend, image=busybox_image)
    try:
        seen = []
        for sb in (a, b):
            r = sb.run("hostname; head -c 16 /dev/urandom | od -An -tx1; date +%s")
            host, rand, now = r.stdout.strip().split("\n")
            assert host == sb.id
            assert abs(int(now) - time.time()) < 30, "the guest's clock was not set"
            seen.append(rand)
        assert seen[0] != seen[1], "two restored guests share a random stream"
    finally:
        a.stop()
        b.stop()


def test_writes_stay_in_their_own_guest(
    client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    with client.create(backend=vm_backend, image=busybox_image) as a:
        a.run("echo mine > /etc/owned")
        with client.create(backend=vm_backend, image=busybox_image) as b:
            assert b.run("cat /etc/owned").exit_code != 0
        assert a.read_file("/etc/owned") == b"mine\n"


def _saved_guests(server: Server) -> set[str]:
    """The saved guests (snapshots of running VMs) in the server's state directory."""
    d = server.state_dir / "vm" / "snapshots"
    return set(os.listdir(d)) if d.is_dir() else set()


def _prune(server: Server) -> None:
    httpx.post(server.url + "/v1/store/prune", timeout=60, trust_env=False).raise_for_status()


@pytest.mark.timeout(300)
def test_fork_of_a_running_guest_carries_its_memory_and_takes_fresh_identities(
    server: Server, client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    before = _saved_guests(server)
    parent = client.create(backend=vm_backend, image=busybox_image)
    kids: list[dsec.Sandbox] = []
    try:
        # State that lives only in the guest's memory: a shell counting in a loop.
        parent.run("echo parent > /root/state")
        ticker = parent.spawn(
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n;"
            " sleep 0.05; done"
        )
        assert wait_until(lambda: parent.run("cat /tmp/n").stdout.strip() != "", 10)
        kids = parent.fork(2)
        assert parent.info().state == "running"
        seen = []
        for kid in kids:
            assert kid.info().backend == vm_backend
            # The parent's process runs on in the child, from where it was.
            assert kid.run(f"kill -0 {ticker.pid}").exit_code == 0
            first = int(kid.run("cat /tmp/n").stdout)

            def counted_on(k: dsec.Sandbox = kid, f: int = first) -> bool:
                return int(k.run("cat /tmp/n").stdout) > f

            assert wait_until(counted_on, 10)
            r = kid.run(
                "hostname; head -c 16 /dev/urandom | od -An -tx1;"
                " cat /proc/sys/kernel/random/boot_id; date +%s"
            )
            host, rand, boot_id, now = r.stdout.strip().split("\n")
            assert host == kid.id
            assert abs(int(now) - time.time()) < 30, "the child's clock was not set"
            seen.append((rand, boot_id))
            assert kid.run("cat /root/state").stdout == "parent\n"
        assert seen[0][0] != seen[1][0], "two children share a random stream"
        # Read first in the children: each made its own.
        assert seen[0][1] != seen[1][1]
        for i, kid in enumerate(kids):
            kid.run(f"echo {i} > /root/state")
        assert [k.read_file("/root/state") for k in kids] == [b"0\n", b"1\n"]
        assert parent.read_file("/root/state") == b"parent\n"
        assert parent.run("echo still").stdout == "still\n"
        # A child forks again, from its own memory and disk.
        grandkids = kids[0].fork(1)
        kids += grandkids
        assert grandkids[0].run("cat /root/state").stdout == "0\n"
        assert grandkids[0].run(f"kill -0 {ticker.pid}").exit_code == 0
        assert len(_saved_guests(server) - before) == 2, "one saved guest per fork"
    finally:
        for k in kids:
            k.stop()
        parent.stop()
    for sb in [parent, *kids]:
        assert_no_leftovers(server, sb.id)
    # The fork images go once their children are gone, and their saved guests with them.
    _prune(server)
    assert not _saved_guests(server) - before


@pytest.mark.timeout(300)
def test_fork_while_the_guest_floods_its_channel(
    client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    """Saved halfway through a frame, a child still finds where its own stream begins."""
    with client.create(backend=vm_backend, image=busybox_image) as parent:
        flood = parent.spawn("while :; do cat /bin/busybox; done")
        kids = []
        try:
            for _ in range(3):
                kids += parent.fork(1)
            for kid in kids:
                assert kid.run("echo ok; hostname").stdout == f"ok\n{kid.id}\n"
            assert parent.run("echo parent").stdout == "parent\n"
        finally:
            flood.kill()
            for kid in kids:
                kid.stop()


@pytest.mark.timeout(300)
def test_snapshot_of_a_running_guest_starts_guests_of_its_shape_only(
    server: Server, client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    name = f"vmsnap-{vm_backend}-{os.getpid()}"
    before = _saved_guests(server)
    with client.create(backend=vm_backend, image=busybox_image, memory_mb=192) as sb:
        sb.run("echo kept > /root/kept")
        img = sb.snapshot(name)
        assert sb.run("cat /root/kept").stdout == "kept\n"
    try:
        assert img.name == name
        assert client.get_image(name).layers == client.get_image(busybox_image).layers
        other = "vm" if vm_backend == "microvm" else "microvm"
        for wrong, match in [
            (dict(backend="container"), f'backend="{vm_backend}"'),
            (dict(backend=other, memory_mb=192), f'backend="{vm_backend}"'),
            (dict(backend=vm_backend), "memory_mb=192"),
            (dict(backend=vm_backend, memory_mb=192, disk_mb=64), "disk_mb="),
        ]:
            with pytest.raises(dsec.InvalidArgument, match=match):
                client.create(image=name, **wrong)  # type: ignore[arg-type]
        copies = [client.create(backend=vm_backend, image=name, memory_mb=192) for _ in range(2)]
        try:
            for c in copies:
                assert c.run("cat /root/kept; hostname").stdout == f"kept\n{c.id}\n"
            saved = _saved_guests(server) - before
            assert len(saved) == 1
            # Deleted while guests run from it: they keep it until they stop.
            client.delete_image(name)
            _prune(server)
            assert saved <= _saved_guests(server)
            assert copies[0].run("cat /root/kept").stdout == "kept\n"
        finally:
            for c in copies:
                c.stop()
        _prune(server)
        assert not saved & _saved_guests(server)
    finally:
        if name in {i.name for i in client.images()}:
            client.delete_image(name)


@pytest.mark.timeout(300)
def test_pause_that_saves_the_guest_frees_its_memory_and_loses_nothing(
    make_server: Callable[..., Server], vm_backend: str
) -> None:
    s = make_server(extra_args=["--vm-pause", "save"])
    with s.client() as c, c.create(backend=vm_backend, image="busybox") as sb:
        # Numbered lines, on the channel and in the guest's memory, across each pause.
        p = sb.spawn("i=0; while [ $i -lt 60 ]; do i=$((i+1)); echo $i; sleep 0.05; done")
        echo = sb.spawn("cat", stdin=True)
        echo.send_stdin("before\n")
        for _ in range(2):
            time.sleep(0.4)
            sb.pause()
            assert sb.info().state == "paused"
            assert wait_until(lambda: not qemu_procs(sb.id), 10), "its QEMU still runs"
            assert (sb.info().usage.memory_bytes or 0) == 0
            time.sleep(0.3)
            sb.resume()
            assert len(qemu_procs(sb.id)) == 1
        # A request resumes it too.
        sb.pause()
        assert wait_until(lambda: not qemu_procs(sb.id), 10)
        assert sb.run("hostname").stdout == f"{sb.id}\n"
        assert p.wait(timeout=60) == 0
        out = "".join(ev.data for ev in p.events() if ev.kind == "stdout")
        assert out.split() == [str(i) for i in range(1, 61)], "output lost across a pause"
        echo.send_stdin("after\n")
        echo.close_stdin()
        assert echo.wait(timeout=30) == 0
        assert "".join(ev.data for ev in echo.events() if ev.kind == "stdout") == "before\nafter\n"
        r = sb.run("date +%s")
        assert abs(int(r.stdout) - time.time()) < 30, "the resumed guest's clock was not set"
        sb_id = sb.id
    assert_no_leftovers(s, sb_id)


def _kept_dirs(server: Server) -> set[str]:
    """The VM sandbox directories in the server's state directory."""
    d = server.state_dir / "vm" / "sandboxes"
    return set(os.listdir(d)) if d.is_dir() else set()


@pytest.mark.timeout(360)
@pytest.mark.parametrize("how", ["kill9", "stop"])
def test_a_guest_paused_to_disk_survives_a_server_restart(
    make_server: Callable[..., Server], vm_backend: str, how: str
) -> None:
    """A guest paused to disk is kept by a server killed (or stopped) and restarted on the
    same state directory: listed paused with all it had, and its next request restores it
    with its processes and files; stop then leaves nothing."""
    s = make_server(extra_args=["--vm-pause", "save"])
    trajectory = f"kept-{os.urandom(4).hex()}"
    with s.client() as c:
        sb = c.create(
            backend=vm_backend,
            image="busybox",
            labels={"team": "kept"},
            ttl_s=3600,
            idle_ttl_s=1800,
            memory_mb=192,
            env={"KEPT": "yes"},
            trajectory_id=trajectory,
        )
        first = "echo before > /tmp/f; sleep 1000 >/dev/null 2>&1 & echo $!"
        sleeper = sb.run(first).stdout.strip()
        assert sleeper.isdigit()
        sb.pause()
        assert wait_until(lambda: not qemu_procs(sb.id), 10), "its QEMU still runs"
        before = c.get(sb.id).info()
        assert before.state == "paused"
    if how == "kill9":
        s.kill9()
    else:
        s.stop()
    assert _kept_dirs(s) == {sb.id}
    s.restart()
    with s.client() as c:
        listed = {x.id: x.info() for x in c.list()}
        assert set(listed) == {sb.id}
        again = c.get(sb.id)
        after = again.info()
        assert after.state == "paused"
        for field in (
            "backend", "image", "labels", "limits", "ttl_s", "idle_ttl_s",
            "trajectory_id", "project", "created_at", "accelerator",
        ):
            assert getattr(after, field) == getattr(before, field), field
        assert not qemu_procs(sb.id), "adopted, not restored yet"
        # Its trajectory goes on: step 0 is the recorded one, step 1 runs.
        replay = again.run(first)
        assert replay.replayed and replay.stdout.strip() == sleeper
        t0 = time.monotonic()
        r = again.run(f"cat /tmp/f; kill -0 {sleeper} && echo alive; hostname; echo $KEPT")
        restored_s = time.monotonic() - t0
        assert r.stdout.split() == ["before", "alive", sb.id, "yes"], r
        assert again.info().state == "running"
        assert len(qemu_procs(sb.id)) == 1
        date = again.run("date +%s").stdout
        assert abs(int(date) - time.time()) < 30, "the restored guest's clock was not set"
        steps = [x["step"] for x in c.log(sb.id)["steps"]]
        assert steps == [0, 1, 2], steps
        print(f"restore after a restart -> first exec: {restored_s:.2f} s")
        again.stop()
    assert_no_leftovers(s, sb.id)
    assert _kept_dirs(s) == set()


@pytest.mark.timeout(360)
def test_a_restart_removes_running_and_half_saved_guests_but_keeps_the_saved(
    make_server: Callable[..., Server], vm_backend: str
) -> None:
    """Only guests whose pause files are whole outlive a restart: a running guest, one
    half-saved and a record that does not parse are removed, the server starts and the
    kept one works; one resumed before the restart is not kept."""
    s = make_server(extra_args=["--vm-pause", "save"])
    with s.client() as c:
        running = c.create(backend=vm_backend, image="busybox")
        kept, half, resumed = (c.create(backend=vm_backend, image="busybox") for _ in range(3))
        for sb in (kept, half, resumed):
            sb.run("echo x > /root/x")
            sb.pause()
        resumed.resume()
        assert running.run("echo up").stdout == "up\n"
    s.kill9()
    assert wait_until(lambda: not qemu_procs(running.id) and not qemu_procs(resumed.id), 10)
    vm_sandboxes = s.state_dir / "vm" / "sandboxes"
    (vm_sandboxes / half.id / "paused" / "state").unlink()
    bogus = vm_sandboxes / "bogus-000000000000" / "paused"
    bogus.mkdir(parents=True)
    for name in ("memory", "state"):
        (bogus / name).write_bytes(b"\0" * 4096)
    (bogus / "kept.json").write_text("{not json")
    s.restart()
    with s.client() as c:
        assert {x.id for x in c.list()} == {kept.id}
        assert c.get(kept.id).run("cat /root/x").stdout == "x\n"
        for gone in (running, half, resumed):
            assert_no_leftovers(s, gone.id)
        assert _kept_dirs(s) == {kept.id}
        c.get(kept.id).stop()
    assert_no_leftovers(s, kept.id)
    assert _kept_dirs(s) == set()


def test_disk_limit_is_the_scratch_disk(
    client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    with client.create(backend=vm_backend, image=busybox_image, disk_mb=32) as sb:
        r = sb.run("dd if=/dev/zero of=/big bs=1M count=64; echo rc=$?", timeout=60)
        assert "rc=1" in r.stdout, r
        assert "No space left" in r.stderr
        # Deleting frees the space again: the limit is the disk, not a count of writes.
        assert sb.run("rm /big && dd if=/dev/zero of=/big bs=1M count=8").exit_code == 0


@pytest.mark.timeout(120)
def test_killed_qemu_fails_the_sandbox_promptly(
    server: Server, client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    sb = client.create(backend=vm_backend, image=busybox_image)
    procs = qemu_procs(sb.id)
    assert len(procs) == 1, procs
    os.kill(procs[0][0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(dsec.DsecError):
        sb.run("echo still here", timeout=30)
    assert time.monotonic() - t0 < 5, "a command on a dead VM hung"
    assert wait_until(lambda: sb.info().state == "failed", 5), sb.info().state
    assert_no_leftovers(server, sb.id)


@pytest.mark.timeout(120)
def test_ttl_expiry_leaves_nothing(
    server: Server, client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    sb = client.create(backend=vm_backend, image=busybox_image, ttl_s=2)
    assert sb.run("echo up").stdout == "up\n"
    assert leftovers(server, sb.id), "sanity: a live VM shows on the host"
    assert wait_until(lambda: sb.id not in {x.id for x in client.list()}, 15)
    assert_no_leftovers(server, sb.id)


@pytest.mark.timeout(240)
def test_server_kill9_then_restart_leaves_no_vm(
    make_server: Callable[..., Server], vm_backend: str
) -> None:
    s = make_server()
    with s.client() as c:
        sbs = [c.create(backend=vm_backend, image="busybox") for _ in range(2)]
        for sb in sbs:
            assert sb.run("echo x > /root/x").exit_code == 0
            assert qemu_procs(sb.id), "sanity: its QEMU is running"
        s.kill9()
    # QEMU dies with the server (PR_SET_PDEATHSIG); the restart removes the rest.
    assert wait_until(lambda: not any(qemu_procs(sb.id) for sb in sbs), 10), [
        qemu_procs(sb.id) for sb in sbs
    ]
    s.restart()
    for sb in sbs:
        assert_no_leftovers(s, sb.id, timeout=20)
    with s.client() as c2, c2.create(backend=vm_backend, image="busybox") as fresh:
        assert fresh.run("echo new").stdout == "new\n"


def test_small_memory_is_refused_clearly(
    client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    with pytest.raises(dsec.InvalidArgument, match="at least 128"):
        client.create(backend=vm_backend, image=busybox_image, memory_mb=64)


def test_qemu_has_an_empty_network_namespace_without_a_network(
    client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    """A guest without a network has loopback only, and its QEMU a network namespace of its
    own with no interface but a loopback that is down: not even QEMU can reach anything.
    (Networked guests: tests/test_network.py, which runs on the VM backends too.)"""
    with client.create(backend=vm_backend, image=busybox_image) as sb:
        assert sb.run("ls /sys/class/net").stdout.split() == ["lo"]
        [(pid, _)] = qemu_procs(sb.id)
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        r = subprocess.run(
            ["nsenter", "-t", str(pid), "-n", "ip", "-o", "link"],
            capture_output=True, text=True, check=True,
        )
        [lo] = r.stdout.splitlines()
        assert lo.split(":")[1].strip() == "lo" and "state DOWN" in lo, lo


def test_guest_cannot_reach_the_agent_channel(
    client: dsec.Client, busybox_image: str, vm_backend: str
) -> None:
    with client.create(backend=vm_backend, image=busybox_image) as sb:
        # The port exists (sysfs says so) but has no node in the guest's /dev ...
        names = sb.run("cat /sys/class/virtio-ports/*/name").stdout.split()
        assert "dsec.agent" in names
        assert "vport" not in sb.run("ls /dev").stdout
        # ... and commands can neither make one, nor mount a devtmpfs, nor read the
        # agent's descriptors.
        port = sb.run("cat /sys/class/virtio-ports/*/dev | head -1").stdout.strip()
        major, minor = port.split(":")
        r = sb.run(f"mknod /tmp/port c {major} {minor}")
        assert r.exit_code != 0 and "Operation not permitted" in r.stderr, r
        r = sb.run("mkdir -p /tmp/d && mount -t devtmpfs none /tmp/d")
        assert r.exit_code != 0, r
        fds = sb.run("ls /proc/1/fd").stdout.split()
        assert fds, "sanity: the agent holds descriptors"
        for fd in fds:
            r = sb.run(f"readlink /proc/1/fd/{fd} || echo x >> /proc/1/fd/{fd}")
            assert r.exit_code != 0 and "Permission denied" in r.stderr, (fd, r)
