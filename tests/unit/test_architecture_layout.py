"""docs/architecture.md's "Package layout" names every package of services/meshllm (and nothing that is gone)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "services" / "meshllm"


def layout_block() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Package layout", 1)[1]
    return section.split("```", 2)[1]


def test_every_package_is_listed_and_every_listed_package_exists() -> None:
    packages = {
        str(init.parent.relative_to(PACKAGE)) + "/"
        for init in PACKAGE.rglob("__init__.py")
        if init.parent != PACKAGE and "__pycache__" not in init.parts
    }
    listed = set(re.findall(r"^  ([a-z0-9_/]+/) ", layout_block(), flags=re.MULTILINE))
    assert packages - listed == set(), "packages missing from docs/architecture.md's layout"
    assert listed - packages == set(), "docs/architecture.md's layout lists packages that do not exist"
