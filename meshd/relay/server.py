"""The relay server: WebSocket frames between authenticated nodes, STUN over UDP.

One TCP listener (WebSocket) and one UDP socket (STUN binding) on the same
port number.  Each client proves it owns its NodeId by signing a fresh nonce;
then its ``Send`` frames go to the destination's queue as ``Recv`` frames.

The connections are :mod:`.wsconn`'s: each client's task reads its frames and
forwards each one inline, written into the destination's socket at once when
nothing is queued for it, so a frame crosses the relay in one task step
(no queue or task hop per message); a writer task per client takes over only
what a full socket buffer leaves behind.

The relay vouches for the sender of every ``Recv``, so it forwards only
payloads that the proven connection itself sent: a gossip packet, or a data
channel frame (``RELAY_DATA`` followed by a packet), whose sender field is the
connection's node id.  Anything else is dropped and counted.  A payload sealed
with the mesh key is forwarded unread: the receiving member opens it and checks
its sender against the ``Recv`` source itself.

Given the mesh's key file, the relay admits members only: a client's Auth must
carry a proof under a key in the file (see ``protocol``).  The file is read
again, on the next connection, whenever it changes, so an operator rotating
the mesh's key adds the new key to the relay's file first.

What the relay queues stays bounded whoever connects: each destination's queue holds at most
``queue_bytes``, all queues together at most ``total_queue_bytes``; frames
beyond either are dropped (the nodes resend, as over UDP).  A client whose
writer makes no progress for ``send_timeout`` is dropped; it never holds up
the others.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import secrets
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import trio

from .. import keyring as mesh_keyring
from ..identity import prefix, verify
from ..logs import Quieted
from ..wire import RELAY_DATA, WireError, packet_sender
from . import protocol, stun, wsconn
from .protocol import (
    CLOSE_AUTH_TIMEOUT,
    CLOSE_BAD_SIGNATURE,
    CLOSE_FULL,
    CLOSE_MALFORMED,
    CLOSE_NOT_MEMBER,
    CLOSE_PING_TIMEOUT,
    CLOSE_REPLACED,
    CLOSE_SHUTTING_DOWN,
    CLOSE_TOO_BIG,
    CLOSE_UNAUTHENTICATED,
    MAX_PAYLOAD,
    NODE_ID_BYTES,
    NOT_MEMBER_REASON,
    REPLACED_REASON,
    RelayProtocolError,
)
from .ratelimit import TokenBucket
from .wsconn import ConnectionClosed, HandshakeError, WebSocket, WriteStalled

log = logging.getLogger("meshd.relay")

STUN_MAX_DATAGRAM = 2048
# A refusal is logged once per reason and host in this many seconds; the rest are counted.
REFUSAL_LOG_INTERVAL = 60.0
MAX_REFUSAL_LOG_KEYS = 1024
# On shutdown, how long to wait for each client to answer our close frame.
SHUTDOWN_GRACE = 0.25


@dataclass(frozen=True)
class RelayConfig:
    max_payload: int = MAX_PAYLOAD
    rate_bytes_per_s: float = 8 * 1024 * 1024
    burst_bytes: float = 16 * 1024 * 1024
    handshake_timeout: float = 10.0  # TCP accept -> WebSocket upgrade done
    auth_timeout: float = 10.0  # challenge sent -> signed answer received
    ping_interval: float = 15.0  # ping a client this long after its last message
    ping_timeout: float = 10.0
    # A client whose writer cannot hand one frame to the socket for this long is dropped.
    # The kernel's socket buffers (megabytes on a fast link) are full by then, so the client
    # has taken nothing for longer still; the slowest SWIM profile's probe timeout is 3 s.
    send_timeout: float = 5.0
    close_timeout: float = 2.0
    # Bytes waiting for one destination, counting the frame being written.  16 full frames:
    # an eighth of a second at the default per-client rate, enough to ride out a reader's
    # pause; beyond it frames are dropped and the nodes resend.
    queue_bytes: int = 1024 * 1024
    # Bytes waiting for all destinations together: what a crowd of clients that stop reading
    # can make the relay hold, however many there are (32 of them at queue_bytes each).
    total_queue_bytes: int = 32 * 1024 * 1024
    # Clients connected at once: past it a new node id is refused (an id connected already may
    # reconnect).  Without a mesh key anyone can prove a fresh id, so this bounds what a crowd
    # of them can make the relay hold (a socket and a few tasks each).
    max_clients: int = 4096
    # Connections not yet authenticated (upgrade and challenge, up to handshake_timeout +
    # auth_timeout each): past it, the oldest from the address that holds the most is closed,
    # so a stranger opening connection after connection cannot use up the relay's sockets.
    max_pending: int = 256

    def __post_init__(self) -> None:
        if not 0 < self.max_payload <= MAX_PAYLOAD:
            raise ValueError(f"max_payload must be in 1..{MAX_PAYLOAD}")
        if self.burst_bytes < self.max_frame:
            raise ValueError(f"burst_bytes must hold at least one full frame ({self.max_frame} bytes)")
        if self.queue_bytes < self.max_frame:
            raise ValueError(f"queue_bytes must hold at least one full frame ({self.max_frame} bytes)")
        if self.total_queue_bytes < self.queue_bytes:
            raise ValueError("total_queue_bytes must be at least queue_bytes")
        if self.max_clients < 1:
            raise ValueError("max_clients must be at least 1")
        if self.max_pending < 1:
            raise ValueError("max_pending must be at least 1")

    @property
    def max_frame(self) -> int:
        return 1 + NODE_ID_BYTES + self.max_payload


class RelayBindError(OSError):
    """The relay could not bind its port; the message names the address."""


@dataclass(eq=False)
class _Client:
    node_id: bytes
    ws: WebSocket  # its outbox holds the frames for this client the socket has not taken yet
    remote: str
    bucket: TokenBucket
    connected_at: float
    last_rx: float
    closed: bool = False  # the session ended: nothing more is queued for it
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    frames_in: int = 0
    bytes_in: int = 0
    frames_out: int = 0
    rate_limited: int = 0
    dropped: int = 0

    @property
    def prefix(self) -> str:
        return prefix(self.node_id)

    @property
    def queued_bytes(self) -> int:
        """Frames for this client not yet in its socket, counting the one being written."""
        return self.ws.queued_bytes


class Relay:
    """The relay's state: who is connected, and what happened, in counters.

    With ``mesh_key_file`` it admits members of that mesh only; the file is read here
    (KeyringError names what is wrong with it) and again whenever it changes.
    """

    def __init__(self, config: RelayConfig | None = None,
                 mesh_key_file: str | os.PathLike | None = None) -> None:
        self.config = config or RelayConfig()
        self.mesh_key_file = Path(mesh_key_file) if mesh_key_file is not None else None
        self.mesh_key: mesh_keyring.Keyring | None = None
        self._mesh_key_stamp: tuple[int, int, int] | None = None
        self.mesh_key_reloads = 0
        self._mesh_key_error: str | None = None  # the last failed re-read, logged once
        if self.mesh_key_file is not None:
            self.mesh_key, self._mesh_key_stamp = _read_keyring(self.mesh_key_file)
        self._clients: dict[bytes, _Client] = {}
        # Connections not yet authenticated -> (their host, the scope whose cancel closes them).
        self._pending: dict[trio.abc.Stream, tuple[str, trio.CancelScope]] = {}
        self._evicted: set[trio.abc.Stream] = set()
        # Refusals logged once a minute per (reason, host)
        self._refusals_logged = Quieted(REFUSAL_LOG_INTERVAL, MAX_REFUSAL_LOG_KEYS)
        # While a reader forwards one read's frames: the destinations it holds (see _reader).
        self._held: list[WebSocket] | None = None
        self.frames_forwarded = 0
        self.bytes_forwarded = 0
        self.peer_not_here = 0
        self.peer_lists = 0  # ListPeers answered
        self.rate_limited = 0
        self.dropped_queue_full = 0  # the destination's queue held queue_bytes already
        self.dropped_relay_full = 0  # all queues together held total_queue_bytes already
        self.dropped_sender_mismatch = 0  # a packet claiming a sender other than its connection
        self.dropped_malformed = 0  # a payload that is not a packet
        self.queued_bytes = 0  # in every client's queue, counting frames being written
        self.accepted = 0
        self.replaced = 0
        self.dead = 0
        self.refused: dict[str, int] = {}
        self.stun_answered = 0
        self.stun_ignored = 0

    def snapshot(self) -> dict:
        now = trio.current_time()
        return {
            "clients_connected": len(self._clients),
            "clients": {
                c.prefix: {
                    "id": c.node_id.hex(),
                    "remote": c.remote,
                    "connected_s": round(now - c.connected_at, 3),
                    "frames_in": c.frames_in,
                    "bytes_in": c.bytes_in,
                    "frames_out": c.frames_out,
                    "rate_limited": c.rate_limited,
                    "dropped": c.dropped,
                    "queued_bytes": c.queued_bytes,
                }
                for c in self._clients.values()
            },
            "accepted": self.accepted,
            "frames_forwarded": self.frames_forwarded,
            "bytes_forwarded": self.bytes_forwarded,
            "peer_not_here": self.peer_not_here,
            "peer_lists": self.peer_lists,
            "rate_limited": self.rate_limited,
            "dropped_queue_full": self.dropped_queue_full,
            "dropped_relay_full": self.dropped_relay_full,
            "dropped_sender_mismatch": self.dropped_sender_mismatch,
            "dropped_malformed": self.dropped_malformed,
            "queued_bytes": self.queued_bytes,
            "replaced": self.replaced,
            "dead": self.dead,
            "refused": dict(self.refused),
            "stun_answered": self.stun_answered,
            "stun_ignored": self.stun_ignored,
            "mesh_keys": self.mesh_key.ids if self.mesh_key is not None else None,
            "mesh_key_reloads": self.mesh_key_reloads,
        }

    def is_connected(self, node_id: bytes) -> bool:
        return node_id in self._clients

    # --- connection lifecycle ---

    async def handle_connection(self, stream: trio.SocketStream) -> None:
        """One accepted TCP connection, from the WebSocket upgrade to the close; the stream is
        always closed.  A connection whose upgrade never completes (garbage on the port, a
        port scanner) is counted as refused."""
        remote = _stream_peer(stream)
        ws = None
        self._make_pending_room()
        pending = self._pending[stream] = (_stream_host(stream), trio.CancelScope())
        try:
            with pending[1]:
                with trio.move_on_after(self.config.handshake_timeout):
                    try:
                        ws = await wsconn.accept(stream, max_message=self.config.max_frame,
                                                 on_queued=self._queued)
                    except HandshakeError as exc:
                        log.debug("relay: %s: %s", remote, exc)
                if ws is None:
                    self._count_refused("handshake-failed", remote,
                                        "no WebSocket upgrade (not a relay client)")
                    return
                await self.handle(ws, remote)
        finally:
            self._pending.pop(stream, None)
            self._evicted.discard(stream)
            if ws is not None:
                with trio.CancelScope(shield=True):  # bounded: our Close, once, then the stream
                    await ws.aclose(timeout=self.config.close_timeout)
            else:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

    async def handle(self, ws: WebSocket, remote: str) -> None:
        """One upgraded connection: authenticate it, then serve it until it closes."""
        try:
            node_id = await self._authenticate(ws, remote)
            self._pending.pop(ws.stream, None)  # proven: no longer the crowd's to make room in
            if node_id is not None:
                await self._session(ws, node_id, remote)
        finally:
            if ws.closed is None and ws.stream in self._evicted:
                text = f"over {self.config.max_pending} connections wait to authenticate here"
                with trio.CancelScope(shield=True):
                    await ws.aclose(CLOSE_FULL, text, timeout=min(self.config.close_timeout, SHUTDOWN_GRACE))
            elif ws.closed is None:
                # Cancelled: the relay is shutting down. Say so, so clients reconnect at once;
                # the close frame goes out at once, the wait for the peer's reply is short.
                with trio.CancelScope(shield=True):
                    await ws.aclose(CLOSE_SHUTTING_DOWN, "relay shutting down",
                                    timeout=min(self.config.close_timeout, SHUTDOWN_GRACE))

    def _make_pending_room(self) -> None:
        """Room for one more unauthenticated connection: past max_pending, close the oldest one
        from the host that has the most waiting (counted as refused "busy", not logged one by
        one: a crowd would fill the log)."""
        if len(self._pending) < self.config.max_pending:
            return
        busiest = Counter(host for host, _ in self._pending.values()).most_common(1)[0][0]
        victim = next(stream for stream, (host, _) in self._pending.items() if host == busiest)
        _, scope = self._pending.pop(victim)
        self._evicted.add(victim)
        scope.cancel()
        self.refused["busy"] = self.refused.get("busy", 0) + 1
        log.debug("relay: closed a connection from %s waiting to authenticate: %d wait already",
                  busiest, self.config.max_pending)

    def _current_mesh_key(self) -> mesh_keyring.Keyring | None:
        """Our keyring, read again if its file changed since; a file that cannot be read now
        keeps the ring we have (logged once per error)."""
        if self.mesh_key_file is None:
            return None
        try:
            st = self.mesh_key_file.stat()
            if (st.st_mtime_ns, st.st_ino, st.st_size) == self._mesh_key_stamp:
                return self.mesh_key
            ring, self._mesh_key_stamp = _read_keyring(self.mesh_key_file)
        except (OSError, mesh_keyring.KeyringError) as exc:
            error = str(exc)
            if error != self._mesh_key_error:
                held = ",".join(self.mesh_key.ids) if self.mesh_key is not None else "none"
                log.warning("relay: %s; keeping the mesh keys we hold (%s)", error, held)
            self._mesh_key_error = error
            return self.mesh_key
        self.mesh_key, self._mesh_key_error = ring, None
        self.mesh_key_reloads += 1
        log.warning("relay: mesh key file %s changed; admitting members with keys %s",
                    self.mesh_key_file, ",".join(ring.ids))
        return ring

    async def _authenticate(self, ws: WebSocket, remote: str) -> bytes | None:
        """The client's proven node id, or None once it has been refused."""
        ring = self._current_mesh_key()
        nonce = secrets.token_bytes(protocol.NONCE_BYTES)
        try:
            with trio.move_on_after(self.config.auth_timeout) as scope:
                ws.send_nowait(protocol.Challenge(nonce).encode())
                await ws.flush()
                data = await ws.receive()
        except ConnectionClosed:
            if _closed_too_big(ws):
                self._count_refused("oversized", remote, "frame over the size limit before authenticating")
            return None
        if scope.cancelled_caught:
            t = self.config.auth_timeout
            await self._refuse(ws, remote, "auth-timeout", CLOSE_AUTH_TIMEOUT,
                               f"no answer to the challenge within {t:g}s")
            return None
        try:
            frame = protocol.decode(data)  # type: ignore[arg-type]
        except RelayProtocolError as exc:
            await self._refuse(ws, remote, "malformed", CLOSE_MALFORMED, f"malformed frame: {exc}")
            return None
        if not isinstance(frame, protocol.Auth):
            await self._refuse(ws, remote, "unauthenticated", CLOSE_UNAUTHENTICATED,
                               f"{type(frame).__name__} frame before authentication")
            return None
        if not verify(frame.node_id, frame.signature, protocol.auth_message(nonce, frame.node_id)):
            # A claim to someone else's id lands here too: only the owner's key verifies.
            held = " (an id connected here)" if frame.node_id in self._clients else ""
            await self._refuse(ws, remote, "bad-signature", CLOSE_BAD_SIGNATURE,
                               f"signature does not prove ownership of node {prefix(frame.node_id)}{held}")
            return None
        if ring is not None:
            message = protocol.auth_message(nonce, frame.node_id)
            if not any(ring.check_mac(message, proof) for proof in frame.mesh_proofs):
                await self._refuse(ws, remote, "not-member", CLOSE_NOT_MEMBER,
                                   f"{NOT_MEMBER_REASON} (node {prefix(frame.node_id)}, "
                                   f"{len(frame.mesh_proofs)} proofs)")
                return None
        if frame.node_id not in self._clients and len(self._clients) >= self.config.max_clients:
            await self._refuse(ws, remote, "full", CLOSE_FULL,
                               f"the relay holds {self.config.max_clients} clients (--max-clients); "
                               f"node {prefix(frame.node_id)} refused")
            return None
        return frame.node_id

    async def _session(self, ws: WebSocket, node_id: bytes, remote: str) -> None:
        now = trio.current_time()
        client = _Client(
            node_id=node_id, ws=ws, remote=remote, connected_at=now, last_rx=now,
            bucket=TokenBucket(self.config.rate_bytes_per_s, self.config.burst_bytes, now),
        )
        old = self._clients.get(node_id)
        self._clients[node_id] = client
        self.accepted += 1
        log.info("relay: %s connected from %s", client.prefix, remote)
        try:
            if not ws.send_nowait(protocol.Accepted(self.config.max_payload).encode()):
                return
            async with trio.open_nursery() as nursery:
                client.scope = nursery.cancel_scope  # cancelling it ends every task of this client
                if old is not None:
                    self.replaced += 1
                    log.info("relay: %s reconnected from %s; closing its connection from %s",
                             client.prefix, remote, old.remote)
                    nursery.start_soon(self._replace, old)
                nursery.start_soon(self._writer, client)
                nursery.start_soon(self._keepalive, client)
                await self._reader(client)
                nursery.cancel_scope.cancel()
        finally:
            # The writer has ended with the nursery: what is still queued will never be sent.
            client.closed = True
            ws.discard_queued()
            if self._clients.get(node_id) is client:
                del self._clients[node_id]
            log.info("relay: %s disconnected (%s)", client.prefix, _close_text(ws))

    async def _replace(self, old: _Client) -> None:
        old.ws.send_nowait(protocol.Replaced().encode())  # goes before the Close frame
        await self._close(old, CLOSE_REPLACED, REPLACED_REASON)

    async def _close(self, client: _Client, code: int, reason: str) -> None:
        # Bounded by close_timeout; the TCP stream is closed whatever happens.
        await client.ws.aclose(code, _close_reason(reason), timeout=self.config.close_timeout)
        client.scope.cancel()

    async def _refuse(self, ws: WebSocket, remote: str, why: str, code: int, text: str) -> None:
        self._count_refused(why, remote, text)
        await ws.aclose(code, _close_reason(text), timeout=self.config.close_timeout)

    def _count_refused(self, why: str, remote: str, text: str) -> None:
        """Count a refusal; log it once a minute per reason and host (anyone can make
        refusals as fast as it connects, and must not fill the log with them)."""
        self.refused[why] = self.refused.get(why, 0) + 1
        key = (why, remote.rpartition(":")[0])
        quiet = self._refusals_logged.due(key, trio.current_time())
        if quiet is None:
            return
        more = f" ({quiet} more refused as {why} from {key[1]} since, not logged)" if quiet else ""
        log.warning("relay: refused %s: %s%s", remote, text, more)

    # --- per-client tasks ---

    async def _reader(self, client: _Client) -> None:
        """Forward what ``client`` sends.  The frames of one read go out together: each
        destination is held (see WebSocket.hold) until the read's last frame is forwarded, so
        a burst costs one write per destination, not one per frame.  A read's last frame
        holds nothing new: alone (one packet at a time), it goes out at once."""
        ws = client.ws
        held: list[WebSocket] = []
        try:
            while True:
                try:
                    data = ws.receive_nowait()
                    if data is None:
                        self._release(held)  # before waiting for anything
                        data = await ws.receive()
                except ConnectionClosed:
                    if _closed_too_big(ws):
                        text = f"{client.prefix} sent an oversized frame"
                        self._count_refused("oversized", client.remote, text)
                    return
                client.last_rx = now = trio.current_time()
                try:
                    frame = protocol.decode(data)  # type: ignore[arg-type]
                    if isinstance(frame, protocol.ListPeers):
                        self._held = held if ws.more_buffered else None
                        self._list_peers(client)
                        continue
                    if not isinstance(frame, protocol.Send):
                        raise RelayProtocolError(f"a client may not send {type(frame).__name__} frames")
                    if len(frame.payload) > self.config.max_payload:
                        limit = self.config.max_payload
                        raise RelayProtocolError(f"payload over this relay's {limit}-byte limit")
                except RelayProtocolError as exc:
                    self._release(held)
                    self._count_refused("malformed", client.remote, f"{client.prefix}: {exc}")
                    await self._close(client, CLOSE_MALFORMED, f"malformed frame: {exc}")
                    return
                self._held = held if ws.more_buffered else None
                self._forward(client, frame, len(data), now)
        finally:
            self._release(held)

    def _release(self, held: list[WebSocket]) -> None:
        """Write what one read's frames left held for their destinations."""
        self._held = None
        for ws in held:
            ws.release()
        held.clear()

    def _list_peers(self, client: _Client) -> None:
        """Answer a ListPeers with a random sample of the other connected nodes.  It costs the
        asker its answer's size from its rate budget, so asking cannot outrun forwarding."""
        others = [node for node in self._clients if node != client.node_id]
        sample = random.sample(others, min(len(others), protocol.MAX_LISTED))
        answer = protocol.Peers(tuple(sample)).encode()
        if not client.bucket.take(len(answer), trio.current_time()):
            client.rate_limited += 1
            self.rate_limited += 1
            return
        self.peer_lists += 1
        self._enqueue(client, answer)

    def _forward(self, client: _Client, frame: protocol.Send, size: int, now: float) -> None:
        client.frames_in += 1
        client.bytes_in += size
        if not self._sent_by(client, frame):
            return
        if not client.bucket.take(size, now):
            client.rate_limited += 1
            self.rate_limited += 1
            return
        dst = self._clients.get(frame.dst)
        if dst is None:
            self.peer_not_here += 1
            self._enqueue(client, protocol.PeerNotHere(frame.dst).encode())
            return
        if self._enqueue(dst, protocol.Recv(client.node_id, frame.payload).encode()):
            self.frames_forwarded += 1
            self.bytes_forwarded += len(frame.payload)

    def _sent_by(self, client: _Client, frame: protocol.Send) -> bool:
        """Whether the payload is a packet whose sender is the client's proven id.

        The receiving node takes the ``Recv`` source as vouched for by the relay, so a
        payload claiming another sender would let one node speak for another.  Bad
        frames are dropped one by one; the connection stays (its other frames may be fine).
        """
        payload: bytes | memoryview = frame.payload
        head = payload[:1]
        if head == mesh_keyring.MAGIC:
            return True  # sealed with the mesh key: the member that opens it checks the sender
        if head == RELAY_DATA:  # a data-channel frame: the prefix, then a packet (not copied)
            payload = memoryview(payload)[1:]
        try:
            sender = packet_sender(payload)  # type: ignore[arg-type]  # it reads a view as well
        except WireError as exc:
            self.dropped_malformed += 1
            client.dropped += 1
            log.debug("relay: dropped a frame from %s to %s: %s", client.prefix, prefix(frame.dst), exc)
            return False
        if sender != client.node_id:
            self.dropped_sender_mismatch += 1
            client.dropped += 1
            log.debug("relay: dropped a frame from %s to %s claiming to be from %s",
                      client.prefix, prefix(frame.dst), prefix(sender))
            return False
        return True

    def _enqueue(self, client: _Client, data: bytes) -> bool:
        """Send ``data`` to ``client`` now, or queue it for its writer; False (and counted) when
        a byte limit is reached.  Limits count every frame the socket has not taken yet."""
        size = len(data)
        if client.closed:
            client.dropped += 1
            return False
        if client.queued_bytes + size > self.config.queue_bytes:
            client.dropped += 1
            self.dropped_queue_full += 1
            return False
        if self.queued_bytes + size > self.config.total_queue_bytes:
            client.dropped += 1
            self.dropped_relay_full += 1
            return False
        ws = client.ws
        if self._held is not None and not ws.holding:  # the reader releases it after this read
            ws.hold()
            self._held.append(ws)
        if not ws.send_nowait(data):  # closing, or its connection broke
            client.dropped += 1
            return False
        client.frames_out += 1
        return True

    def _queued(self, change: int) -> None:
        """A connection's outbox grew by ``change`` bytes (or, negative, let go of them)."""
        self.queued_bytes += change

    async def _writer(self, client: _Client) -> None:
        """Write what ``client``'s socket did not take at once; drop the client when its
        socket takes nothing for send_timeout (its kernel buffers are full by then)."""
        try:
            await client.ws.run_writer(self.config.send_timeout)
        except WriteStalled:
            self.dead += 1
            t = self.config.send_timeout
            log.warning("relay: %s took no frame for %gs; dropping it", client.prefix, t)
            # Part of a frame may be in its socket: no Close frame can follow it.
            await client.ws.abort()
            client.scope.cancel()

    async def _keepalive(self, client: _Client) -> None:
        interval, timeout = self.config.ping_interval, self.config.ping_timeout
        while True:
            idle_until = client.last_rx + interval
            if trio.current_time() < idle_until:
                await trio.sleep_until(idle_until)
                continue
            with trio.move_on_after(timeout) as scope:
                try:
                    await client.ws.ping()
                except ConnectionClosed:
                    return
            if scope.cancelled_caught:
                self.dead += 1
                log.warning("relay: %s did not answer a ping within %gs; dropping it", client.prefix, timeout)
                await self._close(client, CLOSE_PING_TIMEOUT, f"no pong within {timeout:g}s")
                return
            client.last_rx = trio.current_time()

    # --- STUN ---

    async def serve_stun(self, sock: trio.socket.SocketType) -> NoReturn:
        while True:
            try:
                data, addr = await sock.recvfrom(STUN_MAX_DATAGRAM)
            except OSError:
                continue  # an ICMP error surfacing on the socket; not ours to handle
            try:
                response = stun.binding_response(data, _unmapped(addr[0], addr[1]))
            except stun.StunError:
                self.stun_ignored += 1
                continue
            self.stun_answered += 1
            try:
                await sock.sendto(response, addr)
            except OSError as exc:
                log.debug("relay: STUN reply to %s failed: %s", addr, exc)


