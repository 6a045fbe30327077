"""docs/benchmarks.md: where every bench script writes its own `## Section`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def write_section(heading: str, section: str, doc: Path = DOC) -> None:
    """Replace the section that starts with `heading` (append it when missing); other sections stay."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    pattern = re.compile(r"^" + re.escape(heading) + r"\n.*?(?=^## |\Z)", re.S | re.M)
    body = section.rstrip("\n") + "\n\n"  # keep a blank line before the next section
    text = pattern.sub(lambda _: body, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + body
    doc.write_text(text.rstrip("\n") + "\n")


def publish(heading: str, section: str, *, write: bool, doc: Path = DOC) -> None:
    """Print a bench script's section; with `write`, also put it in `doc` under `heading` (`write_section`)."""
    print(section)
    if write:
        write_section(heading, section, doc)
        print(f"updated {doc}", file=sys.stderr)
