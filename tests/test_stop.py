"""Stop strings over streamed text pieces: holding back, releasing, multiple stops, flush."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_core.errors import OptionError
from turbospark_core.stop import StopMatcher


def _run(stop: str | list[str] | None, pieces: list[str]) -> tuple[str, bool]:
    """Feed pieces the way the runner does (then a final flush); returns (emitted, stopped)."""
    matcher = StopMatcher(stop)
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    tail, stopped = matcher.feed("", final=True)
    return "".join(out) + tail, stopped


def test_stop_split_across_pieces() -> None:
    m = StopMatcher("STOP")
    assert m.feed("abc ST") == ("abc ", False)  # "ST" is held back
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)


def test_stop_inside_one_piece_cuts_before_it() -> None:
    assert StopMatcher(["\n\n"]).feed("first\n\nsecond") == ("first", True)


def test_stop_at_the_very_start() -> None:
    assert StopMatcher("END").feed("END of it") == ("", True)


def test_held_prefix_is_released_when_it_does_not_complete() -> None:
    m = StopMatcher("STOP")
    assert m.feed("ab S") == ("ab ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("x") == ("STx", False)


def test_release_keeps_a_new_partial_held() -> None:
    m = StopMatcher("aab")
    assert m.feed("aa") == ("", False)
    assert m.feed("a") == ("a", False)  # "aa" may still start "aab"
    assert m.feed("b") == ("", True)


def test_multiple_stops_earliest_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)


def test_multiple_stops_each_holds_its_own_prefix() -> None:
    m = StopMatcher(["<end>", "###"])
    assert m.feed("x <e") == ("x ", False)
    assert m.feed("#") == ("<e", False)  # "<e#" can no longer be <end>; "#" may start ###
    assert m.feed("#") == ("", False)
    assert m.feed("#") == ("", True)


def test_final_flush_releases_the_held_prefix() -> None:
    m = StopMatcher("STOP")
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("", final=True) == ("ST", False)


def test_final_piece_can_still_complete_a_stop() -> None:
    m = StopMatcher("STOP")
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("OP!", final=True) == ("", True)


def test_no_stops_passes_text_through() -> None:
    for stop in (None, []):
        m = StopMatcher(stop)
        assert m.feed("any") == ("any", False)
        assert m.feed(" text", final=True) == (" text", False)


@pytest.mark.parametrize("stop", ["", [""], ["ok", ""], [3], ["ok", None]])
def test_bad_stop_is_refused(stop: object) -> None:
    with pytest.raises(OptionError, match="stop="):
        StopMatcher(stop)  # type: ignore[arg-type]


def _reference(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    """What a stream must emit: check the whole text after every piece, cut at the earliest stop."""
    text = ""
    for piece in pieces:
        text += piece
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[: min(found)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text("ab", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.text("abc", max_size=4), max_size=8),
)
def test_streamed_output_equals_whole_text_check(stops: list[str], pieces: list[str]) -> None:
    assert _run(stops, pieces) == _reference(stops, pieces)
