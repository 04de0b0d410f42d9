"""Helpers for the dsec test suite: the host-side helpers of ``tools/dsec_local.py`` (real
servers, what a sandbox leaves on the host) plus the pytest glue: which backends run, and
:func:`require`, which fails or skips a test whose feature is missing depending on whether
``scripts/setup.sh`` set that feature up. Nothing here mocks the server."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import dsec
import dsec_local
import pytest
from dsec_local import (
    DSEC_BIN,
    REPO,
    ServerError,
    cgroup_dirs,
    cgroup_mounts,
    cmdline,
    descendants,
    docker_containers,
    docker_import_rootfs,
    docker_unavailable_reason,
    free_port,
    leftovers,
    metric,
    mountinfo,
    mounts_under,
    proc_cgroups,
    procs_in,
    qemu_procs,
    safe_rmtree,
    still_running,
    wait_until,
)

__all__ = [
    "BACKENDS",
    "DOCKER_TEST_IMAGE",
    "DSEC_BIN",
    "FEATURES",
    "MAKE_ROOTFS",
    "MAX_UPLOAD_MB",
    "REPO",
    "SETUP_FEATURES",
    "STATEFUL",
    "VM_BACKENDS",
    "Server",
    "ServerError",
    "assert_no_leftovers",
    "cgroup_dirs",
    "cgroup_mounts",
    "cgroup_parents",
    "cmdline",
    "descendants",
    "docker_containers",
    "docker_import_rootfs",
    "docker_unavailable_reason",
    "free_port",
    "image_for",
    "leftovers",
    "make_tempdir",
    "metric",
    "mountinfo",
    "mounts_under",
    "point_e2b_sdk",
    "proc_cgroups",
    "procs_in",
    "qemu_procs",
    "require",
    "safe_rmtree",
    "sh_lines",
    "spare_cgroup_sets",
    "still_running",
    "unless_unimplemented",
    "wait_until",
]

MAKE_ROOTFS = dsec_local.MAKE_BUSYBOX_ROOTFS
MAX_UPLOAD_MB = 8
BACKENDS = [
    b.strip() for b in os.environ.get("DSEC_TEST_BACKENDS", "container").split(",") if b.strip()
]
#: The Docker reference the docker backend's tests use: the busybox rootfs, `docker import`ed.
DOCKER_TEST_IMAGE = "dsec-test/busybox:latest"
#: Backends whose sandboxes keep state between commands (fncall runs each call fresh).
STATEFUL = {"container", "docker", "microvm", "vm"}
#: Backends whose sandboxes are QEMU guests.
VM_BACKENDS = {"microvm", "vm"}


def image_for(backend: str) -> str:
    """The image name a test sandbox of this backend uses."""
    if backend == "docker":
        return os.environ.get("DSEC_TEST_DOCKER_IMAGE", DOCKER_TEST_IMAGE)
    return "busybox"


def make_tempdir(prefix: str) -> Path:
    """A temporary directory under $DSEC_TEST_TMPDIR (default: the system's)."""
    return dsec_local.make_tempdir(prefix, os.environ.get("DSEC_TEST_TMPDIR"))


class Server(dsec_local.Server):
    """A ``dsec serve`` of the test suite: ``dsec_local.Server`` with ``--max-upload-mb 8``
    (so that the upload limit is cheap to hit)."""

    def __init__(self, state_dir: Path, *, extra_args: Sequence[str] = (), **kw: Any) -> None:
        super().__init__(
            state_dir, extra_args=["--max-upload-mb", str(MAX_UPLOAD_MB), *extra_args], **kw
        )


# ------------------------------------------------------------------ set-up features

#: What `scripts/setup.sh` can set up, and what it means. It records those it set up and
#: verified in the stamp file `.dsec-setup`; `scripts/test.sh` exports them as
#: $DSEC_SETUP_FEATURES.
FEATURES = {
    "network": "sandbox networking: nftables, iproute2, the kernel's nf_tables",
    "docker": "the Docker Engine (docker.io), for the docker backend",
    "vm": "QEMU, Debian's cloud kernel and the static guest agent, for microvm and vm",
    "registry": "a local OCI registry (docker-registry) and skopeo, for image pulls",
    "debian-rootfs": "debootstrap, for the Debian test image with python3",
    "http-peers": "socat and tinyproxy: TLS and an HTTP proxy in front of the server (SDK)",
    "etcd": "etcd (Debian's etcd-server), for the fleet's membership",
    "postgres": "PostgreSQL (postgresql), for the trajectory log on --trajectory-db postgres://",
    "grader-image": "the grader image's root filesystem (scripts/make-grader-image.sh)",
    "vm-disk": "a bootable Debian disk for the vm backend (scripts/make-vm-disk.sh)",
}
#: The features this machine was set up for ($DSEC_SETUP_FEATURES, blank- or comma-separated).
SETUP_FEATURES = frozenset(os.environ.get("DSEC_SETUP_FEATURES", "").replace(",", " ").split())


def point_e2b_sdk(
    monkeypatch: pytest.MonkeyPatch, api_url: str, sandbox_url: str, api_key: str
) -> None:
    """The environment a user sets to point the e2b SDK at dsec's E2B listeners (a
    `dsec serve`'s, or a fleet apiserver's), out of the SDK's debug mode."""
    monkeypatch.setenv("E2B_API_URL", api_url)
    monkeypatch.setenv("E2B_SANDBOX_URL", sandbox_url)
    monkeypatch.setenv("E2B_API_KEY", api_key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)


def require(feature: str, why: str | None) -> None:
    """The test needs ``feature``; ``why`` says why it is missing (None: it is there).

    A missing feature that ``scripts/setup.sh`` set up on this machine fails the test: the
    machine is broken, and a skip would hide it. One it did not set up skips the test: the
    machine was not set up for it.
    """
    if feature not in FEATURES:
        raise ValueError(f"unknown set-up feature {feature!r}; known: {sorted(FEATURES)}")
    if why is None:
        return
    if feature in SETUP_FEATURES:
        pytest.fail(
            f"{feature} ({FEATURES[feature]}) was set up on this machine by scripts/setup.sh, "
            f"but is missing: {why}",
            pytrace=False,
        )
    pytest.skip(f"{feature} not set up on this machine (scripts/setup.sh): {why}")


# ------------------------------------------------------------------ leftovers


def assert_no_leftovers(server: Server, sandbox_id: str, timeout: float = 10.0) -> None:
    left = wait_until(lambda: not leftovers(server, sandbox_id), timeout)
    if not left:
        pytest.fail(f"sandbox {sandbox_id} left on the host: {leftovers(server, sandbox_id)}")


# ------------------------------------------------------------------ features not there yet


@contextlib.contextmanager
def unless_unimplemented(feature: str) -> Iterator[None]:
    """Skip (not fail) when the server has no such route or says it cannot do it yet."""
    try:
        yield
    except dsec.Unavailable as e:
        pytest.skip(f"{feature}: server says unavailable: {e}")
    except dsec.NotFound as e:
        if e.kind is None or "route" in e.message:  # the router's 404: no such route
            pytest.skip(f"{feature}: no such route on the server yet")
        raise
    except dsec.DsecError as e:
        if e.status in (404, 405, 501):
            pytest.skip(f"{feature}: not implemented by the server ({e.status})")
        raise


def cgroup_parents(server: Server, sandbox_id: str) -> list[str]:
    """The `dsec-<tag>` parents of a live sandbox's cgroups: the server's own."""
    return sorted({os.path.dirname(d) for d in cgroup_dirs(sandbox_id, server.cgroups)})


def spare_cgroup_sets(parents: Sequence[str]) -> set[str]:
    """The spare cgroup sets (`.spare-<n>`, v1 hosts) in a server's `dsec-<tag>` parents
    (from [`cgroup_parents`]): its own, not those other servers left."""
    names: set[str] = set()
    for parent in parents:
        try:
            names.update(e.name for e in os.scandir(parent) if e.name.startswith(".spare-"))
        except FileNotFoundError:
            continue
    return names


def sh_lines(r: Any) -> list[str]:
    return [x for x in r.stdout.splitlines() if x.strip()]
