"""The mocker's KV handle: what a prefill leg's `disagg.kv_handle` bytes say.

Layout (little-endian): magic `MKV1`, u32 block size, u32 prompt tokens, u64
engine nonce, u64 hold id, then one u64 chained block hash per full prompt
block (`meshllm.protocol.kv`). The nonce and hold id let a decode leg on the
same engine end the hold early; any other engine only checks the shape.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from meshllm.errors import InvalidArgument

__all__ = ["KvHandle", "decode_kv_handle", "encode_kv_handle"]

_MAGIC = b"MKV1"
_HEADER = struct.Struct("<4sIIQQ")


class KvHandle(NamedTuple):
    """What a prefill leg's `kv_handle` says: the prompt's blocks and who holds them."""

    block_size: int
    prompt_tokens: int
    engine_nonce: int
    hold_id: int
    block_hashes: tuple[int, ...]


def encode_kv_handle(handle: KvHandle) -> bytes:
    """Pack a handle: a fixed header, then the full blocks' hashes as little-endian u64."""
    head = _HEADER.pack(_MAGIC, handle.block_size, handle.prompt_tokens, handle.engine_nonce, handle.hold_id)
    return head + struct.pack(f"<{len(handle.block_hashes)}Q", *handle.block_hashes)


def decode_kv_handle(data: bytes) -> KvHandle:
    """Unpack a handle; `InvalidArgument` when it is not a mocker handle."""
    rest = len(data) - _HEADER.size
    if rest < 0 or rest % 8 or data[:4] != _MAGIC:
        raise InvalidArgument("disagg.kv_handle is not a mocker-v1 KV handle", param="disagg.kv_handle")
    _, block_size, prompt_tokens, nonce, hold_id = _HEADER.unpack_from(data)
    hashes = struct.unpack_from(f"<{rest // 8}Q", data, _HEADER.size)
    return KvHandle(block_size, prompt_tokens, nonce, hold_id, hashes)
