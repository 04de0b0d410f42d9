"""The values the SDK returns: plain dataclasses built from the server's JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CommandResult",
    "FileInfo",
    "Image",
    "Limits",
    "SandboxInfo",
    "StreamEvent",
    "Usage",
]


def _opt_int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _opt_float(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _str_dict(v: Any) -> dict[str, str]:
    return {str(k): str(x) for k, x in v.items()} if isinstance(v, dict) else {}


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
        return cls(
            exit_code=_opt_int(d.get("exit_code")),
            stdout=str(d.get("stdout") or ""),
            stderr=str(d.get("stderr") or ""),
            timed_out=bool(d.get("timed_out", False)),
            truncated=bool(d.get("truncated", False)),
            duration_ms=_opt_float(d.get("duration_ms")) or 0.0,
            replayed=bool(d.get("replayed", False)),
            oom_killed=bool(d.get("oom_killed", False)),
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
        return cls(
            kind=str(d.get("kind", "")),
            data=str(d.get("data") or ""),
            exit_code=_opt_int(d.get("exit_code")),
            timed_out=bool(d.get("timed_out", False)),
            truncated=bool(d.get("truncated", False)),
            oom_killed=bool(d.get("oom_killed", False)),
            duration_ms=_opt_float(d.get("duration_ms")),
            replayed=bool(d.get("replayed", False)),
        )


@dataclass(frozen=True)
class FileInfo:
    """An entry of a directory listing. ``mode`` holds the permission bits."""

    name: str
    size: int
    is_dir: bool
    mode: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FileInfo:
        return cls(
            name=str(d.get("name", "")),
            size=_opt_int(d.get("size")) or 0,
            is_dir=bool(d.get("is_dir", False)),
            mode=_opt_int(d.get("mode")) or 0,
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
        return cls(
            cpus=_opt_float(d.get("cpus")),
            memory_mb=_opt_int(d.get("memory_mb")),
            pids=_opt_int(d.get("pids")),
            disk_mb=_opt_int(d.get("disk_mb")),
        )


@dataclass(frozen=True)
class Usage:
    """A sandbox's current resource usage."""

    memory_bytes: int | None = None
    pids: int | None = None
    cpu_ms: float | None = None

    @classmethod
    def from_json(cls, d: Any) -> Usage:
        if not isinstance(d, dict):
            return cls()
        return cls(
            memory_bytes=_opt_int(d.get("memory_bytes")),
            pids=_opt_int(d.get("pids")),
            cpu_ms=_opt_float(d.get("cpu_ms")),
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
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SandboxInfo:
        tid = d.get("trajectory_id")
        accel = d.get("accelerator")
        return cls(
            id=str(d.get("id", "")),
            backend=str(d.get("backend", "")),
            image=str(d.get("image", "")),
            state=str(d.get("state", "")),
            created_at=_opt_float(d.get("created_at")) or 0.0,
            limits=Limits.from_json(d.get("limits")),
            usage=Usage.from_json(d.get("usage")),
            labels=_str_dict(d.get("labels")),
            ttl_s=_opt_float(d.get("ttl_s")),
            idle_ttl_s=_opt_float(d.get("idle_ttl_s")),
            trajectory_id=str(tid) if tid is not None else None,
            next_step=int(d["next_step"]) if d.get("next_step") is not None else None,
            accelerator=str(accel) if accel is not None else None,
            raw=d,
        )


@dataclass(frozen=True)
class Image:
    """A dsec image. ``raw`` keeps the whole JSON object."""

    name: str
    id: str
    size: int
    layers: list[str] = field(default_factory=list)
    created_at: float | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Image:
        layers = d.get("layers")
        return cls(
            name=str(d.get("name", "")),
            id=str(d.get("id", "")),
            size=_opt_int(d.get("size")) or 0,
            layers=[str(x) for x in layers] if isinstance(layers, list) else [],
            created_at=_opt_float(d.get("created_at")),
            raw=d,
        )
