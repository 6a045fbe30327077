"""KV block hashing shared by every engine and the router.

A prompt is cut into full blocks of `block_size` tokens (a trailing partial
block is never hashed). Each block's *tokens hash* is XXH3-64 (seed 1337) over
its token ids as little-endian u32. Its *block hash* chains the previous
block's hash with its tokens hash, so equal block hashes mean equal prefixes:

    block_hash[0] = tokens_hash[0]
    block_hash[i] = XXH3-64(le_u64(block_hash[i-1]) || le_u64(tokens_hash[i]), seed 1337)
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

from meshllm.protocol.types import KvSourceInfo

__all__ = [
    "PREFIX_MAGIC",
    "SEED",
    "block_hashes",
    "chain_hash",
    "kv_source_prefix",
    "parse_prefix_handle",
    "prefix_handle",
    "stored_blocks",
    "tokens_hash",
]

SEED = 1337
_PAIR = struct.Struct("<QQ")
_xxh3 = xxhash.xxh3_64_intdigest
_BIG_ENDIAN = sys.byteorder == "big"


def _le_u32(tokens: Sequence[int]) -> bytes:
    arr = array("I", tokens)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def tokens_hash(tokens: Sequence[int]) -> int:
    """XXH3-64 (seed 1337) of one block's token ids as little-endian u32."""
    return _xxh3(_le_u32(tokens), SEED)


def chain_hash(parent_hash: int | None, block_tokens_hash: int) -> int:
    """The block hash of a block whose parent has `parent_hash` (None for the first)."""
    if parent_hash is None:
        return block_tokens_hash
    return _xxh3(_PAIR.pack(parent_hash, block_tokens_hash), SEED)


def stored_blocks(tokens: Sequence[int], block_size: int, *, parent_hash: int | None = None) -> list[tuple[int, int]]:
    """(block_hash, tokens_hash) of every full block of `tokens`, in order."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(tokens) // block_size
    if n_full == 0:
        return []
    raw = _le_u32(tokens[: n_full * block_size])
    step = block_size * 4
    out: list[tuple[int, int]] = []
    parent = parent_hash
    for i in range(n_full):
        th = _xxh3(raw[i * step : (i + 1) * step], SEED)
        bh = th if parent is None else _xxh3(_PAIR.pack(parent, th), SEED)
        out.append((bh, th))
        parent = bh
    return out


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained block hash of every full block of `tokens`, in order."""
    return [bh for bh, _ in stored_blocks(tokens, block_size)]


#: First bytes of a prefix handle (`prefix_handle`).
PREFIX_MAGIC = b"MLKVPFX1"
_U32 = struct.Struct("<I")


def prefix_handle(block_size: int, hashes: Sequence[int]) -> bytes:
    """A `Worker.PullKv` handle naming a prompt prefix by its block hashes (`DisaggParams.kv_source`).

    Layout: `PREFIX_MAGIC`, `block_size` as little-endian u32, then each
    block hash as little-endian u64, first block first. Unlike the
    engine-defined handle of a finished prefill leg, any engine can resolve
    it against the blocks it keeps in any tier.
    """
    if block_size <= 0 or not hashes:
        raise ValueError("a prefix handle needs a positive block size and at least one block hash")
    return PREFIX_MAGIC + _U32.pack(block_size) + struct.pack(f"<{len(hashes)}Q", *hashes)


def parse_prefix_handle(handle: bytes) -> tuple[int, list[int]] | None:
    """`(block_size, block_hashes)` of a prefix handle; None for any other handle (or a malformed one)."""
    head = len(PREFIX_MAGIC) + _U32.size
    if not handle.startswith(PREFIX_MAGIC) or len(handle) <= head or (len(handle) - head) % 8:
        return None
    (block_size,) = _U32.unpack_from(handle, len(PREFIX_MAGIC))
    if block_size <= 0:
        return None
    return block_size, list(struct.unpack_from(f"<{(len(handle) - head) // 8}Q", handle, head))


def kv_source_prefix(source: KvSourceInfo) -> tuple[str, bytes, int, list[int]]:
    """`(address, handle, block_size, block_hashes)` of a `disagg.kv_source`; InvalidArgument when it names none."""
    from meshllm.errors import InvalidArgument

    address, handle = source.get("address", ""), source.get("kv_handle", b"")
    parsed = parse_prefix_handle(handle)
    if not address or parsed is None:
        raise InvalidArgument("disagg.kv_source needs an address and a prefix handle", param="disagg.kv_source")
    return address, handle, parsed[0], parsed[1]
