"""`TierStore`: the host-memory and disk tiers that keep evicted sequence prefixes for a later restore.

Granularity: one *blob* per saved prefix — a slot's `llama_state_seq_get_data`
state, trimmed to whole blocks — indexed by every block hash it covers. A
prompt matches the deepest of its block hashes any blob covers (chained hashes:
an equal hash is an equal prefix); the engine loads the whole blob into a slot
and trims it to the match (`llama_memory_seq_rm`). Per-block pieces would need
either one state export per block or parsing llama.cpp's private state format
(it changes between versions); a blob is one export, one memcpy, one file.
The cost is overlap: two conversations sharing a system prompt hold it twice.
Two rules keep that bounded: a prefix whose deepest block a tier already holds
is not saved again (the holder is touched instead), and a saved prefix that
extends a held one replaces it (the longer blob covers every block of the
shorter).

Each tier is LRU within a byte budget counting actual bytes (state length in
host memory, file size on disk); a blob bigger than the budget is not kept.
Saves go to every enabled tier (write-through: the disk copy survives a
restart even when host memory still holds the prefix). A hit promotes: the
blob becomes most recent in its tier, and a disk hit is copied into host
memory. Block reference counts per tier (`slots.BlockRefs`) turn blob changes
into KV events with the tier: a block is stored in a tier when its first blob
there arrives and removed when its last leaves.

Everything here runs on the engine thread (disk reads and writes included:
they delay that thread's next step by milliseconds, never the event loop)."""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from meshllm.config import ConfigError
from meshllm.engine.base import KvTier, TierUsage
from meshllm.engine.llamacpp import kvfile
from meshllm.engine.llamacpp.slots import BlockRefs, KvEvent
from meshllm.protocol.kv import stored_blocks

__all__ = ["Blob", "Hit", "Tier", "TierStats", "TierStore"]

log = logging.getLogger("meshllm.engine.llamacpp")


@dataclass(eq=False, slots=True)
class Blob:
    """One saved prefix: `tokens` (whole blocks), their `blocks`, and where its state lives in a tier."""

    key: int  # the deepest block hash
    tokens: list[int]
    blocks: list[tuple[int, int]]
    nbytes: int  # what it costs the tier's budget
    data: bytes | None = None  # host tier
    path: Path | None = None  # disk tier
    header: kvfile.FileHeader | None = None


@dataclass(frozen=True, slots=True)
class Hit:
    """A prompt's deepest match in a lower tier: its first `n_blocks` blocks are `blob`'s."""

    tier: KvTier
    blob: Blob
    n_blocks: int
    n_tokens: int


@dataclass(slots=True)
class TierStats:
    """Counters of one engine's tiers (read by benchmarks; written on the engine thread)."""

    saves: int = 0
    saved_bytes: int = 0
    save_seconds: float = 0.0
    hits: dict[KvTier, int] = field(default_factory=dict)
    restored_tokens: dict[KvTier, int] = field(default_factory=dict)
    restored_bytes: dict[KvTier, int] = field(default_factory=dict)
    restore_seconds: dict[KvTier, float] = field(default_factory=dict)
    failed_restores: int = 0


