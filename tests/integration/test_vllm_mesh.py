"""`meshllm run --engine vllm --workers 2` (real vLLM on CPU, SmolLM2-135M) through the unmodified `openai` SDK.

- the chat answer: "Paris", with the system prompt "Answer the question in one sentence.";
- guided JSON through `response_format` parses and validates;
- `kv` routing: a repeated document (with a new question each time) goes to the worker that caches it, so every
  repeat reports the document's full blocks as cached tokens (round-robin would alternate, and miss every other time);
- after a burst, the router's index holds exactly the blocks each worker reports it holds (`Worker.GetKvSnapshot`):
  vLLM's KV events reached the router, re-hashed;
- the two workers' vLLM worker processes are pinned to disjoint CPUs (each its share, `--cpu-bind`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import pytest
import pytest_asyncio
from mesh_run import MeshRun
from openai import AsyncOpenAI
from vllm_support import require_vllm

from meshllm.plane.request.channels import ChannelCache
from meshllm.router.client import RouterClient
from meshllm.testing.waiting import wait_until
from meshllm.worker.client import WorkerClient

require_vllm()
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(420)]

SYSTEM = "Answer the question in one sentence."
DOCUMENT = " ".join(f"Section {i}: the river Arno flows through Florence and Pisa before it reaches the sea." for i in range(30))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh() -> AsyncIterator[MeshRun]:
    with MeshRun.start(
        "--engine", "vllm", "--workers", "2", "--router-mode", "kv", "--", "--max-model-len", "1024", "--max-num-seqs", "4",
        ready_timeout_s=400,
    ) as m:  # fmt: skip
        yield m


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(mesh: MeshRun) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{mesh.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


async def model_of(client: AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def test_the_chat_answer_is_paris(client: AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model=await model_of(client),
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    assert "Paris" in (r.choices[0].message.content or ""), r


async def test_guided_json_parses_and_validates(client: AsyncOpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "rank": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    for seed in range(3):
        r = await client.chat.completions.create(
            model=await model_of(client),
            messages=[{"role": "user", "content": "Name a city and rank it from 1 to 5, as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
            max_tokens=80,
            temperature=0.8,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)


async def test_kv_routing_sends_a_repeated_document_to_the_worker_that_caches_it(mesh: MeshRun, client: AsyncOpenAI) -> None:
    model = await model_of(client)
    cached = []
    for q in ("Which city is named first?", "Where does the river go?", "How many sections are there?", "Name the river."):
        r = await client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": DOCUMENT}, {"role": "user", "content": q}],
            max_tokens=4,
            temperature=0,
        )
        assert r.usage is not None and r.usage.prompt_tokens > 600, r.usage
        details = r.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details is not None else 0)
    assert cached[0] == 0 and all(c >= 512 for c in cached[1:]), cached

    # A burst of distinct prompts, then the router's index must hold what each worker holds.
    await asyncio.gather(
        *(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Story {i}: " + "once upon a time " * 60}], max_tokens=2
            )
            for i in range(6)
        )
    )
    async with ChannelCache() as channels:
        router = RouterClient(channels, mesh.router_address)

        async def agree() -> bool:
            listed = {w.worker_id: w.indexed_blocks for w in (await router.list_workers()).workers}
            for w in mesh.workers:
                snap = await WorkerClient(channels, w.address).get_kv_snapshot()
                held = sum(len(rank.block_hashes) for rank in snap.ranks)
                if listed.get(w.worker_id) != held or not held:
                    return False
            return True

        await wait_until(agree, timeout_s=20, what="the router's index to equal every worker's blocks")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # ended meanwhile
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _vllm_worker_affinities(root: int) -> list[set[int]]:
    """The CPU affinity of every vLLM worker process below `root` (below its engine-core process)."""
    tree, todo = [], [root]
    while todo:
        kids = _children(todo.pop())
        tree += kids
        todo += kids
    return [os.sched_getaffinity(p) for p in tree if Path(f"/proc/{p}/comm").read_text().startswith("VLLM::Worker")]


async def test_each_vllm_worker_pins_its_threads_to_its_own_cpus(mesh: MeshRun) -> None:
    pinned = _vllm_worker_affinities(mesh.proc.pid)
    assert len(pinned) == 2, pinned
    if len(os.sched_getaffinity(0)) < 2:  # fewer CPUs than workers: they share the one there is
        assert pinned[0] == pinned[1], pinned
    else:
        assert not pinned[0] & pinned[1], pinned
