"""Projects: tokens that see only their project's sandboxes, and quotas on what they hold."""

from __future__ import annotations

import re
import subprocess
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

import dsec
import httpx
import pytest
from dsec_testlib import DSEC_BIN, Server, free_port

ADMIN = "admin-token-of-the-projects-test"


@pytest.fixture
def srv(make_server: Callable[..., Server], tmp_path: Path) -> Server:
    """A server of its own, with an admin token (the shared one has none)."""
    f = tmp_path / "token"
    f.write_text(ADMIN + "\n")
    f.chmod(0o600)
    return make_server(token_file=f)


def cli(s: Server, *args: str, token: str = ADMIN) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(DSEC_BIN), *args, "--url", s.url, "--token", token],
        capture_output=True,
        text=True,
        timeout=60,
    )


def new_project(s: Server, name: str, *quota_args: str) -> str:
    r = cli(s, "project", "create", name, *quota_args)
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip()
    assert token.startswith("dsecp_") and len(token) == 6 + 64, token
    return token


def assert_hidden(c: dsec.Client, own: dsec.Sandbox, target: str) -> None:
    """Every sandbox route of `c` answers `target` as an id that never existed."""
    other = c.get(own.id)
    other.id = target  # the same client, aimed at another (or no) sandbox
    for attempt in (
        partial(c.get, target),
        partial(other.run, "true"),
        partial(other.read_file, "/secret"),
        partial(other.write_file, "/x", b"b"),
        partial(other.list_files, "/"),
        partial(other.stat, "/secret"),
        partial(other.mkdir, "/d"),
        partial(other.move, "/secret", "/stolen"),
        partial(other.remove, "/secret"),
        partial(other.watch, "/"),
        partial(other.spawn, "sleep 1"),
        other.processes,
        other.pause,
        other.network_refused,
        other.log,
    ):
        with pytest.raises(dsec.NotFound) as e:
            attempt()
        assert f"sandbox {target!r}".replace("'", '"') in str(e.value), e.value
        assert "not found: it was stopped, expired, or never existed" in str(e.value)


def test_a_project_sees_and_touches_only_its_own(srv: Server) -> None:
    a, b = new_project(srv, "team-a"), new_project(srv, "team-b")
    with (
        srv.client(token=a) as ca,
        srv.client(token=b) as cb,
        srv.client(token=ADMIN) as admin,
    ):
        sa = ca.create(image="busybox", labels={"who": "a"})
        sb = cb.create(image="busybox")
        try:
            sa.write_file("/secret", b"a's")
            assert [s.id for s in ca.list()] == [sa.id]
            assert [s.id for s in cb.list()] == [sb.id]
            owners = {s.id: s.info().project for s in admin.list()}
            assert owners[sa.id] == "team-a" and owners[sb.id] == "team-b"
            # Every route with A's id answers B as for an id that never existed.
            assert_hidden(cb, sb, sa.id)
            assert_hidden(cb, sb, "nosuch-000000000000")
            r = httpx.delete(
                f"{srv.url}/v1/sandboxes/{sa.id}",
                headers={"Authorization": "Bearer " + b},
                trust_env=False,
            )
            assert r.status_code == 404, r.text
            assert sa.run("cat /secret").stdout == "a's"
            # Events: B's stream has none of A's sandbox; the admin's has both.
            b_events = {e.sandbox for e in cb.events()}
            assert sa.id not in b_events and sb.id in b_events
            assert {e.sandbox for e in cb.events(sandbox=sa.id)} == set()
            assert {sa.id, sb.id} <= {e.sandbox for e in admin.events()}
            # The admin reaches A's sandbox as any other.
            assert admin.get(sa.id).run("cat /secret").stdout == "a's"
            # The admin's images are shared: a project uses them but cannot delete them
            # (its own images: tests/test_project_images.py).
            assert any(i.name == "busybox" for i in cb.images())
            with pytest.raises(dsec.Unauthorized, match="admin token"):
                cb.delete_image("busybox")
            # A fork's children are B's, and so is its image (B's filesystem).
            (kid,) = sb.fork(1)
            try:
                assert kid.id in {s.id for s in cb.list()}
                assert kid.id not in {s.id for s in ca.list()}
                (fork_image,) = [i.name for i in admin.images() if i.raw.get("fork_of") == sb.id]
                assert fork_image.startswith("team-b/")
                assert fork_image in {i.name for i in cb.images()}
                assert fork_image not in {i.name for i in ca.images()}
                with pytest.raises(dsec.NotFound, match="import it first"):
                    ca.get_image(fork_image)
                with pytest.raises(dsec.NotFound, match="import it first"):
                    ca.create(image=fork_image)
            finally:
                kid.stop()
            # Projects: a project lists only itself; only the admin makes or deletes.
            assert [p["name"] for p in cb.projects()] == ["team-b"]
            assert {"team-a", "team-b"} <= {p["name"] for p in admin.projects()}
            with pytest.raises(dsec.Unauthorized, match="admin token"):
                cb.create_project("sneaky")
            with pytest.raises(dsec.Unauthorized, match="admin token"):
                cb.delete_project("team-a")
            auth = {"Authorization": "Bearer " + b}
            r = httpx.get(srv.url + "/metrics", headers=auth, trust_env=False)
            assert r.status_code == 401
            # SandboxFusion takes project tokens (tests/test_sandboxfusion.py): this body is
            # read, and refused as SandboxFusion refuses it.
            r = httpx.post(srv.url + "/run_code", json={}, headers=auth, trust_env=False)
            assert r.status_code == 422, r.text
        finally:
            sa.stop()
            sb.stop()


