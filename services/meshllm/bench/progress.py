"""The progress display of `meshllm bench` on stderr: done/total, rate, elapsed time and ETA.

On a terminal it is one line redrawn in place (at most 10 times a second);
elsewhere (`--progress` with stderr not a terminal, e.g. a CI log) a plain
line at every tenth of the run. Off by default when stderr is not a terminal.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress", "format_duration"]


def format_duration(seconds: float) -> str:
    """12.3 -> "0:12", 3725 -> "1:02:05"."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """Counts finished requests of one level and shows them (see the module docstring)."""

    def __init__(self, label: str, total: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.label, self.total, self.done, self.errors = label, total, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self._last = 0.0
        self._last_tenth = 0

    def line(self, now: float | None = None) -> str:
        """The status text: label, done/total, errors, req/s, elapsed and ETA."""
        elapsed = (time.perf_counter() if now is None else now) - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = format_duration((self.total - self.done) / rate) if rate > 0 else "?"
        errors = f", {self.errors} errors" if self.errors else ""
        return f"{self.label} {self.done}/{self.total}{errors}  {rate:6.1f} req/s  elapsed {format_duration(elapsed)}  ETA {eta}"

    def tick(self, *, error: bool = False) -> None:
        self.done += 1
        self.errors += error
        if not self.enabled or self.total <= 0:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last >= 0.1 or self.done == self.total:
                self._last = now
                width = 24
                filled = int(width * self.done / self.total)
                bar = "█" * filled + "░" * (width - filled)
                end = "\n" if self.done == self.total else ""
                self.stream.write(f"\r\x1b[K{bar} {self.line(now)}{end}")
                self.stream.flush()
        elif (tenth := 10 * self.done // self.total) != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(self.line(now) + "\n")
            self.stream.flush()

    def finish(self) -> None:
        """End an unfinished bar's line (a stopped run)."""
        if self.enabled and self.tty and self.done < self.total:
            self.stream.write("\n")
            self.stream.flush()
