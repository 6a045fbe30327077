"""Pythonic tool calls: a Python list of calls opening the output, `[f(a=1), g(b="x")]`.

Published example (Llama 3.2 / Llama 4 model cards, vLLM's pythonic parser docs):

    [get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', metric='celsius')]

Llama 4 may wrap it in `<|python_start|>` / `<|python_end|>`. The list is held
until its closing bracket, then parsed with `ast` (literals only: strings,
numbers, booleans, None, lists, dicts); each call streams as one delta with its
name and JSON arguments. A list that is not calls is content.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from meshllm.frontend.tools.base import CallDelta, ToolParser, call_id

__all__ = ["PythonicParser"]

_START, _END = "<|python_start|>", "<|python_end|>"


class PythonicParser(ToolParser):
    def __init__(self) -> None:
        self._buf = ""
        self._mode = "start"  # start → list → after → text
        self._depth = 0
        self._quote = ""
        self._esc = False
        self._scanned = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if self._mode == "text":
            return text, []
        self._buf += text
        if self._mode == "after":
            return self._after(), []
        if self._mode == "start":
            s = self._buf.lstrip()
            if s.startswith(_START):
                s = s[len(_START) :].lstrip()
            elif _START.startswith(s):
                return "", []
            if not s:
                return "", []
            if s[0] != "[":
                self._mode = "text"
                out, self._buf = self._buf, ""
                return out, []
            self._mode = "list"
            self._buf = s
        end = self._scan()
        if end is None:
            return "", []
        head, self._buf = self._buf[:end], self._buf[end:]
        calls = _calls(head)
        if calls is None:
            self._mode, out, self._buf = "text", head + self._buf, ""
            return out, []
        self._mode = "after"
        return self._after(), [CallDelta(i, call_id(), name, args) for i, (name, args) in enumerate(calls)]

    def _after(self) -> str:
        """After the list: drop whitespace and one `<|python_end|>`, then everything is content."""
        s = self._buf.lstrip()
        if s.startswith(_END):
            s = s[len(_END) :].lstrip()
            self._buf = s
            if not s:
                return ""
        elif _END.startswith(s):
            return ""
        self._mode, self._buf = "text", ""
        return s

    def _scan(self) -> int | None:
        """The end of the bracketed list in `_buf`, scanning only what is new."""
        s = self._buf
        for j in range(self._scanned, len(s)):
            c = s[j]
            if self._quote:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == self._quote:
                    self._quote = ""
            elif c in "'\"":
                self._quote = c
            elif c in "[({":
                self._depth += 1
            elif c in "])}":
                self._depth -= 1
                if self._depth == 0:
                    return j + 1
        self._scanned = len(s)
        return None

    def finish(self) -> tuple[str, list[CallDelta]]:
        out = self._buf.lstrip() if self._mode == "after" else "" if self._mode == "text" else self._buf
        self._buf = ""
        return out, []


def _calls(text: str) -> list[tuple[str, str]] | None:
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    out = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _name(node.func)
        if name is None:
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        out.append((name, json.dumps(args, ensure_ascii=False)))
    return out


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None
