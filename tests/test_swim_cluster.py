"""Acceptance scenarios: real Swim objects on the seeded in-memory network.

Every scenario runs on a fixed seed, so a failure replays exactly. Times are
virtual; detection times are printed in protocol periods (run with ``-s``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace

import pytest

from meshd.sim.memnet import MemNet, RelayPath, SimNode
from meshd.swim import EventKind, State
from meshd.wire import Alive, Meta, Packet, Ping, Suspect

SEED = 1


def cluster(n: int, seed: int = SEED, **fault) -> tuple[MemNet, list[SimNode]]:
    """``n`` members that joined through the first one, converged; ``fault`` applies to every link."""
    net = MemNet(seed)
    for name, value in fault.items():
        setattr(net.default_fault, name, value)
    first = net.add_node()
    nodes = [first] + [net.add_node(seeds=[first.addr]) for _ in range(n - 1)]
    net.run_until_converged(max_periods=30)
    return net, nodes


def flush(net: MemNet, node: SimNode) -> None:
    """After calling the node's Swim directly: send what it queued and re-arm its timer."""
    net._after(node)


def deliver(net: MemNet, node: SimNode, packet: Packet) -> None:
    """Hand ``packet`` to ``node`` now, as if it had just come off the network."""
    node.swim.receive(packet, "10.255.255.255:7946", net.now)
    flush(net, node)


def run_until(net: MemNet, done: Callable[[], bool], max_periods: float) -> float:
    """Run in half periods until ``done()``; returns the virtual time it took."""
    start = net.now
    while not done():
        limit = max_periods * net.config.probe_interval
        assert net.now - start <= limit, f"not done in {max_periods} periods"
        net.run_periods(0.5)
    return net.now - start


def probes(nodes: list[SimNode]) -> dict[bytes, int]:
    return {n.id: n.swim.counters["probes"] for n in nodes}


def assert_kept_probing(net: MemNet, before: dict[bytes, int], periods: float) -> None:
    """Every up node went on probing: a quiet log means a healthy cluster, not a stalled one."""
    for node in net.up_nodes():
        assert node.swim.counters["probes"] - before[node.id] >= periods / 2, node.prefix
        assert node.swim.next_deadline() >= net.now, f"{node.prefix} has a deadline in the past"


def first_seen(net: MemNet, kind: EventKind, subject: SimNode) -> dict[bytes, float]:
    """observer -> when it first logged ``kind`` about ``subject``."""
    seen: dict[bytes, float] = {}
    for o in net.events(kind, subject):
        seen.setdefault(o.observer, o.at)
    return seen


# ---------------------------------------------------------------- membership


@pytest.mark.parametrize("n", [3, 5, 20])
def test_members_converge(n):
    net, nodes = cluster(n)
    assert net.converged()
    for node in nodes:
        assert node.swim.live_count() == n
        assert {m.incarnation for m in node.swim.members.values()} == {0}  # nobody had to refute
    assert [o for o in net.log if o.event.kind is not EventKind.JOIN] == []


