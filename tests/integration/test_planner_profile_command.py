"""`meshllm planner profile` as a user runs it: it starts a real `meshllm run` of the engine, measures it through
the mesh's HTTP API, and writes a profile the planner reads (meshllm.planner.profile). The mocker in both layouts;
vLLM on CPU (real SmolLM2-135M) aggregated, the layout its CPU build serves (tests/integration/vllm_support.py
says when vLLM is not installed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshllm.planner.decide import needed
from meshllm.planner.model import Load
from meshllm.planner.profile import Profile

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def profile(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "profile.json"
    argv = [sys.executable, "-m", "meshllm", "planner", "profile", "--out", str(out), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False), out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["disagg", "agg"])
def test_a_mocker_profile_is_measured_and_the_planner_sizes_from_it(tmp_path: Path, mode: str) -> None:
    done, out = profile(tmp_path, "--engine", "mocker", "--mode", mode, "--isl", "64,1024", "--context", "128,384",
                        "--concurrency", "1,4", "--osl", "24", "--requests", "2",
                        "--", "--speedup-ratio", "0.5", "--max-num-seqs", "4")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"profile written to {out}" in done.stdout
    p = Profile.load(out)
    assert p.engine == "mocker" and p.engine_args == ("--speedup-ratio", "0.5", "--max-num-seqs", "4")
    assert [r.isl for r in p.prefill] == sorted(r.isl for r in p.prefill) and len(p.prefill) == 2
    assert p.prefill[1].isl > 8 * p.prefill[0].isl  # as the server counted them (the chat template included)
    assert p.prefill[1].ttft_s > p.prefill[0].ttft_s  # a longer prompt takes longer to prefill
    assert {(r.concurrency, r.context >= c) for r, c in zip(p.decode, (128, 384, 128, 384), strict=True)} == {
        (1, True),
        (4, True),
    }
    one, four = (max(r.tokens_per_s for r in p.decode if r.concurrency == n) for n in (1, 4))
    assert four > 2 * one  # the mocker batches: four streams give more than twice one stream's tokens
    # the planner can size from it: more load needs more workers
    light = needed(Load(1.0, 200, 24), p, 2.0, 0.2, mode=mode)
    heavy = needed(Load(8.0, 200, 24), p, 2.0, 0.2, mode=mode)
    assert all(heavy[role][0] > light[role][0] > 0 for role in light)


@pytest.mark.timeout(120)
def test_an_engine_that_will_not_start_ends_the_profile_with_its_reason(tmp_path: Path) -> None:
    done, out = profile(tmp_path, "--engine", "mocker", "--", "--no-such-flag", timeout=100)
    assert done.returncode == 2
    assert done.stderr.startswith("meshllm planner profile: error: profile: `meshllm run` exited")
    assert "--no-such-flag" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


def test_a_bad_grid_is_refused_at_once_in_one_line(tmp_path: Path) -> None:
    done, out = profile(tmp_path, "--isl", "128,many", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "meshllm planner profile: error: --isl '128,many': comma-separated whole numbers expected"
    ]
    assert not out.exists()


@pytest.mark.timeout(600)
def test_a_vllm_profile_on_cpu(tmp_path: Path) -> None:
    from vllm_support import require_vllm

    require_vllm()
    done, out = profile(tmp_path, "--engine", "vllm", "--mode", "agg", "--isl", "32,256", "--context", "96",
                        "--concurrency", "1,2", "--osl", "12", "--requests", "1", "--", "--max-model-len", "512",
                        timeout=560)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    p = Profile.load(out)
    assert p.engine == "vllm" and len(p.prefill) == 2 and len(p.decode) == 2
    assert all(r.ttft_s > 0 and r.tokens_per_s > 0 for r in p.prefill)
    assert all(0 < r.itl_s < 5 and r.tokens_per_s > 0 for r in p.decode)
    need = needed(Load(0.5, 100, 12), p, 5.0, 1.0, mode="agg")
    assert need["agg"][0] > 0
