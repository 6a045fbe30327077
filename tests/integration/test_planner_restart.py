"""A planner's state survives its restart: the next planner (new objects, the same etcd) continues where it stopped.

Real: etcd (the `etcd_server` fixture), the election and the state in it (EtcdLeadership), the local connector
and the processes it starts. Not real: the workers are a stand-in for `meshllm worker`
(tests/unit/planner_standin.py), since what is tested is the state and the adoption of running processes, not
serving (tests/integration/test_planner_local.py runs real workers); and the planner reads the mesh from a
reader-like object over a frontend's real metrics registry, its steps driven one by one on a test clock.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from planner_frontend import Frontend, Request
from planner_standin import Standins, running
from planner_support import make_profile

from meshllm.plane.discovery.etcd import EtcdDiscovery
from meshllm.planner.config import PlanMode, PlannerConfig, RoleBounds
from meshllm.planner.leader import EtcdLeadership
from meshllm.planner.local import LocalConnector
from meshllm.planner.model import Decision
from meshllm.planner.observe import WorkerLoad
from meshllm.planner.service import Planner
from meshllm.served_counts import Counts, read_counts
from meshllm.testing.servers import EtcdServer
from meshllm.testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NS = "restarttest"
INTERVAL_S = 10.0


class Reader:
    """What the planner reads: one frontend's real registry, and the workers the connector runs (as discovery
    would list them once registered)."""

    def __init__(self, frontend: Frontend, connector: LocalConnector) -> None:
        self.frontend = frontend
        self.connector = connector

    async def counts(self, at: float) -> Counts:
        return read_counts(self.frontend.metrics.registry.collect(), at)

    async def workers(self) -> WorkerLoad:
        return WorkerLoad({k: v for k, v in (await self.connector.replicas()).items() if v})

    async def aclose(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def standins(tmp_path: Path) -> Iterator[Standins]:
    s = Standins(tmp_path)
    yield s
    s.kill_all()


@pytest_asyncio.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[list[EtcdDiscovery]]:
    """Two planner processes' etcd handles."""
    handles = [await EtcdDiscovery.connect([etcd_server.endpoint], NS) for _ in range(2)]
    yield handles
    for h in handles:
        await h.aclose()


def _planner(name: str, etcd: EtcdDiscovery, standins: Standins, frontend: Frontend, clock: Clock, **opts: Any) -> Planner:
    config = PlannerConfig(
        ttft_s=0.5, itl_s=0.05, mode=PlanMode.AGGREGATED, bounds={"agg": RoleBounds(1, 4)}, interval_s=INTERVAL_S,
        predictor="constant", down_intervals=2, up_cooldown_s=0.0, down_cooldown_s=600.0,
        etcd_endpoints=("unused",), leader_ttl_s=2.0, planner_id=name,
    )  # fmt: skip
    connector = LocalConnector(standins.flags(), log_dir=standins.logs, command=standins.command, **opts)
    leadership = EtcdLeadership(etcd, name, ttl_s=2.0)
    return Planner(config, reader=Reader(frontend, connector), connector=connector, profile=make_profile(),  # type: ignore[arg-type]
                   leadership=leadership, clock=clock)  # fmt: skip


async def _step(planner: Planner, clock: Clock, frontend: Frontend, requests: int) -> Decision:
    """One interval of `requests` requests (2000-token prompts, 200 tokens out), then the planner's step."""
    for _ in range(requests):
        frontend.serve(Request(isl=2000, osl=200, ttft_s=0.2, itl_s=0.02))
    clock.now += INTERVAL_S
    (decision,) = await planner.step()
    return decision


async def _save(planner: Planner) -> None:
    assert planner.leadership is not None
    assert await planner.leadership.save_state(planner.state())


async def _agg(planner: Planner) -> int:
    return (await planner.connector.replicas())["agg"]


async def test_a_restarted_planner_continues_from_the_state_in_etcd_and_adopts_the_workers(
    etcd: list[EtcdDiscovery], standins: Standins
) -> None:
    frontend, clock = Frontend(), Clock()
    one = _planner("planner-one", etcd[0], standins, frontend, clock)
    assert one.leadership is not None
    await one.leadership.campaign()
    first = await _step(one, clock, frontend, 0)  # the baseline reading: brings the pool to its minimum
    assert (first.current, first.target) == (0, 1)
    busy = await _step(one, clock, frontend, 200)  # 20 req/s of 2000-token prompts: more than 4 workers' worth
    assert busy.direction == "up" and busy.target == 4
    quiet = await _step(one, clock, frontend, 1)  # the load fell: one interval below, of the two a shrink needs
    assert quiet.direction == "hold" and "1 of 2 intervals" in quiet.reason
    await _save(one)
    records = one.connector.workers()  # type: ignore[attr-defined]
    assert len(records) == 4
    for r in records:
        await standins.ready(r["instance_id"])
    saved_predictor, saved_scaler = one.predictor.state(), one.scaler.state()
    saved_decisions = list(one.metrics.recent)
    assert [d["target"] for d in saved_decisions] == [4, 4, 1]  # newest first
    await one.aclose()  # the planner stops: it resigns and leaves its workers serving
    assert all(running(r["pid"], r["instance_id"]) for r in records)

    two = _planner("planner-two", etcd[1], standins, frontend, clock, stop_on_close=True)
    try:
        assert two.leadership is not None
        await two.leadership.campaign()
        saved = await two.leadership.load_state()
        assert saved is not None and saved["planner_id"] == "planner-one"
        two.restore(saved)
        assert two.predictor.state() == saved_predictor
        assert two.scaler.state() == saved_scaler
        assert list(two.metrics.recent) == saved_decisions
        assert await _agg(two) == 4  # adopted, not started anew
        assert sorted(r["instance_id"] for r in two.connector.workers()) == sorted(r["instance_id"] for r in records)  # type: ignore[attr-defined]
        assert len(list(standins.out.glob("*.json"))) == 4

        await _step(two, clock, frontend, 1)  # its own baseline reading
        await _step(two, clock, frontend, 1)
        held = await _step(two, clock, frontend, 1)  # low for long enough, but the restored down cooldown holds
        assert held.target == 4 and "down cooldown" in held.reason, held.reason
        assert len(two.predictor.state()["request_rate"]) == len(saved_predictor["request_rate"]) + 2
        assert list(two.metrics.recent)[-len(saved_decisions) :] == saved_decisions
        assert not any(standins.got_sigterm(r["instance_id"]) for r in records)
    finally:
        await two.aclose()
    assert all(standins.got_sigterm(r["instance_id"]) for r in records)
    await wait_until(lambda: not any(running(r["pid"], r["instance_id"]) for r in records), what="the workers to stop")


async def test_a_planner_leading_again_does_not_count_its_own_decisions_twice(
    etcd: list[EtcdDiscovery], standins: Standins
) -> None:
    frontend, clock = Frontend(), Clock()
    planner = _planner("planner-one", etcd[0], standins, frontend, clock, stop_on_close=True)
    try:
        assert planner.leadership is not None
        await planner.leadership.campaign()
        await _step(planner, clock, frontend, 0)
        await _step(planner, clock, frontend, 200)
        await _save(planner)
        decisions = list(planner.metrics.recent)
        saved = await planner.leadership.load_state()
        assert saved is not None
        planner.restore(saved)  # what run() does each time it wins the election again
        assert list(planner.metrics.recent) == decisions
        assert await _agg(planner) == 4  # its own workers, known already: none adopted twice
    finally:
        await planner.aclose()
