"""Stop strings: never emitted, partial matches held back and released, independent of how text is split."""

from __future__ import annotations

import random

import pytest

from meshllm.frontend.text.stop_strings import StopStringMatcher


def stream(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, bool]:
    """Feed pieces like a stream would; return everything emitted (flush included) and whether it stopped."""
    out = []
    stopped = False
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            break
    out.append(matcher.flush())
    return "".join(out), stopped


def test_text_without_stops_passes_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.push("anything") == ("anything", False)
    assert matcher.flush() == ""


def test_stop_string_is_never_emitted_and_nothing_after_it() -> None:
    """The text before the stop comes out; the stop and everything after never do."""
    matcher = StopStringMatcher(["END"])
    assert matcher.push("one two END three") == ("one two ", True)
    assert matcher.stopped and matcher.matched == "END"
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_partial_match_is_held_back_then_released_when_it_fails() -> None:
    """A tail that could become a stop waits; once it cannot, it comes out unchanged."""
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("hello ST") == ("hello ", False)
    assert matcher.push("O") == ("", False)
    assert matcher.push("RM") == ("STORM", False)
    assert matcher.push("ST") == ("", False)
    assert matcher.flush() == "ST"


def test_stop_spanning_several_pushes_is_caught() -> None:
    matcher = StopStringMatcher(["<|end|>"])
    assert stream(matcher, ["abc<", "|e", "nd", "|>tail"]) == ("abc", True)


def test_multiple_stops_the_first_to_complete_wins() -> None:
    """Of several stops, the one that ends first decides, as a character-by-character stream would."""
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.push("xabcd") == ("xa", True)
    assert matcher.matched == "bc"
    matcher = StopStringMatcher(["world", "o w"])
    assert matcher.push("hello world") == ("hell", True)
    assert matcher.matched == "o w"


def test_include_stop_keeps_the_stop_string() -> None:
    matcher = StopStringMatcher(["\n\n"], include_stop=True)
    assert stream(matcher, ["para\n", "\nnext"]) == ("para\n\n", True)


def test_empty_and_duplicate_stops_are_ignored() -> None:
    matcher = StopStringMatcher(["", "x", "x"])
    assert matcher.stops == ("x",)
    assert matcher.push("abc") == ("abc", False)


def test_unicode_stop_strings() -> None:
    matcher = StopStringMatcher(["😀!", "終わり"])
    assert stream(matcher, ["hi 😀", "? ok 終", "わり more"]) == ("hi 😀? ok ", True)


@pytest.mark.parametrize("seed", range(40))
def test_result_does_not_depend_on_how_text_is_split(seed: int) -> None:
    """Random text cut at random places gives exactly the one-shot result, and never leaks a stop."""
    rng = random.Random(seed)
    alphabet = "ab c\nSTOP<>|é😀"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
    stops = ["STOP", "<|>", "a b", "\n\n", "😀é"][: rng.randint(1, 5)]
    expected_stop = StopStringMatcher(stops).push(text)[1]
    pieces, i = [], 0
    while i < len(text):
        size = rng.randint(1, 6)
        pieces.append(text[i : i + size])
        i += size
    one_shot = StopStringMatcher(stops)
    one_shot_text = one_shot.push(text)[0] + one_shot.flush()
    out, stopped = stream(StopStringMatcher(stops), pieces)
    assert out == one_shot_text
    assert stopped == expected_stop
    assert not any(stop in out for stop in stops)
