"""Which requests run now, and which wait: the orchestrator's admission.

A request runs when fewer than ``max_running`` run and the KV cache it needs at
the stage with the most layers fits the per-stage budget beside the running
ones'; otherwise it waits in a bounded FIFO queue, and beyond the queue it is
refused (``Busy``: 503 with Retry-After).  The queue is strictly first come,
first served, so a large request at its head is not overtaken forever by
small ones: no request starves.  A request that runs is never evicted: the
stages hold its cache until it ends.

A stage's cache for one request is ``positions x layers x kv heads x head_dim x
2 (k, v) x 4 bytes``, allocated whole when the request starts there (see
``StageModel.new_cache``), so the budget is kept by counting, not by measuring.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import trio

from .api import Busy
from .config import LlamaConfig
from .model import kv_cache_bytes

DEFAULT_MAX_RUNNING = 64
DEFAULT_MAX_QUEUED = 256
DEFAULT_KV_BUDGET_MB = 1024
RETRY_AFTER_S = 1


class TooLarge(ValueError):
    """A request whose cache alone is over the budget: it could never run."""


def kv_bytes(config: LlamaConfig, stages: int, positions: int) -> int:
    """One request's KV cache at the stage with the most layers, for ``positions`` positions."""
    layers = -(-config.num_hidden_layers // stages)  # the first stages take the extra layers
    return kv_cache_bytes(config, layers, positions)


@dataclass
class _Waiter:
    cost: int
    granted: trio.Event = field(default_factory=trio.Event)


class Admission:
    def __init__(self, max_running: int = DEFAULT_MAX_RUNNING, max_queued: int = DEFAULT_MAX_QUEUED,
                 budget_bytes: int = DEFAULT_KV_BUDGET_MB << 20) -> None:
        if max_running < 1 or max_queued < 0 or budget_bytes < 1:
            raise ValueError(f"max_running {max_running}, max_queued {max_queued} and budget {budget_bytes} "
                             "must be positive")
        self.max_running, self.max_queued, self.budget = max_running, max_queued, budget_bytes
        self.running = 0
        self.used = 0  # bytes of KV cache the running requests hold at the largest stage
        self.waiting: deque[_Waiter] = deque()

    def busy(self) -> Busy | None:
        """The refusal a request gets when it would have to wait and the queue is full."""
        if len(self.waiting) < self.max_queued or (not self.waiting and self._fits(0)):
            return None
        return Busy(f"busy: {self.running} requests running and {len(self.waiting)} waiting "
                    f"(--max-running {self.max_running}, --max-queued {self.max_queued}); "
                    f"retry in {RETRY_AFTER_S} s", RETRY_AFTER_S)

    def load(self) -> dict[str, int | float]:
        """What runs and waits now, against the limits."""
        return {"running": self.running, "waiting": len(self.waiting), "max_running": self.max_running,
                "max_queued": self.max_queued, "kv_used_mb": round(self.used / 2**20, 1),
                "kv_budget_mb": round(self.budget / 2**20, 1)}

    def _fits(self, cost: int) -> bool:
        return self.running < self.max_running and self.used + cost <= self.budget

    def _take(self, cost: int) -> None:
        self.running += 1
        self.used += cost

    async def admit(self, cost: int) -> float:
        """Wait for a slot for a request needing ``cost`` bytes at a stage; the seconds waited.
        Raises Busy when the queue is full, TooLarge when it could never fit."""
        if cost > self.budget:
            raise TooLarge(f"the request needs {cost / 2**20:.1f} MB of KV cache at a stage, more than the "
                           f"budget of {self.budget / 2**20:.0f} MB (--kv-budget-mb): ask for fewer tokens")
        if not self.waiting and self._fits(cost):
            self._take(cost)
            return 0.0
        if (busy := self.busy()) is not None:
            raise busy
        waiter = _Waiter(cost)
        self.waiting.append(waiter)
        t0 = time.perf_counter()
        try:
            await waiter.granted.wait()
        except BaseException:
            if waiter.granted.is_set():  # granted as it was cancelled: give the slot back
                self.release(cost)
            else:
                self.waiting.remove(waiter)
                self._grant()  # it may have held back smaller ones behind it
            raise
        return time.perf_counter() - t0

    def release(self, cost: int) -> None:
        """A request that ran ended: its slot and cache go to the first waiters that fit."""
        self.running -= 1
        self.used -= cost
        self._grant()

    def _grant(self) -> None:
        while self.waiting and self._fits(self.waiting[0].cost):
            waiter = self.waiting.popleft()
            self._take(waiter.cost)
            waiter.granted.set()
