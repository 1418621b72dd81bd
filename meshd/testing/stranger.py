"""What a stranger on the network can do to a mesh, for the adversarial tests.

A stranger knows no mesh secret: it writes raw msgpack (so it can put any
number in any field, past what meshd's own records check), makes a fresh key
whenever it likes, and reaches a node's gossip port (UDP), its data port
(TCP, where any key passes the stream handshake for its own id) and the relay.
Once through a stream handshake it holds that stream's data keys, as any
member would: :func:`chunk_frame` and :func:`relay_data` seal its chunks with
the keys of its last handshake, so they reach the node's reassembly.
"""

from __future__ import annotations

import socket
from typing import Any

import msgpack
import trio

from ..identity import Identity
from ..net.data_keys import PairKeys, ProcessKeys
from ..net.framing import FramingError, frame, read_packet
from ..net.handshake import proof_data
from ..wire import (
    PROTOCOL_VERSION,
    RELAY_DATA,
    STREAM_NONCE_BYTES,
    DataChunk,
    Packet,
    StreamChallenge,
    StreamProof,
)

# The data keys of each stranger's last stream handshake, by the id it claimed.
_stream_keys: dict[bytes, PairKeys] = {}


def raw_packet(sender: bytes, *messages: tuple[int, list]) -> bytes:
    """A packet of ``(tag, body)`` messages, with no check on any field."""
    return msgpack.packb([PROTOCOL_VERSION, sender, [[tag, body] for tag, body in messages]],
                         use_bin_type=True)


def send_udp(addr: str, data: bytes, *, sock: socket.socket | None = None) -> None:
    host, _, port = addr.rpartition(":")
    own = sock or socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        own.sendto(data, (host, int(port)))
    finally:
        if sock is None:
            own.close()


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def open_data_stream(addr: str, identity: Identity, claimed: bytes | None = None, *, epoch: int = 1
                           ) -> tuple[trio.SocketStream, Packet | None]:
    """Dial a node's data port and run the stream handshake as ``claimed`` (default: our own
    id) in process ``epoch``, signing with ``identity``.  Returns the stream and the node's
    proof (None when it refused us and closed the stream).  Past the handshake, the chunks
    :func:`chunk_frame` makes for ``claimed`` are sealed for that node's process."""
    claimed = claimed or identity.node_id
    keys = ProcessKeys(claimed, epoch)
    host, _, port = addr.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    try:
        buf = bytearray()
        challenge = await read_packet(stream, buf)
        (asked,) = challenge.messages
        assert isinstance(asked, StreamChallenge), f"the node opened with {type(asked).__name__}"
        nonce = b"\x05" * STREAM_NONCE_BYTES
        signature = identity.sign(proof_data(asked.nonce, challenge.sender, claimed, epoch, keys.public))
        await stream.send_all(frame(Packet(claimed, (StreamProof(nonce, signature, epoch, keys.public),))))
        try:
            answer = await read_packet(stream, buf)
        except FramingError:
            return stream, None
        _stream_keys[claimed] = keys.pair(challenge.sender, asked.epoch, asked.dh)
    except BaseException:
        await stream.aclose()
        raise
    return stream, answer


def sealed(sender: bytes, chunk: DataChunk) -> DataChunk:
    """``chunk`` sealed with the keys of ``sender``'s last stream handshake; as it is when
    ``sender`` made none (the node then drops it unopened)."""
    keys = _stream_keys.get(sender)
    if keys is None:
        return chunk
    data = keys.seal(chunk.session, chunk.msg_id, chunk.total, chunk.offset, chunk.chunk)
    return DataChunk(chunk.session, chunk.msg_id, chunk.total, chunk.offset, data, chunk.ack_now)


def chunk_frame(sender: bytes, chunk: DataChunk) -> bytes:
    """One data-channel chunk as a stream frame, sealed (see :func:`sealed`)."""
    return frame(Packet(sender, (sealed(sender, chunk),)))


def relay_data(sender: bytes, chunk: DataChunk) -> bytes:
    """One data-channel chunk as a relay payload, sealed (see :func:`sealed`)."""
    return RELAY_DATA + chunk_frame(sender, chunk)[4:]


def snapshot_counter(snapshot: dict[str, Any], name: str) -> int:
    """A counter of a node's snapshot (``/api/snapshot``), 0 when absent."""
    return int(snapshot.get("counters", {}).get(name, 0))
