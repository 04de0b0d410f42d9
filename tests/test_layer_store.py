"""The layer store (issue 14): EROFS blobs, many layers, sharing between servers, garbage
collection, disk usage, import progress, and a store that is corrupt, full, read-only or
gone. Every server here is real; stores on their own filesystems are tmpfs mounts made by
the tests and unmounted by them."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dsec
import httpx
import pytest
from dsec_testlib import (
    BACKENDS,
    DSEC_BIN,
    VM_BACKENDS,
    Server,
    make_tempdir,
    mounts_under,
    safe_rmtree,
)

# ------------------------------------------------------------------ building images


def _tar(entries: list[tuple[str, bytes | None]]) -> bytes:
    """A layer tar: (path, content) files, (path, None) directories."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for path, data in entries:
            info = tarfile.TarInfo(path)
            info.mtime = 1_700_000_000
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                t.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _rootfs_tar(rootfs: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        t.add(str(rootfs), arcname=".")
    return buf.getvalue()


def _docker_save(
    path: Path, layers: list[bytes], *, digest_names: bool = False
) -> None:
    """A legacy `docker save` archive of ``layers`` (bottom first)."""
    diff_ids = ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers]
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    names = [
        f"blobs/sha256/{d[7:]}" if digest_names else f"{i:064x}/layer.tar"
        for i, d in enumerate(diff_ids)
    ]
    manifest = json.dumps([{"Config": config_name, "RepoTags": [], "Layers": names}])
    with tarfile.open(path, "w") as t:
        for name, data in [(config_name, config), ("manifest.json", manifest.encode())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for name, data in zip(names, layers, strict=True):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def _members(path: Path) -> dict[str, bytes]:
    """The files of a tar archive, by name."""
    out = {}
    with tarfile.open(path) as t:
        for m in t.getmembers():
            f = t.extractfile(m)
            if f is not None:
                out[m.name] = f.read()
    return out


def _write_tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def _name(kind: str) -> str:
    return f"ls-{kind}-{uuid.uuid4().hex[:8]}"


def _blobs(store: Path) -> set[str]:
    return {p.name for p in (store / "layers/sha256").glob("*.erofs")}


def _temporaries(store: Path) -> list[str]:
    return [
        p.name for p in (store / "layers/sha256").iterdir() if p.name.startswith(".")
    ]


def _prune(server: Server) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/store/prune", timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.fixture(scope="module")
def base_layer(busybox_rootfs: Path) -> bytes:
    return _rootfs_tar(busybox_rootfs)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path``, unmounted (lazily, if busy) at the end."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        check=True,
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


# ------------------------------------------------------------------ layers and their count


def test_an_image_of_130_layers_starts(
    client: dsec.Client, base_layer: bytes, tmp_path: Path
) -> None:
    layers = [base_layer]
    for i in range(1, 130):
        entries: list[tuple[str, bytes | None]] = [
            ("l", None),
            (f"l/{i}", f"{i}\n".encode()),
        ]
        if i == 100:
            entries.append(("l/.wh.7", b""))  # a deletion many layers up
        layers.append(_tar(entries))
    archive = tmp_path / "deep.tar"
    _docker_save(archive, layers)
    name = _name("deep")
    img = client.import_image(str(archive), name=name)
    try:
        assert len(img.layers) == 130
        with client.create(image=name) as sb:
            r = sb.run("ls /l | wc -l; cat /l/1 /l/129; ls /l/7")
            assert r.stdout.startswith("128\n1\n129\n"), (r.stdout, r.stderr)
            assert "No such file" in r.stderr
    finally:
        client.delete_image(name)


def _stacked_layers(base_layer: bytes, extra: int) -> list[bytes]:
    """busybox, then a layer with /s/a and /s/d/old, one that deletes /s/a (a whiteout)
    and makes /s/d opaque with /s/d/new, then ``extra`` layers adding /s/n/<i>."""
    opaque = tarfile.TarInfo("s/d/.wh..wh..opq")
    opaque.mtime = 1_700_000_000
    second = io.BytesIO()
    with tarfile.open(fileobj=second, mode="w", format=tarfile.PAX_FORMAT) as t:
        for path, data in [("s/.wh.a", b""), ("s/d/new", b"new\n")]:
            info = tarfile.TarInfo(path)
            info.size, info.mtime = len(data), 1_700_000_000
            t.addfile(info, io.BytesIO(data))
        t.addfile(opaque, io.BytesIO(b""))
    layers = [
        base_layer,
        _tar([("s", None), ("s/a", b"a\n"), ("s/d", None), ("s/d/old", b"old\n")]),
        second.getvalue(),
    ]
    layers += [_tar([("s/n", None), (f"s/n/{i}", b"")]) for i in range(extra)]
    return layers


@pytest.mark.parametrize("extra", [1, 20], ids=["4-layers", "23-layers"])
def test_vm_guests_stack_the_layer_blobs_in_place(
    server: Server, client: dsec.Client, base_layer: bytes, tmp_path: Path, extra: int
) -> None:
    """A VM guest is given an image's layer blobs as its disks, as the store keeps them,
    and stacks them as a container's overlay does (whiteouts, opaque directories): no
    merged copy of the image is made. Past guest::MAX_IMAGE_DISKS layers it gets one merged
    disk instead, with the same tree."""
    vms = sorted(VM_BACKENDS & set(BACKENDS))
    if not vms:
        pytest.skip("no VM backend under test (DSEC_TEST_BACKENDS)")
    archive = tmp_path / "stacked.tar"
    _docker_save(archive, _stacked_layers(base_layer, extra))
    name = _name("stacked")
    img = client.import_image(str(archive), name=name)
    merged_disk = server.state_dir / "vm" / "disks" / img.id.replace(":", "-")
    try:
        for backend in ["container", *vms]:
            with client.create(image=name, backend=backend) as sb:
                r = sb.run("ls /s; ls /s/d; ls /s/n | wc -l; cat /s/d/new")
                assert r.stdout == f"d\nn\nnew\n{extra}\nnew\n", (backend, r.stdout, r.stderr)
        merged = list(merged_disk.parent.glob(merged_disk.name + ".*"))
        assert bool(merged) == (extra == 20), merged
    finally:
        client.delete_image(name)


def test_more_layers_than_overlayfs_stacks_are_refused_at_import(
    client: dsec.Client, tmp_path: Path
) -> None:
    archive = tmp_path / "too-deep.tar"
    _docker_save(archive, [_tar([(f"f{i}", b"x")]) for i in range(501)])
    with pytest.raises(dsec.InvalidArgument) as e:
        client.import_image(str(archive), name=_name("too-deep"))
    assert "501 layers" in str(e.value) and "at most 500" in str(e.value)


# ------------------------------------------------------------------ garbage collection


def test_a_deleted_image_in_use_keeps_its_layer_until_its_sandbox_stops(
    client: dsec.Client, server: Server, base_layer: bytes, tmp_path: Path
) -> None:
    archive = tmp_path / "inuse.tar"
    payload = os.urandom(3 << 20)
    _docker_save(archive, [base_layer, _tar([("data", payload)])])
    name = _name("inuse")
    img = client.import_image(str(archive), name=name)
    top = img.layers[-1][7:] + ".erofs"
    store = server.state_dir / "images"
    assert top in _blobs(store)
    assert img.raw["disk_bytes"] >= len(payload)
    sb = client.create(image=name)
    try:
        client.delete_image(name)
        _prune(server)
        assert top in _blobs(store), "a layer a sandbox runs on was pruned"
        r = sb.run("sha256sum /data")
        assert r.stdout.split()[0] == hashlib.sha256(payload).hexdigest()
    finally:
        sb.stop()
    _prune(server)
    assert top not in _blobs(store)


def test_fork_images_are_collected_once_their_sandboxes_are_gone(
    client: dsec.Client, busybox_image: str
) -> None:
    keep = _name("kept-snapshot")
    with client.create(image=busybox_image) as sb:
        sb.run("echo forked > /root/state")
        kids = sb.fork(2)
        sb.snapshot(keep)
        forks = [i for i in client.images() if i.raw.get("fork_of") == sb.id]
        assert len(forks) == 1 and forks[0].name.startswith(sb.id + "-fork-")
        try:
            pruned = httpx.post(f"{client.url}/v1/store/prune", timeout=60).json()
            assert forks[0].name not in pruned["images"], "its children still run"
            assert kids[0].read_file("/root/state") == b"forked\n"
        finally:
            for k in kids:
                k.stop()
        pruned = httpx.post(f"{client.url}/v1/store/prune", timeout=60).json()
        assert pruned["images"] == [forks[0].name]
        names = {i.name for i in client.images()}
        assert forks[0].name not in names
        assert keep in names, "a named snapshot is never collected"
    client.delete_image(keep)


def test_disk_usage_per_image_and_for_the_store(
    client: dsec.Client, busybox_image: str, server: Server
) -> None:
    img = client.get_image(busybox_image)
    assert img.raw["disk_bytes"] > 1_000_000
    store = httpx.get(server.url + "/v1/store", timeout=30, trust_env=False).json()
    assert store["layers"] >= 1 and store["layer_bytes"] >= img.raw["disk_bytes"]
    assert store["root"] == str(server.state_dir / "images")
    ls = subprocess.run(
        [str(DSEC_BIN), "image", "ls", "--url", server.url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert busybox_image in ls and "on disk (shared layers once)" in ls
    pruned = subprocess.run(
        [str(DSEC_BIN), "image", "prune", "--url", server.url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "removed" in pruned and "layers" in pruned


def test_import_reports_progress_layer_by_layer(
    server: Server, base_layer: bytes, tmp_path: Path
) -> None:
    archive = tmp_path / "progress.tar"
    _docker_save(
        archive, [base_layer] + [_tar([(f"p{i}", os.urandom(64))]) for i in range(9)]
    )
    name = _name("progress")
    events = []
    with httpx.stream(
        "POST",
        server.url + "/v1/images",
        json={"source": str(archive), "name": name},
        headers={"Accept": "application/x-ndjson"},
        timeout=120,
        trust_env=False,
    ) as r:
        for line in r.iter_lines():
            if line:
                events.append(json.loads(line))
    assert events[0] == {"event": "layers", "total": 10}
    assert [e["event"] for e in events[1:]] == ["layer"] * 10 + ["done"]
    assert events[-1]["image"]["name"] == name
    # The CLI draws a bar from the same events and ends with the image line.
    cli = subprocess.run(
        [
            str(DSEC_BIN),
            "image",
            "import",
            str(archive),
            "--name",
            name + "-2",
            "--url",
            server.url,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert cli.stdout.startswith(name + "-2 sha256:"), cli.stdout
    for n in (name, name + "-2"):
        httpx.delete(f"{server.url}/v1/images/{n}", trust_env=False)


# ------------------------------------------------------------------ bad input


def test_truncated_and_mismatched_layers_leave_nothing(
    client: dsec.Client, server: Server, base_layer: bytes, tmp_path: Path
) -> None:
    store = server.state_dir / "images"
    before = _blobs(store)
    cut = tmp_path / "cut.tar"
    good = _tar([("big", os.urandom(1 << 20))])
    _docker_save(cut, [good])
    # Truncate the layer inside the archive: rewrite it with half the layer's bytes.
    members = _members(cut)
    layer_name = next(n for n in members if n.endswith("layer.tar"))
    members[layer_name] = members[layer_name][: len(good) // 2]
    _write_tar(cut, members)
    with pytest.raises(dsec.InvalidArgument) as e:
        client.import_image(str(cut), name=_name("cut"))
    assert "corrupt" in str(e.value)
    # A blob named by a digest it does not have.
    mismatch = tmp_path / "mismatch.tar"
    _docker_save(mismatch, [good], digest_names=True)
    members = _members(mismatch)
    blob = next(n for n in members if n.startswith("blobs/"))
    members["blobs/sha256/" + "0" * 64] = members.pop(blob)
    manifest = json.loads(members["manifest.json"])
    manifest[0]["Layers"] = ["blobs/sha256/" + "0" * 64]
    members["manifest.json"] = json.dumps(manifest).encode()
    _write_tar(mismatch, members)
    with pytest.raises(dsec.InvalidArgument) as e:
        client.import_image(str(mismatch), name=_name("mismatch"))
    assert "does not match its digest" in str(e.value)
    assert _blobs(store) == before
    assert not _temporaries(store)
    assert not list((store / "staging").iterdir())


def test_a_damaged_blob_fails_only_the_sandboxes_that_need_it(
    client: dsec.Client,
    server: Server,
    busybox_image: str,
    base_layer: bytes,
    tmp_path: Path,
) -> None:
    archive = tmp_path / "damaged.tar"
    _docker_save(archive, [base_layer, _tar([("mine", b"mine")])])
    name = _name("damaged")
    img = client.import_image(str(archive), name=name)
    try:
        blob = (
            server.state_dir / "images/layers/sha256" / (img.layers[-1][7:] + ".erofs")
        )
        blob.write_bytes(blob.read_bytes()[:512])
        with pytest.raises(dsec.InvalidArgument) as e:
            client.create(image=name)
        assert "damaged" in str(e.value) and name in str(e.value)
        with client.create(image=busybox_image) as sb:  # everything else still works
            assert sb.run("echo ok").stdout == "ok\n"
    finally:
        client.delete_image(name)


@pytest.fixture
def store_server(
    busybox_rootfs: Path,
) -> Iterator[Callable[..., tuple[Server, Path]]]:
    """Servers whose layer store is a tmpfs of the given size (made and unmounted here)."""
    made: list[tuple[Server, Path, contextlib.ExitStack]] = []

    def make(size: str = "64m") -> tuple[Server, Path]:
        base = make_tempdir("dsec-store-")
        stack = contextlib.ExitStack()
        store = stack.enter_context(_tmpfs(base / "store", size))
        s = Server(
            base / "state",
            log_path=base / "server.log",
            extra_args=["--layer-store", str(store)],
        )
        made.append((s, base, stack))
        s.start()
        return s, store

    yield make
    for s, base, stack in made:
        s.cleanup()
        stack.close()
        safe_rmtree(base)


def test_a_full_store_refuses_the_import_and_keeps_nothing_half_written(
    store_server: Callable[..., tuple[Server, Path]],
    busybox_rootfs: Path,
    tmp_path: Path,
) -> None:
    server, store = store_server("8m")
    with server.client() as c:
        big = tmp_path / "big.tar"
        _docker_save(big, [_tar([("noise", os.urandom(12 << 20))])])
        with pytest.raises(dsec.Unavailable) as e:
            c.import_image(str(big), name="big")
        assert "is full" in str(e.value) and str(store) in str(e.value)
        assert not _blobs(store) and not _temporaries(store)
        assert not c.images()
        c.import_image(str(busybox_rootfs), name="busybox")  # what fits still goes in
        with c.create(image="busybox") as sb:
            assert sb.run("echo ok").stdout == "ok\n"


def test_a_read_only_store_refuses_imports_and_still_serves_its_images(
    store_server: Callable[..., tuple[Server, Path]],
    busybox_rootfs: Path,
    tmp_path: Path,
) -> None:
    server, store = store_server()
    with server.client() as c:
        c.import_image(str(busybox_rootfs), name="busybox")
        subprocess.run(["mount", "-o", "remount,ro", str(store)], check=True)
        other = tmp_path / "other.tar"
        _docker_save(other, [_tar([("x", b"x")])])
        with pytest.raises(dsec.Unavailable) as e:
            c.import_image(str(other), name="other")
        assert "read-only" in str(e.value)
        with c.create(image="busybox") as sb:
            assert sb.run("echo ok").stdout == "ok\n"
        subprocess.run(["mount", "-o", "remount,rw", str(store)], check=True)


def test_a_store_that_vanishes_fails_only_new_work(
    store_server: Callable[..., tuple[Server, Path]], busybox_rootfs: Path
) -> None:
    server, store = store_server()
    with server.client() as c:
        c.import_image(str(busybox_rootfs), name="busybox")
        sb = c.create(image="busybox")
        subprocess.run(["umount", "-l", str(store)], check=True)
        try:
            # The running sandbox keeps its mounted layer.
            assert sb.run("ls /bin | wc -l && cat /etc/group | head -1").exit_code == 0
            with pytest.raises(dsec.Unavailable) as e:
                c.create(image="busybox")
            assert "not reachable" in str(e.value)
            assert (
                httpx.get(server.url + "/healthz", trust_env=False).status_code == 200
            )
        finally:
            sb.stop()


# ------------------------------------------------------------------ a store shared by servers


def _share_scenario(
    a: Server, b: Server, store: Path, base_layer: bytes, tmp: Path
) -> None:
    """What two servers sharing one layer store must get right."""
    archive = tmp / "shared.tar"
    payload = os.urandom(2 << 20)
    _docker_save(archive, [base_layer, _tar([("payload", payload)])])
    with a.client() as ca, b.client() as cb:
        # Both import the same image at once: one blob per layer, no temporaries.
        results: list[Any] = []
        threads = [
            threading.Thread(
                target=lambda c=c: results.append(
                    c.import_image(str(archive), name="shared")
                )
            )
            for c in (ca, cb)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 2 and results[0].layers == results[1].layers
        layers = results[0].layers
        assert _blobs(store) == {d[7:] + ".erofs" for d in layers}
        assert not _temporaries(store)
        # B starts from what A wrote: nothing to pull or unpack.
        sb = cb.create(image="shared")
        try:
            ca.delete_image("shared")
            assert _prune(a)["layers"] == 0, "B's running sandbox holds the layers"
            assert (
                sb.run("sha256sum /payload").stdout.split()[0]
                == hashlib.sha256(payload).hexdigest()
            )
        finally:
            sb.stop()
        # B lets go of its mounts and says so in its lease: then either prune collects.
        assert _prune(b)["layers"] + _prune(a)["layers"] == 2
        assert not _blobs(store)


def test_two_servers_share_a_layer_store(base_layer: bytes) -> None:
    base = make_tempdir("dsec-shared-")
    servers = []
    try:
        store = base / "store"
        for edge in ("a", "b"):
            s = Server(
                base / f"state-{edge}",
                log_path=base / f"server-{edge}.log",
                extra_args=["--layer-store", str(store), "--edge-name", f"e{edge}"],
            )
            servers.append(s)
            s.start()
        _share_scenario(servers[0], servers[1], store, base_layer, base)
    finally:
        for s in servers:
            s.cleanup()
        safe_rmtree(base)


def _nfs_unavailable() -> str | None:
    subprocess.run(["modprobe", "nfsd"], capture_output=True, check=False)
    subprocess.run(["modprobe", "nfs"], capture_output=True, check=False)
    filesystems = Path("/proc/filesystems").read_text().split()
    missing = [fs for fs in ("nfsd", "nfs") if fs not in filesystems]
    if missing:
        return (
            f"this kernel has no {' or '.join(missing)} support (not built, no module)"
        )
    return None


@contextlib.contextmanager
def _nfs_export(export: Path, mountpoint: Path) -> Iterator[Path]:
    """``export`` served by the kernel's NFS server (v4, loopback only) and mounted at
    ``mountpoint``; the server's daemons are started here and stopped by pid."""
    for tool in ("exportfs", "rpc.nfsd", "rpc.mountd"):
        if shutil.which(tool) is None:
            pytest.fail(
                f"{tool} is missing: scripts/setup.sh installs nfs-kernel-server"
            )
    if not os.path.ismount("/proc/fs/nfsd"):
        subprocess.run(["mount", "-t", "nfsd", "nfsd", "/proc/fs/nfsd"], check=True)
    mountd = subprocess.Popen(["rpc.mountd", "--foreground", "--no-nfs-version", "3"])
    export.mkdir(parents=True, exist_ok=True)
    mountpoint.mkdir(parents=True, exist_ok=True)
    spec = f"127.0.0.1:{export}"
    try:
        subprocess.run(["rpc.nfsd", "--no-nfs-version", "3", "4"], check=True)
        subprocess.run(
            [
                "exportfs",
                "-i",
                "-o",
                "rw,sync,no_root_squash,no_subtree_check,fsid=7731",
                spec,
            ],
            check=True,
        )
        subprocess.run(
            [
                "mount",
                "-t",
                "nfs4",
                "-o",
                "vers=4.2",
                f"127.0.0.1:{export}",
                str(mountpoint),
            ],
            check=True,
        )
        yield mountpoint
    finally:
        subprocess.run(
            ["umount", "-l", str(mountpoint)], capture_output=True, check=False
        )
        subprocess.run(["exportfs", "-u", spec], capture_output=True, check=False)
        subprocess.run(["rpc.nfsd", "0"], capture_output=True, check=False)
        mountd.terminate()
        mountd.wait(10)


def test_two_servers_share_a_layer_store_over_nfs(base_layer: bytes) -> None:
    reason = _nfs_unavailable()
    if reason is not None:
        pytest.skip(f"NFS: {reason}")
    base = make_tempdir("dsec-nfs-")
    servers = []
    try:
        with _nfs_export(base / "export", base / "nfs") as store:
            for edge in ("a", "b"):
                s = Server(
                    base / f"state-{edge}",
                    log_path=base / f"server-{edge}.log",
                    extra_args=["--layer-store", str(store), "--edge-name", f"e{edge}"],
                )
                servers.append(s)
                s.start()
            _share_scenario(servers[0], servers[1], store, base_layer, base)
            for s in servers:
                s.cleanup()
            assert not [m for m in mounts_under(base) if "/state-" in m]
    finally:
        for s in servers:
            s.cleanup()
        safe_rmtree(base)
