"""Signed facts in the SWIM core: a member's own facts count only in its own signed word,
accusations only in their accuser's, and a live member's signed refutation always wins.

Each Swim here signs with a real ed25519 identity (as a node does).  ``mallory`` is a
member of the mesh, with her own valid key, who tries to speak for ``victim``.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from meshd.identity import Identity
from meshd.swim import LAN, State, Swim
from meshd.swim.facts import (
    SignedFacts,
    Unsigned,
    accusation_data,
    alive_data,
    claim_data,
    paths_data,
)
from meshd.wire import (
    COUNTER_MAX,
    STATE_ALIVE,
    STATE_DEAD,
    STATE_LEFT,
    Alive,
    Dead,
    MemberState,
    Meta,
    NameClaim,
    Packet,
    PathEntry,
    PathSummary,
    PushPull,
    Suspect,
)


class Signed:
    """Swims with real keys that know each other; packets move only when a test hands them."""

    def __init__(self, n: int, allow: set[int] | None = None) -> None:
        self.ids = [Identity.generate() for _ in range(n)]
        allow_nodes = frozenset(self.ids[i].node_id for i in allow) if allow is not None else None
        self.swims = [
            Swim(ident.node_id, f"10.0.0.{i + 1}:7946", Meta(role="stage", stage=i, stages=n), LAN,
                 random.Random(i), 0.0, facts=SignedFacts(ident), allow_nodes=allow_nodes)
            for i, ident in enumerate(self.ids)
        ]
        for s in self.swims:  # everyone hears everyone's own signed Alive
            for o in self.swims:
                if o is not s:
                    s.receive(Packet(o.id, (o._alive_self(),)), o.me.addr, 0.0)
            s.outbox()
            s.events()

    def tell(self, to: Swim, sender: bytes, *msgs, now: float = 1.0) -> None:
        to.receive(Packet(sender, msgs), "10.0.0.99:7946", now)


@pytest.fixture
def mesh():
    return Signed(4)


def _forged_alive(mallory: Identity, victim: Swim, incarnation: int, addr: str) -> Alive:
    meta = victim.me.meta
    sig = mallory.sign(alive_data(victim.id, incarnation, addr, meta))
    return Alive(incarnation, victim.id, addr, meta, sig)


def test_every_member_knows_every_other_from_its_own_signed_word(mesh):
    for s in mesh.swims:
        assert sorted(m.state.name for m in s.members.values()) == ["ALIVE"] * 4
        assert all(m.proof for m in s.members.values())


def test_a_leave_in_another_members_name_is_refused(mesh):
    victim, observer = mesh.swims[1], mesh.swims[2]
    mallory = mesh.ids[3]
    for inc in (0, 1, 2**40):
        sig = mallory.sign(accusation_data("dead", victim.id, inc, victim.id))
        mesh.tell(observer, mesh.ids[3].node_id, Dead(inc, victim.id, victim.id, sig))
        mesh.tell(observer, mesh.ids[3].node_id, Dead(inc, victim.id, victim.id))  # unsigned
    assert observer.members[victim.id].state is State.ALIVE
    assert observer.counters["rx_bad_signature"] == 6


def test_a_leave_in_push_pull_needs_the_members_own_signature(mesh):
    victim, observer, mallory = mesh.swims[1], mesh.swims[2], mesh.ids[3]
    forged = mallory.sign(accusation_data("dead", victim.id, 5, victim.id))
    left = MemberState(victim.id, victim.me.addr, 5, STATE_LEFT, victim.me.meta, forged)
    pp = PushPull(False, False, (left,), ())
    mesh.tell(observer, mallory.node_id, pp)
    assert observer.members[victim.id].state is State.ALIVE
    # The member's own leave, passed on by anyone, is taken.
    victim.leave(2.0)
    own = victim.me.proof
    pp = PushPull(False, False, (MemberState(victim.id, victim.me.addr, victim.incarnation, STATE_LEFT,
                                             victim.me.meta, own),), ())
    mesh.tell(observer, mallory.node_id, pp, now=3.0)
    assert observer.members[victim.id].state is State.LEFT


def test_a_death_in_another_accusers_name_is_refused_and_blames_nobody(mesh):
    orch, victim, observer, mallory = mesh.swims[0], mesh.swims[1], mesh.swims[2], mesh.ids[3]
    sig = mallory.sign(accusation_data("dead", victim.id, 0, orch.id))
    mesh.tell(observer, orch.id, Dead(0, victim.id, orch.id, sig))
    assert observer.members[victim.id].state is State.ALIVE
    assert not [e for e in observer.events() if e.kind.name == "DEAD"]


def test_a_members_own_accusation_counts_and_the_victims_refutation_wins(mesh):
    victim, observer, accuser = mesh.swims[1], mesh.swims[2], mesh.swims[3]
    dead = accuser._accusation(Dead, victim.id, 0)
    mesh.tell(observer, accuser.id, dead)
    assert observer.members[victim.id].state is State.DEAD
    # The victim hears it and refutes in its own signed word; its names come back with it.
    mesh.tell(victim, accuser.id, dead)
    (alive,) = [m for m in victim.broadcasts.take(10_000, 10) if isinstance(m, Alive) and m.node == victim.id]
    mesh.tell(observer, victim.id, alive, now=2.0)
    assert observer.members[victim.id].state is State.ALIVE


def test_confirmations_count_distinct_signed_accusers_only(mesh):
    victim, observer = mesh.swims[1], mesh.swims[2]
    first = mesh.swims[3]._accusation(Suspect, victim.id, 0)
    mesh.tell(observer, first.sender, first)
    start = observer.suspicion_deadline(victim.id)
    # Accusations "by" the other members, signed by somebody else, shorten nothing.
    mallory = mesh.ids[3]
    for accuser in (mesh.swims[0].id, mesh.ids[1].node_id):
        sig = mallory.sign(accusation_data("suspect", victim.id, 0, accuser))
        mesh.tell(observer, accuser, Suspect(0, victim.id, accuser, sig))
    assert observer.suspicion_deadline(victim.id) == start
    # The orchestrator's own signed accusation does.
    mesh.tell(observer, mesh.swims[0].id, mesh.swims[0]._accusation(Suspect, victim.id, 0))
    assert observer.suspicion_deadline(victim.id) < start


def test_an_alive_in_another_members_name_cannot_move_it(mesh):
    victim, observer = mesh.swims[1], mesh.swims[2]
    mesh.tell(observer, mesh.ids[3].node_id, _forged_alive(mesh.ids[3], victim, 2**40, "10.9.9.9:1"))
    assert observer.members[victim.id].addr == victim.me.addr
    assert observer.members[victim.id].incarnation == 0


def test_a_member_cannot_take_or_bury_another_members_name(mesh):
    victim, observer, mallory = mesh.swims[1], mesh.swims[2], mesh.ids[3]
    victim.register_name("pp-stage-1", 1.0)
    (claim,) = [m for m in victim.broadcasts.take(10_000, 10) if isinstance(m, NameClaim)]
    mesh.tell(observer, victim.id, claim)
    assert observer.live_owners("pp-stage-1") == [victim.id]
    tomb = NameClaim("pp-stage-1", victim.id, 2**40, True)
    mesh.tell(observer, mallory.node_id, replace(tomb, sig=mallory.sign(claim_data(tomb))), tomb)
    assert observer.live_owners("pp-stage-1") == [victim.id]
    assert observer.counters["rx_bad_signature"] == 2


def test_allow_nodes_keeps_stage_names_for_the_listed_nodes():
    mesh = Signed(4, allow={0, 1, 2})
    observer, outsider = mesh.swims[0], mesh.swims[3]
    outsider.register_name("pp-stage-1", 1.0)
    outsider.register_name("pp-orchestrator-notes", 1.0)
    for claim in [m for m in outsider.broadcasts.take(10_000, 10) if isinstance(m, NameClaim)]:
        mesh.tell(observer, outsider.id, claim)
    assert observer.live_owners("pp-stage-1") == []
    assert observer.live_owners("pp-orchestrator-notes") == [outsider.id]  # not a stage name
    assert observer.counters["rx_names_refused"] == 1


def test_a_path_summary_in_another_members_name_is_refused(mesh):
    victim, observer, mallory = mesh.swims[1], mesh.swims[2], mesh.ids[3]
    victim.publish_paths(PathSummary(victim.id, 1, (PathEntry(observer.id, "direct", 100, 0, "", 0),)), 1.0)
    (own,) = [m for m in victim.broadcasts.take(10_000, 10) if isinstance(m, PathSummary)]
    mesh.tell(observer, victim.id, own)
    forged = PathSummary(victim.id, 2**40, (PathEntry(observer.id, "none", 0, 99, "forged", 0),))
    mesh.tell(observer, mallory.node_id, replace(forged, sig=mallory.sign(paths_data(forged))))
    assert observer.path_summaries[victim.id][0] == own


def test_a_dead_members_names_come_back_when_it_refutes(mesh):
    victim, observer, accuser = mesh.swims[1], mesh.swims[2], mesh.swims[3]
    victim.register_name("pp-stage-1", 1.0)
    (claim,) = [m for m in victim.broadcasts.take(10_000, 10) if isinstance(m, NameClaim)]
    mesh.tell(observer, victim.id, claim)
    mesh.tell(observer, accuser.id, accuser._accusation(Dead, victim.id, 0))
    assert observer.live_owners("pp-stage-1") == []
    # Our own tombstone of its claim is never passed on as its word.
    assert all(c.sig for c in observer._push_pull(False, False).names)
    victim._refute(0, 2.0)
    mesh.tell(observer, victim.id, victim._alive_self(), now=3.0)
    assert observer.live_owners("pp-stage-1") == [victim.id]


def test_an_unsigned_alive_from_a_stranger_adds_no_member(mesh):
    observer = mesh.swims[0]
    fake = Identity.generate().node_id
    mesh.tell(observer, fake, Alive(0, fake, "10.0.0.77:1", Meta()))
    pp = PushPull(True, False, (MemberState(fake, "10.0.0.77:1", 0, STATE_ALIVE, Meta()),), ())
    mesh.tell(observer, fake, pp)
    assert fake not in observer.members


def test_the_simulator_signs_nothing_and_takes_everything():
    facts = Unsigned()
    assert facts.sign(b"x") == b"" and facts.verify(b"\0" * 32, b"", b"x")


@pytest.mark.parametrize("kind", [Suspect, Dead])
def test_a_members_signed_accusation_at_the_counter_limit_cannot_bury_a_live_member(mesh, kind):
    """At COUNTER_MAX a refutation cannot beat an accusation.  A member's own signed word
    at an incarnation the victim never said is dropped by every node, the victim included:
    it costs the victim nothing, and nothing is left that it could not answer."""
    victim, observer, accuser = mesh.swims[1], mesh.swims[2], mesh.swims[3]
    accusation = accuser._accusation(kind, victim.id, COUNTER_MAX)
    for to in (observer, victim):
        mesh.tell(to, accuser.id, accusation)
    assert observer.members[victim.id].state is State.ALIVE
    assert observer.members[victim.id].incarnation == victim.incarnation == 0
    assert (observer.counters["rx_accusations_ahead"], victim.counters["rx_accusations_ahead"]) == (1, 1)
    assert not [e for e in observer.events() if e.kind.name in ("SUSPECT", "DEAD")]
    # At the victim's own incarnation the accusation counts, and the victim's refutation wins.
    mesh.tell(observer, accuser.id, accuser._accusation(kind, victim.id, 0))
    assert observer.members[victim.id].state is not State.ALIVE
    mesh.tell(victim, accuser.id, accuser._accusation(kind, victim.id, 0))
    (alive,) = [m for m in victim.broadcasts.take(10_000, 10) if isinstance(m, Alive) and m.node == victim.id]
    mesh.tell(observer, victim.id, alive, now=2.0)
    assert observer.members[victim.id].state is State.ALIVE


def test_push_pull_cannot_say_a_member_is_dead_past_its_own_word(mesh):
    """A push-pull entry is nobody's signed word: one past the member's incarnation is
    dropped, and the member moves past such an entry about itself only when it carries
    its own signed Alive there (its last process's)."""
    victim, observer, sender = mesh.swims[1], mesh.swims[2], mesh.swims[3]
    forged = MemberState(victim.id, victim.me.addr, COUNTER_MAX, STATE_DEAD, victim.me.meta, b"\0" * 64)
    for to in (observer, victim):
        mesh.tell(to, sender.id, PushPull(False, False, (forged,), ()))
    assert observer.members[victim.id].state is State.ALIVE and victim.incarnation == 0
    # Its own signed Alive at 7 (a process before this one, same key): it answers past it.
    signed = mesh.ids[1].sign(alive_data(victim.id, 7, victim.me.addr, victim.me.meta))
    mesh.tell(victim, sender.id, PushPull(False, False, (replace(forged, incarnation=7, sig=signed),), ()))
    assert victim.incarnation == 8
