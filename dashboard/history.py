"""The node's last minutes, for the page's charts: a bounded ring of samples.

Every ``interval`` seconds one sample is taken from the node's snapshot (the
pipeline's readiness, and per directed edge of the topology its path and
round trip) and from its pipeline service's metrics (the orchestrator's tokens
per second and time to first token; a stage's compute steps per second and
their mean time).  The ring holds ``capacity`` samples, so a page opened now
draws the last ``capacity * interval`` seconds; the oldest sample goes first.

Rates are differences of the service's counters between two samples, on the
clock the caller passes in (``now``), so a test moves a number, not a clock.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from meshd.pipeline.metrics import OrchestratorMetrics, PipelineMetrics, StageMetrics

from . import views

log = logging.getLogger("meshd.dashboard")

INTERVAL_S = 2.0
CAPACITY = 300  # ten minutes at one sample every two seconds
MAX_EDGES = 48  # edges kept per sample: a big mesh's first ones in pipeline order


def edge_key(edge: dict) -> str:
    """An edge's key in a sample: ``FROMPREFIX>TOPREFIX`` (names repeat among replicas)."""
    return f"{edge['from'][:8]}>{edge['to'][:8]}"


def reading(inference: PipelineMetrics | None) -> dict[str, float] | None:
    """The service's counters a rate is taken from; None without a service."""
    if isinstance(inference, OrchestratorMetrics):
        running, waiting = inference.admitted()
        return {"tokens": float(inference.generation_tokens), "ttft_sum": inference.first_token.sum,
                "ttft_n": float(inference.first_token.count), "in_flight": float(inference.in_flight),
                "running": float(running), "waiting": float(waiting)}
    if isinstance(inference, StageMetrics):
        steps = list(inference.compute.values())
        return {"steps": float(sum(h.count for h in steps)), "step_sum": sum(h.sum for h in steps)}
    return None


def rates(now: dict[str, float] | None, before: dict[str, float] | None, dt: float) -> dict[str, Any]:
    """Per second and per event between two readings; None where nothing was measured."""
    out: dict[str, Any] = {"tokens_per_s": None, "ttft_ms": None, "in_flight": None, "running": None,
                           "waiting": None, "steps_per_s": None, "step_ms": None}
    if now is None:
        return out
    if "tokens" in now:  # what the orchestrator holds now: admitted and running, queued
        for gauge in ("in_flight", "running", "waiting"):
            out[gauge] = int(now[gauge])
    if before is None or before.keys() != now.keys() or dt <= 0:
        return out
    if "tokens" in now:
        out["tokens_per_s"] = round(max(0.0, now["tokens"] - before["tokens"]) / dt, 3)
        n = now["ttft_n"] - before["ttft_n"]
        if n > 0:
            out["ttft_ms"] = round((now["ttft_sum"] - before["ttft_sum"]) / n * 1000, 3)
    else:
        steps = now["steps"] - before["steps"]
        out["steps_per_s"] = round(max(0.0, steps) / dt, 3)
        if steps > 0:
            out["step_ms"] = round((now["step_sum"] - before["step_sum"]) / steps * 1000, 3)
    return out


class History:
    """The ring of samples; ``record`` adds one, ``since`` reads them back."""

    def __init__(self, capacity: int = CAPACITY, interval: float = INTERVAL_S) -> None:
        self.capacity = capacity
        self.interval = interval
        self.samples: deque[dict[str, Any]] = deque(maxlen=capacity)
        # Which ring the samples' seq numbers count in: a restarted node starts another.
        self.ring = secrets.token_hex(4)
        self._seq = 0
        self._last: tuple[float, dict[str, float] | None] | None = None  # (now, reading)

    def record(self, snap: dict, now: float, inference: PipelineMetrics | None = None) -> dict[str, Any]:
        """Take one sample of ``snap`` (and of ``inference``) at ``now`` (seconds, any origin)."""
        topo = views.topology(snap)
        ready = topo["readiness"]
        edges: dict[str, list] = {}
        nodes: dict[str, str] = {}
        for e in topo["edges"][:MAX_EDGES]:
            edges[edge_key(e)] = [e["path"], e["rtt_ms"]]
            nodes[e["from"][:8]], nodes[e["to"][:8]] = e["from_name"], e["to_name"]
        current = reading(inference)
        before_at, before = self._last if self._last is not None else (now, None)
        self._last = (now, current)
        self._seq += 1
        sample = {"seq": self._seq, "t": round(float(snap.get("time") or 0.0), 3),
                  "ready": bool(ready["ready"]), "why": (ready["why"] or [None])[0],
                  "edges": edges, "nodes": nodes, **rates(current, before, now - before_at)}
        self.samples.append(sample)
        return sample

    def since(self, seq: int = 0) -> list[dict[str, Any]]:
        """The samples after ``seq`` (all of them for 0), oldest first."""
        if seq <= 0:
            return list(self.samples)
        return [s for s in self.samples if s["seq"] > seq]

    def view(self, seq: int = 0) -> dict[str, Any]:
        """``GET /api/history``: the ring's shape and its samples after ``seq``."""
        return {"ring": self.ring, "interval_s": self.interval, "capacity": self.capacity,
                "samples": self.since(seq)}


async def serve_history(history: History, snapshot: Callable[[], dict],
                        inference: PipelineMetrics | None = None, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Sample ``snapshot()`` into ``history`` every ``history.interval`` seconds, the first at once."""
    task_status.started()
    while True:
        try:
            history.record(snapshot(), trio.current_time(), inference)
        except Exception:  # a bug here costs the charts a sample, never the node
            log.exception("dashboard history: a sample failed")
        await trio.sleep(history.interval)
