"""Disaggregated KV transfer: kv handles, the prefill side's holds, and ~1 MiB pieces.

A prefill leg ends with its prompt's sequence state (`llama_state_seq_get_data`)
held under a *kv handle* for `--kv-hold-timeout` seconds. The decode worker
pulls it once through `Worker.PullKv` (`LlamaCppEngine.pull_kv` streams the
pieces) and loads it with `llama_state_seq_set_data`. The handle names the
holding engine (a random nonce), the hold, and the prompt (token count and
hash), so a decode leg cannot load the KV of a different prompt; the KV
*layout* (model, KV types, attention kind, llama.cpp version — never the
context size) must match on both sides or the transfer is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from meshllm.engine.base import KvPull, KvTransfer
from meshllm.errors import FailedPrecondition, InvalidArgument, StreamIncomplete
from meshllm.protocol.kv import tokens_hash

__all__ = ["PIECE_BYTES", "KvHandle", "KvHolds", "check_layout", "pieces", "pull_remote"]

log = logging.getLogger("meshllm.engine.llamacpp")

PIECE_BYTES = 1 << 20
_MAGIC = b"LCKV"
_HANDLE = struct.Struct("<4sBQQIQ")  # magic, version, engine nonce, hold id, prompt tokens, prompt hash
_VERSION = 1


@dataclass(frozen=True, slots=True)
class KvHandle:
    """What a prefill leg's `disagg.kv_handle` names."""

    nonce: int
    hold_id: int
    n_tokens: int
    prompt_hash: int

    def encode(self) -> bytes:
        return _HANDLE.pack(_MAGIC, _VERSION, self.nonce, self.hold_id, self.n_tokens, self.prompt_hash)

    @classmethod
    def decode(cls, data: bytes) -> KvHandle:
        if len(data) != _HANDLE.size or data[:4] != _MAGIC:
            raise InvalidArgument("disagg.kv_handle is not a llamacpp kv handle", param="disagg")
        _, version, nonce, hold_id, n_tokens, prompt_hash = _HANDLE.unpack(data)
        if version != _VERSION:
            raise FailedPrecondition(f"kv handle version {version} is not supported (this engine speaks {_VERSION})")
        return cls(nonce, hold_id, n_tokens, prompt_hash)

    def check_prompt(self, prompt: list[int]) -> None:
        """The handle must describe exactly this prompt."""
        if self.n_tokens != len(prompt) or self.prompt_hash != tokens_hash(prompt):
            raise InvalidArgument(
                f"kv_handle covers a different prompt ({self.n_tokens} tokens) than the request ({len(prompt)} tokens)",
                param="disagg",
            )


def check_layout(theirs: str, ours: str, *, who: str) -> None:
    """Refuse KV whose layout differs from ours (FailedPrecondition, naming both)."""
    if theirs != ours:
        raise FailedPrecondition(f"KV layout mismatch: {who} has {theirs!r}, this worker {ours!r}; KV cannot move between them")


async def pull_remote(pull: KvPull, address: str, raw_handle: bytes, *, layout: str, n_tokens: int) -> bytes:
    """Pull a held KV from the prefill worker at `address` through `pull`, checking layout and length."""
    t0 = time.monotonic()
    buf = bytearray()
    total = -1
    async for chunk in pull(address, raw_handle, layout):
        if total < 0:
            check_layout(chunk.layout, layout, who=f"the prefill worker at {address}")
            total = chunk.total_bytes
        buf += chunk.data
    if len(buf) != total:
        raise StreamIncomplete(f"the KV transfer from {address} ended after {len(buf)} of {total} bytes")
    log.debug("pulled %d bytes of KV for %d tokens from %s in %.3f s", total, n_tokens, address, time.monotonic() - t0)
    return bytes(buf)


def pieces(data: bytes, *, layout: str, n_tokens: int, size: int = PIECE_BYTES) -> Iterator[KvTransfer]:
    """`data` as KvTransfer pieces of at most `size` bytes (one empty piece when `data` is empty)."""
    view = memoryview(data)
    for off in range(0, max(len(data), 1), size):
        yield KvTransfer(bytes(view[off : off + size]), len(data), layout, n_tokens)


@dataclass(slots=True)
class _Held:
    handle: KvHandle
    data: bytes
    timer: asyncio.TimerHandle


class KvHolds:
    """Prefill results waiting to be pulled once; released after `timeout_s` (event-loop side)."""

    def __init__(self, nonce: int, timeout_s: float) -> None:
        self.nonce = nonce
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._held: dict[int, _Held] = {}
        self.expired = 0
        #: Called (on the event loop) with each handle released unpulled after the timeout.
        self.on_expire: Callable[[KvHandle], None] | None = None

    def __len__(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return sum(len(h.data) for h in self._held.values())

    def hold(self, data: bytes, prompt: list[int]) -> KvHandle:
        hold_id = next(self._ids)
        handle = KvHandle(self.nonce, hold_id, len(prompt), tokens_hash(prompt))
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, hold_id)
        self._held[hold_id] = _Held(handle, data, timer)
        return handle

    def take(self, handle: KvHandle) -> bytes | None:
        """The held bytes, once; None if unknown, expired or already taken."""
        if handle.nonce != self.nonce:
            return None
        held = self._held.get(handle.hold_id)
        if held is None or held.handle != handle:
            return None
        del self._held[handle.hold_id]
        held.timer.cancel()
        return held.data

    def release(self, handle: KvHandle) -> None:
        self.take(handle)

    def _expire(self, hold_id: int) -> None:
        held = self._held.pop(hold_id, None)
        if held is None:
            return
        self.expired += 1
        log.info("released %d bytes of prefill KV nobody pulled within %.1f s", len(held.data), self.timeout_s)
        if self.on_expire is not None:
            self.on_expire(held.handle)

    def clear(self) -> None:
        for held in self._held.values():
            held.timer.cancel()
        self._held.clear()
