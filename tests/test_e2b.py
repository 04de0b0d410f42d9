"""The real e2b SDK (PyPI `e2b`, pinned in scripts/setup.sh) against `dsec serve
--e2b-listen --e2b-envd-listen`: through the control plane (E2B_API_URL, E2B_SANDBOX_URL,
E2B_API_KEY) and in the SDK's debug mode (E2B_DEBUG=true, one sandbox for every call).

Commands are dsec's spawned processes (stdin, PTYs, list, kill, connect, surviving a
disconnect), as root or as a user of the image. Files carry E2B's metadata as user.e2b.*
extended attributes, and watch events their entries. What dsec's E2B API does not do yet
(templates, volumes) is asserted to answer at once with E2B's error shape and a message that
says so.

The "base" template here is the suite's Debian test image (bash, python3; made once by
scripts/make-debian-rootfs.sh into $DSEC_TEST_DEBIAN_ROOTFS, shared with test_network.py):
phase A runs everything as root, so E2B's own base image (scripts/make-base-image.sh, with
the user `user` and sudo; about 2.5 minutes to build) is not needed, and is kept out of
the suite. $DSEC_TEST_E2B_ROOTFS names another root filesystem to import as "base".
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dsec
import httpx
import pytest
from dsec_testlib import (
    BACKENDS,
    VM_BACKENDS,
    Server,
    assert_no_leftovers,
    free_port,
    make_tempdir,
    point_e2b_sdk,
    require,
    safe_rmtree,
    wait_until,
)

e2b = pytest.importorskip("e2b", reason="the e2b SDK (pip install e2b==2.63.0)")
from e2b import (  # noqa: E402
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    InvalidArgumentException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEBIAN_ROOTFS = Path(os.environ.get("DSEC_TEST_DEBIAN_ROOTFS", "/var/tmp/dsec-test-debian-rootfs"))
API_KEY = "e2b_" + "0" * 40


@pytest.fixture(scope="module")
def base_rootfs() -> Path:
    if chosen := os.environ.get("DSEC_TEST_E2B_ROOTFS"):
        return Path(chosen)
    r = subprocess.run(
        [str(REPO / "scripts/make-debian-rootfs.sh"), str(DEBIAN_ROOTFS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        require("debian-rootfs", f"no Debian rootfs with bash: {r.stderr[-400:]}")
    return DEBIAN_ROOTFS


class E2bServer:
    """A dsec server with both E2B listeners, its "base" image imported."""

    def __init__(self, server: Server, api_port: int, envd_port: int) -> None:
        self.server = server
        self.api_url = f"http://127.0.0.1:{api_port}"
        self.sandbox_url = f"http://127.0.0.1:{envd_port}"


@pytest.fixture(scope="module")
def e2b_server(base_rootfs: Path) -> Iterator[E2bServer]:
    tmp = make_tempdir("dsec-e2b-test-")
    api_port, envd_port = free_port(), free_port()
    server = Server(
        tmp / "state",
        log_path=tmp / "server.log",
        extra_args=[
            "--e2b-listen",
            f"127.0.0.1:{api_port}",
            "--e2b-envd-listen",
            f"127.0.0.1:{envd_port}",
            "--e2b-debug-template",
            "base",
        ],
    )
    server.start()
    try:
        with server.client() as c:
            c.import_image(str(base_rootfs), name="base")
        yield E2bServer(server, api_port, envd_port)
    finally:
        try:
            server.stop()
        finally:
            server.cleanup()
            safe_rmtree(tmp)


@pytest.fixture
def e2b_env(e2b_server: E2bServer, monkeypatch: pytest.MonkeyPatch) -> E2bServer:
    """The environment a user sets to point the e2b SDK at dsec."""
    point_e2b_sdk(monkeypatch, e2b_server.api_url, e2b_server.sandbox_url, API_KEY)
    return e2b_server


@pytest.fixture
def sandbox(e2b_env: E2bServer) -> Iterator[Sandbox]:
    sb = Sandbox.create("base", metadata={"suite": "test_e2b"}, timeout=120)
    yield sb
    sb.kill()


# ------------------------------------------------------------------ commands


def test_commands_run_streams_output_and_exit_codes(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("echo out; echo err >&2; echo $GREETING", envs={"GREETING": "hi"})
    assert (r.stdout, r.stderr, r.exit_code) == ("out\nhi\n", "err\n", 0)
    assert sandbox.commands.run("pwd").stdout == "/root\n"
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    with pytest.raises(InvalidArgumentException, match="/no/such/dir"):
        sandbox.commands.run("pwd", cwd="/no/such/dir")
    seen: list[str] = []
    sandbox.commands.run("echo a; echo b", on_stdout=seen.append)
    assert "".join(seen) == "a\nb\n"
    with pytest.raises(CommandExitException) as exc:
        sandbox.commands.run("echo partial; exit 3")
    assert exc.value.exit_code == 3
    assert exc.value.stdout == "partial\n"


def test_commands_run_replaces_broken_utf8(sandbox: Sandbox) -> None:
    r = sandbox.commands.run(r"printf 'a\xffb'")
    assert r.stdout == "a\ufffdb"


def test_commands_timeout_raises_and_kills(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 30", timeout=2)
    assert time.monotonic() - t0 < 15
    # The command is gone, not left running in the sandbox.
    procs = sandbox.commands.run(
        "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' <$f; echo; done"
    ).stdout
    assert "sleep 30" not in procs
    # A background command's timeout ends it too, whether or not anyone still listens.
    handle = sandbox.commands.run("sleep 30", background=True, timeout=1)
    handle.disconnect()
    assert wait_until(lambda: handle.pid not in [p.pid for p in sandbox.commands.list()], 10)


def test_commands_background_finishes_and_reports(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 0.5; echo done", background=True)
    result = handle.wait()
    assert (result.stdout, result.exit_code) == ("done\n", 0)


def test_commands_stdin_send_stream_and_close(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("cat", background=True, stdin=True)
    assert handle.pid > 0
    sandbox.commands.send_stdin(handle.pid, "hello\n")
    handle.send_stdin(b"bytes\n")
    sandbox.commands.stream_input(handle.pid, ["str", b"eam\n"])
    sandbox.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "hello\nbytes\nstream\n"
    # Ended, it is gone, as in envd.
    with pytest.raises(NotFoundException, match="no running process"):
        sandbox.commands.send_stdin(handle.pid, "late")
    # A command started without stdin refuses input, and says why.
    quiet = sandbox.commands.run("sleep 60", background=True)
    with pytest.raises(SandboxException, match="standard input is closed"):
        sandbox.commands.send_stdin(quiet.pid, "x")
    assert quiet.kill() is True


def test_commands_process_calls_reach_the_trajectory_log(
    e2b_env: E2bServer, sandbox: Sandbox
) -> None:
    """envd's process calls are the sandbox's steps, as dsec's own process calls are."""
    cat = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(cat.pid, "logged\n")
    sandbox.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "logged\n"
    assert sandbox.commands.run("sleep 60", background=True).kill() is True
    with e2b_env.server.client() as c:
        steps = c.log(sandbox.sandbox_id)["steps"]
    kinds = [s["request"].get("kind", "run") for s in steps]
    assert kinds.count("spawn") == 2 and kinds.count("close_stdin") == 1, kinds
    assert kinds.count("kill") == 1, kinds
    (stdin,) = [s for s in steps if s["request"].get("kind") == "stdin"]
    spawn_step = stdin["request"]["process"]["spawn_step"]
    assert stdin["request"]["process"]["input"] == "logged\n"
    assert steps[kinds.index("spawn")]["step"] == spawn_step


