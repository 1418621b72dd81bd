"""Lifeguard's local health multiplier.

A node that misses acks it should have had (no nacks from the helpers, or it
had to refute a suspicion of itself) is probably the slow one; it stretches
its own probe interval and timeout rather than accuse others.
"""

from __future__ import annotations


class Awareness:
    def __init__(self, max_multiplier: int) -> None:
        self.max = max_multiplier
        self.score = 0  # 0 is healthy; max - 1 is the worst

    def apply_delta(self, delta: int) -> None:
        self.score = min(max(self.score + delta, 0), self.max - 1)

    def scale(self, timeout: float) -> float:
        return timeout * (self.score + 1)
