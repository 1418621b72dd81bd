"""Stop strings (meshd.pipeline.stops): where the text ends, and what a stream may show before
it knows whether a stop string is coming."""

from __future__ import annotations

import pytest

from meshd.pipeline.stops import find_stop, pending_stop, settled


def test_the_text_ends_before_the_first_stop_string_of_any():
    assert find_stop("one. two\nthree", ["\n", "."]) == 3
    assert find_stop("one two", ["\n"]) is None
    assert find_stop("abc", []) is None
    assert settled("Answer: 4\n\nQ: next", ["\n\n", "Q:"]) == "Answer: 4"


@pytest.mark.parametrize(
    "text, stops, pending",
    [
        ("Hello, ST", ["STOP"], 2),
        ("Hello, STO", ["STOP", "TOP"], 3),
        ("Hello, S", ["STOP", "\n"], 1),
        ("Hello", ["STOP"], 0),
        ("aaa", ["aab"], 2),
        ("", ["x"], 0),
    ],
)
def test_a_tail_that_may_begin_a_stop_string_is_pending(text, stops, pending):
    assert pending_stop(text, stops) == pending


def stream(pieces: list[str], stops: list[str]) -> list[str]:
    """What a stream shows after each piece of decoded text arrives (as _Events does)."""
    text, shown, out = "", "", []
    for piece in pieces:
        text += piece
        now = settled(text, stops)
        out.append(now[len(shown):] if now.startswith(shown) else "")
        shown += out[-1]
    return out


def test_a_stream_holds_back_what_may_be_a_stop_string_and_never_shows_it():
    text = "The answer is 42.\nUser: thanks"
    chunks = stream(list(text), ["\nUser:"])
    assert "".join(chunks) == "The answer is 42."
    # While "\nUs" could still become "\nUser:", nothing of it was shown.
    assert all("\n" not in c for c in chunks)


def test_a_held_back_tail_that_turns_out_not_to_stop_is_shown_then():
    chunks = stream(["Say S", "TO", "RY time"], ["STOP"])
    assert chunks == ["Say ", "", "STORY time"]


def test_a_character_whose_bytes_are_not_all_here_waits():
    # "é" is two bytes: decoded with one of them, the text ends in U+FFFD, which is not shown.
    assert settled("caf\ufffd", []) == "caf"
    assert settled("café!", []) == "café!"
