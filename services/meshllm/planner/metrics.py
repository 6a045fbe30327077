"""The planner's Prometheus metrics and the decisions it keeps for the dashboard (with their reasons)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Info

from meshllm.planner.model import Decision, Load, Observation

__all__ = ["PlannerMetrics"]

KEPT_DECISIONS = 50  # the most recent changes (and holds that explain them) shown on the dashboard


class PlannerMetrics:
    def __init__(self, planner_id: str, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        Info("meshllm_planner", "This planner", registry=r).info({"planner_id": planner_id})
        self.leader = Gauge("meshllm_planner_leader", "1 while this planner leads (0: standby)", registry=r)
        self.workers = Gauge("meshllm_planner_workers", "Workers the connector runs, by role", ["role"], registry=r)
        self.target = Gauge("meshllm_planner_target_workers", "Workers last asked for, by role", ["role"], registry=r)
        self.needed = Gauge(
            "meshllm_planner_needed_workers", "Workers the predicted load needs (fractional), by role", ["role"], registry=r
        )
        self.decisions = Counter(
            "meshllm_planner_decisions", "Decisions by role, direction (up/down/hold) and rule",
            ["role", "direction", "rule"], registry=r,
        )  # fmt: skip
        self.predicted = Gauge(
            "meshllm_planner_predicted", "Next interval's predicted load: request_rate, isl, osl", ["what"], registry=r
        )
        self.observed = Gauge(
            "meshllm_planner_observed",
            "Last interval: request_rate, isl, osl, ttft_p90_s, itl_p90_s, waiting, kv_usage",
            ["what"],
            registry=r,
        )
        self.failures = Counter("meshllm_planner_interval_failures", "Intervals that could not be read or acted on", registry=r)
        self.recent: deque[dict[str, Any]] = deque(maxlen=KEPT_DECISIONS)

    def record(self, obs: Observation, load: Load, needed: dict[str, float], decisions: Iterable[Decision]) -> None:
        for what in ("request_rate", "isl", "osl"):
            self.predicted.labels(what).set(getattr(load, what))
        self.observed.labels("request_rate").set(obs.request_rate)
        self.observed.labels("waiting").set(obs.waiting)
        for what in ("isl", "osl", "ttft_p90_s", "itl_p90_s", "kv_usage"):
            value = getattr(obs, what)
            if value is not None:
                self.observed.labels(what).set(value)
        for role, n in needed.items():
            self.needed.labels(role).set(n)
        self.decided(decisions)

    def decided(self, decisions: Iterable[Decision]) -> None:
        """Count the decisions, set the targets, keep them for the dashboard (also the first interval's, which
        has no observation yet but may already bring a role up to its minimum)."""
        for d in decisions:
            self.decisions.labels(d.role, d.direction, rule_of(d.reason)).inc()
            self.target.labels(d.role).set(d.target)
            self.recent.appendleft({**asdict(d), "direction": d.direction})

    def set_workers(self, replicas: dict[str, int]) -> None:
        for role, n in replicas.items():
            self.workers.labels(role).set(n)


def rule_of(reason: str) -> str:
    """A reason's first word (its rule, e.g. "up", "hold", "cooldown"), a bounded label value."""
    word = reason.split(":", 1)[0].split(" ", 1)[0].strip().lower()
    return word if word.isalpha() and len(word) <= 16 else "other"
