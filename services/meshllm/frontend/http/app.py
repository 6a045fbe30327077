"""The OpenAI-compatible HTTP API as a hand-written ASGI app (served by uvicorn + httptools + uvloop).

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST /v1/embeddings,
GET /v1/models, GET /v1/models/{model}, POST /v1/tokenize, POST /v1/detokenize and GET /v1/tokenizer_info (also
without /v1, as vLLM serves them; frontend/openai/tokenize_api.py), GET /health (ready: admitting and serving a model),
GET /live, GET /metrics, and the live mesh page GET /dashboard (+ /dashboard/state, frontend/http/dashboard.py).

Every error is an OpenAI error body with the status from
`meshllm.errors.ERROR_TABLE` (429 carries Retry-After); nothing a client sends
can raise out of the app, and no traceback reaches a user. A client that
disconnects cancels its request at once: a watcher on `receive()` cancels the
handler, which closes the upstream streams, which cancels the gRPC calls down
to the engine.

Before a request runs (docs/security.md): with API keys set, every route but
/health and /live (and /metrics, /dashboard* with `open_metrics`) needs
`Authorization: Bearer KEY` (401 `invalid_api_key`; /metrics and /dashboard*
take `Basic` with the key as password too, so a browser's login prompt opens
the page). The key's id is the request's tenant (`TENANT_KEY` in the scope;
`ANONYMOUS` without keys): stored responses belong to it. A client's request
id (`x-request-id`, else the body's `request_id`) names the response and is
echoed in `x-request-id`; the id the request has inside the mesh is always
made here. POST bodies must be `application/json`
(415); a body must arrive within `body_timeout_s` (408) and fit
`max_body_bytes` (413). A refused request's body is read and dropped up to
`DISCARD_LIMIT_BYTES` before the answer, and the connection then closed, so
the client reads the status instead of a reset. Header timeouts and sizes are
enforced below the app (`meshllm.frontend.http.guard`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import orjson
import uvicorn
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from meshllm.errors import (
    InvalidArgument,
    MeshError,
    Overloaded,
    Unknown,
    log_unexpected,
    openai_error_body,
    shorten,
    spec_of,
)
from meshllm.frontend.http.auth import ANONYMOUS, ApiKeys, AuthFailure, unauthorized_body
from meshllm.frontend.http.dashboard import ASSETS, Dashboard, asset
from meshllm.frontend.http.guard import guarded_protocol
from meshllm.frontend.openai.inference import Completion, InferenceCore

if TYPE_CHECKING:
    from meshllm.plane.tls import TlsConfig
from meshllm.frontend.http.ready_writes import write_ready
from meshllm.frontend.openai import embeddings_api
from meshllm.frontend.openai.bodies import collect, sse_events
from meshllm.frontend.openai.responses_api import ResponsesApi
from meshllm.frontend.openai.tokenize_api import detokenize, model_info, tokenize, tokenizer_info
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.request.transport import CallInfo
from meshllm.protocol.openai import TextRequest, model_list, parse_chat, parse_completion, parse_json_body
from meshllm.tracing import FRONTEND_SERVICE, extract_context, tracer

__all__ = ["HttpServer", "OpenAIApp"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# How a completion becomes a response body: (whole JSON body, SSE events); chat/completions' or the Responses API's.
Shape = tuple[Callable[[Completion], Awaitable[Any]], Callable[[Completion], AsyncIterator[bytes]]]
EMBEDDINGS: Shape = (embeddings_api.collect, embeddings_api.events)

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
IGNORED_HEADER = b"x-meshllm-ignored-params"  # request fields that had no effect, comma-separated
CLOSE = (b"connection", b"close")
WWW_AUTHENTICATE = (b"www-authenticate", b'Bearer realm="meshllm"')
BROWSER_LOGIN = (b"www-authenticate", b'Basic realm="meshllm", charset="UTF-8"')  # the dashboard page: a login prompt
# Most of a refused or oversized body read (and dropped) before answering; past it the connection is cut.
DISCARD_LIMIT_BYTES = 64 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
MODEL_KEY = "meshllm.model"  # scope key: the model a request named, for the request counter
TENANT_KEY = "meshllm.tenant"  # scope key: the tenant (API key id) a request was let in as
REQUEST_ID_HEADER = b"x-request-id"
MAX_CLIENT_ID_CHARS = 256


class BodyTooLarge(InvalidArgument):
    """The request body is over the frontend's limit (HTTP 413)."""


