"""The data stream's handshake: each end proves its node id, says its process epoch and its
X25519 public key, and, in a mesh with a key, proves it holds that key.

The accepting end sends a nonce, its epoch and its public key (StreamChallenge);
the dialler signs that nonce with its node key, with its own epoch and public
key, and sends a nonce of its own (StreamProof); the accepting end signs that
back, with its epoch and public key.  Every later frame on the stream must
come from the proven id, so nobody who can reach the port can speak for a
member, and a dial that reaches someone else fails.  The epoch is random per
process: a known node id with a new one is a restarted peer, and every
session with it starts again.  The public keys, each covered by its owner's
signature, are what the two processes' data keys derive from (see
:mod:`.data_keys`).

With a mesh keyring, each end's StreamProof also carries a MAC under the mesh
key over the whole exchange (both nonces, ids, epochs and public keys, and
which end made it), and a stream whose other end cannot show one is refused:
a node key alone admits nobody to such a mesh.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import trio

from ..identity import prefix, verify
from ..keyring import Keyring
from ..wire import DH_KEY_BYTES, STREAM_NONCE_BYTES, Message, Packet, StreamChallenge, StreamProof
from .data_keys import BadPeerKey, ProcessKeys
from .framing import FramingError, frame, read_packet

# A handshake frame holds one StreamChallenge or StreamProof: under 400 bytes encoded.  A larger
# length is refused from the frame's header, so a stranger who has proved nothing yet cannot make
# us buffer a data frame's megabyte on each of its connections.
MAX_HANDSHAKE_FRAME_BYTES = 1024


class HandshakeError(Exception):
    """A stream's handshake did not prove the other end's node id, process key or mesh key."""


# How a stream's handshake can fail, at either end.
HANDSHAKE_FAILURES = (HandshakeError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError)


@dataclass(frozen=True)
class LocalEnd:
    """Who we are on a stream: our node id, our process epoch, how we sign, our process's
    X25519 keys, and the mesh keyring (None: a mesh without a key)."""

    node_id: bytes
    epoch: int
    sign: Callable[[bytes], bytes]
    keys: ProcessKeys
    keyring: Keyring | None = None


@dataclass(frozen=True)
class Proven:
    """The other end of a stream, as its handshake proved it: its node id, its process epoch and
    its process's X25519 public key."""

    node_id: bytes
    epoch: int
    dh: bytes


def proof_data(nonce: bytes, verifier: bytes, prover: bytes, epoch: int, dh: bytes) -> bytes:
    """What a stream's end signs: the other end's nonce, both ids in their roles, its own epoch
    and its own X25519 public key."""
    return b"meshd data stream v3\0" + nonce + verifier + prover + epoch.to_bytes(8, "big") + dh


@dataclass(frozen=True)
class Transcript:
    """Everything both ends said in a handshake, which each end's mesh-key proof covers."""

    acceptor: bytes
    acceptor_nonce: bytes
    acceptor_epoch: int
    acceptor_dh: bytes
    dialler: bytes
    dialler_nonce: bytes
    dialler_epoch: int
    dialler_dh: bytes

    def mesh_proof_data(self, by_dialler: bool) -> bytes:
        """What the dialler's (or the acceptor's) mesh-key proof is a MAC of: each end's proof
        names its role, so neither can hand the other's back."""
        return (b"meshd data stream mesh proof v1\0" + (b"dialler\0" if by_dialler else b"acceptor\0")
                + self.acceptor + self.acceptor_nonce + self.acceptor_epoch.to_bytes(8, "big")
                + self.acceptor_dh + self.dialler + self.dialler_nonce
                + self.dialler_epoch.to_bytes(8, "big") + self.dialler_dh)


_M = TypeVar("_M", bound=Message)


def _only(packet: Packet, kind: type[_M]) -> _M:
    msg = packet.messages[0] if len(packet.messages) == 1 else None
    if not isinstance(msg, kind):
        raise HandshakeError(f"expected {kind.__name__} from {prefix(packet.sender)}")
    return msg


async def _read(stream: trio.SocketStream, buf: bytearray) -> Packet:
    try:
        return await read_packet(stream, buf, MAX_HANDSHAKE_FRAME_BYTES)
    except FramingError as exc:
        raise HandshakeError(str(exc)) from exc


def _check_dh(node: bytes, dh: bytes) -> None:
    if len(dh) != DH_KEY_BYTES:
        raise HandshakeError(f"{prefix(node)} sent no X25519 key for its data keys")


