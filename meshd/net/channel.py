"""A reliable, ordered message channel to each peer, for activations.

Direct when a TCP stream to the peer completes, else through the relay in
chunks under its frame cap.  Every message carries an id, so it arrives
exactly once and in order even when the path changes halfway through it (see
:mod:`meshd.net.reassembly`).  A send that cannot be delivered fails within
its timeout with an error that names the peer and every path tried.

A direct stream starts with a handshake in which each end proves its node id:
the accepting end sends a nonce (StreamChallenge), the dialler signs it with
its node key and sends a nonce of its own (StreamProof), and the accepting end
signs that back.  Every later frame must come from the proven id, so nobody who
can reach the port can speak for a member, and a dial that reaches someone else
fails as a path failure.

Dial policy: one attempt at a time with a per-attempt timeout; a failed or
broken stream is dropped, never reused, and the direct path is not dialled
again for a backoff (doubling, with jitter) while the relay carries the data.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import trio

from ..identity import prefix, verify
from ..wire import (
    MAX_FRAME_BYTES,
    RELAY_DATA,
    STREAM_NONCE_BYTES,
    DataAck,
    DataChunk,
    Packet,
    StreamChallenge,
    StreamProof,
    WireError,
    decode,
    encode,
)
from .faults import Faults
from .reassembly import ChunkError, Reassembler

log = logging.getLogger("meshd.channel")

# One chunk size for every path, so chunks of a message resent over another
# path line up with those already received.  It fits one relay frame.
CHUNK_BYTES = 63 * 1024
ACKS_PER_PACKET = 256
WINDOW = 256  # messages written ahead of the oldest unacked one
MAX_BACKLOG = 1024  # messages from one sender waiting for its handler before its reader waits too
_LEN = struct.Struct("!I")
# Under malloc's mmap threshold: a 256 KiB receive buffer cost 11 µs per read, 64 KiB under 1 µs.
RECV_BYTES = 64 * 1024


def _write_some(stream: trio.SocketStream, data: bytes) -> int:
    """How many bytes of ``data`` the socket takes now, without waiting (0 when its buffer
    is full).  Raises trio.BrokenResourceError when the stream is broken."""
    try:
        return os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        return 0
    except OSError as exc:  # reset, broken pipe, or closed under us (fd -1)
        raise trio.BrokenResourceError(f"write failed: {exc.strerror or exc}") from None


async def _write(lock: trio.Lock, stream: trio.SocketStream, data: bytes) -> None:
    """Write ``data`` whole to ``stream``; at once when no other writer holds ``lock``.

    A small frame on an idle stream goes straight into the socket buffer,
    without a trip through the scheduler: on a pipeline's critical path every
    such trip is a wait behind whatever else is runnable.  The rest, if the
    buffer is full, goes the usual way, under the lock.
    """
    if not lock.locked():
        sent = _write_some(stream, data)
        if sent == len(data):
            return
        data = data[sent:]
    async with lock:
        await stream.send_all(data)


class DeliveryError(Exception):
    """A message could not be delivered in time; says to whom and over which paths."""


class PathFailed(Exception):
    """One attempt over one path failed; the reason goes into the DeliveryError."""


class HandshakeError(Exception):
    """A stream's handshake did not prove the other end's node id."""


# How a stream's handshake can fail, at either end.
_HANDSHAKE_FAILURES = (HandshakeError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError)


def _proof_data(nonce: bytes, verifier: bytes, prover: bytes) -> bytes:
    """What a stream's end signs: the other end's nonce, and both ids, in their roles."""
    return b"meshd data stream v1\0" + nonce + verifier + prover


def _frame(packet: Packet) -> bytes:
    data = encode(packet, MAX_FRAME_BYTES)
    return _LEN.pack(len(data)) + data


def _next_frame(buf: bytearray) -> bytes | None:
    """The next whole frame, taken off the front of ``buf``; None until one is whole.

    Raises WireError for a length no frame of ours has (not our protocol)."""
    if len(buf) < _LEN.size:
        return None
    (n,) = _LEN.unpack_from(buf)
    if n > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {n} bytes")
    if len(buf) < _LEN.size + n:
        return None
    frame = bytes(buf[_LEN.size:_LEN.size + n])
    del buf[:_LEN.size + n]
    return frame


async def _read_packet(stream: trio.SocketStream, buf: bytearray) -> Packet:
    """The next whole frame from ``stream`` (bytes after it stay in ``buf``), decoded."""
    while True:
        try:
            frame = _next_frame(buf)
            if frame is not None:
                return decode(frame, MAX_FRAME_BYTES)
        except WireError as exc:
            raise HandshakeError(f"not our protocol ({exc})") from None
        data = await stream.receive_some(RECV_BYTES)
        if not data:
            raise HandshakeError("the stream closed")
        buf += data


def _only(packet: Packet, kind: type) -> Any:
    if len(packet.messages) != 1 or not isinstance(packet.messages[0], kind):
        raise HandshakeError(f"expected {kind.__name__} from {prefix(packet.sender)}")
    return packet.messages[0]


@dataclass
class ChannelConfig:
    dial_timeout: float = 1.0
    handshake_timeout: float = 2.0  # for the three frames that prove each end's node id
    ack_timeout: float = 2.0  # after the last chunk is out
    direct_backoff: float = 2.0  # first wait before dialling a failed peer again
    direct_backoff_max: float = 30.0
    relay_rate: float = 6 * 1024 * 1024  # bytes/s we put on the relay (below its limit)
    receive_queue: int = 256
    # How long a receiver may hold an ack so that a burst's acks share a frame.
    # Writers never wait on acks, so this costs no latency; a chunk marked
    # ack_now (send(), resends) is acknowledged at once.  Each ack frame wakes
    # the sender's process: at 25 ms a 3-stage pipeline's links woke a process
    # about once per token, as often as the tokens themselves.
    ack_delay: float = 0.1


@dataclass
class Outgoing:
    """One message on its way: written at once where it can be, then watched until acked."""

    msg_id: int
    data: bytes
    timeout: float
    deadline: float
    session: int
    on_error: Callable[[DeliveryError], Awaitable[None]] | None = None
    urgent: bool = False  # the sender waits on it: ask for the ack at once
    acked: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    written: str | None = None  # the path it was already written to, not yet acked
    writing: bool = False  # post() is writing it now: nobody else should
    path: str | None = None  # the path that delivered it
    error: DeliveryError | None = None


@dataclass
class _Peer:
    # Message ids count up per session; a new session starts the count again (see _renew).
    session: int = field(default_factory=lambda: random.getrandbits(63))
    next_id: int = 1
    stream: trio.SocketStream | None = None
    stream_lock: trio.Lock = field(default_factory=trio.Lock)  # whole frames, one at a time
    dial_lock: trio.Lock = field(default_factory=trio.Lock)
    acks: dict[int, trio.Event] = field(default_factory=dict)
    queue: deque[Outgoing] = field(default_factory=deque)  # unacked, oldest first
    supervised: bool = False  # a task is watching the queue
    retrying: bool = False  # the head of the queue failed a path: no writes ahead of it
    direct_retry_at: float = 0.0
    dialing: bool = False  # a background re-probe of the direct path is under way
    backoff: float = 0.0
    path: str = "direct"
    last_failure: str | None = None
    sent: int = 0


class DataChannel:
    def __init__(
        self,
        node_id: bytes,
        *,
        addr_of: Callable[[bytes], str | None],
        describe: Callable[[bytes], str],
        relay_send: Callable[[bytes, bytes], Awaitable[None]] | None,
        sign: Callable[[bytes], bytes],
        faults: Faults | None = None,
        config: ChannelConfig | None = None,
    ) -> None:
        self.id = node_id
        self.sign = sign
        self.addr_of = addr_of
        self.describe = describe
        self.relay_send = relay_send
        self.faults = faults or Faults()
        self.config = config or ChannelConfig()
        self.reassembler = Reassembler()
        self._peers: dict[bytes, _Peer] = {}
        self._recv_send, self.received = trio.open_memory_channel[tuple[bytes, bytes]](
            self.config.receive_queue
        )
        self._nursery: trio.Nursery | None = None
        self._handler: Callable[[bytes, bytes], Awaitable[None]] | None = None
        self._inline = False
        self._backlogs: dict[bytes, deque[bytes]] = {}  # per sender: delivered, not yet handled
        self._running: dict[bytes, trio.Event] = {}  # senders whose backlog a task is running
        self._owed: dict[tuple[bytes, trio.SocketStream | None], list[DataAck]] = {}
        self._relay_budget_at = 0.0
        self.counters: dict[str, int] = {
            "sent": 0, "delivered": 0, "resent": 0, "bad_frames": 0, "streams_in": 0,
            "streams_refused": 0, "handshake_failures": 0, "dials": 0, "dial_failures": 0,
            "reader_errors": 0,
        }

    # ------------------------------------------------------------- serving

    async def serve(self, listeners, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept streams on ``listeners`` and keep the stream readers running."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(trio.serve_listeners, self._handle_inbound, listeners)
            nursery.start_soon(self._expire_loop)
            task_status.started()

    async def _expire_loop(self) -> None:
        """Drop what peers left unfinished: a message nobody completes must not be held for ever."""
        while True:
            await trio.sleep(self.reassembler.idle_expiry / 4)
            dropped = self.reassembler.expire(trio.current_time())
            if dropped:
                log.info("dropped %d data-channel sessions that made no progress for %gs",
                         dropped, self.reassembler.idle_expiry)

    async def _handle_inbound(self, stream: trio.SocketStream) -> None:
        self.counters["streams_in"] += 1
        async with stream:
            buf = bytearray()
            try:
                with trio.fail_after(self.config.handshake_timeout):
                    dialler = await self._prove_inbound(stream, buf)
            except _HANDSHAKE_FAILURES as exc:
                self.counters["handshake_failures"] += 1
                log.debug("inbound data stream refused: %s", exc or "handshake timed out")
                return
            await self._read_stream(stream, dialler, buf)

    async def _prove_inbound(self, stream: trio.SocketStream, buf: bytearray) -> bytes:
        """Challenge the dialler, check its proof, prove ourselves; returns its node id."""
        nonce = os.urandom(STREAM_NONCE_BYTES)
        await stream.send_all(_frame(Packet(self.id, (StreamChallenge(nonce),))))
        packet = await _read_packet(stream, buf)
        proof = _only(packet, StreamProof)
        if not verify(packet.sender, proof.signature, _proof_data(nonce, self.id, packet.sender)):
            raise HandshakeError(f"{prefix(packet.sender)}'s signature does not verify")
        addr = self.addr_of(packet.sender)
        if addr is not None and self.faults.stream_blocked(addr):
            raise HandshakeError("a fault blocks this link")  # as a filter would have
        signature = self.sign(_proof_data(proof.nonce, packet.sender, self.id))
        await stream.send_all(_frame(Packet(self.id, (StreamProof(nonce, signature),))))
        return packet.sender

    async def _prove_outbound(self, node: bytes, stream: trio.SocketStream, buf: bytearray) -> None:
        """Answer the challenge of the node we dialled, and check that it is that node."""
        packet = await _read_packet(stream, buf)
        challenge = _only(packet, StreamChallenge)
        if packet.sender != node:
            raise HandshakeError(f"the address answers as {prefix(packet.sender)}, not {prefix(node)}")
        nonce = os.urandom(STREAM_NONCE_BYTES)
        signature = self.sign(_proof_data(challenge.nonce, node, self.id))
        await stream.send_all(_frame(Packet(self.id, (StreamProof(nonce, signature),))))
        packet = await _read_packet(stream, buf)
        proof = _only(packet, StreamProof)
        if packet.sender != node or not verify(node, proof.signature, _proof_data(nonce, self.id, node)):
            raise HandshakeError(f"{prefix(node)}'s signature does not verify")

    async def _read_stream(self, stream: trio.SocketStream, expect: bytes, buf: bytearray) -> None:
        """Read frames from ``expect`` until the stream ends or breaks the protocol; whatever
        handling a frame raises drops this stream only, counted and logged, never the node."""
        try:
            await self._read_frames(stream, expect, buf)
        except Exception:
            self.counters["reader_errors"] += 1
            log.exception("data stream from %s dropped: its frames could not be handled",
                          self.describe(expect))

    async def _read_frames(self, stream: trio.SocketStream, expect: bytes, buf: bytearray) -> None:
        """Read frames from ``expect`` until the stream ends; acks go back on the same stream.

        Every frame that one read brings is handled, its messages delivered,
        and then one packet acknowledges all of them.  ``buf`` holds what the
        handshake read past its last frame.
        """
        while True:
            acks: list[DataAck] = []
            ready: list[tuple[bytes, bytes]] = []
            urgent = bad = False
            while True:
                try:
                    frame = _next_frame(buf)
                    if frame is None:
                        break
                    packet = decode(frame, MAX_FRAME_BYTES)
                except WireError:
                    self.counters["bad_frames"] += 1
                    bad = True  # not our protocol: drop the stream
                    break
                if packet.sender != expect:
                    self.counters["bad_frames"] += 1
                    bad = True
                    break
                addr = self.addr_of(packet.sender)
                if addr is not None and self.faults.stream_blocked(addr):
                    # A filter on this link would have stopped the handshake.
                    self.counters["streams_refused"] += 1
                    bad = True
                    break
                urgent = self._take(packet, acks, ready) or urgent
            # What came whole before a bad frame is ours: the reassembler has moved past it,
            # so it is acked and handed over even when the stream is then dropped.
            # Acks first: they say "received", whatever the handlers then take.
            if acks:
                await self._owe_acks(expect, acks, stream, urgent)
            await self._hand_over(ready, reader=True)
            if bad:
                return
            try:
                data = await stream.receive_some(RECV_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            buf += data

    async def on_relay_payload(self, src: bytes, payload: bytes) -> None:
        """A relay frame whose first byte is RELAY_DATA."""
        try:
            packet = decode(payload[1:], MAX_FRAME_BYTES)
        except WireError:
            self.counters["bad_frames"] += 1
            return
        if packet.sender != src:
            self.counters["bad_frames"] += 1  # the relay vouches for src, not for the claim
            return
        acks: list[DataAck] = []
        ready: list[tuple[bytes, bytes]] = []
        urgent = self._take(packet, acks, ready)
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
                peer = self._peer(sender)
                if msg.session != peer.session:
                    continue  # an ack for an earlier session of ours with this peer
                event = peer.acks.get(msg.msg_id)
                if event is not None:
                    event.set()
            elif isinstance(msg, DataChunk):
                try:
                    ack, whole = self.reassembler.accept(sender, msg, trio.current_time())
                except ChunkError as exc:
                    self.counters["bad_frames"] += 1
                    log.warning("data from %s refused: %s", self.describe(sender), exc)
                    return urgent
                if ack:
                    acks.append(DataAck(msg.session, msg.msg_id))
                    if msg.ack_now:
                        urgent = True
                ready.extend((sender, data) for data in whole)
        return urgent

    async def _hand_over(self, ready: list[tuple[bytes, bytes]], *, reader: bool = False,
                         wait: bool = True) -> None:
        """Give messages, released in order by the reassembler, to their consumer.

        Without a handler: onto ``received``.  With one (``dispatch``): each
        message joins its sender's backlog, all of them before anything can
        run, and one task at a time handles a sender's backlog, in order.

        That task is a new one, so a slow handler (a long prefill) never stops
        a stream being read and acked; or, for a handler dispatched with
        ``inline=True`` (it promises to hand long work to a task of its own),
        the stream's ``reader`` itself, which saves a trip through the
        scheduler per message: on a pipeline's critical path, one per hop.
        A reader waits while its sender's backlog runs elsewhere or holds
        MAX_BACKLOG messages (``wait``); the relay's loop only at MAX_BACKLOG.
        """
        if not ready:
            return
        self.counters["delivered"] += len(ready)
        handler = self._handler
        if handler is None:
            for sender, data in ready:
                await self._recv_send.send((sender, data))
            return
        for sender, data in ready:
            self._backlogs.setdefault(sender, deque()).append(data)
        assert self._nursery is not None, "dispatch() needs the channel to be serving"
        inline = reader and self._inline
        for sender in dict.fromkeys(sender for sender, _ in ready):
            backlog = self._backlogs[sender]
            running = self._running.get(sender)
            if running is None:
                done = self._running[sender] = trio.Event()
                if inline:
                    await self._run_backlog(sender, handler, backlog, done)
                else:
                    self._nursery.start_soon(self._run_backlog, sender, handler, backlog, done)
            elif wait and (inline or len(backlog) > MAX_BACKLOG):
                await running.wait()

    async def _run_backlog(
        self,
        sender: bytes,
        handler: Callable[[bytes, bytes], Awaitable[None]],
        backlog: deque[bytes],
        done: trio.Event,
    ) -> None:
        try:
            while backlog:
                data = backlog.popleft()
                try:
                    await handler(sender, data)
                except Exception:  # one message's failure must not stop the rest
                    log.exception("handling a message from %s failed", self.describe(sender))
        finally:
            del self._running[sender]
            if not backlog:
                self._backlogs.pop(sender, None)
            done.set()

    async def dispatch(
        self, handler: Callable[[bytes, bytes], Awaitable[None]], *, inline: bool = False
    ) -> None:
        """Hand every message delivered from now on to ``handler``, until cancelled.

        Each sender's messages are handled in order, one at a time; different
        senders' messages may be handled concurrently (see ``_hand_over``).
        ``inline``: the handler returns quickly (long work goes to a task of
        its own), so stream readers may run it themselves.
        """
        self._handler, self._inline = handler, inline
        try:
            while True:  # whatever reached ``received`` before, first
                try:
                    src, data = self.received.receive_nowait()
                except trio.WouldBlock:
                    break
                self.counters["delivered"] -= 1
                await self._hand_over([(src, data)], wait=False)
            await trio.sleep_forever()
        finally:
            self._handler = None

    async def _owe_acks(
        self, node: bytes, acks: list[DataAck], stream: trio.SocketStream | None, now: bool
    ) -> None:
        """Acknowledge within ``ack_delay`` (so a burst's acks share a frame), or at once."""
        key = (node, stream)
        delay = self.config.ack_delay
        if now or delay <= 0 or self._nursery is None:
            await self._send_acks(node, self._owed.pop(key, []) + acks, stream)
            return
        owed = self._owed.get(key)
        if owed is None:
            owed = self._owed[key] = []
            self._nursery.start_soon(self._flush_acks, key, delay)
        owed.extend(acks)

    async def _flush_acks(self, key: tuple[bytes, trio.SocketStream | None], delay: float) -> None:
        await trio.sleep(delay)
        acks = self._owed.pop(key, None)
        if acks:
            await self._send_acks(key[0], acks, key[1])

    async def _send_acks(self, node: bytes, acks: list[DataAck], stream: trio.SocketStream | None) -> None:
        for start in range(0, len(acks), ACKS_PER_PACKET):
            frame = encode(Packet(self.id, tuple(acks[start:start + ACKS_PER_PACKET])))
            try:
                if stream is not None:
                    await _write(self._peer(node).stream_lock, stream, _LEN.pack(len(frame)) + frame)
                elif self.relay_send is not None and not self.faults.relay_blocked():
                    await self.relay_send(node, RELAY_DATA + frame)
            except Exception as exc:  # the sender resends; its copy will be acked again
                log.debug("acks %d.. to %s lost: %s", acks[start].msg_id, self.describe(node), exc)
                return

    async def loopback(self, data: bytes) -> None:
        """Give ``data`` to our own handler (see ``dispatch``), as if we had sent it.

        Never waits on the handler: the caller may be the very task running it.
        """
        if self._handler is None:
            raise RuntimeError("loopback() delivers to the dispatch() handler, and none is set")
        await self._hand_over([(self.id, data)], wait=False)

    # ------------------------------------------------------------- sending

    async def send(self, node: bytes, data: bytes, timeout: float = 30.0) -> str:
        """Deliver ``data`` to ``node`` exactly once, in order; returns the path that did it."""
        item = await self.post(node, data, timeout, urgent=True)
        await item.done.wait()
        if item.error is not None:
            raise item.error
        assert item.path is not None
        return item.path

    async def post(
        self,
        node: bytes,
        data: bytes,
        timeout: float = 30.0,
        on_error: Callable[[DeliveryError], Awaitable[None]] | None = None,
        *,
        urgent: bool = False,
    ) -> Outgoing:
        """Send ``data`` to ``node`` without waiting for its ack.

        On a working path (an open direct stream, or the relay while direct is
        backed off) the frames are written before this returns, so nothing
        stands between a stage's compute and the socket.  A task per peer then
        waits for the acks, oldest first, and sends again over whatever path
        works; a message not acked by its deadline fails with a
        DeliveryError, given to ``on_error`` and kept on the returned item.
        """
        peer = self._peer(node)
        item = Outgoing(peer.next_id, data, timeout, trio.current_time() + timeout, peer.session, on_error,
                        urgent)
        peer.next_id += 1
        # The one-frame message on an idle stream (every activation of a pipeline) goes into
        # the socket before any bookkeeping: the peer starts reading it while we do that.
        rest = self._write_now(peer, item)
        peer.acks[item.msg_id] = item.acked
        peer.queue.append(item)
        if self._nursery is None:  # no serve(): deliver in the caller's task
            if not peer.supervised:
                peer.supervised = True
                await self._supervise(node, peer)
            return item
        if not peer.supervised:  # before writing: the item's deadline holds whatever happens
            peer.supervised = True
            self._nursery.start_soon(self._supervise, node, peer)
        item.writing = True  # the supervisor, which may run while we wait, leaves it to us
        try:
            if rest is not None:  # half a frame is in the socket: the rest before anything else
                stream = peer.stream
                assert stream is not None
                with trio.move_on_at(item.deadline):
                    try:
                        await self._write_frames(peer, stream, [rest])
                        item.written = "direct"
                    except PathFailed:
                        pass  # the stream is dropped; the supervisor sends it again
            elif item.written is None and not peer.retrying and len(peer.queue) <= WINDOW:
                path, stream = self._choose(node, peer), peer.stream
                with trio.move_on_at(item.deadline):  # a peer that stops reading cannot hold us
                    try:
                        if path == "direct" and stream is not None:
                            await self._write_frames(peer, stream, self._framed(item))
                            item.written = path
                        elif path == "relay":
                            await self._send_relay(node, item)
                            item.written = path
                    except PathFailed:
                        pass  # the supervisor finds it unwritten and sends it again
        finally:
            item.writing = False
        # The frames are out; now let the rest of the node run (acks, the supervisor).
        await trio.lowlevel.checkpoint()
        return item

    def _write_now(self, peer: _Peer, item: Outgoing) -> bytes | None:
        """Write a one-frame message into an idle direct stream, without waiting for anything.

        Sets ``item.written`` when the whole frame went; returns the bytes
        still to write when only part of it did (the stream then holds half a
        frame), else None (also when this path does not apply or failed: the
        usual path, or the supervisor, sends it).
        """
        stream = peer.stream
        if (stream is None or peer.retrying or peer.stream_lock.locked() or len(peer.queue) >= WINDOW
                or len(item.data) > CHUNK_BYTES or self._nursery is None):
            return None
        frame = next(self._framed(item))
        try:
            sent = _write_some(stream, frame)
        except trio.BrokenResourceError:  # as _write_frames would
            self._drop_stream(peer)
            return None
        if sent == 0:
            return None
        if sent == len(frame):
            item.written = "direct"
            return None
        return frame[sent:]

    async def _supervise(self, node: bytes, peer: _Peer) -> None:
        """See each queued message acked, or failed at its deadline, oldest first."""
        try:
            while peer.queue:
                item = peer.queue[0]
                try:
                    item.path = await self._deliver(node, peer, item)
                    peer.path = item.path
                    peer.sent += 1
                    self.counters["sent"] += 1
                except DeliveryError as exc:
                    item.error = exc
                finally:
                    peer.queue.popleft()
                    peer.acks.pop(item.msg_id, None)
                    peer.retrying = False
                if item.error is not None:
                    self._renew(peer)
                item.done.set()
                if item.error is not None and item.on_error is not None:
                    await item.on_error(item.error)
        finally:
            peer.supervised = False

    async def _deliver(self, node: bytes, peer: _Peer, item: Outgoing) -> str:
        tried: list[str] = []
        path = None
        with trio.move_on_at(item.deadline):
            while True:
                if item.acked.is_set():
                    return item.written or peer.path
                if item.written is not None:
                    path = item.written  # on the wire: wait for its ack
                else:
                    path = self._choose(node, peer)
                    if tried:
                        self.counters["resent"] += 1
                    try:
                        # Until none is left unwritten: messages posted while this one dialled
                        # would otherwise wait for its ack.
                        while (ahead := self._unwritten(peer)) is not None:
                            ahead.urgent = True  # a resend: learn soon whether this path works
                            if path == "direct":
                                await self._send_direct(node, peer, ahead)
                            else:
                                await self._send_relay(node, ahead)
                            ahead.written = path
                    except PathFailed as exc:
                        tried.append(f"{path}: {exc}")
                        self._path_failed(node, peer, path, str(exc))
                        if path == "relay" and not self._direct_due(peer):
                            await trio.sleep(0.2)  # both down: don't spin
                        continue
                with trio.move_on_after(self.config.ack_timeout):
                    await item.acked.wait()
                if item.acked.is_set():
                    return path
                reason = f"no ack within {self.config.ack_timeout:g}s"
                tried.append(f"{path}: {reason}")
                self._path_failed(node, peer, path, reason)
        if path is not None and not (tried and tried[-1].startswith(path)):
            tried.append(f"{path}: no ack before the deadline")
        raise DeliveryError(
            f"could not deliver message {item.msg_id} ({len(item.data)} bytes) to {self.describe(node)} "
            f"within {item.timeout:g}s; tried: {'; '.join(tried[-6:]) or 'nothing (no path available)'}"
        )

    @staticmethod
    def _unwritten(peer: _Peer) -> Outgoing | None:
        """The oldest message in the window that is neither on the wire, being written, nor acked."""
        for item in itertools.islice(peer.queue, WINDOW):
            if item.written is None and not item.writing and not item.acked.is_set():
                return item
        return None

    def _renew(self, peer: _Peer) -> None:
        """After a message to ``peer`` failed: a new session, and every message behind it again.

        The receiver delivers in id order, so it would wait for the failed id
        for ever, holding (and acking) everything after it.  None of those can
        have been delivered; in a new session they are numbered from 1 and sent
        again, and the receiver starts its count afresh.
        """
        peer.session = random.getrandbits(63)
        peer.acks.clear()
        for n, item in enumerate(peer.queue, start=1):
            item.session, item.msg_id, item.written = peer.session, n, None
            item.acked = peer.acks[n] = trio.Event()
        peer.next_id = len(peer.queue) + 1

    def _choose(self, node: bytes, peer: _Peer) -> str:
        if peer.stream is not None or self.relay_send is None:
            return "direct"
        if peer.path == "direct" and self._direct_due(peer):
            return "direct"
        if self._direct_due(peer) and not peer.dialing and self._nursery is not None:
            # Re-probe direct in the background; the relay carries this message.
            peer.dialing = True
            self._nursery.start_soon(self._probe_direct, node, peer)
        return "relay"

    async def _probe_direct(self, node: bytes, peer: _Peer) -> None:
        try:
            await self._stream(node, peer)
        except PathFailed as exc:
            self._path_failed(node, peer, "direct", str(exc))
        else:
            peer.path = "direct"
        finally:
            peer.dialing = False

    def _direct_due(self, peer: _Peer) -> bool:
        return trio.current_time() >= peer.direct_retry_at

    def _path_failed(self, node: bytes, peer: _Peer, path: str, reason: str) -> None:
        peer.last_failure = f"{path}: {reason}"
        peer.retrying = True
        for item in peer.queue:
            if item.written == path:
                item.written = None
        if path == "direct":
            self._drop_stream(peer)
            cfg = self.config
            peer.backoff = min(cfg.direct_backoff_max, max(cfg.direct_backoff, peer.backoff * 2))
            peer.direct_retry_at = trio.current_time() + peer.backoff * random.uniform(0.8, 1.2)
            if self.relay_send is not None:
                peer.path = "relay"

    def _drop_stream(self, peer: _Peer) -> None:
        if peer.stream is not None:
            stream, peer.stream = peer.stream, None
            for item in peer.queue:  # unacked on a stream that is gone: send again
                if item.written == "direct":
                    item.written = None
            if self._nursery is not None:
                self._nursery.start_soon(stream.aclose)

    async def _stream(self, node: bytes, peer: _Peer) -> trio.SocketStream:
        async with peer.dial_lock:
            if peer.stream is not None:
                return peer.stream
            addr = self.addr_of(node)
            if addr is None:
                raise PathFailed("no known address")
            self.counters["dials"] += 1
            timeout = self.config.dial_timeout
            host, _, port = addr.rpartition(":")
            try:
                with trio.fail_after(timeout):
                    if self.faults.stream_blocked(addr):
                        await trio.sleep_forever()  # the SYN goes nowhere, as behind a filter
                    stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
            except trio.TooSlowError:
                self.counters["dial_failures"] += 1
                raise PathFailed(f"connect to {addr} timed out after {timeout:g}s") from None
            except OSError as exc:
                self.counters["dial_failures"] += 1
                raise PathFailed(f"connect to {addr} failed: {exc.strerror or exc}") from None
            buf = bytearray()
            try:
                with trio.fail_after(self.config.handshake_timeout):
                    await self._prove_outbound(node, stream, buf)
            except _HANDSHAKE_FAILURES as exc:
                self.counters["handshake_failures"] += 1
                await stream.aclose()
                reason = str(exc) if isinstance(exc, HandshakeError) else (
                    f"no handshake within {self.config.handshake_timeout:g}s"
                    if isinstance(exc, trio.TooSlowError) else "the stream broke")
                raise PathFailed(f"handshake with {addr} failed: {reason}") from None
            peer.stream = stream
            peer.backoff = 0.0
            if self._nursery is not None:
                self._nursery.start_soon(self._read_outbound, node, peer, stream, buf)
            return stream

    async def _read_outbound(
        self, node: bytes, peer: _Peer, stream: trio.SocketStream, buf: bytearray
    ) -> None:
        """Acks come back on the stream we dialled; its end means it is broken."""
        await self._read_stream(stream, node, buf)
        if peer.stream is stream:
            self._drop_stream(peer)
        await stream.aclose()

    async def _send_direct(self, node: bytes, peer: _Peer, item: Outgoing) -> None:
        await self._write_frames(peer, await self._stream(node, peer), self._framed(item))

    async def _write_frames(self, peer: _Peer, stream: trio.SocketStream, frames: Iterable[bytes]) -> None:
        """Write length-prefixed ``frames`` whole; a stream left holding part of one is dropped."""
        whole = False
        try:
            for frame in frames:
                await _write(peer.stream_lock, stream, frame)
            whole = True
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise PathFailed(f"stream broke while sending ({exc.__class__.__name__})") from None
        finally:
            if not whole and peer.stream is stream:
                self._drop_stream(peer)  # it may hold half a frame: nothing after it would parse

    async def _send_relay(self, node: bytes, item: Outgoing) -> None:
        if self.relay_send is None:
            raise PathFailed("no relay configured")
        if self.faults.relay_blocked():
            raise PathFailed("relay unreachable (isolated)")
        for frame in self._frames(item):
            await self._pace(len(frame))
            try:
                await self.relay_send(node, RELAY_DATA + frame)
            except Exception as exc:  # RelayError, RelayNotConnected
                raise PathFailed(str(exc)) from None

    async def _pace(self, n: int) -> None:
        """Stay under the relay's per-client rate, so no chunk is dropped there."""
        now = trio.current_time()
        self._relay_budget_at = max(self._relay_budget_at, now) + n / self.config.relay_rate
        ahead = self._relay_budget_at - now
        if ahead > 0.25:  # let a burst through, then keep to the rate
            await trio.sleep(ahead - 0.25)

    def _frames(self, item: Outgoing):
        total = len(item.data)
        view = memoryview(item.data)
        for offset in range(0, max(total, 1), CHUNK_BYTES):
            chunk = bytes(view[offset:offset + CHUNK_BYTES])
            msg = DataChunk(item.session, item.msg_id, total, offset, chunk, item.urgent)
            yield encode(Packet(self.id, (msg,)), MAX_FRAME_BYTES)

    def _framed(self, item: Outgoing) -> Iterator[bytes]:
        """``_frames`` with the length prefix of a stream."""
        for frame in self._frames(item):
            yield _LEN.pack(len(frame)) + frame

    def _peer(self, node: bytes) -> _Peer:
        peer = self._peers.get(node)
        if peer is None:
            peer = self._peers[node] = _Peer()
        return peer

    def path(self, node: bytes) -> str:
        """The path our messages to ``node`` take now ("direct" until we know better)."""
        peer = self._peers.get(node)
        return "direct" if peer is None else peer.path

    def view(self, node: bytes) -> dict:
        peer = self._peers.get(node)
        if peer is None:
            return {"data_out": None, "data_sent": 0, "data_last_failure": None}
        return {"data_out": peer.path, "data_sent": peer.sent, "data_last_failure": peer.last_failure}
