"""The Mooncake trace loader and the replay scheduler of `meshllm bench --trace`, on small traces written here.

Loader: equal hash ids give equal token runs (and different ids different
runs), the same on every load; scaling cuts the last block in proportion;
caps, speed-up, row limit and time window; malformed rows name their line;
the reuse ceiling. Scheduler (fake senders, no network): open loop sends at
the arrival times and overlaps requests, closed loop holds exactly
`concurrency` in flight, and a run stops at its deadline or after failures in
a row, saying why.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from meshllm.bench.http import Endpoint
from meshllm.bench.main import HttpSender, bench_arg_parser
from meshllm.bench.replay import ReplayMode, replay
from meshllm.bench.report import RequestRecord
from meshllm.bench.trace import (
    TraceRequest,
    TraceScale,
    hash_id_tokens,
    load_trace,
    sample_sessions,
    token_arrivals,
    trace_stats,
    unbounded_hits,
)

ROWS: list[dict[str, Any]] = [
    {"timestamp": 1000, "input_length": 1500, "output_length": 40, "hash_ids": [0, 1, 2]},  # last block: 476 of 512
    {"timestamp": 1000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 3]},  # last block: 76 of 512
    {"timestamp": 3000, "input_length": 512, "output_length": 300, "hash_ids": [0]},
    {"timestamp": 9000, "input_length": 2048, "output_length": 2, "hash_ids": [4, 5, 6, 7]},
]


def write_trace(tmp_path: Path, rows: list[dict[str, Any]] = ROWS) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def test_equal_hash_ids_become_equal_runs_and_different_ids_different_runs(tmp_path: Path) -> None:
    """Locks: a prompt is the concatenation of its hash ids' runs, so shared ids give a shared token prefix."""
    scale = TraceScale(tokens_per_block=16)
    a, b, c, d = load_trace(write_trace(tmp_path), scale)
    run = {h: hash_id_tokens(h, scale) for h in range(8)}
    assert a.prompt_token_ids[:32] == b.prompt_token_ids[:32] == run[0] + run[1]
    assert c.prompt_token_ids == run[0]
    assert a.prompt_token_ids[32:] == run[2][: len(a.prompt_token_ids) - 32]
    assert b.prompt_token_ids[32:] == run[3][: len(b.prompt_token_ids) - 32]
    assert len(set(run.values())) == 8, "distinct ids must not share a run"
    assert d.prompt_token_ids == run[4] + run[5] + run[6] + run[7]


def test_runs_are_deterministic_within_the_vocab_range_and_change_with_the_seed(tmp_path: Path) -> None:
    path = write_trace(tmp_path)
    scale = TraceScale(tokens_per_block=40, token_offset=300, vocab_size=700)
    first, again = load_trace(path, scale), load_trace(path, scale)
    assert first == again
    ids = [t for r in first for t in r.prompt_token_ids]
    assert min(ids) >= 300 and max(ids) < 700
    long_run = hash_id_tokens(7, TraceScale(tokens_per_block=8000, token_offset=300, vocab_size=700))
    assert set(long_run) == set(range(300, 700)), "a long run should draw every id of the range"
    reseeded = load_trace(path, TraceScale(tokens_per_block=40, token_offset=300, vocab_size=700, seed=1))
    assert reseeded[0].prompt_token_ids != first[0].prompt_token_ids
    assert reseeded[0].prompt_token_ids[:80] == reseeded[1].prompt_token_ids[:80]  # still shared within a seed


@pytest.mark.parametrize("per_block", [1, 16, 32, 100])
def test_the_last_block_is_cut_in_proportion_to_the_scaled_input_length(tmp_path: Path, per_block: int) -> None:
    """Locks: full blocks → per_block tokens each; the last one → ceil(its source tokens × per_block / 512)."""
    reqs = load_trace(write_trace(tmp_path), TraceScale(tokens_per_block=per_block))
    for row, req in zip(ROWS, reqs, strict=True):
        n = len(row["hash_ids"])
        last = row["input_length"] - 512 * (n - 1)
        assert req.block_lengths == (per_block,) * (n - 1) + (math.ceil(last * per_block / 512),)
        assert len(req.prompt_token_ids) == sum(req.block_lengths)
        assert req.hash_ids == tuple(row["hash_ids"]) and req.max_tokens == row["output_length"]


