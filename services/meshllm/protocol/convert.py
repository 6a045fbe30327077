"""Pure converters between the internal TypedDicts and the meshllm.v1 protobufs.

Each function is one direction of one message: the request and the chunk are
built from the converters of their sub-messages (sampling, guided decoding,
stop conditions, output options, routing hints, disaggregation), which an
edge that carries only a sub-message (the Router's `Route` takes routing
hints) calls directly. Used once per hop at a service edge; round trips are
lossless for every field the protos define.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

from meshllm.errors import InvalidArgument
from meshllm.protocol.types import (
    DisaggInfo,
    FinishReason,
    GuidedSettings,
    LogprobItem,
    OutputSettings,
    RequestType,
    RouteHints,
    SamplingSettings,
    StopSettings,
    TokenChunk,
    TokenRequest,
    TokenUsage,
)
from meshllm.v1 import generate_pb2 as pb

__all__ = [
    "chunk_from_proto",
    "chunk_into_proto",
    "chunk_to_proto",
    "disagg_from_proto",
    "disagg_to_proto",
    "guided_from_proto",
    "guided_into_proto",
    "hints_from_proto",
    "hints_into_proto",
    "output_from_proto",
    "output_into_proto",
    "request_from_proto",
    "request_to_proto",
    "sampling_from_proto",
    "sampling_into_proto",
    "stop_from_proto",
    "stop_into_proto",
    "wire_range",
]

_FINISH_TO_PB: dict[str, int] = {
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "error": pb.FINISH_REASON_ERROR,
    "content_filter": pb.FINISH_REASON_CONTENT_FILTER,
}
_FINISH_FROM_PB = {v: cast(FinishReason, k) for k, v in _FINISH_TO_PB.items()}
# chunk_from_proto's fast path compares descriptors by identity: a miss only takes the general path.
_CHUNK_TOKEN_IDS = pb.GenerateChunk.DESCRIPTOR.fields_by_name["token_ids"]
_RTYPE_TO_PB = {
    "context_only": pb.DISAGG_REQUEST_TYPE_CONTEXT_ONLY,
    "generation_only": pb.DISAGG_REQUEST_TYPE_GENERATION_ONLY,
}
_RTYPE_FROM_PB = {v: cast(RequestType, k) for k, v in _RTYPE_TO_PB.items()}

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty")
_GUIDED = ("json_schema", "regex", "grammar", "json_object")
_HINTS_OPT = ("backend_instance_id", "prefill_worker_id", "decode_worker_id", "dp_rank")
# DisaggParams' plain proto3 scalars: a zero value is an absent key.
_DISAGG = ("kv_handle", "prefill_worker_id", "prefill_address", "ctx_request_id", "opaque_state", "cached_tokens", "kv_bytes")


def disagg_to_proto(d: DisaggInfo) -> pb.DisaggParams:
    m = pb.DisaggParams(first_token_ids=d.get("first_token_ids", ()))
    _set_present(m, d, _DISAGG)
    if "request_type" in d:
        m.request_type = _RTYPE_TO_PB[d["request_type"]]  # type: ignore[assignment]
    src = d.get("kv_source")
    if src:
        m.kv_source.CopyFrom(
            pb.KvSource(
                worker_id=src.get("worker_id", ""), address=src.get("address", ""), kv_handle=src.get("kv_handle", b""),
                blocks=src.get("blocks", 0), block_size=src.get("block_size", 0), tier=src.get("tier", 0),  # type: ignore[arg-type]
            )
        )  # fmt: skip
    return m


def disagg_from_proto(m: pb.DisaggParams) -> DisaggInfo:
    d = cast(DisaggInfo, {k: v for k in _DISAGG if (v := getattr(m, k))})
    if m.request_type:
        rtype = _RTYPE_FROM_PB.get(m.request_type)
        if rtype is None:  # proto3 enums are open: any int32 arrives
            raise InvalidArgument(f"'disagg.request_type': unknown value {m.request_type}", param="disagg.request_type")
        d["request_type"] = rtype
    if m.first_token_ids:
        d["first_token_ids"] = list(m.first_token_ids)
    if m.HasField("kv_source"):
        s = m.kv_source
        d["kv_source"] = {
            "worker_id": s.worker_id, "address": s.address, "kv_handle": s.kv_handle, "blocks": s.blocks,
            "block_size": s.block_size, "tier": int(s.tier),
        }  # fmt: skip
    return d


@contextmanager
def wire_range() -> Iterator[None]:
    """Around internal → proto: a value the proto cannot hold (e.g. top_k >= 2^31) is InvalidArgument, not a crash."""
    try:
        yield
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidArgument(f"a request value is out of range for the wire format: {exc}") from None


def request_to_proto(r: TokenRequest) -> pb.GenerateRequest:
    """Internal → proto (within `wire_range`)."""
    with wire_range():
        return _request_to_proto(r)


def _request_to_proto(r: TokenRequest) -> pb.GenerateRequest:
    m = pb.GenerateRequest(
        request_id=r["request_id"],
        model=r.get("model", ""),
        token_ids=r["token_ids"],
        eos_token_ids=r.get("eos_token_ids", ()),
        annotations=r.get("annotations", {}),
    )
    if s := r.get("sampling"):
        sampling_into_proto(m.sampling, s)
    if st := r.get("stop"):
        stop_into_proto(m.stop, st)
    if o := r.get("output"):
        output_into_proto(m.output, o)
    if h := r.get("routing"):
        hints_into_proto(m.routing, h)
    if "disagg" in r:
        m.disagg.CopyFrom(disagg_to_proto(r["disagg"]))
    return m


def request_from_proto(m: pb.GenerateRequest) -> TokenRequest:
    r: TokenRequest = {"request_id": m.request_id, "token_ids": m.token_ids[:]}  # a slice: a list made in C
    if m.model:
        r["model"] = m.model
    if m.HasField("sampling"):
        r["sampling"] = sampling_from_proto(m.sampling)
    if m.HasField("stop"):
        r["stop"] = stop_from_proto(m.stop)
    if m.HasField("output"):
        r["output"] = output_from_proto(m.output)
    if m.eos_token_ids:
        r["eos_token_ids"] = m.eos_token_ids[:]
    if m.HasField("routing"):
        r["routing"] = hints_from_proto(m.routing)
    if m.HasField("disagg"):
        r["disagg"] = disagg_from_proto(m.disagg)
    if m.annotations:
        r["annotations"] = dict(m.annotations)
    return r


# ---------------------------------------------------------------- one pair per sub-message
# `*_into_proto(m, x)` fills the (empty) sub-message `m` of a parent in place; `*_from_proto(m)` reads one.


def _set_present(m: Any, d: Mapping[str, Any], keys: Iterable[str]) -> None:
    """Copy the keys of `keys` that `d` holds onto the message's fields of the same names."""
    for k in keys:
        if k in d:
            setattr(m, k, d[k])


