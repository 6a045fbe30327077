"""The clients in clients/ run unchanged against a live `meshllm run` mesh (issue 8).

Locks: the OpenAI SDK example streams text over HTTP; the typed Python gRPC
example streams a chat through Inference.ChatCompletion and gets a Router.Route
decision naming one of the mesh's workers; the Node example does the same
with stubs that @grpc/proto-loader builds from protos/ after a real
`npm ci` of the committed package-lock.json.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mesh_run import ROOT, MeshRun, clean_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENTS = ROOT / "clients"
RUN_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def mesh() -> Iterator[MeshRun]:
    # Two aggregated mocker workers: Route has two candidates to choose between.
    with MeshRun.start("--workers", "2", "--", "--speedup-ratio", "10") as m:
        yield m


def run_client(argv: list[str], *, cwd: Path = ROOT, timeout_s: float = RUN_TIMEOUT_S) -> str:
    """Run a client to completion; its stdout (fails with both streams on a non-zero exit)."""
    done = subprocess.run(argv, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{argv[:2]} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


def streamed_text(out: str) -> str:
    m = re.search(r"^text: (.*)$", out, re.MULTILINE)
    assert m is not None, out
    return m[1]


def routed_worker(out: str) -> str:
    m = re.search(r"^route: worker_id=(\S*) ", out, re.MULTILINE)
    assert m is not None, out
    return m[1]


def test_openai_sdk_example_streams_a_chat_over_http(mesh: MeshRun) -> None:
    out = run_client([sys.executable, str(CLIENTS / "python" / "openai_example.py"), "--base-url", f"{mesh.http_url}/v1",
                      "--max-tokens", "8"])  # fmt: skip
    assert streamed_text(out).strip(), out
    assert re.search(r"^finish_reason: (length|stop) prompt_tokens=\d+ completion_tokens=\d+$", out, re.MULTILINE), out


def test_python_grpc_example_streams_through_inference_and_routes_to_a_mesh_worker(mesh: MeshRun) -> None:
    out = run_client([sys.executable, str(CLIENTS / "python" / "grpc_example.py"), "--inference", mesh.inference_address,
                      "--router", mesh.router_address, "--max-tokens", "8"])  # fmt: skip
    assert streamed_text(out).strip(), out
    assert "finish_reason: FINISH_REASON_" in out
    assert routed_worker(out) in {w.worker_id for w in mesh.workers}, out
    assert out.count("  candidate ") == len(mesh.workers), out
    assert out.count("\nworker: ") == len(mesh.workers), out


def test_python_grpc_example_offers_a_tool_and_reports_a_refusal_in_one_line(mesh: MeshRun) -> None:
    """Locks: --weather-tool with auto streams as usual; forcing it on the mocker (no guided decoding) is one clear line."""
    base = [sys.executable, str(CLIENTS / "python" / "grpc_example.py"), "--inference", mesh.inference_address,
            "--router", "", "--max-tokens", "8", "--weather-tool"]  # fmt: skip
    out = run_client(base)
    assert "finish_reason: FINISH_REASON_" in out and "route:" not in out, out
    done = subprocess.run([*base, "--tool-choice", "required"], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("grpc_example: INVALID_ARGUMENT: 'tool_choice': 'required' needs guided decoding"), done.stderr
    assert "the mocker engine" in last, done.stderr


@pytest.fixture(scope="module")
def node_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """clients/node copied beside a copy of protos/ (the example's ../../protos), installed with `npm ci`."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    npm = shutil.which("npm")
    assert npm is not None, "node is installed but npm is not"
    root = tmp_path_factory.mktemp("node-client")
    shutil.copytree(ROOT / "protos", root / "protos", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    app = root / "clients" / "node"
    shutil.copytree(CLIENTS / "node", app, ignore=shutil.ignore_patterns("node_modules"))
    done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=app, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"
    return app


def test_node_example_streams_through_inference_and_routes_to_a_mesh_worker(mesh: MeshRun, node_client: Path) -> None:
    node = shutil.which("node")
    assert node is not None
    out = run_client([node, "example.js", "--inference", mesh.inference_address, "--router", mesh.router_address,
                      "--max-tokens", "8"], cwd=node_client)  # fmt: skip
    assert streamed_text(out).strip(), out
    finish = r"^finish_reason: FINISH_REASON_(LENGTH|STOP|EOS) prompt_tokens=\d+ completion_tokens=\d+$"
    assert re.search(finish, out, re.MULTILINE), out
    assert routed_worker(out) in {w.worker_id for w in mesh.workers}, out
    assert out.count("  candidate ") == len(mesh.workers), out
    assert out.count("\nworker: ") == len(mesh.workers), out


def test_node_example_sends_the_weather_tool_through_the_generated_stubs(mesh: MeshRun, node_client: Path) -> None:
    """Locks: the proto-loader stubs carry tools / tool_choice; forcing the tool on the mocker is one clear line."""
    node = shutil.which("node")
    assert node is not None
    base = [node, "example.js", "--inference", mesh.inference_address, "--router", mesh.router_address,
            "--max-tokens", "8", "--weather-tool"]  # fmt: skip
    out = run_client(base, cwd=node_client)
    assert re.search(r"^finish_reason: FINISH_REASON_(LENGTH|STOP|EOS) ", out, re.MULTILINE), out
    done = subprocess.run(
        [*base, "--tool-choice", "get_weather"], cwd=node_client, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "needs guided decoding" in done.stderr and "mocker engine" in done.stderr, done
