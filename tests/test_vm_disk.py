"""Bootable disk images for the `vm` backend: a user's own qcow2 or raw disk, with its own
bootloader, kernel and init, imported as an image and booted by QEMU's firmware; the
guest's `dsec-agent --service` serves the same SDK. The disk is the one
`scripts/make-vm-disk.sh` builds (Debian bookworm; `scripts/setup.sh` builds it once, as
the `vm-disk` feature). One guest boots for the whole module: a systemd boot under TCG
takes tens of seconds."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import dsec
import pytest
from dsec_testlib import Server, assert_no_leftovers, qemu_procs, require

VM_DISK = Path(os.environ.get("DSEC_TEST_VM_DISK", "/var/tmp/dsec-test-vm-disk.qcow2"))


def _vm_under_test() -> None:
    backends = os.environ.get("DSEC_TEST_BACKENDS", "container").split(",")
    if "vm" not in backends:
        pytest.skip("the vm backend is not under test (DSEC_TEST_BACKENDS)")


@pytest.fixture(scope="module")
def disk_image(client: dsec.Client) -> str:
    """The built disk, imported as "test-vm-disk"."""
    _vm_under_test()
    require(
        "vm-disk",
        None if VM_DISK.is_file() else f"no disk at {VM_DISK} (scripts/make-vm-disk.sh)",
    )
    img = client.import_image(str(VM_DISK), name="test-vm-disk")
    assert img.disk is not None and img.disk["format"] == "qcow2"
    assert img.disk["virtual_size"] > 100 << 20
    assert len(img.layers) == 1
    return img.name


def test_a_bootable_disk_serves_the_sdk_from_its_own_system(
    client: dsec.Client, server: Server, disk_image: str
) -> None:
    t0 = time.monotonic()
    sb = client.create(backend="vm", image=disk_image, memory_mb=512, disk_mb=1024)
    boot_s = time.monotonic() - t0
    print(f"disk image: create (firmware, kernel, systemd, agent) took {boot_s:.1f} s")
    try:
        assert sb.info().accelerator in ("kvm", "tcg")
        r = sb.run(
            "cat /etc/os-release; cat /etc/dsec-vm-disk; uname -r; cat /proc/1/comm; hostname"
        )
        assert r.exit_code == 0, r.stderr
        out = r.stdout
        # The disk's own distribution, kernel and init (dsec's guests run the agent as PID 1).
        assert "VERSION_CODENAME=bookworm" in out
        assert "built by scripts/make-vm-disk.sh" in out
        lines = out.strip().splitlines()
        assert lines[-3].endswith("-cloud-amd64")
        assert lines[-2] == "systemd"
        assert lines[-1] == sb.id
        # Files, both ways, and a command that reads what was written.
        sb.write_file("/root/note.txt", b"from the host\n")
        assert sb.read_file("/root/note.txt") == b"from the host\n"
        assert sb.run("cat /root/note.txt; echo oops >&2; exit 3").exit_code == 3
        assert sb.run("cat /root/note.txt").stdout == "from the host\n"
        # Commands are confined as in dsec's own guests: no CAP_SYS_ADMIN, no mknod.
        caps = int(sb.run("awk '/CapEff/ {print $2}' /proc/self/status").stdout, 16)
        assert caps & (1 << 21) == 0 and caps & (1 << 27) == 0, hex(caps)
        # A timeout stops the command's whole tree.
        t = time.monotonic()
        assert sb.run("sleep 60", timeout=1).timed_out
        assert time.monotonic() - t < 30
        # What needs dsec's own guest is refused clearly.
        with pytest.raises(dsec.InvalidArgument, match="bootable disk"):
            sb.snapshot("test-vm-disk-snap")
        dir_ = server.state_dir / "vm" / "sandboxes" / sb.id
        assert (dir_ / "disk.qcow2").is_file()
        assert len(qemu_procs(sb.id)) == 1
    finally:
        sb.stop()
    assert not qemu_procs(sb.id)
    assert_no_leftovers(server, sb.id)


def test_a_disk_image_starts_only_on_vm(client: dsec.Client, disk_image: str) -> None:
    with pytest.raises(dsec.InvalidArgument, match='backend="vm"'):
        client.create(backend="container", image=disk_image)
    with pytest.raises(dsec.InvalidArgument, match="network"):
        client.create(backend="vm", image=disk_image, network=True)
    # Its guest may write the whole disk into its overlay on the host: disk_mb must cover it.
    with pytest.raises(dsec.InvalidArgument, match=r"disk_mb=\d+ or more"):
        client.create(backend="vm", image=disk_image, disk_mb=16)


def test_a_qcow2_naming_another_file_is_refused(client: dsec.Client, tmp_path: Path) -> None:
    _vm_under_test()
    secret = tmp_path / "host-secret"
    secret.write_bytes(b"not for guests\n" * 100)
    disk = tmp_path / "backed.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(secret), str(disk)],
        check=True,
    )
    with pytest.raises(dsec.InvalidArgument, match="backing file"):
        client.import_image(str(disk), name="test-backed-disk")
    assert all(i.name != "test-backed-disk" for i in client.images())


def test_what_is_no_disk_is_refused_and_a_raw_disk_is_converted(
    client: dsec.Client, tmp_path: Path
) -> None:
    _vm_under_test()
    text = tmp_path / "notes.txt"
    text.write_bytes(b"just some text\n" * 100)
    with pytest.raises(dsec.InvalidArgument, match="qcow2 or raw disk"):
        client.import_image(str(text), name="test-not-a-disk")
    raw = tmp_path / "empty.raw"
    mbr = bytearray(1 << 20)
    mbr[510:512] = b"\x55\xaa"
    raw.write_bytes(bytes(mbr))
    img = client.import_image(str(raw), name="test-raw-disk")
    try:
        assert img.disk == {"format": "qcow2", "virtual_size": 1 << 20}
    finally:
        client.delete_image(img.name)
