"""Run a traced mesh in this process and print the spans of one request as JSON lines.

Layout (disaggregated, every hop real gRPC on loopback): HTTP → frontend →
Router gRPC (the routing core of `meshllm run`) → prefill worker, then decode
worker. Spans go to OpenTelemetry's in-memory exporter; one request carries
the caller's `traceparent`. Used by tests/integration/test_tracing.py as a
subprocess, because gRPC instrumentation is process-global.
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from meshllm.frontend.config import FrontendConfig
from meshllm.frontend.main import Frontend
from meshllm.run import Mesh, RunConfig
from meshllm.testing.waiting import wait_until
from meshllm.tracing import setup_tracing, shutdown_tracing

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json", "traceparent": TRACEPARENT}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


async def main() -> None:
    exporter = InMemorySpanExporter()
    setup_tracing("meshllm-trace-test", exporter=exporter)
    cfg = RunConfig(
        workers=1,
        prefill_workers=1,
        router_port=0,
        engine="mocker",
        engine_args=("--speedup-ratio", "0"),
        frontend=FrontendConfig(http_port=0),
    )
    async with await Mesh.start(cfg) as mesh:
        assert mesh.router_address is not None
        fcfg = FrontendConfig(
            plane=cfg.plane, http_host="127.0.0.1", http_port=0, grpc=None, router_addresses=(mesh.router_address,)
        )
        async with await Frontend.start(fcfg, memory_store=mesh.store, memory_broker=mesh.broker) as front:
            assert front.registry is not None
            await front.registry.wait_for(mesh.model, timeout_s=30)
            exporter.clear()
            prompt = "tell me a long story about the sea " * 20
            body = {"model": mesh.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
            result = await asyncio.to_thread(post, f"{front.url}/v1/chat/completions", body)
            print(json.dumps({"completion_tokens": result["usage"]["completion_tokens"]}))  # type: ignore[index]
            await wait_until(
                lambda: sum(s.name == "engine.generate" for s in exporter.get_finished_spans()) >= 2,
                what="both legs' engine.generate spans to end",
            )
    for s in exporter.get_finished_spans():
        ctx, parent = s.context, s.parent
        print(
            json.dumps(
                {
                    "name": s.name,
                    "kind": s.kind.name,
                    "trace_id": f"{ctx.trace_id:032x}",
                    "span_id": f"{ctx.span_id:016x}",
                    "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
                    "attributes": dict(s.attributes or {}),
                }
            )
        )
    shutdown_tracing()


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
