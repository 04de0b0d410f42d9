"""What the server stores on the host, attacked as a host user would (issue 20, item 3).

A sandbox's agent is root inside it, and snapshots and forks store its writable layer on the
host faithfully: a setuid-root file or a file capability it made is kept. So is one that an
imported image carries. Any unprivileged host user who can reach such a file runs it as root
unless the server keeps it out of reach (a private state directory) and powerless (a
``nosuid,nodev`` mount). The tests below are the attack: a fresh host user (``useradd``)
tries to run what a sandbox planted, first as the server leaves it, then after someone
loosened the state directory's permissions. Device nodes in images are the same class of
hole, inside the sandbox: dsec has no device cgroup, so its root overlay is ``nodev``.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dsec
import pytest
from dsec_testlib import Server, make_tempdir, mounts_under, safe_rmtree, wait_until

SETCAP = shutil.which("setcap") or "/usr/sbin/setcap"
#: Host tools copied into the test image with their libraries: (host path, path in image).
HOST_TOOLS = [
    ("/usr/bin/id", "/opt/host/id"),
    ("/usr/bin/cat", "/opt/host/cat"),
    (SETCAP, "/opt/host/setcap"),
    (shutil.which("getcap") or "/usr/sbin/getcap", "/opt/host/getcap"),
]
#: What the "untrusted import" plants: a setuid-root id and a cat that may read anything.
EVIL_ID = "/opt/evil/id"
EVIL_CAT = "/opt/evil/cat"
READ_ANYTHING = "cap_dac_read_search+ep"


@dataclass
class HostUser:
    name: str
    uid: int
    gid: int

    def run(
        self, argv: list[str]
    ) -> subprocess.CompletedProcess[str] | PermissionError:
        """Runs ``argv`` as this user (no supplementary groups); a path it cannot reach
        comes back as the PermissionError the exec raised."""
        try:
            return subprocess.run(
                argv,
                check=False,
                user=self.uid,
                group=self.gid,
                extra_groups=[],
                capture_output=True,
                text=True,
                timeout=10,
                cwd="/",
            )
        except PermissionError as e:
            return e


@pytest.fixture(scope="module")
def host_user() -> Iterator[HostUser]:
    """An unprivileged host user made for these tests, removed after them."""
    name = f"dsecprobe{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["useradd", "--no-create-home", "--user-group", "--shell", "/bin/sh", name],
        check=True,
        capture_output=True,
    )
    try:
        ids = subprocess.run(
            ["id", "-u", name], check=True, capture_output=True, text=True
        ).stdout.strip()
        gid = subprocess.run(
            ["id", "-g", name], check=True, capture_output=True, text=True
        ).stdout.strip()
        yield HostUser(name, int(ids), int(gid))
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)


@pytest.fixture(scope="module")
def open_base() -> Iterator[Path]:
    """A temp directory every host user may traverse: only the state directory inside it
    stands between them and the store."""
    d = make_tempdir("dsec-exposure-")
    d.chmod(0o755)
    yield d
    safe_rmtree(d)


@pytest.fixture(scope="module")
def server(open_base: Path) -> Iterator[Server]:
    state = open_base / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)  # as an operator might have left it
    s = Server(state, log_path=open_base / "server.log")
    s.start()
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[dsec.Client]:
    with server.client() as c:
        yield c


def _copy_with_libs(rootfs: Path, host_path: str, image_path: str) -> None:
    """Copies a dynamically linked host binary and the libraries it loads into ``rootfs``."""
    shutil.copy2(host_path, rootfs / image_path.lstrip("/"))
    ldd = subprocess.run(["ldd", host_path], check=True, capture_output=True, text=True)
    for line in ldd.stdout.splitlines():
        words = line.split()
        lib = words[2] if "=>" in words else words[0]
        if not lib.startswith("/"):
            continue  # linux-vdso
        dest = rootfs / lib.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.exists():
            shutil.copy(lib, dest)


@pytest.fixture(scope="module")
def tools_image(client: dsec.Client, busybox_rootfs: Path, open_base: Path) -> str:
    """busybox plus the host's id, cat, setcap and getcap, and what an untrusted image
    plants: a setuid-root id, a cat with CAP_DAC_READ_SEARCH, host device nodes."""
    rootfs = open_base / "tools-rootfs"
    subprocess.run(["cp", "-a", str(busybox_rootfs), str(rootfs)], check=True)
    for d in ("opt/host", "opt/evil"):
        (rootfs / d).mkdir(parents=True)
    for host_path, image_path in HOST_TOOLS:
        _copy_with_libs(rootfs, host_path, image_path)
    shutil.copy2("/usr/bin/id", rootfs / EVIL_ID.lstrip("/"))
    os.chmod(rootfs / EVIL_ID.lstrip("/"), 0o4755)
    shutil.copy2("/usr/bin/cat", rootfs / EVIL_CAT.lstrip("/"))
    subprocess.run(
        [SETCAP, READ_ANYTHING, str(rootfs / EVIL_CAT.lstrip("/"))], check=True
    )
    # /dev/null's numbers under another name, and a loop device when the host has one.
    os.mknod(rootfs / "opt/evil/null", 0o20666, os.makedev(1, 3))
    if os.path.exists("/dev/loop0"):
        os.mknod(rootfs / "opt/evil/loop0", 0o60666, os.makedev(7, 0))
    return str(client.import_image(str(rootfs), name="tools").name)


def _stored_copies(server: Server, image_path: str) -> list[Path]:
    """Every copy of ``image_path`` the host can see under the state directory (searched
    as root): in the layers the server has mounted for its sandboxes."""
    suffix = image_path.lstrip("/")
    found = []
    for dirpath, _dirs, files in os.walk(server.state_dir / "images"):
        for name in files:
            p = Path(dirpath, name)
            if str(p).endswith("/" + suffix):
                found.append(p)
    return found


def _loosen(server: Server, path: Path) -> None:
    """What an operator's `chmod -R go+rx` does to the directories down to ``path``."""
    d = path.parent
    while True:
        try:
            d.chmod(0o755)
        except OSError as e:  # inside a read-only layer: its modes are the image's
            if e.errno != errno.EROFS:
                raise
        if d == server.state_dir:
            return
        d = d.parent


