"""Request building and response parsing, shared by the sync and async clients.

Every operation is a :class:`Call`: the HTTP request to send plus the function that turns
a successful response into a value. The clients only differ in how they send it (the
thread and asyncio pools of :mod:`dsec._http`).
"""

from __future__ import annotations

import base64
import os
import re
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar, Union

import orjson

from . import _http
from .errors import (
    BatchError,
    ConnectionFailed,
    DsecError,
    InvalidArgument,
    NotFound,
    RequestTimeout,
    SandboxFailed,
    error_from_kind,
    error_from_response,
)
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
S = TypeVar("S")

__version__ = "0.1.0"

DEFAULT_URL = "http://127.0.0.1:7700"
#: The server's default command timeout, used to size the HTTP timeout of a run.
DEFAULT_COMMAND_TIMEOUT_S = 600.0
#: How much longer than the command's own timeout the HTTP request may take.
RUN_TIMEOUT_MARGIN_S = 60.0
DEFAULT_REQUEST_TIMEOUT_S = 300.0
CREATE_TIMEOUT_S = 900.0
IMPORT_TIMEOUT_S = 3600.0
CONNECT_TIMEOUT_S = 30.0

Data = bytes | str
Command = str | Sequence[str]
Network = bool | Mapping[str, Sequence[str]]
Files = Mapping[str, Data]
Labels = Mapping[str, str]
PathLike = Union[str, "os.PathLike[str]"]


def resolve_url(url: str | None) -> str:
    return (url or os.environ.get("DSEC_URL") or DEFAULT_URL).rstrip("/")


def resolve_token(token: str | None) -> str | None:
    t = token if token is not None else os.environ.get("DSEC_TOKEN")
    return t.strip() or None if t else None


def origin(url: str, token: str | None) -> _http.Origin:
    """Where a client's requests go, with the headers every one of them carries."""
    headers = {"User-Agent": f"dsec-python/{__version__}"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        return _http.Origin(url, headers)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def dumps(doc: Any) -> bytes:
    try:
        return orjson.dumps(doc)
    except TypeError as e:  # orjson.JSONEncodeError: e.g. an integer beyond 64 bits
        raise InvalidArgument(f"cannot encode the request as JSON: {e}") from None


def to_bytes(data: Data) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"expected bytes or str, got {type(data).__name__}")


def b64(data: Data) -> str:
    return base64.b64encode(to_bytes(data)).decode("ascii")


def _raise(err: DsecError) -> Any:
    raise err


class Call(Generic[T]):
    """One HTTP request and how to read its answer."""

    __slots__ = (
        "accept",
        "body",
        "content_type",
        "idempotency_key",
        "method",
        "on_error",
        "parse",
        "target",
        "timeout",
    )

    def __init__(
        self,
        method: str,
        path: str,
        parse: Callable[[_http.Response], T],
        *,
        params: Sequence[tuple[str, str]] | None = None,
        json: Any = None,
        content: bytes | None = None,
        read_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
        accept: str = "application/json",
        on_error: Callable[[DsecError], T] = _raise,
        idempotency_key: str | None = None,
    ) -> None:
        self.method = method
        #: Sent as ``Idempotency-Key``: the server makes one thing per key, so the request
        #: may be sent again after a lost answer.
        self.idempotency_key = idempotency_key
        self.target = f"{path}?{urllib.parse.urlencode(params)}" if params else path
        self.parse = parse
        if json is not None:
            self.body: bytes | None = dumps(json)
            self.content_type: str | None = "application/json"
        else:
            self.body = content
            self.content_type = "application/octet-stream" if content is not None else None
        self.timeout = read_timeout
        self.accept = accept
        #: Called with the error of a failed request; may return a value instead of raising.
        self.on_error = on_error

    def request(self, origin: _http.Origin) -> _http.Request:
        headers = f"Accept: {self.accept}\r\n"
        if self.content_type is not None:
            headers += f"Content-Type: {self.content_type}\r\n"
        if self.idempotency_key is not None:
            headers += f"Idempotency-Key: {self.idempotency_key}\r\n"
        return _http.Request(
            origin,
            self.method,
            self.target,
            headers=headers,
            body=self.body,
            timeout=self.timeout,
            idempotent=self.idempotency_key is not None,
        )

    def finish(self, resp: _http.Response) -> T:
        """Turn a (fully read) response into the call's value or exception."""
        if resp.is_success:
            return self.parse(resp)
        return self.on_error(error_from_response(resp.status, resp.body))


