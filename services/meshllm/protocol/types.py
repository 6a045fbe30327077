"""Internal request/response types: TypedDicts mirroring the meshllm.v1 protos under names of their own.

`TokenRequest` is the dict of a `meshllm.v1.GenerateRequest`, `TokenChunk` of a
`GenerateChunk`, and so on (the table is in docs/protocol.md): a name says
whether a value is a dict or a wire message.

Engines and services work with these plain dicts; protobuf messages exist only
at the gRPC edge (`meshllm.protocol.convert` turns one into the other, once per
hop). Optional keys are simply absent.

Finish reasons are the lower-case names of `meshllm.v1.FinishReason`:
"eos", "stop", "length", "cancelled", "error", "content_filter".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NotRequired, Required, TypedDict

__all__ = [
    "FINISH_REASONS",
    "ChunkRelay",
    "DisaggInfo",
    "ErrorInfo",
    "FinishReason",
    "GuidedSettings",
    "KvSourceInfo",
    "LogprobItem",
    "OutputSettings",
    "RequestType",
    "RouteHints",
    "SamplingSettings",
    "StopSettings",
    "TokenChunk",
    "TokenRequest",
    "TokenUsage",
]

FinishReason = Literal["eos", "stop", "length", "cancelled", "error", "content_filter"]
FINISH_REASONS: tuple[FinishReason, ...] = ("eos", "stop", "length", "cancelled", "error", "content_filter")
RequestType = Literal["context_only", "generation_only"]


class GuidedSettings(TypedDict, total=False):
    """At most one key: the output constraint."""

    json_schema: str
    regex: str
    grammar: str
    choice: list[str]
    json_object: bool


class SamplingSettings(TypedDict, total=False):
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    guided: GuidedSettings
    logit_bias: dict[int, float]  # token id -> bias added to its logit, in [-100, 100]


class StopSettings(TypedDict, total=False):
    max_tokens: int
    min_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool


class OutputSettings(TypedDict, total=False):
    logprobs: int  # top alternatives per generated token (0 = the sampled token's only)
    prompt_logprobs: int  # top alternatives per prompt token; engines that cannot refuse it (InvalidArgument)
    skip_special_tokens: bool
    embedding: bool  # embed the prompt instead of generating (see generate.proto)


class RouteHints(TypedDict, total=False):
    backend_instance_id: str
    prefill_worker_id: str
    decode_worker_id: str
    dp_rank: int
    lora_name: str
    priority: int
    allowed_worker_ids: list[str]


class KvSourceInfo(TypedDict, total=False):
    """A prompt prefix a peer worker holds (`DisaggParams.kv_source`): pull it with `kv_handle` from `address`."""

    worker_id: str
    address: str
    kv_handle: bytes  # a prefix handle (meshllm.protocol.kv.prefix_handle)
    blocks: int
    block_size: int
    tier: int  # meshllm.v1.KvTier: the farthest tier the peer holds part of it in


class DisaggInfo(TypedDict, total=False):
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
    kv_source: KvSourceInfo  # context_only legs: a peer's prefix to pull instead of computing


class TokenRequest(TypedDict, total=False):
    """A token-level request. `request_id` and `token_ids` are always present."""

    request_id: Required[str]
    token_ids: Required[list[int]]
    model: str
    sampling: SamplingSettings
    stop: StopSettings
    output: OutputSettings
    eos_token_ids: list[int]
    routing: RouteHints
    disagg: DisaggInfo
    annotations: dict[str, str]


class TokenUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class LogprobItem(TypedDict):
    token_id: int
    logprob: float
    top: NotRequired[list[tuple[int, float]]]


class ErrorInfo(TypedDict):
    """`code` is a class name of meshllm.errors."""

    code: str
    message: str


class TokenChunk(TypedDict, total=False):
    """One piece of a stream. The terminal chunk has `finish_reason` and `usage`."""

    token_ids: list[int]
    index: int
    finish_reason: FinishReason
    stop_reason: str
    usage: TokenUsage
    logprobs: list[LogprobItem]
    prompt_logprobs: list[LogprobItem]  # first chunk only: prompt tokens 1..N-1 (see generate.proto)
    embedding: list[float]  # terminal chunk of an output.embedding request
    disagg: DisaggInfo
    error: ErrorInfo


# Takes one stream's non-terminal chunks synchronously as they are made or arrive, instead of its iterator
# (`Context.relay`, `SessionClient.generate`'s `relay`): it must not block or await, and it owns the chunk.
ChunkRelay = Callable[[TokenChunk], None]
