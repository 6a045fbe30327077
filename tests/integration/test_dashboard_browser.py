"""The live mesh page in a real headless Chromium, over a split mesh of real processes (issue 16).

Two mocker workers and a frontend (embedded routing core) over real etcd and
nats-server; Chromium loads /dashboard through the DevTools protocol
(meshllm.testing.chromium). Locks: the page loads with no console errors,
shows both workers healthy, the routing decisions with both candidates'
costs, and chart lines once requests ran; when one worker is killed
(SIGKILL), the same page — never reloaded — drops it and shows the
worker-left event, still without errors. A planner's leader and state,
written to etcd as a planner writes them, show in the Planner panel: the
leader, and its decisions with the change set apart from the hold.

The screenshot goes to the test's tmp dir, and to the path in
$MESHLLM_DASHBOARD_SCREENSHOT when set (docs/dashboard.png is made that way).
Skipped, with the reason, when no Chromium is installed (`make servers`
installs Debian's `chromium`).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from meshllm.plane.discovery.etcd import EtcdDiscovery
from meshllm.protocol.names import planner_key
from meshllm.testing.chromium import Chromium, Page, find_chromium
from meshllm.testing.mesh import ProcessMesh, stream_completion
from meshllm.testing.servers import EtcdServer, NatsServer
from meshllm.testing.waiting import wait_until

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(find_chromium() is None, reason="no chromium on PATH (make servers installs Debian's chromium)"),
]

ROWS = "[...document.querySelectorAll('#workers tr[data-worker]')].map((r) => [r.dataset.worker, r.dataset.health])"
CANDIDATES = (
    "[...document.querySelectorAll('#decisions details')]"
    ".map((d) => [...d.querySelectorAll('tbody td:first-child')].map((td) => td.textContent).sort())"
)
EVENTS = "[...document.querySelectorAll('#events li[data-kind]')].map((li) => li.dataset.kind + ' ' + li.textContent)"
LINES = "document.querySelectorAll('#chart-rate polyline, #chart-e2e polyline').length"
UPDATED = "Number(document.body.dataset.updated || 0)"
PLANNER = (
    "[document.getElementById('planner').hidden, document.getElementById('planner').dataset.leader,"
    " [...document.querySelectorAll('#planner-decisions tr[data-direction]')].map((r) => [r.className, r.textContent])]"
)
PLANNER_SHOWN = "document.getElementById('planner').dataset.leader === 'planner-a'"
PLANNER_STATE = {
    "version": 1, "planner_id": "planner-a", "saved_at": 1700000061.5, "targets": {"ttft_s": 0.5, "itl_s": 0.05},
    "decisions": [
        {"at": 1700000060.0, "role": "decode", "current": 2, "target": 3, "wanted": 3,
         "reason": "up: ITL p90 0.081 s over the 0.05 s target", "direction": "up"},
        {"at": 1700000000.0, "role": "decode", "current": 2, "target": 2, "wanted": 2, "reason": "hold: within target",
         "direction": "hold"},
    ],
}  # fmt: skip


async def shows(page: Page, workers: dict[str, str]) -> bool:
    """Whether the page's worker table is exactly `workers` (id -> health)."""
    return dict(await page.evaluate(ROWS)) == workers


async def truthy(page: Page, expression: str) -> bool:
    return bool(await page.evaluate(expression))


async def write_planner(etcd: EtcdServer) -> None:
    """A planner's keys in the default namespace: its identity (under a lease, as it holds it) and its state."""
    async with await EtcdDiscovery.connect([etcd.endpoint], "meshllm") as handle:
        lease = await handle.call("grant", lambda c: c.lease(120))
        await handle.call("put", lambda c: c.put(planner_key("meshllm", "leader").encode(), b"planner-a", lease=lease.id))
        await handle.call("put", lambda c: c.put(planner_key("meshllm", "state").encode(), json.dumps(PLANNER_STATE).encode()))


async def test_the_dashboard_shows_the_mesh_and_follows_a_worker_killed(tmp_path: Path) -> None:
    async with (
        EtcdServer() as etcd,
        NatsServer() as nats,
        ProcessMesh(etcd.endpoint, nats.url, lease_ttl_s=2.0) as mesh,
    ):
        await write_planner(etcd)
        await mesh.worker("w1")
        victim, _ = await mesh.worker("w2")
        _, url = await mesh.frontend(workers=2)
        prompts = [{"model": "mocker", "prompt": f"dashboard prompt {i} " * 20, "max_tokens": 8} for i in range(8)]
        results = await asyncio.gather(*(stream_completion(url, body, timeout_s=30) for body in prompts))
        assert all(r.ok for r in results), [r.error for r in results]

        async with Chromium.start() as browser:
            page = await browser.open(f"{url}/dashboard")
            await wait_until(
                lambda: shows(page, {"w1": "healthy", "w2": "healthy"}), timeout_s=15, what="both workers shown healthy"
            )
            await wait_until(lambda: truthy(page, LINES), timeout_s=15, what="chart lines")
            tables = await page.evaluate(CANDIDATES)
            assert tables and all(t == ["w1", "w2"] for t in tables), tables  # every decision weighed both
            await wait_until(lambda: truthy(page, PLANNER_SHOWN), timeout_s=15, what="the planner panel")
            hidden, leader, rows = await page.evaluate(PLANNER)
            assert (hidden, leader) == (False, "planner-a"), (hidden, leader)
            assert [cls for cls, _ in rows] == ["change", "hold"], rows
            assert "2 → 3" in rows[0][1] and "over the 0.05 s target" in rows[0][1], rows

            victim.kill9()
            loaded_at = await page.evaluate(UPDATED)
            await wait_until(lambda: shows(page, {"w1": "healthy"}), timeout_s=20, what="w2 gone from the page")
            events = await page.evaluate(EVENTS)
            assert any(e.startswith("worker-left") and "w2" in e for e in events), events
            assert await page.evaluate(UPDATED) > loaded_at  # the same page updated itself
            assert page.errors == [], page.errors

            png = await page.screenshot()
            assert png.startswith(b"\x89PNG")
            for target in (tmp_path / "dashboard.png", os.environ.get("MESHLLM_DASHBOARD_SCREENSHOT")):
                if target:
                    Path(target).write_bytes(png)  # noqa: ASYNC240  # a small file, once
