"""WebSocket framing (RFC 6455, no extensions) without I/O: bytes in, messages out.

The relay's connections carry one small binary message per packet, so the
cost per message is the relay's cost: this codec parses a frame with a few
slices, unmasks with numpy (a 64 KiB frame in ~15 µs, where XOR through a
Python int takes ~240 µs; below 512 bytes the int is quicker), and keeps no
state beyond the bytes of the frame being read and the fragments of the
message being assembled (at most MAX_FRAGMENTS of them).

A ``FrameReader`` takes the bytes read from the peer and hands back whole
messages (``bytes`` for binary, ``str`` for text) and control frames
(:class:`Ping`, :class:`Pong`, :class:`Close`).  What breaks the protocol
raises :class:`FrameError`, and nothing else; its ``code`` is the close code
to answer with.  A message over ``max_message`` bytes is refused from its
frame header, before its payload is buffered.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

OP_CONTINUATION = 0x0
OP_TEXT = 0x1
OP_BINARY = 0x2
OP_CLOSE = 0x8
OP_PING = 0x9
OP_PONG = 0xA

CLOSE_NORMAL = 1000
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_NO_STATUS = 1005  # a Close frame without a code (never sent)
CLOSE_ABNORMAL = 1006  # the stream ended without a Close frame (never sent)
CLOSE_INVALID_DATA = 1007
CLOSE_TOO_BIG = 1009

MAX_CONTROL_PAYLOAD = 125
# Frames one message may come in.  Each fragment is held until the last, so an endless run of
# empty ones would grow the reader without bound while staying under max_message; no client
# of ours fragments at all.
MAX_FRAGMENTS = 1024

_U16 = struct.Struct("!H")
_U64 = struct.Struct("!Q")
# Buffered bytes already parsed are dropped once they are this many (and whenever all are).
_COMPACT_AT = 64 * 1024


class FrameError(Exception):
    """Bytes that break the WebSocket protocol; ``code`` is the close code to answer with."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code


@dataclass(frozen=True, slots=True)
class Ping:
    payload: bytes


@dataclass(frozen=True, slots=True)
class Pong:
    payload: bytes


@dataclass(frozen=True, slots=True)
class Close:
    code: int
    reason: str


Event = bytes | str | Ping | Pong | Close


# Up to this many bytes, XOR through a Python int is quicker than numpy's fixed cost.
_INT_XOR_MAX = 512


