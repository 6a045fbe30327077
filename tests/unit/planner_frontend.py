"""A frontend's real metrics (`FrontendMetrics`), fed the way a request feeds them, for the planner's tests.

As frontend/openai/inference.py and frontend/http/app.py do: a TTFT observation at the first token, ITL
observations per later token, and when the request ends its e2e latency, its token counts and the requests
counter (by route and status).
"""

from __future__ import annotations

from dataclasses import dataclass

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