def sampling_into_proto(m: pb.SamplingOptions, s: SamplingSettings) -> None:
    _set_present(m, s, _SAMPLING)
    if g := s.get("guided"):
        guided_into_proto(m.guided, g)
    if bias := s.get("logit_bias"):
        m.logit_bias.update(bias)


def sampling_from_proto(m: pb.SamplingOptions) -> SamplingSettings:
    s = cast(SamplingSettings, {k: getattr(m, k) for k in _SAMPLING if m.HasField(k)})
    if m.HasField("guided") and (g := guided_from_proto(m.guided)) is not None:
        s["guided"] = g
    if m.logit_bias:
        s["logit_bias"] = dict(m.logit_bias)
    return s


def guided_into_proto(m: pb.GuidedDecoding, g: GuidedSettings) -> None:
    _set_present(m, g, _GUIDED)
    if "choice" in g:
        m.choice.values.extend(g["choice"])


def guided_from_proto(m: pb.GuidedDecoding) -> GuidedSettings | None:
    """The one constraint the oneof holds; None when it holds none."""
    kind = m.WhichOneof("kind")
    if kind == "choice":
        return GuidedSettings(choice=list(m.choice.values))
    return None if kind is None else cast(GuidedSettings, {kind: getattr(m, kind)})


def stop_into_proto(m: pb.StopConditions, st: StopSettings) -> None:
    if "max_tokens" in st:
        m.max_tokens = st["max_tokens"]
    m.min_tokens = st.get("min_tokens", 0)
    m.stop_token_ids.extend(st.get("stop_token_ids", ()))
    m.ignore_eos = st.get("ignore_eos", False)


def stop_from_proto(m: pb.StopConditions) -> StopSettings:
    st = StopSettings(min_tokens=m.min_tokens, stop_token_ids=m.stop_token_ids[:], ignore_eos=m.ignore_eos)
    if m.HasField("max_tokens"):
        st["max_tokens"] = m.max_tokens
    return st


def output_into_proto(m: pb.OutputOptions, o: OutputSettings) -> None:
    if "logprobs" in o:
        m.logprobs = o["logprobs"]
    if "prompt_logprobs" in o:
        m.prompt_logprobs = o["prompt_logprobs"]
    m.skip_special_tokens = o.get("skip_special_tokens", False)
    m.embedding = o.get("embedding", False)


