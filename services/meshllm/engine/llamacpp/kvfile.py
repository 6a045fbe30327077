"""The disk tier's file format: one saved sequence prefix per file, written atomically, validated when read.

    <key:016x>.mlkv = b"MLKVTIER" | u32 header length | header (JSON, UTF-8) | state bytes

The header names the KV layout (`LlamaBackend.kv_layout`: llama.cpp version,
model digest, shape, KV types, attention kind), the prefix's token ids (the
block hashes are recomputed from them, so a file never lies about what it
holds), and the state's length and XXH3-64. A file is written to a dot-named
temporary in the same directory and renamed into place, so a reader sees a
whole file or none. There is no fsync: after a power loss a recent file may be
short or empty, and then fails validation and is skipped like any corrupt file.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

__all__ = ["SUFFIX", "FileHeader", "KvFileError", "encode_header", "file_name", "read_header", "read_state", "write_file"]

MAGIC = b"MLKVTIER"
SUFFIX = ".mlkv"
VERSION = 1
_LEN = struct.Struct("<I")
_MAX_HEADER = 64 << 20


class KvFileError(Exception):
    """A file that is not a valid saved prefix for this engine (the message says why)."""


@dataclass(frozen=True, slots=True)
class FileHeader:
    layout: str
    tokens: list[int]
    state_bytes: int
    state_xxh3: int
    offset: int  # where the state starts in the file


def file_name(key: int) -> str:
    return f"{key:016x}{SUFFIX}"


def encode_header(*, layout: str, tokens: list[int], state: bytes) -> bytes:
    """Everything a file holds before the state (its size plus the state's is the file's size)."""
    meta = {
        "v": VERSION,
        "layout": layout,
        "tokens": tokens,
        "state_bytes": len(state),
        "state_xxh3": xxhash.xxh3_64_intdigest(state),
    }
    body = json.dumps(meta, separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(body)) + body


def write_file(directory: Path, key: int, header: bytes, state: bytes) -> Path:
    """Write one prefix's file atomically (temporary + rename); its final path."""
    path = directory / file_name(key)
    tmp = directory / f".tmp-{os.getpid()}-{path.name}"
    try:
        with tmp.open("wb") as f:
            f.write(header)
            f.write(state)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_header(path: Path, layout: str) -> FileHeader:
    """The header of `path`, checked against `layout` and the file's size (KvFileError if anything is off)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(len(MAGIC) + _LEN.size)
            if len(head) < len(MAGIC) + _LEN.size or head[: len(MAGIC)] != MAGIC:
                raise KvFileError("not a meshllm KV tier file")
            (n,) = _LEN.unpack(head[len(MAGIC) :])
            if n > _MAX_HEADER:
                raise KvFileError(f"header of {n} bytes is implausible")
            raw = f.read(n)
    except OSError as exc:
        raise KvFileError(f"cannot read it: {exc.strerror}") from None
    try:
        meta = json.loads(raw)
        version, theirs = meta["v"], meta["layout"]
        tokens, state_bytes, state_xxh3 = meta["tokens"], meta["state_bytes"], meta["state_xxh3"]
    except (ValueError, KeyError, TypeError):
        raise KvFileError("its header is not valid JSON with the expected fields") from None
    if version != VERSION:
        raise KvFileError(f"format version {version} (this engine reads {VERSION})")
    if theirs != layout:
        raise KvFileError(f"KV layout {theirs!r} is not this engine's {layout!r}")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise KvFileError("its token list is empty or malformed")
    offset = len(MAGIC) + _LEN.size + n
    if not isinstance(state_bytes, int) or state_bytes <= 0 or offset + state_bytes != size:
        raise KvFileError(f"it is {size} bytes, the header says {offset} + {state_bytes}")
    return FileHeader(theirs, tokens, state_bytes, int(state_xxh3), offset)


def read_state(path: Path, header: FileHeader) -> bytes:
    """The state bytes of a file whose header was read, checked against the header's length and hash."""
    try:
        with path.open("rb") as f:
            f.seek(header.offset)
            state = f.read(header.state_bytes + 1)
    except OSError as exc:
        raise KvFileError(f"cannot read it: {exc.strerror}") from None
    if len(state) != header.state_bytes or xxhash.xxh3_64_intdigest(state) != header.state_xxh3:
        raise KvFileError("its state bytes do not match the header's length and hash")
    return state