def transport_error(url: str, exc: _http.TransportError) -> DsecError:
    """The exception for a request that got no HTTP answer."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, _http.ConnectError):
        return ConnectionFailed(f"cannot reach dsec server at {url}: {detail}")
    if isinstance(exc, _http.ReadTimeout):
        return RequestTimeout(f"dsec server at {url} did not answer in time: {detail}")
    return ConnectionFailed(f"lost connection to dsec server at {url}: {detail}")


def lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a streamed body (without their ``\\n``), as the chunks come."""
    rest = b""
    for chunk in chunks:
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        yield from parts
    if rest:
        yield rest


class LineSplitter:
    """:func:`lines` for a body that arrives asynchronously: feed chunks, get lines."""

    __slots__ = ("_rest",)

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        parts = (self._rest + chunk).split(b"\n")
        self._rest = parts.pop()
        return parts

    def end(self) -> list[bytes]:
        rest, self._rest = self._rest, b""
        return [rest] if rest else []


# ---------------------------------------------------------------- parsing


def _json(resp: _http.Response) -> Any:
    try:
        return orjson.loads(resp.body)
    except orjson.JSONDecodeError as e:
        raise DsecError(f"server sent invalid JSON: {e}", status=resp.status) from e


def _obj(resp: _http.Response) -> dict[str, Any]:
    doc = _json(resp)
    if not isinstance(doc, dict):
        raise DsecError(f"expected a JSON object, got {type(doc).__name__}")
    return doc


def _list(resp: _http.Response) -> list[dict[str, Any]]:
    doc = _json(resp)
    if isinstance(doc, dict):  # tolerate {"items": [...]} / {"sandboxes": [...]} envelopes
        for v in doc.values():
            if isinstance(v, list):
                doc = v
                break
    if not isinstance(doc, list):
        raise DsecError(f"expected a JSON array, got {type(doc).__name__}")
    return [x for x in doc if isinstance(x, dict)]


def parse_info(resp: _http.Response) -> SandboxInfo:
    return SandboxInfo.from_json(_obj(resp))


def parse_infos(resp: _http.Response) -> list[SandboxInfo]:
    return [SandboxInfo.from_json(d) for d in _list(resp)]


def parse_result(resp: _http.Response) -> CommandResult:
    return CommandResult.from_json(_obj(resp))


def parse_image(resp: _http.Response) -> Image:
    return Image.from_json(_obj(resp))


def parse_images(resp: _http.Response) -> list[Image]:
    return [Image.from_json(d) for d in _list(resp)]


def parse_files(resp: _http.Response) -> list[FileInfo]:
    return [FileInfo.from_json(d) for d in _list(resp)]


def parse_bytes(resp: _http.Response) -> bytes:
    return resp.body


def parse_none(resp: _http.Response) -> None:
    return None


def parse_any(resp: _http.Response) -> Any:
    return _json(resp) if resp.body else None


def _json_object(line: bytes, what: str) -> dict[str, Any]:
    """One NDJSON line of a stream, which must be a JSON object (``what`` names the line
    in the error)."""
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise DsecError(f"{what}: {line[:200]!r}") from e
    if not isinstance(doc, dict):
        raise DsecError(f"{what}: {line[:200]!r}")
    return doc


def parse_event(line: bytes) -> StreamEvent | None:
    """Parse one NDJSON line of a streamed command (``None`` for blank lines)."""
    line = line.strip()
    if line.startswith(b"data:"):  # tolerate SSE framing
        line = line[5:].strip()
    if not line:
        return None
    doc = _json_object(line, "bad event in command stream")
    err = doc.get("error")
    if doc.get("kind") == "error" or isinstance(err, dict):
        raise error_from_response(500, orjson.dumps({"error": err if err else doc}))
    return StreamEvent.from_json(doc)


def parse_server_event(line: bytes) -> Event | None:
    """Parse one NDJSON line of ``GET /v1/events`` (``None`` for heartbeats)."""
    line = line.strip()
    if line.startswith(b"data:"):  # tolerate SSE framing
        line = line[5:].strip()
    if not line or line.startswith(b":") or line.startswith(b"id:"):
        return None
    doc = _json_object(line, "bad line in the event stream")
    return Event.from_json(doc)


