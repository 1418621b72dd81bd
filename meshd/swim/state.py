"""What the core knows about one member, and what it hands back to its driver."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..identity import prefix
from ..wire import STATE_ALIVE, STATE_DEAD, STATE_LEFT, STATE_SUSPECT, Meta, Packet


class State(enum.IntEnum):
    ALIVE = STATE_ALIVE
    SUSPECT = STATE_SUSPECT
    DEAD = STATE_DEAD
    LEFT = STATE_LEFT

    @property
    def live(self) -> bool:
        return self in (State.ALIVE, State.SUSPECT)


@dataclass(slots=True)
class Member:
    id: bytes
    addr: str
    meta: Meta
    incarnation: int
    state: State
    state_change: float
    last_seen: float | None = None  # any packet from it
    rtt: float | None = None  # last direct probe round trip
    relay_rtt: float | None = None  # last relayed probe round trip, from the relayed ping's own send
    # Its own signature: over its Alive (incarnation, addr, meta) while it lives, over its
    # leave once it left; push-pull passes it on, so its word reaches others as its own.
    proof: bytes = b""

    @property
    def prefix(self) -> str:
        return prefix(self.id)

    @property
    def name(self) -> str:
        return self.meta.name


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A packet for the driver to send: to ``addr``, which is ``node`` if known."""

    addr: str
    node: bytes | None
    packet: Packet
    reliable: bool = False  # push-pull: a stream would suit it better than a datagram
    via: str | None = None  # "direct" or "relay" forces that path; None lets the path table choose


class EventKind(enum.Enum):
    JOIN = "join"
    UPDATE = "update"
    SUSPECT = "suspect"
    ALIVE = "alive"  # a suspicion was cleared
    DEAD = "dead"
    LEFT = "left"
    NAME = "name"  # the registry changed
    RESTART = "restart"  # a member's new process (a new epoch): detail {"epoch"}
    PATH = "path"  # a probe told us which path reaches a member: detail {"direct", "rtt"}; direct is
    # True (it answered directly), False (only over the relay) or None (only others vouched for it)
    KEYRING = "keyring"  # a member changed the mesh keyring: detail {"change": KeyringChange}
    PUNCHED = "punched"  # a punch through a member's NAT was answered: detail {"addr", "seen"}
    TWIN = "twin"  # another live process signs as us (see twin.py): detail {"twin", "keep"}
    MISSED = "missed"  # a probe's direct ping went unanswered again, the path unchanged (PATH said it)


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    node: bytes | None
    at: float
    detail: dict = field(default_factory=dict)

    @property
    def membership(self) -> bool:
        return self.kind not in (EventKind.NAME, EventKind.PATH, EventKind.PUNCHED, EventKind.TWIN,
                                 EventKind.MISSED)
