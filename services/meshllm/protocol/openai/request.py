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

from meshllm.errors import InvalidArgument
from meshllm.protocol.openai.extensions import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    request_fields,
    tool_choice,
)
from meshllm.protocol.openai.fields import (
    bool_field,
    float_field,
    guided_settings,
    int_field,
    logit_bias,
    model_name,
    object_field,
    stop_strings,
    token_ids,
    type_name,
)
from meshllm.protocol.types import SamplingSettings, StopSettings
from meshllm.protocol.validate import (
    FLOAT_RANGES,
    MAX_COUNT,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    bad,
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
_bad = bad


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


# ---------------------------------------------------------------- common fields


# size: one request field after another, in the order of OpenAI's API reference
def _common(body: Mapping[str, Any], kind: RequestKind) -> dict[str, Any]:
    """The fields chat and completions share."""
    sampling = SamplingSettings()
    for key in FLOAT_RANGES:
        if (f := float_field(body, key)) is not None:
            sampling[key] = f  # type: ignore[literal-required]
    top_k = int_field(body, "top_k")
    if top_k is not None and (k := check_top_k("top_k", top_k)) is not None:
        sampling["top_k"] = k
    if (seed := int_field(body, "seed", -(1 << 63), _UINT64 - 1)) is not None:
        sampling["seed"] = seed % _UINT64
    if (guided := guided_settings(body)) is not None:
        sampling["guided"] = guided
    if (bias := logit_bias(body)) is not None:
        sampling["logit_bias"] = bias

    max_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = int_field(body, max_key, 1, MAX_COUNT)
    stop_conditions = StopSettings()
    if (min_tokens := int_field(body, "min_tokens", 0, MAX_COUNT)) is not None:
        if max_tokens is not None and min_tokens > max_tokens:
            raise _bad("min_tokens", f"{min_tokens} is greater than {max_key} ({max_tokens})")
        stop_conditions["min_tokens"] = min_tokens
    if (sti := body.get("stop_token_ids")) is not None:
        stop_conditions["stop_token_ids"] = list(dict.fromkeys(token_ids(sti, "stop_token_ids")))
    if bool_field(body, "ignore_eos"):
        stop_conditions["ignore_eos"] = True

    stream = bool(bool_field(body, "stream"))
    include_usage = continuous = False
    opts = object_field(body, "stream_options")
    if opts is not None:
        if not stream:
            raise _bad("stream_options", "only allowed when 'stream' is true")
        include_usage = bool(bool_field(opts, "include_usage"))
        continuous = bool(bool_field(opts, "continuous_usage_stats"))
        if continuous and not include_usage:
            raise _bad("stream_options", "'continuous_usage_stats' needs 'include_usage': true")
    n = int_field(body, "n", 1, MAX_N)
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 256):
        raise _bad("request_id", "expected a non-empty string of at most 256 characters")
    skip = bool_field(body, "skip_special_tokens")
    prompt_logprobs = int_field(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    return {
        "prompt_logprobs": prompt_logprobs,
        "model": model_name(body),
        "n": 1 if n is None else n,
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous,
        "max_tokens": max_tokens,
        "stop": stop_strings(body),
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
        raise _bad(param, f"expected a string or an array of content parts, got {type_name(value)}")
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
        raise _bad("messages", f"expected an array of messages, got {type_name(raw)}")
    if not raw:
        raise _bad("messages", "must contain at least one message")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"expected an object, got {type_name(m)}")
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
        raise InvalidArgument(f"request body must be a JSON object, got {type_name(body)}")
    ignored = request_fields(body, CHAT_FIELDS, strict=strict)
    common = _common(body, "chat")
    logprobs = None
    if bool_field(body, "logprobs"):
        logprobs = int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    elif body.get("top_logprobs") is not None:
        int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if body["top_logprobs"]:
            raise _bad("top_logprobs", "requires 'logprobs': true")
    kwargs, agp, tools = _template_inputs(body)
    messages = _messages(body)
    choice, forced = tool_choice(body, tools)
    if forced is not None:
        if "guided" in common["sampling"]:
            raise _bad("tool_choice", f"{body['tool_choice']!r} cannot be combined with another output constraint")
        common["sampling"]["guided"] = forced
    continue_final = bool(bool_field(body, "continue_final_message"))
    if continue_final:
        if agp:
            raise _bad("continue_final_message", "cannot be combined with 'add_generation_prompt': true")
        if messages[-1]["role"] != "assistant":
            raise _bad("continue_final_message", "the last message must be the assistant's message to continue")
        agp = False
    parallel = bool_field(body, "parallel_tool_calls")
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
        echo=bool(bool_field(body, "echo")),
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
    kwargs = dict(object_field(body, "chat_template_kwargs") or {})
    agp = bool_field(body, "add_generation_prompt")
    tools = _tools(body, "tools")
    if "messages" in kwargs:
        raise _bad("chat_template_kwargs.messages", "is reserved: the template gets the request's 'messages'")
    if "add_generation_prompt" in kwargs:
        inner = kwargs.pop("add_generation_prompt")
        if inner is not None and not isinstance(inner, bool):
            raise _bad("chat_template_kwargs.add_generation_prompt", f"expected a boolean, got {type_name(inner)}")
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
        return (tuple(token_ids(p, "prompt")),)
    if all(isinstance(x, list) for x in p):
        return tuple(tuple(token_ids(x, f"prompt[{i}]")) for i, x in enumerate(p))
    raise _bad("prompt", "expected a string, an array of strings, or an array of token ids")


def parse_completion(body: Any, *, strict: bool = False) -> TextRequest:
    """Validate a /v1/completions body (`strict`: an unknown field is a 400, as OpenAI answers)."""
    if not isinstance(body, dict):
        raise InvalidArgument(f"request body must be a JSON object, got {type_name(body)}")
    ignored = request_fields(body, COMPLETION_FIELDS, strict=strict)
    common = _common(body, "completion")
    prompts = _prompts(body)
    if len(prompts) * common["n"] > MAX_N:
        raise _bad("n", f"prompts x n must be at most {MAX_N}")
    return TextRequest(
        kind="completion",
        prompts=prompts,
        logprobs=int_field(body, "logprobs", 0, MAX_TOP_LOGPROBS),
        echo=bool(bool_field(body, "echo")),
        ignored=ignored,
        **common,
    )
