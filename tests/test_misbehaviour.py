"""Agent misbehaviour (issue 18): each case asserts containment and the event an operator
sees — a fork bomb (`limit.pids`, then the Watcher's flag), a `yes` flood
(`output.truncated`, no server memory or disk growth), a memory hog (`limit.oom`), a full
writable layer (`limit.disk`, by bytes and by files), a CPU hog (`limit.cpu`, the Watcher's
`cpu-hog`), a zombie storm (reaped), endless and huge files through the files API (refused
at once: `file.refused`), 500 concurrent commands in one sandbox (all answered, a quiet
sandbox still quick), a port scan (`network.refused` and the Watcher's `port-scan` flag;
the host's services unreachable), package fetches outside the allow-list (NXDOMAIN and the
proxy's refusal, both `network.refused` with the name), a write over `/bin/sh` through the
files API (the Watcher's `binary-overwrite` flag; the image and other sandboxes unchanged),
a thread storm (`limit.pids`, the Watcher's `pids-storm`), forged frames (output, never
taken for the channel's), `chattr` ioctls (refused), masked `/proc` and `/sys` paths
(empty, and refused by the files API: `file.refused`), a symbolic link swapped between the
files API's check and use (never the host's file), oversized uploads (`file.refused`), and
the Watcher's acting rules (cut the network, pause, stop). One project reaching into
another's sandboxes is tests/test_projects.py (`NotFound` on every route, on every
backend).

Throughout the module a quiet container sandbox answers a command every half second (its
round trip's p50 is reported at the end, not asserted), and at the end every sandbox the
module made on the shared server is stopped and has left nothing on the host."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import socket
import socketserver
import statistics
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import dsec
import pytest
from dsec_local import leftovers_of, wait_until
from dsec_testlib import MAX_UPLOAD_MB, STATEFUL, VM_BACKENDS, Server
from test_network import NsHost, web, zone_server  # noqa: F401 (fixtures, by name below)

Make = Callable[..., dsec.Sandbox]


def kinds_of(client: dsec.Client, sandbox: str, kinds: list[str]) -> list[dsec.Event]:
    return list(client.events(sandbox=sandbox, kinds=kinds))


def wait_for(
    client: dsec.Client, sandbox: str, kind: str, timeout: float = 15.0
) -> list[dsec.Event]:
    found = wait_until(lambda: kinds_of(client, sandbox, [kind]), timeout, interval=0.2)
    assert found, f"no {kind} for {sandbox}: {list(client.events(sandbox=sandbox))}"
    return found


@pytest.fixture(scope="module", autouse=True)
def quiet_neighbour(
    server: Server,
    busybox_image: str,
    request: pytest.FixtureRequest,
    record_testsuite_property: Callable[[str, object], None],
) -> Iterator[None]:
    """The server stays responsive and nothing leaks while the cases below misbehave: a
    quiet container sandbox runs `true` every half second (each must answer within 30 s;
    the p50 is reported, not asserted: this host is shared and noisy), and at the end every
    sandbox the module made on the shared server has stopped and left nothing behind."""
    started = time.time()
    rtts_ms: list[float] = []
    failures: list[str] = []
    done = threading.Event()
    with server.client() as c:
        quiet = c.create(backend="container", image=busybox_image)

        def probe() -> None:
            while not done.wait(0.5):
                t = time.perf_counter()
                try:
                    r = quiet.run("true", timeout=30)
                except dsec.DsecError as e:
                    failures.append(repr(e))
                    continue
                rtts_ms.append((time.perf_counter() - t) * 1000)
                if r.exit_code != 0:
                    failures.append(f"exit {r.exit_code}: {r.stderr}")

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        try:
            yield
        finally:
            done.set()
            prober.join(60)
            quiet.stop()
        p50 = statistics.median(rtts_ms) if rtts_ms else float("nan")
        record_testsuite_property("misbehaviour_quiet_exec_p50_ms", round(p50, 2))
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(
                f"\n[misbehaviour] quiet sandbox exec p50 throughout the module: {p50:.1f} ms "
                f"(n={len(rtts_ms)}, max {max(rtts_ms, default=0):.0f} ms)"
            )
        assert not failures, f"the quiet sandbox stopped answering: {failures[:5]}"
        assert len(rtts_ms) >= 2, "the quiet sandbox was never probed"
        made = {e.sandbox for e in c.events(kinds=["sandbox.created"], since=started)}
        ended = {
            e.sandbox
            for e in c.events(kinds=["sandbox.stopped", "sandbox.failed"], since=started)
        }
        assert made - ended == set(), f"sandboxes still running: {made - ended}"
        ids = {sid for sid in made if sid}
        if not wait_until(lambda: not leftovers_of(server, ids), 10):
            pytest.fail(f"left on the host: {leftovers_of(server, ids)}")


def du(path: Path | None) -> int:
    """Bytes allocated under `path`, on its own filesystem (no sandbox's mounts)."""
    if path is None or not path.exists():
        return 0
    r = subprocess.run(["du", "-sxB1", str(path)], capture_output=True, text=True)
    return int(r.stdout.split()[0])


def server_rss(server: Server) -> int:
    for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_fork_bomb_hits_the_pids_limit_and_is_flagged(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    if backend == "fncall":
        pytest.skip(f"{backend}: the pids limit is not the host's cgroup to read")
    sb = make_sandbox(pids=32)
    # Five bursts of 40 forks, 1.3 s apart: the sampler sees refused forks in several
    # rounds. Each burst runs in a shell of its own, which a refused fork ends; the
    # outer shell forks again only once the burst's sleeps are gone.
    r = sb.run(
        "for k in 1 2 3 4 5; do sh -c 'for i in $(seq 40); do sleep 1 & done' 2>/dev/null; "
        "sleep 1.3; done; true",
        timeout=30,
    )
    assert r.exit_code is not None
    hits = wait_for(client, sb.id, "limit.pids")
    assert hits[0].data["limit"] == 32 and hits[0].data["refused_forks"] > 0
    assert sb.info().usage.pids_limit_hits
    action = wait_for(client, sb.id, "watcher.action")[0]
    assert action.data["rule"] == "pids-storm" and action.data["action"] == "flag"
    assert action.data["ok"] is True
    hit_ids = {e.id for e in kinds_of(client, sb.id, ["limit.pids"])}
    assert set(action.data["evidence"]["events"]) <= hit_ids
    assert sb.info().labels.get("watcher.pids-storm") == "flagged"
    assert sb.id in [s.id for s in client.list(labels={"watcher.pids-storm": "flagged"})]
    assert sb.run("echo alive").stdout == "alive\n", "a flag does not stop the sandbox"


#: A loop that keeps one core busy for as long as the command runs.
BUSY_LOOP = "timeout 3 sh -c 'while :; do :; done'; true"


def test_a_cpu_hog_is_throttled_and_reported(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    if backend in VM_BACKENDS or backend == "fncall":
        pytest.skip(f"{backend}: the CPU limit is not the host's cgroup to read")
    sb = make_sandbox(cpus=0.1)
    sb.run(BUSY_LOOP, timeout=30)
    usage = sb.info().usage
    # 3 s at a tenth of a core: held back for most of it (less on a loaded host, where
    # the loop waits for a core as well as for its quota).
    assert usage.cpu_throttled_ms is not None and usage.cpu_throttled_ms > 500, usage
    assert usage.cpu_ms is not None and usage.cpu_ms < 3000 * 0.5, usage
    hit = wait_for(client, sb.id, "limit.cpu")[0]
    assert hit.data["cpus"] == 0.1 and hit.data["throttled_ms"] >= 100, hit.data


def test_a_cpu_hog_is_flagged(make_server: Callable[..., Server], tmp_path: Path) -> None:
    config = tmp_path / "watcher.json"
    config.write_text(
        '{"rules": [{"name": "cpu-hog", "kind": "limit.cpu", "count": 2, "action": "flag"}]}'
    )
    server = make_server(extra_args=["--watcher-config", str(config)])
    with server.client() as c:
        sb = c.create(image="busybox", cpus=0.1)
        try:
            sb.run(BUSY_LOOP, timeout=30)
            action = wait_for(c, sb.id, "watcher.action")[0]
            assert action.data["rule"] == "cpu-hog" and action.data["ok"] is True
            assert sb.info().labels.get("watcher.cpu-hog") == "flagged"
            with c.create(image="busybox", cpus=0.2) as idle:
                idle.run("sleep 2")
                assert not kinds_of(c, idle.id, ["limit.cpu"]), "an idle sandbox is no hog"
        finally:
            sb.stop()


def test_yes_flood_is_truncated_without_server_growth(
    client: dsec.Client, server: Server, make_sandbox: Make, backend: str
) -> None:
    # The flood is bounded by volume, not run for a minute: what it proves, that nothing
    # on the path holds or stores what was cut, holds per byte. 0.9 GB through a container;
    # Docker's attach stream and a TCG guest's channel carry a few MB/s, so there 10 and
    # 4 times the bound, three times over.
    flood = {"docker": 10_000_000, "microvm": 4_000_000, "vm": 4_000_000}.get(
        backend, 300_000_000
    )
    sb = make_sandbox()
    before = server_rss(server)
    disk_before = du(server.state_dir) + du(server.log_path)
    for _ in range(3):
        r = sb.run(f"yes | head -c {flood}", max_output_bytes=1 << 20, timeout=60)
        assert r.truncated
        assert len(r.stdout) <= 1 << 20
    grew = server_rss(server) - before
    assert grew < 64 << 20, f"server grew {grew} bytes"
    # What is kept (the trajectory log's bounded output, the events) is a few MiB at most.
    disk_grew = du(server.state_dir) + du(server.log_path) - disk_before
    assert disk_grew < 16 << 20, f"the state directory and log grew {disk_grew} bytes"
    usage = sb.info().usage
    assert usage.disk_bytes is None or usage.disk_bytes < 8 << 20, usage
    assert len(wait_for(client, sb.id, "output.truncated")) == 3
    action = wait_for(client, sb.id, "watcher.action")[0]
    assert action.data["rule"] == "output-flood"


def test_memory_hog_is_killed_and_reported(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    memory_mb = 128 if backend in VM_BACKENDS else 64  # a guest's smallest
    sb = make_sandbox(memory_mb=memory_mb)
    r = sb.run("head -c 400m /dev/zero | tail > /dev/null", timeout=60)
    assert r.oom_killed, r
    oom = wait_for(client, sb.id, "limit.oom")
    assert oom[0].data["memory_mb"] == memory_mb
    end = kinds_of(client, sb.id, ["command.end"])[-1]
    assert end.data["oom_killed"] is True
    if backend in STATEFUL:
        assert sb.run("echo alive").stdout == "alive\n"


def test_disk_filler_is_stopped_at_the_limit(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    if backend != "container":
        pytest.skip(f"{backend}: the writable layer's fill is not read from the host")
    sb = make_sandbox(disk_mb=16)
    r = sb.run("dd if=/dev/zero of=/tmp/fill bs=1M count=64", timeout=60)
    assert r.exit_code != 0 and "No space left" in r.stderr, r
    ev = wait_for(client, sb.id, "limit.disk")[0]
    assert ev.data["disk_mb"] == 16 and ev.data["used_bytes"] >= 15 << 20


def test_an_inode_filler_gets_enospc_not_the_oom_killer(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    """Empty files take no blocks: without a bound on the writable layer's inodes they
    would fill the memory limit with kernel memory instead (the OOM killer, and memory
    that stays taken). A 32 MiB layer holds 16,384 files."""
    if backend != "container":
        pytest.skip(f"{backend}: the writable layer is not dsec's tmpfs")
    sb = make_sandbox(disk_mb=32, memory_mb=128)
    r = sb.run(
        "i=0; while [ $i -lt 40000 ] && true 2>/dev/null > /f$i; do i=$((i+1)); done; echo $i; "
        "true > /one-more",
        timeout=120,
    )
    made = int(r.stdout.split()[0])
    assert 16_000 < made < 16_384, r.stdout
    assert "No space left on device" in r.stderr, r.stderr
    assert r.exit_code == 1, "ENOSPC, not the OOM killer"
    usage = sb.info().usage
    assert usage.oom_kills == 0 and usage.disk_inodes is not None and usage.disk_inodes > 16_000
    assert usage.memory_bytes is not None and usage.memory_bytes < 64 << 20, usage
    hit = wait_for(client, sb.id, "limit.disk")[0]
    assert hit.data["inodes"] == 16_384 and hit.data["inodes_used"] > 16_000, hit.data
    assert sb.run("rm /f1 && : > /again && echo ok").stdout == "ok\n"
    # /dev is bounded the same way.
    r = sb.run(
        "i=0; while [ $i -lt 40000 ] && true 2>/dev/null > /dev/f$i; do i=$((i+1)); done; "
        "echo $i",
        timeout=120,
    )
    assert int(r.stdout) < 16_384, r.stdout


#: How many processes of the sandbox are zombies (state Z in /proc/PID/stat).
COUNT_ZOMBIES = "cat /proc/[0-9]*/stat 2>/dev/null | awk '$3 == \"Z\"' | wc -l"


def test_a_zombie_storm_is_reaped(make_sandbox: Make, backend: str) -> None:
    """200 children exit under a parent that never waits for them; once it is gone they
    are the sandbox's init's to reap, and they are."""
    if backend == "fncall":
        pytest.skip("fncall: a call's processes end with it")
    sb = make_sandbox(pids=512)
    # The parent lingers without waiting while the count is polled until the storm is in
    # (a TCG guest takes seconds to fork 200), then goes. Nothing but a fresh exec may run
    # in the parent after the storm: a shell reaps finished jobs whenever it waits for one.
    r = sb.run(
        "sh -c 'for i in $(seq 200); do true & done; exec sleep 60' & "
        f'for i in $(seq 300); do n=$({COUNT_ZOMBIES}); [ "$n" -ge 150 ] && break; '
        'sleep 0.1; done; echo "$n"; kill $!; wait',
        timeout=60,
    )
    assert int(r.stdout) >= 150, (r.stdout, r.stderr)
    reaped = wait_until(lambda: sb.run(COUNT_ZOMBIES).stdout.strip() == "0", 10, interval=0.2)
    assert reaped, sb.run(COUNT_ZOMBIES).stdout
    if backend not in VM_BACKENDS:
        assert (sb.info().usage.pids or 0) < 10, sb.info().usage


#: Starts threads until the kernel refuses one (or N are up), prints how many, and holds
#: them a moment: threads count against the pids limit exactly as processes do.
THREAD_STORM_C = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static void *hold(void *arg) { (void)arg; sleep(3); return NULL; }
int main(int argc, char **argv) {
    int want = argc > 1 ? atoi(argv[1]) : 1000, made = 0;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    for (pthread_t t; made < want && pthread_create(&t, &attr, hold, NULL) == 0; made++) {
    }
    printf("%d\n", made);
    return 0;
}
"""


@pytest.fixture(scope="session")
def thread_storm(tmp_base: Path) -> bytes:
    """A static binary (the sandbox images have no compiler) of `THREAD_STORM_C`."""
    src, binary = tmp_base / "thread-storm.c", tmp_base / "thread-storm"
    src.write_text(THREAD_STORM_C)
    subprocess.run(
        ["gcc", "-O2", "-static", "-pthread", "-o", str(binary), str(src)],
        check=True,
        capture_output=True,
    )
    return binary.read_bytes()


def test_a_thread_storm_hits_the_pids_limit_and_is_flagged(
    client: dsec.Client, make_sandbox: Make, backend: str, thread_storm: bytes
) -> None:
    """Threads, not processes: four storms of up to 1,000 threads in a sandbox limited to
    48 tasks are each stopped at the limit, `limit.pids` is reported, the Watcher flags
    the storm, and the sandbox and a quiet neighbour keep answering."""
    if backend not in STATEFUL:
        pytest.skip(f"{backend} keeps no state between commands")
    sb, quiet = make_sandbox(pids=48), make_sandbox()
    sb.write_file("/work/thread-storm", thread_storm, mode=0o755)
    for _ in range(4):
        r = sb.run("/work/thread-storm 1000", timeout=60)
        assert r.exit_code == 0, (r.stdout, r.stderr)
        assert 1 <= int(r.stdout) < 48, r.stdout
        time.sleep(1.3)
    hits = wait_for(client, sb.id, "limit.pids")
    assert hits[0].data["limit"] == 48 and hits[0].data["refused_forks"] > 0
    action = wait_for(client, sb.id, "watcher.action")[0]
    assert action.data["rule"] == "pids-storm", action.data
    assert sb.run("echo alive").stdout == "alive\n"
    rtts = []
    for _ in range(10):
        t0 = time.monotonic()
        assert quiet.run("true").exit_code == 0
        rtts.append(time.monotonic() - t0)
    assert statistics.median(rtts) < 2.0, rtts


@pytest.mark.parametrize(
    ("path", "why"),
    [
        # Containers and VM guests name the file's type, docker the sandbox's /dev.
        ("/dev/zero", "character device|sandbox's /dev"),
        ("/dev/urandom", "character device|sandbox's /dev"),
        ("/proc/self/mem", "procfs"),
        ("/proc/kmsg", "procfs"),
        ("/big", "over the server's limit"),
    ],
)
def test_endless_and_huge_files_are_refused_by_the_files_api(
    client: dsec.Client, make_sandbox: Make, backend: str, path: str, why: str
) -> None:
    if backend == "fncall":
        pytest.skip("fncall: no files API")
    sb = make_sandbox()
    sb.run("truncate -s 10G /big")  # sparse: no blocks, 10 GiB to read
    t = time.monotonic()
    with pytest.raises(dsec.InvalidArgument, match=why):
        sb.read_file(path)
    assert time.monotonic() - t < 10, "refused before reading"
    assert sb.run("echo ok").stdout == "ok\n"
    assert_refused(client, sb.id, "read", path, why)


def assert_refused(client: dsec.Client, sandbox: str, op: str, path: str, why: str) -> None:
    """The operator sees the refusal: a `file.refused` event with its reason."""
    refused = [e.data for e in wait_for(client, sandbox, "file.refused") if e.data["path"] == path]
    assert refused, list(client.events(sandbox=sandbox))
    assert refused[-1]["op"] == op and re.search(why, refused[-1]["error"]), refused
    assert refused[-1]["status"] in (400, 413), refused


def test_500_concurrent_commands_in_one_sandbox(
    server: Server, make_sandbox: Make, backend: str, record_property: Callable[..., None]
) -> None:
    """All 500 are answered with their own output, and a quiet sandbox's round trip is
    measured meanwhile (reported, not asserted: machines here are noisy). On docker 150:
    the daemon takes ~0.1 s a command, however many wait."""
    if backend in VM_BACKENDS or backend == "fncall":
        pytest.skip(f"{backend}: 500 at once take minutes under TCG / a call is one command")
    n = 150 if backend == "docker" else 500
    busy, quiet = make_sandbox(), make_sandbox()
    quiet_ms: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t = time.perf_counter()
            assert quiet.run("true").exit_code == 0
            quiet_ms.append((time.perf_counter() - t) * 1000)

    async def storm() -> list[dsec.CommandResult]:
        async with dsec.AsyncClient(server.url, max_connections=n) as ac:
            sb = await ac.get(busy.id)
            return await asyncio.gather(*(sb.run(f"echo {i}", timeout=120) for i in range(n)))

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        results = asyncio.run(storm())
    finally:
        done.set()
        prober.join()
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(n)]
    assert all(r.exit_code == 0 for r in results)
    p50 = statistics.median(quiet_ms)
    record_property("quiet_exec_p50_ms", round(p50, 2))
    print(f"quiet sandbox exec p50 during {n} concurrent commands: {p50:.2f} ms, n={len(quiet_ms)}")
    assert busy.run("echo alive").stdout == "alive\n"


def test_overwriting_bin_sh_is_flagged_and_stays_in_the_sandbox(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    if backend not in STATEFUL:
        pytest.skip(f"{backend} keeps no state between commands")
    sb, other = make_sandbox(), make_sandbox()
    original = other.read_file("/bin/busybox")
    sb.write_file("/bin/busybox.new", b"#!/bin/false\n")
    sb.write_file("/usr/bin/evil", b"#!/bin/false\n", mode=0o755)
    action = wait_for(client, sb.id, "watcher.action")[0]
    assert action.data["rule"] == "binary-overwrite"
    writes = kinds_of(client, sb.id, ["file.write"])
    assert set(action.data["evidence"]["events"]) <= {e.id for e in writes}
    assert sb.info().labels.get("watcher.binary-overwrite") == "flagged"
    assert other.read_file("/bin/busybox") == original
    fresh = make_sandbox()
    assert fresh.run("ls /usr/bin/evil").exit_code != 0


def test_removing_an_image_binary_from_inside_is_seen(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    if backend not in STATEFUL:
        pytest.skip(f"{backend} keeps no state between commands")
    sb, other = make_sandbox(), make_sandbox()
    assert sb.run("rm /bin/true && echo gone > /tmp/new-file").exit_code == 0
    seen = wait_until(
        lambda: [
            e
            for e in kinds_of(client, sb.id, ["file.write"])
            if e.data["by"] == "layer" and e.data["path"] == "/bin/true"
        ],
        10,
        interval=0.2,
    )
    assert seen, list(client.events(sandbox=sb.id))
    assert wait_for(client, sb.id, "watcher.action")[0].data["rule"] == "binary-overwrite"
    assert other.run("/bin/true").exit_code == 0, "other sandboxes keep the image's binary"
    assert make_sandbox().run("/bin/true").exit_code == 0


def test_a_link_planted_over_usr_is_reported_not_followed(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    """The sampler reads the writable layer from the host: a `usr -> /` link planted there
    is reported as replacing the image's /usr/bin, never followed into the host's own
    directories (whose files would show up as the sandbox's)."""
    if backend not in STATEFUL:
        pytest.skip(f"{backend} keeps no state between commands")
    sb = make_sandbox()
    assert sb.run("rm -rf /usr && ln -s / /usr && test -x /usr/bin/sh").exit_code == 0

    def layer_writes() -> set[str]:
        events = kinds_of(client, sb.id, ["file.write"])
        return {e.data["path"] for e in events if e.data["by"] == "layer"}

    assert wait_until(lambda: "/usr/bin/" in layer_writes(), 10, interval=0.2), list(
        client.events(sandbox=sb.id)
    )
    time.sleep(2.5)  # two more samples: anything read through the link would show by now
    usr = {p for p in layer_writes() if p.startswith("/usr/")}
    if backend == "docker" or backend in VM_BACKENDS:
        # Docker's `rm -rf`, and any under TCG, is slow enough for a sample to see files
        # whited out one by one before the link replaced their directory: the image's own
        # files, each removed. (The walk itself is the container backend's, held exactly
        # below.)
        image_files = {
            f"{d}/{name}"
            for d in ("/usr/bin", "/usr/sbin")
            for name in make_sandbox().run(f"ls {d}").stdout.split()
        }
        usr -= image_files
    assert usr == {"/usr/bin/", "/usr/sbin/"}
    assert wait_for(client, sb.id, "watcher.action")[0].data["rule"] == "binary-overwrite"
    assert sb.run("echo alive").stdout == "alive\n"


def test_oversized_uploads_are_refused_and_seen(client: dsec.Client, sb: dsec.Sandbox) -> None:
    big = os.urandom(MAX_UPLOAD_MB * 1024 * 1024 + 4096)
    with pytest.raises(dsec.PayloadTooLarge) as e:
        sb.write_file("/tmp/big", big)
    assert e.value.status == 413
    assert isinstance(e.value, dsec.InvalidArgument)
    assert_refused(client, sb.id, "write", "/tmp/big", "over the server's limit")
    # just under the limit works
    ok = os.urandom((MAX_UPLOAD_MB - 1) * 1024 * 1024)
    sb.write_file("/tmp/ok", ok)
    assert sb.run("wc -c < /tmp/ok").stdout.strip() == str(len(ok))


def frame(kind: int, exec_id: int, payload: bytes) -> bytes:
    """A frame of the channel between the edge and a sandbox's init or agent
    (`dsec_runtime::proto`: length, kind, exec id, payload)."""
    return struct.pack("<IBI", len(payload), kind, exec_id) + payload


#: What a command would forge: the channel's Stderr (5) and Exit (6) frames, the latter
#: claiming success, for the first exec ids, and Docker's stream header for stderr.
FORGED = b"".join(
    frame(kind, exec_id, payload)
    for exec_id in range(4)
    for kind, payload in (
        (5, b"forged"),
        (6, b'{"exit_code":0,"signal":null,"timed_out":false,"truncated":false,"duration_us":1}'),
    )
) + b"\x02\x00\x00\x00\x00\x00\x00\x06forged"


def test_forged_frames_are_output_and_the_channel_is_out_of_reach(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    """A command prints frames of the channel its output travels on (the Exit frame claiming
    success) to its stdout and stderr, and writes them to every descriptor of the sandbox's
    PID 1 (its init or agent, which holds the channel): they come back byte for byte as
    output, the command's own exit code stands (the `command.end` an operator reads too),
    and PID 1's descriptors cannot be opened."""
    sb = make_sandbox()
    forged = "".join(f"\\{b:03o}" for b in FORGED)  # a printf format of octal escapes
    r = sb.run(f"printf '{forged}'; printf '{forged}' >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, FORGED.decode(), FORGED.decode()), r
    ends = [e.data for e in wait_for(client, sb.id, "command.end")]
    assert ends[-1]["exit_code"] == 7 and not ends[-1]["truncated"], ends
    r = sb.run(
        f"for fd in $(seq 0 31); do printf '{forged}' 2>/dev/null >/proc/1/fd/$fd && "
        'echo "$fd $(readlink /proc/1/fd/$fd)"; done; true'
    )
    opened = [line.split(maxsplit=1)[-1] for line in r.stdout.splitlines()]
    if backend == "docker":
        # PID 1 is Docker's `sleep infinity`: its descriptors are its stdio, which no one
        # reads (the containers log nothing); the daemon's API is not in the sandbox.
        assert all(t == "/dev/null" or t.startswith("pipe:") for t in opened), r.stdout
    else:
        assert opened == [], f"PID 1's descriptors opened from inside: {r.stdout}"
    assert sb.run("echo alive").stdout == "alive\n"


def test_filesystem_flag_ioctls_are_refused(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    """The incident: a filesystem ioctl from inside corrupted the host filesystem's
    metadata. The flag-setting ioctl (`FS_IOC_SETFLAGS`, what `chattr` does: immutable,
    append-only) needs a capability no command has, on an image's file and on a new one;
    both stay writable, and the refused command is on the record (`command.end`)."""
    if backend not in STATEFUL:
        pytest.skip(f"{backend} keeps no state between commands")
    sb = make_sandbox()
    for cmd in ("chattr +i /etc/passwd", "echo x > /tmp/own && chattr +a /tmp/own"):
        r = sb.run(cmd)
        assert r.exit_code != 0, (cmd, r)
    assert sb.run("echo y >> /etc/passwd && echo y > /tmp/own && echo ok").stdout == "ok\n"
    assert wait_until(lambda: len(kinds_of(client, sb.id, ["command.end"])) >= 3, 10)
    ends = kinds_of(client, sb.id, ["command.end"])
    assert [e.data["exit_code"] != 0 for e in ends] == [True, True, False], ends


#: Kernel interfaces masked in a container (an empty file or directory in their place).
MASKED = [
    "/proc/kcore",
    "/proc/keys",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/proc/kpagecgroup",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/scsi",
    "/proc/acpi",
    "/sys/firmware",
]


def test_masked_proc_and_sys_paths_read_as_nothing(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    """The incident: a recursive grep over /proc reached /proc/kpagecgroup and crashed the
    host's kernel. Each masked path reads as nothing inside, a recursive grep over them
    finds nothing, one over all of /proc is ended by its timeout (`command.end`:
    `timed_out`), and the files API refuses them (`file.refused`)."""
    if backend in VM_BACKENDS:
        pytest.skip(f"{backend}: a guest's /proc is its own kernel's, a crash there the guest's")
    sb = make_sandbox()
    r = sb.run(
        f"for p in {' '.join(MASKED)}; do echo $p $(if [ -d $p ]; then ls -A $p 2>/dev/null; "
        "else head -c 256 $p 2>/dev/null; fi | wc -c); done"
    )
    sizes = dict(line.split() for line in r.stdout.splitlines())
    assert sizes == dict.fromkeys(MASKED, "0"), f"readable inside the sandbox: {sizes}"
    r = sb.run(f"grep -rs -m 1 . {' '.join(MASKED)} | wc -c", timeout=60)
    assert r.stdout.strip() == "0", r
    # Over all of /proc the grep never ends by itself (each process's pagemap reads as
    # its whole address space): the command's timeout ends it, and says so.
    r = sb.run("grep -rs dsec-needle-7c1e /proc", timeout=3)
    assert r.timed_out and r.stdout == "", r
    end = wait_for(client, sb.id, "command.end")[-1].data
    assert end["timed_out"] is True, end
    assert sb.run("echo alive").stdout == "alive\n"
    if backend == "fncall":
        return  # no files API
    # The mask (the null device over a file) or procfs itself: a kernel interface either way.
    why = "character device|procfs|sandbox's /dev"
    files = sb.run(f"for p in {' '.join(MASKED)}; do [ -f $p -o -c $p ] && echo $p; done")
    assert files.stdout.split(), "no masked file exists on this kernel: the check is empty"
    for path in files.stdout.split():
        with pytest.raises(dsec.InvalidArgument, match=why):
            sb.read_file(path)
        assert_refused(client, sb.id, "read", path, why)


def test_a_link_swapped_between_check_and_use_never_reaches_the_host(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    """The files API checks a path, then opens it; a command swaps the path between a file
    and links out of the root (relative, climbing past `/`, and absolute) as fast as it
    can. Each read gets the sandbox's own file or a refusal, never the host's; no write
    lands on the host; and every read is on the record (`file.read` or `file.refused`)."""
    if backend not in STATEFUL:
        pytest.skip(f"{backend} keeps no state between commands")
    name = f"dsec-race-{uuid.uuid4().hex}"
    host_file, host_dir_file = Path("/tmp") / name, Path("/tmp") / f"{name}-w"
    host_file.write_text("host-secret\n")
    up = "../" * 12 + "tmp"
    sb = make_sandbox()
    swapper = sb.spawn(
        f"echo decoy > /tmp/{name}; mkdir -p /work; cd /work; while :; do "
        "echo inside > t && mv -f t x; "
        f"ln -sfn {up}/{name} l && mv -f l x; "
        f"ln -sfn /tmp/{name} a && mv -f a x; "
        f"rm -rf d; mkdir d; rm -rf d; ln -sfn {up} d; "
        "done"
    )
    reads: dict[str, int] = {"ok": 0, "refused": 0, "missing": 0}
    seen: set[bytes] = set()
    try:
        assert wait_until(lambda: sb.run("test -e /work/x").exit_code == 0, 30)
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            try:
                seen.add(sb.read_file("/work/x"))
                reads["ok"] += 1
            except (dsec.InvalidArgument, dsec.Conflict):  # docker: Conflict, it saw the swap
                reads["refused"] += 1
            except dsec.NotFound:
                reads["missing"] += 1
            for path in ("/work/x", f"/work/d/{name}-w"):
                try:
                    sb.write_file(path, b"from-the-api\n")
                except (dsec.InvalidArgument, dsec.NotFound):
                    pass
                except dsec.Conflict as e:  # docker: the daemon saw the swap
                    assert "changed in the sandbox" in str(e), e
    finally:
        swapper.kill()
        assert host_file.read_text() == "host-secret\n", "a write reached the host"
        host_file.unlink()
        assert not host_dir_file.exists(), "a write through the swapped directory reached the host"
    own = {b"inside\n", b"decoy\n", b"from-the-api\n"}
    if backend == "docker":
        # dockerd sizes an archive's entry by one lstat and copies what the path names a
        # moment later (inside the container's root), cut to that size: a file swapped in
        # between reads as a prefix of itself. Torn, but the sandbox's own bytes.
        own |= {whole[:n] for whole in own for n in range(1, len(whole))}
    assert seen <= own, seen
    assert reads["ok"] + reads["refused"] >= 5, reads

    def on_record() -> tuple[int, int]:
        events = kinds_of(client, sb.id, ["file.read", "file.refused"])
        of_x = [
            e for e in events if e.data["path"] == "/work/x" and e.data.get("op", "read") == "read"
        ]
        return (
            sum(e.kind == "file.read" for e in of_x),
            sum(e.kind == "file.refused" for e in of_x),
        )

    want = (reads["ok"], reads["refused"])
    assert wait_until(lambda: on_record() == want, 10, interval=0.2), (on_record(), want)
    assert sb.run("echo alive").stdout == "alive\n"


# ---------------------------------------------------------------------- network


@pytest.fixture(scope="module")
def net_server(busybox_rootfs: Path) -> Iterator[tuple[Server, ipaddress.IPv4Network]]:
    from test_network import own_server

    yield from own_server(Server, busybox_rootfs)


def test_port_scan_is_refused_and_flagged(
    net_server: tuple[Server, ipaddress.IPv4Network], backend: str
) -> None:
    if backend not in ("container", *VM_BACKENDS):
        pytest.skip(f"{backend}: its network is Docker's, not dsec's policy")
    server, pool = net_server
    with server.client() as c:
        sb = c.create(backend=backend, image="busybox", network={"allow": ["192.0.2.1:9"]})
        gateway = str(next(pool.hosts()))
        services: list[socketserver.ThreadingTCPServer] = []
        try:
            # A service of the host's on the gateway's address and on 127.0.0.1 (the host
            # reaches both), on a port among those scanned.
            services += [hello_service(gateway), hello_service("127.0.0.1")]
            scanned = [*range(2000, 2019), *(svc.server_address[1] for svc in services)]
            ports = " ".join(map(str, scanned))
            # 20 ports of the gateway (the host), of the sandbox's own 127.0.0.1 and of
            # another address: all refused, and the host's services unreachable.
            r = sb.run(
                f"for p in {ports}; do nc -w 1 {gateway} $p </dev/null & "
                "nc -w 1 127.0.0.1 $p </dev/null & "
                "nc -w 1 198.51.100.7 $p </dev/null & done; wait",
                timeout=60,
            )
            assert "hello" not in r.stdout
            refused = wait_for(c, sb.id, "network.refused")
            assert len({e.data["port"] for e in refused}) >= 10, refused
            action = wait_for(c, sb.id, "watcher.action")[0]
            assert action.data["rule"] == "port-scan"
            assert len(action.data["evidence"]["distinct"]) >= 10
            assert c.get(sb.id).info().labels.get("watcher.port-scan") == "flagged"
        finally:
            sb.stop()
            for svc in services:
                svc.shutdown()
                svc.server_close()


def test_package_fetches_outside_the_allow_list_are_refused_and_seen(
    request: pytest.FixtureRequest, backend: str
) -> None:
    """A sandbox allowed its package mirror (test_network's `web`, also the zone's DNS
    server) by name fetches from it; asking for another site's name gets NXDOMAIN, and
    fetching another site through the mirror's address (a package proxy's way to arbitrary
    code) is refused by the name-checking proxy. The operator sees both, with the name:
    `network.refused`."""
    from test_network import WEB, ZONE, egress_works, resolve

    if backend != "container":
        pytest.skip(
            f"{backend}: the resolver and the proxy are the host's, the same for every "
            "backend (VM guests' resolving: tests/test_network.py)"
        )
    mirror: NsHost = request.getfixturevalue("web")
    server, pool = request.getfixturevalue("zone_server")
    evil = f"evil.{ZONE}"
    with server.client() as c:
        sb = c.create(backend=backend, image="busybox", network={"allow": [WEB]})
        try:
            assert egress_works(sb, mirror), "the allowed mirror answers"
            assert resolve(sb, evil) is None
            head = f"GET /hello.txt HTTP/1.0\\r\\nHost: {evil}\\r\\n\\r\\n"
            r = sb.run(f"printf '{head}' | nc -w 3 {mirror.ip} 80", timeout=15)
            assert "hello from" not in r.stdout, r.stdout

            def refusals() -> set[tuple[str, str, int]]:
                events = kinds_of(c, sb.id, ["network.refused"])
                return {
                    (e.data["protocol"], e.data["dst"], e.data["port"])
                    for e in events
                    if e.data.get("name") == evil
                }

            gateway = str(pool.network_address + 1)
            want = {("dns", gateway, 53), ("tcp", mirror.ip, 80)}
            assert wait_until(lambda: want <= refusals(), 15, interval=0.2), (
                refusals(),
                list(c.events(sandbox=sb.id)),
            )
            assert {e.get("name") for e in sb.network_refused()} >= {evil}
            assert not any(e.get("name") == WEB for e in sb.network_refused())
        finally:
            sb.stop()


def refused_to(client: dsec.Client, sandbox: str, dst: str) -> bool:
    """Whether a `network.refused` event of `sandbox` names `dst`."""
    return any(e.data["dst"] == dst for e in kinds_of(client, sandbox, ["network.refused"]))


#: Rules that act, each on a misbehaviour of the cases above.
ACTING_RULES = """{"rules": [
  {"name": "scan-cut", "kind": "network.refused", "count": 3, "distinct": ["dst", "port"],
   "action": "cut_network"},
  {"name": "flood-pause", "kind": "output.truncated", "count": 1, "action": "pause"},
  {"name": "oom-stop", "kind": "limit.oom", "count": 1, "action": "stop"}]}"""


def test_the_watchers_actions_cut_the_network_pause_and_stop(
    busybox_rootfs: Path, backend: str, tmp_path: Path
) -> None:
    """Rules from `--watcher-config` act: a scan cuts the sandbox's network (what its
    policy allowed is refused from then on), an output flood pauses it, an OOM kill stops
    it. Each action is a `watcher.action` event with its evidence, and the lifecycle
    events follow (`sandbox.paused`, `sandbox.stopped` with reason `watcher`). The
    actions are the edge's, the same for every backend: run on containers."""
    from test_network import own_server

    if backend != "container":
        pytest.skip(f"{backend}: the Watcher's actions are the edge's, run on containers")
    config = tmp_path / "watcher.json"
    config.write_text(ACTING_RULES)
    for server, _ in own_server(Server, busybox_rootfs, ("--watcher-config", str(config))):
        with server.client() as c:
            net = c.create(image="busybox", network={"allow": ["192.0.2.1:9"]})
            flood = c.create(image="busybox")
            hog = c.create(image="busybox", memory_mb=64)
            try:
                probe = "nc -w 1 192.0.2.1 9 </dev/null; true"
                net.run(probe)  # allowed: it leaves (and goes nowhere), no refusal
                assert not refused_to(c, net.id, "192.0.2.1")
                net.run("for p in 1 2 3 4 5; do nc -w 1 198.51.100.7 $p </dev/null & done; wait")
                assert flood.run("yes | head -c 1000000", max_output_bytes=1000).truncated
                # The Watcher may stop it before the command's answer: "is stopped".
                with contextlib.suppress(dsec.Conflict):
                    hog.run("head -c 400m /dev/zero | tail > /dev/null", timeout=60)
                acted = {
                    sb.id: wait_for(c, sb.id, "watcher.action")[0].data for sb in (net, flood, hog)
                }
                for sb, rule, action, kind in (
                    (net, "scan-cut", "cut_network", "network.refused"),
                    (flood, "flood-pause", "pause", "output.truncated"),
                    (hog, "oom-stop", "stop", "limit.oom"),
                ):
                    data = acted[sb.id]
                    assert (data["rule"], data["action"], data["ok"]) == (rule, action, True), data
                    evidence = {e.id for e in kinds_of(c, sb.id, [kind])}
                    assert data["evidence"]["kind"] == kind, data
                    assert set(data["evidence"]["events"]) <= evidence, (data, evidence)
                assert wait_for(c, flood.id, "sandbox.paused")
                stopped = wait_for(c, hog.id, "sandbox.stopped")[0]
                assert stopped.data["reason"] == "watcher", stopped.data
                # The cut network: the destination its policy allowed is refused now.
                net.run(probe)
                refused = partial(refused_to, c, net.id, "192.0.2.1")
                assert wait_until(refused, 10, interval=0.2), net.network_refused()
            finally:
                for sb in (net, flood, hog):
                    with contextlib.suppress(dsec.NotFound):
                        sb.stop()


class _Hello(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(b"hello\n")


def hello_service(address: str) -> socketserver.ThreadingTCPServer:
    """A TCP service on `address` (a free port) that greets every connection."""
    svc = socketserver.ThreadingTCPServer((address, 0), _Hello)
    svc.daemon_threads = True
    threading.Thread(target=svc.serve_forever, daemon=True).start()
    with socket.create_connection((address, svc.server_address[1]), timeout=3) as conn:
        assert conn.recv(6) == b"hello\n", "the host reaches its own service"
    return svc
