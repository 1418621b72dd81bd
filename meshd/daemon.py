"""The composition root: one ``meshd run`` is a mesh node and the services of its role.

This is the one module (besides the CLI) that knows both the mesh and the
services.  It loads the pipeline service for the node's role (when it has a
model) before the node serves and announces its names, so a stage whose name
resolves can serve; then it starts the node, the service and the dashboard.
``run_daemon`` owns the signals and the graceful leave.
"""

from __future__ import annotations

import gc
import logging
import signal
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio

from . import ctrl_c
from .identity import Identity
from .limits import raise_open_files_limit
from .node import Node, NodeOptions

if TYPE_CHECKING:
    from .pipeline.service import Orchestrator, StageService

log = logging.getLogger("meshd.daemon")


@dataclass
class Daemon:
    """A running node and its services."""

    node: Node
    app: StageService | Orchestrator | None = None  # when the node has a model
    dashboard_url: str | None = None
    dashboard_token: str | None = None  # asked for when the dashboard is bound beyond loopback


def _service(node: Node, options: NodeOptions) -> StageService | Orchestrator | None:
    """The pipeline service of this node's role, its model loaded; None without a model."""
    if options.model is None:
        return None
    from .pipeline.admission import Admission
    from .pipeline.service import Orchestrator, StageService

    budget = options.kv_budget_mb << 20
    if options.role == "orchestrator":
        return Orchestrator(node, options.model, options.stages or 1,
                            admission=Admission(options.max_running, options.max_queued, budget))
    assert options.stage is not None and options.stages is not None, "a stage knows its place"
    return StageService(node, options.model, options.stage, options.stages, options.max_batch, budget,
                        options.poll_ms / 1000)


async def serve_daemon(node: Node, *,
                       task_status: trio.TaskStatus[Daemon] = trio.TASK_STATUS_IGNORED) -> None:
    """Run ``node`` and the services of its role until cancelled; reports the :class:`Daemon`."""
    options, out = node.options, node.out
    daemon = Daemon(node, _service(node, options))  # the model loads before anything serves
    if daemon.app is not None:
        options.checkpoint = daemon.app.checkpoint  # gossiped: a replica must serve the same weights
    async with trio.open_nursery() as nursery:
        await nursery.start(node.serve)
        if daemon.app is not None:
            await nursery.start(daemon.app.serve)
        if options.dashboard is not None:
            from dashboard.app import dashboard_token, serve_dashboard

            daemon.dashboard_token = dashboard_token(options.dashboard)
            generator = daemon.app if options.role == "orchestrator" else None  # the generation API
            inference = daemon.app.metrics if daemon.app is not None else None  # for /metrics
            daemon.dashboard_url = await nursery.start(
                partial(serve_dashboard, inference=inference), node, options.dashboard, generator,
                daemon.dashboard_token)
            out(f"meshd dashboard url={daemon.dashboard_url}"
                + (f" token={daemon.dashboard_token}" if daemon.dashboard_token else ""))
        task_status.started(daemon)


# How long a stage leaving on a signal lets its running requests finish before it hands
# them over to replicas; a launcher's grace before SIGKILL should exceed it.
DRAIN_S = 5.0


async def drain(daemon: Daemon, timeout: float = DRAIN_S) -> None:
    """Before a stage leaves: no new requests, running ones finished or handed over."""
    from .pipeline.stage import StageService

    if isinstance(daemon.app, StageService):
        await daemon.app.drain(timeout)
        daemon.node.out(f"meshd drained handed_over={daemon.app.counters['handed_over']}")


def settle_heap() -> int:
    """Move the objects the process holds once it serves (every imported module's functions
    and classes, the compiled kernels' records) out of the garbage collector's sight: a full
    collection then walks only what serving allocates since.  Walking all of a stage's
    136 thousand objects took 65-69 ms, a pause of the whole pipeline every few thousand
    tokens.  Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def run_daemon(identity: Identity, options: NodeOptions) -> int:
    """``meshd run``: serve until SIGINT, SIGTERM or SIGHUP (see ``leave_signals``), then
    leave and exit 0."""
    with trio.open_signal_receiver(*ctrl_c.leave_signals()) as signals:
        ctrl_c.raise_if_lost()  # a Ctrl-C while the modules loaded: exit 130, nothing started
        raise_open_files_limit()
        node = Node(identity, options)
        await node.bind()  # fail here, with a plain error (BindError), before any task starts
        async with trio.open_nursery() as nursery:
            daemon: Daemon = await nursery.start(serve_daemon, node)
            log.debug("%d objects set aside from garbage collection", settle_heap())
            async for signum in signals:
                log.info("leaving (%s)", signal.Signals(signum).name)
                await drain(daemon)
                with trio.move_on_after(1.5):
                    await daemon.node.leave()
                nursery.cancel_scope.cancel()
                break
    return 0
