"""Which path carries each direction of each link, and why.

Per peer and per direction: the path in use (``direct``, ``relay`` or
``none``), outbound attempts and successes, inbound messages seen per path,
the last RTT and why the last direct attempt failed.  The SWIM core reports
probe verdicts (direct answered, only the relayed ping was, or neither was and
only other members vouched for the peer: ``none``); every probe tries direct
first, so a recovered link is used again within a period.

A peer's new process (a restart) is shown as ``unknown`` until a probe of it
gives a verdict: what the old process's probes showed is not its, and a direct
path nobody has tested yet is not one that works.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..identity import prefix
from ..wire import (
    GOSSIP_BUDGET_BYTES,
    MAX_PATH_ENTRIES,
    MAX_REASON_CHARS,
    MAX_RELAY_URL_CHARS,
    PACKET_OVERHEAD,
    PathEntry,
    PathSummary,
    encoded_size,
)

# A summary must fit one gossip packet, or the broadcast queue would never send it.
MAX_SUMMARY_BYTES = GOSSIP_BUDGET_BYTES - PACKET_OVERHEAD - 64

DIRECT, RELAY, NONE = "direct", "relay", "none"
UNKNOWN = "unknown"  # shown, never routed on: a new process no probe has given a verdict on
# Why a direction reads none while the peer is alive: a probe ended with neither our direct
# ping nor a relayed one answered, and only ping-req helpers vouched for the peer.
VOUCHED_ONLY = "direct ping unanswered; only others vouched"  # fits a summary (MAX_REASON_CHARS)


@dataclass
class Outbound:
    path: str = DIRECT
    since: float = 0.0
    attempts: int = 0  # datagrams we sent
    direct_failures: int = 0  # probes whose direct ping went unanswered
    relay_ok: int = 0  # probes answered only over the relay
    last_failure: str | None = None
    punched: str | None = None  # the address a punch through its NAT opened (direct goes there)
    # The peer's new process has had no probe verdict yet: our datagrams go by ``path`` (direct,
    # as to a member just met), but the direction shows as unknown, not as working.
    unprobed: bool = False

    @property
    def shown(self) -> str:
        """The path as views and summaries show it."""
        return UNKNOWN if self.unprobed else self.path


@dataclass
class Inbound:
    seen: dict[str, int] = field(default_factory=lambda: {DIRECT: 0, RELAY: 0})
    last_path: str = NONE
    last_seen: float | None = None

    @property
    def path(self) -> str:
        return self.last_path


@dataclass
class PeerPaths:
    out: Outbound = field(default_factory=Outbound)
    inn: Inbound = field(default_factory=Inbound)


class PathTable:
    def __init__(self) -> None:
        self.peers: dict[bytes, PeerPaths] = {}

    def _peer(self, node: bytes) -> PeerPaths:
        peer = self.peers.get(node)
        if peer is None:
            peer = self.peers[node] = PeerPaths()
        return peer

    def out_path(self, node: bytes | None) -> str:
        """The path our datagrams to ``node`` take: ``direct``, ``relay`` or ``none``."""
        if node is None:
            return DIRECT
        peer = self.peers.get(node)
        return peer.out.path if peer is not None else DIRECT

    def shown_path(self, node: bytes) -> str:
        """The outbound path to ``node`` as it is shown: ``out_path``, or ``unknown`` while
        its new process has had no probe verdict."""
        peer = self.peers.get(node)
        return peer.out.shown if peer is not None else DIRECT

    def sent(self, node: bytes | None) -> None:
        if node is not None:
            self._peer(node).out.attempts += 1

    def received(self, node: bytes, via: str, now: float) -> None:
        inn = self._peer(node).inn
        inn.seen[via] = inn.seen.get(via, 0) + 1
        inn.last_path = via
        inn.last_seen = now

    def probe_verdict(self, node: bytes, direct: bool | None, now: float, reason: str) -> bool:
        """Record what a probe showed; True if the outbound path shown changed.

        ``direct`` None: the probe ended with only other members vouching for the peer (neither
        our direct ping nor a relayed one was answered), so no path of ours is known to reach
        it: ``none``, with ``VOUCHED_ONLY`` as the reason (``reason`` speaks of a relay that
        answered).  Our datagrams still go direct: nothing else could carry them."""
        out = self._peer(node).out
        if direct is None:
            out.direct_failures += 1
            out.last_failure = VOUCHED_ONLY
            if out.shown == NONE:
                return False
            out.path, out.since, out.unprobed = NONE, now, False
            return True
        new = DIRECT if direct else RELAY
        if not direct:
            out.direct_failures += 1
            out.relay_ok += 1
            out.last_failure = reason
        if new == out.shown:
            return False
        out.path, out.since, out.unprobed = new, now, False
        return True

    def missed(self, node: bytes) -> None:
        """Another probe's direct ping to ``node`` went unanswered, the path as it was."""
        self._peer(node).out.direct_failures += 1

    def set_punched(self, node: bytes, addr: str | None) -> None:
        """Our direct packets to ``node`` go to ``addr``, opened by hole punching (None: its own)."""
        self._peer(node).out.punched = addr

    def punched(self, node: bytes | None) -> bool:
        """Our direct path to ``node`` is one hole punching opened, and in use."""
        peer = self.peers.get(node) if node is not None else None
        return peer is not None and peer.out.path == DIRECT and peer.out.punched is not None

    def unreachable(self, node: bytes, now: float, reason: str) -> None:
        """Failure detection found ``node`` down (dead or left): no path reaches it."""
        out = self._peer(node).out
        out.last_failure = reason
        if out.shown != NONE:
            out.path, out.since, out.unprobed = NONE, now, False

    def restarted(self, node: bytes, now: float) -> None:
        """``node`` runs a new process (a new epoch): the counts, failures and path our
        packets and probes showed of its old process say nothing of the new one.  Our
        datagrams go direct, as to a member just met, but the direction shows as unknown
        until a probe of the new process gives its verdict (the SWIM core owes one), so
        neither the old process's failures are blamed on it nor a direct path that nobody
        has tested is reported as working.  Where a punch through its NAT opened the way
        stays the SWIM core's to say."""
        punched = self.peers[node].out.punched if node in self.peers else None
        self.peers[node] = PeerPaths(Outbound(since=now, punched=punched, unprobed=True))

    def revived(self, node: bytes, now: float) -> None:
        """A member is back: try direct again (the next probe will tell)."""
        out = self._peer(node).out
        if out.path == NONE:
            out.path, out.since = DIRECT, now

    def view(self, node: bytes, now: float, stale_after: float | None = None) -> dict:
        """What we know of our paths with ``node``.  ``path_in`` is the way its last packet
        came, or ``none`` when nothing has come from it for ``stale_after`` seconds."""
        peer = self._peer(node)
        out, inn = peer.out, peer.inn
        stale = stale_after is not None and (inn.last_seen is None or now - inn.last_seen > stale_after)
        return {
            "peer": prefix(node),
            "path_out": out.shown,
            "punched": out.punched if out.shown == DIRECT else None,
            "path_out_since_s": round(now - out.since, 3) if out.since else None,
            "path_in": NONE if stale else inn.path,
            "path_in_seen_s": None if inn.last_seen is None else round(now - inn.last_seen, 3),
            "out_attempts": out.attempts,
            "direct_failures": out.direct_failures,
            "relay_ok": out.relay_ok,
            "in_seen": dict(inn.seen),
            "last_failure": out.last_failure,
        }

    def summary(self, me: bytes, version: int, peers: list[tuple[bytes, float | None, str | None]],
                now: float) -> PathSummary:
        """Our outbound view of ``peers`` ((node, the last RTT over the path each entry names, the
        relay that carries it if any)), compact enough to gossip.

        A failure reason rides along only when the path is not direct: it is what
        explains an asymmetric pair, and it keeps a healthy mesh's summary small.  In a
        mesh too big for one packet, relay and none entries go first; the direct ones
        that do not fit are left out (the topology shows them as not reported).  A peer
        whose new process has had no probe verdict is left out too: it is not reported
        yet, which every reader takes as unknown (the wire has no word for it).
        """
        entries = []
        for node, rtt, relay in peers[:MAX_PATH_ENTRIES]:
            peer = self.peers.get(node)
            out = peer.out if peer is not None else Outbound()
            if out.unprobed:
                continue
            reason = "" if out.path == DIRECT else (out.last_failure or "")[:MAX_REASON_CHARS].rstrip(" ;,.")
            carrier = relay if out.path == RELAY and relay and len(relay) <= MAX_RELAY_URL_CHARS else ""
            entries.append(PathEntry(node, out.path, 0 if rtt is None else max(0, round(rtt * 1e6)),
                                     out.direct_failures, reason,
                                     max(0, round((now - out.since) * 1000)) if out.since else 0, carrier,
                                     out.path == DIRECT and out.punched is not None))
        entries.sort(key=lambda e: e.path == DIRECT)  # stable: keeps the callers' order within
        summary = PathSummary(me, version, tuple(entries))
        while entries and encoded_size(summary) > MAX_SUMMARY_BYTES:
            del entries[-max(1, len(entries) // 8):]
            summary = PathSummary(me, version, tuple(entries))
        return summary
