"""A TCP proxy on loopback, for tests that stand between two ends of a stream.

It can hold new connections at a gate (a dial to it then waits, as one to a slow peer
would) and hand every byte it carries, either way, to a hook (to check what the wire
shows).  Each connection it accepts gets its own connection to the target; when either
side of one ends, so does the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import trio

# Which way bytes go through the proxy: from the dialler to the target, or back.
Direction = Literal["to_target", "from_target"]


class TcpProxy:
    """A proxy to ``target`` (``host:port``).  ``on_bytes(direction, data)`` sees each piece
    it carries before passing it on.  With ``closed=True`` the gate starts closed: a
    connection made then waits, unanswered, until :meth:`open`."""

    def __init__(self, target: str, *, on_bytes: Callable[[Direction, bytes], None] | None = None,
                 closed: bool = False) -> None:
        self.target = target
        self.on_bytes = on_bytes
        self._gate = trio.Event()
        if not closed:
            self._gate.set()

    def open(self) -> None:
        """Let every waiting connection, and each new one, through to the target."""
        self._gate.set()

    def close(self) -> None:
        """Hold each new connection until the next :meth:`open`; those through stay up."""
        if self._gate.is_set():
            self._gate = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept on a fresh loopback port until cancelled; reports ``127.0.0.1:<port>``."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._handle, listeners)
            task_status.started(f"127.0.0.1:{listeners[0].socket.getsockname()[1]}")

    async def _handle(self, client: trio.SocketStream) -> None:
        # Only an unset gate is ever replaced, so a connection waiting here waits on the
        # event the next open() sets.
        await self._gate.wait()
        host, _, port = self.target.rpartition(":")
        async with client, await trio.open_tcp_stream(host, int(port)) as server:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, client, server, "to_target", nursery.cancel_scope)
                nursery.start_soon(self._pump, server, client, "from_target", nursery.cancel_scope)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, direction: Direction,
                    connection: trio.CancelScope) -> None:
        try:
            while data := await src.receive_some(65536):
                if self.on_bytes is not None:
                    self.on_bytes(direction, data)
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        connection.cancel()  # one side gone: so is the connection
