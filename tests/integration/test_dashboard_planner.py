"""The live mesh page's Planner panel over a real etcd (the `etcd_server` fixture) and an in-process frontend.

The planner's two keys are written as a planner writes them (planner/leader.py): the leader's identity under
a lease of its own, the state as JSON without one. Locks: GET /dashboard/state shows the leader, the targets
and the decisions with their reasons once they are in etcd; when the leader's lease goes, "no planner leads"
while the last state stays; with etcd stopped the page keeps that state and says the read failed, and once
etcd is back the note goes. Reads are every second here (every few seconds by default: the cadence is
tests/unit/test_dashboard_planner_panel.py's matter).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from meshllm.bench.http import Connection, Endpoint
from meshllm.config import DiscoveryKind, EventsKind, PlaneConfig
from meshllm.frontend.config import FrontendConfig
from meshllm.frontend.main import Frontend
from meshllm.plane.discovery.etcd import EtcdDiscovery
from meshllm.protocol.names import planner_key
from meshllm.testing.servers import EtcdServer
from meshllm.testing.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

NS = "dashplanner"
STATE = {
    "version": 1, "planner_id": "planner-a", "saved_at": 1700000061.5, "targets": {"ttft_s": 0.5, "itl_s": 0.05},
    "decisions": [
        {"at": 1700000060.0, "role": "decode", "current": 2, "target": 3, "wanted": 3,
         "reason": "up: ITL p90 0.081 s over the 0.05 s target", "direction": "up"},
        {"at": 1700000000.0, "role": "decode", "current": 2, "target": 2, "wanted": 2, "reason": "hold: within target",
         "direction": "hold"},
    ],
}  # fmt: skip


@pytest_asyncio.fixture
async def frontend(etcd_server: EtcdServer) -> AsyncIterator[Frontend]:
    plane = PlaneConfig(discovery=DiscoveryKind.ETCD, etcd_endpoints=(etcd_server.endpoint,), events=EventsKind.NONE,
                        namespace=NS, lease_ttl_s=3)  # fmt: skip
    config = FrontendConfig(plane=plane, http_host="127.0.0.1", http_port=0, grpc=None, router_mode="round-robin")
    async with await Frontend.start(config) as front:
        assert front.dashboard is not None and front.dashboard.planner is not None, "an etcd frontend reads the planner"
        front.dashboard.planner.every_s = 1.0
        yield front


@pytest_asyncio.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[EtcdDiscovery]:
    """The planner's side: a handle of its own on the same etcd."""
    async with await EtcdDiscovery.connect([etcd_server.endpoint], NS) as handle:
        yield handle


async def planner_state(front: Frontend) -> dict[str, Any]:
    conn = Connection(Endpoint.parse(front.url))
    try:
        resp = await conn.get("/dashboard/state")
        assert resp.status == 200, resp.status
        planner: dict[str, Any] = json.loads(await resp.read())["planner"]
    finally:
        await conn.close()
    return planner


async def test_the_state_shows_the_planner_in_etcd_and_follows_its_leader_and_etcd(
    frontend: Frontend, etcd: EtcdDiscovery, etcd_server: EtcdServer
) -> None:
    await wait_until(lambda: _read(frontend), timeout_s=10, what="the first planner read")
    first = await planner_state(frontend)
    assert (first["found"], first["namespace"], first["leader"], first["decisions"]) == (False, NS, None, [])

    leader_key, state_key = planner_key(NS, "leader").encode(), planner_key(NS, "state").encode()
    lease = await etcd.call("grant", lambda c: c.lease(30))
    await etcd.call("put leader", lambda c: c.put(leader_key, b"planner-a", lease=lease.id))
    await etcd.call("put state", lambda c: c.put(state_key, json.dumps(STATE).encode()))

    async def shown() -> bool:
        return (await planner_state(frontend))["leader"] == "planner-a"

    await wait_until(shown, timeout_s=10, what="the leader on /dashboard/state")
    p = await planner_state(frontend)
    assert p["found"] and p["note"] == "" and p["saved_by"] == "planner-a" and p["saved_at"] == 1700000061.5
    assert p["targets"] == {"ttft_s": 0.5, "itl_s": 0.05}
    assert [(d["role"], d["current"], d["target"], d["direction"], d["reason"]) for d in p["decisions"]] == [
        ("decode", 2, 3, "up", "up: ITL p90 0.081 s over the 0.05 s target"),
        ("decode", 2, 2, "hold", "hold: within target"),
    ]

    await etcd.call("revoke", lambda c: c.revoke_lease(lease.id))  # the planner resigned: its key goes, its state stays

    async def no_leader() -> bool:
        return (await planner_state(frontend))["leader"] is None

    await wait_until(no_leader, timeout_s=10, what="no leader on /dashboard/state")
    p = await planner_state(frontend)
    assert p["found"] and p["saved_by"] == "planner-a" and len(p["decisions"]) == 2

    await etcd_server.stop()

    async def noted() -> bool:
        return (await planner_state(frontend))["note"].startswith(("the planner state could not be read", "etcd did not"))

    await wait_until(noted, timeout_s=20, what="a note that etcd cannot be read")
    kept = await planner_state(frontend)
    assert kept["found"] and kept["saved_by"] == "planner-a" and len(kept["decisions"]) == 2  # the last read stays

    await etcd_server.start()

    async def clear() -> bool:
        return (await planner_state(frontend))["note"] == ""

    await wait_until(clear, timeout_s=30, what="the note gone once etcd is back")
    assert (await planner_state(frontend))["saved_by"] == "planner-a"


async def _read(front: Frontend) -> bool:
    return (await planner_state(front))["read_at"] is not None
