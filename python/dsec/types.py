"""The values the SDK returns: plain frozen dataclasses built from the server's JSON.

``from_json`` trusts the server's types (the API is typed at its source) and fills each
instance's fields directly: a frozen dataclass's ``__init__`` sets every field through
``object.__setattr__``, which cost more than the rest of parsing a response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T")

__all__ = [
    "CommandResult",
    "Event",
    "FileInfo",
    "Image",
    "Limits",
    "ProcessEvent",
    "ProcessInfo",
    "SandboxInfo",
    "StreamEvent",
    "Usage",
]


def _opt_int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _opt_float(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _make(cls: type[_T], fields: dict[str, Any]) -> _T:
    """An instance of the dataclass ``cls`` with these fields (all of them), unvalidated."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


@dataclass(frozen=True)
class CommandResult:
    """The result of one command. A non-zero exit status is not an exception."""

    exit_code: int | None
    """``None`` when the command timed out; ``128 + N`` when killed by signal N."""
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False
    duration_ms: float = 0.0
    replayed: bool = False
    oom_killed: bool = False

    @property
    def ok(self) -> bool:
        """True when the command exited with status 0."""
        return self.exit_code == 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CommandResult:
        return _make(
            cls,
            {
                "exit_code": d.get("exit_code"),
                "stdout": d.get("stdout") or "",
                "stderr": d.get("stderr") or "",
                "timed_out": d.get("timed_out", False),
                "truncated": d.get("truncated", False),
                "duration_ms": d.get("duration_ms") or 0.0,
                "replayed": d.get("replayed", False),
                "oom_killed": d.get("oom_killed", False),
            },
        )


@dataclass(frozen=True)
class Event:
    """One event of the server's stream (:meth:`dsec.Client.events`).

    ``kind`` is e.g. ``"command.end"`` or ``"limit.pids"`` (docs/SDK.md lists them);
    ``data`` holds its details; ``sandbox`` and ``labels`` name the sandbox it is about.
    """

    id: int
    time: float
    kind: str
    sandbox: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    data: Any = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Event:
        return _make(
            cls,
            {
                "id": d.get("id", 0),
                "time": d.get("time", 0.0),
                "kind": d.get("kind", ""),
                "sandbox": d.get("sandbox"),
                "labels": d.get("labels") or {},
                "data": d.get("data"),
            },
        )


@dataclass(frozen=True)
class StreamEvent:
    """One event of a streamed command: ``kind`` is ``"stdout"``, ``"stderr"`` or ``"exit"``.

    ``data`` is set for output events; the other fields for the final ``exit`` event.
    """

    kind: str
    data: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    truncated: bool = False
    oom_killed: bool = False
    duration_ms: float | None = None
    replayed: bool = False

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StreamEvent:
        return _make(
            cls,
            {
                "kind": d.get("kind", ""),
                "data": d.get("data") or "",
                "exit_code": d.get("exit_code"),
                "timed_out": d.get("timed_out", False),
                "truncated": d.get("truncated", False),
                "oom_killed": d.get("oom_killed", False),
                "duration_ms": d.get("duration_ms"),
                "replayed": d.get("replayed", False),
            },
        )


