"""Bounded tables keyed by peer, where strangers make room before members.

A node keeps per-peer state learned from the network (a process's epoch, the keys
shared with it, a session's reassembly), each table bounded.  Anyone holding the mesh
key can handshake under as many fresh node ids as it likes; if the oldest entry made
room, such a flood would push out the members' entries, and with them the state their
traffic needs (a session's next message id, the key its chunks open with).  So the
oldest entry of a node that is not a live member goes first, and a member's only when
the table holds nothing else.  ``keep_newest`` bounds the plainer sets of keys a node
remembers (who was logged once, which requests ended), newest kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")


def victim(table: OrderedDict[K, V], member: Callable[[K], bool]) -> K:
    """The key of ``table`` (oldest first, not empty) to make room with: the oldest that is
    not a ``member``'s, or the oldest of all when every key is."""
    return next((key for key in table if not member(key)), next(iter(table)))


def evict_one(table: OrderedDict[K, V], member: Callable[[K], bool]) -> K:
    """Remove and return ``victim(table, member)``."""
    key = victim(table, member)
    del table[key]
    return key


def keep_newest(recent: dict[Any, None], key: Hashable, most: int) -> None:
    """Add ``key`` to ``recent``, a set in insertion order, keeping its newest ``most``."""
    recent[key] = None
    while len(recent) > most:
        recent.pop(next(iter(recent)))
