"""An engine defined outside services/ is loaded by `module:Class` and passes the kit."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshllm.engine import load_engine_class
from meshllm.engine.base import LLMEngine
from meshllm.testing.conformance import factory_for, run_conformance

EXTERNAL = Path(__file__).parent / "external"


async def test_an_engine_in_its_own_module_outside_services_passes_the_kit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Locks: third-party engines need nothing but the public contract and an importable module."""
    monkeypatch.syspath_prepend(str(EXTERNAL))
    cls = load_engine_class("my_engine:MyEngine")
    assert issubclass(cls, LLMEngine) and cls.__module__ == "my_engine"
    report = await run_conformance(factory_for(cls, ["--model-name", "echo-1"]))
    assert report.passed, report.summary()
