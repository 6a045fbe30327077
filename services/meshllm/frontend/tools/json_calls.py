"""Call objects inside a model's output: where a JSON value ends, and `{"name", "arguments"}` streamed as CallDeltas."""

from __future__ import annotations

import json
import re

from meshllm.frontend.tools.base import CallDelta, call_id

__all__ = ["CallObject", "JsonScanner"]


class JsonScanner:
    """Finds where one JSON value ends, fed piece by piece (no parsing, no validation)."""

    __slots__ = ("_depth", "_esc", "_in_str", "_prim", "started")

    def __init__(self) -> None:
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._prim = False
        self.started = False

    def feed(self, s: str, start: int = 0) -> int | None:
        """The index in `s` just past the value's end, or None while it has not ended."""
        for j in range(start, len(s)):
            c = s[j]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    if self._depth == 0:
                        return j + 1
            elif not self.started:
                if c in " \t\r\n":
                    continue
                self.started = True
                if c in "{[":
                    self._depth = 1
                elif c == '"':
                    self._in_str = True
                else:
                    self._prim = True
            elif self._prim:
                if c in " \t\r\n,;}]":
                    return j
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return j + 1
        return None


_HEAD = re.compile(r'\s*\{\s*"(?:name|function)"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:')  # seen before a name: the object is emitted whole
_HEAD_LIMIT = 1024  # a name and its key fit in this; past it the object is emitted whole


class CallObject:
    """One `{"name": ..., "arguments": ...}` object, streamed as CallDeltas."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.buf = ""
        self.scanner = JsonScanner()
        self.named = False  # name emitted, arguments streaming
        self.whole = False  # emit at the end only
        self.args_scan: JsonScanner | None = None
        self.args_sent = 0  # characters of buf sent as arguments
        self.args_start = 0

    def feed(self, text: str) -> tuple[int | None, list[CallDelta], str]:
        """Consume text → (characters of `text` used when the object ended, else None; deltas; content).

        An object that turns out not to be a call (invalid JSON, no name) is content.
        """
        before = len(self.buf)
        end = self.scanner.feed(text)
        used = len(text) if end is None else end
        self.buf += text[:used]
        out: list[CallDelta] = []
        if not self.named and not self.whole:
            m = _HEAD.match(self.buf)
            if m is not None:
                rest = self.buf[m.end() :].lstrip()
                if rest.startswith('"'):
                    self.whole = True
                elif rest or end is not None:
                    self.named = True
                    out.append(CallDelta(self.index, call_id(), json.loads(f'"{m.group(1)}"')))
                    self.args_start = self.args_sent = m.end()
                    self.args_scan = JsonScanner()
                    before = m.end()
            elif len(self.buf) > _HEAD_LIMIT or _ARGS_KEY.search(self.buf):
                self.whole = True
        if self.named and self.args_scan is not None:
            new = self.buf[before:]
            stop = self.args_scan.feed(new)
            if stop is not None:
                piece = new[:stop]
                self.args_scan = None
            else:
                piece = new
            if piece:
                out.append(CallDelta(self.index, arguments=piece))
        if end is not None and not self.named:
            whole = self._whole()
            if whole is None:
                return end, out, self.buf
            out.append(whole)
        return end, out, ""

    def _whole(self) -> CallDelta | None:
        try:
            obj = json.loads(self.buf)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        name = obj.get("name", obj.get("function"))
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(name, str) or not name:
            return None
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return CallDelta(self.index, call_id(), name, text)

    def abandon(self) -> str:
        """The output ended inside the object: its text is content unless its name was sent."""
        return "" if self.named else self.buf
