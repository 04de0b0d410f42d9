"""The asyncio client: :class:`AsyncClient` and :class:`AsyncSandbox`.

One :class:`AsyncClient` drives thousands of sandboxes from one event loop; requests
share one connection pool (see ``max_connections``).
"""

from __future__ import annotations

import builtins
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterable, Mapping
from types import TracebackType
from typing import Any, TypeVar

from . import _http
from . import _protocol as p
from ._protocol import Command, Data, Files, Labels, Network, PathLike
from .errors import DsecError
from .types import (
    CommandResult,
    Event,
    FileInfo,
    Image,
    ProcessEvent,
    ProcessInfo,
    SandboxInfo,
    StreamEvent,
    WatchEvent,
)

T = TypeVar("T")
E = TypeVar("E")

__all__ = ["AsyncClient", "AsyncProcess", "AsyncSandbox"]


def _default_max_connections() -> int:
    """As many connections as open files allow (leaving some), between 256 and 10000."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 1000
    if soft == resource.RLIM_INFINITY:
        return 10000
    return max(256, min(10000, soft - 128))


class AsyncClient:
    """The asyncio twin of :class:`dsec.Client`: the same methods, as coroutines.

    ``max_connections`` bounds concurrent HTTP requests (further ones wait for a free
    connection); by default it follows the open-file limit (``ulimit -n``).
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        max_connections: int | None = None,
    ) -> None:
        self.url = p.resolve_url(url)
        n = max_connections if max_connections is not None else _default_max_connections()
        self._origin = p.origin(self.url, p.resolve_token(token))
        self._pool = _http.AsyncPool(self._origin, n, p.CONNECT_TIMEOUT_S)

    # -- transport

    async def _do(self, call: p.Call[T]) -> T:
        try:
            resp = await self._pool.request(call.request(self._origin))
        except _http.TransportError as e:
            raise p.transport_error(self.url, e) from e
        return call.finish(resp)

    def _stream(self, call: p.Call[None]) -> AsyncIterator[StreamEvent]:
        return self._lines(call, p.parse_event)

    async def _armed(
        self, call: p.Call[None], parse: Callable[[bytes], E | None]
    ) -> AsyncIterator[E]:
        lines = self._lines(call, parse)
        if await anext(lines, None) is None:
            raise DsecError("the stream ended before it was armed")
        return lines

    async def _lines(
        self, call: p.Call[None], parse: Callable[[bytes], E | None]
    ) -> AsyncIterator[E]:
        try:
            head, body = await self._pool.stream(call.request(self._origin))
        except _http.TransportError as e:
            raise p.transport_error(self.url, e) from e
        try:
            if not (200 <= head.status < 300):
                data = b"".join([chunk async for chunk in body])
                call.finish(_http.Response(head.status, head.head, data))
                return
            split = p.LineSplitter()
            async for chunk in body:
                for line in split.feed(chunk):
                    ev = parse(line)
                    if ev is not None:
                        yield ev
            for line in split.end():
                ev = parse(line)
                if ev is not None:
                    yield ev
        except _http.TransportError as e:
            raise p.transport_error(self.url, e) from e
        finally:
            await body.aclose()

    # -- sandboxes

    def create(
        self,
        backend: str = "container",
        image: str | None = None,
        cpus: float | None = None,
        memory_mb: int | None = None,
        pids: int | None = None,
        disk_mb: int | None = None,
        ttl_s: float | None = None,
        idle_ttl_s: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        network: Network = False,
        labels: Labels | None = None,
        trajectory_id: str | None = None,
        ca_bundle: bool | None = None,
    ) -> PendingSandbox:
        """Create a sandbox: ``sb = await client.create(...)``, or
        ``async with client.create(...) as sb:`` to stop it on exit."""
        call = p.create_call(p.create_body(**p.create_args(locals())))
        return PendingSandbox(self._create(call))

    async def create_many(
        self,
        n: int,
        backend: str = "container",
        image: str | None = None,
        cpus: float | None = None,
        memory_mb: int | None = None,
        pids: int | None = None,
        disk_mb: int | None = None,
        ttl_s: float | None = None,
        idle_ttl_s: float | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        network: Network = False,
        labels: Labels | None = None,
        trajectory_id: str | None = None,
        ca_bundle: bool | None = None,
    ) -> builtins.list[AsyncSandbox]:
        """Create ``n`` sandboxes alike in one request (see ``Client.create_many``)."""
        body = p.create_body(**p.create_args(locals()))
        items = await self._do(p.create_many_call(n, body))
        return p.settle_batch(items, lambda info: AsyncSandbox(self, info))

    async def _create(self, call: p.Call[SandboxInfo]) -> AsyncSandbox:
        return AsyncSandbox(self, await self._do(call))

    async def get(self, id: str) -> AsyncSandbox:
        """Reconnect to a sandbox by id (its step count starts at 0 again)."""
        return AsyncSandbox(self, await self._do(p.get_call(id)))

    async def log(self, id: str, trajectory_id: str | None = None) -> dict[str, Any]:
        """The trajectory log of a sandbox, also after it is gone (see ``Client.log``)."""
        return await self._do(p.log_call(id, trajectory_id))

    async def list(self, labels: Labels | None = None) -> builtins.list[AsyncSandbox]:
        return [AsyncSandbox(self, i) for i in await self._do(p.list_call(labels))]

    async def call(
        self,
        cmd: Command,
        image: str | None = None,
        timeout: float | None = None,
        files: Files | None = None,
        stdin: Data | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        cpus: float | None = None,
        memory_mb: int | None = None,
        pids: int | None = None,
        disk_mb: int | None = None,
        max_output_bytes: int | None = None,
    ) -> CommandResult:
        """Run one command in a fresh worker of the image's ``fncall`` pool (one request)."""
        return await self._do(
            p.fncall_call(
                p.fncall_body(
                    cmd,
                    image=image,
                    cpus=cpus,
                    memory_mb=memory_mb,
                    pids=pids,
                    disk_mb=disk_mb,
                    timeout=timeout,
                    env=env,
                    cwd=cwd,
                    stdin=stdin,
                    files=files,
                    max_output_bytes=max_output_bytes,
                )
            )
        )

    async def call_stream(
        self,
        cmd: Command,
        image: str | None = None,
        timeout: float | None = None,
        files: Files | None = None,
        stdin: Data | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        cpus: float | None = None,
        memory_mb: int | None = None,
        pids: int | None = None,
        disk_mb: int | None = None,
        max_output_bytes: int | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """``async for ev in client.call_stream(cmd, image=...):`` as :meth:`call`, streamed."""
        async for ev in self._stream(
            p.fncall_stream_call(
                p.fncall_body(
                    cmd,
                    image=image,
                    cpus=cpus,
                    memory_mb=memory_mb,
                    pids=pids,
                    disk_mb=disk_mb,
                    timeout=timeout,
                    env=env,
                    cwd=cwd,
                    stdin=stdin,
                    files=files,
                    max_output_bytes=max_output_bytes,
                )
            )
        ):
            yield ev

    async def events(
        self,
        sandbox: str | None = None,
        kinds: Iterable[str] | None = None,
        since: float | None = None,
        follow: bool = False,
        labels: Labels | None = None,
    ) -> AsyncIterator[Event]:
        """``async for ev in client.events(...):`` as :meth:`dsec.Client.events`."""
        async for ev in self._lines(
            p.events_call(sandbox, kinds, since, follow, labels), p.parse_server_event
        ):
            yield ev

    # -- images

    async def import_image(self, source: PathLike, name: str | None = None) -> Image:
        return await self._do(p.import_image_call(source, name))

    async def images(self) -> builtins.list[Image]:
        return await self._do(p.images_call())

    async def get_image(self, name: str) -> Image:
        return await self._do(p.get_image_call(name))

    async def delete_image(self, name: str) -> None:
        await self._do(p.delete_image_call(name))

    # -- projects (with the server's admin token)

    async def create_project(
        self,
        name: str,
        *,
        max_sandboxes: int | None = None,
        max_cpus: float | None = None,
        max_memory_mb: int | None = None,
    ) -> Any:
        """Create a project; returns ``{"name", "token", "quotas"}``: the token is shown once."""
        return await self._do(p.create_project_call(name, max_sandboxes, max_cpus, max_memory_mb))

    async def projects(self) -> Any:
        """The projects (a project's token: its own), with quotas and current usage."""
        return await self._do(p.projects_call())

    async def delete_project(self, name: str) -> None:
        """Delete a project and its tokens (refused while it has sandboxes)."""
        await self._do(p.delete_project_call(name))

    # -- misc

    async def health(self) -> Any:
        return await self._do(p.health_call())

    async def close(self) -> None:
        """Close the idle connections (a closed client can still be used: it reconnects)."""
        self._pool.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient(url={self.url!r})"


class PendingSandbox:
    """What :meth:`AsyncClient.create` returns: await it, or use it with ``async with``."""

    def __init__(self, coro: Coroutine[Any, Any, AsyncSandbox]) -> None:
        self._coro = coro
        self._sandbox: AsyncSandbox | None = None

    def __await__(self) -> Generator[Any, None, AsyncSandbox]:
        return self._coro.__await__()

    async def __aenter__(self) -> AsyncSandbox:
        self._sandbox = await self._coro
        return self._sandbox

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._sandbox is not None:
            await self._sandbox.stop()


class AsyncSandbox(p.SandboxBase):
    """The asyncio twin of :class:`dsec.Sandbox`."""

    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        super().__init__(info)
        self.client = client

    async def run(
        self,
        cmd: Command,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: Data | None = None,
        files: Files | None = None,
        step: int | None = None,
        max_output_bytes: int | None = None,
        user: str | None = None,
    ) -> CommandResult:
        s = self._steps.take(step)
        body = p.exec_body(
            cmd,
            timeout=timeout,
            env=env,
            cwd=cwd,
            stdin=stdin,
            files=files,
            step=s,
            max_output_bytes=max_output_bytes,
            user=user,
        )
        try:
            return await self.client._do(p.exec_call(self.id, body))
        except BaseException:
            self._steps.give_back(s)
            raise

    async def stream(
        self,
        cmd: Command,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: Data | None = None,
        files: Files | None = None,
        step: int | None = None,
        max_output_bytes: int | None = None,
        user: str | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """``async for ev in sb.stream(cmd):`` output as it comes, then the ``exit`` event."""
        s = self._steps.take(step)
        body = p.exec_body(
            cmd,
            timeout=timeout,
            env=env,
            cwd=cwd,
            stdin=stdin,
            files=files,
            step=s,
            max_output_bytes=max_output_bytes,
            user=user,
        )
        started = False
        try:
            async for ev in self.client._stream(p.stream_call(self.id, body)):
                started = True
                yield ev
        except BaseException:
            if not started:
                self._steps.give_back(s)
            raise

    async def spawn(
        self,
        cmd: Command,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bool = True,
        pty: Mapping[str, int] | None = None,
        tag: str | None = None,
        user: str | None = None,
        step: int | None = None,
    ) -> AsyncProcess:
        s = self._steps.take(step)
        call = p.spawn_call(
            self.id, cmd, env=env, cwd=cwd, stdin=stdin, pty=pty, tag=tag, user=user, step=s
        )
        try:
            return AsyncProcess(self, await self.client._do(call))
        except BaseException:
            self._steps.give_back(s)
            raise

    async def attach(self, pid_or_tag: int | str) -> AsyncProcess:
        return AsyncProcess(self, await self.client._do(p.process_call(self.id, pid_or_tag)))

    async def processes(self) -> builtins.list[ProcessInfo]:
        return await self.client._do(p.processes_call(self.id))

    async def write_file(
        self, path: str, data: Data, mode: int | None = None, *, user: str | None = None
    ) -> None:
        await self.client._do(p.write_file_call(self.id, path, data, mode, user))

    async def read_file(self, path: str, *, user: str | None = None) -> bytes:
        return await self.client._do(p.read_file_call(self.id, path, user))

    async def list_files(
        self, path: str, depth: int = 1, *, user: str | None = None
    ) -> list[FileInfo]:
        return await self.client._do(p.list_files_call(self.id, path, depth, user))

    async def stat(self, path: str, *, user: str | None = None) -> FileInfo:
        return await self.client._do(p.stat_call(self.id, path, user))

    async def mkdir(
        self,
        path: str,
        *,
        parents: bool = True,
        exist_ok: bool = True,
        mode: int | None = None,
        user: str | None = None,
    ) -> bool:
        return await self.client._do(p.mkdir_call(self.id, path, parents, exist_ok, mode, user))

    async def move(
        self, src: str, dst: str, *, overwrite: bool = False, user: str | None = None
    ) -> None:
        await self.client._do(p.move_call(self.id, src, dst, overwrite, user))

    async def watch(self, path: str, recursive: bool = False) -> AsyncIterator[WatchEvent]:
        """``async for ev in await sb.watch(path)``: armed once awaited."""
        return await self.client._armed(p.watch_call(self.id, path, recursive), p.parse_watch_event)

    async def remove(self, path: str, *, recursive: bool = False, user: str | None = None) -> None:
        await self.client._do(p.remove_call(self.id, path, recursive, user))

    async def set_network(self, network: Network) -> None:
        await self.client._do(p.set_network_call(self.id, network))

    async def network_refused(self) -> builtins.list[dict[str, Any]]:
        """Connection attempts the network policy refused lately, oldest first."""
        return await self.client._do(p.network_refused_call(self.id))

    async def pause(self) -> None:
        await self.client._do(p.pause_call(self.id))

    async def resume(self) -> None:
        await self.client._do(p.resume_call(self.id))

    async def snapshot(self, name: str | None = None) -> Image:
        return await self.client._do(p.snapshot_call(self.id, name))

    async def fork(self, n: int) -> list[AsyncSandbox]:
        infos = await self.client._do(p.fork_call(self.id, n))
        return [AsyncSandbox(self.client, i) for i in infos]

    async def info(self) -> SandboxInfo:
        return await self.client._do(p.get_call(self.id))

    async def log(self) -> dict[str, Any]:
        """This sandbox's trajectory log (see ``Client.log``)."""
        return await self.client.log(self.id)

    async def stop(self) -> None:
        await self.client._do(p.stop_call(self.id))

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


class AsyncProcess:
    """The asyncio twin of :class:`dsec.Process`."""

    def __init__(self, sandbox: AsyncSandbox, info: ProcessInfo) -> None:
        self.sandbox = sandbox
        self.pid: int = info.pid
        self.tag: str | None = info.tag

    async def info(self) -> ProcessInfo:
        return await self.sandbox.client._do(p.process_call(self.sandbox.id, self.pid))

    async def events(self) -> AsyncIterator[ProcessEvent]:
        call = p.process_events_call(self.sandbox.id, self.pid)
        async for ev in self.sandbox.client._lines(call, p.parse_process_event):
            yield ev

    async def _act(self, call: Callable[[int | None], p.Call[None]], step: int | None) -> None:
        s = self.sandbox._steps.take(step)
        try:
            await self.sandbox.client._do(call(s))
        except BaseException:
            self.sandbox._steps.give_back(s)
            raise

    async def send_stdin(self, data: Data, step: int | None = None) -> None:
        await self._act(lambda s: p.send_stdin_call(self.sandbox.id, self.pid, data, s), step)

    async def close_stdin(self, step: int | None = None) -> None:
        await self._act(lambda s: p.close_stdin_call(self.sandbox.id, self.pid, s), step)

    async def signal(self, sig: int | str, step: int | None = None) -> None:
        await self._act(lambda s: p.signal_call(self.sandbox.id, self.pid, sig, s), step)

    async def kill(self, step: int | None = None) -> None:
        await self._act(lambda s: p.kill_process_call(self.sandbox.id, self.pid, s), step)

    async def resize(self, cols: int, rows: int, step: int | None = None) -> None:
        await self._act(lambda s: p.resize_call(self.sandbox.id, self.pid, cols, rows, s), step)

    async def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = p.wait_slice(deadline, time.monotonic())
            info = await self.sandbox.client._do(p.wait_call(self.sandbox.id, self.pid, wait))
            code = p.exit_code_of(info, deadline, time.monotonic())
            if code is not None:
                return code

    def __repr__(self) -> str:
        return f"AsyncProcess(pid={self.pid!r}, tag={self.tag!r}, sandbox={self.sandbox.id!r})"
