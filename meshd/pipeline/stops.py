"""Stop strings: where generated text ends, and how much of it a stream may show yet.

Generation ends at the first occurrence of any stop string in the decoded text,
and the text returned ends before it (OpenAI's ``stop``).  A stream shows text
only once no stop string can begin in it: a tail that is the beginning of a
stop string waits until the next tokens settle it, so what a client has seen
is always a prefix of the final text.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 1024


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string in ``text`` begins, or None."""
    hits = [i for stop in stops if (i := text.find(stop)) >= 0]
    return min(hits) if hits else None


def pending_stop(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the beginning of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def settled(text: str, stops: Sequence[str]) -> str:
    """The part of ``text`` (decoded so far) a stream can show: up to the first stop string,
    without a tail that may begin one, and without a last character whose bytes are not all
    here yet (decoded as U+FFFD)."""
    cut = find_stop(text, stops)
    if cut is not None:
        return text[:cut]
    text = text.rstrip("\ufffd")
    return text[:len(text) - pending_stop(text, stops)]