def test_trajectory_ids_reveal_no_other_project_sandbox(srv: Server) -> None:
    a, b = new_project(srv, "traj-a"), new_project(srv, "traj-b")
    with srv.client(token=a) as ca, srv.client(token=b) as cb:
        sa = ca.create(image="busybox", trajectory_id="shared-name")
        try:
            sa.run("true")
            with pytest.raises(dsec.Conflict, match="pick a new one") as e:
                cb.create(image="busybox", trajectory_id="shared-name")
            assert sa.id not in str(e.value)
        finally:
            sa.stop()


def test_a_project_reads_its_own_logs_after_its_sandboxes_stop(srv: Server) -> None:
    a, b = new_project(srv, "log-a"), new_project(srv, "log-b")
    with (
        srv.client(token=a) as ca,
        srv.client(token=b) as cb,
        srv.client(token=ADMIN) as admin,
    ):
        sa = ca.create(image="busybox")
        sa.run("echo mine")
        mine = admin.create(image="busybox")
        mine.run("echo admin's")
        sa.stop()
        mine.stop()
        log = ca.log(sa.id)
        assert log["stopped_at"] is not None and log["sandbox"]["project"] == "log-a"
        assert [s["result"]["stdout"] for s in log["steps"]] == ["mine\n"]
        assert admin.log(sa.id)["steps"] == log["steps"]
        # Another project's stopped sandbox, and the admin's, answer as an unknown id.
        unknown = "e0-000000000000"
        answers = []
        for c, target in ((cb, sa.id), (ca, mine.id), (cb, unknown)):
            with pytest.raises(dsec.NotFound) as e:
                c.log(target)
            answers.append(str(e.value).replace(target, "ID"))
        assert len(set(answers)) == 1, answers
        assert "not found: it was stopped, expired, or never existed" in answers[0]
        assert "project" not in admin.log(mine.id)["sandbox"]


def test_idempotency_keys_are_per_project(srv: Server) -> None:
    a, b = new_project(srv, "key-a"), new_project(srv, "key-b")
    headers = {"Idempotency-Key": "same-key"}
    body = {"backend": "container", "image": "busybox"}
    made = []
    for token in (a, b):
        r = httpx.post(
            srv.url + "/v1/sandboxes",
            json=body,
            headers={**headers, "Authorization": "Bearer " + token},
            trust_env=False,
        )
        assert r.status_code == 201, r.text
        made.append(r.json()["id"])
    try:
        assert made[0] != made[1]
        r = httpx.get(
            srv.url + "/v1/idempotency/same-key",
            headers={"Authorization": "Bearer " + b},
            trust_env=False,
        )
        assert r.json()["id"] == made[1]
    finally:
        with srv.client(token=ADMIN) as admin:
            for id in made:
                admin.get(id).stop()


