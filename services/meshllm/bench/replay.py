"""Replaying trace requests: open loop (arrivals follow the timestamps) or closed loop (fixed concurrency), bounded.

The replayer schedules; a `Send` coroutine delivers one request and returns
its `RequestRecord` (never raising for a failed request: it sets
`record.error`). `meshllm.bench.main.HttpSender` sends to an OpenAI endpoint;
a benchmark can pass its own (e.g. straight into a `RouterCore`).

- **open loop**: request i is sent at `start + arrival_s` whatever is still
  in flight, so requests overlap as the trace says; if the sender falls
  behind, `max_lag_s` says by how much.
- **closed loop**: `concurrency` users each send the next request in trace
  order as soon as their previous one ends; timestamps are ignored.

Bounded: the run stops at `deadline_s`; when the first request to end
failed (no server, wrong model: waiting for the next arrival would not
help); or after `max_consecutive_errors` requests in a row failed (a server
that died or refuses). It cancels what is in flight; `ReplayResult.stopped`
says why, and every request not completed has a record saying so.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from meshllm.bench.report import LevelResult, RequestRecord, percentile, summarize
from meshllm.bench.trace import TraceRequest

__all__ = ["Arrival", "ReplayMode", "ReplayResult", "Send", "replay"]


class Arrival(Protocol):
    """What the replayer needs of a request: when to send it (open loop), seconds from the start."""

    @property
    def arrival_s(self) -> float: ...


R = TypeVar("R", bound=Arrival)
Send = Callable[[TraceRequest], Awaitable[RequestRecord]]


class ReplayMode(enum.StrEnum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayResult:
    """One replay: `records[i]` belongs to `requests[i]` of the replay call."""

    mode: ReplayMode
    concurrency: int  # closed loop: the users; open loop: the most requests that were in flight at once
    records: list[RequestRecord]
    duration_s: float
    max_lag_s: float  # open loop: the latest any request was sent after its arrival time
    stopped: str | None = None  # why the run ended early, None when every request ran

    def summary(self, *, slo: Mapping[str, float] | None = None, request_rate: float | None = None) -> LevelResult:
        """The same figures as `meshllm bench` (TTFT, ITL, e2e, req/s, ...), one row; `request_rate` marks rate mode."""
        mode = "rate" if request_rate is not None else self.mode.value
        return summarize(self.concurrency, self.records, self.duration_s, mode=mode, request_rate=request_rate, slo=slo)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.records if r.error is None)

    @property
    def cached_tokens(self) -> int | None:
        """Cached prompt tokens over the completed requests; None when the endpoint reported none."""
        values = [r.cached_tokens for r in self.records if r.error is None]
        if not values or any(v is None for v in values):
            return None
        return sum(v for v in values if v is not None)

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate (cached / prompt tokens of completed requests); NaN when not reported."""
        cached = self.cached_tokens
        return cached / self.prompt_tokens if cached is not None and self.prompt_tokens else math.nan

    def ttft_ms(self, q: float) -> float:
        return percentile([r.ttft for r in self.records if r.error is None and r.ttft is not None], q) * 1000.0

    def e2e_ms(self, q: float) -> float:
        return percentile([r.e2e for r in self.records if r.error is None], q) * 1000.0

    def describe(self) -> str:
        """One line beside the table: p90s, cache hits, how the load was applied, why it stopped."""
        hit = "not reported" if math.isnan(self.hit_rate) else f"{self.hit_rate:.1%}"
        load = (
            f"open loop, up to {self.concurrency} in flight, sends up to {self.max_lag_s * 1000:,.0f} ms late"
            if self.mode is ReplayMode.OPEN
            else f"closed loop, {self.concurrency} user{'s' if self.concurrency > 1 else ''}"
        )
        line = (
            f"{load}; TTFT p90 {_ms(self.ttft_ms(90), '.1f')}, e2e p90 {_ms(self.e2e_ms(90), ',.0f')} / "
            f"p99 {_ms(self.e2e_ms(99), ',.0f')}; prefix-cache hit rate {hit}"
        )
        return line if self.stopped is None else f"{line}\nSTOPPED EARLY: {self.stopped}"


