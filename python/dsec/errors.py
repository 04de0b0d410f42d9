"""Exceptions raised by the dsec SDK, and the one place that maps server errors to them."""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "BatchError",
    "CapacityExceeded",
    "Conflict",
    "ConnectionFailed",
    "DsecError",
    "InvalidArgument",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "RequestTimeout",
    "SandboxFailed",
    "TrajectoryDiverged",
    "Unauthorized",
    "Unavailable",
    "error_from_kind",
    "error_from_response",
]


class DsecError(Exception):
    """Base class of every error the SDK raises.

    ``message`` is the server's message (or a description of the client-side failure),
    ``status`` the HTTP status when there was a response, ``kind`` the server's error kind.
    """

    def __init__(self, message: str, *, status: int | None = None, kind: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, status={self.status!r}, kind={self.kind!r})"
        )


class InvalidArgument(DsecError):
    """Bad input: unknown backend, bad limits, bad path, malformed request (HTTP 400)."""


class PayloadTooLarge(InvalidArgument):
    """The request body is larger than the server accepts (HTTP 413)."""


class Unauthorized(DsecError):
    """Missing or wrong token (HTTP 401)."""


class NotFound(DsecError):
    """No such sandbox, image, file or route (HTTP 404)."""


class PermissionDenied(DsecError):
    """The user a file operation runs as (``user=``) may not do it in the sandbox (HTTP 403)."""


class Conflict(DsecError):
    """The sandbox is in the wrong state for the request (HTTP 409)."""


class TrajectoryDiverged(Conflict):
    """A replayed trajectory step differs from the recorded one (HTTP 409)."""


class SandboxFailed(Conflict):
    """The sandbox's init died (killed from outside, by the OOM killer, or crashed), so the
    sandbox can serve nothing more; the message says how when the server knows. Stop it and
    create a new one (HTTP 409)."""


class QuotaExceeded(Conflict):
    """A create would take the project past one of its quotas; the message names the quota,
    its limit and the current use (HTTP 409)."""


class Unavailable(DsecError):
    """The server cannot do this on this host (backend missing, feature not there: HTTP 503)."""


class CapacityExceeded(Unavailable):
    """This server has promised all the memory or processes its budget allows; the same
    request may succeed on another server, or here once sandboxes stop (HTTP 503)."""


class ConnectionFailed(DsecError):
    """The server could not be reached, or the connection broke before an answer came."""


class RequestTimeout(DsecError):
    """The server did not answer in time."""


class BatchError(DsecError):
    """Some sandboxes of a ``create_many`` were made and some were not.

    ``sandboxes`` holds those made, in request order: they are running, yours to use or
    stop. ``errors`` maps the index of each item not made to the exception a single
    ``create`` would have raised for it (``status`` is ``None``: items share one response).
    """

    def __init__(self, message: str, *, sandboxes: list[Any], errors: dict[int, DsecError]):
        super().__init__(message)
        self.sandboxes = sandboxes
        self.errors = errors


_BY_KIND: dict[str, type[DsecError]] = {
    "permission_denied": PermissionDenied,
    "invalid_argument": InvalidArgument,
    "payload_too_large": PayloadTooLarge,
    "unauthorized": Unauthorized,
    "not_found": NotFound,
    "conflict": Conflict,
    "trajectory_diverged": TrajectoryDiverged,
    "sandbox_failed": SandboxFailed,
    "unavailable": Unavailable,
    "capacity": CapacityExceeded,
    "quota_exceeded": QuotaExceeded,
    "internal": DsecError,
}

_BY_STATUS: dict[int, type[DsecError]] = {
    400: InvalidArgument,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    415: InvalidArgument,
    422: InvalidArgument,
    501: Unavailable,
    503: Unavailable,
}


def error_from_response(status: int, body: bytes) -> DsecError:
    """Build the exception for an error response: by the JSON ``kind``, else by the status."""
    kind: str | None = None
    message: str | None = None
    try:
        doc: Any = json.loads(body) if body else None
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict):
            k, m = err.get("kind"), err.get("message")
            kind = k if isinstance(k, str) else None
            message = m if isinstance(m, str) else None
        elif isinstance(err, str):
            message = err
    if message is None:
        text = body.decode("utf-8", "replace").strip()
        message = text[:1000] if text else f"HTTP {status}"
    return error_from_kind(kind, message, status=status)


def error_from_kind(kind: str | None, message: str, *, status: int | None = None) -> DsecError:
    """The exception for a server error of ``kind`` (by ``status`` when the kind is unknown)."""
    cls = _BY_KIND.get(kind) if kind is not None else None
    if cls is None:
        cls = _BY_STATUS.get(status, DsecError) if status is not None else DsecError
    return cls(message, status=status, kind=kind)
