"""The models a frontend serves, following ModelCards in discovery, each with its tokenizer and chat template.

A model is listed while at least one live instance publishes its card. Its
tokenizer comes from the card's `tokenizer_source`:

    builtin:NAME   the built-in tokenizer (no files)
    a path         `load_tokenizer(path)` (HF directory or .gguf file)
    worker:ID      the files fetched from that worker with `Worker.GetModelFiles`,
                   verified against the card's checksum, cached on disk

`--model-path` overrides the source (for `--model-name`'s model, or for every
model when no name is given). Loading happens in the background when a model
first appears; `get()` waits for it and raises the load error, if any, as
`Unavailable`. Blocking work (file reads, hashing, tokenizer construction)
runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path

from meshllm.errors import InvalidArgument, MeshError, NotFound, Unavailable
from meshllm.frontend.openai.capabilities import Capabilities, combine
from meshllm.frontend.text.chat_template import ChatTemplate
from meshllm.frontend.text.tokenizer import Tokenizer, load_tokenizer
from meshllm.lifecycle import AsyncCloseable
from meshllm.plane.discovery.base import Discovery
from meshllm.plane.request.channels import ChannelCache
from meshllm.v1 import discovery_pb2
from meshllm.worker.client import WorkerClient

__all__ = ["ModelRegistry", "ServedModel", "files_checksum"]

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 300.0
RETRY_AFTER_S = 5.0  # a failed tokenizer load is retried by the first request after this long


def files_checksum(files: dict[str, bytes]) -> str:
    """SHA-256 over sorted name + NUL + bytes: the ModelCard checksum of GetModelFiles' files."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name])
    return h.hexdigest()


@dataclass(slots=True)
class Tokenization:
    """A loaded tokenizer with the chat template and eos ids a model uses."""

    tokenizer: Tokenizer
    template: ChatTemplate | None
    eos_token_ids: tuple[int, ...]


@dataclass(slots=True, eq=False)
class ServedModel:
    """One model name as served now: its cards, instance count and tokenization."""

    name: str
    card: discovery_pb2.ModelCard
    instances: int
    created: int
    source: str
    _loaded: asyncio.Future[Tokenization] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    failed_at: float | None = None  # monotonic time of the last failed load (a later request retries)
    capabilities: Capabilities = field(default_factory=Capabilities)  # over every live card (frontend/openai/capabilities.py)

    @property
    def context_length(self) -> int:
        return int(self.card.context_length)

    @property
    def ready(self) -> bool:
        return self._loaded.done() and self._loaded.exception() is None

    async def tokenization(self) -> Tokenization:
        """The loaded tokenizer; raises Unavailable when loading failed or takes too long."""
        if self._loaded.done():
            return self._loaded.result()
        try:
            return await asyncio.wait_for(asyncio.shield(self._loaded), LOAD_TIMEOUT_S)
        except TimeoutError:
            raise Unavailable(f"the tokenizer of {self.name!r} is still loading") from None


def _source_key(card: discovery_pb2.ModelCard, source: str) -> tuple[str, str, str]:
    return source, card.checksum, card.chat_template


