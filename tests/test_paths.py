"""Per-direction paths over real loopback sockets, with the relay: a one-way drop
moves that direction onto the relay, leaves the other direction direct, and
never costs a live member its life."""

from __future__ import annotations

from functools import partial

import trio

from meshd.net.faults import Faults
from meshd.node import NodeOptions
from meshd.relay.server import Relay, serve_relay
from meshd.swim import LOCAL
from meshd.testing.inprocess import start_node as _start
from meshd.testing.inprocess import wait_converged


async def test_one_way_drop_goes_via_relay_and_nobody_dies():
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            relay = Relay()
            host, port = await nursery.start(partial(serve_relay, relay=relay), "127.0.0.1", 0)
            url = f"ws://{host}:{port}"
            opts = dict(profile="local", relay=url, stages=3)
            a = await _start(nursery, NodeOptions(role="orchestrator", **opts), lines)
            b = await _start(nursery, NodeOptions(stage=0, seeds=[a.addr], **opts), lines)
            d = await _start(nursery, NodeOptions(stage=2, seeds=[a.addr], **opts), lines)
            # C (stage-1) loses every direct packet it sends to A.
            c = await _start(
                nursery,
                NodeOptions(stage=1, seeds=[b.addr], faults=Faults.parse([f"drop:{a.addr}"]), **opts),
                lines,
            )
            nodes = [a, b, c, d]
            await wait_converged(nodes)
            # Long enough for several probes each way and a full suspicion timeout.
            await trio.sleep(3 * LOCAL.suspicion_bounds(4)[0])

            assert c.paths.out_path(a.identity.node_id) == "relay"
            # Each node asked the relay's STUN how its gossip socket looks from outside;
            # on loopback that is its own address, so it is the one candidate gossiped.
            assert relay.stun_answered >= 4
            for n in nodes:
                assert n.candidates == [n.addr] and n.swim.me.meta.addrs == (n.addr,)
                assert f"meshd candidates {n.addr}" in lines
            assert a.paths.out_path(c.identity.node_id) == "direct"
            snap_c = {m["prefix"]: m for m in c.snapshot()["members"]}
            view = snap_c[a.identity.prefix]
            assert view["path_out"] == "relay" and view["relay_ok"] > 0
            assert "direct ping unanswered" in view["last_failure"]
            snap_a = {m["prefix"]: m for m in a.snapshot()["members"]}
            assert snap_a[c.identity.prefix]["path_out"] == "direct"
            assert snap_a[c.identity.prefix]["in_seen"]["relay"] > 0, "C's packets reach A via the relay"
            path_line = f"meshd path stage-1->orchestrator prefix={a.identity.prefix} out=relay"
            assert any(line.startswith(path_line) for line in lines)
            assert not [line for line in lines if line.startswith("meshd member dead")]
            # With the relay answering, A is never even suspected by C.
            assert not [line for line in lines
                        if line.startswith(f"meshd member suspect prefix={a.identity.prefix}")]
            nursery.cancel_scope.cancel()


def test_a_way_in_nothing_came_by_for_a_while_reads_none_not_the_last_one_used():
    """``meshd peers``' IN column: the relay that carried a peer's last packet, while packets
    come; once none has come for the window (its relay gone, the peer dead), none."""
    from meshd.net.path_table import PathTable

    table, peer = PathTable(), b"\x07" * 32
    assert table.view(peer, 0.0, stale_after=3.0)["path_in"] == "none"  # nothing yet
    table.received(peer, "relay", 10.0)
    assert table.view(peer, 12.0, stale_after=3.0)["path_in"] == "relay"
    seen = table.view(peer, 14.0, stale_after=3.0)
    assert (seen["path_in"], seen["path_in_seen_s"]) == ("none", 4.0)
    table.received(peer, "direct", 15.0)
    assert table.view(peer, 15.5, stale_after=3.0)["path_in"] == "direct"
    assert table.view(peer, 15.5, stale_after=0.0)["path_in"] == "none"  # a member not live