class Tier:
    """Blobs in LRU order (oldest first) within `capacity` bytes; a block is held while any blob covers it."""

    def __init__(self, kind: KvTier, capacity: int, events: list[KvEvent]) -> None:
        self.kind = kind
        self.capacity = capacity
        self.blobs: OrderedDict[int, Blob] = OrderedDict()
        self.owners: dict[int, dict[int, None]] = {}  # block hash -> keys of the blobs covering it
        self.refs = BlockRefs(kind, events)
        self.used = 0
        self.blob_blocks = 0  # blocks over all blobs, overlaps counted (bytes per block = used / this)

    def __len__(self) -> int:
        return len(self.blobs)

    def covers(self, block_hash: int) -> bool:
        return block_hash in self.refs

    def deepest(self, hashes: list[int]) -> tuple[Blob, int] | None:
        """The most recent blob covering the deepest of `hashes` held here, and how many of them match."""
        for i in range(len(hashes) - 1, -1, -1):
            keys = self.owners.get(hashes[i])
            if keys:
                return self.blobs[next(reversed(keys))], i + 1
        return None

    def holder(self, block_hash: int) -> Blob | None:
        keys = self.owners.get(block_hash)
        return self.blobs[next(reversed(keys))] if keys else None

    def touch(self, blob: Blob) -> None:
        if blob.key in self.blobs:
            self.blobs.move_to_end(blob.key)

    def add(self, blob: Blob) -> bool:
        """Keep `blob` (False when it is bigger than the budget); drop the blobs it extends, then the LRU ones over budget."""
        if blob.nbytes > self.capacity:
            return False
        self.refs.ref(blob.blocks, None)  # before the drops below, so shared blocks are never removed and re-stored
        for bh, _ in blob.blocks[:-1]:
            if bh in self.blobs:
                self.remove(self.blobs[bh])
        while self.blobs and self.used + blob.nbytes > self.capacity:
            self.remove(next(iter(self.blobs.values())))
        if not self._keep(blob):
            self.refs.unref(blob.blocks)
            return False
        self.blobs[blob.key] = blob
        for bh, _ in blob.blocks:
            self.owners.setdefault(bh, {})[blob.key] = None
        self.used += blob.nbytes
        self.blob_blocks += len(blob.blocks)
        return True

    def _keep(self, blob: Blob) -> bool:
        """Store the blob's bytes in the medium (host memory: they already are)."""
        return True

    def remove(self, blob: Blob) -> None:
        if self.blobs.pop(blob.key, None) is None:
            return
        for bh, _ in blob.blocks:
            keys = self.owners[bh]
            del keys[blob.key]
            if not keys:
                del self.owners[bh]
        self.used -= blob.nbytes
        self.blob_blocks -= len(blob.blocks)
        self.refs.unref(blob.blocks)
        self._drop(blob)

    def _drop(self, blob: Blob) -> None:
        """Free the blob's bytes in the medium."""

    def clear(self) -> int:
        held = len(self.refs)
        for blob in list(self.blobs.values()):
            self.remove(blob)
        return held


