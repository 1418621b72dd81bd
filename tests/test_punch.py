"""Hole punching through NATs, on the in-memory network's NAT model (meshd.sim.memnet.SimNat).

A node behind a NAT gossips its own address and the mapping a STUN server saw.
Its own address does not route, so the others' direct pings fail; once they
punch, their direct pings go to the mapping and are answered there.
"""

from __future__ import annotations

import random
from dataclasses import replace

import trio

from meshd.node import NodeOptions
from meshd.relay.server import serve_relay
from meshd.sim.memnet import MemNet, RelayPath
from meshd.swim import Config, EventKind
from meshd.swim.punch import GAP_S, MAX_OBSERVED, RETRY_MAX_S, RETRY_S, TRIES, Punching
from meshd.swim.state import Member, State
from meshd.testing.inprocess import start_node, wait_converged
from meshd.wire import CallMeMaybe, Meta, Packet, Punch, PunchAck, encode

RELAY = ("ws://relay:3340",)


def mesh(n: int, nat: dict[int, str], seed: int = 1) -> MemNet:
    """``n`` nodes sharing a relay; ``nat`` puts node i behind an "eim" or "symmetric" NAT."""
    net = MemNet(seed=seed)
    net.relay = RelayPath()
    nodes = []
    for i in range(n):
        seeds = [nodes[0].addr] if nodes else None
        node = net.add_node(Meta(role="stage", stage=i, stages=n, relays=RELAY), seeds=None)
        if i in nat:
            net.put_behind_nat(node, symmetric=nat[i] == "symmetric")
            # As the node does at start: its mapping from two STUN servers, and what they say.
            first, second = net.stun(node, "192.0.2.1:3478"), net.stun(node, "192.0.2.2:3478")
            kind = "endpoint-independent" if first == second else "symmetric"
            node.swim.set_meta(replace(node.swim.me.meta, addrs=(node.addr, first), nat=kind), net.now)
        else:
            node.swim.set_meta(replace(node.swim.me.meta, addrs=(node.addr,)), net.now)
        if seeds:
            node.swim.join(seeds, net.now)
        net.flush(node)
        nodes.append(node)
    return net


def direct_ok(net: MemNet, a: int, b: int) -> bool:
    nodes = list(net.nodes.values())
    return nodes[a].swim._direct_ok.get(nodes[b].id, True)  # the core records changes only


def test_every_pair_with_a_node_behind_an_endpoint_independent_nat_ends_punched():
    net = mesh(4, {3: "eim"})
    net.run_until_converged(60)
    net.run_periods(30)
    nodes = list(net.nodes.values())
    natted = nodes[3]
    mapping = natted.swim.me.meta.addrs[1]
    for node in nodes[:3]:
        assert node.swim.punch.address(natted.id) == mapping, node.swim.punch.peers
        assert direct_ok(net, node.index, 3)  # its probes go to the mapping and are answered there
        assert direct_ok(net, 3, node.index)
    punched = net.events(EventKind.PUNCHED, natted)
    assert {o.observer for o in punched} == {n.id for n in nodes[:3]}
    assert all(o.event.detail["addr"] == mapping for o in punched)
    # Nobody was suspected on the way: a path down is not a member down.
    assert not net.events(EventKind.SUSPECT)
    assert net.counters["nat_unroutable"] > 0  # the private address really was tried, and lost


def test_two_nodes_behind_their_own_nats_punch_each_other():
    net = mesh(4, {2: "eim", 3: "eim"})
    net.run_until_converged(60)
    net.run_periods(30)
    nodes = list(net.nodes.values())
    a, b = nodes[2], nodes[3]
    assert a.swim.punch.address(b.id) == b.swim.me.meta.addrs[1]
    assert b.swim.punch.address(a.id) == a.swim.me.meta.addrs[1]
    assert direct_ok(net, 2, 3) and direct_ok(net, 3, 2)
    assert not net.events(EventKind.SUSPECT)


def test_a_symmetric_nat_keeps_its_pairs_on_the_relay_and_says_why():
    net = mesh(4, {3: "symmetric"})
    net.run_until_converged(60)
    net.run_periods(30)
    nodes = list(net.nodes.values())
    natted = nodes[3]
    assert natted.swim.me.meta.nat == "symmetric"
    for node in nodes[:3]:
        assert node.swim.punch.address(natted.id) is None
        assert not direct_ok(net, node.index, 3)  # the relay carries it
        assert node.swim.punch.status(natted.id) == "behind a symmetric NAT: not punched"
        assert node.swim.members[natted.id].state is State.ALIVE
    assert not net.events(EventKind.PUNCHED)
    assert sum(n.swim.counters["tx_punches"] for n in nodes) == 0