#: A follower's read timeout: the server sends a heartbeat every 15 s.
FOLLOW_READ_TIMEOUT_S = 60.0


def events_call(
    sandbox: str | None,
    kinds: Iterable[str] | None,
    since: float | None,
    follow: bool,
    labels: Labels | None,
) -> Call[None]:
    """``GET /v1/events``; its response is read line by line with :func:`parse_server_event`."""
    if isinstance(kinds, str):
        kinds = [kinds]
    params: list[tuple[str, str]] = []
    if sandbox is not None:
        params.append(("sandbox", sandbox))
    params.extend(("kind", k) for k in kinds or ())
    params.extend(("label", f"{k}={v}") for k, v in (labels or {}).items())
    if since is not None:
        params.append(("since", repr(float(since))))
    if follow:
        params.append(("follow", "true"))
    return Call(
        "GET",
        "/v1/events",
        parse_none,
        params=params or None,
        read_timeout=FOLLOW_READ_TIMEOUT_S if follow else DEFAULT_REQUEST_TIMEOUT_S,
        accept="application/x-ndjson",
    )


def watch_call(id: str, path: str, recursive: bool) -> Call[None]:
    """The watch's NDJSON stream, read line by line with :func:`parse_watch_event`."""
    params = [("path", path), ("recursive", "true" if recursive else "false")]
    return Call(
        "GET",
        _sb(id, "/files/watch"),
        parse_none,
        params=params,
        read_timeout=FOLLOW_READ_TIMEOUT_S,
        accept="application/x-ndjson",
    )


def parse_watch_event(line: bytes) -> WatchEvent | None:
    """Parse one line of a watch (``None`` for heartbeats); the first is ``watching``."""
    line = line.strip()
    if not line:
        return None
    doc = _json_object(line, "bad line in the watch stream")
    return WatchEvent.from_json(doc)


def _swallow_not_found(err: DsecError) -> None:
    if isinstance(err, NotFound):
        return None
    raise err


# ---------------------------------------------------------------- calls


#: Sandbox ids as the server makes them need no quoting (the common case, and the fast one).
_PLAIN_ID = re.compile(r"[A-Za-z0-9_.~-]+")


def _sb(id: str, rest: str = "") -> str:
    quoted = id if _PLAIN_ID.fullmatch(id) else urllib.parse.quote(id, safe="")
    return f"/v1/sandboxes/{quoted}{rest}"


def _image(name: str) -> str:
    """An image's path: names may hold ``/`` and ``:`` (registry references)."""
    return f"/v1/images/{urllib.parse.quote(name, safe='/:@')}"


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _network(network: Network) -> Any:
    if isinstance(network, bool):
        return network
    return {k: list(v) for k, v in network.items()}


def create_body(
    *,
    backend: str,
    image: str | None,
    cpus: float | None,
    memory_mb: int | None,
    pids: int | None,
    disk_mb: int | None,
    ttl_s: float | None,
    idle_ttl_s: float | None,
    env: Mapping[str, str] | None,
    workdir: str | None,
    network: Network,
    labels: Labels | None,
    trajectory_id: str | None,
    ca_bundle: bool | None = None,
) -> dict[str, Any]:
    """The body of ``POST /v1/sandboxes`` (and each item of a batch)."""
    return _drop_none(
        {
            "backend": backend,
            "image": image,
            "cpus": cpus,
            "memory_mb": memory_mb,
            "pids": pids,
            "disk_mb": disk_mb,
            "ttl_s": ttl_s,
            "idle_ttl_s": idle_ttl_s,
            "env": dict(env) if env is not None else None,
            "workdir": workdir,
            "network": _network(network),
            "ca_bundle": ca_bundle,
            "labels": dict(labels) if labels is not None else None,
            "trajectory_id": trajectory_id,
        }
    )


def create_args(scope: dict[str, Any]) -> dict[str, Any]:
    """:func:`create_body`'s arguments from ``locals()`` taken first thing in a client's
    ``create`` or ``create_many``, whose parameters are the contract (tests check that the
    four agree): all but ``self`` and ``n``."""
    return {k: v for k, v in scope.items() if k not in ("self", "n")}


def create_call(body: dict[str, Any]) -> Call[SandboxInfo]:
    return Call(
        "POST",
        "/v1/sandboxes",
        parse_info,
        json=body,
        read_timeout=CREATE_TIMEOUT_S,
        idempotency_key=uuid.uuid4().hex,
    )


