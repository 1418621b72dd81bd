"""Path summaries: each node gossips its own outbound paths; every node keeps the newest."""

from __future__ import annotations

import random

import pytest

from meshd import wire
from meshd.swim import LOCAL, Swim
from meshd.wire import Meta, Packet, PathEntry, PathSummary

NODE_A = b"\xaa" * 32
NODE_B = b"\xbb" * 32
NODE_C = b"\xcc" * 32


def _swim(node: bytes) -> Swim:
    """A node that knows A, B and C as alive members."""
    s = Swim(node, f"10.0.0.{node[0] % 200}:7946", Meta(), LOCAL, random.Random(1), 0.0)
    others = tuple(wire.Alive(1, n, f"10.0.0.{n[0] % 200}:7946", Meta()) for n in (NODE_A, NODE_B, NODE_C)
                   if n != node)
    s.receive(Packet(others[0].node, others), "10.0.0.9:1", 0.0)
    return s


def _summary(version: int, path: str = "relay") -> PathSummary:
    return PathSummary(NODE_A, version, (PathEntry(NODE_B, path, 1500, 2, "direct ping unanswered", 3000),))


def test_a_newer_summary_replaces_an_older_one_and_an_older_is_ignored():
    s = _swim(NODE_C)
    s.receive(Packet(NODE_A, (_summary(2),)), "10.0.0.1:1", 1.0)
    assert s.path_summaries[NODE_A] == (_summary(2), 1.0)
    s.receive(Packet(NODE_A, (_summary(1, "direct"),)), "10.0.0.1:1", 2.0)
    assert s.path_summaries[NODE_A] == (_summary(2), 1.0), "an older version must not win"
    s.receive(Packet(NODE_B, (_summary(3, "none"),)), "10.0.0.2:1", 3.0)  # relayed by B
    assert s.path_summaries[NODE_A][0].entries[0].path == "none"


def test_a_summary_for_a_node_we_do_not_know_is_not_kept():
    s = _swim(NODE_C)
    stranger = b"\x51" * 32
    s.receive(Packet(stranger, (PathSummary(stranger, 5, ()),)), "10.0.0.7:1", 1.0)
    assert stranger not in s.path_summaries


def test_a_summary_forged_in_our_name_is_replaced_by_ours_at_a_higher_version():
    a = _swim(NODE_A)
    a.publish_paths(_summary(10, "direct"), 0.0)
    a.broadcasts.take(10_000, 100)  # what was queued so far has gone out
    forged = PathSummary(NODE_A, 2**62, (PathEntry(NODE_B, "none", 0, 9, "forged", 0),))
    a.receive(Packet(NODE_C, (forged,)), "10.0.0.3:1", 1.0)
    held = a.path_summaries[NODE_A][0]
    assert held.version == 2**62 + 1 and held.entries == _summary(10, "direct").entries
    assert held in a.broadcasts.take(10_000, 5), "our own summary goes out again"
    # The node's own next summary, numbered from its clock, still wins at every peer.
    a.publish_paths(_summary(11, "relay"), 2.0)
    assert a.path_summaries[NODE_A][0].version == 2**62 + 2
    assert a.path_summaries[NODE_A][0].entries[0].path == "relay"


def test_a_summary_is_gossiped_on_until_the_retransmit_limit():
    a, b = _swim(NODE_A), _swim(NODE_B)
    a.publish_paths(_summary(1), 0.0)
    assert a.path_summaries[NODE_A][0] == _summary(1)
    taken = a.broadcasts.take(10_000, 5)
    assert _summary(1) in taken
    b.receive(Packet(NODE_A, tuple(taken)), "10.0.0.1:1", 0.5)
    assert b.path_summaries[NODE_A][0] == _summary(1)
    assert _summary(1) in b.broadcasts.take(10_000, 5), "B passes A's summary on"


@pytest.mark.parametrize("bad", [
    [NODE_A, 1, [[NODE_B, "carrier-pigeon", 0, 0, "", 0]]],
    [NODE_A, 1, [[NODE_B, "direct", -1, 0, "", 0]]],
    [NODE_A, 1, [[NODE_B, "relay", 0, 0, "x" * 49, 0]]],
    [NODE_A, 1, [[NODE_B, "relay", 0, 0, "", 0]] * 65],
    [NODE_A, 1, [[NODE_B, "relay", 0, 0, ""]]],
    [b"short", 1, []],
])
def test_malformed_summaries_are_wire_errors(bad):
    with pytest.raises(wire.WireError):
        PathSummary.from_body(bad)