def test_a_punched_pair_stays_open_with_at_most_one_keepalive_per_25_seconds():
    # Two nodes, probing each other every period, send no keepalive at all; with the probe
    # interval far apart (a big mesh probes each member rarely), the keepalives keep the
    # mapping open, one small packet per KEEPALIVE_S.
    config = replace(Config(), probe_interval=60.0, probe_timeout=3.0, gossip_interval=3600.0,
                     push_pull_interval=3600.0)
    net = MemNet(seed=3, config=config)
    net.relay = RelayPath()
    a = net.add_node(Meta(role="stage", stage=0, relays=RELAY))
    b = net.add_node(Meta(role="stage", stage=1, relays=RELAY))
    net.put_behind_nat(b)
    b.swim.set_meta(replace(b.swim.me.meta, addrs=(b.addr, net.stun(b))), net.now)
    b.swim.join([a.addr], net.now)
    net.flush(b)
    net.run_for(120)
    assert a.swim.punch.address(b.id) is not None
    start = a.swim.counters["tx_punch_keepalives"]
    t0 = net.now
    net.run_for(600)
    keepalives = a.swim.counters["tx_punch_keepalives"] - start
    assert 0 < keepalives <= (net.now - t0) / 25 + 1
    assert a.swim.punch.address(b.id) is not None  # the mapping never lapsed
    assert a.swim.members[b.id].state is State.ALIVE and not net.events(EventKind.SUSPECT)


# --- what a stranger or a lying member can make of it ---

def member(node: bytes, addrs: tuple[str, ...], nat: str = "") -> Member:
    return Member(node, addrs[0], Meta(addrs=addrs, nat=nat), 0, State.ALIVE, 0.0)


def test_an_answer_counts_only_with_our_nonce_from_an_address_named_for_the_member():
    me = member(b"a" * 32, ("10.0.0.1:7946",))
    peer = member(b"b" * 32, ("10.1.0.2:7946", "198.51.0.2:40000"))
    punching = Punching(random.Random(0))
    sends = punching.direct_failed(peer, me, 0.0)
    punch = next(s.msgs[0] for s in sends if isinstance(s.msgs[0], Punch))
    assert {s.addr for s in sends if s.via == "direct"} == {"198.51.0.2:40000"}
    assert any(isinstance(s.msgs[0], CallMeMaybe) and s.via == "relay" for s in sends)
    assert not punching.answered(peer, punch.nonce + 1, "198.51.0.2:40000", 0.1)  # a guessed nonce
    assert not punching.answered(peer, punch.nonce, "203.0.113.66:1", 0.1)  # an address nobody named
    assert not punching.answered(peer, 0, "198.51.0.2:40000", 0.1)  # a keepalive's nonce
    assert punching.address(peer.id) is None
    assert punching.answered(peer, punch.nonce, "198.51.0.2:40000", 0.1)
    assert punching.address(peer.id) == "198.51.0.2:40000"


def test_a_round_nothing_answered_is_tried_again_at_the_first_failing_probe_after_the_wait():
    # (Its punches may reach a peer that has not heard of us yet, and be refused.)
    me = member(b"a" * 32, ("10.0.0.1:7946",))
    peer = member(b"b" * 32, ("10.1.0.2:7946", "198.51.0.2:40000"))
    punching = Punching(random.Random(0))
    assert punching.direct_failed(peer, me, 0.0)
    now = 0.0
    while now < TRIES * GAP_S + 0.1:
        now += GAP_S
        punching.due({peer.id: peer}, me, now, lambda node: False)
    assert punching.status(peer.id) == "no answer to 1 punch round"
    assert punching.direct_failed(peer, me, now) == []  # too soon
    again = punching.direct_failed(peer, me, now + RETRY_S)
    assert {s.addr for s in again if s.via == "direct"} == {"198.51.0.2:40000"}


