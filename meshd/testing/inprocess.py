"""Several meshd nodes in one trio run, on loopback, for fast real-socket tests."""

from __future__ import annotations

import trio

from ..identity import Identity
from ..node import Node, NodeOptions


async def start_node(nursery: trio.Nursery, options: NodeOptions, lines: list[str]) -> Node:
    """Start a node in ``nursery``; its log lines go to ``lines``."""
    node = Node(Identity.generate(), options, out=lines.append)
    await nursery.start(node.serve)
    return node


async def wait_converged(nodes: list[Node], timeout: float = 20.0) -> None:
    """Until every node counts every node live; raises TooSlowError naming who lags."""
    try:
        with trio.fail_after(timeout):
            while not all(n.swim.live_count() == len(nodes) for n in nodes):
                await trio.sleep(0.05)
    except trio.TooSlowError:
        lagging = [f"{n.swim.me.name} sees {n.swim.live_count()}" for n in nodes
                   if n.swim.live_count() != len(nodes)]
        raise trio.TooSlowError(f"no convergence of {len(nodes)} nodes in {timeout:g}s: "
                                + ", ".join(lagging)) from None
