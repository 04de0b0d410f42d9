"""Spawned processes in the trajectory log: a spawn, its stdin writes (bounded, with their
digests), close-stdin and signals are steps, numbered with the runs; the process's end is
its spawn step's result. `dsec replay` re-spawns and re-feeds them, and reports a process
that ends differently; a re-issued step of a keyed trajectory is fast-forwarded.

Every test runs on the embedded SQLite log and on a PostgreSQL database (as
tests/test_trajectory.py's)."""

from __future__ import annotations

import hashlib
from typing import Any

import dsec
import pytest
from dsec_testlib import Server, wait_until
from test_processes import read_until
from test_trajectory import (  # noqa: F401 (fixtures)
    busybox_image,
    client,
    pg_cluster,
    run_cli,
    server,
    store,
    tid,
)

KEPT = 64 << 10  # the default --trajectory-output-bytes


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def kinds(log: dict[str, Any]) -> list[str]:
    return [s["request"].get("kind", "run") for s in log["steps"]]


def ended(client: dsec.Client, sandbox: str, step: int) -> dict[str, Any]:
    """Step `step` of `sandbox`'s log once its process's end is recorded in it."""
    def done() -> bool:
        return not client.log(sandbox)["steps"][step]["result"].get("running", False)

    assert wait_until(done, 10), f"the end of step {step} was not recorded"
    return dict(client.log(sandbox)["steps"][step])


def test_spawn_stdin_and_exit_are_logged_in_order(
    server: Server, client: dsec.Client, busybox_image: str
) -> None:
    with client.create(image=busybox_image) as sb:
        sb.run("echo before")
        p = sb.spawn("cat > /tmp/f; echo wrote; exit 3", tag="writer")
        p.send_stdin("hello\n")
        p.send_stdin(b"world\n")
        p.close_stdin()
        assert p.wait(timeout=30) == 3
        assert sb.run("cat /tmp/f").stdout == "hello\nworld\n"
        log = sb.log()
    assert kinds(log) == ["run", "spawn", "stdin", "stdin", "close_stdin", "run"]
    assert [s["step"] for s in log["steps"]] == [0, 1, 2, 3, 4, 5]
    spawn, first, second, close = log["steps"][1:5]
    assert spawn["request"]["argv"] == ["/bin/sh", "-c", "cat > /tmp/f; echo wrote; exit 3"]
    assert spawn["request"]["process"] == {"tag": "writer", "stdin_open": True}
    assert spawn["result"]["pid"] == p.pid and "running" not in spawn["result"]
    assert (spawn["result"]["exit_code"], spawn["result"]["stdout"]) == (3, "wrote\n")
    assert spawn["result"]["stdout_sha256"] == sha256(b"wrote\n")
    # The end came after the close, before the run that read the file.
    assert close["started_at"] <= spawn["finished_at"] <= log["steps"][5]["started_at"]
    for step, data in ((first, b"hello\n"), (second, b"world\n")):
        assert step["request"]["stdin_sha256"] == sha256(data)
        assert step["request"]["process"] == {
            "spawn_step": 1,
            "input": data.decode(),
            "input_bytes": len(data),
        }
    assert close["request"]["process"] == {"spawn_step": 1}
    r = run_cli(server, "log", sb.id)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[3].split()[:2] == ["1", "3"] and "spawn [writer]" in lines[3], lines[3]
    assert 'stdin to process of step 1: 6 bytes "hello\\n"' in lines[4], lines[4]
    assert "close stdin of process of step 1" in lines[6], lines[6]


def test_signals_kills_and_a_running_process_are_logged(
    client: dsec.Client, busybox_image: str
) -> None:
    with client.create(image=busybox_image) as sb:
        p = sb.spawn("trap 'echo got' USR1; echo ready; while :; do sleep 0.1; done")
        q = sb.spawn("sleep 600", stdin=False)
        events = p.events()
        read_until(events, "ready")
        p.signal("USR1")
        read_until(events, "got")
        p.kill()
        assert p.wait(timeout=30) == 137
        log = sb.log()
        steps = log["steps"]
        assert kinds(log) == ["spawn", "spawn", "signal", "kill"]
        assert steps[2]["request"]["process"] == {"spawn_step": 0, "signal": 10}
        assert steps[3]["request"]["process"] == {"spawn_step": 0}
        assert ended(client, sb.id, 0)["result"]["exit_code"] == 137
        # A process that still runs is logged as running.
        assert steps[1]["result"]["running"] is True
        assert steps[1]["request"]["process"] == {}
        q.kill()


