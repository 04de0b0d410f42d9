"""Hardening of the host against its sandboxes (issue 20, item 6), each test written as the
attack: over-budget creates, impossible `pids`, kernel memory filled with inodes, a memory
hog, processes that tamper with init's OOM score, init killed from the host, and TCP state
one fncall call leaves for the next. Each asserts the attack is contained and the server
stays healthy.

Native `container` (and `fncall`) sandboxes only: these are properties of dsec's own
runtime and of the edge's admission control.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import dsec
import httpx
import pytest
from dsec_testlib import (
    Server,
    assert_no_leftovers,
    cgroup_dirs,
    cgroup_mounts,
    cgroup_parents,
    descendants,
    metric,
    procs_in,
    spare_cgroup_sets,
    wait_until,
)

MakeSandbox = Callable[..., dsec.Sandbox]
MakeServer = Callable[..., Server]

#: Each filler makes kernel objects that outlive the process making them (tmpfs inodes and
#: dentries); the negative-dentry one makes reclaimable ones, which must not fail at all.
FILLERS = {
    "files": "i=0; while : > /tmp/f$i; do i=$((i+1)); done",
    "directories": "i=0; while mkdir /tmp/d$i; do i=$((i+1)); done",
    "negative dentries": "i=0; while [ $i -lt 100000 ]; do [ -e /tmp/nx$i ]; i=$((i+1)); done",
}


@pytest.fixture(autouse=True)
def native_container(backend: str) -> None:
    if backend != "container":
        pytest.skip(f"dsec's own runtime and admission, not backend {backend}")


def healthy(server: Server) -> bool:
    return server.alive() and httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200


def cgroup_line(pid: int, controller: str) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return path
    raise AssertionError(f"process {pid} has no {controller} cgroup")


def init_pid(sb: dsec.Sandbox) -> int:
    """The host pid of a container sandbox's init: the one process of the sandbox whose
    parent (the zygote) is not in it."""
    procs = {pid for pid, _ in procs_in(sb.id)}
    inits = [pid for pid in procs if _ppid(pid) not in procs]
    assert len(inits) == 1, f"sandbox {sb.id}: {inits} of {procs}"
    return inits[0]


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def oom_score_adj(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


def has_cap_sys_resource(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << 24))
    return False


# ------------------------------------------------------------------ admission control


def test_over_budget_creates_are_refused_while_existing_sandboxes_work(
    make_server: MakeServer,
) -> None:
    s = make_server(extra_args=["--memory-overcommit", "0.05", "--net-pool", "10.235.0.0/16"])
    budget = metric(s.url, "dsec_admission_budget", resource="memory_mb")
    assert budget > 0
    each = int(budget / 2.5)
    with s.client() as c:
        first = [c.create(image="busybox", memory_mb=each) for _ in range(2)]
        with pytest.raises(dsec.CapacityExceeded) as e:
            c.create(image="busybox", memory_mb=each)
        err = e.value
        assert isinstance(err, dsec.Unavailable)
        assert (err.status, err.kind) == (503, "capacity")
        for needle in (
            f"memory budget is {int(budget)} MiB",
            f"{2 * each} MiB of it is promised to 2 sandboxes",
            f"asks for {each} MiB",
            "--memory-overcommit",
        ):
            assert needle in err.message, err.message
        # What is already there keeps working, and a stopped sandbox gives its share back.
        for sb in first:
            assert sb.run("echo ok").stdout == "ok\n"
        first[0].stop()
        replacement = c.create(image="busybox", memory_mb=each)
        assert replacement.run("echo ok").stdout == "ok\n"
        # A fncall worker is a sandbox of the host too: with the budget promised, a call
        # fails at once instead of waiting out its timeout for a worker.
        started = time.monotonic()
        with pytest.raises(dsec.CapacityExceeded):
            c.call("true", image="busybox", timeout=60)
        assert time.monotonic() - started < 20
        for sb in (first[1], replacement):
            sb.stop()
    assert metric(s.url, "dsec_admission_refused_total", resource="memory") >= 2
    assert metric(s.url, "dsec_admission_promised", resource="memory_mb") <= budget
    assert healthy(s)


def test_the_sandboxes_parents_are_limited(sb: dsec.Sandbox, server: Server) -> None:
    """All sandboxes together cannot take the host's memory or pids: the `dsec-<tag>`
    parents carry the capacity the edge admits against. init lives beside the sandboxes,
    in the parent's cgroup of all inits, outside its own sandbox's limit."""
    pid = init_pid(sb)
    mounts = _cgroup_mounts()
    init_memory = Path(mounts["memory"]) / cgroup_line(pid, "memory").lstrip("/")
    assert init_memory.name == "inits", init_memory
    parent = init_memory.parent
    capacity_mb = metric(server.url, "dsec_admission_capacity", resource="memory_mb")
    capacity_pids = metric(server.url, "dsec_admission_capacity", resource="pids")
    assert int((parent / "memory.limit_in_bytes").read_text()) == int(capacity_mb) << 20
    pids_dir = Path(mounts["pids"]) / cgroup_line(pid, "pids").lstrip("/")
    assert pids_dir.name == sb.id
    assert int((pids_dir.parent / "pids.max").read_text()) == int(capacity_pids)
    # The sandbox's own limit binds its commands, which run in its memory cgroup.
    sandbox_memory = parent / sb.id
    assert int((sandbox_memory / "memory.limit_in_bytes").read_text()) == 512 << 20
    r = sb.run("cat /proc/self/cgroup")
    assert any(line.endswith(":memory:/") for line in r.stdout.splitlines()), r.stdout


def _cgroup_mounts() -> dict[str, str]:
    """controller -> v1 mount point (this host's layout is v1 for memory and pids)."""
    out = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields = right.split()
        if fields and fields[0] == "cgroup":
            for opt in fields[2].split(","):
                if opt in ("memory", "pids"):
                    out[opt] = left.split()[4]
    if set(out) != {"memory", "pids"}:
        pytest.skip("memory and pids are not v1 hierarchies on this host")
    return out


def test_pids_above_the_hosts_limit_are_refused(
    client: dsec.Client, busybox_image: str, server: Server
) -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    capacity = int(metric(server.url, "dsec_admission_capacity", resource="pids"))
    assert capacity < pid_max
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create(image=busybox_image, pids=pid_max + 1)
    assert f"pids must be between 4 and {capacity}" in e.value.message
    assert "kept for the host" in e.value.message
    with pytest.raises(dsec.InvalidArgument):
        client.create(image=busybox_image, pids=capacity + 1)
    assert healthy(server)


# ------------------------------------------------------------------ init and the OOM killer


def ran_or_oom_killed(r: dsec.CommandResult) -> bool:
    """The command ran, was OOM-killed, or could not start for want of memory (the clone
    charged to a cgroup full of what nothing can free fails, or execve finds no page to
    copy the arguments into, which the kernel calls E2BIG) and said so."""
    refused = r.exit_code == 126 and "Cannot allocate memory" in r.stderr
    return r.exit_code == 0 or r.oom_killed or refused


@pytest.mark.parametrize("filler", list(FILLERS))
def test_kernel_memory_fillers_never_kill_init(
    make_sandbox: MakeSandbox, server: Server, filler: str
) -> None:
    sb = make_sandbox(memory_mb=32)
    init = init_pid(sb)
    failures = metric(server.url, "dsec_sandbox_failures_total")
    r = sb.run(FILLERS[filler], timeout=120)
    assert not r.timed_out, f"{filler}: ran past its timeout"
    if filler == "negative dentries":
        # Reclaimable: the kernel frees them at the limit instead of killing anything.
        assert (r.exit_code, r.oom_killed) == (0, False), (r.exit_code, r.stderr)
    else:
        assert r.exit_code != 0 and r.oom_killed, (r.exit_code, r.oom_killed, r.stderr)
    # The sandbox answers: each command runs, or (the limit is full of files nothing can
    # free) is OOM-killed or cannot start, and says so. init never goes.
    for _ in range(3):
        r = sb.run("echo alive", timeout=30)
        assert ran_or_oom_killed(r), (r.exit_code, r.stdout, r.stderr)
    assert sb.info().state == "running"
    assert init_pid(sb) == init
    assert metric(server.url, "dsec_sandbox_failures_total") == failures
    assert healthy(server)


def test_memory_hog_never_kills_init(make_sandbox: MakeSandbox, server: Server) -> None:
    sb = make_sandbox(memory_mb=32)
    init = init_pid(sb)
    # Many small hogs, so that none is bigger than init: the OOM killer must still pick
    # among the commands only.
    r = sb.run(
        "for i in 1 2 3 4 5 6 7 8; do head -c 24m /dev/zero | tail & done; wait",
        timeout=120,
    )
    assert r.oom_killed, (r.exit_code, r.stderr)
    assert sb.run("echo alive").stdout == "alive\n"
    assert init_pid(sb) == init
    assert sb.info().state == "running"
    assert healthy(server)


def test_commands_cannot_change_inits_oom_score(make_sandbox: MakeSandbox) -> None:
    sb = make_sandbox()
    init = init_pid(sb)
    before = oom_score_adj(init)
    for _ in range(5):
        assert sb.run("true").exit_code == 0
    r = sb.run(
        "cat /proc/self/oom_score_adj;"
        " echo 1000 > /proc/1/oom_score_adj && echo RAISED-INIT;"
        " echo 15 > /proc/1/oom_adj && echo RAISED-INIT-LEGACY;"
        " ls /proc/1/task;"
        " echo -1000 > /proc/self/oom_score_adj && echo LOWERED-SELF;"
        " echo -17 > /proc/self/oom_adj && echo LOWERED-SELF-LEGACY;"
        " true"
    )
    assert r.stdout.split() == ["0"], (r.stdout, r.stderr)
    assert "Read-only file system" in r.stderr
    assert oom_score_adj(init) == before


def test_init_is_exempt_from_the_oom_killer_where_the_host_allows(
    make_sandbox: MakeSandbox, server: Server
) -> None:
    if not has_cap_sys_resource(server.pid):
        pytest.skip(
            "the server has no CAP_SYS_RESOURCE here, so init keeps oom_score_adj 0 "
            "(its protection is the cgroup split the other tests check)"
        )
    sb = make_sandbox()
    init = init_pid(sb)
    for _ in range(3):
        assert sb.run("cat /proc/self/oom_score_adj").stdout == "0\n"
    assert oom_score_adj(init) == -1000


def test_init_killed_from_the_host_answers_sandbox_failed(
    make_sandbox: MakeSandbox, server: Server
) -> None:
    quiet = make_sandbox()
    sb = make_sandbox()
    failures = metric(server.url, "dsec_sandbox_failures_total", cause="signal")
    os.kill(init_pid(sb), signal.SIGKILL)

    def failed() -> dsec.SandboxFailed | None:
        try:
            sb.run("true", timeout=10)
        except dsec.SandboxFailed as e:
            return e
        return None

    err = wait_until(failed, 10)
    assert err is not None, "a sandbox whose init was killed still runs commands"
    assert isinstance(err, dsec.Conflict)  # old `except dsec.Conflict` keeps working
    assert (err.status, err.kind) == (409, "sandbox_failed")
    assert "SIGKILL" in err.message, err.message
    assert sb.info().state == "failed"
    with pytest.raises(dsec.SandboxFailed):
        sb.read_file("/etc/hostname")
    assert metric(server.url, "dsec_sandbox_failures_total", cause="signal") == failures + 1
    assert quiet.run("echo ok").stdout == "ok\n"
    sb.stop()
    assert_no_leftovers(server, sb.id)
    assert healthy(server)


# ------------------------------------------------------------------ descriptors and inits


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def zombies_under(pid: int) -> list[int]:
    """Descendants of ``pid`` that exited and wait to be reaped (an init the zygote kept)."""
    out = []
    for p in descendants(pid):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] == "Z":
            out.append(p)
    return out