def test_a_members_calls_cannot_make_us_punch_faster_than_our_own_rounds():
    me = member(b"a" * 32, ("10.0.0.1:7946", "198.51.0.1:40000"))
    peer = member(b"b" * 32, ("10.1.0.2:7946",))
    punching = Punching(random.Random(0))
    calls = 0
    now = 0.0
    for step in range(600):  # a call every 0.1 s for a minute, each naming a new address
        now = step * 0.1
        calls += len(punching.called(peer, me, (f"203.0.113.{step % 250}:{1000 + step}",), now))
        calls += len(punching.due({peer.id: peer}, me, now, lambda node: True))
    # Rounds only as our own retries space them (2.5 s, doubling): five in a minute, each
    # TRIES punches to its own address and the (at most MAX_OBSERVED) addresses it named.
    rounds, t, wait = 0, 0.0, RETRY_S
    while t < 60:
        rounds, t, wait = rounds + 1, t + TRIES * GAP_S + wait, min(2 * wait, RETRY_MAX_S)
    assert calls <= rounds * TRIES * (MAX_OBSERVED + 1)
    assert rounds * TRIES * (MAX_OBSERVED + 1) < 600 * TRIES  # far below one round per call


def nodes_of(net: MemNet):
    return list(net.nodes.values())


def test_a_strangers_punch_gets_one_small_answer_and_unrelayed_calls_get_nothing():
    net = mesh(3, {2: "eim"})
    net.run_until_converged(60)
    a, _, natted = nodes_of(net)
    stranger = b"s" * 32
    assert a.swim.outbox() == []
    # A stranger's punch is answered as a ping is: one packet no larger than it, no round of ours.
    punch = encode(Packet(stranger, (Punch(5, a.id),)))
    a.swim.receive_datagram(punch, "203.0.113.5:1", net.now)
    [answer] = a.swim.outbox()
    assert answer.addr == "203.0.113.5:1" and [type(m) for m in answer.packet.messages] == [PunchAck]
    assert len(encode(answer.packet)) <= len(punch) + 32  # the address it echoes, at most
    assert a.swim.punch.peers.get(stranger) is None
    # A punch through the relay, or for somebody else, gets nothing.
    a.swim.receive_datagram(encode(Packet(stranger, (Punch(6, natted.id),))), "203.0.113.5:1", net.now)
    assert a.swim.counters["rx_punch_refused"] == 1
    # A member's call-me-maybe that came as a datagram, not over the relay: ignored.
    a.swim.receive_datagram(encode(Packet(natted.id, (CallMeMaybe(("203.0.113.5:1",)),))),
                            "203.0.113.5:1", net.now)
    # An unasked PunchAck does not redirect anything.
    a.swim.receive_datagram(encode(Packet(natted.id, (PunchAck(12345, "x:1"),))), "203.0.113.5:1", net.now)
    assert not [o for o in a.swim.outbox() if o.addr.startswith("203.0.113.5")]
    assert a.swim.punch.address(natted.id) != "203.0.113.5:1"


# --- the whole node on loopback: an address that does not route, a mapping that does ---

async def _free_port() -> int:
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM)
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


async def _hidden_mesh(nursery, lines: list[str], nat: str = ""):
    """A relay, an orchestrator, stage-1 advertising a port where nothing listens (its own
    address does not route, as behind a NAT; ``nat`` is the kind it then says it has) and
    stage-0 with a dashboard, converged: (orchestrator, stage-1, stage-0)."""
    host, port = await nursery.start(serve_relay, "127.0.0.1", 0)
    opts = dict(profile="local", relay=f"ws://{host}:{port}", stages=2)
    orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
    hidden = await start_node(nursery, NodeOptions(
        stage=1, seeds=[orch.addr], advertise=f"127.0.0.1:{await _free_port()}", **opts), lines)
    if nat:  # said before stage-0 starts, so it never punches
        hidden.core.set_meta(replace(hidden.core.me.meta, nat=nat), trio.current_time())
    peer = await start_node(nursery, NodeOptions(stage=0, seeds=[orch.addr], dashboard="127.0.0.1:0", **opts),
                            lines)
    await wait_converged([orch, hidden, peer])
    return orch, hidden, peer


