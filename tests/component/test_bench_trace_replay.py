"""`meshllm bench --trace` against `meshllm run` in-process (mocker workers, memory planes, real HTTP and gRPC).

Locks: ten rows of a Mooncake-shaped trace replayed open loop and closed
loop all complete, each with the prompt length the trace scaled to and the
output length it asked for; the endpoint's cached-token counts come back per
request and match the prefix the trace repeats (one worker: the second of
two rows sharing hash ids finds their blocks in its cache); the CLI prints
the scaling line and the table; a dead endpoint stops the run with a clear
message instead of waiting out the trace.
"""

from __future__ import annotations

import asyncio
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import pytest_asyncio

from meshllm.bench.http import Endpoint
from meshllm.bench.main import run_trace
from meshllm.bench.replay import ReplayMode
from meshllm.bench.trace import TraceScale, load_trace
from meshllm.frontend.config import FrontendConfig
from meshllm.run import Mesh, RunConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK = 16  # the mocker's KV block = the tokens each hash id becomes, so a hash id is one cached block
SCALE = TraceScale(tokens_per_block=BLOCK, speedup=50.0, max_osl=12)


def trace_rows() -> list[dict[str, object]]:
    """Ten rows in the trace's shape: a shared first block, conversations that grow, arrivals over 2 s."""
    rows: list[dict[str, object]] = []
    for i in range(10):
        convo = i % 3  # three conversations; each turn repeats the previous turn's blocks and adds two
        turn = i // 3
        ids = [0] + [100 * (convo + 1) + k for k in range(2 + 2 * turn)]
        rows.append({"timestamp": 200 * i, "input_length": 512 * len(ids) - 100, "output_length": 5 + i, "hash_ids": ids})
    return rows


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in trace_rows()))
    return path


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    engine = ("--block-size", str(BLOCK), "--speedup-ratio", "20", "--num-gpu-blocks", "4096")
    m = await Mesh.start(
        RunConfig(workers=1, engine_args=engine, frontend=FrontendConfig(http_port=0, router_mode="kv")),
    )
    yield m
    await m.aclose()


def url(mesh: Mesh) -> str:
    assert mesh.frontend is not None
    return mesh.frontend.url


@pytest.mark.parametrize(("mode", "concurrency"), [(ReplayMode.OPEN, 1), (ReplayMode.CLOSED, 3)])
async def test_every_request_completes_with_the_trace_lengths(
    mesh: Mesh, trace_file: Path, mode: ReplayMode, concurrency: int
) -> None:
    requests = load_trace(trace_file, SCALE)
    assert len(requests) == 10
    result = await run_trace(
        Endpoint.parse(url(mesh)), mesh.model, requests, mode=mode, concurrency=concurrency, deadline_s=120, progress=False
    )
    assert result.stopped is None
    for req, rec in zip(requests, result.records, strict=True):
        assert rec.error is None, rec.error
        assert rec.prompt_tokens == len(req.prompt_token_ids)
        assert rec.completion_tokens == req.max_tokens
        assert rec.ttft is not None and rec.cached_tokens is not None
    summary = result.summary()
    assert summary.requests == 10 and summary.errors == 0
    assert summary.mean_osl == sum(r.max_tokens for r in requests) / 10


async def test_cached_tokens_come_back_for_the_prefix_the_trace_repeats(mesh: Mesh, tmp_path: Path) -> None:
    """One worker, sequential: a row repeating another's first three hash ids finds exactly those blocks cached."""
    rows = [
        {"timestamp": 0, "input_length": 5 * 512, "output_length": 3, "hash_ids": [7000, 7001, 7002, 7003, 7004]},
        {"timestamp": 1, "input_length": 4 * 512, "output_length": 3, "hash_ids": [7000, 7001, 7002, 7100]},
    ]
    path = tmp_path / "repeat.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    requests = load_trace(path, SCALE)
    result = await run_trace(Endpoint.parse(url(mesh)), mesh.model, requests, mode=ReplayMode.CLOSED, progress=False)
    first, second = result.records
    assert first.error is None and second.error is None
    assert first.cached_tokens == 0
    assert second.cached_tokens == 3 * BLOCK
    assert result.hit_rate == pytest.approx(3 * BLOCK / (9 * BLOCK))


async def test_a_dead_endpoint_stops_the_run_with_a_clear_message(trace_file: Path) -> None:
    requests = load_trace(trace_file, TraceScale(tokens_per_block=BLOCK, speedup=0.01))  # arrivals hours apart
    result = await run_trace(Endpoint.parse("http://127.0.0.1:9"), "mocker", requests, deadline_s=60, progress=False)
    assert result.stopped is not None and result.stopped.startswith("the first request to end failed: HttpError")
    assert "cannot connect to 127.0.0.1:9" in result.stopped
    assert result.duration_s < 60, "a dead endpoint must not wait out the trace or the deadline"


async def test_the_cli_prints_the_scaling_line_and_the_table(mesh: Mesh, trace_file: Path) -> None:
    """`meshllm bench --trace ...` in its own process, as a user runs it."""
    argv = ["-m", "meshllm", "bench", "--url", url(mesh), "--model", mesh.model, "--trace", str(trace_file), "--quiet"]
    argv += ["--trace-speedup", "50", "--trace-max-osl", "4", "--trace-mode", "closed", "--concurrency", "1,2"]
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv, stdout=PIPE, stderr=PIPE)
    out_b, err_b = await asyncio.wait_for(proc.communicate(), timeout=120)
    out = out_b.decode()
    assert proc.returncode == 0, (out, err_b.decode())
    assert "scaled trace: 1 hash id = 16 tokens (trace: 512), arrivals 50× faster" in out
    assert "trace.jsonl: 10 requests" in out and "prefix-reuse ceiling" in out
    assert "| TTFT p50 ms |" in out and "c=1: closed loop, 1 user;" in out and "c=2: closed loop, 2 users" in out
    assert "prefix-cache hit rate" in out and "not reported" not in out