class RequestTimeout(InvalidArgument):
    """The request body did not arrive in time (HTTP 408)."""


class UnsupportedMediaType(InvalidArgument):
    """A POST body that is not application/json (HTTP 415)."""


_STATUS: dict[type[MeshError], int] = {BodyTooLarge: 413, RequestTimeout: 408, UnsupportedMediaType: 415}


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

    def __init__(
        self,
        core: InferenceCore,
        *,
        max_body_bytes: int = 4 * 1024 * 1024,
        api_keys: ApiKeys | None = None,
        open_metrics: bool = False,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        dashboard: Dashboard | None = None,
        strict_params: bool = False,
    ) -> None:
        self.core = core
        self.responses = ResponsesApi()  # /v1/responses, with its stored responses (frontend/openai/responses_api.py)
        self.strict_params = strict_params  # unknown request fields are a 400 (else named in IGNORED_HEADER)
        self.dashboard = dashboard
        self.metrics = core.metrics
        self.max_body_bytes = max_body_bytes
        self.api_keys = api_keys if api_keys is not None else ApiKeys()
        self.body_timeout_s = body_timeout_s
        self._open_paths = {"/health", "/live"} | ({"/metrics"} if open_metrics else set())
        self._monitor_paths = {"/metrics"}  # also take Basic auth (browsers, Prometheus basic_auth)
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[int]]] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/responses"): self._responses,
            ("POST", "/v1/embeddings"): self._embeddings,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/live"): self._live,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/v1/tokenize"): self._tokenize,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/v1/detokenize"): self._detokenize,
            ("POST", "/detokenize"): self._detokenize,
            ("GET", "/v1/tokenizer_info"): self._tokenizer_info,
            ("GET", "/tokenizer_info"): self._tokenizer_info,
        }
        # Routes with an id in the path: (method, prefix) → handler
        self._prefix_routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[int]]] = {
            ("GET", "/v1/models/"): self._model,  # names may hold "/" (org/name)
            ("GET", "/v1/responses/"): self._response_get,
            ("DELETE", "/v1/responses/"): self._response_delete,
        }
        if dashboard is not None:  # the live mesh page (frontend/http/dashboard.py): governed like /metrics
            self._routes.update({("GET", path): self._dashboard_asset for path in ASSETS})
            self._routes[("GET", "/dashboard/state")] = self._dashboard_state
            self._monitor_paths |= {*ASSETS, "/dashboard/state"}
            if open_metrics:
                self._open_paths |= self._monitor_paths
        self._paths = {path for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan and websockets are not served
        path = scope["path"].rstrip("/") or "/"
        method = scope["method"]
        handler = self._routes.get((method, path))
        if handler is None:
            handler = self._prefixed(method, path)
        status = 500
        try:
            refused = self._authorize(scope, path) if self.api_keys and path not in self._open_paths else None
            if refused is not None:
                login = BROWSER_LOGIN if path in ASSETS else WWW_AUTHENTICATE
                status = await self._refuse(scope, receive, send, 401, unauthorized_body(refused), login)
            elif handler is None:
                if path in self._paths or self._prefixed(None, path) is not None:
                    status = await _error(send, InvalidArgument(f"method {method} is not allowed on {path}"), status=405)
                else:
                    status = await _error(send, _not_found(path), status=404)
            else:
                status = await handler(scope, receive, send)
        except Exception as exc:  # never a traceback to a user
            log_unexpected(log, f"unhandled error on {method} {shorten(path)}", exc)
            status = await _error(send, Unknown(f"internal error: {type(exc).__name__}"))
        finally:
            route = path if handler is not None else "other"
            self.metrics.requests.labels(route, str(status), scope.get(MODEL_KEY, "")).inc()

    # ------------------------------------------------------------ refusals before a request runs
    def _prefixed(self, method: str | None, path: str) -> Callable[[Scope, Receive, Send], Awaitable[int]] | None:
        """The handler of a route with an id in its path (any method's when `method` is None)."""
        for (m, prefix), handler in self._prefix_routes.items():
            if (method is None or m == method) and path.startswith(prefix) and len(path) > len(prefix):
                return handler
        return None

    def _authorize(self, scope: Scope, path: str) -> AuthFailure | None:
        """Check the key: None when accepted (the scope's tenant is its id), else why not."""
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        result = self.api_keys.check(header, basic=path in self._monitor_paths)
        if isinstance(result, AuthFailure):
            self.metrics.auth_failures.labels("http", result.value).inc()
            return result
        self.metrics.key_used(result, "http")
        scope[TENANT_KEY] = result
        return None

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, body: Any, *headers: Any) -> int:
        """Answer a request refused before its body was read: drop the body (bounded), answer, close."""
        declared = _content_length(scope)
        sent_body = declared != 0 and (declared is not None or _header(scope, b"transfer-encoding") is not None)
        if sent_body and not _expects_continue(scope) and (declared is None or declared <= DISCARD_LIMIT_BYTES):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.body_timeout_s):
                    await _discard(receive, DISCARD_LIMIT_BYTES)
        return await _json(send, status, body, [*headers, CLOSE])

    def _media_type_error(self, scope: Scope) -> UnsupportedMediaType | None:
        value = _header(scope, b"content-type")
        media = value.split(b";", 1)[0].strip().lower() if value is not None else b""
        if media == b"application/json":
            return None
        got = f"Content-Type {shorten(media.decode('latin-1'), 60)!r}" if media else "no Content-Type"
        return UnsupportedMediaType(
            f"request bodies must be JSON with Content-Type: application/json; this request sent {got} "
            "(curl: add -H 'Content-Type: application/json')"
        )

    # ------------------------------------------------------------ simple routes
    async def _models(self, scope: Scope, receive: Receive, send: Send) -> int:
        body = model_list([(m.name, m.created, m.context_length) for m in self.core.registry.list()])
        return await _json(send, 200, body)

    async def _model(self, scope: Scope, receive: Receive, send: Send) -> int:
        try:
            body = model_info(self.core, scope["path"].rstrip("/").removeprefix("/v1/models/"))
        except MeshError as exc:
            return await _error(send, exc)
        return await _json(send, 200, body)

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._post_json(scope, receive, send, tokenize)

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._post_json(scope, receive, send, detokenize)

    async def _tokenizer_info(self, scope: Scope, receive: Receive, send: Send) -> int:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        try:
            body = await tokenizer_info(self.core, query["model"][-1] if "model" in query else None)
        except MeshError as exc:
            return await _error(send, exc)
        return await _json(send, 200, body)

    async def _post_json(
        self, scope: Scope, receive: Receive, send: Send, run: Callable[[InferenceCore, Any], Awaitable[Any]]
    ) -> int:
        """A JSON POST answered with one JSON body (tokenize, detokenize)."""
        media_error = self._media_type_error(scope)
        if media_error is not None:
            return await self._refuse(scope, receive, send, 415, openai_error_body(media_error))
        try:
            result = await run(self.core, parse_json_body(await self._read_body(scope, receive)))
        except MeshError as exc:
            return await _error(send, exc)
        return await _json(send, 200, result)

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

    async def _dashboard_asset(self, scope: Scope, receive: Receive, send: Send) -> int:
        found = asset(scope["path"].rstrip("/"))
        assert found is not None  # only asset paths are routed here
        body, content_type = found
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return 200

    async def _dashboard_state(self, scope: Scope, receive: Receive, send: Send) -> int:
        assert self.dashboard is not None
        return await _json(send, 200, self.dashboard.state(), [(b"cache-control", b"no-store")])

    # ------------------------------------------------------------ generation routes
    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._generate(scope, receive, send, parse_chat)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._generate(scope, receive, send, parse_completion)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._generate(scope, receive, send, embeddings_api.parse_embeddings, shape=EMBEDDINGS)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> int:
        api, tenant = self.responses, _tenant(scope)

        def parse(body: Any, *, strict: bool = False) -> TextRequest:
            return api.parse(body, strict=strict, tenant=tenant)

        return await self._generate(scope, receive, send, parse, shape=(api.collect, api.events))

    async def _response_get(self, scope: Scope, receive: Receive, send: Send) -> int:
        """GET /v1/responses/{id}: a stored response of this tenant (else the 404 of an unknown id)."""
        try:
            body = self.responses.retrieve(_path_id(scope, "/v1/responses/"), _tenant(scope))
        except MeshError as exc:
            return await _error(send, exc)
        return await _json(send, 200, body)

    async def _response_delete(self, scope: Scope, receive: Receive, send: Send) -> int:
        """DELETE /v1/responses/{id}: forget a stored response of this tenant (else the 404 of an unknown id)."""
        try:
            body = self.responses.delete(_path_id(scope, "/v1/responses/"), _tenant(scope))
        except MeshError as exc:
            return await _error(send, exc)
        return await _json(send, 200, body)

    async def _generate(
        self, scope: Scope, receive: Receive, send: Send, parse: Callable[..., TextRequest], *, shape: Shape | None = None
    ) -> int:
        # The request's server span: a child of the caller's W3C traceparent, parent of the router call.
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in (b"traceparent", b"tracestate")}
        with tracer(FRONTEND_SERVICE).start_as_current_span(
            f"{scope['method']} {scope['path']}", context=extract_context(headers), kind=SpanKind.SERVER
        ) as span:
            status = await self._generate_traced(scope, receive, send, parse, shape or (collect, sse_events))
            span.set_attribute("http.response.status_code", status)
            return status

    async def _generate_traced(
        self, scope: Scope, receive: Receive, send: Send, parse: Callable[..., TextRequest], shape: Shape
    ) -> int:
        t0 = time.perf_counter()
        media_error = self._media_type_error(scope)
        if media_error is not None:
            return await self._refuse(scope, receive, send, 415, openai_error_body(media_error))
        try:
            req = parse(parse_json_body(await self._read_body(scope, receive)), strict=self.strict_params)
        except MeshError as exc:
            return await _error(send, exc)
        try:
            client_id = _client_request_id(scope, req)
        except MeshError as exc:
            return await _error(send, exc)
        extra: list[tuple[bytes, bytes]] = []
        if req.ignored:  # never silently: the client sees which of its fields had no effect
            names = ",".join(req.ignored)
            log.debug("%s %s: ignored request fields %s", scope["method"], scope["path"], names)
            extra.append((IGNORED_HEADER, shorten(names, 1000).encode("latin-1", "replace")))
        watch = _Disconnect(receive)
        completion: Completion | None = None
        try:
            completion = await self.core.begin(
                req, call=_call_info(scope), t0=t0, tenant=_tenant(scope), client_request_id=client_id
            )
            scope[MODEL_KEY] = completion.model.name  # a served model's name only: clients cannot add series
            _annotate_span(completion, client_id)
            extra.append((REQUEST_ID_HEADER, completion.id.encode("latin-1", "replace")))
            if req.stream:
                return await self._stream(send, shape[1](completion), watch, extra)
            result = await shape[0](completion)
            watch.stop()
            return await _json(send, 200, result, extra)
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

    async def _stream(
        self, send: Send, events: AsyncIterator[bytes], watch: _Disconnect, headers: list[tuple[bytes, bytes]] | None = None
    ) -> int:
        first = await anext(events)  # errors before the first event become a plain HTTP error
        await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *(headers or ())]})

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        await body(first)
        last = await write_ready(events, body)  # events ready back to back share one write (http/ready_writes.py)
        watch.stop()
        await send({"type": "http.response.body", "body": last, "more_body": False})
        return 200

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole body within `body_timeout_s` (else 408), at most `max_body_bytes` (else 413, body dropped)."""
        declared = _content_length(scope)
        if declared is None and _header(scope, b"content-length") is not None:
            raise InvalidArgument("invalid Content-Length header")
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        body: bytes | None = None
        if declared is None or declared <= self.max_body_bytes:
            try:
                async with asyncio.timeout_at(deadline):
                    body = await self._receive_body(receive)
            except TimeoutError:
                raise RequestTimeout(f"the request body did not arrive within {self.body_timeout_s:g}s") from None
            if body is not None:
                return body
        # Over the limit: read the rest and drop it (bounded), so the client gets to read the 413.
        if not _expects_continue(scope) and (declared is None or declared <= DISCARD_LIMIT_BYTES):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await _discard(receive, DISCARD_LIMIT_BYTES)
        size = f" of {declared} bytes" if declared is not None else ""
        raise BodyTooLarge(f"request body{size} is over the limit of {self.max_body_bytes} bytes")

    async def _receive_body(self, receive: Receive) -> bytes | None:
        """The body, or None as soon as it grows over the limit."""
        parts: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise InvalidArgument("the client went away while sending the body")
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
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


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k == name), None)


def _content_length(scope: Scope) -> int | None:
    """The declared body length, None when absent or not a number."""
    value = _header(scope, b"content-length")
    return int(value) if value is not None and value.strip().isdigit() else None


def _expects_continue(scope: Scope) -> bool:
    """The client waits for `100 Continue` before its body: refusing without reading it sends none."""
    value = _header(scope, b"expect")
    return value is not None and value.lower() == b"100-continue"


def _annotate_span(completion: Completion, client_id: str | None) -> None:
    """The request's ids and tenant on its server span (traces name the client's id beside the mesh's)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("meshllm.request_id", completion.internal_id)
        span.set_attribute("meshllm.tenant", completion.tenant)
        if client_id is not None:
            span.set_attribute("meshllm.client_request_id", client_id)


