"""Request fields beyond the basics: tool_choice, structured outputs, strictness, 64-bit JSON integers (pure, no I/O).

parse_json_body(raw)             bytes → JSON value; an integer beyond 64 bits is a 400, not a rounded float
request_fields(body, kind, strict)  the fields the request sends that the frontend ignores (strict: unknown → 400)
tool_choice(body, tools)         "none" | "auto" | "required" | "function:NAME", and the schema forcing it
structured_outputs(body)         vLLM's `structured_outputs` → GuidedSettings
check_schema(text, param)        a JSON schema's shape, with a readable 400 when it is malformed
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from meshllm.errors import InvalidArgument
from meshllm.protocol.types import GuidedSettings

__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "IGNORED_FIELDS",
    "check_schema",
    "guided_field",
    "named_schema",
    "parse_json_body",
    "request_fields",
    "required_schema",
    "structured_outputs",
    "tool_choice",
]

_SHARED = frozenset(
    {
        "model", "n", "stream", "stream_options", "max_tokens", "stop", "temperature", "top_p", "top_k", "min_p",
        "seed", "frequency_penalty", "presence_penalty", "repetition_penalty", "response_format", "guided_json",
        "guided_regex", "guided_grammar", "guided_choice", "structured_outputs", "min_tokens", "stop_token_ids",
        "ignore_eos", "skip_special_tokens", "request_id", "logprobs", "prompt_logprobs", "echo", "logit_bias",
    }
)  # fmt: skip
#: The fields each endpoint acts on.
CHAT_FIELDS = _SHARED | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
}  # fmt: skip
COMPLETION_FIELDS = _SHARED | {"prompt"}
#: Fields OpenAI or vLLM define that are accepted without effect: named in `x-meshllm-ignored-params`,
#: never refused (any other unknown field is refused under --strict-params, as OpenAI does).
IGNORED_FIELDS = frozenset(
    {
        "user", "store", "metadata", "service_tier", "functions", "function_call", "modalities",
        "audio", "prediction", "reasoning_effort", "web_search_options", "safety_identifier", "prompt_cache_key",
        "verbosity", "suffix", "best_of", "use_beam_search", "length_penalty", "include_stop_str_in_output",
        "spaces_between_special_tokens", "truncate_prompt_tokens", "priority", "add_special_tokens", "documents",
        "chat_template", "mm_processor_kwargs", "return_tokens_as_token_ids", "cache_salt", "kv_transfer_params",
        "vllm_xargs", "guided_decoding_backend", "guided_whitespace_pattern", "bad_words", "allowed_token_ids",
        "return_token_ids", "logits_processors",
    }
)  # fmt: skip

_BIG_INT = re.compile(rb"\d{19,}")
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1


class _BigInt(str):
    """An integer literal beyond 64 bits, kept as its text while the body is re-read."""


def _int_or_big(text: str) -> int | _BigInt:
    v = int(text)
    return v if _INT64_MIN <= v <= _UINT64_MAX else _BigInt(text)


def _find_big(value: Any, path: str) -> tuple[str, str] | None:
    """(where, literal) of the first beyond-64-bit integer in a re-read body."""
    if isinstance(value, _BigInt):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _find_big(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON; InvalidArgument when it is not JSON or holds an integer beyond 64 bits.

    orjson reads integers outside [-2^63, 2^64) as floats, silently rounded; a
    body with 19 or more consecutive digits is read again by the standard
    library, which hands each integer literal over as its text, and the first
    one out of range is refused with its place as `param`.
    """
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if _BIG_INT.search(raw):
        found = _find_big(json.loads(raw, parse_int=_int_or_big), "")
        if found is not None:
            where, text = found
            shown = text if len(text) <= 40 else text[:37] + "..."
            place = f"'{where}'" if where else "the body"
            raise InvalidArgument(f"{place}: the integer {shown} does not fit in 64 bits", param=where or None)
    return data


def request_fields(body: Mapping[str, Any], fields: frozenset[str], *, strict: bool) -> tuple[str, ...]:
    """The body's fields the endpoint does not act on, sorted; `strict` refuses one that is not even known."""
    ignored = sorted(k for k in body if k not in fields)
    if strict:
        for k in ignored:
            if k not in IGNORED_FIELDS:
                raise InvalidArgument(f"Unrecognized request argument supplied: {k}", param=k)
    return tuple(ignored)


def tool_choice(body: Mapping[str, Any], tools: Sequence[dict[str, Any]] | None) -> tuple[str, GuidedSettings | None]:
    """`tool_choice` → ("none" | "auto" | "required" | "function:NAME", the constraint forcing a call or None)."""
    v = body.get("tool_choice")
    if v is None:
        return ("auto" if tools else "none"), None
    if v in ("none", "auto"):
        return (v if tools else "none"), None
    if v == "required":
        if not tools:
            raise InvalidArgument("'tool_choice': 'required' needs 'tools'", param="tool_choice")
        return "required", {"json_schema": required_schema(tools)}
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidArgument(
            "'tool_choice': expected 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            param="tool_choice",
        )
    for t in tools or ():
        f = t.get("function")
        if isinstance(f, dict) and f.get("name") == name:
            return f"function:{name}", {"json_schema": named_schema(t)}
    raise InvalidArgument(f"'tool_choice': function {name!r} is not among 'tools'", param="tool_choice")


