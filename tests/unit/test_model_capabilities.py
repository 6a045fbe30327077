"""Combining the capabilities of a model's ModelCards: old cards (no field) leave the frontend as it was."""

from __future__ import annotations

from meshllm.frontend.openai.capabilities import Capabilities, combine
from meshllm.v1 import discovery_pb2


def card(**caps: bool) -> discovery_pb2.ModelCard:
    c = discovery_pb2.ModelCard(name="m")
    if caps:
        c.capabilities.CopyFrom(discovery_pb2.EngineCapabilities(**caps))
    return c


def test_cards_that_say_nothing_leave_every_capability_unknown() -> None:
    assert combine([]) == Capabilities()
    assert combine([card(), card()]) == Capabilities(None, None, None)


def test_an_all_false_message_still_counts_as_said() -> None:
    c = discovery_pb2.ModelCard(name="m")
    c.capabilities.SetInParent()
    assert combine([c]) == Capabilities(False, False, False)


def test_all_must_have_it_and_one_without_it_is_enough_to_refuse() -> None:
    full = card(prompt_logprobs=True, embeddings=True, guided_decoding=True)
    assert combine([full, full]) == Capabilities(True, True, True)
    assert combine([full, card(prompt_logprobs=True, guided_decoding=False)]) == Capabilities(True, False, False)
    assert combine([full, card()]) == Capabilities(None, None, None)  # an old worker: unknown, checked as before
    assert combine([card(embeddings=True), card()]).prompt_logprobs is False  # said False by one card wins
