"""A reliable, ordered message channel to each peer, for activations.

Direct when a TCP stream to the peer completes, else through the relay in
chunks under its frame cap.  Every message carries an id, so it arrives
exactly once and in order even when the path changes halfway through it (see
:mod:`meshd.net.reassembly`).  A send that cannot be delivered fails within
its timeout with an error that names the peer and every path tried.

Dial policy: one attempt at a time with a per-attempt timeout; a failed or
broken stream is dropped, never reused, and the direct path is not dialled
again for a backoff (doubling, with jitter) while the relay carries the data.
"""

from __future__ import annotations

import logging
import random
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from ..wire import MAX_FRAME_BYTES, DataAck, DataChunk, Packet, WireError, decode, encode
from .faults import Faults
from .reassembly import ChunkError, Reassembler

log = logging.getLogger("meshd.channel")

# One chunk size for every path, so chunks of a message resent over another
# path line up with those already received.  It fits one relay frame.
CHUNK_BYTES = 63 * 1024
RELAY_DATA = b"D"  # first byte of a relay payload that carries the data channel
_LEN = struct.Struct("!I")


class DeliveryError(Exception):
    """A message could not be delivered in time; says to whom and over which paths."""


class PathFailed(Exception):
    """One attempt over one path failed; the reason goes into the DeliveryError."""


@dataclass
class ChannelConfig:
    dial_timeout: float = 1.0
    ack_timeout: float = 2.0  # after the last chunk is out
    direct_backoff: float = 2.0  # first wait before dialling a failed peer again
    direct_backoff_max: float = 30.0
    relay_rate: float = 6 * 1024 * 1024  # bytes/s we put on the relay (below its limit)
    receive_queue: int = 256


