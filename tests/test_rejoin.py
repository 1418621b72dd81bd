"""Restarts: a restarted seed is found again, and a restarted node finds the mesh.

Three ways back in, each tested where it lives: the survivors' reconnect (Serf's:
they keep asking a dead member's last address) in the sans-IO core and on the
in-memory network; the state file beside the key (the members a node knew, its
name clock) as a module; and both over real loopback sockets, within the 5 s a
restart may take.  Core times are protocol time; loopback times are measured and
printed (run with ``-s``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import stat

import pytest
import trio

from meshd import cli
from meshd import memory as node_memory
from meshd.identity import Identity
from meshd.memory import MAX_FILE_BYTES, MAX_REMEMBERED, NodeMemory, RememberedMember
from meshd.node import NodeOptions
from meshd.sim.memnet import MemNet, SimNode
from meshd.swim import LAN, Config, State, Swim
from meshd.swim.core import MAX_RECONNECTS, RECONNECT_ASKERS
from meshd.swim.state import Member, Outgoing
from meshd.testing.inprocess import Running, start_node
from meshd.wire import Alive, Dead, Meta, Packet, PushPull

SEED = 3
STRANGER = b"\xee" * 32


# ------------------------------------------------------------ the core's reconnect


def core_with_members(n: int, config: Config = LAN) -> Swim:
    """A Swim at time 0 that knows ``n`` other members, alive."""
    swim = Swim(b"\x01" * 32, "10.0.0.1:7946", Meta(stage=0), config, random.Random(0), 0.0)
    alives = tuple(Alive(0, bytes([0x10 + i]) * 32, f"10.0.1.{i}:7946", Meta(stage=i + 1)) for i in range(n))
    swim.receive(Packet(STRANGER, alives), "10.255.255.255:7946", 0.0)
    swim.outbox()
    return swim


def reconnects(outs: list[Outgoing]) -> list[str]:
    """Where the join push-pulls among ``outs`` went (a reconnect, or a join)."""
    return [o.addr for o in outs if isinstance(o.packet.messages[0], PushPull) and o.packet.messages[0].join]


def run_core(swim: Swim, until: float) -> list[tuple[float, list[str]]]:
    """Tick ``swim`` at each of its deadlines up to ``until``; the reconnects of each tick."""
    sent = []
    while (now := swim.next_deadline()) <= until:
        swim.tick(now)
        addrs = reconnects(swim.outbox())
        if addrs:
            sent.append((now, addrs))
    return sent


def ticked_until(swim: Swim, until: float) -> list[Outgoing]:
    """Tick ``swim`` at each of its deadlines up to ``until``; everything it sent."""
    sent = []
    while (now := swim.next_deadline()) <= until:
        swim.tick(now)
        sent.extend(swim.outbox())
    return sent


def test_an_answered_ask_brings_our_whole_state_and_the_dead_member_refutes_at_once():
    s = core_with_members(3)
    r_id = bytes([0x10]) * 32
    r_addr = s.members[r_id].addr
    s.receive(Packet(STRANGER, (Dead(0, r_id, s.id),)), "10.255.255.255:7946", 0.0)  # our own verdict
    # Its restarted process: the same id and address, and it knows nobody.
    r = Swim(r_id, r_addr, Meta(stage=1, epoch=2), LAN, random.Random(5), 1.0)
    r.outbox()

    t = LAN.reconnect_interval
    sent = ticked_until(s, t)
    (ask,) = [o for o in sent if o.addr == r_addr and isinstance(o.packet.messages[0], PushPull)]
    (pp,) = ask.packet.messages
    assert pp.join and pp.reply and [m.node for m in pp.members] == [s.id]  # small: ourselves only
    r.receive(ask.packet, s.me.addr, t)
    (answer,) = r.outbox()
    assert answer.addr == s.me.addr and r.live_count() == 2  # it knows us now

    s.receive(answer.packet, r_addr, t)
    (follow_up,) = [o for o in s.outbox() if o.addr == r_addr]
    assert len(follow_up.packet.messages[0].members) == 4  # the whole mesh
    r.receive(follow_up.packet, s.me.addr, t)
    assert r.incarnation == 1  # refuted at once
    alive = {m.id for m in s.members.values() if m.state is State.ALIVE}
    assert alive - {r.id} <= {m.id for m in r.members.values() if m.state.live}  # knows the mesh

    for out in ticked_until(r, t + LAN.gossip_interval):
        if out.addr == s.me.addr:
            s.receive(out.packet, r_addr, t + LAN.gossip_interval)
    assert (s.members[r_id].state, s.members[r_id].incarnation) == (State.ALIVE, 1)
    assert (s.counters["tx_reconnect"], s.counters["tx_reconnect_followups"]) == (1, 1)


def test_a_seed_no_live_member_answers_at_is_asked_back_until_one_does():
    """The orchestrator, our --seed, moved to another port (its last address), died there,
    and came back at the seed's address under a new key, knowing nobody: nothing but the
    seed leads to it, so the seed is asked every interval while no live member holds it,
    and not once a live member answers there."""
    swim = core_with_members(2)
    seed = "10.0.1.0:7946"  # the first member's address
    swim.anchors = (seed, swim.me.addr)  # our own address is never asked
    interval = LAN.reconnect_interval
    assert run_core(swim, 2 * interval) == []  # a live member holds it
    first = bytes([0x10]) * 32
    moved = Alive(1, first, "10.0.1.9:7946", Meta(stage=1))  # it moved, then died there
    swim.receive(Packet(STRANGER, (moved, Dead(1, first, swim.id))), "10.255.255.255:7946", 2 * interval)
    rounds = run_core(swim, 6 * interval)
    assert rounds and all(seed in addrs for _, addrs in rounds)
    assert len(rounds) == 4 and all(swim.me.addr not in addrs for _, addrs in rounds)
    # A new process answers at the seed and joins: it is not asked again.
    swim.receive(Packet(STRANGER, (Alive(0, b"\x77" * 32, seed, Meta(role="orchestrator")),)),
                 "10.255.255.255:7946", 6 * interval)
    assert all(seed not in addrs for _, addrs in run_core(swim, 9 * interval))


def test_dead_members_are_asked_back_every_interval_a_bounded_number_at_a_time_in_turn():
    swim = core_with_members(12)
    dead = [m for m in swim.members.values() if m.id != swim.id]
    for m in dead:
        swim.receive(Packet(STRANGER, (Dead(0, m.id, swim.id),)), "10.255.255.255:7946", 0.0)
    assert all(m.state is State.DEAD for m in dead)
    interval = LAN.reconnect_interval
    rounds = run_core(swim, 3 * interval)
    assert [t for t, _ in rounds] == [interval, 2 * interval, 3 * interval]
    assert all(len(addrs) == MAX_RECONNECTS for _, addrs in rounds)
    # In turn: two rounds reach all twelve, the second taking up where the first stopped.
    first, second = rounds[0][1], rounds[1][1]
    assert set(first + second) == {m.addr for m in dead}
    assert swim.counters["tx_reconnect"] == 3 * MAX_RECONNECTS


def test_a_left_member_is_not_asked_back():
    swim = core_with_members(2)
    gone, dead = [m for m in swim.members.values() if m.id != swim.id]
    swim.receive(Packet(gone.id, (Dead(0, gone.id, gone.id),)), gone.addr, 0.0)  # its goodbye
    swim.receive(Packet(STRANGER, (Dead(0, dead.id, swim.id),)), "10.255.255.255:7946", 0.0)
    assert (gone.state, dead.state) == (State.LEFT, State.DEAD)
    rounds = run_core(swim, 5 * LAN.reconnect_interval)
    assert rounds and all(addrs == [dead.addr] for _, addrs in rounds)


def test_reconnect_stops_after_the_reconnect_timeout():
    config = LAN.with_(reconnect_interval=2.0, reconnect_timeout=20.0)
    swim = core_with_members(1, config)
    (m,) = [m for m in swim.members.values() if m.id != swim.id]
    swim.receive(Packet(STRANGER, (Dead(0, m.id, swim.id),)), "10.255.255.255:7946", 0.0)
    rounds = run_core(swim, 60.0)
    assert [t for t, _ in rounds] == [2.0 * k for k in range(1, 11)]  # up to 20 s after it died


def test_a_dead_members_address_a_live_member_took_over_is_not_asked():
    swim = core_with_members(1)
    (old,) = [m for m in swim.members.values() if m.id != swim.id]
    swim.receive(Packet(STRANGER, (Dead(0, old.id, swim.id),)), "10.255.255.255:7946", 0.0)
    # A new process (a new identity) at the same address joined already.
    swim.receive(Packet(STRANGER, (Alive(0, b"\x77" * 32, old.addr, Meta(stage=1)),)), old.addr, 0.5)
    # (Until the newcomer, which answers no probe here, could be declared dead itself.)
    assert run_core(swim, LAN.suspicion_bounds(3)[0]) == []
    assert swim.members[b"\x77" * 32].state.live


# ---------------------------------------------------------- on the in-memory network


def seeded_cluster(n: int, config: Config = LAN) -> tuple[MemNet, SimNode, list[SimNode]]:
    """``n`` members that joined through the first (the seed), converged: (net, seed, others)."""
    net = MemNet(SEED, config=config)
    seed = net.add_node(meta=Meta(role="orchestrator"))
    others = [net.add_node(seeds=[seed.addr]) for _ in range(n - 1)]
    net.run_until_converged(max_periods=30)
    return net, seed, others


def crash_until_dead(net: MemNet, victim: SimNode, survivors: list[SimNode]) -> None:
    net.crash(victim)
    start = net.now
    while not all(net.view(x, victim) is State.DEAD for x in survivors):
        assert net.now - start < 60 * net.config.probe_interval, "never declared dead"
        net.run_periods(0.25)


@pytest.mark.parametrize("reconnect", [True, False])
def test_a_seed_restarted_without_seeds_is_found_again_by_the_survivors(reconnect):
    config = LAN if reconnect else LAN.with_(reconnect_timeout=0.0)  # the control: no reconnect
    net, seed, others = seeded_cluster(5, config)
    crash_until_dead(net, seed, others)
    net.run_for(0.3 * LAN.reconnect_interval)  # not in step with anyone's reconnect timer
    net.restart(seed, seeds=[], meta=Meta(role="orchestrator", epoch=2))
    bound = 2 * LAN.reconnect_interval  # one answered ask brings it back
    if not reconnect:
        with pytest.raises(TimeoutError):
            net.run_until_converged(max_periods=bound / LAN.probe_interval, step_periods=0.1)
        return
    took = net.run_until_converged(max_periods=bound / LAN.probe_interval, step_periods=0.1)
    print(f"restarted seed found again after {took:.2f} s ({took / LAN.reconnect_interval:.2f} intervals)")
    assert seed.swim.live_count() == 5
    assert all(x.swim.members[seed.id].meta.epoch == 2 for x in others)


@pytest.mark.parametrize("n", [6, 30])
def test_the_mesh_asks_a_dead_member_back_a_few_times_an_interval_whatever_its_size(n):
    net, seed, others = seeded_cluster(n)
    victim, survivors = others[-1], [seed] + others[:-1]
    crash_until_dead(net, victim, survivors)
    before = sum(x.swim.counters["tx_reconnect"] for x in survivors)
    intervals = 20
    net.run_for(intervals * LAN.reconnect_interval)
    per_interval = (sum(x.swim.counters["tx_reconnect"] for x in survivors) - before) / intervals
    print(f"{n} members: the dead one asked back {per_interval:.2f} times per interval")
    assert 1 <= per_interval <= 2 * RECONNECT_ASKERS


def test_a_seed_that_left_and_restarts_without_seeds_is_not_asked_back():
    net, seed, others = seeded_cluster(4)
    seed.swim.leave(net.now)
    net.flush(seed)
    net.run_periods(2)
    net.crash(seed)
    assert all(net.view(x, seed) is State.LEFT for x in others)
    net.restart(seed, seeds=[])
    net.run_for(10 * LAN.reconnect_interval)
    assert seed.swim.live_count() == 1
    assert sum(x.swim.counters["tx_reconnect"] for x in others) == 0


# --------------------------------------------------------------------- the state file


def member(i: int, state: State, changed: float = 0.0, name: str | None = None) -> Member:
    meta = Meta(role="stage", stage=i) if name is None else Meta(role=name)
    return Member(bytes([i]) * 32, f"10.0.0.{i}:7946", meta, 0, state, changed)


def test_the_state_file_round_trips_live_members_first_and_no_left_ones(tmp_path):
    me = member(1, State.ALIVE)
    members = [me, member(2, State.DEAD, 5.0), member(3, State.ALIVE), member(4, State.LEFT),
               member(5, State.SUSPECT), member(6, State.DEAD, 9.0),
               member(7, State.ALIVE, name="orchestrator")]
    memory = node_memory.remember(members, me.id, name_clock=17)
    assert [m.name for m in memory.members] == ["orchestrator", "stage-3", "stage-5", "stage-6", "stage-2"]
    path = tmp_path / "node.key.state.json"
    node_memory.save(path, memory)
    assert node_memory.load(path) == memory
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and doc["name_clock"] == 17
    assert doc["members"][0] == {"id": (b"\x07" * 32).hex(), "addr": "10.0.0.7:7946", "name": "orchestrator"}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["node.key.state.json"]  # no temporary file left behind
    assert memory.addrs(me.id, me.addr) == ["10.0.0.7:7946", "10.0.0.3:7946", "10.0.0.5:7946",
                                            "10.0.0.6:7946", "10.0.0.2:7946"]


def test_the_state_file_is_bounded_and_keeps_whom_a_restart_has_not_found_yet():
    me = member(1, State.ALIVE)
    many = [me] + [Member(i.to_bytes(32, "big"), f"10.1.{i // 256}.{i % 256}:7946", Meta(stage=i % 8), 0,
                          State.ALIVE, 0.0) for i in range(2, 300)]
    assert len(node_memory.remember(many, me.id, 0).members) == MAX_REMEMBERED
    # A restart that found nobody yet still remembers whom to ask next time.
    previous = NodeMemory(4, (RememberedMember(b"\x09" * 32, "10.0.0.9:7946", "stage-8"),))
    again = node_memory.remember([me], me.id, 5, previous)
    assert again == NodeMemory(5, previous.members)
    # ...until it hears of them again, as they are now.
    back = node_memory.remember([me, member(9, State.LEFT)], me.id, 5, previous)
    assert back.members == ()


def test_a_missing_state_file_is_a_first_start(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert node_memory.load(tmp_path / "absent.state.json") == NodeMemory()
    assert caplog.records == []


GOOD_MEMBER = {"id": "ab" * 32, "addr": "10.0.0.2:7946", "name": "stage-1"}


@pytest.mark.parametrize("content", [
    b"",
    b"{\"version\": 1, \"name_clock\": 3, \"members\": [",
    b"\xff\xfe not utf-8",
    b"[1, 2, 3]",
    b"[" * 60_000,
    b" " * MAX_FILE_BYTES + b"{}",
    json.dumps({"version": 2, "name_clock": 0, "members": []}).encode(),
    json.dumps({"version": 1, "name_clock": "7", "members": []}).encode(),
    json.dumps({"version": 1, "name_clock": -1, "members": []}).encode(),
    json.dumps({"version": 1, "name_clock": True, "members": []}).encode(),
    json.dumps({"version": 1, "name_clock": 2**64, "members": []}).encode(),
    b'{"version": 1, "name_clock": 1' + b"0" * 5000 + b', "members": []}',
    json.dumps({"version": 1, "name_clock": 0, "members": {"a": 1}}).encode(),
    json.dumps({"version": 1, "name_clock": 0, "members": [GOOD_MEMBER, "x"]}).encode(),
    json.dumps({"version": 1, "name_clock": 0, "members": [{**GOOD_MEMBER, "id": "zz" * 32}]}).encode(),
    json.dumps({"version": 1, "name_clock": 0, "members": [{**GOOD_MEMBER, "id": 5}]}).encode(),
    json.dumps({"version": 1, "name_clock": 0, "members": [{**GOOD_MEMBER, "addr": "nowhere"}]}).encode(),
    json.dumps({"version": 1, "name_clock": 0, "members": [{**GOOD_MEMBER, "addr": "h:99999"}]}).encode(),
    json.dumps({"version": 1, "name_clock": 0, "members": [{**GOOD_MEMBER, "name": "n" * 1000}]}).encode(),
    json.dumps({"version": 1, "name_clock": 0, "members": [{**GOOD_MEMBER, "name": None}]}).encode(),
])
def test_a_corrupt_or_hostile_state_file_gives_an_empty_memory_and_one_warning(tmp_path, caplog, content):
    path = tmp_path / "node.key.state.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert node_memory.load(path) == NodeMemory()
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert str(path) in record.getMessage() and "\n" not in record.getMessage()


def test_a_state_file_with_more_members_than_remembered_keeps_the_first(tmp_path):
    entries = [{"id": i.to_bytes(32, "big").hex(), "addr": f"10.0.0.{i}:7946", "name": f"stage-{i}"}
               for i in range(1, 201)]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"version": 1, "name_clock": 9, "members": entries}))
    memory = node_memory.load(path)
    assert len(memory.members) == MAX_REMEMBERED and memory.members[0].addr == "10.0.0.1:7946"


def test_run_with_a_key_file_keeps_its_state_file_beside_it(tmp_path, monkeypatch):
    seen: list[NodeOptions] = []

    async def fake_run_daemon(identity, options):
        seen.append(options)
        return 0

    monkeypatch.setattr("meshd.daemon.run_daemon", fake_run_daemon)
    key = tmp_path / "node.key"
    assert cli.main(["run", "--role", "orchestrator", "--key-file", str(key), "--dashboard", "off"]) == 0
    assert cli.main(["run", "--role", "orchestrator", "--dashboard", "off"]) == 0
    assert [o.state_file for o in seen] == [f"{key}.state.json", None]


# ------------------------------------------------------------------ over loopback


class Crashable:
    """A node in its own cancel scope: ``crash`` stops it where it stands, no leave."""

    def __init__(self, running: Running, scope: trio.CancelScope, done: trio.Event) -> None:
        self.running, self.scope, self.done = running, scope, done

    async def crash(self) -> None:
        self.scope.cancel()
        await self.done.wait()  # its sockets are closed


async def start_crashable(nursery: trio.Nursery, options: NodeOptions, lines: list[str],
                          identity: Identity) -> Crashable:
    async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
        done = trio.Event()
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as inner:
                    running = await start_node(inner, options, lines, identity)
                    task_status.started(Crashable(running, scope, done))
        finally:
            done.set()

    return await nursery.start(run)


def sees_all_alive(nodes: list[Running]) -> bool:
    """Every node sees every other alive, at the address and the process it has now."""
    for a in nodes:
        for b in nodes:
            if a is b:
                continue
            m = a.core.members.get(b.identity.node_id)
            if m is None or m.state is not State.ALIVE or m.addr != b.addr or m.meta.epoch != b.data.epoch:
                return False
    return True


async def until(done, timeout: float, what: str) -> float:
    """Poll ``done()`` until true; the seconds it took (an AssertionError saying ``what`` if
    not within ``timeout``)."""
    start = trio.current_time()
    try:
        with trio.fail_after(timeout):
            while not done():
                await trio.sleep(0.02)
    except trio.TooSlowError:
        raise AssertionError(f"not {what} in {timeout:g} s") from None
    return trio.current_time() - start


def back_in(node: Running, others: list[Running]) -> bool:
    """``node`` and ``others`` see each other alive, and the others resolve its name to it."""
    mine = node.options.names()[0]
    return sees_all_alive([node, *others]) and all(o.resolve(mine) == node.identity.node_id for o in others)


def remembered(path) -> set[str]:
    return {m.name for m in node_memory.load(path).members}


# How long a rejoin takes is measured and printed, not asserted: usually well under a second,
# it has a tail of seconds on a loaded machine (join retries back off). The bound below is
# what the protocol's retries guarantee, not a speed target.
REJOIN_BOUND_S = 15


@pytest.mark.parametrize("declared_dead", [False, True])
async def test_a_seed_restarted_without_seeds_rejoins_through_its_state_file(tmp_path, declared_dead):
    lines: list[str] = []
    state_file = str(tmp_path / "orch.key.state.json")
    ident = Identity.generate()
    orch_opts = NodeOptions(role="orchestrator", stages=2, profile="local", state_file=state_file)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            orch = await start_crashable(nursery, orch_opts, lines, ident)
            seed = orch.running.addr
            stages = [await start_node(nursery, NodeOptions(stage=k, stages=2, profile="local", seeds=[seed]),
                                       lines) for k in range(2)]
            await until(lambda: remembered(state_file) == {"stage-0", "stage-1"}, 10, "state file written")
            old_clock = orch.running.core.registry.own_clock

            await orch.crash()
            if declared_dead:  # its name is tombstoned too, and must come back with it
                await until(lambda: all(s.core.members[ident.node_id].state is State.DEAD for s in stages),
                            60, "declared dead")
            rejoin_lines: list[str] = []
            back = await start_crashable(nursery, orch_opts, rejoin_lines, ident)  # a new port, no seed
            took = await until(lambda: back_in(back.running, stages), REJOIN_BOUND_S, "rejoined")
            print(f"seed restarted without seeds rejoined through its state file in {took:.2f} s")
            assert f"meshd rejoin trying 2 remembered members from {state_file}" in rejoin_lines
            assert back.running.core.registry.own_clock > old_clock
            nursery.cancel_scope.cancel()


async def test_the_name_clock_continues_from_the_state_file(tmp_path):
    path = tmp_path / "k.state.json"
    path.write_text(json.dumps({"version": 1, "name_clock": 41, "members": []}))
    lines: list[str] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, NodeOptions(role="orchestrator", profile="local",
                                                         state_file=str(path)), lines)
            # Past 41 and past the tombstone (at 42) the others wrote when that process died.
            claim = node.core.registry.get("pp-orchestrator", node.identity.node_id)
            assert claim is not None and claim.clock == 43
            await until(lambda: node_memory.load(path).name_clock == 43, 5, "clock saved")
            assert not [line for line in lines if line.startswith("meshd rejoin")]  # nobody to try
            nursery.cancel_scope.cancel()


async def test_a_node_restarted_with_a_seed_rejoins():
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            orch_opts = NodeOptions(role="orchestrator", stages=2, profile="local")
            orch = await start_node(nursery, orch_opts, lines)
            opts = NodeOptions(stage=0, stages=2, profile="local", seeds=[orch.addr])
            ident = Identity.generate()
            stage = await start_crashable(nursery, opts, lines, ident)
            other = await start_node(nursery, NodeOptions(stage=1, stages=2, profile="local",
                                                          seeds=[orch.addr]), lines)
            await until(lambda: sees_all_alive([orch, stage.running, other]), 20, "converged")
            await stage.crash()
            back = await start_crashable(nursery, opts, lines, ident)
            took = await until(lambda: back_in(back.running, [orch, other]), REJOIN_BOUND_S, "rejoined")
            print(f"node restarted with --seed rejoined in {took:.2f} s")
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("same_identity", [True, False])
async def test_survivors_find_a_seed_restarted_at_its_address_with_no_seed_and_no_state_file(same_identity):
    """The survivors' reconnect over real sockets, through the amplification guards (the
    restarted node's is fresh: it has seen nobody prove an address yet), names included:
    under the same key, the follow-up tells it of its old names' tombstones to claim past."""
    lines: list[str] = []
    ident = Identity.generate()
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            orch_opts = NodeOptions(role="orchestrator", stages=2, profile="local")
            orch = await start_crashable(nursery, orch_opts, lines, ident)
            addr = orch.running.addr
            stages = [await start_node(nursery, NodeOptions(stage=k, stages=2, profile="local", seeds=[addr]),
                                       lines) for k in range(2)]
            await until(lambda: sees_all_alive([orch.running, *stages]), 20, "converged")
            # As a seed that served a while: its address answered their probes, so what they
            # send there is not held to the budget of an unproven address.
            await until(lambda: all(s.guard.is_verified(addr) for s in stages), 10, "probed")
            await orch.crash()
            await until(lambda: all(s.core.members[ident.node_id].state is State.DEAD for s in stages), 60,
                        "declared dead")
            again = NodeOptions(role="orchestrator", stages=2, profile="local", bind=addr)
            new_ident = ident if same_identity else Identity.generate()
            back = await start_crashable(nursery, again, lines, new_ident)
            # reconnect asks every second in the local profile; the bound leaves room for a loaded
            # machine (make test runs two tests at once), and tx_reconnect below says it was reconnect
            took = await until(lambda: back_in(back.running, stages), 15, "found")
            print(f"seed restarted without seeds found by reconnect in {took:.2f} s "
                  f"({'same' if same_identity else 'new'} identity)")
            assert sum(s.core.counters["tx_reconnect"] for s in stages) > 0
            nursery.cancel_scope.cancel()


