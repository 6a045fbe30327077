"""bench/fleet.py's in-process part: a routing core fed the fleet's events in this process, its decisions against
scoring every worker, reused blocks spread through the eviction orders, and Dynamo's RadixTree beside the walk."""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleet_procs import MODEL
from fleet_report import summary
from fleet_sim import (
    BLOCK_SIZE,
    SimWorker,
)

from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.plane.discovery.base import MemoryDiscovery, MemoryStore
from meshllm.plane.events.base import MemoryBroker, MemoryEventBus
from meshllm.plane.request.channels import ChannelCache
from meshllm.protocol.kv import block_hashes, stored_blocks
from meshllm.router.config import RouterConfig
from meshllm.router.core import RouterCore
from meshllm.router.policy.fleet import bit_indices
from meshllm.router.workers import AGGREGATED, PoolWorker
from meshllm.v1 import discovery_pb2, events_pb2, worker_pb2

DYN_HEAD = struct.Struct("<IIBQI")  # bench/fleet_dynamo.py's event records
DYN_PAIR = struct.Struct("<QQ")


def dynamo_python() -> Path | None:
    """A Python whose `dynamo._core` has the RadixTree ($DYN_VENV, else the anchors' venvs under /tmp/meshllm-anchor)."""
    home = Path(os.environ.get("ANCHOR_HOME", "/tmp/meshllm-anchor"))
    venvs = [Path(os.environ["DYN_VENV"])] if os.environ.get("DYN_VENV") else [home / "dynvllm", home / "dyn"]
    for venv in venvs:
        py = venv / "bin" / "python"
        if py.exists() and subprocess.run([py, "-c", "from dynamo._core import RadixTree"], capture_output=True).returncode == 0:
            return py
    return None


def in_process_core(workers: Sequence[SimWorker], blocks: int) -> RouterCore:
    """A RouterCore of this process with the fleet as its pool (nothing started: its index is fed by hand)."""
    plane = PlaneConfig(discovery=DiscoveryKind.MEMORY, events=EventsKind.MEMORY)
    core = RouterCore(RouterConfig(plane=plane), MemoryDiscovery(MemoryStore()), MemoryEventBus(MemoryBroker()), ChannelCache())
    card = discovery_pb2.ModelCard(name=MODEL, kv_block_size=BLOCK_SIZE)
    card.runtime_limits.total_kv_blocks = blocks
    core.pool._update({w.id: PoolWorker(w.id, f"sim/{w.id}", AGGREGATED, MODEL, 1, card) for w in workers})
    for w in workers:
        core.index.add_worker(w.id)
        core.index.apply_snapshot(worker_pb2.KvSnapshot(worker_id=w.id, last_event_id=0))
    return core


def measure_in_process(
    core: RouterCore, prompts: Sequence[list[int]], exhaustive: int
) -> tuple[dict[str, list[float]], float, list[str]]:
    """Per prompt: the whole decision (hash + `plan`), the candidates it scored, the hash + walk alone; the exhaustive
    scorer on the first `exhaustive` prompts (its times, and the share of them where both choose the same worker);
    the fleet choices."""
    keys = [(w.id, 0) for w in core.pool.workers(MODEL, AGGREGATED)]
    for p in prompts[:10]:
        core.plan(MODEL, p, {}, set())
    times: dict[str, list[float]] = {"decision": [], "walk": [], "exhaustive": [], "scored": []}
    chosen = []
    gc.collect()
    for p in prompts:
        t = time.perf_counter()
        plan = core.plan(MODEL, p, {}, set())
        times["decision"].append((time.perf_counter() - t) * 1000)
        times["scored"].append(len(plan.main.candidates))
        chosen.append(plan.main.chosen.worker_id)
        t = time.perf_counter()
        core.index.overlaps(block_hashes(p, BLOCK_SIZE), keys)
        times["walk"].append((time.perf_counter() - t) * 1000)
    same = 0
    core.candidates.fleet = False
    for p, want in zip(prompts[:exhaustive], chosen, strict=False):
        t = time.perf_counter()
        plan = core.plan(MODEL, p, {}, set())
        times["exhaustive"].append((time.perf_counter() - t) * 1000)
        same += plan.main.chosen.worker_id == want
    core.candidates.fleet = True
    return times, same / max(1, min(exhaustive, len(prompts))), chosen