#: Extra time to wait for a batch's answer, per sandbox in it.
BATCH_TIMEOUT_PER_SANDBOX_S = 0.1


def create_many_call(count: int, body: dict[str, Any]) -> Call[list[SandboxInfo | DsecError]]:
    """``POST /v1/sandboxes/batch``: ``count`` sandboxes made from ``body``, one item each."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"n must be an int, not {type(count).__name__}")
    return Call(
        "POST",
        "/v1/sandboxes/batch",
        parse_batch,
        json={"count": count, "sandbox": body},
        read_timeout=CREATE_TIMEOUT_S + count * BATCH_TIMEOUT_PER_SANDBOX_S,
        idempotency_key=uuid.uuid4().hex,
    )


def parse_batch(resp: _http.Response) -> list[SandboxInfo | DsecError]:
    items = _obj(resp).get("items")
    if not isinstance(items, list):
        raise DsecError("server sent a batch answer without items", status=resp.status)
    out: list[SandboxInfo | DsecError] = []
    for item in items:
        sandbox = item.get("sandbox") if isinstance(item, dict) else None
        if isinstance(sandbox, dict):
            out.append(SandboxInfo.from_json(sandbox))
            continue
        err = item.get("error") if isinstance(item, dict) else None
        err = err if isinstance(err, dict) else {}
        kind, message = err.get("kind"), err.get("message")
        out.append(
            error_from_kind(
                kind if isinstance(kind, str) else None,
                message if isinstance(message, str) else "the server gave no reason",
            )
        )
    return out


def settle_batch(items: list[SandboxInfo | DsecError], wrap: Callable[[SandboxInfo], S]) -> list[S]:
    """The sandboxes of a batch that was wholly made; else raise: the items' error when
    none was made, :class:`BatchError` (holding those made) when some were."""
    made = [wrap(i) for i in items if isinstance(i, SandboxInfo)]
    errors = {n: e for n, e in enumerate(items) if isinstance(e, DsecError)}
    if not errors:
        return made
    index, first = next(iter(errors.items()))
    if not made:
        raise type(first)(
            f"none of the {len(items)} sandboxes could be made: {first.message}",
            status=first.status,
            kind=first.kind,
        )
    raise BatchError(
        f"{len(errors)} of {len(items)} sandboxes could not be made ({len(made)} were: "
        f"BatchError.sandboxes holds them, use or stop them); item {index}: {first.message}",
        sandboxes=made,
        errors=errors,
    )


def get_call(id: str) -> Call[SandboxInfo]:
    return Call("GET", _sb(id), parse_info)


def list_call(labels: Labels | None) -> Call[list[SandboxInfo]]:
    params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    return Call("GET", "/v1/sandboxes", parse_infos, params=params or None)


def log_call(id: str, trajectory_id: str | None) -> Call[dict[str, Any]]:
    params = [("trajectory_id", trajectory_id)] if trajectory_id is not None else None
    return Call("GET", _sb(id, "/log"), _obj, params=params)


def stop_call(id: str) -> Call[None]:
    return Call("DELETE", _sb(id), parse_none, on_error=_swallow_not_found)


def exec_body(
    cmd: Command,
    *,
    timeout: float | None,
    env: Mapping[str, str] | None,
    cwd: str | None,
    stdin: Data | None,
    files: Files | None,
    step: int | None,
    max_output_bytes: int | None,
    user: str | None = None,
) -> dict[str, Any]:
    if isinstance(cmd, (bytes, bytearray)):
        raise TypeError("cmd must be a str or a sequence of str, not bytes")
    # Only the fields given: most commands are a bare cmd, built here in one step.
    body: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else [str(a) for a in cmd]}
    if env is not None:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if stdin is not None:
        body["stdin_b64"] = b64(stdin)
    if files:
        body["files"] = [{"path": p, "data_b64": b64(d)} for p, d in files.items()]
    if timeout is not None:
        body["timeout_s"] = timeout
    if max_output_bytes is not None:
        body["max_output_bytes"] = max_output_bytes
    if step is not None:
        body["step"] = step
    if user is not None:
        body["user"] = user
    return body


def _run_read_timeout(timeout: float | None) -> float:
    t = DEFAULT_COMMAND_TIMEOUT_S if timeout is None else max(float(timeout), 0.0)
    return t + RUN_TIMEOUT_MARGIN_S


def exec_call(id: str, body: dict[str, Any]) -> Call[CommandResult]:
    return Call(
        "POST",
        _sb(id, "/exec"),
        parse_result,
        json=body,
        read_timeout=_run_read_timeout(body.get("timeout_s")),
    )


def fncall_body(
    cmd: Command,
    *,
    image: str | None,
    cpus: float | None,
    memory_mb: int | None,
    pids: int | None,
    disk_mb: int | None,
    **command: Any,
) -> dict[str, Any]:
    """The body of ``POST /v1/calls``: the command (as :func:`exec_body`), its image and the
    worker's limits."""
    body = exec_body(cmd, step=None, **command)
    body.update(
        _drop_none(
            {"image": image, "cpus": cpus, "memory_mb": memory_mb, "pids": pids, "disk_mb": disk_mb}
        )
    )
    return body


