"""OpenAI's Responses API schema: a `/v1/responses` body → a chat-completions body, and Response objects (pure, no I/O).

    chat_body_of(body, history)     the request as the chat path takes it, plus what the Response echoes back
    response_object(...)            the `response` object (non-streaming body, and inside stream events)
    message_item / function_call_item / reasoning_item   output items

A request runs as a chat completion (`parse_chat` validates what it becomes):
`instructions` is a leading system message; `input` is a string (one user
message) or a list of items — messages with `input_text` / `output_text`
parts, `function_call` and `function_call_output` items (a tool round trip),
and `reasoning` items (the model's own earlier output, dropped);
`max_output_tokens` is `max_tokens`; function `tools` and `tool_choice` take
their chat shapes; `text.format` becomes `response_format`. Anything else
OpenAI defines but meshllm does not do (built-in tools, `background`,
`conversation`, ...) is a 400 naming it, as is an unknown field.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshllm.errors import InvalidArgument
from meshllm.protocol.validate import bad as _bad

__all__ = [
    "ResponseEcho",
    "chat_body_of",
    "function_call_item",
    "message_item",
    "new_id",
    "reasoning_item",
    "remap_error",
    "response_object",
    "responses_usage",
]

# Fields taken as they are (or mapped); `reasoning` is accepted when null only.
_ACCEPTED = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools", "tool_choice",
        "parallel_tool_calls", "previous_response_id", "store", "metadata", "user", "text", "truncation", "include",
        "reasoning",
    }
)  # fmt: skip
_NOT_SUPPORTED = frozenset(
    {
        "background", "conversation", "prompt", "service_tier", "top_logprobs", "stream_options", "max_tool_calls",
        "prompt_cache_key", "safety_identifier", "context_management",
    }
)  # fmt: skip
_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
# chat-path parameter names → the Responses names a client sent
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ResponseEcho:
    """The request fields a Response object repeats back."""

    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    text: dict[str, Any]
    user: str | None


def _text_of(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, "expected a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise _bad(f"{param}[{j}].type", f"content part type {kind!r} is not supported (only text parts)")
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise _bad(f"{param}[{j}].text", "expected a string")
        texts.append(text)
    return "".join(texts)


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` → chat messages (a function_call right after another joins its assistant message: parallel calls)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "expected a string or a non-empty array of input items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(param, "expected an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(f"{param}.role", f"must be one of {', '.join(sorted(_ROLES))}, got {role!r}")
            out.append({"role": role, "content": _text_of(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise _bad(param, "a function_call item needs string 'call_id', 'name' and 'arguments'")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{param}.call_id", "expected a string")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(item.get("output"), f"{param}.output")})
        elif kind != "reasoning":  # reasoning items are the model's own earlier output: not sent back to it
            raise _bad(f"{param}.type", f"input item type {kind!r} is not supported")
    return out


def _tools(value: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Responses function tools → (as echoed back, as the chat path takes them)."""
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise _bad("tools", "expected an array of tools")
    echoed, chat = [], []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"tools[{i}].type", f"only function tools are supported, got {kind!r}")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"tools[{i}].name", "a function tool needs a name")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        chat.append({"type": "function", "function": fn})
        echoed.append({"type": "function", "strict": tool.get("strict", True), "description": None, "parameters": None, **fn})
    return echoed, chat


def _tool_choice(value: Any) -> Any:
    """Responses `tool_choice` → the chat shape ({"type": "function", "name": N} → {..., "function": {"name": N}})."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise _bad("tool_choice", "expected 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` → chat `response_format` (None for plain text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        raise _bad("text", 'expected {"format": {"type": "text" | "json_object" | "json_schema", ...}}')
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema", {})}}
    raise _bad("text.format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _check_fields(body: Mapping[str, Any]) -> None:
    for key in body:
        if key in _NOT_SUPPORTED and body[key] is not None:
            raise _bad(key, "is not supported by meshllm's Responses API")
        if key not in _ACCEPTED and key not in _NOT_SUPPORTED:
            raise InvalidArgument(f"Unrecognized request argument supplied: {key}", param=key)
    if body.get("reasoning") is not None:
        raise _bad("reasoning", "reasoning options are not supported (a reasoning parser splits a model's own thinking)")
    if body.get("include"):
        raise _bad("include", "no extra output can be included")
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation", "only 'disabled' is supported (a prompt over the context length is a 400)")
    for key, kind in (("instructions", str), ("previous_response_id", str), ("user", str), ("store", bool)):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise _bad(key, f"expected a {'string' if kind is str else 'boolean'}")
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict) or len(metadata) > 16 or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise _bad("metadata", "expected an object of at most 16 string values")


def chat_body_of(body: Any, history: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]], ResponseEcho]:
    """(the chat-completions body, the new input as chat messages, what the Response echoes) of a Responses body.

    `history` is the conversation of `previous_response_id` (its input and output as messages), placed
    after `instructions` and before the new input. The chat body is validated by the caller (`parse_chat`),
    whose errors name chat fields: `remap_error` gives them their Responses names.
    """
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    _check_fields(body)
    if "input" not in body:
        raise _bad("input", "is required")
    new = _input_messages(body["input"])
    echoed_tools, chat_tools = _tools(body.get("tools"))
    instructions = body.get("instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + [*history, *new]
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    stream = body.get("stream")
    if stream is not None:
        chat["stream"] = stream
        if stream is True:
            chat["stream_options"] = {"include_usage": True}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if chat_tools:
        chat["tools"] = chat_tools
    if (choice := _tool_choice(body.get("tool_choice"))) is not None:
        chat["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if (fmt := _response_format(body.get("text"))) is not None:
        chat["response_format"] = fmt
    echo = ResponseEcho(
        instructions=instructions,
        max_output_tokens=body.get("max_output_tokens"),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        tools=echoed_tools,
        tool_choice=body.get("tool_choice") or "auto",
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        previous_response_id=body.get("previous_response_id"),
        store=body.get("store") is not False,
        metadata=dict(body.get("metadata") or {}),
        text=body.get("text") or {"format": {"type": "text"}},
        user=body.get("user"),
    )
    return chat, new, echo


def remap_error(exc: InvalidArgument) -> InvalidArgument:
    """A chat-path validation error, naming the Responses field the client sent."""
    if exc.param is None:
        return exc
    base = exc.param.split(".", 1)[0].split("[", 1)[0]
    if base not in _PARAMS:
        return exc
    param = _PARAMS[base]  # "messages[3]" has no Responses twin: instructions and history shift the indices
    message = exc.message.replace(f"'{base}", f"'{_PARAMS[base]}", 1)
    return type(exc)(message, param=param)


# ---------------------------------------------------------------- output


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def responses_usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Chat usage → Responses usage (input/output tokens, cached input tokens)."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"],
    }


def response_object(
    rid: str,
    created_at: int,
    model: str,
    echo: ResponseEcho,
    *,
    status: str,
    output: Sequence[dict[str, Any]] = (),
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `response` object; status "incomplete" means max_output_tokens cut it short."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "model": model,
        "output": list(output),
        "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": echo.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": echo.store,
        "temperature": echo.temperature,
        "text": echo.text,
        "tool_choice": echo.tool_choice,
        "tools": echo.tools,
        "top_p": echo.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": echo.user,
        "metadata": echo.metadata,
    }
