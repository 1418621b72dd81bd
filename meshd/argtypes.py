"""argparse value types shared by the subcommands: one clear line for bad input."""

from __future__ import annotations

import argparse
import errno
import math
import os
import tempfile
from collections.abc import Callable


def finite_float(text: str) -> float:
    """A number that is not NaN or infinite: a wait, a rate or a temperature of ``inf`` or
    ``nan`` passes every comparison it meets unseen and hangs or crashes far from here."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be greater than 0")
    return value


def float_between(least: float, most: float, unit: str = "") -> Callable[[str], float]:
    """A parser of a finite number from ``least`` to ``most`` (``unit`` follows them in its error)."""
    unit = f" {unit}" if unit else ""

    def parse(text: str) -> float:
        value = finite_float(text)
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"{text!r} must be from {least:g} to {most:g}{unit}")
        return value

    return parse


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


def writable_dir(text: str) -> str:
    """A directory this process can write files in, made (with its parents) if missing."""
    try:
        if os.path.exists(text) and not os.path.isdir(text):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        os.makedirs(text, exist_ok=True)
        tempfile.TemporaryFile(dir=text).close()
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc.strerror or exc}") from None
    return text


def path(text: str) -> str:
    """A file or directory name: not empty (an empty one would mean the current directory, or
    nothing given at all)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return text


def utf8_text(text: str) -> str:
    """Text that is valid UTF-8 as the command line held it: bytes that are not reach Python as
    lone surrogates (surrogateescape), which no tokenizer, JSON body or file can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = len(text[:exc.start].encode("utf-8", "surrogateescape"))  # the bytes before the first bad one
        raise argparse.ArgumentTypeError(f"not valid UTF-8 (byte {byte})") from None
    return text