def fncall_call(body: dict[str, Any]) -> Call[CommandResult]:
    """One fncall in one request (create, run and stop happen in the server)."""
    return Call(
        "POST",
        "/v1/calls",
        parse_result,
        json=body,
        read_timeout=_run_read_timeout(body.get("timeout_s")),
    )


def fncall_stream_call(body: dict[str, Any]) -> Call[None]:
    """The streamed fncall; read like :func:`stream_call`."""
    return Call(
        "POST",
        "/v1/calls/stream",
        parse_none,
        json=body,
        read_timeout=_run_read_timeout(body.get("timeout_s")),
        accept="application/x-ndjson",
    )


def stream_call(id: str, body: dict[str, Any]) -> Call[None]:
    """The streamed exec; its response is read line by line with :func:`parse_event`."""
    return Call(
        "POST",
        _sb(id, "/exec/stream"),
        parse_none,
        json=body,
        read_timeout=_run_read_timeout(body.get("timeout_s")),
        accept="application/x-ndjson",
    )


#: The longest wait the server takes in one request; longer waits are several requests.
MAX_WAIT_S = 3600.0


def _proc(id: str, process: int | str, rest: str = "") -> str:
    return _sb(id, f"/processes/{urllib.parse.quote(str(process), safe='')}{rest}")


def parse_process(resp: _http.Response) -> ProcessInfo:
    return ProcessInfo.from_json(_obj(resp))


def parse_processes(resp: _http.Response) -> list[ProcessInfo]:
    return [ProcessInfo.from_json(d) for d in _list(resp)]


def parse_process_event(line: bytes) -> ProcessEvent | None:
    """Parse one NDJSON line of a process's events (``None`` for heartbeats)."""
    line = line.strip()
    if not line:
        return None
    doc = _json_object(line, "bad event in a process's events")
    return ProcessEvent.from_json(doc)


def spawn_call(
    id: str,
    cmd: Command,
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    stdin: bool,
    pty: Mapping[str, int] | None,
    tag: str | None,
    user: str | None,
    step: int | None = None,
) -> Call[ProcessInfo]:
    body: dict[str, Any] = {"cmd": cmd if isinstance(cmd, str) else list(cmd), "stdin": stdin}
    if env:
        body["env"] = dict(env)
    if pty is not None:
        body["pty"] = {"cols": int(pty.get("cols", 80)), "rows": int(pty.get("rows", 24))}
    body.update(_drop_none({"cwd": cwd, "tag": tag, "user": user, "step": step}))
    return Call("POST", _sb(id, "/processes"), parse_process, json=body)


def processes_call(id: str) -> Call[list[ProcessInfo]]:
    return Call("GET", _sb(id, "/processes"), parse_processes)


def process_call(id: str, process: int | str) -> Call[ProcessInfo]:
    return Call("GET", _proc(id, process), parse_process)


def process_events_call(id: str, process: int | str) -> Call[None]:
    """A process's events; read line by line with :func:`parse_process_event`."""
    return Call(
        "GET",
        _proc(id, process, "/events"),
        parse_none,
        read_timeout=FOLLOW_READ_TIMEOUT_S,
        accept="application/x-ndjson",
    )


def _step_params(step: int | None) -> list[tuple[str, str]] | None:
    """An act on a process is a step of the sandbox's trajectory, as a run is."""
    return None if step is None else [("step", str(int(step)))]