def _ms(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else f"{value:{spec}} ms"


# size: the replay loop with its open/closed modes, stop rules and cleanup in one place: the finally must see every exit
async def replay(
    requests: Sequence[R],
    send: Callable[[R], Awaitable[RequestRecord]],
    *,
    mode: ReplayMode = ReplayMode.OPEN,
    concurrency: int = 1,
    deadline_s: float | None = None,
    max_consecutive_errors: int | None = 10,
    on_done: Callable[[RequestRecord], None] | None = None,
    max_in_flight: int | None = None,
) -> ReplayResult:
    """Send every request (see the module docstring); returns when all ended or the run was stopped.

    Any request type with an `arrival_s` works (`TraceRequest`, the
    synthetic `BenchRequest`). `max_in_flight` caps an open loop: a request
    due while that many are in flight waits for one to end (its lateness
    shows in `max_lag_s`).
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError("max_in_flight must be >= 1")
    run = _Run(requests, send, max_consecutive_errors, on_done, max_in_flight)
    t0 = time.perf_counter()
    if mode is ReplayMode.OPEN:
        drive = asyncio.create_task(run.open_loop(t0))
    else:
        drive = asyncio.create_task(run.closed_loop(min(concurrency, max(len(requests), 1))))
    failed = asyncio.create_task(run.failed.wait())
    try:
        done, _ = await asyncio.wait({drive, failed}, timeout=deadline_s, return_when=asyncio.FIRST_COMPLETED)
        if drive not in done:
            if run.stopped is None:
                run.stopped = f"the deadline of {deadline_s:g} s passed with requests still to go"
            drive.cancel()
        try:
            await drive
        except asyncio.CancelledError:
            if not drive.cancelled():
                raise  # our caller was cancelled, not just the drive
    finally:
        failed.cancel()
        drive.cancel()
    duration = time.perf_counter() - t0
    reason = run.stopped or "not completed"
    records = [r if r is not None else RequestRecord(error=f"not completed: {reason}") for r in run.records]
    return ReplayResult(
        mode=mode,
        concurrency=run.peak if mode is ReplayMode.OPEN else min(concurrency, max(len(requests), 1)),
        records=records,
        duration_s=duration,
        max_lag_s=run.max_lag,
        stopped=run.stopped,
    )


class _Run(Generic[R]):
    """The state one replay shares between its tasks."""

    def __init__(
        self,
        requests: Sequence[R],
        send: Callable[[R], Awaitable[RequestRecord]],
        max_consecutive_errors: int | None,
        on_done: Callable[[RequestRecord], None] | None,
        max_in_flight: int | None = None,
    ) -> None:
        self.requests, self.send = requests, send
        self.slots = asyncio.Semaphore(max_in_flight) if max_in_flight is not None else None
        self.records: list[RequestRecord | None] = [None] * len(requests)
        self.max_errors, self.on_done = max_consecutive_errors, on_done
        self.errors_in_a_row = 0
        self.succeeded = False
        self.in_flight = self.peak = 0
        self.max_lag = 0.0
        self.stopped: str | None = None
        self.failed = asyncio.Event()

    async def one(self, i: int) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            rec = await self.send(self.requests[i])
        finally:
            self.in_flight -= 1
        self.records[i] = rec
        if self.on_done is not None:
            self.on_done(rec)
        if rec.error is None:
            self.errors_in_a_row, self.succeeded = 0, True
            return
        self.errors_in_a_row += 1
        if self.stopped is not None:
            return
        if not self.succeeded:
            self.stopped = f"the first request to end failed: {rec.error}"
        elif self.max_errors is not None and self.errors_in_a_row >= self.max_errors:
            self.stopped = f"{self.errors_in_a_row} requests in a row failed; the last: {rec.error}"
        else:
            return
        self.failed.set()

    async def open_loop(self, t0: float) -> None:
        async with asyncio.TaskGroup() as tg:
            for i, req in enumerate(self.requests):
                due = t0 + req.arrival_s
                if (delay := due - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)  # the request's arrival time
                if self.slots is not None:
                    await self.slots.acquire()
                if self.stopped is not None:
                    return
                self.max_lag = max(self.max_lag, time.perf_counter() - due)
                tg.create_task(self._slotted(i))

    async def _slotted(self, i: int) -> None:
        try:
            await self.one(i)
        finally:
            if self.slots is not None:
                self.slots.release()

    async def closed_loop(self, users: int) -> None:
        next_index = iter(range(len(self.requests)))

        async def user() -> None:
            for i in next_index:
                if self.stopped is not None:
                    return
                await self.one(i)

        async with asyncio.TaskGroup() as tg:
            for _ in range(users):
                tg.create_task(user())