def _assert_blobs_unreadable(server: Server, user: HostUser) -> None:
    """The layer blobs themselves (the images' content) are the server's alone."""
    blobs = list((server.state_dir / "images/layers/sha256").glob("*.erofs"))
    assert blobs
    for blob in blobs:
        assert blob.stat().st_mode & 0o077 == 0, f"{blob} is readable by others"
        r = user.run(["/bin/cat", str(blob)])
        assert isinstance(r, PermissionError) or r.returncode != 0, (
            f"{user.name} read {blob}"
        )


def _assert_powerless(user: HostUser, id_path: Path, cat_path: Path) -> None:
    """Neither the setuid id nor the capable cat gives the user anything."""
    r = user.run([str(id_path)])
    if not isinstance(r, PermissionError):
        assert r.returncode == 0, r.stderr
        assert f"uid={user.uid}(" in r.stdout, r.stdout
        assert "euid=0" not in r.stdout, f"{id_path} ran as root: {r.stdout}"
    r = user.run([str(cat_path), "/etc/shadow"])
    if not isinstance(r, PermissionError):
        assert r.returncode != 0, f"{cat_path} read /etc/shadow as {user.name}"
        assert "Permission denied" in r.stderr, r.stderr


def test_state_directory_is_private(server: Server, host_user: HostUser) -> None:
    assert server.state_dir.stat().st_mode & 0o7777 == 0o700, "not tightened at start"
    assert server.state_dir.stat().st_uid == 0
    # Whatever lies beneath — trajectory.db, images, VM disks — is out of the user's reach.
    for entry in ["trajectory.db", "images", "sandboxes", "lock"]:
        r = host_user.run(["/bin/cat", str(server.state_dir / entry)])
        assert isinstance(r, PermissionError) or "Permission denied" in r.stderr, r
    flags = os.statvfs(server.state_dir / "images").f_flag
    assert flags & os.ST_NOSUID and flags & os.ST_NODEV, "the store is not nosuid,nodev"


