"""The one validation layer (meshllm.protocol.validate) and the fixes around it.

Locks: HTTP bodies and token-level requests are refused with the same
message for the same value; every integer bound fits its proto field (no
overflow into a 500); chat_template_kwargs may carry add_generation_prompt
and tools without a duplicate-keyword crash; unknown enum values are
InvalidArgument; error messages are truncated; a traceback is logged once
per distinct error.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

from meshllm.errors import MAX_MESSAGE_CHARS, ContextLengthExceeded, InvalidArgument, NotFound, log_unexpected, shorten
from meshllm.frontend.text.chat_template import ChatTemplate
from meshllm.protocol.convert import request_from_proto, request_to_proto
from meshllm.protocol.openai import parse_chat, parse_completion
from meshllm.protocol.types import TokenRequest
from meshllm.protocol.validate import INT32_MAX, MAX_PROMPT_TOKENS, Limits, validate_generate, validate_prompt
from meshllm.v1 import generate_pb2

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat_error(**fields: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        parse_chat({**CHAT, **fields})
    return info.value


def token_error(req: TokenRequest, limits: Limits = Limits()) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        validate_generate(req, limits)
    return info.value


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", 2**31), ("max_tokens", 2**32), ("min_tokens", 2**31), ("max_completion_tokens", 2**31), ("seed", 2**64)],
)
def test_http_integers_are_bounded_by_their_proto_field(field: str, value: int) -> None:
    err = chat_error(**{field: value})
    assert err.param == field and "greater than the maximum" in err.message


def test_the_largest_accepted_integers_convert_to_proto() -> None:
    req = parse_chat({**CHAT, "top_k": INT32_MAX, "seed": 2**64 - 1, "min_tokens": 1, "max_tokens": INT32_MAX})
    m = request_to_proto(
        {"request_id": "r", "token_ids": [1], "sampling": req.sampling, "stop": {**req.stop_conditions, "max_tokens": INT32_MAX}}
    )
    assert m.sampling.top_k == INT32_MAX and m.sampling.seed == 2**64 - 1


def test_a_value_the_proto_cannot_hold_is_invalid_argument_not_a_crash() -> None:
    with pytest.raises(InvalidArgument):
        request_to_proto({"request_id": "r", "token_ids": [1], "sampling": {"top_k": 2**31}})


@pytest.mark.parametrize(
    ("key", "value"),
    [("temperature", math.nan), ("temperature", 2.5), ("top_p", math.inf), ("top_p", 0.0), ("min_p", -0.1),
     ("frequency_penalty", -math.inf), ("repetition_penalty", 0.0)],
)  # fmt: skip
def test_token_level_sampling_is_refused_with_the_http_message(key: str, value: float) -> None:
    err = token_error({"request_id": "r", "token_ids": [1], "sampling": {key: value}})  # type: ignore[misc]
    assert err.param == f"sampling.{key}"
    if not math.isnan(value):  # JSON has no NaN: HTTP cannot send one
        http = chat_error(**{key: value})
        assert err.message == http.message.replace(f"'{key}'", f"'sampling.{key}'")


def test_token_level_logit_bias_is_checked_against_the_vocabulary_with_the_http_rules() -> None:
    """Locks: a mesh peer's logit_bias gets the HTTP API's checks, and token ids beyond the model's vocabulary."""
    base: TokenRequest = {"request_id": "r", "token_ids": [1]}
    validate_generate({**base, "sampling": {"logit_bias": {99: 100.0}}}, Limits(vocab_size=100))
    err = token_error({**base, "sampling": {"logit_bias": {100: 1.0}}}, Limits(vocab_size=100))
    assert err.param == "sampling.logit_bias" and "token 100 is not in the model's vocabulary (0..99)" in err.message
    err = token_error({**base, "sampling": {"logit_bias": {3: 150.0}}})
    http = chat_error(logit_bias={"3": 150})
    assert err.message == http.message.replace("'logit_bias'", "'sampling.logit_bias'")


@pytest.mark.parametrize(("top_k", "ok"), [(-2, False), (-1, True), (0, True), (40, True), (-(2**31), False)])
def test_top_k_minus_one_and_zero_mean_disabled_other_negatives_are_refused(top_k: int, ok: bool) -> None:
    req: TokenRequest = {"request_id": "r", "token_ids": [1], "sampling": {"top_k": top_k}}
    if ok:
        validate_generate(req)
        assert "top_k" not in parse_chat({**CHAT, "top_k": top_k}).sampling or top_k > 0
    else:
        assert token_error(req).param == "sampling.top_k"
        assert chat_error(top_k=top_k).param == "top_k"


