"""bench/harness/doc.py: a script's section replaces its own in the document, and is only printed without --write."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import load_bench


def test_publish_prints_and_writes_only_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## A\n\nold a\n\n## B\n\nold b\n")
    benchdoc = load_bench("harness.doc")
    benchdoc.publish("## A", "## A\n\nnew a\n", write=False, doc=doc)
    assert "new a" in capsys.readouterr().out
    assert "old a" in doc.read_text()
    benchdoc.publish("## A", "## A\n\nnew a\n", write=True, doc=doc)
    assert doc.read_text() == "# Benchmarks\n\n## A\n\nnew a\n\n## B\n\nold b\n"
    benchdoc.publish("## C", "## C\n\nc\n", write=True, doc=doc)
    assert doc.read_text().endswith("## B\n\nold b\n\n## C\n\nc\n")


def test_no_bench_script_shadows_an_installed_package() -> None:
    """Locks: a script named like an installed top-level package (bench/vllm.py once) is imported instead of it
    wherever bench/ is on sys.path: in the bench scripts themselves and in every test that loads them."""
    import importlib.metadata

    installed = set(importlib.metadata.packages_distributions())
    shadows = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "bench").glob("*.py") if p.stem in installed)
    assert not shadows, f"bench scripts named like installed packages: {shadows}"


def test_every_section_of_the_benchmarks_doc_names_a_bench_script_that_exists() -> None:
    """Locks: a reader of docs/benchmarks.md can rerun what they read: each `## ` section names the bench/ script
    (the scenario) that wrote it, and that script is still there."""
    import re

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "benchmarks.md").read_text()
    sections = re.split(r"(?m)^## ", text)[1:]
    assert len(sections) > 20
    problems = []
    for section in sections:
        title = section.splitlines()[0]
        scripts = set(re.findall(r"\bbench/[\w/]+\.py\b", section))
        if not scripts:
            problems.append(f"{title}: names no bench/ script")
        problems += [f"{title}: {s} is gone" for s in sorted(scripts) if not (root / s).is_file()]
    assert not problems, problems
