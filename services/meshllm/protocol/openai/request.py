"""OpenAI chat/completions requests: parsing and validation into a `TextRequest` (pure, no I/O).

Validation follows OpenAI's documented ranges (temperature 0..2, penalties
-2..2, top_logprobs 0..20, ...). Fields the frontend does not act on are
listed in `TextRequest.ignored` (refused when unknown under `strict`,
`meshllm.protocol.openai.extensions`); a known field with the wrong type or an out-of-range value is an
InvalidArgument whose `param` names it. Engine-level pieces
(`SamplingSettings`, `StopSettings`) come out ready for `TokenRequest`;
`max_tokens` is settled later, when the prompt length and the model's
context length are known.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from meshllm.errors import InvalidArgument
from meshllm.protocol.openai.extensions import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    check_schema,
    guided_field,
    request_fields,
    structured_outputs,
    tool_choice,
)
from meshllm.protocol.types import GuidedSettings, SamplingSettings, StopSettings
from meshllm.protocol.validate import (
    FLOAT_RANGES,
    MAX_COUNT,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    UINT32_MAX,
    bad,
    check_float,
    check_int,
    check_logit_bias,
    check_top_k,
)

__all__ = [
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS",
    "EmbeddingsRequest",
    "RequestKind",
    "TextRequest",
    "parse_chat",
    "parse_completion",
]

RequestKind = Literal["chat", "completion"]
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_UINT64 = 1 << 64


@dataclass(frozen=True, kw_only=True, slots=True)
class TextRequest:
    """A validated chat or completion request, before tokenization."""

    kind: RequestKind
    model: str
    messages: tuple[dict[str, Any], ...] = ()  # chat: role + string content (+ name, tool_calls, tool_call_id)
    prompts: tuple[str | tuple[int, ...], ...] = ()  # completion: text or token ids, one choice set each
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    sampling: SamplingSettings = field(default_factory=lambda: SamplingSettings())
    stop_conditions: StopSettings = field(default_factory=lambda: StopSettings())
    logprobs: int | None = None  # alternatives per token; None = no logprobs
    prompt_logprobs: int | None = None  # vLLM extension: alternatives per prompt token; None = none
    echo: bool = False
    tools: tuple[dict[str, Any], ...] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    skip_special_tokens: bool = True
    request_id: str | None = None
    # tools (chat): "none" | "auto" | "required" | "function:NAME"; whether several calls may come back
    tool_choice: str = "none"
    parallel_tool_calls: bool = True
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every streamed chunk
    continue_final_message: bool = False  # chat: the prompt ends inside the last (assistant) message
    ignored: tuple[str, ...] = ()  # body fields the frontend does not act on (x-meshllm-ignored-params)

    def prompt_logprobs_asked(self) -> int | None:
        """Alternatives per prompt token the engine must compute: `prompt_logprobs`, or completions' `echo` + `logprobs`."""
        echoed = self.logprobs if self.kind == "completion" and self.echo else None  # chat echo is the answer's opening
        asked = [k for k in (self.prompt_logprobs, echoed) if k is not None]
        return max(asked) if asked else None


@dataclass(frozen=True, kw_only=True, slots=True)
class EmbeddingsRequest(TextRequest):
    """An embeddings request as the completion path runs it (one prompt per input; parsed by the embeddings API)."""

    encoding_format: str = "float"


# ---------------------------------------------------------------- field readers


_bad = bad


