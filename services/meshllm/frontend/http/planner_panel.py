"""The live mesh page's Planner panel: which planner leads, its SLA targets and its recent decisions with their reasons.

The SLA planner (`meshllm planner`, docs/planner.md) keeps two etcd keys in the
namespace: `planner_key(ns, "leader")`, the elected planner's identity (bound to
its lease: gone when no planner leads), and `planner_key(ns, "state")`, the JSON
it saves after each interval (`planner_id`, `saved_at`, `targets` {ttft_s,
itl_s}, `decisions` newest first, each with at, role, current, target, wanted,
reason, direction). The frontend reads them through its own discovery handle
(`EtcdDiscovery.call`: one range read, both keys at one revision) and never
imports the planner's code; a frontend whose discovery is not etcd has no
reader and the page hides the panel (a planner always keeps its state in etcd).

The dashboard's sampler calls `PlannerPanel.refresh` once a second; it reads
at most every `REFRESH_S` seconds, bounded by `READ_TIMEOUT_S`, never per poll
of the page. A failed read keeps what the last one found and says why in
`note`; a state that does not parse shows the leader and the note.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshllm.protocol.names import planner_key

if TYPE_CHECKING:
    from meshllm.plane.discovery.etcd import EtcdDiscovery

__all__ = ["PlannerPanel", "PlannerRead", "PlannerReader", "etcd_planner_reader", "planner_view"]

log = logging.getLogger(__name__)

REFRESH_S = 5.0  # the planner decides once an interval (a minute by default): a few seconds late is fresh enough
READ_TIMEOUT_S = 2.0  # the sampler waits no longer (its chart points are due once a second)
SHOWN_DECISIONS = 50  # the planner keeps as many (planner/metrics.py KEPT_DECISIONS)
DIRECTIONS = ("up", "down", "hold")


@dataclass(frozen=True, slots=True)
class PlannerRead:
    """What one read found: the leader's identity and the saved state (JSON bytes), each None when absent."""

    namespace: str
    leader: str | None
    state: bytes | None


PlannerReader = Callable[[], Awaitable[PlannerRead]]


def etcd_planner_reader(discovery: EtcdDiscovery) -> PlannerReader:
    """A reader of the planner's keys in `discovery`'s namespace (one etcd range read a call)."""
    namespace = discovery.namespace
    leader_key, state_key = planner_key(namespace, "leader").encode(), planner_key(namespace, "state").encode()
    prefix = planner_key(namespace, "").encode()  # .../planner/: both keys in one read

    async def read() -> PlannerRead:
        got = await discovery.call("read the planner's state", lambda c: c.get_prefix(prefix))
        found = {kv.key: kv.value for kv in got}
        leader = found.get(leader_key)
        return PlannerRead(namespace, leader.decode(errors="replace") if leader is not None else None, found.get(state_key))

    return read


def planner_view(read: PlannerRead) -> tuple[dict[str, Any], str]:
    """The panel's data from one read, and a note when the saved state is unreadable."""
    state: dict[str, Any] = {}
    note = ""
    if read.state is not None:
        try:
            parsed = json.loads(read.state)
        except ValueError as exc:
            parsed, note = None, f"the planner state in etcd does not parse: {exc}"
        if isinstance(parsed, dict):
            state = parsed
        elif not note:
            note = f"the planner state in etcd is a JSON {type(parsed).__name__}, not an object"
    targets = state.get("targets")
    raw = state.get("decisions")
    decisions = [d for d in map(_decision, raw if isinstance(raw, list) else []) if d is not None]
    view = {
        "namespace": read.namespace,
        "found": read.leader is not None or read.state is not None,
        "leader": read.leader,
        "saved_by": _text(state.get("planner_id")),
        "saved_at": _number(state.get("saved_at")),
        "targets": {k: _number(targets.get(k)) for k in ("ttft_s", "itl_s")} if isinstance(targets, dict) else None,
        "decisions": decisions[:SHOWN_DECISIONS],
    }
    return view, note


def _decision(d: Any) -> dict[str, Any] | None:
    if not isinstance(d, dict):
        return None
    current, target = _integer(d.get("current")), _integer(d.get("target"))
    direction = d.get("direction")
    if direction not in DIRECTIONS:  # an older or foreign writer: derive it as the planner does
        direction = "hold"
        if current is not None and target is not None:
            direction = "up" if target > current else "down" if target < current else "hold"
    return {
        "at": _number(d.get("at")), "role": _text(d.get("role")) or "?", "current": current, "target": target,
        "wanted": _integer(d.get("wanted")), "reason": _text(d.get("reason")) or "", "direction": direction,
    }  # fmt: skip


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _integer(v: Any) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _text(v: Any) -> str | None:
    return v if isinstance(v, str) else None


class PlannerPanel:
    """The last planner state read, refreshed at most every `every_s` seconds; errors kept as a note."""

    def __init__(
        self,
        read: PlannerReader,
        *,
        every_s: float = REFRESH_S,
        timeout_s: float = READ_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.every_s = every_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._due = -float("inf")
        self._view: dict[str, Any] | None = None  # what the last good read found
        self._read_at: float | None = None  # when (wall clock)
        self._problem = ""  # what was wrong with the state the last good read found
        self._failure = ""  # why the latest read failed ("" when it did not)

    async def refresh(self) -> None:
        """Read the planner's keys when the last read is `every_s` old; a failure keeps the last view."""
        now = self._clock()
        if now < self._due:
            return
        self._due = now + self.every_s
        try:
            async with asyncio.timeout(self.timeout_s):
                got = await self._read()
        except TimeoutError:
            self._failed(f"etcd did not answer the planner read within {self.timeout_s:g} s")
        except Exception as exc:  # whatever the read raised, the page keeps its last view and says why
            self._failed(f"the planner state could not be read: {type(exc).__name__}: {exc}")
        else:
            if self._failure:
                log.info("dashboard: the planner state is read again")
            self._view, self._problem = planner_view(got)
            self._read_at, self._failure = time.time(), ""

    def _failed(self, why: str) -> None:
        if why != self._failure:
            log.warning("dashboard: %s (the page keeps the last state read)", why)
        self._failure = why

    def state(self) -> dict[str, Any]:
        """The panel's part of /dashboard/state (see the module docstring)."""
        view = self._view or {
            "namespace": None, "found": False, "leader": None, "saved_by": None, "saved_at": None, "targets": None,
            "decisions": [],
        }  # fmt: skip
        return {**view, "read_at": self._read_at, "note": self._failure or self._problem}
