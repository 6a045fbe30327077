"""Tracing without a collector (issue 16): `--otlp-endpoint console` / `OTEL_TRACES_EXPORTER=console`.

Real processes print one JSON line per span on stderr (the SDK's span JSON,
`resource.attributes["service.name"]` included). Each role names its spans:
meshllm-frontend, meshllm-worker-prefill, meshllm-worker-decode — in
`meshllm run` too, where every role shares one process. A worker started on
real etcd exports no span for its discovery calls (lease, registration,
watches) nor for control calls (GetInfo), and health canaries are no
traces either: only requests are.
"""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
from typing import Any

import pytest
from mesh_run import MeshRun, clean_env

from meshllm.plane.request.channels import ChannelCache
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.servers import EtcdServer
from meshllm.testing.waiting import wait_until
from meshllm.worker.client import WorkerClient

pytestmark = pytest.mark.integration

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def console_spans(stderr: str) -> list[dict[str, Any]]:
    """The span lines of a process's stderr (log lines are not JSON objects)."""
    spans = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            obj = json.loads(line)
            if "context" in obj and "name" in obj:
                spans.append(obj)
    return spans


def service(span: dict[str, Any]) -> str:
    return str(span["resource"]["attributes"]["service.name"])


def canaries(http_url: str) -> float:
    """Generate requests the workers accepted so far (idle: all of them health canaries), from the one /metrics."""
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("meshllm_worker_requests_total"))


def post(url: str, body: dict[str, object]) -> dict[str, Any]:
    headers = {"content-type": "application/json", "traceparent": TRACEPARENT}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


async def test_meshllm_run_prints_the_spans_of_a_request_with_a_service_name_per_role() -> None:
    engine_flags = ["--speedup-ratio", "0", "--health-check-interval", "0.05"]  # idle workers run canaries meanwhile
    with MeshRun.start("--prefill-workers", "1", "--workers", "1", "--otlp-endpoint", "console", "--", *engine_flags) as mesh:

        async def canaries_ran() -> bool:
            return await asyncio.to_thread(canaries, mesh.http_url) >= 4

        await wait_until(canaries_ran, timeout_s=20, what="the workers' health canaries to run")
        body = {"model": "mocker", "messages": [{"role": "user", "content": "tell me about the sea " * 30}], "max_tokens": 4}
        result = await asyncio.to_thread(post, f"{mesh.http_url}/v1/chat/completions", body)
        assert result["usage"]["completion_tokens"] == 4
        assert mesh.stop() == 0  # the shutdown flushes every span
        spans = console_spans(mesh.log_path.read_text())
    assert spans, "no span printed on stderr"
    ours = [s for s in spans if s["context"]["trace_id"] == f"0x{TRACE_ID}"]
    http = [s for s in ours if s["name"] == "POST /v1/chat/completions"]
    assert len(http) == 1 and service(http[0]) == "meshllm-frontend" and http[0]["kind"] == "SpanKind.SERVER"
    engine = {s["attributes"]["disagg_role"]: service(s) for s in ours if s["name"] == "engine.generate"}
    assert engine == {"context_only": "meshllm-worker-prefill", "generation_only": "meshllm-worker-decode"}
    served = {service(s) for s in ours if s["name"] == "/meshllm.v1.Worker/Generate" and s["kind"] == "SpanKind.SERVER"}
    assert served == {"meshllm-worker-prefill", "meshllm-worker-decode"}  # in-process calls too
    roots = [s["name"] for s in spans if s["parent_id"] is None]
    assert roots == [], f"spans outside the request's trace (startup, plane calls, health canaries): {roots}"


async def test_a_worker_on_etcd_traces_requests_but_not_its_discovery_or_control_calls(etcd_server: EtcdServer) -> None:
    env = clean_env(OTEL_TRACES_EXPORTER="console", MESHLLM_LOG_LEVEL="INFO")
    argv = ["worker", "--engine", "mocker", "--role", "prefill", "--discovery", "etcd", "--events", "none"]
    argv += ["--etcd-endpoints", etcd_server.endpoint, "--port", "0", "--grace-period", "0", "--speedup-ratio", "0"]
    worker = MeshllmProcess(*argv, env=env)
    try:
        address = await worker.address()
        async with ChannelCache() as channels:
            client = WorkerClient(channels, address)
            assert (await client.get_info()).instance.address == address  # a control call: never a trace
            chunks = [
                c
                async for c in client.generate({"request_id": "r1", "token_ids": list(range(10, 40)), "stop": {"max_tokens": 2}})
            ]
            assert chunks[-1].get("finish_reason")
        worker.send_signal(signal.SIGTERM)  # deregistration from etcd, then the flush
        assert await worker.wait(timeout_s=30) == 0
        stderr = worker.stderr_tail(1_000_000)
    finally:
        await worker.stop()
    assert "tracing: printing spans of meshllm-worker-prefill to stderr" in stderr
    spans = console_spans(stderr)
    names = sorted(s["name"] for s in spans)
    assert "engine.generate" in names, stderr[-3000:]
    assert {service(s) for s in spans} == {"meshllm-worker-prefill"}
    plane = [n for n in names if "etcdserverpb" in n or "GetInfo" in n or "Health" in n]
    assert plane == [], f"plane/control calls were traced: {plane}"
    generate_roots = [s for s in spans if s["parent_id"] is None]
    assert all(s["name"] == "/meshllm.v1.Worker/Generate" for s in generate_roots), names
