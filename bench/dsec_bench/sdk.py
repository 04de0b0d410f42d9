"""`sdk`: dsec as a Python user sees it, beside the lean Rust client, in one run.

- the SDK's own CPU per request (this process's user + system time over N requests,
  nothing subtracted), sync and asyncio, with the same request through other HTTP clients
  (httpx, which the SDK used before; http.client; aiohttp when installed) taking turns
  with it, block by block;
- creations/s through `AsyncClient` at concurrency 32, alternated with `dsec-loadgen`
  runs of the same size, and their ratio;
- fncall calls/s through `AsyncClient.call` at concurrency 32 (one request per call),
  beside `dsec-loadgen --calls`, and the sync `client.call` round trip;
- 1,000 sandboxes active at once from one `AsyncClient`: create, write a file, three
  commands, stop; failures counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import importlib.util
import json
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import dsec
import dsec_local
import orjson
from dsec_local import percentile

from .common import Dsec, latency_stats, log
from .create import LOADGEN, concurrent_creates, run_loadgen

TARGET_SDK_CPU_US = 150.0
TARGET_SDK_CREATIONS_PER_S = 300.0
TARGET_SDK_VS_LEAN = 0.8
TARGET_ASYNC_CALLS_PER_S = 500.0
TARGET_SYNC_CALL_P50_MS = 2.0
CONCURRENCY = 32
ACTIVE = 1000


#: Requests per measured block. Clients take turns block by block, so that a busy host's
#: noise falls on all of them alike; the best block is the cost without contention.
BLOCK = 100


def _summary(samples: list[float]) -> dict[str, float]:
    return {"cpu_us": percentile(samples, 0.5), "cpu_us_best": min(samples), "blocks": len(samples)}


def sync_cpu(clients: dict[str, Callable[[], Any]], n: int) -> dict[str, dict[str, float]]:
    """µs of this process's CPU (user + system) per call of each function, in turns of
    :data:`BLOCK` calls, ``n`` calls each in all (after a warm-up)."""
    samples: dict[str, list[float]] = {k: [] for k in clients}
    for fn in clients.values():
        for _ in range(20):
            fn()
    for _ in range(max(1, n // BLOCK)):
        for name, fn in clients.items():
            c0 = time.process_time()
            for _ in range(BLOCK):
                fn()
            samples[name].append((time.process_time() - c0) / BLOCK * 1e6)
    return {k: _summary(v) for k, v in samples.items()}


async def async_cpu(
    clients: dict[str, Callable[[], Awaitable[Any]]], n: int, concurrency: int
) -> dict[str, dict[str, float]]:
    """The same for coroutines, ``concurrency`` in flight within each block."""
    sem = asyncio.Semaphore(concurrency)

    async def one(fn: Callable[[], Awaitable[Any]]) -> None:
        async with sem:
            await fn()

    samples: dict[str, list[float]] = {k: [] for k in clients}
    for fn in clients.values():
        await asyncio.gather(*(one(fn) for _ in range(20)))
    for _ in range(max(1, n // BLOCK)):
        for name, fn in clients.items():
            c0 = time.process_time()
            await asyncio.gather(*(one(fn) for _ in range(BLOCK)))
            samples[name].append((time.process_time() - c0) / BLOCK * 1e6)
    return {k: _summary(v) for k, v in samples.items()}


class RawHttp:
    """The least a Python client can do per request: one blocking socket, the request
    bytes prepared once, the answer's head read by line and its body by length (no
    timeouts, no pool, no checks). The floor the SDK's CPU per request is compared with."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 80))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = self.sock.makefile("rb")

    @staticmethod
    def request(method: str, path: str, body: bytes = b"") -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: dsec\r\nContent-Length: {len(body)}\r\n"
        return head.encode() + b"Content-Type: application/json\r\n\r\n" + body

    def send(self, req: bytes) -> Any:
        self.sock.sendall(req)
        self.file.readline()
        length = 0
        while (line := self.file.readline()) not in (b"\r\n", b""):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        return orjson.loads(self.file.read(length))

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class _RawProtocol(asyncio.Protocol):
    """One connection of :class:`RawAsyncHttp`: collects an answer, wakes its caller."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.answer: asyncio.Future[bytes] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        at = self.buf.lower().find(b"content-length:", 0, end)
        length = int(self.buf[at + 15 : self.buf.find(b"\r\n", at)])
        if len(self.buf) >= end + 4 + length and self.answer is not None:
            body, self.buf = self.buf[end + 4 : end + 4 + length], b""
            self.answer.set_result(body)


class RawAsyncHttp:
    """The least an asyncio client can do per request, the floor of the async rows: one
    `asyncio.Protocol` per connection in flight, kept, the request bytes prepared once,
    the answer's body found by its length (no timeouts, no checks)."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.idle: list[_RawProtocol] = []

    async def send(self, req: bytes) -> Any:
        loop = asyncio.get_running_loop()
        if self.idle:
            proto = self.idle.pop()
        else:
            _, proto = await loop.create_connection(_RawProtocol, self.host, self.port)
        assert proto.transport is not None
        proto.answer = loop.create_future()
        proto.transport.write(req)
        body = await proto.answer
        self.idle.append(proto)
        return orjson.loads(body)

    def close(self) -> None:
        for proto in self.idle:
            if proto.transport is not None:
                proto.transport.close()


