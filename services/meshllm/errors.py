"""The one exception tree of meshllm and its mapping to gRPC and HTTP.

    MeshError                      base; never raised itself
    ├── InvalidArgument            bad request values           INVALID_ARGUMENT   400
    │   └── ContextLengthExceeded  prompt longer than the model INVALID_ARGUMENT   400
    ├── NotFound                   unknown model / id           NOT_FOUND          404
    ├── Overloaded                 admission limit reached      RESOURCE_EXHAUSTED 429
    ├── FailedPrecondition         e.g. KV layout mismatch      FAILED_PRECONDITION 409
    ├── Unimplemented              optional RPC not offered     UNIMPLEMENTED      501
    ├── Cancelled                  the caller went away         CANCELLED          499
    ├── Unavailable                nothing can serve it now     UNAVAILABLE        503
    │   ├── CannotConnect          connect to a peer failed     UNAVAILABLE        503
    │   ├── Disconnected           a peer went away mid-call    UNAVAILABLE        503
    │   └── EngineShutdown         the engine is shutting down  UNAVAILABLE        503
    ├── ResponseTimeout            deadline passed              DEADLINE_EXCEEDED  504
    ├── ConnectionTimeout          connecting took too long     DEADLINE_EXCEEDED  504
    ├── StreamIncomplete           stream ended w/o terminal    DATA_LOSS          502
    └── Unknown                    anything else (wrapped)      UNKNOWN            500

Lower-layer errors are translated in exactly one place each: gRPC in
`meshllm.plane.request.transport` (status + the `meshllm-error` trailer carry the
class name, so a typed client raises the same class the server raised) and
HTTP in the frontend (status + OpenAI error body from `openai_error_body`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc

__all__ = [
    "ERROR_TABLE",
    "MAX_MESSAGE_CHARS",
    "Cancelled",
    "CannotConnect",
    "ConfigError",
    "ConnectionTimeout",
    "ContextLengthExceeded",
    "Disconnected",
    "EngineShutdown",
    "ErrorSpec",
    "FailedPrecondition",
    "InvalidArgument",
    "MeshError",
    "NotFound",
    "Overloaded",
    "ResponseTimeout",
    "StreamIncomplete",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "error_from_code",
    "error_from_status",
    "log_unexpected",
    "openai_error_body",
    "shorten",
]


# A message travels as the grpc-message header (percent-encoded, up to 12 bytes
# a character) whose default limit is 8 KiB: longer ones would turn the status
# into RESOURCE_EXHAUSTED. Echoed input (a model name, a prompt) is cut to fit.
MAX_MESSAGE_CHARS = 500


def shorten(text: str, limit: int = 100) -> str:
    """`text`, or its head and tail around a marker saying how much was cut, in at most about `limit` characters."""
    if len(text) <= limit:
        return text
    keep = max(limit - len(f"…[{len(text)} characters cut]…"), 2)
    head, tail = keep - keep // 4, keep // 4
    return f"{text[:head]}…[{len(text) - head - tail} characters cut]…{text[len(text) - tail :]}"


class MeshError(Exception):
    """Base of every meshllm error. `message` is safe to show to a user."""

    code: ClassVar[str] = "MeshError"
    # True when rebuilt from a bare gRPC status that no meshllm server sent (no error trailer):
    # the connection failed, the peer did not answer. Set by `meshllm.plane.request.transport.mesh_error`.
    from_transport: bool = False

    def __init__(self, message: str, *, param: str | None = None) -> None:
        message = shorten(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.param = param

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.code = cls.__name__


class InvalidArgument(MeshError):
    """The request is malformed or a value is out of range; `param` names the field."""


class ConfigError(InvalidArgument):
    """A flag or environment value is invalid; the message is one line for the operator (also `meshllm.config`'s)."""


class ContextLengthExceeded(InvalidArgument):
    """Prompt (plus max_tokens) is longer than the model's context length."""


class NotFound(MeshError):
    """The named model, request or handle does not exist."""


class Overloaded(MeshError):
    """An admission limit is reached; retry later."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FailedPrecondition(MeshError):
    """The request cannot run in the current state (e.g. KV layouts differ)."""


class Unimplemented(MeshError):
    """The callee does not offer this operation."""


class Cancelled(MeshError):
    """The caller cancelled the request."""


class Unavailable(MeshError):
    """Nothing can serve the request right now; another attempt may succeed."""


class CannotConnect(Unavailable):
    """Connecting to a peer failed."""


class Disconnected(Unavailable):
    """A peer went away in the middle of a call."""


class EngineShutdown(Unavailable):
    """The engine or worker is shutting down and admits nothing new."""


class ResponseTimeout(MeshError):
    """The request's deadline passed before it completed."""


class ConnectionTimeout(MeshError):
    """Connecting to a peer took longer than allowed."""


class StreamIncomplete(MeshError):
    """A stream ended without its terminal chunk."""


class Unknown(MeshError):
    """An unexpected error, wrapped with its original message."""


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    """How one error class appears on each wire."""

    grpc_status: grpc.StatusCode
    http_status: int
    openai_type: str


ERROR_TABLE: dict[type[MeshError], ErrorSpec] = {
    InvalidArgument: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    ContextLengthExceeded: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    ConfigError: ErrorSpec(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    NotFound: ErrorSpec(grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
    Overloaded: ErrorSpec(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
    FailedPrecondition: ErrorSpec(grpc.StatusCode.FAILED_PRECONDITION, 409, "invalid_request_error"),
    Unimplemented: ErrorSpec(grpc.StatusCode.UNIMPLEMENTED, 501, "not_implemented_error"),
    Cancelled: ErrorSpec(grpc.StatusCode.CANCELLED, 499, "cancelled_error"),
    Unavailable: ErrorSpec(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    CannotConnect: ErrorSpec(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    Disconnected: ErrorSpec(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    EngineShutdown: ErrorSpec(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
    ResponseTimeout: ErrorSpec(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    ConnectionTimeout: ErrorSpec(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
    StreamIncomplete: ErrorSpec(grpc.StatusCode.DATA_LOSS, 502, "api_error"),
    Unknown: ErrorSpec(grpc.StatusCode.UNKNOWN, 500, "internal_error"),
}

_BY_CODE: dict[str, type[MeshError]] = {cls.code: cls for cls in ERROR_TABLE}

# The class a bare status (no meshllm-error trailer, e.g. from a foreign
# server or grpc itself) turns into: the first class listed for it.
_BY_STATUS: dict[grpc.StatusCode, type[MeshError]] = {}
for _cls, _spec in ERROR_TABLE.items():
    _BY_STATUS.setdefault(_spec.grpc_status, _cls)
_BY_STATUS[grpc.StatusCode.INTERNAL] = Unknown
_BY_STATUS[grpc.StatusCode.ABORTED] = Unavailable
_BY_STATUS[grpc.StatusCode.OUT_OF_RANGE] = InvalidArgument
_BY_STATUS[grpc.StatusCode.PERMISSION_DENIED] = FailedPrecondition
_BY_STATUS[grpc.StatusCode.UNAUTHENTICATED] = FailedPrecondition
_BY_STATUS[grpc.StatusCode.ALREADY_EXISTS] = FailedPrecondition


def spec_of(err: MeshError) -> ErrorSpec:
    """The wire mapping of an error (its nearest listed ancestor's)."""
    for cls in type(err).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]  # type: ignore[index]
    return ERROR_TABLE[Unknown]


def error_from_code(code: str, message: str) -> MeshError:
    """Rebuild an error from its class name (as carried by GenerateChunk.error)."""
    return _BY_CODE.get(code, Unknown)(message)


def error_from_status(status: grpc.StatusCode, message: str, code: str | None = None) -> MeshError:
    """Rebuild an error from a gRPC status, preferring the class name when known."""
    if code and code in _BY_CODE:
        return _BY_CODE[code](message)
    return _BY_STATUS.get(status, Unknown)(message)


def openai_error_body(err: MeshError) -> dict[str, Any]:
    """The OpenAI-shaped JSON error body for an error."""
    spec = spec_of(err)
    return {
        "error": {
            "message": err.message,
            "type": spec.openai_type,
            "param": err.param,
            "code": err.code,
        }
    }


# ---------------------------------------------------------------- logging unexpected errors

_SEEN: dict[tuple[str, str, int], list[float]] = {}  # distinct error -> [last logged at, repeats since]
_MAX_SEEN = 1024


def _error_key(exc: BaseException) -> tuple[str, str, int]:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = (tb.tb_frame.f_code.co_filename, tb.tb_lineno) if tb is not None else ("", 0)
    return (type(exc).__qualname__, *where)


def log_unexpected(logger: logging.Logger, what: str, exc: BaseException, *, repeat_interval_s: float = 60.0) -> None:
    """Log an unexpected exception, its traceback once per distinct error (type + where raised).

    Repeats are counted and reported in one line at most every
    `repeat_interval_s`, so input that triggers a bug on every call cannot
    flood the log (or fill the disk).
    """
    key = _error_key(exc)
    now = time.monotonic()
    seen = _SEEN.get(key)
    if seen is None:
        if len(_SEEN) >= _MAX_SEEN:
            _SEEN.pop(next(iter(_SEEN)))
        _SEEN[key] = [now, 0.0]
        logger.error("%s", what, exc_info=exc)
        return
    seen[1] += 1
    if now - seen[0] >= repeat_interval_s:
        logger.error(
            "%s: %s: %s (%d times since the last report; traceback logged the first time)",
            what, type(exc).__name__, shorten(str(exc)), int(seen[1]),
        )  # fmt: skip
        seen[0], seen[1] = now, 0.0