@pytest.mark.parametrize("n", [3, 5, 20])
def test_a_crashed_member_is_declared_dead_within_memberlists_bound(n):
    net, nodes = cluster(n)
    victim = nodes[n // 2]
    survivors = [x for x in nodes if x is not victim]
    high = net.config.suspicion_bounds(n)[1]
    bound = high + 2 * net.config.probe_interval  # one period to notice, one to gossip the verdict

    crashed_at = net.now
    net.crash(victim)
    net.run_for(bound + 10 * net.config.probe_interval)

    seen = first_seen(net, EventKind.DEAD, victim)
    assert set(seen) == {x.id for x in survivors}
    detection = (max(seen.values()) - crashed_at) / net.config.probe_interval
    print(f"\nN={n}: crash detected by every survivor in {detection:.2f} protocol periods "
          f"(bound {bound / net.config.probe_interval:.2f})")
    assert detection <= bound / net.config.probe_interval
    assert [o.event.node for o in net.events(EventKind.DEAD)] == [victim.id] * len(survivors)
    for x in survivors:
        assert net.view(x, victim) is State.DEAD


@pytest.mark.parametrize("then_stops", [False, True], ids=["stays-up", "then-stops"])
def test_a_graceful_leave_is_left_not_dead(then_stops):
    net, nodes = cluster(5)
    leaver = nodes[2]
    leaver.swim.leave(net.now)
    flush(net, leaver)
    if then_stops:
        net.crash(leaver)  # the process exits as soon as its goodbyes are on the wire
    net.run_periods(40)

    others = [x for x in nodes if x is not leaver]
    assert [net.view(x, leaver) for x in others] == [State.LEFT] * len(others)
    assert set(first_seen(net, EventKind.LEFT, leaver)) == {x.id for x in others}
    assert net.events(EventKind.DEAD) == []


def test_a_one_way_drop_kills_nobody():
    net, nodes = cluster(5)
    a, b = nodes[1], nodes[3]
    net.fault(a, b).drop = True
    before = probes(nodes)
    net.run_periods(300)
    assert net.counters["lost"] > 0
    assert b.swim.counters["ping_reqs"] > 0  # b had to go around the broken direction
    assert net.events(EventKind.DEAD) == []
    assert_kept_probing(net, before, 300)
    assert all(net.view(x, y).live for x in nodes for y in nodes)


def test_a_member_whose_acks_cannot_come_back_directly_is_kept_alive_by_the_relay():
    """b -> a is blocked; a's relayed ping reaches b and b must answer over the
    relay too, or a suspects b on every probe and, since b's refutations cannot
    reach a either, declares it dead."""
    net = MemNet(SEED)
    net.relay = RelayPath()
    meta = [Meta(stage=i, relay_url="ws://relay.test:3340") for i in range(2)]
    a = net.add_node(meta=meta[0])
    b = net.add_node(meta=meta[1], seeds=[a.addr])
    net.run_until_converged(max_periods=10)
    net.fault(b, a).drop = True
    net.run_periods(60)
    assert a.swim.counters["relay_pings"] > 10
    assert net.events(EventKind.SUSPECT, b) == [] and net.view(a, b) is State.ALIVE


def test_ten_percent_loss_on_every_link_kills_nobody():
    net, nodes = cluster(20)
    net.set_loss(0.10)
    before = probes(nodes)
    net.run_periods(300)
    assert net.events(EventKind.SUSPECT) != []  # the loss did bite ...
    assert net.events(EventKind.DEAD) == []  # ... and every suspicion was refuted in time
    assert_kept_probing(net, before, 300)
    assert all(net.view(x, y).live for x in nodes for y in nodes)


@pytest.mark.parametrize(
    "fault",
    [{"duplicate": 0.5}, {"delay": 0.2}, {"duplicate": 0.5, "delay": 0.2}],
    ids=["duplicate", "delay", "duplicate+delay"],
)
def test_duplication_and_delay_kill_nobody(fault):
    net, nodes = cluster(10, **fault)
    # A slow link (both ways) and a slow direction: round trips outlast the 0.5 s probe timeout.
    for src, dst in ((nodes[1], nodes[2]), (nodes[2], nodes[1]), (nodes[4], nodes[7])):
        net.fault(src, dst).delay = 0.4
    before = probes(nodes)
    net.run_periods(200)
    assert net.events(EventKind.DEAD) == []
    assert_kept_probing(net, before, 200)
    assert net.converged()
    if "duplicate" in fault:  # the network really did duplicate
        assert sum(x.swim.counters["rx_packets"] for x in nodes) > sum(x.tx_packets for x in nodes)


def test_a_member_cut_off_until_declared_dead_comes_back_when_the_link_heals():
    net, nodes = cluster(5)
    x = nodes[2]
    others = [n for n in nodes if n is not x]
    links = [net.fault(x, o) for o in others] + [net.fault(o, x) for o in others]
    for link in links:
        link.drop = True
    run_until(net, lambda: all(net.view(o, x) is State.DEAD for o in others), max_periods=40)
    for link in links:
        link.drop = False
    # x hears it was declared dead (gossip still reaches the recently dead) and refutes.
    net.run_until_converged(max_periods=40)
    assert x.swim.incarnation > 0
    assert all(o.swim.members[x.id].incarnation == x.swim.incarnation for o in others)


def test_news_missed_while_deaf_arrives_by_push_pull():
    net, nodes = cluster(5)
    net.run_periods(2 * net.config.push_pull_interval)  # past everyone's first, staggered push-pull
    deaf, speaker = nodes[2], nodes[0]
    for o in nodes:
        if o is not deaf:
            net.fault(o, deaf).drop = True
    speaker.swim.set_meta(Meta(stage=0, version="0.2.0"), net.now)
    flush(net, speaker)
    net.run_periods(3)  # long enough for the gossip about it to run out
    assert deaf.swim.members[speaker.id].meta.version == ""
    for link in net.faults.values():
        link.drop = False
    took = run_until(net, lambda: deaf.swim.members[speaker.id].meta.version == "0.2.0",
                     max_periods=net.config.push_pull_interval + 5)
    assert took <= net.config.push_pull_interval + 5 * net.config.probe_interval


# ------------------------------------------------------------------ registry


def test_a_name_registered_early_resolves_everywhere_dies_with_its_owner_and_comes_back():
    net = MemNet(SEED)
    owner = net.add_node()
    second = net.add_node(seeds=[owner.addr])
    net.run_until_converged(max_periods=10)
    owner.swim.register_name("pp-entry", net.now)
    flush(net, owner)
    nodes = [owner, second]
    for _ in range(18):
        nodes.append(net.add_node(seeds=[nodes[-1].addr]))
        # A missed gossip is repaired by push-pull, every 30 s.
        net.run_until_converged(max_periods=45)
    run_until(net, lambda: all(x.swim.resolve("pp-entry") == owner.id for x in nodes), max_periods=5)

    net.crash(owner)
    survivors = nodes[1:]
    run_until(net, lambda: all(net.view(x, owner) is State.DEAD for x in survivors), max_periods=40)
    for x in survivors:
        assert x.swim.resolve("pp-entry") is None
        assert x.swim.registry.get("pp-entry", owner.id).tombstone

    net.restart(owner, seeds=[second.addr])
    owner.swim.register_name("pp-entry", net.now)
    flush(net, owner)
    run_until(net, lambda: all(x.swim.resolve("pp-entry") == owner.id for x in nodes), max_periods=10)
    assert net.converged()


def test_a_crashed_member_restarting_with_the_same_id_comes_back_with_a_higher_incarnation():
    net, nodes = cluster(5)
    victim = nodes[3]
    survivors = [x for x in nodes if x is not victim]
    net.crash(victim)
    run_until(net, lambda: all(net.view(x, victim) is State.DEAD for x in survivors), max_periods=30)
    died_at = {x.id: x.swim.members[victim.id].incarnation for x in survivors}

    restarted_at = net.now
    net.restart(victim, seeds=[nodes[0].addr])
    net.run_until_converged(max_periods=10)
    for x in survivors:
        assert net.view(x, victim) is State.ALIVE
        assert x.swim.members[victim.id].incarnation > died_at[x.id]
    rejoined = {o.observer for o in net.events(EventKind.JOIN, victim) if o.at >= restarted_at}
    assert rejoined == {x.id for x in survivors}
    assert [o.event.node for o in net.events(EventKind.DEAD)] == [victim.id] * len(survivors)


def test_a_new_identity_takes_a_dead_owners_name_at_once():
    net, nodes = cluster(5)
    old = nodes[1]
    old.swim.register_name("pp-stage-1", net.now)
    flush(net, old)
    run_until(net, lambda: all(x.swim.resolve("pp-stage-1") == old.id for x in nodes), max_periods=10)
    net.crash(old)
    survivors = [x for x in nodes if x is not old]
    run_until(net, lambda: all(net.view(x, old) is State.DEAD for x in survivors), max_periods=40)

    new = net.add_node(meta=Meta(role="stage", stage=1), seeds=[nodes[0].addr])
    new.swim.register_name("pp-stage-1", net.now)  # clock 1, far below the old owner's tombstone
    flush(net, new)
    took = run_until(net, lambda: all(x.swim.resolve("pp-stage-1") == new.id for x in [*survivors, new]),
                     max_periods=10)
    assert took <= 5 * net.config.probe_interval
    assert all(x.swim.registry.get("pp-stage-1", old.id).tombstone for x in survivors)


def test_replicas_share_a_name_and_one_leaving_orphans_nobody():
    net, nodes = cluster(5)
    a, b = nodes[1], nodes[2]
    for x in (a, b):
        x.swim.register_name("pp-stage-0", net.now)
        flush(net, x)
    both = sorted([a.id, b.id])
    run_until(net, lambda: all(x.swim.live_owners("pp-stage-0") == both for x in nodes), max_periods=10)
    a.swim.leave(net.now)
    flush(net, a)
    rest = [x for x in nodes if x is not a]
    run_until(net, lambda: all(x.swim.live_owners("pp-stage-0") == [b.id] for x in rest), max_periods=10)


def test_a_restart_under_the_same_id_is_seen_and_its_old_names_are_withdrawn():
    net, nodes = cluster(5)
    victim = nodes[3]
    victim.swim.register_name("pp-stage-3", net.now)
    flush(net, victim)
    run_until(net, lambda: all(x.swim.resolve("pp-stage-3") == victim.id for x in nodes), max_periods=10)
    net.crash(victim)  # and back before anyone notices: only the epoch tells
    restarted_at = net.now
    net.restart(victim, seeds=[nodes[0].addr], meta=replace(victim.meta, stage=4, epoch=2))
    victim.swim.register_name("pp-stage-4", net.now)
    flush(net, victim)
    others = [x for x in nodes if x is not victim]
    run_until(net, lambda: all(x.swim.resolve("pp-stage-4") == victim.id
                               and x.swim.resolve("pp-stage-3") is None for x in nodes), max_periods=20)
    seen = {o.observer for o in net.events(EventKind.RESTART, victim) if o.at >= restarted_at}
    assert seen == {x.id for x in others}
    assert not net.events(EventKind.TWIN), "a process that exited is no twin"


def test_a_restarted_process_hearing_its_last_process_again_and_again_takes_it_for_no_twin():
    net, nodes = cluster(4)
    victim = nodes[3]
    net.crash(victim)
    net.restart(victim, seeds=[nodes[0].addr], meta=replace(victim.meta, epoch=2))
    net.run_periods(5)
    old = Alive(victim.swim.incarnation, victim.id, victim.addr, replace(victim.meta, epoch=0))
    for _ in range(6):  # its last word, brought back by gossip out of order
        deliver(net, victim, Packet(nodes[0].id, [old]))
        net.run_periods(1)
    assert not net.events(EventKind.TWIN)
    assert victim.swim.twins.yielded is None


@pytest.mark.parametrize("start", [0, 10_000])
def test_a_recorded_word_of_an_earlier_process_replayed_makes_no_twin_of_a_process_that_starts_past_it(start):
    """Old signed Alives at climbing incarnations, replayed from a stranger's address, look like
    a live twin's answers to a process that counts from 0; a node starts from its clock
    (``Node``: ``start_incarnation``), past every incarnation its earlier processes signed."""
    net, nodes = cluster(4)
    victim = nodes[3]
    old_meta = replace(victim.meta, epoch=1, started=1)
    recorded = [Alive(k, victim.id, "10.9.9.9:7946", old_meta) for k in (5, 7, 9, 11)]
    net.crash(victim)
    net.restart(victim, seeds=[nodes[0].addr], meta=replace(victim.meta, epoch=2, started=2),
                incarnation=start)
    for alive in recorded:
        deliver(net, victim, Packet(victim.id, [alive]))
    yielded = victim.swim.twins.yielded is not None
    assert yielded == (start == 0)
    if start:
        assert victim.swim.incarnation == start and not net.events(EventKind.TWIN)


def twins(net: MemNet, nodes: list[SimNode]) -> tuple[SimNode, SimNode]:
    """Two live processes under one node id: the first started at 100 s, the other at 200 s."""
    meta = Meta(role="stage", stage=7)
    first = net.add_node(meta=replace(meta, epoch=11, started=100), seeds=[nodes[0].addr])
    net.run_periods(5)
    second = net.add_node(meta=replace(meta, epoch=22, started=200), seeds=[nodes[1].addr],
                          node_id=first.id)
    return first, second


def test_of_two_live_processes_under_one_id_the_later_started_stops_and_the_flapping_ends():
    net, nodes = cluster(5)
    first, second = twins(net, nodes)
    run_until(net, lambda: len(net.events(EventKind.TWIN)) == 2, max_periods=30)
    # Each process names the other: the first keeps the id, the second gives it up.
    said = {o.event.detail["twin"].epoch: o.event.detail["keep"] for o in net.events(EventKind.TWIN)}
    assert said == {22: True, 11: False}
    assert first.swim.twins.yielded is None
    assert second.swim.twins.yielded is not None and second.swim.twins.yielded.addr == first.addr
    # The id settles on the first process at every member, and its incarnation stops climbing.
    run_until(net, lambda: all(x.swim.members[first.id].meta.epoch == 11 for x in nodes), max_periods=10)
    incarnation = first.swim.incarnation
    net.run_periods(20)
    assert first.swim.incarnation == incarnation
    for x in nodes:
        m = x.swim.members[first.id]
        assert (m.meta.epoch, m.state, m.addr) == (11, State.ALIVE, first.addr), x.prefix
    # The second process exits; its last word, replayed, moves nothing.
    net.crash(second)
    last = second.swim._alive_self()
    for _ in range(5):
        deliver(net, first, Packet(nodes[0].id, [last]))
    assert first.swim.incarnation == incarnation and first.swim.twins.yielded is None
    assert len(net.events(EventKind.TWIN)) == 2


def test_two_processes_started_the_same_second_agree_on_one_keeper():
    net, nodes = cluster(4)
    meta = Meta(role="stage", stage=7, started=100)
    first = net.add_node(meta=replace(meta, epoch=50), seeds=[nodes[0].addr])
    second = net.add_node(meta=replace(meta, epoch=40), seeds=[nodes[1].addr], node_id=first.id)
    run_until(net, lambda: len(net.events(EventKind.TWIN)) == 2, max_periods=30)
    # The same second: the smaller epoch keeps the id, whichever joined first.
    assert first.swim.twins.yielded is not None and second.swim.twins.yielded is None


# --------------------------------------------------------------- determinism


def scenario_log(seed: int) -> list[tuple]:
    """A lossy, duplicating run with a crash and a restart; its whole membership log."""
    net, nodes = cluster(8, seed, loss=0.05, duplicate=0.1)
    net.crash(nodes[5])
    net.run_periods(40)
    net.restart(nodes[5], seeds=[nodes[0].addr])
    net.run_periods(20)
    return [(o.at, o.observer, o.event.kind, o.event.node) for o in net.log]


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    first = scenario_log(3)
    assert len({kind for _, _, kind, _ in first}) >= 3  # joins, suspicions, deaths: a log worth comparing
    assert scenario_log(3) == first
    assert scenario_log(4) != first


def test_the_same_seed_gives_the_same_run_in_another_process():
    # Python salts str/bytes hashes per process; nothing in a run may depend on them.
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('scenarios', sys.argv[1])\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "print(repr(mod.scenario_log(3)))\n"
    )
    runs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        done = subprocess.run([sys.executable, "-c", script, __file__], env=env, capture_output=True,
                              text=True, timeout=60, check=True)
        runs.append(done.stdout)
    assert runs[0] == runs[1] == repr(scenario_log(3)) + "\n"



