"""The trtllm engine's pure translations, against stand-ins shaped like TensorRT-LLM's objects."""

from __future__ import annotations

import dataclasses
import math
import re
from types import SimpleNamespace
from typing import Any

import pytest
from test_trtllm_fakes import (
    CompletionOutput,
    DisaggregatedParams,
    GuidedDecodingParams,
    KvCacheMetrics,
    Logprob,
    RequestPerfMetrics,
    SamplingParams,
)

from meshllm.engine.trtllm import translate as tr
from meshllm.errors import ContextLengthExceeded, FailedPrecondition, InvalidArgument
from meshllm.protocol.convert import chunk_from_proto, chunk_to_proto, request_from_proto, request_to_proto
from meshllm.protocol.types import TokenChunk, TokenRequest
from meshllm.v1 import generate_pb2 as pb


def req(**kw: Any) -> TokenRequest:
    r: TokenRequest = {"request_id": "r1", "token_ids": [1, 2, 3, 4]}
    r.update(kw)  # type: ignore[typeddict-item]
    return r


def kwargs(r: TokenRequest, **kw: Any) -> dict[str, Any]:
    return tr.sampling_kwargs(r, default_max_tokens=kw.pop("default_max_tokens", 16), **kw)


# ------------------------------------------------------------ request side


def test_every_sampling_option_maps_to_a_real_sampling_params_field() -> None:
    """Each option lands on the SamplingParams field of the same meaning, and the kwargs construct it."""
    r = req(
        sampling={
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 7,
            "frequency_penalty": 0.1,
            "presence_penalty": 0.2,
            "repetition_penalty": 1.1,
        },
        stop={"max_tokens": 12, "min_tokens": 3, "stop_token_ids": [50]},
        output={"logprobs": 2},
    )
    kw = kwargs(r)
    assert kw == {
        "max_tokens": 12,
        "min_tokens": 3,
        "stop_token_ids": [50],
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 7,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.2,
        "repetition_penalty": 1.1,
        "logprobs": 2,
        "detokenize": False,
        "return_perf_metrics": True,
    }
    SamplingParams(**kw)


def test_temperature_zero_is_greedy_through_top_k_one() -> None:
    """Greedy is top_k=1 (TensorRT-LLM's `_greedy_decoding`), never temperature 0; top_p/min_p are dropped."""
    kw = kwargs(req(sampling={"temperature": 0.0, "top_p": 0.5, "min_p": 0.1, "seed": 0}))
    assert kw["top_k"] == 1 and "temperature" not in kw and "top_p" not in kw and "min_p" not in kw
    assert kw["seed"] == 0


def test_first_eos_is_end_id_and_the_others_are_stop_tokens_that_finish_as_eos() -> None:
    """eos_token_ids[0] → end_id; further EOS ids → stop_token_ids, reported as "eos" (not "stop")."""
    r = req(eos_token_ids=[2, 7, 9], stop={"stop_token_ids": [9, 50]})
    kw = kwargs(r)
    assert kw["end_id"] == 2 and kw["stop_token_ids"] == [9, 50, 7]
    assert tr.extra_eos_ids(r) == frozenset({7})
    assert tr.map_finish_reason("stop", 7, extra_eos=tr.extra_eos_ids(r)) == ("eos", "")
    assert tr.map_finish_reason("stop", 9, extra_eos=tr.extra_eos_ids(r)) == ("stop", "9")


def test_ignore_eos_sends_no_extra_eos_stop_tokens() -> None:
    r = req(eos_token_ids=[2, 7], stop={"ignore_eos": True})
    kw = kwargs(r)
    assert kw["ignore_eos"] is True and "stop_token_ids" not in kw
    assert tr.extra_eos_ids(r) == frozenset()


def test_max_tokens_defaults_to_the_rest_of_the_context_and_is_checked_against_it() -> None:
    assert kwargs(req(), context_length=10)["max_tokens"] == 6
    assert kwargs(req(), default_max_tokens=5)["max_tokens"] == 5
    assert kwargs(req(stop={"max_tokens": 6}), context_length=10)["max_tokens"] == 6
    with pytest.raises(ContextLengthExceeded):
        kwargs(req(stop={"max_tokens": 7}), context_length=10)
    with pytest.raises(ContextLengthExceeded):
        kwargs(req(token_ids=list(range(10))), context_length=10)
    with pytest.raises(InvalidArgument):
        kwargs(req(stop={"max_tokens": -1}))


def test_a_context_only_leg_generates_exactly_one_token() -> None:
    kw = kwargs(req(stop={"max_tokens": 100, "min_tokens": 5}, disagg={"request_type": "context_only"}))
    assert kw["max_tokens"] == 1 and kw["min_tokens"] == 1


