"""JSON Schema, JSON mode and regexes as llama.cpp GBNF grammars whose every sentence is valid.

    schema_grammar({"type": "object", ...})   # output parses with json.loads and validates against the schema
    JSON_OBJECT_GBNF                          # JSON mode: any JSON object
    regex_grammar("[a-z]+@[a-z]+")            # a guided regex (full match)

Why not llama-cpp-python's own converter: its strings admit raw control
characters (which `json.loads` refuses), its numbers ignore bounds, and its
pattern strings emit `"` and `\\` unescaped. Here every construct generates
a *subset* of what the schema allows, never a superset: strings hold no
control character, quote or backslash except as JSON escapes; a pattern is
matched in full (which also satisfies JSON Schema's unanchored search);
objects carry their declared properties only (declared order, required
ones always); numbers with bounds are integers in range, or decimals whose
integer part keeps the whole value in range. A keyword whose meaning the
grammar cannot guarantee (`not`, `uniqueItems`, `multipleOf`, ...) is a
`SchemaUnsupported` error naming it, never a grammar that might break it;
annotations (`title`, `description`, `default`, ...) are ignored. Regexes:
`meshllm.engine.llamacpp.regex_gbnf`."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from meshllm.engine.llamacpp.regex_gbnf import Regex, SchemaUnsupported, json_lit, lit, regex_grammar

__all__ = ["JSON_OBJECT_GBNF", "SchemaUnsupported", "regex_grammar", "schema_grammar"]

MAX_INT_DIGITS = 16  # unbounded integers: at most this many digits (keeps generation from running away)

# A character of a JSON string: anything but '"', '\\' and controls, or an escape.
CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
_BASE = {
    "space": '" "?',
    "char": CHAR,
    "string": r'"\"" char* "\"" space',
    "integer": '"-"? ("0" | [1-9] [0-9]{0,15}) space',
    "number": '"-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})? space',
    "boolean": '("true" | "false") space',
    "null": '"null" space',
    "value": "object | array | string | number | boolean | null",
    "object": '"{" space ( string ":" space value ("," space string ":" space value)* )? "}" space',
    "array": '"[" space ( value ("," space value)* )? "]" space',
}
_DEPS = {
    "string": ("char", "space"),
    "integer": ("space",),
    "number": ("space",),
    "boolean": ("space",),
    "null": ("space",),
    "value": ("object", "array", "string", "number", "boolean", "null"),
    "object": ("space", "string", "value"),
    "array": ("space", "value"),
}
_FORMATS = {
    "date": r'[0-9]{4} "-" ("0" [1-9] | "1" [0-2]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])',
    "time": r'([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{3})? '
    r'("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])',
    "uuid": r'[0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12}',
}
_FORMATS["date-time"] = f'{_FORMATS["date"]} "T" {_FORMATS["time"]}'
_IGNORED = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "format", "readOnly", "writeOnly",
     "deprecated", "$defs", "definitions", "contentMediaType", "contentEncoding"}
)  # fmt: skip
_KNOWN = _IGNORED | {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum",
}  # fmt: skip


class _Converter:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.rules: dict[str, str] = {"space": _BASE["space"]}
        self.refs: dict[str, str] = {}  # "$ref" → rule name (recursion-safe)

    def rule(self, name: str, body: str) -> str:
        base = "".join(c if c.isalnum() else "-" for c in name).strip("-") or "r"
        key, n = base, 0
        while key in self.rules and self.rules[key] != body:
            n += 1
            key = f"{base}-{n}"
        self.rules[key] = body
        return key

    def base(self, name: str) -> str:
        if name not in self.rules:
            self.rules[name] = _BASE[name]
            for dep in _DEPS.get(name, ()):
                self.base(dep)
        return name

    # ------------------------------------------------------------ schemas
    def visit(self, schema: Any, name: str) -> str:
        if schema is True or schema == {}:
            return self.base("value")
        if not isinstance(schema, dict):
            raise SchemaUnsupported(f"{name or 'the schema'}: expected an object, got {json.dumps(schema)[:60]}")
        unknown = sorted(k for k in schema if k not in _KNOWN)
        if unknown:
            raise SchemaUnsupported(f"{name or 'the schema'}: keyword {unknown[0]!r} is not supported in guided decoding")
        if "$ref" in schema:
            return self.ref(schema["$ref"])
        if "const" in schema:
            return self.rule(name, json_lit(schema["const"]))
        if "enum" in schema:
            return self.rule(name, " | ".join(json_lit(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.union(schema, key, name)
        if "allOf" in schema:
            return self.visit(_merge_all_of(schema), name)
        kind = schema.get("type")
        if kind is None and not any(k in schema for k in _KNOWN - _IGNORED):
            return self.base("value")
        if isinstance(kind, list):
            rest = {k: v for k, v in schema.items() if k != "type"}
            return self.rule(name, " | ".join(self.visit({**rest, "type": t}, f"{name}-{t}") for t in kind))
        if kind is None:
            kind = _implied_type(schema)
        visit: Callable[[dict[str, Any], str], str] | None = getattr(self, f"visit_{kind}", None)
        if visit is None:
            raise SchemaUnsupported(f"{name or 'the schema'}: unknown type {kind!r}")
        return visit(schema, name)

    def union(self, schema: dict[str, Any], key: str, name: str) -> str:
        if key == "oneOf" and len(schema[key]) > 1:
            raise SchemaUnsupported(
                f"{name or 'the schema'}: oneOf with several schemas (exactly one must match) is not supported; use anyOf"
            )
        rest = {k: v for k, v in schema.items() if k != key}
        alts = [self.visit({**rest, **s} if isinstance(s, dict) else s, f"{name}-{i}") for i, s in enumerate(schema[key])]
        return self.rule(name, " | ".join(alts))

    def ref(self, ref: str) -> str:
        if ref in self.refs:
            return self.refs[ref]
        if not ref.startswith("#"):
            raise SchemaUnsupported(f"$ref {ref!r}: only references inside the schema (#/...) are supported")
        target: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaUnsupported(f"$ref {ref!r} points nowhere in the schema")
            target = target[part]
        name = self.rule("ref-" + ref.rsplit("/", 1)[-1], "")  # reserve the name first: refs may recurse
        self.refs[ref] = name
        self.rules[name] = self.visit(target, name + "-body")
        return name

    def visit_null(self, schema: dict[str, Any], name: str) -> str:
        return self.base("null")

    def visit_boolean(self, schema: dict[str, Any], name: str) -> str:
        return self.base("boolean")

    def visit_object(self, schema: dict[str, Any], name: str) -> str:
        props: dict[str, Any] = schema.get("properties") or {}
        missing = set(schema.get("required", ())) - set(props)
        if missing:
            raise SchemaUnsupported(f"{name or 'the schema'}: required property {sorted(missing)[0]!r} is not in properties")
        if not props:
            extra = schema.get("additionalProperties", True)
            if extra is False:
                return self.rule(name, '"{" space "}" space')
            if extra is True or extra == {}:
                return self.base("object")
            value = self.visit(extra, f"{name}-value")
            kv = f'{self.base("string")} ":" space {value}'
            return self.rule(name, f'"{{" space ( {kv} ("," space {kv})* )? "}}" space')
        required = [k for k in props if k in set(schema.get("required", ()))]
        self.base("space")
        kvs = {
            k: self.rule(
                f"{name}-{k}-kv", f'{lit(json.dumps(k, ensure_ascii=False))} space ":" space {self.visit(v, f"{name}-{k}")}'
            )
            for k, v in props.items()
        }
        # Declared order; required ones always, each optional one may be left out.
        keys, body, opened = list(props), '"{" space ', False
        for i, k in enumerate(keys):
            if k in required:
                body += ('"," space ' if opened else "") + kvs[k] + " "
                opened = True
            elif opened:
                body += f'("," space {kvs[k]})? '
            else:  # nothing written yet: this optional property or a later one opens the object
                body += self.object_tail(keys[i:], kvs, required) + " "
                break
        return self.rule(name, body + '"}" space')

    def object_tail(self, keys: list[str], kvs: dict[str, str], required: list[str]) -> str:
        """Properties `keys` (declared order) where none has been written yet: a choice of which opens the object."""
        alts = []
        for i, k in enumerate(keys):
            seq = [kvs[k]]
            for later in keys[i + 1 :]:
                seq.append(f'"," space {kvs[later]}' if later in required else f'("," space {kvs[later]})?')
            alts.append(" ".join(seq))
            if k in required:  # a required property cannot be skipped: no later one may open instead
                return "(" + " | ".join(alts) + ")"
        return "(" + " | ".join(alts) + ")?"

    def visit_array(self, schema: dict[str, Any], name: str) -> str:
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        prefix = schema.get("prefixItems")
        if prefix is not None:
            parts = [self.visit(s, f"{name}-{i}") for i, s in enumerate(prefix)]
            if lo > len(parts) or (schema.get("items") not in (None, False)):
                raise SchemaUnsupported(f"{name or 'the schema'}: prefixItems with more items after them is not supported")
            return self.rule(name, '"[" space ' + ' "," space '.join(parts) + ' "]" space')
        item = self.visit(schema.get("items", True), f"{name}-item")
        if hi is not None and int(hi) < lo:
            raise SchemaUnsupported(f"{name or 'the schema'}: maxItems {hi} < minItems {lo}")
        return self.rule(name, '"[" space ' + _repeat(item, lo, None if hi is None else int(hi), '"," space') + ' "]" space')

    def visit_string(self, schema: dict[str, Any], name: str) -> str:
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        if "pattern" in schema:
            if "minLength" in schema or "maxLength" in schema:
                raise SchemaUnsupported(f"{name or 'the schema'}: pattern together with minLength/maxLength is not supported")
            return self.rule(name, r'"\"" (' + Regex(schema["pattern"], json_string=True).gbnf() + r') "\"" space')
        fmt = schema.get("format")
        if fmt in _FORMATS and not ("minLength" in schema or "maxLength" in schema):
            return self.rule(name, r'"\"" ' + _FORMATS[fmt] + r' "\"" space')
        if "minLength" not in schema and hi is None:
            return self.base("string")
        self.base("char")
        self.base("space")
        reps = "{" + f"{lo}," + ("" if hi is None else str(int(hi))) + "}"
        return self.rule(name, r'"\"" char' + reps + r' "\"" space')

    def visit_integer(self, schema: dict[str, Any], name: str) -> str:
        lo, hi = _int_bounds(schema)
        if lo is None and hi is None:
            return self.base("integer")
        self.base("space")
        return self.rule(name, f"({_int_range(lo, hi)}) space")

    def visit_number(self, schema: dict[str, Any], name: str) -> str:
        lo, hi = _int_bounds(schema)
        if not any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            return self.base("number")
        self.base("space")
        whole = _int_range(lo, hi)
        # k.fraction lies in [k, k+1): inside the bounds when k >= the lower one and k + 1 <= the upper one.
        f_lo = max(0, lo if lo is not None else 0)
        f_hi = None if hi is None else _frac_top(schema)
        if f_hi is not None and f_hi < f_lo:
            return self.rule(name, f"({whole}) space")
        return self.rule(name, f'({whole} | ({_int_range(f_lo, f_hi)}) "." [0-9]{{1,6}}) space')


def _frac_top(schema: dict[str, Any]) -> int:
    """The largest k whose decimals k.xxx all stay at or below the upper bound."""
    tops = [schema[k] for k in ("maximum", "exclusiveMaximum") if k in schema]
    return math.floor(min(tops)) - 1


def _int_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The integers allowed by minimum/maximum/exclusive*: inclusive (lo, hi), None where open."""
    lows, highs = [], []
    if "minimum" in schema:
        lows.append(math.ceil(schema["minimum"]))
    if "exclusiveMinimum" in schema:
        lows.append(math.floor(schema["exclusiveMinimum"]) + 1)
    if "maximum" in schema:
        highs.append(math.floor(schema["maximum"]))
    if "exclusiveMaximum" in schema:
        highs.append(math.ceil(schema["exclusiveMaximum"]) - 1)
    lo, hi = (max(lows) if lows else None), (min(highs) if highs else None)
    if lo is not None and hi is not None and lo > hi:
        raise SchemaUnsupported(f"no integer lies between the bounds {lo} and {hi}")
    return lo, hi


