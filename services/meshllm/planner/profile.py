"""One engine's measured performance (`meshllm planner profile` writes it, the planner reads it).

The file is JSON::

    {"version": 1, "engine": "mocker", "engine_args": [...], "measured_at": "<ISO 8601>", "host": {...},
     "prefill": [{"isl": 512, "ttft_s": 0.08, "tokens_per_s": 6400.0}, ...],
     "decode": [{"context": 1024, "concurrency": 8, "itl_s": 0.012, "tokens_per_s": 660.0}, ...]}

A prefill row: one worker serving one request at a time of `isl` prompt tokens (its TTFT; tokens/s either
isl / ttft_s or measured at saturation). A decode row: one worker with `concurrency` streams at context length
`context` (its ITL and its total output tokens/s).

Between rows values are linear in ISL / context. Beyond them latencies extrapolate linearly (they grow with
length; clamping would promise too much) and throughputs clamp to the end row (a falling line would reach 0).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from meshllm.errors import ConfigError

__all__ = ["MAX_UTILISATION", "VERSION", "Capacity", "DecodePoint", "PrefillPoint", "Profile", "ttft_p90"]

VERSION = 1
MAX_UTILISATION = 0.95  # the busiest a prefill worker is planned to be: above it an M/D/1 queue explodes
FLOOR = 1e-6  # no interpolated latency or rate goes below this


@dataclass(frozen=True, slots=True)
class PrefillPoint:
    isl: int
    ttft_s: float
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class DecodePoint:
    context: int
    concurrency: int
    itl_s: float
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Capacity:
    """What one worker can take while its latency meets a target."""

    tokens_per_s: float
    reachable: bool  # False: even an idle worker misses the target; tokens_per_s is then its bare rate
    latency_s: float  # the predicted latency (TTFT p90 or ITL) at that operating point
    load: float  # prefill: the utilisation 0..1; decode: the concurrency


def interpolate(x: float, xs: Sequence[float], ys: Sequence[float], *, extrapolate: bool) -> float:
    """Linear in x through sorted, distinct `xs`; beyond them linear (`extrapolate`) or the end value."""
    if len(xs) == 1:
        return max(ys[0], FLOOR)
    if not extrapolate and (x <= xs[0] or x >= xs[-1]):
        return max(ys[0] if x <= xs[0] else ys[-1], FLOOR)
    i = min(max(bisect_right(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), FLOOR)


def ttft_p90(utilisation: float, ttft_s: float, service_s: float) -> float:
    """The TTFT p90 of a prefill worker at `utilisation`, as an M/D/1 queue in front of a `ttft_s` prefill.

    `service_s` is the worker's time per request (isl / its tokens/s). The mean wait of M/D/1 is
    Wq = ρ·D / (2(1−ρ)); a request waits at all with probability ρ, and its wait is taken as exponential with
    the conditional mean Wq/ρ (the exponential tail of M/G/1 waits, slightly heavier than M/D/1's, so on the
    safe side). The p90 wait is then 0 for ρ ≤ 0.1, else (Wq/ρ)·ln(10ρ) = D·ln(10ρ) / (2(1−ρ)).
    """
    if utilisation <= 0.1:
        return ttft_s
    rho = min(utilisation, 0.999)
    return ttft_s + service_s * math.log(10 * rho) / (2 * (1 - rho))


@dataclass(slots=True)
class Profile:
    """The measured rows and what follows from them; `load`/`save` read and write the file."""

    engine: str
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    engine_args: tuple[str, ...] = ()
    measured_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    host: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("a profile needs at least one prefill row and one decode row")
        self.prefill = tuple(sorted(self.prefill, key=lambda r: r.isl))
        self.decode = tuple(sorted(self.decode, key=lambda r: (r.concurrency, r.context)))

    # --- the file ---

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"profile {path}: cannot read it ({e.strerror or e})") from e
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"profile {path}: not JSON ({e.msg} at line {e.lineno})") from e
        return cls.from_json(data, source=str(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically: a temporary file beside `path`, then os.replace."""
        target = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_json(), f, indent=2)
                f.write("\n")
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def to_json(self) -> dict[str, Any]:
        """The file's content as a JSON-ready dict."""
        return {
            "version": VERSION,
            "engine": self.engine,
            "engine_args": list(self.engine_args),
            "measured_at": self.measured_at,
            "host": dict(self.host),
            "prefill": [{"isl": r.isl, "ttft_s": r.ttft_s, "tokens_per_s": r.tokens_per_s} for r in self.prefill],
            "decode": [
                {"context": r.context, "concurrency": r.concurrency, "itl_s": r.itl_s, "tokens_per_s": r.tokens_per_s}
                for r in self.decode
            ],
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "profile") -> Profile:
        """A validated profile from the file's dict; ConfigError naming `source` and the field otherwise."""
        return _Reader(source).profile(data)

    # --- prefill ---

    def prefill_ttft(self, isl: float) -> float:
        """An idle worker's TTFT for a prompt of `isl` tokens."""
        return interpolate(isl, [r.isl for r in self.prefill], [r.ttft_s for r in self.prefill], extrapolate=True)

    def prefill_rate(self, isl: float) -> float:
        """One worker's prefill tokens/s at full load: the measured rate, and never less than isl / TTFT
        (serving one request at a time already achieves that)."""
        rate = interpolate(isl, [r.isl for r in self.prefill], [r.tokens_per_s for r in self.prefill], extrapolate=False)
        return max(rate, isl / self.prefill_ttft(isl)) if isl > 0 else rate

    def prefill_ttft_p90(self, isl: float, utilisation: float, *, correction: float = 1.0) -> float:
        """The TTFT p90 at `utilisation` (ttft_p90), with service times `correction` times the profile's."""
        ttft, rate = self.prefill_ttft(isl) * correction, self.prefill_rate(isl) / correction
        return ttft_p90(utilisation, ttft, max(isl, 0.0) / rate)

    def prefill_capacity(self, isl: float, ttft_target_s: float, *, correction: float = 1.0) -> Capacity:
        """The prefill tokens/s one worker takes while its TTFT p90 (`ttft_p90`) stays ≤ the target: the
        largest utilisation ρ ≤ MAX_UTILISATION that keeps it there, times the worker's rate. `correction`
        (observed / profiled latency) stretches the service times. When even an idle worker misses the target,
        the bare rate, flagged unreachable."""
        rate = self.prefill_rate(isl) / correction
        floor = self.prefill_ttft(isl) * correction
        if floor > ttft_target_s:
            return Capacity(rate, False, floor, 1.0)
        lo, hi = 0.1, MAX_UTILISATION  # p90 is the bare TTFT up to ρ = 0.1 and rises monotonically after
        if self.prefill_ttft_p90(isl, hi, correction=correction) <= ttft_target_s:
            lo = hi
        for _ in range(40):
            if hi - lo < 1e-4:
                break
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.prefill_ttft_p90(isl, mid, correction=correction) <= ttft_target_s else (lo, mid)
        return Capacity(lo * rate, True, self.prefill_ttft_p90(isl, lo, correction=correction), lo)

    # --- decode ---

    def _decode_levels(self) -> dict[int, list[DecodePoint]]:
        levels: dict[int, list[DecodePoint]] = {}
        for r in self.decode:  # sorted by (concurrency, context)
            levels.setdefault(r.concurrency, []).append(r)
        return levels

    @staticmethod
    def _at_context(rows: list[DecodePoint], context: float) -> tuple[float, float]:
        contexts = [r.context for r in rows]
        itl = interpolate(context, contexts, [r.itl_s for r in rows], extrapolate=True)
        return itl, interpolate(context, contexts, [r.tokens_per_s for r in rows], extrapolate=False)

    def decode_itl(self, context: float, concurrency: float) -> float:
        """The ITL at `context` with `concurrency` streams: linear in context per measured concurrency, then
        linear in concurrency (extrapolated beyond the measured ones)."""
        levels = self._decode_levels()
        xs = list(levels)
        return interpolate(concurrency, xs, [self._at_context(levels[c], context)[0] for c in xs], extrapolate=True)

    def decode_peak_rate(self, context: float) -> float:
        """The most output tokens/s one worker delivered at `context`, over the measured concurrencies."""
        return max(self._at_context(rows, context)[1] for rows in self._decode_levels().values())

    def decode_capacity(self, context: float, itl_target_s: float, *, correction: float = 1.0) -> Capacity:
        """The most output tokens/s of one worker whose ITL at `context`, times `correction` (a mesh that runs
        slower than profiled), stays ≤ the target: among the measured concurrencies, and where the ITL crosses
        the target between two of them, at the crossing (linear in concurrency). Continuous in the target and
        the correction: a small change never jumps from one measured row to a far lower one. None meets it: the
        lowest concurrency's tokens/s, flagged unreachable."""
        levels = self._decode_levels()
        points = [(float(c), *self._at_context(rows, context)) for c, rows in sorted(levels.items())]
        best: Capacity | None = None
        for i, (c, itl, rate) in enumerate(points):
            if itl * correction > itl_target_s:
                continue
            candidates = [(c, itl, rate)]
            if i + 1 < len(points) and points[i + 1][1] * correction > itl_target_s:
                c2, itl2, rate2 = points[i + 1]
                frac = (itl_target_s / correction - itl) / (itl2 - itl)
                candidates.append((c + frac * (c2 - c), itl + frac * (itl2 - itl), rate + frac * (rate2 - rate)))
            for cc, ii, rr in candidates:
                if best is None or rr > best.tokens_per_s:
                    best = Capacity(rr, True, ii * correction, cc)
        if best is not None:
            return best
        c, itl, rate = points[0]
        return Capacity(rate, False, itl * correction, c)


