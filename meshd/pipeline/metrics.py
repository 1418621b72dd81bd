"""Inference metrics a pipeline service keeps for ``GET /metrics``: counters and histograms that
the hot path adds to, read as metric families when scraped.

Names follow Prometheus's conventions (and vLLM's where it has one): base units
(seconds), one unit per metric name, ``_total`` on counters.  Everything here
is touched only from the service's trio thread, so nothing needs a lock; the
dashboard renders :meth:`families` into Prometheus text (``dashboard.metrics``).

Orchestrator: ``meshd_requests_total{outcome}`` (OUTCOMES), ``meshd_requests_in_flight``,
``meshd_requests_running``, ``meshd_requests_waiting``,
``meshd_prompt_tokens_total``, ``meshd_generation_tokens_total``, ``meshd_failovers_total``,
``meshd_time_to_first_token_seconds``, ``meshd_time_per_output_token_seconds``,
``meshd_e2e_request_latency_seconds``, ``meshd_request_queue_seconds``.  Stage:
``meshd_stage_compute_seconds{stage,phase}``, ``meshd_stage_batch_size{stage}``.
Both: ``meshd_hop_transit_seconds{hop,path}`` for the hops into the node, and
``meshd_messages_not_from_route_total``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import wraps
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import trio

from .api import Busy, NotReady
from .messages import Hop

# How a request ended (``meshd_requests_total{outcome}``): ``stop`` at the end-of-sequence token
# or a stop string, ``length`` at max_tokens, ``error`` when the pipeline failed it,
# ``cancelled`` when its caller went away (a client that disconnected), ``refused`` when it
# never started (the prompt does not fit the context, or a stage has no usable owner), ``busy``
# when every slot was taken and the queue full (a 503 with Retry-After).
OUTCOMES = ("stop", "length", "error", "cancelled", "refused", "busy")
# A stage's compute: ``prefill`` runs its layers over several rows (a prompt, or a failover's
# replay), ``decode`` over one row, ``head`` is the LM head and sampling (last stage, and stage
# 0 when the head is split between them).
PHASES = ("prefill", "decode", "head")

# Bucket upper bounds in seconds, for CPU inference: a decode step's compute of a small model
# takes well under a millisecond, a long prompt's prefill on a big one tens of seconds.
COMPUTE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TRANSIT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0)
FIRST_TOKEN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
PER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.25, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
QUEUE_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
MAX_HOPS = 256  # hop series a node keeps: a trace's hop names come from its peers

HELP = {
    "requests": "Generation requests by how they ended: stop (end-of-sequence token or a stop string), "
                "length (max_tokens), error (the pipeline failed it), cancelled (the caller went away), "
                "refused (never started: prompt too long, or a stage without a usable owner), busy (503: "
                "every slot taken and the queue full)",
    "in_flight": "Generation requests at the orchestrator now: running, or waiting in its queue",
    "running": "Requests admitted and running now (--max-running and the stages' KV budget cap them)",
    "waiting": "Requests waiting in the orchestrator's queue for a free slot now (--max-queued caps them)",
    "prompt_tokens": "Prompt tokens of the requests the orchestrator started",
    "generation_tokens": "Tokens generated for the orchestrator's requests, as they reach it (an "
                         "end-of-sequence token is not counted, as usage.completion_tokens)",
    "failovers": "Moves of a request to a replica of a stage after a node of its route failed",
    "first_token": "From a request's start at the orchestrator to its first token there "
                   "(orchestrator clock; failovers included)",
    "per_output_token": "Per request with two tokens or more: (end-to-end latency - time to first "
                        "token) / (tokens - 1), on the orchestrator's clock; a mean per request, as "
                        "tokens reach the orchestrator in batches",
    "e2e": "From a request's start at the orchestrator to its end there (orchestrator clock), "
           "for requests that ended with stop or length",
    "compute": "A stage's compute for one message, on its own clock: prefill and decode are its layers "
               "over several rows or one, head is the LM head and sampling",
    "stage_requests": "Requests whose KV cache this stage holds now",
    "kv": "Bytes of KV cache this stage holds now (--kv-budget-mb caps it)",
    "polled": "Seconds this stage's event loop spent polling its sockets, never sleeping, while a "
              "message was due (--poll-ms)",
    "batch": "Decode steps a stage ran as one forward pass (--max-batch caps it)",
    "room": "How long a request's start waited at this stage for its KV cache to fit the stage's "
            "--kv-budget-mb (a budget below the orchestrator's); only the starts that waited",
    "queued": "How long a request waited at the orchestrator for a free slot before it started "
              "(--max-running caps the requests running at once)",
    "transit": "Pipeline hops into this node: this node's wall clock on receipt minus the sender's when "
               "it sent (data channel, queueing and decoding included). Both ends share a clock on "
               "one host; across hosts the figure also holds their clock offset (negative ones count "
               "as 0), so compare it with the hosts' NTP offset",
    "not_from_route": "Pipeline messages about a running request that came from a node not serving "
                      "it (not on its route) and were ignored",
}


class Histogram:
    """Observations counted into fixed buckets, as a Prometheus histogram: ``bounds`` are the
    buckets' upper bounds (inclusive), one more bucket past the last takes the rest."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations at or below it)`` per bucket, the last bound infinite."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family as scraped: ``series`` pairs label values with a number (counter,
    gauge) or a :class:`Histogram`.  A counter's name ends in ``_total``."""

    name: str
    help: str
    kind: str  # "counter", "gauge" or "histogram"
    labels: tuple[str, ...]
    series: list[tuple[tuple[str, ...], Any]]


