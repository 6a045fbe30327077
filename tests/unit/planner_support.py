"""A made-up engine profile for the planner's unit tests (test_planner_profile.py, test_planner_decide.py)."""

from __future__ import annotations

from meshllm.planner.profile import DecodePoint, PrefillPoint, Profile


def itl(context: int, concurrency: int) -> float:
    return 0.01 * (1 + concurrency / 32) * (1 + context / 8192)


def make_profile() -> Profile:
    """TTFT linear in ISL (20 ms + 50 µs a token) served one at a time; ITL rising with streams and context."""
    prefill = tuple(PrefillPoint(isl, 0.02 + isl / 20000, isl / (0.02 + isl / 20000)) for isl in (128, 512, 2048, 8192))
    decode = tuple(DecodePoint(ctx, c, itl(ctx, c), c / itl(ctx, c)) for ctx in (512, 2048, 8192) for c in (1, 4, 16, 64))
    return Profile("mocker", prefill, decode, ("--speedup", "1"), "2025-01-02T03:04:05+00:00", {"cpus": 16})