def test_state_directory_owned_by_another_user_is_refused(
    host_user: HostUser,
) -> None:
    base = make_tempdir("dsec-exposure-owner-")
    try:
        state = base / "state"
        state.mkdir()
        os.chown(state, host_user.uid, host_user.gid)
        s = Server(state, log_path=base / "server.log")
        proc = s.spawn()
        try:
            assert proc.wait(20) != 0
        finally:
            s.kill9()
        log = s.log_tail()
        assert f"owned by uid {host_user.uid}" in log and "chown it" in log, log
    finally:
        safe_rmtree(base)


def test_setuid_and_capabilities_through_snapshot_and_fork_are_inert_on_the_host(
    client: dsec.Client, server: Server, tools_image: str, host_user: HostUser
) -> None:
    name = f"planted-{uuid.uuid4().hex[:8]}"
    sb = client.create(image=tools_image)
    kids: list[dsec.Sandbox] = []
    try:
        r = sb.run(
            "cp /opt/host/id /work/id && chmod 4755 /work/id"
            f" && cp /opt/host/cat /work/cat && /opt/host/setcap {READ_ANYTHING} /work/cat"
            " && stat -c '%a %u' /work/id && /opt/host/getcap /work/cat"
        )
        assert r.exit_code == 0, r.stderr
        assert r.stdout.startswith("4755 0\n") and "cap_dac_read_search" in r.stdout
        sb.snapshot(name)
        sb.run("touch /work/after-snapshot")  # so that the fork's layer is another one
        kids = sb.fork(1)
        restored = client.create(image=name)
        kids.append(restored)

        # Layers are EROFS blobs; the files appear as files on the host only where the
        # edge mounted a layer for the sandboxes built on it: those are the targets.
        ids = _stored_copies(server, "/work/id")
        assert len(ids) == 2, f"snapshot and fork each have a mounted layer: {ids}"
        for id_path in ids:
            cat_path = id_path.with_name("cat")
            assert id_path.stat().st_mode & 0o4000, "the layer keeps the setuid bit"
            assert os.getxattr(cat_path, "security.capability")
            # As the server leaves it: the user cannot even reach the files.
            server.state_dir.chmod(0o700)
            assert isinstance(host_user.run([str(id_path)]), PermissionError)
            _assert_powerless(host_user, id_path, cat_path)
            # Loosened permissions: reachable, still powerless (nosuid).
            _loosen(server, id_path)
            _loosen(server, cat_path)
            assert not isinstance(host_user.run([str(id_path)]), PermissionError)
            _assert_powerless(host_user, id_path, cat_path)
        _assert_blobs_unreadable(server, host_user)

        # Inside sandboxes the copies are faithful.
        for copy in kids:
            r = copy.run("stat -c '%a %u' /work/id; /opt/host/getcap /work/cat")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.startswith("4755 0\n"), r.stdout
            assert "cap_dac_read_search" in r.stdout, r.stdout
    finally:
        server.state_dir.chmod(0o700)
        sb.stop()
        for k in kids:
            k.stop()
        for img in client.images():
            if img.name == name or img.name.startswith(sb.id + "-fork-"):
                client.delete_image(img.name)


def test_setuid_and_capabilities_of_an_imported_image_are_inert_on_the_host(
    client: dsec.Client, server: Server, tools_image: str, host_user: HostUser
) -> None:
    with client.create(image=tools_image) as sb:
        ids = _stored_copies(server, EVIL_ID)
        assert ids, "the import keeps the planted files"
        try:
            for id_path in ids:
                cat_path = id_path.with_name("cat")
                server.state_dir.chmod(0o700)
                assert isinstance(host_user.run([str(id_path)]), PermissionError)
                _loosen(server, id_path)
                _loosen(server, cat_path)
                _assert_powerless(host_user, id_path, cat_path)
            _assert_blobs_unreadable(server, host_user)
        finally:
            server.state_dir.chmod(0o700)
        r = sb.run(f"stat -c '%a %u' {EVIL_ID}; /opt/host/getcap {EVIL_CAT}")
        assert r.stdout.startswith("4755 0\n") and "cap_dac_read_search" in r.stdout