def test_a_big_meshs_summary_still_fits_one_gossip_packet_with_the_broken_paths_first():
    from meshd.net.path_table import MAX_SUMMARY_BYTES, PathTable

    table = PathTable()
    relay = "ws://relay.example:3478"
    peers = [(bytes([i]) * 32, 0.001, relay) for i in range(1, 60)]
    broken = peers[-1][0]
    table.probe_verdict(broken, False, 10.0, "direct ping unanswered within the probe timeout; x")
    summary = table.summary(NODE_A, 1, peers, 12.0)
    assert wire.encoded_size(summary) <= MAX_SUMMARY_BYTES
    assert summary.entries[0].peer == broken and summary.entries[0].path == "relay"
    assert summary.entries[0].reason == "direct ping unanswered within the probe timeout"
    assert summary.entries[0].since_ms == 2000
    # The relay that carries a relayed direction rides along; a direct entry names none.
    assert summary.entries[0].relay == relay and {e.relay for e in summary.entries[1:]} == {""}
    assert 10 < len(summary.entries) < len(peers)


def test_a_restarted_peer_starts_with_no_failures_and_reads_unknown_until_probed():
    """Probes and packets of a peer's old process say nothing of its new one: doctor must not
    read the old process's relayed probes as a firewall in front of the new one, nor call the
    new one's direct path working before a probe of it says so.  Meanwhile datagrams go
    direct, as to a member just met, and the summary leaves the peer out (not reported)."""
    from meshd.net.path_table import DIRECT, RELAY, UNKNOWN, PathTable

    table, b = PathTable(), NODE_B
    table.sent(b)
    table.received(b, RELAY, 1.0)
    assert table.probe_verdict(b, False, 2.0, "direct ping unanswered")
    table.unreachable(b, 3.0, "member suspect: no path answered")
    table.restarted(b, 4.0)
    assert table.out_path(b) == DIRECT and table.shown_path(b) == UNKNOWN
    view = table.view(b, 5.0)
    assert (view["path_out"], view["direct_failures"], view["relay_ok"], view["last_failure"],
            view["out_attempts"], view["in_seen"]) == (UNKNOWN, 0, 0, None, 0, {"direct": 0, "relay": 0})
    assert table.summary(NODE_A, 1, [(b, None, None)], 5.0).entries == ()
    # The first verdict on the new process is news either way: here, direct works.
    assert table.probe_verdict(b, True, 6.0, "")
    (entry,) = table.summary(NODE_A, 2, [(b, None, None)], 7.0).entries
    assert (entry.path, entry.direct_failures, entry.reason) == (DIRECT, 0, "")
    assert table.view(b, 7.0)["path_out"] == DIRECT and not table.probe_verdict(b, True, 8.0, "")


def test_a_restarted_peer_behind_a_one_way_drop_goes_from_unknown_to_relay_never_direct():
    """A drop of our packets to the peer outlives its restart: the new process's first probe
    finds it again, and until then the direction is unknown, never direct."""
    from meshd.net.path_table import RELAY, UNKNOWN, PathTable

    table, b = PathTable(), NODE_B
    assert table.probe_verdict(b, False, 1.0, "direct ping unanswered")
    table.restarted(b, 2.0)
    assert table.view(b, 2.5)["path_out"] == UNKNOWN
    assert table.probe_verdict(b, False, 3.0, "direct ping unanswered")
    view = table.view(b, 4.0)
    assert (view["path_out"], view["direct_failures"], view["path_out_since_s"]) == (RELAY, 1, 1.0)
    (entry,) = table.summary(NODE_A, 1, [(b, None, "ws://relay:1")], 4.0).entries
    assert (entry.path, entry.direct_failures, entry.relay) == (RELAY, 1, "ws://relay:1")
    # Failure detection's verdict counts too: a new process found dead has no path.
    table.restarted(b, 5.0)
    table.unreachable(b, 6.0, "member dead: no path answered")
    assert table.view(b, 6.0)["path_out"] == "none"