def test_a_refutation_goes_out_before_relayed_news():
    """Only a member can refute a suspicion of itself, and its news rides mostly on
    probe traffic: its own Alive goes before everything it relays, even facts
    sent fewer times (here forty strangers it just heard of)."""
    net, nodes = cluster(3)
    a, b = nodes[0], nodes[1]
    swim, now = a.swim, net.now
    swim.outbox()
    swim.receive(Packet(b.id, (Suspect(swim.incarnation, a.id, b.id),)), b.addr, now)
    assert swim.incarnation == 1
    swim.receive(Packet(b.id, (Ping(1, a.id),)), b.addr, now)
    (ack,) = [o for o in swim.outbox() if o.node == b.id]
    assert ack.packet.messages[1] == swim._alive_self()  # sent once, right after the Ack
    strangers = [bytes([0x80 + i]) * 32 for i in range(40)]
    swim.receive(Packet(b.id, tuple(Alive(0, g, f"10.9.0.{i}:7946", Meta(stage=i))
                                    for i, g in enumerate(strangers))), b.addr, now)
    swim.receive(Packet(b.id, (Ping(2, a.id),)), b.addr, now)
    (ack,) = [o for o in swim.outbox() if o.node == b.id]
    assert ack.packet.messages[1] == swim._alive_self()


