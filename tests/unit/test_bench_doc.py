"""bench/benchdoc.py: a script's section replaces its own in the document, and is only printed without --write."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import load_bench


def test_publish_prints_and_writes_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## A\n\nold a\n\n## B\n\nold b\n")
    benchdoc = load_bench("benchdoc")
    benchdoc.publish("## A", "## A\n\nnew a\n", write=False, doc=doc)
    assert "new a" in capsys.readouterr().out
    assert "old a" in doc.read_text()
    benchdoc.publish("## A", "## A\n\nnew a\n", write=True, doc=doc)
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nnew a\n\n## B\n\nold b\n"
    benchdoc.publish("## C", "## C\n\nc\n", write=True, doc=doc)
    assert doc.read_text().endswith("## B\n\nold b\n\n## C\n\nc\n")