@dataclass
class _Peer:
    next_id: int = 1
    stream: trio.SocketStream | None = None
    stream_lock: trio.Lock = field(default_factory=trio.Lock)  # whole frames, one at a time
    dial_lock: trio.Lock = field(default_factory=trio.Lock)
    acks: dict[int, trio.Event] = field(default_factory=dict)
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
        faults: Faults | None = None,
        config: ChannelConfig | None = None,
    ) -> None:
        self.id = node_id
        self.addr_of = addr_of
        self.describe = describe
        self.relay_send = relay_send
        self.faults = faults or Faults()
        self.config = config or ChannelConfig()
        self.reassembler = Reassembler()
        self.session = random.getrandbits(63)
        self._peers: dict[bytes, _Peer] = {}
        self._recv_send, self.received = trio.open_memory_channel[tuple[bytes, bytes]](
            self.config.receive_queue
        )
        self._nursery: trio.Nursery | None = None
        self._relay_budget_at = 0.0
        self.counters: dict[str, int] = {
            "sent": 0, "delivered": 0, "resent": 0, "bad_frames": 0, "streams_in": 0,
            "streams_refused": 0, "dials": 0, "dial_failures": 0,
        }

    # ------------------------------------------------------------- serving

    async def serve(self, listeners, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Accept streams on ``listeners`` and keep the stream readers running."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(trio.serve_listeners, self._handle_inbound, listeners)
            task_status.started()

    async def _handle_inbound(self, stream: trio.SocketStream) -> None:
        self.counters["streams_in"] += 1
        async with stream:
            await self._read_stream(stream, None)

    async def _read_stream(self, stream: trio.SocketStream, expect: bytes | None) -> None:
        """Read frames until the stream ends; acks go back on the same stream."""
        buf = bytearray()
        while True:
            try:
                data = await stream.receive_some(256 * 1024)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            buf += data
            while len(buf) >= _LEN.size:
                (n,) = _LEN.unpack_from(buf)
                if n > MAX_FRAME_BYTES:
                    self.counters["bad_frames"] += 1
                    return  # not our protocol: drop the stream
                if len(buf) < _LEN.size + n:
                    break
                frame = bytes(buf[_LEN.size:_LEN.size + n])
                del buf[:_LEN.size + n]
                try:
                    packet = decode(frame, MAX_FRAME_BYTES)
                except WireError:
                    self.counters["bad_frames"] += 1
                    return
                if expect is not None and packet.sender != expect:
                    self.counters["bad_frames"] += 1
                    return
                addr = self.addr_of(packet.sender)
                if addr is not None and self.faults.stream_blocked(addr):
                    # A filter on this link would have stopped the handshake.
                    self.counters["streams_refused"] += 1
                    return
                await self._on_packet(packet, stream)

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
        await self._on_packet(packet, None)

    async def _on_packet(self, packet: Packet, stream: trio.SocketStream | None) -> None:
        sender = packet.sender
        for msg in packet.messages:
            if isinstance(msg, DataAck):
                if msg.session != self.session:
                    continue  # an ack for a previous run of ours
                event = self._peer(sender).acks.get(msg.msg_id)
                if event is not None:
                    event.set()
            elif isinstance(msg, DataChunk):
                try:
                    ack, ready = self.reassembler.accept(sender, msg)
                except ChunkError as exc:
                    self.counters["bad_frames"] += 1
                    log.warning("data from %s refused: %s", self.describe(sender), exc)
                    return
                if ack:
                    await self._send_ack(sender, msg.session, msg.msg_id, stream)
                for data in ready:
                    self.counters["delivered"] += 1
                    await self._recv_send.send((sender, data))

    async def _send_ack(
        self, node: bytes, session: int, msg_id: int, stream: trio.SocketStream | None
    ) -> None:
        frame = encode(Packet(self.id, (DataAck(session, msg_id),)))
        try:
            if stream is not None:
                async with self._peer(node).stream_lock:
                    await stream.send_all(_LEN.pack(len(frame)) + frame)
            elif self.relay_send is not None and not self.faults.relay_blocked():
                await self.relay_send(node, RELAY_DATA + frame)
        except Exception as exc:  # the sender resends; its copy will be acked again
            log.debug("ack %d to %s lost: %s", msg_id, self.describe(node), exc)

    # ------------------------------------------------------------- sending

    async def send(self, node: bytes, data: bytes, timeout: float = 30.0) -> str:
        """Deliver ``data`` to ``node`` exactly once, in order; returns the path that did it."""
        peer = self._peer(node)
        msg_id = peer.next_id
        peer.next_id += 1
        acked = peer.acks[msg_id] = trio.Event()
        tried: list[str] = []
        deadline = trio.current_time() + timeout
        path = None
        try:
            with trio.move_on_at(deadline):
                while True:
                    path = self._choose(node, peer)
                    if tried:
                        self.counters["resent"] += 1
                    try:
                        with trio.move_on_at(deadline):
                            if path == "direct":
                                await self._send_direct(node, peer, msg_id, data)
                            else:
                                await self._send_relay(node, msg_id, data)
                    except PathFailed as exc:
                        tried.append(f"{path}: {exc}")
                        self._path_failed(node, peer, path, str(exc))
                        if path == "relay" and not self._direct_due(peer):
                            await trio.sleep(0.2)  # both down: don't spin
                        continue
                    with trio.move_on_after(self.config.ack_timeout):
                        await acked.wait()
                    if acked.is_set():
                        peer.path = path
                        peer.sent += 1
                        self.counters["sent"] += 1
                        return path
                    reason = f"no ack within {self.config.ack_timeout:g}s"
                    tried.append(f"{path}: {reason}")
                    self._path_failed(node, peer, path, reason)
        finally:
            peer.acks.pop(msg_id, None)
        if path is not None and not (tried and tried[-1].startswith(path)):
            tried.append(f"{path}: no ack before the deadline")
        raise DeliveryError(
            f"could not deliver message {msg_id} ({len(data)} bytes) to {self.describe(node)} "
            f"within {timeout:g}s; tried: {'; '.join(tried[-6:]) or 'nothing (no path available)'}"
        )

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
            peer.stream = stream
            peer.backoff = 0.0
            if self._nursery is not None:
                self._nursery.start_soon(self._read_outbound, node, peer, stream)
            return stream

    async def _read_outbound(self, node: bytes, peer: _Peer, stream: trio.SocketStream) -> None:
        """Acks come back on the stream we dialled; its end means it is broken."""
        await self._read_stream(stream, node)
        if peer.stream is stream:
            peer.stream = None
        await stream.aclose()

    async def _send_direct(self, node: bytes, peer: _Peer, msg_id: int, data: bytes) -> None:
        stream = await self._stream(node, peer)
        try:
            for frame in self._frames(msg_id, data):
                async with peer.stream_lock:
                    await stream.send_all(_LEN.pack(len(frame)) + frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise PathFailed(f"stream broke while sending ({exc.__class__.__name__})") from None

    async def _send_relay(self, node: bytes, msg_id: int, data: bytes) -> None:
        if self.relay_send is None:
            raise PathFailed("no relay configured")
        if self.faults.relay_blocked():
            raise PathFailed("relay unreachable (isolated)")
        for frame in self._frames(msg_id, data):
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

    def _frames(self, msg_id: int, data: bytes):
        total = len(data)
        view = memoryview(data)
        for offset in range(0, max(total, 1), CHUNK_BYTES):
            chunk = bytes(view[offset:offset + CHUNK_BYTES])
            msg = DataChunk(self.session, msg_id, total, offset, chunk)
            yield encode(Packet(self.id, (msg,)), MAX_FRAME_BYTES)

    def _peer(self, node: bytes) -> _Peer:
        peer = self._peers.get(node)
        if peer is None:
            peer = self._peers[node] = _Peer()
        return peer

    def view(self, node: bytes) -> dict:
        peer = self._peers.get(node)
        if peer is None:
            return {"data_out": None, "data_sent": 0, "data_last_failure": None}
        return {"data_out": peer.path, "data_sent": peer.sent, "data_last_failure": peer.last_failure}