def test_device_nodes_of_an_image_do_not_open_in_the_sandbox(
    client: dsec.Client, tools_image: str
) -> None:
    nodes = ["/opt/evil/null"] + (
        ["/opt/evil/loop0"] if os.path.exists("/dev/loop0") else []
    )
    with client.create(image=tools_image) as sb:
        for node in nodes:
            r = sb.run(f"ls -l {node} && cat {node}")
            assert r.exit_code != 0, f"{node} opened in the sandbox: {r.stdout}"
            assert "Permission denied" in r.stderr, r.stderr
        # The sandbox's own /dev still works.
        r = sb.run("echo x > /dev/null && head -c 4 /dev/zero | wc -c")
        assert r.exit_code == 0 and r.stdout.strip() == "4", r.stderr


#: Where a root's builder mounts or makes directories, as a link an image may carry
#: (relative or to a host directory), and the backend that builds it.
LINKED_MOUNT_POINTS = [
    ("dev", "container", "host"),
    ("proc", "container", "tmp"),
    ("sys", "container", "host"),
    (".dsec", "fncall", "host"),
    (".dsec/layers", "fncall", "host"),
]


@pytest.mark.parametrize(("link", "backend", "to"), LINKED_MOUNT_POINTS)
def test_a_link_an_image_carries_where_the_root_is_built_is_refused(
    client: dsec.Client,
    busybox_rootfs: Path,
    open_base: Path,
    link: str,
    backend: str,
    to: str,
) -> None:
    """The root is built before the pivot, where a link is followed from the host's `/`:
    an image whose `/.dsec` led to a host directory had each fncall worker make its
    directories there, and a linked `/dev`, `/proc` or `/sys` put the mount elsewhere.
    Such an image is refused, saying which path, and nothing lands on the host."""
    tag = link.replace("/", "-").strip(".-")
    probe = open_base / f"probe-{tag}"
    probe.mkdir()
    rootfs = open_base / f"linked-{tag}-rootfs"
    subprocess.run(["cp", "-a", str(busybox_rootfs), str(rootfs)], check=True)
    path = rootfs / link
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        shutil.rmtree(path)
    path.symlink_to(probe if to == "host" else to)
    image = client.import_image(str(rootfs), name=f"linked-{tag}").name
    try:
        with pytest.raises(dsec.InvalidArgument) as refused:
            if backend == "fncall":
                client.call(["/bin/true"], image=image, timeout=30)
            else:
                client.create(image=image).stop()
        message = str(refused.value)
        assert "symbolic link" in message and f" /{link}:" in message, message
        assert list(probe.iterdir()) == [], "the root's builder wrote on the host"
    finally:
        client.delete_image(image)
        safe_rmtree(rootfs)


def test_store_mounts_are_adopted_after_a_crash_and_gone_after_stop(
    server: Server,
) -> None:
    store = server.state_dir / "images"
    flags = os.statvfs(server.state_dir.parent).f_flag
    if flags & os.ST_NOSUID and flags & os.ST_NODEV:
        pytest.skip(
            "the test directory is on a nosuid,nodev filesystem: nothing to seal"
        )

    def at(path: Path) -> int:
        return sum(1 for m in mounts_under(store) if m == str(path))

    layers = [m for m in mounts_under(store / "mnt") if m != str(store / "mnt")]
    assert at(store) == 1 and at(store / "mnt") == 1 and layers, mounts_under(store)
    server.kill9()
    assert at(store) == 1, "a killed server cannot unmount"
    server.restart()
    assert at(store) == 1 and at(store / "mnt") == 1, f"stacked: {mounts_under(store)}"
    assert not [m for m in mounts_under(store / "mnt") if m != str(store / "mnt")], (
        "the crashed server's layer mounts are still there"
    )
    os.kill(server.pid, signal.SIGTERM)
    assert server.proc is not None
    server.proc.wait(20)
    assert wait_until(lambda: not mounts_under(store), 5), mounts_under(store)
    assert not (server.state_dir / "images.mount").exists()
    server.restart()  # the module's remaining users (teardown) expect it running