@pytest.mark.parametrize(
    ("guided", "expected"),
    [
        ({"json_schema": '{"type": "object"}'}, {"json": '{"type": "object"}'}),
        ({"regex": "[a-z]+"}, {"regex": "[a-z]+"}),
        ({"grammar": 'root ::= "yes"'}, {"grammar": 'root ::= "yes"'}),
        ({"json_object": True}, {"json_object": True}),
    ],
)
def test_guided_decoding_maps_to_guided_decoding_params(guided: dict[str, Any], expected: dict[str, Any]) -> None:
    kw = kwargs(req(sampling={"guided": guided}))
    assert kw["guided_decoding"] == expected
    GuidedDecodingParams(**kw["guided_decoding"])


def test_a_choice_becomes_an_escaped_alternation_regex() -> None:
    """GuidedDecodingParams has no "choice"; the regex matches each choice literally and nothing else."""
    kw = kwargs(req(sampling={"guided": {"choice": ["yes", "no (maybe)", "a.b"]}}))
    pattern = kw["guided_decoding"]["regex"]
    for choice in ("yes", "no (maybe)", "a.b"):
        assert re.fullmatch(pattern, choice)
    assert not re.fullmatch(pattern, "axb") and not re.fullmatch(pattern, "no maybe")


def test_two_guided_constraints_are_invalid() -> None:
    with pytest.raises(InvalidArgument):
        kwargs(req(sampling={"guided": {"regex": "a", "grammar": "b"}}))


def test_logprobs_zero_still_asks_for_the_chosen_tokens_logprob() -> None:
    assert kwargs(req(output={"logprobs": 0}))["logprobs"] == 1
    assert "logprobs" not in kwargs(req(output={"skip_special_tokens": True}))


def test_a_request_decoded_from_the_proto_translates_the_same() -> None:
    """Proto-decoded requests carry explicit zero values (min_tokens=0, ignore_eos=False); they change nothing."""
    r = req(sampling={"temperature": 0.5, "guided": {"choice": ["a", "b"]}}, stop={"max_tokens": 4}, eos_token_ids=[2])
    again = request_from_proto(pb.GenerateRequest.FromString(request_to_proto(r).SerializeToString()))
    assert kwargs(again) == kwargs(r)


# ------------------------------------------------------------- output side


def test_cumulative_outputs_become_deltas_that_add_up_to_the_final_output() -> None:
    """CompletionOutput.token_ids grows across streaming steps; each chunk carries only the new tokens."""
    out = CompletionOutput()
    cursor, chunks = 0, []
    for step in ([11], [12, 13], [], [14]):
        out.token_ids.extend(step)
        delta, cursor = tr.token_delta(out.token_ids, cursor)
        chunks.append(delta)
    assert chunks == [[11], [12, 13], [], [14]]
    assert [t for delta in chunks for t in delta] == out.token_ids


def test_a_generation_only_leg_skips_the_prefills_first_token() -> None:
    """The decode leg's token_ids start with first_gen_tokens; the cursor starts past them."""
    delta, cursor = tr.token_delta([42, 43, 44], 1)
    assert (delta, cursor) == ([43, 44], 3)


def test_a_trimmed_stop_token_below_the_cursor_emits_nothing() -> None:
    assert tr.token_delta([1, 2], 3) == ([], 3)


def test_logprobs_come_from_the_token_to_logprob_dicts_aligned_with_token_ids() -> None:
    out = CompletionOutput(
        token_ids=[5, 6],
        logprobs=[
            {5: Logprob(-0.1, 1), 9: Logprob(-2.5, 2)},
            {8: Logprob(-0.2, 1), 6: Logprob(-0.9, 2), 7: Logprob(-3.0, 3)},
        ],
    )
    lps = tr.logprob_delta(out.logprobs, out.token_ids, 0, 2, 2)
    assert lps == [
        {"token_id": 5, "logprob": -0.1, "top": [(5, -0.1), (9, -2.5)]},
        {"token_id": 6, "logprob": -0.9, "top": [(8, -0.2), (6, -0.9)]},
    ]
    assert tr.logprob_delta(out.logprobs, out.token_ids, 1, 2, 0) == [{"token_id": 6, "logprob": -0.9, "top": []}]


def test_float_logprobs_and_missing_ones() -> None:
    """The C++ path gives one float per token; positions without logprobs give none at all."""
    assert tr.logprob_delta([-0.5, -0.25], [3, 4], 1, 2, 5) == [{"token_id": 4, "logprob": -0.25}]
    assert tr.logprob_delta([], [3, 4], 0, 2, 1) == []
    assert tr.logprob_delta([{9: Logprob(-1.0)}], [3], 0, 1, 1)[0]["logprob"] == -math.inf


