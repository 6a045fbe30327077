"""docs/python-api.md's example runs as printed: its Python block is extracted and run in a fresh interpreter.

Locks: the documented imports exist; a custom `LLMEngine` served by two
`Worker`s answers a `WorkerClient` directly; a `RouterCore` finds both in
discovery, reports a decision with both candidates, and routes requests
that each come back complete; and the output is what the doc shows (bar
addresses and ids).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "python-api.md"


def blocks(lang: str) -> list[str]:
    """The fenced code blocks of the doc whose info string is `lang` ("" = none)."""
    found: list[tuple[str, str]] = []
    info: str | None = None
    lines: list[str] = []
    for line in DOC.read_text().splitlines(keepends=True):
        if not line.startswith("```"):
            lines.append(line)
        elif info is None:
            info, lines = line[3:].strip(), []
        else:
            found.append((info, "".join(lines)))
            info = None
    return [text for kind, text in found if kind == lang]


def test_the_documented_example_runs_and_prints_what_the_doc_shows(tmp_path: Path) -> None:
    (program,) = blocks("python")
    script = tmp_path / "example.py"
    script.write_text(program)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = next(b for b in blocks("") if b.startswith("counter at "))

    def shape(text: str) -> list[str]:
        text = re.sub(r"127\.0\.0\.1:\d+", "ADDR", text)
        return re.sub(r"counting-[0-9a-f]+", "WORKER", text).splitlines()

    assert shape(proc.stdout) == shape(printed)
