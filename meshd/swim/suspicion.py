"""Lifeguard suspicion timers: the more independent confirmations, the sooner.

The timeout starts at ``max`` and falls toward ``min`` as the expected ``k``
confirmations arrive, following memberlist's remainingSuspicionTime:
``max - (max - min) · log(n + 1) / log(k + 1)``.
"""

from __future__ import annotations

import math


def suspicion_duration(n: int, k: int, low: float, high: float) -> float:
    if k < 1:
        return low
    frac = math.log(n + 1) / math.log(k + 1)
    raw = high - frac * (high - low)
    return max(low, math.floor(raw * 1000) / 1000)


class Suspicion:
    def __init__(self, sender: bytes, k: int, low: float, high: float, start: float) -> None:
        self.k = k
        self.low = low
        self.high = high
        self.start = start
        self.confirmers = {sender}
        self.n = 0
        self.deadline = start + suspicion_duration(0, k, low, high)

    def would_confirm(self, sender: bytes) -> bool:
        """Whether ``sender``'s accusation would count (checked before its signature is)."""
        return self.n < self.k and sender not in self.confirmers

    def confirm(self, sender: bytes) -> bool:
        """Count an independent confirmation; True if it was new and shortened the timer."""
        if self.n >= self.k or sender in self.confirmers:
            return False
        self.confirmers.add(sender)
        self.n += 1
        self.deadline = self.start + suspicion_duration(self.n, self.k, self.low, self.high)
        return True