async def test_a_node_restarted_under_its_key_starts_afresh_in_its_peers_path_tables():
    """What a peer's probes showed of a node's old process (direct pings unanswered, the
    relay answering) is no verdict on the new process under the same key: kept, doctor
    would name a firewall in front of a node that merely restarted.  The new process's
    direction reads unknown until a probe of it tells: here, direct."""
    lines: list[str] = []
    ident = Identity.generate()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            orch_opts = NodeOptions(role="orchestrator", stages=2, profile="local")
            orch = await start_node(nursery, orch_opts, lines)
            opts = NodeOptions(stage=0, stages=2, profile="local", seeds=[orch.addr])
            stage = await start_crashable(nursery, opts, lines, ident)
            await until(lambda: sees_all_alive([orch, stage.running]), 20, "converged")
            # The old process's last probe: its direct ping unanswered, the relay answering.
            orch.paths.probe_verdict(ident.node_id, False, trio.current_time(), "direct ping unanswered")
            await stage.crash()
            back = await start_crashable(nursery, opts, lines, ident)
            await until(lambda: sees_all_alive([orch, back.running]), 20, "back")
            await until(lambda: orch.paths.shown_path(ident.node_id) != "unknown", 10, "probed")
            view = orch.paths.view(ident.node_id, trio.current_time())
            assert (view["path_out"], view["direct_failures"], view["relay_ok"], view["last_failure"]) == (
                "direct", 0, 0, None)
            nursery.cancel_scope.cancel()
