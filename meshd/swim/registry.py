"""A last-writer-wins name registry (``pp-entry``, ``pp-stage-K``, ...).

Each name maps to the claim with the highest (clock, tombstone, owner). When
an owner dies, every member writes the same tombstone for its names, so the
registry converges without extra traffic; a member that comes back reclaims
its names with a higher clock.
"""

from __future__ import annotations

from ..wire import MAX_PUSHPULL_NAMES, NameClaim, next_counter

# Names we hold at most: as many as one push-pull can carry.
MAX_NAMES = MAX_PUSHPULL_NAMES


class Registry:
    def __init__(self) -> None:
        self.claims: dict[str, NameClaim] = {}

    def merge(self, claim: NameClaim) -> bool:
        """Take ``claim`` if it beats what we hold; True if it changed anything."""
        held = self.claims.get(claim.name)
        if held is not None and not claim.beats(held):
            return False
        if held is None and len(self.claims) >= MAX_NAMES:
            return False  # a flood of made-up names must not grow the table
        self.claims[claim.name] = claim
        return True

    def claim(self, name: str, owner: bytes) -> NameClaim:
        held = self.claims.get(name)
        clock = next_counter(held.clock) if held is not None else 1
        claim = NameClaim(name=name, owner=owner, clock=clock, tombstone=False)
        self.claims[name] = claim
        return claim

    def tombstone_owner(self, owner: bytes) -> list[NameClaim]:
        """Tombstone every live name ``owner`` holds; returns the tombstones."""
        out = []
        for name, held in list(self.claims.items()):
            if held.owner == owner and not held.tombstone:
                tomb = NameClaim(name=name, owner=owner, clock=next_counter(held.clock), tombstone=True)
                self.claims[name] = tomb
                out.append(tomb)
        return out

    def owner(self, name: str) -> bytes | None:
        held = self.claims.get(name)
        if held is None or held.tombstone:
            return None
        return held.owner
