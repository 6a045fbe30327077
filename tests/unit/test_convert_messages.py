"""One converter pair per protobuf sub-message (meshllm.protocol.convert): each round-trips on its own, and the
request converter is exactly their composition (no second mapping anywhere)."""

from __future__ import annotations

import pytest

from meshllm.errors import InvalidArgument
from meshllm.protocol import convert
from meshllm.protocol.types import (
    GuidedSettings,
    OutputSettings,
    RouteHints,
    SamplingSettings,
    StopSettings,
    TokenRequest,
)
from meshllm.v1 import generate_pb2 as pb

# Values float32 holds exactly (the wire type of the sampling floats).
SAMPLING = SamplingSettings(temperature=0.5, top_p=0.75, top_k=40, min_p=0.0625, seed=7, frequency_penalty=0.125,
                           presence_penalty=0.25, repetition_penalty=1.5, guided=GuidedSettings(regex="a+"),
                           logit_bias={5: -100.0, 42: 2.5})  # fmt: skip
STOP = StopSettings(max_tokens=16, min_tokens=2, stop_token_ids=[5, 6], ignore_eos=True)
OUTPUT = OutputSettings(logprobs=3, prompt_logprobs=1, skip_special_tokens=True)
HINTS = RouteHints(backend_instance_id="w1", dp_rank=2, lora_name="l", priority=3, allowed_worker_ids=["w1", "w2"])

PAIRS = [
    (pb.SamplingOptions, convert.sampling_into_proto, convert.sampling_from_proto, SAMPLING),
    (pb.StopConditions, convert.stop_into_proto, convert.stop_from_proto, STOP),
    (pb.OutputOptions, convert.output_into_proto, convert.output_from_proto, OUTPUT),
    (pb.RoutingHints, convert.hints_into_proto, convert.hints_from_proto, HINTS),
]


@pytest.mark.parametrize(("message", "into", "read", "value"), PAIRS, ids=lambda p: getattr(p, "__name__", ""))
def test_each_sub_message_round_trips_on_its_own(message: type, into: object, read: object, value: dict[str, object]) -> None:
    m = message()
    into(m, value)  # type: ignore[operator]
    assert read(m) == value  # type: ignore[operator]


@pytest.mark.parametrize("guided", [GuidedSettings(json_schema="{}"), GuidedSettings(grammar="root ::= x"),
                                    GuidedSettings(choice=["a", "b"]), GuidedSettings(json_object=True)])  # fmt: skip
def test_every_guided_constraint_round_trips(guided: GuidedSettings) -> None:
    m = pb.GuidedDecoding()
    convert.guided_into_proto(m, guided)
    assert convert.guided_from_proto(m) == guided
    assert convert.guided_from_proto(pb.GuidedDecoding()) is None


def test_the_request_is_the_composition_of_its_sub_messages() -> None:
    req = TokenRequest(request_id="r", token_ids=[1, 2], model="m", sampling=SAMPLING, stop=STOP, output=OUTPUT,
                          routing=HINTS, eos_token_ids=[2], annotations={"k": "v"})  # fmt: skip
    m = convert.request_to_proto(req)
    assert convert.request_from_proto(m) == req
    assert convert.sampling_from_proto(m.sampling) == SAMPLING and convert.hints_from_proto(m.routing) == HINTS


def test_a_value_the_wire_cannot_hold_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="out of range"):
        convert.request_to_proto(TokenRequest(request_id="r", token_ids=[1], sampling=SamplingSettings(top_k=2**31)))
    with pytest.raises(InvalidArgument, match="out of range"), convert.wire_range():
        convert.hints_into_proto(pb.RoutingHints(), RouteHints(dp_rank=2**40))


def test_no_internal_type_shares_a_name_with_a_wire_message() -> None:
    """A name tells a dict from a protobuf message (docs/protocol.md has the table of pairs)."""
    from typing import is_typeddict

    from meshllm.protocol import types
    from meshllm.v1 import discovery_pb2, events_pb2, generate_pb2, inference_pb2, router_pb2, session_pb2, worker_pb2

    wire = {
        name
        for module in (generate_pb2, discovery_pb2, events_pb2, inference_pb2, router_pb2, session_pb2, worker_pb2)
        for name in module.DESCRIPTOR.message_types_by_name
    }
    internal = {name for name in types.__all__ if is_typeddict(getattr(types, name))}
    assert {"TokenRequest", "TokenChunk"} <= internal
    assert not internal & wire
