"""Packets as length-prefixed frames on a data stream: make, parse, read and write them.

A frame is a 4-byte big-endian length and an encoded packet of at most
MAX_FRAME_BYTES.  Writing tries the socket first, without a trip through the
scheduler, since on a pipeline's critical path every such trip is a wait
behind whatever else is runnable; so does reading what a socket already holds.
"""

from __future__ import annotations

import os
import struct

import trio

from ..wire import MAX_FRAME_BYTES, Packet, WireError, decode, encode
from .netem_socket import NetemSocket

_LEN = struct.Struct("!I")
# Under malloc's mmap threshold: a 256 KiB receive buffer cost 11 µs per read, 64 KiB under 1 µs.
RECV_BYTES = 64 * 1024


class FramingError(Exception):
    """The stream ended, or carried something that is not our framing, before a whole frame."""


def prefixed(encoded: bytes) -> bytes:
    """An encoded packet as a frame: its length, then the packet."""
    return _LEN.pack(len(encoded)) + encoded


def frame(packet: Packet) -> bytes:
    """``packet`` encoded, as a frame."""
    return prefixed(encode(packet, MAX_FRAME_BYTES))


def next_frame(buf: bytearray, max_bytes: int = MAX_FRAME_BYTES) -> bytes | None:
    """The next whole frame's packet bytes, taken off the front of ``buf``; None until one is whole.

    Raises WireError for a length over ``max_bytes`` (not our protocol, or not at this point of it)."""
    if len(buf) < _LEN.size:
        return None
    (n,) = _LEN.unpack_from(buf)
    if n > max_bytes:
        raise WireError(f"a frame of {n} bytes, over {max_bytes}")
    if len(buf) < _LEN.size + n:
        return None
    data = bytes(buf[_LEN.size:_LEN.size + n])
    del buf[:_LEN.size + n]
    return data


async def read_packet(stream: trio.abc.ReceiveStream, buf: bytearray, max_bytes: int = MAX_FRAME_BYTES
                      ) -> Packet:
    """The next whole frame from ``stream``, decoded; bytes read past it stay in ``buf``.

    Raises FramingError when the stream closes first or the bytes are not our protocol
    (a frame over ``max_bytes`` included: it is refused from its length, before it is read)."""
    while True:
        try:
            data = next_frame(buf, max_bytes)
            if data is not None:
                return decode(data, max_bytes)
        except WireError as exc:
            raise FramingError(f"not our protocol ({exc})") from exc
        more = await stream.receive_some(RECV_BYTES)
        if not more:
            raise FramingError("the stream closed")
        buf += more


def read_some(stream: trio.SocketStream) -> bytes | None:
    """What the socket holds now (up to RECV_BYTES), without a trip through the scheduler:
    None when it holds nothing yet (and always for a socket under faults, read the usual
    way), ``b""`` once the peer closed.  Raises trio.BrokenResourceError when the stream
    is broken or closed."""
    if isinstance(stream.socket, NetemSocket):
        return None
    try:
        return os.read(stream.socket.fileno(), RECV_BYTES)
    except BlockingIOError:
        return None
    except OSError as exc:  # reset, or closed under us (fd -1)
        raise trio.BrokenResourceError(f"read failed: {exc.strerror or exc}") from None


def write_some(stream: trio.SocketStream, data: bytes) -> int:
    """How many bytes of ``data`` the socket takes now, without waiting (0 when its buffer
    is full, and always under a fault that holds the stream's writes: they must go through
    ``send_all``, which holds them).  Raises trio.BrokenResourceError when the stream is broken."""
    if isinstance(stream.socket, NetemSocket):
        return 0
    try:
        return os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        return 0
    except OSError as exc:  # reset, broken pipe, or closed under us (fd -1)
        raise trio.BrokenResourceError(f"write failed: {exc.strerror or exc}") from None


async def write_frame(lock: trio.Lock, stream: trio.SocketStream, data: bytes) -> None:
    """Write ``data`` whole to ``stream``; at once when no other writer holds ``lock``.

    What the socket buffer does not take goes the usual way, under the lock,
    so whole frames never interleave.
    """
    if not lock.locked():
        sent = write_some(stream, data)
        if sent == len(data):
            return
        data = data[sent:]
    async with lock:
        await stream.send_all(data)
