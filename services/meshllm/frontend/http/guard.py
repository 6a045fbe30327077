"""Slow and oversized clients, stopped below the ASGI app: the HTTP protocol uvicorn runs for the frontend.

uvicorn's httptools protocol times out only idle keep-alive connections
(`timeout_keep_alive`, armed after a response): a connection that sends half
a request header, or trickles its body, holds a socket and a parser for ever,
and httptools bounds no header size. `guarded_protocol` adds, per request:

- a header read timeout, from the connection's start (or the next request's
  first byte) to the end of its headers: a client that sent part of a header
  gets a 408 with an OpenAI error body and the connection closes; one that
  sent nothing is closed silently;
- a header size bound (`MAX_HEADER_BYTES`): 431, then close;
- a body backstop: the app answers a slow body itself (408 from
  `OpenAIApp._read_body` at the body timeout); a body still arriving
  `BODY_SLACK_S` later — one the app never reads, such as a body on a refused
  request — closes the connection.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

__all__ = ["BODY_SLACK_S", "MAX_HEADER_BYTES", "guarded_protocol"]

MAX_HEADER_BYTES = 64 * 1024
BODY_SLACK_S = 2.0


class _GuardedProtocol(HttpToolsProtocol):
    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._in_header = False
        self._header_bytes = 0

    # ------------------------------------------------------------ phases
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_header:
            self._start_header()

    def on_headers_complete(self) -> None:
        self._in_header = False
        self._arm(self.body_timeout_s + BODY_SLACK_S, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def data_received(self, data: bytes) -> None:
        if self._in_header:
            self._header_bytes += len(data)
        super().data_received(data)
        if self._in_header and self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._refuse(431, "HeadersTooLarge", f"the request headers are over the limit of {MAX_HEADER_BYTES} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # ------------------------------------------------------------ timers
    def _start_header(self) -> None:
        self._in_header = True
        self._header_bytes = 0
        self._arm(self.header_timeout_s, self._header_timed_out)

    def _arm(self, delay_s: float, callback: Any) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timed_out(self) -> None:
        self._timer = None
        if not self._in_header or self.transport.is_closing():
            return
        if self._header_bytes == 0:
            self.transport.close()  # nothing was asked: nothing to answer
            return
        self._refuse(408, "RequestTimeout", f"the request headers did not arrive within {self.header_timeout_s:g}s")

    def _body_timed_out(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer `status` with an OpenAI error body and close (only close while a response is under way)."""
        self._disarm()
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
        head = b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        self.transport.write(STATUS_LINE[status] + head + body)
        self.transport.close()


def guarded_protocol(*, header_timeout_s: float, body_timeout_s: float) -> type[HttpToolsProtocol]:
    """The httptools protocol with these limits, for `uvicorn.Config(http=...)`."""
    return type(
        "GuardedHttpToolsProtocol",
        (_GuardedProtocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )
