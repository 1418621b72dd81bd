"""How much a node may send to an address that has not proven it is one of us.

A UDP source address is whatever the sender wrote.  A stranger who writes a
victim's address on a small packet must not make us send the victim much
more than that packet (QUIC's anti-amplification rule, RFC 9000 section 8):
until an address has answered a ping we sent it, what we send it is held to
``factor`` times what we received from it, plus a small allowance that
refills slowly, so a member we only learned of by gossip can still be probed.
Sans-IO: the caller passes ``now``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Budget:
    tokens: float  # bytes we may still send
    at: float  # when ``tokens`` was last refilled


class AmplificationGuard:
    def __init__(
        self,
        factor: float = 3.0,
        allowance: float = 1024.0,  # a ping with some gossip; a join pays for its answer (x3)
        refill_per_s: float = 32.0,  # a bare ping every few seconds
        max_addresses: int = 4096,
    ) -> None:
        self.factor = factor
        self.allowance = allowance  # at most this much of the refill is banked
        self.refill_per_s = refill_per_s
        self.max_addresses = max_addresses
        self._verified: OrderedDict[str, None] = OrderedDict()
        self._budgets: OrderedDict[str, _Budget] = OrderedDict()

    def verified(self, addr: str) -> None:
        """``addr`` answered something only its real owner could: no limit from now on."""
        self._budgets.pop(addr, None)
        self._verified[addr] = None
        self._verified.move_to_end(addr)
        if len(self._verified) > self.max_addresses:
            self._verified.popitem(last=False)

    def received(self, addr: str, size: int, now: float) -> None:
        if addr in self._verified:
            return
        budget = self._budget(addr, now)
        budget.tokens += self.factor * size

    def is_verified(self, addr: str) -> bool:
        return addr in self._verified

    def room(self, addr: str, now: float) -> float:
        """Bytes we may send to ``addr`` now (infinite once it has proven itself)."""
        if addr in self._verified:
            return float("inf")
        return self._budget(addr, now).tokens

    def may_send(self, addr: str, size: int, now: float) -> bool:
        """Whether ``size`` more bytes to ``addr`` stay within its budget; if so, they are spent."""
        if addr in self._verified:
            return True
        budget = self._budget(addr, now)
        if budget.tokens < size:
            return False
        budget.tokens -= size
        return True

    def _budget(self, addr: str, now: float) -> _Budget:
        budget = self._budgets.get(addr)
        if budget is None:
            budget = self._budgets[addr] = _Budget(self.allowance, now)
            if len(self._budgets) > self.max_addresses:
                self._budgets.popitem(last=False)  # forgetting one only gives it a fresh allowance
        else:
            self._budgets.move_to_end(addr)
            if budget.tokens < self.allowance:
                budget.tokens = min(self.allowance, budget.tokens + (now - budget.at) * self.refill_per_s)
            budget.at = now
        return budget