def _nonneg_range(a: int, b: int | None) -> list[str]:
    """GBNF alternatives for the integers a..b (0 <= a; b None = up to MAX_INT_DIGITS digits), no leading zeros."""
    top = 10**MAX_INT_DIGITS - 1 if b is None else b
    alts: list[str] = []
    digits = 1
    while a <= top:
        seg_lo, seg_hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
        lo, hi = max(a, seg_lo), min(top, seg_hi)
        if lo <= hi:
            if lo == seg_lo and hi == seg_hi and digits > 1:
                alts.append(f"[1-9] [0-9]{{{digits - 1}}}")
            else:
                alts += _blocks(lo, hi)
        a = max(a, seg_hi + 1)
        digits += 1
    return alts


def _blocks(a: int, b: int) -> list[str]:
    """a..b (same digit count) as prefix + one digit range + free digits, per block."""
    out = []
    width = len(str(b))
    while a <= b:
        k = 0
        while k + 1 < width and a % 10 ** (k + 1) == 0 and a + 10 ** (k + 1) - 1 <= b:
            k += 1
        n = 1
        while (a // 10**k + n) % 10 != 0 and a + (n + 1) * 10**k - 1 <= b:
            n += 1
        prefix = str(a // 10 ** (k + 1)) if a >= 10 ** (k + 1) else ""
        d1 = (a // 10**k) % 10
        parts = [lit(prefix)] if prefix else []
        parts.append(f"[{d1}-{d1 + n - 1}]" if n > 1 else f'"{d1}"')
        if k:
            parts.append(f"[0-9]{{{k}}}")
        out.append(" ".join(parts))
        a += n * 10**k
    return out


def _int_range(lo: int | None, hi: int | None) -> str:
    alts: list[str] = []
    if lo is None or lo < 0:  # negatives: "-" then |value| in max(1, -hi) .. -lo
        neg_hi = None if lo is None else -lo
        neg_lo = 1 if hi is None or hi >= 0 else -hi
        if neg_hi is None or neg_lo <= neg_hi:
            alts.append('"-" (' + " | ".join(_nonneg_range(neg_lo, neg_hi)) + ")")
    if hi is None or hi >= 0:
        alts += _nonneg_range(max(0, lo or 0), hi)
    return " | ".join(alts)


def _repeat(item: str, lo: int, hi: int | None, sep: str) -> str:
    if hi == 0:
        return ""
    if lo == 0:
        rest = "{0," + ("" if hi is None else str(hi - 1)) + "}"
        return f"({item} ({sep} {item}){rest})?"
    rest = "{" + f"{lo - 1}," + ("" if hi is None else str(hi - 1)) + "}"
    return f"{item} ({sep} {item}){rest}"


def _implied_type(schema: dict[str, Any]) -> str:
    if "properties" in schema or "additionalProperties" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    if "pattern" in schema or "minLength" in schema or "maxLength" in schema:
        return "string"
    if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        return "number"
    if "format" in schema:
        return "string"
    return "value"


def _merge_all_of(schema: dict[str, Any]) -> dict[str, Any]:
    """allOf of object schemas as one object (properties and required united); anything else is refused."""
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    props = dict(merged.get("properties") or {})
    required = list(merged.get("required") or ())
    for part in schema["allOf"]:
        if not isinstance(part, dict) or set(part) - {"type", "properties", "required", "title", "description"}:
            raise SchemaUnsupported("allOf is supported for object schemas with properties and required only")
        for k, v in (part.get("properties") or {}).items():
            if k in props and props[k] != v:
                raise SchemaUnsupported(f"allOf gives property {k!r} two different schemas")
            props[k] = v
        required += [r for r in part.get("required", ()) if r not in required]
    merged.update(type="object", properties=props, required=required)
    return merged


# ------------------------------------------------------------------ regexes
# ------------------------------------------------------------------ entry points


def schema_grammar(schema: Any) -> str:
    """The GBNF of a JSON Schema (a dict, or its JSON text); SchemaUnsupported names what cannot be guaranteed."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise SchemaUnsupported(f"the schema is not valid JSON: {exc}") from None
    conv = _Converter(schema if isinstance(schema, dict) else {})
    top = conv.visit(schema, "root")
    if top != "root":
        conv.rules["root"] = top
    return "\n".join(f"{name} ::= {body}" for name, body in conv.rules.items())


JSON_OBJECT_GBNF = "\n".join(
    ["root ::= object"]
    + [f"{n} ::= {_BASE[n]}" for n in ("object", "value", "array", "string", "char", "number", "boolean", "null", "space")]
)
