"""bench/tokenize_idle.py and bench/tokenize_cache.py: a tiny real run of each, and what their reports state."""

from __future__ import annotations

import pytest
from bench_support import load_bench as load
from bench_support import needs_model

pytestmark = pytest.mark.usefixtures("bench_cache")  # tests/unit/conftest.py


@needs_model
def test_idle_run_counts_every_kind_of_pause_past_each_blocks_settling_encodes() -> None:
    idle = load("tokenize_idle")
    times, tokens = idle.run(4, 3, seed=1)  # blocks of 3, the first 2 not counted: 4 rounds for 4 each
    assert list(times) == [label for label, _ in idle.PAUSES]
    assert all(len(v) == 4 and all(ms > 0 for ms in v) for v in times.values())
    assert 400 < tokens < 800  # bench/mesh.py's ~600-token prompts, template included


def test_idle_report_divides_each_median_by_the_back_to_back_one() -> None:
    idle = load("tokenize_idle")
    labels = [label for label, _ in idle.PAUSES]
    times = {label: [0.2 * (i + 1)] * 3 for i, label in enumerate(labels)}
    text = idle.render(times, 612.4, 3, 20, [0.5, 0.7])
    assert text.startswith(idle.SECTION + "\n")
    assert "--requests 3 --block 20" in text and "612 tokens" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.endswith("× |")]
    assert [r.rsplit("|", 2)[1].strip() for r in rows] == ["1.00×", "2.00×", "3.00×", "4.00×", "5.00×"]
    assert "| 0.200 / 0.200 / 0.200 |" in rows[0]


@pytest.mark.parametrize(
    ("bench", "argv", "message"),
    [
        ("tokenize_idle", ["--block", "2"], "--block more than 2"),
        ("tokenize_batch", ["--rounds", "0"], "--rounds and --calls must be at least 1"),
    ],
)
def test_flags_are_checked_with_a_one_line_error(
    bench: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        load(bench).main([*argv, "--no-write"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@needs_model
def test_cache_bench_checks_both_encodings_agree_and_reports_the_reuse() -> None:
    cache = load("tokenize_cache")
    args = cache.argparse.Namespace(conversations=2, turns=3, unique=4, seed=0)
    table, figures = cache.run(args)
    assert "conversations, all turns | 6 |" in table and "unique prompts (bench/mesh.py's shape) | 4 |" in table
    assert 0.3 < figures["reused"] < 1.0  # later turns repeat the earlier pieces


@needs_model
def test_batch_bench_measures_both_ways_for_every_size_each_round() -> None:
    batch = load("tokenize_batch")
    res = batch.run(2, 40)
    assert set(res) == {(k, w) for k in batch.SIZES for w in (0, 1)}
    assert all(len(v) == 2 and all(cpu > 0 and wall > 0 for cpu, wall in v) for v in res.values())


def test_batch_report_divides_each_ways_cpu_by_the_batchs_and_shows_wall_time() -> None:
    batch = load("tokenize_batch")
    res = {(k, w): [(10.0 * k * (1 if w == 0 else 0.5), 7.0 * k)] * 3 for k in batch.SIZES for w in (0, 1)}
    text = batch.render(res, 3, 400, [0.4])
    assert text.startswith(batch.SECTION + "\n") and "--rounds 3 --calls 400" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.endswith("× |")]
    assert len(rows) == 2 * len(batch.SIZES)
    assert rows[0].startswith("| 1 | one batch") and rows[0].endswith("| 7.0 | 1.00× |")
    assert rows[1].startswith("| 1 | one call per text") and "| 5.0 (5.0–5.0) |" in rows[1] and rows[1].endswith("0.50× |")
