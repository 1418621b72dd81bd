"""The SWIM core's parts with exact numbers, and Swim objects driven by hand.

No network here: packets move only when a test hands them over with
``receive``, and time is whatever number the test passes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from meshd import wire
from meshd.swim import LAN, LOCAL, PROFILES, WAN, Config, EventKind, Outgoing, State, Swim
from meshd.swim.awareness import Awareness
from meshd.swim.broadcast import BroadcastQueue
from meshd.swim.registry import Registry
from meshd.swim.suspicion import Suspicion, suspicion_duration
from meshd.wire import Ack, Alive, Dead, Meta, Nack, NameClaim, Packet, Ping, PingReq, PushPull, Suspect

NODE_A = b"\xaa" * 32
NODE_B = b"\xbb" * 32
NODE_C = b"\xcc" * 32
NODE_D = b"\xdd" * 32
NODE_E = b"\xee" * 32

# ---------------------------------------------------------------- suspicion


# memberlist's TestSuspicion_remainingSuspicionTime cases (elapsed 0): min 2 s, max 30 s, k = 3.
@pytest.mark.parametrize(
    ("n", "expected"), [(0, 30.0), (1, 16.0), (2, 7.81), (3, 2.0), (4, 2.0), (5, 2.0)]
)
def test_suspicion_duration_matches_memberlist(n, expected):
    assert suspicion_duration(n, 3, 2.0, 30.0) == expected


def test_suspicion_duration_falls_from_max_to_min_as_confirmations_arrive():
    durations = [suspicion_duration(n, 5, 4.0, 24.0) for n in range(7)]
    assert durations[0] == 24.0
    assert durations[5] == 4.0 and durations[6] == 4.0
    assert all(a > b for a, b in zip(durations[:5], durations[1:6], strict=True))


@pytest.mark.parametrize("k", [0, -1])
def test_suspicion_duration_without_expected_confirmations_is_the_minimum(k):
    assert suspicion_duration(0, k, 4.0, 24.0) == 4.0


def test_suspicion_confirmations_move_the_deadline_earlier_up_to_k():
    s = Suspicion(NODE_A, k=3, low=2.0, high=30.0, start=100.0)
    assert s.deadline == 130.0

    assert s.confirm(NODE_A) is False  # the one who raised it is not a confirmation
    assert s.deadline == 130.0

    assert s.confirm(NODE_B) is True
    assert s.deadline == 116.0
    assert s.confirm(NODE_B) is False  # a duplicate counts once
    assert s.deadline == 116.0

    assert s.confirm(NODE_C) is True
    assert s.deadline == 107.81
    assert s.confirm(NODE_D) is True
    assert s.deadline == 102.0

    assert s.confirm(NODE_E) is False  # k reached: nothing more to count
    assert s.n == 3
    assert s.deadline == 102.0


def test_suspicion_with_k_zero_starts_at_the_minimum_and_ignores_confirmations():
    s = Suspicion(NODE_A, k=0, low=4.0, high=24.0, start=10.0)
    assert s.deadline == 14.0
    assert s.confirm(NODE_B) is False
    assert s.deadline == 14.0


# ------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("config", "n", "expected"),
    [
        (LAN, 0, (4.0, 24.0)),
        (LAN, 1, (4.0, 24.0)),
        (LAN, 10, (4.0, 24.0)),
        (LAN, 100, (8.0, 48.0)),
        (LAN, 1000, (12.0, 72.0)),
        (LOCAL, 5, (3.0, 18.0)),
        (LOCAL, 100, (6.0, 36.0)),
        (WAN, 10, (30.0, 180.0)),
    ],
)
def test_suspicion_bounds_exact(config, n, expected):
    assert config.suspicion_bounds(n) == expected


@pytest.mark.parametrize(("config", "mult"), [(LAN, 4), (LOCAL, 3)])
@pytest.mark.parametrize("n", [2, 20, 50, 500])
def test_suspicion_bounds_follow_memberlist_formula(config, mult, n):
    low, high = config.suspicion_bounds(n)
    assert low == pytest.approx(mult * max(1.0, math.log10(n)) * config.probe_interval)
    assert high == pytest.approx(6 * low)


@pytest.mark.parametrize(
    ("config", "n", "expected"),
    [(LAN, 1, 4), (LAN, 9, 4), (LAN, 10, 8), (LAN, 99, 8), (LAN, 100, 12), (LOCAL, 9, 2), (LOCAL, 10, 4)],
)
def test_retransmit_limit_is_mult_times_ceil_log10_n_plus_1(config, n, expected):
    assert config.retransmit_limit(n) == expected


def test_push_pull_interval_backs_off_beyond_32_members():
    # memberlist's TestPushPullScale, with a 1 s base.
    config = Config(push_pull_interval=1.0)
    assert {config.push_pull_interval_for(n) for n in range(0, 33)} == {1.0}
    assert {config.push_pull_interval_for(n) for n in range(33, 65)} == {2.0}
    assert {config.push_pull_interval_for(n) for n in range(65, 129)} == {3.0}
    assert config.push_pull_interval_for(129) == 4.0
    assert LAN.push_pull_interval_for(40) == 60.0


def test_profiles_carry_memberlist_values():
    assert PROFILES == {"lan": LAN, "wan": WAN, "local": LOCAL}
    # (probe_interval, probe_timeout, indirect_checks, retransmit_mult, suspicion_mult,
    #  suspicion_max_timeout_mult, push_pull_interval, gossip_interval, gossip_nodes,
    #  gossip_to_the_dead_time, awareness_max_multiplier)
    def timings(c: Config) -> tuple:
        return (c.probe_interval, c.probe_timeout, c.indirect_checks, c.retransmit_mult, c.suspicion_mult,
                c.suspicion_max_timeout_mult, c.push_pull_interval, c.gossip_interval, c.gossip_nodes,
                c.gossip_to_the_dead_time, c.awareness_max_multiplier)

    assert timings(LAN) == (1.0, 0.5, 3, 4, 4, 6, 30.0, 0.2, 3, 30.0, 8)
    assert timings(WAN) == (5.0, 3.0, 3, 4, 6, 6, 60.0, 0.5, 4, 60.0, 8)
    assert timings(LOCAL) == (1.0, 0.2, 1, 2, 3, 6, 15.0, 0.1, 3, 15.0, 8)


# ---------------------------------------------------------------- awareness


def test_awareness_clamps_and_scales_like_memberlist():
    # memberlist's TestAwareness table: (delta, score after, 1 s timeout scaled).
    steps = [
        (0, 0, 1.0), (-1, 0, 1.0), (-10, 0, 1.0), (1, 1, 2.0), (-1, 0, 1.0), (10, 7, 8.0),
        (-1, 6, 7.0), (-1, 5, 6.0), (-1, 4, 5.0), (-1, 3, 4.0), (-1, 2, 3.0), (-1, 1, 2.0),
        (-1, 0, 1.0), (-1, 0, 1.0),
    ]
    a = Awareness(8)
    for delta, score, timeout in steps:
        a.apply_delta(delta)
        assert (a.score, a.scale(1.0)) == (score, timeout), f"after delta {delta}"


# ---------------------------------------------------------------- broadcast


def alive(node: bytes, incarnation: int = 0) -> Alive:
    return Alive(incarnation, node, "10.0.0.1:7946", Meta(stage=1))


def test_broadcasts_fewest_transmitted_first():
    q = BroadcastQueue()
    q.queue(NODE_A, alive(NODE_A))
    q.queue(NODE_B, alive(NODE_B))
    assert q.take(10_000, limit=10) == [alive(NODE_B), alive(NODE_A)]  # newer first among equals
    q.queue(NODE_C, alive(NODE_C))
    one = wire.encoded_size(alive(NODE_C))
    assert q.take(one, limit=10) == [alive(NODE_C)]  # never sent beats sent once
    q.queue(NODE_D, alive(NODE_D))
    assert q.take(one, limit=10) == [alive(NODE_D)]
    assert q.take(one, limit=10) == [alive(NODE_D)]  # now all four were sent once; D is newest
    assert q.take(one, limit=10) == [alive(NODE_C)]


def test_path_summaries_never_go_before_membership_facts_and_name_claims():
    """A fresh path summary (each node republishes its own as its paths change) waits behind
    a name claim already sent twice: stages resolve each other by those names."""
    q = BroadcastQueue()
    claim = NameClaim("pp-stage-2", NODE_A, 1, False)
    q.queue(("name", "pp-stage-2"), claim)
    one = wire.encoded_size(claim)
    q.take(one, limit=10)
    q.take(one, limit=10)
    summary = wire.PathSummary(NODE_B, 7, ())
    q.queue(("paths", NODE_B), summary, background=True)
    assert q.take(one, limit=10) == [claim]
    assert q.take(10_000, limit=10) == [claim, summary]


def test_a_newer_fact_replaces_the_queued_one_with_the_same_key():
    q = BroadcastQueue()
    q.queue(NODE_A, alive(NODE_A, 0))
    q.queue(NODE_A, Suspect(0, NODE_A, NODE_B))
    q.queue(NODE_A, alive(NODE_A, 1))
    assert len(q) == 1
    assert q.take(10_000, limit=10) == [alive(NODE_A, 1)]


def test_a_replaced_fact_starts_over_at_zero_transmissions():
    q = BroadcastQueue()
    q.queue(NODE_A, alive(NODE_A, 0))
    for _ in range(3):
        q.take(10_000, limit=4)
    q.queue(NODE_A, alive(NODE_A, 1))
    assert [len(q.take(10_000, limit=4)) for _ in range(5)] == [1, 1, 1, 1, 0]


def test_broadcasts_are_dropped_after_limit_transmissions():
    q = BroadcastQueue()
    q.queue(NODE_A, alive(NODE_A))
    assert q.take(10_000, limit=3) == [alive(NODE_A)]
    assert q.take(10_000, limit=3) == [alive(NODE_A)]
    assert q.take(10_000, limit=3) == [alive(NODE_A)]
    assert len(q) == 0
    assert q.take(10_000, limit=3) == []


def test_broadcasts_respect_the_byte_budget():
    q = BroadcastQueue()
    big = Alive(0, NODE_A, "x" * 300, Meta(stage=1))
    small = [Suspect(0, node, NODE_E) for node in (NODE_B, NODE_C, NODE_D)]
    q.queue(NODE_A, big)
    for msg in small:
        q.queue(msg.node, msg)
    size = wire.encoded_size(small[0])
    taken = q.take(2 * size, limit=10)
    assert len(taken) == 2 and big not in taken  # the big one does not fit; two small ones do
    assert sum(wire.encoded_size(m) for m in taken) <= 2 * size
    assert q.take(0, limit=10) == []
    assert len(q) == 4  # nothing reached the limit, nothing was lost


# ----------------------------------------------------------------- registry


def test_registry_keeps_one_entry_per_owner():
    r = Registry()
    assert r.merge(NameClaim("pp-entry", NODE_A, 1, False)) is True
    assert r.merge(NameClaim("pp-entry", NODE_B, 2, False)) is True
    assert r.merge(NameClaim("pp-entry", NODE_A, 1, False)) is False  # the same, again
    assert r.merge(NameClaim("pp-entry", NODE_B, 1, False)) is False  # older, from the same owner
    assert sorted(r.owners("pp-entry")) == [NODE_A, NODE_B]  # two owners: replicas, not a conflict


def test_a_tombstone_hides_only_its_own_owners_claim():
    # A dead owner's tombstone at a clock far past a new owner's claim must not hide it:
    # a stage restarted under a new identity serves at once.
    r = Registry()
    r.merge(NameClaim("pp-stage-1", NODE_A, 7, True))
    r.merge(NameClaim("pp-stage-1", NODE_B, 1, False))
    assert r.owners("pp-stage-1") == [NODE_B]
    r.merge(NameClaim("pp-stage-1", NODE_A, 6, False))  # a stale copy of the dead owner's claim
    assert r.owners("pp-stage-1") == [NODE_B]


def test_registry_claim_counts_up_past_our_own_entries_only():
    r = Registry(clock=4)  # what the owner's last process used (persisted beside its key)
    assert r.claim("stage-0", NODE_A) == NameClaim("stage-0", NODE_A, 5, False)
    r.merge(NameClaim("stage-0", NODE_B, 70, False))  # another owner's clock is its own business
    r.merge(NameClaim("stage-1", NODE_A, 9, True))  # a tombstone our last process left
    assert r.claim("stage-1", NODE_A) == NameClaim("stage-1", NODE_A, 10, False)


def test_tombstone_owner_buries_only_that_owners_live_names():
    r = Registry()
    r.merge(NameClaim("stage-0", NODE_A, 1, False))
    r.merge(NameClaim("stage-1", NODE_A, 4, False))
    r.merge(NameClaim("stage-1", NODE_B, 2, False))
    tombs = r.tombstone_owner(NODE_A)
    assert sorted(tombs, key=lambda c: c.name) == [
        NameClaim("stage-0", NODE_A, 2, True),
        NameClaim("stage-1", NODE_A, 5, True),
    ]
    assert r.owners("stage-0") == [] and r.owners("stage-1") == [NODE_B]
    assert r.tombstone_owner(NODE_A) == []  # already buried


def test_every_member_writes_the_same_tombstone():
    first, second = Registry(), Registry()
    for r in (first, second):
        r.merge(NameClaim("pp-entry", NODE_A, 3, False))
    (tomb,) = first.tombstone_owner(NODE_A)
    second.tombstone_owner(NODE_A)
    assert second.merge(tomb) is False  # nothing to gossip: they agree already
    assert first.claims == second.claims


def test_a_reclaim_beats_the_tombstone():
    owner, other = Registry(), Registry()
    owner.merge(NameClaim("pp-entry", NODE_A, 1, False))
    other.merge(NameClaim("pp-entry", NODE_A, 1, False))
    (tomb,) = other.tombstone_owner(NODE_A)
    owner.merge(tomb)
    assert owner.owners("pp-entry") == []
    reclaim = owner.claim("pp-entry", NODE_A)
    assert reclaim == NameClaim("pp-entry", NODE_A, 3, False)
    assert other.merge(reclaim) is True
    assert other.owners("pp-entry") == [NODE_A]


def test_a_full_registry_makes_room_by_dropping_tombstones_only():
    from meshd.swim.registry import MAX_NAMES

    r = Registry()
    for i in range(MAX_NAMES - 1):
        r.merge(NameClaim(f"n{i}", NODE_A, 1, False))
    r.merge(NameClaim("gone", NODE_B, 2, True))
    assert r.merge(NameClaim("new", NODE_B, 1, False)) is True  # the tombstone made room
    assert r.merge(NameClaim("flood", NODE_B, 1, False)) is False  # live entries are never dropped
    assert len(r.claims) == MAX_NAMES


# ------------------------------------------------------ Swim, driven by hand

Match = type | Callable[[wire.Message], bool]
STRANGER = b"\x01" * 32  # a sender no Swim here knows
STRANGER_ADDR = "10.0.0.99:7946"


def found(out: Outgoing, match: Match) -> list[wire.Message]:
    """The messages in ``out`` that match a type or a predicate."""
    test = (lambda m: isinstance(m, match)) if isinstance(match, type) else match
    return [m for m in out.packet.messages if test(m)]


class Bench:
    """Swim objects wired by hand: a packet moves only when a test hands it over.

    Each Swim keeps its own clock, which never goes back: ``run`` and
    ``tick_until`` tick at the Swim's deadlines (late, if it received something
    after one), and whatever it sends that the test does not take is lost.
    """

    def __init__(self, n: int, config: Config = LAN) -> None:
        self.swims = [
            Swim(bytes([0xA0 + i]) * 32, f"10.0.0.{i + 1}:7946", Meta(stage=i), config, random.Random(i), 0.0)
            for i in range(n)
        ]
        self.by_id = {s.id: s for s in self.swims}
        self.by_addr = {s.me.addr: s for s in self.swims}
        self.clock = {s.id: 0.0 for s in self.swims}
        for s in self.swims:  # everyone knows everyone at incarnation 0
            others = tuple(Alive(0, o.id, o.me.addr, o.me.meta) for o in self.swims if o is not s)
            s.receive(Packet(STRANGER, others), STRANGER_ADDR, 0.0)
            s.outbox()
            s.events()

    def deliver(self, to: Swim, packet: Packet, now: float) -> list[Outgoing]:
        """``to`` receives ``packet`` at ``now``; returns what it sends straight back."""
        assert now >= self.clock[to.id], "time only moves forward"
        self.clock[to.id] = now
        src = self.by_id.get(packet.sender)
        to.receive(packet, src.me.addr if src else STRANGER_ADDR, now)
        return to.outbox()

    def tell(self, to: Swim, sender: Swim | bytes, *msgs: wire.Message, now: float) -> list[Outgoing]:
        sender_id = sender if isinstance(sender, bytes) else sender.id
        return self.deliver(to, Packet(sender_id, msgs), now)

    def hand(self, out: Outgoing, now: float) -> list[Outgoing]:
        """Deliver one packet some Swim sent, to the Swim at its address."""
        return self.deliver(self.by_addr[out.addr], out.packet, now)

    def run(self, swim: Swim, until: float) -> list[tuple[float, Outgoing]]:
        """Tick ``swim`` at each deadline up to ``until``; everything it sent, with when."""
        sent = []
        while (now := max(swim.next_deadline(), self.clock[swim.id])) <= until:
            self.clock[swim.id] = now
            swim.tick(now)
            sent.extend((now, out) for out in swim.outbox())
            assert len(sent) < 10_000
        return sent

    def tick_until(
        self, swim: Swim, match: Match, to: Swim | None = None, limit: float = 60.0
    ) -> tuple[float, list[Outgoing]]:
        """Tick ``swim`` until it sends packets holding a ``match`` message (to ``to``, if given).

        Returns when, and those packets; everything else it sent is lost.
        """
        while (now := max(swim.next_deadline(), self.clock[swim.id])) <= limit:
            self.clock[swim.id] = now
            swim.tick(now)
            hits = [o for o in swim.outbox() if found(o, match) and (to is None or o.node == to.id)]
            if hits:
                return now, hits
        raise AssertionError(f"{swim.me.name} sent nothing matching {match} before t={limit}")


def test_a_suspect_about_us_at_our_incarnation_is_refuted_with_an_alive():
    bench = Bench(2)
    a, b = bench.swims
    bench.tell(a, b, Suspect(0, a.id, b.id), now=1.0)
    assert a.incarnation == 1
    assert a.counters["refutes"] == 1
    assert a.awareness.score == 1  # being accused counts against our own health
    # The refutation rides on the next packet we send: here, the ack to b's ping.
    (ack,) = bench.tell(a, b, Ping(9, a.id), now=1.1)
    assert found(ack, Ack) == [Ack(9)]
    assert found(ack, lambda m: isinstance(m, Alive) and m.node == a.id) == [
        Alive(1, a.id, a.me.addr, a.me.meta)
    ]


def test_refutation_goes_above_the_accused_incarnation():
    bench = Bench(2)
    a, b = bench.swims
    bench.tell(a, b, Dead(0, a.id, b.id), now=1.0)
    assert a.incarnation == 1 and a.me.state is State.ALIVE
    # Our last process's Alive at 5: the mesh may hold us there, so we answer past it.
    bench.tell(a, b, Alive(5, a.id, "10.0.0.1:1", a.me.meta), now=2.0)
    assert a.incarnation == 6
    bench.tell(a, b, Dead(6, a.id, b.id), now=3.0)
    assert a.incarnation == 7 and a.me.state is State.ALIVE


def test_an_accusation_past_our_incarnation_is_dropped_not_answered():
    """Nobody saw us live at an incarnation we never said: such an accusation is made up."""
    bench = Bench(2)
    a, b = bench.swims
    for at, msg in enumerate((Suspect(3, a.id, b.id), Dead(9, a.id, b.id))):
        bench.tell(a, b, msg, now=1.0 + at)
    assert (a.incarnation, a.counters["refutes"], a.counters["rx_accusations_ahead"]) == (0, 0, 2)
    assert a.me.state is State.ALIVE


def test_a_stale_suspect_about_us_is_ignored():
    bench = Bench(2)
    a, b = bench.swims
    bench.tell(a, b, Suspect(0, a.id, b.id), now=1.0)
    bench.tell(a, b, Suspect(1, a.id, b.id), now=2.0)
    assert (a.incarnation, a.counters["refutes"], a.awareness.score) == (2, 2, 2)
    bench.tell(a, b, Suspect(1, a.id, b.id), now=3.0)
    assert (a.incarnation, a.counters["refutes"], a.awareness.score) == (2, 2, 2)


def test_only_the_member_itself_refutes_and_its_refutation_clears_the_suspicion():
    bench = Bench(3)
    a, b, c = bench.swims
    bench.tell(c, a, Suspect(0, b.id, a.id), now=0.01)
    assert c.members[b.id].state is State.SUSPECT
    assert c.members[b.id].incarnation == 0  # c does not speak for b
    assert (c.incarnation, c.counters["refutes"]) == (0, 0)
    assert [(e.kind, e.node) for e in c.events()] == [(EventKind.SUSPECT, b.id)]

    # c gossips the suspicion; b hears it and refutes; c hears the refutation.
    t, (gossip,) = bench.tick_until(c, lambda m: isinstance(m, Suspect) and m.node == b.id, to=b)
    assert found(gossip, Suspect) == [Suspect(0, b.id, a.id)]
    bench.hand(gossip, t)
    assert b.incarnation == 1
    t, (refutation,) = bench.tick_until(b, lambda m: isinstance(m, Alive) and m.node == b.id, to=c)
    bench.hand(refutation, t)
    assert (c.members[b.id].state, c.members[b.id].incarnation) == (State.ALIVE, 1)
    assert c.suspicion_deadline(b.id) is None
    assert [(e.kind, e.node) for e in c.events()] == [(EventKind.ALIVE, b.id)]


def test_independent_confirmations_shorten_the_timer_and_are_regossiped():
    bench = Bench(5)  # five members: k = suspicion_mult - 2 = 2 confirmations expected
    a, b, c, d, _ = bench.swims
    low, high = LAN.suspicion_bounds(5)
    assert (low, high) == (4.0, 24.0)
    bench.tell(b, c, Suspect(0, a.id, c.id), now=0.01)
    assert b.suspicion_deadline(a.id) == 0.01 + high
    bench.tell(b, c, Suspect(0, a.id, c.id), now=0.02)
    assert b.suspicion_deadline(a.id) == 0.01 + high  # the same accuser twice is one opinion
    bench.tell(b, d, Suspect(0, a.id, d.id), now=0.03)
    assert b.suspicion_deadline(a.id) == 0.01 + suspicion_duration(1, 2, low, high) == 0.01 + 11.381
    # The confirmation replaced the original suspicion in b's gossip queue.
    (ack,) = bench.tell(b, c, Ping(1, b.id), now=0.04)
    assert found(ack, lambda m: isinstance(m, Suspect) and m.node == a.id) == [Suspect(0, a.id, d.id)]


def test_our_own_failed_probe_confirms_an_existing_suspicion():
    # Awareness off, so that b's probes stay one second apart while everything it sends is lost.
    bench = Bench(5, LAN.with_(awareness_max_multiplier=1))
    a, b, c, _, _ = bench.swims
    bench.tell(b, c, Suspect(0, a.id, c.id), now=0.0)
    assert b.suspicion_deadline(a.id) == 24.0
    t, (ping,) = bench.tick_until(b, lambda m: isinstance(m, Ping) and m.target == a.id)
    assert t < 4.0  # round-robin reaches a within one round of four
    t, _ = bench.tick_until(b, lambda m: isinstance(m, Suspect) and m.node == a.id and m.sender == b.id)
    assert b.suspicion_deadline(a.id) == 11.381  # start 0 + duration after one confirmation
    assert t < 11.381


def test_buddy_system_a_ping_to_a_suspect_carries_the_suspicion():
    bench = Bench(3)
    a, b, c = bench.swims
    bench.tell(b, c, Suspect(0, a.id, c.id), now=0.0)
    t, (out,) = bench.tick_until(b, Ping)
    (ping,) = found(out, Ping)
    assert (out.node, out.addr, ping.target) == (a.id, a.me.addr, a.id)
    # b's own accusation rides with the ping (the gossip it heard may ride along too).
    assert Suspect(0, a.id, b.id) in found(out, Suspect)
    replies = bench.hand(out, t)
    assert a.incarnation == 1  # refuted on the spot, not when gossip finds it
    assert [found(r, Ack) for r in replies] == [[Ack(ping.seq)]]


def test_an_accusation_by_somebody_who_never_joined_counts_for_nothing():
    bench = Bench(2)
    a, b = bench.swims
    bench.tell(b, STRANGER, Suspect(0, a.id, STRANGER), now=0.0)
    bench.tell(b, STRANGER, Dead(0, a.id, STRANGER), now=0.0)
    assert b.members[a.id].state is State.ALIVE
    assert b.counters["rx_accusations_refused"] == 2


def test_a_ping_to_an_alive_member_carries_no_suspicion():
    bench = Bench(2)
    _, (out,) = bench.tick_until(bench.swims[1], Ping)
    assert found(out, Suspect) == []


def test_gossip_reaches_a_member_declared_dead_so_it_can_refute():
    bench = Bench(3)
    a, b, c = bench.swims
    bench.tell(a, c, Dead(0, b.id, c.id), now=0.01)
    assert a.members[b.id].state is State.DEAD
    t, outs = bench.tick_until(a, lambda m: isinstance(m, Dead) and m.node == b.id)
    assert {o.node for o in outs} == {b.id, c.id}  # a no longer probes b, but still gossips to it
    bench.hand(next(o for o in outs if o.node == b.id), t)
    assert b.incarnation == 1
    t, (back,) = bench.tick_until(b, lambda m: isinstance(m, Alive) and m.node == b.id, to=a)
    bench.hand(back, t)
    assert (a.members[b.id].state, a.members[b.id].incarnation) == (State.ALIVE, 1)


def test_gossip_to_the_dead_stops_after_gossip_to_the_dead_time():
    bench = Bench(3)
    a, b, c = bench.swims
    bench.tell(a, c, Dead(0, b.id, c.id), now=0.01)
    later = 0.01 + LAN.gossip_to_the_dead_time + 1.0
    bench.run(a, later)
    a.set_meta(Meta(stage=0, version="0.2.0"), later)  # news to gossip
    sent = bench.run(a, later + 2.0)
    assert any(found(o, Alive) for _, o in sent)
    # The dead member still gets reconnect asks (join push-pulls); nobody else gets gossip.
    assert {o.node for _, o in sent if not isinstance(o.packet.messages[0], wire.PushPull)} == {c.id}


def first_probe(bench: Bench, prober: Swim) -> tuple[float, Ping]:
    """``prober``'s first probe (the ping is lost): when, and the ping."""
    t, (out,) = bench.tick_until(prober, Ping)
    (ping,) = found(out, Ping)
    return t, ping


def test_a_probe_timeout_sends_ping_req_with_nack_to_helpers():
    bench = Bench(3)
    b = bench.swims[1]
    t_ping, ping = first_probe(bench, b)
    target = bench.by_id[ping.target]
    (helper,) = [s for s in bench.swims if s not in (b, target)]
    t, (out,) = bench.tick_until(b, PingReq)
    assert t == t_ping + LAN.probe_timeout
    assert (out.node, out.addr) == (helper.id, helper.me.addr)
    assert found(out, PingReq) == [PingReq(ping.seq, target.id, target.me.addr, True)]


def test_ping_req_goes_to_every_helper_up_to_indirect_checks():
    bench = Bench(6)  # the target and four candidates for three helper slots
    b = bench.swims[1]
    _, ping = first_probe(bench, b)
    _, outs = bench.tick_until(b, PingReq)
    helpers = [o.node for o in outs]
    assert len(helpers) == LAN.indirect_checks == len(set(helpers))
    assert ping.target not in helpers and b.id not in helpers


def test_ping_req_helpers_are_alive_members_not_suspects():
    """memberlist picks indirect-probe helpers among alive members only: a suspect
    is likely down, and its missing nack would count against our own health."""
    bench = Bench(6)
    b = bench.swims[1]
    t, ping = first_probe(bench, b)
    others = [s for s in bench.swims if s.id not in (b.id, ping.target)]
    suspects, accuser = others[:2], others[2]
    for s in suspects:
        bench.tell(b, accuser, Suspect(0, s.id, accuser.id), now=t)
    assert all(b.members[s.id].state is State.SUSPECT for s in suspects)
    _, outs = bench.tick_until(b, PingReq)
    helpers = {o.node for o in outs}
    assert len(helpers) == 2 and not helpers & {s.id for s in suspects}


