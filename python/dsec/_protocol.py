"""Request building and response parsing, shared by the sync and async clients.

Every operation is a :class:`Call`: the HTTP request to send plus the function that turns
a successful response into a value. The clients only differ in how they send it.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, Union

import httpx

from .errors import ConnectionFailed, DsecError, NotFound, RequestTimeout, error_from_response
from .types import CommandResult, FileInfo, Image, SandboxInfo, StreamEvent

T = TypeVar("T")

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


def default_headers(token: str | None) -> dict[str, str]:
    h = {"User-Agent": f"dsec-python/{__version__}", "Accept": "application/json"}
    if token:
        h["Authorization"] = f"Bearer {token}"
    return h


def timeout(read: float) -> httpx.Timeout:
    """Timeouts for one request; waiting for a pooled connection is not bounded."""
    return httpx.Timeout(read, connect=CONNECT_TIMEOUT_S, pool=None)


def to_bytes(data: Data) -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"expected bytes or str, got {type(data).__name__}")


def b64(data: Data) -> str:
    return base64.b64encode(to_bytes(data)).decode("ascii")


def http_options(
    url: str, token: str | None, max_connections: int | None, *, asynchronous: bool
) -> dict[str, Any]:
    """httpx client options shared by :class:`~dsec.Client` and :class:`~dsec.AsyncClient`."""
    host = httpx.URL(url).host
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=30.0,
    )
    # Connecting is retried (nothing was sent yet): a burst of thousands of new connections
    # can overflow a listen backlog for a moment.
    transport: httpx.BaseTransport | httpx.AsyncBaseTransport = (
        httpx.AsyncHTTPTransport(limits=limits, retries=3)
        if asynchronous
        else httpx.HTTPTransport(limits=limits, retries=3)
    )
    return {
        "base_url": url,
        "headers": default_headers(token),
        "timeout": timeout(DEFAULT_REQUEST_TIMEOUT_S),
        "transport": transport,
        # A server on this host must never be reached through an HTTP proxy.
        "trust_env": host not in ("127.0.0.1", "localhost", "::1", "[::1]"),
    }


_NO_BODY: Any = object()


def _raise(err: DsecError) -> Any:
    raise err


@dataclass(frozen=True)
class Call(Generic[T]):
    """One HTTP request and how to read its answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: list[tuple[str, str]] | None = None
    json: Any = _NO_BODY
    content: bytes | None = None
    read_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    headers: dict[str, str] = field(default_factory=dict)
    #: Called with the error of a failed request; may return a value instead of raising.
    on_error: Callable[[DsecError], T] = _raise

    def build(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        kw: dict[str, Any] = {}
        if self.params:
            kw["params"] = self.params
        if self.json is not _NO_BODY:
            kw["json"] = self.json
        if self.content is not None:
            kw["content"] = self.content
        if self.headers:
            kw["headers"] = self.headers
        return http.build_request(self.method, self.path, timeout=timeout(self.read_timeout), **kw)

    def finish(self, resp: httpx.Response) -> T:
        """Turn a (fully read) response into the call's value or exception."""
        if resp.is_success:
            return self.parse(resp)
        return self.on_error(error_from_response(resp.status_code, resp.content))


def transport_error(url: str, exc: httpx.TransportError) -> DsecError:
    """The exception for a request that got no HTTP answer."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
            return ConnectionFailed(f"cannot reach dsec server at {url}: {detail}")
        return RequestTimeout(f"dsec server at {url} did not answer in time: {detail}")
    if isinstance(exc, httpx.ConnectError):
        return ConnectionFailed(f"cannot reach dsec server at {url}: {detail}")
    return ConnectionFailed(f"lost connection to dsec server at {url}: {detail}")


# ---------------------------------------------------------------- parsing


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError as e:
        raise DsecError(
            f"server sent invalid JSON for {resp.request.method} {resp.request.url.path}: {e}",
            status=resp.status_code,
        ) from e


def _obj(resp: httpx.Response) -> dict[str, Any]:
    doc = _json(resp)
    if not isinstance(doc, dict):
        raise DsecError(f"expected a JSON object, got {type(doc).__name__}")
    return doc


def _list(resp: httpx.Response) -> list[dict[str, Any]]:
    doc = _json(resp)
    if isinstance(doc, dict):  # tolerate {"items": [...]} / {"sandboxes": [...]} envelopes
        for v in doc.values():
            if isinstance(v, list):
                doc = v
                break
    if not isinstance(doc, list):
        raise DsecError(f"expected a JSON array, got {type(doc).__name__}")
    return [x for x in doc if isinstance(x, dict)]


def parse_info(resp: httpx.Response) -> SandboxInfo:
    return SandboxInfo.from_json(_obj(resp))


def parse_infos(resp: httpx.Response) -> list[SandboxInfo]:
    return [SandboxInfo.from_json(d) for d in _list(resp)]


def parse_result(resp: httpx.Response) -> CommandResult:
    return CommandResult.from_json(_obj(resp))


def parse_image(resp: httpx.Response) -> Image:
    return Image.from_json(_obj(resp))


def parse_images(resp: httpx.Response) -> list[Image]:
    return [Image.from_json(d) for d in _list(resp)]


def parse_files(resp: httpx.Response) -> list[FileInfo]:
    return [FileInfo.from_json(d) for d in _list(resp)]


def parse_bytes(resp: httpx.Response) -> bytes:
    return resp.content


def parse_none(resp: httpx.Response) -> None:
    return None


def parse_any(resp: httpx.Response) -> Any:
    return _json(resp) if resp.content else None


def parse_event(line: str) -> StreamEvent | None:
    """Parse one NDJSON line of a streamed command (``None`` for blank lines)."""
    line = line.strip()
    if line.startswith("data:"):  # tolerate SSE framing
        line = line[5:].strip()
    if not line:
        return None
    try:
        doc = json.loads(line)
    except ValueError as e:
        raise DsecError(f"bad event in command stream: {line[:200]!r}") from e
    if not isinstance(doc, dict):
        raise DsecError(f"bad event in command stream: {line[:200]!r}")
    err = doc.get("error")
    if doc.get("kind") == "error" or isinstance(err, dict):
        raise error_from_response(500, json.dumps({"error": err if err else doc}).encode())
    return StreamEvent.from_json(doc)


def _swallow_not_found(err: DsecError) -> None:
    if isinstance(err, NotFound):
        return None
    raise err


# ---------------------------------------------------------------- calls


def _sb(id: str, rest: str = "") -> str:
    return f"/v1/sandboxes/{id}{rest}"


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _network(network: Network) -> Any:
    if isinstance(network, bool):
        return network
    return {k: list(v) for k, v in network.items()}


def create_call(
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
) -> Call[SandboxInfo]:
    body = _drop_none(
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
    return Call("POST", "/v1/sandboxes", parse_info, json=body, read_timeout=CREATE_TIMEOUT_S)


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
) -> dict[str, Any]:
    if isinstance(cmd, (bytes, bytearray)):
        raise TypeError("cmd must be a str or a sequence of str, not bytes")
    return _drop_none(
        {
            "cmd": cmd if isinstance(cmd, str) else [str(a) for a in cmd],
            "env": dict(env) if env is not None else None,
            "cwd": cwd,
            "stdin_b64": b64(stdin) if stdin is not None else None,
            "files": [{"path": p, "data_b64": b64(d)} for p, d in files.items()] if files else None,
            "timeout_s": timeout,
            "max_output_bytes": max_output_bytes,
            "step": step,
        }
    )


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


def stream_call(id: str, body: dict[str, Any]) -> Call[None]:
    """The streamed exec; its response is read line by line with :func:`parse_event`."""
    return Call(
        "POST",
        _sb(id, "/exec/stream"),
        parse_none,
        json=body,
        read_timeout=_run_read_timeout(body.get("timeout_s")),
        headers={"Accept": "application/x-ndjson"},
    )


def write_file_call(id: str, path: str, data: Data, mode: int | None) -> Call[None]:
    params = [("path", path)]
    if mode is not None:
        params.append(("mode", str(int(mode))))
    return Call(
        "PUT",
        _sb(id, "/files"),
        parse_none,
        params=params,
        content=to_bytes(data),
        headers={"Content-Type": "application/octet-stream"},
    )


def read_file_call(id: str, path: str) -> Call[bytes]:
    return Call(
        "GET",
        _sb(id, "/files"),
        parse_bytes,
        params=[("path", path)],
        headers={"Accept": "application/octet-stream"},
    )


def list_files_call(id: str, path: str) -> Call[list[FileInfo]]:
    return Call("GET", _sb(id, "/files/list"), parse_files, params=[("path", path)])


def set_network_call(id: str, network: Network) -> Call[None]:
    return Call("PUT", _sb(id, "/network"), parse_none, json={"network": _network(network)})


def _refused(resp: httpx.Response) -> list[dict[str, Any]]:
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
    return Call("GET", f"/v1/images/{name}", parse_image)


def delete_image_call(name: str) -> Call[None]:
    return Call("DELETE", f"/v1/images/{name}", parse_none)


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
