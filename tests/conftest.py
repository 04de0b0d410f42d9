"""Fixtures: a real `dsec serve` (started from $DSEC_BIN, default target/debug/dsec), a busybox
image built with scripts/make-busybox-rootfs.sh, and the `backend` parameter
($DSEC_TEST_BACKENDS, comma-separated, default "container").

Run as root: `pytest tests/`. Nothing is mocked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dsec
import pytest
from dsec_local import make_busybox_rootfs
from dsec_testlib import (
    BACKENDS,
    DOCKER_TEST_IMAGE,
    STATEFUL,
    Server,
    docker_import_rootfs,
    docker_unavailable_reason,
    image_for,
    make_tempdir,
    require,
    safe_rmtree,
)

_SESSION_SERVER: list[Server] = []


@pytest.fixture(scope="session")
def tmp_base() -> Iterator[Path]:
    d = make_tempdir("dsec-test-")
    yield d
    safe_rmtree(d)


@pytest.fixture(scope="session")
def server(tmp_base: Path) -> Iterator[Server]:
    """The suite's shared server, started with --max-upload-mb 8."""
    s = Server(tmp_base / "state", log_path=tmp_base / "server.log")
    s.start()
    _SESSION_SERVER.append(s)
    yield s
    _SESSION_SERVER.clear()
    try:
        s.stop()
        assert not s.alive(), "dsec serve is still running"
    finally:
        s.cleanup()


@pytest.fixture(scope="session")
def client(server: Server) -> Iterator[dsec.Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="session")
def busybox_rootfs(tmp_base: Path) -> Path:
    """A busybox root filesystem directory, made by scripts/make-busybox-rootfs.sh."""
    return make_busybox_rootfs(tmp_base / "rootfs-busybox")


@pytest.fixture(scope="session")
def busybox_image(client: dsec.Client, busybox_rootfs: Path) -> str:
    """The image "busybox" imported into the shared server."""
    img = client.import_image(str(busybox_rootfs), name="busybox")
    assert img.name == "busybox"
    return img.name


@pytest.fixture(scope="session")
def docker_daemon() -> None:
    """A Docker daemon answers: else the test fails where scripts/setup.sh installed Docker,
    and skips where it did not."""
    require("docker", docker_unavailable_reason())


@pytest.fixture(scope="session")
def docker_image(docker_daemon: None, busybox_rootfs: Path) -> str:
    """The busybox rootfs as a Docker image (see `docker_daemon` for a missing daemon)."""
    docker_import_rootfs(busybox_rootfs, DOCKER_TEST_IMAGE)
    return DOCKER_TEST_IMAGE


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, busybox_image: str) -> str:
    """The backend under test; the conformance suite runs once per backend."""
    if request.param == "docker":
        request.getfixturevalue("docker_image")
    return str(request.param)


@pytest.fixture
def image(backend: str) -> str:
    return image_for(backend)


@pytest.fixture
def stateful(backend: str) -> None:
    """Skip for backends where nothing persists between commands (fncall)."""
    if backend not in STATEFUL:
        pytest.skip(f"backend {backend} keeps no state between commands")


@pytest.fixture
def make_sandbox(
    client: dsec.Client, backend: str, image: str
) -> Iterator[Callable[..., dsec.Sandbox]]:
    """Create sandboxes of the backend under test; all are stopped at the end of the test."""
    made: list[dsec.Sandbox] = []

    def make(**kw: Any) -> dsec.Sandbox:
        kw.setdefault("backend", backend)
        kw.setdefault("image", image)
        sb = client.create(**kw)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.stop()


@pytest.fixture
def sb(make_sandbox: Callable[..., dsec.Sandbox]) -> dsec.Sandbox:
    """One sandbox of the backend under test, with default limits."""
    return make_sandbox()


@pytest.fixture
def make_server(tmp_base: Path, busybox_rootfs: Path) -> Iterator[Callable[..., Server]]:
    """Start extra servers (own state dir); each is stopped (or was killed) by the end."""
    started: list[Server] = []

    def make(*, import_busybox: bool = True, start: bool = True, **kw: Any) -> Server:
        d = make_tempdir("dsec-test-extra-")
        s = Server(d / "state", log_path=d / "server.log", **kw)
        s.tmp = d  # type: ignore[attr-defined]
        started.append(s)
        if start:
            s.start()
            if import_busybox:
                with s.client(token=_token_of(s)) as c:
                    c.import_image(str(busybox_rootfs), name="busybox")
        return s

    yield make
    for s in started:
        s.cleanup()
        safe_rmtree(s.tmp)  # type: ignore[attr-defined]


def _token_of(s: Server) -> str | None:
    if s.token_file is None:
        return None
    return s.token_file.read_text().strip()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[Any]:
    """On failure, attach the tail of the shared server's log."""
    outcome: Any = yield
    rep = outcome.get_result()
    if rep.failed and _SESSION_SERVER:
        rep.sections.append(("dsec serve log (tail)", _SESSION_SERVER[0].log_tail(40)))