def test_an_idle_sandbox_costs_the_server_one_descriptor(make_server: MakeServer) -> None:
    """Issue 15: the host's hard RLIMIT_NOFILE (20,000 on some hosts, with no
    CAP_SYS_RESOURCE to raise it) bounds the sandboxes an edge holds, so an idle sandbox
    holds one of the server's descriptors (its control channel), not two (init's pidfd was
    the second); each stop gives it back and leaves no init unreaped under the zygote."""
    n = 50
    s = make_server()
    with s.client() as c:
        # The first create opens what every later one shares (the image's layers, the log).
        c.create(image="busybox", memory_mb=32).stop()
        before = open_descriptors(s.pid)
        sbs = c.create_many(n, image="busybox", memory_mb=32)
        try:
            held = open_descriptors(s.pid) - before
            assert n * 0.9 <= held <= n * 1.2, f"{n} idle sandboxes hold {held} descriptors"
            assert all(sb.run("true").exit_code == 0 for sb in sbs[:3])
        finally:
            for sb in sbs:
                sb.stop()
        assert wait_until(lambda: open_descriptors(s.pid) <= before + 2, 10), (
            f"{open_descriptors(s.pid) - before} descriptors outlived their sandboxes"
        )
        assert wait_until(lambda: not zombies_under(s.pid), 10), (
            f"inits left unreaped: {zombies_under(s.pid)}"
        )


