"""Ctrl-C while a command starts, before trio's signal receiver takes SIGINT over.

Python raises Ctrl-C as a KeyboardInterrupt wherever the interpreter happens to be.  Where
that is a weakref callback or a ``__del__`` (one runs inside every import, releasing its
module lock), the interpreter prints "Exception ignored" and goes on: the Ctrl-C is lost,
and a node would start and serve as if it had never come.  :func:`interrupt` is meshd's
SIGINT handler from its first line, and counts each Ctrl-C it raises; a command that takes
signals over with trio asks :func:`raise_if_lost` once it has, and ends as Ctrl-C asks."""

from __future__ import annotations

import signal
import sys
from types import FrameType

_raised = 0


def interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGINT's handler until a command takes it over: Python's own, counted."""
    global _raised
    _raised += 1
    raise KeyboardInterrupt


def _unraisable(unraisable) -> None:
    """Python's hook for an exception it drops: one of ours is kept for :func:`raise_if_lost`,
    not printed as a traceback the user did nothing to cause."""
    if unraisable.exc_type is not KeyboardInterrupt or not _raised:
        sys.__unraisablehook__(unraisable)


def install() -> None:
    signal.signal(signal.SIGINT, interrupt)
    sys.unraisablehook = _unraisable


def lost() -> bool:
    """Whether a Ctrl-C came and was swallowed where it landed (once: it is then taken).
    Ask once SIGINT is another handler's: from then on none can be lost."""
    global _raised
    taken, _raised = _raised, 0
    return bool(taken)


def raise_if_lost() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that was swallowed (see :func:`lost`)."""
    if lost():
        raise KeyboardInterrupt
