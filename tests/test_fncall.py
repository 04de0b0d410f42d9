"""The fncall backend: stateless calls on pools of pre-warmed workers (issue 3)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import dsec
import pytest
from dsec_testlib import (
    Server,
    cgroup_dirs,
    make_tempdir,
    metric,
    procs_in,
    safe_rmtree,
    wait_until,
)


@pytest.fixture
def fn(client: dsec.Client, busybox_image: str) -> Iterator[dsec.Sandbox]:
    sb = client.create(backend="fncall", image=busybox_image)
    yield sb
    sb.stop()


def test_a_file_from_one_call_is_absent_in_the_next(fn: dsec.Sandbox) -> None:
    first = fn.run("echo secret > /tmp/left; hostname")
    assert first.exit_code == 0
    second = fn.run("cat /tmp/left; hostname")
    assert "secret" not in second.stdout
    assert "No such file" in second.stderr


def test_a_background_process_does_not_survive_its_call(fn: dsec.Sandbox) -> None:
    r = fn.run("(sleep 611 &) ; sleep 611 & echo started")
    assert r.stdout.strip() == "started"
    assert "sleep 611" not in fn.run("ps -o pid,args").stdout
    # The worker that ran them is destroyed in the background: soon nothing is left.
    assert wait_until(lambda: not _host_sleepers(), 10), _host_sleepers()


def _host_sleepers() -> list[str]:
    out = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and Path(f"/proc/{p}/cmdline").read_bytes() == b"sleep\x00611\x00":
                out.append(p)
        except OSError:
            pass
    return out


def test_a_reused_worker_is_pristine(fn: dsec.Sandbox) -> None:
    """Sequential calls reuse warm workers; each call still starts from the image."""
    first = fn.run(
        "echo x > /dev/shm/seg; echo y > /root/home; mkdir -p /var/run/left; rm /bin/ls;"
        " (sleep 777 &); hostname"
    )
    assert first.exit_code == 0, first.stderr
    hosts = {first.stdout.split()[-1]}
    for _ in range(11):
        r = fn.run(
            "ls /dev/shm /root /var/run/left 2>&1; ls / >/dev/null && echo ls-ok;"
            " ps -o args; hostname"
        )
        lines = r.stdout.split()
        hosts.add(lines[-1])
        assert "seg" not in r.stdout and "home" not in r.stdout, r.stdout
        assert "ls-ok" in r.stdout
        assert "sleep 777" not in r.stdout, "a process from an earlier call lives on"
    # Calls this close together are served by a few warm workers, in turn: reused.
    assert len(hosts) < 12


# What a call sees of its root, in shell builtins only (it also runs where a call may not
# fork): its mount points and their options, then how many processes /proc shows, how many
# entries /proc/acpi has, whether /proc/keys reads as empty, whether /proc/sys is writable.
VIEW = (
    'while read -r _ _ _ _ point opts _; do echo "$point $opts"; done < /proc/self/mountinfo;'
    " echo ==; set -- /proc/[0-9]*; echo $#;"
    ' set -- /proc/acpi/*; [ -e "$1" ] && echo $# || echo 0;'
    " read -r k < /proc/keys && echo keys || echo empty;"
    " { echo 1 > /proc/sys/kernel/domainname; } 2>/dev/null && echo rw || echo ro"
)


def call_view(sb: dsec.Sandbox) -> tuple[frozenset[str], str]:
    r = sb.run(VIEW)
    assert r.exit_code == 0, r.stderr
    mounts, rest = r.stdout.split("==\n")
    return frozenset(mounts.splitlines()), rest


def standby_first_processes(worker: str) -> list[int]:
    """The processes of a worker that are PID 1 of a pid namespace below its init's: its
    standby's first process (between calls, nothing else is)."""
    nspids = {}
    for pid, _ in procs_in(worker):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                nspids[pid] = line.split()[1:]
    inits = [ns for ns in nspids.values() if ns[-1] == "1"]
    if not inits:
        return []
    depth = min(len(ns) for ns in inits) + 1
    return [pid for pid, ns in nspids.items() if len(ns) == depth and ns[-1] == "1"]


