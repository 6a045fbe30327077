"""`POST /v1/embeddings` on an engine that does not embed (the echo engine), and its request validation.

The embeddings themselves are checked on llama.cpp against llama-cpp-python
(tests/integration/test_llamacpp_openai_depth.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import pytest_asyncio
from frontend_support import Mesh, request, start_mesh

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=1, max_inflight=16)
    yield m
    await m.aclose()


async def test_an_engine_that_does_not_embed_is_a_clear_400(mesh: Mesh) -> None:
    """Locks: the SDK gets BadRequestError naming the model; the engine (its card says it cannot embed) saw nothing."""
    seen = len(mesh.engines[0].requests)
    async with openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0, timeout=20) as client:
        with pytest.raises(openai.BadRequestError, match="does not compute embeddings"):
            await client.embeddings.create(model="echo", input=["ECHO:abc", "ECHO:def"])
    assert len(mesh.engines[0].requests) == seen


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "model": ""}, "model"),
        ({"input": "x", "model": "nope"}, "model"),
    ],
)
async def test_bad_embeddings_requests_name_the_field(mesh: Mesh, body: dict[str, Any], param: str) -> None:
    r = await request(mesh.url, "/v1/embeddings", {"model": "echo", **body})
    assert r.status in (400, 404) and r.json()["error"]["param"] == param, r.body