def _check_mesh_proof(me: LocalEnd, node: bytes, transcript: Transcript, proof: bytes, by_dialler: bool
                      ) -> None:
    if me.keyring is not None and not me.keyring.check_mac(transcript.mesh_proof_data(by_dialler), proof):
        raise HandshakeError(f"no valid mesh-key proof from {prefix(node)}")


def _mesh_proof(me: LocalEnd, transcript: Transcript, by_dialler: bool) -> bytes:
    return b"" if me.keyring is None else me.keyring.mac(transcript.mesh_proof_data(by_dialler))


def _learn_keys(me: LocalEnd, node: bytes, epoch: int, dh: bytes) -> None:
    """Derive (and keep) the data keys with the proven process; a key that gives none fails."""
    try:
        me.keys.pair(node, epoch, dh)
    except BadPeerKey as exc:
        raise HandshakeError(f"{prefix(node)}'s X25519 key is unusable: {exc}") from None


async def accept(
    stream: trio.SocketStream, buf: bytearray, me: LocalEnd, blocked: Callable[[bytes], bool]
) -> Proven:
    """Challenge the dialler, check its proof, prove ourselves; returns who it proved to be.

    ``blocked(node)`` refuses a proven dialler, as a packet filter on that link would have.
    """
    nonce = os.urandom(STREAM_NONCE_BYTES)
    challenge = StreamChallenge(nonce, me.epoch, me.keys.public)
    await stream.send_all(frame(Packet(me.node_id, (challenge,))))
    packet = await _read(stream, buf)
    proof = _only(packet, StreamProof)
    dialler = packet.sender
    _check_dh(dialler, proof.dh)
    transcript = Transcript(me.node_id, nonce, me.epoch, me.keys.public,
                            dialler, proof.nonce, proof.epoch, proof.dh)
    _check_mesh_proof(me, dialler, transcript, proof.mesh_proof, by_dialler=True)  # before the costlier check
    if not verify(dialler, proof.signature, proof_data(nonce, me.node_id, dialler, proof.epoch, proof.dh)):
        raise HandshakeError(f"{prefix(dialler)}'s signature does not verify")
    if blocked(dialler):
        raise HandshakeError("a fault blocks this link")
    _learn_keys(me, dialler, proof.epoch, proof.dh)
    signature = me.sign(proof_data(proof.nonce, dialler, me.node_id, me.epoch, me.keys.public))
    answer = StreamProof(nonce, signature, me.epoch, me.keys.public, _mesh_proof(me, transcript, False))
    await stream.send_all(frame(Packet(me.node_id, (answer,))))
    return Proven(dialler, proof.epoch, proof.dh)


async def dial(stream: trio.SocketStream, buf: bytearray, node: bytes, me: LocalEnd) -> Proven:
    """Answer the challenge of ``node``, which we dialled, and check that it is that node."""
    packet = await _read(stream, buf)
    challenge = _only(packet, StreamChallenge)
    if packet.sender != node:
        raise HandshakeError(f"the address answers as {prefix(packet.sender)}, not {prefix(node)}")
    _check_dh(node, challenge.dh)
    nonce = os.urandom(STREAM_NONCE_BYTES)
    transcript = Transcript(node, challenge.nonce, challenge.epoch, challenge.dh,
                            me.node_id, nonce, me.epoch, me.keys.public)
    signature = me.sign(proof_data(challenge.nonce, node, me.node_id, me.epoch, me.keys.public))
    ours = StreamProof(nonce, signature, me.epoch, me.keys.public, _mesh_proof(me, transcript, True))
    await stream.send_all(frame(Packet(me.node_id, (ours,))))
    packet = await _read(stream, buf)
    proof = _only(packet, StreamProof)
    signed = proof_data(nonce, me.node_id, node, proof.epoch, proof.dh)
    if packet.sender != node or not verify(node, proof.signature, signed):
        raise HandshakeError(f"{prefix(node)}'s signature does not verify")
    if proof.epoch != challenge.epoch or proof.dh != challenge.dh:
        raise HandshakeError(f"{prefix(node)}'s challenge and proof name different processes")
    _check_mesh_proof(me, node, transcript, proof.mesh_proof, by_dialler=False)
    _learn_keys(me, node, proof.epoch, proof.dh)
    return Proven(node, proof.epoch, proof.dh)