def test_a_relayed_refutation_goes_out_before_accusations_and_news():
    """A false death is the worse error: an Alive that clears a suspicion is
    passed on ahead of everything else a member relays."""
    net, nodes = cluster(3)
    a, b, c = nodes
    swim, now = a.swim, net.now
    swim.outbox()
    swim.receive(Packet(b.id, (Suspect(0, c.id, b.id),)), b.addr, now)
    refutation = Alive(1, c.id, c.addr, c.swim.me.meta)
    swim.receive(Packet(c.id, (refutation,)), c.addr, now)
    assert swim.members[c.id].state is State.ALIVE
    swim.receive(Packet(b.id, (Ping(1, a.id),)), b.addr, now)
    (ack,) = [o for o in swim.outbox() if o.node == b.id]
    assert refutation in ack.packet.messages
    strangers = [bytes([0x80 + i]) * 32 for i in range(40)]
    swim.receive(Packet(b.id, tuple(Alive(0, g, f"10.9.0.{i}:7946", Meta(stage=i))
                                    for i, g in enumerate(strangers))), b.addr, now)
    swim.receive(Packet(b.id, (Ping(2, a.id),)), b.addr, now)
    (ack,) = [o for o in swim.outbox() if o.node == b.id]
    assert refutation in ack.packet.messages[:3]