def output_from_proto(m: pb.OutputOptions) -> OutputSettings:
    o = OutputSettings(skip_special_tokens=m.skip_special_tokens)
    if m.HasField("logprobs"):
        o["logprobs"] = m.logprobs
    if m.HasField("prompt_logprobs"):
        o["prompt_logprobs"] = m.prompt_logprobs
    if m.embedding:
        o["embedding"] = True
    return o


def hints_into_proto(m: pb.RoutingHints, h: RouteHints) -> None:
    _set_present(m, h, _HINTS_OPT)
    m.lora_name = h.get("lora_name", "")
    m.priority = h.get("priority", 0)
    m.allowed_worker_ids.extend(h.get("allowed_worker_ids", ()))


def hints_from_proto(m: pb.RoutingHints) -> RouteHints:
    h = cast(RouteHints, {k: getattr(m, k) for k in _HINTS_OPT if m.HasField(k)})
    if m.lora_name:
        h["lora_name"] = m.lora_name
    if m.priority:
        h["priority"] = m.priority
    if m.allowed_worker_ids:
        h["allowed_worker_ids"] = list(m.allowed_worker_ids)
    return h


def chunk_to_proto(c: TokenChunk) -> pb.GenerateChunk:
    m = pb.GenerateChunk()
    chunk_into_proto(m, c)
    return m


def chunk_into_proto(m: pb.GenerateChunk, c: TokenChunk) -> None:
    """Fill an empty GenerateChunk message in place (e.g. one inside a batch, with no copy)."""
    if len(c) == 1 and "token_ids" in c:  # nearly every chunk of a stream: one lookup, not one per field
        m.token_ids.extend(c["token_ids"])
        return
    if ids := c.get("token_ids"):
        m.token_ids.extend(ids)
    if index := c.get("index"):
        m.index = index
    if stop_reason := c.get("stop_reason"):
        m.stop_reason = stop_reason
    if "finish_reason" in c:
        m.finish_reason = _FINISH_TO_PB[c["finish_reason"]]  # type: ignore[assignment]
    if u := c.get("usage"):
        m.usage.prompt_tokens = u["prompt_tokens"]
        m.usage.completion_tokens = u["completion_tokens"]
        m.usage.cached_tokens = u["cached_tokens"]
    if lps := c.get("logprobs"):  # per token: a plain chunk touches no logprob field
        _logprobs_into(m.logprobs, lps)
    if lps := c.get("prompt_logprobs"):
        _logprobs_into(m.prompt_logprobs, lps)
    if emb := c.get("embedding"):
        m.embedding.extend(emb)
    if "disagg" in c:
        m.disagg.CopyFrom(disagg_to_proto(c["disagg"]))
    if err := c.get("error"):
        m.error.code = err["code"]
        m.error.message = err["message"]


def chunk_from_proto(m: pb.GenerateChunk) -> TokenChunk:
    fields = m.ListFields()  # one call; nearly every chunk of a stream sets token_ids alone
    if len(fields) == 1 and fields[0][0] is _CHUNK_TOKEN_IDS:
        return {"token_ids": fields[0][1][:]}  # a slice is a list, made in C (list() iterates in Python: 2x slower)
    c: TokenChunk = {"token_ids": m.token_ids[:]}
    if m.index:
        c["index"] = m.index
    if m.finish_reason:
        c["finish_reason"] = _FINISH_FROM_PB[m.finish_reason]
    if m.stop_reason:
        c["stop_reason"] = m.stop_reason
    if m.HasField("usage"):
        c["usage"] = TokenUsage(
            prompt_tokens=m.usage.prompt_tokens,
            completion_tokens=m.usage.completion_tokens,
            cached_tokens=m.usage.cached_tokens,
        )
    if m.logprobs:
        c["logprobs"] = _logprobs_from(m.logprobs)
    if m.prompt_logprobs:
        c["prompt_logprobs"] = _logprobs_from(m.prompt_logprobs)
    if m.embedding:
        c["embedding"] = m.embedding[:]
    if m.HasField("disagg"):
        c["disagg"] = disagg_from_proto(m.disagg)
    if m.HasField("error"):
        c["error"] = {"code": m.error.code, "message": m.error.message}
    return c


def _logprobs_into(field: Any, entries: Iterable[LogprobItem]) -> None:
    for lp in entries:
        e = field.add(token_id=lp["token_id"], logprob=lp["logprob"])
        for tid, p in lp.get("top", ()):
            e.top.add(token_id=tid, logprob=p)


def _logprobs_from(entries: Iterable[pb.TokenLogprob]) -> list[LogprobItem]:
    return [LogprobItem(token_id=e.token_id, logprob=e.logprob, top=[(t.token_id, t.logprob) for t in e.top]) for e in entries]
