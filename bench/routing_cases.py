"""bench/routing.py's cases: the workload, the mesh setup, a scenario of the matrix and one run's result."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from harness.stats import pct
from routing_http import HttpDocs

from meshllm.protocol.types import TokenRequest

__all__ = ["Arrival", "Result", "Scenario", "Setup", "Workload", "requests"]


@dataclass(frozen=True, slots=True)
class Workload:
    groups: int = 8
    per_group: int = 32
    prefix_tokens: int = 1024
    suffix_tokens: int = 16
    max_tokens: int = 8
    rate: float = 3.0  # requests per second (exponential inter-arrival)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Setup:
    workers: int = 4
    block_size: int = 16
    num_gpu_blocks: int = 160
    speedup_ratio: float = 1.0


@dataclass(slots=True)
class Result:
    mode: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    per_worker: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def p(self, values: list[float], q: float) -> float:
        """The `q` quantile (0..1) of `values` (the harness's percentile); 0.0 for none."""
        return pct(values, q * 100) if values else 0.0


def requests(w: Workload) -> list[tuple[float, int, TokenRequest]]:
    """(arrival offset s, group, request) in arrival order."""
    rng = random.Random(w.seed)
    prefixes = [[rng.randrange(3, 30000) for _ in range(w.prefix_tokens)] for _ in range(w.groups)]
    order = [g for g in range(w.groups) for _ in range(w.per_group)]
    rng.shuffle(order)
    out = []
    t = 0.0
    for i, g in enumerate(order):
        t += rng.expovariate(w.rate)
        prompt = prefixes[g] + [rng.randrange(3, 30000) for _ in range(w.suffix_tokens)]
        req: TokenRequest = {
            "request_id": f"q{i}", "model": "mocker", "token_ids": prompt,
            "stop": {"max_tokens": w.max_tokens, "ignore_eos": True},
        }  # fmt: skip
        out.append((t, g, req))
    return out


Arrival = tuple[float, TokenRequest]  # (arrival offset s, request); offsets are ignored in closed loop


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload of the matrix: its requests, how they are sent, and the cache sizes it runs at."""

    name: str
    describe: str
    requests: list[Arrival]
    concurrency: int | None  # None = open loop at the arrival offsets
    caches: tuple[tuple[str, int], ...]  # (label, --num-gpu-blocks) per cache size
    cache_unit: tuple[str, int]  # ("documents", blocks per document) to state the cache sizes in
    ceiling: float  # best hit rate any router can reach with unbounded caches
    context_length: int = 2048
    http: HttpDocs | None = None  # sent through `meshllm run`'s HTTP API instead of an embedded core