def mask_bytes(data: bytes | bytearray | memoryview, key: bytes) -> bytes:
    """``data`` XORed with the 4-byte ``key`` repeated (masking and unmasking are the same)."""
    n = len(data)
    if n == 0:
        return b""
    keys = (key * (n // 4 + 1))[:n]
    if n <= _INT_XOR_MAX:
        return (int.from_bytes(data, "little") ^ int.from_bytes(keys, "little")).to_bytes(n, "little")
    return (np.frombuffer(data, np.uint8) ^ np.frombuffer(keys, np.uint8)).tobytes()


def header(opcode: int, length: int, mask_key: bytes | None = None) -> bytes:
    """A final frame's header for ``length`` payload bytes, with ``mask_key`` when masked."""
    first = 0x80 | opcode
    bit = 0x80 if mask_key is not None else 0
    if length < 126:
        head = bytes((first, bit | length))
    elif length < 1 << 16:
        head = bytes((first, bit | 126)) + _U16.pack(length)
    else:
        head = bytes((first, bit | 127)) + _U64.pack(length)
    return head + mask_key if mask_key is not None else head


def frame(opcode: int, payload: bytes, *, mask: bool) -> bytes:
    """One final frame carrying ``payload``.  A client masks (``mask``) with a fresh random key."""
    if mask:
        key = os.urandom(4)
        return header(opcode, len(payload), key) + mask_bytes(payload, key)
    return header(opcode, len(payload)) + payload


def close_payload(code: int, reason: str = "") -> bytes:
    """A Close frame's payload: the code, then at most 123 bytes of UTF-8 reason."""
    return _U16.pack(code) + reason.encode()[:MAX_CONTROL_PAYLOAD - 2].decode(errors="ignore").encode()


_DEFINED_CLOSE_CODES = frozenset((1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014))


def _valid_close_code(code: int) -> bool:
    """Codes a peer may send (RFC 6455 7.4): the defined ones, and 3000-4999 for libraries and apps."""
    return code in _DEFINED_CLOSE_CODES or 3000 <= code <= 4999


class FrameReader:
    """Frames from one peer: ``feed`` what was read, then take ``next_event`` until it is None.

    ``masked``: whether the peer's frames must be masked (a server reads a client's).
    """

    def __init__(self, *, masked: bool, max_message: int) -> None:
        self._masked = masked
        self._max_message = max_message
        self._buf = bytearray()
        self._pos = 0  # where the next frame starts in _buf
        self._parts: list[bytes] = []  # the fragments of the message being assembled
        self._size = 0  # their total length
        self._text = False  # that message is text

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet parsed into events."""
        return len(self._buf) - self._pos

    def next_event(self) -> Event | None:
        """The next whole message or control frame, or None until more bytes are fed.

        Raises FrameError for anything that breaks the protocol; the reader is not
        to be used after that.
        """
        while True:
            buf, pos = self._buf, self._pos
            have = len(buf) - pos
            if have < 2:
                self._need_more()
                return None
            b0, b1 = buf[pos], buf[pos + 1]
            if b0 & 0x70:
                raise FrameError(CLOSE_PROTOCOL_ERROR, "reserved bits set (no extension was agreed)")
            if bool(b1 & 0x80) != self._masked:
                raise FrameError(CLOSE_PROTOCOL_ERROR, "frame masked" if b1 & 0x80 else "frame not masked")
            opcode, fin, length = b0 & 0x0F, b0 & 0x80, b1 & 0x7F
            start = pos + 2
            if length == 126:
                if have < 4:
                    self._need_more()
                    return None
                (length,) = _U16.unpack_from(buf, pos + 2)
                start += 2
            elif length == 127:
                if have < 10:
                    self._need_more()
                    return None
                (length,) = _U64.unpack_from(buf, pos + 2)
                start += 8
            if opcode >= OP_CLOSE:
                if opcode > OP_PONG:
                    raise FrameError(CLOSE_PROTOCOL_ERROR, f"unknown control opcode {opcode}")
                if not fin or length > MAX_CONTROL_PAYLOAD:
                    raise FrameError(CLOSE_PROTOCOL_ERROR, "control frame fragmented or over 125 bytes")
            elif opcode > OP_BINARY:
                raise FrameError(CLOSE_PROTOCOL_ERROR, f"unknown data opcode {opcode}")
            elif (opcode == OP_CONTINUATION) != bool(self._parts):
                if opcode == OP_CONTINUATION:
                    raise FrameError(CLOSE_PROTOCOL_ERROR, "continuation frame without a message to continue")
                raise FrameError(CLOSE_PROTOCOL_ERROR, "new message before the last one was finished")
            elif self._size + length > self._max_message:
                raise FrameError(CLOSE_TOO_BIG, f"message over {self._max_message} bytes")
            elif len(self._parts) >= MAX_FRAGMENTS:
                raise FrameError(CLOSE_TOO_BIG, f"message in over {MAX_FRAGMENTS} fragments")
            key = None
            if self._masked:
                key = bytes(buf[start:start + 4])
                start += 4
            end = start + length
            if len(buf) < end:
                self._need_more()
                return None
            self._pos = end
            payload = bytes(buf[start:end]) if key is None else mask_bytes(memoryview(buf)[start:end], key)
            if opcode >= OP_CLOSE:
                return self._control(opcode, payload)
            if opcode != OP_CONTINUATION:
                self._text = opcode == OP_TEXT
            if fin and not self._parts:
                return self._message(payload)  # the usual case: one frame, one message
            self._parts.append(payload)
            self._size += length
            if fin:
                data = b"".join(self._parts)
                self._parts, self._size = [], 0
                return self._message(data)

    def _need_more(self) -> None:
        """No whole frame is buffered: drop the parsed bytes before more are fed."""
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos >= _COMPACT_AT:
            del self._buf[:self._pos]
            self._pos = 0

    def _message(self, data: bytes) -> bytes | str:
        if not self._text:
            return data
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise FrameError(CLOSE_INVALID_DATA, "text message is not UTF-8") from None

    @staticmethod
    def _control(opcode: int, payload: bytes) -> Ping | Pong | Close:
        if opcode == OP_PING:
            return Ping(payload)
        if opcode == OP_PONG:
            return Pong(payload)
        if not payload:
            return Close(CLOSE_NO_STATUS, "")
        if len(payload) == 1:
            raise FrameError(CLOSE_PROTOCOL_ERROR, "close frame with a 1-byte payload")
        (code,) = _U16.unpack_from(payload)
        if not _valid_close_code(code):
            raise FrameError(CLOSE_PROTOCOL_ERROR, f"close code {code} may not be sent")
        try:
            reason = payload[2:].decode()
        except UnicodeDecodeError:
            raise FrameError(CLOSE_INVALID_DATA, "close reason is not UTF-8") from None
        return Close(code, reason)