def test_every_call_sees_the_same_confined_view(busybox_rootfs: Path) -> None:
    """A worker sets its next call up ahead (a standby: the root built, the call's first
    process waiting in its pid namespace); a call whose standby died clones its own first
    process, which builds the same root. Either way a call sees the same mounts, with /proc
    its own pid namespace's and the kernel's interfaces masked or read-only."""
    base = make_tempdir("dsec-fncall-")
    # One worker per pool, so that the next call goes where the standby was killed.
    one = ["--fncall-min-warm", "1", "--fncall-max-warm", "1"]
    s = Server(base / "state", log_path=base / "server.log", extra_args=one)
    try:
        s.start()
        with s.client() as c:
            c.import_image(str(busybox_rootfs), name="bb")
            fn = c.create(backend="fncall", image="bb")
            views = [call_view(fn) for _ in range(4)]

            def standbys() -> list[int] | None:
                workers = os.listdir(s.state_dir / "sandboxes")
                found = [standby_first_processes(w) for w in workers]
                return [pid for f in found for pid in f] if found and all(found) else None

            for _ in range(3):
                killed = wait_until(standbys, 15)
                assert killed, "no standby first process in the pool's worker"
                for pid in killed:
                    os.kill(pid, signal.SIGKILL)
                views.append(call_view(fn))
            views.append(call_view(fn))
            fn.stop()
        assert all(v == views[0] for v in views), views
        mounts, rest = views[0]
        points = dict(line.split(maxsplit=1) for line in mounts)
        assert points["/proc/sys"].startswith("ro"), points
        assert points["/proc/acpi"].startswith("ro"), points
        assert "/proc/keys" in points and "/sys/firmware" in points, points
        # The shell alone (PID 1), an empty /proc/acpi, /proc/keys reading as /dev/null,
        # /proc/sys not writable.
        assert rest == "1\n0\nempty\nro\n", views
    finally:
        s.cleanup()
        safe_rmtree(base)


def test_the_standby_takes_no_process_from_a_calls_pids(
    client: dsec.Client, busybox_image: str
) -> None:
    """pids=4 has always left a call three processes beside its worker's init: the worker's
    standby (the next call set up ahead: a holder of its root, and its first process, which
    becomes the call's command) is dsec's own and does not take one."""
    fn = client.create(backend="fncall", image=busybox_image, pids=4)
    try:
        for _ in range(3):  # the first call may find no standby yet; the later ones do
            r = fn.run("sleep 0.2 & sleep 0.2 & wait; echo ok")
            assert (r.exit_code, r.stdout) == (0, "ok\n"), r.stderr
    finally:
        fn.stop()


def test_environment_and_files_do_not_carry(fn: dsec.Sandbox) -> None:
    r = fn.run("cat /in/data; echo ${MARK:-unset}", env={"MARK": "x"}, files={"/in/data": "1\n"})
    assert r.stdout == "1\nx\n"
    r = fn.run("cat /in/data 2>/dev/null; echo ${MARK:-unset}")
    assert r.stdout == "unset\n"


def test_client_call_one_shot(client: dsec.Client, busybox_image: str) -> None:
    r = client.call(
        "read x; echo got $x; cat /task.txt",
        image=busybox_image,
        stdin="42\n",
        files={"/task.txt": "hello"},
        timeout=10,
    )
    assert r.exit_code == 0
    assert r.stdout == "got 42\nhello"


def test_concurrent_calls_are_isolated(
    client: dsec.Client, busybox_image: str, server: Server
) -> None:
    async def main() -> list[dsec.CommandResult]:
        async with server.async_client() as ac:
            sb = await ac.create(backend="fncall", image=busybox_image)
            try:
                calls = [
                    sb.run(f"echo {i} > /shared; sleep 0.2; cat /shared; ls /tmp | wc -l")
                    for i in range(12)
                ]
                return list(await asyncio.gather(*calls))
            finally:
                await sb.stop()

    results = asyncio.run(main())
    for i, r in enumerate(results):
        assert r.exit_code == 0, r
        assert r.stdout.split() == [str(i), "0"], f"call {i} saw another call's state: {r.stdout!r}"