def _read_keyring(path: Path) -> tuple[mesh_keyring.Keyring, tuple[int, int, int]]:
    """The keyring in ``path`` and the file's (mtime, inode, size), to see when it changes."""
    try:
        st = path.stat()  # before reading: a change in between is seen on the next look
    except OSError as exc:
        raise mesh_keyring.KeyringError(f"cannot read mesh key file {path}: {exc.strerror}") from exc
    return mesh_keyring.load(path), (st.st_mtime_ns, st.st_ino, st.st_size)


def _close_reason(text: str) -> str:
    """A WebSocket close reason holds at most 123 bytes of UTF-8."""
    return text.encode()[:123].decode(errors="ignore")


def _unmapped(host: str, port: int) -> tuple[str, int]:
    """An IPv4 peer on a dual-stack socket shows as ``::ffff:a.b.c.d``; report it as IPv4."""
    if host.startswith("::ffff:") and "." in host:
        return host[len("::ffff:"):], port
    return host, port


def _closed_too_big(ws: WebSocket) -> bool:
    return ws.closed is not None and ws.closed.code == CLOSE_TOO_BIG


def _close_text(ws: WebSocket) -> str:
    reason = ws.closed
    if reason is None:  # no close handshake: the stream broke, or this relay is stopping
        return "no close frame: its connection ended or this relay is stopping"
    return f"{reason.code} {reason.reason}".strip()


