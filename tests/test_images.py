"""Image import, listing and deletion through the SDK."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import dsec
import pytest


def _name(kind: str) -> str:
    return f"test-{kind}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def cleanup_images(client: dsec.Client) -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for n in names:
        try:
            client.delete_image(n)
        except dsec.NotFound:
            pass


def _check_usable(client: dsec.Client, backend: str, name: str) -> None:
    with client.create(backend=backend, image=name) as sb:
        r = sb.run("cat /etc/group; ls /bin | wc -l")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.startswith("root:x:0:")


def test_import_directory(
    client: dsec.Client, busybox_rootfs: Path, backend: str, cleanup_images: list[str]
) -> None:
    if backend == "docker":
        pytest.skip("the docker backend uses Docker image references")
    name = _name("dir")
    img = client.import_image(busybox_rootfs, name=name)  # a Path works too
    cleanup_images.append(name)
    assert isinstance(img, dsec.Image)
    assert img.name == name
    assert img.id.startswith("sha256:")
    assert img.size > 1_000_000
    assert img.layers
    assert name in {i.name for i in client.images()}
    _check_usable(client, backend, name)


@pytest.mark.parametrize("fmt", ["tar.gz", "tar"])
def test_import_tarball(
    client: dsec.Client,
    busybox_rootfs: Path,
    tmp_path: Path,
    backend: str,
    cleanup_images: list[str],
    fmt: str,
) -> None:
    if backend == "docker":
        pytest.skip("the docker backend uses Docker image references")
    archive = tmp_path / f"rootfs.{fmt}"
    flags = "-czf" if fmt == "tar.gz" else "-cf"
    subprocess.run(
        ["tar", "-C", str(busybox_rootfs), flags, str(archive), "."], check=True
    )
    name = _name(fmt.replace(".", ""))
    img = client.import_image(str(archive), name=name)
    cleanup_images.append(name)
    assert img.name == name
    assert img.size > 1_000_000
    _check_usable(client, backend, name)


def test_same_content_same_id(
    client: dsec.Client,
    busybox_rootfs: Path,
    busybox_image: str,
    cleanup_images: list[str],
) -> None:
    name = _name("again")
    img = client.import_image(str(busybox_rootfs), name=name)
    cleanup_images.append(name)
    assert img.layers == client.get_image(busybox_image).layers


def test_default_name(
    client: dsec.Client, busybox_rootfs: Path, tmp_path: Path
) -> None:
    src = tmp_path / f"myrootfs{uuid.uuid4().hex[:6]}"
    subprocess.run(["cp", "-a", str(busybox_rootfs), str(src)], check=True)
    img = client.import_image(str(src))
    try:
        assert img.name
        assert img.name in {i.name for i in client.images()}
    finally:
        client.delete_image(img.name)


def test_relative_path_is_made_absolute(
    client: dsec.Client, busybox_rootfs: Path, cleanup_images: list[str]
) -> None:
    name = _name("rel")
    cwd = os.getcwd()
    os.chdir(busybox_rootfs.parent)
    try:
        client.import_image(busybox_rootfs.name, name=name)
    finally:
        os.chdir(cwd)
    cleanup_images.append(name)


def test_delete_image(client: dsec.Client, busybox_rootfs: Path, backend: str) -> None:
    name = _name("del")
    client.import_image(str(busybox_rootfs), name=name)
    client.delete_image(name)
    assert name not in {i.name for i in client.images()}
    with pytest.raises(dsec.NotFound):
        client.get_image(name)
    with pytest.raises(dsec.NotFound) as e:
        client.create(backend="container", image=name)
    assert name in str(e.value)
    with pytest.raises(dsec.NotFound):
        client.delete_image(name)


def test_delete_image_in_use(client: dsec.Client, busybox_rootfs: Path) -> None:
    name = _name("inuse")
    client.import_image(str(busybox_rootfs), name=name)
    sb = client.create(backend="container", image=name)
    try:
        try:
            client.delete_image(name)
            deleted = True
        except dsec.Conflict:
            deleted = False
        # either way the running sandbox keeps working
        assert sb.run("ls /bin/busybox && echo ok").stdout.endswith("ok\n")
    finally:
        sb.stop()
    if not deleted:
        client.delete_image(name)
    assert name not in {i.name for i in client.images()}


def test_import_missing_source(client: dsec.Client) -> None:
    with pytest.raises((dsec.NotFound, dsec.InvalidArgument)):
        client.import_image("/no/such/rootfs/dir", name=_name("missing"))


def test_import_garbage(client: dsec.Client, tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(dsec.InvalidArgument):
        client.import_image(str(junk), name=_name("junk"))


@pytest.mark.parametrize("bad", ["", "../x", "with space", "a\nb"])
def test_bad_image_name(client: dsec.Client, busybox_rootfs: Path, bad: str) -> None:
    with pytest.raises(dsec.InvalidArgument):
        img = client.import_image(str(busybox_rootfs), name=bad)
        client.delete_image(img.name)
