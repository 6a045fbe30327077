"""A frontend's real metrics (`FrontendMetrics`), fed the way a request feeds them, for the planner's tests.

As frontend/openai/inference.py and frontend/http/app.py do: a TTFT observation at the first token, ITL
observations per later token, and when the request ends its e2e latency, its token counts and the requests
counter (by route and status).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import generate_latest

from meshllm.frontend.metrics import FrontendMetrics, ObservationBatch
from meshllm.served_counts import Counts, read_counts

ROUTE = "/v1/chat/completions"


@dataclass
class Request:
    isl: int
    osl: int
    ttft_s: float = 0.03
    itl_s: float = 0.004


class Frontend:
    """A FrontendMetrics fed as the frontend feeds it."""

    def __init__(self) -> None:
        self.metrics = FrontendMetrics()
        self.model = self.metrics.for_model("m")

    def start(self, r: Request) -> Request:
        """The first token went out (the request is streaming)."""
        self.model.ttft.observe(r.ttft_s)
        return r

    def finish(self, r: Request) -> None:
        """The rest of its tokens went out (one ITL each), then it ended: e2e, tokens, the requests counter."""
        itl = ObservationBatch(self.model.itl)
        itl.observe(r.itl_s, r.osl - 1)
        itl.flush()
        self.model.e2e.observe(r.ttft_s + r.itl_s * (r.osl - 1))
        self.model.input_tokens.inc(r.isl)
        self.model.output_tokens.inc(r.osl)
        self.metrics.requests.labels(ROUTE, "200", "m").inc()

    def serve(self, r: Request) -> None:
        self.finish(self.start(r))

    def refuse(self, status: str = "429") -> None:
        """A request turned away before any work (overloaded, a bad body): counted, but no tokens, no e2e."""
        self.metrics.requests.labels(ROUTE, status, "").inc()

    def read(self, at: float) -> Counts:
        return read_counts(self.metrics.registry.collect(), at)


class MetricsServer:
    """A real HTTP server answering GET /metrics with a registry's text; `api_key` demands a bearer key, `fail`
    answers 503, `hold` (when cleared) keeps a request waiting until it is set."""

    def __init__(self, fe: Frontend, api_key: str | None = None, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.fe = fe
        self.api_key = api_key
        self.fail = False
        self.hold = threading.Event()
        self.hold.set()
        self.received = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.received.set()
                outer.hold.wait(20)
                if outer.api_key is not None and self.headers.get("Authorization") != f"Bearer {outer.api_key}":
                    self._answer(401, b"unauthorized")
                elif outer.fail or self.path != "/metrics":
                    self._answer(503 if outer.fail else 404, b"no")
                else:
                    self._answer(200, generate_latest(outer.fe.metrics.registry))

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # type: ignore[method-assign]
        self.port = int(self.server.server_address[1])
        self.url = f"http://{host}:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()
