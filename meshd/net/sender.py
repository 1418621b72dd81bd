"""The sending half of the data channel: per-peer sessions, the send window, and its supervisor.

Every message to a peer carries its session and an id counting up from 1, so
the receiver delivers it exactly once and in order whatever path each chunk
took.  ``post`` writes a message at once where a path works; a task per peer
(the supervisor) then sees each one acked, oldest first, sends again over
whatever path works, and fails a message at its deadline.  Every chunk is
sealed for the peer's current process where its frame is made (see
:mod:`.data_keys`); while we know no key of that process, nothing is written
and the message waits, as an unacked one does.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from ..wire import MAX_FRAME_BYTES, DataAck, DataChunk, Packet, encode
from .data_keys import PairKeys
from .dialer import Dialer, Link, PathFailed, Refused, Unproven
from .framing import prefixed, write_frame, write_some

if TYPE_CHECKING:
    from .channel import DataChannel

# One chunk size for every path, so chunks of a message resent over another
# path line up with those already received.  It fits one relay frame, sealed.
CHUNK_BYTES = 63 * 1024
WINDOW = 256  # messages written ahead of the oldest unacked one
# Through a punched NAT, chunks go as datagrams: each one small enough for one IP packet
# anywhere, and no message larger than this goes that way (the stream or the relay takes it).
PUNCHED_CHUNK_BYTES = 1024
PUNCHED_MAX_BYTES = 1024 * 1024
PUNCHED_RETRY_S = 10.0  # after a message over punched datagrams went unacked
NO_KEY_WAIT_S = 0.2  # how often a message waits to learn the key of the peer's new process
# A message with no path at all to its peer this long fails then, not at its deadline: no
# stream, every dial since unanswered (not refused: a process gone or restarting is told
# apart), and no relay or punched way that reaches it.  Whoever sent it can go another way
# (a replica) at once.  A lossy link keeps its stream, or dials that get through; a dial is
# one SYN and its resends, so several failing in a row say the way is cut.
NO_PATH_GIVE_UP_S = 8.0
# Between two tries of a path that failed at once, when no other path is left to try.
RETRY_PAUSE_S = 0.2


class DeliveryError(Exception):
    """A message could not be delivered in time; says to whom and over which paths."""


class NoPeerKey(PathFailed):
    """We know no X25519 key of the peer's current process yet, so nothing can be sealed for it."""


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
    gone_with: str | None = None  # why the process it was sent to went away unacked: it fails now


@dataclass
class _Peer:
    link: Link = field(default_factory=Link)
    # Message ids count up per session; a new session starts the count again (see _renew).
    session: int = field(default_factory=lambda: random.getrandbits(63))
    next_id: int = 1
    acks: dict[int, trio.Event] = field(default_factory=dict)
    queue: deque[Outgoing] = field(default_factory=deque)  # unacked, oldest first
    supervised: bool = False  # a task is watching the queue
    retrying: bool = False  # the head of the queue failed a path: no writes ahead of it
    sent: int = 0


