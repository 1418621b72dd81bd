"""Reach: joining through the relay, never joining in silence, and several relays."""

from __future__ import annotations

import socket
from functools import partial

import trio

from dashboard import views
from meshd.net.faults import Faults
from meshd.node import NodeOptions
from meshd.relay.server import serve_relay
from meshd.swim import State
from meshd.testing.inprocess import start_node, wait_converged


async def _until(check, timeout: float, what: str) -> float:
    """Poll ``check`` until it holds; returns how long it took, or fails naming ``what``."""
    start = trio.current_time()
    with trio.move_on_after(timeout):
        while not check():
            await trio.sleep(0.05)
        return trio.current_time() - start
    raise AssertionError(f"not {what} within {timeout:g} s")


async def _relay(nursery: trio.Nursery) -> tuple[str, trio.CancelScope]:
    """A relay on loopback, and the scope that stops it (as if its host went away)."""
    scope = trio.CancelScope()

    async def run(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await serve_relay("127.0.0.1", 0, task_status=task_status)

    host, port = await nursery.start(run)
    return f"ws://{host}:{port}", scope


async def _pair(nursery: trio.Nursery, lines: list[str], faults: list[str] | None = None):
    """A relay, an orchestrator A, and a stage B seeded with A (``faults`` given to B with
    ``{a}`` standing for A's address), converged."""
    url, _ = await _relay(nursery)
    opts = partial(NodeOptions, stages=1, profile="local", relay=url)
    a = await start_node(nursery, opts(role="orchestrator"), lines)
    specs = [spec.format(a=a.addr) for spec in faults or []]
    b = await start_node(nursery, opts(stage=0, seeds=[a.addr], faults=Faults.parse(specs)), lines)
    await wait_converged([a, b])
    return a, b


def _silent_port() -> int:
    """A loopback UDP port where nothing listens (bound, read, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_node_whose_packets_never_reach_its_seed_joins_through_the_relay():
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url, _ = await _relay(nursery)
            seed = await start_node(nursery, NodeOptions(role="orchestrator", stages=1, profile="local",
                                                         relay=url), lines)
            # Every direct packet of ours to the seed is lost; its packets to us arrive.
            faults = Faults.parse([f"drop:{seed.addr}"])
            joiner = await start_node(nursery, NodeOptions(stage=0, stages=1, profile="local", relay=url,
                                                           seeds=[seed.addr], faults=faults), lines)
            me = joiner.identity.node_id
            members = seed.core.members
            took = await _until(lambda: me in members and members[me].state is State.ALIVE, 20,
                                "alive in the seed's list")
            await wait_converged([seed, joiner])
            await _until(lambda: any(line.startswith("meshd join: joined") for line in lines), 5, "said")
            said = [line for line in lines if line.startswith("meshd join:")]
            assert said[0].startswith(f"meshd join: no answer from {seed.addr} after 3 s, retrying"), said
            assert any("joined through the relay" in line for line in said), said
            assert joiner.join_status()["joined"]
            print(f"\njoined through the relay in {took:.1f} s: {said}")
            # The joiner's datagrams to the seed take the relay; the seed reaches it directly.
            await _until(lambda: joiner.paths.out_path(seed.identity.node_id) == "relay", 10,
                         "the joiner's path to the seed on the relay")
            assert seed.paths.out_path(me) == "direct"
            nursery.cancel_scope.cancel()


async def test_a_seed_where_nothing_listens_is_named_and_the_node_says_it_is_not_joined():
    lines: list[str] = []
    silent = f"127.0.0.1:{_silent_port()}"
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, NodeOptions(stage=0, stages=1, profile="local", seeds=[silent]),
                                    lines)
            await _until(lambda: any(line.startswith("meshd join: no answer") for line in lines), 15,
                         "a line naming the silent seed")
            (line,) = [line for line in lines if line.startswith("meshd join:")]
            assert line == f"meshd join: no answer from {silent} after 3 s, retrying"
            snap = node.snapshot()
            assert snap["join"]["joined"] is False and snap["join"]["seeds"] == [silent]
            status = views.peers(snap)["join"]["status"]
            assert status.startswith(f"not joined: no answer from {silent} after "), status
            problems = [p for p in views.problems(snap) if p["kind"] == "not-joined"]
            assert problems and silent in problems[0]["detail"]
            # Retried with a growing wait, and said again at twice the wait.
            await _until(lambda: sum(line.startswith("meshd join:") for line in lines) == 2, 10, "said again")
            assert lines[-1].startswith(f"meshd join: no answer from {silent} after 6 s")
            attempts = node.core.join_attempts
            assert 5 <= attempts <= 7, f"{attempts} join attempts in 6 s: one a second, then backing off"
            nursery.cancel_scope.cancel()


async def test_a_node_with_no_seed_or_a_seed_that_answers_says_nothing_about_joining():
    lines: list[str] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            first = await start_node(nursery, NodeOptions(role="orchestrator", stages=1, profile="local"),
                                     lines)
            second = await start_node(nursery, NodeOptions(stage=0, stages=1, profile="local",
                                                           seeds=[first.addr]), lines)
            await wait_converged([first, second])
            await trio.sleep(3.5)  # past the first "no answer" line, had there been one
            assert not [line for line in lines if line.startswith("meshd join")]
            for node in (first, second):
                assert node.join_status()["joined"]
                assert not [p for p in views.problems(node.snapshot()) if p["kind"] == "not-joined"]
            nursery.cancel_scope.cancel()


async def test_a_relayed_pair_moves_to_the_second_relay_when_the_first_dies():
    """Both ends hold two relays; C's direct packets to A are lost, so C->A goes by relay.  The
    first relay dies: the next frames take the second, said in a relay-move line, and nobody
    is suspected, let alone declared dead."""
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            first_url, first = await _relay(nursery)
            second_url, _ = await _relay(nursery)
            opts = partial(NodeOptions, profile="local", stages=2, relays=[first_url, second_url])
            a = await start_node(nursery, opts(role="orchestrator"), lines)
            b = await start_node(nursery, opts(stage=0, seeds=[a.addr]), lines)
            drop = Faults.parse([f"drop:{a.addr}"])
            c = await start_node(nursery, opts(stage=1, seeds=[b.addr], faults=drop), lines)
            await wait_converged([a, b, c])
            a_id = a.identity.node_id
            assert a.core.members[c.identity.node_id].meta.relay_urls == (first_url, second_url)
            got: list[bytes] = []

            async def collect() -> None:
                async for _src, data in a.data.received:
                    got.append(data)

            nursery.start_soon(collect)
            assert await c.send(a_id, b"one", timeout=20) == "relay"
            assert c.relays.via(a_id) == first_url
            first.cancel()
            await _until(lambda: not c.relays.clients[0].connected, 10, "C sees the first relay gone")
            assert await c.send(a_id, b"two", timeout=20) == "relay"
            assert c.relays.via(a_id) == second_url
            moves = [line for line in lines if line.startswith("meshd relay-move stage-1->orchestrator")]
            assert moves and f"from={first_url} to={second_url}" in moves[0], moves
            # The probes' relayed pings take the second relay too: A stays alive for C.
            probes = c.core.counters["relay_pings"]
            await _until(lambda: c.core.counters["relay_pings"] >= probes + 3, 20, "3 more relayed probes")
            assert c.core.members[a_id].state is State.ALIVE
            assert not [ln for ln in lines if ln.startswith(("meshd member suspect", "meshd member dead"))]
            assert got == [b"one", b"two"]
            view = {m["prefix"]: m for m in c.snapshot()["members"]}[a.identity.prefix]
            assert view["relay_via"] == second_url and view["rtt_path"] == "relay"
            # doctor and the dashboard name the relay the pair uses now.
            topo = views.topology(c.snapshot())
            (edge,) = [e for e in topo["edges"]
                       if (e["from_name"], e["to_name"]) == ("stage-1", "orchestrator")]
            assert (edge["path"], edge["relay"]) == ("relay", second_url)
            # The pair shows as asymmetric once A's summary of its own direction (direct)
            # has reached C by gossip.
            await _until(lambda: any(f"via relay {second_url}" in a["detail"]
                                     for a in views.topology(c.snapshot())["asymmetric"]),
                         10, "the pair shown asymmetric, C->A via the second relay")
            nursery.cancel_scope.cancel()


# --- the relay's peer list: what a joiner asks, and what it cannot be made to do ---


async def test_a_relay_lists_the_other_connected_nodes_and_keeps_the_list_to_its_rate():
    from meshd.identity import Identity
    from meshd.relay.client import RelayClient
    from meshd.relay.protocol import MAX_LISTED, Peers
    from meshd.relay.server import Relay, RelayConfig

    relay = Relay(RelayConfig(max_payload=1000, rate_bytes_per_s=2000, burst_bytes=5000))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(partial(serve_relay, relay=relay), "127.0.0.1", 0)
            clients = [RelayClient(f"ws://{host}:{port}", Identity.generate()) for _ in range(4)]
            for client in clients:
                await nursery.start(client.run)
            asker, others = clients[0], clients[1:]
            await asker.list_peers()
            answer = await asker.received.receive()
            assert isinstance(answer, Peers)
            assert sorted(answer.node_ids) == sorted(o.identity.node_id for o in others)  # never the asker
            assert len(answer.node_ids) <= MAX_LISTED
            # Asking costs the answer's bytes from the asker's budget: a flood gets a few answers.
            for _ in range(200):
                await asker.list_peers()
            await _until(lambda: relay.snapshot()["clients"][asker.identity.prefix]["rate_limited"] > 0, 10,
                         "rate limited")
            assert relay.snapshot()["peer_lists"] < 200
            nursery.cancel_scope.cancel()


def test_a_peers_frame_that_is_not_whole_node_ids_or_too_many_is_a_protocol_error():
    import pytest

    from meshd.relay import protocol

    ids = tuple(bytes([i]) * 32 for i in range(3))
    assert protocol.decode(protocol.Peers(ids).encode()) == protocol.Peers(ids)
    for body in (b"\x01" * 33, b"\x02" * 32 * (protocol.MAX_LISTED + 1)):
        with pytest.raises(protocol.RelayProtocolError):
            protocol.decode(bytes([protocol.Peers.TAG]) + body)
    with pytest.raises(protocol.RelayProtocolError):
        protocol.decode(bytes([protocol.ListPeers.TAG]) + b"x")


async def test_a_peer_list_reaching_a_node_that_has_joined_sends_nothing():
    """A relay may hand us a list at any time (or make one up): only a node still waiting on
    its seeds sends joins to the ids on it."""
    from meshd.relay.protocol import Peers

    lines: list[str] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a, b = await _pair(nursery, lines)
            strangers = tuple(bytes([i]) * 32 for i in range(1, 9))
            await b.relays.clients[0]._incoming_send.send(Peers(strangers))  # as if the relay said it
            await trio.sleep(0.3)
            assert b.core.counters["tx_join_via_relay"] == 0
            assert not [line for line in lines if line.startswith("meshd join")]
            nursery.cancel_scope.cancel()


async def test_delay_holds_what_a_node_sends_over_the_relay_too():
    """netem on a host holds its relay connection's packets as well: in-process, ``delay:``
    holds every relay payload we send, in order."""
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            a, c = await _pair(nursery, lines, ["drop:{a}", "delay:80"])  # C -> A over the relay, late
            got: list[tuple[float, bytes]] = []

            async def collect() -> None:
                async for _src, data in a.data.received:
                    got.append((trio.current_time(), data))

            nursery.start_soon(collect)
            await _until(lambda: c.paths.out_path(a.identity.node_id) == "relay", 20, "C->A on the relay")
            sent = []
            for i in range(5):
                sent.append(trio.current_time())
                await c.data.post(a.identity.node_id, b"%d" % i, timeout=20)
            await _until(lambda: len(got) == 5, 20, "all five delivered")
            assert [data for _, data in got] == [b"%d" % i for i in range(5)]
            assert all(at - when >= 0.08 for (at, _), when in zip(got, sent, strict=True))
            nursery.cancel_scope.cancel()


async def test_a_seed_no_datagram_can_be_sent_to_is_named_with_the_reason():
    """A seed the socket refuses outright (a name that does not resolve; here the broadcast
    address, refused without SO_BROADCAST) is not silence: the join line says why."""
    lines: list[str] = []
    refused = "255.255.255.255:7946"
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, NodeOptions(stage=0, stages=1, profile="local", seeds=[refused]),
                                    lines)
            await _until(lambda: any(line.startswith("meshd join: no answer") for line in lines), 15,
                         "a line naming the seed")
            (line,) = [line for line in lines if line.startswith("meshd join:")]
            assert line.startswith(f"meshd join: no answer from {refused} (cannot send there: "), line
            status = views.peers(node.snapshot())["join"]["status"]
            assert "(cannot send there: " in status, status
            nursery.cancel_scope.cancel()
