"""Typed readers of OpenAI request fields (pure, no I/O): each returns the field's value or None, or raises the
InvalidArgument whose `param` names the field (`meshllm.protocol.validate` holds the ranges and messages)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import orjson

from meshllm.protocol.openai.extensions import check_schema, guided_field, structured_outputs
from meshllm.protocol.types import GuidedSettings
from meshllm.protocol.validate import MAX_STOP_STRINGS, UINT32_MAX, bad, check_float, check_int, check_logit_bias

__all__ = [
    "bool_field",
    "float_field",
    "guided_settings",
    "int_field",
    "logit_bias",
    "model_name",
    "object_field",
    "stop_strings",
    "token_ids",
    "type_name",
]

T = TypeVar("T")


def type_name(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def int_field(body: Mapping[str, Any], key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(key, f"expected an integer, got {type_name(v)}")
    return check_int(key, v, lo, hi)


def float_field(body: Mapping[str, Any], key: str) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(key, f"expected a number, got {type_name(v)}")
    try:
        return check_float(key, float(v))
    except OverflowError:  # an integer too large for a float
        raise bad(key, "is out of range") from None


def bool_field(body: Mapping[str, Any], key: str) -> bool | None:
    return _typed_field(body, key, bool, "a boolean")


def object_field(body: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    return _typed_field(body, key, dict, "an object")


def _typed_field(body: Mapping[str, Any], key: str, kind: type[T], what: str) -> T | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, kind):
        raise bad(key, f"expected {what}, got {type_name(v)}")
    return v


def logit_bias(body: Mapping[str, Any]) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: {"token id": bias}; the ids arrive as JSON object keys, so as strings."""
    raw = object_field(body, "logit_bias")
    if not raw:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        text = str(key).strip()
        if not text.lstrip("-").isdigit():
            raise bad("logit_bias", f"key {key!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("logit_bias", f"the bias of token {text} must be a number, got {type_name(value)}")
        try:
            bias[int(text)] = float(value)
        except OverflowError:
            raise bad("logit_bias", f"the bias of token {text} is out of range") from None
    check_logit_bias("logit_bias", bias)
    return bias


def model_name(body: Mapping[str, Any]) -> str:
    v = body.get("model")
    if not isinstance(v, str) or not v.strip():
        raise bad("model", "a model name (non-empty string) is required")
    return v


def stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", "expected a string or an array of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not s for s in items):
        raise bad("stop", "stop strings must not be empty")
    return tuple(dict.fromkeys(items))


def token_ids(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32_MAX for t in value
    ):
        raise bad(param, "expected an array of non-negative integer token ids")
    return value


def guided_settings(body: Mapping[str, Any]) -> GuidedSettings | None:
    """response_format (OpenAI) or the guided_* extensions (vLLM) → one GuidedSettings."""
    kinds: list[GuidedSettings] = []
    rf = object_field(body, "response_format")
    if rf is not None:
        t = rf.get("type")
        if t == "json_object":
            kinds.append({"json_object": True})
        elif t == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise bad("response_format", "type json_schema needs a 'json_schema' object")
            schema = js.get("schema", {})
            if not isinstance(schema, dict):
                raise bad("response_format", "'json_schema.schema' must be an object")
            kinds.append({"json_schema": check_schema(orjson.dumps(schema).decode(), "response_format")})
        elif t != "text":
            raise bad("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {t!r}")
    if (gj := body.get("guided_json")) is not None:
        if isinstance(gj, dict):
            gj = orjson.dumps(gj).decode()
        if not isinstance(gj, str):
            raise bad("guided_json", "expected a JSON schema object or string")
        kinds.append({"json_schema": check_schema(gj, "guided_json")})
    for kind in ("regex", "grammar", "choice"):
        if (g := body.get(f"guided_{kind}")) is not None:
            kinds.append(guided_field(kind, g, f"guided_{kind}"))
    if (so := structured_outputs(body)) is not None:
        kinds.append(so)
    if len(kinds) > 1:
        raise bad("response_format", "at most one output constraint (response_format, structured_outputs or one guided_* field)")
    return kinds[0] if kinds else None