def _stream_host(stream: trio.abc.Stream) -> str:
    try:
        return str(stream.socket.getpeername()[0])  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return ""


def _stream_peer(stream: trio.abc.Stream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return "unknown peer"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _bind_same_port(host: str, port: int) -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
    """A listening TCP socket and a UDP socket on the same port number."""
    what = f"{host}:{port}"
    try:
        infos = await trio.socket.getaddrinfo(host or None, port, type=trio.socket.SOCK_STREAM,
                                              flags=trio.socket.AI_PASSIVE)
    except trio.socket.gaierror as exc:
        raise RelayBindError(errno.EINVAL, f"cannot bind relay on {what}: {exc.strerror}") from exc
    family, _, _, _, sockaddr = infos[0]
    # Port 0: the kernel picks a free TCP port, which may be taken for UDP; try a few.
    for _ in range(16 if port == 0 else 1):
        tcp = trio.socket.socket(family, trio.socket.SOCK_STREAM)
        udp = trio.socket.socket(family, trio.socket.SOCK_DGRAM)
        try:
            # SO_REUSEADDR: a restarted relay gets its port back despite TIME_WAIT.
            tcp.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
            await tcp.bind(sockaddr)
            tcp.listen(128)
            await udp.bind((sockaddr[0], tcp.getsockname()[1], *sockaddr[2:]))
            return tcp, udp
        except OSError as exc:
            tcp.close()
            udp.close()
            if port == 0 and exc.errno == errno.EADDRINUSE:
                continue
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise RelayBindError(exc.errno, f"cannot bind relay on {what}: {reason}") from exc
    raise RelayBindError(errno.EADDRINUSE, f"cannot bind relay on {what}: no port free for both TCP and UDP")


async def serve_relay(
    host: str,
    port: int,
    *,
    relay: Relay | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Serve the relay (WebSocket on TCP, STUN on UDP, same port) until cancelled.

    Reports the bound ``(host, port)`` through ``task_status``.  Pass a
    :class:`Relay` to read its ``snapshot()`` or to set its config.
    Raises :class:`RelayBindError` if the port cannot be bound.
    """
    relay = relay if relay is not None else Relay()
    tcp, udp = await _bind_same_port(host, port)
    bound = tcp.getsockname()[:2]
    with udp:
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, relay.handle_connection, [trio.SocketListener(tcp)])
            nursery.start_soon(relay.serve_stun, udp)
            log.info("relay: serving ws://%s:%d and STUN on udp %d", bound[0], bound[1], bound[1])
            task_status.started((bound[0], bound[1]))
            await trio.sleep_forever()
    raise AssertionError("unreachable")
