"""The live mesh page's Planner panel (frontend/http/planner_panel.py) over a stand-in reader.

Locks: /dashboard/state's `planner` is null without a reader; with one it holds
the leader, the targets and the decisions as the planner saved them (newest
first, direction kept or derived, junk entries dropped); the sampler reads at
most every few seconds; a failed or slow read keeps the last state and says
why, and the next good read clears the note; an unreadable state still shows
the leader. The real etcd keys: tests/integration/test_dashboard_planner.py.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from meshllm.errors import Unavailable
from meshllm.frontend.http.dashboard import Dashboard
from meshllm.frontend.http.planner_panel import PlannerPanel, PlannerRead, planner_view
from meshllm.frontend.metrics import FrontendMetrics

NS = "paneltest"
DECISIONS = [
    {"at": 1700000060.0, "role": "decode", "current": 2, "target": 3, "wanted": 3, "reason": "up: ITL p90 over target",
     "direction": "up"},
    {"at": 1700000060.0, "role": "prefill", "current": 1, "target": 1, "wanted": 2, "reason": "cooldown: 40 s left",
     "direction": "hold"},
    {"at": 1700000000.0, "role": "decode", "current": 3, "target": 2, "wanted": 2, "reason": "down"},  # no direction
    "not a decision",
    {"at": True, "role": 7, "current": "2", "target": None, "reason": None},  # wrong types: kept, fields emptied
]  # fmt: skip
STATE = {
    "version": 1, "planner_id": "planner-a", "saved_at": 1700000061.5, "targets": {"ttft_s": 0.5, "itl_s": 0.05},
    "profile": {"ignored": True}, "decisions": DECISIONS,
}  # fmt: skip


def saved(state: Any = STATE, leader: str | None = "planner-a") -> PlannerRead:
    return PlannerRead(NS, leader, json.dumps(state).encode() if state is not None else None)


class Reader:
    """Answers what `answer` holds (a PlannerRead, or an exception to raise) and counts its calls."""

    def __init__(self, answer: PlannerRead | Exception) -> None:
        self.answer = answer
        self.calls = 0

    async def __call__(self) -> PlannerRead:
        self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stub_core() -> Any:
    """What Dashboard.sample() and .state() read of an InferenceCore."""
    return SimpleNamespace(metrics=FrontendMetrics(), admitting=True, inflight=0, registry=SimpleNamespace(list=list))


async def test_without_a_reader_the_state_has_no_planner() -> None:
    dashboard = Dashboard(stub_core())
    await dashboard.sample()
    assert dashboard.state()["planner"] is None


async def test_the_state_shows_the_leader_targets_and_decisions_with_their_reasons() -> None:
    dashboard = Dashboard(stub_core(), planner=Reader(saved()))
    await dashboard.sample()
    p = dashboard.state()["planner"]
    assert p["found"] and p["namespace"] == NS and p["note"] == "" and p["read_at"] is not None
    assert (p["leader"], p["saved_by"], p["saved_at"]) == ("planner-a", "planner-a", 1700000061.5)
    assert p["targets"] == {"ttft_s": 0.5, "itl_s": 0.05}
    assert p["decisions"] == [
        {"at": 1700000060.0, "role": "decode", "current": 2, "target": 3, "wanted": 3,
         "reason": "up: ITL p90 over target", "direction": "up"},
        {"at": 1700000060.0, "role": "prefill", "current": 1, "target": 1, "wanted": 2, "reason": "cooldown: 40 s left",
         "direction": "hold"},
        {"at": 1700000000.0, "role": "decode", "current": 3, "target": 2, "wanted": 2, "reason": "down",
         "direction": "down"},
        {"at": None, "role": "?", "current": None, "target": None, "wanted": None, "reason": "", "direction": "hold"},
    ]  # fmt: skip
    assert "profile" not in p and json.loads(json.dumps(dashboard.state())) is not None  # JSON, and only what it shows


async def test_no_keys_in_etcd_reads_as_no_planner_and_a_standby_state_as_no_leader() -> None:
    view, note = planner_view(PlannerRead(NS, None, None))
    assert (view["found"], view["leader"], view["decisions"], note) == (False, None, [], "")
    view, note = planner_view(saved(leader=None))  # the leader's lease is gone, its last state stays
    assert view["found"] and view["leader"] is None and view["saved_by"] == "planner-a" and len(view["decisions"]) == 4


@pytest.mark.parametrize(
    ("raw", "says"),
    [(b"{not json", "does not parse"), (b"[1, 2]", "a JSON list, not an object")],
)
async def test_an_unreadable_state_still_shows_the_leader_and_says_why(raw: bytes, says: str) -> None:
    view, note = planner_view(PlannerRead(NS, "planner-b", raw))
    assert view["leader"] == "planner-b" and view["found"] and view["decisions"] == []
    assert says in note


async def test_the_sampler_reads_at_most_every_few_seconds() -> None:
    reader, clock = Reader(saved()), Clock()
    dashboard = Dashboard(stub_core(), planner=reader)
    dashboard.planner = PlannerPanel(reader, every_s=5.0, clock=clock)
    for _ in range(5):  # five samples in one second: one read
        await dashboard.sample()
        dashboard.state()
    assert reader.calls == 1
    clock.now += 4.9
    await dashboard.sample()
    assert reader.calls == 1
    clock.now += 0.1
    await dashboard.sample()
    assert reader.calls == 2


async def test_a_failed_read_keeps_the_last_state_and_notes_it_until_a_read_succeeds() -> None:
    reader, clock = Reader(saved()), Clock()
    panel = PlannerPanel(reader, every_s=5.0, clock=clock)
    await panel.refresh()
    first = panel.state()

    reader.answer = Unavailable("etcd at 127.0.0.1:2379 is unavailable")
    clock.now += 5
    await panel.refresh()
    failed = panel.state()
    assert failed["note"] == "the planner state could not be read: Unavailable: etcd at 127.0.0.1:2379 is unavailable"
    assert {k: v for k, v in failed.items() if k != "note"} == {k: v for k, v in first.items() if k != "note"}

    reader.answer = saved(leader="planner-b")
    clock.now += 5
    await panel.refresh()
    assert panel.state()["note"] == "" and panel.state()["leader"] == "planner-b"


async def test_a_read_that_hangs_is_cut_at_the_timeout_and_noted() -> None:
    never = asyncio.Event()

    async def hangs() -> PlannerRead:
        await never.wait()
        raise AssertionError("unreachable")

    panel = PlannerPanel(hangs, timeout_s=0.05)
    await panel.refresh()
    state = panel.state()
    assert state["note"] == "etcd did not answer the planner read within 0.05 s"
    assert state["read_at"] is None and not state["found"]  # nothing read yet: the page says so