class _Reader:
    """Validates the file's dict, naming the file and the field in every error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> ConfigError:
        return ConfigError(f"profile {self.source}: {where} {problem}")

    def profile(self, data: Any) -> Profile:
        if not isinstance(data, Mapping):
            raise self.fail("content", f"must be a JSON object, got {type(data).__name__}")
        if data.get("version") != VERSION:
            raise self.fail("version", f"must be {VERSION}, got {data.get('version')!r}")
        engine = self.field(data, "engine", str)
        args = self.field(data, "engine_args", list, default=[])
        if not all(isinstance(a, str) for a in args):
            raise self.fail("engine_args", "must be a list of strings")
        measured_at = self.field(data, "measured_at", str)
        try:
            datetime.fromisoformat(measured_at)
        except ValueError:
            raise self.fail("measured_at", f"is not an ISO 8601 time: {measured_at!r}") from None
        prefill = [PrefillPoint(**self.row(r, f"prefill[{i}]", PREFILL_FIELDS)) for i, r in enumerate(self.rows(data, "prefill"))]
        decode = [DecodePoint(**self.row(r, f"decode[{i}]", DECODE_FIELDS)) for i, r in enumerate(self.rows(data, "decode"))]
        self.distinct([(r.isl,) for r in prefill], "prefill", "isl")
        self.distinct([(r.concurrency, r.context) for r in decode], "decode", "(concurrency, context)")
        host = self.field(data, "host", dict, default={})
        return Profile(engine, tuple(prefill), tuple(decode), tuple(args), measured_at, host)

    def field(self, data: Mapping[str, Any], name: str, kind: type, default: Any = None) -> Any:
        value = data.get(name, default)
        if value is None:
            raise self.fail(name, "is missing")
        if not isinstance(value, kind):
            raise self.fail(name, f"must be a {kind.__name__}, got {type(value).__name__}")
        return value

    def rows(self, data: Mapping[str, Any], name: str) -> list[Any]:
        rows = self.field(data, name, list)
        if not rows:
            raise self.fail(name, "has no rows")
        return rows

    def row(self, row: Any, where: str, fields: Mapping[str, type]) -> dict[str, Any]:
        if not isinstance(row, Mapping):
            raise self.fail(where, "must be an object")
        values: dict[str, Any] = {}
        for name, kind in fields.items():
            value = row.get(name)
            if value is None:
                raise self.fail(f"{where}.{name}", "is missing")
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise self.fail(f"{where}.{name}", f"must be a number, got {value!r}")
            if kind is int and value != int(value):
                raise self.fail(f"{where}.{name}", f"must be an integer, got {value!r}")
            if value <= 0:
                raise self.fail(f"{where}.{name}", f"must be positive, got {value!r}")
            values[name] = kind(value)
        return values

    def distinct(self, keys: list[tuple[int, ...]], name: str, what: str) -> None:
        seen: set[tuple[int, ...]] = set()
        for key in keys:
            if key in seen:
                raise self.fail(name, f"repeats {what} {key if len(key) > 1 else key[0]}")
            seen.add(key)


PREFILL_FIELDS: Mapping[str, type] = {"isl": int, "ttft_s": float, "tokens_per_s": float}
DECODE_FIELDS: Mapping[str, type] = {"context": int, "concurrency": int, "itl_s": float, "tokens_per_s": float}