def test_stdin_over_the_budget_is_kept_bounded_with_its_digest(
    client: dsec.Client, busybox_image: str
) -> None:
    data = bytes(range(256)) * 1024  # 256 KiB, not valid UTF-8, four times what is kept
    with client.create(image=busybox_image) as sb:
        p = sb.spawn("wc -c")
        p.send_stdin(data)
        p.close_stdin()
        assert p.wait(timeout=30) == 0
        step = sb.log()["steps"][1]
    kept = step["request"]["process"]
    assert step["request"]["stdin_sha256"] == sha256(data)
    assert (kept["input_bytes"], kept["input_elided"]) == (len(data), len(data) - KEPT)
    assert "bytes not kept by the dsec trajectory log" in kept["input"]
    # Its head and tail: invalid UTF-8 is kept as replacement characters, like output's.
    assert len(kept["input"].encode()) < 4 * KEPT
    assert ended(client, sb.id, 0)["result"]["stdout"].strip() == str(len(data))


def test_replay_reproduces_a_process_fed_by_stdin(
    server: Server, client: dsec.Client, busybox_image: str
) -> None:
    with client.create(image=busybox_image, trajectory_id=tid()) as sb:
        p = sb.spawn("cat > /tmp/f")
        p.send_stdin("one\n")
        sb.run("echo between")
        p.send_stdin("two\n")
        p.close_stdin()
        assert p.wait(timeout=30) == 0
        assert sb.run("cat /tmp/f").stdout == "one\ntwo\n"
        assert [s["step"] for s in sb.log()["steps"]] == list(range(6))
    r = run_cli(server, "replay", sb.id)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 6 steps match" in r.stdout


def test_replay_reports_a_process_that_ends_differently(
    server: Server, client: dsec.Client, busybox_image: str
) -> None:
    with client.create(image=busybox_image) as sb:
        # A file the log does not know of (file writes are not steps): the replay lacks it.
        sb.write_file("/tmp/in", "x")
        p = sb.spawn("test -e /tmp/in")
        assert p.wait(timeout=30) == 0
        sb.run("echo after")
    r = run_cli(server, "replay", sb.id)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "step 0 differs: the process of step 0 (test -e /tmp/in)" in r.stdout, r.stdout
    assert "exit code Some(1) (recorded Some(0))" in r.stdout, r.stdout
    assert client.list(labels={"dsec.replay-of": sb.id}) == []


def test_replay_stops_at_a_stdin_write_it_does_not_hold(
    server: Server, client: dsec.Client, busybox_image: str
) -> None:
    with client.create(image=busybox_image) as sb:
        p = sb.spawn("cat > /dev/null")
        p.send_stdin(b"y" * (KEPT + 1))
        p.close_stdin()
        assert p.wait(timeout=30) == 0
    r = run_cli(server, "replay", sb.id)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"step 1: cannot be replayed: the log kept its stdin write of {KEPT + 1} bytes" in (
        r.stdout
    )


def test_reissued_process_steps_fast_forward(client: dsec.Client, busybox_image: str) -> None:
    sb = client.create(image=busybox_image, trajectory_id=tid())
    try:
        p = sb.spawn("cat", tag="echoer")  # step 0
        p.send_stdin("a\n")  # step 1
        # A resumed client re-issues its steps from 0: nothing runs or is sent twice.
        again = client.get(sb.id)
        q = again.spawn("cat", tag="echoer")
        assert (q.pid, q.tag) == (p.pid, "echoer")
        q.send_stdin("a\n")
        with pytest.raises(dsec.TrajectoryDiverged, match="diverged at step 0"):
            again.spawn("cat", tag="other", step=0)
        with pytest.raises(dsec.TrajectoryDiverged, match="diverged at step 1") as e:
            q.send_stdin("b\n", step=1)
        assert sha256(b"a\n") in str(e.value) and sha256(b"b\n") in str(e.value)
        q.close_stdin(step=2)
        assert q.wait(timeout=30) == 0
        assert ended(client, sb.id, 0)["result"]["stdout"] == "a\n"
        # A spawn re-issued after its process ended answers that end.
        third = client.get(sb.id)
        info = third.spawn("cat", tag="echoer").info()
        assert (info.pid, info.running, info.exit_code) == (p.pid, False, 0)
        third.run("true", step=3)
        assert kinds(sb.log()) == ["spawn", "stdin", "close_stdin", "run"]
    finally:
        sb.stop()
