"""What a benchmark report says about its own run: build, repeats, percentiles and the machine's load, all measured.

Every sentence a report prints about *this* run comes from here, computed from what the run saw: the package
versions and llama.cpp build read from the installed libraries, how many times each figure was measured and which
statistic it shows, the 1-minute load average sampled while the run went on (with an explanatory sentence only when
it was high), and latency figures that always carry p90 and p99 beside p50.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import re
import shlex
import statistics
import sys
import threading
from collections.abc import Iterable, Sequence
from types import TracebackType

__all__ = [
    "LoadMonitor",
    "best_phrase",
    "command_line",
    "llama_cpp_build",
    "load_sentence",
    "machine",
    "median_range",
    "python",
    "today",
    "versions",
]


def today() -> str:
    return datetime.date.today().isoformat()


_DOUBLE_QUOTABLE = re.compile(r'[^"$`\\!]*')


def command_line(argv: Sequence[str]) -> str:
    """`argv` as a shell command a reader can copy: `shlex.join`, except that an argument with an apostrophe and
    nothing a shell expands inside double quotes is double-quoted (`--label "the router's relay"`, not the
    `'the router'"'"'s relay'` that `shlex.quote` gives)."""
    return " ".join(f'"{a}"' if "'" in a and _DOUBLE_QUOTABLE.fullmatch(a) else shlex.quote(a) for a in argv)


def machine() -> str:
    """'x86_64, 2 cores, Python 3.11.7 (/usr)', read from this process."""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {python()}"


def python() -> str:
    """'3.11.7 (/root/.pyenv/versions/3.11.7)': the interpreter's version and installation, since its build
    (PGO/LTO or not) moves every figure of a Python process by 15 % or more (docs/operations.md)."""
    return f"{platform.python_version()} ({sys.base_prefix})"


def versions(*names: str) -> str:
    """'grpcio 1.85.3, uvloop 0.23.0' from importlib.metadata; packages that are not installed are left out."""
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def llama_cpp_build() -> str:
    """llama-cpp-python's version and the CPU features its llama.cpp was compiled with, read from the library."""
    import llama_cpp

    version = getattr(llama_cpp, "__version__", None) or importlib.metadata.version("llama_cpp_python")
    raw = llama_cpp.llama_print_system_info()
    info = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return f"llama-cpp-python {version}, llama.cpp system info `{compact_system_info(info)}`"


def compact_system_info(info: str) -> str:
    """'CPU : SSE3 = 1 | AVX = 1 | AVX512 = 0 | OPENMP = 1 |' → 'CPU: SSE3 AVX OPENMP' (the features that are on)."""
    parts: list[str] = []
    for field in info.replace("\n", "|").split("|"):
        field = field.strip()
        if not field:
            continue
        if ":" in field and "=" not in field.split(":", 1)[0]:
            head, field = (s.strip() for s in field.split(":", 1))
            parts.append(f"{head}:")
            if not field:
                continue
        name, eq, value = (s.strip() for s in field.partition("="))
        if not eq:
            parts.append(name)
        elif value not in ("0", ""):
            parts.append(name if value == "1" else f"{name}={value}")
    return " ".join(parts)


class LoadMonitor:
    """Samples the 1-minute load average every `interval_s` on a thread while the run goes on (and at start/end)."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        self.samples.append(os.getloadavg()[0])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):  # a sampling period, not synchronisation
            self.sample()

    def __enter__(self) -> LoadMonitor:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="load-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


def load_sentence(samples: Sequence[float], cores: int | None = None) -> str:
    """The load average the run saw; the sentence about noise only when it exceeded the core count."""
    cores = cores or os.cpu_count() or 1
    if not samples:
        return "The load average was not sampled."
    lo, hi = min(samples), max(samples)
    span = f"{lo:.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}–{hi:.1f}"
    text = f"1-minute load average {span} during the run ({len(samples)} samples, {cores} cores)."
    if hi > cores:
        text += (
            f" It rose above the core count ({hi:.1f} > {cores}): processes waited for a CPU at times, so absolute "
            "figures are noisy; compare the ratios measured side by side."
        )
    return text


def best_phrase(repeats: int, what: str = "run") -> str:
    """'best of 3 runs', or 'one run' when there was no choice."""
    return f"best of {repeats} {what}s" if repeats > 1 else f"one {what}"


def median_range(values: Iterable[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    """'0.47× (0.41–0.52, median of 3)'-style: the median, then the range and the count when repeated."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "–"
    med = fmt.format(statistics.median(vals)) + unit
    if len(vals) == 1:
        return f"{med} (one run)"
    return f"{med} ({fmt.format(min(vals))}–{fmt.format(max(vals))}, median of {len(vals)})"
