"""A reliable, ordered message channel to each peer, for activations.

Direct when a TCP stream to the peer completes, else through the relay in
chunks under its frame cap.  Every message carries an id, so it arrives
exactly once and in order even when the path changes halfway through it (see
:mod:`meshd.net.reassembly`).  A send that cannot be delivered fails within
its timeout with an error that names the peer and every path tried.

``DataChannel`` is the one entry point; its parts each hold one concern:
:mod:`.framing` (frames on a stream), :mod:`.handshake` (each end proves its
node id and says its process epoch and key), :mod:`.data_keys` (the keys each
pair of processes shares, and sealing chunks with them), :mod:`.receiver`
(reading, opening, acks, handing messages over), :mod:`.sender` (sessions, the
send window, its supervisor) and :mod:`.dialer` (dialling, backoff, relay
pacing).

Every chunk is encrypted end to end, whichever path carries it: sealed by the
sender with the key it shares with the receiver's current process, opened by
the receiver before reassembly.  A peer's process key comes from a stream
handshake or from its (signed) metadata; until we know the one of its current
process nothing goes to it, and a chunk that does not open is dropped unacked
(the sender sends it again), counted as ``rx_data_undecryptable``.

Each process draws a random epoch.  A handshake that shows a known node id
with a new epoch means the peer restarted: every session with it starts
again at once, so nothing waits for message ids its old process took along.
A process found gone (its stream ended and its port refused a dial) took what
we sent it unacked along: those messages fail then, not at their deadline.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from ..bounded import evict_one
from ..keyring import Keyring
from .data_keys import BadPeerKey, PairKeys, ProcessKeys
from .dialer import Dialer, PathFailed, Refused
from .faults import Faults
from .handshake import HANDSHAKE_FAILURES, LocalEnd, Proven, accept
from .netem_socket import with_stream_faults
from .reassembly import Reassembler
from .receiver import Handler, Receiver
from .sender import CHUNK_BYTES, DeliveryError, Outgoing, Sender

__all__ = ["CHUNK_BYTES", "ChannelConfig", "DataChannel", "DeliveryError", "Outgoing"]

log = logging.getLogger("meshd.channel")

# Peers whose epoch we keep: enough for any mesh, bounded against strangers with fresh keys.
MAX_EPOCHS = 4096

# Inbound streams held at once, in all and from one node id.  A member holds one or two (a
# new one when it dials again after a break); on a mesh without a key anyone can prove a
# fresh node id.  Past the first bound a stranger's oldest stream goes first; past the
# second, that peer's oldest.
MAX_INBOUND_STREAMS = 512
MAX_INBOUND_PER_PEER = 4
# Inbound connections still in their handshake.  Each holds a socket for up to the handshake
# timeout before it has proved anything, so a stranger who keeps opening connections would
# otherwise hold as many sockets as the process may open (and then none is left for our own
# dials, the relay or the dashboard).  Past the bound, the oldest one from the address that
# holds the most goes: a member's handshake takes a round trip, a stranger's waits out the timeout.
MAX_PENDING_HANDSHAKES = 128


@dataclass
class ChannelConfig:
    dial_timeout: float = 1.0
    handshake_timeout: float = 2.0  # for the three frames that prove each end's node id
    ack_timeout: float = 2.0  # after the last chunk is out
    direct_backoff: float = 2.0  # first wait before dialling a failed peer again
    direct_backoff_max: float = 30.0
    relay_rate: float = 6 * 1024 * 1024  # bytes/s we put on the relay (below its limit)
    punched_rate: float = 16 * 1024 * 1024  # bytes/s of datagrams to a peer behind a punched NAT
    receive_queue: int = 256
    # How long a receiver may hold an ack so that a burst's acks share a frame.
    # Writers never wait on acks, so this costs no latency; a chunk marked
    # ack_now (send(), resends) is acknowledged at once.  Each ack frame wakes
    # the sender's process: at 25 ms a 3-stage pipeline's links woke a process
    # about once per token, as often as the tokens themselves.
    ack_delay: float = 0.1
    # With no stream yet to a peer we believe reachable directly, a message waits this long
    # for the dial, then goes over the relay while the dial goes on (Happy Eyeballs, RFC 8305).
    direct_grace: float = 0.03


# After a stream with a peer ends: how many dials tell whether it is down, how far apart.
DOWN_CHECKS = 3
DOWN_CHECK_GAP_S = 0.1


class DataChannel:
    """Messages to and from every peer, each delivered exactly once and in order.

    Runs inside ``serve()``: sending and receiving both need its tasks.
    """

    def __init__(
        self,
        node_id: bytes,
        *,
        addr_of: Callable[[bytes], str | None],
        describe: Callable[[bytes], str],
        relay_send: Callable[[bytes, bytes], Awaitable[None]] | None,
        relay_reaches: Callable[[bytes], bool] | None = None,
        datagram_path: Callable[[bytes], str] | None = None,
        punched_addr: Callable[[bytes], str | None] | None = None,
        datagram_send: Callable[[str, bytes], Awaitable[None]] | None = None,
        sign: Callable[[bytes], bytes],
        faults: Faults | None = None,
        config: ChannelConfig | None = None,
        epoch: int | None = None,
        keyring: Keyring | None = None,
        encrypt: bool = True,
        member: Callable[[bytes], bool] | None = None,
    ) -> None:
        """``keyring``: the mesh key, which every stream handshake must then prove.
        ``member``: whether a node id is a live member (its streams are the last to go when
        the inbound streams are at their bound); every node counts as one without it.
        ``encrypt=False`` sends chunks in clear, for ``bench/`` to measure what encryption
        costs (both ends must agree); nothing else may turn it off."""
        self.id = node_id
        self.sign = sign
        self.addr_of = addr_of
        self.describe = describe
        self.relay_send = relay_send
        # Whether a relay reaches the peer now (a relay we both hold is connected); without it,
        # every peer counts as reachable whenever we have a relay.
        self.relay_reaches = relay_reaches or (lambda node: relay_send is not None)
        # The path our datagrams to the peer take (its probes' verdict): "relay" means a direct
        # dial is likely to time out, so data goes over the relay at once while it is tried.
        self.datagram_path = datagram_path or (lambda node: "direct")
        # Where a punch through the peer's NAT opened a way for our datagrams (None: nowhere), and
        # how a datagram goes out on the gossip socket: the path for data a stream cannot carry
        # to a peer behind a NAT (see Sender._choose).
        self.punched_addr = punched_addr or (lambda node: None)
        self.datagram_send = datagram_send
        self.faults = faults or Faults()
        self.config = config or ChannelConfig()
        self.epoch = random.getrandbits(63) if epoch is None else epoch
        self.member = member or (lambda node: True)
        self.keys = ProcessKeys(node_id, self.epoch, encrypt=encrypt,  # drawn per process, as the epoch
                                member=lambda node: self.member(node))
        self.keyring = keyring
        self._inbound: dict[trio.SocketStream, bytes] = {}  # inbound streams -> peer, oldest first
        self._evicted: set[trio.SocketStream] = set()  # closed by _make_room, their readers not yet out
        self._pending: dict[trio.SocketStream, str] = {}  # inbound, in their handshake -> peer host
        self.reassembler = Reassembler(member=lambda node: self.member(node))
        self.counters: dict[str, int] = {
            "sent": 0, "delivered": 0, "resent": 0, "bad_frames": 0, "streams_in": 0,
            "streams_refused": 0, "handshake_failures": 0, "dials": 0, "dial_failures": 0,
            "reader_errors": 0, "peer_restarts": 0, "peers_down": 0, "rx_data_undecryptable": 0,
            "bad_peer_keys": 0, "streams_evicted": 0, "handshakes_evicted": 0,
            "sent_bytes": 0, "delivered_bytes": 0,  # message payload bytes
        }
        self._down: dict[bytes, float] = {}  # peers whose process looks gone, since when
        self._checking: set[bytes] = set()
        self._epochs: OrderedDict[bytes, int] = OrderedDict()  # least recently proven first
        self._nursery: trio.Nursery | None = None
        self._serving = trio.Event()
        self._dialer = Dialer(self)
        self._sender = Sender(self, self._dialer)
        self._receiver = Receiver(self)

    @property
    def public_key(self) -> bytes:
        """This process's X25519 public key, for our metadata (``Meta.dh``)."""
        return self.keys.public

    def local_end(self) -> LocalEnd:
        """Who we are in a stream handshake."""
        return LocalEnd(self.id, self.epoch, self.sign, self.keys, self.keyring)

    @property
    def received(self) -> trio.MemoryReceiveChannel[tuple[bytes, bytes]]:
        """``(sender, message)`` for every message delivered while no ``dispatch`` handler is set."""
        return self._receiver.received

    # ------------------------------------------------------------- serving

    async def serve(
        self,
        listeners: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept streams on ``listeners``, and run the channel's tasks, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(trio.serve_listeners, self._handle_inbound, listeners)
            nursery.start_soon(self._receiver.expire_loop)
            self._serving.set()
            task_status.started()

    def _spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` as one of the channel's tasks."""
        if self._nursery is None:
            raise RuntimeError("the data channel is not serving: start DataChannel.serve() first")
        self._nursery.start_soon(fn, *args)

    async def _handle_inbound(self, stream: trio.SocketStream) -> None:
        self.counters["streams_in"] += 1
        raw = stream
        stream = with_stream_faults(stream, self.faults, self._spawn)  # our writes on it held, as netem would
        async with stream:
            buf = bytearray()
            self._make_pending_room()
            self._pending[raw] = _peer_host(raw)
            try:
                with trio.fail_after(self.config.handshake_timeout):
                    proven = await accept(stream, buf, self.local_end(), self._blocked)
            except HANDSHAKE_FAILURES as exc:
                self.counters["handshake_failures"] += 1
                log.debug("inbound data stream refused: %s", exc or "handshake timed out")
                return
            finally:
                self._pending.pop(raw, None)
            node = proven.node_id
            if not self._make_room(node):
                self.counters["streams_refused"] += 1
                log.info("inbound data stream from %s refused: %d streams held, all members'",
                         self.describe(node), len(self._inbound))
                return
            self._proven(proven)
            self._inbound[stream] = node
            try:
                await self._receiver.read_stream(stream, node, buf)
            finally:
                self._inbound.pop(stream, None)
                evicted = stream in self._evicted
                self._evicted.discard(stream)
            if evicted:
                return  # we closed it to make room: it says nothing of the peer
        self._stream_lost(proven.node_id, proven.epoch)

    def _make_room(self, node: bytes) -> bool:
        """Room for one more inbound stream from ``node``: the oldest of its own past
        MAX_INBOUND_PER_PEER, then a stranger's oldest past MAX_INBOUND_STREAMS (a member's
        oldest, for a member, when only members' are held).  False: a stranger finds none."""
        own = [stream for stream, peer in self._inbound.items() if peer == node]
        if len(own) >= MAX_INBOUND_PER_PEER:
            self._close_inbound(own[0])
        if len(self._inbound) < MAX_INBOUND_STREAMS:
            return True
        victim = next((stream for stream, peer in self._inbound.items() if not self.member(peer)), None)
        if victim is None:
            if not self.member(node):
                return False
            victim = next(iter(self._inbound))
        self._close_inbound(victim)
        return True

    def _make_pending_room(self) -> None:
        """Room for one more connection in its handshake: past MAX_PENDING_HANDSHAKES, close the
        oldest one from the host that has the most in theirs."""
        if len(self._pending) < MAX_PENDING_HANDSHAKES:
            return
        busiest = Counter(self._pending.values()).most_common(1)[0][0]
        victim = next(stream for stream, host in self._pending.items() if host == busiest)
        del self._pending[victim]
        victim.socket.close()  # its handshake fails at its next read or write
        self.counters["handshakes_evicted"] += 1

    def _close_inbound(self, stream: trio.SocketStream) -> None:
        """Close an inbound stream to make room.  Its socket closes, not its reader's task: a
        message the reader hands over now (acked already) is handled to its end, and the
        reader stops at its next read."""
        self._inbound.pop(stream, None)  # counted out now
        self._evicted.add(stream)
        stream.socket.close()
        self.counters["streams_evicted"] += 1

    async def _read_dialled(self, node: bytes, stream: trio.SocketStream, buf: bytearray, epoch: int
                            ) -> None:
        """Acks come back on the stream we dialled; its end means it is broken."""
        try:
            await self._receiver.read_stream(stream, node, buf)
        finally:  # cancelled too: a stopped node's streams close, as a process's do when it exits
            current = self._sender.link(node).stream is stream  # not one we dropped ourselves
            self._sender.stream_ended(node, stream)
            with trio.CancelScope(shield=True):
                await stream.aclose()
        if current:
            self._stream_lost(node, epoch)

    # ------------------------------------------------------------- peers down

    def is_down(self, node: bytes) -> bool:
        """Whether ``node``'s process looks gone: a stream with it ended and its data port
        refused our dial since.  A stream it proves again, or a new epoch, clears it."""
        return node in self._down

    def down_since(self, node: bytes) -> float | None:
        """When ``node`` started to look down (trio time), or None."""
        return self._down.get(node)

    def _stream_lost(self, node: bytes, epoch: int) -> None:
        """A stream with ``node``'s process ``epoch`` ended: dial it at once to learn whether
        it still runs.

        A killed process's streams end at once, and its port refuses the next dial;
        that is known in a round trip, long before failure detection could say it."""
        if node not in self._down and node not in self._checking and self.addr_of(node) is not None:
            self._checking.add(node)
            self._spawn(self._check_down, node, epoch)

    async def _check_down(self, node: bytes, epoch: int) -> None:
        """Dial ``node`` until it answers (it runs), refuses (it is down), or DOWN_CHECKS
        attempts fail otherwise (unreachable directly: failure detection decides).

        A dying process closes its sockets one by one: a dial can land between its stream's
        end and its listener's, be accepted by the kernel, and break in the handshake.  The
        next dial, a moment later, is refused."""
        try:
            for _ in range(DOWN_CHECKS):
                try:
                    await self._dialer.stream(node, self._sender.link(node))
                    return
                except Refused as exc:
                    if self._epochs.get(node) != epoch:
                        return  # a newer process of it has proven itself: the ended one is gone
                    self._down[node] = trio.current_time()
                    self.counters["peers_down"] += 1
                    self._sender.process_gone(node, f"its stream ended and {exc}")
                    # News only while the mesh holds it live: of a peer that left or died,
                    # its member line has said so.
                    if self.member(node):
                        log.info("%s looks down: its stream ended and %s", self.describe(node), exc)
                    return
                except PathFailed:
                    await trio.sleep(DOWN_CHECK_GAP_S)
        finally:
            self._checking.discard(node)

    def _blocked(self, node: bytes) -> bool:
        """A fault blocks streams with ``node``, as a packet filter on that link would."""
        addr = self.addr_of(node)
        return addr is not None and self.faults.stream_blocked(addr)

    # ------------------------------------------------------------- epochs

    def peer_epoch(self, node: bytes) -> int | None:
        """The process epoch of ``node`` our data with it is sealed for: the last a stream
        handshake proved or its signed metadata said (``note_epoch``); None before either."""
        return self._epochs.get(node)

    def _proven(self, proven: Proven) -> None:
        """Record the process a handshake proved; a new epoch for a known node id is a restart."""
        self._down.pop(proven.node_id, None)
        self.note_epoch(proven.node_id, proven.epoch, proven.dh)

    def note_epoch(self, node: bytes, epoch: int, dh: bytes = b"") -> None:
        """``node`` runs as process ``epoch`` with X25519 public key ``dh`` (empty: not said),
        as a handshake proved or its own signed metadata says: a new epoch for a known node
        id resets every session with it at once; data to and from that process is sealed
        with keys derived from ``dh``, and waits until we know it."""
        if dh:
            try:
                self.keys.pair(node, epoch, dh)
            except BadPeerKey as exc:
                self.counters["bad_peer_keys"] += 1
                log.warning("%s's process key is unusable (%s): no data to or from it until it says "
                            "another", self.describe(node), exc)
        known = self._epochs.pop(node, None)
        self._epochs[node] = epoch
        if len(self._epochs) > MAX_EPOCHS:
            evict_one(self._epochs, self.member)  # a stranger's before a member's
        if known == epoch:
            return
        self._down.pop(node, None)  # whatever looked down was another process
        if known is None:
            return
        self.counters["peer_restarts"] += 1
        log.info("%s restarted (a new process epoch): its data-channel sessions start again",
                 self.describe(node))
        self.reassembler.drop_unfinished(node)
        self._sender.restart(node)

    def pair_keys(self, node: bytes) -> PairKeys | None:
        """The keys we share with ``node``'s current process; None until we know its key."""
        return self.keys.current(node, self._epochs.get(node))

    # ------------------------------------------------------------- receiving

    async def on_datagram(self, source: str, payload: bytes) -> None:
        """A datagram on the gossip socket, from ``source``, whose first byte is RELAY_DATA."""
        if not self._serving.is_set():
            await self._serving.wait()
        await self._receiver.on_datagram(source, payload)

    async def on_relay_payload(self, src: bytes, payload: bytes) -> None:
        """A relay frame whose first byte is RELAY_DATA."""
        if not self._serving.is_set():  # a wait on a set event still costs a scheduler round
            await self._serving.wait()  # the relay's loop may start before serve()
        await self._receiver.on_relay_payload(src, payload)

    async def dispatch(self, handler: Handler, *, inline: bool = False) -> None:
        """Hand every message delivered from now on to ``handler``, until cancelled.

        Each sender's messages are handled in order, one at a time; different
        senders' messages may be handled concurrently.  A task per sender runs
        them, so a slow handler never stops a stream being read and acked;
        ``inline``: the handler returns quickly (long work goes to a task of
        its own), so stream readers may run it themselves, which saves a trip
        through the scheduler per message.
        """
        await self._receiver.dispatch(handler, inline=inline)

    async def loopback(self, data: bytes) -> None:
        """Give ``data`` to our own handler (see ``dispatch``), as if we had sent it.

        Never waits on the handler: the caller may be the very task running it.
        """
        await self._receiver.loopback(data)

    # ------------------------------------------------------------- sending

    async def send(self, node: bytes, data: bytes, timeout: float = 30.0) -> str:
        """Deliver ``data`` to ``node`` exactly once, in order; returns the path that did it."""
        return await self._sender.send(node, data, timeout)

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
        return await self._sender.post(node, data, timeout, on_error, urgent=urgent)

    def path(self, node: bytes) -> str:
        """The path our messages to ``node`` take now ("direct" until we know better)."""
        return self._sender.path(node)

    def view(self, node: bytes) -> dict[str, Any]:
        """Our data path to ``node``, for the snapshot: in use, messages sent, the last failure."""
        return self._sender.view(node)


def _peer_host(stream: trio.SocketStream) -> str:
    """The address a connection comes from ("" once it cannot be read)."""
    try:
        return str(stream.socket.getpeername()[0])
    except OSError:
        return ""
