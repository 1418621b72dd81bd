"""A TCP socket whose writes reach the wire late, as tc netem on the writer's interface makes them.

On the netns testbed ``--fault delay:MS`` and ``loss:P`` are netem on every
job's interface, so they hold every packet a node sends, its data streams'
included.  In-process, a data stream under such a fault (dialled or
accepted: data chunks and acks alike) runs over this socket, under an
ordinary ``trio.SocketStream``, and each write leaves when
:meth:`Faults.stream_send_delay` says (the model is described in
:mod:`.faults`): in the order it was made, a FIN (``send_eof``) after every
write before it.  It sits under the stream rather than around it, so every
part of the channel keeps an ordinary ``trio.SocketStream``;
:func:`.framing.write_some`, which writes into the socket's descriptor
itself, takes nothing from it, so every write goes through ``send``.

A task per socket, on the data channel's nursery, writes each one into the
real socket when it is due.  A closed socket stops reading at once; what was
written before the close still leaves, as the kernel sends what a closed
socket left in its buffer, and then the real socket is closed and the task
ends.  It also ends with the channel, the real socket closed with it.

At most MAX_IN_FLIGHT bytes are on their way at once; a writer waits past
that, as it would for a full send buffer.
"""

from __future__ import annotations

import errno
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from .faults import Faults

if TYPE_CHECKING:
    from typing_extensions import Buffer

MAX_IN_FLIGHT = 4 * 1024 * 1024


def with_stream_faults(
    stream: trio.SocketStream, faults: Faults, spawn: Callable[[Callable[[], Awaitable[None]]], None]
) -> trio.SocketStream:
    """``stream`` itself while ``faults`` leave streams alone; else the same connection with
    its writes held as they say, their task started with ``spawn``."""
    if not faults.stream_faults:
        return stream
    sock = NetemSocket(stream.socket, faults)
    spawn(sock.deliver)
    return trio.SocketStream(sock)


class NetemSocket(trio.socket.SocketType):
    """A connected TCP socket whose sends leave when ``faults`` say; reads are the real socket's."""

    def __init__(self, sock: trio.socket.SocketType, faults: Faults) -> None:
        super().__init__()
        self._sock = sock
        self._faults = faults
        # Writes on their way, oldest first: when each leaves, and its bytes (None: our FIN).
        # The task takes them in this order, each when due, so one behind a held write waits
        # for it, as TCP delivers nothing past a lost segment until it is sent again.  One
        # stays at the front while the task writes it: an empty queue means the task is idle.
        self._queue: deque[tuple[float, bytes | None]] = deque()
        self._in_flight = 0  # bytes in the queue
        self._work = trio.lowlevel.ParkingLot()  # the task waits here for a write
        self._room = trio.lowlevel.ParkingLot()  # writers wait here for MAX_IN_FLIGHT to allow theirs
        self._shut_wr = False
        self._closed = False
        self._broken: OSError | None = None  # why the real socket took no more

    # ------------------------------------------------------------- writing

    async def send(self, data: Buffer, flags: int = 0, /) -> int:
        """Take all of ``data`` to write when it is due; raises OSError as a socket's send does."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            self._check_writable()
            if self._in_flight < MAX_IN_FLIGHT:
                break
            await self._room.park()
        chunk = bytes(data)
        self._enqueue(self._faults.stream_send_delay(), chunk)
        await trio.lowlevel.cancel_shielded_checkpoint()  # taken: a cancel now must not say otherwise
        return len(chunk)

    async def wait_writable(self) -> None:
        while True:
            self._check_writable()
            if self._in_flight < MAX_IN_FLIGHT:
                break
            await self._room.park()
        await trio.lowlevel.checkpoint()

    def shutdown(self, flag: int) -> None:
        if flag in (trio.socket.SHUT_RD, trio.socket.SHUT_RDWR):
            self._sock.shutdown(trio.socket.SHUT_RD)
        if flag in (trio.socket.SHUT_WR, trio.socket.SHUT_RDWR) and not self._shut_wr:
            self._check_writable()
            self._shut_wr = True
            self._enqueue(self._faults.delay_s, None)

    def _enqueue(self, delay: float, data: bytes | None) -> None:
        self._queue.append((trio.current_time() + delay, data))
        self._in_flight += len(data or b"")
        self._work.unpark_all()

    def _check_writable(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, "the socket is closed")
        if self._shut_wr:
            raise OSError(errno.EPIPE, "the socket is shut down for writing")
        if self._broken is not None:
            raise OSError(self._broken.errno, self._broken.strerror)

    async def deliver(self) -> None:
        """Write each queued write into the real socket when it is due, until closed (see the
        module's doc)."""
        try:
            while True:
                while not self._queue:
                    if self._closed:
                        return
                    await self._work.park()
                due, data = self._queue[0]
                await trio.sleep_until(due)
                try:
                    if data is None:
                        self._sock.shutdown(trio.socket.SHUT_WR)
                    else:
                        await self._send_all(data)
                except OSError as exc:  # reset, broken pipe: the reader sees it too; its close is the user's
                    self._broken = exc
                    return
                self._queue.popleft()
                self._in_flight -= len(data or b"")
                self._room.unpark_all()
        finally:
            if self._broken is None:  # closed and done, or the channel stops: the socket goes with us
                self._broken = OSError(errno.EPIPE, "the stream's writer stopped")
                self._sock.close()
            self._queue.clear()
            self._in_flight = 0
            self._room.unpark_all()

    async def _send_all(self, data: bytes) -> None:
        with memoryview(data) as view:
            sent = 0
            while sent < len(view):
                sent += await self._sock.send(view[sent:])

    # ------------------------------------------------------------- reading, closing

    async def recv(self, buflen: int, flags: int = 0, /) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("the socket is closed")
        data = await self._sock.recv(buflen, flags)
        if self._closed:  # closed while we waited (see close)
            raise trio.ClosedResourceError("the socket is closed")
        return data

    def close(self) -> None:
        """Stop reading now; what was written leaves when due, and then the real socket closes."""
        if self._closed:
            return
        self._closed = True
        if self._queue:
            try:
                self._sock.shutdown(trio.socket.SHUT_RD)  # wakes a reader waiting on it
            except OSError:
                pass  # not connected any more: the task's next write says so
        else:
            self._sock.close()
        self._work.unpark_all()
        self._room.unpark_all()

    def is_readable(self) -> bool:
        return self._sock.is_readable()

    # ------------------------------------------------------------- the real socket's

    def fileno(self) -> int:
        return -1 if self._closed else self._sock.fileno()

    @property
    def did_shutdown_SHUT_WR(self) -> bool:
        return self._shut_wr

    @property
    def family(self) -> Any:
        return self._sock.family

    @property
    def type(self) -> Any:
        return self._sock.type

    @property
    def proto(self) -> int:
        return self._sock.proto

    def getsockname(self) -> Any:
        return self._sock.getsockname()

    def getpeername(self) -> Any:
        return self._sock.getpeername()

    def getsockopt(self, *args: Any) -> Any:
        return self._sock.getsockopt(*args)

    def setsockopt(self, *args: Any) -> None:
        self._sock.setsockopt(*args)

    def __repr__(self) -> str:
        return f"<NetemSocket over {self._sock!r}>"
