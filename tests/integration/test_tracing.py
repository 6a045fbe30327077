"""Tracing end to end: one HTTP request yields one trace spanning frontend → router → workers.

The mesh runs in a subprocess (tests/integration/trace_mesh.py) because gRPC
instrumentation is process-global; spans come from OpenTelemetry's in-memory
exporter there, printed as JSON.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


REQUEST_SPANS = {"POST /v1/chat/completions", "/meshllm.v1.Router/Generate", "/meshllm.v1.Worker/Generate", "engine.generate"}


@pytest.fixture(scope="module")
def spans() -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, str(HERE / "trace_mesh.py")], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["completion_tokens"] == 8
    return lines[1:]


def ancestors(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> list[str]:
    names = []
    while span["parent_id"] in by_id:
        span = by_id[span["parent_id"]]
        names.append(span["name"])
    return names


async def test_one_request_is_one_trace_from_the_callers_traceparent(spans: list[dict[str, Any]]) -> None:
    """Locks: W3C traceparent from the HTTP request is the trace of every hop."""
    await asyncio.sleep(0)
    request_spans = [s for s in spans if s["name"] in REQUEST_SPANS]
    assert {s["name"] for s in request_spans} == REQUEST_SPANS
    assert {s["trace_id"] for s in request_spans} == {TRACE_ID}  # background calls (KV resyncs) are traces of their own
    http = [s for s in spans if s["name"] == "POST /v1/chat/completions"]
    assert len(http) == 1 and http[0]["parent_id"] == CALLER_SPAN and http[0]["kind"] == "SERVER"


async def test_the_trace_spans_frontend_router_prefill_and_decode_workers(spans: list[dict[str, Any]]) -> None:
    """Locks: engine.generate of both legs descends from the worker server span, the router, and the HTTP span."""
    by_id = {s["span_id"]: s for s in spans}
    names = {(s["name"], s["kind"]) for s in spans}
    assert ("/meshllm.v1.Router/Generate", "CLIENT") in names and ("/meshllm.v1.Router/Generate", "SERVER") in names
    engine = [s for s in spans if s["name"] == "engine.generate"]
    roles = sorted(s["attributes"]["disagg_role"] for s in engine)
    assert roles == ["context_only", "generation_only"]
    for s in engine:
        chain = ancestors(s, by_id)
        assert chain[0] == "/meshllm.v1.Worker/Generate", chain
        assert "/meshllm.v1.Router/Generate" in chain and chain[-1] == "POST /v1/chat/completions", chain


async def test_engine_span_carries_the_request_attributes(spans: list[dict[str, Any]]) -> None:
    decode = next(s for s in spans if s["name"] == "engine.generate" and s["attributes"]["disagg_role"] == "generation_only")
    attrs = decode["attributes"]
    assert attrs["model"] and attrs["input_tokens"] > 100
    assert attrs["output_tokens"] >= 1 and attrs["finish_reason"] == "length" and attrs["ttft_ms"] >= 0
