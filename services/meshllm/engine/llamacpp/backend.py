"""`LlamaBackend`: one GGUF model and one llama.cpp context, through llama-cpp-python's low-level API.

The context holds `n_seq_max` sequences with `kv_unified=False`: every
sequence has its own KV stream of `n_ctx` cells, so attention never mixes
batch neighbours and a sequence's tokens do not depend on who else runs.
Every method runs on the engine thread (ctypes releases the GIL during
llama.cpp calls, so the event loop keeps running meanwhile).

How llama.cpp's OpenMP threads wait (`OMP_WAIT_POLICY`) is decided before
this module is first imported: `openmp.decide`, called by the engine's start.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as L  # after openmp.decide (the engine imports this module in start)
import numpy as np

from meshllm.config import ConfigError
from meshllm.engine.llamacpp.config import LlamaCppConfig
from meshllm.engine.llamacpp.sampling import PENALTY_LAST_N, SamplingSpec
from meshllm.engine.llamacpp.scheduler import BatchEntry
from meshllm.errors import InvalidArgument, Unavailable
from meshllm.protocol.types import LogprobItem

__all__ = ["LlamaBackend", "ModelInfo", "Sampler", "model_digest"]

log = logging.getLogger("meshllm.engine.llamacpp")
_LEVELS = {3: logging.WARNING, 4: logging.ERROR}  # ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 cont


@L.llama_log_callback  # type: ignore[misc]
def _log_callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if level in _LEVELS and text:
        log.log(_LEVELS[level], "llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine reports about the loaded model."""

    n_vocab: int
    n_ctx_train: int
    chat_template: str
    eos_token_ids: tuple[int, ...]  # eos, eot when distinct
    eog_token_ids: frozenset[int]  # every id llama.cpp treats as end of generation
    bos_token_id: int | None
    kv_layout: str


class Sampler:
    """One sequence's `llama_sampler` chain; `suppressing` while a logit-bias sampler leads it."""

    __slots__ = ("chain", "suppressing")

    def __init__(self, chain: L.llama_sampler_p, suppressing: bool) -> None:
        self.chain = chain
        self.suppressing = suppressing


