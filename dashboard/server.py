"""The dashboard's HTTP server: Hypercorn's connections, each one isolated from the others.

Hypercorn on trio runs every connection in one nursery, so an exception raised
inside Hypercorn for one connection ends the whole server, and with it the
node: a WebSocket upgrade followed at once by bytes that are not frames makes
h11 raise ``LocalProtocolError`` there.  Here each connection runs under its
own ``except``: the error is logged, that connection dropped, the server goes on.
And each connection's writes have a deadline (``DeadlineStream``): a client that
stops reading cannot hold a task, or a place on ``/api/live``, for ever.

It is built from Hypercorn's own parts, as ``hypercorn.trio.run.worker_serve``
is (without lifespan events: the dashboard's app has none).  Where the installed
Hypercorn's parts are not the ones this was written against, Hypercorn's own
``serve`` runs instead.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import trio

log = logging.getLogger("meshd.dashboard")

_TCP_SERVER_PARAMETERS = ["app", "config", "context", "state", "stream"]
# A client that takes no byte of one write for this long is cut off.  Hypercorn writes inside a
# shielded cancel scope, so no deadline of the app's (``/api/live``'s per push, say) can end a
# write blocked on a client that does not read; this one can, and the connection goes.
SEND_DEADLINE_S = 30.0


class DeadlineStream(trio.abc.HalfCloseableStream):
    """A connection's stream whose every ``send_all`` has a deadline: past it the connection
    is closed and the write raises BrokenResourceError (Hypercorn then closes its side)."""

    def __init__(self, stream: trio.SocketStream, deadline: float = SEND_DEADLINE_S) -> None:
        self.stream = stream
        self.socket = stream.socket  # Hypercorn reads the peer's address off it
        self.deadline = deadline

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with trio.move_on_after(self.deadline) as writing:
            await self.stream.send_all(data)
        if writing.cancelled_caught:
            await trio.aclose_forcefully(self.stream)
            raise trio.BrokenResourceError(f"the client took no data for {self.deadline:g} s")

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.stream.receive_some(max_bytes)

    # Hypercorn closes a connection it must not keep (``Connection: close``, HTTP/1.0) from
    # inside the app's last send, and then tells the app the client is gone.  An app that
    # cancels its sending on that news (Starlette's static files, the event streams) cancels
    # the close too, at its first checkpoint, and the socket stays open for as long as the
    # client keeps it: a client that reads to the end never sees one.  Neither step waits (a
    # shutdown, then a close), so both are shielded.

    async def send_eof(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.send_eof()

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()


def _parts() -> tuple[Any, Any, Any, Any] | None:
    """(TCPServer kept to HTTP/1.1, WorkerContext, repr_socket_addr, wrap_app) if they are the
    expected ones."""
    try:
        from hypercorn.protocol.h11 import H11Protocol
        from hypercorn.trio.tcp_server import TCPServer
        from hypercorn.trio.worker_context import WorkerContext
        from hypercorn.utils import repr_socket_addr, wrap_app
    except ImportError:
        return None
    if (list(inspect.signature(TCPServer).parameters) != _TCP_SERVER_PARAMETERS
            or not inspect.iscoroutinefunction(getattr(H11Protocol, "_check_protocol", None))):
        return None
    return _http11_only(TCPServer, H11Protocol), WorkerContext, repr_socket_addr, wrap_app


def _http11_only(tcp_server: Any, h11_protocol: Any) -> Any:
    """Hypercorn's TCPServer whose connections stay HTTP/1.1.

    Hypercorn turns a connection into HTTP/2 on an ``Upgrade: h2c`` request or on HTTP/2's
    preface, and its HTTP/2 side breaks the whole connection (a KeyError inside it) when a
    request's body goes on arriving after its answer: every refusal of the guard (a body too
    large, of the wrong type, without the token) would reach the client as a dropped
    connection, with every other request on it, instead of its 4xx.  Nothing here needs
    HTTP/2 (OpenAI's clients, curl and browsers speak HTTP/1.1 to an ``http://`` URL), so
    ``Upgrade: h2c`` is ignored, as HTTP/1.1 lets a server do, and the preface reaches the
    guard as a request of version 2.0, which it answers 505.
    """

    class Http11Protocol(h11_protocol):
        async def _check_protocol(self, event: Any) -> None:
            return None

    class Http11Server(tcp_server):
        # TCPServer.run makes the connection's ProtocolWrapper and assigns it here; its HTTP/1.1
        # protocol (the only one it starts with, without TLS) becomes ours before any byte is read.
        @property
        def protocol(self) -> Any:
            return self._http11_wrapper

        @protocol.setter
        def protocol(self, wrapper: Any) -> None:
            if type(getattr(wrapper, "protocol", None)) is h11_protocol:
                wrapper.protocol.__class__ = Http11Protocol
            self._http11_wrapper = wrapper

    return Http11Server


async def serve(app: Any, config: Any, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
                ) -> None:
    """Serve ``app`` on ``config.bind`` until cancelled; reports the bound URLs."""
    parts = _parts()
    if parts is None:
        from hypercorn.trio import serve as hypercorn_serve

        await hypercorn_serve(app, config, task_status=task_status)
        return
    tcp_server, worker_context, repr_socket_addr, wrap_app = parts
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    sockets = config.create_sockets()  # OSError here: the port is taken, or the address not ours
    listeners, binds = [], []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    context = worker_context(None)

    async def connection(stream: trio.SocketStream) -> None:
        try:
            await tcp_server(wrapped, config, context, {}, DeadlineStream(stream))
        except Exception as exc:  # one connection broke the protocol: it goes, the server stays
            log.warning("dashboard: dropped a connection that broke HTTP or WebSocket (%s: %s)",
                        type(exc).__name__, exc)
            log.debug("dashboard: the dropped connection's error", exc_info=True)
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        task_status.started(binds)
        await trio.serve_listeners(connection, listeners, handler_nursery=nursery)
