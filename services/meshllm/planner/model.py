"""What the planner's parts exchange: an interval's observation, a predicted load, a decision, a connector.

Roles are the worker roles' names as `meshllm worker --role` spells them:
"prefill" and "decode" for a disaggregated mesh, "agg" for one pool of aggregated workers.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from meshllm.lifecycle import AsyncCloseable

__all__ = ["ROLES", "Connector", "Decision", "Load", "Observation"]

ROLES = ("prefill", "decode", "agg")


@dataclass(frozen=True, slots=True)
class Observation:
    """One interval of the mesh, as the planner read it (None where the interval had no sample)."""

    at: float  # wall-clock seconds at the end of the interval
    interval_s: float
    requests: float  # requests that started streaming (sent a first token) in the interval
    isl: float | None  # mean prompt tokens of the requests that ended in the interval
    osl: float | None  # mean output tokens of the requests that ended in the interval
    ttft_p90_s: float | None
    itl_p90_s: float | None
    waiting: int = 0  # sequences queued on the workers (router's view)
    kv_usage: float | None = None  # active / total KV blocks over the workers, 0..1
    workers: Mapping[str, int] = field(default_factory=dict)  # role -> live workers in the router's pool
    output_tokens: float | None = None  # output tokens streamed in the interval (None: requests × osl)

    @property
    def request_rate(self) -> float:
        return self.requests / self.interval_s if self.interval_s > 0 else 0.0

    @property
    def output_rate(self) -> float | None:
        """Output tokens/s streamed in the interval; requests × OSL when the streamed tokens are not known."""
        if self.output_tokens is not None:
            return self.output_tokens / self.interval_s if self.interval_s > 0 else 0.0
        return None if self.osl is None else self.request_rate * self.osl


@dataclass(frozen=True, slots=True)
class Load:
    """The load the planner expects over the next interval."""

    request_rate: float  # requests per second
    isl: float
    osl: float
    output_rate: float | None = None  # output tokens/s, when predicted on its own (else request_rate × osl)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.request_rate * self.isl

    @property
    def decode_tokens_per_s(self) -> float:
        """Streams in flight decode whether or not requests start: the output rate, predicted on its own."""
        return self.output_rate if self.output_rate is not None else self.request_rate * self.osl


@dataclass(frozen=True, slots=True)
class Decision:
    """What the planner decided for one role in one interval, and why (shown on /metrics and the dashboard)."""

    at: float
    role: str
    current: int
    target: int  # what it asked the connector for (== current when it held)
    wanted: int  # what the load alone asked for, before min/max, hysteresis and cooldown
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down" if self.target < self.current else "hold"


class Connector(AsyncCloseable, abc.ABC):
    """Starts and stops workers of each role. Scaling down always drains (the worker's SIGTERM path)."""

    kind: ClassVar[str]

    @abc.abstractmethod
    async def replicas(self) -> dict[str, int]:
        """Workers of each role this connector runs now, draining ones not counted."""

    @abc.abstractmethod
    async def scale(self, role: str, replicas: int, *, busy: Mapping[str, int] | None = None) -> None:
        """Ask for `replicas` workers of `role`. Returns once started ones are launched and stopped ones are
        told to drain; it does not wait for a drain to finish. `busy` (instance id -> requests in flight, the
        router's view, when known): a connector that chooses which workers go drains the least busy first."""
