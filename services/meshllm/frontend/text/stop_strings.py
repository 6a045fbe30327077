"""Stop strings on streamed text: never emitted, partial matches held back until they resolve.

A `StopStringMatcher` sees the text of one choice piece by piece. It returns what
is safe to show now and holds back the longest tail that could still grow into a
stop string. When a stop string completes, the text before it is released, the
stream is stopped, and nothing after it is ever returned.

Which stop wins when several match: the one that *ends* first (ties: the
longest), i.e. the one a character-by-character stream completes first — so the
output does not depend on how the text was split into pieces.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStringMatcher", "partial_tail"]


class StopStringMatcher:
    """Matches `stops` across pushes; one instance per choice. Empty stop strings are ignored.

    After a match, `stopped` is True and `matched` holds the stop string (the
    OpenAI `stop_reason`); later pushes return ("", True).
    `include_stop=True` keeps the stop string itself in the output.
    """

    def __init__(self, stops: Sequence[str], *, include_stop: bool = False) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.include_stop = include_stop
        self.stopped = False
        self.matched: str | None = None
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string has matched)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self.stopped, self.matched, self._held = True, stop, ""
            return buffer[: start + len(stop)] if self.include_stop else buffer[:start], True
        keep = partial_tail(buffer, self.stops)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """At the end of the stream: the held-back text (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.stops:
            start = buffer.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop


def partial_tail(text: str, candidates: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `candidates` (to hold back: it may
    still grow into one)."""
    longest = max(map(len, candidates), default=0)
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[len(text) - size :]
        if any(c.startswith(tail) for c in candidates):
            return size
    return 0
