"""meshllm.config.scoped_environ: variables set for a block, each restored afterwards (even on an error)."""

from __future__ import annotations

import os

import pytest

from meshllm.config import scoped_environ


def test_a_block_sees_the_variables_and_leaves_the_environment_as_it_found_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_TEST_KEPT", "before")
    monkeypatch.delenv("MESHLLM_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError), scoped_environ({"MESHLLM_TEST_KEPT": "inside", "MESHLLM_TEST_NEW": "1"}):
        assert os.environ["MESHLLM_TEST_KEPT"] == "inside" and os.environ["MESHLLM_TEST_NEW"] == "1"
        raise RuntimeError("a failing block restores too")
    assert os.environ["MESHLLM_TEST_KEPT"] == "before"
    assert "MESHLLM_TEST_NEW" not in os.environ
