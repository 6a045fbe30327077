"""Modules of at most 400 lines and functions of at most 50, unless a `# size:` comment says why (issue 41).

A module may be longer when one of its lines starts with `# size:` followed by
the reason; a function when the line right above its `def` (or above its first
decorator) is such a comment. Lines count as written (docstrings and comments
included). The generated code (meshllm/v1) is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "services" / "meshllm"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50
MARK = "# size:"


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "v1" not in p.relative_to(PACKAGE).parts[:1])


def _reason(line: str) -> bool:
    text = line.strip()
    return text.startswith(MARK) and len(text) > len(MARK) + 10  # a reason, not an empty mark


def test_every_module_is_short_or_says_why() -> None:
    long = []
    for path in modules():
        lines = path.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES and not any(_reason(line) for line in lines):
            long.append(f"{path.relative_to(PACKAGE)}: {len(lines)} lines")
    assert long == [], "split these modules, or say why in a '# size:' comment"


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