class DiskTier(Tier):
    """A tier whose blobs are files in `directory` (see `kvfile`); LRU order is kept in the files' mtimes."""

    def __init__(self, directory: Path, capacity: int, events: list[KvEvent], *, layout: str) -> None:
        super().__init__(KvTier.DISK, capacity, events)
        self.directory = directory
        self.layout = layout
        self._pending: dict[int, tuple[bytes, bytes]] = {}  # key -> (header, state) being added
        self._lock: int | None = None

    def lock(self) -> None:
        """Own the directory for this engine's lifetime (ConfigError if another engine does): one directory, one worker."""
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"--kv-disk-dir {self.directory} is in use by another worker; give each worker its own") from None
        self._lock = fd

    def unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    def add_state(self, tokens: list[int], blocks: list[tuple[int, int]], state: bytes) -> bool:
        header = kvfile.encode_header(layout=self.layout, tokens=tokens, state=state)
        blob = Blob(blocks[-1][0], tokens, blocks, len(header) + len(state))
        self._pending[blob.key] = (header, state)
        try:
            return self.add(blob)
        finally:
            self._pending.pop(blob.key, None)

    def _keep(self, blob: Blob) -> bool:
        pending = self._pending.get(blob.key)
        if pending is None:  # a file found by `scan`: already on disk
            return True
        header, state = pending
        try:
            blob.path = kvfile.write_file(self.directory, blob.key, header, state)
        except OSError as exc:
            log.warning("kv disk tier: cannot write %s: %s", kvfile.file_name(blob.key), exc.strerror or exc)
            return False
        return True

    def touch(self, blob: Blob) -> None:
        super().touch(blob)
        if blob.path is not None:
            try:
                os.utime(blob.path)
            except OSError:
                pass  # the LRU order in memory is what counts while running

    def _drop(self, blob: Blob) -> None:
        if blob.path is not None:
            blob.path.unlink(missing_ok=True)

    def scan(self, block_size: int) -> None:
        """Index the files a previous run left (oldest first); skip, with a log line, any that fail validation."""
        self.lock()
        for tmp in self.directory.glob(f".tmp-*{kvfile.SUFFIX}"):
            tmp.unlink(missing_ok=True)  # a write interrupted by a crash
        entries: list[tuple[float, Path]] = []
        for path in self.directory.glob(f"*{kvfile.SUFFIX}"):
            try:
                entries.append((path.stat().st_mtime, path))
            except OSError:
                continue
        for _, path in sorted(entries):
            try:
                header = kvfile.read_header(path, self.layout)
            except kvfile.KvFileError as exc:
                log.warning("kv disk tier: skipping %s: %s", path, exc)
                continue
            blocks = stored_blocks(header.tokens, block_size)
            if not blocks or self.covers(blocks[-1][0]):
                log.warning("kv disk tier: skipping %s: it holds no block not already held", path)
                continue
            blob = Blob(blocks[-1][0], header.tokens, blocks, header.offset + header.state_bytes, path=path, header=header)
            self.add(blob)
        log.info(
            "kv disk tier: %d prefixes, %d blocks, %d bytes found in %s", len(self), len(self.refs), self.used, self.directory
        )


