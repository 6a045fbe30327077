"""The garbage collector's settings for a long-running service: `settle_heap`, called once it is up.

CPython's cyclic collector scans, at every full (oldest-generation)
collection, every container object the process holds. A started service holds
a great many of them (modules, classes, protobuf descriptors, the tokenizer's
tables) that live as long as the process, and a busy frontend ran full
collections several times a second. `gc.freeze()` after startup moves everything
alive then into the permanent generation, which collections skip; what
requests allocate afterwards is collected as before. The youngest
generation's threshold goes from 700 to `YOUNG_THRESHOLD` allocations, so
the short-lived objects of a request (chunks, deltas, dicts) die by reference
counting before a collection can promote them to the older generations.
Effect (split mesh, one event per token): docs/benchmarks.md, "Change against
its base: garbage collector settled after startup".
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "settle_heap"]

YOUNG_THRESHOLD = 10_000  # allocations between young collections (CPython's default: 700)


def settle_heap() -> None:
    """Collect once, freeze what survives (the process's startup state), and collect the young less often."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
