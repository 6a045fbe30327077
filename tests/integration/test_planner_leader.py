"""The planner's leader election and saved state against a real etcd (the `etcd_server` fixture).

Two EtcdLeadership candidates on two etcd handles, as two planner processes would hold them; a third handle
plays whoever else touches etcd (an operator revoking a lease). TTLs are 2 s, the least the planner accepts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from meshllm.plane.discovery.etcd import EtcdDiscovery
from meshllm.planner.leader import EtcdLeadership
from meshllm.protocol.names import planner_key
from meshllm.testing.servers import EtcdServer
from meshllm.testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

TTL_S = 2.0
NS = "plannertest"


@pytest_asyncio.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[list[EtcdDiscovery]]:
    """Three etcd handles on one real etcd: two planners' and a bystander's."""
    handles = [await EtcdDiscovery.connect([etcd_server.endpoint], NS) for _ in range(3)]
    yield handles
    for h in handles:
        await h.aclose()


@pytest_asyncio.fixture
async def pair(etcd: list[EtcdDiscovery]) -> AsyncIterator[tuple[EtcdLeadership, EtcdLeadership]]:
    a, b = EtcdLeadership(etcd[0], "planner-a", ttl_s=TTL_S), EtcdLeadership(etcd[1], "planner-b", ttl_s=TTL_S)
    yield a, b
    for leadership in (a, b):
        await leadership.aclose()


async def _leader_lease(bystander: EtcdDiscovery) -> int:
    key = planner_key(NS, "leader").encode()
    got: Any = await bystander.call("get", lambda c: c.get(key))
    assert got is not None, "no leader key"
    return int(got.lease)


async def test_the_first_campaign_wins_and_the_second_waits_until_the_first_resigns(
    pair: tuple[EtcdLeadership, EtcdLeadership], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = pair
    caplog.set_level(logging.INFO, logger="meshllm.planner.leader")
    await a.campaign()
    assert a.leading
    assert await a.leader() == await b.leader() == "planner-a"

    standby = asyncio.create_task(b.campaign())
    await wait_until(lambda: "planner planner-b: standby (planner planner-a leads)" in caplog.text, what="b to stand by")
    assert not standby.done() and not b.leading
    assert await b.leader() == "planner-a" and a.leading

    t0 = time.monotonic()
    await a.resign()
    assert not a.leading and not a.lost.is_set()  # resigning is no loss
    await asyncio.wait_for(standby, timeout=TTL_S / 2 + 3)
    took = time.monotonic() - t0
    assert b.leading and await a.leader() == "planner-b"
    assert took <= TTL_S / 2 + 1.5, f"the standby took {took:.1f}s to take over after a resignation"


async def test_only_the_leader_saves_state_and_anyone_loads_it(
    pair: tuple[EtcdLeadership, EtcdLeadership], etcd: list[EtcdDiscovery]
) -> None:
    a, b = pair
    assert await a.load_state() is None  # nothing saved yet
    await a.campaign()
    state = {"version": 1, "decisions": [{"role": "agg", "target": 2}], "samples": [1.5, 2.0]}
    assert await a.save_state(state) is True
    assert await b.save_state({"version": 1, "from": "b"}) is False  # not the leader: writes nothing
    assert await b.load_state() == state
    assert await a.load_state() == state

    await a.resign()
    assert await a.save_state({"version": 1, "from": "a, resigned"}) is False  # no longer the leader either
    assert await b.load_state() == state

    key = planner_key(NS, "state").encode()
    await etcd[2].call("put", lambda c: c.put(key, b"{not json"))
    assert await b.load_state() is None  # does not parse: start afresh, not crash


async def test_a_leader_whose_lease_is_revoked_behind_its_back_knows_it_lost(
    pair: tuple[EtcdLeadership, EtcdLeadership], etcd: list[EtcdDiscovery]
) -> None:
    a, b = pair
    await a.campaign()
    lease = await _leader_lease(etcd[2])
    await etcd[2].call("revoke", lambda c: c.revoke_lease(lease))
    took = await wait_until(a.lost.is_set, timeout_s=3 * TTL_S, what="the leader to notice its lease is gone")
    assert took <= TTL_S, f"noticed after {took:.1f}s (it refreshes every TTL/3)"
    assert not a.leading
    assert await a.leader() is None
    assert await a.save_state({"version": 1}) is False
    await asyncio.wait_for(b.campaign(), timeout=5)  # the key went with the lease: b wins at its first try
    assert b.leading and await b.leader() == "planner-b"


async def test_the_lease_in_etcd_lasts_at_least_the_ttl_the_leader_counts(etcd: list[EtcdDiscovery]) -> None:
    """A leader counts itself out after its TTL; etcd must not drop its key sooner (2.4 s must not be a 2 s lease)."""
    leadership = EtcdLeadership(etcd[0], "planner-a", ttl_s=2.4)
    try:
        await leadership.campaign()
        lease = await _leader_lease(etcd[2])
        info: Any = await etcd[2].call("lease info", lambda c: c.get_lease_info(lease, keys=False))
        assert info.grantedTTL >= 2.4
    finally:
        await leadership.aclose()


async def test_a_leader_cut_off_by_a_hung_etcd_stands_down_within_its_ttl(
    pair: tuple[EtcdLeadership, EtcdLeadership], etcd_server: EtcdServer
) -> None:
    """etcd stops answering (SIGSTOP: connections stay open, calls hang). By the TTL etcd may have let the key go and
    another planner may lead: the leader must count itself out by then, not when its hung refresh times out."""
    a, _ = pair
    await a.campaign()
    pid = etcd_server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        took = await wait_until(a.lost.is_set, timeout_s=20, what="the cut-off leader to stand down")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert not a.leading
    # Its last refresh was at most TTL/3 before the stop: it counts itself out at most a TTL after that refresh.
    assert took <= TTL_S + 1.0, f"stood down {took:.1f}s after etcd hung; its {TTL_S:g}s lease may have gone long before"
