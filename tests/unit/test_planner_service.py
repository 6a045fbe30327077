"""The planner's loop (service.py) and its metrics (metrics.py), one unit: its reader, connector and leadership
are fakes here (tests/integration/test_planner_restart.py runs it on a real etcd and real processes)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import pytest
from planner_frontend import Frontend, Request
from planner_support import make_profile
from prometheus_client import CollectorRegistry

from meshllm.errors import CannotConnect, ConfigError
from meshllm.planner.config import PlanMode, PlannerConfig, RoleBounds
from meshllm.planner.metrics import PlannerMetrics, rule_of
from meshllm.planner.model import Connector
from meshllm.planner.observe import WorkerLoad
from meshllm.planner.service import STATE_VERSION, Planner
from meshllm.served_counts import Counts, read_counts
from meshllm.testing.waiting import wait_until

pytestmark = pytest.mark.timeout(30)


class FakeConnector(Connector):
    kind = "fake"

    def __init__(self, order: list[str], fail: Exception | None = None) -> None:
        self.counts = {"agg": 0}
        self.order = order
        self.fail = fail
        self.busy: Mapping[str, int] | None = None

    async def replicas(self) -> dict[str, int]:
        if self.fail is not None:
            raise self.fail
        return dict(self.counts)

    async def scale(self, role: str, replicas: int, *, busy: Mapping[str, int] | None = None) -> None:
        self.counts[role] = replicas
        self.busy = busy

    async def _aclose(self) -> None:
        self.order.append("connector")


class FakeReader:
    def __init__(self, frontend: Frontend, order: list[str], fail: Exception | None = None) -> None:
        self.frontend = frontend
        self.order = order
        self.fail = fail
        self.reads = 0

    async def counts(self, at: float) -> Counts:
        self.reads += 1
        if self.fail is not None:
            raise self.fail
        return read_counts(self.frontend.metrics.registry.collect(), at)

    async def workers(self) -> WorkerLoad:
        return WorkerLoad({}, waiting=5, kv_usage=0.25, busy={"w1": 2, "w2": 0})

    async def aclose(self) -> None:
        self.order.append("reader")


class FakeLeadership:
    def __init__(self, order: list[str]) -> None:
        self.order = order

    async def aclose(self) -> None:
        self.order.append("leadership")


def _planner(
    order: list[str] | None = None, *, reader_fail: Exception | None = None, connector_fail: Exception | None = None
) -> Planner:
    order = [] if order is None else order
    config = PlannerConfig(mode=PlanMode.AGGREGATED, bounds={"agg": RoleBounds(1, 4)}, interval_s=1.0, predictor="constant",
                           down_cooldown_s=600.0, planner_id="planner-unit")  # fmt: skip
    metrics = PlannerMetrics("planner-unit", registry=CollectorRegistry())
    return Planner(config, reader=FakeReader(Frontend(), order, reader_fail), connector=FakeConnector(order, connector_fail),  # type: ignore[arg-type]
                   profile=make_profile(), leadership=None, metrics=metrics, clock=lambda: 1000.0)  # fmt: skip


def _sample(metrics: PlannerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_the_first_reading_brings_a_role_to_its_minimum_and_says_so_in_the_metrics() -> None:
    planner = _planner()
    (decision,) = await planner.step()
    assert (decision.current, decision.target, decision.direction) == (0, 1, "up")
    assert await planner.connector.replicas() == {"agg": 1}
    m = planner.metrics
    assert _sample(m, "meshllm_planner_target_workers", role="agg") == 1
    assert _sample(m, "meshllm_planner_decisions_total", role="agg", direction="up", rule="up") == 1
    assert [d["target"] for d in m.recent] == [1] and m.recent[0]["reason"].startswith("up: below min 1")


async def test_a_full_interval_records_what_it_observed_predicted_and_needed() -> None:
    planner = _planner()
    reader: FakeReader = planner.reader  # type: ignore[assignment]
    await planner.step()
    for _ in range(30):
        reader.frontend.serve(Request(isl=400, osl=50))
    planner.clock = lambda: 1010.0
    (decision,) = await planner.step()
    m = planner.metrics
    assert _sample(m, "meshllm_planner_observed", what="request_rate") == pytest.approx(3.0)
    assert _sample(m, "meshllm_planner_observed", what="isl") == 400
    assert _sample(m, "meshllm_planner_observed", what="waiting") == 5  # the router's queues and KV use (ListWorkers)
    assert _sample(m, "meshllm_planner_observed", what="kv_usage") == 0.25
    assert _sample(m, "meshllm_planner_predicted", what="osl") == 50
    assert _sample(m, "meshllm_planner_needed_workers", role="agg") is not None
    assert _sample(m, "meshllm_planner_workers", role="agg") == 1
    assert m.recent[0]["at"] == 1010.0 and m.recent[0]["target"] == decision.target


async def test_a_decode_correction_carries_over_an_interval_that_saturated_the_pool() -> None:
    planner = _planner()
    reader: FakeReader = planner.reader  # type: ignore[assignment]
    await planner.step()
    for _ in range(30):  # 150 tokens/s at 50-ms ITLs: slower than the profile, measured
        reader.frontend.serve(Request(isl=400, osl=50, itl_s=0.05))
    planner.clock = lambda: 1010.0
    await planner.step()
    measured = planner.corrections.decode
    assert measured > 1.5
    for _ in range(500):  # 2,500 tokens/s on one worker: past the profile's peak, its ITLs say nothing
        reader.frontend.serve(Request(isl=400, osl=50, itl_s=0.2))
    planner.clock = lambda: 1020.0
    await planner.step()
    assert planner.corrections.decode == measured


async def test_a_scaling_tells_the_connector_how_busy_each_worker_is() -> None:
    planner = _planner()
    reader: FakeReader = planner.reader  # type: ignore[assignment]
    connector: FakeConnector = planner.connector  # type: ignore[assignment]
    await planner.step()  # first reading: up to the minimum, no worker known yet
    assert connector.busy is None
    connector.counts["agg"] = 4  # above the need of an idle mesh; the scale-down waits out its cooldown
    planner.scaler.down_cooldown_s = 0.0
    for t in (1010.0, 1020.0, 1030.0, 1040.0):
        reader.frontend.serve(Request(isl=400, osl=50))
        planner.clock = lambda t=t: t  # type: ignore[misc]
        await planner.step()
        if connector.counts["agg"] < 4:
            break
    assert connector.counts["agg"] < 4 and connector.busy == {"w1": 2, "w2": 0}


def test_a_reason_is_counted_by_its_rule() -> None:
    assert rule_of("up: need 3.2; prefill ...") == "up"
    assert rule_of("hold: down cooldown 30 s left (need 1.0)") == "hold"
    assert rule_of("at max 4 (need 8.4)") == "at"
    assert rule_of("42 workers") == "other"  # never an unbounded label value


def _state(planner: Planner, **changes: Any) -> dict[str, Any]:
    return {**planner.state(), **changes}


async def test_a_state_whose_history_does_not_parse_is_ignored_whole_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    source = _planner()
    await source.step()
    good = source.state()
    for broken in (
        _state(source, scaler={"version": 99}),
        _state(source, predictor={"request_rate": ["many"]}),
        _state(source, decisions=[17]),
    ):
        planner = _planner()
        planner.restore(broken)
        assert planner.scaler.state() == _planner().scaler.state()  # nothing of it taken
        assert planner.predictor.state() == _planner().predictor.state()
        assert list(planner.metrics.recent) == []
    assert "does not parse" in caplog.text
    planner = _planner()
    planner.restore({**good, "version": STATE_VERSION + 1})
    assert list(planner.metrics.recent) == []
    planner.restore(good)
    assert list(planner.metrics.recent) == good["decisions"] and planner.scaler.state() == good["scaler"]


async def test_restoring_the_same_state_twice_keeps_each_decision_once() -> None:
    planner = _planner()
    await planner.step()
    state = planner.state()
    assert state["decisions"]
    planner.restore(state)  # leading again: run() restores what this planner itself saved
    planner.restore(state)
    assert list(planner.metrics.recent) == state["decisions"]


async def test_closing_resigns_before_the_connector_stops_its_workers() -> None:
    order: list[str] = []
    planner = _planner(order)
    planner.leadership = FakeLeadership(order)  # type: ignore[assignment]
    await planner.aclose()
    assert order == ["leadership", "connector", "reader"]


async def test_an_interval_that_cannot_read_the_mesh_is_counted_and_the_next_one_tries_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="meshllm.planner.service")
    planner = _planner(reader_fail=CannotConnect("frontend 127.0.0.1:8000 is down"))
    reader: FakeReader = planner.reader  # type: ignore[assignment]
    running = asyncio.create_task(planner.run())
    try:
        await wait_until(lambda: reader.reads >= 2, timeout_s=10, what="a second interval after a failed one")
        assert not running.done()
        assert _sample(planner.metrics, "meshllm_planner_interval_failures_total") >= 1  # type: ignore[operator]
        assert "interval skipped: frontend 127.0.0.1:8000 is down" in caplog.text
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_a_refused_worker_template_ends_the_planner() -> None:
    planner = _planner(connector_fail=ConfigError("the worker template was refused: bad flag"))
    with pytest.raises(ConfigError, match="bad flag"):
        await asyncio.wait_for(planner.run(), timeout=10)