def test_caps_cut_the_prompt_and_the_output(tmp_path: Path) -> None:
    reqs = load_trace(write_trace(tmp_path), TraceScale(tokens_per_block=16, max_isl=20, max_osl=30))
    a, b, c, d = reqs
    assert a.block_lengths == (16, 4) and a.hash_ids == (0, 1) and len(a.prompt_token_ids) == 20
    assert a.prompt_token_ids == b.prompt_token_ids, "the cap falls inside the shared prefix"
    assert c.block_lengths == (16,) and c.hash_ids == (0,)
    assert [r.max_tokens for r in reqs] == [30, 7, 30, 2]
    assert d.prompt_token_ids == hash_id_tokens(4, TraceScale()) + hash_id_tokens(5, TraceScale())[:4]


def test_arrivals_start_at_the_first_selected_row_and_divide_by_the_speedup(tmp_path: Path) -> None:
    path = write_trace(tmp_path)
    assert [r.arrival_s for r in load_trace(path)] == [0.0, 0.0, 2.0, 8.0]
    assert [r.arrival_s for r in load_trace(path, TraceScale(speedup=4))] == [0.0, 0.0, 0.5, 2.0]


def test_limit_and_time_window_select_rows(tmp_path: Path) -> None:
    path = write_trace(tmp_path)
    assert [r.index for r in load_trace(path, TraceScale(limit=2))] == [0, 1]
    window = load_trace(path, TraceScale(start_s=2.0, duration_s=7.0))  # trace seconds 2 ≤ t < 9
    assert [r.index for r in window] == [2] and window[0].arrival_s == 0.0
    assert [r.index for r in load_trace(path, TraceScale(start_s=3.0, limit=1))] == [2]
    assert load_trace(path, TraceScale(start_s=100.0)) == []


