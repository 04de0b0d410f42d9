"""Bad input is refused with the right exception and a message that says what is wrong."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import dsec
import httpx
import pytest
from dsec_testlib import MAX_UPLOAD_MB, Server

MakeSandbox = Callable[..., dsec.Sandbox]


def test_error_hierarchy() -> None:
    for cls in (
        dsec.NotFound,
        dsec.InvalidArgument,
        dsec.PayloadTooLarge,
        dsec.Unavailable,
        dsec.Conflict,
        dsec.TrajectoryDiverged,
        dsec.Unauthorized,
        dsec.ConnectionFailed,
    ):
        assert issubclass(cls, dsec.DsecError)
    assert issubclass(dsec.PayloadTooLarge, dsec.InvalidArgument)


def test_unknown_backend(client: dsec.Client, busybox_image: str) -> None:
    with pytest.raises(dsec.InvalidArgument) as e:
        client.create(backend="nope", image=busybox_image)
    msg = str(e.value)
    assert "nope" in msg
    assert "container" in msg  # names the valid ones
    assert e.value.status == 400


def test_unknown_image(client: dsec.Client, busybox_image: str) -> None:
    with pytest.raises(dsec.NotFound) as e:
        client.create(backend="container", image="no-such-image-xyz")
    assert "no-such-image-xyz" in str(e.value)


@pytest.mark.parametrize(
    "limits",
    [
        {"cpus": 0},
        {"cpus": -1},
        {"cpus": 10000},
        {"memory_mb": 0},
        {"memory_mb": -5},
        {"memory_mb": 10**9},
        {"pids": 0},
        {"pids": -3},
        {"disk_mb": -1},
        {"disk_mb": 0},
        {"ttl_s": -1},
        {"idle_ttl_s": -1},
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_bad_limits(
    client: dsec.Client, busybox_image: str, limits: dict[str, Any]
) -> None:
    with pytest.raises(dsec.InvalidArgument) as e:
        sb = client.create(backend="container", image=busybox_image, **limits)
        sb.stop()
    assert next(iter(limits)) in str(e.value)  # the message names the field


@pytest.mark.parametrize(
    "network", [True, {"allow": ["example.com:443", "10.0.0.0/8"]}]
)
def test_network_is_given_or_unavailable_with_the_reason(
    client: dsec.Client, busybox_image: str, network: Any
) -> None:
    # Networking itself is tested in test_network.py (with a server of its own address
    # pool); the shared server may find its default pool taken by another dsec server on
    # this host, and then says so.
    try:
        sb = client.create(backend="container", image=busybox_image, network=network)
    except dsec.Unavailable as e:
        assert "networking is unavailable on this server:" in str(e), str(e)
        return
    try:
        assert sb.run("ip -o link show eth0").exit_code == 0
    finally:
        sb.stop()


@pytest.mark.parametrize(
    "rule", ["10.0.0.0/33", "1.2.3.4:0", "exa mple.com", "[::1]:443", ""]
)
def test_malformed_network_rule_names_it(
    client: dsec.Client, busybox_image: str, rule: str
) -> None:
    with pytest.raises(dsec.InvalidArgument) as e:
        sb = client.create(
            backend="container", image=busybox_image, network={"allow": ["pypi.org", rule]}
        )
        sb.stop()
    assert repr(rule) in str(e.value) or f'"{rule}"' in str(e.value), str(e.value)


def test_network_on_a_backend_without_networking(
    client: dsec.Client, busybox_image: str
) -> None:
    with pytest.raises(dsec.Unavailable) as e:
        client.create(backend="fncall", image=busybox_image, network=True)
    assert "networking" in str(e.value)


def test_exec_on_stopped_sandbox(make_sandbox: MakeSandbox) -> None:
    sb = make_sandbox()
    sb.stop()
    with pytest.raises(dsec.NotFound):
        sb.run("true")
    with pytest.raises(dsec.NotFound):
        sb.write_file("/tmp/x", b"x")
    with pytest.raises(dsec.NotFound):
        sb.list_files("/")


def test_exec_on_unknown_sandbox(client: dsec.Client, busybox_image: str) -> None:
    sb = dsec.Sandbox(client, dsec.SandboxInfo.from_json({"id": "c-000000000000"}))
    with pytest.raises(dsec.NotFound) as e:
        sb.run("true")
    assert "c-000000000000" in str(e.value)
    with pytest.raises(dsec.NotFound):
        sb.read_file("/etc/passwd")
    sb.stop()  # NotFound is swallowed by stop()


def _raw(server: Server, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, server.url + path, timeout=30, trust_env=False, **kw)


def _error(r: httpx.Response) -> dict[str, Any]:
    doc = r.json()
    assert set(doc) == {"error"}, doc
    assert set(doc["error"]) >= {"kind", "message"}
    return dict(doc["error"])


def test_malformed_json(server: Server, busybox_image: str) -> None:
    r = _raw(
        server,
        "POST",
        "/v1/sandboxes",
        content=b'{"image": "busybox",',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert _error(r)["kind"] == "invalid_argument"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "image"),
        ({"image": 5}, "image"),
        ({"image": "busybox", "memory_mb": "lots"}, "memory_mb"),
        ({"image": "busybox", "labels": ["a"]}, "labels"),
        ({"image": "busybox", "network": "yes"}, "network"),
    ],
)
def test_wrong_field_names_the_field(
    server: Server, busybox_image: str, body: dict[str, Any], field: str
) -> None:
    r = _raw(server, "POST", "/v1/sandboxes", json=body)
    if r.status_code == 201:
        _raw(server, "DELETE", f"/v1/sandboxes/{r.json()['id']}")
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["kind"] == "invalid_argument"
    assert field in err["message"], err["message"]


def test_exec_wrong_field(server: Server, sb: dsec.Sandbox) -> None:
    r = _raw(server, "POST", f"/v1/sandboxes/{sb.id}/exec", json={"cmd": 5})
    assert r.status_code == 400
    assert "cmd" in _error(r)["message"]
    r = _raw(
        server,
        "POST",
        f"/v1/sandboxes/{sb.id}/exec",
        json={"cmd": "true", "stdin_b64": "!!"},
    )
    assert r.status_code == 400
    assert "stdin" in _error(r)["message"]


def test_not_found_is_json(server: Server) -> None:
    r = _raw(server, "GET", "/v1/sandboxes/c-nope")
    assert r.status_code == 404
    assert _error(r)["kind"] == "not_found"


def test_oversized_exec_files(sb: dsec.Sandbox) -> None:
    big = os.urandom(MAX_UPLOAD_MB * 1024 * 1024 + 4096)
    with pytest.raises(dsec.PayloadTooLarge):
        sb.run("true", files={"/tmp/big": big})


@pytest.mark.parametrize(
    "path",
    [
        "../../etc/passwd",
        "/../../etc/passwd",
        "/tmp/../../../etc/passwd",
        "/tmp/up/etc/passwd",
        "/tmp/rel/etc/passwd",
    ],
)
def test_read_file_escape(sb: dsec.Sandbox, path: str) -> None:
    # /tmp/up -> / and /tmp/rel -> ../../../../../.. leave the sandbox's root when resolved
    # on the host.
    sb.run("ln -s / /tmp/up; ln -s ../../../../../.. /tmp/rel")
    with pytest.raises(dsec.InvalidArgument):
        data = sb.read_file(path)
        # If the server did answer, it must at least not be the host's file.
        with open("/etc/passwd", "rb") as f:
            assert data != f.read()


def test_read_file_absolute_symlink(sb: dsec.Sandbox) -> None:
    # An absolute symlink to a file: refused, or resolved inside the sandbox, never the host.
    sb.run("ln -s /etc/passwd /tmp/pw")
    try:
        data = sb.read_file("/tmp/pw")
    except dsec.InvalidArgument:
        return
    with open("/etc/passwd", "rb") as f:
        assert data != f.read()
    assert data == sb.read_file("/etc/passwd")


def test_write_file_escape(sb: dsec.Sandbox) -> None:
    sb.run("ln -s / /tmp/up")
    marker = "dsec-escape-" + sb.id
    for path in (f"/tmp/up/tmp/{marker}", f"/../../tmp/{marker}", f"../tmp/{marker}"):
        with pytest.raises(dsec.InvalidArgument):
            sb.write_file(path, b"escaped")
        assert not os.path.exists(f"/tmp/{marker}"), (
            f"write through {path} reached the host"
        )


def test_list_files_escape(sb: dsec.Sandbox) -> None:
    sb.run("ln -s / /tmp/up")
    with pytest.raises(dsec.InvalidArgument):
        sb.list_files("/tmp/up/")
    with pytest.raises(dsec.InvalidArgument):
        sb.list_files("/../..")


def test_read_missing(sb: dsec.Sandbox) -> None:
    with pytest.raises(dsec.NotFound):
        sb.read_file("/tmp/missing")


def test_negative_timeout(sb: dsec.Sandbox) -> None:
    with pytest.raises(dsec.InvalidArgument) as e:
        sb.run("true", timeout=-1)
    assert "timeout" in str(e.value)


def test_connection_refused() -> None:
    from dsec_testlib import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with dsec.Client(url) as c, pytest.raises(dsec.ConnectionFailed) as e:
        c.images()
    assert url in str(e.value)
    assert "cannot reach dsec server" in str(e.value)
