"""The direct datagram path: one UDP socket per node, bound on ``--bind``."""

from __future__ import annotations

import contextlib
import errno

import trio

MAX_DATAGRAM = 65_535
RECEIVE_BUFFER_BYTES = 4 * 1024 * 1024


class AddressError(ValueError):
    """A HOST:PORT string that cannot be used."""


def parse_addr(text: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``, with a message a user can act on."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise AddressError(f"{text!r} is not HOST:PORT")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise AddressError(f"{text!r}: port {port_text!r} is not a number") from None
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise AddressError(f"{text!r}: port {port} is out of range")
    return host, port


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class BindError(OSError):
    """The node could not bind its socket; the message names the address."""


def first_of(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """``exc`` if it is a ``kind``, else the first ``kind`` in it (exception groups, nested)."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_of(inner, kind)
            if found is not None:
                return found
    return None


async def open_udp(bind: str) -> trio.socket.SocketType:
    host, port = parse_addr(bind, allow_port_zero=True)
    family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
    sock = trio.socket.socket(family, trio.socket.SOCK_DGRAM)
    # Room for a burst of data datagrams to a peer behind a punched NAT (a prefill's
    # activations); the kernel caps it at net.core.rmem_max, which is also fine.
    with contextlib.suppress(OSError):
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
    try:
        await sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise BindError(exc.errno, f"cannot bind UDP {bind}: {reason}") from exc
    return sock


async def open_udp_and_tcp(
    bind: str, attempts: int = 20
) -> tuple[trio.socket.SocketType, list[trio.SocketListener]]:
    """A UDP socket and TCP listeners on the same port (gossip and the data stream).

    With port 0, the port the kernel picks for UDP may be taken for TCP; then
    we try again with a fresh one.
    """
    host, port = parse_addr(bind, allow_port_zero=True)
    for _ in range(attempts if port == 0 else 1):
        sock = await open_udp(bind)
        bound = sock.getsockname()[1]
        try:
            listeners = await trio.open_tcp_listeners(bound, host=host)
        except OSError as exc:
            sock.close()
            if port == 0 and exc.errno == errno.EADDRINUSE:
                continue
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise BindError(exc.errno, f"cannot bind TCP {format_addr(host, bound)}: {reason}") from exc
        return sock, listeners
    raise BindError(errno.EADDRINUSE, f"cannot find a port free for both UDP and TCP on {host}")