def test_an_indirect_ack_through_the_helper_keeps_the_target_alive():
    bench = Bench(3)
    b = bench.swims[1]
    _, ping = first_probe(bench, b)
    target = bench.by_id[ping.target]
    t, (req,) = bench.tick_until(b, PingReq)
    (relayed,) = bench.hand(req, t + 0.01)
    assert (relayed.node, found(relayed, Ping)[0].target) == (target.id, target.id)
    (ack,) = bench.hand(relayed, t + 0.02)
    (forwarded,) = bench.hand(ack, t + 0.03)
    assert (forwarded.node, found(forwarded, Ack)) == (b.id, [Ack(ping.seq)])
    bench.hand(forwarded, t + 0.04)
    bench.tick_until(b, Ping)  # the period ends, the next probe starts
    assert b.members[target.id].state is State.ALIVE
    assert b.counters["acks"] == 1
    helper = bench.by_addr[req.addr]
    assert [o for _, o in bench.run(helper, t + 3.0) if found(o, Nack)] == []  # answered: no nack


def test_a_helper_that_gets_no_ack_sends_a_nack_in_time():
    bench = Bench(3)
    b = bench.swims[1]
    t_ping, ping = first_probe(bench, b)
    t, (req,) = bench.tick_until(b, PingReq)
    helper = bench.by_addr[req.addr]
    (relayed,) = bench.hand(req, t)  # ... and the relayed ping is lost
    t_nack, (nack,) = bench.tick_until(helper, Nack)
    assert (nack.node, nack.addr) == (b.id, b.me.addr)
    assert found(nack, Nack) == [Nack(ping.seq)]
    assert t < t_nack < t_ping + LAN.probe_interval  # early enough to count for b's probe


