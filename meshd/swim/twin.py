"""Another live process under our own node id: a twin.

A node id is a key pair (``--key-file``).  Two processes that hold the same key
(a key file copied to a second host, or a process left running where the node
was started again) each take the other's Alive for their last process's and
refute it.  The two incarnations then climb without end, every member sees
the node restart back and forth, and requests through it fail.

A process that has exited stops answering: one refutation past its last word
ends it, however often gossip brings that word back.  A live twin answers: its
incarnation comes back past the one we refuted it with.  ``TWIN_ANSWERS`` such
answers make a twin.

The process started first keeps the id (``Meta.started``, then the smaller
epoch): it is the one the mesh knew, serving.  Both processes see the same two
records, so exactly one of them stops.  It stops refuting at once (the driver
then exits with an error that names the other's address); it never leaves,
since a leave under our id would take the keeper out with it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Answers past our refutation before another process counts as a live twin: gossip can
# bring back a process's older words out of order once, not three times.
TWIN_ANSWERS = 3

# Other processes tracked at once (the newest kept): a restart leaves one behind, a twin is one more.
MAX_TRACKED = 4


@dataclass(slots=True)
class Twin:
    """Another process that signed an Alive under our node id."""

    epoch: int
    addr: str
    started: int  # its Meta.started: seconds since the epoch, 0 when not said
    said: int  # the incarnation we refuted its last word with
    first_seen: float
    last_seen: float
    answers: int = 0  # its words past our refutation

    @property
    def live(self) -> bool:
        return self.answers >= TWIN_ANSWERS

    def to_json(self, now: float) -> dict:
        return {"epoch": self.epoch, "addr": self.addr, "started": self.started,
                "answers": self.answers, "seen_s_ago": round(now - self.last_seen, 1)}


class Twins:
    """The other processes that spoke as us, and whether one of them is alive."""

    def __init__(self, epoch: int, started: int) -> None:
        self.epoch = epoch
        self.started = started
        self.known: dict[int, Twin] = {}
        self.yielded: Twin | None = None  # the twin we gave the id to

    def heard(self, epoch: int, addr: str, started: int, incarnation: int, said: int,
              now: float) -> Twin | None:
        """Process ``epoch`` signed an Alive of ours at ``incarnation`` and we refuted it with
        ``said``; returns its record the one time this makes it a live twin."""
        t = self.known.pop(epoch, None)  # re-inserted: the dict keeps the newest last
        if t is None:
            t = Twin(epoch, addr, started, said, now, now)
            if len(self.known) >= MAX_TRACKED:
                del self.known[next(iter(self.known))]
        elif incarnation > t.said:
            t.answers += 1
        t.addr, t.said, t.last_seen = addr, said, now
        self.known[epoch] = t
        return t if t.answers == TWIN_ANSWERS else None

    def keeps_id(self, twin: Twin) -> bool:
        """Whether this process keeps the node id against ``twin``: the earlier start does."""
        return (self.started, self.epoch) < (twin.started, twin.epoch)

    def latest_live(self) -> Twin | None:
        """The live twin heard from last, if any."""
        live = [t for t in self.known.values() if t.live]
        return max(live, key=lambda t: t.last_seen) if live else None
