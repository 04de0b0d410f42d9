"""The trajectory log: every command recorded durably, fast-forward replay of re-issued
steps, divergence and gaps refused, `dsec log` and `dsec replay`, and the log's bounds.

Every test runs twice: on the embedded SQLite log, and on a PostgreSQL database of a
cluster this module starts (`--trajectory-db postgres://…`)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dsec
import httpx
import pytest
from dsec_testlib import (
    DSEC_BIN,
    REPO,
    Server,
    ServerError,
    free_port,
    make_tempdir,
    require,
    safe_rmtree,
    wait_until,
)
from postgres_cluster import PASSWORD, PostgresCluster, pg_bin_dir
from test_processes import read_until

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


class Store:
    """The trajectory database of this module's servers: SQLite in each server's state
    directory, or a new database of the module's PostgreSQL cluster for each server."""

    def __init__(self, cluster: PostgresCluster | None) -> None:
        self.cluster = cluster

    def server_args(self) -> list[str]:
        if self.cluster is None:
            return []
        return ["--trajectory-db", self.cluster.database()]


@pytest.fixture(scope="module")
def pg_cluster() -> Iterator[PostgresCluster]:
    """This module's PostgreSQL cluster (skipped, saying why, where none is installed)."""
    missing = "no initdb in $DSEC_PG_BIN or /usr/lib/postgresql/*/bin"
    require("postgres", None if pg_bin_dir() else missing)
    # In the system's temporary directory: the `postgres` user must reach it.
    cluster = PostgresCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest) -> Store:
    if request.param == "sqlite":
        return Store(None)
    return Store(request.getfixturevalue("pg_cluster"))


@pytest.fixture(scope="module")
def server(store: Store) -> Iterator[Server]:
    """This module's server, on the store under test."""
    d = make_tempdir("dsec-test-traj-")
    s = Server(d / "state", log_path=d / "server.log", extra_args=store.server_args())
    try:
        s.start()
        yield s
    finally:
        s.cleanup()
        safe_rmtree(d)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[dsec.Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def busybox_image(client: dsec.Client, busybox_rootfs: Path) -> str:
    return client.import_image(str(busybox_rootfs), name="busybox").name


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
        for r, s in zip(results, seen, strict=False):  # seen: the first five
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
    with (
        client.create(image=busybox_image, trajectory_id=t) as sb,
        pytest.raises(dsec.Conflict, match=sb.id),
    ):
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
    make_server: Callable[..., Server], store: Store
) -> None:
    s = make_server(extra_args=store.server_args())
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
        check=False,
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


def refused_at_start(make_server: Callable[..., Server], *args: str) -> str:
    """What `dsec serve ARGS` said when it would not start (what it printed, not the
    argv the test harness logged)."""
    s = make_server(start=False, extra_args=list(args))
    with pytest.raises(ServerError):
        s.start()
    assert s.proc is not None and s.proc.returncode != 0
    return s.log_path.read_text().split("\n", 2)[-1]


def test_postgres_bad_databases_are_refused_at_start(
    make_server: Callable[..., Server], pg_cluster: PostgresCluster
) -> None:
    url = pg_cluster.database()
    name = url.rsplit("/", 1)[1]
    closed = free_port()
    cases = [
        (url.replace(f":{pg_cluster.port}/", f":{closed}/"), "cannot reach PostgreSQL"),
        (url.replace(PASSWORD, "wrong"), 'refused the password of user "dsec"'),
        (url.replace(f"/{name}", "/missing"), 'database "missing" does not exist'),
    ]
    for bad, want in cases:
        said = refused_at_start(make_server, "--trajectory-db", bad)
        assert want in said, said
        assert PASSWORD not in said and ":wrong@" not in said, said
    # A second server under an edge name in use is refused, not let in to mark the first
    # one's live sandboxes stopped.
    first = make_server(extra_args=["--trajectory-db", url, "--edge-name", "ea"])
    said = refused_at_start(make_server, "--trajectory-db", url, "--edge-name", "ea")
    assert 'edge name "ea" is in use by another server' in said, said
    assert first.alive()


def test_postgres_log_outlives_its_edge_and_replays_from_another(
    make_server: Callable[..., Server], pg_cluster: PostgresCluster
) -> None:
    """Two servers on one database: a sandbox's log is read, and replayed, from the other
    server after the sandbox's own server was SIGKILLed."""
    url = pg_cluster.database()
    a = make_server(extra_args=["--trajectory-db", url, "--edge-name", "ea"])
    b = make_server(extra_args=["--trajectory-db", url, "--edge-name", "eb"])
    with a.client() as ca:
        sb = ca.create(image="busybox", trajectory_id=tid())
        assert sb.id.startswith("ea-")
        outs = [sb.run(cmd).stdout for cmd in ("echo one > /f; cat /f", "printf 'a\\0b'", "cat /f")]
    assert outs == ["one\n", "a\0b", "one\n"]
    a.kill9()
    with b.client() as cb:
        steps = cb.log(sb.id)["steps"]
        assert [st["result"]["stdout"] for st in steps] == outs
    r = run_cli(b, "replay", sb.id)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all 3 steps match" in r.stdout
    # The edge's restart marks its earlier run's sandbox stopped.
    a.restart()
    with b.client() as cb:
        assert cb.log(sb.id)["stopped_at"] is not None


def test_log_route_is_in_openapi(server: Server) -> None:
    doc = httpx.get(server.url + "/openapi.json", trust_env=False).json()
    assert "/v1/sandboxes/{id}/log" in doc["paths"]