@pytest.mark.parametrize(("nack_arrives", "score", "next_interval"), [(True, 0, 1.0), (False, 1, 2.0)])
def test_missing_nacks_raise_awareness_and_stretch_the_probe_interval(nack_arrives, score, next_interval):
    bench = Bench(3)
    b = bench.swims[1]
    t_ping, ping = first_probe(bench, b)
    t, (req,) = bench.tick_until(b, PingReq)
    helper = bench.by_addr[req.addr]
    bench.hand(req, t)
    t_nack, (nack,) = bench.tick_until(helper, Nack)
    if nack_arrives:
        bench.hand(nack, t_nack)
    t_second, _ = bench.tick_until(b, Ping)
    assert t_second == t_ping + LAN.probe_interval
    assert b.members[ping.target].state is State.SUSPECT  # no ack either way
    assert b.awareness.score == score
    t_third, _ = bench.tick_until(b, Ping)
    assert t_third == t_second + next_interval


def test_a_duplicated_nack_does_not_hide_a_missing_one():
    bench = Bench(4)
    b = bench.swims[1]
    _, ping = first_probe(bench, b)
    t, reqs = bench.tick_until(b, PingReq)
    assert len(reqs) == 2  # two helpers: the members that are neither b nor the target
    helper = bench.by_addr[reqs[0].addr]
    bench.hand(reqs[0], t)
    t_nack, (nack,) = bench.tick_until(helper, Nack)
    bench.hand(nack, t_nack)
    bench.hand(nack, t_nack + 0.001)  # the network duplicated it; the other helper stays silent
    bench.tick_until(b, Ping)
    assert b.members[ping.target].state is State.SUSPECT
    assert b.awareness.score == 1


