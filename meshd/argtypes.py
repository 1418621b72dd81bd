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


MAX_CPU = 4095  # the highest CPU number a list may name (Linux's default CPU_SETSIZE is 1024)


def cpu_list(text: str) -> frozenset[int]:
    """CPU numbers as taskset and /proc write them: ``0``, ``0,2``, ``0-3``, ``0-1,4``."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a CPU list (numbers and ranges, as in 0-1,4)") from None
        if not 0 <= low <= high <= MAX_CPU:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {part.strip()!r} is not CPUs from 0 to {MAX_CPU}, the lower first")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def cpu_text(cpus: set[int] | frozenset[int] | list[int]) -> str:
    """``cpu_list``'s form of a set of CPU numbers: runs as ranges, ``0-1,4``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
