"""A stage polls its sockets, rather than sleeping, while its next message is due.

A process asleep in ``epoll_wait`` on a VM sleeps on a halted vCPU, and waking it for a
message costs the hypervisor tens of microseconds or more (``bench/wake.py``: a trio reader
asleep 5 ms read a message 39-138 µs after its write, one asleep 0.3 ms in 14-33 µs).  A
pipelined token pays that at every hop.  For a window after each message, a stage instead turns its event loop
without blocking (trio polls epoll with a zero timeout while a task is runnable) and yields
its CPU at each turn to anything else runnable there: the next message is read within
microseconds of its arrival.  This spends a CPU per stage while a request runs, as
CUDA's spin-wait does, and nothing once the messages stop: the window closes and the loop
sleeps again.

While a compute thread runs (a prompt's prefill, a large batch) polling pauses: the loop's
thread would take the GIL from it at every turn.  The stage decides when a message is due
(``StageService._due_soon``): it polls only while it serves a single request.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import trio

DEFAULT_POLL_MS = 50.0  # longer than the gap between a decode's messages at a stage


class Poller:
    """Polls for ``window_s`` after each ``touch``; ``run`` is the polling task (it returns
    at once when ``window_s`` is 0: polling is off)."""

    def __init__(self, window_s: float) -> None:
        if not 0 <= window_s < math.inf:
            raise ValueError(f"poll window {window_s} s must be finite and at least 0")
        self.window_s = window_s
        self._polled_s = 0.0  # in the polling stretches that ended
        self._stretch: float | None = None  # trio time the current stretch began
        self._until = -math.inf  # trio time the window closes
        self._threads = 0  # compute threads running: no polling meanwhile
        self._wake = trio.Event()

    def touch(self) -> None:
        """A message came, or compute ended: the next is due soon, so poll for the window."""
        if self.window_s > 0:
            self._until = trio.current_time() + self.window_s
            self._wake.set()

    def stop(self) -> None:
        """Close the window: sleep until the next ``touch``."""
        self._until = -math.inf

    @contextlib.contextmanager
    def thread_running(self) -> Iterator[None]:
        """Around a compute thread's run: no polling until it ends."""
        self._threads += 1
        try:
            yield
        finally:
            self._threads -= 1
            self._wake.set()  # a window still open goes on

    @property
    def polled_s(self) -> float:
        """Seconds spent in polling stretches, the current one included (for /metrics)."""
        if self._stretch is None:
            return self._polled_s
        return self._polled_s + trio.current_time() - self._stretch

    def polling(self) -> bool:
        return self._threads == 0 and trio.current_time() < self._until

    async def run(self) -> None:
        if self.window_s <= 0:
            return
        while True:
            if not self.polling():
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            self._stretch = trio.current_time()
            try:
                while self.polling():
                    await trio.lowlevel.checkpoint()  # one turn of the loop: I/O polled, nothing slept
                    os.sched_yield()  # a neighbour on this CPU (a stage sharing it) runs first
            finally:
                self._polled_s += trio.current_time() - self._stretch
                self._stretch = None