def sdk_cpu(d: Dsec, n: int) -> dict[str, Any]:
    """CPU per request of the SDK, sync and async, with the same `GET /v1/sandboxes/{id}`
    through other HTTP clients taking turns with it."""
    import httpx

    sb = d.client.create(image=d.image, labels=d.labels)
    d.track(sb.id)
    path = f"/v1/sandboxes/{sb.id}"
    u = urlsplit(d.url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80)

    def stdlib() -> Any:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())

    raw = RawHttp(d.url)
    raw_info = RawHttp.request("GET", path)
    raw_run = RawHttp.request("POST", f"{path}/exec", b'{"cmd":["/bin/true"]}')

    res: dict[str, Any] = {}
    try:
        log(f"sdk: CPU per request, {n} of each, in turns of {BLOCK}")
        with httpx.Client(base_url=d.url, trust_env=False) as hx:
            res["sync"] = sync_cpu(
                {
                    "sdk_run": lambda: sb.run(["/bin/true"]),
                    "raw_run": lambda: raw.send(raw_run),
                    "sdk_info": sb.info,
                    "raw_info": lambda: raw.send(raw_info),
                    "httpx_info": lambda: hx.get(path).json(),
                    "http_client_info": stdlib,
                },
                n,
            )

        async def aio(c: int) -> dict[str, dict[str, float]]:
            async with (
                d.async_client() as ac,
                httpx.AsyncClient(base_url=d.url, trust_env=False) as ax,
            ):
                asb = await ac.get(sb.id)

                async def hx_info() -> Any:
                    return (await ax.get(path)).json()

                raw_async = RawAsyncHttp(d.url)
                clients: dict[str, Callable[[], Awaitable[Any]]] = {
                    "sdk_run": lambda: asb.run(["/bin/true"]),
                    "raw_run": lambda: raw_async.send(raw_run),
                    "sdk_info": asb.info,
                    "raw_info": lambda: raw_async.send(raw_info),
                    "httpx_info": hx_info,
                }
                try:
                    if importlib.util.find_spec("aiohttp") is None:
                        return await async_cpu(clients, n, c)
                    import aiohttp

                    async with aiohttp.ClientSession(d.url) as session:

                        async def aio_info() -> Any:
                            async with session.get(path) as r:
                                return await r.json()

                        clients["aiohttp_info"] = aio_info
                        return await async_cpu(clients, n, c)
                finally:
                    raw_async.close()

        for c in (1, CONCURRENCY):
            res[f"async_c{c}"] = asyncio.run(aio(c))
    finally:
        conn.close()
        raw.close()
        sb.stop()
        d.untrack(sb.id)
    return res


def creations(d: Dsec, count: int, rounds: int = 2) -> dict[str, Any]:
    """Creations/s at concurrency 32, the SDK and dsec-loadgen alternating."""
    sdk: list[float] = []
    lean: list[float] = []
    for r in range(rounds):
        log(f"sdk: {count} creations at c={CONCURRENCY} through AsyncClient (round {r + 1})")
        run = asyncio.run(concurrent_creates(d, CONCURRENCY, count, stop_each=False))
        sdk.append(run["per_s"])
        if LOADGEN.exists():
            lean.append(run_loadgen(d, count, CONCURRENCY)["creations_per_s"])
    res: dict[str, Any] = {"n": count, "rounds": rounds, "sdk_per_s": sum(sdk) / len(sdk)}
    if lean:
        res["lean_per_s"] = sum(lean) / len(lean)
        res["ratio"] = res["sdk_per_s"] / res["lean_per_s"]
    return res


