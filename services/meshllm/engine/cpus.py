"""The CPUs a process may use, and CPU lists in the form Linux and the engines' variables write them ("0-3,6")."""

from __future__ import annotations

import os

from meshllm.config import ConfigError

__all__ = ["cpu_shares", "format_cpu_list", "parse_cpu_list", "usable_cpus"]


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> list[int]:
    """`"0-3,6"` -> [0, 1, 2, 3, 6]; a ConfigError (one line) for anything else."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if hi else int(lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ConfigError(f"--cpu-bind {text!r}: give auto or a CPU list such as 0-3 or 0,2") from None
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the form VLLM_CPU_OMP_THREADS_BIND and /proc use)."""
    runs: list[str] = []
    for c in sorted(cpus):
        if runs and int(runs[-1].rsplit("-", 1)[-1]) == c - 1:
            runs[-1] = f"{runs[-1].split('-')[0]}-{c}"
        else:
            runs.append(str(c))
    return ",".join(runs)


def cpu_shares(cpus: list[int], count: int) -> list[str] | None:
    """`count` disjoint CPU lists covering `cpus` (the first ones one CPU larger when it does not divide), or None
    when there are fewer CPUs than workers (they then share all of them)."""
    if count <= 1 or len(cpus) < count:
        return None
    size, extra = divmod(len(cpus), count)
    shares, at = [], 0
    for i in range(count):
        n = size + (1 if i < extra else 0)
        shares.append(format_cpu_list(cpus[at : at + n]))
        at += n
    return shares