@dataclass(eq=False)
class ModelRegistry(AsyncCloseable):
    """ModelCards from discovery → served models with tokenizers (see the module docstring)."""

    discovery: Discovery
    channels: ChannelCache
    _: KW_ONLY
    model_path: str | None = None
    model_name: str | None = None
    cache_dir: Path | None = None
    _models: dict[str, ServedModel] = field(init=False, default_factory=dict)
    _loads: dict[tuple[str, str, str], asyncio.Task[Tokenization]] = field(init=False, default_factory=dict)
    _task: asyncio.Task[None] | None = field(init=False, default=None)
    _first: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    _changed: asyncio.Condition = field(init=False, default_factory=asyncio.Condition)

    async def start(self) -> ModelRegistry:
        self._task = asyncio.create_task(self._watch(), name="model-registry-watch")
        await self._first.wait()
        return self

    # ------------------------------------------------------------ queries
    def list(self) -> list[ServedModel]:
        """Models with at least one live instance, by name."""
        return [m for _, m in sorted(self._models.items())]

    def lookup(self, name: str) -> ServedModel:
        model = self._models.get(name)
        if model is None:
            raise NotFound(f"The model '{name}' does not exist", param="model")
        return model

    async def tokenization(self, model: ServedModel) -> Tokenization:
        """The model's tokenizer; a load that failed a while ago (worker not up yet, files moved) is retried once."""
        if model.failed_at is not None and time.monotonic() - model.failed_at > RETRY_AFTER_S:
            model.failed_at = None
            model._loaded = asyncio.get_running_loop().create_future()
            self._loads.pop(_source_key(model.card, model.source), None)
            self._load_into(model)
        return await model.tokenization()

    async def engines(self, name: str) -> set[str]:
        """The engine names live instances serving `name` publish ("" where they name none, as in static mode)."""
        return {i.metadata.get("engine", "") for i in (await self.discovery.list_instances()).values() if i.model == name}

    async def wait_for(self, name: str, *, timeout_s: float) -> ServedModel:
        """Wait until `name` is served (tests, `meshllm run` startup)."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: name in self._models)
        return self._models[name]

    # ------------------------------------------------------------ watching
    async def _watch(self) -> None:
        try:
            async for snapshot in self.discovery.watch_models():
                await self._apply(snapshot)
                self._first.set()
        except Exception:
            log.exception("model discovery watch failed")
        finally:
            self._first.set()

    async def _apply(self, snapshot: dict[str, discovery_pb2.ModelCard]) -> None:
        by_name: dict[str, list[discovery_pb2.ModelCard]] = {}
        for card in snapshot.values():
            by_name.setdefault(card.name, []).append(card)
        models: dict[str, ServedModel] = {}
        for name, cards in by_name.items():
            cards.sort(key=lambda c: c.instance_id)
            card = cards[0]
            source = self._source_for(card)
            old = self._models.get(name)
            if old is not None and _source_key(old.card, old.source) == _source_key(card, source):
                old.card, old.instances = card, len(cards)
                models[name] = old
                continue
            model = ServedModel(name=name, card=card, instances=len(cards), created=int(time.time()), source=source)
            if old is not None:
                model.created = old.created
            self._load_into(model)
            models[name] = model
        for name, cards in by_name.items():
            models[name].capabilities = combine(cards)
        for name in self._models.keys() - models.keys():
            log.info("model %s is no longer served", name)
        for name in models.keys() - self._models.keys():
            log.info("model %s is served (%d instance(s))", name, models[name].instances)
        self._models = models
        async with self._changed:
            self._changed.notify_all()

    def _source_for(self, card: discovery_pb2.ModelCard) -> str:
        if self.model_path and (self.model_name is None or self.model_name == card.name):
            return self.model_path
        return card.tokenizer_source

    def _load_into(self, model: ServedModel) -> None:
        key = _source_key(model.card, model.source)
        task = self._loads.get(key)
        if task is None or (task.done() and task.exception() is not None):
            task = asyncio.create_task(self._load(model.card, model.source), name=f"load-tokenizer-{model.name}")
            self._loads[key] = task

        def done(t: asyncio.Task[Tokenization]) -> None:
            if model._loaded.done():
                return
            if t.cancelled():
                model._loaded.set_exception(Unavailable(f"loading the tokenizer of {model.name!r} was cancelled"))
                model._loaded.exception()  # retrieved: a shutdown cancels loads nobody waits for
            elif (exc := t.exception()) is not None:
                model._loaded.set_exception(exc)
                model._loaded.exception()  # retrieved: requests report it, the loop need not
                model.failed_at = time.monotonic()
            else:
                model._loaded.set_result(t.result())

        task.add_done_callback(done)

    # ------------------------------------------------------------ loading
    async def _load(self, card: discovery_pb2.ModelCard, source: str) -> Tokenization:
        try:
            if not source:  # e.g. static mode whose workers did not answer GetInfo at startup: ask them now
                card, source = await self._card_from_workers(card)
            if not source:
                raise InvalidArgument(f"model {card.name!r} names no tokenizer source and no --model-path was given")
            if source.startswith("worker:"):
                directory = await self._fetch(card, source.removeprefix("worker:"))
                tok = await asyncio.to_thread(load_tokenizer, str(directory), cache_dir=self.cache_dir)
            else:
                tok = await asyncio.to_thread(load_tokenizer, source, cache_dir=self.cache_dir)
            pieces = getattr(tok, "byte_pieces", None)
            if pieces is not None:  # the streaming detokenizer's table, built here rather than on the first request
                await asyncio.to_thread(pieces, skip_special_tokens=True)
            text = card.chat_template or tok.chat_template
            template = ChatTemplate(text, bos_token=tok.bos_token, eos_token=tok.eos_token) if text else None
            eos = tuple(card.eos_token_ids) or tuple(tok.eos_token_ids)
            log.info("model %s: tokenizer %s (vocab %d), eos %s", card.name, tok.name, tok.vocab_size, list(eos))
            return Tokenization(tok, template, eos)
        except MeshError as exc:
            log.error("model %s: cannot load its tokenizer: %s", card.name, exc.message)
            raise Unavailable(f"cannot load the tokenizer of {card.name!r}: {exc.message}") from None
        except Exception as exc:
            log.exception("model %s: cannot load its tokenizer", card.name)
            raise Unavailable(f"cannot load the tokenizer of {card.name!r}: {type(exc).__name__}: {exc}") from None

    async def _card_from_workers(self, card: discovery_pb2.ModelCard) -> tuple[discovery_pb2.ModelCard, str]:
        """The card a live worker of the model publishes in GetInfo (its tokenizer source), or ("", card)."""
        for inst in (await self.discovery.list_instances()).values():
            if inst.model != card.name:
                continue
            try:
                info = await WorkerClient(self.channels, inst.address).get_info(timeout_s=5.0)
            except MeshError:
                continue
            found = discovery_pb2.ModelCard()
            found.CopyFrom(info.model_card)
            found.name = card.name
            if found.tokenizer_source.startswith("worker:"):
                found.tokenizer_source = f"worker:{inst.id}"
            return found, found.tokenizer_source
        return card, ""

    def _files_dir(self, checksum: str) -> Path:
        from meshllm.frontend.text.tokenizer import default_cache_dir

        base = self.cache_dir if self.cache_dir is not None else default_cache_dir()
        return base / "worker-files" / checksum

    async def _fetch(self, card: discovery_pb2.ModelCard, instance_id: str) -> Path:
        """Fetch the model files from a worker (once per checksum) and verify them."""
        if not card.checksum:
            raise InvalidArgument(f"model card of {card.name!r} has no checksum for its worker files")
        directory = self._files_dir(card.checksum)
        if await asyncio.to_thread((directory / ".verified").exists):
            return directory
        instances = await self.discovery.list_instances()
        inst = instances.get(instance_id)
        if inst is None:
            inst = next((i for i in instances.values() if i.model == card.name), None)
        if inst is None:
            raise Unavailable(f"worker {instance_id!r} that serves the files of {card.name!r} is not in discovery")
        files = await WorkerClient(self.channels, inst.address).get_model_files()
        got = await asyncio.to_thread(files_checksum, files)
        if got != card.checksum:
            raise InvalidArgument(
                f"model files from {inst.address} do not match the card's checksum ({got[:12]} != {card.checksum[:12]})"
            )
        await asyncio.to_thread(_store, directory, files)
        log.info("model %s: fetched %d file(s) from worker %s", card.name, len(files), inst.id)
        return directory

    async def _aclose(self) -> None:
        tasks = [t for t in (self._task, *self._loads.values()) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


def _store(directory: Path, files: dict[str, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        target = (directory / name).resolve()
        if directory.resolve() not in target.parents:
            raise InvalidArgument(f"worker file name {name!r} escapes the cache directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(target.suffix + ".part")
        tmp.write_bytes(data)
        tmp.replace(target)
    (directory / ".verified").touch()
