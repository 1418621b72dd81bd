"""A peer's new process (a restart under its key) has no path verdict until a probe of it
gives one: the direction reads ``unknown``, never the old process's failures nor a direct
path nobody has tested.  In the SWIM core (its first verdict is reported even when direct
works), then over loopback with a one-way drop that outlives the restart."""

from __future__ import annotations

from functools import partial

import pytest
import trio
from test_rejoin import start_crashable, until
from test_swim_units import Bench, found, path_moves, restart, with_relay

from dashboard.views import problems, topology
from meshd.identity import Identity
from meshd.net.path_table import VOUCHED_ONLY, PathTable
from meshd.node import NodeOptions
from meshd.relay.server import Relay, serve_relay
from meshd.swim import EventKind, Swim
from meshd.testing.inprocess import start_node
from meshd.wire import Ack, Ping, PingReq


def test_a_new_process_s_first_probe_verdict_is_reported_even_when_direct_works():
    """A member just met is taken to be direct, so its first direct answer is no news; a
    new process is not (its driver shows it unknown until then), so its first is."""
    bench = Bench(2)
    a, b = bench.swims

    def direct_probe(since: float) -> tuple[float, list]:
        t, (ping,) = bench.tick_until(a, Ping, to=b, limit=since + 30)
        for out in bench.hand(ping, t + 0.001):
            if found(out, Ack):
                a.receive(out.packet, b.me.addr, t + 0.002)
        bench.clock[a.id] = t + 0.002
        return t + 0.002, [(e.node, e.detail["direct"]) for e in a.events() if e.kind is EventKind.PATH]

    now, moves = direct_probe(0.0)
    assert moves == [], "a member just met: direct, as assumed"
    bench.tell(a, b, restart(bench, b, now), now=now)
    assert EventKind.RESTART in [e.kind for e in a.events()]
    now, moves = direct_probe(now)
    assert moves == [(b.id, True)], "the new process's first verdict"
    _, moves = direct_probe(now)
    assert moves == [], "and then only changes"



def helpers_only_probe(bench: Bench, a: Swim, b: Swim, c: Swim, since: float) -> float:
    """A's next probe of B: A's direct ping to B is dropped (one way: A->B), and so is anything
    A sends over a relay; C, asked by A, pings B, and B's answer reaches A only as C's.  A's
    probes of C are answered.  Returns A's time once its probe of B is over."""
    probing_b = False
    while (now := max(a.next_deadline(), bench.clock[a.id])) <= since + 30:
        bench.clock[a.id] = now
        a.tick(now)
        if probing_b and a._probe is None:
            return now
        for out in a.outbox():
            if out.via == "relay" or out.node == b.id:
                probing_b = probing_b or bool(found(out, Ping))
                continue  # dropped
            if out.node != c.id or not (found(out, Ping) or found(out, PingReq)):
                continue
            t = max(now, bench.clock[c.id]) + 0.001
            for back in bench.hand(out, t):  # C's ack to A, or its ping of B for A
                if back.node == b.id:
                    for ack in bench.hand(back, max(t, bench.clock[b.id]) + 0.001):
                        if found(ack, Ack):
                            for vouch in bench.hand(ack, bench.clock[c.id] + 0.001):
                                bench.hand(vouch, max(now, bench.clock[a.id]) + 0.002)
                elif found(back, Ack):
                    bench.hand(back, max(now, bench.clock[a.id]) + 0.002)
    raise AssertionError("A's probe of B did not end")