class PipelineMetrics:
    """What every pipeline service keeps: the transit times of the hops into it, and the
    messages it ignored because their sender does not serve their request."""

    def __init__(self) -> None:
        self.transit: dict[tuple[str, str], Histogram] = {}  # (hop name, path)
        self.not_from_route = 0

    def arrived(self, trace: tuple[Hop, ...]) -> None:
        """Count the transit that ends ``trace`` (just timed by ``meshd.pipeline.app.arrived``)."""
        if not trace or trace[-1].kind != "transit":
            return
        hop = trace[-1]
        hist = self.transit.get((hop.name, hop.path))
        if hist is None:
            if len(self.transit) >= MAX_HOPS:
                return
            hist = self.transit[(hop.name, hop.path)] = Histogram(TRANSIT_BUCKETS_S)
        hist.observe(hop.ms / 1000)

    def families(self) -> list[Family]:
        return [Family("meshd_hop_transit_seconds", HELP["transit"], "histogram", ("hop", "path"),
                       [(key, hist) for key, hist in self.transit.items()]),
                Family("meshd_messages_not_from_route_total", HELP["not_from_route"], "counter", (),
                       [((), self.not_from_route)])]


class StageMetrics(PipelineMetrics):
    """A stage's: its compute time per message, by phase."""

    def __init__(self, stage: str) -> None:
        super().__init__()
        self.stage = stage
        self.compute = {phase: Histogram(COMPUTE_BUCKETS_S) for phase in PHASES}
        self.batch = Histogram(BATCH_BUCKETS)
        self.room = Histogram(QUEUE_BUCKETS_S)
        # What the stage holds now: (requests, KV cache bytes), read at scrape time.
        self.holding: Callable[[], tuple[int, int]] = lambda: (0, 0)
        # The stage's load for its snapshot (``meshd doctor``): see ``StageService.load``.
        self.load: Callable[[], dict[str, int | float]] = lambda: {}
        self.polled: Callable[[], float] = lambda: 0.0  # seconds polled so far, read at scrape time

    def computed(self, phase: str, seconds: float) -> None:
        self.compute[phase].observe(seconds)

    def batched(self, size: int) -> None:
        self.batch.observe(size)

    def families(self) -> list[Family]:
        compute = Family("meshd_stage_compute_seconds", HELP["compute"], "histogram", ("stage", "phase"),
                         [((self.stage, phase), hist) for phase, hist in self.compute.items()])
        batch = Family("meshd_stage_batch_size", HELP["batch"], "histogram", ("stage",),
                       [((self.stage,), self.batch)])
        room = Family("meshd_stage_room_wait_seconds", HELP["room"], "histogram", ("stage",),
                      [((self.stage,), self.room)])
        requests, kv = self.holding()
        held = [Family("meshd_stage_requests", HELP["stage_requests"], "gauge", ("stage",),
                       [((self.stage,), requests)]),
                Family("meshd_stage_kv_cache_bytes", HELP["kv"], "gauge", ("stage",), [((self.stage,), kv)]),
                Family("meshd_stage_polled_seconds_total", HELP["polled"], "counter", ("stage",),
                       [((self.stage,), self.polled())])]
        return [compute, batch, room, *held, *super().families()]


