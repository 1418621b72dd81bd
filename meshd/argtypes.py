"""argparse value types shared by the subcommands: one clear line for bad input."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
    return value


def int_up_to(most: int, what: str = "") -> Callable[[str], int]:
    """A parser of a whole number from 1 to ``most``; past it, "must be at most ``most``
    ``what``"."""
    limit = f"{most} {what}" if what else str(most)

    def parse(text: str) -> int:
        value = positive_int(text)
        if value > most:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {limit}")
        return value

    return parse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value
