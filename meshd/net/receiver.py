"""The receiving half of the data channel: read frames, acknowledge them, hand messages over.

Chunks from a stream or the relay are opened with the keys we share with the
sender's current process (one that does not open is dropped, unacked and
counted: the sender sends it again) and go to the reassembler, which releases
whole messages in order; acks go back the way the chunks came, held up to
``ack_delay`` so that a burst's acks share a frame.  Messages go to the
``dispatch`` handler (one task at a time per sender, in order), or onto
``received`` while none is set.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from ..logs import Quieted
from ..wire import (
    MAX_FRAME_BYTES,
    MAX_PACKET_BYTES,
    RELAY_DATA,
    DataAck,
    DataChunk,
    Packet,
    WireError,
    decode,
    encode,
)
from .framing import RECV_BYTES, next_frame, prefixed, read_some, write_frame
from .reassembly import ChunkError

if TYPE_CHECKING:
    from .channel import DataChannel

log = logging.getLogger("meshd.channel")

ACKS_PER_PACKET = 256
MAX_BACKLOG = 1024  # messages from one sender waiting for its handler before its reader waits too

Handler = Callable[[bytes, bytes], Awaitable[None]]
# Where acks are owed: the peer, and the stream they go back on (None: the relay).
# Where acks go: back on the stream the data came on, over the relay (None), or as a datagram
# to the address the data came from (a str: a peer sending through a punched NAT).
_AckRoute = tuple[bytes, trio.SocketStream | str | None]
ACKS_PER_DATAGRAM = 48  # an ack datagram stays within one small IP packet


class Receiver:
    """Reads what peers send us, acknowledges it, and gives whole messages to their consumer."""

    def __init__(self, channel: DataChannel) -> None:
        self._ch = channel
        self._recv_send, self.received = trio.open_memory_channel[tuple[bytes, bytes]](
            channel.config.receive_queue
        )
        self._handler: Handler | None = None
        self._inline = False
        self._backlogs: dict[bytes, deque[bytes]] = {}  # per sender: delivered, not yet handled
        self._running: dict[bytes, trio.Event] = {}  # senders whose backlog a task is running
        self._owed: dict[_AckRoute, list[DataAck]] = {}
        self._refusals = Quieted()  # chunks refused, logged per sender

    # ------------------------------------------------------------- reading

    async def read_stream(self, stream: trio.SocketStream, expect: bytes, buf: bytearray) -> None:
        """Read frames from ``expect`` until the stream ends or breaks the protocol; whatever
        handling a frame raises drops this stream only, counted and logged, never the node."""
        try:
            await self._read_frames(stream, expect, buf)
        except Exception:
            self._ch.counters["reader_errors"] += 1
            log.exception("data stream from %s dropped: its frames could not be handled",
                          self._ch.describe(expect))

    async def _read_frames(self, stream: trio.SocketStream, expect: bytes, buf: bytearray) -> None:
        """Read frames from ``expect`` until the stream ends; acks go back on the same stream.

        Every frame that one read brings is handled, its messages delivered,
        and then one packet acknowledges all of them.  ``buf`` holds what the
        handshake read past its last frame.

        What the socket already holds is taken at once when the read before
        went through the scheduler: at stage 0 the last stage's share of the
        head waits there while stage 0 computes its own, and a trip through
        the scheduler before reading it is on every token's critical path.
        Every other read goes through the scheduler, so a stream that always
        has more cannot keep the rest of the node from running.
        """
        eager = False
        while True:
            acks: list[DataAck] = []
            ready: list[tuple[bytes, bytes]] = []
            urgent, bad = self._take_frames(buf, expect, acks, ready)
            self._queue(ready)  # before any wait: in the order the reassembler released them
            # What came whole before a bad frame is ours: the reassembler has moved past it,
            # so it is acked and handed over even when the stream is then dropped.
            # Acks first: they say "received", whatever the handlers then take.
            if acks:
                await self._owe_acks(expect, acks, stream, urgent)
            await self._hand_over(ready, reader=True)
            if bad:
                return
            try:
                data = read_some(stream) if eager else None
                eager = data is None
                if data is None:
                    data = await stream.receive_some(RECV_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            buf += data

    def _take_frames(self, buf: bytearray, expect: bytes, acks: list[DataAck],
                     ready: list[tuple[bytes, bytes]]) -> tuple[bool, bool]:
        """Take every whole frame in ``buf`` (see ``_take``); returns (an ack is asked for at once,
        a frame broke the protocol and the stream is to be dropped)."""
        urgent = False
        while True:
            try:
                data = next_frame(buf)
                if data is None:
                    return urgent, False
                packet = decode(data, MAX_FRAME_BYTES)
            except WireError:
                self._ch.counters["bad_frames"] += 1
                return urgent, True  # not our protocol
            if packet.sender != expect:
                self._ch.counters["bad_frames"] += 1
                return urgent, True
            if self._ch._blocked(packet.sender):
                # A filter on this link would have stopped the handshake.
                self._ch.counters["streams_refused"] += 1
                return urgent, True
            urgent = self._take(packet, acks, ready) or urgent

    async def on_datagram(self, source: str, payload: bytes) -> None:
        """Chunks and acks as datagrams on the gossip socket (a peer behind a NAT we punched,
        or that punched ours).  A chunk proves its sender: it opens only with our pair key.
        An ack does not, so only one from the address our punch opened for its sender counts."""
        try:
            packet = decode(payload[1:], MAX_PACKET_BYTES)
        except WireError:
            self._ch.counters["bad_frames"] += 1
            return
        if packet.sender == self._ch.id:
            return
        if self._ch.punched_addr(packet.sender) != source:
            kept = tuple(m for m in packet.messages if not isinstance(m, DataAck))
            if len(kept) != len(packet.messages):
                self._ch.counters["bad_frames"] += 1
            packet = Packet(packet.sender, kept)
        acks: list[DataAck] = []
        ready: list[tuple[bytes, bytes]] = []
        urgent = self._take(packet, acks, ready)
        self._queue(ready)
        if acks:
            await self._owe_acks(packet.sender, acks, source, urgent)
        await self._hand_over(ready)

    async def on_relay_payload(self, src: bytes, payload: bytes) -> None:
        """A relay frame whose first byte is RELAY_DATA."""
        try:
            packet = decode(payload[1:], MAX_FRAME_BYTES)
        except WireError:
            self._ch.counters["bad_frames"] += 1
            return
        if packet.sender != src:
            self._ch.counters["bad_frames"] += 1  # the relay vouches for src, not for the claim
            return
        acks: list[DataAck] = []
        ready: list[tuple[bytes, bytes]] = []
        urgent = self._take(packet, acks, ready)
        self._queue(ready)  # before any wait: in the order the reassembler released them
        if acks:
            await self._owe_acks(src, acks, None, urgent)
        await self._hand_over(ready)

    def _take(self, packet: Packet, acks: list[DataAck], ready: list[tuple[bytes, bytes]]) -> bool:
        """Take acks and chunks: adds the acks we owe to ``acks`` and whole messages, in order, to
        ``ready``.  True when one of those acks is asked for at once."""
        sender = packet.sender
        urgent = False
        for msg in packet.messages:
            if isinstance(msg, DataAck):
                self._ch._sender.on_ack(sender, msg)
            elif isinstance(msg, DataChunk):
                keys = self._ch.pair_keys(sender)
                plain = None if keys is None else keys.open(msg)
                if plain is None:  # made up, altered, or sealed for another process of ours or its
                    self._ch.counters["rx_data_undecryptable"] += 1
                    log.debug("a chunk from %s does not open: dropped", self._ch.describe(sender))
                    continue
                try:
                    ack, whole = self._ch.reassembler.accept(sender, msg, trio.current_time(), plain)
                except ChunkError as exc:
                    self._ch.counters["bad_frames"] += 1
                    held = self._refusals.due(sender, trio.current_time())
                    if held is not None:
                        more = f" ({held} more refused since, not logged)" if held else ""
                        log.warning("data from %s refused: %s%s", self._ch.describe(sender), exc, more)
                    return urgent
                if ack:
                    acks.append(DataAck(msg.session, msg.msg_id))
                    if msg.ack_now:
                        urgent = True
                ready.extend((sender, data) for data in whole)
        return urgent

    # ------------------------------------------------------------- acks

    async def _owe_acks(
        self, node: bytes, acks: list[DataAck], stream: trio.SocketStream | str | None, now: bool
    ) -> None:
        """Acknowledge within ``ack_delay`` (so a burst's acks share a frame), or at once."""
        route = (node, stream)
        delay = self._ch.config.ack_delay
        if now or delay <= 0:
            await self._send_acks(node, self._owed.pop(route, []) + acks, stream)
            return
        owed = self._owed.get(route)
        if owed is None:
            owed = self._owed[route] = []
            self._ch._spawn(self._flush_acks, route, delay)
        owed.extend(acks)

    async def _flush_acks(self, route: _AckRoute, delay: float) -> None:
        await trio.sleep(delay)
        acks = self._owed.pop(route, None)
        if acks:
            await self._send_acks(route[0], acks, route[1])

    async def _send_acks(self, node: bytes, acks: list[DataAck],
                         stream: trio.SocketStream | str | None) -> None:
        ch = self._ch
        per = ACKS_PER_DATAGRAM if isinstance(stream, str) else ACKS_PER_PACKET
        for start in range(0, len(acks), per):
            data = encode(Packet(ch.id, tuple(acks[start:start + per])))
            try:
                if isinstance(stream, str):
                    if ch.datagram_send is not None:
                        await ch.datagram_send(stream, RELAY_DATA + data)
                elif stream is not None:
                    await write_frame(ch._sender.link(node).stream_lock, stream, prefixed(data))
                elif ch.relay_send is not None and not ch.faults.relay_blocked():
                    await ch.relay_send(node, RELAY_DATA + data)
            except Exception as exc:  # the sender resends; its copy will be acked again
                log.debug("acks %d.. to %s lost: %s", acks[start].msg_id, ch.describe(node), exc)
                return

    # ------------------------------------------------------------- handing over

    def _queue(self, ready: list[tuple[bytes, bytes]]) -> None:
        """Put messages the reassembler released on their senders' backlogs, at once.

        A stream's reader and the relay's loop may both release a sender's
        messages (its path moved); whichever waits first (to ack at once,
        say) must not be overtaken, so nothing waits between release and here.
        """
        for sender, data in ready:
            self._backlogs.setdefault(sender, deque()).append(data)
        self._ch.counters["delivered"] += len(ready)
        self._ch.counters["delivered_bytes"] += sum(len(data) for _, data in ready)

    async def _hand_over(self, ready: list[tuple[bytes, bytes]], *, reader: bool = False,
                         wait: bool = True) -> None:
        """Give the backlogs of ``ready``'s senders (see ``_queue``) to their consumer.

        One task at a time runs a sender's backlog, in order: into the
        ``dispatch`` handler, or without one onto ``received``.

        That task is a new one, so a slow handler (a long prefill) never stops
        a stream being read and acked; or, for a handler dispatched with
        ``inline=True`` (it promises to hand long work to a task of its own),
        the stream's ``reader`` itself, which saves a trip through the
        scheduler per message: on a pipeline's critical path, one per hop.
        A reader waits while its sender's backlog runs elsewhere or holds
        MAX_BACKLOG messages (``wait``); the relay's loop only at MAX_BACKLOG.
        """
        inline = reader and self._inline and self._handler is not None
        for sender in dict.fromkeys(sender for sender, _ in ready):
            backlog = self._backlogs.get(sender)
            if backlog is None:
                continue  # another task ran it dry already
            running = self._running.get(sender)
            if running is None:
                done = self._running[sender] = trio.Event()
                if inline:
                    await self._run_backlog(sender, backlog, done)
                else:
                    self._ch._spawn(self._run_backlog, sender, backlog, done)
            elif wait and (inline or len(backlog) > MAX_BACKLOG):
                await running.wait()

    async def _run_backlog(self, sender: bytes, backlog: deque[bytes], done: trio.Event) -> None:
        try:
            while backlog:
                data = backlog.popleft()
                handler = self._handler  # dispatch() may start while we run
                if handler is None:
                    await self._recv_send.send((sender, data))
                    continue
                try:
                    await handler(sender, data)
                except Exception:  # one message's failure must not stop the rest
                    log.exception("handling a message from %s failed", self._ch.describe(sender))
        finally:
            del self._running[sender]
            if not backlog:
                self._backlogs.pop(sender, None)
            done.set()

    async def dispatch(self, handler: Handler, *, inline: bool = False) -> None:
        self._handler, self._inline = handler, inline
        try:
            # Whatever reached ``received`` before goes first: it is older than anything
            # still in a backlog, which feeds ``received`` in order.
            early: list[tuple[bytes, bytes]] = []
            while True:
                try:
                    early.append(self.received.receive_nowait())
                except trio.WouldBlock:
                    break
            for src, data in reversed(early):
                self._backlogs.setdefault(src, deque()).appendleft(data)
            await self._hand_over(early, wait=False)
            await trio.sleep_forever()
        finally:
            self._handler = None

    async def loopback(self, data: bytes) -> None:
        if self._handler is None:
            raise RuntimeError("loopback() delivers to the dispatch() handler, and none is set")
        ready = [(self._ch.id, data)]
        self._queue(ready)
        await self._hand_over(ready, wait=False)

    async def expire_loop(self) -> None:
        """Drop what peers left unfinished: a message nobody completes must not be held for ever."""
        reassembler = self._ch.reassembler
        while True:
            await trio.sleep(reassembler.idle_expiry / 4)
            dropped = reassembler.expire(trio.current_time())
            if dropped:
                log.info("dropped %d data-channel sessions that made no progress for %gs",
                         dropped, reassembler.idle_expiry)
