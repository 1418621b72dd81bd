"""The relay client a node keeps open to its home relay, and a STUN query.

``RelayClient.run`` connects, answers the relay's challenge, and reconnects
with exponential backoff and jitter for as long as it runs.  Every network wait
has a timeout, and every error names the relay URL and what was waited for.

The connection is a :mod:`.wsconn` WebSocket: a send goes into the socket at
once (no task or lock in between unless the socket's buffer is full), and the
session's reader parses frames straight off the socket and puts each one on
``received``.
"""

from __future__ import annotations

import logging
import random
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import trio

from ..identity import Identity, prefix
from . import protocol, stun, wsconn
from .protocol import (
    CLOSE_REPLACED,
    MAX_FRAME,
    NODE_ID_BYTES,
    PeerNotHere,
    Peers,
    Recv,
    RelayProtocolError,
    Replaced,
)
from .wsconn import ConnectionClosed, HandshakeError, WebSocket, WriteStalled

if TYPE_CHECKING:
    from ..keyring import Keyring

log = logging.getLogger("meshd.relay.client")

# What the receive channel yields: a packet from a peer, or a notice from the relay.
Incoming = Recv | PeerNotHere | Replaced | Peers


class RelayError(Exception):
    """The relay could not be reached or used; the message names the relay and what failed."""


class RelayNotConnected(RelayError):
    """A send while there is no authenticated connection to the relay."""


class RelayReplaced(RelayError):
    """Another connection with our node id took our place at the relay."""


@dataclass(frozen=True)
class ClientConfig:
    connect_timeout: float = 5.0  # TCP connect + WebSocket upgrade
    auth_timeout: float = 5.0  # challenge received, answered, accepted
    send_timeout: float = 5.0
    ping_interval: float = 10.0  # ping the relay this long after its last message
    ping_timeout: float = 5.0
    close_timeout: float = 1.0
    backoff_initial: float = 0.2
    backoff_max: float = 10.0
    receive_queue: int = 4096  # frames held for the consumer; beyond this they are dropped


