"""CPU time of processes and named process trees from /proc: CPU-ms per request in every benchmark that reports it.

A process's `/proc/PID/stat` counts every thread of the process (utime +
stime) and the children it has reaped (cutime + cstime); a tree's total adds
the live descendants too, so a service that forks helpers is charged for them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuMeter", "ProcStat", "parse_stat", "process_seconds", "read_stats", "tree_ticks"]

TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ProcStat:
    """One process: its parent and its CPU clock ticks (all threads, plus reaped children; `own`: its threads only)."""

    pid: int
    ppid: int
    ticks: int
    own: int = 0


def parse_stat(text: str) -> ProcStat:
    """Parse one `/proc/PID/stat` line (the command name may hold spaces and parentheses)."""
    head, _, rest = text.rpartition(")")
    pid = int(head.split("(", 1)[0])
    fields = rest.split()  # fields[0] is field 3 (state) of proc(5)
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
    return ProcStat(pid, ppid, utime + stime + cutime + cstime, utime + stime)


def process_seconds(pid: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds of one process's own threads (utime + stime), without its children."""
    return parse_stat((proc / str(pid) / "stat").read_text()).own / TICK


def read_stats(proc: Path = Path("/proc")) -> dict[int, ProcStat]:
    """Every process visible in `proc` (ones that exit while it is read are skipped)."""
    stats = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stats[int(entry.name)] = parse_stat((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
    return stats


def tree_ticks(root: int, stats: Mapping[int, ProcStat]) -> int:
    """Ticks of `root` and all its live descendants; KeyError when `root` is gone."""
    children: dict[int, list[int]] = {}
    for s in stats.values():
        children.setdefault(s.ppid, []).append(s.pid)
    if root not in stats:
        raise KeyError(f"process {root} is gone")  # a dead service is an error, not zero CPU
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid].ticks
        todo.extend(children.get(pid, ()))
    return total


class CpuMeter:
    """CPU seconds of named process trees; `sample()` before and after a level, subtract. Names in `alone` count
    their process's own threads only (a front process apart from the engine processes it spawned)."""

    def __init__(self, roots: Mapping[str, int], proc: Path = Path("/proc"), alone: Iterable[str] = ()) -> None:
        self.roots = dict(roots)
        self.alone = frozenset(alone)
        self._proc = proc

    def sample(self) -> dict[str, float]:
        stats = read_stats(self._proc)
        out = {}
        for name, pid in self.roots.items():
            if name in self.alone:
                if pid not in stats:
                    raise KeyError(f"process {pid} is gone")
                out[name] = stats[pid].own / TICK
            else:
                out[name] = tree_ticks(pid, stats) / TICK
        return out

    @staticmethod
    def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
        return {name: after[name] - before[name] for name in before}