@pytest.mark.parametrize(
    ("reason", "stop_reason", "expected"),
    [
        ("stop", None, ("eos", "")),
        ("stop", 13, ("stop", "13")),
        ("stop", "</s>", ("stop", "</s>")),
        ("length", None, ("length", "")),
        ("cancelled", None, ("cancelled", "")),
        ("timeout", None, ("error", "timeout")),
        (None, None, ("error", "finished without a finish reason")),
        ("something-new", None, ("error", "something-new")),
    ],
)
def test_finish_reasons_map_to_ours(reason: str | None, stop_reason: Any, expected: tuple[str, str]) -> None:
    assert tr.map_finish_reason(reason, stop_reason) == expected


def test_cached_tokens_come_from_the_requests_kv_reuse_metrics() -> None:
    out = CompletionOutput(request_perf_metrics=RequestPerfMetrics(KvCacheMetrics(num_reused_blocks=2)))
    assert tr.cached_tokens(SimpleNamespace(), out, block_size=32, prompt_len=100) == 64
    assert tr.cached_tokens(SimpleNamespace(), out, block_size=32, prompt_len=40) == 40
    assert tr.cached_tokens(SimpleNamespace(cached_tokens=17), out, block_size=32, prompt_len=100) == 17
    assert tr.cached_tokens(SimpleNamespace(), CompletionOutput(), block_size=32, prompt_len=100) == 0
    assert tr.usage(10, 3, 12) == {"prompt_tokens": 10, "completion_tokens": 3, "cached_tokens": 10}


# ---------------------------------------------------------- disaggregation


def test_disaggregated_params_round_trip_through_our_proto() -> None:
    """context-only answer → our DisaggInfo → proto bytes → generation-only kwargs == the answer, retyped."""
    answer = DisaggregatedParams(
        request_type="context_only",
        first_gen_tokens=[1234],
        ctx_request_id=2**40 + 5,
        opaque_state=b"\x00\x01ucx-state\xff",
        draft_tokens=[7, 8],
        disagg_request_id=99,
        ctx_dp_rank=1,
        ctx_info_endpoint="tcp://10.0.0.1:5000",
    )
    ours = tr.disagg_from_trtllm(answer, cached=64)
    chunk: TokenChunk = {
        "token_ids": [1234],
        "finish_reason": "length",
        "disagg": ours,
        "usage": {"prompt_tokens": 100, "completion_tokens": 1, "cached_tokens": 64},
    }
    wire = chunk_from_proto(pb.GenerateChunk.FromString(chunk_to_proto(chunk).SerializeToString()))
    decode = req(disagg={**wire["disagg"], "request_type": "generation_only"})
    decoded = request_from_proto(pb.GenerateRequest.FromString(request_to_proto(decode).SerializeToString()))
    rebuilt = DisaggregatedParams(**tr.disagg_to_trtllm(decoded["disagg"]))
    assert rebuilt == dataclasses.replace(answer, request_type="generation_only")
    assert wire["disagg"]["cached_tokens"] == 64


def test_an_older_answer_without_extras_round_trips_with_only_the_core_fields() -> None:
    """Older DisaggregatedParams lack draft/endpoint fields; none are invented for the generation leg."""
    answer = SimpleNamespace(request_type="context_only", first_gen_tokens=[5], ctx_request_id=3, opaque_state=None)
    kw = tr.disagg_to_trtllm({**tr.disagg_from_trtllm(answer), "request_type": "generation_only"})
    assert kw == {"request_type": "generation_only", "first_gen_tokens": [5], "ctx_request_id": 3, "opaque_state": None}


def test_bad_disaggregated_params_are_refused_with_typed_errors() -> None:
    with pytest.raises(InvalidArgument, match="first_token_ids"):
        tr.disagg_to_trtllm({"request_type": "generation_only", "ctx_request_id": "1"})
    with pytest.raises(InvalidArgument, match="integer"):
        tr.disagg_to_trtllm({"request_type": "generation_only", "first_token_ids": [1], "ctx_request_id": "x"})
    with pytest.raises(InvalidArgument, match="trtllm prefill"):
        tr.disagg_to_trtllm({"first_token_ids": [1], "ctx_request_id": "1", "kv_handle": b"sample:r1"})
    with pytest.raises(InvalidArgument, match="unknown fields"):
        tr.decode_handle(tr.encode_handle({"evil": 1}))
    with pytest.raises(FailedPrecondition):
        tr.disagg_from_trtllm(DisaggregatedParams(request_type="context_only"))


def test_logit_bias_is_refused_with_its_field_named() -> None:
    """Locks: TensorRT-LLM's SamplingParams has no per-token bias map, so the engine refuses it instead of ignoring it."""
    with pytest.raises(InvalidArgument, match="logit_bias is not supported by the trtllm engine") as info:
        kwargs(req(sampling={"temperature": 0.0, "logit_bias": {5: 1.0}}))
    assert info.value.param == "logit_bias"