def network_namespaces_held(pid: int) -> set[str]:
    """The network namespaces ``pid`` holds descriptors of (``net:[inode]``)."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("net:["):
            held.add(target)
    return held


def test_each_sandbox_has_a_fresh_network_namespace_of_its_own(make_server: MakeServer) -> None:
    """Issue 15: a new network namespace is the dearest part of a sandbox's clone, so the
    zygote makes a few ahead while it waits, and a create takes one. Each sandbox's is still
    its own: not the host's, no other sandbox's, no spare the zygote still holds; no init
    holds a descriptor of any (a spare, or the zygote's own namespace, inherited at the
    clone); and a spare is fresh: only loopback in it, up."""
    s = make_server()
    host = os.readlink("/proc/self/ns/net")
    zygote = next(
        p for p in descendants(s.pid) if b"__zygote" in Path(f"/proc/{p}/cmdline").read_bytes()
    )

    def spares() -> set[str]:
        return network_namespaces_held(zygote) - {host}

    assert wait_until(lambda: len(spares()) >= 2, 10), "the zygote keeps no spare namespaces"
    with s.client() as c:
        made = spares()
        # More than the zygote keeps: some creates take a spare, the rest may make their own.
        sbs = [c.create(image="busybox", network=False, memory_mb=32) for _ in range(8)]
        try:
            nets = [os.readlink(f"/proc/{init_pid(sb)}/ns/net") for sb in sbs]
            assert host not in nets
            assert len(set(nets)) == len(nets), f"sandboxes share a namespace: {nets}"
            assert made & set(nets), "no sandbox took a spare: the test proves nothing"
            assert not spares() & set(nets), "the zygote still holds a namespace it gave away"
            for sb in sbs:
                assert not network_namespaces_held(init_pid(sb)), "an init holds a namespace"
                dev = sb.run("cat /proc/net/dev").stdout.splitlines()[2:]
                assert [line.split(":")[0].strip() for line in dev] == ["lo"], dev
                assert sb.run("ping -c 1 -W 2 127.0.0.1").exit_code == 0
        finally:
            for sb in sbs:
                sb.stop()


def test_a_sandbox_made_from_a_spare_cgroup_set_has_its_own_limits(
    make_server: MakeServer,
) -> None:
    """Issue 15: on a v1 host a create renames a cgroup set made ahead (five `mkdir`s off its
    path) to its id, then writes its limits: the sandbox's cgroups are named by its id and
    hold its limits, the spare is gone, and none outlives the server's stop."""
    s = make_server()
    if not any(key == "memory" for _, key in cgroup_mounts()):
        pytest.skip("no v1 memory hierarchy: on cgroup2 every create makes its own cgroup")
    with s.client() as c:
        with c.create(image="busybox", memory_mb=32) as first:
            parents = cgroup_parents(s, first.id)
        assert wait_until(lambda: len(spare_cgroup_sets(parents)) >= 2, 10), parents
        before = spare_cgroup_sets(parents)
        with c.create(image="busybox", memory_mb=48, pids=37) as sb:
            dirs = cgroup_dirs(sb.id, s.cgroups)
            memory = [d for d in dirs if "/memory/" in d]
            pids = [d for d in dirs if "/pids/" in d]
            assert len(memory) == 1 and len(pids) == 1, dirs
            assert Path(memory[0], "memory.limit_in_bytes").read_text() == f"{48 << 20}\n"
            assert Path(pids[0], "pids.max").read_text() == "37\n"
            assert sb.run("true").exit_code == 0
            taken = before - spare_cgroup_sets(parents)
            assert len(taken) == 1, f"not one spare set taken: {sorted(taken)}"
        assert_no_leftovers(s, sb.id)
    assert s.stop() == 0
    assert not spare_cgroup_sets(parents), spare_cgroup_sets(parents)