class TierStore:
    """The enabled lower tiers of one engine, their index, events and usage (engine thread only)."""

    def __init__(
        self, *, block_size: int, layout: str, host_bytes: int = 0, disk_dir: Path | None = None, disk_bytes: int = 0
    ) -> None:
        self.block_size = block_size
        self.events: list[KvEvent] = []
        self.host = Tier(KvTier.HOST, host_bytes, self.events) if host_bytes > 0 else None
        self.disk = DiskTier(disk_dir, disk_bytes, self.events, layout=layout) if disk_dir is not None else None
        # every key present from the start, so a reader on another thread never sees a dict change size
        zero = dict.fromkeys(self.kinds, 0)
        self.stats = TierStats(
            hits=dict(zero), restored_tokens=dict(zero), restored_bytes=dict(zero), restore_seconds=dict.fromkeys(self.kinds, 0.0)
        )

    @property
    def tiers(self) -> list[Tier]:
        return [t for t in (self.host, self.disk) if t is not None]

    @property
    def kinds(self) -> tuple[KvTier, ...]:
        return tuple(t.kind for t in self.tiers)

    def scan(self) -> None:
        """Lock the disk directory and index what it holds (call once, before the first request)."""
        if self.disk is not None:
            self.disk.scan(self.block_size)

    def close(self) -> None:
        """Release the disk directory (the files stay for the next run)."""
        if self.disk is not None:
            self.disk.unlock()

    # ------------------------------------------------------------ saving
    def covers(self, block_hash: int) -> bool:
        """Every enabled tier already holds the prefix ending in `block_hash`."""
        return all(t.covers(block_hash) for t in self.tiers)

    def touch(self, block_hash: int) -> None:
        for t in self.tiers:
            blob = t.holder(block_hash)
            if blob is not None:
                t.touch(blob)

    def save(self, tokens: list[int], blocks: list[tuple[int, int]], state: bytes, seconds: float = 0.0) -> None:
        """Keep an evicted prefix (`tokens`: whole blocks; `state`: its sequence state) in every tier lacking it."""
        t0 = time.perf_counter()
        key = blocks[-1][0]
        if self.host is not None:
            held = self.host.holder(key)
            if held is not None:
                self.host.touch(held)
            else:
                self.host.add(Blob(key, tokens, blocks, len(state), data=state))
        if self.disk is not None:
            held = self.disk.holder(key)
            if held is not None:
                self.disk.touch(held)
            else:
                self.disk.add_state(tokens, blocks, state)
        self.stats.saves += 1
        self.stats.saved_bytes += len(state)
        self.stats.save_seconds += seconds + time.perf_counter() - t0

    # ------------------------------------------------------------ restoring
    def lookup(self, tokens: list[int]) -> Hit | None:
        """The deepest match of `tokens`' full blocks in any tier (host wins a tie: it is faster)."""
        hashes = [bh for bh, _ in stored_blocks(tokens, self.block_size)]
        best: Hit | None = None
        for t in self.tiers:
            found = t.deepest(hashes)
            if found is not None and (best is None or found[1] > best.n_blocks):
                blob, n = found
                best = Hit(t.kind, blob, n, n * self.block_size)
        return best

    def fetch(self, hit: Hit) -> bytes | None:
        """The hit's state bytes; None (and the blob dropped, with a log line) when a disk file fails validation."""
        blob = hit.blob
        if blob.data is not None:
            return blob.data
        assert blob.path is not None and self.disk is not None
        try:
            header = blob.header or kvfile.read_header(blob.path, self.disk.layout)
            return kvfile.read_state(blob.path, header)
        except kvfile.KvFileError as exc:
            log.warning("kv disk tier: dropping %s: %s", blob.path, exc)
            self.disk.remove(blob)
            return None

    def prefix(self, hashes: list[int]) -> tuple[Hit, bytes] | None:
        """A blob whose first blocks are exactly `hashes` (a peer's prefix handle) and its state; None when no tier has one.

        Host first (faster); the state covers the whole blob, which may run past
        the prefix: the puller trims it to `len(hashes)` blocks as a restore does.
        """
        if not hashes:
            return None
        n = len(hashes)
        for t in self.tiers:
            blob = t.holder(hashes[-1])
            if blob is None or [bh for bh, _ in blob.blocks[:n]] != hashes:
                continue
            hit = Hit(t.kind, blob, n, n * self.block_size)
            state = self.fetch(hit)
            if state is not None:
                self.touch(blob.key)
                return hit, state
        return None

    def restored(self, hit: Hit, state: bytes, seconds: float) -> None:
        """A hit was loaded into a slot in `seconds`: count it and promote the blob."""
        s, k = self.stats, hit.tier
        s.hits[k] += 1
        s.restored_tokens[k] += hit.n_tokens
        s.restored_bytes[k] += len(state)
        s.restore_seconds[k] += seconds
        self.touch(hit.blob.key)
        if k is KvTier.DISK and self.host is not None and not self.host.covers(hit.blob.key):
            b = hit.blob
            self.host.add(Blob(b.key, b.tokens, b.blocks, len(state), data=state))

    def discard(self, hit: Hit) -> None:
        """A blob that failed to load: it will not be offered again."""
        self.stats.failed_restores += 1
        for t in self.tiers:
            if t.kind is hit.tier:
                t.remove(hit.blob)

    # ------------------------------------------------------------ reporting
    def clear(self) -> int:
        """Drop every blob of every tier (disk files included); how many blocks left each tier, summed."""
        return sum(t.clear() for t in self.tiers)

    def usage(self) -> tuple[TierUsage, ...]:
        out = []
        for t in self.tiers:
            secs = self.stats.restore_seconds.get(t.kind, 0.0)
            rate = self.stats.restored_bytes.get(t.kind, 0) / secs if secs > 0 else 0.0
            per_block = t.used // t.blob_blocks if t.blob_blocks else 0
            out.append(TierUsage(t.kind, len(t.refs), t.used, t.capacity, per_block, rate))
        return tuple(out)

    def drain_events(self) -> list[KvEvent]:
        events = list(self.events)
        self.events.clear()
        return events