def test_quotas_refuse_naming_the_quota_and_free_at_stop(srv: Server) -> None:
    token = new_project(
        srv, "small", "--max-sandboxes", "2", "--max-cpus", "1.5", "--max-memory-mb", "384"
    )
    with srv.client(token=token) as c:
        first = c.create(image="busybox", cpus=0.5, memory_mb=128)
        try:
            with pytest.raises(dsec.QuotaExceeded) as e:
                c.create(image="busybox", cpus=1.5, memory_mb=64)
            assert isinstance(e.value, dsec.Conflict) and e.value.status == 409
            msg = str(e.value)
            assert "max_cpus" in msg and "limit 1.5" in msg and "in use 0.5" in msg, msg
            with pytest.raises(dsec.QuotaExceeded, match=r"max_memory_mb.*limit 384 MB"):
                c.create(image="busybox", cpus=0.5, memory_mb=300)
            second = c.create(image="busybox", cpus=0.5, memory_mb=128)
            with pytest.raises(dsec.QuotaExceeded, match=r"max_sandboxes.*limit 2, in use 2"):
                c.create(image="busybox", cpus=0.1, memory_mb=64)
            (usage,) = [p["usage"] for p in c.projects()]
            assert usage == {"sandboxes": 2, "cpus": 1.0, "memory_mb": 256}
            # The metrics, by project (never by sandbox).
            assert project_gauges(srv, "small") == (2, 1.0, 256)
            second.stop()
            # Released at stop: the same create is admitted again.
            c.create(image="busybox", cpus=0.5, memory_mb=128).stop()
        finally:
            first.stop()
        assert [p["usage"]["sandboxes"] for p in c.projects()] == [0]
    assert project_gauges(srv, "small") == (0, 0.0, 0)


def project_gauges(s: Server, project: str) -> tuple[float, ...]:
    """`dsec_project_{sandboxes,cpus,memory_mb}` of `project` in the server's /metrics."""
    auth = {"Authorization": "Bearer " + ADMIN}
    text = httpx.get(s.url + "/metrics", headers=auth, trust_env=False).text
    values = []
    for name in ("sandboxes", "cpus", "memory_mb"):
        m = re.search(rf'^dsec_project_{name}{{project="{project}"}} (\S+)$', text, re.M)
        assert m, f"no dsec_project_{name} of {project} in /metrics"
        values.append(float(m.group(1)))
    return tuple(values)


