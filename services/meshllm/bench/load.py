"""Driving a level of `meshllm bench`: closed loop at a concurrency, open loop at a Poisson rate, or a trace replay.

Every kind runs through `meshllm.bench.replay.replay`, so each is bounded
the same way: `--timeout` per request, a deadline for the level, and it
stops when the first request to end fails (no server, wrong model) or when
`max_consecutive_errors` requests in a row fail (the server went away).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from meshllm.bench.http import Endpoint
from meshllm.bench.progress import Progress
from meshllm.bench.replay import ReplayMode, ReplayResult, replay
from meshllm.bench.report import LevelResult, RequestRecord
from meshllm.bench.sender import CONNECTION_ERROR_PREFIX, HttpSender, is_connection_error
from meshllm.bench.trace import TraceRequest
from meshllm.bench.workload import BenchRequest, poisson_arrivals, with_arrivals

__all__ = ["Level", "LevelRun", "rate_arrivals", "run_level", "run_trace", "stop_message", "with_rate"]

MAX_ERRORS_IN_A_ROW = 5  # "the server went away": this many requests in a row failed


@dataclass(frozen=True, slots=True)
class Level:
    """How one level loads the server: `concurrency` users (closed loop), or Poisson arrivals at `request_rate`."""

    concurrency: int = 1
    request_rate: float | None = None  # req/s; inf = every request at once
    max_in_flight: int | None = None  # rate mode: the most requests in flight (None = no cap)

    @property
    def label(self) -> str:
        return f"rate={self.request_rate:g}/s" if self.request_rate is not None else f"c={self.concurrency}"


@dataclass(frozen=True, slots=True)
class LevelRun:
    """A level's summary and the replay behind it (records, why it stopped)."""

    summary: LevelResult
    replay: ReplayResult


def rate_arrivals(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send times for rate mode: Poisson (or gamma with `burstiness`) at `rate`, all at 0 for an infinite rate."""
    return [0.0] * n if math.isinf(rate) else poisson_arrivals(n, rate, seed, burstiness=burstiness)


async def run_level(
    endpoint: Endpoint,
    model: str,
    requests: Sequence[BenchRequest],
    level: Level,
    *,
    warmup: Sequence[BenchRequest] = (),
    progress: bool = True,
    timeout_s: float = 600.0,
    deadline_s: float | None = None,
    slo: Mapping[str, float] | None = None,
    max_consecutive_errors: int = MAX_ERRORS_IN_A_ROW,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> LevelRun:
    """Send `requests` (after the unrecorded `warmup` ones, closed loop) as `level` says; its summary.

    `on_done` is called with each measured request's record as it ends.
    """
    sender = HttpSender(endpoint, model, timeout_s=timeout_s)
    try:
        if warmup:
            users = level.concurrency if level.request_rate is None else (level.max_in_flight or 1)
            await replay(list(warmup), sender, mode=ReplayMode.CLOSED, concurrency=users, deadline_s=deadline_s,
                         max_consecutive_errors=max_consecutive_errors)  # fmt: skip
        bar = Progress(f"{level.label:<10}", len(requests), enabled=progress)

        def done(rec: RequestRecord) -> None:
            bar.tick(error=rec.error is not None)
            if on_done is not None:
                on_done(rec)

        if level.request_rate is None:
            result = await replay(
                requests, sender, mode=ReplayMode.CLOSED, concurrency=level.concurrency, deadline_s=deadline_s,
                max_consecutive_errors=max_consecutive_errors, on_done=done,
            )  # fmt: skip
        else:
            result = await replay(
                requests, sender, mode=ReplayMode.OPEN, deadline_s=deadline_s, max_in_flight=level.max_in_flight,
                max_consecutive_errors=max_consecutive_errors, on_done=done,
            )  # fmt: skip
        bar.finish()
    finally:
        await sender.aclose()
    return LevelRun(result.summary(slo=slo, request_rate=level.request_rate), result)


def with_rate(requests: list[BenchRequest], level: Level, seed: int, burstiness: float = 1.0) -> list[BenchRequest]:
    """The requests with their send times for `level` (unchanged for a concurrency level)."""
    if level.request_rate is None:
        return requests
    return with_arrivals(requests, rate_arrivals(len(requests), level.request_rate, seed, burstiness))


async def run_trace(
    endpoint: Endpoint,
    model: str,
    requests: Sequence[TraceRequest],
    *,
    mode: ReplayMode = ReplayMode.OPEN,
    concurrency: int = 1,
    ignore_eos: bool = True,
    temperature: float | None = None,
    timeout_s: float = 600.0,
    deadline_s: float | None = 3600.0,
    progress: bool = True,
    max_consecutive_errors: int | None = 10,
) -> ReplayResult:
    """Replay trace requests against an OpenAI endpoint (see `HttpSender` and `meshllm.bench.replay.replay`)."""
    sender = HttpSender(endpoint, model, ignore_eos=ignore_eos, temperature=temperature, timeout_s=timeout_s)
    label = f"{mode.value:<6}" if mode is ReplayMode.OPEN else f"c={concurrency:<4}"
    bar = Progress(label, len(requests), enabled=progress)
    try:
        result = await replay(
            requests, sender, mode=mode, concurrency=concurrency, deadline_s=deadline_s,
            max_consecutive_errors=max_consecutive_errors, on_done=lambda r: bar.tick(error=r.error is not None),
        )  # fmt: skip
    finally:
        await sender.aclose()
    bar.finish()
    return result


def stop_message(result: ReplayResult, url: str) -> str:
    """The one line a stopped run ends with: "the server went away" when the failures were lost connections."""
    assert result.stopped is not None
    done = sum(1 for r in result.records if r.error is None)
    where = f"stopped after {done} of {len(result.records)} requests completed"
    at = result.stopped.find(CONNECTION_ERROR_PREFIX)
    if at >= 0 and is_connection_error(result.stopped[at:]):
        why = result.stopped[at + len(CONNECTION_ERROR_PREFIX) :]
        if done == 0:
            return f"cannot reach the server at {url} ({why})"
        return f"the server at {url} went away ({why}); {where}"
    return f"{result.stopped}; {where}"
