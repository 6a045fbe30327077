"""`meshllm run` as a user runs it: one line per server and a curl command, serving, a clean stop; bad flags → one line.

Uses the subprocess helper of tests/integration/mesh_run.py (SIGTERM = the ordered shutdown).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from mesh_run import ROOT, MeshRun, clean_env

pytestmark = pytest.mark.integration


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        data: dict[str, object] = json.loads(resp.read())
        return data


def test_meshllm_run_prints_its_servers_serves_and_stops_cleanly() -> None:
    """Locks: HTTP, Inference gRPC, router and every worker get a line; the mesh answers; SIGTERM exits 0."""
    with MeshRun.start("--workers", "3", "--", "--speedup-ratio", "100", "--num-gpu-blocks", "512") as mesh:
        assert mesh.http_url.startswith("http://127.0.0.1:")
        assert mesh.inference_address and mesh.router_address
        assert [w.role for w in mesh.workers] == ["agg", "agg", "agg"]
        assert len({w.address for w in mesh.workers}) == 3
        body = _post(
            f"{mesh.http_url}/v1/chat/completions",
            {"model": "mocker", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
        )
        assert body["object"] == "chat.completion"
        with urllib.request.urlopen(f"{mesh.http_url}/health", timeout=30) as resp:
            assert json.loads(resp.read())["status"] == "healthy"
        code = mesh.stop()
    assert code == 0


def test_meshllm_run_disaggregated_layout_has_prefill_and_decode_workers() -> None:
    with MeshRun.start("--workers", "1", "--prefill-workers", "1", "--", "--speedup-ratio", "100") as mesh:
        assert sorted(w.role for w in mesh.workers) == ["decode", "prefill"]
        body = _post(f"{mesh.http_url}/v1/completions", {"model": "mocker", "prompt": "hello " * 40, "max_tokens": 4})
        assert body["object"] == "text_completion"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--workers", "0"], "--workers"),
        (["--engine", "nosuchengine"], "--engine"),
        (["--model-path", "/no/such/model"], "--model-path"),
        (["--http-port", "70000"], "--http-port"),
    ],
)
def test_bad_run_flags_stop_with_one_line(args: list[str], needle: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "meshllm", "run", *args],
        capture_output=True, text=True, cwd=ROOT, env=clean_env(), timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