@dataclass(frozen=True)
class FileInfo:
    """An entry of a directory listing, or the status of a path. ``mode`` holds the
    permission bits; ``kind`` is ``file``, ``dir``, ``symlink`` or ``other``; ``path`` is
    relative to the listed directory (for ``stat``, the path asked); ``mtime`` is seconds
    since the epoch; ``link`` a symbolic link's target; ``uid``/``gid`` ``None`` where the
    backend does not know them (docker's ``stat``); ``metadata`` a file's or directory's
    ``user.e2b.*`` extended attributes, the prefix dropped (what E2B's metadata uploads set;
    empty on docker)."""

    name: str
    size: int
    is_dir: bool
    mode: int
    path: str = ""
    kind: str = "file"
    mtime: int = 0
    uid: int | None = None
    gid: int | None = None
    link: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileInfo:
        link = d.get("link")
        metadata = d.get("metadata")
        return cls(
            name=str(d.get("name", "")),
            size=_opt_int(d.get("size")) or 0,
            is_dir=bool(d.get("is_dir", False)),
            mode=_opt_int(d.get("mode")) or 0,
            path=str(d.get("path") or d.get("name", "")),
            kind=str(d.get("kind", "dir" if d.get("is_dir") else "file")),
            mtime=_opt_int(d.get("mtime")) or 0,
            uid=_opt_int(d.get("uid")),
            gid=_opt_int(d.get("gid")),
            link=None if link is None else str(link),
            metadata=(
                {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}
            ),
        )


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by :meth:`dsec.Sandbox.watch`. ``kind`` is ``create`` (made or moved
    in), ``write``, ``remove``, ``rename`` (moved away: the old path), ``chmod`` or
    ``overflow`` (the sandbox's queue overflowed: events were lost; ``path`` empty);
    ``path`` is absolute, under the watched one."""

    kind: str
    path: str
    is_dir: bool = False

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WatchEvent:
        return cls(
            kind=str(d.get("kind", "")),
            path=str(d.get("path", "")),
            is_dir=bool(d.get("is_dir", False)),
        )


@dataclass(frozen=True)
class Limits:
    """A sandbox's resource limits as the server applied them."""

    cpus: float | None = None
    memory_mb: int | None = None
    pids: int | None = None
    disk_mb: int | None = None

    @classmethod
    def from_json(cls, d: Any) -> Limits:
        if not isinstance(d, dict):
            return cls()
        return _make(
            cls,
            {
                "cpus": d.get("cpus"),
                "memory_mb": d.get("memory_mb"),
                "pids": d.get("pids"),
                "disk_mb": d.get("disk_mb"),
            },
        )


@dataclass(frozen=True)
class Usage:
    """A sandbox's current resource usage."""

    memory_bytes: int | None = None
    pids: int | None = None
    cpu_ms: float | None = None
    #: Most memory charged at once since creation (0 where the backend cannot tell).
    memory_peak_bytes: int | None = None
    #: Forks the pids limit refused since creation.
    pids_limit_hits: int | None = None
    #: Processes the memory limit killed since creation.
    oom_kills: int | None = None
    #: Bytes used in the writable layer (``None`` where the backend cannot tell).
    disk_bytes: int | None = None
    #: Files and directories in the writable layer (``None`` where the backend cannot tell).
    disk_inodes: int | None = None
    #: CPU time its CPU limit held it back (throttled) since creation.
    cpu_throttled_ms: float | None = None
    #: Bytes received and sent over its network interface (``None`` without a network).
    network_rx_bytes: int | None = None
    network_tx_bytes: int | None = None

    @classmethod
    def from_json(cls, d: Any) -> Usage:
        if not isinstance(d, dict):
            return cls()
        return _make(
            cls,
            {
                "memory_bytes": d.get("memory_bytes"),
                "pids": d.get("pids"),
                "cpu_ms": d.get("cpu_ms"),
                "memory_peak_bytes": d.get("memory_peak_bytes"),
                "pids_limit_hits": d.get("pids_limit_hits"),
                "oom_kills": d.get("oom_kills"),
                "disk_bytes": d.get("disk_bytes"),
                "disk_inodes": d.get("disk_inodes"),
                "cpu_throttled_ms": d.get("cpu_throttled_ms"),
                "network_rx_bytes": d.get("network_rx_bytes"),
                "network_tx_bytes": d.get("network_tx_bytes"),
            },
        )


@dataclass(frozen=True)
class SandboxInfo:
    """What the server knows about a sandbox. ``raw`` keeps the whole JSON object."""

    id: str
    backend: str
    image: str
    state: str
    created_at: float
    limits: Limits
    usage: Usage
    labels: dict[str, str]
    ttl_s: float | None = None
    idle_ttl_s: float | None = None
    trajectory_id: str | None = None
    #: Set on the sandboxes ``fork`` returns: the step their inherited trajectory continues at.
    next_step: int | None = None
    #: ``microvm`` and ``vm`` sandboxes: the accelerator their guest runs on, ``kvm`` or ``tcg``.
    accelerator: str | None = None
    #: The name of the edge that owns the sandbox (``dsec serve``: the server's ``--name``).
    edge: str = ""
    #: The project it belongs to (``dsec project create``); ``None``: the admin's.
    project: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SandboxInfo:
        return _make(
            cls,
            {
                "id": d.get("id", ""),
                "backend": d.get("backend", ""),
                "image": d.get("image", ""),
                "state": d.get("state", ""),
                "created_at": d.get("created_at") or 0.0,
                "limits": Limits.from_json(d.get("limits")),
                "usage": Usage.from_json(d.get("usage")),
                "labels": d.get("labels") or {},
                "ttl_s": d.get("ttl_s"),
                "idle_ttl_s": d.get("idle_ttl_s"),
                "trajectory_id": d.get("trajectory_id"),
                "next_step": d.get("next_step"),
                "accelerator": d.get("accelerator"),
                "edge": d.get("edge") or "",
                "project": d.get("project"),
                "raw": d,
            },
        )


@dataclass(frozen=True)
class Image:
    """A dsec image: ``project`` owns it (``None``: the admin's, shared). ``raw`` keeps the
    whole JSON object."""

    name: str
    id: str
    size: int
    layers: list[str] = field(default_factory=list)
    created_at: float | None = None
    project: str | None = None
    #: A bootable disk image (a qcow2 or raw disk with its own bootloader and kernel, which
    #: only ``backend="vm"`` starts): ``{"format": "qcow2", "virtual_size": BYTES}``.
    disk: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Image:
        layers = d.get("layers")
        project = d.get("project")
        disk = d.get("disk")
        return cls(
            name=str(d.get("name", "")),
            id=str(d.get("id", "")),
            size=_opt_int(d.get("size")) or 0,
            layers=[str(x) for x in layers] if isinstance(layers, list) else [],
            created_at=_opt_float(d.get("created_at")),
            project=str(project) if project is not None else None,
            disk=dict(disk) if isinstance(disk, dict) else None,
            raw=d,
        )


@dataclass(frozen=True)
class ProcessInfo:
    """A spawned process: ``pid`` inside the sandbox, its ``tag`` and ``cmd`` (argv);
    ``running`` until it ends, then ``exit_code`` (``128 + N`` when signal ``N`` killed it,
    ``signal`` set) or, when the sandbox went first, ``error``."""

    pid: int
    tag: str | None
    cmd: list[str]
    pty: bool
    started_at: float
    running: bool
    exit_code: int | None = None
    signal: int | None = None
    error: str | None = None
    #: Its spawn's step in the sandbox's trajectory log.
    step: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProcessInfo:
        exit = d.get("exit") or {}
        return _make(
            cls,
            {
                "pid": int(d["pid"]),
                "tag": d.get("tag"),
                "cmd": list(d.get("cmd") or []),
                "pty": bool(d.get("pty", False)),
                "started_at": float(d.get("started_at", 0.0)),
                "running": bool(d.get("running", False)),
                "exit_code": _opt_int(exit.get("exit_code")),
                "signal": _opt_int(exit.get("signal")),
                "error": exit.get("error"),
                "step": _opt_int(d.get("step")),
            },
        )


@dataclass(frozen=True)
class ProcessEvent:
    """One event of a spawned process: ``kind`` is ``"stdout"``, ``"stderr"``, ``"pty"``
    (a terminal's output) or ``"exit"`` (last; ``exit_code``, ``signal``, ``error`` set).

    ``dropped`` counts the bytes of output just before this event that were no longer
    buffered for this reader (the server keeps the last 1 MiB per process).
    """

    kind: str
    data: str = ""
    exit_code: int | None = None
    signal: int | None = None
    oom_killed: bool = False
    duration_ms: float | None = None
    error: str | None = None
    dropped: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ProcessEvent:
        return _make(
            cls,
            {
                "kind": d.get("kind", ""),
                "data": d.get("data") or "",
                "exit_code": _opt_int(d.get("exit_code")),
                "signal": _opt_int(d.get("signal")),
                "oom_killed": bool(d.get("oom_killed", False)),
                "duration_ms": _opt_float(d.get("duration_ms")),
                "error": d.get("error"),
                "dropped": int(d.get("dropped", 0)),
            },
        )
