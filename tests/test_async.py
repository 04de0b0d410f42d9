"""dsec.AsyncClient: the same API as coroutines, and many sandboxes from one event loop."""

from __future__ import annotations

import asyncio
import time
import uuid

import dsec
import pytest
from dsec_testlib import VM_BACKENDS, Server, assert_no_leftovers


def test_async_api(server: Server, backend: str, image: str) -> None:
    async def main() -> None:
        async with server.async_client() as c:
            tag = uuid.uuid4().hex[:12]
            async with c.create(backend=backend, image=image, labels={"t": tag}) as sb:
                assert isinstance(sb, dsec.AsyncSandbox)
                r = await sb.run("echo hi; echo err >&2; exit 3")
                assert (r.exit_code, r.stdout, r.stderr) == (3, "hi\n", "err\n")
                r = await sb.run(["cat"], stdin=b"\x00\x01", env={"A": "b"})
                assert r.stdout == "\x00\x01"
                events = [ev async for ev in sb.stream("echo a; echo b >&2")]
                assert events[-1].kind == "exit" and events[-1].exit_code == 0
                assert "".join(e.data for e in events if e.kind == "stdout") == "a\n"
                if backend != "fncall":
                    await sb.write_file("/tmp/f", "data")
                    assert await sb.read_file("/tmp/f") == b"data"
                    assert "f" in {f.name for f in await sb.list_files("/tmp")}
                info = await sb.info()
                assert (info.id, info.state) == (sb.id, "running")
                assert [s.id for s in await c.list(labels={"t": tag})] == [sb.id]
                again = await c.get(sb.id)
                assert (await again.run("echo x")).stdout == "x\n"
                with pytest.raises(dsec.NotFound):
                    await sb.read_file("/no/such")
            with pytest.raises(dsec.NotFound):
                await c.get(sb.id)
            await sb.stop()  # harmless
            # plain await + explicit stop
            sb2 = await c.create(backend=backend, image=image)
            assert (await sb2.run("true")).exit_code == 0
            await sb2.stop()
            assert any(i.name == "busybox" for i in await c.images())

    asyncio.run(main())


def test_async_errors(server: Server, busybox_image: str) -> None:
    async def main() -> None:
        async with server.async_client() as c:
            with pytest.raises(dsec.InvalidArgument):
                await c.create(backend="nope", image=busybox_image)
            with pytest.raises(dsec.NotFound):
                await c.create(image="no-such-image-xyz")

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_200_concurrent_sandboxes(server: Server, backend: str, image: str) -> None:
    # A TCG guest costs ~160 MiB of host memory and a share of a core: 200 of them would
    # not fit this host, so VM backends run a handful at once; Docker's daemon takes ~0.3 s
    # a container however many wait, so 50 there.
    n = 8 if backend in VM_BACKENDS else 50 if backend == "docker" else 200
    tag = uuid.uuid4().hex[:12]
    # 200 of the default 512 MiB would pass admission's budget on a small host (4 × its
    # memory); an echo needs far less.
    memory_mb = None if backend in VM_BACKENDS else 64

    async def one(c: dsec.AsyncClient, i: int) -> str:
        sb = await c.create(backend=backend, image=image, labels={"t": tag}, memory_mb=memory_mb)
        try:
            r = await sb.run(f"echo $(({i} * 3))")
            assert r.exit_code == 0, r.stderr
            assert r.stdout == f"{i * 3}\n"
        finally:
            await sb.stop()
        return sb.id

    async def main() -> tuple[list[str | BaseException], list[dsec.AsyncSandbox]]:
        async with server.async_client() as c:
            results = await asyncio.gather(
                *(one(c, i) for i in range(n)), return_exceptions=True
            )
            return results, await c.list(labels={"t": tag})

    t0 = time.monotonic()
    results, remaining = asyncio.run(main())
    elapsed = time.monotonic() - t0
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"{len(failures)}/{n} failed, e.g. {failures[:3]!r}"
    assert len(set(results)) == n
    assert remaining == []
    print(f"{n} sandboxes in {elapsed:.1f}s ({n / elapsed:.0f}/s)")
    for sid in list(results)[:: max(1, n // 10)]:
        assert_no_leftovers(server, str(sid))
