"""The event stream (issue 18): `GET /v1/events`, `client.events()` (sync and async),
`dsec events`; lifecycle, command, file and limit events; filters; follow; kept in the
state directory across a restart; live usage in `sb.info().usage` and `dsec top`."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import dsec
import httpx
import pytest
from dsec_local import DSEC_BIN, wait_until
from dsec_testlib import STATEFUL, Server

Make = Callable[..., dsec.Sandbox]


def events_of(
    client: dsec.Client, sandbox: str, kinds: list[str] | None = None, **kw: Any
) -> list[dsec.Event]:
    return list(client.events(sandbox=sandbox, kinds=kinds, **kw))


def wait_for(
    client: dsec.Client, sandbox: str, kind: str, timeout: float = 10.0
) -> list[dsec.Event]:
    """The sandbox's events of `kind`, once there is one (the usage sampler emits some of
    them up to a second late)."""
    found = wait_until(lambda: events_of(client, sandbox, [kind]), timeout, interval=0.2)
    assert found, f"no {kind} event for {sandbox}: {events_of(client, sandbox)}"
    return found


def test_a_sandbox_s_life_is_a_sequence_of_events(
    client: dsec.Client, make_sandbox: Make, backend: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    sb = make_sandbox(labels={"run": tag})
    assert sb.run("echo hi").stdout == "hi\n"
    sb.write_file("/tmp/note.txt", b"x" * 1000)
    assert sb.read_file("/tmp/note.txt") == b"x" * 1000
    sb.stop()
    events = wait_until(
        lambda: (e := events_of(client, sb.id)) and e[-1].kind == "sandbox.stopped" and e,
        10,
    )
    assert events, events_of(client, sb.id)
    kinds = [e.kind for e in events]
    assert kinds[0] == "sandbox.created", kinds
    assert kinds[-1] == "sandbox.stopped", kinds
    for k in ("command.start", "command.end", "file.write", "file.read"):
        assert k in kinds, kinds
    assert [e.id for e in events] == sorted(e.id for e in events)
    assert all(e.sandbox == sb.id and e.labels.get("run") == tag for e in events)
    created = events[0].data
    assert created["backend"] == backend and created["limits"]["pids"] > 0
    start = next(e for e in events if e.kind == "command.start")
    assert start.data["cmd"] == "echo hi"
    end = next(e for e in events if e.kind == "command.end")
    assert end.data["exit_code"] == 0 and end.data["timed_out"] is False
    assert end.data["duration_ms"] >= 0
    write = next(e for e in events if e.kind == "file.write" and e.data["by"] == "files")
    assert write.data["path"] == "/tmp/note.txt" and write.data["size"] == 1000
    read = next(e for e in events if e.kind == "file.read")
    assert read.data == {"path": "/tmp/note.txt", "size": 1000, "complete": True}
    assert events[-1].data["reason"] == "requested"
    assert all(abs(e.time - time.time()) < 120 for e in events)

    # Filters: label, kind family, since.
    by_label = list(client.events(labels={"run": tag}))
    assert [e.id for e in by_label] == [e.id for e in events]
    assert {e.kind for e in events_of(client, sb.id, ["command"])} == {
        "command.start",
        "command.end",
    }
    assert events_of(client, sb.id, ["sandbox.stopped", "sandbox.created"]) == [
        events[0],
        events[-1],
    ]
    assert events_of(client, sb.id, since=events[-1].time) == [events[-1]]
    assert list(client.events(sandbox=sb.id, since=time.time() + 60)) == []


def test_command_outcomes_are_in_command_end(client: dsec.Client, sb: dsec.Sandbox) -> None:
    r = sb.run("sleep 5", timeout=0.5)
    assert r.timed_out
    r = sb.run("head -c 100000 /dev/zero", max_output_bytes=1000)
    assert r.truncated
    r = sb.run("exit 3")
    assert r.exit_code == 3
    ends = [e.data for e in events_of(client, sb.id, ["command.end"])]
    assert [e["timed_out"] for e in ends] == [True, False, False]
    assert [e["truncated"] for e in ends] == [False, True, False]
    assert ends[2]["exit_code"] == 3
    truncated = events_of(client, sb.id, ["output.truncated"])
    assert len(truncated) == 1


def test_a_spawned_process_starts_and_ends_as_events(
    client: dsec.Client, sb: dsec.Sandbox, backend: str
) -> None:
    if backend not in STATEFUL:
        pytest.skip(f"{backend} holds no sandbox to spawn processes in")
    done = sb.spawn("exit 4", tag="short")
    assert done.wait(timeout=30) == 4
    killed = sb.spawn(["sleep", "1000"])
    killed.kill()
    assert killed.wait(timeout=30) == 128 + 9
    starts = [e.data for e in events_of(client, sb.id, ["command.start"])]
    assert [(e.get("spawned"), e.get("tag")) for e in starts] == [(True, "short"), (True, None)]
    assert wait_until(lambda: len(events_of(client, sb.id, ["command.end"])) >= 2, 10)
    ends = {e.data["pid"]: e.data for e in events_of(client, sb.id, ["command.end"])}
    assert ends.keys() == {done.pid, killed.pid}, ends
    assert ends[done.pid]["exit_code"] == 4 and ends[done.pid]["tag"] == "short", ends
    assert ends[killed.pid]["exit_code"] == 128 + 9 and ends[killed.pid]["spawned"], ends
    assert all(e["duration_ms"] >= 0 for e in ends.values()), ends


def test_follow_sees_new_events_as_they_happen(client: dsec.Client, sb: dsec.Sandbox) -> None:
    seen: list[dsec.Event] = []
    done = threading.Event()

    def follow() -> None:
        with dsec.Client(client.url) as c:
            for ev in c.events(sandbox=sb.id, kinds=["command.end"], follow=True):
                seen.append(ev)
                if len(seen) == 2:
                    break
        done.set()

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    sb.run("true")  # may land in the history or live: either way exactly once
    time.sleep(0.5)
    sb.run("exit 7")
    assert done.wait(10), seen
    assert [e.data["exit_code"] for e in seen] == [0, 7]


def test_async_client_reads_the_same_events(client: dsec.Client, sb: dsec.Sandbox) -> None:
    sb.run("true")

    async def read() -> list[dsec.Event]:
        async with dsec.AsyncClient(client.url) as c:
            return [e async for e in c.events(sandbox=sb.id)]

    assert asyncio.run(read()) == events_of(client, sb.id)


def test_bad_queries_are_refused_with_the_reason(server: Server) -> None:
    for query, says in [
        ("since=yesterday", "since"),
        ("label=novalue", "key=value"),
        ("follow=maybe", "follow"),
        ("sandboxes=x", "unknown query parameter"),
    ]:
        r = httpx.get(f"{server.url}/v1/events?{query}", trust_env=False)
        assert r.status_code == 400, query
        assert says in r.json()["error"]["message"], r.text


def test_sse_framing(server: Server, sb: dsec.Sandbox) -> None:
    r = httpx.get(
        f"{server.url}/v1/events",
        params={"sandbox": sb.id},
        headers={"Accept": "text/event-stream"},
        trust_env=False,
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    first = r.text.split("\n\n")[0]
    assert first.startswith("id: ") and "\ndata: {" in first, first


def test_dsec_events_cli(server: Server, sb: dsec.Sandbox) -> None:
    sb.run("echo from-cli")
    out = subprocess.run(
        [str(DSEC_BIN), "events", "--url", server.url, "--sandbox", sb.id, "--kind", "command"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert any("command.start" in line and "from-cli" in line for line in lines), out
    assert any("command.end" in line and "exit_code=0" in line for line in lines), out


def test_events_are_kept_across_a_restart(make_server: Callable[..., Server]) -> None:
    s = make_server()
    with s.client() as c:
        sb = c.create(image="busybox")
        sb.run("echo before")
        sb_id = sb.id
        sb.stop()
        before = list(c.events(sandbox=sb_id))
    assert before and before[-1].kind == "sandbox.stopped"
    s.stop()
    s.restart()
    with s.client() as c:
        after = list(c.events(sandbox=sb_id))
        assert after == before
        sb = c.create(image="busybox")
        first_new = next(iter(c.events(sandbox=sb.id)))
        sb.stop()
    # Numbering continues: ids only grow.
    assert first_new.id > max(e.id for e in before)
    files = sorted(p.name for p in (s.state_dir / "events").iterdir())
    assert "current.ndjson" in files


def test_no_events_records_none_and_usage_still_reads(
    make_server: Callable[..., Server],
) -> None:
    s = make_server(extra_args=["--no-events"])
    with s.client() as c:
        sb = c.create(image="busybox")
        assert sb.run("echo hi").stdout == "hi\n"
        assert sb.info().usage.cpu_ms is not None
        sb.stop()
        assert list(c.events()) == []


def test_live_usage(client: dsec.Client, sb: dsec.Sandbox, backend: str) -> None:
    if backend not in STATEFUL:
        pytest.skip(f"{backend}: no usage of the sandbox's own")
    vm = backend in ("microvm", "vm")
    sb.run("dd if=/dev/zero of=/blob bs=1M count=8 2>/dev/null; sync")
    sb.run("(sleep 30 >/dev/null 2>&1 &)")
    disk = backend == "container" or vm

    def settled() -> bool:
        u = sb.info().usage
        return (u.pids or 0) >= 1 and (not disk or (u.disk_bytes or 0) >= 8 << 20)

    # A guest's own counts come from its agent, asked in the background as usage is read
    # (the first reports may predate the writes).
    assert wait_until(settled, 15)
    u = sb.info().usage
    assert u.memory_bytes and u.memory_bytes > 0
    assert u.cpu_ms is not None and u.cpu_ms > 0
    assert u.memory_peak_bytes is not None and u.memory_peak_bytes > 0
    if not vm:  # a VM's memory_bytes is QEMU's on the host, its peak the guest's commands'
        assert u.memory_peak_bytes >= u.memory_bytes
    if disk:
        assert u.disk_bytes is not None and u.disk_bytes >= 8 << 20
        assert u.disk_inodes


def test_dsec_top_once(server: Server, sb: dsec.Sandbox) -> None:
    out = subprocess.run(
        [
            str(DSEC_BIN),
            "top",
            "--url",
            server.url,
            "--once",
            "--interval",
            "0.2",
            "--sort",
            "memory",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    header, *rows = out.splitlines()
    assert header.split()[:4] == ["ID", "BACKEND", "STATE", "CPU%"]
    assert any(r.startswith(sb.id) for r in rows), out
