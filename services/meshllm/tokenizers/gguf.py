"""The exact fast tokenizer of a GGUF model, built from its metadata and cached on disk.

A GGUF file carries its tokenizer as metadata: `tokenizer.ggml.model` (gpt2 =
byte-level BPE, llama = SentencePiece BPE), `.pre` (the pre-tokenizer),
`.tokens`, `.token_type`, `.merges` or `.scores`, the bos/eos/eot ids and
`tokenizer.chat_template`. `build_tokenizer_json` turns that into the same
tokenizer.json the original Hugging Face repository ships, which `tokenizers`
runs natively.

`gguf.GGUFReader` parses every tensor and array element (seconds for a 100 MB
file); `read_gguf_metadata` reads only the key/value header with `struct`, using
gguf's key names and value types. The built tokenizer.json and a small meta.json
are cached under `cache_dir/<key>/`, key = sha256 of (format version, resolved
path, size, mtime_ns), so a second load neither parses nor builds anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

from gguf import GGUF_MAGIC, GGUFValueType, Keys
from tokenizers import Tokenizer as FastTokenizer

from meshllm.config import ConfigError
from meshllm.tokenizers.gguf_build import build_tokenizer_json
from meshllm.tokenizers.hf import HFTokenizer

__all__ = ["CACHE_FORMAT", "cache_key", "default_cache_dir", "is_gguf", "load_gguf_tokenizer", "read_gguf_metadata"]

log = logging.getLogger(__name__)

CACHE_FORMAT = 1
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}  # fmt: skip


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/meshllm/tokenizers (~/.cache/...): where GGUF-built tokenizers are kept unless told otherwise.

    XDG_CACHE_HOME lets a user without a writable home (the container image's) keep the cache elsewhere.
    """
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "meshllm" / "tokenizers"


def is_gguf(path: Path) -> bool:
    """Whether `path` is named *.gguf or starts with the GGUF magic."""
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == struct.pack("<I", GGUF_MAGIC)
    except OSError:
        return False


class _Cursor:
    """Sequential little- or big-endian reads from a memory-mapped GGUF header."""

    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf, self.order, self.pos = buf, order, 0

    def unpack(self, fmt: str, count: int = 1) -> tuple[Any, ...]:
        size = struct.calcsize(f"{self.order}{fmt}") * count
        if self.pos + size > len(self.buf):
            raise struct.error("the header runs past the end of the file")
        values = struct.unpack_from(f"{self.order}{count}{fmt}", self.buf, self.pos)
        self.pos += size
        return values

    def string(self, keep: bool = True) -> str:
        (length,) = self.unpack("Q")
        start, self.pos = self.pos, self.pos + length
        if self.pos > len(self.buf):
            raise struct.error("a string runs past the end of the file")
        return self.buf[start : self.pos].decode("utf-8", errors="replace") if keep else ""

    def value(self, vtype: int, keep: bool) -> Any:
        """The next value of type `vtype`; None (but skipped correctly) when not `keep`."""
        if vtype == GGUFValueType.STRING:
            return self.string(keep)
        if vtype == GGUFValueType.ARRAY:
            (item_type,) = self.unpack("I")
            (count,) = self.unpack("Q")
            if item_type in _SCALARS:
                if not keep:
                    self.pos += struct.calcsize(f"{self.order}{_SCALARS[item_type]}") * count
                    return None
                return list(self.unpack(_SCALARS[item_type], count)) if count else []
            items = [self.value(item_type, keep) for _ in range(count)]
            return items if keep else None
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])[0]
        raise struct.error(f"unknown GGUF value type {vtype}")


def read_gguf_metadata(path: Path, *, prefixes: tuple[str, ...] = ("tokenizer.", "general.")) -> dict[str, Any]:
    """The header key/values of a GGUF file whose key starts with one of `prefixes` (others are skipped)."""
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != struct.pack("<I", GGUF_MAGIC):
                raise ConfigError(f"{path} is not a GGUF file (bad magic)")
            (version,) = struct.unpack_from("<I", buf, 4)
            order = ">" if version & 0xFFFF == 0 else "<"
            cursor = _Cursor(buf, order)
            cursor.pos = 4
            (version,) = cursor.unpack("I")
            if version not in (2, 3):
                raise ConfigError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
            _tensor_count, kv_count = cursor.unpack("Q", 2)
            meta: dict[str, Any] = {}
            for _ in range(kv_count):
                key = cursor.string()
                (vtype,) = cursor.unpack("I")
                keep = key.startswith(prefixes)
                value = cursor.value(vtype, keep)
                if keep:
                    meta[key] = value
            return meta
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError(f"cannot read GGUF metadata from {path}: {exc}") from exc