def test_timeout_kills_the_call_and_reports_it(fn: dsec.Sandbox) -> None:
    t = time.monotonic()
    r = fn.run("trap '' TERM; sleep 600", timeout=1)
    assert r.timed_out and r.exit_code is None
    assert time.monotonic() - t < 10
    assert fn.run("echo next").stdout == "next\n"


def test_memory_limit_is_reported(client: dsec.Client, busybox_image: str) -> None:
    sb = client.create(backend="fncall", image=busybox_image, memory_mb=32)
    try:
        # `tail` keeps the whole last line: 200 MiB of NULs with no newline.
        r = sb.run("head -c 200m /dev/zero | tail", timeout=60)
        assert r.oom_killed, r
        assert sb.run("echo fine").stdout == "fine\n"
    finally:
        sb.stop()


def test_stateful_operations_are_refused(fn: dsec.Sandbox) -> None:
    with pytest.raises(dsec.InvalidArgument, match="no state between calls"):
        fn.write_file("/x", "y")
    with pytest.raises(dsec.InvalidArgument):
        fn.read_file("/etc/passwd")


def test_bad_input(client: dsec.Client, busybox_image: str) -> None:
    with pytest.raises(dsec.NotFound, match="no-such-image"):
        client.create(backend="fncall", image="no-such-image")
    with pytest.raises(dsec.NotFound, match="no-such-image"):
        client.call("true", image="no-such-image")
    with pytest.raises(dsec.InvalidArgument, match="timeout"):
        client.call("true", image=busybox_image, timeout=-1)


def test_pool_refills_after_a_burst(
    server: Server, client: dsec.Client, busybox_image: str
) -> None:
    sb = client.create(backend="fncall", image=busybox_image)
    try:
        misses_before = metric(server.url, "dsec_fncall_pool_misses_total")

        async def burst() -> None:
            async with server.async_client() as ac:
                h = await ac.get(sb.id)
                rs = await asyncio.gather(*(h.run("true") for _ in range(40)))
                assert all(r.exit_code == 0 for r in rs)

        asyncio.run(burst())
        assert metric(server.url, "dsec_fncall_pool_hits_total") > 0
        # the burst outran the pool, so some calls waited for a worker rather than failing
        assert metric(server.url, "dsec_fncall_pool_misses_total") >= misses_before
        # afterwards the pool is warm again: the next calls find a worker ready
        wait_until(lambda: metric(server.url, "dsec_fncall_pool_ready") >= 2, 15)
        hits = metric(server.url, "dsec_fncall_pool_hits_total")
        assert sb.run("true").exit_code == 0
        assert metric(server.url, "dsec_fncall_pool_hits_total") == hits + 1
    finally:
        sb.stop()


def test_nothing_is_left_after_the_server_stops(busybox_rootfs: Path) -> None:
    base = make_tempdir("dsec-fncall-")
    s = Server(base / "state", log_path=base / "server.log")
    try:
        s.start()
        with s.client() as c:
            c.import_image(str(busybox_rootfs), name="bb")
            sb = c.create(backend="fncall", image="bb")
            assert sb.run("echo ok").stdout == "ok\n"
            wait_until(lambda: len(os.listdir(s.state_dir / "sandboxes")) >= 2, 15)
            workers = os.listdir(s.state_dir / "sandboxes")
        assert s.stop() == 0
        assert os.listdir(s.state_dir / "sandboxes") == []
        for w in workers:
            assert not cgroup_dirs(w), f"cgroups of worker {w} left: {cgroup_dirs(w)}"
            assert not procs_in(w), f"processes of worker {w} left: {procs_in(w)}"
    finally:
        s.cleanup()
        safe_rmtree(base)