def test_stop_kills_a_sandbox_whatever_its_processes_do(
    make_sandbox: MakeSandbox, server: Server
) -> None:
    """stop kills init by its pid: processes that ignore every catchable signal, left their
    session, or keep forking go with init's pid namespace, and init is reaped."""
    sb = make_sandbox()
    sb.run(
        "for s in HUP INT TERM USR1; do trap '' $s; done;"
        " (setsid sh -c 'trap \"\" TERM; sleep 1001' &);"
        " (while :; do sleep 1002 & sleep 0.1; done &) ; true"
    )

    def sleepers() -> int:
        return sum("sleep 100" in cmd for _, cmd in procs_in(sb.id))

    assert wait_until(lambda: sleepers() >= 3, 10), procs_in(sb.id)
    init = init_pid(sb)
    sb.stop()
    assert_no_leftovers(server, sb.id)
    assert wait_until(lambda: init not in zombies_under(server.pid), 10), (
        "the stopped sandbox's init was left unreaped"
    )
    assert healthy(server)


# ------------------------------------------------------------------ fncall residue


def test_tcp_state_of_one_call_is_invisible_to_the_next(
    make_server: MakeServer,
) -> None:
    """Call 1 opens and closes loopback TCP connections (the closing side would keep each
    in TIME_WAIT for a minute); the next call on the same worker finds none of them.
    (The pool may hand calls to its workers in turn: the looker is repeated until it runs
    on the opener's worker; on another worker it touches nothing.)"""
    s = make_server(
        extra_args=[
            "--fncall-min-warm",
            "1",
            "--fncall-max-warm",
            "1",
            "--net-pool",
            "10.236.0.0/16",
        ]
    )
    port = 5321
    opener = (
        f"for i in 1 2 3 4 5; do nc -l -p {port} > /dev/null & sleep 0.1;"
        f" echo hi | nc -w 1 127.0.0.1 {port}; wait; done; echo CONNECTED; hostname"
    )
    looker = "cat /proc/net/tcp /proc/net/tcp6; hostname"
    with s.client() as c:
        fn = c.create(backend="fncall", image="busybox")
        first = fn.run(opener, timeout=30)
        assert first.exit_code == 0 and "CONNECTED" in first.stdout, first.stderr
        for _ in range(5):
            second = fn.run(looker, timeout=30)
            assert second.exit_code == 0, second.stderr
            if first.stdout.split()[-1] == second.stdout.split()[-1]:
                break
        else:
            pytest.fail("no two consecutive calls ran on the same worker")
        seen = [line for line in second.stdout.splitlines() if f":{port:04X} " in line.upper()]
        assert not seen, f"the previous call's connections: {seen}"
        fn.stop()
    assert healthy(s)
