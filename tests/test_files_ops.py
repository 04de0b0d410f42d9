"""File operations beyond read/write (issue 17): stat, mkdir, move, remove and listings with
depth, on every backend that keeps files, confined as reads and writes are.

Each mutation is checked from inside the sandbox with a command, not only through the files
API that made it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import dsec
import pytest

pytestmark = pytest.mark.usefixtures("stateful")


def _exists(sb: dsec.Sandbox, path: str) -> bool:
    return sb.run(["test", "-e", path]).exit_code == 0


def _is_link(sb: dsec.Sandbox, path: str) -> bool:
    return sb.run(["test", "-L", path]).exit_code == 0


def test_stat_reports_files_directories_and_links(sb: dsec.Sandbox) -> None:
    sb.write_file("/work/a.txt", "hello", mode=0o640)
    assert sb.run("ln -s a.txt /work/link && ln -s /etc /work/abs").ok
    before = time.time()

    f = sb.stat("/work/a.txt")
    assert (f.name, f.path, f.kind, f.size, f.mode, f.is_dir) == (
        "a.txt",
        "/work/a.txt",
        "file",
        5,
        0o640,
        False,
    )
    assert 0 < f.mtime <= before + 60
    d = sb.stat("/work")
    assert (d.kind, d.is_dir) == ("dir", True)
    link = sb.stat("/work/link")
    assert (link.kind, link.link) == ("symlink", "a.txt")
    # A link out of the root is reported, not followed.
    assert sb.stat("/work/abs").link == "/etc"
    assert sb.stat("/").kind == "dir"
    with pytest.raises(dsec.NotFound):
        sb.stat("/work/missing")
    with pytest.raises(dsec.InvalidArgument):
        sb.stat("work/a.txt")


def test_mkdir_makes_parents_and_reports_what_existed(sb: dsec.Sandbox) -> None:
    assert sb.mkdir("/work/x/y/z") is True
    assert sb.run(["test", "-d", "/work/x/y/z"]).ok
    assert sb.mkdir("/work/x/y/z") is False
    with pytest.raises(dsec.Conflict, match="exist_ok"):
        sb.mkdir("/work/x/y/z", exist_ok=False)
    with pytest.raises(dsec.NotFound):
        sb.mkdir("/work/nope/deeper", parents=False)
    assert not _exists(sb, "/work/nope")
    sb.write_file("/work/file", "f")
    with pytest.raises(dsec.Conflict, match="not a directory"):
        sb.mkdir("/work/file")
    assert sb.read_file("/work/file") == b"f"
    assert sb.mkdir("/work/private", mode=0o700)
    assert sb.stat("/work/private").mode == 0o700


def test_move_renames_and_overwrites_only_when_asked(sb: dsec.Sandbox) -> None:
    sb.write_file("/work/a", "A")
    sb.write_file("/work/b", "B")
    with pytest.raises(dsec.Conflict, match="overwrite"):
        sb.move("/work/a", "/work/b")
    assert sb.read_file("/work/b") == b"B"
    sb.move("/work/a", "/work/b", overwrite=True)
    assert sb.read_file("/work/b") == b"A"
    assert not _exists(sb, "/work/a")

    sb.write_file("/work/dir/inner.txt", "in")
    sb.move("/work/dir", "/work/moved")
    assert sb.read_file("/work/moved/inner.txt") == b"in"
    with pytest.raises(dsec.InvalidArgument, match="itself"):
        sb.move("/work/moved", "/work/moved/sub")
    with pytest.raises(dsec.NotFound):
        sb.move("/work/missing", "/work/c")
    with pytest.raises(dsec.NotFound):
        sb.move("/work/b", "/work/no/such/dir/b")
    assert sb.read_file("/work/b") == b"A"
    with pytest.raises(dsec.InvalidArgument, match="root"):
        sb.move("/", "/work/root")
    # A link is moved itself.
    assert sb.run("ln -s moved /work/l").ok
    sb.move("/work/l", "/work/l2")
    assert _is_link(sb, "/work/l2")
    assert sb.read_file("/work/moved/inner.txt") == b"in"


def test_remove_files_links_and_trees(sb: dsec.Sandbox) -> None:
    sb.write_file("/work/t/a/b/c.txt", "c")
    sb.write_file("/work/f", "f")
    assert sb.run("ln -s t /work/link && mkdir /work/empty").ok
    sb.remove("/work/f")
    assert not _exists(sb, "/work/f")
    sb.remove("/work/empty")
    assert not _exists(sb, "/work/empty")
    sb.remove("/work/link")
    assert not _is_link(sb, "/work/link")
    assert sb.read_file("/work/t/a/b/c.txt") == b"c"
    with pytest.raises(dsec.InvalidArgument, match="recursive"):
        sb.remove("/work/t")
    assert sb.read_file("/work/t/a/b/c.txt") == b"c"
    sb.remove("/work/t", recursive=True)
    assert not _exists(sb, "/work/t")
    with pytest.raises(dsec.NotFound):
        sb.remove("/work/t")
    with pytest.raises(dsec.InvalidArgument, match="root"):
        sb.remove("/", recursive=True)
    assert sb.run("true").ok


def test_list_with_depth(sb: dsec.Sandbox) -> None:
    sb.write_file("/work/l/top.txt", "t")
    sb.write_file("/work/l/sub/mid.txt", "mm")
    sb.write_file("/work/l/sub/deeper/low.txt", "lll")
    assert sb.run("ln -s sub /work/l/ln").ok
    one = sb.list_files("/work/l")
    assert [(f.name, f.path) for f in one] == [
        ("ln", "ln"),
        ("sub", "sub"),
        ("top.txt", "top.txt"),
    ]
    assert [f.kind for f in one] == ["symlink", "dir", "file"]
    two = [f.path for f in sb.list_files("/work/l", depth=2)]
    assert two == ["ln", "sub", "sub/deeper", "sub/mid.txt", "top.txt"]
    deep = {f.path: f for f in sb.list_files("/work/l", depth=10)}
    assert deep["sub/deeper/low.txt"].size == 3
    assert deep["sub/deeper/low.txt"].name == "low.txt"
    # The link is never followed: nothing below it is listed.
    assert not any(p.startswith("ln/") for p in deep)
    with pytest.raises(dsec.InvalidArgument, match="depth"):
        sb.list_files("/work/l", depth=0)
    with pytest.raises(dsec.InvalidArgument):
        sb.list_files("/work/l/top.txt", depth=2)


def test_every_operation_is_confined(sb: dsec.Sandbox) -> None:
    """Links that point out of the root, and the kernel interfaces, as for reads."""
    sb.write_file("/work/keep", "k")
    assert sb.run("ln -s /etc /work/abs && ln -s ../../../.. /work/up").ok
    escapes = [
        lambda: sb.stat("/work/abs/passwd"),
        lambda: sb.stat("/work/up/etc"),
        lambda: sb.mkdir("/work/abs/made"),
        lambda: sb.move("/work/keep", "/work/abs/keep"),
        lambda: sb.move("/work/abs/passwd", "/work/passwd"),
        lambda: sb.remove("/work/abs/passwd"),
        lambda: sb.remove("/work/abs/group", recursive=True),
        lambda: sb.list_files("/work/abs", depth=2),
    ]
    for call in escapes:
        with pytest.raises(dsec.InvalidArgument, match="escapes"):
            call()
    assert not _exists(sb, "/etc/made")
    assert _exists(sb, "/etc/passwd")
    assert sb.read_file("/work/keep") == b"k"
    # Removing a link to a directory removes the link, never its target.
    sb.remove("/work/abs", recursive=True)
    assert _exists(sb, "/etc/passwd")

    kernel = [
        lambda: sb.stat("/proc/1/environ"),
        lambda: sb.stat("/proc/self"),
        lambda: sb.mkdir("/proc/made"),
        lambda: sb.mkdir("/sys/made"),
        lambda: sb.remove("/proc/1", recursive=True),
        lambda: sb.remove("/proc", recursive=True),
        lambda: sb.remove("/dev/null"),
        lambda: sb.move("/dev/null", "/work/null"),
        lambda: sb.move("/work/keep", "/dev/keep"),
    ]
    for call in kernel:
        with pytest.raises(dsec.InvalidArgument):
            call()
    assert sb.run(["test", "-c", "/dev/null"]).ok
    assert sb.read_file("/work/keep") == b"k"


def test_changes_are_events(client: dsec.Client, sb: dsec.Sandbox) -> None:
    sb.mkdir("/work/ev")
    sb.write_file("/work/ev/a", "a")
    sb.move("/work/ev/a", "/work/ev/b")
    sb.remove("/work/ev", recursive=True)
    kinds = ["file.mkdir", "file.move", "file.remove"]
    deadline = time.monotonic() + 10
    while True:
        got = list(client.events(sandbox=sb.id, kinds=kinds))
        if len(got) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [e.kind for e in got] == kinds
    assert got[0].data["path"] == "/work/ev"
    assert (got[1].data["src"], got[1].data["dst"]) == ("/work/ev/a", "/work/ev/b")
    assert got[2].data == {"path": "/work/ev", "recursive": True}


def test_the_async_sdk_does_the_same(client: dsec.Client, sb: dsec.Sandbox) -> None:
    async def go() -> None:
        async with dsec.AsyncClient(client.url) as ac:
            asb = await ac.get(sb.id)
            assert await asb.mkdir("/work/as/sub")
            await asb.write_file("/work/as/sub/f", "x")
            assert (await asb.stat("/work/as/sub/f")).size == 1
            paths = [f.path for f in await asb.list_files("/work/as", depth=2)]
            assert paths == ["sub", "sub/f"]
            await asb.move("/work/as/sub/f", "/work/as/g")
            await asb.remove("/work/as", recursive=True)
            with pytest.raises(dsec.NotFound):
                await asb.stat("/work/as")

    asyncio.run(go())


def _until(events: Iterator[dsec.WatchEvent], want: set[tuple[str, str]]) -> list[dsec.WatchEvent]:
    """Events read until every (kind, path) of ``want`` was seen (the watch's heartbeats
    keep the read from stalling); fails after WATCH_WAIT_S."""
    seen: list[dsec.WatchEvent] = []
    deadline = time.monotonic() + WATCH_WAIT_S
    missing = set(want)
    while missing:
        assert time.monotonic() < deadline, f"never saw {missing}; saw {seen}"
        ev = next(events)
        seen.append(ev)
        missing.discard((ev.kind, ev.path))
    return seen


#: Longest wait for an event the sandbox should have reported at once.
WATCH_WAIT_S = 20.0


def test_watch_sees_create_write_rename_chmod_remove(sb: dsec.Sandbox) -> None:
    sb.mkdir("/work/w")
    events = sb.watch("/work/w")
    try:
        # Armed on return: a change made right after is seen.
        sb.write_file("/work/w/a.txt", "1")
        sb.run("echo more >> /work/w/a.txt && chmod 600 /work/w/a.txt")
        sb.move("/work/w/a.txt", "/work/w/b.txt")
        sb.mkdir("/work/w/sub")
        sb.remove("/work/w/b.txt")
        seen = _until(
            events,
            {
                ("create", "/work/w/a.txt"),
                ("write", "/work/w/a.txt"),
                ("chmod", "/work/w/a.txt"),
                ("rename", "/work/w/a.txt"),
                ("create", "/work/w/b.txt"),
                ("create", "/work/w/sub"),
                ("remove", "/work/w/b.txt"),
            },
        )
        assert next(e for e in seen if e.path == "/work/w/sub").is_dir
        # Not recursive: a change below a subdirectory is not reported...
        sb.write_file("/work/w/sub/deep", "d")
        sb.write_file("/work/w/marker", "m")
        later = _until(events, {("create", "/work/w/marker")})
        assert all(e.path != "/work/w/sub/deep" for e in later)
        # ...and the watch ends with its directory.
        sb.remove("/work/w", recursive=True)
        rest = list(events)
        assert all(e.path.startswith("/work/w/") for e in rest), rest
    finally:
        events.close()  # type: ignore[attr-defined]


def test_a_recursive_watch_follows_new_subdirectories(sb: dsec.Sandbox) -> None:
    sb.write_file("/work/r/old/keep", "k")
    events = sb.watch("/work/r", recursive=True)
    try:
        sb.write_file("/work/r/old/f", "1")
        sb.mkdir("/work/r/new/deeper")
        _until(events, {("create", "/work/r/old/f"), ("create", "/work/r/new")})
        # A directory made after the watch began is watched too, once reported.
        deadline = time.monotonic() + WATCH_WAIT_S
        n = 0
        while True:
            n += 1
            sb.write_file(f"/work/r/new/deeper/g{n}", "2")
            want = {("create", f"/work/r/new/deeper/g{n}")}
            try:
                _until(events, want)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
    finally:
        events.close()  # type: ignore[attr-defined]


def test_watch_refuses_what_list_refuses(sb: dsec.Sandbox) -> None:
    sb.write_file("/work/file", "f")
    assert sb.run("ln -s /etc /work/abs").ok
    with pytest.raises(dsec.NotFound):
        sb.watch("/work/missing")
    with pytest.raises(dsec.InvalidArgument, match="not a directory"):
        sb.watch("/work/file")
    with pytest.raises(dsec.InvalidArgument, match="escapes"):
        sb.watch("/work/abs")
    with pytest.raises(dsec.InvalidArgument, match="procfs"):
        sb.watch("/proc")
    with pytest.raises(dsec.InvalidArgument):
        sb.watch("/dev")


def test_watches_are_bounded_and_released_when_the_client_goes(
    sb: dsec.Sandbox,
) -> None:
    """Eight watches per sandbox; a closed stream gives its watch back (the server sees
    the client gone, at the latest at the next heartbeat, and ends it in the sandbox)."""
    sb.mkdir("/work/b")

    def open_all() -> list[Iterator[dsec.WatchEvent]]:
        opened: list[Iterator[dsec.WatchEvent]] = []
        deadline = time.monotonic() + 30
        while len(opened) < 8:
            try:
                opened.append(sb.watch("/work/b"))
            except dsec.Conflict:
                assert time.monotonic() < deadline, "closed watches were never released"
                time.sleep(0.5)
        return opened

    for _ in range(3):
        opened = open_all()
        with pytest.raises(dsec.Conflict, match="watches open"):
            sb.watch("/work/b")
        for w in opened:
            w.close()  # type: ignore[attr-defined]
    # The sandbox still answers, and a watch still works.
    w = open_all()[0]
    sb.write_file("/work/b/x", "x")
    _until(w, {("create", "/work/b/x")})


def test_the_async_watch_is_armed_once_awaited(client: dsec.Client, sb: dsec.Sandbox) -> None:

    async def go() -> None:
        async with dsec.AsyncClient(client.url) as ac:
            asb = await ac.get(sb.id)
            await asb.mkdir("/work/aw")
            events = await asb.watch("/work/aw")
            await asb.write_file("/work/aw/f", "x")
            async for ev in events:
                if (ev.kind, ev.path) == ("create", "/work/aw/f"):
                    break
            await events.aclose()  # type: ignore[attr-defined]

    asyncio.run(asyncio.wait_for(go(), WATCH_WAIT_S))