def cache_key(path: Path) -> str:
    """The cache key of a GGUF file: changes when the file is replaced or modified."""
    resolved = path.resolve()
    st = resolved.stat()
    ident = f"{CACHE_FORMAT}\0{resolved}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode("utf-8", errors="surrogatepass")).hexdigest()[:40]


def _tokenizer_meta(meta: dict[str, Any], path: Path) -> dict[str, Any]:
    """What `HFTokenizer` needs beyond tokenizer.json: special token texts, eos ids, chat template."""
    tokens: list[str] = meta[Keys.Tokenizer.LIST]

    def token_at(key: str) -> tuple[int | None, str | None]:
        token_id = meta.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            return token_id, tokens[token_id]
        return None, None

    bos_id, bos = token_at(Keys.Tokenizer.BOS_ID)
    eos_id, eos = token_at(Keys.Tokenizer.EOS_ID)
    end_ids = [i for i in (eos_id, token_at(Keys.Tokenizer.EOT_ID)[0], token_at(Keys.Tokenizer.EOM_ID)[0]) if i is not None]
    template = meta.get(Keys.Tokenizer.CHAT_TEMPLATE)
    return {
        "format": CACHE_FORMAT,
        "name": path.stem,
        "bos_token": bos if bos_id is not None else None,
        "eos_token": eos,
        "eos_token_ids": end_ids,
        "chat_template": template if isinstance(template, str) else None,
    }


def _from_parts(tokenizer_json: str, meta: dict[str, Any]) -> HFTokenizer:
    return HFTokenizer(
        FastTokenizer.from_str(tokenizer_json),
        name=meta["name"],
        bos_token=meta["bos_token"],
        eos_token=meta["eos_token"],
        extra_eos_ids=meta["eos_token_ids"],
        chat_template=meta["chat_template"],
    )


def _read_cache(entry: Path) -> HFTokenizer | None:
    try:
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        if meta.get("format") != CACHE_FORMAT:
            return None
        return _from_parts((entry / "tokenizer.json").read_text(encoding="utf-8"), meta)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except Exception as exc:  # a damaged entry is rebuilt, never fatal
        log.warning("ignoring damaged tokenizer cache entry %s: %s", entry, exc)
        return None


def _write_atomic(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_cache(entry: Path, tokenizer_json: str, meta: dict[str, Any]) -> None:
    """tokenizer.json first, meta.json last: meta.json present means the entry is complete."""
    try:
        entry.mkdir(parents=True, exist_ok=True)
        _write_atomic(entry / "tokenizer.json", tokenizer_json)
        _write_atomic(entry / "meta.json", json.dumps(meta, ensure_ascii=False))
    except OSError as exc:
        log.warning("cannot cache the tokenizer built from the GGUF file in %s: %s", entry, exc)


def load_gguf_tokenizer(path: Path, *, cache_dir: Path | None = None) -> HFTokenizer:
    """The tokenizer of GGUF file `path`, from the cache when built before (see the module docstring)."""
    try:
        entry = (cache_dir or default_cache_dir()) / cache_key(path)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    cached = _read_cache(entry)
    if cached is not None:
        return cached
    meta = read_gguf_metadata(path)
    if Keys.Tokenizer.LIST not in meta:
        raise ConfigError(f"{path} holds no tokenizer (no {Keys.Tokenizer.LIST} metadata)")
    tokenizer_json = json.dumps(build_tokenizer_json(meta, source=str(path)), ensure_ascii=False)
    info = _tokenizer_meta(meta, path)
    tokenizer = _from_parts(tokenizer_json, info)
    _write_cache(entry, tokenizer_json, info)
    return tokenizer
