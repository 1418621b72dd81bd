"""The direct datagram path: one UDP socket per node, bound on ``--bind``."""

from __future__ import annotations

import errno

import trio

MAX_DATAGRAM = 65_535


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


async def open_udp(bind: str) -> trio.socket.SocketType:
    host, port = parse_addr(bind, allow_port_zero=True)
    family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
    sock = trio.socket.socket(family, trio.socket.SOCK_DGRAM)
    try:
        await sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise BindError(exc.errno, f"cannot bind UDP {bind}: {reason}") from exc
    return sock
