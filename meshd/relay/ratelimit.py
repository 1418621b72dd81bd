"""A token bucket per relay client, in bytes.  Time is an argument."""

from __future__ import annotations


class TokenBucket:
    """``rate`` bytes per second refill, at most ``burst`` bytes saved up."""

    __slots__ = ("rate", "burst", "_tokens", "_last")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._last = now

    def take(self, amount: float, now: float) -> bool:
        """Spend ``amount`` tokens if there are that many; False (and spend nothing) if not."""
        if now > self._last:
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
        if amount > self._tokens:
            return False
        self._tokens -= amount
        return True
