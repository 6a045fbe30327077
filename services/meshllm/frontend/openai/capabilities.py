"""What the engines behind a model can do (ModelCard `capabilities`), combined over its live workers.

Each worker publishes its engine's capabilities (`LLMEngine.supports_*`) in
its card; a model's are combined over every live card: False when any
worker lacks one (a request may be routed to it), True when all have it,
None ("not said") when some card predates the field and none says False.

The 400s refusing what a model's engines cannot do are in
`frontend/openai/capability_checks.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshllm.v1 import discovery_pb2

__all__ = ["Capabilities", "combine"]

_NAMES = ("prompt_logprobs", "embeddings", "guided_decoding")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """A model's capabilities over its live workers: True, False, or None when not said (older cards)."""

    prompt_logprobs: bool | None = None
    embeddings: bool | None = None
    guided_decoding: bool | None = None


def combine(cards: Iterable[discovery_pb2.ModelCard]) -> Capabilities:
    """The capabilities every card's worker shares (see the module docstring)."""
    said = [c.capabilities if c.HasField("capabilities") else None for c in cards]
    values: dict[str, bool | None] = {}
    for name in _NAMES:
        each = [None if c is None else bool(getattr(c, name)) for c in said]
        values[name] = False if False in each else None if (None in each or not each) else True
    return Capabilities(**values)
