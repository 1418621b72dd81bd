"""Several meshd nodes in one trio run, on loopback, for fast real-socket tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from ..daemon import Daemon, serve_daemon
from ..identity import Identity
from ..net.faults import Faults
from ..node import Node, NodeOptions
from ..relay.server import serve_relay


class Running:
    """A node and its services, started in a test's nursery: ``app``, ``dashboard_url`` and
    ``dashboard_token`` are the daemon's; every other attribute is the node's."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.node = daemon.node
        self.app: Any = daemon.app
        self.dashboard_url = daemon.dashboard_url
        self.dashboard_token = daemon.dashboard_token

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)


async def start_node(nursery: trio.Nursery, options: NodeOptions, lines: list[str],
                     identity: Identity | None = None) -> Running:
    """Start a node and its services in ``nursery``; its log lines go to ``lines``."""
    node = Node(identity or Identity.generate(), options, out=lines.append)
    return Running(await nursery.start(serve_daemon, node))


async def wait_converged(nodes: list[Running] | list[Node], timeout: float = 20.0) -> None:
    """Until every node counts every node live; raises TooSlowError naming who lags."""
    cores = [n.core for n in nodes]
    try:
        with trio.fail_after(timeout):
            while not all(c.live_count() == len(nodes) for c in cores):
                await trio.sleep(0.05)
    except trio.TooSlowError:
        lagging = [f"{c.me.name} sees {c.live_count()}" for c in cores if c.live_count() != len(nodes)]
        raise trio.TooSlowError(f"no convergence of {len(nodes)} nodes in {timeout:g}s: "
                                + ", ".join(lagging)) from None


async def start_killable(nursery: trio.Nursery, options: NodeOptions, lines: list[str],
                         identity: Identity | None = None) -> tuple[Running, trio.CancelScope]:
    """``start_node``, and the scope that stops it the way SIGKILL would: sockets closed at
    once, no leave said."""

    async def run(*, task_status: trio.TaskStatus[tuple[Running, trio.CancelScope]]) -> None:
        with trio.CancelScope() as scope:
            node = Node(identity or Identity.generate(), options, out=lines.append)
            async with trio.open_nursery() as inner:
                daemon = await inner.start(serve_daemon, node)
                task_status.started((Running(daemon), scope))

    return await nursery.start(run)


async def start_pipeline(nursery: trio.Nursery, model: str | Path, stages: int, lines: list[str],
                         feedback_drop: bool = False, stage_options: dict[int, dict[str, Any]] | None = None,
                         **options: Any) -> list[Running]:
    """A relay, an orchestrator and ``stages`` stages serving ``model``, converged and ready:
    [orchestrator, stage-0, ...].  ``feedback_drop``: the last stage's direct packets to
    stage 0 are lost, so the feedback edge takes the relay.  ``options`` go to every node's
    NodeOptions (``max_batch=1``, ``max_running=4``, ...), ``stage_options[k]`` to stage k's
    over them (``faults``: what stage k's transport does to what it sends)."""
    host, port = await nursery.start(serve_relay, "127.0.0.1", 0)
    opts: dict[str, Any] = dict(profile="local", relay=f"ws://{host}:{port}", stages=stages, model=str(model),
                                **options)
    orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
    nodes = [orch]
    for k in range(stages):
        mine = {"faults": Faults(), **opts, **(stage_options or {}).get(k, {})}
        if feedback_drop and k == stages - 1:
            mine["faults"] = Faults.parse([f"drop:{nodes[1].addr}"])  # last stage -> stage 0, direct lost
        nodes.append(await start_node(nursery, NodeOptions(stage=k, seeds=[orch.addr], **mine), lines))
    await wait_converged(nodes)
    await orch.app.wait_ready(10)
    return nodes
