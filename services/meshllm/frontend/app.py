"""The OpenAI-compatible HTTP API as a hand-written ASGI app (served by uvicorn + httptools + uvloop).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /health (ready: admitting and serving a model), GET /live, GET /metrics.

Every error is an OpenAI error body with the status from
`meshllm.errors.ERROR_TABLE` (429 carries Retry-After); nothing a client sends
can raise out of the app, and no traceback reaches a user. Request bodies are
capped (`max_body_bytes`, 413). A client that disconnects cancels its request
at once: a watcher on `receive()` cancels the handler, which closes the
upstream streams, which cancels the gRPC calls down to the engine.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
import uvicorn
from opentelemetry.trace import SpanKind

from meshllm.errors import InvalidArgument, MeshError, Overloaded, Unknown, openai_error_body, spec_of
from meshllm.frontend.inference import Completion, InferenceCore
from meshllm.frontend.responses import collect, sse_events
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.transport import CallInfo
from meshllm.protocol.openai import TextRequest, model_list, parse_chat, parse_completion
from meshllm.tracing import extract_context, tracer

__all__ = ["HttpServer", "OpenAIApp"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class BodyTooLarge(InvalidArgument):
    """The request body is over the frontend's limit (HTTP 413)."""


class _Disconnect:
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


class OpenAIApp:
    """ASGI callable: OpenAI routes over an InferenceCore."""

    def __init__(self, core: InferenceCore, *, max_body_bytes: int = 4 * 1024 * 1024) -> None:
        self.core = core
        self.metrics = core.metrics
        self.max_body_bytes = max_body_bytes
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[int]]] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/live"): self._live,
            ("GET", "/metrics"): self._metrics,
        }
        self._paths = {path for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan and websockets are not served
        path = scope["path"].rstrip("/") or "/"
        method = scope["method"]
        handler = self._routes.get((method, path))
        status = 500
        try:
            if handler is None:
                if path in self._paths:
                    status = await _error(send, InvalidArgument(f"method {method} is not allowed on {path}"), status=405)
                else:
                    status = await _error(send, _not_found(path), status=404)
            else:
                status = await handler(scope, receive, send)
        except Exception as exc:  # never a traceback to a user
            log.exception("unhandled error on %s %s", method, path)
            status = await _error(send, Unknown(f"internal error: {type(exc).__name__}"))
        finally:
            self.metrics.requests.labels(path if handler is not None else "other", str(status)).inc()

    # ------------------------------------------------------------ simple routes
    async def _models(self, scope: Scope, receive: Receive, send: Send) -> int:
        body = model_list([(m.name, m.created, m.context_length) for m in self.core.registry.list()])
        return await _json(send, 200, body)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> int:
        models = [m.name for m in self.core.registry.list()]
        ok = self.core.admitting and bool(models)
        body = {"status": "healthy" if ok else "unhealthy", "models": models, "inflight": self.core.inflight}
        return await _json(send, 200 if ok else 503, body)

    async def _live(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await _json(send, 200, {"status": "live"})

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> int:
        data = await asyncio.to_thread(self.metrics.render)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain; version=0.0.4")]})
        await send({"type": "http.response.body", "body": data})
        return 200

    # ------------------------------------------------------------ generation routes
    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._generate(scope, receive, send, parse_chat)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._generate(scope, receive, send, parse_completion)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, parse: Callable[[Any], TextRequest]) -> int:
        # The request's server span: a child of the caller's W3C traceparent, parent of the router call.
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in (b"traceparent", b"tracestate")}
        with tracer().start_as_current_span(
            f"{scope['method']} {scope['path']}", context=extract_context(headers), kind=SpanKind.SERVER
        ) as span:
            status = await self._generate_traced(scope, receive, send, parse)
            span.set_attribute("http.response.status_code", status)
            return status

    async def _generate_traced(self, scope: Scope, receive: Receive, send: Send, parse: Callable[[Any], TextRequest]) -> int:
        t0 = time.perf_counter()
        try:
            body = await self._read_body(scope, receive)
            try:
                data = orjson.loads(body)
            except orjson.JSONDecodeError as exc:
                raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
            req = parse(data)
        except MeshError as exc:
            return await _error(send, exc)
        watch = _Disconnect(receive)
        completion: Completion | None = None
        try:
            completion = await self.core.begin(req, call=_call_info(scope), t0=t0)
            if req.stream:
                return await self._stream(send, completion, watch)
            result = await collect(completion)
            watch.stop()
            return await _json(send, 200, result)
        except MeshError as exc:
            watch.stop()
            return await _error(send, exc)
        except asyncio.CancelledError:
            if not watch.disconnected:
                raise
            self.metrics.disconnects.inc()
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            return 499
        finally:
            watch.stop()
            if completion is not None:
                await completion.aclose()

    async def _stream(self, send: Send, completion: Completion, watch: _Disconnect) -> int:
        events = sse_events(completion)
        first = await anext(events)  # errors before the first event become a plain HTTP error
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        async for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        watch.stop()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return 200

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise InvalidArgument("invalid Content-Length header") from None
                if declared > self.max_body_bytes:
                    raise BodyTooLarge(f"request body of {declared} bytes is over the limit of {self.max_body_bytes} bytes")
        parts: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise InvalidArgument("the client went away while sending the body")
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge(f"request body is over the limit of {self.max_body_bytes} bytes")
            parts.append(chunk)
            if not msg.get("more_body", False):
                break
        return parts[0] if len(parts) == 1 else b"".join(parts)


def _call_info(scope: Scope) -> CallInfo | None:
    for name, value in scope.get("headers", ()):
        if name == b"traceparent":
            return CallInfo(traceparent=value.decode("latin-1"))
    return None


def _not_found(path: str) -> MeshError:
    from meshllm.errors import NotFound

    return NotFound(f"no route {path}")


async def _json(send: Send, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None) -> int:
    data = orjson.dumps(body)
    hdrs = [*JSON_HEADERS, (b"content-length", str(len(data)).encode()), *(headers or ())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": data})
    return status


async def _error(send: Send, err: MeshError, *, status: int | None = None) -> int:
    headers: list[tuple[bytes, bytes]] = []
    if status is None:
        status = 413 if isinstance(err, BodyTooLarge) else spec_of(err).http_status
    if isinstance(err, Overloaded):
        headers.append((b"retry-after", str(max(1, round(err.retry_after_s))).encode()))
    if isinstance(err, BodyTooLarge):
        headers.append((b"connection", b"close"))
    return await _json(send, status, openai_error_body(err), headers)


class HttpServer(AsyncCloseable):
    """uvicorn (httptools) serving an ASGI app on a pre-bound socket; close = graceful stop."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket) -> None:
        self._server = server
        self._sock = sock
        self.host, self.port = sock.getsockname()[:2]

    @classmethod
    async def start(
        cls, app: OpenAIApp, host: str, port: int, *, graceful_s: float = 10.0, reuse_port: bool = False
    ) -> HttpServer:
        """Serve `app` on host:port; `reuse_port` shares the port with the other processes of `--workers N`."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            from meshllm.config import ConfigError

            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        sock.listen(2048)
        sock.setblocking(False)
        config = uvicorn.Config(
            app,
            http="httptools",
            loop="none",
            lifespan="off",
            ws="none",
            interface="asgi3",
            access_log=False,
            log_config=None,
            server_header=False,
            date_header=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=max(1, round(graceful_s)),
            backlog=2048,
        )
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        return cls(server, sock)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("[::1]" if self.host == "::" else self.host)
        return f"http://{host}:{self.port}"

    async def _aclose(self) -> None:
        await self._server.shutdown(sockets=[self._sock])
