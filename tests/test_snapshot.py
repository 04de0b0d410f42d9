"""Snapshot and fork of live sandboxes (issue 6)."""

from __future__ import annotations

import time
import uuid

import dsec


def test_snapshot_keeps_deletions_and_replaced_directories(
    client: dsec.Client, busybox_image: str
) -> None:
    name = "snap-" + uuid.uuid4().hex[:8]
    with client.create(image=busybox_image) as sb:
        r = sb.run(
            "rm /bin/vi; rm -rf /etc && mkdir /etc && echo fresh > /etc/only;"
            " mkdir -p /work/deep/er && echo data > /work/deep/er/file"
        )
        assert r.exit_code == 0, r.stderr
        img = sb.snapshot(name)
    try:
        assert img.layers[:-1] == client.get_image(busybox_image).layers
        with client.create(image=name) as sb2:
            r = sb2.run("ls /bin/vi; ls /etc; cat /work/deep/er/file")
            assert "No such file" in r.stderr  # the deletion is a whiteout in the new layer
            assert r.stdout == "only\ndata\n"  # /etc is opaque: only what the sandbox left
        with client.create(image=busybox_image) as base:
            assert base.run("ls /bin/vi && ls /etc | wc -l").exit_code == 0
    finally:
        client.delete_image(name)


def test_snapshot_of_a_busy_sandbox_is_a_consistent_point(
    client: dsec.Client, busybox_image: str
) -> None:
    name = "snap-" + uuid.uuid4().hex[:8]
    with client.create(image=busybox_image) as sb:
        loop = (
            "i=0; while true; do i=$((i+1));"
            " echo $i > /tmp/a.new; mv /tmp/a.new /tmp/a;"
            " echo $i > /tmp/b.new; mv /tmp/b.new /tmp/b; done"
        )
        sb.run(f"({loop}) >/dev/null 2>&1 &")
        time.sleep(0.3)
        img = sb.snapshot(name)
        assert sb.info().state == "running"
    try:
        with client.create(image=img.name) as copy:
            a = int(copy.read_file("/tmp/a"))
            b = int(copy.read_file("/tmp/b"))
            assert a > 0 and b in (a, a - 1), (a, b)
    finally:
        client.delete_image(name)


def test_forks_and_parent_diverge_independently(
    client: dsec.Client, busybox_image: str
) -> None:
    with client.create(image=busybox_image, memory_mb=256, labels={"t": "fork"}) as sb:
        sb.run("echo 0 > /root/n")
        kids = sb.fork(3)
        try:
            assert all(k.info().limits.memory_mb == 256 for k in kids)
            assert all(k.info().labels == {"t": "fork"} for k in kids)
            for i, k in enumerate(kids):
                k.run(f"echo {i + 1} > /root/n; touch /root/kid{i}")
            sb.run("echo parent > /root/n")
            assert sb.read_file("/root/n") == b"parent\n"
            for i, k in enumerate(kids):
                assert k.read_file("/root/n") == f"{i + 1}\n".encode()
                assert k.run("ls /root").stdout.split() == sorted(["n", f"kid{i}"])
        finally:
            for k in kids:
                k.stop()
            fork_images = [i.name for i in client.images() if i.name.startswith(sb.id + "-fork-")]
            for name in fork_images:
                client.delete_image(name)


def test_bad_fork_requests(client: dsec.Client, busybox_image: str) -> None:
    with client.create(image=busybox_image) as sb:
        for n in (0, -1, 100000):
            try:
                sb.fork(n)
            except dsec.InvalidArgument as e:
                assert "n must be between" in str(e)
            else:
                raise AssertionError(f"fork({n}) was accepted")
    try:
        client.get("e0-000000000000").snapshot("x")
    except dsec.NotFound:
        pass
    else:
        raise AssertionError("snapshot of an unknown sandbox was accepted")


def test_forks_inherit_the_trajectory_at_the_current_step(
    client: dsec.Client, busybox_image: str
) -> None:
    tid = "fork-" + uuid.uuid4().hex[:8]
    with client.create(image=busybox_image, trajectory_id=tid) as sb:
        sb.run("echo a >> /root/log")
        sb.run("echo b >> /root/log")
        kids = sb.fork(2)
        try:
            for i, k in enumerate(kids):
                assert k.trajectory_id and k.trajectory_id.startswith(tid + ".fork-")
                r = k.run(f"echo kid{i} >> /root/log; cat /root/log")
                assert r.stdout == f"a\nb\nkid{i}\n" and not r.replayed
                steps = [s["step"] for s in k.log()["steps"]]
                assert steps == [0, 1, 2]
                # A reconnecting client re-issues the child's steps: the inherited ones replay.
                again = client.get(k.id)
                assert again.run("echo a >> /root/log").replayed
                assert again.run("echo b >> /root/log").replayed
            # The parent's trajectory goes on independently.
            r = sb.run("cat /root/log")
            assert r.stdout == "a\nb\n" and not r.replayed
        finally:
            for k in kids:
                k.stop()
            for img in client.images():
                if img.name.startswith(sb.id + "-fork-"):
                    client.delete_image(img.name)
