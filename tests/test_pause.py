"""Pause and resume (issue 6): a paused sandbox uses no CPU and resumes where it was."""

from __future__ import annotations

import time

import dsec
import pytest
from dsec_testlib import Server, assert_no_leftovers

SPIN = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/count; done"


@pytest.fixture
def spinning(client: dsec.Client, busybox_image: str):  # type: ignore[no-untyped-def]
    sb = client.create(image=busybox_image, cpus=0.5)
    sb.run(f"({SPIN}) >/dev/null 2>&1 &")
    time.sleep(0.3)
    yield sb
    sb.stop()


def count(sb: dsec.Sandbox) -> int:
    return int(sb.read_file("/tmp/count").decode().strip() or 0)


def test_paused_sandbox_uses_no_cpu_and_resumes_where_it_was(spinning: dsec.Sandbox) -> None:
    sb = spinning
    sb.pause()
    info = sb.info()
    assert info.state == "paused"
    cpu0 = info.usage.cpu_ms
    assert cpu0 is not None
    time.sleep(1.0)
    info = sb.info()
    assert info.state == "paused"
    used = (info.usage.cpu_ms or 0.0) - cpu0
    assert used < 5, f"a paused sandbox used {used} ms CPU"
    sb.resume()
    before = count(sb)
    time.sleep(0.5)
    after = count(sb)
    assert after > before, "the background loop did not continue after resume"
    assert (sb.info().usage.cpu_ms or 0.0) > cpu0


def test_a_request_resumes_a_paused_sandbox(spinning: dsec.Sandbox) -> None:
    sb = spinning
    sb.pause()
    r = sb.run("echo awake")
    assert r.stdout == "awake\n"
    assert sb.info().state == "running"


def test_pause_is_idempotent_and_unknown_ids_are_not_found(
    client: dsec.Client, spinning: dsec.Sandbox
) -> None:
    spinning.pause()
    spinning.pause()
    spinning.resume()
    spinning.resume()
    assert spinning.info().state == "running"
    with pytest.raises(dsec.NotFound):
        client.get("e0-000000000000").pause()


def test_a_paused_sandbox_stops_and_leaves_nothing(
    server: Server, client: dsec.Client, busybox_image: str
) -> None:
    # v1's freezer holds even SIGKILLed tasks: stopping a paused sandbox must thaw it.
    sb = client.create(image=busybox_image)
    sb.run("sleep 1000 >/dev/null 2>&1 &")
    sb.pause()
    sb.stop()
    assert_no_leftovers(server, sb.id)