def _type_name(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _int(body: Mapping[str, Any], key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, f"expected an integer, got {_type_name(v)}")
    return check_int(key, v, lo, hi)


def _float(body: Mapping[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(key, f"expected a number, got {_type_name(v)}")
    try:
        return check_float(key, float(v))
    except OverflowError:  # an integer too large for a float
        raise _bad(key, "is out of range") from None


def _bool(body: Mapping[str, Any], key: str) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad(key, f"expected a boolean, got {_type_name(v)}")
    return v


def _object(body: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad(key, f"expected an object, got {_type_name(v)}")
    return v


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: {"token id": bias}; the ids arrive as JSON object keys, so as strings."""
    raw = _object(body, "logit_bias")
    if not raw:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        text = str(key).strip()
        if not text.lstrip("-").isdigit():
            raise _bad("logit_bias", f"key {key!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad("logit_bias", f"the bias of token {text} must be a number, got {_type_name(value)}")
        try:
            bias[int(text)] = float(value)
        except OverflowError:
            raise _bad("logit_bias", f"the bias of token {text} is out of range") from None
    check_logit_bias("logit_bias", bias)
    return bias


def _model(body: Mapping[str, Any]) -> str:
    v = body.get("model")
    if not isinstance(v, str) or not v.strip():
        raise _bad("model", "a model name (non-empty string) is required")
    return v


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("stop", "expected a string or an array of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not s for s in items):
        raise _bad("stop", "stop strings must not be empty")
    return tuple(dict.fromkeys(items))


def _token_ids(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in value
    ):
        raise _bad(param, "expected an array of non-negative integer token ids")
    return value


def _guided(body: Mapping[str, Any]) -> GuidedSettings | None:
    """response_format (OpenAI) or the guided_* extensions (vLLM) → one GuidedSettings."""
    kinds: list[GuidedSettings] = []
    rf = _object(body, "response_format")
    if rf is not None:
        t = rf.get("type")
        if t == "json_object":
            kinds.append({"json_object": True})
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise _bad("response_format", "type json_schema needs a 'json_schema' object")
            schema = js.get("schema", {})
            if not isinstance(schema, dict):
                raise _bad("response_format", "'json_schema.schema' must be an object")
            kinds.append({"json_schema": check_schema(orjson.dumps(schema).decode(), "response_format")})
        elif t != "text":
            raise _bad("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {t!r}")
    if (gj := body.get("guided_json")) is not None:
        if isinstance(gj, dict):
            gj = orjson.dumps(gj).decode()
        if not isinstance(gj, str):
            raise _bad("guided_json", "expected a JSON schema object or string")
        kinds.append({"json_schema": check_schema(gj, "guided_json")})
    for kind in ("regex", "grammar", "choice"):
        if (g := body.get(f"guided_{kind}")) is not None:
            kinds.append(guided_field(kind, g, f"guided_{kind}"))
    if (so := structured_outputs(body)) is not None:
        kinds.append(so)
    if len(kinds) > 1:
        raise _bad("response_format", "at most one output constraint (response_format, structured_outputs or one guided_* field)")
    return kinds[0] if kinds else None


# ---------------------------------------------------------------- common fields


def _common(body: Mapping[str, Any], kind: RequestKind) -> dict[str, Any]:
    """The fields chat and completions share."""
    sampling = SamplingSettings()
    for key in FLOAT_RANGES:
        if (f := _float(body, key)) is not None:
            sampling[key] = f  # type: ignore[literal-required]
    top_k = _int(body, "top_k")
    if top_k is not None and (k := check_top_k("top_k", top_k)) is not None:
        sampling["top_k"] = k
    if (seed := _int(body, "seed", -(1 << 63), _UINT64 - 1)) is not None:
        sampling["seed"] = seed % _UINT64
    if (guided := _guided(body)) is not None:
        sampling["guided"] = guided
    if (bias := _logit_bias(body)) is not None:
        sampling["logit_bias"] = bias

    max_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_key, 1, MAX_COUNT)
    stop_conditions = StopSettings()
    if (min_tokens := _int(body, "min_tokens", 0, MAX_COUNT)) is not None:
        if max_tokens is not None and min_tokens > max_tokens:
            raise _bad("min_tokens", f"{min_tokens} is greater than {max_key} ({max_tokens})")
        stop_conditions["min_tokens"] = min_tokens
    if (sti := body.get("stop_token_ids")) is not None:
        stop_conditions["stop_token_ids"] = list(dict.fromkeys(_token_ids(sti, "stop_token_ids")))
    if _bool(body, "ignore_eos"):
        stop_conditions["ignore_eos"] = True

    stream = bool(_bool(body, "stream"))
    include_usage = continuous = False
    opts = _object(body, "stream_options")
    if opts is not None:
        if not stream:
            raise _bad("stream_options", "only allowed when 'stream' is true")
        include_usage = bool(_bool(opts, "include_usage"))
        continuous = bool(_bool(opts, "continuous_usage_stats"))
        if continuous and not include_usage:
            raise _bad("stream_options", "'continuous_usage_stats' needs 'include_usage': true")
    n = _int(body, "n", 1, MAX_N)
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 256):
        raise _bad("request_id", "expected a non-empty string of at most 256 characters")
    skip = _bool(body, "skip_special_tokens")
    prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    return {
        "prompt_logprobs": prompt_logprobs,
        "model": _model(body),
        "n": 1 if n is None else n,
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous,
        "max_tokens": max_tokens,
        "stop": _stop(body),
        "sampling": sampling,
        "stop_conditions": stop_conditions,
        "skip_special_tokens": True if skip is None else skip,
        "request_id": rid,
    }


# ---------------------------------------------------------------- chat


def _content(value: Any, i: int, role: str, has_tool_calls: bool) -> str:
    param = f"messages[{i}].content"
    if isinstance(value, str):
        return value
    if value is None:
        if role == "assistant" and has_tool_calls:
            return ""
        raise _bad(param, f"content is required for role {role!r}")
    if not isinstance(value, list):
        raise _bad(param, f"expected a string or an array of content parts, got {_type_name(value)}")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise _bad(f"{param}[{j}]", "expected a content part object")
        if part.get("type") != "text":
            raise _bad(f"{param}[{j}].type", f"content part type {part.get('type')!r} is not supported (only 'text')")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"{param}[{j}].text", "expected a string")
        texts.append(text)
    return "".join(texts)


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise _bad("messages", f"expected an array of messages, got {_type_name(raw)}")
    if not raw:
        raise _bad("messages", "must contain at least one message")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"expected an object, got {_type_name(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(sorted(ROLES))}, got {role!r}")
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise _bad(f"messages[{i}].tool_calls", "expected an array")
        msg: dict[str, Any] = {"role": role, "content": _content(m.get("content"), i, role, bool(tool_calls))}
        for key in ("name", "tool_call_id"):
            if (v := m.get(key)) is not None:
                if not isinstance(v, str):
                    raise _bad(f"messages[{i}].{key}", "expected a string")
                msg[key] = v
        if tool_calls:
            msg["tool_calls"] = tool_calls
        out.append(msg)
    return tuple(out)


def parse_chat(body: Any, *, strict: bool = False) -> TextRequest:
    """Validate a /v1/chat/completions body (`strict`: an unknown field is a 400, as OpenAI answers)."""
    if not isinstance(body, dict):
        raise InvalidArgument(f"request body must be a JSON object, got {_type_name(body)}")
    ignored = request_fields(body, CHAT_FIELDS, strict=strict)
    common = _common(body, "chat")
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if body["top_logprobs"]:
            raise _bad("top_logprobs", "requires 'logprobs': true")
    kwargs, agp, tools = _template_inputs(body)
    messages = _messages(body)
    choice, forced = tool_choice(body, tools)
    if forced is not None:
        if "guided" in common["sampling"]:
            raise _bad("tool_choice", f"{body['tool_choice']!r} cannot be combined with another output constraint")
        common["sampling"]["guided"] = forced
    continue_final = bool(_bool(body, "continue_final_message"))
    if continue_final:
        if agp:
            raise _bad("continue_final_message", "cannot be combined with 'add_generation_prompt': true")
        if messages[-1]["role"] != "assistant":
            raise _bad("continue_final_message", "the last message must be the assistant's message to continue")
        agp = False
    parallel = _bool(body, "parallel_tool_calls")
    return TextRequest(
        kind="chat",
        messages=messages,
        logprobs=logprobs,
        tools=tuple(tools) if tools else None,
        template_kwargs=kwargs,
        add_generation_prompt=True if agp is None else agp,
        tool_choice=choice,
        parallel_tool_calls=True if parallel is None else parallel,
        continue_final_message=continue_final,
        echo=bool(_bool(body, "echo")),
        ignored=ignored,
        **common,
    )


def _tools(body: Mapping[str, Any], key: str) -> list[dict[str, Any]] | None:
    tools = body.get(key)
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _bad(key, "expected an array of tool objects")
    return tools


def _template_inputs(body: Mapping[str, Any]) -> tuple[dict[str, Any], bool | None, list[dict[str, Any]] | None]:
    """chat_template_kwargs, add_generation_prompt and tools, reconciled.

    `chat_template_kwargs` may set `add_generation_prompt` and `tools` too (as
    vLLM allows): a value there is used when the top-level field is absent,
    and must agree with it when both are given. `messages` is reserved.
    """
    kwargs = dict(_object(body, "chat_template_kwargs") or {})
    agp = _bool(body, "add_generation_prompt")
    tools = _tools(body, "tools")
    if "messages" in kwargs:
        raise _bad("chat_template_kwargs.messages", "is reserved: the template gets the request's 'messages'")
    if "add_generation_prompt" in kwargs:
        inner = kwargs.pop("add_generation_prompt")
        if inner is not None and not isinstance(inner, bool):
            raise _bad("chat_template_kwargs.add_generation_prompt", f"expected a boolean, got {_type_name(inner)}")
        if agp is not None and inner is not None and inner != agp:
            raise _bad("chat_template_kwargs.add_generation_prompt", "conflicts with the top-level 'add_generation_prompt'")
        agp = agp if agp is not None else inner
    if "tools" in kwargs:
        try:
            inner_tools = _tools(kwargs, "tools")
        except InvalidArgument:
            raise _bad("chat_template_kwargs.tools", "expected an array of tool objects") from None
        kwargs.pop("tools")
        if tools is not None and inner_tools is not None and inner_tools != tools:
            raise _bad("chat_template_kwargs.tools", "conflicts with the top-level 'tools'")
        tools = tools if tools is not None else inner_tools
    return kwargs, agp, tools


# ---------------------------------------------------------------- completions


def _prompts(body: Mapping[str, Any]) -> tuple[str | tuple[int, ...], ...]:
    p = body.get("prompt")
    if isinstance(p, str):
        return (p,)
    if not isinstance(p, list) or not p:
        raise _bad("prompt", "expected a string, an array of strings, or an array of token ids")
    if all(isinstance(x, str) for x in p):
        return tuple(p)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return (tuple(_token_ids(p, "prompt")),)
    if all(isinstance(x, list) for x in p):
        return tuple(tuple(_token_ids(x, f"prompt[{i}]")) for i, x in enumerate(p))
    raise _bad("prompt", "expected a string, an array of strings, or an array of token ids")


def parse_completion(body: Any, *, strict: bool = False) -> TextRequest:
    """Validate a /v1/completions body (`strict`: an unknown field is a 400, as OpenAI answers)."""
    if not isinstance(body, dict):
        raise InvalidArgument(f"request body must be a JSON object, got {_type_name(body)}")
    ignored = request_fields(body, COMPLETION_FIELDS, strict=strict)
    common = _common(body, "completion")
    prompts = _prompts(body)
    if len(prompts) * common["n"] > MAX_N:
        raise _bad("n", f"prompts x n must be at most {MAX_N}")
    return TextRequest(
        kind="completion",
        prompts=prompts,
        logprobs=_int(body, "logprobs", 0, MAX_TOP_LOGPROBS),
        echo=bool(_bool(body, "echo")),
        ignored=ignored,
        **common,
    )
