"""Internal request/response types: TypedDicts mirroring the meshllm.v1 protos.

Engines and services work with these plain dicts; protobuf messages exist only
at the gRPC edge (`meshllm.protocol.convert` turns one into the other, once per
hop). Optional keys are simply absent.

Finish reasons are the lower-case names of `meshllm.v1.FinishReason`:
"eos", "stop", "length", "cancelled", "error", "content_filter".
"""

from __future__ import annotations

from typing import Literal, NotRequired, Required, TypedDict

__all__ = [
    "FINISH_REASONS",
    "DisaggParams",
    "ErrorInfo",
    "FinishReason",
    "GenerateChunk",
    "GenerateRequest",
    "GuidedDecoding",
    "OutputOptions",
    "RequestType",
    "RoutingHints",
    "SamplingOptions",
    "StopConditions",
    "TokenLogprob",
    "Usage",
]

FinishReason = Literal["eos", "stop", "length", "cancelled", "error", "content_filter"]
FINISH_REASONS: tuple[FinishReason, ...] = ("eos", "stop", "length", "cancelled", "error", "content_filter")
RequestType = Literal["context_only", "generation_only"]


class GuidedDecoding(TypedDict, total=False):
    """At most one key: the output constraint."""

    json_schema: str
    regex: str
    grammar: str
    choice: list[str]
    json_object: bool


class SamplingOptions(TypedDict, total=False):
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    guided: GuidedDecoding


class StopConditions(TypedDict, total=False):
    max_tokens: int
    min_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool


class OutputOptions(TypedDict, total=False):
    logprobs: int  # top alternatives per generated token (0 = the sampled token's only)
    prompt_logprobs: int  # top alternatives per prompt token; engines that cannot refuse it (InvalidArgument)
    skip_special_tokens: bool
    embedding: bool  # embed the prompt instead of generating (see generate.proto)


class RoutingHints(TypedDict, total=False):
    backend_instance_id: str
    prefill_worker_id: str
    decode_worker_id: str
    dp_rank: int
    lora_name: str
    priority: int
    allowed_worker_ids: list[str]


class DisaggParams(TypedDict, total=False):
    """Sent to a prefill leg (request_type only) and answered by it (the rest)."""

    request_type: RequestType
    kv_handle: bytes
    prefill_worker_id: str
    prefill_address: str
    first_token_ids: list[int]
    ctx_request_id: str
    opaque_state: bytes
    cached_tokens: int
    kv_bytes: int


class GenerateRequest(TypedDict, total=False):
    """A token-level request. `request_id` and `token_ids` are always present."""

    request_id: Required[str]
    token_ids: Required[list[int]]
    model: str
    sampling: SamplingOptions
    stop: StopConditions
    output: OutputOptions
    eos_token_ids: list[int]
    routing: RoutingHints
    disagg: DisaggParams
    annotations: dict[str, str]


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class TokenLogprob(TypedDict):
    token_id: int
    logprob: float
    top: NotRequired[list[tuple[int, float]]]


class ErrorInfo(TypedDict):
    """`code` is a class name of meshllm.errors."""

    code: str
    message: str


class GenerateChunk(TypedDict, total=False):
    """One piece of a stream. The terminal chunk has `finish_reason` and `usage`."""

    token_ids: list[int]
    index: int
    finish_reason: FinishReason
    stop_reason: str
    usage: Usage
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]  # first chunk only: prompt tokens 1..N-1 (see generate.proto)
    embedding: list[float]  # terminal chunk of an output.embedding request
    disagg: DisaggParams
    error: ErrorInfo