async def test_a_node_behind_an_address_that_does_not_route_is_punched_and_takes_data_as_datagrams():
    # ``--advertise`` names a port where nothing listens, as a NAT'd node's own address is
    # unreachable; the relay's STUN sees its real socket, the mapping a peer can punch.  Its
    # pings there are answered, and data smaller than 1 MiB goes as datagrams to it.
    import hashlib

    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            _orch, hidden, peer = await _hidden_mesh(nursery, lines)
            mapping = hidden.candidates[1]
            node = hidden.node_id
            while peer.core.punch.address(node) != mapping or not peer.paths.punched(node):
                await trio.sleep(0.05)
            assert any(line.startswith(f"meshd punched stage-0->stage-1 prefix={hidden.node_id.hex()[:8]} "
                                       f"addr={mapping}") for line in lines)
            got: list[tuple[bytes, bytes]] = []
            sizes = [10, 64 * 1024 + 7, 1024 * 1024, 1024 * 1024 + 1]
            payloads = [bytes(range(256)) * (n // 256) + b"x" * (n % 256) for n in sizes]

            async def collect():
                async for src, data in hidden.data.received:
                    got.append((src, data))
                    if len(got) == len(sizes):
                        return

            paths = []
            async with trio.open_nursery() as inner:
                inner.start_soon(collect)
                for data in payloads:
                    paths.append(await peer.send(hidden.node_id, data, timeout=30))
            # Up to 1 MiB as datagrams through the mapping; more over the relay.
            assert paths == ["punched", "punched", "punched", "relay"]
            digest = [hashlib.sha256(d).digest() for d in payloads]
            assert [hashlib.sha256(d).digest() for _, d in got] == digest
            assert not [line for line in lines if "member suspect" in line or "member dead" in line]
            nursery.cancel_scope.cancel()


async def test_a_failed_dial_beside_the_punched_path_leaves_the_data_path_punched():
    """Data through a punched NAT goes as datagrams while a direct dial is tried beside it; the
    dial fails (nothing listens at the address the node advertises), and what the node reports
    of its data path is still the path its messages take: punched, not the relay."""
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            _orch, hidden, peer = await _hidden_mesh(nursery, lines)
            node = hidden.node_id
            while not peer.paths.punched(node):
                await trio.sleep(0.05)
            assert await peer.send(node, b"step", timeout=30) == "punched"
            while not (peer.data.view(node)["data_last_failure"] or "").startswith("direct:"):
                await trio.sleep(0.05)  # the dial beside it failed
            assert peer.data.view(node)["data_out"] == "punched"
            assert peer.data.path(node) == "punched", "the next message goes punched too"
            nursery.cancel_scope.cancel()


async def test_an_ack_datagram_from_anywhere_but_the_punched_address_counts_for_nothing():
    # Acks are not sealed: one that does not come from the address our punch opened for its
    # sender is dropped, so a stranger cannot make us think a message arrived.
    from meshd.identity import Identity
    from meshd.net.channel import DataChannel
    from meshd.wire import RELAY_DATA, DataAck

    victim = Identity.generate()
    claimed = Identity.generate().node_id
    channel = DataChannel(victim.node_id, addr_of=lambda n: None, describe=lambda n: n.hex()[:8],
                          relay_send=None, punched_addr=lambda n: "198.51.100.7:40000",
                          datagram_send=None, sign=victim.sign)
    seen = []
    channel._sender.on_ack = lambda node, ack: seen.append((node, ack))  # type: ignore[method-assign]
    forged = RELAY_DATA + encode(Packet(claimed, (DataAck(1, 1),)))
    channel._serving.set()  # as serve() does; acks need none of its tasks
    await channel.on_datagram("203.0.113.9:1", forged)
    assert seen == [] and channel.counters["bad_frames"] == 1
    await channel.on_datagram("198.51.100.7:40000", forged)  # the guard is the address, nothing else
    assert seen == [(claimed, DataAck(1, 1))]


async def test_doctor_says_a_symmetric_nat_keeps_a_pair_on_the_relay(capsys):
    # The node says its NAT maps per destination (as two relays' STUN would find): nobody
    # punches it, and doctor names that as the reason, with what to change.
    import json

    from meshd.cli import main

    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            _orch, hidden, peer = await _hidden_mesh(nursery, lines, nat="symmetric")
            while not (peer.paths.view(hidden.node_id, 0.0)["last_failure"] or "").startswith(
                    "behind a symmetric NAT: not punched"):
                await trio.sleep(0.05)
            mine: list[dict] = []
            while not mine:  # until stage-1's own summary (its way back) has reached us too
                await trio.sleep(0.2)
                capsys.readouterr()
                code = await trio.to_thread.run_sync(main, ["doctor", peer.dashboard_url, "--json"])
                report = json.loads(capsys.readouterr().out)
                assert code == 1
                mine = [p for p in report["problems"] if p["where"] == "stage-0→stage-1"]
            assert "behind a symmetric NAT: not punched" in mine[0]["detail"], report["problems"]
            assert "stage-1 is behind a symmetric NAT" in mine[0]["check"]
            assert peer.core.punch.address(hidden.node_id) is None
            assert peer.core.counters["tx_punches"] == 0
            nursery.cancel_scope.cancel()