def send_stdin_call(id: str, pid: int, data: Data, step: int | None = None) -> Call[None]:
    return Call(
        "POST",
        _proc(id, pid, "/stdin"),
        parse_none,
        params=_step_params(step),
        content=to_bytes(data),
    )


def close_stdin_call(id: str, pid: int, step: int | None = None) -> Call[None]:
    return Call("POST", _proc(id, pid, "/close-stdin"), parse_none, params=_step_params(step))


def signal_call(id: str, pid: int, sig: int | str, step: int | None = None) -> Call[None]:
    body = {"signal": sig if isinstance(sig, str) else int(sig)}
    return Call("POST", _proc(id, pid, "/signal"), parse_none, params=_step_params(step), json=body)


def kill_process_call(id: str, pid: int, step: int | None = None) -> Call[None]:
    return Call("POST", _proc(id, pid, "/kill"), parse_none, params=_step_params(step))


def resize_call(id: str, pid: int, cols: int, rows: int, step: int | None = None) -> Call[None]:
    body = {"cols": int(cols), "rows": int(rows)}
    return Call("POST", _proc(id, pid, "/resize"), parse_none, params=_step_params(step), json=body)


def wait_call(id: str, pid: int, timeout: float) -> Call[ProcessInfo]:
    t = min(max(float(timeout), 0.0), MAX_WAIT_S)
    return Call(
        "POST",
        _proc(id, pid, "/wait"),
        parse_process,
        params=[("timeout", repr(t))],
        read_timeout=t + RUN_TIMEOUT_MARGIN_S,
    )


def wait_slice(deadline: float | None, now: float) -> float:
    """How long the next wait request waits: to ``deadline``, at most :data:`MAX_WAIT_S`."""
    return MAX_WAIT_S if deadline is None else min(max(deadline - now, 0.0), MAX_WAIT_S)


def exit_code_of(info: ProcessInfo, deadline: float | None, now: float) -> int | None:
    """A waited-for process's exit code; ``None`` to wait again. Raises
    :class:`RequestTimeout` past ``deadline``, :class:`SandboxFailed` when the process's end
    is unknown (its sandbox went first)."""
    if info.running:
        if deadline is not None and now >= deadline:
            raise RequestTimeout(f"process {info.pid} still runs after the wait's timeout")
        return None
    if info.exit_code is None:
        raise SandboxFailed(f"process {info.pid}: {info.error or 'its end is unknown'}")
    return info.exit_code


def _as(params: list[tuple[str, str]], user: str | None) -> list[tuple[str, str]]:
    """``params`` with the user a file operation runs as, when one is named."""
    return params if user is None else [*params, ("user", user)]


def write_file_call(
    id: str, path: str, data: Data, mode: int | None, user: str | None = None
) -> Call[None]:
    params = [("path", path)]
    if mode is not None:
        params.append(("mode", str(int(mode))))
    params = _as(params, user)
    return Call("PUT", _sb(id, "/files"), parse_none, params=params, content=to_bytes(data))


def read_file_call(id: str, path: str, user: str | None = None) -> Call[bytes]:
    return Call(
        "GET",
        _sb(id, "/files"),
        parse_bytes,
        params=_as([("path", path)], user),
        accept="application/octet-stream",
    )


def list_files_call(
    id: str, path: str, depth: int = 1, user: str | None = None
) -> Call[list[FileInfo]]:
    params = [("path", path)]
    if depth != 1:
        params.append(("depth", str(int(depth))))
    return Call("GET", _sb(id, "/files/list"), parse_files, params=_as(params, user))


def _file_info(resp: _http.Response) -> FileInfo:
    return FileInfo.from_json(_obj(resp))


def stat_call(id: str, path: str, user: str | None = None) -> Call[FileInfo]:
    return Call("GET", _sb(id, "/files/stat"), _file_info, params=_as([("path", path)], user))


def _created(resp: _http.Response) -> bool:
    return bool(_obj(resp).get("created"))


def mkdir_call(
    id: str, path: str, parents: bool, exist_ok: bool, mode: int | None, user: str | None = None
) -> Call[bool]:
    body: dict[str, Any] = {"path": path, "parents": parents, "exist_ok": exist_ok}
    if mode is not None:
        body["mode"] = int(mode)
    if user is not None:
        body["user"] = user
    return Call("POST", _sb(id, "/files/mkdir"), _created, json=body)