def test_a_malformed_row_names_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(orjson.dumps(ROWS[0]) + b"\n\n" + b'{"timestamp": 5, "input_length": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not a Mooncake trace row"):
        load_trace(path)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"tokens_per_block": 0}, "--trace-tokens-per-block"),
        ({"speedup": 0.0}, "--trace-speedup"),
        ({"limit": 0}, "--trace-limit"),
        ({"max_isl": 0}, "--trace-max-isl"),
        ({"max_osl": 0}, "--trace-max-osl"),
        ({"duration_s": 0.0}, "--trace-duration"),
        ({"token_offset": 500, "vocab_size": 500}, "--trace-token-offset"),
    ],
)
def test_a_bad_scale_names_its_flag(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        TraceScale(**kwargs)


def test_describe_states_every_scaling_applied() -> None:
    line = TraceScale(tokens_per_block=32, speedup=8, limit=200, max_isl=4096, max_osl=64).describe()
    for part in ("1 hash id = 32 tokens (trace: 512)", "arrivals 8× faster", "first 200 rows", "input ≤ 4,096", "output ≤ 64"):
        assert part in line, line


def test_reuse_ceiling_counts_the_prefix_blocks_seen_before(tmp_path: Path) -> None:
    """Locks: row 1 reuses blocks 0 and 1 (32 tokens), row 2 block 0 (16); rows 0 and 3 reuse nothing."""
    reqs = load_trace(write_trace(tmp_path), TraceScale(tokens_per_block=16))
    stats = trace_stats(reqs)
    prompt = sum(len(r.prompt_token_ids) for r in reqs)
    assert stats.prompt_tokens == prompt and stats.requests == 4 and stats.unique_hash_ids == 8
    assert stats.reuse_ceiling == pytest.approx((32 + 16) / prompt)
    assert unbounded_hits(reqs) == [0, 32, 16, 0]
    lengths = sorted(len(r.prompt_token_ids) for r in reqs)
    left = sorted(len(r.prompt_token_ids) - hit for r, hit in zip(reqs, (0, 32, 16, 0), strict=True))
    assert stats.p50_prefill_floor == pytest.approx(((left[1] + left[2]) / 2) / ((lengths[1] + lengths[2]) / 2))
    assert stats.p50_prefill_floor < 1.0
    assert stats.span_s == 8.0 and stats.output_tokens == 40 + 7 + 300 + 2


def test_http_sender_sends_token_ids_to_completions_with_the_output_length() -> None:
    req = TraceRequest(index=0, arrival_s=0.0, prompt_token_ids=(5, 6, 7), max_tokens=9, hash_ids=(0,), block_lengths=(3,))
    out = HttpSender(Endpoint.parse("http://127.0.0.1:1"), "m").request(req)
    body = orjson.loads(out.body)
    assert out.path == "/completions" and out.osl == 9
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 9 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["model"] == "m"


def test_trace_flags_read_their_meshllm_env_variables() -> None:
    env = {"MESHLLM_TRACE": "t.jsonl", "MESHLLM_TRACE_SPEEDUP": "5", "MESHLLM_TRACE_MODE": "closed"}
    ns = bench_arg_parser(env=env).parse_args(["--model", "m"])
    assert (ns.trace, ns.trace_speedup, ns.trace_mode, ns.trace_tokens_per_block) == ("t.jsonl", 5.0, "closed", 16)


# ---------------------------------------------------------------- the scheduler


def requests_at(*arrivals: float) -> list[TraceRequest]:
    return [
        TraceRequest(index=i, arrival_s=a, prompt_token_ids=(i,), max_tokens=1, hash_ids=(i,), block_lengths=(1,))
        for i, a in enumerate(arrivals)
    ]


class GatedSender:
    """Holds every request until `release` is set; records when each was sent and how many were in flight."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.sent: list[tuple[int, float]] = []
        self.in_flight = self.peak = 0
        self.arrived = asyncio.Event()
        self.expect = 0

    async def __call__(self, req: TraceRequest) -> RequestRecord:
        self.sent.append((req.index, time.perf_counter()))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        if len(self.sent) >= self.expect:
            self.arrived.set()
        await self.release.wait()
        self.in_flight -= 1
        return RequestRecord(ttft=0.001, e2e=0.002, prompt_tokens=1, completion_tokens=1, cached_tokens=0)


async def test_open_loop_sends_at_the_arrival_times_and_overlaps_requests() -> None:
    """Locks: nothing is sent before its arrival; all three are in flight together (none waits for another)."""
    sender = GatedSender()
    sender.expect = 3

    async def release_when_all_arrived() -> None:
        await sender.arrived.wait()
        sender.release.set()

    t0 = time.perf_counter()
    releaser = asyncio.create_task(release_when_all_arrived())
    result = await replay(requests_at(0.0, 0.02, 0.05), sender, mode=ReplayMode.OPEN, deadline_s=30)
    await releaser
    assert [i for i, _ in sender.sent] == [0, 1, 2]
    for (_, at), arrival in zip(sender.sent, (0.0, 0.02, 0.05), strict=True):
        assert at - t0 >= arrival
    assert sender.peak == 3 and result.concurrency == 3 and result.stopped is None
    assert all(r.error is None for r in result.records) and result.summary().requests == 3


async def test_closed_loop_keeps_exactly_concurrency_requests_in_flight_and_ignores_arrivals() -> None:
    sender = GatedSender()
    sender.expect = 2
    done = 0

    def on_done(_: RequestRecord) -> None:
        nonlocal done
        done += 1

    async def release_when_two_in_flight() -> None:
        await sender.arrived.wait()
        try:
            assert sender.in_flight == 2, "a third request was sent before one of the first two ended"
        finally:
            sender.release.set()

    releaser = asyncio.create_task(release_when_two_in_flight())
    result = await replay(requests_at(0, 100, 200, 300, 400), sender, mode=ReplayMode.CLOSED, concurrency=2, on_done=on_done)
    await releaser
    assert sender.peak == 2 and result.concurrency == 2 and done == 5
    assert sorted(i for i, _ in sender.sent) == [0, 1, 2, 3, 4]
    assert result.duration_s < 100, "closed loop must not wait for the trace's arrival times"
    assert result.hit_rate == 0.0 and result.cached_tokens == 0


async def test_a_run_stops_at_its_deadline_and_marks_what_did_not_complete() -> None:
    sender = GatedSender()  # never released: a server that accepts and never answers
    result = await replay(requests_at(0, 0, 3600), sender, mode=ReplayMode.OPEN, deadline_s=0.05)
    assert result.stopped is not None and "deadline of 0.05 s" in result.stopped
    assert len(sender.sent) == 2, "the request due in an hour was never sent"
    assert all(r.error is not None and r.error.startswith("not completed: the deadline") for r in result.records)
    assert "STOPPED EARLY" in result.describe() and result.summary().errors == 3


REFUSED = "HttpError: cannot connect to 127.0.0.1:1: Connection refused"


async def test_a_run_stops_when_its_first_request_fails_instead_of_waiting_for_the_next_arrival() -> None:
    async def refused(req: TraceRequest) -> RequestRecord:
        return RequestRecord(error=REFUSED)

    result = await replay(requests_at(0.0, 3600.0), refused, mode=ReplayMode.OPEN, deadline_s=60)
    assert result.stopped == f"the first request to end failed: {REFUSED}"
    assert result.records[1].error == f"not completed: {result.stopped}"
    assert math.isnan(result.hit_rate)


async def test_after_a_success_a_run_stops_only_after_failures_in_a_row() -> None:
    """Locks: failures separated by a success do not count together; the stop reports the last error."""
    outcomes = iter([None, "HTTP 500: a", None, "HTTP 500: b", "HTTP 500: c", "HTTP 429: d", None])

    async def flaky(req: TraceRequest) -> RequestRecord:
        error = next(outcomes)
        return RequestRecord(error=error, ttft=None if error else 0.001, prompt_tokens=1, completion_tokens=1)

    result = await replay(requests_at(*range(7)), flaky, mode=ReplayMode.CLOSED, max_consecutive_errors=3)
    assert result.stopped == "3 requests in a row failed; the last: HTTP 429: d"
    assert [r.error for r in result.records] == [None, "HTTP 500: a", None, "HTTP 500: b", "HTTP 500: c", "HTTP 429: d",
                                                 f"not completed: {result.stopped}"]  # fmt: skip
    assert math.isnan(result.hit_rate)


def test_sessions_are_sampled_whole_and_arrivals_start_at_zero(tmp_path: Path) -> None:
    """Locks: requests sharing their second hash id stay together (all or none); a one-block request is its own."""
    rows = [
        {"timestamp": 1000 * i, "input_length": 40, "output_length": 3, "hash_ids": [0, 10 + i % 5, 100 + i]} for i in range(60)
    ] + [{"timestamp": 61_000, "input_length": 10, "output_length": 2, "hash_ids": [0]}]
    reqs = load_trace(write_trace(tmp_path, rows), TraceScale(tokens_per_block=16))
    picked = sample_sessions(reqs, 0.5, seed=3)
    sessions = {r.hash_ids[1] for r in picked if len(r.hash_ids) > 1}
    assert 0 < len(sessions) < 5  # some sessions kept, not all
    assert [r.index for r in picked] == [r.index for r in reqs if len(r.hash_ids) > 1 and r.hash_ids[1] in sessions] + (
        [60] if any(r.index == 60 for r in picked) else []
    )
    assert sample_sessions(reqs, 0.5, seed=3) == picked  # seeded
    assert len(sample_sessions(reqs, 1.0)) == len(reqs) and sample_sessions(reqs, 0.0) == []
    arrivals = token_arrivals(picked, "m")
    assert arrivals[0][0] == 0.0 and all(a[0] <= b[0] for a, b in itertools.pairwise(arrivals))
    first = arrivals[0][1]
    assert first["request_id"] == f"m{picked[0].index}" and first["token_ids"] == list(picked[0].prompt_token_ids)
    assert first["stop"] == {"max_tokens": picked[0].max_tokens, "ignore_eos": True} and first["model"] == "m"
