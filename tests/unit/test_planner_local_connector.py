"""The planner's local connector against real processes: a stand-in for `meshllm worker` (tests/unit/planner_standin.py)
that records its argv, drains on SIGTERM (at once, when told, or never) and exits when told.

Nothing here sleeps to synchronise: the stand-in announces itself through files the test waits for
(`wait_until`), takes orders through a FIFO, and its exit is waited on with waitid(WNOWAIT), which leaves the
reaping to the connector.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from planner_standin import Standins, running

from meshllm.errors import ConfigError
from meshllm.planner import local
from meshllm.planner.local import LocalConnector
from meshllm.testing.waiting import wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def standins(tmp_path: Path) -> Iterator[Standins]:
    s = Standins(tmp_path)
    yield s
    s.kill_all()


@pytest.fixture
async def new(standins: Standins) -> AsyncIterator[Any]:
    """new(on_term=..., **connector options) -> a LocalConnector starting stand-ins; closed after the test."""
    made: list[LocalConnector] = []

    def make(on_term: str = "exit", refuse: str = "", **opts: Any) -> LocalConnector:
        c = LocalConnector(standins.flags(on_term, refuse), log_dir=standins.logs, command=standins.command, **opts)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.aclose()


async def exited(pid: int) -> None:
    """Until child `pid` has exited, without reaping it (the connector's Popen does)."""
    await asyncio.to_thread(os.waitid, os.P_PID, pid, os.WEXITED | os.WNOWAIT)


def ids(c: LocalConnector, role: str | None = None) -> list[str]:
    return [r["instance_id"] for r in c.workers() if role is None or r["role"] == role]


async def count(c: LocalConnector, role: str) -> int:
    return (await c.replicas())[role]


class Clock:
    """`time` for meshllm.planner.local, running `offset` seconds ahead of the real clocks."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


# ------------------------------------------------------------------ starting


async def test_scale_up_appends_role_and_instance_id_after_the_template_flags(standins: Standins, new: Any) -> None:
    c = new()
    await c.scale("prefill", 2)
    await c.scale("decode", 1)
    records = c.workers()
    assert sorted(r["role"] for r in records) == ["decode", "prefill", "prefill"]
    assert len(set(ids(c))) == 3
    for r in records:
        seen = await standins.ready(r["instance_id"])
        assert seen["pid"] == r["pid"]
        assert seen["argv"] == [*standins.flags(), "--role", r["role"], "--instance-id", r["instance_id"]]
        assert Path(r["log_path"]).parent == standins.logs and _exists(r["log_path"])
    assert await c.replicas() == {"prefill": 2, "decode": 1, "agg": 0}

    await c.scale("prefill", 2)  # already there: nothing started
    assert sorted(ids(c)) == sorted(r["instance_id"] for r in records)
    with pytest.raises(ValueError, match="unknown worker role"):
        await c.scale("router", 1)


@pytest.mark.parametrize("flags", [["--role", "agg"], ["--engine", "mocker", "--instance-id=w1"], ["--role=prefill"]])
def test_a_template_that_sets_what_the_planner_sets_is_refused(flags: list[str], tmp_path: Path) -> None:
    flag = next(f.split("=", 1)[0] for f in flags if f.split("=", 1)[0] in ("--role", "--instance-id"))
    with pytest.raises(ConfigError, match=f"must not set {flag}"):
        LocalConnector(flags, log_dir=tmp_path)


async def test_a_template_the_worker_refuses_at_once_is_a_config_error_with_its_last_line(new: Any) -> None:
    c = new(refuse="--engine nope: no such engine")

    async def refused() -> bool:
        try:
            await c.replicas()
        except ConfigError as exc:
            assert "meshllm worker: error: --engine nope: no such engine" in exc.message
            assert "loading the engine" not in exc.message  # the last line, not the whole log
            return True
        return False

    await c.scale("agg", 1)
    await wait_until(refused, timeout_s=20, what="the refused template to be a ConfigError")
    assert await c.replicas() == {"prefill": 0, "decode": 0, "agg": 0}  # the refused worker is not counted


async def test_a_refusal_noticed_long_after_the_start_is_still_a_config_error(new: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner looks once an interval (30 s by default): a worker that exited with status 2 at once is a refusal
    even when that is noticed after EARLY_EXIT_S."""
    clock = Clock()
    monkeypatch.setattr(local, "time", clock)
    c = new(refuse="--max-num-seqs must be positive")
    await c.scale("agg", 1)
    await exited(c.workers()[0]["pid"])
    clock.offset = local.EARLY_EXIT_S + 30
    with pytest.raises(ConfigError, match="--max-num-seqs must be positive"):
        await c.replicas()


async def test_status_2_from_a_worker_seen_running_long_after_its_start_is_no_refusal(
    standins: Standins, new: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    monkeypatch.setattr(local, "time", clock)
    c = new()
    await c.scale("agg", 1)
    (record,) = c.workers()
    await standins.ready(record["instance_id"])
    clock.offset = local.EARLY_EXIT_S + 30
    assert await count(c, "agg") == 1  # seen running well past EARLY_EXIT_S
    await standins.tell(record["instance_id"], "2")
    await exited(record["pid"])
    assert await count(c, "agg") == 0
    assert f"agg worker {record['instance_id']} exited by itself (status 2" in caplog.text


# ------------------------------------------------------------------ stopping


async def test_scale_down_drains_the_youngest_counted_as_draining_until_it_exits(standins: Standins, new: Any) -> None:
    c = new(on_term="hold")
    await c.scale("agg", 3)
    order = ids(c)  # in start order
    for i in order:
        await standins.ready(i)
    youngest = order[-1]

    await c.scale("agg", 2)
    assert await count(c, "agg") == 2  # no longer a replica at once
    assert c.draining() == 1
    await wait_until(lambda: standins.got_sigterm(youngest), what="SIGTERM to reach the youngest worker")
    assert not any(standins.got_sigterm(i) for i in order[:-1])
    pid = next(r["pid"] for r in c.workers() if r["instance_id"] == youngest)
    assert running(pid, youngest)  # still draining
    assert c.draining() == 1

    await standins.tell(youngest)  # let its drain end
    await wait_until(lambda: c.draining() == 0, what="draining() to stop counting the worker that exited")
    assert await count(c, "agg") == 2
    assert ids(c) == order[:-1]


async def test_scale_down_drains_the_least_busy_first_then_the_youngest(standins: Standins, new: Any) -> None:
    c = new(on_term="hold")
    await c.scale("agg", 4)
    oldest, second, third, youngest = order = ids(c)
    for i in order:
        await standins.ready(i)
    # the router's requests in flight: the oldest idle, the youngest busiest; second and third tie
    await c.scale("agg", 2, busy={oldest: 0, second: 3, third: 3, youngest: 9})
    await wait_until(lambda: standins.got_sigterm(oldest) and standins.got_sigterm(third), what="SIGTERM to the two that go")
    assert not standins.got_sigterm(second) and not standins.got_sigterm(youngest)
    for i in (oldest, third):
        await standins.tell(i)
    await wait_until(lambda: c.draining() == 0, what="both drains to end")
    assert await count(c, "agg") == 2
    assert ids(c) == [second, youngest]


async def test_a_worker_that_ignores_sigterm_gets_sigkill_after_kill_after_s(
    standins: Standins, new: Any, caplog: pytest.LogCaptureFixture
) -> None:
    c = new(on_term="ignore", kill_after_s=0.5)
    await c.scale("agg", 1)
    (record,) = c.workers()
    await standins.ready(record["instance_id"])
    t0 = time.monotonic()
    await c.scale("agg", 0)
    await wait_until(lambda: standins.got_sigterm(record["instance_id"]), what="SIGTERM to reach the worker")
    assert running(record["pid"], record["instance_id"])  # it ignored it

    async def gone() -> bool:
        await c.replicas()  # kills what outlived kill_after_s, and drops what exited
        return c.workers() == []

    await wait_until(gone, timeout_s=20, what="the worker to be killed")
    assert time.monotonic() - t0 >= 0.5
    assert f"worker {record['instance_id']} still runs 0.5s after SIGTERM; killing it" in caplog.text
    assert not running(record["pid"], record["instance_id"]) and c.workers() == []


async def test_a_worker_that_exits_by_itself_is_dropped_and_logged(
    standins: Standins, new: Any, caplog: pytest.LogCaptureFixture
) -> None:
    c = new()
    await c.scale("decode", 2)
    first, second = ids(c)
    for i in (first, second):
        await standins.ready(i)
    await standins.tell(first, "3")
    await wait_until(lambda: _is(count(c, "decode"), 1), what="the exited worker to be dropped")
    assert ids(c) == [second]
    assert c.draining() == 0
    assert f"decode worker {first} exited by itself (status 3" in caplog.text


def _exists(path: str) -> bool:
    return Path(path).exists()


async def _is(value: Any, expected: int) -> bool:
    return bool(await value == expected)


async def test_stop_on_close_drains_every_worker(standins: Standins, new: Any) -> None:
    c = new(stop_on_close=True)
    await c.scale("agg", 2)
    await c.scale("prefill", 1)
    records = c.workers()
    for r in records:
        await standins.ready(r["instance_id"])
    await c.aclose()
    for r in records:
        assert standins.got_sigterm(r["instance_id"])  # drained (SIGTERM), not killed
        assert not running(r["pid"], r["instance_id"])
    assert c.workers() == []


async def test_by_default_workers_outlive_the_connector(standins: Standins, new: Any) -> None:
    c = new()
    await c.scale("agg", 2)
    records = c.workers()
    for r in records:
        await standins.ready(r["instance_id"])
    await c.aclose()
    for r in records:
        assert running(r["pid"], r["instance_id"])  # still serving, for the next planner
        assert not standins.got_sigterm(r["instance_id"])


async def test_a_worker_spawned_while_its_scale_call_is_cancelled_is_still_tracked(
    standins: Standins, new: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planner stopped mid scale-up (its task cancelled while the spawn thread runs) must not leave a worker
    behind that it neither counts nor drains."""
    c = new(stop_on_close=True)
    entered, release = threading.Event(), threading.Event()
    spawn = c._spawn

    def slow_spawn(role: str) -> Any:
        entered.set()
        release.wait(20)
        return spawn(role)

    monkeypatch.setattr(c, "_spawn", slow_spawn)
    scaling = asyncio.create_task(c.scale("agg", 1))
    await wait_until(entered.is_set, what="the spawn thread to start")
    scaling.cancel()
    with pytest.raises(asyncio.CancelledError):
        await scaling
    release.set()
    await wait_until(lambda: _is(count(c, "agg"), 1), what="the worker spawned meanwhile to be tracked")
    (record,) = c.workers()
    await standins.ready(record["instance_id"])
    await c.aclose()
    assert standins.got_sigterm(record["instance_id"]) and not running(record["pid"], record["instance_id"])


# ------------------------------------------------------------------ adopting


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


async def test_a_new_connector_adopts_the_running_workers_and_nothing_else(standins: Standins, new: Any) -> None:
    before = new()
    await before.scale("agg", 2)
    await before.scale("prefill", 1)
    records = before.workers()
    for r in records:
        await standins.ready(r["instance_id"])
    await before.aclose()  # leaves them running

    template = {"role": "agg", "started_at": time.time(), "log_path": ""}
    dead = {**template, "instance_id": "planner-agg-dead0000", "pid": _dead_pid()}
    reused = {**template, "instance_id": "planner-agg-reused00", "pid": os.getpid()}  # alive, but not that worker
    broken = {"role": "agg", "instance_id": "planner-agg-broken00"}  # no pid
    after = new(stop_on_close=True)
    assert after.adopt([*records, dead, reused, broken, records[0]]) == 3
    assert await after.replicas() == {"agg": 2, "prefill": 1, "decode": 0}
    assert sorted(ids(after)) == sorted(r["instance_id"] for r in records)
    assert after.adopt(records) == 0  # known already

    youngest = max((r for r in records if r["role"] == "agg"), key=lambda r: r["started_at"])
    await after.scale("agg", 1)  # an adopted worker drains like an own one
    await wait_until(lambda: standins.got_sigterm(youngest["instance_id"]), what="SIGTERM to the youngest adopted worker")
    await wait_until(lambda: after.draining() == 0, what="the adopted worker's exit to be noticed")
    assert await after.replicas() == {"agg": 1, "prefill": 1, "decode": 0}
    await after.aclose()
    assert not any(running(r["pid"], r["instance_id"]) for r in records)


async def test_a_worker_draining_when_the_state_was_saved_is_adopted_as_draining(standins: Standins, new: Any) -> None:
    before = new(on_term="hold")
    await before.scale("agg", 2)
    staying, leaving = ids(before)
    for i in (staying, leaving):
        await standins.ready(i)
    await before.scale("agg", 1)
    records = before.workers()
    assert {r["instance_id"]: r["draining"] for r in records} == {staying: False, leaving: True}
    await before.aclose()

    after = new()
    assert after.adopt(records) == 2
    assert await count(after, "agg") == 1  # the leaving one is no replica
    assert after.draining() == 1
    await wait_until(lambda: standins.got_sigterm(leaving), what="SIGTERM to reach the worker told to leave")
    await standins.tell(leaving)  # the drain it holds may end now
    await wait_until(lambda: after.draining() == 0, what="the draining worker to exit")
    assert await count(after, "agg") == 1 and ids(after) == [staying]
