"""How the data channel reaches a peer: a dialled, proven stream, or the relay at a steady pace.

Dial policy: one attempt at a time with a per-attempt timeout; a failed or
broken stream is dropped, never reused, and the direct path is not dialled
again for a backoff (doubling, with jitter) while the relay carries the data.
The relay is paced below its per-client rate, so it never drops our chunks.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from ..wire import RELAY_DATA
from .handshake import HANDSHAKE_FAILURES, HandshakeError, dial
from .netem_socket import with_stream_faults

if TYPE_CHECKING:
    from .channel import DataChannel

# The relay may take this much ahead of its rate at once; past it, we keep to the rate.
RELAY_BURST_S = 0.25
PUNCHED_BURST_S = 0.004  # at the punched rate, about 64 KiB: one prefill's activations at once


class PathFailed(Exception):
    """One attempt over one path failed; the reason goes into the DeliveryError."""


class Refused(PathFailed):
    """The peer's host answered the dial with a refusal: nothing listens there now."""


class Unproven(PathFailed):
    """The dial was answered, and the handshake over it failed: the address is reached."""


@dataclass
class Link:
    """How we reach one peer: the stream we dialled, the path in use, the direct path's backoff."""

    stream: trio.SocketStream | None = None
    stream_lock: trio.Lock = field(default_factory=trio.Lock)  # whole frames, one at a time
    dial_lock: trio.Lock = field(default_factory=trio.Lock)
    path: str = "direct"
    direct_retry_at: float = 0.0
    dialing: bool = False  # a background dial of the direct path is under way
    dialed: trio.Event = field(default_factory=trio.Event)  # set when that dial ends, either way
    relay_failed_at: float = float("-inf")  # when a message over the relay last went unacked
    punched_failed_at: float = float("-inf")  # when one over punched datagrams last went unacked
    backoff: float = 0.0
    last_failure: str | None = None
    direct_failure: str | None = None  # why the direct path last failed, a dial or a stream

    def direct_due(self) -> bool:
        return trio.current_time() >= self.direct_retry_at


def _refused(exc: BaseException | None) -> bool:
    """Whether a failed connect was refused (trio wraps each attempt's error in the cause)."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return bool(exc.exceptions) and all(_refused(e) for e in exc.exceptions)
    return exc is not None and exc.__cause__ is not None and _refused(exc.__cause__)


class Dialer:
    """Dials and proves streams to peers, backs off the direct path, and paces the relay."""

    def __init__(self, channel: DataChannel) -> None:
        self._ch = channel
        self._relay_budget_at = 0.0
        self._punched_budget_at = 0.0

    def back_off(self, link: Link) -> None:
        """The direct path to ``link``'s peer failed: wait longer before dialling it again."""
        cfg = self._ch.config
        link.backoff = min(cfg.direct_backoff_max, max(cfg.direct_backoff, link.backoff * 2))
        link.direct_retry_at = trio.current_time() + link.backoff * random.uniform(0.8, 1.2)

    async def stream(self, node: bytes, link: Link) -> trio.SocketStream:
        """``link``'s open stream, or a new one dialled to ``node`` and proven to be it.

        A new stream gets a reader (acks come back on it) and is ``link.stream``
        until it breaks.  Raises PathFailed saying why no stream could be had.
        """
        async with link.dial_lock:
            if link.stream is not None:
                return link.stream
            addr = self._ch.addr_of(node)
            if addr is None:
                raise PathFailed("no known address")
            stream = await self._connect(addr)
            buf = bytearray()
            ch = self._ch
            timeout = ch.config.handshake_timeout
            try:
                with trio.fail_after(timeout):
                    proven = await dial(stream, buf, node, ch.local_end())
            except HANDSHAKE_FAILURES as exc:
                ch.counters["handshake_failures"] += 1
                await stream.aclose()
                reason = str(exc) if isinstance(exc, HandshakeError) else (
                    f"no handshake within {timeout:g}s"
                    if isinstance(exc, trio.TooSlowError) else "the stream broke")
                raise Unproven(f"handshake with {addr} failed: {reason}") from None
            ch._proven(proven)  # a restarted peer's sessions start again before this stream carries any
            link.stream = stream
            link.backoff, link.direct_failure = 0.0, None
            ch._spawn(ch._read_dialled, node, stream, buf, proven.epoch)
            return stream

    async def _connect(self, addr: str) -> trio.SocketStream:
        self._ch.counters["dials"] += 1
        timeout = self._ch.config.dial_timeout
        host, _, port = addr.rpartition(":")
        faults = self._ch.faults
        try:
            with trio.fail_after(timeout):
                if faults.stream_blocked(addr):
                    await trio.sleep_forever()  # the SYN goes nowhere, as behind a filter
                if faults.stream_faults:
                    await trio.sleep(faults.connect_delay())  # our SYN, held as netem would
                stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
        except trio.TooSlowError:
            self._ch.counters["dial_failures"] += 1
            raise PathFailed(f"connect to {addr} timed out after {timeout:g}s") from None
        except OSError as exc:
            self._ch.counters["dial_failures"] += 1
            cls = Refused if _refused(exc) else PathFailed
            raise cls(f"connect to {addr} failed: {exc.strerror or exc}") from None
        return with_stream_faults(stream, faults, self._ch._spawn)

    async def relay(self, node: bytes, frames: Iterable[bytes]) -> None:
        """Send encoded packets to ``node`` through the relay, each as one relay frame."""
        relay_send = self._ch.relay_send
        if relay_send is None:
            raise PathFailed("no relay configured")
        if self._ch.faults.relay_blocked():
            raise PathFailed("relay unreachable (isolated)")
        for data in frames:
            await self._pace(len(data))
            try:
                await relay_send(node, RELAY_DATA + data)
            except Exception as exc:  # RelayError, RelayNotConnected
                raise PathFailed(str(exc)) from None

    async def punched(self, node: bytes, addr: str, frames: Iterable[bytes]) -> None:
        """Send encoded packets to ``node`` as datagrams on the gossip socket, to ``addr``, the
        address a punch through its NAT opened; each packet one datagram, paced."""
        send = self._ch.datagram_send
        if send is None:
            raise PathFailed("no datagram socket")
        for data in frames:
            now = trio.current_time()
            rate = self._ch.config.punched_rate
            self._punched_budget_at = max(self._punched_budget_at, now) + len(data) / rate
            ahead = self._punched_budget_at - now
            if ahead > PUNCHED_BURST_S:  # a burst the peer's socket buffer holds, then the rate
                await trio.sleep(ahead - PUNCHED_BURST_S)
            try:
                await send(addr, RELAY_DATA + data)
            except OSError as exc:
                raise PathFailed(f"datagram to {addr} failed: {exc.strerror or exc}") from None

    async def _pace(self, n: int) -> None:
        """Stay under the relay's per-client rate, so no chunk is dropped there."""
        now = trio.current_time()
        self._relay_budget_at = max(self._relay_budget_at, now) + n / self._ch.config.relay_rate
        ahead = self._relay_budget_at - now
        if ahead > RELAY_BURST_S:  # let a burst through, then keep to the rate
            await trio.sleep(ahead - RELAY_BURST_S)
