"""The synchronous client: :class:`Client` and :class:`Sandbox`."""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
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

__all__ = ["Client", "Process", "Sandbox"]


class Client:
    """A connection to a dsec server.

    ``url`` defaults to ``$DSEC_URL``, else ``http://127.0.0.1:7700``; ``token`` to
    ``$DSEC_TOKEN`` (sent as ``Authorization: Bearer``). A client is safe to share between
    threads; ``max_connections`` bounds the requests in flight at once (more wait).
    """

    def __init__(
        self, url: str | None = None, token: str | None = None, *, max_connections: int = 100
    ) -> None:
        self.url = p.resolve_url(url)
        self._origin = p.origin(self.url, p.resolve_token(token))
        self._pool = _http.SyncPool(self._origin, max_connections, p.CONNECT_TIMEOUT_S)

    # -- transport

    def _do(self, call: p.Call[T]) -> T:
        try:
            resp = self._pool.request(call.request(self._origin))
        except _http.TransportError as e:
            raise p.transport_error(self.url, e) from e
        return call.finish(resp)

    def _stream(self, call: p.Call[None]) -> Iterator[StreamEvent]:
        return self._lines(call, p.parse_event)

    def _lines(self, call: p.Call[None], parse: Callable[[bytes], E | None]) -> Iterator[E]:
        try:
            head, body = self._pool.stream(call.request(self._origin))
        except _http.TransportError as e:
            raise p.transport_error(self.url, e) from e
        try:
            if not (200 <= head.status < 300):
                call.finish(_http.Response(head.status, head.head, b"".join(body)))
                return
            for line in p.lines(body):
                ev = parse(line)
                if ev is not None:
                    yield ev
        except _http.TransportError as e:
            raise p.transport_error(self.url, e) from e
        finally:
            body.close()

    def _armed(self, call: p.Call[None], parse: Callable[[bytes], E | None]) -> Iterator[E]:
        """The lines of a stream whose first line says it is armed, read past that one."""
        lines = self._lines(call, parse)
        if next(lines, None) is None:
            raise DsecError("the stream ended before it was armed")
        return lines

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
    ) -> Sandbox:
        """Create a sandbox. ``with client.create(...) as sb:`` stops it on exit."""
        info = self._do(p.create_call(p.create_body(**p.create_args(locals()))))
        return Sandbox(self, info)

    def create_many(
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
    ) -> builtins.list[Sandbox]:
        """Create ``n`` sandboxes alike in one request (spread over a fleet's edges).

        Raises the items' error when none could be made, and :class:`dsec.BatchError`
        when some were: its ``sandboxes`` are running, its ``errors`` say why the others
        were not.
        """
        body = p.create_body(**p.create_args(locals()))
        items = self._do(p.create_many_call(n, body))
        return p.settle_batch(items, lambda info: Sandbox(self, info))

    def get(self, id: str) -> Sandbox:
        """Reconnect to a sandbox by id (its step count starts at 0 again)."""
        return Sandbox(self, self._do(p.get_call(id)))

    def log(self, id: str, trajectory_id: str | None = None) -> dict[str, Any]:
        """The trajectory log of a sandbox, also after it is gone: ``{"sandbox": {...},
        "steps": [{"step", "request", "result", ...}]}`` (see docs/API.md)."""
        return self._do(p.log_call(id, trajectory_id))

    def list(self, labels: Labels | None = None) -> builtins.list[Sandbox]:
        """The sandboxes having all the given labels."""
        return [Sandbox(self, i) for i in self._do(p.list_call(labels))]

    def call(
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
        """Run one command in a fresh worker of the image's ``fncall`` pool (one request).

        ``cpus``, ``memory_mb``, ``pids`` and ``disk_mb`` are the worker's limits; the rest
        is as for :meth:`Sandbox.run`.
        """
        return self._do(
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

    def call_stream(
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
    ) -> Iterator[StreamEvent]:
        """:meth:`call`, yielding the output as it comes; the last event has kind ``exit``."""
        yield from self._stream(
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
        )

    def events(
        self,
        sandbox: str | None = None,
        kinds: Iterable[str] | None = None,
        since: float | None = None,
        follow: bool = False,
        labels: Labels | None = None,
    ) -> Iterator[Event]:
        """The server's events, oldest first: lifecycle changes, commands, file operations,
        limit hits, network refusals, Watcher actions (docs/SDK.md lists the kinds).

        Filters: one ``sandbox``; ``kinds`` (``"limit"`` stands for every ``limit.*``);
        ``since`` (Unix time); ``labels`` (all must match). With ``follow`` the iterator
        goes on with new events as they happen, until it is closed.
        """
        yield from self._lines(
            p.events_call(sandbox, kinds, since, follow, labels), p.parse_server_event
        )

    # -- images

    def import_image(self, source: PathLike, name: str | None = None) -> Image:
        """Import an image from a path on the server's host or a registry reference."""
        return self._do(p.import_image_call(source, name))

    def images(self) -> builtins.list[Image]:
        return self._do(p.images_call())

    def get_image(self, name: str) -> Image:
        return self._do(p.get_image_call(name))

    def delete_image(self, name: str) -> None:
        self._do(p.delete_image_call(name))

    # -- projects (with the server's admin token)

    def create_project(
        self,
        name: str,
        *,
        max_sandboxes: int | None = None,
        max_cpus: float | None = None,
        max_memory_mb: int | None = None,
    ) -> Any:
        """Create a project; returns ``{"name", "token", "quotas"}``: the token is shown once."""
        return self._do(p.create_project_call(name, max_sandboxes, max_cpus, max_memory_mb))

    def projects(self) -> Any:
        """The projects (a project's token: its own), with quotas and current usage."""
        return self._do(p.projects_call())

    def delete_project(self, name: str) -> None:
        """Delete a project and its tokens (refused while it has sandboxes)."""
        self._do(p.delete_project_call(name))

    # -- misc

    def health(self) -> Any:
        """``GET /healthz``."""
        return self._do(p.health_call())

    def close(self) -> None:
        """Close the idle connections (a closed client can still be used: it reconnects)."""
        self._pool.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(url={self.url!r})"


class Sandbox(p.SandboxBase):
    """A sandbox on a dsec server. Get one from :meth:`Client.create` or :meth:`Client.get`."""

    def __init__(self, client: Client, info: SandboxInfo) -> None:
        super().__init__(info)
        self.client = client

    def run(
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
        """Run ``cmd`` (a str for ``/bin/sh -c``, or an argv list) and wait for it.
        ``user`` (a name, a uid or ``"uid:gid"`` of the sandbox's own ``/etc/passwd``) runs
        it as that user, in its home unless ``cwd`` is given; root by default."""
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
            return self.client._do(p.exec_call(self.id, body))
        except BaseException:
            self._steps.give_back(s)
            raise

    def stream(
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
    ) -> Iterator[StreamEvent]:
        """Run ``cmd`` and yield its output as it comes; the last event has kind ``exit``."""
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
            for ev in self.client._stream(p.stream_call(self.id, body)):
                started = True
                yield ev
        except BaseException:
            if not started:
                self._steps.give_back(s)
            raise

    def spawn(
        self,
        cmd: Command,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bool = True,
        pty: Mapping[str, int] | None = None,
        tag: str | None = None,
        user: str | None = None,
        step: int | None = None,
    ) -> Process:
        """Start ``cmd`` as a process that outlives this call: read it with
        :meth:`Process.events`, reach it again with :meth:`attach`. ``pty={"cols", "rows"}``
        runs it on a terminal (one output stream, kind ``pty``); ``tag`` names it (unique
        among running processes); ``stdin=False`` closes its input at once. The spawn, and
        each act on the process, is a step of the trajectory log, numbered as runs are."""
        s = self._steps.take(step)
        call = p.spawn_call(
            self.id, cmd, env=env, cwd=cwd, stdin=stdin, pty=pty, tag=tag, user=user, step=s
        )
        try:
            return Process(self, self.client._do(call))
        except BaseException:
            self._steps.give_back(s)
            raise

    def attach(self, pid_or_tag: int | str) -> Process:
        """The spawned process ``pid_or_tag`` names (pid, or tag), from any client."""
        return Process(self, self.client._do(p.process_call(self.id, pid_or_tag)))

    def processes(self) -> builtins.list[ProcessInfo]:
        """Spawned processes: those running, and the last ones that ended."""
        return self.client._do(p.processes_call(self.id))

    def write_file(
        self, path: str, data: Data, mode: int | None = None, *, user: str | None = None
    ) -> None:
        """Write ``data`` (str is UTF-8 encoded) to ``path``, creating parent directories.
        Every file operation takes ``user=`` as ``run`` does: done as that user, what it
        makes is the user's, and what the user may not do raises ``dsec.PermissionDenied``."""
        self.client._do(p.write_file_call(self.id, path, data, mode, user))

    def read_file(self, path: str, *, user: str | None = None) -> bytes:
        return self.client._do(p.read_file_call(self.id, path, user))

    def list_files(self, path: str, depth: int = 1, *, user: str | None = None) -> list[FileInfo]:
        """The entries of a directory, ``depth`` levels deep (1: its own entries), sorted
        by ``path`` (relative to the listed directory). Links are listed, not followed."""
        return self.client._do(p.list_files_call(self.id, path, depth, user))

    def stat(self, path: str, *, user: str | None = None) -> FileInfo:
        """The status of ``path``; a symbolic link is reported (``kind="symlink"``,
        ``link``), not followed."""
        return self.client._do(p.stat_call(self.id, path, user))

    def mkdir(
        self,
        path: str,
        *,
        parents: bool = True,
        exist_ok: bool = True,
        mode: int | None = None,
        user: str | None = None,
    ) -> bool:
        """Make a directory (``mode`` default 0o755); whether it was made."""
        return self.client._do(p.mkdir_call(self.id, path, parents, exist_ok, mode, user))

    def move(self, src: str, dst: str, *, overwrite: bool = False, user: str | None = None) -> None:
        """Rename ``src`` to ``dst`` (whose parent must exist) within the sandbox."""
        self.client._do(p.move_call(self.id, src, dst, overwrite, user))

    def watch(self, path: str, recursive: bool = False) -> Iterator[WatchEvent]:
        """Changes in the directory ``path`` (with ``recursive``, below it too, including
        directories made later), as they happen. The watch is armed when this returns:
        every change after it is seen. It ends when the directory goes; close the
        iterator to end it sooner. On docker, changes on the container's own mounts
        (volumes, a tmpfs) are not seen."""
        return self.client._armed(p.watch_call(self.id, path, recursive), p.parse_watch_event)

    def remove(self, path: str, *, recursive: bool = False, user: str | None = None) -> None:
        """Remove a file, a link (itself) or a directory (not empty: ``recursive``)."""
        self.client._do(p.remove_call(self.id, path, recursive, user))

    def set_network(self, network: Network) -> None:
        """Change the egress policy: False, True or ``{"allow": [...]}``."""
        self.client._do(p.set_network_call(self.id, network))

    def network_refused(self) -> builtins.list[dict[str, Any]]:
        """Connection attempts the network policy refused lately, oldest first:
        ``[{"time", "dst", "port", "protocol"}]`` (the last 256; at most 50 a second), with
        ``"name"`` for a name refused (a proxied connection's SNI or ``Host``, or a DNS
        question: ``"protocol": "dns"``)."""
        return self.client._do(p.network_refused_call(self.id))

    def pause(self) -> None:
        self.client._do(p.pause_call(self.id))

    def resume(self) -> None:
        self.client._do(p.resume_call(self.id))

    def snapshot(self, name: str | None = None) -> Image:
        """Save the sandbox's filesystem as a new image."""
        return self.client._do(p.snapshot_call(self.id, name))

    def fork(self, n: int) -> list[Sandbox]:
        """``n`` new sandboxes from this sandbox's current state."""
        return [Sandbox(self.client, i) for i in self.client._do(p.fork_call(self.id, n))]

    def info(self) -> SandboxInfo:
        return self.client._do(p.get_call(self.id))

    def log(self) -> dict[str, Any]:
        """This sandbox's trajectory log (see :meth:`Client.log`)."""
        return self.client.log(self.id)

    def stop(self) -> None:
        """Terminate and delete the sandbox; calling it again is harmless."""
        self.client._do(p.stop_call(self.id))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class Process:
    """A process spawned by :meth:`Sandbox.spawn` (or found by :meth:`Sandbox.attach`)."""

    def __init__(self, sandbox: Sandbox, info: ProcessInfo) -> None:
        self.sandbox = sandbox
        self.pid: int = info.pid
        self.tag: str | None = info.tag

    def info(self) -> ProcessInfo:
        return self.sandbox.client._do(p.process_call(self.sandbox.id, self.pid))

    def events(self) -> Iterator[ProcessEvent]:
        """Its output from the oldest still buffered, then live; the last has kind ``exit``."""
        call = p.process_events_call(self.sandbox.id, self.pid)
        yield from self.sandbox.client._lines(call, p.parse_process_event)

    def _act(self, call: Callable[[int | None], p.Call[None]], step: int | None) -> None:
        """One act on the process, as a step of the sandbox's trajectory."""
        s = self.sandbox._steps.take(step)
        try:
            self.sandbox.client._do(call(s))
        except BaseException:
            self.sandbox._steps.give_back(s)
            raise

    def send_stdin(self, data: Data, step: int | None = None) -> None:
        self._act(lambda s: p.send_stdin_call(self.sandbox.id, self.pid, data, s), step)

    def close_stdin(self, step: int | None = None) -> None:
        self._act(lambda s: p.close_stdin_call(self.sandbox.id, self.pid, s), step)

    def signal(self, sig: int | str, step: int | None = None) -> None:
        """Send ``sig``: a number, or a name (``"TERM"``, ``"SIGINT"``)."""
        self._act(lambda s: p.signal_call(self.sandbox.id, self.pid, sig, s), step)

    def kill(self, step: int | None = None) -> None:
        """Kill it and everything it started."""
        self._act(lambda s: p.kill_process_call(self.sandbox.id, self.pid, s), step)

    def resize(self, cols: int, rows: int, step: int | None = None) -> None:
        """Resize its terminal (spawned with ``pty``)."""
        self._act(lambda s: p.resize_call(self.sandbox.id, self.pid, cols, rows, s), step)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, once it ends; :class:`dsec.RequestTimeout` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = p.wait_slice(deadline, time.monotonic())
            info = self.sandbox.client._do(p.wait_call(self.sandbox.id, self.pid, wait))
            code = p.exit_code_of(info, deadline, time.monotonic())
            if code is not None:
                return code

    def __repr__(self) -> str:
        return f"Process(pid={self.pid!r}, tag={self.tag!r}, sandbox={self.sandbox.id!r})"
