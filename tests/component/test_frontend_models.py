"""Tokenizers per model from the ModelCard: fetched from a worker (GetModelFiles) and checked against the card's
checksum, a local --model-path override, and a clear 503 when loading fails."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
from frontend_support import PLANE, EchoEngine, request, start_mesh, wait_until
from tokenizers import Tokenizer, models, pre_tokenizers

from meshllm.engine.base import EngineConfig
from meshllm.engine.worker_config import WorkerConfig
from meshllm.worker.runtime import Worker

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "ECHO:", "a", "b"]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def make_model_dir(root: Path) -> Path:
    """A tiny HF model directory: a WordLevel tokenizer.json, tokenizer_config.json with a chat template."""
    root.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}))
    return root


class FilesEngine(EchoEngine):
    """An echo engine whose tokenizer lives in files it serves with GetModelFiles (card source worker:<id>)."""

    def __init__(self, model: str, directory: Path) -> None:
        super().__init__(model)
        self.directory = directory
        self.last_prompt: list[int] = []

    async def start(self, worker_id: str) -> EngineConfig:
        return EngineConfig(model=self.model, context_length=64, eos_token_ids=(2,))

    def model_files(self) -> Mapping[str, Path]:
        return {p.name: p for p in self.directory.iterdir()}

    def generate(self, request, context):  # type: ignore[no-untyped-def]
        self.last_prompt = list(request["token_ids"])
        return self._words(request)

    async def _words(self, request):  # type: ignore[no-untyped-def]
        yield {"token_ids": [3]}
        yield {"token_ids": [4]}
        yield {
            "token_ids": [2],
            "finish_reason": "eos",
            "usage": {"prompt_tokens": 1, "completion_tokens": 3, "cached_tokens": 0},
        }


async def test_a_tokenizer_fetched_from_a_worker_is_verified_and_used(tmp_path: Path) -> None:
    """Locks: card source worker:<id> → GetModelFiles → checksum ok → the model's own tokenizer and template."""
    mesh = await start_mesh(workers=0, tokenizer_cache_dir=tmp_path / "cache")
    engine = FilesEngine("files", make_model_dir(tmp_path / "model"))
    try:
        worker = await Worker.start(
            engine,
            WorkerConfig(engine="files", plane=PLANE, grace_period_s=0.0),
            memory_store=mesh.store,
            memory_broker=mesh.broker,
        )
        mesh.workers.append(worker)
        assert worker.model_card is not None and worker.model_card.tokenizer_source == f"worker:{worker.id}"
        assert mesh.frontend.registry is not None
        await mesh.frontend.registry.wait_for("files", timeout_s=30)
        r = await request(
            mesh.url, "/v1/chat/completions", {"model": "files", "messages": [{"role": "user", "content": "hello world"}]}
        )
        assert r.status == 200, r.body
        assert r.json()["choices"][0]["message"]["content"].split() == ["hello", "world"]  # </s> is special: skipped
        assert engine.last_prompt == [3, 4]  # the template rendered "hello world " and WordLevel tokenized it
        cached = list((tmp_path / "cache" / "worker-files").iterdir())
        assert len(cached) == 1 and cached[0].name == worker.model_card.checksum
    finally:
        await mesh.aclose()


async def test_files_that_do_not_match_the_checksum_are_refused_with_503(tmp_path: Path) -> None:
    mesh = await start_mesh(workers=0, tokenizer_cache_dir=tmp_path / "cache")
    directory = make_model_dir(tmp_path / "model")
    engine = FilesEngine("tampered", directory)
    try:
        worker = await Worker.start(
            engine,
            WorkerConfig(engine="files", plane=PLANE, grace_period_s=0.0),
            memory_store=mesh.store,
            memory_broker=mesh.broker,
        )
        mesh.workers.append(worker)
        (directory / "tokenizer_config.json").write_text("{}")  # the files change after the card's checksum was taken
        registry = mesh.frontend.registry
        assert registry is not None
        await registry.wait_for("tampered", timeout_s=30)
        r = await request(mesh.url, "/v1/completions", {"model": "tampered", "prompt": "hello"})
        assert r.status == 503 and "checksum" in r.json()["error"]["message"]
    finally:
        await mesh.aclose()


@pytest.mark.parametrize("use_override", [True, False])
async def test_model_path_overrides_the_card_tokenizer(tmp_path: Path, use_override: bool) -> None:
    """Locks: --model-path replaces the card's builtin tokenizer (WordLevel ids instead of bytes)."""
    directory = make_model_dir(tmp_path / "model")
    mesh = await start_mesh(workers=1, model_path=str(directory) if use_override else None)
    try:
        await request(mesh.url, "/v1/completions", {"model": "echo", "prompt": "hello world", "max_tokens": 1})
        engine = mesh.engines[0]
        await wait_until(lambda: bool(engine.requests))
        prompt = engine.requests[-1]["token_ids"]
        # completions add the tokenizer's special tokens: the builtin one prepends bos (1); this WordLevel one adds none
        assert prompt == ([3, 4] if use_override else [1, *(b + 3 for b in b"hello world")])
    finally:
        await mesh.aclose()


async def test_loading_a_tokenizer_builds_its_streaming_table_before_any_request(tmp_path: Path) -> None:
    """Locks: the registry builds the detokenizer's byte table (tokenizers/bytelevel.py) when it loads a tokenizer, in
    its loading thread, so the first streamed request does not pay for it (here a WordLevel tokenizer: no table)."""
    directory = make_model_dir(tmp_path / "model")
    mesh = await start_mesh(workers=1, model_path=str(directory))
    try:
        registry = mesh.frontend.registry
        assert registry is not None
        await registry.wait_for("echo", timeout_s=30)
        tk = await registry.tokenization(registry.lookup("echo"))
        assert tk.tokenizer._byte_tables == {True: None}  # type: ignore[attr-defined]
    finally:
        await mesh.aclose()
