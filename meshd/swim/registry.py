"""The name registry (``pp-entry``, ``pp-stage-K``, ...): entries keyed by (name, owner).

Each owner keeps its own clock for its own claims, and only a newer entry
from the same owner replaces one.  A tombstone is per owner: every member
writes it when that owner leaves or is declared dead, and it never hides
another owner's claim.  A name resolves to its live set, the live owners of
its non-tombstoned entries (the caller says which owners are live); more
than one means replicas.  An owner that finds a tombstone in its own name
while it lives claims again past it, as SWIM's refutation does.

Entries travel signed by their owner (see facts.py); the caller passes the
signing function for its own.  A tombstone written because an owner was
declared dead is ours, unsigned and never passed on: if the owner refutes,
its claims come back (``revive_owner``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..wire import MAX_PUSHPULL_NAMES, NameClaim, next_counter

# Entries we hold at most: as many as one push-pull can carry.
MAX_NAMES = MAX_PUSHPULL_NAMES

Key = tuple[str, bytes]
Sign = Callable[[NameClaim], NameClaim]


def _unsigned(claim: NameClaim) -> NameClaim:
    return claim


class Registry:
    def __init__(self, clock: int = 0) -> None:
        self._by_name: dict[str, dict[bytes, NameClaim]] = {}
        self._count = 0
        # Owners' claims hidden by a tombstone we wrote when we declared the owner dead.
        self._buried: dict[Key, NameClaim] = {}
        # The highest clock we used for a claim of our own; a restart continues from it
        # (the node persists it beside its key file) so a new claim beats the old entries.
        self.own_clock = clock

    def merge(self, claim: NameClaim) -> bool:
        """Take ``claim`` if it is newer than our entry for its key; True if it changed anything."""
        held = self.get(claim.name, claim.owner)
        if held is not None and not claim.beats(held):
            return False
        if held is None and self._count >= MAX_NAMES and not self._evict():
            return False  # a flood of made-up names must not grow the table
        self._buried.pop(claim.key, None)
        self._put(claim)
        return True

    def get(self, name: str, owner: bytes) -> NameClaim | None:
        entries = self._by_name.get(name)
        return entries.get(owner) if entries is not None else None

    @property
    def claims(self) -> list[NameClaim]:
        """Every entry, tombstones included (what push-pull carries)."""
        return [c for entries in self._by_name.values() for c in entries.values()]

    def _put(self, claim: NameClaim) -> None:
        entries = self._by_name.setdefault(claim.name, {})
        if claim.owner not in entries:
            self._count += 1
        entries[claim.owner] = claim

    def claim(self, name: str, owner: bytes, sign: Sign = _unsigned) -> NameClaim:
        """Our claim on ``name``, past any entry in our name (a tombstone of a past process)."""
        held = self.get(name, owner)
        self.own_clock = next_counter(max(self.own_clock, held.clock if held is not None else 0))
        claim = sign(NameClaim(name=name, owner=owner, clock=self.own_clock, tombstone=False))
        self._buried.pop(claim.key, None)
        self._put(claim)
        return claim

    def tombstone_owner(self, owner: bytes, sign: Sign | None = None) -> list[NameClaim]:
        """Tombstone every live entry of ``owner``; returns the tombstones.

        ``sign`` given: the owner's own withdrawal, signed.  None: the owner was declared
        dead; the tombstones are ours, and ``revive_owner`` undoes them."""
        out = []
        for name in list(self._by_name):
            out.extend(self.tombstone_owner_name(owner, name, sign))
        return out

    def tombstone_owner_name(self, owner: bytes, name: str, sign: Sign | None = None) -> list[NameClaim]:
        """Tombstone ``owner``'s entry for ``name`` if it is live; returns the tombstone, if any."""
        held = self.get(name, owner)
        if held is None or held.tombstone:
            return []
        tomb = NameClaim(name=name, owner=owner, clock=next_counter(held.clock), tombstone=True)
        if sign is None:
            self._buried[held.key] = held
        else:
            tomb = sign(tomb)
        self._put(tomb)
        return [tomb]

    def revive_owner(self, owner: bytes) -> list[NameClaim]:
        """An owner we declared dead refuted: its claims our tombstones hid hold again."""
        out = []
        for key, claim in list(self._buried.items()):
            if key[1] == owner:
                del self._buried[key]
                held = self.get(*key)
                if held is not None and held.tombstone and not held.sig:
                    self._put(claim)
                    out.append(claim)
        return out

    def owners(self, name: str) -> list[bytes]:
        """Every owner with a live (non-tombstoned) entry for ``name``, alive or not."""
        return [owner for owner, c in self._by_name.get(name, {}).items() if not c.tombstone]

    def entries(self, name: str) -> list[NameClaim]:
        return list(self._by_name.get(name, {}).values())

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def _evict(self) -> bool:
        """Make room by dropping one tombstone: it hides nothing another owner claims."""
        for name, entries in self._by_name.items():
            for owner, held in entries.items():
                if held.tombstone:
                    del entries[owner]
                    self._buried.pop((name, owner), None)
                    if not entries:
                        del self._by_name[name]
                    self._count -= 1
                    return True
        return False