def test_commands_list_and_kill(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("sleep 60", background=True, envs={"MARK": "1"}, cwd="/tmp")
    listed = {p.pid: p for p in sandbox.commands.list()}
    mine = listed[handle.pid]
    assert (mine.cmd, mine.args, mine.envs, mine.cwd) == (
        "/bin/bash",
        ["-l", "-c", "sleep 60"],
        {"MARK": "1"},
        "/tmp",
    )
    assert mine.tag is None
    assert sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as exc:
        handle.wait()
    assert (exc.value.exit_code, exc.value.error) == (-1, "signal: killed")
    assert handle.pid not in [p.pid for p in sandbox.commands.list()]
    # Killing what is gone answers False, as the SDK reads not_found.
    assert sandbox.commands.kill(handle.pid) is False


def test_commands_survive_disconnect_and_connect_from_another_handle(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("echo first; sleep 1; echo second", background=True)
    handle.disconnect()
    other = Sandbox.connect(sandbox.sandbox_id)
    # Output from before the connect is replayed, then the rest follows live.
    result = other.commands.connect(handle.pid).wait()
    assert (result.stdout, result.exit_code) == ("first\nsecond\n", 0)


def test_processes_that_do_not_exist_answer_not_found(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(NotFoundException, match="no running process 999999"):
        sandbox.commands.send_stdin(999999, "x")
    with pytest.raises(NotFoundException):
        sandbox.commands.connect(999999)
    with pytest.raises(NotFoundException):
        sandbox.pty.resize(999999, e2b.PtySize(rows=24, cols=80))
    assert sandbox.commands.kill(999999) is False
    assert time.monotonic() - t0 < 10


def test_pty_input_resize_and_kill(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(e2b.PtySize(rows=24, cols=80))
    output = iter(term)

    def read_until(marker: bytes) -> bytes:
        seen = b""
        for _, _, chunk in output:
            seen += chunk or b""
            if marker in seen:
                return seen
        raise AssertionError(f"{marker!r} never came; got {seen!r}")

    assert term.pid in [p.pid for p in sandbox.commands.list()]
    sandbox.pty.send_stdin(term.pid, b"stty size; echo term=$TERM\n")
    assert b"term=xterm-256color" in read_until(b"term=xterm")
    sandbox.pty.resize(term.pid, e2b.PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(term.pid, b"stty size\n")
    read_until(b"30 100")
    # Pipes' input is not a terminal's.
    with pytest.raises(SandboxException, match="runs on a terminal"):
        sandbox.commands.send_stdin(term.pid, "x")
    assert sandbox.pty.kill(term.pid) is True
    with pytest.raises(CommandExitException) as exc:
        term.wait()
    assert exc.value.exit_code == -1


def test_pty_exits_with_its_shell(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(e2b.PtySize(rows=24, cols=80))
    sandbox.pty.stream_input(term.pid, [b"exit 0\n"])
    seen: list[bytes] = []
    assert term.wait(on_pty=seen.append).exit_code == 0
    assert b"exit" in b"".join(seen)


def test_commands_and_paths_as_another_user(sandbox: Sandbox) -> None:
    # A user the sandbox makes itself is found at once (looked up in its own /etc/passwd).
    sandbox.commands.run("useradd -m -s /bin/sh user", user="root")
    r = sandbox.commands.run("id -un; id -u; pwd; echo $HOME", user="user")
    assert r.stdout.split() == ["user", r.stdout.split()[1], "/home/user", "/home/user"]
    assert r.stdout.split()[1] != "0"
    assert sandbox.commands.run("id -un", user="root").stdout == "root\n"
    # The user's relative paths start at its home; it cannot read root's files.
    sandbox.files.write("notes.txt", "hi", user="user")
    assert sandbox.commands.run("cat /home/user/notes.txt", user="user").stdout == "hi"
    assert [e.name for e in sandbox.files.list(".", user="user")].count("notes.txt") == 1
    # Files and directories made as the user are the user's; what it may not do fails.
    sandbox.files.make_dir("sub", user="user")
    sandbox.files.rename("notes.txt", "sub/n.txt", user="user")
    owners = sandbox.commands.run("stat -c %U /home/user/sub /home/user/sub/n.txt", user="root")
    assert owners.stdout.split() == ["user", "user"]
    sandbox.commands.run("echo secret > /root/s; chmod 600 /root/s", user="root")
    with pytest.raises(CommandExitException):
        sandbox.commands.run("cat /root/s", user="user")
    for refused in (
        lambda: sandbox.files.read("/root/s", user="user"),
        lambda: sandbox.files.write("/root/t", "x", user="user"),
        lambda: sandbox.files.make_dir("/root/d", user="user"),
        lambda: sandbox.files.remove("/root/s", user="user"),
    ):
        with pytest.raises(SandboxException, match="permission denied"):
            refused()
    assert sandbox.files.read("/root/s", user="root") == "secret\n"
    # A background process runs as the user too.
    handle = sandbox.commands.run("sleep 0.2; id -un", background=True, user="user")
    assert handle.wait().stdout == "user\n"
    with pytest.raises(SandboxException, match="nobody-here"):
        sandbox.commands.run("true", user="nobody-here")
    with pytest.raises(SandboxException, match="nobody-here"):
        sandbox.files.read("/etc/hostname", user="nobody-here")


# ------------------------------------------------------------------ files


def test_files_write_read_list(sandbox: Sandbox) -> None:
    info = sandbox.files.write("/tmp/e2b/a.txt", "hello")
    assert (info.path, info.name) == ("/tmp/e2b/a.txt", "a.txt")
    assert sandbox.files.read("/tmp/e2b/a.txt") == "hello"
    # Relative paths are the user's home's; parents are made.
    sandbox.files.write("rel/b.bin", b"\x00\x01\xff")
    assert sandbox.files.read("/root/rel/b.bin", format="bytes") == b"\x00\x01\xff"
    assert b"".join(sandbox.files.read("rel/b.bin", format="stream")) == b"\x00\x01\xff"
    entries = {e.name: e for e in sandbox.files.list("/tmp/e2b")}
    assert set(entries) == {"a.txt"}
    assert entries["a.txt"].size == 5
    assert entries["a.txt"].path == "/tmp/e2b/a.txt"
    assert sandbox.commands.run("cat /tmp/e2b/a.txt").stdout == "hello"


def test_files_uploads_multipart_octet_stream_and_gzip(sandbox: Sandbox) -> None:
    payload = os.urandom(200_000)
    sandbox.files.write("/tmp/multi.bin", payload, use_octet_stream=False)
    sandbox.files.write("/tmp/octet.bin", payload, use_octet_stream=True)
    sandbox.files.write("/tmp/gz.bin", payload, gzip=True)
    written = sandbox.files.write_files(
        [
            WriteEntry(path="/tmp/many/one.txt", data="1"),
            WriteEntry(path="/tmp/many/two.txt", data="2"),
        ]
    )
    assert sorted(w.path for w in written) == ["/tmp/many/one.txt", "/tmp/many/two.txt"]
    for path in ("/tmp/multi.bin", "/tmp/octet.bin", "/tmp/gz.bin"):
        assert sandbox.files.read(path, format="bytes") == payload
        assert sandbox.files.read(path, format="bytes", gzip=True) == payload
    assert sandbox.commands.run("cat /tmp/many/one.txt /tmp/many/two.txt").stdout == "12"


def test_files_over_the_upload_limit_are_refused(sandbox: Sandbox) -> None:
    """The test server takes uploads of up to 8 MiB (--max-upload-mb 8)."""
    big = b"x" * (9 << 20)
    for octet in (True, False):
        with pytest.raises(SandboxException, match=r"(?i)limit|too large"):
            sandbox.files.write("/tmp/big.bin", big, use_octet_stream=octet)
    assert not sandbox.files.exists("/tmp/big.bin")
    # The connection stays usable.
    sandbox.files.write("/tmp/small.bin", b"ok")
    assert sandbox.files.read("/tmp/small.bin") == "ok"


def test_files_exists_and_info(sandbox: Sandbox) -> None:
    sandbox.files.write("/tmp/info/f.txt", "12345")
    assert sandbox.files.exists("/tmp/info/f.txt")
    assert sandbox.files.exists("/tmp/info")
    assert not sandbox.files.exists("/tmp/info/nope")
    assert not sandbox.files.exists("/no/such/dir/f")
    info = sandbox.files.get_info("/tmp/info/f.txt")
    assert (info.name, info.path, info.type, info.size) == (
        "f.txt",
        "/tmp/info/f.txt",
        e2b.FileType.FILE,
        5,
    )
    assert info.permissions == "-rw-r--r--"
    assert sandbox.files.get_info("/tmp/info").type == e2b.FileType.DIR
    assert sandbox.files.get_info("/").type == e2b.FileType.DIR
    with pytest.raises(e2b.FileNotFoundException):
        sandbox.files.get_info("/tmp/info/nope")


def test_files_make_dir_rename_remove_and_deep_lists(sandbox: Sandbox) -> None:
    """filesystem.Filesystem's MakeDir, Move, Remove and ListDir(depth) onto dsec's."""
    assert sandbox.files.make_dir("/tmp/ops/a/b") is True
    assert sandbox.files.make_dir("/tmp/ops/a/b") is False  # already_exists
    sandbox.files.write("/tmp/ops/a/b/f.txt", "x")
    with pytest.raises(SandboxException):
        sandbox.files.make_dir("/tmp/ops/a/b/f.txt")  # a file there: invalid_argument
    deep = {e.path: e for e in sandbox.files.list("/tmp/ops", depth=3)}
    assert set(deep) == {"/tmp/ops/a", "/tmp/ops/a/b", "/tmp/ops/a/b/f.txt"}
    assert deep["/tmp/ops/a/b/f.txt"].name == "f.txt"
    assert deep["/tmp/ops/a/b"].type == e2b.FileType.DIR
    assert [e.name for e in sandbox.files.list("/tmp/ops", depth=1)] == ["a"]
    moved = sandbox.files.rename("/tmp/ops/a/b/f.txt", "/tmp/ops/new/dir/g.txt")
    assert (moved.path, moved.name, moved.size) == ("/tmp/ops/new/dir/g.txt", "g.txt", 1)
    assert sandbox.files.read("/tmp/ops/new/dir/g.txt") == "x"
    assert not sandbox.files.exists("/tmp/ops/a/b/f.txt")
    sandbox.files.remove("/tmp/ops")
    assert not sandbox.files.exists("/tmp/ops")
    with pytest.raises(e2b.NotFoundException):
        sandbox.files.remove("/tmp/ops")


def test_files_watch_dir_polls_dsec_s_watch(sandbox: Sandbox) -> None:
    """The sync SDK's watch_dir: CreateWatcher, GetWatcherEvents, RemoveWatcher."""
    sandbox.files.make_dir("/tmp/wd")
    handle = sandbox.files.watch_dir("/tmp/wd", recursive=True)
    sandbox.files.write("/tmp/wd/a.txt", "a")
    sandbox.files.make_dir("/tmp/wd/sub")
    sandbox.files.remove("/tmp/wd/a.txt")
    want = {
        ("a.txt", e2b.FilesystemEventType.CREATE),
        ("sub", e2b.FilesystemEventType.CREATE),
        ("a.txt", e2b.FilesystemEventType.REMOVE),
    }
    seen: set[tuple[str, Any]] = set()
    deadline = time.monotonic() + 20
    while not want <= seen and time.monotonic() < deadline:
        seen |= {(ev.name, ev.type) for ev in handle.get_new_events()}
        time.sleep(0.2)
    handle.stop()
    assert want <= seen, seen
    with pytest.raises(SandboxException):
        sandbox.files.watch_dir("/tmp/no/such/dir")


def test_files_watch_events_carry_their_entry(sandbox: Sandbox) -> None:
    """include_entry (envd 0.6.3): each event has its path's EntryInfo, except a path
    removed or moved away; metadata is in it."""
    sandbox.files.make_dir("/tmp/we")
    handle = sandbox.files.watch_dir("/tmp/we", include_entry=True)
    sandbox.files.write("/tmp/we/a.txt", "abc", metadata={"tag": "w"})
    sandbox.files.remove("/tmp/we/a.txt")
    events: list[Any] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        events += handle.get_new_events()
        if any(ev.type == e2b.FilesystemEventType.REMOVE for ev in events):
            break
        time.sleep(0.2)
    handle.stop()
    created = [ev for ev in events if ev.type == e2b.FilesystemEventType.CREATE]
    removed = [ev for ev in events if ev.type == e2b.FilesystemEventType.REMOVE]
    assert created and removed, events
    assert all(ev.entry is None for ev in removed)
    # The entry is the path's as the event was handled: there, or already gone.
    told = [ev.entry for ev in events if ev.entry is not None]
    assert told, events
    assert all(e.path == "/tmp/we/a.txt" and e.type == e2b.FileType.FILE for e in told)
    # Without include_entry, no entry.
    plain = sandbox.files.watch_dir("/tmp/we")
    sandbox.files.write("/tmp/we/b.txt", "b")
    deadline = time.monotonic() + 20
    got: list[Any] = []
    while not got and time.monotonic() < deadline:
        got = plain.get_new_events()
        time.sleep(0.2)
    plain.stop()
    assert got and all(ev.entry is None for ev in got)


def _xattrs(sandbox: Sandbox, path: str) -> dict[str, str]:
    """The extended attributes of `path`, as a command in the sandbox reads them."""
    code = (
        "import os, json, sys; p = sys.argv[1]; "
        "print(json.dumps({k: os.getxattr(p, k).decode() for k in os.listxattr(p)}))"
    )
    out = sandbox.commands.run(f"python3 -c {shlex.quote(code)} {path}").stdout
    got: dict[str, str] = json.loads(out)
    return got


def test_files_metadata_is_user_e2b_xattrs(e2b_env: E2bServer, sandbox: Sandbox) -> None:
    """X-Metadata-* uploads (envd 0.6.2) become user.e2b.* extended attributes, read back
    by Stat, ListDir and the upload's reply; a rewrite replaces the whole set."""
    info = sandbox.files.write("/tmp/meta/a.txt", "x", metadata={"owner": "ann", "run": "7"})
    assert info.metadata == {"owner": "ann", "run": "7"}
    assert _xattrs(sandbox, "/tmp/meta/a.txt") == {"user.e2b.owner": "ann", "user.e2b.run": "7"}
    assert sandbox.files.get_info("/tmp/meta/a.txt").metadata == {"owner": "ann", "run": "7"}
    listed = {e.name: e for e in sandbox.files.list("/tmp/meta")}
    assert listed["a.txt"].metadata == {"owner": "ann", "run": "7"}
    # dsec's own SDK reads it too.
    with e2b_env.server.client() as c:
        own = c.get(sandbox.sandbox_id)
        assert own.stat("/tmp/meta/a.txt").metadata == {"owner": "ann", "run": "7"}
        assert {f.name: f.metadata for f in own.list_files("/tmp/meta")}["a.txt"]["run"] == "7"
    # Set in the sandbox by hand, it reads back too (attributes outside user.e2b. do not).
    sandbox.commands.run(
        "python3 -c \"import os; os.setxattr('/tmp/meta/a.txt', 'user.e2b.hand', b'made');"
        " os.setxattr('/tmp/meta/a.txt', 'user.other', b'no')\""
    )
    assert sandbox.files.get_info("/tmp/meta/a.txt").metadata == {
        "owner": "ann",
        "run": "7",
        "hand": "made",
    }
    # A rewrite replaces the set; one without metadata clears it.
    sandbox.files.write("/tmp/meta/a.txt", "y", metadata={"run": "8"}, use_octet_stream=True)
    assert sandbox.files.get_info("/tmp/meta/a.txt").metadata == {"run": "8"}
    plain = sandbox.files.write("/tmp/meta/a.txt", "z")
    assert plain.metadata is None
    assert sandbox.files.get_info("/tmp/meta/a.txt").metadata is None
    # A move keeps it; several files get the same set.
    sandbox.files.write_files(
        [WriteEntry(path="/tmp/meta/m1", data="1"), WriteEntry(path="/tmp/meta/m2", data="2")],
        metadata={"batch": "b"},
    )
    moved = sandbox.files.rename("/tmp/meta/m1", "/tmp/meta/moved")
    assert moved.metadata == {"batch": "b"}
    assert sandbox.files.get_info("/tmp/meta/m2").metadata == {"batch": "b"}
    # Directories carry it too when set in the sandbox.
    sandbox.commands.run("python3 -c \"import os; os.setxattr('/tmp/meta', 'user.e2b.d', b'1')\"")
    assert sandbox.files.get_info("/tmp/meta").metadata == {"d": "1"}


def test_files_metadata_limits_are_envds(e2b_env: E2bServer, sandbox: Sandbox) -> None:
    """What envd refuses with 400 (checked before anything is written), sent raw: the
    SDK checks some of it itself."""
    url = f"{e2b_env.sandbox_url}/files"
    token = sandbox._envd_access_token or ""
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": token}
    bad_values: list[tuple[bytes, bytes, str]] = [
        (b"X-Metadata-k", "caf\u00e9".encode(), "printable"),
        (b"X-Metadata-k", b"a\tb", "printable"),
        (b"X-Metadata-" + b"k" * 247, b"v", "bytes"),
        (b"X-Metadata-k", b"v" * 4096, "4096"),
    ]
    for name, value, why in bad_values:
        r = httpx.post(
            url,
            params={"path": "/tmp/lim.txt"},
            headers=[*((k.encode(), v.encode()) for k, v in headers.items()), (name, value)],
            content=b"x",
            timeout=30,
        )
        assert r.status_code == 400, r.text
        assert why in r.json()["message"], r.text
    assert not sandbox.files.exists("/tmp/lim.txt")
    headers["Content-Type"] = "application/octet-stream"
    headers["X-Metadata-Mixed-Case"] = "v"
    ok = httpx.post(url, params={"path": "/tmp/lim.txt"}, content=b"x", headers=headers, timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.json()[0]["metadata"] == {"mixed-case": "v"}


@pytest.mark.parametrize("backend", sorted(VM_BACKENDS))
def test_files_metadata_in_vm_guests(e2b_env: E2bServer, backend: str) -> None:
    """A guest's agent keeps metadata on its own filesystem (the overlay on its ext4
    scratch disk), as the container's init does."""
    if backend not in BACKENDS:
        pytest.skip(f"{backend} is not in DSEC_TEST_BACKENDS")
    with e2b_env.server.client() as c:
        try:
            c.create(backend=backend, image="base").stop()
        except dsec.Unavailable as e:
            require("vm", f"backend {backend}: {e}")
    sb = Sandbox.create(f"{backend}+base", timeout=300)
    try:
        info = sb.files.write("/root/m.txt", "x", metadata={"k": "v"})
        assert info.metadata == {"k": "v"}
        assert sb.files.get_info("/root/m.txt").metadata == {"k": "v"}
        assert {e.name: e.metadata for e in sb.files.list("/root")}["m.txt"] == {"k": "v"}
        assert _xattrs(sb, "/root/m.txt") == {"user.e2b.k": "v"}
    finally:
        sb.kill()


def test_files_metadata_on_docker_is_refused_not_dropped(
    e2b_env: E2bServer, docker_image: str
) -> None:
    """Docker's archive API carries no extended attributes: a write with metadata says so
    (and writes nothing); one without works."""
    sb = Sandbox.create(f"docker+{docker_image}", timeout=120)
    try:
        with pytest.raises(InvalidArgumentException, match="docker"):
            sb.files.write("/tmp/m.txt", "x", metadata={"k": "v"})
        assert not sb.files.exists("/tmp/m.txt")
        assert sb.files.write("/tmp/m.txt", "x").metadata is None
        assert sb.files.get_info("/tmp/m.txt").metadata is None
    finally:
        sb.kill()


def test_files_errors(sandbox: Sandbox) -> None:
    with pytest.raises(e2b.NotFoundException):
        sandbox.files.read("/tmp/no/such/file")


# ------------------------------------------------------------------ lifecycle


def test_info_list_and_filters(e2b_env: E2bServer) -> None:
    a = Sandbox.create("base", metadata={"team": "a", "run": "list"}, timeout=120)
    b = Sandbox.create("base", metadata={"team": "b", "run": "list"}, timeout=120)
    try:
        info = a.get_info()
        assert info.sandbox_id == a.sandbox_id
        assert info.template_id == "base"
        assert info.metadata == {"team": "a", "run": "list"}
        assert info.state == SandboxState.RUNNING
        assert 100 < (info.end_at - info.started_at).total_seconds() <= 121

        def ids(**query: object) -> set[str]:
            found: set[str] = set()
            paginator = Sandbox.list(query=SandboxQuery(**query), limit=1)  # type: ignore[arg-type]
            while paginator.has_next:
                found |= {s.sandbox_id for s in paginator.next_items()}
            return found

        assert ids(metadata={"run": "list"}) == {a.sandbox_id, b.sandbox_id}
        assert ids(metadata={"run": "list", "team": "b"}) == {b.sandbox_id}
        a.pause()
        assert ids(metadata={"run": "list"}, state=[SandboxState.PAUSED]) == {a.sandbox_id}
        assert ids(metadata={"run": "list"}, state=[SandboxState.RUNNING]) == {b.sandbox_id}
    finally:
        a.kill()
        b.kill()
    for sb in (a, b):
        assert_no_leftovers(e2b_env.server, sb.sandbox_id)


def test_kill(e2b_env: E2bServer) -> None:
    sb = Sandbox.create("base", timeout=120)
    assert sb.is_running()
    assert sb.kill() is True
    assert not sb.is_running()
    assert Sandbox.kill(sb.sandbox_id) is False
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(sb.sandbox_id)
    with pytest.raises(SandboxException):
        sb.commands.run("true")
    assert sb.sandbox_id not in {s.sandbox_id for s in Sandbox.list().next_items()}


def test_pause_and_connect_resume(sandbox: Sandbox) -> None:
    sandbox.files.write("/root/kept.txt", "kept")
    assert sandbox.pause() is True
    assert sandbox.get_info().state == SandboxState.PAUSED
    assert not sandbox.is_running()
    assert Sandbox.pause(sandbox.sandbox_id) is False  # already paused: E2B's 409
    same = Sandbox.connect(sandbox.sandbox_id)
    assert same.is_running()
    assert same.commands.run("cat /root/kept.txt").stdout == "kept"


def test_set_timeout_moves_the_end_and_kills_at_it(e2b_env: E2bServer) -> None:
    sb = Sandbox.create("base", timeout=120)
    try:
        sb.set_timeout(600)
        info = sb.get_info()
        assert 590 < (info.end_at - info.started_at).total_seconds() < 610
        sb.set_timeout(1)
        assert wait_until(lambda: not sb.is_running(), 10)
        with pytest.raises(SandboxNotFoundException):
            sb.get_info()
    finally:
        sb.kill()


def test_on_timeout_pause_and_auto_resume(e2b_env: E2bServer) -> None:
    sb = Sandbox.create("base", timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sb.files.write("/root/state.txt", "before")
        assert wait_until(lambda: sb.get_info().state == SandboxState.PAUSED, 10)
        lifecycle = sb.get_info().lifecycle
        assert lifecycle is not None
        assert lifecycle["on_timeout"] == "pause"
        time.sleep(1)  # paused, it does not time out again
        assert sb.get_info().state == SandboxState.PAUSED
        # An envd request resumes it and starts its timeout again: running for a while,
        # then paused at the new timeout.
        assert sb.commands.run("cat /root/state.txt").stdout == "before"
        assert sb.get_info().state == SandboxState.RUNNING
        assert wait_until(lambda: sb.get_info().state == SandboxState.PAUSED, 10)
    finally:
        sb.kill()
    assert_no_leftovers(e2b_env.server, sb.sandbox_id)


def test_create_refuses_what_dsec_lacks(e2b_env: E2bServer) -> None:
    with pytest.raises(SandboxException, match=r"not found|no image"):
        Sandbox.create("no-such-template", timeout=60)
    with pytest.raises(SandboxException, match="fncall"):
        Sandbox.create("fncall+base", timeout=60)
    with pytest.raises(SandboxException, match="not supported"):
        Sandbox.create("base", timeout=60, mcp={"github": {}})  # type: ignore[arg-type]


def test_auth(e2b_env: E2bServer, sandbox: Sandbox) -> None:
    api = httpx.Client(base_url=e2b_env.api_url, trust_env=False)
    r = api.get("/v2/sandboxes")
    assert r.status_code == 401
    assert set(r.json()) >= {"code", "message"}
    # envd takes the sandbox's access token, and only that.
    envd = httpx.Client(base_url=e2b_env.sandbox_url, trust_env=False)
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "Content-Type": "application/json"}
    r = envd.post("/filesystem.Filesystem/ListDir", headers=headers, json={"path": "/"})
    assert r.status_code == 401
    r = envd.get("/files", params={"path": "/etc/hostname"}, headers=headers)
    assert r.status_code == 401
    assert r.json()["code"] == 401
    # A presigned URL carries the signature instead of the token.
    url = sandbox.download_url("/etc/hostname", use_signature_expiration=60)
    r = envd.get(url, headers={"E2b-Sandbox-Id": sandbox.sandbox_id})
    assert r.status_code == 200, r.text
    url = sandbox.upload_url("/tmp/signed.txt", use_signature_expiration=60)
    r = envd.post(
        url,
        headers={"E2b-Sandbox-Id": sandbox.sandbox_id},
        files={"file": ("signed.txt", b"signed")},
    )
    assert r.status_code == 200, r.text
    assert sandbox.files.read("/tmp/signed.txt") == "signed"
    r = envd.post(
        url.replace("signature=", "signature=x"),
        headers={"E2b-Sandbox-Id": sandbox.sandbox_id},
        files={"file": ("signed.txt", b"forged")},
    )
    assert r.status_code == 401
    # The health check needs no token; an unknown sandbox is E2B's 502.
    assert envd.get("/health", headers=headers).status_code == 204
    r = envd.get("/health", headers={"E2b-Sandbox-Id": "e0-000000000000"})
    assert r.status_code == 502
    assert "not found" in r.json()["message"]


def test_unsupported_routes_answer_e2b_errors(e2b_env: E2bServer) -> None:
    api = httpx.Client(
        base_url=e2b_env.api_url, headers={"X-API-KEY": API_KEY}, trust_env=False, timeout=10
    )
    for method, path in [
        ("GET", "/templates"),
        ("POST", "/v3/templates"),
        ("GET", "/volumes"),
        ("POST", "/sandboxes/x/snapshots"),
    ]:
        r = api.request(method, path, json={})
        assert r.status_code == 501, (path, r.text)
        body = r.json()
        assert body["code"] == 501
        assert "not supported by dsec" in body["message"]
    r = api.get("/no/such/route")
    assert r.status_code == 404
    assert r.json()["code"] == 404


def test_async_sdk(e2b_env: E2bServer) -> None:
    async def main() -> None:
        sb = await AsyncSandbox.create("base", timeout=120)
        try:
            r = await sb.commands.run("echo async")
            assert r.stdout == "async\n"
            cat = await sb.commands.run("cat", background=True, stdin=True)
            assert cat.pid in [p.pid for p in await sb.commands.list()]
            await sb.commands.send_stdin(cat.pid, "in\n")
            await sb.commands.close_stdin(cat.pid)
            assert (await cat.wait()).stdout == "in\n"
            sleeper = await sb.commands.run("sleep 60", background=True)
            assert await sb.commands.kill(sleeper.pid) is True
            with pytest.raises(CommandExitException):
                await sleeper.wait()
            await sb.files.write("/tmp/x.txt", "x")
            assert await sb.files.read("/tmp/x.txt") == "x"
            assert await sb.files.make_dir("/tmp/d") is True
            seen: list[Any] = []
            handle = await sb.files.watch_dir("/tmp/d", seen.append, include_entry=True)
            await sb.files.write("/tmp/d/new.txt", "n")
            for _ in range(100):
                if any(ev.name == "new.txt" for ev in seen):
                    break
                await asyncio.sleep(0.1)
            await handle.stop()
            assert any(ev.name == "new.txt" for ev in seen), seen
            # The WatchDir stream carries entries too (the file is still there).
            assert any(ev.entry is not None and ev.entry.path == "/tmp/d/new.txt" for ev in seen)
        finally:
            assert await sb.kill() is True
        assert not await sb.is_running()

    asyncio.run(main())


# ------------------------------------------------------------------ debug mode


def test_debug_mode(e2b_server: E2bServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """E2B_DEBUG=true: no control-plane calls; dsec makes the one debug sandbox from
    --e2b-debug-template at the first envd request."""
    monkeypatch.setenv("E2B_DEBUG", "true")
    monkeypatch.setenv("E2B_SANDBOX_URL", e2b_server.sandbox_url)
    monkeypatch.delenv("E2B_API_URL", raising=False)
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    sb = Sandbox.create()
    assert sb.sandbox_id == "debug_sandbox_id"
    assert "bookworm" in sb.commands.run("cat /etc/os-release").stdout
    sb.files.write("debug.txt", "d")
    again = Sandbox.connect("debug_sandbox_id")
    assert again.files.read("/root/debug.txt") == "d"
    with e2b_server.server.client() as c:
        debug = c.list(labels={"e2b.debug": "true"})
        assert len(debug) == 1


def _token_file(tmp_path: Path) -> Path:
    token = tmp_path / "token"
    token.write_text("secret-token-0123456789")
    token.chmod(0o600)
    return token


def test_api_key_is_the_servers_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    api_port = free_port()
    server = Server(
        tmp_path / "state",
        log_path=tmp_path / "log",
        token_file=_token_file(tmp_path),
        extra_args=["--e2b-listen", f"127.0.0.1:{api_port}"],
    )
    server.start()
    try:
        monkeypatch.setenv("E2B_API_URL", f"http://127.0.0.1:{api_port}")
        monkeypatch.delenv("E2B_DEBUG", raising=False)
        with pytest.raises(AuthenticationException, match="dsec server's token"):
            Sandbox.create("base", api_key="e2b_" + "1" * 40)
        # The right key gets past authentication, to the missing image.
        with pytest.raises(SandboxException, match="base"):
            Sandbox.create("base", api_key="secret-token-0123456789")
    finally:
        server.stop()
        server.cleanup()


def test_debug_mode_is_refused_with_a_token(tmp_path: Path) -> None:
    server = Server(
        tmp_path / "state",
        log_path=tmp_path / "log",
        token_file=_token_file(tmp_path),
        extra_args=["--e2b-envd-listen", f"127.0.0.1:{free_port()}", "--e2b-debug-template", "x"],
    )
    proc = server.spawn()
    assert proc.wait(timeout=30) != 0
    assert "--e2b-debug-template cannot be combined with --token-file" in server.log_tail()


@pytest.mark.parametrize("option", ["--e2b-listen", "--e2b-envd-listen"])
def test_off_loopback_needs_a_token(tmp_path: Path, option: str) -> None:
    server = Server(
        tmp_path / "state",
        log_path=tmp_path / "log",
        extra_args=[option, f"0.0.0.0:{free_port()}"],
    )
    proc = server.spawn()
    assert proc.wait(timeout=30) != 0
    assert "without --token-file" in server.log_tail()
