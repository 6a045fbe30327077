"""`--no-coalesce` / `MESHLLM_NO_COALESCE=1`: every engine step of every stream travels as its own chunk.

A mocker at `--speedup-ratio 0` steps as fast as its event loop turns, far faster than the 2 ms session interval,
so with coalescing on the tokens of a stream merge on the way (the control below checks they do). With it off
in every process (worker, router, and this test's own session client), each chunk that reaches the caller holds
the one token of one engine step:

- a `meshllm worker` and a `meshllm router` process (static mode, sessions over gRPC), the variable set;
- `meshllm run --no-coalesce` (the in-process plane), through the Router gRPC service it serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from mesh_run import MeshRun

from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.chunks import coalescing, set_coalescing
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.router.client import RouterClient
from meshllm.testing.processes import MeshllmProcess
from meshllm.testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOKENS = 48
STREAMS = 4
FAST = ["--speedup-ratio", "0", "--block-size", "16"]


@pytest.fixture
def no_coalesce_here() -> Iterator[None]:
    """This process (the test's session client) merges nothing either, as every process of such a mesh."""
    before = coalescing()
    set_coalescing(False)
    try:
        yield
    finally:
        set_coalescing(before)


def request(i: int) -> TokenRequest:
    prompt = [(i * 7919 + k * 104729) % 30000 + 3 for k in range(40)]
    return {"request_id": f"nc{i}", "model": "mocker", "token_ids": prompt, "stop": {"max_tokens": TOKENS, "ignore_eos": True}}


async def chunk_sizes(router_address: str) -> list[list[int]]:
    """Token count of every chunk of STREAMS concurrent streams through the router, each stream checked whole."""
    async with ChannelCache() as channels:
        client = RouterClient(channels, router_address)

        async def one(i: int) -> list[int]:
            chunks: list[TokenChunk] = [c async for c in client.generate(request(i))]
            assert chunks[-1].get("finish_reason") == "length", chunks[-1]
            assert sum(len(c.get("token_ids", ())) for c in chunks) == TOKENS
            return [len(c.get("token_ids", ())) for c in chunks]

        return await asyncio.gather(*(one(i) for i in range(STREAMS)))


async def split_mesh(env: dict[str, str]) -> AsyncIterator[str]:
    worker = MeshllmProcess("worker", "--engine", "mocker", "--static", "--port", "0", *FAST, env=env)
    router = None
    try:
        address = await worker.address()
        router = MeshllmProcess(
            "router",
            "--port",
            "0",
            "--static-endpoint",
            "meshllm.worker.generate",
            "--static-workers",
            address,
            "--model-name",
            "mocker",
            env=env,
        )
        address = await router.address()
        async with ChannelCache() as channels:
            client = RouterClient(channels, address)

            async def listed() -> bool:
                return len((await client.list_workers("mocker")).workers) == 1

            await wait_until(listed, timeout_s=30, what="the static router to see its worker")
        yield address
    finally:
        if router is not None:
            await router.stop()
        await worker.stop()


async def test_with_the_variable_set_worker_and_router_processes_send_one_chunk_per_engine_step(
    no_coalesce_here: None,
) -> None:
    async for address in split_mesh({"MESHLLM_NO_COALESCE": "1"}):
        sizes = await chunk_sizes(address)
    assert all(n <= 1 for stream in sizes for n in stream), sizes
    assert all(len(stream) >= TOKENS for stream in sizes), sizes  # one chunk per token (a terminal may hold none)


async def test_control_by_default_the_same_fast_engine_has_its_tokens_merged() -> None:
    """The check above could fail: with coalescing on (the default), the same mesh merges some chunks."""
    async for address in split_mesh({"MESHLLM_NO_COALESCE": "0"}):
        sizes = await chunk_sizes(address)
    assert any(n > 1 for stream in sizes for n in stream), sizes


async def test_meshllm_run_no_coalesce_sends_one_chunk_per_engine_step_in_process(no_coalesce_here: None) -> None:
    with MeshRun.start("--workers", "1", "--no-coalesce", "--", *FAST) as mesh:
        sizes = await chunk_sizes(mesh.router_address)
    assert all(n <= 1 for stream in sizes for n in stream), sizes
    assert all(len(stream) >= TOKENS for stream in sizes), sizes
