"""The relay's WebSocket connections: the opening handshake, then messages in and frames out.

Built for the relay's hot path, where each packet is one small message: the
task that reads a connection parses its frames itself (no reader task and
queue per connection, as a general WebSocket library has), and a frame is
written into the socket by whoever sends it, at once, whenever nothing is
queued before it.  What the socket does not take waits in the connection's
outbox, in order, for its writer task (``run_writer``; before that runs,
``flush``), the only one that ever waits on the socket for writing.  A send
therefore never waits, and wakes no other task unless the socket's buffer is
full.

Reads and writes go straight to the socket's file descriptor for a plain TCP
stream; any other stream (TLS) goes through trio's stream methods.  Control
frames are handled here: a ping is answered (one answer owed at most, so a
peer that pings and never reads cannot grow our queue), a pong wakes
``ping``, and the closing handshake follows RFC 6455 with a timeout.

The HTTP upgrade is h11's parsing with the RFC's checks (``accept`` for a
server, ``connect`` for a client); anything else on the port is answered 400.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import h11
import trio

from . import wsframe
from .wsframe import OP_BINARY, OP_CLOSE, OP_PING, OP_PONG, Close, FrameError, FrameReader, Ping, Pong

# One read takes up to this much (about a full relay frame), under malloc's mmap threshold.
RECV_BYTES = 64 * 1024
# The largest HTTP upgrade request or response we read.
MAX_HANDSHAKE_BYTES = 16 * 1024
ABORT_TIMEOUT = 1.0  # for a stream's own aclose
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_REJECT = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class HandshakeError(Exception):
    """The opening handshake failed; the message says why."""


@dataclass(frozen=True, slots=True)
class CloseReason:
    """Why a connection closed: the close code and reason of its Close frame (ours, if we
    closed first; the peer's, if it did), or 1006 when the stream ended without one."""

    code: int
    reason: str


class ConnectionClosed(Exception):
    """The connection is closed or closing: no more messages."""

    def __init__(self, reason: CloseReason) -> None:
        super().__init__(f"{reason.code} {reason.reason}".strip())
        self.reason = reason


class WriteStalled(Exception):
    """A queued frame did not all go into the socket within the writer's timeout: the peer is
    not reading."""


def accept_token(key: bytes) -> bytes:
    """The Sec-WebSocket-Accept answer to a Sec-WebSocket-Key (RFC 6455 4.2.2)."""
    return base64.b64encode(hashlib.sha1(key + _GUID).digest())


class WebSocket:
    """One connection after the opening handshake.

    ``client``: we are the client (our frames are masked, the peer's are not).
    ``on_queued(n)``: called with what ``queued_bytes`` gains (or, negative, loses) each time it
    changes: a message counts its length, a control frame its length on the wire.
    """

    def __init__(self, stream: trio.abc.Stream, *, client: bool, max_message: int, leftover: bytes = b"",
                 on_queued: Callable[[int], None] | None = None) -> None:
        self.stream = stream
        self.client = client
        self._fd = stream.socket.fileno() if type(stream) is trio.SocketStream else -1
        self._frames = FrameReader(masked=not client, max_message=max_message)
        self._frames.feed(leftover)
        self.closed: CloseReason | None = None  # set once either side began the closing handshake
        self._close_sent = False
        self._peer_closed = trio.Event()  # the peer's Close came, or the stream ended
        self._input_broken = False  # no frame can be read any more (protocol error, end of stream)
        self._output_broken = False  # no frame can be written any more (reset, or cut mid-frame)
        self._stream_closed = False
        self._reading = False  # a task is inside receive()
        # Frames not yet in the socket: (bytes still to write, bytes counted for it).  The first
        # one may be the rest of a frame the socket took part of; it must go before anything else.
        self._outbox: deque[tuple[bytes | memoryview, int]] = deque()
        self.queued_bytes = 0  # counted bytes in the outbox, plus the one the writer is writing
        self._on_queued = on_queued
        self._writing = False  # the writer is in the middle of a frame
        self._writer_running = False
        self._outbox_ready = trio.Event()  # set when the outbox gains a frame
        self._drained = trio.Event()  # set when the outbox empties
        self._drained.set()
        self._held: list[bytes] | None = None  # frames sent while held (see hold), not yet written
        self._held_count = 0
        self._pong_owed: bytes | None = None  # the latest ping's payload, unanswered
        self._pong = trio.Event()  # set by the next pong

    # --- sending ---

    def send_nowait(self, data: bytes, opcode: int = OP_BINARY) -> bool:
        """Send ``data`` as one message, without waiting: written at once when nothing is queued
        before it and the socket takes it, else queued for the writer.

        False (nothing sent) once the closing handshake began or the connection broke.
        """
        if self.closed is not None or self._output_broken:
            return False
        wire = wsframe.frame(opcode, data, mask=self.client)
        self._send(wire, len(data) if opcode < OP_CLOSE else len(wire))
        return True

    def hold(self) -> None:
        """Collect what is sent from now on, and write it with one system call at ``release``.

        The relay holds a destination while it forwards the frames of one read from a
        source, so a burst reaches the destination in one write, not one per frame.  The
        caller releases before it next waits for anything."""
        if self._held is None:
            self._held = []

    @property
    def holding(self) -> bool:
        return self._held is not None

    @property
    def more_buffered(self) -> bool:
        """Whether bytes read from the socket wait to be parsed: more of this read's frames."""
        return self._frames.buffered > 0

    def release(self) -> None:
        """Write (or queue) what was sent since ``hold``, as one piece."""
        held, count = self._held, self._held_count
        self._held, self._held_count = None, 0
        if not held:
            return
        self._dequeued(count)  # _send counts it again if it has to wait
        if self._output_broken:
            return
        self._send(held[0] if len(held) == 1 else b"".join(held), count)

    def _send(self, wire: bytes, count: int) -> None:
        if self._held is not None:
            self._held.append(wire)
            self._held_count += count
            self.queued_bytes += count
            if self._on_queued is not None:
                self._on_queued(count)
            return
        if not self._outbox and not self._writing and self._fd >= 0:
            try:
                sent = os.write(self._fd, wire)
            except BlockingIOError:
                sent = 0
            except OSError:  # reset, broken pipe, or closed under us
                self._output_broken = True
                self._lost()
                return
            if sent == len(wire):
                return
            self._outbox.append((memoryview(wire)[sent:], count))
        else:
            self._outbox.append((wire, count))
        self.queued_bytes += count
        if self._on_queued is not None:
            self._on_queued(count)
        self._drained = trio.Event() if self._drained.is_set() else self._drained
        self._outbox_ready.set()

    def _send_control(self, opcode: int, payload: bytes) -> None:
        wire = wsframe.frame(opcode, payload, mask=self.client)
        self._send(wire, len(wire))

    async def run_writer(self, stall_timeout: float) -> None:
        """Write what the socket did not take at once, in order, for as long as the connection
        lasts.  Raises WriteStalled when one frame takes longer than ``stall_timeout`` to go."""
        self._writer_running = True
        try:
            while True:
                while not self._outbox:
                    self._owe_pong()
                    if self._outbox:
                        break
                    if self._output_broken or self._stream_closed:
                        return
                    self._outbox_ready = trio.Event()
                    await self._outbox_ready.wait()
                if not await self._write_next(stall_timeout):
                    raise WriteStalled(f"a frame did not go into the socket within {stall_timeout:g}s")
        finally:
            self._writer_running = False

    async def _write_next(self, timeout: float) -> bool:
        """Write the oldest queued frame; False if it did not go within ``timeout``."""
        wire, count = self._outbox.popleft()
        self._writing = True
        done = False
        try:
            with trio.move_on_after(timeout):
                await self.stream.send_all(wire)
                done = True
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._output_broken = True
            self._lost()
            done = True
        finally:
            self._writing = False
            if not done:
                self._output_broken = True  # part of the frame may be in the socket
            self._dequeued(count)
            if self._output_broken:
                self.discard_queued(keep_partial=False)  # none of it can go now
            elif not self._outbox:
                self._drained.set()
        return done

    def _dequeued(self, count: int) -> None:
        self.queued_bytes -= count
        if self._on_queued is not None:
            self._on_queued(-count)

    def discard_queued(self, *, keep_partial: bool = True) -> None:
        """Drop every frame still queued; with ``keep_partial``, not the rest of a frame the
        socket took part of (the stream would be left holding half a frame)."""
        keep = []
        if keep_partial and self._outbox and isinstance(self._outbox[0][0], memoryview):
            keep.append(self._outbox.popleft())
        while self._outbox:
            self._dequeued(self._outbox.popleft()[1])
        self._outbox.extend(keep)
        if not self._outbox:
            self._drained.set()

    async def flush(self) -> bool:
        """Until everything queued is in the socket: written by the writer when it runs, else
        here (the caller bounds the wait).  False if the connection broke first."""
        while (self._outbox or self._writing) and not self._output_broken:
            if self._writer_running or self._writing:
                await self._drained.wait()  # set once the frame being written is in, and no more
            else:
                await self._write_next(float("inf"))
        return not self._output_broken

    def _owe_pong(self) -> None:
        if self._pong_owed is not None and self.closed is None and not self._output_broken:
            payload, self._pong_owed = self._pong_owed, None
            self._send_control(OP_PONG, payload)

    async def ping(self) -> None:
        """Ping the peer and wait for a pong (the caller bounds the wait).  Raises ConnectionClosed."""
        if self.closed is not None or self._output_broken:
            raise ConnectionClosed(self.closed or CloseReason(wsframe.CLOSE_ABNORMAL, "connection lost"))
        self._pong = trio.Event()
        self._send_control(OP_PING, os.urandom(4))
        await self._pong.wait()
        if self.closed is not None:
            raise ConnectionClosed(self.closed)

    # --- receiving ---

    async def receive(self) -> bytes | str:
        """The next message (bytes, or str for a text message).  Raises ConnectionClosed once
        the connection closes, from either side; a protocol error closes it with its code."""
        if self._reading:
            raise trio.BusyResourceError("another task is already reading this connection")
        self._reading = True
        try:
            while (message := self.receive_nowait()) is None:
                await self._read_more()
            return message
        finally:
            self._reading = False

    def receive_nowait(self) -> bytes | str | None:
        """The next message already read from the socket, or None; raises as ``receive``."""
        while (event := self._buffered_event()) is not None:
            if isinstance(event, bytes | str):
                if self.closed is None:
                    return event
                # We began the closing handshake: what comes before the peer's Close is dropped.
            elif isinstance(event, Close):
                assert self.closed is not None
                raise ConnectionClosed(self.closed)
        return None

    async def _next_event(self) -> wsframe.Event:
        """The next message or control frame, control frames already acted on."""
        while (event := self._buffered_event()) is None:
            await self._read_more()
        return event

    def _buffered_event(self) -> wsframe.Event | None:
        """The next message or control frame already read, control frames acted on; None until
        more is read.  Raises ConnectionClosed when the stream ended or broke the protocol."""
        if self._input_broken:
            raise ConnectionClosed(self.closed or CloseReason(wsframe.CLOSE_ABNORMAL, "connection lost"))
        try:
            event = self._frames.next_event()
        except FrameError as exc:
            self._input_broken = True
            self._peer_closed.set()
            self._begin_close(exc.code, str(exc))
            raise ConnectionClosed(self.closed or CloseReason(exc.code, str(exc))) from None
        if isinstance(event, Ping):
            self._pong_owed = event.payload
            if not self._outbox and not self._writing:
                self._owe_pong()
            else:  # the writer answers once the outbox drains: one answer, to the latest
                self._outbox_ready.set()
        elif isinstance(event, Pong):
            self._pong.set()
        elif isinstance(event, Close):
            self._peer_closed.set()
            self._input_broken = True  # nothing comes after a Close
            code = wsframe.CLOSE_NORMAL if event.code == wsframe.CLOSE_NO_STATUS else event.code
            if self.closed is None:
                self.closed = CloseReason(event.code, event.reason)
            self._begin_close(code, event.reason)
            self._pong.set()  # a ping waiting for an answer gets ConnectionClosed
        return event

    async def _read_more(self) -> None:
        if self._fd >= 0:
            waited = False
            while True:
                try:
                    data = os.read(self._fd, RECV_BYTES)
                except BlockingIOError:
                    try:
                        await trio.lowlevel.wait_readable(self._fd)
                    except trio.ClosedResourceError:  # closed by abort() while we waited
                        data = b""
                        break
                    waited = True
                    continue
                except OSError:
                    data = b""  # reset: as good as the end of the stream
                if data and not waited:
                    # Data was there without a wait: let others run, as any read does in trio
                    # (a peer that floods us must not keep its reader on the CPU).
                    await trio.lowlevel.checkpoint()
                break
        else:
            try:
                data = bytes(await self.stream.receive_some(RECV_BYTES))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
        if not data:
            self._input_broken = True
            self._peer_closed.set()
            self._lost()
            return
        self._frames.feed(data)

    def _lost(self) -> None:
        """The stream ended or broke without a Close frame."""
        if self.closed is None:
            self.closed = CloseReason(wsframe.CLOSE_ABNORMAL, "the connection ended without a close frame")
        self._pong.set()

    # --- closing ---

    def _begin_close(self, code: int, reason: str) -> None:
        """Queue our Close frame (once), after whatever is queued already."""
        if self.closed is None:
            self.closed = CloseReason(code, reason)
        if self._close_sent or self._output_broken:
            return
        self._close_sent = True
        self._pong_owed = None
        self._send_control(OP_CLOSE, wsframe.close_payload(code, reason))

    async def aclose(self, code: int = wsframe.CLOSE_NORMAL, reason: str = "", timeout: float = 2.0) -> None:
        """The closing handshake, bounded by ``timeout``: what is queued goes first, then our
        Close; then the peer's Close is awaited (read here if no task is reading), and the
        stream is closed whatever happened."""
        if self._stream_closed:
            return
        try:
            with trio.move_on_after(timeout):
                self._begin_close(code, reason)
                await self.flush()
                if not self._peer_closed.is_set():
                    if self._reading:
                        await self._peer_closed.wait()
                    else:
                        try:
                            while True:
                                await self._next_event()  # messages after our Close are dropped
                        except ConnectionClosed:
                            pass
        finally:
            await self.abort()

    async def abort(self) -> None:
        """Close the stream at once, whatever is queued or unfinished."""
        if self._stream_closed:
            return
        self._stream_closed = True
        self._output_broken = True
        self._fd = -1  # the number may belong to another socket once this one is closed
        self._lost()
        self.discard_queued(keep_partial=False)
        self._outbox_ready.set()  # a waiting writer ends
        # Shielded, and bounded: a TLS stream's aclose says goodbye first, and closes its
        # transport even when that is cut short.
        with trio.CancelScope(shield=True, deadline=trio.current_time() + ABORT_TIMEOUT):
            await self.stream.aclose()


# --- the opening handshake ---


async def accept(stream: trio.abc.Stream, *, max_message: int,
                 on_queued: Callable[[int], None] | None = None) -> WebSocket:
    """Read a client's HTTP upgrade request from ``stream`` and accept it.  Anything else is
    answered 400 and raises HandshakeError.  The caller bounds the wait."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HANDSHAKE_BYTES)
    request = None
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await _receive(stream)
                if not data and conn.their_state is h11.IDLE and request is None:
                    raise HandshakeError("the connection closed before a request")
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                request = event
            elif event is h11.PAUSED or isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
            else:
                raise HandshakeError(f"unexpected {type(event).__name__} in the upgrade request")
    except h11.RemoteProtocolError as exc:
        await _reject(stream)
        raise HandshakeError(f"not an HTTP request: {exc}") from None
    try:
        key = _check_request(request, conn)
    except HandshakeError:
        await _reject(stream)
        raise
    headers = [(b"upgrade", b"websocket"), (b"connection", b"Upgrade"),
               (b"sec-websocket-accept", accept_token(key))]
    response = h11.InformationalResponse(status_code=101, reason=b"Switching Protocols", headers=headers)
    await _send_all(stream, conn.send(response) or b"")
    return WebSocket(stream, client=False, max_message=max_message, leftover=conn.trailing_data[0],
                     on_queued=on_queued)


def _check_request(request: h11.Request | None, conn: h11.Connection) -> bytes:
    """The request's Sec-WebSocket-Key, if it is a WebSocket upgrade we can accept."""
    if request is None:
        raise HandshakeError("no request")
    if conn.their_state is not h11.MIGHT_SWITCH_PROTOCOL:
        raise HandshakeError("not an upgrade request")
    headers = {name: value for name, value in request.headers}
    if request.method != b"GET":
        raise HandshakeError(f"method {request.method.decode(errors='replace')}, not GET")
    if headers.get(b"upgrade", b"").lower() != b"websocket":
        raise HandshakeError("not a WebSocket upgrade")
    if b"upgrade" not in [t.strip().lower() for t in headers.get(b"connection", b"").split(b",")]:
        raise HandshakeError("no 'Connection: Upgrade'")
    if headers.get(b"sec-websocket-version") != b"13":
        raise HandshakeError("not WebSocket version 13")
    key = headers.get(b"sec-websocket-key", b"")
    try:
        if len(base64.b64decode(key, validate=True)) != 16:
            raise ValueError
    except ValueError:
        raise HandshakeError("bad Sec-WebSocket-Key") from None
    return key


async def connect(stream: trio.abc.Stream, host: str, path: str, *, max_message: int) -> WebSocket:
    """Send an HTTP upgrade request on ``stream`` and read the server's acceptance.  Raises
    HandshakeError saying why the server did not accept.  The caller bounds the wait."""
    key = base64.b64encode(os.urandom(16))
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HANDSHAKE_BYTES)
    request = h11.Request(method=b"GET", target=path.encode(), headers=[
        (b"host", host.encode()), (b"upgrade", b"websocket"), (b"connection", b"Upgrade"),
        (b"sec-websocket-key", key), (b"sec-websocket-version", b"13")])
    await _send_all(stream, (conn.send(request) or b"") + (conn.send(h11.EndOfMessage()) or b""))
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await _receive(stream)
                if not data:
                    raise HandshakeError("the server closed the connection during the upgrade")
                conn.receive_data(data)
            elif isinstance(event, h11.InformationalResponse | h11.Response):
                break
            else:
                raise HandshakeError(f"unexpected {type(event).__name__} in the upgrade response")
    except h11.RemoteProtocolError as exc:
        raise HandshakeError(f"the server's answer is not HTTP: {exc}") from None
    if event.status_code != 101:
        status = f"{event.status_code} {event.reason.decode(errors='replace')}"
        raise HandshakeError(f"the server answered {status}")
    headers = {name: value for name, value in event.headers}
    accepted = headers.get(b"sec-websocket-accept") == accept_token(key)
    if headers.get(b"upgrade", b"").lower() != b"websocket" or not accepted:
        raise HandshakeError("the server's 101 answer is not a WebSocket acceptance")
    return WebSocket(stream, client=True, max_message=max_message, leftover=conn.trailing_data[0])


async def _receive(stream: trio.abc.Stream) -> bytes:
    try:
        return bytes(await stream.receive_some(RECV_BYTES))
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise HandshakeError(f"the connection broke during the upgrade ({exc})") from exc


async def _send_all(stream: trio.abc.Stream, data: bytes) -> None:
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        raise HandshakeError(f"the connection broke during the upgrade ({exc})") from exc


async def _reject(stream: trio.abc.Stream) -> None:
    try:
        await stream.send_all(_REJECT)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
