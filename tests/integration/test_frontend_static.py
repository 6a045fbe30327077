"""Static mode end to end with no etcd and no NATS: a `meshllm worker --static` process behind a `meshllm frontend`
process given `--static-workers`; and each bad static flag stops the frontend with one line, exit 2, before it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio
from mesh_run import ROOT, clean_env

pytestmark = pytest.mark.integration


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshllm", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL,
        cwd=ROOT, env=clean_env(),
    )  # fmt: skip


async def _line_matching(proc: asyncio.subprocess.Process, pattern: str, timeout_s: float = 120.0) -> re.Match[str]:
    assert proc.stdout is not None
    async with asyncio.timeout(timeout_s):
        while True:
            raw = await proc.stdout.readline()
            if not raw:
                raise AssertionError(f"process exited ({await proc.wait()}) before printing {pattern!r}")
            if m := re.search(pattern, raw.decode()):
                return m


async def _stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            async with asyncio.timeout(20):
                return await proc.wait()
        except TimeoutError:
            proc.kill()
    return await proc.wait()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def frontend_url() -> AsyncIterator[str]:
    worker = await _spawn("worker", "--engine", "mocker", "--static", "--port", "0", "--speedup-ratio", "100")
    frontend = None
    try:
        address = (await _line_matching(worker, r"serving on (\S+)"))[1]
        frontend = await _spawn(
            "frontend", "--static-endpoint", "meshllm.worker.generate", "--static-workers", address,
            "--model-name", "static-model", "--http-host", "127.0.0.1", "--http-port", "0", "--grpc-port", "-1",
        )  # fmt: skip
        yield (await _line_matching(frontend, r"OpenAI HTTP API on (http://\S+)/v1"))[1]
        assert await _stop(frontend) == 0
        frontend = None
    finally:
        if frontend is not None:
            await _stop(frontend)
        await _stop(worker)


@pytest.mark.asyncio(loop_scope="module")
async def test_static_frontend_serves_chat_through_a_static_worker(frontend_url: str) -> None:
    """Locks: no discovery at all — the model card comes from the worker's GetInfo under --model-name."""
    async with openai.AsyncOpenAI(base_url=f"{frontend_url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        assert [m.id async for m in client.models.list()] == ["static-model"]
        r = await client.chat.completions.create(
            model="static-model", messages=[{"role": "user", "content": "hi"}], max_tokens=6, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens == 6
        stream = await client.completions.create(model="static-model", prompt="hi", max_tokens=4, stream=True)
        assert "".join([c.choices[0].text async for c in stream])


BAD_FLAGS = [
    (["--static-endpoint", "ns.worker", "--static-workers", "127.0.0.1:1", "--model-name", "m"], "--static-endpoint"),
    (["--static-endpoint", "ns..generate", "--static-workers", "127.0.0.1:1", "--model-name", "m"], "--static-endpoint"),
    (["--static-endpoint", "ns.worker.generate", "--static-workers", "127.0.0.1:1", "--model-name", ""], "--model-name"),
    (["--static-endpoint", "ns.worker.generate", "--static-workers", "127.0.0.1:1", "--model-name", "  "], "--model-name"),
    (["--static-endpoint", "ns.worker.generate", "--static-workers", "127.0.0.1:1"], "--model-name"),
    (
        [
            "--static-endpoint",
            "ns.worker.generate",
            "--static-workers",
            "127.0.0.1:1",
            "--model-name",
            "m",
            "--model-path",
            "/no/such/dir",
        ],
        "--model-path",
    ),
    (["--static-endpoint", "ns.worker.generate", "--static-workers", "nohostport", "--model-name", "m"], "--static-workers"),
    (["--static-workers", "127.0.0.1:1", "--model-name", "m"], "--static-endpoint"),
    (["--static-endpoint", "ns.worker.generate", "--model-name", "m"], "--static-workers"),
]


@pytest.mark.parametrize(("flags", "names"), BAD_FLAGS, ids=[f"{i}-{n}" for i, (_, n) in enumerate(BAD_FLAGS)])
def test_each_bad_static_flag_stops_startup_with_one_line(flags: list[str], names: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "meshllm", "frontend", "--http-port", "0", *flags],
        capture_output=True, text=True, cwd=ROOT, env=clean_env(), timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("meshllm frontend: error: ") and names in lines[0], lines
    assert proc.stdout == ""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.asyncio
async def test_a_static_frontend_started_before_its_worker_serves_once_the_worker_is_up() -> None:
    """Locks: no GetInfo answer at startup → the card is completed (tokenizer source) when the worker answers later."""
    port = _free_port()
    frontend = await _spawn(
        "frontend", "--static-endpoint", "meshllm.worker.generate", "--static-workers", f"127.0.0.1:{port}",
        "--model-name", "late", "--http-host", "127.0.0.1", "--http-port", "0", "--grpc-port", "-1",
    )  # fmt: skip
    worker = None
    try:
        url = (await _line_matching(frontend, r"OpenAI HTTP API on (http://\S+)/v1"))[1]
        worker = await _spawn("worker", "--engine", "mocker", "--static", "--port", str(port), "--speedup-ratio", "100")
        await _line_matching(worker, r"serving on (\S+)")
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30) as client:
            async with asyncio.timeout(60):
                while True:  # the router re-probes static workers every few seconds; the tokenizer load is retried
                    try:
                        r = await client.completions.create(model="late", prompt="hi", max_tokens=3)
                        break
                    except openai.APIStatusError as exc:
                        assert exc.status_code == 503, exc
                        await asyncio.sleep(0.5)
        assert r.choices[0].text
    finally:
        await _stop(frontend)
        if worker is not None:
            await _stop(worker)
