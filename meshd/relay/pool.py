"""Every relay a node holds, and which of them carries our frames to each peer.

A node connects to each relay it is given (``--relay``, repeatable) and
gossips their URLs in its metadata.  A frame to a peer goes over a relay both
ends hold: the one that carried the last frame to it while that still works,
else the first of the peer's own list we are connected to, else (a peer we
know only by node id so far) the one we last heard it on, else any.  A relay
whose connection dropped, or that said the peer is not there, is skipped
until it works again, so a pair moves to another relay as soon as one dies:
at the next frame, which is at most a probe period away.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from ..identity import Identity, prefix
from .client import RelayClient, RelayError, RelayNotConnected

log = logging.getLogger("meshd.relay.pool")

# A relay that answered "peer not here" is not tried for that peer again for this long,
# unless it is the only one (the peer may be reconnecting to it).
NOT_HERE_S = 2.0

# Peers whose relay choice we remember: bounded against strangers with fresh ids.
MAX_REMEMBERED = 4096


@dataclass(frozen=True)
class Move:
    """The relay carrying our frames to ``node`` changed (``old`` None: the first choice)."""

    node: bytes
    old: str | None
    new: str
    why: str


class RelayPool:
    """Our connections to every relay we hold; ``send`` picks one that reaches the peer."""

    def __init__(self, urls: Sequence[str], identity: Identity, *, mesh_key=None,
                 on_move: Callable[[Move], None] | None = None,
                 blocked: Callable[[], bool] | None = None) -> None:
        if not urls:
            raise ValueError("a relay pool needs at least one relay URL")
        self.clients = [RelayClient(url, identity, mesh_key=mesh_key, blocked=blocked)
                        for url in dict.fromkeys(urls)]
        self._by_url = {c.url: c for c in self.clients}
        self.on_move = on_move
        self._via: dict[bytes, str] = {}  # peer -> the relay that carried our last frame to it
        self._heard: dict[bytes, str] = {}  # peer -> the relay we last heard it on
        self._absent: dict[tuple[str, bytes], float] = {}  # (relay, peer) -> "not here" until
        self.counters = {"moves": 0, "no_common_relay": 0}

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    @property
    def home(self) -> RelayClient:
        return self.clients[0]

    @property
    def connected(self) -> bool:
        return any(c.connected for c in self.clients)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep every relay connection up; ``started`` once each has made its first attempt."""
        async with trio.open_nursery() as nursery:
            pending = len(self.clients)
            first_tries = trio.Event()

            async def keep(client: RelayClient) -> None:
                nonlocal pending

                def tried() -> None:
                    nonlocal pending
                    pending -= 1
                    if pending == 0:
                        first_tries.set()

                await nursery.start(client.run)
                tried()

            for client in self.clients:
                nursery.start_soon(keep, client)
            await first_tries.wait()
            task_status.started()

    def route(self, node: bytes, peer_relays: Sequence[str], now: float) -> RelayClient | None:
        """The relay to send to ``node`` over now (``peer_relays``: the relays its metadata lists)."""
        order = [self._via.get(node), *peer_relays]
        if not peer_relays:
            order += [self._heard.get(node), *self._by_url]
        fallback = None
        for url in order:
            client = self._by_url.get(url) if url is not None else None
            if client is None or not client.connected:
                continue
            if self._absent.get((client.url, node), 0.0) > now:
                fallback = fallback or client
                continue
            return client
        return fallback  # every common relay said "not here" lately: try again anyway

    async def send(self, node: bytes, payload: bytes, peer_relays: Sequence[str]) -> str:
        """Send ``payload`` to ``node`` over a relay both of us hold; returns its URL.

        A relay whose connection fails while sending is left for the next one.
        Raises RelayNotConnected naming every relay when none can carry it.
        """
        tried: list[str] = []
        now = trio.current_time()
        while (client := self.route(node, peer_relays, now)) is not None and client.url not in tried:
            try:
                await client.send(node, payload)
            except RelayError as exc:
                tried.append(client.url)
                self._absent[(client.url, node)] = now + NOT_HERE_S
                log.debug("relay %s failed sending to %s: %s", client.url, prefix(node), exc)
                continue
            self._carried(node, client.url, tried)
            return client.url
        self.counters["no_common_relay"] += 1
        raise RelayNotConnected(self._why_none(node, peer_relays))

    def not_here(self, url: str, node: bytes) -> None:
        """The relay at ``url`` says ``node`` is not connected to it."""
        self._absent[(url, node)] = trio.current_time() + NOT_HERE_S
        self._bound(self._absent)

    def heard(self, url: str, node: bytes) -> None:
        """A frame from ``node`` came over ``url``: that relay reaches it."""
        self._absent.pop((url, node), None)
        if self._heard.get(node) != url:
            self._heard[node] = url
            self._bound(self._heard)

    def via(self, node: bytes) -> str | None:
        """The relay that carried our last frame to ``node``, if any did."""
        return self._via.get(node)

    async def list_peers(self) -> int:
        """Ask every connected relay for its peers (answers come as Peers on each client's
        ``received``); returns how many were asked."""
        asked = 0
        for client in self.clients:
            if client.connected:
                try:
                    await client.list_peers()
                except RelayError as exc:
                    log.debug("%s", exc)
                else:
                    asked += 1
        return asked

    def snapshot(self) -> list[dict]:
        return [client.snapshot() for client in self.clients]

    def _carried(self, node: bytes, url: str, failed: list[str]) -> None:
        old = self._via.get(node)
        if old == url:
            return
        self._via[node] = url
        self._bound(self._via)
        if old is not None:
            self.counters["moves"] += 1
            client = self._by_url.get(old)
            if old in failed:
                why = f"{old} failed sending"
            elif client is not None and not client.connected:
                why = f"{old}: {client.last_error or client.state}"
            else:
                why = f"{prefix(node)} not connected to {old}"
            if self.on_move is not None:
                self.on_move(Move(node, old, url, why))

    def _why_none(self, node: bytes, peer_relays: Sequence[str]) -> str:
        ours = ", ".join(f"{c.url} ({'connected' if c.connected else c.state})" for c in self.clients)
        if peer_relays and not set(peer_relays) & set(self._by_url):
            theirs = ", ".join(peer_relays)
            return f"no relay in common with {prefix(node)} (it holds {theirs}; we hold {ours})"
        return f"no relay reaches {prefix(node)} now (ours: {ours})"

    @staticmethod
    def _bound(table: dict) -> None:
        if len(table) > MAX_REMEMBERED:
            del table[next(iter(table))]