def parse_relay_url(url: str) -> tuple[str, int, str, bool]:
    """``ws://HOST:PORT[/path]`` -> ``(host, port, path, tls)``; ValueError with a message otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise ValueError(f"relay URL {url!r} must start with ws:// or wss://")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"relay URL {url!r} has a bad port") from None
    if not parts.hostname:
        raise ValueError(f"relay URL {url!r} has no host")
    tls = parts.scheme == "wss"
    return parts.hostname, port or (443 if tls else 80), parts.path or "/", tls


class RelayClient:
    """One node's connection to one relay.

    Start ``run`` in a nursery (``await nursery.start(client.run)`` returns once
    the first attempt has succeeded or failed), ``send`` frames to node ids, and
    read ``received``: it yields :class:`Recv` ``(src, payload)``,
    :class:`PeerNotHere` ``(node_id)`` and :class:`Replaced` notices.

    With ``mesh_key`` its Auth carries a proof under every key of the ring (read at each
    connect, so a rotation shows), for a relay that admits members only.  Payloads are
    sent as given: sealing them is the node's business.

    With ``on_frame``, the connection's reader hands each frame to it, in order, instead
    of putting it on ``received``: that saves a task switch per frame on the relay path.
    It must return promptly (hand long work to a task of its own): while it runs the
    connection is not read, so the relay's pings wait too.  What it raises is counted
    (``handler_errors``) and logged; the connection carries on.
    """

    def __init__(self, url: str, identity: Identity, *, config: ClientConfig | None = None,
                 mesh_key: Keyring | None = None,
                 on_frame: Callable[[Incoming], Awaitable[None]] | None = None,
                 blocked: Callable[[], bool] | None = None) -> None:
        """``blocked``: whether a fault cuts this node off (``--fault isolate``): then every
        dial fails, as behind a filter, and the relay is seen not connected."""
        self.url = url
        self.blocked = blocked or (lambda: False)
        self.on_frame = on_frame
        self.identity = identity
        self.mesh_key = mesh_key
        self.config = config or ClientConfig()
        self._host, self._port, self._path, self._tls = parse_relay_url(url)
        self._incoming_send, self.received = trio.open_memory_channel[Incoming](self.config.receive_queue)
        self._ws: WebSocket | None = None
        self._session_scope: trio.CancelScope | None = None
        self._connected = trio.Event()
        self._last_rx = 0.0
        self._end_reason: str | None = None
        self._max_payload = protocol.MAX_PAYLOAD
        self.state = "idle"  # idle | connecting | connected | backoff | replaced
        self.last_error: str | None = None
        self.counters = {
            "attempts": 0, "connects": 0, "sent": 0, "received": 0, "peer_not_here": 0,
            "dropped_receive_full": 0, "ping_timeouts": 0, "send_errors": 0, "handler_errors": 0,
        }

    @property
    def connected(self) -> bool:
        return self._ws is not None

    async def wait_connected(self) -> None:
        await self._connected.wait()

    def snapshot(self) -> dict:
        return {"url": self.url, "state": self.state, "connected": self.connected,
                "last_error": self.last_error, **self.counters}

    # --- the connection loop ---

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Stay connected until cancelled, or until another connection with our id replaces this one.

        ``task_status.started()`` comes once the first attempt has connected or failed.
        """
        started = False

        def signal_started() -> None:
            nonlocal started
            if not started:
                started = True
                task_status.started()

        delay = self.config.backoff_initial
        while True:
            self.state = "connecting"
            self.counters["attempts"] += 1
            connects = self.counters["connects"]
            try:
                await self._connect_and_serve(signal_started)
            except RelayReplaced as exc:
                self.state, self.last_error = "replaced", str(exc)
                log.warning("%s; not reconnecting", exc)
                signal_started()
                return
            except RelayError as exc:
                self.last_error = str(exc)
                log.info("%s", exc)
            signal_started()
            if self.counters["connects"] > connects:
                delay = self.config.backoff_initial  # we were connected: start the backoff over
            self.state = "backoff"
            await trio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.config.backoff_max)

    async def _connect_and_serve(self, on_connected: Callable[[], None]) -> None:
        """One connection, from dial to close. Always ends in a RelayError saying why."""
        cfg = self.config
        self._end_reason = None
        ended: RelayError | None = None
        ws = await self._open()
        try:
            await self._authenticate(ws)
            self._last_rx = trio.current_time()
            self._ws = ws
            self.state = "connected"
            self.counters["connects"] += 1
            self._connected.set()
            log.info("relay %s: connected as %s", self.url, self.identity.prefix)
            on_connected()
            try:
                async with trio.open_nursery() as nursery:
                    self._session_scope = nursery.cancel_scope
                    nursery.start_soon(self._writer, ws)
                    nursery.start_soon(self._keepalive, ws)
                    await self._reader(ws)
                    nursery.cancel_scope.cancel()
            finally:
                self._ws = None
                self._session_scope = None
                self._connected = trio.Event()
                ended = self._ended(ws)
                self.state, self.last_error = "disconnected", str(ended)
        finally:
            with trio.CancelScope(shield=True):
                await ws.aclose(timeout=cfg.close_timeout)
        assert ended is not None
        raise ended

    async def _open(self) -> WebSocket:
        """Dial the relay and upgrade to a WebSocket within connect_timeout."""
        cfg = self.config
        port = self._port
        host = f"[{self._host}]:{port}" if ":" in self._host else f"{self._host}:{port}"
        ws = None
        if self.blocked():
            await trio.sleep(cfg.connect_timeout)  # the SYN goes nowhere, as behind a filter
            raise RelayError(f"cannot connect to relay {self.url}: no answer within "
                             f"{cfg.connect_timeout:g}s (a fault isolates this node)")
        try:
            with trio.move_on_after(cfg.connect_timeout):
                stream: trio.abc.Stream = await trio.open_tcp_stream(self._host, port)
                try:
                    if self._tls:
                        stream = trio.SSLStream(stream, ssl.create_default_context(),
                                                server_hostname=self._host, https_compatible=True)
                        await stream.do_handshake()
                    ws = await wsconn.connect(stream, host, self._path, max_message=MAX_FRAME)
                finally:
                    if ws is None:
                        await trio.aclose_forcefully(stream)
        except HandshakeError as exc:
            raise RelayError(f"cannot connect to relay {self.url}: {exc}") from exc
        except (OSError, trio.BrokenResourceError) as exc:
            raise RelayError(f"connection to relay {self.url} failed: {exc}") from exc
        if ws is None:
            raise RelayError(f"cannot connect to relay {self.url}: "
                             f"no WebSocket upgrade within {cfg.connect_timeout:g}s")
        return ws

    async def _authenticate(self, ws: WebSocket) -> None:
        t = self.config.auth_timeout
        try:
            with trio.move_on_after(t) as scope:
                challenge = protocol.decode(await ws.receive())  # type: ignore[arg-type]
                if not isinstance(challenge, protocol.Challenge):
                    what = type(challenge).__name__
                    raise RelayError(f"relay {self.url} sent {what} instead of a challenge")
                if challenge.version != protocol.RELAY_PROTOCOL_VERSION:
                    raise RelayError(f"relay {self.url} speaks relay protocol {challenge.version}, "
                                     f"we speak {protocol.RELAY_PROTOCOL_VERSION}")
                node_id = self.identity.node_id
                message = protocol.auth_message(challenge.nonce, node_id)
                proofs = tuple(self.mesh_key.macs(message)) if self.mesh_key is not None else ()
                ws.send_nowait(protocol.Auth(node_id, self.identity.sign(message), proofs).encode())
                await ws.flush()
                accepted = protocol.decode(await ws.receive())  # type: ignore[arg-type]
                if not isinstance(accepted, protocol.Accepted):
                    what = type(accepted).__name__
                    raise RelayError(f"relay {self.url} sent {what} instead of accepting us")
                self._max_payload = min(accepted.max_payload, protocol.MAX_PAYLOAD)
        except ConnectionClosed as exc:
            why = _reason_text(exc.reason)
            text = f"relay {self.url} closed the connection during authentication ({why})"
            if getattr(exc.reason, "code", None) == protocol.CLOSE_NOT_MEMBER and text != self.last_error:
                # Said once per reason, not at every reconnect: the relay's key file and ours differ.
                log.warning("%s; %s", text, "it admits members of a keyed mesh only, and we have no mesh "
                            "key" if self.mesh_key is None else "its key file holds none of our mesh keys")
            raise RelayError(text) from exc
        except RelayProtocolError as exc:
            raise RelayError(f"relay {self.url} sent a malformed frame during authentication: {exc}") from exc
        if scope.cancelled_caught:
            raise RelayError(f"relay {self.url}: no challenge/acceptance within {t:g}s")

    def _ended(self, ws: WebSocket) -> RelayError:
        reason = ws.closed
        if reason is not None and reason.code == CLOSE_REPLACED:
            return RelayReplaced(f"relay {self.url}: {reason.reason or protocol.REPLACED_REASON} "
                                 f"(node {self.identity.prefix})")
        if self._end_reason is not None:
            return RelayError(self._end_reason)
        return RelayError(f"relay {self.url} closed the connection ({_reason_text(reason)})")

    async def _reader(self, ws: WebSocket) -> None:
        while True:
            try:
                data = await ws.receive()
            except ConnectionClosed:
                return
            self._last_rx = trio.current_time()
            try:
                frame = protocol.decode(data)  # type: ignore[arg-type]
                if not isinstance(frame, Recv | PeerNotHere | Replaced | Peers):
                    raise RelayProtocolError(f"unexpected {type(frame).__name__} frame")
            except RelayProtocolError as exc:
                self._end_reason = f"relay {self.url} sent a malformed frame: {exc}"
                return
            if isinstance(frame, Recv):
                self.counters["received"] += 1
            elif isinstance(frame, PeerNotHere):
                self.counters["peer_not_here"] += 1
            handler = self.on_frame
            if handler is not None:
                try:
                    await handler(frame)
                except Exception:
                    self.counters["handler_errors"] += 1
                    log.exception("relay %s: handling a %s frame failed", self.url, type(frame).__name__)
                continue
            try:
                self._incoming_send.send_nowait(frame)
            except trio.WouldBlock:
                # Never block here: this task also answers the relay's pings and reads its Close.
                self.counters["dropped_receive_full"] += 1

    async def _writer(self, ws: WebSocket) -> None:
        """Write what the socket did not take at once (the senders wait for it in ``_send_frame``)."""
        t = self.config.send_timeout
        try:
            await ws.run_writer(t)
        except WriteStalled:
            # Part of a frame may be in the socket: the stream is unusable, reconnect.
            self.counters["send_errors"] += 1
            self._end_reason = f"a send to relay {self.url} did not finish within {t:g}s"
            self._drop_session()

    async def _keepalive(self, ws: WebSocket) -> None:
        interval, timeout = self.config.ping_interval, self.config.ping_timeout
        while True:
            idle_until = self._last_rx + interval
            if trio.current_time() < idle_until:
                await trio.sleep_until(idle_until)
                continue
            with trio.move_on_after(timeout) as scope:
                try:
                    await ws.ping()
                except ConnectionClosed:
                    return
            if scope.cancelled_caught:
                self.counters["ping_timeouts"] += 1
                self._end_reason = f"no pong from relay {self.url} within {timeout:g}s"
                self._drop_session()
                return
            self._last_rx = trio.current_time()

    def _drop_session(self) -> None:
        if self._session_scope is not None:
            self._session_scope.cancel()

    # --- sending ---

    async def list_peers(self) -> None:
        """Ask the relay which nodes are connected; its answer comes on ``received`` as
        :class:`Peers`.  Raises RelayNotConnected or RelayError as ``send`` does."""
        await self._send_frame(protocol.ListPeers().encode(), None)

    async def send(self, dst: bytes, payload: bytes) -> None:
        """Hand ``payload`` to the relay for ``dst``.  Delivery is not confirmed:
        an absent peer comes back as a PeerNotHere notice on ``received``.

        Raises RelayNotConnected, RelayError (timeout), or ValueError (bad dst, payload too big).
        """
        if type(dst) is not bytes or len(dst) != NODE_ID_BYTES:
            raise ValueError("dst must be a 32-byte node id")
        if len(payload) > self._max_payload:
            raise ValueError(f"payload of {len(payload)} bytes exceeds the relay's "
                             f"{self._max_payload}-byte limit")
        await self._send_frame(protocol.Send(dst, bytes(payload)).encode(), dst)
        self.counters["sent"] += 1

    async def _send_frame(self, frame: bytes, dst: bytes | None) -> None:
        """Write one frame (to ``dst``, or a request to the relay itself) within the send timeout."""
        ws = self._ws
        if ws is None:
            self.counters["send_errors"] += 1
            raise RelayNotConnected(f"not connected to relay {self.url} ({self.state}; "
                                    f"last error: {self.last_error or 'none'}); cannot send {_what(dst)}")
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller sends nothing
        sent = ws.send_nowait(frame)
        if sent and ws.queued_bytes:
            # The socket's buffer is full: wait until it takes what is queued, as a blocking
            # send would.
            t = self.config.send_timeout
            with trio.move_on_after(t) as scope:
                sent = await ws.flush()
            if scope.cancelled_caught:
                # What is queued may be cut off mid-frame: the stream is unusable, reconnect.
                self.counters["send_errors"] += 1
                self._end_reason = f"a send to relay {self.url} did not finish within {t:g}s"
                self._drop_session()
                raise RelayError(self._end_reason)
        if not sent:
            self.counters["send_errors"] += 1
            raise RelayNotConnected(f"relay {self.url} connection closed while sending {_what(dst)} "
                                    f"({_reason_text(ws.closed)})")