def test_a_stale_accusation_to_our_face_is_answered_with_our_current_alive():
    bench = Bench(3)
    a, b, c = bench.swims
    # c accused b; b refuted; the refutation was gossiped until its retransmit limit, but a heard none of it.
    bench.tell(b, c, Suspect(0, b.id, c.id), now=0.0)
    assert b.incarnation == 1
    bench.run(b, 10.0)  # everything b sends here is lost
    bench.tell(a, c, Suspect(0, b.id, c.id), now=10.0)
    # a pings b with the old accusation attached (the buddy system) ...
    t, (ping,) = bench.tick_until(a, lambda m: isinstance(m, Ping) and m.target == b.id)
    assert Suspect(0, b.id, a.id) in found(ping, Suspect)
    for reply in bench.hand(ping, t):
        bench.hand(reply, t + 0.001)
    # ... and b, which knows better, must let a know before a's suspicion runs out.
    for when, out in bench.run(b, t + 1.0):
        if out.node == a.id:
            bench.hand(out, max(when, t + 0.001))
    assert (a.members[b.id].state, a.members[b.id].incarnation) == (State.ALIVE, 1)


def test_a_ping_is_acked_on_the_path_it_came_in_on():
    """memberlist acks its TCP fallback ping on the same connection: a relayed
    ping answered over UDP would be lost as often as the ping it stood in for."""
    bench = Bench(3)
    a, b, _ = bench.swims
    b.receive(Packet(a.id, (Ping(7, b.id),)), a.me.addr, 1.0, via="relay")
    (out,) = b.outbox()
    assert (out.node, out.via, found(out, Ack)) == (a.id, "relay", [Ack(7)])
    b.receive(Packet(a.id, (Ping(8, b.id),)), a.me.addr, 1.1)
    (out,) = b.outbox()
    assert (out.via, found(out, Ack)) == (None, [Ack(8)])  # the driver's path table chooses
    b.receive(Packet(a.id, (PingReq(9, b.id, b.me.addr, True),)), a.me.addr, 1.2, via="relay")
    (out,) = b.outbox()
    assert (out.via, found(out, Ack)) == ("relay", [Ack(9)])


