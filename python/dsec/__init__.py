"""dsec: elastic sandboxes for training and evaluating AI agents — the Python SDK.

>>> import dsec
>>> with dsec.Client() as client, client.create(image="busybox") as sb:
...     print(sb.run("echo hi").stdout)
"""

from ._protocol import __version__
from .aio import AsyncClient, AsyncProcess, AsyncSandbox, PendingSandbox
from .client import Client, Process, Sandbox
from .errors import (
    BatchError,
    CapacityExceeded,
    Conflict,
    ConnectionFailed,
    DsecError,
    InvalidArgument,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    QuotaExceeded,
    RequestTimeout,
    SandboxFailed,
    TrajectoryDiverged,
    Unauthorized,
    Unavailable,
)
from .types import (
    CommandResult,
    Event,
    FileInfo,
    Image,
    Limits,
    ProcessEvent,
    ProcessInfo,
    SandboxInfo,
    StreamEvent,
    Usage,
    WatchEvent,
)

__all__ = [
    "AsyncClient",
    "AsyncProcess",
    "AsyncSandbox",
    "BatchError",
    "CapacityExceeded",
    "Client",
    "CommandResult",
    "Conflict",
    "ConnectionFailed",
    "DsecError",
    "Event",
    "FileInfo",
    "Image",
    "InvalidArgument",
    "Limits",
    "NotFound",
    "PayloadTooLarge",
    "PendingSandbox",
    "PermissionDenied",
    "Process",
    "ProcessEvent",
    "ProcessInfo",
    "QuotaExceeded",
    "RequestTimeout",
    "Sandbox",
    "SandboxFailed",
    "SandboxInfo",
    "StreamEvent",
    "TrajectoryDiverged",
    "Unauthorized",
    "Unavailable",
    "Usage",
    "WatchEvent",
    "__version__",
]