def _what(dst: bytes | None) -> str:
    """What a send carried, as its errors say it."""
    return f"a frame to {prefix(dst)}" if dst is not None else "a request for its peer list"


def _reason_text(reason: object) -> str:
    if reason is None:
        return "no close reason"
    code, text = getattr(reason, "code", "?"), getattr(reason, "reason", None)
    return f"{code} {text or getattr(reason, 'name', '')}".strip()


async def stun_query(
    relay_host: str,
    port: int,
    timeout: float = 3.0,
    *,
    sock: trio.socket.SocketType | None = None,
    retransmit: float = 0.5,
) -> tuple[str, int]:
    """Our reflexive ``(ip, port)`` as the relay's STUN responder sees it.

    Pass ``sock`` to learn the mapping of that UDP socket (the one peers should
    use); otherwise a temporary socket is opened.  Retransmits with doubling
    intervals; raises RelayError after ``timeout`` seconds without an answer.
    """
    where = f"{relay_host}:{port}"
    try:
        infos = await trio.socket.getaddrinfo(relay_host, port, type=trio.socket.SOCK_DGRAM)
    except trio.socket.gaierror as exc:
        raise RelayError(f"STUN: cannot resolve {where}: {exc.strerror}") from exc
    if sock is not None:
        infos = [info for info in infos if info[0] == sock.family] or infos
    family, _, _, _, target = infos[0]
    own = sock is None
    if sock is None:
        sock = trio.socket.socket(family, trio.socket.SOCK_DGRAM)
    transaction_id, request = stun.binding_request()
    deadline = trio.current_time() + timeout
    try:
        with trio.move_on_at(deadline):
            while True:
                await sock.sendto(request, target)
                with trio.move_on_after(retransmit):
                    while True:
                        data, _ = await sock.recvfrom(2048)
                        try:
                            return stun.parse_binding_response(data, transaction_id)
                        except stun.StunError:
                            continue  # someone else's datagram; keep waiting for ours
                retransmit *= 2
    except OSError as exc:
        raise RelayError(f"STUN query to {where} failed: {exc}") from exc
    finally:
        if own:
            sock.close()
    raise RelayError(f"no STUN binding response from {where} within {timeout:g}s")
