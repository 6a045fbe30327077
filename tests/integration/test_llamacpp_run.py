"""`meshllm run --engine llamacpp` in its own process, used through the OpenAI SDK and the Router gRPC API.

The frontend has no model file: it fetches the tokenizer and chat template
from a worker (GetModelFiles). Two workers share one KV-aware router fed by
the llamacpp engine's real KV events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from test_llamacpp_support import SYSTEM, chat_tokens, require_model

from meshllm.engine.llamacpp.openmp import ENV as OMP_ENV
from meshllm.plane.request.channels import ChannelCache
from meshllm.router.client import RouterClient
from meshllm.testing.processes import MeshllmProcess

require_model()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


class Mesh:
    def __init__(self, proc: MeshllmProcess, lines: list[str]) -> None:
        self.proc = proc
        self.url = next(line.split()[3] for line in lines if line.startswith("OpenAI HTTP API"))
        self.router = next(line.split()[2] for line in lines if line.startswith("Router gRPC"))
        self.workers = [line.split()[2] for line in lines if line.startswith("worker ")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    proc = MeshllmProcess(
        "run", "--engine", "llamacpp", "--workers", "2", "--http-port", "0", "--router-port", "0",
        "--", "--n-ctx", "1024", "--n-seq-max", "4",
        env={OMP_ENV: ""},  # the suite's own PASSIVE (tests/conftest.py) would decide instead of --omp-wait auto
    )  # fmt: skip
    try:
        lines: list[str] = []
        while not (lines and lines[-1].startswith("try:")):
            lines.append(await proc.line(180))
        yield Mesh(proc, lines)
    finally:
        await proc.stop()


async def test_the_openai_sdk_gets_paris_for_the_capital_of_france(mesh: Mesh) -> None:
    """Locks: greedy chat through meshllm run (SmolLM2 chat template, tokenizer fetched from a worker) answers Paris."""
    async with AsyncOpenAI(base_url=mesh.url, api_key="unused", max_retries=0) as client:
        models = await client.models.list()
        model = models.data[0].id
        reply = await client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=24,
        )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop"


async def test_a_repeated_system_prompt_is_routed_to_the_worker_that_caches_it(mesh: Mesh) -> None:
    """Locks: KV events of a real model reach the router: Route shows the overlap on the worker that served
    the system prompt, chooses it, and the next request there reports those tokens cached."""
    system = "You are a museum guide. " + " ".join(f"Fact {i}: the museum opened wing {i} in year {1900 + i}." for i in range(10))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "When did wing 3 open?"}]
    channels = ChannelCache()
    try:
        async with AsyncOpenAI(base_url=mesh.url, api_key="unused", max_retries=0) as client:
            model = (await client.models.list()).data[0].id
            await client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=4)  # type: ignore[arg-type]
            follow_up = [messages[0], {"role": "user", "content": "When did wing 7 open?"}]
            decision = await RouterClient(channels, mesh.router).route(model, chat_tokens(follow_up))
            overlaps = {c.worker_id: c.overlap_blocks for c in decision.candidates}
            assert len(overlaps) == 2
            assert overlaps[decision.worker_id] >= 100 // 16 and sorted(overlaps.values())[0] == 0
            reply = await client.chat.completions.create(model=model, messages=follow_up, temperature=0, max_tokens=4)  # type: ignore[arg-type]
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        assert (reply.usage.prompt_tokens_details.cached_tokens or 0) >= 16 * overlaps[decision.worker_id]
    finally:
        await channels.aclose()


async def test_two_engines_in_one_process_make_llamacpp_threads_sleep_at_barriers(mesh: Mesh) -> None:
    """Locks: `--omp-wait auto` with two engines whose threads (each: every CPU for prompts) overfill the CPUs picks
    passive waiting, logged once per engine."""
    log = mesh.proc.stderr_tail(1_000_000)
    assert log.count("(OpenMP passive)") == 2, log[-3000:]


async def test_one_engine_whose_threads_fit_the_cpus_spins() -> None:
    """Locks: a lone worker with the default threads (decode half, prompts every CPU) keeps OpenMP's spinning
    default, as llama.cpp's own servers run (docs/engines/llamacpp.md, "Threads")."""
    proc = MeshllmProcess("worker", "--engine", "llamacpp", "--static", "--port", "0", env={OMP_ENV: ""})
    try:
        await proc.address(120)
        log = proc.stderr_tail(1_000_000)
        assert "(OpenMP spin)" in log, log[-3000:]
    finally:
        await proc.stop()
