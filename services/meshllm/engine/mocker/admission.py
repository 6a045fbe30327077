"""A request admitted to the mocker: its limits checked, its `Sequence` built."""

from __future__ import annotations

from collections.abc import Callable

from meshllm.engine.mocker.config import MockerConfig
from meshllm.engine.mocker.sequence import Sequence
from meshllm.errors import ContextLengthExceeded, InvalidArgument
from meshllm.protocol.types import TokenRequest

__all__ = ["new_sequence"]


def new_sequence(request: TokenRequest, cfg: MockerConfig, accept_handle: Callable[[bytes, list[int]], None]) -> Sequence:
    """A request's `Sequence`, its limits checked (a decode leg's handle goes to `accept_handle`)."""
    prompt = request.get("token_ids") or []
    if not prompt:
        raise InvalidArgument("token_ids must not be empty", param="token_ids")
    stop = request.get("stop") or {}
    max_tokens = stop.get("max_tokens")
    room = cfg.context_length - len(prompt)
    if max_tokens is not None and max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = len(prompt) + (max_tokens or 1)
        raise ContextLengthExceeded(
            f"prompt ({len(prompt)} tokens) + max_tokens needs {asked} tokens; context length is {cfg.context_length}",
            param="max_tokens",
        )
    min_tokens = stop.get("min_tokens") or 0
    if min_tokens < 0 or (max_tokens is not None and min_tokens > max_tokens):
        raise InvalidArgument(f"min_tokens must be in [0, max_tokens], got {min_tokens}", param="min_tokens")
    disagg = request.get("disagg") or {}
    role = disagg.get("request_type")
    first: list[int] = []
    if role == "generation_only":
        first = list(disagg.get("first_token_ids") or ())
        if not first:
            raise InvalidArgument("a generation_only request needs disagg.first_token_ids", param="disagg")
        accept_handle(disagg.get("kv_handle") or b"", prompt)
    eos = () if stop.get("ignore_eos") else (request.get("eos_token_ids") or (cfg.eos_token_id,))
    seed = request.get("sampling", {}).get("seed")
    return Sequence(
        request["request_id"],
        prompt,
        seed=0 if seed is None else seed,  # the context window makes the output depend on the prompt
        vocab_size=cfg.vocab_size,
        block_size=cfg.block_size,
        max_tokens=1 if role == "context_only" else (max_tokens or room),
        min_tokens=min_tokens,
        stop_token_ids=stop.get("stop_token_ids") or (),
        eos_token_ids=eos,
        first_token_ids=first,
        context_only=role == "context_only",
        hashing=cfg.enable_prefix_caching,
    )
