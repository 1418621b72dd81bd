"""Hole punching: reaching a member behind a NAT directly, sans-IO.

A member behind a NAT gossips the addresses it may be reached at (its bound
one, and the mapping a STUN server saw: ``Meta.addrs``).  Its advertised
address does not route, so our direct pings fail and the probe falls back to
the relay.  Then, as Tailscale's disco and iroh do:

1. we send a ``Punch`` to each of its addresses, and over the relay a
   ``CallMeMaybe`` with ours;
2. it sends a ``Punch`` to each of ours: that opens its NAT towards us (a NAT
   lets in what answers a packet that went out), and we learn the address its
   packet came from (peer-reflexive, the mapping this path really uses);
3. the first ``PunchAck`` that echoes our nonce names the address that works:
   from then on everything we send it directly goes there ("direct (punched)"),
   its probes included, so the probe verdict says direct again.

A round sends ``TRIES`` punches ``GAP_S`` apart; one that nothing answers is
tried again after ``RETRY_S``, doubling up to ``RETRY_MAX_S``.  The end that was
asked (a call, or a punch that got in) punches the asker's own address too:
that is the one it gossips, and the one that works when only our side has a NAT.
A NAT forgets a mapping nobody uses (30 s for UDP on Linux): a punched address
that carried nothing for ``KEEPALIVE_S`` gets one small ``Punch``, counted.  A
member whose NAT maps per destination (``Meta.nat == "symmetric"``) is not
punched: the mapping we would learn is not the one its packets to us use, so
the pair stays on the relay, and ``status`` says why.

Only members are punched or answered, and an answer counts only with the
nonce of a round we started, sent to one of the member's addresses: a stranger
cannot point our packets for a member at an address of its choosing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from ..wire import MAX_ADDRS, CallMeMaybe, Punch
from .state import Member

TRIES = 5  # punches per address in one round
GAP_S = 0.2  # between a round's punches
RETRY_S = 2.5  # after a round nothing answered; doubling each time
RETRY_MAX_S = 30.0
KEEPALIVE_S = 20.0  # a punched address that carried nothing this long gets a punch (NATs forget at 30 s)
MAX_OBSERVED = 4  # peer-reflexive addresses kept per member


@dataclass
class _Peer:
    observed: list[str] = field(default_factory=list)  # where its punches came from, newest last
    nonce: int = 0  # of the round under way, 0 if none
    tries_left: int = 0
    next_at: float = float("inf")  # the next punch of the round under way
    retry_at: float = 0.0  # no new round before this (the last one went unanswered)
    punched: str | None = None  # the address that answered
    last_sent: float = 0.0  # anything we sent to the punched address
    rounds_failed: int = 0
    status: str = ""  # why it is not punched, for the path reason (short: summaries keep 48 characters)
    asked: bool = False  # the round under way answers the peer's call: its own address too


@dataclass(frozen=True, slots=True)
class Send:
    """A packet the core should send: ``msgs`` to ``addr`` (``node``), over ``via``."""

    addr: str
    node: bytes
    msgs: tuple
    via: str


class Punching:
    """Per member: the punch round under way, the address that answered, and why not."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.peers: dict[bytes, _Peer] = {}

    # ------------------------------------------------------------ views

    def address(self, node: bytes) -> str | None:
        """The punched address of ``node``, if one answered."""
        peer = self.peers.get(node)
        return peer.punched if peer is not None else None

    def status(self, node: bytes) -> str:
        """Why ``node`` is not punched ("" if it is, or nobody tried)."""
        peer = self.peers.get(node)
        return peer.status if peer is not None and peer.punched is None else ""

    def next_deadline(self) -> float:
        t = float("inf")
        for peer in self.peers.values():
            t = min(t, peer.next_at, peer.last_sent + KEEPALIVE_S if peer.punched else t)
            if not peer.nonce and peer.punched is None and peer.rounds_failed:
                t = min(t, peer.retry_at)
        return t

    # ------------------------------------------------------------ what happened

    def direct_failed(self, m: Member, me: Member, now: float) -> list[Send]:
        """Our direct pings to ``m`` went unanswered: punch, unless we cannot."""
        peer = self.peers.setdefault(m.id, _Peer())
        if peer.punched is not None:
            peer.punched = None  # the mapping went: punch again
        if peer.nonce:
            return []  # a round is under way
        if m.meta.nat == "symmetric":
            peer.status = "behind a symmetric NAT: not punched"
            return []
        if me.meta.nat == "symmetric":
            peer.status = "we are behind a symmetric NAT: not punched"
            return []
        if not self._targets(m, peer, False):
            return []  # no NAT in the way, nothing to try: a filter, a host down
        if now < peer.retry_at:
            return []  # the last round went unanswered: wait
        return self._start(m, me, peer, now, call=True)

    def called(self, m: Member, me: Member, addrs: tuple[str, ...], now: float) -> list[Send]:
        """``m`` asked us over the relay to punch towards ``addrs``."""
        peer = self.peers.setdefault(m.id, _Peer())
        if me.meta.nat == "symmetric" or peer.nonce or now < peer.retry_at:
            return []  # a member's call cannot make us punch faster than our own rounds would
        for addr in addrs[:MAX_ADDRS]:
            self._observe(peer, addr)
        return self._start(m, me, peer, now, call=False, asked=True)

    def punched_by(self, m: Member, me: Member, source: str, now: float) -> list[Send]:
        """``m``'s punch reached us from ``source``: its NAT's mapping towards us.  Punch back,
        if our own direct path to it is not known to work, so our NAT lets its packets in."""
        peer = self.peers.setdefault(m.id, _Peer())
        self._observe(peer, source)
        if peer.punched is not None or peer.nonce or me.meta.nat == "symmetric" or m.meta.nat == "symmetric":
            return []
        return self._start(m, me, peer, now, call=False, asked=True)

    def answered(self, m: Member, nonce: int, source: str, now: float) -> bool:
        """A ``PunchAck`` from ``m`` at ``source``; True if it opened the path (a new address)."""
        peer = self.peers.get(m.id)
        if peer is None or not nonce or nonce != peer.nonce:
            return False
        if source not in self._targets(m, peer, True):
            return False  # never an address nobody named for it
        if source == m.addr:  # its own address answers: nothing in the way, nothing to redirect
            peer.nonce, peer.tries_left, peer.next_at, peer.status = 0, 0, float("inf"), ""
            return False
        new = peer.punched != source
        peer.punched, peer.last_sent = source, now
        peer.nonce, peer.tries_left, peer.next_at = 0, 0, float("inf")
        peer.rounds_failed, peer.retry_at, peer.status = 0, 0.0, ""
        return new

    def sent(self, node: bytes, addr: str, now: float) -> None:
        """We sent ``node`` something at ``addr`` (it keeps the mapping open)."""
        peer = self.peers.get(node)
        if peer is not None and peer.punched == addr:
            peer.last_sent = now

    def forget(self, node: bytes) -> None:
        """``node`` died or left: its mappings mean nothing to its next process."""
        self.peers.pop(node, None)

    # ------------------------------------------------------------ time

    def due(self, members: dict[bytes, Member], me: Member, now: float,
            failing: Callable[[bytes], bool]) -> list[Send]:
        """The punches and keepalives due at ``now``, and the next round for a member whose direct
        path is still ``failing`` once the wait after an unanswered round is over."""
        out: list[Send] = []
        for node, peer in list(self.peers.items()):
            m = members.get(node)
            if m is None or not m.state.live:
                continue
            if peer.punched is not None and now >= peer.last_sent + KEEPALIVE_S:
                peer.last_sent = now
                out.append(Send(peer.punched, node, (Punch(0, node),), "direct"))
            if not peer.nonce and peer.punched is None and peer.rounds_failed and now >= peer.retry_at:
                if not failing(node):
                    peer.rounds_failed, peer.status = 0, ""  # direct works again: nothing to retry
                    continue
                out += self.direct_failed(m, me, now)
                if not peer.nonce:  # nothing to try now (a NAT kind learned since): not before long
                    peer.retry_at = now + RETRY_MAX_S
                continue
            if now < peer.next_at or not peer.nonce:
                continue
            if peer.tries_left > 0:
                out += self._punches(m, peer, now)
            else:  # the round ended unanswered: the next probe that fails after retry_at tries again
                peer.nonce, peer.rounds_failed, peer.next_at = 0, peer.rounds_failed + 1, float("inf")
                peer.retry_at = now + min(RETRY_MAX_S, RETRY_S * 2 ** (peer.rounds_failed - 1))
                rounds = peer.rounds_failed
                peer.status = f"no answer to {rounds} punch round{'s' if rounds > 1 else ''}"
        return out

    # ------------------------------------------------------------ rounds

    def _start(self, m: Member, me: Member, peer: _Peer, now: float, *, call: bool,
               asked: bool = False) -> list[Send]:
        if not self._targets(m, peer, asked):
            return []
        peer.asked = asked
        peer.nonce = self.rng.getrandbits(63) | 1
        peer.tries_left = TRIES
        out = self._punches(m, peer, now)
        ours = tuple(a for a in me.meta.addrs[:MAX_ADDRS])
        if call and ours:
            out.append(Send(f"relay:{m.prefix}", m.id, (CallMeMaybe(ours),), "relay"))
        return out

    def _punches(self, m: Member, peer: _Peer, now: float) -> list[Send]:
        peer.tries_left -= 1
        peer.next_at = now + GAP_S
        targets = self._targets(m, peer, peer.asked)
        return [Send(addr, m.id, (Punch(peer.nonce, m.id),), "direct") for addr in targets]

    @staticmethod
    def _targets(m: Member, peer: _Peer, own: bool) -> list[str]:
        """Where ``m`` may be reached: the addresses it gossips, then where its punches came from;
        its own (advertised) address only with ``own``, since our probes tried that one."""
        out = [a for a in m.meta.addrs[:MAX_ADDRS] if own or a != m.addr]
        out += [a for a in peer.observed if a not in out and (own or a != m.addr)]
        return out

    @staticmethod
    def _observe(peer: _Peer, addr: str) -> None:
        if addr in peer.observed:
            return
        peer.observed.append(addr)
        del peer.observed[:-MAX_OBSERVED]
