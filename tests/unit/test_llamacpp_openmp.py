"""How llama.cpp's OpenMP threads wait: the choice of `--omp-wait` (engine/llamacpp/openmp.py)."""

from __future__ import annotations

import sys

import pytest

from meshllm.engine.llamacpp import openmp
from meshllm.engine.llamacpp.openmp import choose


@pytest.mark.parametrize(
    ("threads", "cpus", "want"), [(1, 2, "spin"), (2, 2, "spin"), (3, 2, "passive"), (4, 2, "passive"), (16, 16, "spin")]
)
def test_auto_spins_while_every_engines_threads_fit_the_cpus(threads: int, cpus: int, want: str) -> None:
    """Locks: auto = spin when the process's llama.cpp threads fit its CPUs, passive when they overfill them."""
    assert choose("auto", threads, cpus, None)[0] == want


def test_an_operators_omp_wait_policy_wins_over_auto_and_a_flag_over_both() -> None:
    """Locks: OMP_WAIT_POLICY in the environment decides for auto; an explicit --omp-wait decides regardless."""
    assert choose("auto", 1, 8, "PASSIVE") == ("passive", "OMP_WAIT_POLICY=PASSIVE in the environment")
    assert choose("auto", 9, 2, "active")[0] == "spin"
    assert choose("auto", 9, 2, "  ")[0] == "passive"  # blank = not set
    assert choose("spin", 9, 2, "PASSIVE")[0] == "spin"
    assert choose("passive", 1, 8, None)[0] == "passive"


def test_decide_sets_the_environment_before_llama_cpp_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: decide() writes OMP_WAIT_POLICY (or removes a blank / contrary one) only while llama_cpp is not loaded,
    and counts the threads of every registered engine."""
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setattr(openmp, "usable_cpus", lambda: [0, 1])
    monkeypatch.setattr(openmp, "_threads", type(openmp._threads)())

    class Engine:
        pass

    a, b = Engine(), Engine()
    openmp.register(a, 2)
    monkeypatch.setenv("OMP_WAIT_POLICY", "")
    assert openmp.decide("auto") == "spin"
    assert "OMP_WAIT_POLICY" not in openmp.os.environ
    openmp.register(b, 2)
    assert openmp.decide("auto") == "passive"
    assert openmp.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert openmp.decide("spin") == "spin" and "OMP_WAIT_POLICY" not in openmp.os.environ
    openmp.unregister(b)
    assert openmp.decide("auto") == "spin"


def test_once_llama_cpp_is_loaded_the_policy_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: OpenMP read its policy at load; decide() then reports that one and changes nothing."""
    monkeypatch.setitem(sys.modules, "llama_cpp", object())
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert openmp.decide("spin") == "passive"
    assert openmp.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
