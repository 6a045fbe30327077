"""A lean HTTP/1.1 client for load generation: one keep-alive connection per simulated user.

Only what an OpenAI endpoint needs: POST a JSON body, read the status and
headers, then the body by Content-Length or chunked transfer coding, and split
an SSE stream into its `data:` payloads as they arrive. No third-party
dependency, little CPU per event: the load generator must not steal the
machine from the server it measures.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["Connection", "Endpoint", "HttpError", "Response"]


class HttpError(Exception):
    """The connection failed or the server broke the protocol.

    `connection` is True when the server could not be reached or dropped the
    connection (refused, reset, closed mid-response): what a server that went
    away looks like, as opposed to a malformed response.
    """

    def __init__(self, message: str, *, connection: bool = True) -> None:
        super().__init__(message)
        self.connection = connection


def _why(exc: BaseException) -> str:
    """A readable reason for a failed read or write (asyncio's own texts say "undefined expected bytes")."""
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the server closed the connection" + (" mid-response" if exc.partial else "")
    if isinstance(exc, ConnectionResetError):
        return "the connection was reset by the server"
    if isinstance(exc, BrokenPipeError):
        return "the server closed the connection"
    if isinstance(exc, asyncio.LimitOverrunError):
        return "a response line is too long"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where requests go: scheme, host, port and the API base path (ending in /v1)."""

    scheme: str
    host: str
    port: int
    base: str
    api_key: str | None = None
    server_hostname: str | None = None  # the name to send and to check TLS against, when `host` is its address

    @classmethod
    def parse(cls, url: str, api_key: str | None = None) -> Endpoint:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url {url!r} is not an http(s) URL")
        base = parts.path.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, base, api_key)


@dataclass(slots=True)
class Response:
    """Status and headers; the body is read with `read()` or `events()`."""

    status: int
    headers: dict[str, str]
    _conn: Connection

    async def read(self) -> bytes:
        return b"".join([part async for part in self._conn._body(self.headers)])

    async def events(self) -> AsyncGenerator[bytes, None]:
        """The payload of each SSE `data:` line, as soon as its event is complete."""
        buf = b""
        async for part in self._conn._body(self.headers):
            buf += part
            while True:
                end = buf.find(b"\n\n")
                if end < 0:
                    break
                event, buf = buf[:end], buf[end + 2 :]
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].lstrip()


class _Stale(Exception):
    """A reused keep-alive connection turned out closed before any response byte."""


class Connection:
    """One keep-alive connection; requests on it run one after another."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reusable = False
        self._used = False  # a request completed on this connection (a failure may be a stale keep-alive)

    async def _connect(self) -> None:
        ep = self.endpoint
        ctx = ssl.create_default_context() if ep.scheme == "https" else None
        try:
            self._reader, self._writer = await asyncio.open_connection(
                ep.host, ep.port, ssl=ctx, server_hostname=ep.server_hostname if ctx else None, limit=1 << 22
            )
        except OSError as exc:
            raise HttpError(f"cannot connect to {ep.host}:{ep.port}: {exc.strerror or exc}") from None
        self._used = False

    async def post(self, path: str, body: bytes) -> Response:
        """Send a POST with a JSON body to the API base + `path`; returns once the status line and headers are in.

        A kept-alive connection the server closed while idle (nothing at all
        came back) is reopened once and the request sent again, as HTTP
        clients do; any other failure raises `HttpError`.
        """
        return await self._request("POST", self.endpoint.base + path, body)

    async def get(self, path: str) -> Response:
        """Send a GET of `path` from the server's root (e.g. "/metrics"), as `post` does."""
        return await self._request("GET", path, None)

    async def _request(self, method: str, target: str, body: bytes | None) -> Response:
        try:
            return await self._send(method, target, body)
        except _Stale:
            await self.close()
            return await self._send(method, target, body)

    async def _send(self, method: str, target: str, body: bytes | None) -> Response:
        if self._writer is None or not self._reusable:
            await self.close()
            await self._connect()
        assert self._reader is not None and self._writer is not None
        reused = self._used
        ep = self.endpoint
        host = ep.server_hostname or (f"[{ep.host}]" if ":" in ep.host else ep.host)
        head = f"{method} {target} HTTP/1.1\r\nHost: {host}:{ep.port}\r\n"
        if body is not None:
            head += "Content-Type: application/json\r\nAccept: text/event-stream, application/json\r\n"
            head += f"Content-Length: {len(body)}\r\n"
        if ep.api_key:
            head += f"Authorization: Bearer {ep.api_key}\r\n"
        self._reusable = False
        try:
            self._writer.write(head.encode() + b"\r\n" + (body or b""))
            raw = await self._reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            idle_close = isinstance(exc, (ConnectionResetError, BrokenPipeError)) or (
                isinstance(exc, asyncio.IncompleteReadError) and not exc.partial
            )
            if reused and idle_close:
                raise _Stale from None
            await self.close()
            raise HttpError(f"connection failed: {_why(exc)}") from None
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            await self.close()
            raise HttpError(f"bad status line {lines[0]!r}", connection=False) from None
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return Response(status, headers, self)

    async def _body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        reader = self._reader
        assert reader is not None
        try:
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                    if size == 0:
                        await reader.readuntil(b"\r\n")
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif "content-length" in headers:
                yield await reader.readexactly(int(headers["content-length"]))
            else:
                yield await reader.read()
                await self.close()
                return
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            await self.close()
            if isinstance(exc, ValueError):
                raise HttpError(f"reading the body failed: bad chunk size ({exc})", connection=False) from None
            raise HttpError(f"reading the body failed: {_why(exc)}") from None
        self._reusable = headers.get("connection", "").lower() != "close"
        self._used = True

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        self._reusable = False
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except (OSError, ssl.SSLError):
                pass
