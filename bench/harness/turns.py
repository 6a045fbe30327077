"""Systems taking turns on the same requests, so that a drift of the machine's speed falls on all of them alike.

This machine's speed drifts by ±30 % over minutes. A benchmark that measured one system after the other would
put that drift between them; `take_turns` sends every block of requests to every system in turn instead,
rotating which system goes first (none always follows another's request), and charges each system only the
wall time and CPU of its own turns.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from harness.cpu import CpuMeter
from harness.servers import rotated

__all__ = ["Turns", "take_turns"]

T = TypeVar("T")


@dataclass(slots=True)
class Turns:
    """Per system: the seconds of each of its turns (block j: the same requests on every system) and the CPU
    seconds of each metered process over all its turns."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    cpu_s: dict[str, dict[str, float]] = field(default_factory=dict)


async def take_turns(
    meters: Mapping[str, CpuMeter], items: Sequence[T], block: int, send: Callable[[str, Sequence[T]], Awaitable[None]]
) -> Turns:
    """Send `items` in blocks of `block` to every system of `meters` in turn (`send(system, block)` returns when
    the block is done), rotating which system goes first from one block to the next."""
    names = list(meters)
    turns = Turns({n: [] for n in names}, {n: {} for n in names})
    for j in range(0, len(items), block):
        for name in rotated(names, j // block):
            before, t0 = meters[name].sample(), time.perf_counter()
            await send(name, items[j : j + block])
            turns.seconds[name].append(time.perf_counter() - t0)
            cpu = turns.cpu_s[name]
            for process, sec in CpuMeter.delta(before, meters[name].sample()).items():
                cpu[process] = cpu.get(process, 0.0) + sec
    return turns
