"""Regexes as llama.cpp GBNF (the JSON Schema / ECMA subset), and the pieces every grammar here shares.

`regex_grammar` is a guided regex: text that matches the pattern in full.
Inside a JSON string (a schema's `pattern`), `Regex(..., json_string=True)`
keeps quote, backslash and controls out of classes and `.`, and writes them
as JSON escapes when literal: a subset of the pattern's language that
`json.loads` accepts. What cannot be guaranteed (lookarounds,
backreferences, ...) is a `SchemaUnsupported` naming it.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["Regex", "SchemaUnsupported", "json_lit", "lit", "regex_grammar"]


class SchemaUnsupported(ValueError):
    """The schema asks for something this converter cannot guarantee; the message names it."""


def lit(text: str) -> str:
    """A GBNF literal matching `text` exactly."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def json_lit(value: Any) -> str:
    """A GBNF literal of a JSON value's canonical text (a const or enum member)."""
    return lit(json.dumps(value, ensure_ascii=False, separators=(",", ":"))) + " space"


_CLASSES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " "}  # \s: the space alone (tabs/newlines are controls in JSON)
_ESC_CHARS = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}


class Regex:
    """A regex (the JSON Schema / ECMA subset: literals, classes, ., groups, |, *, +, ?, {m,n}) as a GBNF body.

    `json_string`: the text lands inside a JSON string, so quote, backslash and controls come out as JSON
    escapes when literal, and are left out of classes and `.` (a subset of the pattern's language).
    """

    def __init__(self, pattern: str, *, json_string: bool) -> None:
        self.src = pattern
        self.i = 0
        self.json = json_string
        if pattern.startswith("^"):
            self.i = 1
        self.end = len(pattern) - 1 if pattern.endswith("$") and not pattern.endswith("\\$") else len(pattern)

    def gbnf(self) -> str:
        out = self.alternation()
        if self.i != self.end:
            raise self.error("unbalanced ')'")
        return out

    def error(self, what: str) -> SchemaUnsupported:
        return SchemaUnsupported(f"pattern {self.src!r}: {what} at position {self.i}")

    def peek(self) -> str | None:
        return self.src[self.i] if self.i < self.end else None

    def alternation(self) -> str:
        alts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence())
        return " | ".join(a or '""' for a in alts)

    def sequence(self) -> str:
        items: list[str] = []
        while (c := self.peek()) is not None and c not in "|)":
            atom = self.atom()
            items.append(atom + self.quantifier())
        return " ".join(items)

    def quantifier(self) -> str:
        c = self.peek()
        if c is None or c not in "*+?{":
            return ""
        self.i += 1
        if c != "{":
            q = c
        else:
            close = self.src.find("}", self.i)
            if close < 0:
                raise self.error("unterminated {")
            body = self.src[self.i : close]
            self.i = close + 1
            lo, _, hi = body.partition(",")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise self.error(f"bad repetition {{{body}}}")
            q = "{" + body + "}"
        if self.peek() in ("?", "+"):
            self.i += 1  # lazy / possessive: the language is the same
        return q

    def atom(self) -> str:
        c = self.src[self.i]
        self.i += 1
        if c == "(":
            if self.src.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.error("lookarounds and named groups are not supported")
            inner = self.alternation()
            if self.peek() != ")":
                raise self.error("unterminated (")
            self.i += 1
            return f"({inner})"
        if c == "[":
            return self.char_class()
        if c == ".":
            return '[^"\\\\\\x7F\\x00-\\x1F]' if self.json else "[^\\x0A\\x0D]"
        if c == "\\":
            return self.escape(in_class=False)
        if c in "*+?{":
            raise self.error(f"nothing to repeat before {c!r}")
        if c in "^$":
            raise self.error("anchors inside the pattern are not supported")
        return self.literal(c)

    def literal(self, ch: str) -> str:
        if self.json:
            if ch in '"\\':
                return lit("\\" + ch)
            if ord(ch) < 0x20 or ord(ch) == 0x7F:
                return lit(json.dumps(ch)[1:-1])
        return lit(ch)

    def escape(self, *, in_class: bool) -> str:
        if self.i >= self.end:
            raise self.error("trailing backslash")
        c = self.src[self.i]
        self.i += 1
        if c in _CLASSES:
            return _CLASSES[c] if in_class else self.emit_class(_class_ranges(_CLASSES[c]), negate=False)
        if c in "DWSbB":
            raise self.error(f"\\{c} is not supported")
        ch = _ESC_CHARS.get(c, c)
        return ch if in_class else self.literal(ch)

    def class_char(self) -> str:
        """One character of a class (escapes resolved); a class escape (\\d, \\w, \\s) comes back as its ranges."""
        c = self.src[self.i]
        self.i += 1
        if c != "\\":
            return c
        return self.escape(in_class=True)

    def char_class(self) -> str:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated [")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self.class_char()
            if len(lo) > 1:  # \d, \w, \s
                ranges += _class_ranges(lo)
                continue
            if self.peek() == "-" and self.i + 1 < self.end and self.src[self.i + 1] != "]":
                self.i += 1
                hi = self.class_char()
                if len(hi) > 1 or ord(hi) < ord(lo):
                    raise self.error("bad range in a character class")
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
        return self.emit_class(ranges, negate=negate)

    def emit_class(self, ranges: list[tuple[int, int]], *, negate: bool) -> str:
        if not self.json:
            return "[" + ("^" if negate else "") + "".join(_range_text(r) for r in ranges) + "]"
        if negate:  # and never a quote, backslash or control inside a JSON string
            return "[^" + "".join(_range_text(r) for r in [*ranges, *_UNSAFE]) + "]"
        safe = _subtract(ranges, _UNSAFE)
        if not safe:
            raise self.error("the character class holds only characters a JSON string must escape")
        return "[" + "".join(_range_text(r) for r in safe) + "]"


_UNSAFE = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)]  # controls, quote, backslash


def _class_ranges(spec: str) -> list[tuple[int, int]]:
    """`a-zA-Z0-9_` → code point ranges."""
    out, i = [], 0
    while i < len(spec):
        if i + 2 < len(spec) and spec[i + 1] == "-":
            out.append((ord(spec[i]), ord(spec[i + 2])))
            i += 3
        else:
            out.append((ord(spec[i]), ord(spec[i])))
            i += 1
    return out


def _subtract(ranges: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    for lo, hi in ranges:
        pieces = [(lo, hi)]
        for c_lo, c_hi in cut:
            nxt = []
            for p_lo, p_hi in pieces:
                if c_hi < p_lo or c_lo > p_hi:
                    nxt.append((p_lo, p_hi))
                    continue
                if p_lo < c_lo:
                    nxt.append((p_lo, c_lo - 1))
                if p_hi > c_hi:
                    nxt.append((c_hi + 1, p_hi))
            pieces = nxt
        out += pieces
    return out


def _range_text(r: tuple[int, int]) -> str:
    lo, hi = r
    return _class_char(chr(lo)) if lo == hi else f"{_class_char(chr(lo))}-{_class_char(chr(hi))}"


def _class_char(ch: str) -> str:
    if ch in "]\\^-[":
        return "\\" + ch
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"\\x{ord(ch):02X}"
    return ch


def regex_grammar(pattern: str) -> str:
    """The GBNF of text that matches `pattern` in full."""
    return "root ::= " + Regex(pattern, json_string=False).gbnf()
