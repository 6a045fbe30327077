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
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from opentelemetry.trace import SpanKind

from meshllm.errors import (
    InvalidArgument,
    MeshError,
    Unknown,
    log_unexpected,
    openai_error_body,
    shorten,
)
from meshllm.frontend.http.asgi import (
    Disconnect,
    Receive,
    Scope,
    Send,
    error_response,
    json_response,
    media_type_error,
    read_body,
    refuse,
)
from meshllm.frontend.http.auth import ApiKeys, AuthFailure, unauthorized_body
from meshllm.frontend.http.dashboard import ASSETS, Dashboard, asset
from meshllm.frontend.http.ready_writes import write_ready
from meshllm.frontend.http.request_ids import (
    REQUEST_ID_HEADER,
    TENANT_KEY,
    annotate_span,
    call_info,
    client_request_id,
    path_id,
    tenant_of,
)
from meshllm.frontend.http.sse_direct import DirectSse, direct_eligible
from meshllm.frontend.openai import embeddings_api
from meshllm.frontend.openai.bodies import collect, sse_events
from meshllm.frontend.openai.inference import Completion, InferenceCore
from meshllm.frontend.openai.responses_api import ResponsesApi
from meshllm.frontend.openai.tokenize_api import detokenize, model_info, tokenize, tokenizer_info
from meshllm.protocol.openai import TextRequest, model_list, parse_chat, parse_completion, parse_json_body
from meshllm.tracing import FRONTEND_SERVICE, extract_context, tracer

__all__ = ["OpenAIApp"]

log = logging.getLogger(__name__)