def test_push_pull_does_not_add_a_member_we_never_knew_as_suspect_or_dead():
    """memberlist's mergeState: only an alive entry adds a member; suspectNode and
    deadNode ignore unknown nodes, so a late joiner never adds the long dead."""
    bench = Bench(2)
    a, b = bench.swims
    alive_x, suspect_y, dead_z = NODE_C, NODE_D, NODE_E
    entries = (
        wire.MemberState(alive_x, "10.0.0.7:7946", 3, int(State.ALIVE), Meta(stage=7)),
        wire.MemberState(suspect_y, "10.0.0.8:7946", 2, int(State.SUSPECT), Meta(stage=8)),
        wire.MemberState(dead_z, "10.0.0.9:7946", 5, int(State.DEAD), Meta(stage=9)),
        wire.MemberState(b.id, b.me.addr, 0, int(State.DEAD), b.me.meta),  # known: only suspected
    )
    bench.tell(a, b, wire.PushPull(False, False, entries, ()), now=1.0)
    assert a.members[alive_x].state is State.ALIVE
    assert suspect_y not in a.members and dead_z not in a.members
    assert a.members[b.id].state is State.SUSPECT
    assert [(e.kind, e.node) for e in a.events()] == [(EventKind.JOIN, alive_x), (EventKind.SUSPECT, b.id)]
    assert a.live_count() == 3


def test_a_ping_for_another_id_is_not_acked():
    bench = Bench(3)
    a, b, c = bench.swims
    assert bench.tell(a, b, Ping(5, c.id), now=1.0) == []
    assert a.counters["rx_ping_for_other"] == 1
    (ack,) = bench.tell(a, b, Ping(6, a.id), now=1.0)
    assert found(ack, Ack) == [Ack(6)]


def test_garbage_datagrams_become_a_counter():
    bench = Bench(2)
    a, b = bench.swims
    truncated = wire.encode(Packet(b.id, (Ping(1, a.id),)))[:-3]
    before = a.counters.copy()
    for data in (b"", b"\xff\x00garbage", truncated, b"\x93" * 100):
        a.receive_datagram(data, b.me.addr, 1.0)
    assert a.counters - before == {"rx_bad_packet": 4}
    assert a.outbox() == []


def test_a_newer_protocol_version_is_refused_not_parsed():
    bench = Bench(2)
    a, b = bench.swims
    newer = wire.encode(Packet(b.id, (Ping(1, a.id),), version=wire.PROTOCOL_VERSION + 1))
    before = a.counters.copy()
    a.receive_datagram(newer, b.me.addr, 1.0)
    assert a.counters - before == {"rx_refused_newer_version": 1}
    assert a.outbox() == []
    # The same packet at our version is answered.
    a.receive_datagram(wire.encode(Packet(b.id, (Ping(1, a.id),))), b.me.addr, 1.0)
    assert a.counters["rx_packets"] - before["rx_packets"] == 1
    assert [found(o, Ack) for o in a.outbox()] == [[Ack(1)]]


def test_set_meta_bumps_generation_and_incarnation_and_others_see_an_update():
    bench = Bench(2)
    a, b = bench.swims
    a.set_meta(Meta(stage=0, version="0.2.0"), 0.0)
    assert (a.me.meta.generation, a.incarnation, a.me.incarnation) == (1, 1, 1)
    assert [(e.kind, e.node) for e in a.events()] == [(EventKind.UPDATE, a.id)]
    t, (out,) = bench.tick_until(a, lambda m: isinstance(m, Alive) and m.node == a.id, to=b)
    bench.hand(out, t)
    seen = b.members[a.id]
    assert (seen.incarnation, seen.meta.version, seen.meta.generation) == (1, "0.2.0", 1)
    assert [(e.kind, e.node) for e in b.events()] == [(EventKind.UPDATE, a.id)]


def with_relay(bench: Bench) -> None:
    """Every Swim of ``bench`` advertises the same relay, and knows the others do."""
    for s in bench.swims:
        s.set_meta(replace(s.me.meta, relay_url="ws://relay:1"), 0.0)
    for s in bench.swims:
        others = tuple(Alive(o.incarnation, o.id, o.me.addr, o.me.meta) for o in bench.swims if o is not s)
        s.receive(Packet(STRANGER, others), STRANGER_ADDR, 0.0)
        s.outbox()
        s.events()


def answer_only_over_the_relay(bench: Bench, a: Swim, b: Swim, lost: Outgoing, sent: float) -> float:
    """A's direct ping ``lost``, sent to ``b`` at ``sent``, never arrived: A asks again over the
    relay, and ``b``'s answer comes back only there.  Returns when A received it."""
    t, outs = bench.tick_until(a, lambda m: isinstance(m, Ping) and m.seq != found(lost, Ping)[0].seq,
                               to=b, limit=sent + 5)
    (relayed,) = [o for o in outs if o.via == "relay"]
    b.receive(relayed.packet, a.me.addr, t + 0.001, via="relay")
    (answer,) = b.outbox()
    a.receive(answer.packet, b.me.addr, t + 0.002, via="relay")
    return t + 0.002


def path_moves(swim: Swim) -> list[tuple[bytes | None, bool]]:
    """The path moves among the events ``swim`` queued since they were last taken (the rest are
    dropped with them): (peer, direct or not)."""
    return [(e.node, e.detail["direct"]) for e in swim.events() if e.kind is EventKind.PATH]


