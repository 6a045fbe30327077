"""Dynamo's radix tree on bench/fleet.py's events: run by Dynamo's own Python (its venv), not meshllm's.

    DYNAMO_PY bench/fleet_dynamo.py EVENTS QUERIES OUT

EVENTS: records of `<IIBQI` (worker, event id, has parent, parent hash,
blocks) followed by that many `<QQ` (block hash, tokens hash), as
bench/fleet.py writes them. QUERIES: per prompt `<I` n, then n `<Q` tokens
hashes. Applies every event with `RadixTree.apply_event` (JSON, Dynamo's
event format), then times `find_matches` per query; writes JSON to OUT:
apply seconds, per-query milliseconds and each query's scores.
"""

import json
import struct
import sys
import time
from importlib.metadata import PackageNotFoundError, version

from dynamo._core import RadixTree  # type: ignore[import-not-found]

HEAD = struct.Struct("<IIBQI")
PAIR = struct.Struct("<QQ")


def main() -> None:
    events_path, queries_path, out_path = sys.argv[1:4]
    raw = open(events_path, "rb").read()
    tree = RadixTree()
    pos, n_events, n_blocks = 0, 0, 0
    payloads = []
    while pos < len(raw):
        worker, event_id, has_parent, parent, n = HEAD.unpack_from(raw, pos)
        pos += HEAD.size
        blocks = [{"block_hash": bh, "tokens_hash": th} for bh, th in PAIR.iter_unpack(raw[pos : pos + n * PAIR.size])]
        pos += n * PAIR.size
        ev = {
            "event_id": event_id,
            "data": {"stored": {"parent_hash": parent if has_parent else None, "blocks": blocks}},
            "dp_rank": 0,
        }
        payloads.append((worker, json.dumps(ev).encode()))
        n_events += 1
        n_blocks += n
    t0 = time.perf_counter()
    for worker, data in payloads:
        tree.apply_event(worker, data)
    tree.find_matches([0])  # the tree applies on its own thread: a query after the last event waits for them
    apply_s = time.perf_counter() - t0
    qraw = open(queries_path, "rb").read()
    pos, ms, scores = 0, [], []
    while pos < len(qraw):
        (n,) = struct.unpack_from("<I", qraw, pos)
        pos += 4
        seq = list(struct.unpack_from(f"<{n}Q", qraw, pos))
        pos += 8 * n
        t = time.perf_counter()
        res = tree.find_matches(seq)
        ms.append((time.perf_counter() - t) * 1000)
        scores.append({str(k[0] if isinstance(k, tuple) else k): d for k, d in res.scores.items()})
    try:
        release = version("ai-dynamo-runtime")
    except PackageNotFoundError:
        release = ""
    json.dump(
        {"version": release, "apply_s": apply_s, "events": n_events, "blocks": n_blocks, "ms": ms, "scores": scores},
        open(out_path, "w"),
    )


if __name__ == "__main__":
    main()