@pytest.mark.parametrize("relay", [False, True], ids=["no-relay", "relay-down"])
def test_a_restarted_peer_only_helpers_vouch_for_gets_a_verdict_none_not_unknown_forever(relay: bool):
    """A->B is dropped one way, and no relay carries it (none configured, or its relayed ping
    is lost too); B restarts.  Every probe of B's new process is answered only through a
    ping-req helper: that is a verdict (none), so the direction stops reading unknown, is
    reported in A's summary, and is given once.  Direct working again is news."""
    bench = Bench(3)
    if relay:
        with_relay(bench)
    a, b, c = bench.swims
    paths = PathTable()

    def drive(now: float) -> list[tuple[bytes | None, bool | None]]:
        moves = []
        for e in a.events():
            if e.kind is EventKind.RESTART:
                paths.restarted(e.node, e.at)
                a.probe_soon(e.node, e.at)
            elif e.kind is EventKind.PATH:
                moves.append((e.node, e.detail["direct"]))
                paths.probe_verdict(e.node, e.detail["direct"], e.at, "the relayed ping was answered")
        return moves

    bench.tell(a, b, restart(bench, b, 0.0), now=0.0)
    drive(0.0)
    assert paths.shown_path(b.id) == "unknown"
    now = helpers_only_probe(bench, a, b, c, 0.0)
    assert a.members[b.id].state.live
    assert drive(now) == [(b.id, None)], "only helpers vouched: the new process's first verdict"
    view = paths.view(b.id, now)
    assert (view["path_out"], view["last_failure"], paths.out_path(b.id)) == ("none", VOUCHED_ONLY, "none")
    (entry,) = [e for e in paths.summary(a.id, 1, [(b.id, None, None)], now).entries if e.peer == b.id]
    assert (entry.path, entry.reason) == ("none", VOUCHED_ONLY)
    now = helpers_only_probe(bench, a, b, c, now)
    assert drive(now) == [], "and then only changes"
    # The drop is lifted: B's direct answer moves the direction back to direct.
    t, (ping,) = bench.tick_until(a, Ping, to=b, limit=now + 30)
    for out in bench.hand(ping, t + 0.001):
        if found(out, Ack):
            bench.hand(out, t + 0.002)
    assert drive(t) == [(b.id, True)] and paths.shown_path(b.id) == "direct"


def test_a_peer_just_met_that_only_helpers_vouch_for_reads_none_as_a_restarted_one_does():
    """The same one-way drop to a member just met: not direct (as assumed until now), but none."""
    bench = Bench(3)
    a, b, c = bench.swims
    now = helpers_only_probe(bench, a, b, c, 0.0)
    assert path_moves(a) == [(b.id, None)]
    helpers_only_probe(bench, a, b, c, now)
    assert path_moves(a) == []


async def test_a_one_way_drop_to_a_restarted_peer_reads_unknown_then_relay_never_direct():
    """Our packets to stage-0 are dropped (a firewall), and stage-0 restarts at its address
    under its key.  Its new process is behind the same drop: from the moment we know of it
    until the first probe of it tells, the direction reads unknown (topology edge ``ok``
    null, no asymmetric pair: doctor says only that it is not probed yet), and then relay
    again, with the asymmetric pair back in doctor.  It never reads direct."""
    lines: list[str] = []
    ident = Identity.generate()
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            relay = Relay()
            host, port = await nursery.start(partial(serve_relay, relay=relay), "127.0.0.1", 0)
            opts = dict(profile="local", relay=f"ws://{host}:{port}", stages=1)
            orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
            stage_opts = NodeOptions(stage=0, seeds=[orch.addr], **opts)
            stage = await start_crashable(nursery, stage_opts, lines, ident)
            addr, node = stage.running.addr, ident.node_id
            orch.options.faults.drop_to.add(addr)  # from now on, as a firewall in front of stage-0

            def edge() -> dict:
                snap = orch.snapshot()
                topo = topology(snap)
                e = next(e for e in topo["edges"] if (e["from"], e["to"]) == (orch.core.id.hex(), node.hex()))
                return {"path": e["path"], "ok": e["ok"], "epoch": orch.core.members[node].meta.epoch,
                        "asymmetric": [p for p in problems(snap, topo) if p["kind"] == "asymmetric"]}

            await until(lambda: edge()["path"] == "relay", 20, "orchestrator->stage-0 on the relay")
            old_epoch = orch.core.members[node].meta.epoch

            await stage.crash()
            again = NodeOptions(stage=0, seeds=[orch.addr], bind=addr, **opts)
            back = await start_crashable(nursery, again, lines, ident)
            new_epoch = back.running.data.epoch
            assert new_epoch != old_epoch
            seen: list[dict] = []
            with trio.fail_after(30):
                while not seen or seen[-1]["path"] != "relay":
                    e = edge()
                    if e["epoch"] == new_epoch:
                        seen.append(e)
                    await trio.sleep(0.005)
            paths = [e["path"] for e in seen]
            assert "direct" not in paths, paths
            assert paths[0] == "unknown", "the direction to the new process starts unknown"
            assert all(e["ok"] is None and e["asymmetric"] == [] for e in seen if e["path"] == "unknown")
            view = next(m for m in orch.snapshot()["members"] if m["id"] == node.hex())
            assert (view["path_out"], view["direct_failures"]) == ("relay", 1)
            # Once stage-0's own summary says stage-0->orchestrator is direct, doctor names the pair.
            await until(lambda: edge()["asymmetric"], 20, "the asymmetric pair reported again")
            assert edge()["asymmetric"][0]["where"] == "orchestrator→stage-0"
            nursery.cancel_scope.cancel()