def test_dedicated_gossip_stays_within_its_budget_however_busy_the_cluster():
    """Fresh facts go out at once while the token bucket lasts; beyond that the
    gossip rate is gossip_per_period, and the rest rides on probe traffic."""
    net, nodes = cluster(20)
    cfg = net.config
    before = {n.id: n.swim.counters["tx_gossip"] for n in nodes}
    net.set_loss(0.2)  # plenty of suspicions and refutations to tell
    periods = 60
    net.run_periods(periods)
    for n in nodes:
        sent = n.swim.counters["tx_gossip"] - before[n.id]
        assert sent <= cfg.gossip_burst + cfg.gossip_per_period * periods * 1.05, n.prefix
    assert sum(n.swim.counters["tx_gossip"] - before[n.id] for n in nodes) > 0

# -------------------------------------------------------------- the harness


def test_memnet_fires_a_deadline_that_a_delivery_moved_into_the_past():
    net = MemNet(SEED)
    x = net.add_node()
    # x learns five members that are not on the network: whatever it sends them vanishes.
    ghosts = [bytes([0xF0 + i]) * 32 for i in range(5)]
    deliver(net, x, Packet(ghosts[1], tuple(
        Alive(0, g, f"10.9.0.{i}:7946", Meta(stage=10 + i)) for i, g in enumerate(ghosts)
    )))
    victim = ghosts[0]
    deliver(net, x, Packet(ghosts[1], (Suspect(0, victim, ghosts[1]),)))
    start = net.now
    low, high = net.config.suspicion_bounds(6)
    assert x.swim.suspicion_deadline(victim) == start + high
    net.run_for(low + 2.0)  # past start + low, before the timer (one confirmation at most) runs out
    assert x.swim.members[victim].state is State.SUSPECT
    # Two more accusers: the timer drops to start + low, which is already behind us.
    deliver(net, x, Packet(ghosts[2], (Suspect(0, victim, ghosts[2]), Suspect(0, victim, ghosts[3]))))
    assert x.swim.suspicion_deadline(victim) == start + low < net.now
    confirmed_at = net.now
    net.run_periods(5)
    dead = [o for o in net.events(EventKind.DEAD) if o.event.node == victim]
    assert [o.at for o in dead] == [confirmed_at]
    assert x.swim.next_deadline() >= net.now