def structured_outputs(body: Mapping[str, Any]) -> GuidedSettings | None:
    """vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object}) → GuidedSettings."""
    so = body.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, dict):
        raise InvalidArgument("'structured_outputs': expected an object", param="structured_outputs")
    kinds: list[GuidedSettings] = []
    if (js := so.get("json")) is not None:
        text = js if isinstance(js, str) else orjson.dumps(js).decode() if isinstance(js, dict | bool) else None
        if text is None:
            raise InvalidArgument("'structured_outputs.json': expected a JSON schema", param="structured_outputs.json")
        kinds.append({"json_schema": check_schema(text, "structured_outputs.json")})
    for kind in ("regex", "grammar", "choice"):
        if (v := so.get(kind)) is not None:
            kinds.append(guided_field(kind, v, f"structured_outputs.{kind}"))
    if so.get("json_object"):
        kinds.append({"json_object": True})
    if len(kinds) != 1:
        raise InvalidArgument(
            "'structured_outputs': give exactly one of json, regex, choice, grammar, json_object", param="structured_outputs"
        )
    return kinds[0]


def guided_field(kind: str, value: Any, param: str) -> GuidedSettings:
    """One regex / grammar (a non-empty string) or choice (a non-empty array of strings) constraint."""
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
            raise InvalidArgument(f"'{param}': expected a non-empty array of strings", param=param)
        return {"choice": list(value)}
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"'{param}': expected a non-empty string", param=param)
    return {kind: value}  # type: ignore[misc]


# ---------------------------------------------------------------- forcing a tool call (vLLM's schemas)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function")
    return fn if isinstance(fn, dict) else {}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = _function(tool).get("parameters")
    return params if isinstance(params, dict) else {"type": "object"}


def named_schema(tool: dict[str, Any]) -> str:
    """The schema of a forced function's output: its arguments."""
    return json.dumps(_parameters(tool))


def required_schema(tools: Sequence[dict[str, Any]]) -> str:
    """The schema of "required": a non-empty array of calls of the offered functions."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [_function(t).get("name", "")]}, "parameters": _parameters(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    item = options[0] if len(options) == 1 else {"anyOf": options}
    return json.dumps({"type": "array", "minItems": 1, "items": item})


# ---------------------------------------------------------------- JSON schema shape

_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_MAX_DEPTH = 64


def check_schema(text: str, param: str) -> str:
    """`text` if it is a JSON schema of a sane shape; else InvalidArgument saying what is wrong, where."""
    try:
        schema = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"'{param}': the schema is not valid JSON ({exc})", param=param) from None
    refs: list[tuple[str, str]] = []
    _check(schema, param, "schema", 0, refs)
    for where, ref in refs:
        _resolve(schema, ref, param, where)
    return text


def _resolve(root: Any, ref: str, param: str, where: str) -> None:
    """A `$ref` must point inside the schema ('#' or '#/a/b'), at something that is there."""
    if ref != "#" and not ref.startswith("#/"):
        raise InvalidArgument(f"'{param}': only local references ('#/...') are supported, got {ref!r} at {where}", param=param)
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise InvalidArgument(f"'{param}': the reference {ref!r} at {where} points at nothing", param=param)


def _check(s: Any, param: str, where: str, depth: int, refs: list[tuple[str, str]]) -> None:
    def fail(why: str) -> InvalidArgument:
        return InvalidArgument(f"'{param}': {why} at {where}", param=param)

    if isinstance(s, bool):
        return
    if not isinstance(s, dict):
        raise fail("a schema must be an object or a boolean")
    if depth > _MAX_DEPTH:
        raise fail(f"the schema nests deeper than {_MAX_DEPTH} levels")
    t = s.get("type")
    for name in [t] if isinstance(t, str) else t if isinstance(t, list) else [] if t is None else [None]:
        if name not in _TYPES:
            raise fail(f"'type' must be one of {', '.join(sorted(_TYPES))} (or a list of them), got {name!r}")
    req = s.get("required")
    if req is not None and (not isinstance(req, list) or not all(isinstance(r, str) for r in req)):
        raise fail("'required' must be an array of property names")
    enum = s.get("enum")
    if enum is not None and not isinstance(enum, list):
        raise fail("'enum' must be an array")
    ref = s.get("$ref")
    if ref is not None and not isinstance(ref, str):
        raise fail("'$ref' must be a string")
    if ref is not None:
        refs.append((where, ref))
    for key in _SUBSCHEMA_MAPS:
        if (m := s.get(key)) is not None:
            if not isinstance(m, dict):
                raise fail(f"'{key}' must be an object of schemas")
            for k, sub in m.items():
                _check(sub, param, f"{where}.{key}.{k}", depth + 1, refs)
    for key in _SUBSCHEMA_LISTS:
        if (seq := s.get(key)) is not None:
            if not isinstance(seq, list):
                raise fail(f"'{key}' must be an array of schemas")
            for i, sub in enumerate(seq):
                _check(sub, param, f"{where}.{key}[{i}]", depth + 1, refs)
    for key in _SUBSCHEMAS:
        if (sub := s.get(key)) is not None:
            if key == "items" and isinstance(sub, list):  # draft-04 tuple form
                for j, one in enumerate(sub):
                    _check(one, param, f"{where}.items[{j}]", depth + 1, refs)
            else:
                _check(sub, param, f"{where}.{key}", depth + 1, refs)