def test_token_ids_outside_the_vocabulary_and_long_prompts_are_refused() -> None:
    limits = Limits(context_length=100, vocab_size=50)
    assert "outside the vocabulary (size 50)" in token_error({"request_id": "r", "token_ids": [1, 50]}, limits).message
    err = token_error({"request_id": "r", "token_ids": [1], "stop": {"stop_token_ids": [99]}}, limits)
    assert err.param == "stop.stop_token_ids"
    with pytest.raises(ContextLengthExceeded):
        validate_generate({"request_id": "r", "token_ids": [1] * 100}, limits)
    with pytest.raises(ContextLengthExceeded):
        validate_generate({"request_id": "r", "token_ids": [1] * 60, "stop": {"max_tokens": 41}}, limits)
    validate_generate({"request_id": "r", "token_ids": [1] * 60, "stop": {"max_tokens": 40}}, limits)
    with pytest.raises(InvalidArgument, match="more than the maximum"):
        validate_prompt(range(MAX_PROMPT_TOKENS + 1))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="must not be empty"):
        validate_prompt([])
    # a decode leg continues a prompt that may fill the context; only emptiness is checked for its length
    validate_generate({"request_id": "r", "token_ids": [1] * 100, "disagg": {"request_type": "generation_only"}}, limits)


def test_min_tokens_over_max_tokens_and_bad_logprobs_are_refused() -> None:
    assert (
        token_error({"request_id": "r", "token_ids": [1], "stop": {"max_tokens": 2, "min_tokens": 3}}).param == "stop.min_tokens"
    )
    assert token_error({"request_id": "r", "token_ids": [1], "output": {"logprobs": 21}}).param == "output.logprobs"
    assert token_error({"request_id": "x" * 2000, "token_ids": [1]}).param == "request_id"


def test_unknown_enum_value_is_invalid_argument() -> None:
    m = generate_pb2.GenerateRequest(request_id="r", token_ids=[1])
    m.disagg.request_type = 99  # type: ignore[assignment]
    with pytest.raises(InvalidArgument, match="unknown value 99") as info:
        request_from_proto(m)
    assert info.value.param == "disagg.request_type"


def test_chat_template_kwargs_may_set_add_generation_prompt_and_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    req = parse_chat({**CHAT, "chat_template_kwargs": {"add_generation_prompt": False, "tools": tools, "x": 1}})
    assert req.add_generation_prompt is False and req.tools == tuple(tools) and req.template_kwargs == {"x": 1}
    same = parse_chat({**CHAT, "add_generation_prompt": False, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert same.add_generation_prompt is False
    assert chat_error(add_generation_prompt=True, chat_template_kwargs={"add_generation_prompt": False}).param == (
        "chat_template_kwargs.add_generation_prompt"
    )
    assert chat_error(chat_template_kwargs={"add_generation_prompt": "yes"}).param == "chat_template_kwargs.add_generation_prompt"
    assert chat_error(chat_template_kwargs={"tools": "nope"}).param == "chat_template_kwargs.tools"
    assert chat_error(tools=tools, chat_template_kwargs={"tools": []}).param == "chat_template_kwargs.tools"
    assert chat_error(chat_template_kwargs={"messages": []}).param == "chat_template_kwargs.messages"


def test_the_template_renderer_passes_the_reserved_names_once() -> None:
    t = ChatTemplate("{{ add_generation_prompt }}|{{ tools }}|{{ messages | length }}|{{ x }}")
    out = t.render([{"role": "user", "content": "a"}], add_generation_prompt=False, tools=None, x=1)
    assert out == "False|None|1|1"


def test_completion_integers_are_bounded_too() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_completion({"model": "m", "prompt": "a", "top_k": 2**40})
    assert info.value.param == "top_k"
    with pytest.raises(InvalidArgument) as info:
        parse_completion({"model": "m", "prompt": "a", "temperature": 10**400})
    assert info.value.param == "temperature"


def test_error_messages_truncate_echoed_input() -> None:
    err = NotFound(f"model {'é' * 20_000!r} not found")
    assert len(err.message) <= MAX_MESSAGE_CHARS and err.message.startswith("model 'éé") and err.message.endswith("' not found")
    assert "characters cut" in err.message
    assert shorten("short") == "short" and len(shorten("y" * 5000, 80)) <= 80


def test_a_traceback_is_logged_once_per_distinct_error(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.validation")

    def fail(i: int) -> None:
        raise KeyError(i)  # same place every time: one distinct error

    def fail_elsewhere() -> None:
        raise ValueError("other")

    with caplog.at_level(logging.ERROR, logger="test.validation"):
        for i in range(50):
            try:
                fail(i)
            except KeyError as exc:
                log_unexpected(log, "boom", exc, repeat_interval_s=3600)
        try:
            fail_elsewhere()
        except ValueError as exc:
            log_unexpected(log, "boom", exc, repeat_interval_s=3600)
        for i in range(3):
            try:
                fail(i)
            except KeyError as exc:
                log_unexpected(log, "boom", exc, repeat_interval_s=0)  # the interval passed: one line, no traceback
    with_tb = [r for r in caplog.records if r.exc_info]
    assert [type(r.exc_info[1]).__name__ for r in with_tb if r.exc_info] == ["KeyError", "ValueError"]
    repeats = [r.getMessage() for r in caplog.records if not r.exc_info]
    assert len(repeats) == 3 and "50 times since the last report" in repeats[0]
