"""bench/mesh_ab.py, a change against its base: the parts that decide what is compared and how it reads.

Locks: the sides alternate their order from pair to pair; only the base side's services come first on the
processes' PYTHONPATH (this tree's otherwise, any inherited path kept after it); the worktree is a real
checkout of the base commit and is removed afterwards; the table shows medians with their ranges and
head ÷ base for req/s, latency and each process's CPU, and whether the sides' ranges overlap; bad flags
stop it with a one-line reason.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from bench_support import load_bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ab() -> ModuleType:
    return load_bench("mesh_ab")


def test_the_sides_alternate_their_order_from_pair_to_pair(ab: ModuleType) -> None:
    assert [ab.order(i) for i in range(4)] == [("base", "head"), ("head", "base"), ("base", "head"), ("head", "base")]


def test_only_the_base_side_puts_other_services_first_on_the_pythonpath(monkeypatch: pytest.MonkeyPatch) -> None:
    systems = load_bench("harness.systems")
    monkeypatch.setenv("PYTHONPATH", "/already/there")
    head = systems.SystemSpec(speedup=10.0)
    base = systems.SystemSpec(speedup=10.0, services_path="/tmp/base/services")
    assert "PYTHONPATH" not in head.env() and head.env()["MESHLLM_LOG_LEVEL"] == "WARNING"
    assert base.env()["PYTHONPATH"] == "/tmp/base/services:/already/there"
    monkeypatch.delenv("PYTHONPATH")
    assert base.env()["PYTHONPATH"] == "/tmp/base/services"


def test_the_worktree_is_the_base_commit_and_goes_away_afterwards(ab: ModuleType) -> None:
    with ab.worktree("HEAD") as (path, commit):
        assert (path / "services" / "meshllm" / "__init__.py").is_file()
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        assert commit == head.stdout.strip()
        listed = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
        assert str(path) in listed
    assert not path.exists()
    listed = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    assert str(path) not in listed


def _row(req_s: float, frontend: float, router: float, ttft: float = 20.0) -> dict[str, Any]:
    return {
        "req_per_s": req_s,
        "ttft_p50_ms": ttft,
        "itl_p50_ms": 2.0,
        "cpu_ms": {"frontend": frontend, "router": router, "etcd": 0.02, "nats": 0.2},
    }


def test_the_table_gives_medians_ranges_and_head_over_base(ab: ModuleType) -> None:
    res = ab.Results()
    for b, h in ((_row(200, 3.0, 2.2), _row(210, 3.0, 2.0)), (_row(190, 3.2, 2.4), _row(200, 3.1, 2.1))):
        res.add(("router", 10.0, 32), "base", b)
        res.add(("router", 10.0, 32), "head", h)
    res.add(("router", 10.0, 32), "base", _row(180, 3.4, 2.3))
    rows = {name: (b, h, ratio, overlap) for name, b, h, ratio, overlap in ab.metric_rows(res.rows[("router", 10.0, 32)])}
    assert rows["req/s"] == ("190.0 (180.0–200.0)", "205.0 (200.0–210.0)", "1.079×", "yes")  # 200 at both ends
    assert rows["CPU-ms/request, router"] == ("2.30 (2.20–2.40)", "2.05 (2.00–2.10)", "0.891×", "no")
    assert rows["CPU-ms/request, frontend"][2] == "0.953×"  # 3.05 / 3.2
    assert "CPU-ms/request, etcd" not in rows  # the planes count in the whole mesh only
    assert rows["CPU-ms/request, whole mesh"][0] == "5.82 (5.42–5.92)"  # etcd and nats included
    info = {"date": "2026-11-26", "machine": "x86_64, 2 cores", "python": "3.11.7 (/usr)", "packages": "grpcio 1", "dirty": ""}
    text = ab.render(res, argv="bench/mesh_ab.py --base HEAD~1", base="abc1234", head="def5678", pairs=2, requests=640,
                     info=info, load_avg=[0.5, 0.7])  # fmt: skip
    assert text.startswith("## Change against its base\n")
    assert "Base abc1234, head def5678:" in text
    row = "| meshllm split + router process | 10 | 32 | CPU-ms/request, router | 2.30 (2.20–2.40) | 2.05 (2.00–2.10) |"
    assert f"{row} 0.891× | no |" in text
    labelled = ab.render(res, argv="x", base="a", head="b", pairs=2, requests=640, info=info, load_avg=[0.5],
                         heading="## Change against its base: router relay")  # fmt: skip
    assert labelled.startswith("## Change against its base: router relay\n")


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--systems", "router"], "--base"),
        (["--base", "HEAD~1", "--systems", "dynamo"], "--systems takes split, router and run"),
        (["--base", "HEAD~1", "--pairs", "0"], "--pairs"),
    ],
)
def test_bad_flags_stop_it_with_a_reason(ab: ModuleType, argv: list[str], why: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        ab.parse_args(argv)
    assert info.value.code == 2
    assert why in capsys.readouterr().err
