"""Bearer-token authentication, and refusing to listen publicly without it."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import dsec
import httpx
import pytest
from dsec_testlib import Server

TOKEN = "s3cret-dsec-test-token"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    return f


def test_token_required(make_server: Callable[..., Server], token_file: Path) -> None:
    s = make_server(token_file=token_file)
    assert httpx.get(s.url + "/healthz", trust_env=False).status_code == 200
    for token in ("", "wrong-token"):
        with s.client(token=token) as c:
            with pytest.raises(dsec.Unauthorized):
                c.images()
            with pytest.raises(dsec.Unauthorized):
                c.list()
            with pytest.raises(dsec.Unauthorized):
                c.create(image="busybox")
    for path in ("/v1/images", "/v1/sandboxes", "/metrics"):
        r = httpx.get(s.url + path, trust_env=False)
        assert r.status_code == 401, path
    r = httpx.get(
        s.url + "/v1/images",
        headers={"Authorization": "Bearer " + TOKEN},
        trust_env=False,
    )
    assert r.status_code == 200
    with s.client(token=TOKEN) as c:
        assert any(i.name == "busybox" for i in c.images())
        with c.create(image="busybox") as sb:
            assert sb.run("echo authed").stdout == "authed\n"


def test_token_from_environment(
    make_server: Callable[..., Server],
    token_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = make_server(token_file=token_file)
    monkeypatch.setenv("DSEC_TOKEN", TOKEN)
    monkeypatch.setenv("DSEC_URL", s.url)
    with dsec.Client() as c:
        assert c.url == s.url
        c.images()


def test_public_listen_requires_token(make_server: Callable[..., Server]) -> None:
    s = make_server(host="0.0.0.0", start=False)
    p = s.spawn()
    try:
        rc = p.wait(20)
    except subprocess.TimeoutExpired:
        s.kill9()
        pytest.fail(
            "dsec serve --listen 0.0.0.0:PORT without --token-file kept running"
        )
    assert rc != 0
    assert "token" in s.log_tail().lower()


def test_public_listen_with_token(
    make_server: Callable[..., Server], token_file: Path
) -> None:
    s = make_server(host="0.0.0.0", token_file=token_file, import_busybox=False)
    with s.client(token=TOKEN) as c:
        c.images()