def test_concurrent_creates_do_not_overshoot(srv: Server) -> None:
    token = new_project(srv, "burst", "--max-sandboxes", "3")
    with srv.client(token=token) as c:
        with pytest.raises(dsec.BatchError) as e:
            c.create_many(6, image="busybox", memory_mb=64)
        made = e.value.sandboxes
        try:
            assert len(made) == 3
            assert len(e.value.errors) == 3
            assert all(isinstance(x, dsec.QuotaExceeded) for x in e.value.errors.values())
        finally:
            for sb in made:
                sb.stop()
        # Threads racing single creates: never more than the quota at once.
        results: list[object] = []

        def create() -> None:
            try:
                results.append(c.create(image="busybox", memory_mb=64))
            except dsec.QuotaExceeded as err:
                results.append(err)

        threads = [threading.Thread(target=create) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        made = [r for r in results if isinstance(r, dsec.Sandbox)]
        try:
            assert len(made) == 3, results
        finally:
            for sb in made:
                sb.stop()


def test_tokens_survive_restart_and_are_stored_hashed(srv: Server) -> None:
    token = new_project(srv, "durable", "--max-sandboxes", "1")
    added = cli(srv, "project", "token", "durable")
    assert added.returncode == 0, added.stderr
    second = added.stdout.strip()
    srv.stop()
    srv.restart()
    for t in (token, second):
        with srv.client(token=t) as c:
            assert [p["name"] for p in c.projects()] == ["durable"]
            assert c.projects()[0]["quotas"] == {"max_sandboxes": 1}
    for f in srv.state_dir.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert token.encode() not in data and second.encode() not in data, f
    with srv.client(token="dsecp_" + "0" * 64) as c, pytest.raises(dsec.Unauthorized):
        c.list()


def test_project_management_errors(srv: Server, make_server: Callable[..., Server]) -> None:
    token = new_project(srv, "busy")
    r = cli(srv, "project", "create", "busy")
    assert r.returncode != 0 and "already exists" in r.stderr
    r = cli(srv, "project", "create", "Bad Name")
    assert r.returncode != 0 and "project name must be" in r.stderr
    r = cli(srv, "project", "create", "x", token=token)
    assert r.returncode != 0 and "admin token" in r.stderr
    with srv.client(token=token) as c, srv.client(token=ADMIN) as admin:
        sb = c.create(image="busybox")
        with pytest.raises(dsec.Conflict, match="still has 1 sandbox"):
            admin.delete_project("busy")
        sb.stop()
        r = cli(srv, "project", "list")
        assert r.returncode == 0 and "busy" in r.stdout, r.stderr
        r = cli(srv, "project", "delete", "busy")
        assert r.returncode == 0, r.stderr
        with pytest.raises(dsec.Unauthorized):
            c.list()
        with pytest.raises(dsec.NotFound):
            admin.delete_project("busy")
    open_server = make_server()
    with open_server.client() as c, pytest.raises(dsec.Conflict, match="--token-file"):
        c.create_project("p")


def test_scoping_and_quotas_on_every_backend(srv: Server, backend: str, image: str) -> None:
    a = new_project(srv, "on-" + backend, "--max-sandboxes", "1", "--max-memory-mb", "256")
    b = new_project(srv, "off-" + backend)
    with srv.client(token=a) as ca, srv.client(token=b) as cb:
        sa = ca.create(backend=backend, image=image, memory_mb=256)
        try:
            sa.write_file("/secret", b"a's")
            with pytest.raises(dsec.QuotaExceeded, match="max_sandboxes"):
                ca.create(backend=backend, image=image, memory_mb=64)
            own = cb.create(backend=backend, image=image)
            try:
                assert_hidden(cb, own, sa.id)
            finally:
                own.stop()
            assert sa.run("cat /secret").stdout == "a's"
        finally:
            sa.stop()
        ca.create(backend=backend, image=image, memory_mb=256).stop()
        assert ca.projects()[0]["usage"] == {"sandboxes": 0, "cpus": 0.0, "memory_mb": 0}


def test_e2b_api_keys_are_scoped_like_tokens(
    make_server: Callable[..., Server], tmp_path: Path
) -> None:
    f = tmp_path / "token"
    f.write_text(ADMIN + "\n")
    port = free_port()
    srv = make_server(
        token_file=f,
        extra_args=[
            "--e2b-listen",
            f"127.0.0.1:{port}",
            "--e2b-envd-listen",
            f"127.0.0.1:{free_port()}",
        ],
    )
    a = new_project(srv, "e2b-a", "--max-sandboxes", "1")
    b = new_project(srv, "e2b-b")
    e2b = httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=60)

    def call(method: str, path: str, key: str, **kw: object) -> httpx.Response:
        return e2b.request(method, path, headers={"X-API-KEY": key}, **kw)  # type: ignore[arg-type]

    made = call("POST", "/sandboxes", a, json={"templateID": "busybox", "timeout": 60})
    assert made.status_code == 201, made.text
    id = made.json()["sandboxID"]
    try:
        refused = call("POST", "/sandboxes", a, json={"templateID": "busybox"})
        assert refused.status_code == 409 and "max_sandboxes" in refused.text, refused.text
        for method, path in (
            ("GET", f"/sandboxes/{id}"),
            ("POST", f"/sandboxes/{id}/pause"),
            ("DELETE", f"/sandboxes/{id}"),
        ):
            r = call(method, path, b)
            assert r.status_code == 404 and "never existed" in r.text, (path, r.text)
        assert id not in call("GET", "/v2/sandboxes", b).text
        assert id not in call("GET", f"/sandboxes/metrics?sandbox_ids={id}", b).text
        assert call("GET", f"/sandboxes/{id}", ADMIN).status_code == 200
        assert call("GET", "/v2/sandboxes", "wrong").status_code == 401
        with srv.client(token=a) as ca:
            assert [s.id for s in ca.list()] == [id]
    finally:
        assert call("DELETE", f"/sandboxes/{id}", a).status_code == 204
