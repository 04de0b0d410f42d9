"""Commands as a user of the sandbox (`user=` on run, stream and spawn, `dsec exec --user`),
on every backend: the user is looked up in the sandbox's own /etc/passwd and /etc/group (the
test adds it from inside, as root), the command takes its uid, gids and home, and keeps no
capability."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable

import dsec
import pytest
from dsec_testlib import DSEC_BIN, Server

MakeSandbox = Callable[..., dsec.Sandbox]

#: Adds alice (uid 1000, primary group 1000, also in staff, gid 50) with a home, and a
#: secret only root may read.
ADD_ALICE = """
echo 'alice:x:1000:1000:Alice:/home/alice:/bin/sh' >> /etc/passwd
echo 'alice:x:1000:' >> /etc/group
echo 'staff:x:50:bob,alice' >> /etc/group
mkdir -p /home/alice && chown 1000:1000 /home/alice
echo secret > /root/secret && chmod 600 /root/secret && chmod 755 /root
"""

WHO = "id -u; id -g; id -G; echo $HOME; echo $USER $LOGNAME; pwd"


@pytest.fixture
def usb(backend: str, make_sandbox: MakeSandbox) -> dsec.Sandbox:
    """A sandbox of the backend under test with alice in it."""
    if backend == "fncall":
        pytest.skip("fncall calls run as root only (test_fncall_refuses_users)")
    sb = make_sandbox()
    r = sb.run(ADD_ALICE)
    assert r.exit_code == 0, r.stderr
    return sb


def lines(r: dsec.CommandResult) -> list[str]:
    assert r.exit_code == 0, r.stderr
    return r.stdout.splitlines()


def test_a_command_runs_as_a_user_the_sandbox_added(usb: dsec.Sandbox) -> None:
    assert lines(usb.run(WHO, user="alice")) == [
        "1000",
        "1000",
        "1000 50",
        "/home/alice",
        "alice alice",
        "/home/alice",
    ]
    # It keeps no capability: permitted and effective are empty.
    caps = usb.run("grep -E '^Cap(Prm|Eff)' /proc/self/status", user="alice")
    assert lines(caps) == ["CapPrm:\t0000000000000000", "CapEff:\t0000000000000000"]
    # So root's files are closed to it.
    secret = usb.run("cat /root/secret", user="alice")
    assert secret.exit_code != 0 and "Permission denied" in secret.stderr, secret
    write = usb.run("touch /root/mine", user="alice")
    assert write.exit_code != 0 and "Permission denied" in write.stderr, write
    assert usb.run("test -e /root/mine").exit_code == 1
    # What it makes is its own.
    assert lines(usb.run("touch f; stat -c '%u:%g' f", user="alice")) == ["1000:1000"]
    # A streamed command is the same mechanism.
    out = "".join(ev.data for ev in usb.stream(WHO, user="alice") if ev.kind == "stdout")
    assert out.splitlines()[:3] == ["1000", "1000", "1000 50"]


def test_cwd_and_env_given_win_over_the_users(usb: dsec.Sandbox) -> None:
    r = usb.run("pwd; echo $HOME $USER", user="alice", cwd="/tmp", env={"HOME": "/tmp/h"})
    assert lines(r) == ["/tmp", "/tmp/h alice"]
    # A user whose home does not exist starts in the sandbox's working directory.
    usb.run("rm -rf /home/alice")
    assert lines(usb.run("pwd; echo $HOME", user="alice")) == ["/", "/home/alice"]


def test_numeric_uids_and_uid_gid_pairs(usb: dsec.Sandbox) -> None:
    assert lines(usb.run(WHO, user="1000"))[:4] == ["1000", "1000", "1000 50", "/home/alice"]
    # uid:gid names the one group (no supplementary ones, as Docker does).
    assert lines(usb.run("id -u; id -g; id -G", user="1000:50")) == ["1000", "50", "50"]
    # A uid without a passwd line runs with gid 0 and HOME=/, as Docker does.
    assert lines(usb.run("id -u; id -g; echo $HOME; pwd", user="4242")) == ["4242", "0", "/", "/"]


def test_a_spawned_process_runs_as_the_user(usb: dsec.Sandbox) -> None:
    p = usb.spawn("id -u; id -G; pwd; cat /root/secret", user="alice", stdin=False)
    out = {"stdout": "", "stderr": ""}
    for ev in p.events():
        if ev.kind == "exit":
            assert ev.exit_code != 0
            break
        out[ev.kind] += ev.data
    assert out["stdout"].splitlines() == ["1000", "1000 50", "/home/alice"], out
    assert "Permission denied" in out["stderr"], out
    pty = usb.spawn("id -u", user="alice", pty={"cols": 80, "rows": 24})
    assert pty.wait(timeout=60) == 0


def test_root_given_is_the_default(usb: dsec.Sandbox) -> None:
    default = lines(usb.run(WHO))
    assert default[0] == "0"
    for root in ("root", "0", "0:0"):
        assert lines(usb.run(WHO, user=root)) == default


def test_unknown_and_malformed_users_are_invalid_arguments(usb: dsec.Sandbox) -> None:
    with pytest.raises(dsec.InvalidArgument, match=r'"bob" not found in the sandbox.s /etc/passwd'):
        usb.run("true", user="bob")
    with pytest.raises(dsec.InvalidArgument, match=r'"bob" not found in the sandbox.s /etc/passwd'):
        list(usb.stream("true", user="bob"))
    with pytest.raises(dsec.InvalidArgument, match="bob"):
        usb.spawn("true", user="bob")
    for bad in ("a b", "-x", "1:x", ""):
        with pytest.raises(dsec.InvalidArgument, match="malformed"):
            usb.run("true", user=bad)
    # A user added later is found at once: the lookup is made for each command.
    usb.run("echo 'bob:x:1001:1001::/:/bin/sh' >> /etc/passwd")
    assert lines(usb.run("id -u", user="bob")) == ["1001"]


def test_a_stream_as_an_unknown_user_ends_with_the_error(usb: dsec.Sandbox, server: Server) -> None:
    """Over HTTP the stream's last line is the error `/exec` answers with, in place of the
    exit event; the SDK raises it, sync and async, before any event."""
    body = json.dumps({"cmd": "echo out", "user": "nosuchuser"}).encode()
    req = urllib.request.Request(
        f"{server.url}/v1/sandboxes/{usb.id}/exec/stream",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            events = [json.loads(line) for line in resp.read().splitlines() if line.strip()]
    except urllib.error.HTTPError as e:  # a backend that knows before the stream starts
        assert e.code == 400
        events = [json.loads(e.read())]
    assert [ev.get("kind") for ev in events[:-1]] == [], events
    error = events[-1]["error"]
    assert error["kind"] == "invalid_argument", events
    assert error["message"].startswith('user "nosuchuser" not found'), events
    with pytest.raises(dsec.InvalidArgument, match='"nosuchuser" not found') as raised:
        usb.run("true", user="nosuchuser")
    with pytest.raises(dsec.InvalidArgument) as streamed:
        list(usb.stream("echo out", user="nosuchuser"))
    assert str(streamed.value) == str(raised.value)

    async def astream() -> None:
        async with server.async_client() as client:
            asb = await client.get(usb.id)
            async for _ in asb.stream("echo out", user="nosuchuser"):
                pass

    with pytest.raises(dsec.InvalidArgument, match='"nosuchuser" not found'):
        asyncio.run(astream())
    # The sandbox goes on: the same stream as a user it has ends with its exit.
    kinds = [ev.kind for ev in usb.stream("echo out", user="alice")]
    assert kinds[-1] == "exit", kinds


def test_file_operations_run_as_the_user(backend: str, usb: dsec.Sandbox) -> None:
    """What a file operation as a user makes is the user's; what the user may not do is
    refused with dsec.PermissionDenied and changes nothing, where root may do it."""
    if backend == "docker":
        with pytest.raises(dsec.InvalidArgument, match="not supported on docker"):
            usb.write_file("/home/alice/a.txt", "hi", user="alice")
        assert usb.read_file("/etc/hostname", user="root")  # root, named, is the default
        return
    usb.write_file("/home/alice/a/b.txt", "hi", user="alice")
    for path in ("/home/alice/a", "/home/alice/a/b.txt"):  # parents made as the user too
        st = usb.stat(path, user="alice")
        assert (st.uid, st.gid) == (1000, 1000), (path, st)
    assert usb.mkdir("/home/alice/d/e", user="alice") is True
    assert (usb.stat("/home/alice/d").uid, usb.stat("/home/alice/d/e").gid) == (1000, 1000)
    usb.move("/home/alice/a/b.txt", "/home/alice/d/c.txt", user="alice")
    assert usb.read_file("/home/alice/d/c.txt", user="alice") == b"hi"
    assert [f.name for f in usb.list_files("/home/alice/d", user="1000")] == ["c.txt", "e"]
    # A command as alice sees the same owner.
    assert lines(usb.run("stat -c %u:%g /home/alice/d/c.txt", user="alice")) == ["1000:1000"]
    usb.remove("/home/alice/d", recursive=True, user="alice")
    assert usb.run("test -e /home/alice/d").exit_code == 1
    # Groups count: a directory of staff (gid 50) that only the group may write.
    assert usb.run("mkdir -p /srv && mkdir -m 770 /srv/staff && chgrp 50 /srv/staff").exit_code == 0
    usb.write_file("/srv/staff/f", "x", user="alice")
    assert usb.stat("/srv/staff/f").uid == 1000
    with pytest.raises(dsec.PermissionDenied):
        usb.write_file("/srv/staff/g", "x", user="1000:1000")  # that group only
    # What alice may not do, each refused precisely; root does them all.
    assert usb.run("mkdir -m 700 /root/closed && echo in > /root/closed/f").exit_code == 0
    refused = {
        "read": lambda u: usb.read_file("/root/secret", user=u),
        "write": lambda u: usb.write_file("/root/new", "x", user=u),
        "overwrite": lambda u: usb.write_file("/root/secret", "x", user=u),
        "mkdir": lambda u: usb.mkdir("/root/dir", user=u),
        "list": lambda u: usb.list_files("/root/closed", user=u),
        "stat": lambda u: usb.stat("/root/closed/f", user=u),
        "move": lambda u: usb.move("/root/secret", "/home/alice/secret", user=u),
        "remove": lambda u: usb.remove("/root/closed/f", user=u),
    }
    for what, op in refused.items():
        with pytest.raises(dsec.PermissionDenied, match="permission denied") as e:
            op("alice")
        assert e.value.status == 403, what
    # Nothing was changed by the refusals.
    assert usb.read_file("/root/secret") == b"secret\n"
    gone = "test -e /root/new || test -e /root/dir || test -e /home/alice/secret"
    assert usb.run(gone).exit_code == 1
    assert usb.read_file("/root/closed/f") == b"in\n"
    for op in refused.values():
        op(None)
    assert usb.stat("/root/new").uid == 0
    # An unknown user is the same error as for a command.
    with pytest.raises(dsec.InvalidArgument, match=r'"bob" not found in the sandbox.s /etc/passwd'):
        usb.write_file("/tmp/x", "x", user="bob")
    with pytest.raises(dsec.InvalidArgument, match="malformed"):
        usb.stat("/tmp", user="a b")


def test_fncall_refuses_users(backend: str, sb: dsec.Sandbox) -> None:
    if backend != "fncall":
        pytest.skip("fncall only")
    with pytest.raises(dsec.InvalidArgument, match="fncall calls run as root only"):
        sb.run("true", user="alice")


def test_the_cli_runs_as_the_user(backend: str, usb: dsec.Sandbox, server: Server) -> None:
    if backend != "container":
        pytest.skip("the CLI speaks the same request on every backend")
    argv = [str(DSEC_BIN), "exec", usb.id, "--url", server.url, "--user", "alice", "--", "id", "-u"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "1000\n"), r.stderr
    r = subprocess.run(
        [*argv[:5], "--user", "nobody-here", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "nobody-here" in r.stderr, r.stderr


def test_the_trajectory_records_the_user_and_replay_compares_it(
    backend: str, make_sandbox: MakeSandbox
) -> None:
    if backend != "container":
        pytest.skip("the edge records and compares it before any backend is asked")
    sb = make_sandbox(trajectory_id=f"users-{id(make_sandbox)}")
    assert sb.run(ADD_ALICE, step=0).exit_code == 0
    r = sb.run("id -u", user="alice", step=1)
    assert (r.replayed, r.stdout) == (False, "1000\n")
    # The same step as the same user replays; as another user (or root) it diverges.
    again = sb.run("id -u", user="alice", step=1)
    assert (again.replayed, again.stdout) == (True, "1000\n")
    for other in ("root", None, "1000"):
        with pytest.raises(dsec.TrajectoryDiverged, match="alice"):
            sb.run("id -u", user=other, step=1)
    steps = sb.log()["steps"]
    assert steps[1]["request"]["run_as"] == "alice"
    assert "run_as" not in steps[0]["request"]


def test_the_async_sdk_runs_as_the_user(backend: str, usb: dsec.Sandbox, server: Server) -> None:
    if backend != "container":
        pytest.skip("the async SDK sends the same requests on every backend")

    async def main() -> tuple[list[str], str, str]:
        async with server.async_client() as c:
            sb = await c.get(usb.id)
            r = await sb.run("id -u; pwd", user="alice")
            streamed = ""
            async for ev in sb.stream("id -u", user="1000:50"):
                if ev.kind == "stdout":
                    streamed += ev.data
            p = await sb.spawn("id -g", user="alice", stdin=False)
            spawned = ""
            async for pev in p.events():
                if pev.kind == "stdout":
                    spawned += pev.data
            return r.stdout.splitlines(), streamed, spawned

    assert asyncio.run(main()) == (["1000", "/home/alice"], "1000\n", "1000\n")