def _tenant(scope: Scope) -> str:
    return scope.get(TENANT_KEY, ANONYMOUS)


def _path_id(scope: Scope, prefix: str) -> str:
    return scope["path"].rstrip("/").removeprefix(prefix)


def _client_request_id(scope: Scope, req: TextRequest) -> str | None:
    """The client's own id of a request: `x-request-id`, else the body's `request_id`; never a key inside the mesh."""
    value = _header(scope, REQUEST_ID_HEADER)
    if value is None:
        return req.request_id
    text = value.decode("latin-1").strip()
    if not text or len(text) > MAX_CLIENT_ID_CHARS or not text.isprintable():
        raise InvalidArgument(f"the x-request-id header must be 1-{MAX_CLIENT_ID_CHARS} printable characters")
    return text


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
        status = _STATUS.get(type(err)) or spec_of(err).http_status
    if isinstance(err, Overloaded):
        headers.append((b"retry-after", str(max(1, round(err.retry_after_s))).encode()))
    if type(err) in _STATUS:
        headers.append(CLOSE)
    return await _json(send, status, openai_error_body(err), headers)


class HttpServer(AsyncCloseable):
    """uvicorn (httptools) serving an ASGI app on a pre-bound socket; close = graceful stop."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, reload: asyncio.Task[None] | None = None) -> None:
        self._server = server
        self._sock = sock
        self._reload = reload  # HTTPS: loads changed certificate files (plane/tls.py keep_reloaded)
        self.host, self.port = sock.getsockname()[:2]
        self.scheme = "https" if reload is not None else "http"

    @classmethod
    async def start(
        cls,
        app: OpenAIApp,
        host: str,
        port: int,
        *,
        graceful_s: float = 10.0,
        reuse_port: bool = False,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        tls: TlsConfig | None = None,
    ) -> HttpServer:
        """Serve `app` on host:port; `reuse_port` shares the port with the other processes of `--workers N`.

        `tls`: HTTPS (client certificates required when it has a CA), reloaded when its files change.

        A request's headers must arrive within `header_timeout_s`, its body within the app's `body_timeout_s`.
        """
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            from meshllm.ports import bind_error

            raise bind_error(host, port, "--http-port", exc) from None
        sock.listen(2048)
        sock.setblocking(False)
        config = uvicorn.Config(
            app,
            http=guarded_protocol(header_timeout_s=header_timeout_s, body_timeout_s=app.body_timeout_s),
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
        reload = None
        if tls is not None:
            from meshllm.plane.tls import TlsFiles, keep_reloaded, ssl_server_context

            files = TlsFiles(tls)
            config.ssl = ssl_server_context(files)
            reload = asyncio.create_task(keep_reloaded(config.ssl, files), name="https-cert-reload")
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[sock])
        return cls(server, sock, reload)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("[::1]" if self.host == "::" else self.host)
        return f"{self.scheme}://{host}:{self.port}"

    async def _aclose(self) -> None:
        if self._reload is not None:
            self._reload.cancel()
            await asyncio.gather(self._reload, return_exceptions=True)
        await self._server.shutdown(sockets=[self._sock])