class Sender:
    """Our sessions to every peer: what is on its way, and the task that sees it acked."""

    def __init__(self, channel: DataChannel, dialer: Dialer) -> None:
        self._ch = channel
        self._dialer = dialer
        self._peers: dict[bytes, _Peer] = {}

    def _peer(self, node: bytes) -> _Peer:
        peer = self._peers.get(node)
        if peer is None:
            peer = self._peers[node] = _Peer()
        return peer

    def link(self, node: bytes) -> Link:
        return self._peer(node).link

    def path(self, node: bytes) -> str:
        """The path our next message to ``node`` takes, as ``_choose`` would pick it.

        Before any message, or while a dial runs, that is "direct" unless the probes
        already say our packets reach the peer only over the relay (``_choose`` then
        goes there at once).
        """
        peer = self._peers.get(node)
        if peer is not None and peer.link.stream is not None:
            return "direct"
        if self._punched_ok(peer.link if peer is not None else None, node):
            return "punched"
        if self._ch.relay_send is not None and self._ch.relay_reaches(node) and (
                self._ch.datagram_path(node) == "relay"):
            return "relay"
        return "direct" if peer is None else peer.link.path

    def view(self, node: bytes) -> dict[str, Any]:
        peer = self._peers.get(node)
        if peer is None:
            return {"data_out": None, "data_sent": 0, "data_last_failure": None}
        link = peer.link
        # What carries our data to it now: the path our newest unacked message went out on,
        # else the path in use (the one that delivered the last, or the stream proven since);
        # None while none went (a peer we only ack, or a new process of it nothing reached yet).
        written = next((item.written for item in reversed(peer.queue) if item.written), None)
        out = written or (link.path if peer.sent else None)
        return {"data_out": out, "data_sent": peer.sent, "data_last_failure": link.last_failure}

    def on_ack(self, node: bytes, ack: DataAck) -> None:
        peer = self._peers.get(node)
        if peer is None or ack.session != peer.session:
            return  # not ours, or for an older session of ours with this peer
        event = peer.acks.get(ack.msg_id)
        if event is not None:
            event.set()

    def restart(self, node: bytes) -> None:
        """``node`` runs a new process: nothing we sent its old one counts any more.

        Its stream to the old process goes, and every unacked message is sent
        again in a new session, which the new process numbers from 1 as we do.
        A new process is also a new chance for the direct path: no backoff, and
        nothing of the old process's paths is held against it.
        """
        peer = self._peers.get(node)
        if peer is None:
            return
        self.drop_stream(peer)
        link = peer.link
        link.backoff = link.direct_retry_at = 0.0
        # What its old process's paths did says nothing of the new one's: the snapshot shows
        # no data path to it (and no failure) until a message of ours reaches it.
        link.path, link.last_failure, link.direct_failure, peer.sent = "direct", None, None, 0
        self._renew(peer)

    def process_gone(self, node: bytes, why: str) -> None:
        """``node``'s process is gone (``why``: its stream ended and its port refused a dial).

        What we sent it unacked went with it: each such message fails now, saying so,
        not at its deadline, when a new process of it may long be serving.  A message
        posted from now on waits, as ever, for a process that takes it.
        """
        peer = self._peers.get(node)
        if peer is None or not peer.queue:
            return
        for item in peer.queue:
            item.gone_with = why
            old, item.acked = item.acked, trio.Event()  # wake a supervisor waiting on its ack
            peer.acks[item.msg_id] = item.acked
            old.set()

    async def send(self, node: bytes, data: bytes, timeout: float) -> str:
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
        timeout: float,
        on_error: Callable[[DeliveryError], Awaitable[None]] | None = None,
        *,
        urgent: bool = False,
    ) -> Outgoing:
        peer = self._peer(node)
        item = Outgoing(peer.next_id, data, timeout, trio.current_time() + timeout, peer.session, on_error,
                        urgent)
        peer.next_id += 1
        # The one-frame message on an idle stream (every activation of a pipeline) goes into
        # the socket before any bookkeeping: the peer starts reading it while we do that.
        rest = self._write_now(node, peer, item)
        peer.acks[item.msg_id] = item.acked
        peer.queue.append(item)
        if not peer.supervised:  # before writing: the item's deadline holds whatever happens
            self._ch._spawn(self._supervise, node, peer)
            peer.supervised = True
        if rest is not None or (item.written is None and not peer.retrying and len(peer.queue) <= WINDOW):
            # Something to write (a cancel scope costs a pipeline hop a few microseconds: only then).
            item.writing = True  # the supervisor, which may run while we wait, leaves it to us
            try:
                with trio.move_on_at(item.deadline):  # a peer that stops reading cannot hold us
                    await self._write_first(node, peer, item, rest)
            finally:
                item.writing = False
        # The frames are out; now let the rest of the node run (acks, the supervisor).
        await trio.lowlevel.checkpoint()
        return item

    async def _write_first(self, node: bytes, peer: _Peer, item: Outgoing, rest: bytes | None) -> None:
        """Write the ``rest`` of ``item``'s frame, or all of ``item`` over the path in use (the
        caller checked nothing stands before it); a failure is left to the supervisor, which
        finds it unwritten and sends it again."""
        session = item.session
        try:
            if rest is not None:  # half a frame is in the socket: the rest before anything else
                stream = peer.link.stream
                assert stream is not None
                await self._write_frames(peer, stream, [rest])
                path: str | None = "direct"
            else:
                path = await self._choose(node, peer, len(item.data))
                stream = peer.link.stream
                if path == "direct" and stream is not None:
                    await self._write_frames(peer, stream, self._framed(node, item))
                elif path in ("relay", "punched"):
                    await self._write_datagrams(node, path, item)
                else:
                    path = None
        except PathFailed:
            return  # the stream is dropped; the supervisor sends it again
        if path is not None and item.session == session:  # not renumbered while we wrote
            item.written = path

    def _write_now(self, node: bytes, peer: _Peer, item: Outgoing) -> bytes | None:
        """Write a one-frame message into an idle direct stream, without waiting for anything.

        Sets ``item.written`` when the whole frame went; returns the bytes
        still to write when only part of it did (the stream then holds half a
        frame), else None (also when this path does not apply or failed: the
        usual path, or the supervisor, sends it).
        """
        stream = peer.link.stream
        if (stream is None or peer.retrying or peer.link.stream_lock.locked() or len(peer.queue) >= WINDOW
                or len(item.data) > CHUNK_BYTES):
            return None
        try:
            frame = next(self._framed(node, item))
        except NoPeerKey:
            return None
        try:
            sent = write_some(stream, frame)
        except trio.BrokenResourceError:  # as _write_frames would
            self.drop_stream(peer)
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
                    # The path in use from now on: this message's, unless a stream came up
                    # since it was written (it went over the relay while the dial ran past
                    # its grace), which carries the next one.
                    peer.link.path = "direct" if peer.link.stream is not None else item.path
                    peer.sent += 1
                    self._ch.counters["sent"] += 1
                    self._ch.counters["sent_bytes"] += len(item.data)
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
        cut_since: float | None = None  # since when no path at all reaches the peer
        with trio.move_on_at(item.deadline):
            while True:
                if item.acked.is_set():
                    return item.written or peer.link.path
                if item.gone_with is not None:
                    raise DeliveryError(
                        f"could not deliver message {item.msg_id} ({len(item.data)} bytes) to "
                        f"{self._ch.describe(node)}: its process went away before acking it "
                        f"({item.gone_with})")
                if item.written is not None:
                    path = item.written  # on the wire: wait for its ack
                else:
                    path = await self._choose(node, peer, len(item.data))
                    if tried:
                        self._ch.counters["resent"] += 1
                    try:
                        await self._send_unwritten(node, peer, path)
                    except PathFailed as exc:
                        tried.append(f"{path}: {exc}")
                        # Cut off: nothing answered (a stream that broke, a dial refused or
                        # answered and a handshake failed each show a path to the host).
                        cut = (not isinstance(exc, NoPeerKey | Refused | Unproven)
                               and self._cut_off(node, peer))
                        self._path_failed(peer, path, str(exc))
                        if not cut:
                            cut_since = None
                        elif cut_since is None:
                            cut_since = trio.current_time()
                        elif trio.current_time() - cut_since >= NO_PATH_GIVE_UP_S:
                            raise DeliveryError(
                                f"could not deliver message {item.msg_id} ({len(item.data)} bytes) to "
                                f"{self._ch.describe(node)}: no path reaches it for "
                                f"{trio.current_time() - cut_since:.0f}s; tried: "
                                f"{_counted([*tried, *self._no_relay(node)])}") from None
                        if isinstance(exc, NoPeerKey):
                            await trio.sleep(NO_KEY_WAIT_S)  # until membership or a handshake says it
                        elif path == "relay" and not peer.link.direct_due():
                            await trio.sleep(RETRY_PAUSE_S)  # both down: don't spin
                        elif path == "direct" and (self._ch.relay_send is None
                                                   or not self._ch.relay_reaches(node)):
                            # The dial is all there is: one refused or hung up on comes back at
                            # once, so it is tried again after a pause, not in a spin.
                            await trio.sleep(RETRY_PAUSE_S)
                        continue
                    cut_since = None  # written: a path reached it
                acked = item.acked
                with trio.move_on_after(self._ch.config.ack_timeout):
                    await acked.wait()
                if item.acked.is_set():
                    return path
                if item.acked is not acked:
                    continue  # renumbered into a new session (see _renew): send it again
                reason = f"no ack within {self._ch.config.ack_timeout:g}s"
                tried.append(f"{path}: {reason}")
                self._path_failed(peer, path, reason)
        if path is not None and not (tried and tried[-1].startswith(path)):
            tried.append(f"{path}: no ack before the deadline")
        failure = peer.link.direct_failure
        if failure and not any(t.startswith("direct") for t in tried):
            tried.append(f"direct: {failure}")  # the dial that ran in the background meanwhile
        if not any(t.startswith("relay") for t in tried):
            tried += self._no_relay(node)
        down = self._ch.down_since(node)
        if down is not None:  # what it waited for: a new process of the peer, which never came
            tried.append(f"no process of it since one went away {trio.current_time() - down:.0f}s before "
                         "(its stream ended and its port refused a dial)")
        raise DeliveryError(
            f"could not deliver message {item.msg_id} ({len(item.data)} bytes) to {self._ch.describe(node)} "
            f"within {item.timeout:g}s; tried: {_counted(tried) or 'nothing (no path available)'}"
        )

    def _no_relay(self, node: bytes) -> list[str]:
        """Why no relay carries our data to ``node`` now, as an attempt's words (none: one does)."""
        if self._ch.relay_send is None:
            return ["relay: none configured"]
        if not self._ch.relay_reaches(node):
            return ["relay: none of ours reaches it now"]
        return []

    def _cut_off(self, node: bytes, peer: _Peer) -> bool:
        """No path reaches ``node`` now: no stream, no punched way, no relay that reaches it."""
        if peer.link.stream is not None or self._punched_ok(peer.link, node):
            return False
        return self._ch.relay_send is None or not self._ch.relay_reaches(node)

    async def _send_unwritten(self, node: bytes, peer: _Peer, path: str) -> None:
        """Write every message in the window that is not on the wire yet, over ``path``.

        Not only the oldest: messages posted while it dialled would otherwise wait for its ack.
        """
        while (ahead := self._unwritten(peer)) is not None:
            ahead.urgent = True  # a resend: learn soon whether this path works
            if path == "direct":
                stream = await self._dialer.stream(node, peer.link)
                session = ahead.session
                await self._write_frames(peer, stream, self._framed(node, ahead))
            else:
                session = ahead.session
                await self._write_datagrams(node, path, ahead)
            if ahead.session == session:  # not renumbered while we wrote
                ahead.written = path

    @staticmethod
    def _unwritten(peer: _Peer) -> Outgoing | None:
        """The oldest message in the window that is neither on the wire, being written, nor acked."""
        for item in itertools.islice(peer.queue, WINDOW):
            if item.written is None and not item.writing and not item.acked.is_set():
                return item
        return None

    def _renew(self, peer: _Peer) -> None:
        """A new session with ``peer``, and every message in the queue in it, again.

        After a message failed: the receiver delivers in id order, so it would
        wait for the failed id for ever, holding (and acking) everything after
        it.  After the peer restarted: its new process never saw our ids.
        Either way none of the queued messages can have been delivered; in the
        new session they are numbered from 1 and sent again, and the receiver
        starts its count afresh.  A supervisor waiting on an old id's ack is
        woken (its old event set) to send it again at once.
        """
        peer.session = random.getrandbits(63)
        peer.acks.clear()
        for n, item in enumerate(peer.queue, start=1):
            old = item.acked
            item.session, item.msg_id, item.written = peer.session, n, None
            item.acked = peer.acks[n] = trio.Event()
            old.set()
        peer.next_id = len(peer.queue) + 1

    async def _write_datagrams(self, node: bytes, path: str, item: Outgoing) -> None:
        """``item`` over the relay, or as datagrams through the peer's punched NAT (one too large
        for that goes over the relay)."""
        addr = self._ch.punched_addr(node) if path == "punched" else None
        if addr is not None and len(item.data) <= PUNCHED_MAX_BYTES:
            await self._dialer.punched(node, addr, self._frames(node, item, PUNCHED_CHUNK_BYTES))
        elif path == "punched" and self._ch.relay_send is None:
            raise PathFailed("its punched address went, and there is no relay")
        else:
            await self._dialer.relay(node, self._frames(node, item))

    def _punched_ok(self, link: Link | None, node: bytes) -> bool:
        """Whether data to ``node`` may go as datagrams through its punched NAT: a punch opened
        it, and nothing sent that way went unacked lately."""
        if self._ch.datagram_send is None or self._ch.punched_addr(node) is None:
            return False
        return link is None or trio.current_time() - link.punched_failed_at >= PUNCHED_RETRY_S

    async def _choose(self, node: bytes, peer: _Peer, size: int = 0) -> str:
        """The path for the next write to ``node`` (of a message of ``size`` bytes).

        The direct stream once it is up.  Without one, a direct dial runs in the background
        and the relay carries the message: at once if the direct path is known to fail (our
        last dial failed, or our datagrams to the peer go over the relay), else after a short
        grace for the dial (a direct path that works is taken from the first message on).
        Without a relay that reaches the peer, or right after the relay failed it, the dial is
        waited for.
        """
        link = peer.link
        if link.stream is None and size <= PUNCHED_MAX_BYTES and self._punched_ok(link, node):
            # Its NAT lets our datagrams in: they carry it while a dial is tried (a NAT that
            # lets a dial in is rare; a stream, when one comes up, is taken from then on).
            if link.direct_due() and not link.dialing:
                link.dialing, link.dialed = True, trio.Event()
                self._ch._spawn(self._probe_direct, node, peer)
            return "punched"
        if link.stream is not None or self._ch.relay_send is None or not self._ch.relay_reaches(node):
            return "direct"
        if link.direct_due() and not link.dialing:
            link.dialing, link.dialed = True, trio.Event()
            self._ch._spawn(self._probe_direct, node, peer)
        relay_failed = trio.current_time() - link.relay_failed_at < self._ch.config.ack_timeout
        if relay_failed and link.dialing:
            await link.dialed.wait()  # the relay just failed it: the dial under way is the hope
            if link.stream is not None:
                return "direct"
        if relay_failed and link.direct_due():
            return "direct"
        if link.dialing and link.path == "direct" and self._ch.datagram_path(node) != "relay":
            with trio.move_on_after(self._ch.config.direct_grace):
                await link.dialed.wait()
            if link.stream is not None:
                return "direct"
        return "relay"

    async def _probe_direct(self, node: bytes, peer: _Peer) -> None:
        """Dial ``node`` in the background; the next message takes the stream once it is up."""
        try:
            await self._dialer.stream(node, peer.link)
        except PathFailed as exc:
            self._direct_failed(peer, str(exc))
        else:
            peer.link.path = "direct"
        finally:
            peer.link.dialing = False
            peer.link.dialed.set()

    def _path_failed(self, peer: _Peer, path: str, reason: str) -> None:
        """A message over ``path`` failed: it, and what else went that way unacked, go again."""
        peer.retrying = True
        for item in peer.queue:
            if item.written == path:
                item.written = None
        if path == "direct":
            self._direct_failed(peer, reason)
        elif path == "punched":
            peer.link.punched_failed_at = trio.current_time()
            peer.link.last_failure = f"{path}: {reason}"
            if self._ch.relay_send is not None:
                peer.link.path = "relay"  # what the message, sent again, takes now
        else:
            peer.link.relay_failed_at = trio.current_time()
            peer.link.last_failure = f"{path}: {reason}"

    def _direct_failed(self, peer: _Peer, reason: str) -> None:
        """The direct path failed (a dial, or a stream): back off it; the relay carries on."""
        link = peer.link
        link.last_failure, link.direct_failure = f"direct: {reason}", reason
        self.drop_stream(peer)
        self._dialer.back_off(link)
        if self._ch.relay_send is not None and link.path != "punched":
            # A dial tried beside the punched path (see _choose) leaves that path in use.
            link.path = "relay"

    def drop_stream(self, peer: _Peer) -> None:
        """Close the stream we dialled to ``peer``; what it carried unacked is sent again."""
        stream, peer.link.stream = peer.link.stream, None
        if stream is None:
            return
        for item in peer.queue:
            if item.written == "direct":
                item.written = None
        self._ch._spawn(stream.aclose)

    def stream_ended(self, node: bytes, stream: trio.SocketStream) -> None:
        """The stream we dialled to ``node`` ended (its reader saw the end or a bad frame)."""
        peer = self._peers.get(node)
        if peer is not None and peer.link.stream is stream:
            self.drop_stream(peer)

    async def _write_frames(self, peer: _Peer, stream: trio.SocketStream, frames: Iterable[bytes]) -> None:
        """Write length-prefixed ``frames`` whole; a stream left holding part of one is dropped."""
        whole = False
        try:
            for data in frames:
                await write_frame(peer.link.stream_lock, stream, data)
            whole = True
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise PathFailed(f"stream broke while sending ({exc.__class__.__name__})") from None
        finally:
            if not whole and peer.link.stream is stream:
                self.drop_stream(peer)  # it may hold half a frame: nothing after it would parse

    def _frames(self, node: bytes, item: Outgoing, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """``item`` as encoded packets of one chunk each, all in the session it has now, every
        chunk sealed for ``node``'s current process.

        Raises NoPeerKey, before any frame, while we know no key of that process:
        nothing goes in clear.
        """
        keys = self._ch.pair_keys(node)
        if keys is None:
            raise NoPeerKey("no data key for its current process yet (its X25519 key is not known)")
        return self._sealed(keys, item, chunk_bytes)

    def _sealed(self, keys: PairKeys, item: Outgoing, chunk_bytes: int) -> Iterator[bytes]:
        session, msg_id, total = item.session, item.msg_id, len(item.data)
        view = memoryview(item.data)
        for offset in range(0, max(total, 1), chunk_bytes):
            chunk = keys.seal(session, msg_id, total, offset, view[offset:offset + chunk_bytes])
            msg = DataChunk(session, msg_id, total, offset, chunk, item.urgent)
            yield encode(Packet(self._ch.id, (msg,)), MAX_FRAME_BYTES)

    def _framed(self, node: bytes, item: Outgoing) -> Iterator[bytes]:
        """``_frames`` as stream frames (raises NoPeerKey as it does, before any frame)."""
        return map(prefixed, self._frames(node, item))


def _counted(tried: list[str], most: int = 6) -> str:
    """The attempts in order, each different one once with how often it failed in a row
    (``direct: connect to … timed out after 1s (x6)``); the last ``most`` of those."""
    runs: list[list] = []
    for attempt in tried:
        if runs and runs[-1][0] == attempt:
            runs[-1][1] += 1
        else:
            runs.append([attempt, 1])
    return "; ".join(text if n == 1 else f"{text} (x{n})" for text, n in runs[-most:])
