"""The per-token SSE event built from a precomputed frame is byte for byte the one built from the chunk dict."""

from __future__ import annotations

import random

import orjson
import pytest

from meshllm.frontend.openai.bodies import _event, content_event_frame
from meshllm.protocol.openai import chat_chunk


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_content_frame_equals_the_dict_event(seed: int, include_usage: bool) -> None:
    rng = random.Random(seed)
    alphabet = ["a", '"', "\\", "\n", "\x00", "\x1f", "é", "日", "😀", "</script>", "\u2028", " "]
    rid = "chatcmpl-" + "".join(rng.choice('ab"\\é') for _ in range(6))
    model = rng.choice(["m", 'we"ird\\model', "smollm2-135m-instruct"])
    index = rng.randint(0, 3)
    prefix, suffix = content_event_frame(rid, 1_700_000_000, model, index, include_usage)
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        expected = _event(chat_chunk(rid, 1_700_000_000, model, index, content=text, include_usage=include_usage))
        assert prefix + orjson.dumps(text) + suffix == expected


def test_content_frame_parses_as_an_openai_chunk() -> None:
    prefix, suffix = content_event_frame("chatcmpl-1", 5, "m", 0, False)
    event = prefix + orjson.dumps("hi") + suffix
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    obj = orjson.loads(event[len(b"data: ") : -2])
    assert obj["choices"][0]["delta"] == {"content": "hi"} and obj["choices"][0]["finish_reason"] is None
