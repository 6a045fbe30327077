"""`pytest --meshllm-engine module:Class` runs one test per clause, in a project that has no tests of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshllm.testing.conformance import TIER_CLAUSES, Clause

# The sample engine keeps no lower KV tiers: the plugin skips the tier clauses for it.
APPLICABLE = len(Clause) - len(TIER_CLAUSES)

HERE = Path(__file__).parent


def run_pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A fresh pytest process in `cwd` (no config of ours), with this directory importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "asyncio_default_fixture_loop_scope=function"]
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_the_plugin_runs_every_clause_against_the_sample_engine(tmp_path: Path) -> None:
    """Locks: the entry-point plugin contributes one passing test per clause for a conforming engine."""
    proc = run_pytest(
        tmp_path, "-v", "--meshllm-engine", "meshllm.engine.sample:SampleEngine", "--meshllm-engine-args", "--model-name s"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for clause in Clause:
        word = "SKIPPED" if clause in TIER_CLAUSES else "PASSED"
        assert f"meshllm-conformance::{clause} {word}" in proc.stdout, proc.stdout
    assert f"{APPLICABLE} passed, {len(TIER_CLAUSES)} skipped" in proc.stdout


def test_the_plugin_fails_only_the_broken_clause_and_names_it(tmp_path: Path) -> None:
    """Locks: an engine author sees which clause broke, and why, in the pytest report."""
    proc = run_pytest(tmp_path, "-v", "--meshllm-engine", "broken_engines:IgnoresStopTokens")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "meshllm-conformance::stop_token_ids_stop FAILED" in proc.stdout, proc.stdout
    assert f"1 failed, {APPLICABLE - 1} passed, {len(TIER_CLAUSES)} skipped" in proc.stdout
    assert "[stop_token_ids_stop]" in proc.stdout and "the stop token was emitted" in proc.stdout


def test_the_plugin_honours_k_selection_and_conformance_options(tmp_path: Path) -> None:
    """Locks: -k selects clauses; --meshllm-conformance-option reaches ConformanceOptions."""
    proc = run_pytest(
        tmp_path,
        "-k",
        "cancellation",
        "--meshllm-engine",
        "sample",
        "--meshllm-engine-args",
        "--token-delay-ms 1",
        "--meshllm-conformance-option",
        "long_max_tokens=50",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"1 passed, {len(Clause) - 1} deselected" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--meshllm-engine", "no_such_module:Engine"], "cannot import"),
        (["--meshllm-engine", "sample", "--meshllm-conformance-option", "bogus=1"], "NAME=VALUE"),
    ],
)
def test_the_plugin_reports_a_bad_engine_or_option_as_a_usage_error(tmp_path: Path, args: list[str], message: str) -> None:
    proc = run_pytest(tmp_path, *args)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert message in proc.stderr


def test_without_the_option_the_plugin_adds_nothing(tmp_path: Path) -> None:
    proc = run_pytest(tmp_path)
    assert proc.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, proc.stdout + proc.stderr
