"""End-to-end keys for the data channel: each process's X25519 key pair, the keys it shares
with each peer process, and sealing chunks with them.

A process draws its key pair at start, as it draws its epoch, and says the
public half in its stream handshakes and its (signed) metadata.  For a peer
process (node id, epoch, public key) the X25519 shared secret goes through
HKDF-SHA256 once per direction, with an info naming the sender, the receiver,
both epochs and both public keys: the two directions never share a key, and a
restart of either end means new keys.  A chunk is sealed with AES-256-GCM
under a random 96-bit nonce, with its session, message id, message size and
offset as associated data, so a sealed chunk cannot stand in for another one;
neither the relay nor anyone on the path can read a chunk or make one up.

A sealed chunk is ``nonce (12) | ciphertext | tag (16)``.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..bounded import evict_one
from ..wire import DH_KEY_BYTES, DataChunk

NONCE_BYTES = 12
TAG_BYTES = 16
SEAL_OVERHEAD = NONCE_BYTES + TAG_BYTES
KEY_BYTES = 32  # AES-256
# Peer processes whose keys we keep (the latest per node id): as many as the channel keeps epochs.
MAX_PEERS = 4096

_INFO = b"meshd data v1\0"
_AAD = struct.Struct("!QQQQ")  # session, msg_id, total, offset


class BadPeerKey(ValueError):
    """A peer's X25519 public key that gives no shared secret: malformed, or a low-order point."""


def _aad(chunk: DataChunk) -> bytes:
    return _AAD.pack(chunk.session, chunk.msg_id, chunk.total, chunk.offset)


@dataclass(frozen=True, slots=True)
class PairKeys:
    """What this process shares with one peer process: a key that seals what we send it, and
    one that opens what it sends us.  ``None`` keys pass chunks in clear (benchmarks only)."""

    peer_epoch: int
    peer_dh: bytes
    send: AESGCM | None
    recv: AESGCM | None

    def seal(self, session: int, msg_id: int, total: int, offset: int, chunk: bytes | memoryview) -> bytes:
        """``chunk`` (the bytes of message ``msg_id`` at ``offset``) sealed for the peer."""
        if self.send is None:
            return bytes(chunk)
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self.send.encrypt(nonce, chunk, _AAD.pack(session, msg_id, total, offset))

    def open(self, chunk: DataChunk) -> bytes | None:
        """The plaintext of a chunk the peer sealed; None when it was not sealed by that peer's
        process for this place in its stream (made up, altered, moved, or another process's)."""
        if self.recv is None:
            return chunk.chunk
        sealed = memoryview(chunk.chunk)
        if len(sealed) < SEAL_OVERHEAD:
            return None
        try:
            return self.recv.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], _aad(chunk))
        except InvalidTag:
            return None


class ProcessKeys:
    """This process's X25519 key pair, and the keys it shares with the latest process of each peer.

    ``encrypt=False`` derives every key as usual but passes chunks in clear: it exists only so
    that ``bench/`` can measure what encryption costs; every channel that carries data encrypts.
    """

    def __init__(self, node_id: bytes, epoch: int, *, encrypt: bool = True,
                 member: Callable[[bytes], bool] | None = None) -> None:
        """``member``: whether a node id is a live member, whose keys go last when the table
        is at its bound (``bounded.evict_one``)."""
        self.node_id = node_id
        self._member = member or (lambda node: True)
        self.epoch = epoch
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw()
        self._encrypt = encrypt
        self._pairs: OrderedDict[bytes, PairKeys] = OrderedDict()  # least recently learned first

    def pair(self, peer: bytes, epoch: int, dh: bytes) -> PairKeys:
        """The keys shared with ``peer``'s process ``epoch``, whose public key is ``dh``.

        Derived once and kept, as ``peer``'s latest process (one X25519 exchange
        and two HKDFs: never per chunk).  Raises BadPeerKey for a key that gives
        no shared secret.
        """
        known = self._pairs.get(peer)
        if known is not None and known.peer_epoch == epoch and known.peer_dh == dh:
            self._pairs.move_to_end(peer)
            return known
        pair = self._derive(peer, epoch, dh)
        self._pairs.pop(peer, None)
        self._pairs[peer] = pair
        if len(self._pairs) > MAX_PEERS:
            evict_one(self._pairs, self._member)
        return pair

    def current(self, peer: bytes, epoch: int | None) -> PairKeys | None:
        """The keys for ``peer``'s process ``epoch``, if we have learned its public key."""
        known = self._pairs.get(peer)
        return known if known is not None and known.peer_epoch == epoch else None

    def _derive(self, peer: bytes, epoch: int, dh: bytes) -> PairKeys:
        if len(dh) != DH_KEY_BYTES:
            raise BadPeerKey(f"an X25519 public key is {DH_KEY_BYTES} bytes, not {len(dh)}")
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(dh))
        except ValueError as exc:  # a low-order point: the shared secret would be all zeros
            raise BadPeerKey(f"the X25519 public key gives no shared secret ({exc})") from None
        if not self._encrypt:
            return PairKeys(epoch, dh, None, None)
        me = (self.node_id, self.epoch, self.public)
        them = (peer, epoch, dh)
        return PairKeys(epoch, dh, AESGCM(_direction_key(shared, me, them)),
                        AESGCM(_direction_key(shared, them, me)))


def _direction_key(shared: bytes, sender: tuple[bytes, int, bytes], receiver: tuple[bytes, int, bytes]
                   ) -> bytes:
    """The key for chunks from ``sender`` to ``receiver``, each (node id, epoch, public key)."""
    info = (_INFO + sender[0] + receiver[0] + sender[1].to_bytes(8, "big") + receiver[1].to_bytes(8, "big")
            + sender[2] + receiver[2])
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(shared)