def test_a_relayed_ping_also_confirms_the_direct_ping_that_got_through():
    """A's direct ping reached B but B's answer was lost: the relayed answer says
    which direction works, so A keeps A->B direct and names no path failure."""
    bench = Bench(2)
    with_relay(bench)
    a, b = bench.swims
    t, (ping,) = bench.tick_until(a, Ping, to=b)
    bench.hand(ping, t)  # B gets it directly; its direct ack is lost (not handed back)
    t2, outs = bench.tick_until(a, lambda m: isinstance(m, Ping) and m.seq != found(ping, Ping)[0].seq,
                                to=b)
    relayed = [o for o in outs if o.via == "relay"]
    assert relayed, "after the probe timeout A asks again over the relay"
    b.receive(relayed[0].packet, a.me.addr, t2 + 0.001, via="relay")
    (answer,) = b.outbox()
    assert answer.via == "relay"
    assert [m.seq for m in found(answer, Ack)] == [found(ping, Ping)[0].seq, found(relayed[0], Ping)[0].seq]
    a.receive(answer.packet, b.me.addr, t2 + 0.002, via="relay")
    assert [e for e in a.events() if e.kind is EventKind.PATH] == [], "A->B direct works: nothing to report"

    # Had the direct ping not arrived, the relayed answer alone would move A->B to the relay.
    t3, (ping2,) = bench.tick_until(a, Ping, to=b, limit=t2 + 30)
    t4, outs = bench.tick_until(a, lambda m: isinstance(m, Ping) and m.seq != found(ping2, Ping)[0].seq,
                                to=b, limit=t3 + 5)
    relayed = [o for o in outs if o.via == "relay"]
    b.receive(relayed[0].packet, a.me.addr, t4 + 0.001, via="relay")
    (answer,) = b.outbox()
    assert [m.seq for m in found(answer, Ack)] == [found(relayed[0], Ping)[0].seq]
    a.receive(answer.packet, b.me.addr, t4 + 0.002, via="relay")
    paths = [e for e in a.events() if e.kind is EventKind.PATH]
    assert [(e.node, e.detail["direct"]) for e in paths] == [(b.id, False)]
    # Its round trip counts from the relayed ping's own send, not from the direct ping's
    # a probe timeout earlier: 2 ms here, as a relay on loopback shows.
    assert paths[0].detail["rtt"] == pytest.approx(0.002)
    assert a.members[b.id].relay_rtt == pytest.approx(0.002)


def test_a_direction_moved_to_the_relay_is_probed_again_next_period_and_comes_back():
    """One direct ping lost (a host too busy to answer in time) moves A->B to the relay; the
    next probe goes to B again, not a whole round of the probe list later, and its direct
    answer moves A->B back.  The round's other members still get their probe."""
    bench = Bench(6)
    with_relay(bench)
    a = bench.swims[0]
    t, (ping,) = bench.tick_until(a, Ping)  # lost
    b = bench.by_id[ping.node]
    t2 = answer_only_over_the_relay(bench, a, b, ping, t)
    assert path_moves(a) == [(b.id, False)]

    t3, (again,) = bench.tick_until(a, Ping, limit=t2 + 5)
    assert again.node == b.id and again.via == "direct", "the next probe rechecks B's direct path"
    assert t3 - t < 2 * LAN.probe_interval
    back = bench.hand(again, t3 + 0.001)
    for out in back:
        a.receive(out.packet, b.me.addr, t3 + 0.002)
    assert path_moves(a) == [(b.id, True)]

    probed = []
    limit = t3 + 4 * LAN.probe_interval + 0.5
    while True:
        try:
            t4, (p,) = bench.tick_until(a, Ping, limit=limit)
        except AssertionError:
            break
        probed.append(p.node)
        for out in bench.hand(p, t4 + 0.001):
            a.receive(out.packet, bench.by_id[p.node].me.addr, t4 + 0.002)
    others = {s.id for s in bench.swims} - {a.id, b.id}
    assert set(probed[:4]) == others, "the members after B in the round keep their turn"


def test_every_probe_whose_direct_ping_goes_unanswered_again_is_counted_not_only_the_move():
    """A one-way link stays one: each probe of it after the move to the relay says so once
    more (MISSED), so the count of direct failures grows with every probe, not once per move,
    and an operator reading it sees a persistent fault, not a single glitch."""
    from meshd.net.path_table import PathTable

    bench = Bench(2)
    with_relay(bench)
    a, b = bench.swims
    table = PathTable()
    t, (ping,) = bench.tick_until(a, Ping, to=b)
    t = answer_only_over_the_relay(bench, a, b, ping, t)
    for _ in range(3):
        t, (ping,) = bench.tick_until(a, Ping, to=b, limit=t + 5)
        t = answer_only_over_the_relay(bench, a, b, ping, t)
    kinds = [(e.kind, e.node) for e in a.events() if e.kind in (EventKind.PATH, EventKind.MISSED)]
    assert kinds == [(EventKind.PATH, b.id)] + [(EventKind.MISSED, b.id)] * 3
    table.probe_verdict(b.id, False, t, "direct ping unanswered")
    for _ in range(3):
        table.missed(b.id)
    view = table.view(b.id, t)
    assert (view["path_out"], view["direct_failures"]) == ("relay", 4)


def restart(bench: Bench, b: Swim, now: float) -> Alive:
    """``b`` runs as a new process (a new epoch) under its id: the Alive that says so."""
    b.set_meta(replace(b.me.meta, epoch=b.me.meta.epoch + 1), now)
    b.outbox()
    return Alive(b.incarnation, b.id, b.me.addr, b.me.meta)


def test_a_new_process_answering_over_the_relay_a_probe_sent_to_its_old_one_moves_no_path():
    """B's process dies under A's direct ping and a new one, in the same id, answers the
    relayed ping: the direct ping went to the old process, so it says nothing of the direct
    path to the new one.  A keeps A->B direct, as for a member just met."""
    bench = Bench(2)
    with_relay(bench)
    a, b = bench.swims
    t, (ping,) = bench.tick_until(a, Ping, to=b)  # lost: the old process is gone
    bench.tell(a, b, restart(bench, b, t + 0.001), now=t + 0.001)
    assert EventKind.RESTART in [e.kind for e in a.events()]
    answer_only_over_the_relay(bench, a, b, ping, t)
    assert path_moves(a) == []
    assert a.members[b.id].state is State.ALIVE and a.counters["acks"] == 1


def test_a_new_process_starts_with_no_path_verdict_from_its_old_one():
    """A->B moved to the relay while B's old process ran; B restarts.  If the new process
    too answers only over the relay, that is news (A's driver started its path afresh)."""
    bench = Bench(2)
    with_relay(bench)
    a, b = bench.swims

    def relay_only_probe(since: float) -> float:
        t, (ping,) = bench.tick_until(a, Ping, to=b, limit=since + 30)  # lost
        return answer_only_over_the_relay(bench, a, b, ping, t)

    now = relay_only_probe(0.0)
    assert path_moves(a) == [(b.id, False)]
    bench.clock[a.id] = now
    bench.tell(a, b, restart(bench, b, now), now=now)
    a.events()
    relay_only_probe(now)
    assert path_moves(a) == [(b.id, False)]


# --- a stranger cannot turn a member into a reflector or fill its tables ---


def test_a_strangers_empty_push_pull_gets_nothing_back_and_a_joiner_gets_the_mesh():
    bench = Bench(3)
    a = bench.swims[0]
    assert bench.tell(a, STRANGER, wire.PushPull(True, True, (), ()), now=1.0) == []
    assert a.counters["rx_push_pull_refused"] == 1
    joiner = b"\x77" * 32
    me = wire.MemberState(joiner, "10.0.0.77:7946", 0, int(State.ALIVE), Meta(stage=5))
    (reply,) = bench.tell(a, joiner, wire.PushPull(True, True, (me,), ()), now=2.0)
    assert reply.addr == STRANGER_ADDR and len(found(reply, wire.PushPull)[0].members) == 3


