"""ASGI plumbing of the HTTP edge: bodies read within limits, JSON and error answers, disconnect watching.

Nothing here knows a route. `read_body` reads a whole request body within a
time and size limit (408 / 413, the rest of an oversized body dropped so the
client reads the answer instead of a reset); `refuse` answers a request
refused before its body was read (the body dropped, bounded, then the
connection closed); `json_response` and `error_response` write one JSON
body (errors OpenAI-shaped, with the status of `meshllm.errors.ERROR_TABLE`);
`Disconnect` cancels a handler when its client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from meshllm.errors import InvalidArgument, MeshError, Overloaded, openai_error_body, shorten, spec_of

__all__ = [
    "CLOSE",
    "DISCARD_LIMIT_BYTES",
    "BodyTooLarge",
    "Disconnect",
    "Receive",
    "RequestTimeout",
    "Scope",
    "Send",
    "UnsupportedMediaType",
    "error_response",
    "header",
    "json_response",
    "media_type_error",
    "read_body",
    "refuse",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
CLOSE = (b"connection", b"close")
# Most of a refused or oversized body read (and dropped) before answering; past it the connection is cut.
DISCARD_LIMIT_BYTES = 64 * 1024 * 1024


class BodyTooLarge(InvalidArgument):
    """The request body is over the frontend's limit (HTTP 413)."""


class RequestTimeout(InvalidArgument):
    """The request body did not arrive in time (HTTP 408)."""


class UnsupportedMediaType(InvalidArgument):
    """A POST body that is not application/json (HTTP 415)."""


_STATUS: dict[type[MeshError], int] = {BodyTooLarge: 413, RequestTimeout: 408, UnsupportedMediaType: 415}


class Disconnect:
    """Watches `receive()` for the client going away and cancels the handler task."""

    __slots__ = ("_task", "_watcher", "disconnected", "done")

    def __init__(self, receive: Receive) -> None:
        self._task = asyncio.current_task()
        self.done = False
        self.disconnected = False
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if not self.done and self._task is not None:
                    self.disconnected = True
                    self._task.cancel()
                return

    def stop(self) -> None:
        self.done = True
        self._watcher.cancel()


def header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k == name), None)


def content_length(scope: Scope) -> int | None:
    """The declared body length, None when absent or not a number."""
    value = header(scope, b"content-length")
    return int(value) if value is not None and value.strip().isdigit() else None


def expects_continue(scope: Scope) -> bool:
    """The client waits for `100 Continue` before its body: refusing without reading it sends none."""
    value = header(scope, b"expect")
    return value is not None and value.lower() == b"100-continue"


def media_type_error(scope: Scope) -> UnsupportedMediaType | None:
    """None for a JSON body, else the 415 that says what to send."""
    value = header(scope, b"content-type")
    media = value.split(b";", 1)[0].strip().lower() if value is not None else b""
    if media == b"application/json":
        return None
    got = f"Content-Type {shorten(media.decode('latin-1'), 60)!r}" if media else "no Content-Type"
    return UnsupportedMediaType(
        f"request bodies must be JSON with Content-Type: application/json; this request sent {got} "
        "(curl: add -H 'Content-Type: application/json')"
    )


async def read_body(scope: Scope, receive: Receive, *, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body within `timeout_s` (else 408), at most `max_bytes` (else 413, body dropped)."""
    declared = content_length(scope)
    if declared is None and header(scope, b"content-length") is not None:
        raise InvalidArgument("invalid Content-Length header")
    deadline = asyncio.get_running_loop().time() + timeout_s
    body: bytes | None = None
    if declared is None or declared <= max_bytes:
        try:
            async with asyncio.timeout_at(deadline):
                body = await _receive_body(receive, max_bytes)
        except TimeoutError:
            raise RequestTimeout(f"the request body did not arrive within {timeout_s:g}s") from None
        if body is not None:
            return body
    # Over the limit: read the rest and drop it (bounded), so the client gets to read the 413.
    if not expects_continue(scope) and (declared is None or declared <= DISCARD_LIMIT_BYTES):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                await _discard(receive, DISCARD_LIMIT_BYTES)
    size = f" of {declared} bytes" if declared is not None else ""
    raise BodyTooLarge(f"request body{size} is over the limit of {max_bytes} bytes")


async def _receive_body(receive: Receive, max_bytes: int) -> bytes | None:
    """The body, or None as soon as it grows over `max_bytes`."""
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise InvalidArgument("the client went away while sending the body")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            return None
        parts.append(chunk)
        if not msg.get("more_body", False):
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _discard(receive: Receive, limit: int) -> None:
    """Read and drop the rest of a body, up to `limit` bytes."""
    size = 0
    while size <= limit:
        msg = await receive()
        size += len(msg.get("body", b""))
        if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
            return


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, body: Any, *headers: Any, timeout_s: float) -> int:
    """Answer a request refused before its body was read: drop the body (bounded), answer, close."""
    declared = content_length(scope)
    sent_body = declared != 0 and (declared is not None or header(scope, b"transfer-encoding") is not None)
    if sent_body and not expects_continue(scope) and (declared is None or declared <= DISCARD_LIMIT_BYTES):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await _discard(receive, DISCARD_LIMIT_BYTES)
    return await json_response(send, status, body, [*headers, CLOSE])


async def json_response(send: Send, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None) -> int:
    data = orjson.dumps(body)
    hdrs = [*JSON_HEADERS, (b"content-length", str(len(data)).encode()), *(headers or ())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})
    return status


async def error_response(send: Send, err: MeshError, *, status: int | None = None) -> int:
    headers: list[tuple[bytes, bytes]] = []
    if status is None:
        status = _STATUS.get(type(err)) or spec_of(err).http_status
    if isinstance(err, Overloaded):
        headers.append((b"retry-after", str(max(1, round(err.retry_after_s))).encode()))
    if type(err) in _STATUS:
        headers.append(CLOSE)
    return await json_response(send, status, openai_error_body(err), headers)
