"""Exactly-once, in-order delivery of chunked data messages, sans-IO.

Chunks of one message may arrive over different paths (a direct stream that
broke halfway, then the relay), twice, or out of order.  Each sender numbers
its messages 1, 2, 3, ...; the receiver keeps, per sender, the next id it
will deliver, the messages it is still assembling, and the complete ones that
wait for an earlier id.  A message is acknowledged as soon as it is whole, and
again whenever a copy of it arrives later, so the sender can stop resending.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..wire import MAX_DATA_MESSAGE_BYTES, DataChunk


class ChunkError(ValueError):
    """A chunk that contradicts what we already hold for its message."""


@dataclass
class _Assembly:
    total: int
    buf: bytearray
    have: int = 0
    offsets: set[int] = field(default_factory=set)


@dataclass
class _FromSender:
    next_id: int = 1
    assembling: dict[int, _Assembly] = field(default_factory=dict)
    complete: dict[int, bytes] = field(default_factory=dict)


# How far ahead of the next deliverable id a sender may run before we refuse.
MAX_AHEAD = 4096


class Reassembler:
    def __init__(self) -> None:
        self._senders: dict[tuple[bytes, int], _FromSender] = {}
        self.duplicates = 0

    def accept(self, sender: bytes, chunk: DataChunk) -> tuple[bool, list[bytes]]:
        """Take one chunk; returns (acknowledge it?, messages now deliverable in order)."""
        # Keyed by the sender's session too: a restarted peer numbers from 1 again.
        state = self._senders.setdefault((sender, chunk.session), _FromSender())
        msg_id = chunk.msg_id
        if msg_id < state.next_id or msg_id in state.complete:
            self.duplicates += 1
            return True, []  # already whole: ack again, deliver nothing
        if msg_id >= state.next_id + MAX_AHEAD:
            raise ChunkError(f"message {msg_id} is too far ahead of {state.next_id}")
        if chunk.total > MAX_DATA_MESSAGE_BYTES:
            raise ChunkError(f"message {msg_id} claims {chunk.total} bytes")
        end = chunk.offset + len(chunk.chunk)
        if end > chunk.total:
            raise ChunkError(f"chunk at {chunk.offset} runs past the end of message {msg_id}")
        asm = state.assembling.get(msg_id)
        if asm is None:
            asm = state.assembling[msg_id] = _Assembly(chunk.total, bytearray(chunk.total))
        elif asm.total != chunk.total:
            raise ChunkError(f"message {msg_id} changed its size from {asm.total} to {chunk.total}")
        if chunk.offset not in asm.offsets:
            # Every sender cuts a message at the same offsets, whatever the path.
            asm.offsets.add(chunk.offset)
            asm.buf[chunk.offset:end] = chunk.chunk
            asm.have += len(chunk.chunk)
        else:
            self.duplicates += 1
        if asm.have < asm.total:
            return False, []
        del state.assembling[msg_id]
        state.complete[msg_id] = bytes(asm.buf)
        ready = []
        while state.next_id in state.complete:
            ready.append(state.complete.pop(state.next_id))
            state.next_id += 1
        return True, ready
