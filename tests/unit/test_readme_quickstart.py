"""The README quickstart can be followed literally: the model names its curls use are the ones served, and
`make run` takes PORT= and ARGS= and says how to put `meshllm` on PATH.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from meshllm.engine.llamacpp.config import SMOLLM2_GGUF

ROOT = Path(__file__).resolve().parents[2]


def quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Quickstart") : text.index("\n## ", text.index("## Quickstart") + 1)]


def test_each_engine_section_curls_the_model_that_engine_serves() -> None:
    sections = re.split(r"\n\*\*(\w+)\*\*", quickstart())
    by_engine = dict(zip(sections[1::2], sections[2::2], strict=True))
    served = {"mocker": "mocker", "llamacpp": SMOLLM2_GGUF.removesuffix(".gguf")}  # LlamaCppConfig.served_model_name
    for engine, model in served.items():
        names = re.findall(r'"model": "([^"]+)"', by_engine[engine])
        assert names == [model], (engine, names)
    assert "meshllm run --engine llamacpp" in by_engine["llamacpp"]


def test_make_run_takes_a_port_and_flags_and_says_how_to_activate() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "run", "PORT=9123", "ARGS=--workers 3"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert ".venv/bin/meshllm run --http-port 9123 --workers 3" in out.stdout
    assert ". .venv/bin/activate" in out.stdout
    default = subprocess.run(["make", "-n", "-o", ".venv/.installed", "run"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30, check=True)  # fmt: skip
    assert ".venv/bin/meshllm run --http-port 8000 " in default.stdout + " "