def test_a_strangers_push_pull_adds_only_itself():
    bench = Bench(2)
    a = bench.swims[0]
    fake_at_victim = wire.MemberState(b"\x66" * 32, "192.0.2.9:53", 0, int(State.ALIVE), Meta())
    itself = wire.MemberState(STRANGER, "10.0.0.99:7946", 0, int(State.ALIVE), Meta())
    claim = wire.NameClaim("pp-stage-9", b"\x66" * 32, 1, False)
    bench.tell(a, STRANGER, wire.PushPull(False, False, (fake_at_victim, itself), (claim,)), now=1.0)
    assert b"\x66" * 32 not in a.members and "pp-stage-9" not in a.registry.names()
    assert a.members[STRANGER].state is State.ALIVE


def test_a_ping_req_is_served_only_from_a_member_for_a_member_at_its_address():
    bench = Bench(3)
    a, b, c = bench.swims
    assert bench.tell(a, STRANGER, PingReq(1, c.id, c.me.addr, False), now=1.0) == []
    assert bench.tell(a, b, PingReq(2, c.id, "192.0.2.9:53", False), now=1.0) == []
    assert bench.tell(a, b, PingReq(3, b"\x66" * 32, "192.0.2.9:53", False), now=1.0) == []
    assert a.counters["rx_ping_req_refused"] == 3
    (ping,) = bench.tell(a, b, PingReq(4, c.id, c.me.addr, False), now=1.0)
    assert ping.addr == c.me.addr and found(ping, Ping)[0].target == c.id


def test_an_accusation_at_the_limit_cannot_pin_a_member_where_it_cannot_answer():
    """At COUNTER_MAX a refutation cannot beat an accusation: one taken there would bury a
    live member for good.  Neither the accused nor its peers take one past the member's own
    word, and the member's refutations stay encodable."""
    bench = Bench(3)
    a, b, c = bench.swims
    for at, msg in enumerate((Suspect(wire.COUNTER_MAX, a.id, b.id), Dead(wire.COUNTER_MAX, a.id, b.id))):
        bench.tell(a, b, msg, now=1.0 + at)
        bench.tell(c, b, msg, now=1.0 + at)
    assert a.incarnation == 0 and a.me.state is State.ALIVE
    assert c.members[a.id].state is State.ALIVE and c.members[a.id].incarnation == 0
    assert c.counters["rx_accusations_ahead"] == 2
    # Its last process's own Alive at the limit (only its key could sign one) is answered at it.
    bench.tell(a, b, Alive(wire.COUNTER_MAX, a.id, a.me.addr, Meta(stage=7)), now=3.0)
    assert a.incarnation == wire.COUNTER_MAX
    wire.encode(Packet(a.id, (a._alive_self(),)))  # still encodes, and decodes at every peer


def test_a_joiner_tells_a_few_more_members_about_itself_once_its_join_is_answered():
    """On a small mesh, gossip carries a newcomer's Alive only a couple of times from each
    node that heard it; the joiner tells up to JOIN_ANNOUNCE other members itself."""
    from meshd.swim.core import JOIN_ANNOUNCE

    bench = Bench(5)
    seed, *others = bench.swims
    joiner = Swim(b"\x55" * 32, "10.0.0.50:7946", Meta(stage=9), LAN, random.Random(9), 0.0)
    joiner.join([seed.me.addr], 0.0)
    (join,) = joiner.outbox()
    seed.receive(join.packet, joiner.me.addr, 0.1)
    (answer,) = [o for o in seed.outbox() if o.addr == joiner.me.addr]
    joiner.receive(answer.packet, seed.me.addr, 0.2)
    told = [o for o in joiner.outbox() if isinstance(o.packet.messages[0], PushPull)]
    assert len(told) == JOIN_ANNOUNCE and seed.me.addr not in {o.addr for o in told}
    for out in told:
        bench.hand(out, 0.3)
        assert bench.by_addr[out.addr].members[joiner.id].state is State.ALIVE


def test_a_member_restarted_under_its_own_key_tells_the_seed_its_refutation_too():
    """The seed knows the member left; the new process's join push-pull carries the old
    incarnation, which the seed ignores.  The seed's answer makes the member refute, and the
    seed must hear the refutation from the member itself: gossip alone may never bring it
    on a small mesh."""
    bench = Bench(4)
    seed, b, c, gone = bench.swims
    gone.leave(1.0)
    for out in gone.outbox():
        if out.addr == seed.me.addr:
            bench.hand(out, 1.1)
    assert seed.members[gone.id].state is State.LEFT
    back = Swim(gone.id, gone.me.addr, Meta(stage=3), LAN, random.Random(7), 2.0)  # the same key
    back.join([seed.me.addr], 2.0)
    (join,) = back.outbox()
    seed.receive(join.packet, back.me.addr, 2.1)
    assert seed.members[gone.id].state is State.LEFT  # the old incarnation changes nothing
    (answer,) = [o for o in seed.outbox() if o.addr == back.me.addr]
    back.receive(answer.packet, seed.me.addr, 2.2)
    assert back.incarnation > seed.members[gone.id].incarnation  # refuted
    to_seed = [o for o in back.outbox() if o.addr == seed.me.addr]
    assert to_seed
    for out in to_seed:
        seed.receive(out.packet, back.me.addr, 2.3)
    assert (seed.members[gone.id].state, seed.members[gone.id].incarnation) == (State.ALIVE, back.incarnation)


def test_a_member_asked_to_join_an_address_stays_in_the_mesh_whatever_answers():
    """The dashboard's add-peer on a node in a mesh: it asks the address once, and is not put
    back into joining (a mistyped address would show it as out of the mesh); a node that
    does answer there becomes a member."""
    bench = Bench(3)
    member = bench.swims[0]
    before = member.seeds
    member.join(["10.9.9.9:1", "10.9.9.9:1"], 1.0)  # nobody there
    asked = [o for o in member.outbox() if o.addr == "10.9.9.9:1"]
    assert len(asked) == 1 and isinstance(asked[0].packet.messages[0], PushPull)
    assert not member.joining and member.seeds == before
    newcomer = Swim(b"\x66" * 32, "10.0.0.66:7946", Meta(stage=6), LAN, random.Random(6), 1.0)
    member.join([newcomer.me.addr], 2.0)
    (ask,) = [o for o in member.outbox() if o.addr == newcomer.me.addr]
    newcomer.receive(ask.packet, member.me.addr, 2.1)
    for out in newcomer.outbox():
        if out.addr == member.me.addr:
            member.receive(out.packet, newcomer.me.addr, 2.2)
    assert member.members[newcomer.id].state is State.ALIVE and not member.joining
