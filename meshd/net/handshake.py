"""The data stream's handshake: each end proves its node id and says its process epoch.

The accepting end sends a nonce and its epoch (StreamChallenge); the dialler
signs that nonce with its node key, with its own epoch, and sends a nonce of
its own (StreamProof); the accepting end signs that back, with its epoch.
Every later frame on the stream must come from the proven id, so nobody who
can reach the port can speak for a member, and a dial that reaches someone
else fails.  The epoch is random per process: a known node id with a new one
is a restarted peer, and every session with it starts again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from ..identity import prefix, verify
from ..wire import STREAM_NONCE_BYTES, Message, Packet, StreamChallenge, StreamProof
from .framing import FramingError, frame, read_packet


class HandshakeError(Exception):
    """A stream's handshake did not prove the other end's node id."""


# How a stream's handshake can fail, at either end.
HANDSHAKE_FAILURES = (HandshakeError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError)


@dataclass(frozen=True)
class LocalEnd:
    """Who we are on a stream: our node id, our process epoch, and how we sign."""

    node_id: bytes
    epoch: int
    sign: Callable[[bytes], bytes]


@dataclass(frozen=True)
class Proven:
    """The other end of a stream, as its handshake proved it."""

    node_id: bytes
    epoch: int


def proof_data(nonce: bytes, verifier: bytes, prover: bytes, epoch: int) -> bytes:
    """What a stream's end signs: the other end's nonce, both ids in their roles, its own epoch."""
    return b"meshd data stream v2\0" + nonce + verifier + prover + epoch.to_bytes(8, "big")


_M = TypeVar("_M", bound=Message)


def _only(packet: Packet, kind: type[_M]) -> _M:
    msg = packet.messages[0] if len(packet.messages) == 1 else None
    if not isinstance(msg, kind):
        raise HandshakeError(f"expected {kind.__name__} from {prefix(packet.sender)}")
    return msg


async def _read(stream: trio.SocketStream, buf: bytearray) -> Packet:
    try:
        return await read_packet(stream, buf)
    except FramingError as exc:
        raise HandshakeError(str(exc)) from exc


async def accept(
    stream: trio.SocketStream, buf: bytearray, me: LocalEnd, blocked: Callable[[bytes], bool]
) -> Proven:
    """Challenge the dialler, check its proof, prove ourselves; returns who it proved to be.

    ``blocked(node)`` refuses a proven dialler, as a packet filter on that link would have.
    """
    nonce = os.urandom(STREAM_NONCE_BYTES)
    await stream.send_all(frame(Packet(me.node_id, (StreamChallenge(nonce, me.epoch),))))
    packet = await _read(stream, buf)
    proof = _only(packet, StreamProof)
    if not verify(packet.sender, proof.signature, proof_data(nonce, me.node_id, packet.sender, proof.epoch)):
        raise HandshakeError(f"{prefix(packet.sender)}'s signature does not verify")
    if blocked(packet.sender):
        raise HandshakeError("a fault blocks this link")
    signature = me.sign(proof_data(proof.nonce, packet.sender, me.node_id, me.epoch))
    await stream.send_all(frame(Packet(me.node_id, (StreamProof(nonce, signature, me.epoch),))))
    return Proven(packet.sender, proof.epoch)


async def dial(stream: trio.SocketStream, buf: bytearray, node: bytes, me: LocalEnd) -> Proven:
    """Answer the challenge of ``node``, which we dialled, and check that it is that node."""
    packet = await _read(stream, buf)
    challenge = _only(packet, StreamChallenge)
    if packet.sender != node:
        raise HandshakeError(f"the address answers as {prefix(packet.sender)}, not {prefix(node)}")
    nonce = os.urandom(STREAM_NONCE_BYTES)
    signature = me.sign(proof_data(challenge.nonce, node, me.node_id, me.epoch))
    await stream.send_all(frame(Packet(me.node_id, (StreamProof(nonce, signature, me.epoch),))))
    packet = await _read(stream, buf)
    proof = _only(packet, StreamProof)
    signed = proof_data(nonce, me.node_id, node, proof.epoch)
    if packet.sender != node or not verify(node, proof.signature, signed):
        raise HandshakeError(f"{prefix(node)}'s signature does not verify")
    if proof.epoch != challenge.epoch:
        raise HandshakeError(f"{prefix(node)}'s challenge and proof name different epochs")
    return Proven(node, proof.epoch)