# How a completion becomes a response body: (whole JSON body, SSE events); chat/completions' or the Responses API's.
Shape = tuple[Callable[[Completion], Awaitable[Any]], Callable[[Completion], AsyncIterator[bytes]]]
EMBEDDINGS: Shape = (embeddings_api.collect, embeddings_api.events)

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
IGNORED_HEADER = b"x-meshllm-ignored-params"  # request fields that had no effect, comma-separated
WWW_AUTHENTICATE = (b"www-authenticate", b'Bearer realm="meshllm"')
BROWSER_LOGIN = (b"www-authenticate", b'Basic realm="meshllm", charset="UTF-8"')  # the dashboard page: a login prompt
DEFAULT_BODY_TIMEOUT_S = 30.0
MODEL_KEY = "meshllm.model"  # scope key: the model a request named, for the request counter


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
                status = await refuse(scope, receive, send, 401, unauthorized_body(refused), login, timeout_s=self.body_timeout_s)
            elif handler is None:
                if path in self._paths or self._prefixed(None, path) is not None:
                    status = await error_response(send, InvalidArgument(f"method {method} is not allowed on {path}"), status=405)
                else:
                    status = await error_response(send, _not_found(path), status=404)
            else:
                status = await handler(scope, receive, send)
        except Exception as exc:  # never a traceback to a user
            log_unexpected(log, f"unhandled error on {method} {shorten(path)}", exc)
            status = await error_response(send, Unknown(f"internal error: {type(exc).__name__}"))
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

    # ------------------------------------------------------------ simple routes
    async def _models(self, scope: Scope, receive: Receive, send: Send) -> int:
        body = model_list([(m.name, m.created, m.context_length) for m in self.core.registry.list()])
        return await json_response(send, 200, body)

    async def _model(self, scope: Scope, receive: Receive, send: Send) -> int:
        try:
            body = model_info(self.core, scope["path"].rstrip("/").removeprefix("/v1/models/"))
        except MeshError as exc:
            return await error_response(send, exc)
        return await json_response(send, 200, body)

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._post_json(scope, receive, send, tokenize)

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._post_json(scope, receive, send, detokenize)

    async def _tokenizer_info(self, scope: Scope, receive: Receive, send: Send) -> int:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        try:
            body = await tokenizer_info(self.core, query["model"][-1] if "model" in query else None)
        except MeshError as exc:
            return await error_response(send, exc)
        return await json_response(send, 200, body)

    async def _post_json(
        self, scope: Scope, receive: Receive, send: Send, run: Callable[[InferenceCore, Any], Awaitable[Any]]
    ) -> int:
        """A JSON POST answered with one JSON body (tokenize, detokenize)."""
        media_error = media_type_error(scope)
        if media_error is not None:
            return await refuse(scope, receive, send, 415, openai_error_body(media_error), timeout_s=self.body_timeout_s)
        try:
            result = await run(self.core, await self._json_body(scope, receive))
        except MeshError as exc:
            return await error_response(send, exc)
        return await json_response(send, 200, result)

    async def _json_body(self, scope: Scope, receive: Receive) -> Any:
        """The request's body as JSON: 408, 413 or 400 (as MeshErrors) when it is late, too large or not JSON."""
        return parse_json_body(await read_body(scope, receive, max_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s))

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> int:
        models = [m.name for m in self.core.registry.list()]
        ok = self.core.admitting and bool(models)
        body = {"status": "healthy" if ok else "unhealthy", "models": models, "inflight": self.core.inflight}
        return await json_response(send, 200 if ok else 503, body)

    async def _live(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await json_response(send, 200, {"status": "live"})

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
        return await json_response(send, 200, self.dashboard.state(), [(b"cache-control", b"no-store")])

    # ------------------------------------------------------------ generation routes
    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._generate(scope, receive, send, parse_chat)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._generate(scope, receive, send, parse_completion)

    async def _embeddings(self, scope: Scope, receive: Receive, send: Send) -> int:
        return await self._generate(scope, receive, send, embeddings_api.parse_embeddings, shape=EMBEDDINGS)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> int:
        api, tenant = self.responses, tenant_of(scope)

        def parse(body: Any, *, strict: bool = False) -> TextRequest:
            return api.parse(body, strict=strict, tenant=tenant)

        return await self._generate(scope, receive, send, parse, shape=(api.collect, api.events))

    async def _response_get(self, scope: Scope, receive: Receive, send: Send) -> int:
        """GET /v1/responses/{id}: a stored response of this tenant (else the 404 of an unknown id)."""
        return await self._stored_response(scope, send, self.responses.retrieve)

    async def _response_delete(self, scope: Scope, receive: Receive, send: Send) -> int:
        """DELETE /v1/responses/{id}: forget a stored response of this tenant (else the 404 of an unknown id)."""
        return await self._stored_response(scope, send, self.responses.delete)

    async def _stored_response(self, scope: Scope, send: Send, action: Callable[[str, str], dict[str, Any]]) -> int:
        """`action(id, tenant)` on the stored response the path names: its body, or its MeshError, as the reply."""
        try:
            body = action(path_id(scope, "/v1/responses/"), tenant_of(scope))
        except MeshError as exc:
            return await error_response(send, exc)
        return await json_response(send, 200, body)

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
        media_error = media_type_error(scope)
        if media_error is not None:
            return await refuse(scope, receive, send, 415, openai_error_body(media_error), timeout_s=self.body_timeout_s)
        try:
            req = parse(await self._json_body(scope, receive), strict=self.strict_params)
            client_id = client_request_id(scope, req)
        except MeshError as exc:
            return await error_response(send, exc)
        extra: list[tuple[bytes, bytes]] = []
        if req.ignored:  # never silently: the client sees which of its fields had no effect
            names = ",".join(req.ignored)
            log.debug("%s %s: ignored request fields %s", scope["method"], scope["path"], names)
            extra.append((IGNORED_HEADER, shorten(names, 1000).encode("latin-1", "replace")))
        watch = Disconnect(receive)
        completion: Completion | None = None
        try:
            completion = await self.core.begin(
                req, call=call_info(scope), t0=t0, tenant=tenant_of(scope), client_request_id=client_id
            )
            scope[MODEL_KEY] = completion.model.name  # a served model's name only: clients cannot add series
            annotate_span(completion, client_id)
            extra.append((REQUEST_ID_HEADER, completion.id.encode("latin-1", "replace")))
            if req.stream:
                direct = DirectSse(send, completion) if shape[1] is sse_events and direct_eligible(req, completion) else None
                if direct is not None:
                    completion.direct = direct.take
                return await self._stream(send, shape[1](completion), watch, extra, direct)
            result = await shape[0](completion)
            watch.stop()
            return await json_response(send, 200, result, extra)
        except MeshError as exc:
            watch.stop()
            return await error_response(send, exc)
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
        self,
        send: Send,
        events: AsyncIterator[bytes],
        watch: Disconnect,
        headers: list[tuple[bytes, bytes]] | None = None,
        direct: DirectSse | None = None,
    ) -> int:
        first = await anext(events)  # errors before the first event become a plain HTTP error
        await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *(headers or ())]})

        async def body(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        write = body if direct is None else direct.write
        try:
            await write(first)
            if direct is not None:
                direct.live = True  # plain content events may now be written where their tokens arrive
            last = await write_ready(events, write)  # events ready back to back share one write (http/ready_writes.py)
            if direct is not None:
                direct.live = False
                await direct.settle()
        finally:
            if direct is not None:
                direct.close()
        watch.stop()
        await send({"type": "http.response.body", "body": last, "more_body": False})
        return 200


def _not_found(path: str) -> MeshError:
    from meshllm.errors import NotFound

    return NotFound(f"no route {path}")
