"""How llama.cpp's OpenMP threads wait at their barriers (`--omp-wait`), decided before llama.cpp loads.

llama.cpp's CPU backend (built with OpenMP) meets at a barrier after every
operation of a step: some 380 per token for SmolLM2-135M. OpenMP reads
`OMP_WAIT_POLICY` once, when the library loads, for the whole process:

- `spin` (OpenMP's default, what llama.cpp and llama-cpp-python's server run
  with): a thread spins a while before it sleeps. Best while the threads have
  their cores.
- `passive` (`OMP_WAIT_POLICY=PASSIVE`): a thread sleeps at every barrier.
  Best when other busy threads share the cores.
- `auto` (the default): `spin` when the llama.cpp threads of every engine in
  this process (each engine's larger thread count) fit the CPUs the process
  may use, `passive` otherwise (`meshllm run --workers 2` on 2 cores). An
  `OMP_WAIT_POLICY` the operator set wins over `auto`.

`bench/omp_wait.py` measures both (docs/engines/llamacpp.md, "Threads"). The first engine to start decides for the
process; a later engine asking for another policy gets a warning, not it.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from typing import Literal

from meshllm.engine.cpus import usable_cpus

__all__ = ["CHOICES", "ENV", "decide", "register"]

log = logging.getLogger("meshllm.engine.llamacpp")

ENV = "OMP_WAIT_POLICY"
CHOICES = ("auto", "spin", "passive")
Wait = Literal["spin", "passive"]

# Engines built in this process -> the most llama.cpp threads each runs at once.
_threads: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()


def register(engine: object, threads: int) -> None:
    """Count `engine`'s threads until it is garbage (engines are built before any starts: `meshllm run`)."""
    _threads[engine] = threads


def unregister(engine: object) -> None:
    _threads.pop(engine, None)


def _from_env(value: str) -> Wait:
    return "passive" if value.strip().upper() == "PASSIVE" else "spin"


def choose(asked: str, threads_in_process: int, cpus: int, env: str | None) -> tuple[Wait, str]:
    """The wait policy and why, for the flag value `asked` (pure: `decide` applies it)."""
    if asked in ("spin", "passive"):
        return asked, f"--omp-wait {asked}"  # type: ignore[return-value]
    if env is not None and env.strip():
        return _from_env(env), f"{ENV}={env.strip()} in the environment"
    if threads_in_process <= cpus:
        return "spin", f"{threads_in_process} llama.cpp thread(s) fit {cpus} CPU(s)"
    return "passive", f"{threads_in_process} llama.cpp threads in this process for {cpus} CPU(s)"


def decide(asked: str) -> Wait:
    """Set `OMP_WAIT_POLICY` for llama.cpp, unless it is loaded already; what its threads will do."""
    total = sum(_threads.values()) or 1
    current = os.environ.get(ENV)
    wait, why = choose(asked, total, len(usable_cpus()), current)
    if "llama_cpp" in sys.modules:  # OpenMP read its policy when llama.cpp loaded; it stays
        loaded = _from_env(current or "")
        if asked != "auto" and loaded != wait:
            log.warning("--omp-wait %s: llama.cpp is loaded already in this process, its threads %s", asked, loaded)
        return loaded
    if wait == "passive":
        os.environ[ENV] = "PASSIVE"
    elif current is not None and (_from_env(current) == "passive" or not current.strip()):
        del os.environ[ENV]  # an explicit --omp-wait spin, or an empty value (OpenMP would call it invalid)
    log.debug("llama.cpp OpenMP threads %s (%s)", "spin, then sleep" if wait == "spin" else "sleep", why)
    return wait
