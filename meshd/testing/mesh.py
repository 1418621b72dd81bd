"""A small in-process mesh with a relay and a one-way drop, for dashboard tests."""

from __future__ import annotations

from functools import partial
from typing import Any

import trio

from ..net.faults import Faults
from ..node import NodeOptions
from ..relay.server import Relay, serve_relay
from .inprocess import Running, start_node, wait_converged


async def start_one_way_drop_mesh(nursery: trio.Nursery, lines: list[str], *,
                                  dashboard: str = "127.0.0.1:0") -> dict[str, Running]:
    """orchestrator, stage-0 and stage-1 with a relay; stage-1's direct packets to the
    orchestrator are lost (``drop:stage-1->orchestrator``).  Every node serves a dashboard."""
    relay = Relay()
    host, port = await nursery.start(partial(serve_relay, relay=relay), "127.0.0.1", 0)
    relay_url = f"ws://{host}:{port}"

    def options(**more: Any) -> NodeOptions:
        return NodeOptions(profile="local", relay=relay_url, stages=2, dashboard=dashboard, **more)

    orch = await start_node(nursery, options(role="orchestrator"), lines)
    s0 = await start_node(nursery, options(stage=0, seeds=[orch.addr]), lines)
    drop = Faults.parse([f"drop:{orch.addr}"])
    s1 = await start_node(nursery, options(stage=1, seeds=[s0.addr], faults=drop), lines)
    nodes = {"orchestrator": orch, "stage-0": s0, "stage-1": s1}
    await wait_converged(list(nodes.values()))
    return nodes


async def wait_asymmetric(node: Running, timeout: float = 30.0) -> dict:
    """Until ``node``'s topology shows an asymmetric pair and every pair reported; returns it."""
    from dashboard.views import topology

    with trio.fail_after(timeout):
        while True:
            topo = topology(node.snapshot())
            if topo["asymmetric"] and all(e["path"] != "unknown" for e in topo["edges"]):
                return topo
            await trio.sleep(0.1)
