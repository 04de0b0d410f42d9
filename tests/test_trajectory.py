"""The trajectory log: every command recorded durably, fast-forward replay of re-issued
steps, divergence and gaps refused, `dsec log` and `dsec replay`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import dsec
import pytest
from dsec_testlib import DSEC_BIN, REPO, Server, wait_until

PYTHON_SDK = str(REPO / "python")

# A client that re-issues a rollout: step i appends i to a file; step SLOW also sleeps, so
# that a kill can land while it runs. Prints one JSON line per result, as it gets it.
ROLLOUT = r"""
import json, sys
import dsec
url, sandbox_id, n, slow = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sb = dsec.Client(url).get(sandbox_id)
for i in range(n):
    cmd = f"echo {i} >> /tmp/rollout; wc -l < /tmp/rollout"
    if i == slow:
        cmd += "; sleep 2"
    r = sb.run(cmd)
    print(json.dumps({"step": i, "replayed": r.replayed, "stdout": r.stdout}), flush=True)
"""


def rollout(url: str, sandbox_id: str, n: int, slow: int = -1) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=PYTHON_SDK)
    return subprocess.Popen(
        [sys.executable, "-c", ROLLOUT, url, sandbox_id, str(n), str(slow)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def tid() -> str:
    return "traj-" + uuid.uuid4().hex[:12]


def test_killed_client_reissues_and_each_step_ran_once(
    server: Server, client: dsec.Client, busybox_image: str
) -> None:
    with client.create(image=busybox_image, trajectory_id=tid()) as sb:
        first = rollout(server.url, sb.id, 10, slow=5)
        assert first.stdout is not None
        seen = []
        for line in first.stdout:
            seen.append(json.loads(line))
            if seen[-1]["step"] == 4:
                break
        # Step 5 is running (it sleeps 2 s) when the client dies.
        time.sleep(0.5)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert [s["step"] for s in seen] == [0, 1, 2, 3, 4]

        second = rollout(server.url, sb.id, 10, slow=5)
        out, err = second.communicate(timeout=60)
        assert second.returncode == 0, err
        results = [json.loads(line) for line in out.splitlines()]
        assert [r["step"] for r in results] == list(range(10))
        # 0-4 were received, 5 finished after its client died: all six replay.
        assert [r["replayed"] for r in results] == [True] * 6 + [False] * 4
        for r, s in zip(results, seen):
            assert r["stdout"] == s["stdout"]
        assert [r["stdout"] for r in results] == [f"{i + 1}\n" for i in range(10)]
        # Each append ran exactly once.
        content = sb.read_file("/tmp/rollout").decode()
        assert content == "".join(f"{i}\n" for i in range(10))
        log = client.log(sb.id)
        assert [s["step"] for s in log["steps"]] == list(range(10))


def test_stream_is_recorded_and_replayed(client: dsec.Client, busybox_image: str) -> None:
    with client.create(image=busybox_image, trajectory_id=tid()) as sb:
        events = list(sb.stream("echo out; echo err >&2; echo x >> /tmp/s"))
        assert events[-1].kind == "exit" and events[-1].replayed is False
        again = client.get(sb.id)
        r = again.run("echo out; echo err >&2; echo x >> /tmp/s")
        assert r.replayed and (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
        replayed = list(client.get(sb.id).stream("echo out; echo err >&2; echo x >> /tmp/s"))
        assert replayed[-1].kind == "exit" and replayed[-1].replayed is True
        assert "".join(e.data for e in replayed if e.kind == "stdout") == "out\n"
        assert sb.read_file("/tmp/s") == b"x\n"


def test_divergence_names_the_step_and_both_requests(
    client: dsec.Client, busybox_image: str
) -> None:
    with client.create(image=busybox_image, trajectory_id=tid()) as sb:
        sb.run("echo one", files={"/tmp/in": "a"})
        sb.run("echo two", cwd="/tmp")
        again = client.get(sb.id)
        with pytest.raises(dsec.TrajectoryDiverged) as e:
            again.run("echo uno", files={"/tmp/in": "a"})
        msg = e.value.message
        assert e.value.status == 409 and e.value.kind == "trajectory_diverged"
        assert "step 0" in msg and "echo one" in msg and "echo uno" in msg, msg
        assert "sha256:" in msg, msg
        # Same command, different file content: also a divergence.
        with pytest.raises(dsec.TrajectoryDiverged):
            client.get(sb.id).run("echo one", files={"/tmp/in": "b"})
        # Same command, different cwd at step 1.
        with pytest.raises(dsec.TrajectoryDiverged) as e:
            sb.run("echo two", cwd="/", step=1)
        assert "step 1" in e.value.message and '"/tmp"' in e.value.message
        # Nothing diverged ran or was recorded; the trajectory goes on at step 2.
        assert client.get(sb.id).run("echo one", files={"/tmp/in": "a"}).replayed
        r = sb.run("echo three", step=2)
        assert (r.replayed, r.stdout) == (False, "three\n")
        assert len(client.log(sb.id)["steps"]) == 3


def test_gaps_and_negative_steps_are_invalid(client: dsec.Client, busybox_image: str) -> None:
    with client.create(image=busybox_image, trajectory_id=tid()) as sb:
        with pytest.raises(dsec.InvalidArgument, match="skips ahead"):
            sb.run("echo x", step=1)
        with pytest.raises(dsec.InvalidArgument, match="step must be 0 or more"):
            sb.run("echo x", step=-1)
        assert sb.run("echo x").stdout == "x\n"  # the SDK counts on from 0
        assert client.log(sb.id)["steps"][0]["step"] == 0


def test_concurrent_requests_for_one_step_run_it_once(
    client: dsec.Client, busybox_image: str
) -> None:
    with client.create(image=busybox_image, trajectory_id=tid()) as sb:
        results: list[dsec.CommandResult] = []

        def issue() -> None:
            results.append(client.get(sb.id).run("echo x >> /tmp/c; sleep 0.3; cat /tmp/c"))

        threads = [threading.Thread(target=issue) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(r.replayed for r in results) == [False, True, True, True]
        assert {r.stdout for r in results} == {"x\n"}
        assert sb.read_file("/tmp/c") == b"x\n"


def test_a_trajectory_id_names_one_sandbox(client: dsec.Client, busybox_image: str) -> None:
    t = tid()
    with client.create(image=busybox_image, trajectory_id=t) as sb:
        with pytest.raises(dsec.Conflict, match=sb.id):
            client.create(image=busybox_image, trajectory_id=t)
    with pytest.raises(dsec.InvalidArgument):
        client.create(image=busybox_image, trajectory_id="")


def test_every_command_is_logged_without_a_trajectory_id(
    client: dsec.Client, busybox_image: str
) -> None:
    sb = client.create(image=busybox_image, env={"K": "V"})
    sb.run("echo a")
    sb.run(["sh", "-c", "exit 3"], step=7)  # a step without a trajectory is just logged
    list(sb.stream("echo b"))
    sb.run("echo c", stdin="in", files={"/tmp/f": "data"})
    r = sb.run("echo a")
    assert not r.replayed  # no trajectory id: nothing replays
    sb.stop()
    log = client.log(sb.id)  # after the sandbox is gone
    assert log["sandbox"]["trajectory_id"] is None and log["sandbox"]["env"] == {"K": "V"}
    steps = log["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    assert all(s["trajectory_id"] is None and s["sandbox_id"] == sb.id for s in steps)
    assert steps[1]["result"]["exit_code"] == 3
    assert steps[2]["result"]["stdout"] == "b\n"
    assert steps[3]["request"]["stdin_sha256"].startswith("sha256:")
    assert steps[3]["request"]["files"][0]["path"] == "/tmp/f"
    with pytest.raises(dsec.NotFound):
        client.log("e0-000000000000")


@pytest.mark.timeout(180)
def test_server_kill9_keeps_every_result_a_client_received(
    make_server: Callable[..., Server],
) -> None:
    s = make_server()
    received: list[dict[str, Any]] = []
    with s.client() as c:
        sb = c.create(image="busybox", trajectory_id=tid())
        plain = c.create(image="busybox")

        def loop(box: dsec.Sandbox, tag: str) -> None:
            for i in range(100_000):
                try:
                    r = box.run(f"echo {tag}{i}")
                except dsec.DsecError:
                    return
                received.append({"sandbox": box.id, "step": i, "stdout": r.stdout})

        threads = [
            threading.Thread(target=loop, args=(sb, "t"), daemon=True),
            threading.Thread(target=loop, args=(plain, "p"), daemon=True),
        ]
        for t in threads:
            t.start()
        assert wait_until(lambda: len(received) >= 40, 30)
        s.kill9()
        for t in threads:
            t.join(30)
    got = list(received)
    s.restart()
    with s.client() as c2:
        with pytest.raises(dsec.NotFound):
            c2.get(sb.id)  # sandboxes do not survive a restart; the log does
        for box in (sb, plain):
            mine = [r for r in got if r["sandbox"] == box.id]
            assert mine, f"no results for {box.id}"
            logged = {st["step"]: st for st in c2.log(box.id)["steps"]}
            for r in mine:
                assert r["step"] in logged, f"step {r['step']} of {box.id} missing"
                assert logged[r["step"]]["result"]["stdout"] == r["stdout"]


def run_cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(DSEC_BIN), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, DSEC_URL=server.url),
    )


def test_cli_log_and_replay(server: Server, client: dsec.Client, busybox_image: str) -> None:
    with client.create(image=busybox_image, trajectory_id=tid(), env={"G": "hi"}) as sb:
        sb.run("echo $G > /tmp/g; cat /tmp/g")
        sb.run(["cat", "/tmp/g"])
        sb.run("exit 4")
    r = run_cli(server, "log", sb.id)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert sb.id in lines[0] and "STEP" in lines[1]
    assert lines[2].split()[:2] == ["0", "0"] and "echo $G > /tmp/g" in lines[2]
    assert lines[4].split()[:2] == ["2", "4"]
    r = run_cli(server, "log", sb.id, "--json")
    assert [s["step"] for s in json.loads(r.stdout)["steps"]] == [0, 1, 2]

    r = run_cli(server, "replay", sb.id)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 3 steps match" in r.stdout

    with client.create(image=busybox_image) as other:
        other.run("echo same")
        other.run("cat /proc/sys/kernel/random/uuid")
    r = run_cli(server, "replay", other.id)
    assert r.returncode == 1 and "step 1 differs" in r.stdout, r.stdout + r.stderr
    replays = client.list(labels={"dsec.replay-of": other.id})
    assert replays == [], "the replay sandbox was not stopped"
    r = run_cli(server, "log", "e0-000000000000")
    assert r.returncode != 0 and "not found" in r.stderr


def test_log_route_is_in_openapi(server: Server) -> None:
    import httpx

    doc = httpx.get(server.url + "/openapi.json", trust_env=False).json()
    assert "/v1/sandboxes/{id}/log" in doc["paths"]