def fncalls(d: Dsec, count: int, seq_n: int) -> dict[str, Any]:
    """Calls/s of `client.call(["/bin/true"])` through AsyncClient at c=32 (beside
    `dsec-loadgen --calls`), and the sync round trip."""
    res: dict[str, Any] = {"n": count}
    errors: list[str] = []

    async def burst() -> float:
        async with d.async_client() as ac:
            sem = asyncio.Semaphore(CONCURRENCY)

            async def one() -> None:
                async with sem:
                    try:
                        r = await ac.call(["/bin/true"], image=d.image)
                        if r.exit_code != 0:
                            raise RuntimeError(f"exit code {r.exit_code}: {r.stderr[:200]}")
                    except Exception as e:
                        errors.append(f"{type(e).__name__}: {e}")

            await asyncio.gather(*(one() for _ in range(50)))  # the pool warms up
            t0 = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(count)))
            return count / (time.perf_counter() - t0)

    log(f"sdk: {count} fncalls at c={CONCURRENCY} through AsyncClient.call")
    res["async_calls_per_s"] = asyncio.run(burst())
    res["failed"] = len(errors)
    if errors:
        log(f"sdk fncalls: {len(errors)} failed; first: {errors[0]}")
    if LOADGEN.exists():
        res["lean"] = run_loadgen(d, count, CONCURRENCY, "--calls")
    log(f"sdk: {seq_n} sequential client.call round trips")
    rtt: list[float] = []
    failed = 0
    for _ in range(seq_n):
        t0 = time.perf_counter()
        r = d.client.call(["/bin/true"], image=d.image)
        if r.exit_code == 0:
            rtt.append((time.perf_counter() - t0) * 1e3)
        else:
            failed += 1
        time.sleep(0.01)  # a steady 100 calls/s or less, not a burst
    res["sync"] = latency_stats(rtt, failed)
    return res


def active(d: Dsec, count: int) -> dict[str, Any]:
    """`count` sandboxes at once from one AsyncClient: create, write a file, run three
    commands, stop; each lifecycle timed."""
    lat: list[float] = []
    errors: list[str] = []

    async def lifecycle(ac: dsec.AsyncClient, i: int) -> None:
        t0 = time.perf_counter()
        sb = None
        try:
            sb = await ac.create(image=d.image, labels=d.labels)
            d.track(sb.id)
            await sb.write_file("/root/task.sh", f"echo $(( {i} * 2 ))\n")
            r1 = await sb.run("sh /root/task.sh")
            r2 = await sb.run(["cat", "/root/task.sh"])
            r3 = await sb.run("ls /root | wc -l")
            got = (r1.stdout, r2.stdout.startswith("echo"), r3.stdout.strip())
            if got != (f"{i * 2}\n", True, "1"):
                raise RuntimeError(f"wrong output {got}")
            await sb.stop()
            d.untrack(sb.id)
            lat.append((time.perf_counter() - t0) * 1e3)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
            if sb is not None:
                with contextlib.suppress(Exception):
                    await sb.stop()
                d.untrack(sb.id)

    async def main() -> float:
        async with d.async_client() as ac:
            t0 = time.perf_counter()
            await asyncio.gather(*(lifecycle(ac, i) for i in range(count)))
            return time.perf_counter() - t0

    dsec_local.raise_open_file_limit()
    log(f"sdk: {count} sandboxes active at once from one AsyncClient")
    wall = asyncio.run(main())
    if errors:
        log(f"sdk active: {len(errors)}/{count} failed; first: {errors[0]}")
    return {
        "n": count,
        "failed": len(errors),
        "wall_s": wall,
        "p50_ms": percentile(lat, 0.5),
        "p99_ms": percentile(lat, 0.99),
        "first_error": errors[0] if errors else None,
    }


def bench_sdk(d: Dsec, n: int, cpu_n: int, active_n: int = ACTIVE) -> dict[str, Any]:
    count = max(n, 16 * CONCURRENCY)
    return {
        "cpu": sdk_cpu(d, cpu_n),
        "create": creations(d, count),
        "fncall": fncalls(d, count, n),
        "active": active(d, active_n),
    }
