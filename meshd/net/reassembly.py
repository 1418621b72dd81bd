"""Exactly-once, in-order delivery of chunked data messages, sans-IO.

Chunks of one message may arrive over different paths (a direct stream that
broke halfway, then the relay), twice, or out of order.  Streams and the relay
cut a message at the same offsets; datagrams through a punched NAT cut it
finer.  A sender always resends a whole message over one path, so a piece that
overlaps what we hold at other offsets starts the message's assembly afresh
with that path's pieces (what the old path left is dropped).  Each sender numbers
its messages 1, 2, 3, ...; the receiver keeps, per sender, the next id it
will deliver, the messages it is still assembling, and the complete ones that
wait for an earlier id.  A message is acknowledged as soon as it is whole, and
again whenever a copy of it arrives later, so the sender can stop resending.

What a peer makes us hold is bounded, whatever it sends: the first chunk of a
message claims the message's declared size (plus a fixed overhead) from the
peer's budget and from the budget of all peers, and is refused when either
would run over; the claim is given back when the message is delivered.
Nothing is allocated ahead of the bytes that arrive.  A peer has a few
sessions at most (a new one replaces its least recently used), the channel
holds a bounded number in all, and a session that holds data but makes no
progress for ``idle_expiry`` seconds is dropped with everything it holds.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ..bounded import victim
from ..wire import MAX_DATA_MESSAGE_BYTES, DataChunk


class ChunkError(ValueError):
    """A chunk that contradicts what we already hold for its message, or would run over a budget."""


@dataclass
class _Assembly:
    total: int
    claim: int
    pieces: dict[int, bytes] = field(default_factory=dict)  # offset -> chunk
    offsets: list[int] = field(default_factory=list)  # the pieces' offsets, sorted
    have: int = 0

    def overlaps(self, offset: int, size: int) -> bool:
        """A piece at ``offset`` (not one we hold) would overlap a piece we hold."""
        i = bisect.bisect_left(self.offsets, offset)
        if i > 0:
            before = self.offsets[i - 1]
            if before + len(self.pieces[before]) > offset:
                return True
        return i < len(self.offsets) and self.offsets[i] < offset + size

    def add(self, offset: int, piece: bytes) -> None:
        bisect.insort(self.offsets, offset)
        self.pieces[offset] = piece
        self.have += len(piece)

    def clear(self) -> None:
        self.pieces.clear()
        self.offsets.clear()
        self.have = 0


@dataclass
class _FromSender:
    active_at: float
    next_id: int = 1
    assembling: dict[int, _Assembly] = field(default_factory=dict)
    complete: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # id -> (message, claim)
    claimed: int = 0


# How far ahead of the next deliverable id a sender may run before we refuse.
MAX_AHEAD = 4096
# Charged per message on top of its size: the bookkeeping of a message costs memory
# even when it declares no bytes, so a flood of tiny messages runs out of budget too.
MESSAGE_OVERHEAD = 64 * 1024
# Room for two of the largest messages from one peer at once, and for four in all.
PEER_BUDGET = 2 * (MAX_DATA_MESSAGE_BYTES + MESSAGE_OVERHEAD)
TOTAL_BUDGET = 4 * (MAX_DATA_MESSAGE_BYTES + MESSAGE_OVERHEAD)
MAX_SESSIONS_PER_PEER = 4
MAX_SESSIONS = 4096
IDLE_EXPIRY_S = 60.0
# Chunks per message at most: a sender cuts at 63 KiB, so this leaves room for
# any honest cut while a made-up one cannot split a message into millions of entries.
MIN_PIECE_BYTES = 1024


def _max_pieces(total: int) -> int:
    return total // MIN_PIECE_BYTES + 16


class Reassembler:
    def __init__(
        self,
        peer_budget: int = PEER_BUDGET,
        total_budget: int = TOTAL_BUDGET,
        idle_expiry: float = IDLE_EXPIRY_S,
        max_sessions: int = MAX_SESSIONS,
        member: Callable[[bytes], bool] | None = None,
    ) -> None:
        """``member``: whether a sender is a live member, whose sessions go last when the
        sessions are at ``max_sessions`` (``bounded.victim``)."""
        self.member = member or (lambda sender: True)
        self.peer_budget = peer_budget
        self.total_budget = total_budget
        self.idle_expiry = idle_expiry
        self.max_sessions = max_sessions
        # Least recently active first.
        self._senders: OrderedDict[tuple[bytes, int], _FromSender] = OrderedDict()
        self._sessions: dict[bytes, OrderedDict[int, None]] = {}  # per sender, least recently active first
        self._claimed: dict[bytes, int] = {}  # per peer, over all its sessions
        self.claimed_total = 0
        self.duplicates = 0
        self.expired = 0
        self.recut = 0  # assemblies started afresh: a resend over a path that cuts differently

    def held(self, sender: bytes) -> int:
        """Bytes claimed by ``sender``'s unfinished and undelivered messages."""
        return self._claimed.get(sender, 0)

    def accept(self, sender: bytes, chunk: DataChunk, now: float = 0.0,
               data: bytes | None = None) -> tuple[bool, list[bytes]]:
        """Take one chunk, whose bytes are ``data`` (its opened plaintext) or else
        ``chunk.chunk``; returns (acknowledge it?, messages now deliverable in order).

        Raises ChunkError for a chunk that contradicts its message or would run
        over a budget; nothing of it is kept.
        """
        piece = chunk.chunk if data is None else data
        state = self._session(sender, chunk.session, now)
        msg_id, total = chunk.msg_id, chunk.total
        if msg_id < state.next_id or msg_id in state.complete:
            self.duplicates += 1
            return True, []  # already whole: ack again, deliver nothing
        if msg_id >= state.next_id + MAX_AHEAD:
            raise ChunkError(f"message {msg_id} is too far ahead of {state.next_id}")
        if total > MAX_DATA_MESSAGE_BYTES:
            raise ChunkError(f"message {msg_id} claims {total} bytes")
        end = chunk.offset + len(piece)
        if end > total:
            raise ChunkError(f"chunk at {chunk.offset} runs past the end of message {msg_id}")
        if (end == total and chunk.offset == 0 and msg_id == state.next_id and msg_id not in state.assembling
                and self._over_budget(sender, total) is None):
            # The next message, whole in one chunk (every activation of a pipeline): it is
            # delivered at once, so nothing is held for it and no claim is needed.
            state.next_id += 1
            return True, [piece, *self._in_order(sender, state)]
        asm = state.assembling.get(msg_id)
        if asm is None:
            asm = state.assembling[msg_id] = self._claim(sender, state, msg_id, total)
        elif asm.total != total:
            raise ChunkError(f"message {msg_id} changed its size from {asm.total} to {total}")
        if chunk.offset in asm.pieces and len(asm.pieces[chunk.offset]) == len(piece):
            self.duplicates += 1  # the same cut, again
        else:
            if chunk.offset in asm.pieces or asm.overlaps(chunk.offset, len(piece)):
                asm.clear()  # the whole message again, cut for another path: its pieces only
                self.recut += 1
            if len(asm.pieces) >= _max_pieces(asm.total):
                self._drop(sender, state, msg_id)
                raise ChunkError(f"message {msg_id} comes in more pieces than {asm.total} bytes need")
            asm.add(chunk.offset, piece)
        if asm.have < asm.total:
            return False, []
        del state.assembling[msg_id]
        whole = _joined(asm)
        if whole is None:
            self._release(sender, state, asm.claim)
            raise ChunkError(f"message {msg_id}'s chunks overlap or leave a gap")
        state.complete[msg_id] = (whole, asm.claim)
        return True, self._in_order(sender, state)

    def _in_order(self, sender: bytes, state: _FromSender) -> list[bytes]:
        """Take the complete messages that are next in order, giving back their claims."""
        ready = []
        while state.next_id in state.complete:
            data, claim = state.complete.pop(state.next_id)
            self._release(sender, state, claim)
            ready.append(data)
            state.next_id += 1
        return ready

    def expire(self, now: float) -> int:
        """Drop sessions that hold data and made no progress for ``idle_expiry``; returns how many."""
        horizon = now - self.idle_expiry
        stale = [key for key, state in self._senders.items()
                 if state.active_at < horizon and (state.assembling or state.complete)]
        for key in stale:
            self._forget_session(key)
        self.expired += len(stale)
        return len(stale)

    def drop_unfinished(self, sender: bytes) -> None:
        """``sender`` runs another process: drop the messages of its sessions still in pieces.

        None of those was acknowledged, so a process that is alive sends it again.  Each
        session's count and the messages acknowledged stay: the process behind a session may
        never have gone (the epoch also flips back and forth while two processes share a
        key, swim/twin.py), and a session forgotten under a live sender would hold its next
        message, acknowledged, for the ids it already delivered.  A dead process's sessions
        hold no more than its acknowledged messages until they expire or are evicted.
        """
        for key, state in self._senders.items():
            if key[0] == sender:
                for msg_id in list(state.assembling):
                    self._drop(sender, state, msg_id)

    # ------------------------------------------------------------- budgets

    def _session(self, sender: bytes, session: int, now: float) -> _FromSender:
        key = (sender, session)
        state = self._senders.get(key)
        if state is not None:
            state.active_at = now
            self._senders.move_to_end(key)
            self._sessions[sender].move_to_end(session)
            return state
        # Keyed by the sender's session too: a restarted peer numbers from 1 again.
        mine = self._sessions.setdefault(sender, OrderedDict())
        if len(mine) >= MAX_SESSIONS_PER_PEER:
            self._forget_session((sender, next(iter(mine))))  # its least recently used
        if len(self._senders) >= self.max_sessions:
            # A stranger's before a member's: forgetting a live session loses its next id, and
            # its next message would wait, acknowledged, for ids it already delivered.
            self._forget_session(victim(self._senders, lambda k: self.member(k[0])))
        state = self._senders[key] = _FromSender(active_at=now)
        self._sessions.setdefault(sender, mine)[session] = None  # ``mine`` if a forget dropped it
        return state

    def _over_budget(self, sender: bytes, total: int) -> str | None:
        """Which budget claiming a message of ``total`` bytes from ``sender`` would run over
        (as the end of a sentence), or None when it stays within both."""
        claim = total + MESSAGE_OVERHEAD
        if self._claimed.get(sender, 0) + claim > self.peer_budget:
            return f"this peer's unfinished messages hold more than {self.peer_budget} bytes"
        if self.claimed_total + claim > self.total_budget:
            return f"all peers' unfinished messages hold more than {self.total_budget} bytes"
        return None

    def _claim(self, sender: bytes, state: _FromSender, msg_id: int, total: int) -> _Assembly:
        over = self._over_budget(sender, total)
        if over is not None:
            raise ChunkError(f"message {msg_id} ({total} bytes) would make {over}")
        claim = total + MESSAGE_OVERHEAD
        self._claimed[sender] = self._claimed.get(sender, 0) + claim
        self.claimed_total += claim
        state.claimed += claim
        return _Assembly(total, claim)

    def _release(self, sender: bytes, state: _FromSender, claim: int) -> None:
        state.claimed -= claim
        self.claimed_total -= claim
        left = self._claimed.get(sender, 0) - claim
        if left > 0:
            self._claimed[sender] = left
        else:
            self._claimed.pop(sender, None)

    def _drop(self, sender: bytes, state: _FromSender, msg_id: int) -> None:
        asm = state.assembling.pop(msg_id)
        self._release(sender, state, asm.claim)

    def _forget_session(self, key: tuple[bytes, int]) -> None:
        state = self._senders.pop(key)
        mine = self._sessions[key[0]]
        del mine[key[1]]
        if not mine:
            del self._sessions[key[0]]
        if state.claimed:
            self._release(key[0], state, state.claimed)


def _joined(asm: _Assembly) -> bytes | None:
    """The message's bytes in order, or None when its pieces do not tile it exactly."""
    parts, at = [], 0
    for offset in sorted(asm.pieces):
        if offset != at:
            return None
        piece = asm.pieces[offset]
        parts.append(piece)
        at += len(piece)
    return b"".join(parts) if at == asm.total else None
