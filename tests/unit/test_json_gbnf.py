"""The JSON Schema → GBNF converter of the llamacpp engine, without a model (the model runs in
tests/integration/test_llamacpp_json_outputs.py).

Integer ranges are checked exactly: the GBNF of a range is read back as a
Python regex (it uses only literals, classes, groups, `|` and `{k}`), and
every integer around the bounds must match if and only if it is inside.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.engine.llamacpp.json_gbnf import (
    JSON_OBJECT_GBNF,
    SchemaUnsupported,
    _int_range,
    regex_grammar,
    schema_grammar,
)


def as_regex(gbnf: str) -> re.Pattern[str]:
    """A GBNF body of literals, classes, groups, alternation and {k} repetition as an equivalent Python regex."""
    out = re.sub(r'"((?:[^"\\]|\\.)*)"', lambda m: re.escape(m.group(1)), gbnf)
    return re.compile(out.replace(" ", ""))


@settings(max_examples=300, deadline=None)
@given(st.integers(-2000, 2000), st.integers(0, 3000), st.sampled_from(["both", "low", "high"]))
def test_an_integer_range_matches_exactly_the_integers_inside(lo: int, width: int, which: str) -> None:
    low = lo if which in ("both", "low") else None
    high = lo + width if which in ("both", "high") else None
    pattern = as_regex(_int_range(low, high))
    for n in range(lo - 30, lo + width + 30):
        inside = (low is None or n >= low) and (high is None or n <= high)
        assert bool(pattern.fullmatch(str(n))) == inside, (low, high, n)
    assert not pattern.fullmatch("007") and not pattern.fullmatch("-0")  # no leading zeros, no negative zero


def test_strings_never_admit_a_raw_control_character_quote_or_backslash() -> None:
    """Locks: the string character rule of schemas and of JSON mode excludes controls (the bug that broke json.loads)."""
    char = next(line for line in JSON_OBJECT_GBNF.splitlines() if line.startswith("char ::="))
    assert r'[^"\\\x7F\x00-\x1F]' in char
    grammar = schema_grammar({"type": "object", "properties": {"s": {"type": "string", "pattern": "^[^x]+.$"}}})
    body = next(line for line in grammar.splitlines() if line.startswith("root-s ::="))
    classes = re.findall(r"\[\^[^\]]*\]", body.replace("\\\\", "B"))  # backslash pairs out of the way
    assert len(classes) == 2, body  # the negated class and the dot: both leave controls, quote and backslash out
    for cls in classes:
        assert r"\x00-\x1F" in cls and '"' in cls and "B" in cls and r"\x7F" in cls, cls


def test_a_positive_class_loses_its_unsafe_characters_and_literals_become_escapes() -> None:
    grammar = schema_grammar({"type": "string", "pattern": '^["a-c\\\\]x"$'})
    assert "[a-c]" in grammar and r'"\\\""' in grammar  # the class keeps a-c only; a literal quote is written \"


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "integer", "multipleOf": 3}, "multipleOf"),
        ({"not": {"type": "string"}}, "not"),
        ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "oneOf"),
        ({"type": "string", "pattern": "^(?=a)b$"}, "lookaround"),
        ({"type": "string", "pattern": "^a", "maxLength": 3}, "pattern together"),
        ({"type": "object", "properties": {}, "required": ["x"]}, "required property"),
        ({"$ref": "https://example.com/s.json"}, "only references inside"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer"),
    ],
)
def test_what_cannot_be_guaranteed_is_refused_by_name(schema: dict[str, object], keyword: str) -> None:
    with pytest.raises(SchemaUnsupported, match=keyword):
        schema_grammar(schema)


def test_recursive_refs_become_recursive_rules() -> None:
    schema = {
        "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node",
    }
    grammar = schema_grammar(schema)
    assert grammar.count("ref-node ::=") == 1 and "ref-node" in grammar.split("ref-node ::=")[1]


def test_a_regex_is_matched_whole_outside_json() -> None:
    assert regex_grammar("^(ab|c)+d?$") == 'root ::= ("a" "b" | "c")+ "d"?'