def move_call(id: str, src: str, dst: str, overwrite: bool, user: str | None = None) -> Call[None]:
    body: dict[str, Any] = {"src": src, "dst": dst, "overwrite": overwrite}
    if user is not None:
        body["user"] = user
    return Call("POST", _sb(id, "/files/move"), parse_none, json=body)


def remove_call(id: str, path: str, recursive: bool, user: str | None = None) -> Call[None]:
    params = [("path", path), ("recursive", "true" if recursive else "false")]
    return Call("DELETE", _sb(id, "/files"), parse_none, params=_as(params, user))


def set_network_call(id: str, network: Network) -> Call[None]:
    return Call("PUT", _sb(id, "/network"), parse_none, json={"network": _network(network)})


def _refused(resp: _http.Response) -> list[dict[str, Any]]:
    return list(_obj(resp)["refused"])


def network_refused_call(id: str) -> Call[list[dict[str, Any]]]:
    return Call("GET", _sb(id, "/network"), _refused)


def pause_call(id: str) -> Call[None]:
    return Call("POST", _sb(id, "/pause"), parse_none)


def resume_call(id: str) -> Call[None]:
    return Call("POST", _sb(id, "/resume"), parse_none)


def snapshot_call(id: str, name: str | None) -> Call[Image]:
    return Call(
        "POST",
        _sb(id, "/snapshot"),
        parse_image,
        json={"name": name},
        read_timeout=IMPORT_TIMEOUT_S,
    )


def fork_call(id: str, n: int) -> Call[list[SandboxInfo]]:
    return Call(
        "POST", _sb(id, "/fork"), parse_infos, json={"n": int(n)}, read_timeout=CREATE_TIMEOUT_S
    )


def import_image_call(source: PathLike, name: str | None) -> Call[Image]:
    src = os.fspath(source)
    if os.path.exists(src):  # a local path: the server (on this host) needs it absolute
        src = os.path.abspath(src)
    return Call(
        "POST",
        "/v1/images",
        parse_image,
        json=_drop_none({"source": src, "name": name}),
        read_timeout=IMPORT_TIMEOUT_S,
    )


def images_call() -> Call[list[Image]]:
    return Call("GET", "/v1/images", parse_images)


def get_image_call(name: str) -> Call[Image]:
    return Call("GET", _image(name), parse_image)


def delete_image_call(name: str) -> Call[None]:
    return Call("DELETE", _image(name), parse_none)


def create_project_call(
    name: str, max_sandboxes: int | None, max_cpus: float | None, max_memory_mb: int | None
) -> Call[Any]:
    body = {
        "name": name,
        "max_sandboxes": max_sandboxes,
        "max_cpus": max_cpus,
        "max_memory_mb": max_memory_mb,
    }
    return Call("POST", "/v1/projects", parse_any, json=_drop_none(body))


def projects_call() -> Call[Any]:
    return Call("GET", "/v1/projects", parse_any)


def delete_project_call(name: str) -> Call[None]:
    return Call("DELETE", f"/v1/projects/{urllib.parse.quote(name, safe='')}", parse_none)


def health_call() -> Call[Any]:
    return Call("GET", "/healthz", parse_any, read_timeout=30.0)


# ---------------------------------------------------------------- steps


class StepCounter:
    """Numbers a sandbox's commands for the trajectory log (0, 1, 2, ...).

    Only counts when the sandbox has a ``trajectory_id``; an explicit ``step`` resets the
    count to follow it. A step whose request failed is handed back, so re-issuing the same
    command re-uses its number (and replays it if the server did record it).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.next = 0
        self._before = 0

    def take(self, step: int | None) -> int | None:
        self._before = self.next
        if step is not None:
            self.next = int(step) + 1
            return int(step)
        if not self.enabled:
            return None
        s = self.next
        self.next += 1
        return s

    def give_back(self, step: int | None) -> None:
        """Undo :meth:`take` of ``step`` (the count goes back to what it was before)."""
        if step is not None and self.next == step + 1:
            self.next = self._before


class SandboxBase:
    """What sync and async sandboxes share: identity and step numbering."""

    def __init__(self, info: SandboxInfo) -> None:
        self.id: str = info.id
        self.trajectory_id: str | None = info.trajectory_id
        self._steps = StepCounter(info.trajectory_id is not None)
        if info.next_step is not None:
            # A fork: its trajectory holds the parent's steps, and continues after them.
            self._steps.next = info.next_step

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r})"
