"""The piggyback queue: facts to gossip, fewest-transmitted first.

Like memberlist's TransmitLimitedQueue: a newer fact about a node (or a name)
replaces the older one still queued, and each fact is dropped after
``retransmit_limit`` transmissions.  One difference: facts about the owner
itself (its refutations, its own Alive, its leave) go before everything else.
Only the member can refute a suspicion of itself, and with dissemination riding
mostly on probe traffic a refutation must not wait behind relayed news (a new
member's queue holds the whole membership it just learned by push-pull).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

from ..wire import Message, encoded_size


@dataclass(slots=True)
class _Item:
    rank: int  # 0 for facts about the queue's owner (and urgent ones), 1 for the rest, 2 for background
    transmits: int
    neg_order: int  # newer first among equals
    key: object = field(compare=False)
    msg: Message = field(compare=False)
    size: int = field(compare=False)


# Sort by (rank, transmits, neg_order) as C tuples: a dataclass __lt__ is slow in this hot loop.
_priority = attrgetter("rank", "transmits", "neg_order")


class BroadcastQueue:
    def __init__(self, own: object = None) -> None:
        self._own = own
        self._items: dict[object, _Item] = {}
        self._order = 0

    def __len__(self) -> int:
        return len(self._items)

    def queue(self, key: object, msg: Message, urgent: bool = False, background: bool = False) -> None:
        """Queue ``msg``; it replaces any queued fact with the same key.

        ``urgent`` facts (and facts about the owner) go before the rest;
        ``background`` facts after it.  Path summaries are background: every
        node republishes its own whenever its paths change, each new version
        is fresh again, and they must not keep membership facts and name
        claims (which stages resolve each other by) waiting."""
        self._order += 1
        rank = 0 if urgent or key == self._own else 2 if background else 1
        self._items[key] = _Item(rank, 0, -self._order, key, msg, encoded_size(msg))

    def fewest_transmits(self) -> int | None:
        """How often the least-sent queued fact has gone out; None when empty."""
        if not self._items:
            return None
        return min(item.transmits for item in self._items.values())

    def take(self, budget: int, limit: int) -> list[Message]:
        """Messages that fit in ``budget`` bytes, fewest-transmitted first."""
        if not self._items or budget <= 0:
            return []
        out = []
        for item in sorted(self._items.values(), key=_priority):
            if item.size > budget:
                continue
            budget -= item.size
            out.append(item.msg)
            item.transmits += 1
            if item.transmits >= limit:
                del self._items[item.key]
            if budget < 16:
                break
        return out

    def drop(self, key: object) -> None:
        self._items.pop(key, None)
