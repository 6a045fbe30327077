"""Migration bookkeeping: the resent request, the usage the caller sees, when migration is allowed."""

from __future__ import annotations

from meshllm.errors import Disconnected
from meshllm.protocol.types import TokenRequest
from meshllm.router.stream.migration import MigrationState


def request(**kw: object) -> TokenRequest:
    base: TokenRequest = {"request_id": "r", "token_ids": [1, 2, 3], "model": "m", "stop": {"max_tokens": 10, "min_tokens": 4}}
    base.update(kw)  # type: ignore[typeddict-item]
    return base


def test_the_first_attempt_is_the_request_itself() -> None:
    req = request()
    assert MigrationState(req, limit=3).next_request() is req


def test_a_migrated_request_carries_prompt_plus_generated_and_lower_limits() -> None:
    state = MigrationState(request(disagg={"request_type": "generation_only"}), limit=3)
    state.observe({"token_ids": [7, 8]})
    state.observe({"token_ids": [9]})
    state.migrate("w1")
    req = state.next_request()
    assert req is not None
    assert req["token_ids"] == [1, 2, 3, 7, 8, 9]
    assert req["stop"]["max_tokens"] == 7 and req["stop"]["min_tokens"] == 1
    assert req["request_id"] == "r:m1" and "disagg" not in req
    assert state.excluded == {"w1"}
    assert state.request["token_ids"] == [1, 2, 3]  # the original is untouched


def test_usage_reports_the_original_prompt_and_cumulative_completion_tokens() -> None:
    state = MigrationState(request(), limit=3)
    state.observe({"token_ids": [7, 8]})
    state.migrate("w1")
    out = state.observe({"token_ids": [9], "finish_reason": "length",
                         "usage": {"prompt_tokens": 5, "completion_tokens": 1, "cached_tokens": 5}})  # fmt: skip
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 3}


def test_migration_stops_at_the_limit() -> None:
    state = MigrationState(request(), limit=2)
    state.observe({"token_ids": [7]})
    assert state.can_migrate()
    state.migrate("a")
    state.migrate("b")
    assert not state.can_migrate()


def test_a_request_that_streamed_nothing_may_always_be_resent() -> None:
    """Locks docs/routing.md: a resend before the first chunk ignores the limit (the excluded workers bound it)."""
    state = MigrationState(request(), limit=0)
    assert state.can_migrate()
    state.migrate("a")
    state.migrate("b")
    assert state.can_migrate()
    state.observe({"token_ids": [7]})
    assert not state.can_migrate()


def test_guided_decoding_migrates_only_before_the_first_token() -> None:
    state = MigrationState(request(sampling={"guided": {"regex": "a+"}}), limit=3)
    assert state.can_migrate()
    state.observe({"token_ids": [5]})
    assert not state.can_migrate()


def test_a_stream_that_broke_after_its_last_token_ends_with_length() -> None:
    state = MigrationState(request(stop={"max_tokens": 2}), limit=3)
    state.observe({"token_ids": [5, 6]})
    state.migrate("a")
    assert state.next_request() is None
    assert state.length_terminal() == {
        "token_ids": [], "finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0},
    }  # fmt: skip


def test_an_error_terminal_names_the_error() -> None:
    state = MigrationState(request(), limit=0)
    term = state.error_terminal(Disconnected("gone"))
    assert term["finish_reason"] == "error" and term["error"] == {"code": "Disconnected", "message": "gone"}
