"""`meshllm bench`'s figures and inputs: the summary statistics, SLOs and goodput, the outputs, the progress line,
Poisson arrivals, the ShareGPT-style dataset and prompts of an exact token length.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import random
import statistics
from pathlib import Path

import orjson
import pytest

from meshllm.bench.dataset import dataset_requests, load_dataset
from meshllm.bench.main import bench_arg_parser
from meshllm.bench.output import format_level, format_table, write_csv
from meshllm.bench.progress import Progress, format_duration
from meshllm.bench.prompts import PromptBuilder, resolve_tokenizer
from meshllm.bench.report import RequestRecord, summarize
from meshllm.bench.slo import meets, parse_slo
from meshllm.bench.workload import Workload, WorkloadSpec, poisson_arrivals
from meshllm.frontend.text.tokenizer import HFTokenizer


def rec(ttft: float, gaps: list[float], tokens: int, *, error: str | None = None) -> RequestRecord:
    e2e = ttft + sum(gaps)
    return RequestRecord(ttft=ttft, e2e=e2e, gaps=gaps, prompt_tokens=10, completion_tokens=tokens, error=error,
                         events=len(gaps) + 1)  # fmt: skip


# ---------------------------------------------------------------- statistics


def test_summary_has_mean_median_p90_p99_of_every_latency_and_the_totals() -> None:
    records = [rec(0.010 * (i + 1), [0.002] * 4, 5) for i in range(10)] + [RequestRecord(error="HTTP 500: x")]
    s = summarize(4, records, duration_s=2.0)
    ttfts = [10.0 * (i + 1) for i in range(10)]
    assert s.ttft_mean_ms == pytest.approx(statistics.mean(ttfts))
    assert s.ttft_median_ms == pytest.approx(statistics.median(ttfts)) == pytest.approx(s.ttft_p50_ms)
    assert s.ttft_p90_ms == pytest.approx(91.0) and s.ttft_p99_ms == pytest.approx(99.1)
    assert s.itl_mean_ms == pytest.approx(2.0) and s.itl_median_ms == pytest.approx(2.0)
    assert s.tpot_median_ms == pytest.approx(2.0) and s.tpot_p99_ms == pytest.approx(2.0)  # 4 gaps over 4 tokens after the first
    assert s.e2e_mean_ms == pytest.approx(statistics.mean(t + 8.0 for t in ttfts))
    assert (s.requests, s.completed, s.errors, s.first_error) == (11, 10, 1, "HTTP 500: x")
    assert (s.total_input_tokens, s.total_output_tokens) == (100, 50)
    assert s.req_per_s == 5.0 and s.output_tok_per_s == 25.0 and s.total_tok_per_s == 75.0
    assert s.to_dict()["slo_attainment"] is None, "no SLO: no goodput figures (null in JSON, not NaN)"


def test_goodput_counts_the_requests_meeting_every_slo_over_all_requests() -> None:
    fast = rec(0.050, [0.010, 0.010], 3)
    slow_first = rec(0.300, [0.010, 0.010], 3)
    slow_gaps = rec(0.050, [0.080, 0.080], 3)
    failed = RequestRecord(error="HTTP 503: busy")
    slo = parse_slo("ttft=200,itl=50")
    assert [meets(r, slo) for r in (fast, slow_first, slow_gaps, failed)] == [True, False, False, False]
    s = summarize(1, [fast, slow_first, slow_gaps, failed], duration_s=4.0, slo=slo)
    assert s.slo_attainment == 0.25 and s.goodput_req_per_s == 0.25 and s.slo == {"ttft": 200.0, "itl": 50.0}
    assert "goodput (TTFT ≤ 200 ms, ITL ≤ 50 ms): 25.0% of requests met every SLO, 0.25 req/s" in format_level(s)
    assert "goodput req/s" in format_table([s])


@pytest.mark.parametrize(
    ("text", "message"),
    [("ttft", "expected METRIC=MS"), ("latency=5", "expected METRIC=MS"), ("ttft=fast", "not a number"),
     ("itl=-1", "must be a finite number"), ("", "name at least one")],
)  # fmt: skip
def test_a_bad_slo_is_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_slo(text)


def test_the_level_block_and_csv_carry_every_figure(tmp_path: Path) -> None:
    s = summarize(8, [rec(0.01, [0.002], 2), rec(0.02, [0.004], 2)], duration_s=1.0, slo={"e2e": 100.0})
    block = format_level(s)
    for name in ("TTFT", "ITL", "TPOT", "E2E"):
        assert f"| {name}" in block
    assert "| metric (ms) | " in block and "mean | median |" in block and "p90 |" in block and "p99 |" in block
    assert "c=8: 2 of 2 requests completed (0 errors)" in block and "throughput: 2.00 req/s" in block
    path = tmp_path / "out.csv"
    write_csv([s.to_dict()], str(path))
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert len(rows) == 1 and rows[0]["concurrency"] == "8" and float(rows[0]["ttft_mean_ms"]) == pytest.approx(15.0)
    assert rows[0]["slo_e2e_ms"] == "100.0" and "slo" not in rows[0]


# ---------------------------------------------------------------- progress, arrivals


class FakeStream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_progress_shows_elapsed_and_eta_and_stays_silent_when_disabled() -> None:
    log = FakeStream(tty=False)
    bar = Progress("c=4", 20, stream=log)
    for i in range(20):
        bar.tick(error=i == 3)
    lines = log.getvalue().splitlines()
    assert len(lines) == 10, "a plain line per tenth of the run when stderr is not a terminal"
    assert lines[-1].startswith("c=4 20/20, 1 errors") and "elapsed 0:0" in lines[-1] and "ETA 0:00" in lines[-1]
    tty = FakeStream(tty=True)
    Progress("c=1", 3, stream=tty).tick()
    assert tty.getvalue().startswith("\r") and "ETA" in tty.getvalue()
    quiet = FakeStream(tty=True)
    silent = Progress("c=1", 3, enabled=False, stream=quiet)
    silent.tick()
    silent.finish()
    assert quiet.getvalue() == ""
    assert (format_duration(12.3), format_duration(3725)) == ("0:12", "1:02:05")


def test_poisson_arrivals_are_seeded_and_keep_the_rate() -> None:
    a = poisson_arrivals(4000, 20.0, seed=7)
    assert a == poisson_arrivals(4000, 20.0, seed=7) and a != poisson_arrivals(4000, 20.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    gaps = [y - x for x, y in itertools.pairwise(a)]
    assert statistics.mean(gaps) == pytest.approx(0.05, rel=0.08)
    assert statistics.stdev(gaps) == pytest.approx(0.05, rel=0.1), "exponential gaps: stdev = mean"
    regular = poisson_arrivals(4000, 20.0, seed=7, burstiness=50.0)
    assert statistics.stdev([y - x for x, y in itertools.pairwise(regular)]) < 0.01
    with pytest.raises(ValueError, match="--request-rate"):
        poisson_arrivals(3, 0.0, seed=0)


def test_rate_and_slo_flags_parse_and_read_their_env_variables() -> None:
    ns = bench_arg_parser(env={"MESHLLM_REQUEST_RATE": "4,8", "MESHLLM_SLO": "ttft=100"}).parse_args(["--model", "m"])
    assert (ns.request_rate, ns.slo, ns.concurrency, ns.tokenizer, ns.chars_per_token) == ("4,8", "ttft=100", None, None, None)
    help_text = bench_arg_parser(env={}).format_help()
    for flag in ("--request-rate", "--dataset", "--slo", "--csv", "--tokenizer", "--progress", "--burstiness"):
        assert flag in help_text


# ---------------------------------------------------------------- dataset


def test_a_sharegpt_style_dataset_gives_messages_and_output_lengths(tmp_path: Path) -> None:
    rows = [
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A" * 40},
                           {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "B" * 80}]},
        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 7},
        {"prompt": "once upon a time"},
    ]  # fmt: skip
    path = tmp_path / "ds.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n\n")
    loaded = load_dataset(path)
    assert [m["role"] for m in loaded[0].messages] == ["system", "user", "assistant", "user"]
    assert loaded[0].reference == "B" * 80 and loaded[1].output_len == 7
    assert loaded[2].messages[0]["content"] == "once upon a time"
    spec = WorkloadSpec(model="m", osl=11)
    tok, _ = resolve_tokenizer("builtin:mocker", "m")
    assert tok is not None
    builder = PromptBuilder(tok, api="chat")
    stream = dataset_requests(loaded, spec, builder)
    reqs = [next(stream) for _ in range(4)]
    assert [r.osl for r in reqs] == [80, 7, 11, 80], "reference reply's tokens, the row's max_tokens, --osl; then it cycles"
    body = orjson.loads(reqs[0].body)
    assert body["messages"][-1] == {"role": "user", "content": "Q2"} and reqs[0].isl == builder.count_messages(body["messages"])
    array = tmp_path / "ds.json"
    array.write_bytes(orjson.dumps(rows))
    assert len(load_dataset(array, limit=2)) == 2


@pytest.mark.parametrize(
    ("line", "message"),
    [(b"{not json", "ds.jsonl:2: not a JSON object"), (b'{"foo": 1}', "ds.jsonl:2: a row needs"),
     (b'{"conversations": [{"from": "alien", "value": "x"}]}', "ds.jsonl:2: a turn needs a known role"),
     (b'{"messages": [{"role": "assistant", "content": "x"}]}', "ds.jsonl:2: the conversation has no user turn"),
     (b'{"prompt": "x", "max_tokens": 0}', "ds.jsonl:2: max_tokens")],
)  # fmt: skip
def test_a_bad_dataset_row_names_its_file_and_line(tmp_path: Path, line: bytes, message: str) -> None:
    path = tmp_path / "ds.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n' + line + b"\n")
    with pytest.raises(ValueError, match=message):
        load_dataset(path)


# ---------------------------------------------------------------- exact prompt lengths


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_prompts_count_exactly_the_input_length_with_the_smollm2_tokenizer(smollm2: HFTokenizer, api: str) -> None:
    """The server counts chat prompts as template(messages) encoded; completions as the text with special tokens."""
    builder = PromptBuilder(smollm2, api=api, seed=3)
    spec = WorkloadSpec(model="m", api=api, isl=200, isl_spread=150, osl=5, prefix_len=40, num_prefixes=2)  # type: ignore[arg-type]
    workload = Workload(spec, builder)
    prefixes = set()
    for _ in range(40):
        req = workload.next()
        body = orjson.loads(req.body)
        text = body["messages"][0]["content"] if api == "chat" else body["prompt"]
        assert req.isl is not None and builder.count(text) == req.isl, "the count the server makes is the target"
        prefixes.add(smollm2.decode(smollm2.encode(text)[:30]))
    assert len(prefixes) == 2, "every prompt starts with one of the two shared prefixes"
    if api == "chat":
        assert builder.overhead > 20, "SmolLM2's template adds a system prompt: the old character budget missed it"


def test_the_old_character_budget_misses_what_token_counting_hits(smollm2: HFTokenizer) -> None:
    """Locks the issue's miss: 1 character per token sent far more than --isl tokens; the builder hits ±2 %."""
    builder = PromptBuilder(smollm2, api="chat")
    chars = orjson.loads(Workload(WorkloadSpec(model="m", isl=200, chars_per_token=1.0)).next().body)["messages"][0]["content"]
    assert abs(builder.count(chars) - 200) / 200 > 0.02
    rng = random.Random(0)
    counts = [builder.count(builder.build(200, rng)) for _ in range(20)]
    assert all(abs(c - 200) <= 4 for c in counts) and counts.count(200) >= 18


def test_the_tokenizer_is_found_from_the_model_name_or_refused_in_one_line(tmp_path: Path) -> None:
    tok, where = resolve_tokenizer(None, "mocker")
    assert tok is not None and where == "builtin:mocker"
    assert resolve_tokenizer(None, "some-remote-model") == (None, "none found for model 'some-remote-model'")
    assert resolve_tokenizer("none", "mocker") == (None, "none")
    with pytest.raises(ValueError, match=r"^--tokenizer: tokenizer source .* does not exist"):
        resolve_tokenizer(str(tmp_path / "missing"), "m")
    assert math.isnan(summarize(1, [], 1.0).isl_max_deviation)
