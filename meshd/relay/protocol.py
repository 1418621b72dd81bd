"""The relay's frame codec: one binary WebSocket message is one frame.

A frame is one type byte followed by fixed-size fields and, for packets, the
payload (the rest of the message).  The WebSocket layer already delimits
messages, so there is no length prefix.  Decoding untrusted bytes raises only
:class:`RelayProtocolError`.

Handshake (the DERP / iroh-relay shape)::

    server -> client  Challenge(version, nonce)
    client -> server  Auth(node_id, signature over auth_message(nonce, node_id),
                           [mesh-key proofs of the same message])
    server -> client  Accepted(max_payload)

A relay given the mesh key admits only clients with a proof under a key it
holds (``meshd.keyring.Keyring.macs``): one per key in the client's ring, so
a relay whose file is behind a rotation still finds one it can check.  The
proofs trail the signature, and a client without a mesh key sends none: its
Auth frame is the same bytes as before.

then ``Send`` (client -> server) and ``Recv``, ``PeerNotHere``, ``Replaced``
(server -> client).  ``ListPeers`` (client -> server) asks which nodes are
connected; ``Peers`` answers with up to ``MAX_LISTED`` of them, a random
sample: how a node whose direct packets reach no seed finds members to join
through (only members are admitted to a relay that holds the mesh key).

ONLY APPEND TO THE TAG TABLE.  A tag, once shipped, keeps its meaning.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

RELAY_PROTOCOL_VERSION = 1
NODE_ID_BYTES = 32
NONCE_BYTES = 32
SIGNATURE_BYTES = 64
# A mesh-key proof: the key's id and a MAC (meshd.keyring: KEY_ID_BYTES + MAC_BYTES).
MESH_PROOF_BYTES = 20
MAX_MESH_PROOFS = 8  # as many keys as a keyring holds
MAX_PAYLOAD = 64 * 1024
MAX_LISTED = 32  # node ids in one Peers answer
# The largest frame on the wire: type byte + node id + payload.
MAX_FRAME = 1 + NODE_ID_BYTES + MAX_PAYLOAD

# Signed by the client; the prefix keeps this signature from meaning anything
# anywhere else a node key signs.
AUTH_DOMAIN = b"meshd relay auth v1\x00"

# WebSocket close codes the relay uses (4000-4999 are for applications).
CLOSE_BAD_SIGNATURE = 4000
CLOSE_REPLACED = 4001
CLOSE_MALFORMED = 4002
CLOSE_UNAUTHENTICATED = 4003
CLOSE_AUTH_TIMEOUT = 4004
CLOSE_PING_TIMEOUT = 4005
CLOSE_SLOW_READER = 4006
CLOSE_UNSUPPORTED_VERSION = 4007
CLOSE_NOT_MEMBER = 4008
CLOSE_FULL = 4009  # the relay holds --max-clients clients already
CLOSE_SHUTTING_DOWN = 1001
CLOSE_TOO_BIG = 1009  # trio-websocket closes with this above max_message_size

REPLACED_REASON = "replaced by a newer connection"
NOT_MEMBER_REASON = "not a member: no valid mesh-key proof"


class RelayProtocolError(Exception):
    """Bytes that are not a valid relay frame."""


def auth_message(nonce: bytes, node_id: bytes) -> bytes:
    """What the client signs to prove it owns ``node_id``."""
    return AUTH_DOMAIN + nonce + node_id


@dataclass(frozen=True, slots=True)
class Challenge:
    TAG: ClassVar[int] = 1
    nonce: bytes
    version: int = RELAY_PROTOCOL_VERSION

    def encode(self) -> bytes:
        return bytes((self.TAG, self.version)) + _fixed(self.nonce, NONCE_BYTES, "nonce")

    @classmethod
    def decode_body(cls, body: bytes) -> Challenge:
        _expect_len(body, 1 + NONCE_BYTES, "challenge")
        return cls(nonce=body[1:], version=body[0])


@dataclass(frozen=True, slots=True)
class Auth:
    TAG: ClassVar[int] = 2
    node_id: bytes
    signature: bytes
    mesh_proofs: tuple[bytes, ...] = ()  # MESH_PROOF_BYTES each; none without a mesh key

    def encode(self) -> bytes:
        if len(self.mesh_proofs) > MAX_MESH_PROOFS:
            raise RelayProtocolError(f"at most {MAX_MESH_PROOFS} mesh-key proofs")
        return (bytes((self.TAG,)) + _fixed(self.node_id, NODE_ID_BYTES, "node id")
                + _fixed(self.signature, SIGNATURE_BYTES, "signature")
                + b"".join(_fixed(p, MESH_PROOF_BYTES, "mesh-key proof") for p in self.mesh_proofs))

    @classmethod
    def decode_body(cls, body: bytes) -> Auth:
        head = NODE_ID_BYTES + SIGNATURE_BYTES
        rest = len(body) - head
        if rest < 0 or rest % MESH_PROOF_BYTES or rest // MESH_PROOF_BYTES > MAX_MESH_PROOFS:
            raise RelayProtocolError(f"auth frame body is {len(body)} bytes, expected {head} plus up to "
                                     f"{MAX_MESH_PROOFS} mesh-key proofs of {MESH_PROOF_BYTES}")
        proofs = tuple(body[i:i + MESH_PROOF_BYTES] for i in range(head, len(body), MESH_PROOF_BYTES))
        return cls(node_id=body[:NODE_ID_BYTES], signature=body[NODE_ID_BYTES:head], mesh_proofs=proofs)


@dataclass(frozen=True, slots=True)
class Accepted:
    TAG: ClassVar[int] = 3
    max_payload: int

    def encode(self) -> bytes:
        return bytes((self.TAG,)) + struct.pack("!I", self.max_payload)

    @classmethod
    def decode_body(cls, body: bytes) -> Accepted:
        _expect_len(body, 4, "accepted")
        return cls(max_payload=struct.unpack("!I", body)[0])


@dataclass(frozen=True, slots=True)
class Send:
    """Client -> relay: forward ``payload`` to ``dst``."""

    TAG: ClassVar[int] = 4
    dst: bytes
    payload: bytes

    def encode(self) -> bytes:
        return bytes((self.TAG,)) + _fixed(self.dst, NODE_ID_BYTES, "node id") + _payload(self.payload)

    @classmethod
    def decode_body(cls, body: bytes) -> Send:
        dst, payload = _split_packet(body)
        return cls(dst=dst, payload=payload)


@dataclass(frozen=True, slots=True)
class Recv:
    """Relay -> client: ``payload`` from ``src``."""

    TAG: ClassVar[int] = 5
    src: bytes
    payload: bytes

    def encode(self) -> bytes:
        return bytes((self.TAG,)) + _fixed(self.src, NODE_ID_BYTES, "node id") + _payload(self.payload)

    @classmethod
    def decode_body(cls, body: bytes) -> Recv:
        src, payload = _split_packet(body)
        return cls(src=src, payload=payload)


@dataclass(frozen=True, slots=True)
class PeerNotHere:
    """Relay -> client: ``node_id`` is not connected to this relay."""

    TAG: ClassVar[int] = 6
    node_id: bytes

    def encode(self) -> bytes:
        return bytes((self.TAG,)) + _fixed(self.node_id, NODE_ID_BYTES, "node id")

    @classmethod
    def decode_body(cls, body: bytes) -> PeerNotHere:
        _expect_len(body, NODE_ID_BYTES, "peer-not-here")
        return cls(node_id=body)


@dataclass(frozen=True, slots=True)
class Replaced:
    """Relay -> client: a newer connection with the same node id took over."""

    TAG: ClassVar[int] = 7

    def encode(self) -> bytes:
        return bytes((self.TAG,))

    @classmethod
    def decode_body(cls, body: bytes) -> Replaced:
        _expect_len(body, 0, "replaced")
        return cls()


@dataclass(frozen=True, slots=True)
class ListPeers:
    """Client -> relay: which nodes are connected to you?"""

    TAG: ClassVar[int] = 8

    def encode(self) -> bytes:
        return bytes((self.TAG,))

    @classmethod
    def decode_body(cls, body: bytes) -> ListPeers:
        _expect_len(body, 0, "list-peers")
        return cls()


@dataclass(frozen=True, slots=True)
class Peers:
    """Relay -> client: up to ``MAX_LISTED`` node ids connected to the relay, the asker not among them."""

    TAG: ClassVar[int] = 9
    node_ids: tuple[bytes, ...]

    def encode(self) -> bytes:
        if len(self.node_ids) > MAX_LISTED:
            raise RelayProtocolError(f"at most {MAX_LISTED} node ids in a peers frame")
        return bytes((self.TAG,)) + b"".join(_fixed(n, NODE_ID_BYTES, "node id") for n in self.node_ids)

    @classmethod
    def decode_body(cls, body: bytes) -> Peers:
        if len(body) % NODE_ID_BYTES or len(body) // NODE_ID_BYTES > MAX_LISTED:
            raise RelayProtocolError(f"peers frame body is {len(body)} bytes, expected a multiple of "
                                     f"{NODE_ID_BYTES} up to {MAX_LISTED} node ids")
        return cls(tuple(body[i:i + NODE_ID_BYTES] for i in range(0, len(body), NODE_ID_BYTES)))


Frame = Challenge | Auth | Accepted | Send | Recv | PeerNotHere | Replaced | ListPeers | Peers

FRAME_TYPES: dict[int, type[Frame]] = {
    cls.TAG: cls for cls in (Challenge, Auth, Accepted, Send, Recv, PeerNotHere, Replaced, ListPeers, Peers)
}


def decode(data: bytes) -> Frame:
    """Parse one frame. Raises RelayProtocolError, and nothing else, on bad input."""
    if type(data) is not bytes:
        raise RelayProtocolError("frame is not a binary message")
    if not data:
        raise RelayProtocolError("empty frame")
    if len(data) > MAX_FRAME:
        raise RelayProtocolError(f"frame of {len(data)} bytes exceeds the {MAX_FRAME}-byte limit")
    cls = FRAME_TYPES.get(data[0])
    if cls is None:
        raise RelayProtocolError(f"unknown frame type {data[0]}")
    return cls.decode_body(data[1:])


def _fixed(value: bytes, size: int, what: str) -> bytes:
    if type(value) is not bytes or len(value) != size:
        raise RelayProtocolError(f"{what} must be {size} bytes")
    return value


def _payload(value: bytes) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise RelayProtocolError("payload must be bytes")
    if len(value) > MAX_PAYLOAD:
        raise RelayProtocolError(f"payload of {len(value)} bytes exceeds the {MAX_PAYLOAD}-byte limit")
    return bytes(value)


def _expect_len(body: bytes, size: int, what: str) -> None:
    if len(body) != size:
        raise RelayProtocolError(f"{what} frame body is {len(body)} bytes, expected {size}")


def _split_packet(body: bytes) -> tuple[bytes, bytes]:
    if len(body) < NODE_ID_BYTES:
        raise RelayProtocolError("packet frame shorter than a node id")
    return body[:NODE_ID_BYTES], body[NODE_ID_BYTES:]