def model_digest(path: Path) -> str:
    """A cheap identity of a model file: SHA-256 of its size and first and last MiB (16 hex digits)."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


class LlamaBackend:
    """The model, the context and one reusable `llama_batch` (see the module docstring)."""

    def __init__(self, config: LlamaCppConfig) -> None:
        self.config = config
        self._model: L.llama_model_p | None = None
        self._ctx: L.llama_context_p | None = None
        self._batch: L.llama_batch | None = None
        # /v1/embeddings: a second context with embeddings on, made on first use (see `embed`)
        self._embed_ctx: L.llama_context_p | None = None
        self._embed_batch: L.llama_batch | None = None
        L.llama_log_set(_log_callback, ctypes.c_void_p(0))
        L.llama_backend_init()
        try:
            self._load()
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        cfg = self.config
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self._model = L.llama_model_load_from_file(str(cfg.model_path).encode(), mparams)
        if not self._model:
            raise ConfigError(f"llama.cpp cannot load the model {cfg.model_path}")
        self._vocab = L.llama_model_get_vocab(self._model)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = cfg.n_ctx * cfg.n_seq_max
        cparams.n_batch = cfg.n_batch
        cparams.n_ubatch = cfg.n_ubatch
        cparams.n_seq_max = cfg.n_seq_max
        cparams.kv_unified = False
        cparams.n_threads, cparams.n_threads_batch = cfg.n_threads, cfg.n_threads_batch
        cparams.no_perf = True
        cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._type_k, self._type_v = cparams.type_k, cparams.type_v
        self._ctx = L.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise Unavailable(f"llama.cpp cannot create a context of {cfg.n_seq_max} x {cfg.n_ctx} tokens")
        if L.llama_n_ctx_seq(self._ctx) < cfg.n_ctx:
            got = L.llama_n_ctx_seq(self._ctx)
            raise ConfigError(f"llama.cpp gave sequences {got} tokens of context, not --n-ctx {cfg.n_ctx}")
        self._mem = L.llama_get_memory(self._ctx)
        self._batch = L.llama_batch_init(cfg.n_batch, 0, 1)
        self.n_vocab = int(L.llama_vocab_n_tokens(self._vocab))

    def info(self) -> ModelInfo:
        assert self._model is not None
        raw = L.llama_model_chat_template(self._model, None)
        eos = [int(t) for t in (L.llama_vocab_eos(self._vocab), L.llama_vocab_eot(self._vocab)) if t >= 0]
        eog = frozenset(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self._vocab, t))
        bos = int(L.llama_vocab_bos(self._vocab))
        return ModelInfo(
            n_vocab=self.n_vocab,
            n_ctx_train=int(L.llama_model_n_ctx_train(self._model)),
            chat_template=raw.decode("utf-8", "replace") if raw else "",
            eos_token_ids=tuple(dict.fromkeys(eos)),
            eog_token_ids=eog,
            bos_token_id=bos if bos >= 0 else None,
            kv_layout=self.kv_layout(),
        )

    def kv_layout(self) -> str:
        """Everything a sequence state's bytes depend on except the context size."""
        assert self._model is not None
        shape = f"{L.llama_model_n_layer(self._model)}x{L.llama_model_n_head_kv(self._model)}"
        attention = "fa" if self.config.flash_attn else "vtrans"
        digest = model_digest(self.config.model_path)
        return f"llamacpp-{L.__version__}/{digest}/{shape}/k{self._type_k}v{self._type_v}/{attention}"

    def close(self) -> None:
        """Free the batches, the contexts and the model (idempotent)."""
        if self._embed_batch is not None:
            L.llama_batch_free(self._embed_batch)
            self._embed_batch = None
        if self._embed_ctx is not None:
            L.llama_free(self._embed_ctx)
            self._embed_ctx = None
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            L.llama_model_free(self._model)
            self._model = None

    # ------------------------------------------------------------ batches
    def decode(self, entries: Seq[BatchEntry]) -> int:
        batch = self._batch
        assert batch is not None
        arrays: tuple[Any, ...] = (batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits)
        tok, pos, nseq, seq, out = arrays
        for i, (token, position, slot, logits) in enumerate(entries):
            tok[i] = token
            pos[i] = position
            nseq[i] = 1
            seq[i][0] = slot
            out[i] = logits
        batch.n_tokens = len(entries)
        return int(L.llama_decode(self._ctx, batch))

    # ------------------------------------------------------------ embeddings
    def embed(self, tokens: Seq[int]) -> list[float]:
        """The L2-normalized pooled embedding of `tokens` (at most `n_ctx` of them).

        Runs on a second llama.cpp context with embeddings on, made on the first call and kept: one
        sequence of `n_ctx` cells evaluated in one ubatch (its KV and compute buffers, ~25 MB for
        SmolLM2 at n_ctx 1024). Pooling is the model's own when its GGUF names one, else the mean
        over the tokens (a generative model's usual choice, and llama-cpp-python's with MEAN).
        """
        ctx, batch = self._embedding_context()
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        arrays: tuple[Any, ...] = (batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits)
        tok, pos, nseq, seq, out = arrays
        for i, token in enumerate(tokens):
            tok[i], pos[i], nseq[i], out[i] = token, i, 1, True  # pooling reads every token's output
            seq[i][0] = 0
        batch.n_tokens = len(tokens)
        rc = int(L.llama_decode(ctx, batch))
        if rc != 0:
            raise Unavailable(f"llama_decode failed with status {rc} embedding {len(tokens)} tokens")
        ptr = L.llama_get_embeddings_seq(ctx, 0)
        if not ptr:
            raise Unavailable("llama.cpp returned no pooled embedding")
        vec = np.ctypeslib.as_array(ptr, shape=(int(L.llama_model_n_embd(self._model)),)).astype(np.float64)
        norm = float(np.linalg.norm(vec))
        return (vec / norm if norm > 0 else vec).tolist()

    def _embedding_context(self) -> tuple[L.llama_context_p, L.llama_batch]:
        if self._embed_ctx is not None and self._embed_batch is not None:
            return self._embed_ctx, self._embed_batch
        cfg = self.config
        cparams = L.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = cfg.n_ctx  # pooling needs the whole prompt in one ubatch
        cparams.n_seq_max = 1
        cparams.embeddings = True
        cparams.n_threads, cparams.n_threads_batch = cfg.n_threads, cfg.n_threads_batch
        cparams.no_perf = True
        cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = L.llama_init_from_model(self._model, cparams)
        if ctx and L.llama_pooling_type(ctx) == L.LLAMA_POOLING_TYPE_NONE:  # a generative model: mean pooling
            L.llama_free(ctx)
            cparams.pooling_type = L.LLAMA_POOLING_TYPE_MEAN
            ctx = L.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise Unavailable(f"llama.cpp cannot create an embedding context of {cfg.n_ctx} tokens")
        self._embed_ctx = ctx
        self._embed_batch = L.llama_batch_init(cfg.n_ctx, 0, 1)
        return ctx, self._embed_batch

    # ------------------------------------------------------------ sampling
    def new_sampler(self, spec: SamplingSpec, suppress: Seq[int]) -> Sampler:
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        add = L.llama_sampler_chain_add
        biases = dict(spec.logit_bias) | dict.fromkeys(suppress, float("-inf"))
        if biases:
            if (outside := max(biases)) >= self.n_vocab:  # llama.cpp would index past its logits
                L.llama_sampler_free(chain)
                raise InvalidArgument(
                    f"'logit_bias': token {outside} is not in the model's vocabulary (0..{self.n_vocab - 1})",
                    param="logit_bias",
                )
            entries = (L.llama_logit_bias * len(biases))(*[L.llama_logit_bias(t, b) for t, b in biases.items()])
            add(chain, L.llama_sampler_init_logit_bias(self.n_vocab, len(biases), entries))
        if spec.grammar:
            grammar = L.llama_sampler_init_grammar(self._vocab, spec.grammar.encode(), b"root")
            if not grammar:
                L.llama_sampler_free(chain)
                raise InvalidArgument("llama.cpp cannot parse the guided-decoding grammar", param="guided")
            add(chain, grammar)
        if spec.penalized:
            add(
                chain,
                L.llama_sampler_init_penalties(
                    self.n_vocab, PENALTY_LAST_N, spec.repetition_penalty, spec.frequency_penalty, spec.presence_penalty
                ),
            )
        if spec.greedy:
            add(chain, L.llama_sampler_init_greedy())
        else:
            if spec.top_k > 0:
                add(chain, L.llama_sampler_init_top_k(spec.top_k))
            if spec.top_p < 1.0:
                add(chain, L.llama_sampler_init_top_p(spec.top_p, 1))
            if spec.min_p > 0.0:
                add(chain, L.llama_sampler_init_min_p(spec.min_p, 1))
            add(chain, L.llama_sampler_init_temp(spec.temperature))
            add(chain, L.llama_sampler_init_dist(L.LLAMA_DEFAULT_SEED if spec.seed is None else spec.seed))
        return Sampler(chain, bool(suppress))

    def unsuppress(self, sampler: Sampler) -> None:
        if sampler.suppressing:
            L.llama_sampler_free(L.llama_sampler_chain_remove(sampler.chain, 0))
            sampler.suppressing = False

    def accept(self, sampler: Sampler, tokens: Seq[int]) -> None:
        for t in tokens:
            L.llama_sampler_accept(sampler.chain, t)

    def sample(self, sampler: Sampler, index: int) -> int:
        return int(L.llama_sampler_sample(sampler.chain, self._ctx, index))

    def logprob(self, index: int, token: int, top_n: int) -> LogprobItem:
        """Log-probability of `token` (and the `top_n` likeliest) under the raw logits of output `index`."""
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self._ctx, index), shape=(self.n_vocab,))
        peak = float(logits.max())
        lse = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
        out: LogprobItem = {"token_id": token, "logprob": float(logits[token]) - lse}
        if top_n > 0:
            best = np.argpartition(logits, -top_n)[-top_n:]
            best = best[np.argsort(logits[best])[::-1]]
            out["top"] = [(int(t), float(logits[t]) - lse) for t in best]
        return out

    def free_sampler(self, sampler: Sampler) -> None:
        L.llama_sampler_free(sampler.chain)

    # ------------------------------------------------------------ sequences
    def seq_rm(self, slot: int, p0: int, p1: int) -> bool:
        return bool(L.llama_memory_seq_rm(self._mem, slot, p0, p1))

    def seq_cp(self, src: int, dst: int) -> None:
        L.llama_memory_seq_cp(self._mem, src, dst, -1, -1)

    def pos_max(self, slot: int) -> int:
        return int(L.llama_memory_seq_pos_max(self._mem, slot))

    def state_get(self, slot: int) -> bytes:
        size = L.llama_state_seq_get_size(self._ctx, slot)
        buf = (ctypes.c_uint8 * size)()
        written = L.llama_state_seq_get_data(self._ctx, buf, size, slot)
        return ctypes.string_at(buf, written)

    def state_set(self, slot: int, data: bytes) -> int:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return int(L.llama_state_seq_set_data(self._ctx, buf, len(data), slot))
