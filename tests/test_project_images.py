"""Per-project images: a project imports and snapshots images of its own, named under
`<project>/`, that no other project sees; the admin's images stay shared."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import dsec
import httpx
import pytest
from dsec_testlib import Server
from test_projects import ADMIN, cli, new_project


def admin_token(d: Path) -> Path:
    """The admin's token, in a file of `d`."""
    d.mkdir(parents=True, exist_ok=True)
    f = d / "token"
    f.write_text(ADMIN + "\n")
    f.chmod(0o600)
    return f


@pytest.fixture
def srv(make_server: Callable[..., Server], tmp_path: Path, busybox_rootfs: Path) -> Server:
    """Projects may import the busybox rootfs by its path: it is an import root."""
    return make_server(
        token_file=admin_token(tmp_path), extra_args=["--import-root", str(busybox_rootfs)]
    )


def names(c: dsec.Client) -> set[str]:
    return {i.name for i in c.images()}


def test_a_project_imports_and_uses_its_own_images(srv: Server, busybox_rootfs: Path) -> None:
    a, b = new_project(srv, "img-a"), new_project(srv, "img-b")
    with (
        srv.client(token=a) as ca,
        srv.client(token=b) as cb,
        srv.client(token=ADMIN) as admin,
    ):
        # A name without the prefix is put under it; one with it is kept as is.
        mine = ca.import_image(str(busybox_rootfs), name="tools")
        assert mine.name == "img-a/tools" and mine.project == "img-a"
        assert ca.import_image(str(busybox_rootfs), name="img-a/other").name == "img-a/other"
        # Another project's prefix is not a way into its namespace: it is put under B's.
        assert cb.import_image(str(busybox_rootfs), name="img-a/x").name == "img-b/img-a/x"
        assert {"img-a/tools", "img-a/other", "busybox"} <= names(ca)
        assert "busybox" in names(cb) and not any(n.startswith("img-a/") for n in names(cb))
        assert "img-b/img-a/x" not in names(ca)
        admin_view = {i.name: i.project for i in admin.images()}
        assert admin_view["img-a/tools"] == "img-a" and admin_view["busybox"] is None
        # B cannot see, use or delete A's image: each answers as a name never imported.
        for attempt in (
            lambda: cb.get_image("img-a/tools"),
            lambda: cb.create(image="img-a/tools"),
            lambda: cb.delete_image("img-a/tools"),
        ):
            with pytest.raises(dsec.NotFound, match="import it first"):
                attempt()
        # A creates from its own image by its short name or its full one.
        for name in ("tools", "img-a/tools"):
            sb = ca.create(image=name)
            try:
                assert sb.info().image == "img-a/tools"
                assert sb.run("echo ok").stdout == "ok\n"
            finally:
                sb.stop()
        # A's own "busybox" shadows the admin's for A only.
        ca.import_image(str(busybox_rootfs), name="busybox")
        with ca.create(image="busybox") as sa, cb.create(image="busybox") as sb:
            assert sa.info().image == "img-a/busybox"
            assert sb.info().image == "busybox"
        # The admin's images stay the admin's.
        with pytest.raises(dsec.Unauthorized, match="admin token"):
            cb.delete_image("busybox")
        ca.delete_image("busybox")
        with ca.create(image="busybox") as sa:
            assert sa.info().image == "busybox"
        ca.delete_image("img-a/other")
        assert "img-a/other" not in names(admin)


def test_a_project_snapshot_and_fork_are_its_own(srv: Server) -> None:
    a, b = new_project(srv, "snap-a"), new_project(srv, "snap-b")
    with srv.client(token=a) as ca, srv.client(token=b) as cb:
        with ca.create(image="busybox") as sa:
            sa.write_file("/work/state", b"kept")
            snap = sa.snapshot("mid")
            assert snap.name == "snap-a/mid"
            auto = sa.snapshot()
            assert auto.name.startswith("snap-a/") and auto.name in names(ca)
            (kid,) = sa.fork(1)
            try:
                forks = [i for i in ca.images() if i.raw.get("fork_of") == sa.id]
                assert len(forks) == 1 and forks[0].project == "snap-a"
                assert forks[0].name not in names(cb)
            finally:
                kid.stop()
        with ca.create(image="mid") as again:
            assert again.read_file("/work/state") == b"kept"
        assert "snap-a/mid" not in names(cb)
        with pytest.raises(dsec.NotFound):
            cb.create(image="snap-a/mid")


def test_project_images_over_http_cli_and_project_delete(
    srv: Server, busybox_rootfs: Path, tmp_path: Path
) -> None:
    a = new_project(srv, "cli-a")
    r = cli(srv, "image", "import", str(busybox_rootfs), "--name", "cli-img", token=a)
    assert r.returncode == 0, r.stderr
    r = cli(srv, "image", "ls", token=a)
    assert r.returncode == 0 and "cli-a/cli-img" in r.stdout, r.stdout + r.stderr
    # The admin cannot overwrite a project's image by importing over its name.
    with srv.client(token=ADMIN) as admin:
        with pytest.raises(dsec.Conflict, match="belongs to project"):
            admin.import_image(str(busybox_rootfs), name="cli-a/cli-img")
        got = httpx.get(
            f"{srv.url}/v1/images/cli-a/cli-img",
            headers={"Authorization": "Bearer " + ADMIN},
            trust_env=False,
        )
        assert got.status_code == 200 and json.loads(got.text)["project"] == "cli-a"
        # Deleting the project deletes its images: nothing is left that nobody can reach.
        admin.delete_project("cli-a")
        assert not any(n.startswith("cli-a/") for n in names(admin))


def test_a_project_imports_host_paths_only_beneath_an_import_root(
    make_server: Callable[..., Server], tmp_path: Path, busybox_rootfs: Path
) -> None:
    """A host path is read with the server's rights: a project that imported `/etc` would
    read the host's secrets from its sandbox. A project's token imports a path only
    beneath a `--import-root` (a link out of one counts as outside, and a path elsewhere
    is refused whether it exists or not), never from the host's Docker daemon; the
    admin's imports any."""
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    shutil.copytree(busybox_rootfs, shelf / "rootfs", symlinks=True)
    (shelf / "escape").symlink_to("/etc")
    s = make_server(token_file=admin_token(tmp_path), extra_args=["--import-root", str(shelf)])
    bare = make_server(token_file=admin_token(tmp_path / "bare"), import_busybox=False)
    with s.client(token=new_project(s, "shelf")) as c:
        assert c.import_image(str(shelf / "rootfs"), name="mine").name == "shelf/mine"
        for source in ("/etc", str(shelf / "escape"), "/no/such/dir", "docker://busybox"):
            with pytest.raises(dsec.PermissionDenied, match="not a project's to import"):
                c.import_image(source, name="stolen")
        assert "shelf/stolen" not in names(c)
        with c.create(image="mine") as sb:
            assert sb.run("echo ok").stdout == "ok\n"
    with bare.client(token=new_project(bare, "bare")) as c:
        with pytest.raises(dsec.PermissionDenied, match="no --import-root"):
            c.import_image(str(busybox_rootfs), name="mine")
    with bare.client(token=ADMIN) as admin:
        assert admin.import_image(str(busybox_rootfs), name="admins").name == "admins"

