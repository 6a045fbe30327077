"""Modules of at most 400 lines and functions of at most 50, unless a `# size:` comment says why (issue 41).

A module may be longer when one of its lines starts with `# size:` followed by
the reason; a function when the line right above its `def` (or above its first
decorator) is such a comment. Lines count as written (docstrings and comments
included). The generated code (meshllm/v1) is not counted.

bench/ (its scenarios, bench/*.py, and their harness, bench/harness/*.py) keeps the module rule only: its
report renderers write a section's prose and tables line by line, and 13 of its functions run past 50 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "services" / "meshllm"
BENCH = ROOT / "bench"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50
MARK = "# size:"


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "v1" not in p.relative_to(PACKAGE).parts[:1])


def bench_modules() -> list[Path]:
    """bench/'s scenarios and the modules of its harness package."""
    return sorted([*BENCH.glob("*.py"), *(BENCH / "harness").glob("*.py")])


def _reason(line: str) -> bool:
    text = line.strip()
    return text.startswith(MARK) and len(text) > len(MARK) + 10  # a reason, not an empty mark


def _long_modules(paths: list[Path], root: Path) -> list[str]:
    long = []
    for path in paths:
        lines = path.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES and not any(_reason(line) for line in lines):
            long.append(f"{path.relative_to(root)}: {len(lines)} lines")
    return long


def test_every_module_is_short_or_says_why() -> None:
    assert _long_modules(modules(), PACKAGE) == [], "split these modules, or say why in a '# size:' comment"


def test_every_bench_module_is_short_or_says_why() -> None:
    """A scenario keeps what is its own (its systems, workload and section); what scenarios share goes to the
    harness, and a long report to a `NAME_report.py` beside its scenario."""
    paths = bench_modules()
    assert BENCH / "harness" / "stats.py" in paths and BENCH / "mesh.py" in paths
    assert _long_modules(paths, BENCH) == [], "split these bench modules, or say why in a '# size:' comment"


def test_every_function_is_short_or_says_why() -> None:
    long = []
    for path in modules():
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if size > MAX_FUNCTION_LINES and not (first >= 2 and _reason(lines[first - 2])):
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {size} lines")
    assert long == [], "split these functions, or say why in a '# size:' comment right above them"


def test_a_mark_without_a_reason_does_not_count() -> None:
    assert not _reason("# size:")
    assert not _reason("# size: long")
    assert _reason("# size: one field after another, as the API lists them")
