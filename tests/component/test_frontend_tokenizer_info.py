"""vLLM's tokenizer endpoints as lm-evaluation-harness's `remote` tokenizer backend calls them: no "model" in
/tokenize and /detokenize, and GET /tokenizer_info; echo workers on memory planes, real gRPC and HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from frontend_support import Mesh, request, start_mesh

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def mesh() -> AsyncIterator[Mesh]:
    m = await start_mesh(workers=1)
    yield m
    await m.aclose()


async def test_tokenizer_info_names_the_models_tokens_and_template(mesh: Mesh) -> None:
    for path in ("/tokenizer_info", "/v1/tokenizer_info", "/tokenizer_info?model=echo"):
        r = await request(mesh.url, path, None, method="GET")
        assert r.status == 200, (path, r.body)
        info = r.json()
        assert info["model"] == "echo" and info["model_max_length"] == 512
        assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["pad_token"] is None
        assert "<|im_start|>" in info["chat_template"] and info["tokenizer_class"]
    missing = await request(mesh.url, "/tokenizer_info?model=nope", None, method="GET")
    assert missing.status == 404 and missing.json()["error"]["param"] == "model"


async def test_tokenize_and_detokenize_without_a_model_use_the_only_one(mesh: Mesh) -> None:
    """Locks: lm_eval's RemoteTokenizer calls (no "model") answer as with the model named."""
    named = (await request(mesh.url, "/tokenize", {"model": "echo", "prompt": "hé", "add_special_tokens": False})).json()
    r = await request(mesh.url, "/tokenize", {"prompt": "hé", "add_special_tokens": False})
    assert r.status == 200 and r.json()["tokens"] == named["tokens"] and len(named["tokens"]) == 3
    back = await request(mesh.url, "/detokenize", {"tokens": named["tokens"]})
    assert back.status == 200 and back.json()["prompt"] == "hé"
    for body in ({"model": "", "prompt": "x"}, {"model": 3, "prompt": "x"}):
        bad = await request(mesh.url, "/tokenize", body)
        assert bad.status == 400 and bad.json()["error"]["param"] == "model"


async def test_several_models_need_a_model_named() -> None:
    m = await start_mesh(workers=1)
    try:
        await m.add_worker("other")
        assert m.frontend.registry is not None
        await m.frontend.registry.wait_for("other", timeout_s=30)
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [70]})):
            r = await request(m.url, path, body)
            assert r.status == 400, r.body
            err = r.json()["error"]
            assert err["param"] == "model"
            assert err["message"] == "'model' is required: this mesh serves several models (echo, other)"
        info = await request(m.url, "/tokenizer_info", None, method="GET")
        assert info.status == 400 and info.json()["error"]["param"] == "model"
        other = await request(m.url, "/tokenizer_info?model=other", None, method="GET")
        assert other.status == 200 and other.json()["model"] == "other"
    finally:
        await m.aclose()


async def test_no_model_served_yet_is_503() -> None:
    m = await start_mesh(workers=0)
    try:
        r = await request(m.url, "/tokenize", {"prompt": "x"})
        assert r.status == 503 and "no model is served yet" in r.json()["error"]["message"]
    finally:
        await m.aclose()