class OrchestratorMetrics(PipelineMetrics):
    """The orchestrator's: requests, their tokens and latencies, failovers."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.in_flight = 0
        # Admitted and queued requests now: the orchestrator's admission says (``admitted``).
        self.admitted: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.failovers = 0
        self.first_token = Histogram(FIRST_TOKEN_BUCKETS_S)
        self.per_output_token = Histogram(PER_TOKEN_BUCKETS_S)
        self.e2e = Histogram(REQUEST_BUCKETS_S)
        self.queue = Histogram(QUEUE_BUCKETS_S)

    def queued(self, seconds: float) -> None:
        """A request admitted after ``seconds`` in the queue (0: at once)."""
        self.queue.observe(seconds)

    def finished(self, result: dict[str, Any]) -> None:
        """A request that ended with its tokens: ``result`` is what ``generate`` returns."""
        self.requests["length" if result["finish_reason"] == "length" else "stop"] += 1
        timings, n = result["timings"], len(result["tokens"])
        total, first = timings["total_s"], timings["first_token_s"]
        self.e2e.observe(total)
        if first is not None:
            self.first_token.observe(first)
            if n > 1:
                self.per_output_token.observe((total - first) / (n - 1))

    def failed(self, exc: BaseException) -> None:
        """A request that ended with ``exc`` instead."""
        if isinstance(exc, Busy):
            outcome = "busy"
        elif isinstance(exc, NotReady | ValueError):
            outcome = "refused"
        elif isinstance(exc, trio.BrokenResourceError) or not isinstance(exc, Exception):
            outcome = "cancelled"  # cancelled, or the caller's channel for its tokens closed
        else:
            outcome = "error"
        self.requests[outcome] += 1

    def families(self) -> list[Family]:
        running, waiting = self.admitted()
        return [
            Family("meshd_requests_total", HELP["requests"], "counter", ("outcome",),
                   [((outcome,), n) for outcome, n in self.requests.items()]),
            Family("meshd_requests_in_flight", HELP["in_flight"], "gauge", (), [((), self.in_flight)]),
            Family("meshd_requests_running", HELP["running"], "gauge", (), [((), running)]),
            Family("meshd_requests_waiting", HELP["waiting"], "gauge", (), [((), waiting)]),
            Family("meshd_prompt_tokens_total", HELP["prompt_tokens"], "counter", (),
                   [((), self.prompt_tokens)]),
            Family("meshd_generation_tokens_total", HELP["generation_tokens"], "counter", (),
                   [((), self.generation_tokens)]),
            Family("meshd_failovers_total", HELP["failovers"], "counter", (), [((), self.failovers)]),
            Family("meshd_time_to_first_token_seconds", HELP["first_token"], "histogram", (),
                   [((), self.first_token)]),
            Family("meshd_time_per_output_token_seconds", HELP["per_output_token"], "histogram", (),
                   [((), self.per_output_token)]),
            Family("meshd_e2e_request_latency_seconds", HELP["e2e"], "histogram", (), [((), self.e2e)]),
            Family("meshd_request_queue_seconds", HELP["queued"], "histogram", (), [((), self.queue)]),
            *super().families(),
        ]


class _Counted(Protocol):
    metrics: OrchestratorMetrics


P = ParamSpec("P")
S = TypeVar("S", bound=_Counted)


def measured(generate: Callable[Concatenate[S, P], Coroutine[Any, Any, dict]]
             ) -> Callable[Concatenate[S, P], Coroutine[Any, Any, dict]]:
    """``generate`` (an orchestrator's) counted in its ``metrics``: in flight while it runs,
    then how it ended."""

    @wraps(generate)
    async def counted(self: S, *args: P.args, **kwargs: P.kwargs) -> dict:
        metrics = self.metrics
        metrics.in_flight += 1
        try:
            result = await generate(self, *args, **kwargs)
        except BaseException as exc:
            metrics.failed(exc)
            raise
        finally:
            metrics.in_flight -= 1
        metrics.finished(result)
        return result

    return counted
