"""The dashboard's HTTP server: Hypercorn's connections, each one isolated from the others.

Hypercorn on trio runs every connection in one nursery, so an exception raised
inside Hypercorn for one connection ends the whole server, and with it the
node: a WebSocket upgrade followed at once by bytes that are not frames makes
h11 raise ``LocalProtocolError`` there.  Here each connection runs under its
own ``except``: the error is logged, that connection dropped, the server goes on.

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


def _parts() -> tuple[Any, Any, Any, Any] | None:
    """(TCPServer, WorkerContext, repr_socket_addr, wrap_app) if they are the expected ones."""
    try:
        from hypercorn.trio.tcp_server import TCPServer
        from hypercorn.trio.worker_context import WorkerContext
        from hypercorn.utils import repr_socket_addr, wrap_app
    except ImportError:
        return None
    if list(inspect.signature(TCPServer).parameters) != _TCP_SERVER_PARAMETERS:
        return None
    return TCPServer, WorkerContext, repr_socket_addr, wrap_app


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
            await tcp_server(wrapped, config, context, {}, stream)
        except Exception as exc:  # one connection broke the protocol: it goes, the server stays
            log.warning("dashboard: dropped a connection that broke HTTP or WebSocket (%s: %s)",
                        type(exc).__name__, exc)
            log.debug("dashboard: the dropped connection's error", exc_info=True)
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        task_status.started(binds)
        await trio.serve_listeners(connection, listeners, handler_nursery=nursery)
