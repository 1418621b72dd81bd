"""Ctrl-C while a command starts, before trio's signal receiver takes SIGINT over.

Python raises Ctrl-C as a KeyboardInterrupt wherever the interpreter happens to be.  Where
that is a weakref callback or a ``__del__`` (one runs inside every import, releasing its
module lock), the interpreter prints "Exception ignored" and goes on: the Ctrl-C is lost,
and a node would start and serve as if it had never come.  :func:`interrupt` is meshd's
SIGINT handler from its first line, and counts each Ctrl-C it raises; a command that takes
signals over with trio asks :func:`raise_if_lost` once it has, and ends as Ctrl-C asks.
A command that leaves SIGINT to trio's own handling runs its ``trio.run`` inside
:func:`pythons_own`: trio guards its internals from a KeyboardInterrupt only where SIGINT's
handler is Python's default one."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
    Ask once SIGINT is another handler's: a Ctrl-C that lands after the answer is no longer
    counted, so an answer given earlier can miss it."""
    global _raised
    taken, _raised = _raised, 0
    return bool(taken)


def raise_if_lost() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that was swallowed (see :func:`lost`)."""
    if lost():
        raise KeyboardInterrupt


@contextmanager
def pythons_own() -> Iterator[None]:
    """Within: SIGINT is Python's default handler, so ``trio.run`` takes Ctrl-C over and
    delivers it as one KeyboardInterrupt where trio can unwind cleanly, not inside its own
    bookkeeping.  A Ctrl-C swallowed before is raised on entry."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread has signal handlers, and only it gets a Ctrl-C
        return
    raise_if_lost()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGINT, previous)


def leave_signals() -> tuple[signal.Signals, ...]:
    """The signals a long-running command (``meshd run``, ``meshd relay``) leaves on,
    gracefully: SIGINT, SIGTERM, and SIGHUP (its terminal closed, an ssh session dropped)
    unless the process was started ignoring it (``nohup``), which then keeps it running as
    asked."""
    hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)
    return (signal.SIGINT, signal.SIGTERM, *hangup)