def spread_reuse(core: RouterCore, workers: Sequence[SimWorker], rng: random.Random) -> None:
    """Route every cached block again, in runs of 20 in random order, half the runs as reuses (bench/indexer.py's
    adversarial case): reused blocks end up all through every eviction order, so no bound is exact."""
    for w in workers:
        hashes = list(w.cache)
        starts = list(range(0, len(hashes), 20))
        rng.shuffle(starts)
        for i in starts:
            core.index.touch((w.id, 0), hashes[i : i + 20], reused=rng.random() < 0.5)


def hot_share(core: RouterCore) -> float:
    """Reused blocks among all indexed blocks."""
    return sum(core.index.map.hot) / max(1, sum(core.index.map.sizes))


def dynamo_side_by_side(
    core: RouterCore, workers: Sequence[SimWorker], stream_events: Sequence[bytes], prompts: Sequence[list[int]], py: Path
) -> dict[str, Any]:
    """Dynamo's RadixTree fed the same stored events, `find_matches` beside our walk on the same prompts."""
    tmp = Path(tempfile.mkdtemp(prefix="meshllm-fleet-dynamo-"))
    number = {w.id: i for i, w in enumerate(workers)}
    with (tmp / "events").open("wb") as f:
        for data in stream_events:
            batch = events_pb2.KvEventBatch.FromString(data)
            for ev in batch.events:
                st = ev.stored
                has = st.HasField("parent_hash")
                n = len(st.block_hashes)
                f.write(DYN_HEAD.pack(number[batch.worker_id], ev.event_id, has, st.parent_hash if has else 0, n))
                f.write(b"".join(map(DYN_PAIR.pack, st.block_hashes, st.tokens_hashes)))
    keys = [(w.id, 0) for w in workers]
    ours, agree = [], 0
    with (tmp / "queries").open("wb") as f:
        for p in prompts:
            pairs = stored_blocks(p, BLOCK_SIZE)
            f.write(struct.pack("<I", len(pairs)) + struct.pack(f"<{len(pairs)}Q", *(th for _, th in pairs)))
    try:
        proc = subprocess.run([py, Path(__file__).with_name("fleet_dynamo.py"), tmp / "events", tmp / "queries", tmp / "out"],
                              capture_output=True, text=True, timeout=3600)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"fleet_dynamo.py failed: {proc.stderr[-2000:]}")
        theirs = json.loads((tmp / "out").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the events file is ~16 bytes per block
    table = core.candidates.table(MODEL, AGGREGATED)
    assert table is not None
    bmap = core.index.map
    by_dict = []
    gc.collect()
    for p, scores in zip(prompts, theirs["scores"], strict=True):
        hashes = block_hashes(p, BLOCK_SIZE)
        t = time.perf_counter()
        groups = bmap.overlap_groups(hashes, table.mask)  # the decision's walk: depth groups of slot bits
        ours.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        got = core.index.overlaps(hashes, keys)  # the same walk answering {worker: depth}, as find_matches does
        by_dict.append((time.perf_counter() - t) * 1000)
        from_groups = {table.skeys[table.pos_of_slot[s]]: d for d, bits in groups for s in bit_indices(bits).tolist()}
        agree += from_groups == got and {str(number[k[0]]): d for k, d in got.items()} == scores
    return {
        "find_matches_ms": summary(theirs["ms"]),
        "walk_ms": summary(ours),
        "walk_dict_ms": summary(by_dict),
        "same_overlaps": agree / max(1, len(prompts)),
        "dynamo_apply_s": theirs["apply_s"],
        "dynamo_blocks": theirs["blocks"],
        "version": theirs.get("version", ""),
    }
