"""`client.call` in one request (`POST /v1/calls`, `/v1/calls/stream`): the semantics and
errors of create(fncall) + run + stop, the worker's limits, and no handle left behind, also
when the client goes away mid-call."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import dsec
import httpx
import pytest
from dsec_testlib import Server, wait_until


def call_handles(client: dsec.Client) -> list[str]:
    return [sb.id for sb in client.list() if sb.info().backend == "fncall"]


def test_call_is_one_request(client: dsec.Client, busybox_image: str) -> None:
    sent: list[str] = []
    pool = client._pool
    real = pool.request

    def counting(req: Any) -> Any:
        sent.append(req.head.split(b" ", 2)[1].decode())
        return real(req)

    pool.request = counting  # type: ignore[method-assign]
    try:
        r = client.call(["echo", "hi"], image=busybox_image)
    finally:
        del pool.request
    assert r.stdout == "hi\n"
    assert sent == ["/v1/calls"]


def test_call_runs_the_command_with_its_inputs(client: dsec.Client, busybox_image: str) -> None:
    r = client.call(
        "read x; echo got $x; cat /task/in.txt; echo $MARK; pwd; echo oops >&2; exit 3",
        image=busybox_image,
        stdin="42\n",
        files={"/task/in.txt": "hello\n"},
        env={"MARK": "m"},
        cwd="/task",
        timeout=10,
    )
    assert (r.exit_code, r.stdout, r.stderr) == (3, "got 42\nhello\nm\n/task\n", "oops\n")
    assert not r.timed_out and not r.replayed and r.duration_ms > 0


def test_call_limits_are_the_workers(client: dsec.Client, busybox_image: str) -> None:
    r = client.call("head -c 200m /dev/zero | tail", image=busybox_image, memory_mb=48, timeout=60)
    assert r.oom_killed, r
    r = client.call(
        "head -c 1000 /dev/zero | tail -c 10 | wc -c", image=busybox_image, memory_mb=48
    )
    assert r.ok and r.stdout.strip() == "10"
    r = client.call("yes | head -c 100000", image=busybox_image, max_output_bytes=1000)
    assert r.truncated and len(r.stdout) == 1000


def test_call_timeout_kills_it(client: dsec.Client, busybox_image: str) -> None:
    t0 = time.monotonic()
    r = client.call("sleep 30", image=busybox_image, timeout=0.5)
    assert r.timed_out and r.exit_code is None
    assert time.monotonic() - t0 < 10


def test_call_errors_are_those_of_create_and_run(client: dsec.Client, busybox_image: str) -> None:
    with pytest.raises(dsec.NotFound, match="no-such-image"):
        client.call("true", image="no-such-image")
    with pytest.raises(dsec.InvalidArgument, match="memory_mb"):
        client.call("true", image=busybox_image, memory_mb=1)
    with pytest.raises(dsec.InvalidArgument, match="timeout"):
        client.call("true", image=busybox_image, timeout=-1)
    with pytest.raises(dsec.InvalidArgument, match="empty"):
        client.call([], image=busybox_image)
    with pytest.raises(dsec.InvalidArgument, match="cwd"):
        client.call("true", image=busybox_image, cwd="relative")
    with pytest.raises(dsec.NotFound, match="no-such-image"):
        list(client.call_stream("true", image="no-such-image"))
    assert call_handles(client) == []


def test_raw_bad_bodies_are_400(server: Server, busybox_image: str) -> None:
    for body in (
        {"cmd": "true"},  # no image
        {"image": busybox_image},  # no cmd
        {"image": busybox_image, "cmd": "true", "step": 0},  # a call has no trajectory
        {"image": busybox_image, "cmd": "true", "stdin_b64": "not base64!"},
    ):
        r = httpx.post(f"{server.url}/v1/calls", json=body, trust_env=False, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["kind"] == "invalid_argument"


def test_call_stream(client: dsec.Client, busybox_image: str) -> None:
    events = list(client.call_stream("echo a; sleep 0.2; echo b >&2; exit 4", image=busybox_image))
    assert [(e.kind, e.data) for e in events[:-1]] == [("stdout", "a\n"), ("stderr", "b\n")]
    assert events[-1].kind == "exit" and events[-1].exit_code == 4


def test_no_handle_is_left(client: dsec.Client, busybox_image: str) -> None:
    for _ in range(5):
        assert client.call("true", image=busybox_image).ok
        assert [e.kind for e in client.call_stream("true", image=busybox_image)] == ["exit"]
    assert wait_until(lambda: call_handles(client) == [], 5), call_handles(client)


def test_a_client_that_goes_away_leaves_nothing(
    server: Server, client: dsec.Client, busybox_image: str
) -> None:
    body = json.dumps({"image": busybox_image, "cmd": "sleep 3", "timeout_s": 30}).encode()
    for path in ("/v1/calls", "/v1/calls/stream"):
        s = socket.create_connection(("127.0.0.1", server.port))
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        s.sendall(head + body)
        if path == "/v1/calls":  # the streamed call's handle goes once the command started
            assert wait_until(lambda: call_handles(client) != [], 5)
        else:
            time.sleep(0.5)
        s.close()
    assert wait_until(lambda: call_handles(client) == [], 10), call_handles(client)


def test_async_calls(server: Server, busybox_image: str) -> None:
    async def main() -> tuple[list[dsec.CommandResult], list[str]]:
        async with server.async_client() as ac:
            rs = await asyncio.gather(
                *(
                    ac.call(
                        ["sh", "-c", "cat /n; echo $$"], image=busybox_image, files={"/n": f"{i}\n"}
                    )
                    for i in range(40)
                )
            )
            kinds = [ev.kind async for ev in ac.call_stream("echo hi", image=busybox_image)]
            return rs, kinds

    rs, kinds = asyncio.run(main())
    assert [r.stdout.split()[0] for r in rs] == [str(i) for i in range(40)]
    # Each call is PID 1 of a pid namespace of its own.
    assert {r.stdout.split()[1] for r in rs} == {"1"}
    assert kinds == ["stdout", "exit"]


def test_stdin_bytes(client: dsec.Client, busybox_image: str) -> None:
    data = bytes(range(256)) * 4
    r = client.call("od -An -tx1 -v | wc -w", image=busybox_image, stdin=data)
    assert r.stdout.strip() == str(len(data))
