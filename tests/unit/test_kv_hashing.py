"""meshllm.protocol.kv: the block hashing shared by engines and routers."""

import struct

import pytest
import xxhash

from meshllm.protocol import kv


def test_tokens_hash_is_xxh3_over_little_endian_u32_with_seed_1337() -> None:
    """Locks: the documented hash, so other implementations can match it byte for byte."""
    tokens = [1, 2, 3, 65536]
    raw = struct.pack("<4I", *tokens)
    assert kv.tokens_hash(tokens) == xxhash.xxh3_64_intdigest(raw, seed=1337)


def test_block_hashes_chain_parents_and_ignore_the_partial_tail() -> None:
    """Locks: equal block hashes mean equal prefixes; partial blocks are never hashed."""
    a = list(range(10))
    b = list(range(8)) + [99, 98]
    ha, hb = kv.block_hashes(a, 4), kv.block_hashes(b, 4)
    assert len(ha) == 2 and ha == hb  # the 2-token tails differ but are partial
    assert ha[0] == kv.tokens_hash(a[:4])
    assert ha[1] == kv.chain_hash(ha[0], kv.tokens_hash(a[4:8]))
    c = [7, 1, 2, 3] + list(range(4, 8))  # same second block, different first block
    assert kv.block_hashes(c, 4)[1] != ha[1]


def test_stored_blocks_continue_from_a_parent() -> None:
    """Locks: hashing a suffix with parent_hash gives the same hashes as hashing the whole prompt."""
    tokens = list(range(100, 132))
    whole = kv.stored_blocks(tokens, 8)
    tail = kv.stored_blocks(tokens[16:], 8, parent_hash=whole[1][0])
    assert tail == whole[2:]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        kv.block_hashes([1, 2], 0)
