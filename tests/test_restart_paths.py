"""A peer's new process (a restart under its key) has no path verdict until a probe of it
gives one: the direction reads ``unknown``, never the old process's failures nor a direct
path nobody has tested.  In the SWIM core (its first verdict is reported even when direct
works), then over loopback with a one-way drop that outlives the restart."""

from __future__ import annotations

from functools import partial

import trio
from test_rejoin import start_crashable, until
from test_swim_units import Bench, found, restart

from dashboard.views import problems, topology
from meshd.identity import Identity
from meshd.node import NodeOptions
from meshd.relay.server import Relay, serve_relay
from meshd.swim import EventKind
from meshd.testing.inprocess import start_node
from meshd.wire import Ack, Ping


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
