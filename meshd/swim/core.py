"""SWIM + Lifeguard membership as a sans-IO state machine.

No sockets, no clock, no global randomness: the driver passes ``now`` and a
seeded ``random.Random`` in, feeds received datagrams to
:meth:`Swim.receive_datagram`, sleeps until :meth:`Swim.next_deadline`, calls
:meth:`Swim.tick`, and sends what :meth:`Swim.outbox` returns.  The same
object runs in the trio node, in the in-memory test network and in the
thousand-node simulator.

The protocol follows memberlist: randomized round-robin probing, ping-req
through ``indirect_checks`` helpers with Lifeguard nacks, a local health
multiplier, suspicion that shrinks with independent confirmations, the buddy
system, incarnation refutation, piggybacked dissemination, push-pull sync and
graceful leave.  One departure: dedicated gossip packets carry only fresh news
and come from a fixed per-member budget (see :meth:`Swim._gossip`), so the
per-member message rate does not grow with the cluster.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from ..identity import prefix
from ..wire import (
    MAX_PACKET_BYTES,
    MAX_STREAM_BYTES,
    PACKET_OVERHEAD,
    Ack,
    Alive,
    CallMeMaybe,
    Dead,
    KeyringChange,
    MemberState,
    Message,
    Meta,
    Nack,
    NameClaim,
    Packet,
    PathSummary,
    Ping,
    PingReq,
    Punch,
    PunchAck,
    PushPull,
    Suspect,
    UnsupportedVersion,
    WireError,
    decode,
    encoded_size,
    next_counter,
)
from .awareness import Awareness
from .broadcast import BroadcastQueue
from .config import Config
from .facts import Facts, Unsigned, accusation_data, alive_data, claim_data, keyring_change_data, paths_data
from .punch import Punching, Send
from .registry import Registry
from .state import Event, EventKind, Member, Outgoing, State
from .suspicion import Suspicion
from .twin import Twins

INF = float("inf")

# Members we hold at most, dead and left included: a stranger's push-pulls full of
# made-up members must not grow our memory without bound.  Far above any real mesh.
MAX_MEMBERS = 10_000

# Members a joiner tells about itself directly once its join is answered.
JOIN_ANNOUNCE = 3

# An unanswered join is sent again every join_retry_interval for its first few attempts
# (a lost datagram costs one interval), then at twice the wait each time, up to this many
# intervals apart (memberlist leaves retrying to its caller).
JOIN_STEADY_ATTEMPTS = 4
JOIN_BACKOFF_MAX = 8

# Dead members we ask back per reconnect interval at most (in turn, when there are more).
MAX_RECONNECTS = 8

# About how many members, all told, ask each dead member back per interval.  Serf asks
# with probability failed/alive, so that the cluster makes about one attempt per dead
# member per interval whatever its size; a few more ride out a lost packet.
RECONNECT_ASKERS = 3

# Names only the nodes of an allow list may claim (``--allow-nodes``): the pipeline's.
STAGE_NAME_PREFIXES = ("pp-stage-", "pp-entry", "pp-exit")


def _allowed(allow_nodes: frozenset[bytes] | None, owner: bytes, name: str) -> bool:
    return allow_nodes is None or owner in allow_nodes or not name.startswith(STAGE_NAME_PREFIXES)


# Keyring changes we remember having applied, per issuer: their highest clock.
MAX_KEYRING_ISSUERS = 1024


@dataclass(slots=True)
class _Probe:
    """Our probe of one member in the current protocol period."""

    target: bytes
    seq: int
    sent_at: float
    timeout_at: float  # direct ping deadline; then ping-req
    end_at: float  # end of the period; no ack by then means suspect
    indirect_sent: bool = False
    expected_nacks: int = 0
    relay_seq: int | None = None  # the same ping, sent over the relay after the timeout
    relay_sent_at: float = 0.0  # when that relayed ping went: its round trip counts from here
    acked: bool = False  # the member answered, by some path
    acked_at: float = 0.0  # when the first answer came, by any path
    answered: bool = False  # the member itself answered (direct or over the relay), not only helpers
    epoch: int = 0  # the target's process when the direct ping went (its Meta.epoch)
    helpers: frozenset[bytes] = frozenset()
    nackers: set[bytes] = field(default_factory=set)  # helpers that said "no answer"


@dataclass(slots=True)
class _Relay:
    """A ping we send on behalf of a ping-req; its ack goes back to the requester."""

    requester: bytes
    requester_addr: str
    their_seq: int
    nack_at: float  # INF when no nack was asked for
    expire_at: float


class Swim:
    def __init__(
        self,
        node_id: bytes,
        addr: str,
        meta: Meta,
        config: Config,
        rng: random.Random,
        now: float,
        facts: Facts | None = None,
        allow_nodes: frozenset[bytes] | None = None,
        incarnation: int = 0,
    ) -> None:
        """``incarnation``: where this process starts counting.  A node starts past every
        incarnation its earlier processes can have signed (from the clock): their words,
        replayed, are then older than ours and move nothing (see twin.py)."""
        self.id = node_id
        # Who signs and checks facts (see facts.py): the node's identity; nobody in the simulator.
        self.facts: Facts = facts if facts is not None else Unsigned()
        # Node ids that may claim stage names; None lets every member.
        self.allow_nodes = allow_nodes
        self._alive_signed: tuple[tuple[int, str, Meta], bytes] | None = None
        self._keyring_clocks: dict[bytes, int] = {}  # issuer -> highest change clock applied
        self.keyring_clock = 0  # our own changes' clock
        self.config = config
        self.rng = rng
        self.incarnation = incarnation
        me = Member(node_id, addr, meta, incarnation, State.ALIVE, now, last_seen=now)
        self.members: dict[bytes, Member] = {node_id: me}
        self.registry = Registry()
        self.awareness = Awareness(config.awareness_max_multiplier)
        self.broadcasts = BroadcastQueue(node_id)
        self.counters: Counter[str] = Counter()
        self.leaving = False
        self.twins = Twins(meta.epoch, meta.started)  # other processes that signed as us
        # Each node's latest summary of its own outbound paths, and when we took it in.
        self.path_summaries: dict[bytes, tuple[PathSummary, float]] = {}

        self._live: list[bytes] = []  # other members alive or suspect, for random picks
        self._live_index: dict[bytes, int] = {}
        self._recent_dead: dict[bytes, float] = {}  # node -> when it died or left
        self._probe_list: list[bytes] = []
        self._probe_pos = 0
        self._probe: _Probe | None = None
        self._relays: dict[int, _Relay] = {}
        self._suspicions: dict[bytes, Suspicion] = {}
        self._my_names: set[str] = set()
        # Probes the target itself answered, per member: how often we tested our path to it.
        self.path_checks: dict[bytes, int] = {}
        self._direct_pings: dict[bytes, tuple[int, float]] = {}  # last direct ping per prober: (seq, when)
        # The last probe verdict on our direct path to each member; None for a member's new
        # process that no probe has given one yet (its first verdict is news, direct or not).
        self._direct_ok: dict[bytes, bool | None] = {}
        # Members whose last verdict was that only ping-req helpers vouched for them: neither our
        # direct ping nor a relayed one was answered (reported as a PATH event with direct None).
        self._unanswered: set[bytes] = set()
        self._seq = rng.randrange(1 << 31)
        self._out: list[Outgoing] = []
        self._events: list[Event] = []
        self._seeds: tuple[str, ...] = ()
        # The seeds the operator gave (--seed): asked back while no live member answers there
        # (see _reconnect_targets); the driver sets them.
        self.anchors: tuple[str, ...] = ()
        self._rx_via: str | None = None  # the path the packet being handled came in on
        # Addresses that answered a direct ping we sent there (see ``answered_addrs``);
        # a dict as an ordered set, bounded for drivers that never ask.
        self._answered: dict[str, None] = {}
        self.punch = Punching(rng)  # members reached through their NAT (see punch.py)
        self._now = now  # the time of the call being handled, for what _send records

        # Stagger the first timers so nodes started together do not tick in step.
        self._next_probe = now + rng.uniform(0, config.probe_interval)
        self._next_gossip = now + rng.uniform(0, config.gossip_interval)
        self._gossip_tokens = float(config.gossip_burst)
        self._next_push_pull = now + rng.uniform(0, config.push_pull_interval)
        self._next_join = INF
        self._join_wait = config.join_retry_interval  # the next wait between join attempts
        self.join_attempts = 0  # join push-pulls sent since the last join() call
        self._next_reconnect = now + config.reconnect_interval
        self._reconnect_pos = 0  # where the next round of reconnects starts
        self._reconnect_asked: set[str] = set()  # addresses asked back this interval, unanswered
        self.broadcasts.queue(node_id, self._alive_self())

    # ------------------------------------------------------------------ views

    @property
    def me(self) -> Member:
        return self.members[self.id]

    def live_count(self) -> int:
        """Members alive or suspect, ourselves included."""
        return len(self._live) + 1

    def member_by_name(self, name: str) -> Member | None:
        for m in self.members.values():
            if m.meta.name == name and m.state.live:
                return m
        return None

    def resolve(self, name: str) -> bytes | None:
        """One live owner of a registered name (alive before suspect, then the lowest id), or None."""
        owners = self.live_owners(name)
        return owners[0] if owners else None

    def live_owners(self, name: str) -> list[bytes]:
        """The live set of ``name``: owners of its live entries that are alive or suspect,
        alive ones first, each group by node id."""
        live = []
        for owner in self.registry.owners(name):
            m = self.members.get(owner)
            if m is not None and m.state.live and not (owner == self.id and self.leaving):
                live.append((m.state is not State.ALIVE, owner))
        return [owner for _suspect, owner in sorted(live)]

    def suspicion_deadline(self, node: bytes) -> float | None:
        s = self._suspicions.get(node)
        return s.deadline if s else None

    # -------------------------------------------------------------- commands

    def join(self, seeds: list[str] | tuple[str, ...], now: float) -> None:
        """Push-pull with each seed; retried, with a growing wait, until one of them answers.

        A node that is in a mesh already (it knows a live member, and no join of its own is
        waiting) only asks each address once, as memberlist's Join does for a member: a
        mistyped one must not make the node look out of the mesh, nor drop the seeds it has."""
        if not self.joining and any(m.state is State.ALIVE for n, m in self.members.items() if n != self.id):
            packet = self._packet([self._push_pull(True, True)])
            for addr in dict.fromkeys(seeds):
                if addr != self.me.addr:
                    self._out.append(Outgoing(addr, None, packet, True))
                    self.counters["tx_join"] += 1
            return
        self._seeds = tuple(s for s in seeds if s != self.me.addr)
        if self._seeds:
            self._join_wait, self.join_attempts = self.config.join_retry_interval, 0
            self._send_join(now)

    @property
    def joining(self) -> bool:
        """We asked seeds to let us in and none has answered yet."""
        return self._next_join != INF

    @property
    def seeds(self) -> tuple[str, ...]:
        return self._seeds

    def join_via_relay(self, nodes: list[bytes], now: float) -> int:
        """While joining: the same join push-pull to ``nodes``, known only by node id, over the
        relay (the driver sends an address ``relay:<prefix>`` there).  Their answer lets us in
        as a seed's would.  Returns how many were asked."""
        if not self.joining:
            return 0
        packet = self._packet([self._push_pull(True, True)])
        asked = 0
        for node in nodes:
            if node == self.id or node in self.members:
                continue
            self._out.append(Outgoing(f"relay:{node.hex()[:8]}", node, packet, True, via="relay"))
            self.counters["tx_join_via_relay"] += 1
            asked += 1
        return asked

    def set_meta(self, meta: Meta, now: float) -> None:
        """Change our metadata; a new incarnation carries it to everyone."""
        me = self.me
        me.meta = replace(meta, generation=next_counter(me.meta.generation))
        self.incarnation = next_counter(self.incarnation)
        me.incarnation = self.incarnation
        self.broadcasts.queue(self.id, self._alive_self())
        self._emit(EventKind.UPDATE, self.id, now)

    def probe_soon(self, node: bytes, now: float) -> None:
        """Probe ``node`` next, at once if no probe is under way: its address must answer a
        ping of ours before it gets more than a small budget from us (see the node's guard)."""
        if self._probe_next(node) and self._probe is None:
            self._next_probe = min(self._next_probe, now)

    def _probe_next(self, node: bytes) -> bool:
        """Put ``node`` next in the probe list (the probe under way stays); False: not probed."""
        m = self.members.get(node)
        if m is None or node == self.id or not m.state.live or (self._probe and self._probe.target == node):
            return False
        if node in self._probe_list:
            at = self._probe_list.index(node)
            del self._probe_list[at]
            if at < self._probe_pos:  # the members after it keep their turn this round
                self._probe_pos -= 1
        self._probe_list.insert(self._probe_pos, node)
        return True

    def publish_paths(self, summary: PathSummary, now: float) -> None:
        """Gossip our own outbound path summary; a newer one replaces any still queued.

        Its version goes past any summary in our name we have seen, so ours always
        replaces one somebody else made up.
        """
        held = self.path_summaries.get(self.id)
        if held is not None and summary.version <= held[0].version:
            summary = replace(summary, version=next_counter(held[0].version))
        self._on_path_summary(self._sign_paths(summary), now)

    def register_name(self, name: str, now: float) -> None:
        if not self.may_hold(name):
            # Every member refuses this claim (``_on_name``, counted there), and so do we: held
            # in our own registry alone, it would make our view (readiness, doctor) count us
            # as serving the stage.
            self.registry.own_clock = next_counter(self.registry.own_clock)
            claim = NameClaim(name=name, owner=self.id, clock=self.registry.own_clock, tombstone=False)
            self.broadcasts.queue(("name", name, self.id), self._sign_claim(claim))
            return
        claim = self.registry.claim(name, self.id, self._sign_claim)
        self._my_names.add(name)
        self.broadcasts.queue(("name", name, self.id), claim)
        self._emit(EventKind.NAME, self.id, now, name=name)

    def withdraw_names(self, now: float) -> None:
        """Tombstone every name we hold (a drain: new requests go to the other owners)."""
        self._my_names.clear()
        for tomb in self.registry.tombstone_owner(self.id, self._sign_claim):
            self.registry.own_clock = max(self.registry.own_clock, tomb.clock)
            self.broadcasts.queue(("name", tomb.name, self.id), tomb, urgent=True)
            self._emit(EventKind.NAME, self.id, now, name=tomb.name, tombstone=True)

    def warm_start(self, members: list[MemberState], now: float) -> None:
        """Start as a long-settled member that already knows ``members`` (alive).

        For simulations that begin from a converged cluster: no join events,
        nothing queued to gossip, and the push-pull timer spread over the
        interval a cluster of this size uses, as it would be after running a
        while.  The probe order is shuffled from our own ``rng``.
        """
        for ms in members:
            if ms.node == self.id or ms.node in self.members:
                continue
            m = Member(ms.node, ms.addr, ms.meta, ms.incarnation, State.ALIVE, now)
            self.members[ms.node] = m
            self._set_live(m, True)
            self._probe_list.append(ms.node)
        self.rng.shuffle(self._probe_list)
        self._probe_pos = 0
        self.broadcasts = BroadcastQueue(self.id)
        interval = self.config.push_pull_interval_for(self.live_count())
        self._next_push_pull = now + self.rng.uniform(0, interval)

    def leave(self, now: float) -> None:
        """Announce a graceful leave to every live member (and by gossip)."""
        if self.leaving:
            return
        self.leaving = True
        if self.twins.yielded is not None:
            return  # the id is the twin's now: a leave under it would take the twin out
        self._probe = None
        me = self.me
        me.state = State.LEFT
        me.state_change = now
        msg = self._accusation(Dead, self.id, self.incarnation)
        me.proof = msg.sig  # push-pull passes our leave on as our own word
        self.broadcasts.queue(self.id, msg)
        for node in list(self._live)[:64]:
            m = self.members[node]
            self._send(m.addr, node, [msg])

    # ------------------------------------------------------------- receiving

    def receive_datagram(
        self, data: bytes, addr: str, now: float, stream: bool = False, via: str | None = None
    ) -> bytes | None:
        """The receive boundary: bad bytes become a counter, never an exception.

        ``stream`` marks bytes that came over a reliable stream, where a full
        push-pull state may exceed a datagram.  ``via="relay"`` marks a packet
        the relay delivered: a ping that came that way is answered that way.
        Returns the sender's id, or None for a packet that was refused.
        """
        try:
            packet = decode(data, MAX_STREAM_BYTES if stream else MAX_PACKET_BYTES)
        except UnsupportedVersion:
            self.counters["rx_refused_newer_version"] += 1
            return None
        except WireError:
            self.counters["rx_bad_packet"] += 1
            return None
        self.counters["rx_bytes"] += len(data)
        self.receive(packet, addr, now, via)
        return packet.sender

    def receive(self, packet: Packet, addr: str, now: float, via: str | None = None) -> None:
        self._now = now
        sender = packet.sender
        if sender == self.id:
            # Our own packet come back, or another process under our id (twin.py): its
            # signed word on us is all we take from it.
            for msg in packet.messages:
                if type(msg) is Alive and msg.node == self.id:
                    self._on_alive(msg, now)
            return
        self.counters["rx_packets"] += 1
        m = self.members.get(sender)
        if m is not None:
            m.last_seen = now
        self._rx_via = via
        try:
            for msg in packet.messages:
                handler = self._handlers.get(type(msg))
                if handler is not None:
                    handler(self, msg, sender, addr, now)
        finally:
            self._rx_via = None
        if self._reconnect_asked and addr in self._reconnect_asked:
            self._reconnect_answered(addr, sender)

    def _handle_ping(self, msg: Ping, sender: bytes, addr: str, now: float) -> None:
        if msg.target != self.id:
            # A stale address now used by someone else; acking would lie.
            self.counters["rx_ping_for_other"] += 1
            return
        # Answer on the path the ping came in on, as memberlist acks its TCP
        # fallback ping on the same connection: a relayed ping is the prober's
        # question "are you alive when UDP fails?", and a UDP ack would lose
        # the answer as often as the ping it stood in for.
        if self._rx_via != "relay":
            self._direct_pings[sender] = (msg.seq, now)
            self._send(addr, sender, [Ack(msg.seq)], via=self._rx_via)
            return
        acks: list[Message] = [Ack(msg.seq)]
        direct = self._direct_pings.pop(sender, None)
        if direct is not None and now - direct[1] <= self.config.probe_interval:
            # Its direct ping of this probe did reach us; only our answer got lost.
            # Say so first, over the relay: that direction works.
            acks.insert(0, Ack(direct[0]))
        self._send(addr, sender, acks, via="relay")

    def _handle_ping_req(self, msg: PingReq, sender: bytes, addr: str, now: float) -> None:
        if sender not in self.members:
            # Only members may make us probe: a stranger's ping-req would turn us
            # into a reflector towards any address it names.
            self.counters["rx_ping_req_refused"] += 1
            return
        if msg.target == self.id:
            self._send(addr, sender, [Ack(msg.seq)], via=self._rx_via)
            return
        target = self.members.get(msg.target)
        if target is None or target.addr != msg.target_addr:
            # Whatever its state here (the requester may know better), a member we know is
            # at that address; any other address is the asker's to name, not ours to probe.
            self.counters["rx_ping_req_refused"] += 1
            return
        seq = self._next_seq()
        cfg = self.config
        nack_at = now + cfg.probe_timeout * 0.8 if msg.nack else INF
        self._relays[seq] = _Relay(sender, addr, msg.seq, nack_at, now + cfg.probe_interval)
        self.counters["tx_relayed_pings"] += 1
        self._send(msg.target_addr, msg.target, [Ping(seq, msg.target)])

    def _handle_ack(self, msg: Ack, sender: bytes, addr: str, now: float) -> None:
        probe = self._probe
        if probe is not None and msg.seq in (probe.seq, probe.relay_seq):
            from_target = sender == probe.target  # else a ping-req helper forwarded it
            direct = msg.seq == probe.seq and from_target
            if not probe.acked:
                probe.acked, probe.acked_at = True, now
                self.counters["acks"] += 1
                if not probe.indirect_sent:
                    self.awareness.apply_delta(-1)
            relayed = msg.seq == probe.relay_seq
            # Each path's round trip from its own ping's send: the relayed ping went a probe
            # timeout after the direct one, which must not count as relay latency.
            rtt = now - (probe.relay_sent_at if relayed else probe.sent_at)
            if direct:
                self.members[probe.target].rtt = rtt
                if len(self._answered) < 1024:
                    # It received our direct ping at its address, whichever path the ack took.
                    target = self.members[probe.target]
                    self._answered[self.punch.address(target.id) or target.addr] = None
            elif relayed and from_target:
                self.members[probe.target].relay_rtt = rtt
            if from_target:
                probe.answered = True
                self.path_checks[probe.target] = self.path_checks.get(probe.target, 0) + 1
            recheck = False
            # A direct ping that went to a process since replaced says nothing of the direct
            # path to the one that answered over the relay.
            same_process = self.members[probe.target].meta.epoch == probe.epoch
            if from_target and (direct or same_process) and (
                    self._direct_ok.get(probe.target, True) != direct or probe.target in self._unanswered):
                # Only the relayed ping was answered (or direct works again, or this is a new
                # process's first verdict): a path fact, not a failure of the member.
                self._direct_ok[probe.target] = direct
                self._unanswered.discard(probe.target)
                self._emit(EventKind.PATH, probe.target, now, direct=direct, rtt=rtt)
                # One lost ping (a host too busy to answer in time) must not leave the
                # direction on the relay for a whole round of the probe list: the next
                # period's probe goes to this member again, and a direct answer moves it back.
                recheck = not direct
            elif from_target and not direct and same_process:
                self._emit(EventKind.MISSED, probe.target, now)  # counted: a one-way link stays one
            if from_target and not direct:
                # Its NAT may let us in once both ends punch (each round paced by punch.py).
                self._punch_sends(self.punch.direct_failed(self.members[probe.target], self.me, now))
            if direct or probe.relay_seq is None or msg.seq == probe.relay_seq:
                self._probe = None
                if not probe.answered:
                    recheck = self._vouched_only(probe, now)
                if recheck:
                    self._probe_next(probe.target)
            # else: a helper vouched for the member; keep listening for the relayed
            # ack until the period ends, to learn which path reaches it.
            return
        relay = self._relays.pop(msg.seq, None)
        if relay is not None:
            self._send(relay.requester_addr, relay.requester, [Ack(relay.their_seq)])

    def _handle_nack(self, msg: Nack, sender: bytes, addr: str, now: float) -> None:
        probe = self._probe
        if probe is not None and msg.seq == probe.seq and sender in probe.helpers:
            probe.nackers.add(sender)  # per helper: a duplicate must not hide a missing one

    def _handle_alive(self, msg: Alive, sender: bytes, addr: str, now: float) -> None:
        self._on_alive(msg, now)

    def _handle_suspect(self, msg: Suspect, sender: bytes, addr: str, now: float) -> None:
        self._on_suspect(msg, now)

    def _handle_dead(self, msg: Dead, sender: bytes, addr: str, now: float) -> None:
        self._on_dead(msg, now)

    def _handle_name(self, msg: NameClaim, sender: bytes, addr: str, now: float) -> None:
        self._on_name(msg, now)

    def _handle_push_pull(self, msg: PushPull, sender: bytes, addr: str, now: float) -> None:
        self.counters["rx_push_pull"] += 1
        # A member, or a seed answering the join we are still waiting on, tells us the
        # whole mesh.  A stranger speaks for itself only (a joiner knows nobody else
        # yet): its word must not fill our member list with made-up members at others'
        # addresses.
        known = sender in self.members or (self._next_join != INF and not msg.reply)
        incarnation = self.incarnation
        if msg.reply:
            # Our whole state goes only to a member we know, or one that joins in this very
            # push-pull (a restarted one needs it to learn what to refute): a stranger's
            # empty push-pull gets nothing back.
            if known or any(ms.node == sender for ms in msg.members):
                self._out.append(Outgoing(addr, sender, self._packet([self._push_pull(False, False)]), True))
            else:
                self.counters["rx_push_pull_refused"] += 1
        for ms in msg.members:
            if not known and ms.node != sender:
                continue
            if ms.state == State.ALIVE:
                self._on_alive(Alive(ms.incarnation, ms.node, ms.addr, ms.meta, ms.sig), now)
            elif ms.state == State.LEFT:
                self._on_dead(Dead(ms.incarnation, ms.node, ms.node, ms.sig), now)  # its own leave
            else:
                # Dead is only a suspicion until we see it ourselves: it may refute.
                # A member we never knew stays unknown (memberlist's mergeState:
                # suspectNode ignores unknown nodes); if it lives, its own Alive
                # will reach us.  Nobody signed the entry, so the suspicion goes on
                # in our own name, as memberlist's goes on in the sender's.
                self._hearsay(ms, now)
        for claim in msg.names:
            if known or claim.owner == sender:
                self._on_name(claim, now)
        if self.live_count() > 1:
            if self._next_join != INF:
                # A restarted member learns from the seed's answer that it left or died, and
                # refutes: the seed holds our join push-pull at the old incarnation, which it
                # ignored, so it hears the refutation from us too, not only by gossip.
                self._announce(sender, tell_seed=self.incarnation != incarnation)
            self._next_join = INF

    def _handle_path_summary(self, msg: PathSummary, sender: bytes, addr: str, now: float) -> None:
        held = self.path_summaries.get(msg.node)
        if msg.node == self.id:
            if held is not None and msg.version >= held[0].version and self._verified(
                    self.id, msg.sig, lambda: paths_data(msg)):
                # Our last process's summary: say our own paths again, past its version.
                self.counters["path_summary_refuted"] += 1
                self._on_path_summary(self._sign_paths(replace(held[0], version=next_counter(msg.version))),
                                      now)
            return
        if msg.node not in self.members:
            return  # only members' paths are drawn; a known member's next summary arrives soon
        if held is not None and held[0].version >= msg.version:
            return
        if not self._verified(msg.node, msg.sig, lambda: paths_data(msg)):
            self.counters["rx_bad_signature"] += 1
            return
        self._on_path_summary(msg, now)

    def _on_path_summary(self, msg: PathSummary, now: float) -> None:
        held = self.path_summaries.get(msg.node)
        if held is not None and held[0].version >= msg.version:
            return  # old news: neither kept nor passed on
        self.path_summaries[msg.node] = (msg, now)
        self.broadcasts.queue(("paths", msg.node), msg, background=True)

    def _handle_keyring_change(self, msg: KeyringChange, sender: bytes, addr: str, now: float) -> None:
        if msg.issuer == self.id or msg.clock <= self._keyring_clocks.get(msg.issuer, -1):
            return  # ours, or applied already
        if msg.issuer not in self.members or not self._verified(
                msg.issuer, msg.sig, lambda: keyring_change_data(msg)):
            self.counters["rx_bad_signature"] += 1
            return
        self._keyring_clocks[msg.issuer] = msg.clock
        if len(self._keyring_clocks) > MAX_KEYRING_ISSUERS:
            del self._keyring_clocks[next(iter(self._keyring_clocks))]
        self.broadcasts.queue(("keyring", msg.issuer), msg, urgent=True)
        self._emit(EventKind.KEYRING, msg.issuer, now, change=msg)

    def _handle_punch(self, msg: Punch, sender: bytes, addr: str, now: float) -> None:
        if msg.target != self.id or self._rx_via == "relay":
            self.counters["rx_punch_refused"] += 1
            return
        if not msg.nonce:
            self.counters["rx_punch_keepalives"] += 1
            return  # a keepalive: its arrival was the point
        # Answered as a ping is, one small packet for one (a member whose news has not reached
        # us yet punches too); only a member's punch makes us punch back.
        self._out.append(Outgoing(addr, sender, self._packet([PunchAck(msg.nonce, addr)]), via="direct"))
        self.counters["tx_punch_acks"] += 1
        m = self.members.get(sender)
        if m is not None and m.state.live:
            self._punch_sends(self.punch.punched_by(m, self.me, addr, now))

    def _handle_punch_ack(self, msg: PunchAck, sender: bytes, addr: str, now: float) -> None:
        m = self.members.get(sender)
        if m is None or self._rx_via == "relay" or not self.punch.answered(m, msg.nonce, addr, now):
            return
        # The ack echoes a nonce only the address we punched saw: it is the member's.
        if len(self._answered) < 1024:
            self._answered[addr] = None
        self.counters["punched"] += 1
        self._emit(EventKind.PUNCHED, sender, now, addr=addr, seen=msg.seen)
        self.probe_soon(sender, now)  # the next probe goes there: the verdict follows

    def _handle_call_me_maybe(self, msg: CallMeMaybe, sender: bytes, addr: str, now: float) -> None:
        m = self.members.get(sender)
        if m is None or not m.state.live or self._rx_via != "relay":
            return  # the relay vouches for who asks; a datagram could claim anyone
        self._punch_sends(self.punch.called(m, self.me, msg.addrs, now))

    def _vouched_only(self, probe: _Probe, now: float) -> bool:
        """``probe`` is over: helpers vouched for its member, but it answered neither our direct
        ping nor one over the relay (none went, or none came back).  That is a verdict on our
        path to it too, reported once (a PATH event with ``direct`` None): without it a new
        process's path would read unknown for good.  True if it is news: the next period
        probes the member again, so one lost ping does not hold the verdict for a round."""
        node = probe.target
        m = self.members.get(node)
        if m is None or m.meta.epoch != probe.epoch:
            return False  # a ping to a process since replaced says nothing of the new one's path
        if node in self._unanswered:
            self._emit(EventKind.MISSED, node, now)  # said already: counted
            return False
        self._unanswered.add(node)
        self._emit(EventKind.PATH, node, now, direct=None, rtt=probe.acked_at - probe.sent_at)
        return True

    def _direct_failing(self, node: bytes) -> bool:
        """Our last probe of ``node`` found its direct path down (only the relayed ping answered)."""
        return self._direct_ok.get(node) is False

    def _punch_sends(self, sends: list[Send]) -> None:
        for send in sends:
            self._out.append(Outgoing(send.addr, send.node, self._packet(list(send.msgs)), via=send.via))
            self.counters["tx_punches" if send.via == "direct" else "tx_call_me_maybe"] += 1

    _handlers: ClassVar[dict[type[Message], Callable[[Swim, Any, bytes, str, float], None]]] = {
        Ping: _handle_ping,
        PingReq: _handle_ping_req,
        Ack: _handle_ack,
        Nack: _handle_nack,
        Alive: _handle_alive,
        Suspect: _handle_suspect,
        Dead: _handle_dead,
        NameClaim: _handle_name,
        PushPull: _handle_push_pull,
        PathSummary: _handle_path_summary,
        KeyringChange: _handle_keyring_change,
        Punch: _handle_punch,
        PunchAck: _handle_punch_ack,
        CallMeMaybe: _handle_call_me_maybe,
    }

    # -------------------------------------------------------- state changes

    def _on_alive(self, msg: Alive, now: float) -> None:
        if msg.node == self.id:
            if msg.incarnation >= self.incarnation and self._refutes and (
                msg.incarnation > self.incarnation or msg.meta != self.me.meta or msg.addr != self.me.addr
            ) and self._signed_alive(msg):
                # Our own word, from our last process: say ours past it.
                self._refute(msg.incarnation, now)
                if msg.meta.epoch != self.me.meta.epoch:
                    self._other_process(msg, now)
            return
        m = self.members.get(msg.node)
        if m is None:
            if len(self.members) >= MAX_MEMBERS:
                self.counters["members_refused_full"] += 1
                return
            if not self._signed_alive(msg):
                return
            state = State.ALIVE
            m = Member(msg.node, msg.addr, msg.meta, msg.incarnation, state, now, proof=msg.sig)
            self.members[msg.node] = m
            self._set_live(m, True)
            # A newcomer goes to a random place in the probe order (memberlist).
            self._probe_list.insert(self.rng.randint(0, len(self._probe_list)), msg.node)
            self.broadcasts.queue(msg.node, msg)
            self._emit(EventKind.JOIN, msg.node, now)
            return
        if msg.incarnation <= m.incarnation or not self._signed_alive(msg):
            return
        self._suspicions.pop(msg.node, None)
        old = m.state
        meta_changed = m.meta != msg.meta or m.addr != msg.addr
        if m.meta.epoch != msg.meta.epoch:
            # A new process under a known node id: whatever it held (sessions, caches) is gone,
            # and what our probes showed of its direct path was the old process's.  The driver
            # shows the new one's path as unknown until the first verdict, which is emitted
            # even when it finds direct working.
            self.counters["restarts_seen"] += 1
            self._direct_ok[msg.node] = None
            self._unanswered.discard(msg.node)
            self._emit(EventKind.RESTART, msg.node, now, epoch=msg.meta.epoch)
        m.incarnation, m.addr, m.meta, m.proof = msg.incarnation, msg.addr, msg.meta, msg.sig
        if old is not State.ALIVE:
            m.state, m.state_change = State.ALIVE, now
        if old is State.DEAD:
            # Its names come back with it: what we wrote when we declared it dead was ours.
            for claim in self.registry.revive_owner(msg.node):
                self._emit(EventKind.NAME, msg.node, now, name=claim.name, tombstone=False)
        self._set_live(m, True)
        # A refutation clears a suspicion: it goes before accusations and other news,
        # so that it beats the suspicion timers it races (a false death is the worse error).
        self.broadcasts.queue(msg.node, msg, urgent=old is State.SUSPECT)
        if old in (State.DEAD, State.LEFT):
            self._unanswered.discard(msg.node)  # the driver takes it to be direct again (paths.revived)
            if msg.node not in self._probe_list:
                self._probe_list.insert(self.rng.randint(0, len(self._probe_list)), msg.node)
            self._emit(EventKind.JOIN, msg.node, now)
        elif old is State.SUSPECT:
            self._emit(EventKind.ALIVE, msg.node, now)
        elif meta_changed:
            self._emit(EventKind.UPDATE, msg.node, now)

    def _hearsay(self, ms: MemberState, now: float) -> None:
        """A push-pull says ``ms.node`` is suspect or dead: we suspect it ourselves, signed,
        unless that would change nothing (signing costs more than the check)."""
        m = self.members.get(ms.node)
        if m is None or ms.incarnation < m.incarnation or not m.state.live:
            return
        if ms.node == self.id:
            # Whoever says it, we answer in our own word.  Past our incarnation, only as our
            # own signed Alive there (our last process's, which the entry carries) moves us.
            if ms.incarnation > self.incarnation:
                self._on_alive(Alive(ms.incarnation, ms.node, ms.addr, ms.meta, ms.sig), now)
            elif self._refutes:
                self._refute(ms.incarnation, now)
            return
        if self._ahead(m, ms.incarnation):
            return
        s = self._suspicions.get(ms.node)
        if m.state is State.SUSPECT and (s is None or not s.would_confirm(self.id)):
            return
        self._on_suspect(self._accusation(Suspect, ms.node, ms.incarnation), now)

    def _on_suspect(self, msg: Suspect, now: float) -> None:
        """``msg.sender`` suspects ``msg.node``, in its own signed word."""
        m = self.members.get(msg.node)
        if m is None:
            return
        if msg.incarnation < m.incarnation:
            if msg.node == self.id and self._refutes:
                # A stale accusation: its author missed our refutation; say it again.
                self.broadcasts.queue(self.id, self._alive_self())
            return
        if self._ahead(m, msg.incarnation):
            return
        if msg.node == self.id:
            if self._refutes and self._signed_accusation(msg):
                self._refute(msg.incarnation, now)
            return
        if m.state is State.SUSPECT:
            s = self._suspicions.get(msg.node)
            if s is not None and s.would_confirm(msg.sender) and self._signed_accusation(msg):
                s.confirm(msg.sender)
                self.broadcasts.queue(msg.node, msg)  # spread the confirmation
            return
        if m.state is not State.ALIVE or not self._signed_accusation(msg):
            return
        m.incarnation, m.state, m.state_change = msg.incarnation, State.SUSPECT, now
        self.broadcasts.queue(msg.node, msg)
        self.counters["suspicions"] += 1
        cfg = self.config
        n = self.live_count()
        k = cfg.suspicion_mult - 2
        if n - 2 < k:
            k = 0  # too few members to expect confirmations
        low, high = cfg.suspicion_bounds(n)
        self._suspicions[msg.node] = Suspicion(msg.sender, k, low, high, now)
        self._emit(EventKind.SUSPECT, msg.node, now, by=prefix(msg.sender))

    def _on_dead(self, msg: Dead, now: float) -> None:
        m = self.members.get(msg.node)
        if m is None or msg.incarnation < m.incarnation or m.state in (State.DEAD, State.LEFT):
            return
        if msg.sender != msg.node and self._ahead(m, msg.incarnation):
            return  # a leave is the member's own word, at whatever incarnation it says
        if not self._signed_accusation(msg):
            return  # a leave is only ever the member's own word; a death, a member's
        if msg.node == self.id:
            if self._refutes:
                self._refute(msg.incarnation, now)
            return
        self._suspicions.pop(msg.node, None)
        left = msg.sender == msg.node
        m.incarnation, m.state_change = msg.incarnation, now
        m.state = State.LEFT if left else State.DEAD
        if left:
            m.proof = msg.sig
        self._set_live(m, False)
        self.broadcasts.queue(msg.node, msg)
        for tomb in self.registry.tombstone_owner(msg.node):
            self._emit(EventKind.NAME, msg.node, now, name=tomb.name, tombstone=True)
        self._emit(EventKind.LEFT if left else EventKind.DEAD, msg.node, now, by=prefix(msg.sender))

    def _on_name(self, claim: NameClaim, now: float) -> None:
        held = self.registry.get(claim.name, claim.owner)
        if held is not None and not claim.beats(held):
            return  # old news: no signature to check
        if not claim.tombstone and not self._may_claim(claim):
            self.counters["rx_names_refused"] += 1
            return
        if not self._verified(claim.owner, claim.sig, lambda: claim_data(claim)):
            self.counters["rx_bad_signature"] += 1
            return
        if not self.registry.merge(claim):
            return
        self.broadcasts.queue(("name", claim.name, claim.owner), claim)
        self._emit(EventKind.NAME, claim.owner, now, name=claim.name, tombstone=claim.tombstone)
        if claim.owner != self.id or self.leaving:
            return
        # An entry in our own name that is not what we say now: a tombstone written while
        # we live (or by our last process), or a claim our last process made.  Say it again
        # past it, as a refute does: our claim, or our tombstone for a name we no longer hold.
        self.registry.own_clock = max(self.registry.own_clock, claim.clock)
        if claim.name in self._my_names:
            if claim.tombstone:
                self.register_name(claim.name, now)
        elif not claim.tombstone:
            self.counters["names_withdrawn"] += 1
            for tomb in self.registry.tombstone_owner_name(self.id, claim.name, self._sign_claim):
                self.broadcasts.queue(("name", tomb.name, self.id), tomb)

    def _ahead(self, m: Member, incarnation: int) -> bool:
        """Whether an accusation of ``m`` names an incarnation past the newest its own signed
        Alive gave us (ours, for us: ``self.me``): nobody saw it live there, so nobody can
        suspect it there.  Such an accusation is dropped, counted: taken, it would set the
        member's incarnation where it cannot answer (at COUNTER_MAX a refutation cannot
        beat it), and a live member would be buried for good.  An honest accuser that saw a
        newer Alive than ours is rare and brief: that Alive reaches us by the same gossip."""
        if incarnation <= m.incarnation:
            return False
        self.counters["rx_accusations_ahead"] += 1
        return True

    @property
    def _refutes(self) -> bool:
        """Whether we answer what is said of us: not while leaving, nor once a twin keeps our id."""
        return not self.leaving and self.twins.yielded is None

    def _other_process(self, msg: Alive, now: float) -> None:
        """Another process signed ``msg`` under our id and we refuted it: our last one, or a
        live twin if it keeps answering (twin.py).  Of two, the later started stops refuting."""
        twin = self.twins.heard(msg.meta.epoch, msg.addr, msg.meta.started, msg.incarnation,
                                self.incarnation, now)
        # Our refutation straight to the process that spoke: a live twin answers in a round
        # trip, not after the push-pulls that alone reach the one of us the others do not route to.
        for addr in dict.fromkeys((msg.addr, *msg.meta.addrs)):
            if addr != self.me.addr and addr not in self.me.meta.addrs:
                self._out.append(Outgoing(addr, None, self._packet([self._alive_self()]), via="direct"))
                break
        if twin is None:
            return
        self.counters["twins"] += 1
        keep = self.twins.keeps_id(twin)
        if not keep:
            self.twins.yielded = twin
        self._emit(EventKind.TWIN, self.id, now, twin=twin, keep=keep)

    def _refute(self, accused: int, now: float) -> None:
        self.incarnation = next_counter(max(self.incarnation, accused))
        self.me.incarnation = self.incarnation
        self.awareness.apply_delta(1)
        self.counters["refutes"] += 1
        self.broadcasts.queue(self.id, self._alive_self())

    # ----------------------------------------------------------------- time

    def next_deadline(self) -> float:
        """The earliest time :meth:`tick` has work to do."""
        if self.leaving:
            return self._next_gossip
        t = min(self._next_gossip, self._next_push_pull, self._next_join, self._next_reconnect)
        probe = self._probe
        if probe is None:
            t = min(t, self._next_probe)
        else:
            t = min(t, probe.end_at if probe.indirect_sent else probe.timeout_at)
        for s in self._suspicions.values():
            if s.deadline < t:
                t = s.deadline
        for r in self._relays.values():
            t = min(t, r.nack_at, r.expire_at)
        return min(t, self.punch.next_deadline())

    def tick(self, now: float) -> None:
        self._now = now
        if self.leaving:
            if now >= self._next_gossip:
                self._gossip(now)
            return
        probe = self._probe
        if probe is not None and not probe.indirect_sent and now >= probe.timeout_at:
            self._send_ping_reqs(probe, now)
        if probe is not None and now >= probe.end_at:
            if probe.acked:
                self._probe = None
                if not probe.answered and self._vouched_only(probe, now):
                    self._probe_next(probe.target)
            else:
                self._probe_failed(probe, now)
        if self._probe is None and now >= self._next_probe:
            self._start_probe(now)
        if now >= self._next_gossip:
            self._gossip(now)
        if now >= self._next_push_pull:
            self._periodic_push_pull(now)
        if now >= self._next_join:
            self._send_join(now)
        if now >= self._next_reconnect:
            self._reconnect(now)
        for node, s in list(self._suspicions.items()):
            if now >= s.deadline:
                del self._suspicions[node]
                m = self.members[node]
                if m.state is State.SUSPECT:
                    self.counters["declared_dead"] += 1
                    self._on_dead(self._accusation(Dead, node, m.incarnation), now)
        for seq, r in list(self._relays.items()):
            if now >= r.nack_at:
                self._send(r.requester_addr, r.requester, [Nack(r.their_seq)])
                del self._relays[seq]
            elif now >= r.expire_at:
                del self._relays[seq]
        for send in self.punch.due(self.members, self.me, now, self._direct_failing):
            if send.msgs and isinstance(send.msgs[0], Punch) and not send.msgs[0].nonce:
                # A keepalive goes alone: one small packet, no gossip riding on it.
                self._out.append(Outgoing(send.addr, send.node, self._packet(list(send.msgs)), via="direct"))
                self.counters["tx_punch_keepalives"] += 1
            else:
                self._punch_sends([send])

    def _start_probe(self, now: float) -> None:
        cfg = self.config
        interval = self.awareness.scale(cfg.probe_interval)
        self._next_probe = now + interval
        target = self._next_probe_target()
        if target is None:
            return
        m = self.members[target]
        seq = self._next_seq()
        timeout = self.awareness.scale(cfg.probe_timeout)
        self._probe = _Probe(target, seq, now, now + timeout, now + interval, epoch=m.meta.epoch)
        msgs: list[Message] = [Ping(seq, target)]
        if m.state is State.SUSPECT:
            # Buddy system: tell the suspect directly, so it can refute at once.
            msgs.append(self._accusation(Suspect, target, m.incarnation))
        self.counters["probes"] += 1
        # Always direct, even when the path table prefers the relay: this is how a
        # recovered direct link is found again.
        self._send(m.addr, target, msgs, via="direct")

    def _next_probe_target(self) -> bytes | None:
        for _ in range(2):
            while self._probe_pos < len(self._probe_list):
                node = self._probe_list[self._probe_pos]
                self._probe_pos += 1
                m = self.members.get(node)
                if m is not None and m.state.live:
                    return node
            # A full round: drop the dead, reshuffle (randomized round-robin).
            self._probe_list = [n for n in self._probe_list if self.members[n].state.live]
            self.rng.shuffle(self._probe_list)
            self._probe_pos = 0
            if not self._probe_list:
                return None
        return None

    def _send_ping_reqs(self, probe: _Probe, now: float) -> None:
        probe.indirect_sent = True
        target = self.members[probe.target]
        if set(target.meta.relay_urls) & set(self.me.meta.relay_urls):
            # The same question over the relay: an answer there means the member
            # is alive and only the direct path is down.
            probe.relay_seq, probe.relay_sent_at = self._next_seq(), now
            self._send(target.addr, probe.target, [Ping(probe.relay_seq, probe.target)], via="relay")
            self.counters["relay_pings"] += 1
        # Helpers are alive members only (memberlist): a suspect is likely down,
        # and its missing nack would count against our own health.
        helpers = self._random_members(self.config.indirect_checks, exclude=probe.target, alive_only=True)
        for node in helpers:
            helper = self.members[node]
            self._send(helper.addr, node, [PingReq(probe.seq, probe.target, target.addr, True)])
        probe.expected_nacks = len(helpers)
        probe.helpers = frozenset(helpers)
        self.counters["ping_reqs"] += len(helpers)

    def _probe_failed(self, probe: _Probe, now: float) -> None:
        self._probe = None
        if not probe.indirect_sent:
            self._send_ping_reqs(probe, now)
        # Lifeguard: missing nacks mean our own links are the likely problem.
        if probe.expected_nacks > 0:
            self.awareness.apply_delta(probe.expected_nacks - len(probe.nackers))
        else:
            self.awareness.apply_delta(1)
        self.counters["probe_failures"] += 1
        m = self.members.get(probe.target)
        if m is not None and m.state.live:
            # Already suspect: our own failed probe is an independent confirmation.
            self._on_suspect(self._accusation(Suspect, probe.target, m.incarnation), now)

    def _gossip(self, now: float) -> None:
        """Dedicated gossip: only for fresh news, and within a budget.

        memberlist sends ``gossip_nodes`` packets on every tick with anything
        queued, so the more events a cluster has (and a bigger cluster has
        more), the more packets each member sends.  Here a tick sends only while
        some queued fact has gone out fewer than ``gossip_fresh_transmits``
        times, just enough packets to bring it there, each paid from a token
        bucket (``gossip_per_period`` per probe interval, ``gossip_burst`` at
        most).  The rest of each fact's ``retransmit_limit`` transmissions ride
        on pings, acks, ping-reqs and nacks, which are sent anyway (SWIM's
        piggybacking): messages per member stay flat in N, bytes grow.
        """
        cfg = self.config
        self._next_gossip = max(self._next_gossip + cfg.gossip_interval, now)
        refill = cfg.gossip_per_period * cfg.gossip_interval / cfg.probe_interval
        self._gossip_tokens = min(float(cfg.gossip_burst), self._gossip_tokens + refill)
        fewest = self.broadcasts.fewest_transmits()
        if fewest is None:
            return
        k = min(cfg.gossip_nodes, int(self._gossip_tokens), cfg.gossip_fresh_transmits - fewest)
        if k <= 0:
            return
        for node in self._random_members(k, gossip_at=now):
            msgs = self._take_broadcasts(cfg.gossip_budget)
            if not msgs:
                break
            m = self.members[node]
            self._out.append(Outgoing(m.addr, node, self._packet(msgs)))
            self._gossip_tokens -= 1.0
            self.counters["tx_packets"] += 1
            self.counters["tx_gossip"] += 1

    def _periodic_push_pull(self, now: float) -> None:
        cfg = self.config
        self._next_push_pull = now + cfg.push_pull_interval_for(self.live_count())
        picks = self._random_members(1, alive_only=True)
        if picks:
            m = self.members[picks[0]]
            self._out.append(Outgoing(m.addr, m.id, self._packet([self._push_pull(False, True)]), True))
            self.counters["tx_push_pull"] += 1

    def _send_join(self, now: float) -> None:
        self._next_join = now + self._join_wait
        self.join_attempts += 1
        if self.join_attempts >= JOIN_STEADY_ATTEMPTS:
            self._join_wait = min(self._join_wait * 2, self.config.join_retry_interval * JOIN_BACKOFF_MAX)
        packet = self._packet([self._push_pull(True, True)])
        for addr in self._seeds:
            self._out.append(Outgoing(addr, None, packet, True))
            self.counters["tx_join"] += 1

    def _reconnect(self, now: float) -> None:
        """Serf's reconnect: ask recently dead members back, at their last address.

        A member declared dead may be a restarted process that knows nobody (a seed
        has no seed to join).  Asking costs little: a join push-pull with ourselves
        only, all a node that does not know us takes from it.  Its answer makes us
        follow up with our whole state (see :meth:`_reconnect_answered`).  Each
        member asks each dead one with probability ``RECONNECT_ASKERS`` / (live
        members), so the mesh asks each about that often per interval.  A member
        that left said goodbye and is not asked back.
        """
        self._next_reconnect = now + self.config.reconnect_interval
        self._reconnect_asked.clear()  # an answer comes within the interval or not at all
        targets = self._reconnect_targets(now)
        if not targets:
            return
        share = RECONNECT_ASKERS / max(1, len(self._live))
        start = self._reconnect_pos % len(targets)
        picks: list[str] = []
        examined = 0
        for addr in targets[start:] + targets[:start]:
            if len(picks) == MAX_RECONNECTS:
                break
            examined += 1
            if share >= 1.0 or self.rng.random() < share:
                picks.append(addr)
        self._reconnect_pos = start + examined
        packet = self._packet([self._introduction()])
        for addr in picks:
            self._reconnect_asked.add(addr)
            self._out.append(Outgoing(addr, None, packet, True))
            self.counters["tx_reconnect"] += 1

    def _reconnect_answered(self, addr: str, sender: bytes) -> None:
        """Whoever answered at an address we asked back knows us now, so it takes our whole
        state: the mesh, and, if it is the member we declared dead, the news it must refute."""
        self._reconnect_asked.discard(addr)
        self._out.append(Outgoing(addr, sender, self._packet([self._push_pull(False, True)]), True))
        self.counters["tx_reconnect_followups"] += 1

    def _announce(self, seed: bytes, tell_seed: bool = False) -> None:
        """Our join was answered: tell a few more members about us at once (and the seed
        again, with ``tell_seed``).

        Gossip carries our Alive only ``retransmit_limit`` times from each node that
        heard it (2 on the local profile with a handful of members), and some of those
        go to members that just died or to ourselves: without this, the rest of a small
        mesh could first hear of us at the next push-pull, a quarter minute later."""
        intro = self._introduction()
        pp = PushPull(False, False, intro.members, intro.names)
        told = self._random_members(JOIN_ANNOUNCE, exclude=seed, alive_only=True)
        if tell_seed and seed in self.members:
            told = [*told, seed]
        for node in told:
            self._out.append(Outgoing(self.members[node].addr, node, self._packet([pp]), True))
            self.counters["tx_join_announce"] += 1

    def _introduction(self) -> PushPull:
        """A join push-pull that carries ourselves and our own names only."""
        me = self.me
        own = MemberState(me.id, me.addr, me.incarnation, int(me.state), me.meta, self._alive_self().sig)
        return PushPull(True, True, (own,), tuple(c for c in self.registry.claims if c.owner == self.id))

    def _reconnect_targets(self, now: float) -> list[str]:
        """Where to ask: the last address of each member dead (not left) for at most
        ``reconnect_timeout``, then each of our ``anchors``, every address once and none
        that a live member holds (a new process there has joined already).  An anchor is
        asked for as long as no live member answers there: a node restarted under a new key
        at its old address knows nobody, and none of us would ask it otherwise (its old
        self's last address may be another)."""
        anchors = [a for a in self.anchors if a != self.me.addr]
        if len(self.members) == self.live_count() and not anchors:
            return []  # nobody dead or left and no anchor, the usual case: no scan
        horizon = now - self.config.reconnect_timeout
        taken: set[str] = set()
        dead: list[str] = []
        for m in self.members.values():
            if m.state.live:
                taken.add(m.addr)
            elif m.state is State.DEAD and m.state_change >= horizon:
                dead.append(m.addr)
        targets = []
        for addr in [*dead, *anchors]:
            if addr not in taken:
                taken.add(addr)
                targets.append(addr)
        return targets

    # -------------------------------------------------------------- sending

    def outbox(self) -> list[Outgoing]:
        out, self._out = self._out, []
        return out

    def events(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def answered_addrs(self) -> list[str]:
        """Addresses whose member acked a direct ping we sent there, since the last call.

        The ack (direct, or over the relay, which vouches for its sender) echoes a
        sequence number only the ping's receiver saw, so the address really is the
        member's, not one a stranger wrote into a packet: the driver may send it
        more than it has received from it.
        """
        out, self._answered = list(self._answered), {}
        return out

    def _send(self, addr: str, node: bytes | None, msgs: list[Message], via: str | None = None) -> None:
        if via != "relay" and node is not None and (punched := self.punch.address(node)) is not None:
            m = self.members.get(node)
            if m is not None and addr == m.addr:
                addr = punched  # its advertised address does not route; this one answered
            self.punch.sent(node, addr, self._now)
        budget = self.config.gossip_budget - PACKET_OVERHEAD - sum(encoded_size(m) for m in msgs)
        msgs = msgs + self._take_broadcasts(budget)
        self._out.append(Outgoing(addr, node, self._packet(msgs), via=via))
        self.counters["tx_packets"] += 1

    def _take_broadcasts(self, budget: int) -> list[Message]:
        return self.broadcasts.take(budget, self.config.retransmit_limit(self.live_count()))

    def _packet(self, msgs: list[Message]) -> Packet:
        return Packet(sender=self.id, messages=tuple(msgs))

    def _push_pull(self, join: bool, reply: bool) -> PushPull:
        me = self.me
        members = tuple(
            MemberState(m.id, m.addr, m.incarnation, int(m.state), m.meta,
                        self._alive_self().sig if m is me and not self.leaving else m.proof)
            for m in self.members.values()
        )
        # Entries nobody signed (tombstones we wrote when an owner died) are ours alone.
        signed = self.facts.signing
        return PushPull(join, reply, members, tuple(c for c in self.registry.claims if c.sig or not signed))

    def _alive_self(self) -> Alive:
        me = self.me
        key = (self.incarnation, me.addr, me.meta)
        if self._alive_signed is None or self._alive_signed[0] != key:
            self._alive_signed = key, self._signature(lambda: alive_data(self.id, *key))
            me.proof = self._alive_signed[1]
        return Alive(self.incarnation, self.id, me.addr, me.meta, self._alive_signed[1])

    # ------------------------------------------------------------- signing

    def _verified(self, node: bytes, sig: bytes, data: Callable[[], bytes]) -> bool:
        """Whether ``sig`` is ``node``'s over what ``data`` builds (built only where facts are
        signed: the simulator's thousand nodes skip it)."""
        return not self.facts.signing or self.facts.verify(node, sig, data())

    def _signature(self, data: Callable[[], bytes]) -> bytes:
        return self.facts.sign(data()) if self.facts.signing else b""

    def _signed_alive(self, msg: Alive) -> bool:
        def data() -> bytes:
            return alive_data(msg.node, msg.incarnation, msg.addr, msg.meta)

        if self._verified(msg.node, msg.sig, data):
            return True
        self.counters["rx_bad_signature"] += 1
        return False

    def _signed_accusation(self, msg: Suspect | Dead) -> bool:
        """Whether ``msg`` is its sender's own signed word, and the sender a live member (or
        the accused itself, leaving): somebody who never joined accuses nobody.  An
        accusation of us needs only its signature: we answer any real one."""
        accuser = self.members.get(msg.sender)
        if msg.sender not in (msg.node, self.id) and msg.node != self.id and (
                accuser is None or not accuser.state.live):
            self.counters["rx_accusations_refused"] += 1
            return False
        kind = "suspect" if isinstance(msg, Suspect) else "dead"
        def data() -> bytes:
            return accusation_data(kind, msg.node, msg.incarnation, msg.sender)

        if self._verified(msg.sender, msg.sig, data):
            return True
        self.counters["rx_bad_signature"] += 1
        return False

    def _accusation(self, kind: type[Suspect] | type[Dead], node: bytes, incarnation: int) -> Any:
        """Our signed word that ``node`` is suspect or dead (our leave, for ourselves)."""
        label = "suspect" if kind is Suspect else "dead"
        sig = self._signature(lambda: accusation_data(label, node, incarnation, self.id))
        return kind(incarnation, node, self.id, sig)

    def _sign_claim(self, claim: NameClaim) -> NameClaim:
        return replace(claim, sig=self._signature(lambda: claim_data(claim)))

    def _sign_paths(self, summary: PathSummary) -> PathSummary:
        return replace(summary, sig=self._signature(lambda: paths_data(summary)))

    def _may_claim(self, claim: NameClaim) -> bool:
        """Whether ``claim.owner`` may hold ``claim.name``: stage names are for the allow list."""
        return _allowed(self.allow_nodes, claim.owner, claim.name)

    def may_hold(self, name: str) -> bool:
        """Whether our allow list (``--allow-nodes``) lets us hold ``name``."""
        return _allowed(self.allow_nodes, self.id, name)

    def keyring_change(self, change: KeyringChange, now: float) -> None:
        """Gossip our signed change of the mesh keyring to every member (the node applied it)."""
        self.keyring_clock = max(self.keyring_clock, change.clock)
        self.broadcasts.queue(("keyring", self.id), change, urgent=True)

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        return self._seq

    def _emit(self, kind: EventKind, node: bytes | None, now: float, **detail: Any) -> None:
        self._events.append(Event(kind, node, now, detail))

    # --------------------------------------------------------- random picks

    def _set_live(self, m: Member, live: bool) -> None:
        if live:
            self._recent_dead.pop(m.id, None)
        else:
            self._recent_dead[m.id] = m.state_change
            self.punch.forget(m.id)
        idx = self._live_index.get(m.id)
        if live and idx is None:
            self._live_index[m.id] = len(self._live)
            self._live.append(m.id)
        elif not live and idx is not None:
            last = self._live.pop()
            if last != m.id:
                self._live[idx] = last
                self._live_index[last] = idx
            del self._live_index[m.id]

    def _random_members(
        self, k: int, exclude: bytes | None = None, gossip_at: float | None = None, alive_only: bool = False
    ) -> list[bytes]:
        """Up to ``k`` distinct random live members; with ``gossip_at``, the recently dead too;
        with ``alive_only``, no suspects."""
        pool = self._live
        if gossip_at is not None and self._recent_dead:
            # Keep telling the recently dead: a live node wrongly declared can refute.
            horizon = gossip_at - self.config.gossip_to_the_dead_time
            for node, since in list(self._recent_dead.items()):
                if since < horizon:
                    del self._recent_dead[node]
            pool = pool + list(self._recent_dead)
        n = len(pool)
        if n == 0 or k <= 0:
            return []
        members = self.members
        if n <= 3 * k:
            picks = [p for p in pool if p != exclude
                     and not (alive_only and members[p].state is not State.ALIVE)]
            self.rng.shuffle(picks)
            return picks[:k]
        chosen: list[bytes] = []
        # Bounded, as memberlist's kRandomNodes: a pool of mostly suspects gives fewer.
        for _ in range(3 * n):
            p = pool[self.rng.randrange(n)]
            if p != exclude and p not in chosen and not (alive_only and members[p].state is not State.ALIVE):
                chosen.append(p)
                if len(chosen) == k:
                    break
        return chosen
