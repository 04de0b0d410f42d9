"""scripts/fleet.sh: `up 2` starts etcd, PostgreSQL, the registry, two edges in network
namespaces and two apiservers; the fleet works through either apiserver (an image
imported once is pulled by the other edge, logs come from the shared database); `down`
leaves no process, namespace, address or directory behind."""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import dsec
import pytest
from dsec_fleet import REGISTRY_BIN, etcd_unavailable_reason
from dsec_local import DSEC_BIN, REPO
from dsec_testlib import make_tempdir, require, safe_rmtree
from postgres_cluster import pg_bin_dir

SCRIPT = REPO / "scripts" / "fleet.sh"
APISERVERS = ("http://127.0.0.1:7701", "http://127.0.0.1:7702")


def fleet_sh(fleet_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DSEC_FLEET_DIR=str(fleet_dir), DSEC_BIN=str(DSEC_BIN))
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def fleet_dir() -> Iterator[Path]:
    require("etcd", etcd_unavailable_reason())
    require("postgres", None if pg_bin_dir() else "no initdb in /usr/lib/postgresql/*/bin")
    require("registry", None if Path(REGISTRY_BIN).exists() else f"no {REGISTRY_BIN}")
    base = make_tempdir("dsec-fleet-sh-")
    base.chmod(0o755)  # PostgreSQL runs as its own user under it
    d = base / "fleet"
    yield d
    if (d / "pids").exists():
        fleet_sh(d, "down")
    safe_rmtree(base)


def pids_of(fleet_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in (fleet_dir / "pids").iterdir()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(600)
def test_up_runs_a_whole_fleet_and_down_leaves_nothing(
    fleet_dir: Path, busybox_rootfs: Path
) -> None:
    up = fleet_sh(fleet_dir, "up", "2")
    assert up.returncode == 0, up.stdout + up.stderr
    for service in ("etcd", "PostgreSQL", "registry", "edge e1", "edge e2", "apiserver"):
        assert service in up.stdout, up.stdout
    pids = pids_of(fleet_dir)
    assert len(pids) == 7 and all(alive(p) for p in pids), pids
    with dsec.Client(APISERVERS[0]) as a, dsec.Client(APISERVERS[1]) as b:
        a.import_image(str(busybox_rootfs), name="busybox")
        made = a.create_many(6, image="busybox", memory_mb=64)
        try:
            assert Counter(sb.info().edge for sb in made).keys() == {"e1", "e2"}
            for sb in made:
                assert b.get(sb.id).run("echo up").stdout == "up\n"
        finally:
            for sb in made:
                sb.stop()
        # The logs are in the fleet's database: readable through either apiserver.
        assert [s["result"]["stdout"] for s in b.log(made[0].id)["steps"]] == ["up\n"]
    down = fleet_sh(fleet_dir, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(alive(p) for p in pids)
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "dsec-fleet-" not in netns, netns
    lo = subprocess.run(["ip", "addr", "show", "lo"], capture_output=True, text=True).stdout
    assert "10.231.0.1" not in lo, lo
    assert not fleet_dir.exists()
