"""bench/mesh_stages.py and its probe (bench/stage_probe/sitecustomize.py).

Locks: marks are grouped into requests by their HTTP mark and time order, whatever process wrote them; a stage row
is the interval between consecutive marks every request has (a stage some request lacks is left out, not zero);
the servers' own part subtracts each request's own engine prefill; the probe wraps every target it names in a
process started with its folder on PYTHONPATH (a renamed function fails here, not silently in a benchmark), marks
a request's first token once, and does nothing without its environment variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_support import BENCH, load_bench

ROOT = BENCH.parent


@pytest.fixture(scope="module")
def stages():  # type: ignore[no-untyped-def]
    return load_bench("mesh_stages")


def _lines(marks: list[tuple[float, int, str]]) -> list[str]:
    return [f"{t:.7f} {pid} {stage}" for t, pid, stage in marks]


def test_marks_group_into_requests_in_time_order_across_processes(stages) -> None:  # type: ignore[no-untyped-def]
    marks = [
        (2.0000, 7, "frontend.http_request"),
        (1.0000, 7, "frontend.http_request"),
        (1.0040, 9, "engine.start"),  # the worker's line, written to the same log out of order
        (1.0010, 7, "frontend.preprocess"),
        (1.0300, 9, "engine.first_token"),
        (2.0020, 7, "frontend.preprocess"),
        (1.0310, 7, "frontend.first_event_sent"),
        (1.0320, 7, "frontend.first_event_sent"),  # a later mark of the same stage: the first one counts
    ]
    reqs = stages.per_request(_lines(marks))
    assert len(reqs) == 2
    assert reqs[0]["engine.start"] == pytest.approx(1.004)
    assert reqs[0]["frontend.first_event_sent"] == pytest.approx(1.031)
    assert set(reqs[1]) == {"frontend.http_request", "frontend.preprocess"}


def test_stage_rows_cover_the_marks_every_request_has(stages) -> None:  # type: ignore[no-untyped-def]
    reqs = [
        {"frontend.http_request": 0.0, "frontend.preprocess": 0.001, "frontend.preprocessed": 0.003, "engine.start": 0.004},
        {"frontend.http_request": 1.0, "frontend.preprocess": 1.002, "frontend.preprocessed": 1.005},
        {"frontend.http_request": 2.0, "frontend.preprocess": 2.003, "frontend.preprocessed": 2.004},
    ]
    rows = stages.stage_table(reqs)
    assert [(r["from"], r["to"]) for r in rows] == [
        ("frontend.http_request", "frontend.preprocess"),
        ("frontend.preprocess", "frontend.preprocessed"),
    ]  # engine.start: only one request has it
    assert rows[0]["p50"] == pytest.approx(2.0) and rows[0]["p90"] == pytest.approx(2.8)  # interpolated
    assert rows[1]["p50"] == pytest.approx(2.0) and rows[1]["n"] == 3


def test_servers_own_part_subtracts_each_requests_engine_time(stages) -> None:  # type: ignore[no-untyped-def]
    def req(t0: float, engine_ms: float, own_ms: float) -> dict[str, float]:
        start = t0 + own_ms / 2000.0
        return {
            "frontend.http_request": t0,
            "engine.start": start,
            "engine.first_token": start + engine_ms / 1000.0,
            "frontend.first_event_sent": t0 + (engine_ms + own_ms) / 1000.0,
        }

    whole, own = stages.server_part([req(0.0, 20.0, 2.0), req(1.0, 30.0, 3.0), req(2.0, 25.0, 1.0)])
    assert whole == pytest.approx(26.0)  # 22, 33, 26 ms
    assert own == pytest.approx(2.0)


def _probe(code: str, folder: Path | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MESHLLM_BENCH_STAGES"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH / "stage_probe"), str(ROOT / "services")])
    if folder is not None:
        env["MESHLLM_BENCH_STAGES"] = str(folder)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout


def test_the_probe_wraps_every_target_and_marks_a_first_token_once(tmp_path: Path) -> None:
    code = (
        "import sitecustomize as s\n"
        "print(len(s.WRAPPED), len(s.TARGETS))\n"
        "from meshllm.plane.request.session_client import _Pipe\n"
        "p = _Pipe()\n"
        "p.put({'token_ids': []}); p.put({'token_ids': [5]}); p.put({'token_ids': [6]})\n"
        "_Pipe().put({'token_ids': [7]})\n"
    )
    wrapped, targets = _probe(code, tmp_path).split()
    assert wrapped == targets == "8"
    marks = (tmp_path / "stages.log").read_text().split("\n")
    assert [m.split()[2] for m in marks if m] == ["frontend.first_token_received"] * 2  # one per pipe


def test_the_probe_does_nothing_without_its_variable() -> None:
    code = (
        "import sitecustomize as s\n"
        "from meshllm.plane.request.session_client import _Pipe\n"
        "print(len(s.WRAPPED), hasattr(_Pipe.put, '__wrapped__'))\n"
    )
    assert _probe(code, None).split() == ["0", "False"]


def test_the_probe_marks_an_engines_first_token_handed_to_a_relay(tmp_path: Path) -> None:
    """A worker session's stream gets its tokens through `Context.relay`, not the iterator (which yields only the
    terminal): the probe marks the first token where the relay receives it, once."""
    code = (
        "import asyncio, sitecustomize, time\n"
        "from meshllm.engine.base import Context\n"
        "from meshllm.engine.mocker import MockerConfig, MockerEngine\n"
        "async def main():\n"
        "    e = MockerEngine(MockerConfig(speedup_ratio=0.0))\n"
        "    await e.start('w')\n"
        "    got = []\n"
        "    ctx = Context('r')\n"
        "    ctx.relay = lambda c: got.append(time.perf_counter())\n"
        "    req = {'request_id': 'r', 'token_ids': list(range(1, 70)), 'stop': {'max_tokens': 4, 'ignore_eos': True}}\n"
        "    out = [c async for c in e.generate(req, ctx)]\n"
        "    print(len(got), len(out), f'{got[0]:.7f}')\n"
        "    await e.cleanup()\n"
        "asyncio.run(main())\n"
    )
    sunk, yielded, first_at = _probe(code, tmp_path).split()
    assert int(sunk) >= 1 and int(yielded) == 1  # the tokens went through the relay; the iterator gave the terminal
    marks = [m.split() for m in (tmp_path / "stages.log").read_text().split("\n") if m]
    assert [m[2] for m in marks] == ["engine.start", "engine.first_token"]
    assert float(marks[1][0]) <= float(first_at)  # marked as the relay took the first token, not at the terminal