FLOOD = 16 << 20  # the server's default --max-output-bytes per stream
CHATTY = f"yes | head -c {FLOOD}"
SMALLER = f"yes | head -c {2 << 20}"  # still 32 times what the log keeps of an output
#: Sandboxes each of the 3 flood workers runs in turn: 9 of ~1 MiB of log, for a 4 MiB log.
ROUNDS = 3
LOG_BUDGET_MB = 4
KEPT = 64 << 10  # the default --trajectory-output-bytes


def log_bytes(s: Server, store: Store) -> int:
    """What the trajectory log takes: on SQLite, its files (database and WAL); on
    PostgreSQL, whose files are its own business, what the log stores."""
    if store.cluster is not None:
        return int(metric(s, "dsec_trajectory_bytes"))
    return sum(
        (s.state_dir / name).stat().st_size
        for name in ("trajectory.db", "trajectory.db-wal")
        if (s.state_dir / name).exists()
    )


def metric(s: Server, name: str) -> float:
    text = httpx.get(s.url + "/metrics", trust_env=False).text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    return sum(values)


@pytest.mark.timeout(600)
def test_chatty_commands_cannot_fill_the_disk_through_the_log(
    make_server: Callable[..., Server], store: Store
) -> None:
    """The attack: commands that print 16 MiB each, over and over, in many sandboxes, against
    a 4 MiB log. The log's files stay under it, the server stays healthy, an early step of a
    live sandbox still replays (head and tail, flagged truncated), and `dsec log` says what
    was not kept."""
    s = make_server(
        extra_args=[
            "--trajectory-max-mb",
            str(LOG_BUDGET_MB),
            "--trajectory-sandbox-mb",
            "1",
            *store.server_args(),
        ]
    )
    budget = LOG_BUDGET_MB << 20
    with s.client() as c:
        keeper = c.create(image="busybox", trajectory_id=tid())
        first = keeper.run(CHATTY)
        assert len(first.stdout) == FLOOD and not first.truncated and not first.replayed

        # A live sandbox past its own budget (1 MiB): every step is still recorded.
        hog = c.create(image="busybox", trajectory_id=tid())
        for _ in range(24):
            assert len(hog.run(SMALLER + " >&2").stderr) == 2 << 20

        stopped: list[str] = []
        peak = 0

        def flood(worker: int) -> None:
            nonlocal peak
            for _ in range(ROUNDS):
                with c.create(image="busybox") as sb:
                    for cmd, size in [(CHATTY, FLOOD), (SMALLER, 2 << 20), (SMALLER, 2 << 20)]:
                        r = sb.run(cmd)
                        assert len(r.stdout) == size and r.exit_code == 0
                        peak = max(peak, log_bytes(s, store))
                stopped.append(sb.id)

        threads = [threading.Thread(target=flood, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(stopped) == 3 * ROUNDS, "a flood worker failed"
        # 180 MiB of output went through; the log's files never passed the budget.
        assert peak <= budget, f"trajectory log reached {peak} bytes on disk"
        assert log_bytes(s, store) <= budget
        assert metric(s, "dsec_trajectory_bytes") <= budget
        assert metric(s, "dsec_trajectory_pruned_sandboxes_total") > 0
        assert metric(s, "dsec_trajectory_elided_bytes_total") > 3 * ROUNDS * FLOOD

        # Healthy: a quiet sandbox answers, and the oldest stopped sandboxes' logs were pruned.
        assert httpx.get(s.url + "/healthz", trust_env=False).status_code == 200
        with c.create(image="busybox") as quiet:
            assert quiet.run("echo ok").stdout == "ok\n"
        with pytest.raises(dsec.NotFound, match="pruned"):
            c.log(stopped[0])
        assert c.log(stopped[-1])["steps"], "the newest stopped sandbox was pruned first"

        # The early step of the live sandbox replays: head and tail of its output, flagged.
        again = c.get(keeper.id).run(CHATTY)
        assert again.replayed and again.truncated and again.exit_code == 0
        head, marker, tail = again.stdout.partition(
            f"\n[... {FLOOD - KEPT} bytes not kept by the dsec trajectory log ...]\n"
        )
        assert marker, again.stdout[KEPT // 2 - 100 : KEPT // 2 + 100]
        assert head == tail == "y\n" * (KEPT // 4)
        step0 = c.log(keeper.id)["steps"][0]["result"]
        assert step0["stdout_bytes"] == FLOOD and step0["stdout_elided"] == FLOOD - KEPT
        assert (
            step0["stdout_sha256"] == "sha256:" + hashlib.sha256(b"y\n" * (FLOOD // 2)).hexdigest()
        )
        assert step0["truncated"] is False  # what the client was told when it ran

        # The hog's last steps were recorded without output: a replay returns only the marker.
        hog_log = c.log(hog.id)
        assert len(hog_log["steps"]) == 24 and hog_log["bytes"] < 2 << 20
        last = hog_log["steps"][-1]["result"]
        assert last["stderr_elided"] == last["stderr_bytes"] == 2 << 20
        r = c.get(hog.id).run(SMALLER + " >&2", step=23)
        assert r.replayed and r.truncated
        assert r.stderr == f"\n[... {2 << 20} bytes not kept by the dsec trajectory log ...]\n"

        out = run_cli(s, "log", keeper.id)
        assert out.returncode == 0, out.stderr
        assert f"stdout: {FLOOD} bytes, {FLOOD - KEPT} not kept by the log" in out.stdout, (
            out.stdout
        )
        assert "16.0 MiB" in out.stdout.splitlines()[2]
        keeper.stop()
        hog.stop()
    assert "pruned the logs of the oldest stopped sandboxes" in s.log_tail(400)


# ---------------------------------------------------------------- spawned processes
# A spawn, its stdin writes (bounded, with their digests), close-stdin and signals are
# steps, numbered with the runs; the process's end is its spawn step's result.


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
