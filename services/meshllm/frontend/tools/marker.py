"""`MarkerParser`: the text/block machine of the marker-based tool-call formats (see `meshllm.frontend.tools.base`)."""

from __future__ import annotations

from meshllm.frontend.text.stop_strings import partial_tail
from meshllm.frontend.tools.base import CallDelta, ToolParser
from meshllm.frontend.tools.json_calls import CallObject

__all__ = ["MarkerParser"]


class MarkerParser(ToolParser):
    """Calls after a start marker, or a JSON value opening the output (see the module docstring).

    `markers`: texts that start a block of calls; `end_marker`: what closes a
    block ("" = the block ends after its calls); `opening`: characters that
    start a block when they open the output (e.g. "{[" for formats whose
    output is the JSON itself). A block holds one object or an array of
    objects; objects may be separated by "," or ";".
    """

    markers: tuple[str, ...] = ()
    end_marker: str = ""
    opening: str = ""

    def __init__(self) -> None:
        self._pending = ""
        self._in_block = False
        self._at_start = True  # only whitespace seen so far
        self._after_call = False  # drop whitespace right after a block
        self._array = 0  # nesting of "[" in the current block
        self._obj: CallObject | None = None
        self._count = 0

    # ------------------------------------------------------------ text mode
    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        buf = self._pending + text
        self._pending = ""
        content: list[str] = []
        calls: list[CallDelta] = []
        while buf:
            if self._in_block:
                buf = self._block(buf, calls, content)
                if self._in_block:  # waiting for more
                    break
                continue
            buf = self._text(buf, content)
            if not self._in_block:
                break
        return "".join(content), calls

    def _text(self, buf: str, content: list[str]) -> str:
        """Content until a block starts; returns what is left for the block (the rest is pending)."""
        if self._after_call or self._at_start:
            stripped = buf.lstrip()
            if not stripped:
                self._pending = buf if self._at_start and not self._after_call else ""
                return ""
            if self._after_call:
                buf = stripped
        if self._at_start and self.opening:
            s = buf.lstrip()
            if s[0] in self.opening and not any(m.startswith(s[: len(m)]) for m in self.markers):
                self._start_block()
                return s
        found = [(i, m) for m in self.markers if (i := buf.find(m)) >= 0]
        if found:
            i, m = min(found)
            self._emit(buf[:i].rstrip(), content)
            self._start_block()
            return buf[i + len(m) :]
        keep = partial_tail(buf, self.markers)
        cut = len(buf) - keep
        while cut > 0 and buf[cut - 1].isspace():
            cut -= 1
        self._emit(buf[:cut], content)
        self._pending = buf[cut:]
        return ""

    def _emit(self, text: str, content: list[str]) -> None:
        if text:
            content.append(text)
            self._at_start = self._after_call = False

    def _start_block(self) -> None:
        self._in_block = True
        self._at_start = False
        self._array = 0

    def _end_block(self) -> None:
        self._in_block = False
        self._after_call = True

    # ------------------------------------------------------------ block mode
    def _block(self, buf: str, calls: list[CallDelta], content: list[str]) -> str:
        """Consume block text; returns the text after the block (or "" with the rest pending)."""
        while buf:
            if self._obj is not None:
                end, deltas, text = self._obj.feed(buf)
                calls.extend(deltas)
                if end is None:
                    return ""
                buf = buf[end:]
                if not text:  # it was a call
                    self._count += 1
                self._obj = None
                if text:
                    self._emit(text, content)
                continue
            s = buf.lstrip()
            if not s:
                self._pending = buf
                return ""
            c = s[0]
            if c == "{":
                self._obj = CallObject(self._count)
                buf = s
            elif c == "[":
                self._array += 1
                buf = s[1:]
            elif c in ",;":
                buf = s[1:]
            elif c == "]" and self._array:
                self._array -= 1
                buf = s[1:]
                if not self._array and not self.end_marker:
                    self._end_block()
                    return buf
            elif self.end_marker and s.startswith(self.end_marker):
                self._end_block()
                return s[len(self.end_marker) :]
            elif self.end_marker and self.end_marker.startswith(s):
                self._pending = s
                return ""
            else:  # not a call: back to content
                self._end_block()
                self._after_call = False
                return s
        return ""

    def finish(self) -> tuple[str, list[CallDelta]]:
        content = ""
        if self._obj is not None:
            content = self._obj.abandon()
            self._obj = None
        elif not self._in_block:
            content = self._pending
        self._pending = ""
        return content, []
