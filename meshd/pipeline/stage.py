"""A stage: its layers of the model, a KV cache per request, and its place in each request's route.

Stage K holds layers split_layers(N)[K].  Stage 0 embeds; each stage runs its
layers and forwards the hidden state to the next node of the request's route
(the orchestrator picks one replica per stage when the request starts, and
every activation carries that route); the last stage samples, streams the
token to the orchestrator, and feeds it back to the route's stage 0 (the
autoregressive edge).  Each activation carries a trace: every stage's compute
time and every hop's transit time and path.

Churn: a stage drops the requests of an orchestrator that is gone; tells a
request's orchestrator at once when the next or previous node of its route
looks down (its stream ended and its port refused a dial), so the request
moves to a replica; and on SIGTERM drains: it withdraws its names, lets its
requests finish for a while, and hands over the rest.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import trio

from ..bounded import keep_newest
from ..mesh import Mesh
from ..wire import MAX_BATCH_ROWS, Message
from .admission import DEFAULT_KV_BUDGET_MB
from .api import PipelineError
from .app import PREFILL_ROWS, App, Undelivered, arrived, route_neighbours
from .checkpoint import LoadProgress, fingerprint
from .config import LlamaConfig
from .messages import (
    HANDED_OVER,
    HANDING_OVER,
    NO_ROOM,
    TOO_LARGE,
    UNDELIVERED,
    Activation,
    Batch,
    HeadInput,
    HeadPart,
    HeadParts,
    Hop,
    Release,
    Row,
    Sampling,
    StageError,
    Token,
)
from .metrics import StageMetrics
from .model import KVCache, StageModel, head_cut, prefill_chunks, split_layers
from .polling import Poller
from .sampling import Sampler, Shortlist, is_greedy, merge, shortlist

log = logging.getLogger("meshd.pipeline")

MAX_CACHED_REQUESTS = 64  # bounds what is kept of requests that ended or died (not their caches)
ENDED_KEPT = 4096  # ids of the requests that ended last, each a few dozen bytes
# A request without a message for this long lost its end (its Release): its cache goes.  The
# orchestrator fails a request after 30 s without a token and releases it; a request running
# anywhere on its route brings every stage a message per token.
JOB_IDLE_S = 120.0
# Decode steps of up to this many requests run as one forward pass (``--max-batch``): each
# weight is read once per batch, not once per request.  1 runs each step alone.
DEFAULT_MAX_BATCH = 16
# How long stage 0 holds a batch for the other running requests' steps (see ``_gather``):
# about a tenth of a batched step of the small preset on one core.
BATCH_GATHER_S = 0.005
# About how many steps stage 0 makes a batch of while more requests decode (see ``group_size``):
# measured on the small preset, 16 streams over 3 stages served 2.3-2.6x the monolithic
# single stream as two batches of 8 in flight against 1.9-2.3x as one batch of 16, and 4
# streams 1.0x as two batches of 2 against 1.2-1.4x as one of 4; 15 streams 870 tokens/s
# as batches of 7 and 8 against 834 as one of 15.
MIN_GROUP = 8
# Two groups go in flight as soon as each would hold this many steps (the rows the decode
# kernel multiplies at once, see ``kernels._dot_rows``), so 8 streams keep two stages busy
# rather than one: side by side, 8 streams 634 tokens/s as two batches of 4 against 518 as
# one of 8, and 16 streams alike (829 and 831) (medians of 4 runs, small preset, 3 stages
# on 2 cores).
SPLIT_GROUP = 4
# The LM head is cut between stage 0 and the last stage only when half of it outweighs the
# extra message that costs: on loopback a hop is about 0.3 ms, some 2-4 M multiply-adds of
# numpy.  The small preset's head (32000 x 288) is cut; the tiny one's (258 x 64) is not,
# and cutting it slowed `meshd smoke-run` from 64-89 to 48-64 tokens/s.
HEAD_SPLIT_MIN_MACS = 4_000_000
# Tokens streamed to the orchestrator gather for this long into one message (the first and
# last of a request go at once).  Each message wakes the orchestrator's process, and on a
# host with fewer cores than nodes a woken process can take the core of the stage that
# computes the next token: one message per token cost the pipeline about a tenth of its speed.
# The gathered tokens leave with the next token streamed, which is once its request's next
# step has left this stage: the orchestrator then runs while the later stages compute one at
# a time, not while stage 0 and the last stage compute the head together (see ``_stream``).
TOKEN_BATCH_S = 0.02
# A request whose next token is slow to come has its gathered tokens sent after this long.
TOKEN_BATCH_LATE_S = 0.05
TOKEN_BATCH_MAX = 32
POLL_MAX_REQUESTS = 1  # a stage polls for its next message while it serves this many or fewer
# One step in this many, the first always, carries its trace (a dozen hops: each stage's
# compute, each transit, the waits) from stage to stage and on to the orchestrator; the
# others carry only the transit they are on (each node's metrics count every transit), and
# a request's hop medians (``timings.hops``) are over the traced steps.  Each hop of a
# trace is encoded and decoded at every node it passes, on the cores the stages compute
# on: with every token traced, 16 streams over 3 stages on 2 cores made 927 tokens/s
# against 1024 with one in four (medians of 12 passes each, side by side).
TRACE_EVERY = 4
WATCH_S = 0.05  # how often the neighbours of running requests are looked at
ACTIVE_S = 2.0  # a request that moved within this long is running (draining waits for it)
# A request whose orchestrator the mesh has not told us of within this long is dropped: the
# sender of a request we hold is a member, and gossip names a new member within a few periods.
ORIGIN_UNKNOWN_S = 10.0
# A request that starts here while its KV cache does not fit beside the running ones' (this
# stage's --kv-budget-mb below the orchestrator's, which admits by its own) waits for one of
# them to end, up to this long: under the orchestrator's 30 s without a token, so the caller
# reads this stage's reason rather than a stall.
ROOM_WAIT_S = 25.0


class TooLargeHere(PipelineError):
    """A request that could never run at this stage: its KV cache is more than the whole budget."""


class NoRoomHere(PipelineError):
    """The KV budget here had no room for a request's start in time."""


class LostState(PipelineError):
    """A message of a request this stage holds no state for (it restarted, or dropped it)."""


@dataclass
class _Job:
    """One request at this stage."""

    req_id: str
    origin: bytes  # its orchestrator
    route: tuple[bytes, ...]
    cache: KVCache
    started: float  # trio time it started here (or its replay did)
    touched: float  # trio time of its last message
    sampler: Sampler | None = None
    reported: set[bytes] = field(default_factory=set)  # peers already reported down for it
    decoding: bool = False  # a decode step of it came here: its next ones come back
    origin_epoch: int | None = None  # the orchestrator's process that sent it, as our data channel knew it

    def follows(self, pos: int, rows: int = 1) -> bool:
        """Whether ``rows`` rows from ``pos`` on are the next its cache takes."""
        return pos == self.cache.length and pos + rows <= self.cache.max_seq


def splits_head(config: LlamaConfig, stages: int) -> bool:
    """With two stages or more, stage 0 and the last stage each compute half of the LM head's
    rows at once, and stage 0 samples (see ``StageService._share_heads``): the head is the
    biggest matmul of a decode step, and stage 0 would only wait for the token."""
    return stages >= 2 and config.vocab_size * config.hidden_size >= HEAD_SPLIT_MIN_MACS


def stage_share(config: LlamaConfig, stage: int, stages: int) -> tuple[range, bool, bool]:
    """What stage ``stage`` of ``stages`` loads: its layers, the embedding, the LM head."""
    layers = split_layers(config.num_hidden_layers, stages)[stage]
    embed = stage == 0
    head = stage == stages - 1 or (stage == 0 and splits_head(config, stages))
    return layers, embed, head


def group_size(decoding: int, stages: int, max_batch: int) -> tuple[int, int]:
    """How many of the ``decoding`` requests' steps stage 0 sends on as one batch: at least
    the first, at most the second.

    One batch holding every request keeps one stage busy at a time while the
    others wait for it.  So the requests split into groups of about MIN_GROUP
    (while one group's batch is at a later stage, the next one runs here), never
    more groups than stages: a weight pass shared by fewer rows costs more per
    token than the idle stages it fills.  Groups that cannot be equal differ by
    one (15 requests: 7 and 8), and a batch goes on once the smaller size is
    ready, so neither waits for a step that is not coming.  Two groups of
    SPLIT_GROUP already beat one of twice that: the kernel's cost per row
    hardly grows below its block of four rows, and the second group keeps a
    second stage busy.
    """
    groups = (decoding + MIN_GROUP // 2) // MIN_GROUP
    if decoding >= 2 * SPLIT_GROUP:
        groups = max(groups, 2)
    groups = max(1, min(stages, groups))
    least, most = decoding // groups, -(-decoding // groups)
    return max(1, min(max_batch, least)), max(1, min(max_batch, most))


class StageService(App):
    def __init__(self, mesh: Mesh, model_dir: str | Path, stage: int, stages: int,
                 max_batch: int = DEFAULT_MAX_BATCH, kv_budget: int = DEFAULT_KV_BUDGET_MB << 20,
                 poll_s: float = 0.0) -> None:
        super().__init__(mesh)
        self.stage, self.stages = stage, stages
        if not 1 <= max_batch <= MAX_BATCH_ROWS:  # a batch crosses a hop as one message
            raise ValueError(f"max_batch {max_batch} must be from 1 to {MAX_BATCH_ROWS}")
        self.max_batch = max_batch
        self.kv_budget = kv_budget
        self.name = f"stage-{stage}"
        config = LlamaConfig.load(model_dir)
        self.checkpoint = fingerprint(model_dir)
        self.layers, _, head = stage_share(config, stage, stages)
        self.last = stage == stages - 1
        self.split_head = splits_head(config, stages)
        what = f"{self.name} (layers {self.layers.start}..{self.layers.stop - 1})"
        self.model = StageModel.load(model_dir, self.layers, config=config, head=head,
                                     progress=LoadProgress(what, log.info))
        cut = head_cut(config.vocab_size)
        self.head_rows = slice(0, cut) if stage == 0 else slice(cut, config.vocab_size)
        self.eos = set(config.eos_token_ids)
        self.jobs: dict[str, _Job] = {}  # oldest first
        self._heads: dict[tuple[str, int], _HeadJoin] = {}  # at stage 0: (req_id, step) -> the two halves
        self._outbox: dict[bytes, list[Message]] = {}  # per orchestrator: tokens (and errors) not yet sent
        self._outbox_since: dict[bytes, float] = {}  # per orchestrator: when its outbox began (trio time)
        self._flush_timers: set[bytes] = set()  # orchestrators whose outbox a timer will send
        self.counters = {"activations": 0, "tokens": 0, "errors": 0, "dropped_orphans": 0,
                         "reported_down": 0, "handed_over": 0, "late_after_end": 0, "waited_for_room": 0}
        self.metrics = StageMetrics(self.name)
        self.metrics.holding = lambda: (len(self.jobs), self.kv_in_use())
        self.metrics.load = self.load
        self.poller = Poller(poll_s)  # off unless asked for (``meshd run`` asks: --poll-ms)
        self.metrics.polled = lambda: self.poller.polled_s
        self.draining = False
        self._lost: dict[str, None] = {}  # requests we said we have no state for (bounded)
        self._ended: dict[str, None] = {}  # requests that ended here (their last token, a Release)
        self._strangers: dict[bytes, None] = {}  # nodes said to send for requests they do not serve (bounded)
        # Decode steps and head inputs waiting for the next batch, in arrival order (FIFO:
        # the oldest go first, so none starves), and the event that wakes the batcher.
        self._ready: list[_Step] = []
        self._heads_ready: list[tuple[HeadInput, tuple[Hop, ...], float]] = []
        self._work = trio.Event()  # set when something is ready
        self._busy = False  # the batcher is running batches
        self._freed = trio.Event()  # set when a request ends here: room for one waiting to start
        self._for_room: deque[str] = deque()  # the starts waiting for room, oldest first

    def start_background(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._watch)
        nursery.start_soon(self.poller.run)
        if self.max_batch > 1:
            nursery.start_soon(self._batcher)

    def kv_in_use(self) -> int:
        """Bytes of KV cache held for the requests here."""
        return sum(job.cache.nbytes for job in self.jobs.values())

    def load(self) -> dict[str, int | float]:
        """What this stage holds now against its budget, and the starts waiting for room."""
        return {"requests": len(self.jobs), "kv_used_mb": round(self.kv_in_use() / 2**20, 1),
                "kv_budget_mb": round(self.kv_budget / 2**20, 1), "waiting_for_room": len(self._for_room)}

    def _start_cache(self, msg: Activation) -> tuple[int, int]:
        """(positions, bytes) of the KV cache a start of ``msg``'s request (position 0) takes here:
        the prompt (a replay's first ``prefill`` rows) and every token."""
        rows = len(msg.tokens) if msg.tokens else msg.rows
        need = min((msg.prefill or rows) + msg.sampling.max_tokens, self.model.config.max_position_embeddings)
        return need, self.model.cache_bytes(need)

    def _room(self, msg: Activation, size: int) -> tuple[bool, int]:
        """Whether ``size`` bytes for ``msg``'s request fit the budget beside the others' (its
        own earlier cache, which a start replaces, aside); and the bytes those others hold."""
        held = self.jobs.get(msg.req_id)
        used = self.kv_in_use() - (held.cache.nbytes if held is not None else 0)
        return used + size <= self.kv_budget, used

    def _no_room(self, msg: Activation, size: int, used: int, waited: float = 0.0) -> NoRoomHere:
        within = f" within {waited:.1f} s" if waited else ""
        return NoRoomHere(f"no room for request {msg.req_id}'s KV cache ({size / 2**20:.1f} MB){within}: "
                             f"{used / 2**20:.1f} of {self.kv_budget / 2**20:.0f} MB held by "
                             f"{len(self.jobs)} requests (--kv-budget-mb)")

    def _splits_head(self, s: Sampling) -> bool:
        """Whether this request's head is cut in two; not when every logit must travel
        (``want_logits``) or be sampled from (temperature without top-k)."""
        return self.split_head and not s.want_logits and (is_greedy(s.temperature, s.top_k) or s.top_k > 0)

    def _from_route(self, src: bytes, msg: Message) -> bool:
        """Whether ``src`` may send ``msg``: a request running here hears only from the nodes
        that serve it (its orchestrator, the stage before this one, and at stage 0 the last
        stage), so no other member can steer, reset or end it, as none can speak for another.
        A message about a request not running here goes on, and fails as it would."""
        job = self.jobs.get(getattr(msg, "req_id", ""))
        if job is None or src == self.mesh.node_id or src == job.origin:
            return True
        if src == job.route[self.stage - 1]:  # at stage 0: the last stage
            return True
        self.metrics.not_from_route += 1
        if src not in self._strangers:
            keep_newest(self._strangers, src, MAX_CACHED_REQUESTS)
            log.warning("%s: ignoring %s for request %s from %s, which does not serve it (its route: %s)",
                        self.name, type(msg).__name__, job.req_id, self.mesh.describe(src),
                        ", ".join(f"stage-{k} {node.hex()[:8]}" for k, node in enumerate(job.route)))
        return False

    async def on_message(self, src: bytes, msg: Message) -> None:
        if not self._from_route(src, msg):
            return
        req_id = getattr(msg, "req_id", None)
        if req_id in self.jobs and isinstance(msg, HeadInput | HeadPart):  # stage 0's head exchange
            self._due_soon()  # from its route (above); steps open the window once they follow
        if req_id in self._ended:
            if not (isinstance(msg, Activation) and msg.pos == 0):
                # A step that was on its way when the request ended (its client left, a stop
                # string): nothing is lost, and nobody waits for it.
                self.counters["late_after_end"] += 1
                return
            del self._ended[req_id]  # started again (a failover's replay)
        if isinstance(msg, Activation):
            await self._activation(msg)
        elif isinstance(msg, Token):  # the feedback edge, at stage 0
            job = self.jobs.get(msg.req_id)
            if job is None:
                raise LostState(f"has no KV cache for request {msg.req_id} at step "
                                f"{msg.step + 1} (did this stage restart?)")
            await self._activation(Activation(
                msg.req_id, msg.origin, msg.pos, msg.step + 1, 0, 0, b"", (msg.token,),
                msg.sampling, msg.sent_at, msg.trace, job.route,
            ))
        elif isinstance(msg, HeadInput):
            await self._head_input(msg)
        elif isinstance(msg, HeadPart):
            await self._head_part(msg)
        elif isinstance(msg, Release):
            job = self._end(msg.req_id)
            if job is not None and not self.last:
                await self.send(job.route[self.stage + 1], msg)

    async def on_rows(self, src: bytes, msg: Batch | HeadParts) -> None:
        rows: Sequence[Message] = msg.rows()
        if isinstance(msg, Batch) and not msg.head and self._batching():
            rows = self._queue_steps(src, msg, cast(list[Activation], rows))
        for row in rows:
            await self._on_message(src, row)

    def _queue_steps(self, src: bytes, batch: Batch, rows: list[Activation]) -> list[Activation]:
        """A batch of decode steps from ``src``, the stage before: each row that is the next
        step of a request running here goes to the batcher at once, as ``_activation`` would
        put it there, with one look at its request.  Returns the other rows (a request this
        stage does not hold or that ended, a step that does not follow its cache or comes from
        a node not on its route, an orchestrator gone), each for ``on_message``, which says
        why as it would for a message of its own."""
        now = trio.current_time()
        shared = arrived(batch.trace, batch.sent_at)
        hidden = np.frombuffer(batch.hidden, dtype=np.float32).reshape(len(rows), batch.dims)
        rest = []
        for i, msg in enumerate(rows):
            job = self.jobs.get(msg.req_id)
            if (job is None or not msg.pos or not job.follows(msg.pos) or src != job.route[self.stage - 1]
                    or msg.req_id in self._ended or msg.route != job.route or msg.origin != job.origin
                    or self._gone(msg.origin, job.started)):
                rest.append(msg)
                continue
            self.counters["activations"] += 1
            self.metrics.arrived(shared)
            job.touched, job.decoding = now, True
            self._ready.append(_Step(msg, job, hidden[i:i + 1], (*batch.prefixes[i], *shared), now))
        if len(rest) < len(rows):
            self._work.set()
            self._due_soon()
        return rest

    # --- the forward pass ---

    def _job(self, msg: Activation) -> _Job:
        """The request's state here: new at position 0 (a start, or a failover's replay)."""
        if len(msg.route) != self.stages or msg.route[self.stage] != self.mesh.node_id:
            raise PipelineError(f"request {msg.req_id} is routed through "
                                f"{len(msg.route)} stages, not through this node as {self.name}")
        job = self.jobs.get(msg.req_id)
        if msg.pos == 0:
            # A request that runs is never evicted: one that does not fit the budget waited for
            # room (``_when_room``) before it came here.
            need, size = self._start_cache(msg)
            fits, used = self._room(msg, size)
            if not fits:
                raise self._no_room(msg, size, used)
            self.jobs.pop(msg.req_id, None)
            now = trio.current_time()
            # Stage 0 has the step from the orchestrator itself, opened with that process's keys:
            # the epoch our channel holds is the sender's.  A later stage may not know a
            # restarted orchestrator's new process yet; stage 0 releases the request for it.
            origin_epoch = self.mesh.peer_epoch(msg.origin) if self.stage == 0 else None
            job = _Job(msg.req_id, msg.origin, msg.route, self.model.new_cache(need), now, now,
                       origin_epoch=origin_epoch)
            self.jobs[msg.req_id] = job
        elif job is None:
            raise LostState(f"has no KV cache for request {msg.req_id} at position "
                            f"{msg.pos} (did this stage restart?)")
        job.touched = trio.current_time()
        return job

    async def _forward(self, hidden: np.ndarray, job: _Job, pos: int, prefill: int) -> np.ndarray | None:
        """Our layers over ``hidden``: rows [0, prefill) as one pass, then each later row alone
        (a replay keeps the original run's shapes, so its numbers are the same bits).  None:
        the request ended while its prompt ran."""
        model, cache = self.model, job.cache
        if not 0 < prefill < hidden.shape[0]:
            if hidden.shape[0] > PREFILL_ROWS:
                return await self._prefill(hidden, job, pos)
            return model.forward(hidden, cache, pos)  # a decode step is shorter than a thread hand-off

        def replay() -> np.ndarray:
            outs = [model.forward(hidden[:prefill], cache, pos)]
            for i in range(prefill, hidden.shape[0]):
                outs.append(model.forward(np.array(hidden[i:i + 1]), cache, pos + i))
            return np.concatenate(outs)

        return await self._in_thread(replay)

    async def _in_thread(self, fn: Callable[..., np.ndarray], *args: Any) -> np.ndarray:
        """``fn(*args)`` in a worker thread, off the event loop; the loop does not poll meanwhile."""
        with self.poller.thread_running():
            out = await trio.to_thread.run_sync(fn, *args)
        self._due_soon()
        return out

    def _due_soon(self) -> None:
        """A request's next message here is due soon (one of its steps came, or its compute
        ended): poll for it while this stage serves at most POLL_MAX_REQUESTS, where each
        hop's wake-up is the request's latency.  With more, batches keep the stage busy, and
        polling would take turns from a neighbour sharing its CPU.  Only messages a running
        request's route sent, and that follow its state, call this: no other member can keep
        a stage spinning."""
        if 1 <= len(self.jobs) <= POLL_MAX_REQUESTS:
            self.poller.touch()
        else:
            self.poller.stop()

    async def _prefill(self, hidden: np.ndarray, job: _Job, pos: int) -> np.ndarray | None:
        """A prompt's rows, one chunk (``model.prefill_chunks``) at a time in a worker thread:
        off the event loop, so gossip keeps its timing and the decode passes of the requests
        in flight here go on meanwhile instead of waiting for the whole prompt.  A request
        that ended (released, or its orchestrator gone) stops at the next chunk, and once its
        last chunk is done nothing of it goes on: None."""
        outs = []
        for rows in prefill_chunks(hidden.shape[0]):
            if self.jobs.get(job.req_id) is not job:
                return None
            job.touched = trio.current_time()  # running: draining waits for it
            outs.append(await self._in_thread(self.model.forward, hidden[rows], job.cache, pos + rows.start))
        if self.jobs.get(job.req_id) is not job:  # released during the last chunk: nothing goes on
            return None
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    async def _activation(self, msg: Activation, trace: tuple[Hop, ...] | None = None) -> None:
        """One message's rows through our layers.  ``trace``: the message's, timed on arrival,
        when it comes back from waiting for room (``_when_room``)."""
        job = self.jobs.get(msg.req_id)
        if self._gone(msg.origin, job.started if job is not None and msg.pos else None):
            await self._drop_orphan(msg.req_id)
            return
        if trace is None:
            self.counters["activations"] += 1
            trace = arrived(msg.trace, msg.sent_at)
            self.metrics.arrived(trace)
            if msg.pos == 0 and not self._room(msg, size := self._start_cache(msg)[1])[0]:
                if size > self.kv_budget:  # it would never fit: no use waiting
                    raise TooLargeHere(f"request {msg.req_id}'s KV cache ({size / 2**20:.1f} MB) is more "
                                        f"than this stage's whole --kv-budget-mb "
                                        f"({self.kv_budget / 2**20:.1f} MB): ask for fewer tokens")
                self.counters["waited_for_room"] += 1
                assert self._nursery is not None  # messages arrive only while serve() runs
                self._nursery.start_soon(self._when_room, msg, trace)
                return
        model = self.model
        if msg.tokens:
            hidden = model.embed(list(msg.tokens))  # (T, D)
        else:
            hidden = np.frombuffer(msg.hidden, dtype=np.float32).reshape(msg.rows, msg.dims)
        job = self._job(msg)
        if msg.pos and not job.follows(msg.pos, hidden.shape[0]):
            # Rows of a request whose state here is not the one they follow (steps resent from
            # before a restart to the new process): the orchestrator replays it, as for a
            # request this stage does not hold, and the state here goes (nothing will extend it).
            # Rows past a cache they follow are a bad request.
            why = (f"request {msg.req_id} step {msg.step} at position {msg.pos} "
                   f"({hidden.shape[0]} rows) does not follow its cache ({job.cache.length} of "
                   f"{job.cache.max_seq} filled)")
            if msg.pos == job.cache.length:
                raise PipelineError(why)
            self._forget(msg.req_id)
            raise LostState(why)
        self._due_soon()  # a step that follows its request's state: the next is due soon
        if self._batching() and hidden.shape[0] == 1 and not msg.prefill:
            job.decoding = True
            self._ready.append(_Step(msg, job, hidden, trace, trio.current_time()))
            self._work.set()
            return
        t0 = time.perf_counter()
        out = await self._forward(hidden, job, msg.pos, msg.prefill)
        if out is None:
            return
        took = time.perf_counter() - t0
        self.metrics.computed("prefill" if hidden.shape[0] > 1 else "decode", took)
        if hidden.shape[0] == 1:
            self.metrics.batched(1)
        onward = (*trace, Hop("compute", self.name, took * 1000, "")) if _traced(msg.step) else ()
        await self._emit([_Computed(msg, job, out, onward)])

    async def _when_room(self, msg: Activation, trace: tuple[Hop, ...]) -> None:
        """Start ``msg``'s request once its KV cache fits beside the running ones' (a request
        here ends) and the starts that waited longer have gone, its wait a step of its trace;
        or fail it after ROOM_WAIT_S.  Nothing of it is held meanwhile, and a Release (its
        caller left) ends the wait."""
        t0 = trio.current_time()
        _, size = self._start_cache(msg)
        self._for_room.append(msg.req_id)
        try:
            while self._for_room[0] != msg.req_id or not self._room(msg, size)[0]:
                waited = trio.current_time() - t0
                if msg.req_id in self._ended or self._gone(msg.origin, t0):
                    return
                if waited >= ROOM_WAIT_S:
                    exc = self._no_room(msg, size, self._room(msg, size)[1], waited)
                    log.warning("%s: %s", self.name, exc)
                    await self.failed(msg, exc)
                    return
                with trio.move_on_after(ROOM_WAIT_S - waited):
                    await self._freed.wait()
        finally:
            self._for_room.remove(msg.req_id)
            self._wake_for_room()  # the next in line may fit now
        waited = trio.current_time() - t0
        self.metrics.room.observe(waited)
        wait = Hop("wait", f"{self.name} room", waited * 1000, "")
        await self._guarded(msg, self._activation(msg, (*trace, wait)))

    def _wake_for_room(self) -> None:
        self._freed.set()
        self._freed = trio.Event()

    def _decoding(self) -> int:
        return sum(job.decoding for job in self.jobs.values())

    def _batching(self) -> bool:
        """Whether a step goes to the batcher: not for a request alone here with nothing
        queued, which runs at once, as with ``--max-batch 1`` (no task switch on its way)."""
        queued = self._busy or bool(self._ready or self._heads_ready)
        return self.max_batch > 1 and (len(self.jobs) > 1 or queued)

    async def _batcher(self) -> None:
        """Run what is ready as batches: the head inputs first (a token waits on them), then
        up to ``max_batch`` decode steps as one forward pass.  A request joins the next batch
        as soon as its step is here and leaves when it ends; the oldest go first, so none
        starves.  What reaches a stage in one message (a batch from the stage before) is
        ready at once; stage 0, where each step starts, gathers the batch (``_gather``), a
        group of the requests decoding there (``group_size``)."""
        while True:
            await self._work.wait()
            self._work = trio.Event()
            self._busy = True
            try:
                await self._run_ready()
            finally:
                self._busy = False

    async def _run_ready(self) -> None:
        while self._heads_ready or self._ready:
            if self._heads_ready:
                heads, self._heads_ready = self._heads_ready, []
                await self._head_inputs(heads)
                continue
            size = self.max_batch
            if self.stage == 0:
                least, size = group_size(self._decoding(), self.stages, self.max_batch)
                await self._gather(least)
                if self._heads_ready:
                    continue
            batch, self._ready = self._ready[:size], self._ready[size:]
            await self._decode(batch)

    async def _gather(self, size: int) -> None:
        """At stage 0: wait up to BATCH_GATHER_S for ``size`` steps (a group of the requests
        decoding here, see ``group_size``; one still in its prefill does not count), so
        requests that came back at different times go on as one batch.  Once together they
        come back together: the wait is paid once, and a request alone never waits."""
        with trio.move_on_after(BATCH_GATHER_S):
            while len(self._ready) < size and not self._heads_ready:
                await self._work.wait()
                self._work = trio.Event()

    async def _decode(self, batch: list[_Step]) -> None:
        """One decode step of every request in ``batch`` as one forward pass."""
        now = trio.current_time()
        batch = [b for b in batch if self.jobs.get(b.msg.req_id) is b.job]  # released meanwhile: dropped
        if not batch:
            return
        hidden = np.concatenate([b.hidden for b in batch])
        parts = [(b.job.cache, b.msg.pos) for b in batch]
        t0 = time.perf_counter()
        try:
            if len(batch) > PREFILL_ROWS:  # off the event loop, so gossip keeps its timing
                out = await self._in_thread(self.model.forward_batch, hidden, parts)
            else:
                out = self.model.forward_batch(hidden, parts)
        except Exception as exc:  # one request's bad state must not take the others' steps
            log.exception("%s: a batch of %d steps failed", self.name, len(batch))
            for b in batch:
                await self.failed(b.msg, exc)
            return
        took = time.perf_counter() - t0
        self.metrics.computed("decode", took)
        self.metrics.batched(len(batch))
        compute = Hop("compute", self.name, took * 1000, "")
        done = []
        for i, b in enumerate(batch):
            waited = (now - b.queued) * 1000
            wait = (Hop("wait", f"{self.name} batch", waited, ""),) if waited >= 1 else ()
            onward = (*b.trace, *wait, compute) if _traced(b.msg.step) else ()
            done.append(_Computed(b.msg, b.job, out[i:i + 1], onward))
        await self._emit(done)

    async def _emit(self, steps: list[_Computed]) -> None:
        """Pass computed steps on: each activation to the next stage, or, at the last stage,
        the head (cut with stage 0, or whole here) and its token.  What goes to one node
        goes as one message."""
        if self.last:
            cut = [st for st in steps if self._splits_head(st.msg.sampling)]
            whole = [st for st in steps if not self._splits_head(st.msg.sampling)]
            if cut:
                await self._share_heads(cut)
            if whole:
                await self._whole_heads(whole)
            return
        out: dict[bytes, list[_Computed]] = {}
        for st in steps:
            out.setdefault(st.job.route[self.stage + 1], []).append(st)
        now = time.time()
        for dst, group in out.items():
            hop = Hop("transit", f"{self.name}->stage-{self.stage + 1}", 0.0, self.path_to(dst))
            if len(group) > 1 and all(st.out.shape[0] == 1 and not st.msg.prefill for st in group):
                await self.send(dst, Batch.of(False, [_row(st) for st in group], _rows_bytes(group),
                                              group[0].out.shape[1], now, hop))
                continue
            await self.send(dst, *[Activation(
                st.msg.req_id, st.msg.origin, st.msg.pos, st.msg.step, st.out.shape[0], st.out.shape[1],
                np.ascontiguousarray(st.out, dtype=np.float32).tobytes(), (), st.msg.sampling, now,
                (*st.trace, hop), st.job.route, st.msg.prefill,
            ) for st in group])

    async def _whole_heads(self, steps: list[_Computed]) -> None:
        """At the last stage: the whole head over the steps' last rows at once, a token each."""
        t0 = time.perf_counter()
        logits_all = self.model.logits(np.concatenate([st.out[-1:] for st in steps]))
        tokens = []
        for st, logits in zip(steps, logits_all, strict=True):
            tokens.append(self._sampler(st.job, st.msg.sampling, st.msg.step)(logits))
        self.metrics.computed("head", time.perf_counter() - t0)
        feedback: dict[bytes, list[Message]] = {}
        streamed = []
        for st, logits, token in zip(steps, logits_all, tokens, strict=True):
            msg, job, s = st.msg, st.job, st.msg.sampling
            pos = msg.pos + st.out.shape[0]
            done = self._done(token, msg.step, s)
            self.counters["tokens"] += 1
            entry = job.route[0]
            if not done:
                hop = Hop("transit", f"{self.name}->stage-0", 0.0, self.path_to(entry))
                feedback.setdefault(entry, []).append(
                    Token(msg.req_id, msg.origin, msg.step, token, pos, "", b"", s, time.time(), (hop,)))
            else:
                self._end(msg.req_id)
                if self.stages > 1:
                    feedback.setdefault(entry, []).append(Release(msg.req_id))
            raw = logits.astype(np.float32).tobytes() if s.want_logits else b""
            streamed.append(Token(msg.req_id, msg.origin, msg.step, token, pos, done, raw, s, time.time(),
                                  (*st.trace, Hop("transit", f"{self.name}->orchestrator", 0.0,
                                                  self.path_to(msg.origin)))))
        # The feedback edge first: it is on the critical path of the next tokens.
        for dst, msgs in feedback.items():
            await self.send(dst, *msgs)
        for token_msg in streamed:
            await self._stream(token_msg)

    # --- tokens to the orchestrator ---

    async def _stream(self, token: Token) -> None:
        """Stream ``token`` to its orchestrator: a request's first and last token at once, the
        rest gathered into one message (see TOKEN_BATCH_S).  Called once the request's next
        step has left: what has gathered for TOKEN_BATCH_S leaves now, with this token, and
        a timer sends what waits TOKEN_BATCH_LATE_S for a token to come.

        ``token.sent_at`` is when it joined the outbox; its trace ends with the transit to
        the orchestrator, still to be timed."""
        origin = token.origin
        pending = self._outbox.setdefault(origin, [])
        pending.append(token)
        since = self._outbox_since.setdefault(origin, trio.current_time())
        if (token.step == 0 or token.done or token.logits or len(pending) >= TOKEN_BATCH_MAX
                or trio.current_time() - since >= TOKEN_BATCH_S):
            await self._flush(origin)
        elif origin not in self._flush_timers:
            self._flush_timers.add(origin)
            assert self._nursery is not None
            self._nursery.start_soon(self._flush_late, origin)

    async def _flush_late(self, origin: bytes) -> None:
        """Send ``origin``'s outbox once its oldest message has waited TOKEN_BATCH_LATE_S;
        one such timer per orchestrator, until its outbox is empty."""
        try:
            while (since := self._outbox_since.get(origin)) is not None:
                await trio.sleep_until(since + TOKEN_BATCH_LATE_S)
                if self._outbox_since.get(origin) == since:
                    await self._flush(origin)
        finally:
            self._flush_timers.discard(origin)

    async def _flush(self, origin: bytes) -> None:
        """Send the outbox of ``origin``, in order, as one message."""
        self._outbox_since.pop(origin, None)
        pending = self._outbox.pop(origin, [])
        if not pending:
            return
        now = time.time()
        batch = [self._leaving(m, now) if isinstance(m, Token) else m for m in pending]
        try:
            await self.send(origin, *batch)  # what is not delivered fails through ``failed``
        except Exception as exc:  # a message that cannot even be encoded: say so, and go on
            log.warning("%s: could not send %d messages to the orchestrator: %s", self.name, len(batch), exc)

    def _leaving(self, token: Token, now: float) -> Token:
        """``token`` as it leaves the outbox: its wait there is a step of its own, and its
        transit to the orchestrator is timed from now.  Only one step in TRACE_EVERY keeps its
        whole trace; for the others that transit is all of the trace that goes."""
        if not _traced(token.step):  # the transit alone: the orchestrator's metrics count it
            return replace(token, sent_at=now, trace=token.trace[-1:])
        wait = Hop("wait", f"{self.name} outbox", max(0.0, (now - token.sent_at) * 1000), "")
        return replace(token, sent_at=now, trace=(*token.trace[:-1], wait, token.trace[-1]))

    def _sampler(self, job: _Job, s: Sampling, step: int) -> Sampler:
        """The request's sampler, made at its first sample here: step 0 for a new request,
        the token count for a replay, whose sampler skips the draws already made."""
        if job.sampler is None:
            job.sampler = Sampler(s.temperature, s.top_k, s.seed, s.top_p).skip(step)
        return job.sampler

    def _done(self, token: int, step: int, s: Sampling) -> str:
        """Why generation ends with this token ("eos", "length"), or "" while it goes on."""
        return "eos" if token in self.eos else ("length" if step + 1 >= s.max_tokens else "")

    def _forget(self, req_id: str) -> _Job | None:
        for key in [k for k in self._heads if k[0] == req_id]:
            del self._heads[key]
        job = self.jobs.pop(req_id, None)
        self._wake_for_room()  # and one whose Release this is ends its wait
        if not self.jobs:
            self.poller.stop()  # nothing is due
        return job

    def _end(self, req_id: str) -> _Job | None:
        """Forget a request that ended, and keep its id a while: a step of it still on its
        way (sent before the end was known) is then dropped quietly, not taken for lost state."""
        keep_newest(self._ended, req_id, ENDED_KEPT)
        return self._forget(req_id)

    async def _drop_orphan(self, req_id: str) -> None:
        """Forget a request whose orchestrator is gone: nobody would read what we compute.
        The later stages end it too, as at its end: one may not know yet that the orchestrator
        is gone (one restarted under its key is never declared dead)."""
        job = self._forget(req_id)
        self.counters["dropped_orphans"] += 1
        if job is not None and not self.last:
            await self.send(job.route[self.stage + 1], Release(req_id))

    # --- the LM head in two halves: the last stage and stage 0 ---

    async def _share_heads(self, steps: list[_Computed]) -> None:
        """At the last stage: stage 0 gets the normalised hidden states first, and computes its
        rows while we compute ours; then it gets our shortlists, and samples."""
        normed = self.model.final_norm(np.concatenate([st.out[-1:] for st in steps]))
        inputs: dict[bytes, list[int]] = {}  # per stage 0: the rows of ``steps`` it gets
        for i, st in enumerate(steps):
            inputs.setdefault(st.job.route[0], []).append(i)
        now = time.time()
        for dst, rows in inputs.items():
            hop = Hop("transit", f"{self.name}->stage-0", 0.0, self.path_to(dst))
            if len(rows) > 1:
                hidden = np.ascontiguousarray(normed[rows], dtype="<f4").tobytes()
                await self.send(dst, Batch.of(True, [_row(steps[i], head=True) for i in rows], hidden,
                                              normed.shape[1], now, hop))
                continue
            req_id, origin, pos, step, sampling, _, trace = _row(steps[rows[0]], head=True)
            await self.send(dst, HeadInput(req_id, origin, step, pos,
                                           np.ascontiguousarray(normed[rows[0]], dtype="<f4").tobytes(),
                                           sampling, now, (*trace, hop)))
        t0 = time.perf_counter()
        logits_all = self.model.head_logits(normed, self.head_rows)
        picks = [shortlist(logits, st.msg.sampling.temperature, st.msg.sampling.top_k, self.head_rows.start)
                 for st, logits in zip(steps, logits_all, strict=True)]
        took = time.perf_counter() - t0
        self.metrics.computed("head", took)
        for dst, rows in inputs.items():  # each stage 0 its rows' shortlists, as it got their inputs
            parts = [HeadPart(steps[i].msg.req_id, steps[i].msg.origin, steps[i].msg.step,
                              picks[i][0].astype("<i8").tobytes(), picks[i][1].astype("<f4").tobytes(),
                              took * 1000) for i in rows]
            await self.send(dst, HeadParts.of(parts) if len(parts) > 1 else parts[0])

    def _join(self, req_id: str, step: int) -> _HeadJoin:
        join = self._heads.get((req_id, step))
        if join is None:
            join = self._heads[(req_id, step)] = _HeadJoin()
            while len(self._heads) > len(self.jobs) + MAX_CACHED_REQUESTS:  # of requests that died midway
                self._heads.pop(next(iter(self._heads)))
        return join

    async def _head_input(self, msg: HeadInput) -> None:
        """At stage 0: our rows of the head for this step (with the batch, when batching)."""
        dims = self.model.config.hidden_size
        if len(msg.hidden) != 4 * dims:
            raise PipelineError(f"head input of {len(msg.hidden)} bytes, expected {4 * dims}")
        trace = arrived(msg.trace, msg.sent_at)
        self.metrics.arrived(trace)
        if self._batching():
            self._heads_ready.append((msg, trace, trio.current_time()))
            self._work.set()
            return
        await self._head_inputs([(msg, trace, trio.current_time())])

    async def _head_inputs(self, inputs: list[tuple[HeadInput, tuple[Hop, ...], float]]) -> None:
        """At stage 0: our rows of the head for these steps, one matrix product.

        On the event loop, though the last stage's part then waits to be read until ours
        is done: in a worker thread the hand-off and the GIL cost more than the overlap
        saves (docs/performance.md, "Where a single stream's token goes")."""
        dims = self.model.config.hidden_size
        t0 = time.perf_counter()
        normed = np.stack([np.frombuffer(msg.hidden, dtype="<f4") for msg, _, _ in inputs]).reshape(-1, dims)
        logits_all = self.model.head_logits(normed, self.head_rows)
        mine = [shortlist(logits, msg.sampling.temperature, msg.sampling.top_k)
                for (msg, _, _), logits in zip(inputs, logits_all, strict=True)]
        ms = (time.perf_counter() - t0) * 1000
        for (msg, trace, _), pick in zip(inputs, mine, strict=True):
            join = self._join(msg.req_id, msg.step)
            join.input, join.trace = msg, trace
            join.mine, join.mine_ms = pick, ms
            if join.theirs is not None:
                await self._sample_or_fail(msg)

    async def _sample_or_fail(self, msg: HeadInput | HeadPart) -> None:
        """``_sample``, failing only this request if it cannot: a batch carries others."""
        try:
            await self._sample(msg.req_id, msg.step)
        except Exception as exc:
            if not isinstance(exc, PipelineError):
                log.exception("%s: sampling %s step %d failed", self.name, msg.req_id, msg.step)
            await self.failed(msg, exc)

    async def _head_part(self, msg: HeadPart) -> None:
        """At stage 0: the last stage's shortlist for this step."""
        join = self._join(msg.req_id, msg.step)
        join.theirs = _their_shortlist(msg, self.head_rows.stop, self.model.config.vocab_size)
        join.their_ms = msg.ms
        if join.input is not None:
            await self._sample(msg.req_id, msg.step)

    async def _sample(self, req_id: str, step: int) -> None:
        join = self._heads.pop((req_id, step))
        msg = join.input
        assert msg is not None and join.mine is not None and join.theirs is not None
        job = self.jobs.get(req_id)
        if job is None:
            raise LostState(f"has no state for request {req_id} at step {step}")
        s = msg.sampling
        t0 = time.perf_counter()
        token = self._sampler(job, s, step).choose(merge([join.mine, join.theirs], s.top_k))
        done = self._done(token, step, s)
        self.counters["tokens"] += 1
        head_ms = join.mine_ms + (time.perf_counter() - t0) * 1000
        self.metrics.computed("head", head_ms / 1000)
        trace = (*join.trace,
                 Hop("compute", f"{self.name} head", head_ms, ""),
                 Hop("compute", f"stage-{self.stages - 1} head", join.their_ms, "")) if _traced(step) else ()
        if done:
            self._end(req_id)
            await self.send(job.route[self.stage + 1], Release(req_id))
        else:
            # The next step first: it is the critical path; the orchestrator's copy after.
            await self._activation(Activation(req_id, msg.origin, msg.pos, step + 1, 0, 0, b"", (token,), s,
                                              0.0, (), job.route))
        hop = Hop("transit", f"{self.name}->orchestrator", 0.0, self.path_to(msg.origin))
        await self._stream(Token(req_id, msg.origin, step, token, msg.pos, done, b"", s, time.time(),
                                 (*trace, hop)))

    # --- failures, churn and draining ---

    async def failed(self, msg: Message, exc: Exception, peer: bytes = b"") -> None:
        self.counters["errors"] += 1
        req_id = getattr(msg, "req_id", "")
        job = self.jobs.get(req_id)
        origin = getattr(msg, "origin", None) or (job.origin if job is not None else None)
        if origin is None or origin == peer or self._gone(origin, job.started if job is not None else None):
            return  # a Release, or the orchestrator is what failed or is gone: nobody to tell
        text = str(exc) if isinstance(exc, PipelineError) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, LostState):
            if req_id in self._lost:
                return  # said once: every later step of it fails the same way
            keep_newest(self._lost, req_id, MAX_CACHED_REQUESTS)
            peer = self.mesh.node_id  # we lost it: the orchestrator replays it, here or on a replica
        kind = (TOO_LARGE if isinstance(exc, TooLargeHere) else NO_ROOM if isinstance(exc, NoRoomHere)
                else UNDELIVERED if isinstance(exc, Undelivered) and peer else "")
        await self._tell(origin, StageError(req_id, self.name, text[:500], peer, kind))

    async def _tell(self, origin: bytes, error: StageError) -> None:
        # Behind the tokens waiting in the outbox: the orchestrator stops listening to a
        # request at its error, and every token before the error belongs to its stream.
        self._outbox.setdefault(origin, []).append(error)
        await self._flush(origin)

    async def _watch(self) -> None:
        """Drop the requests of a gone orchestrator; report a request's down neighbours."""
        while True:
            await trio.sleep(WATCH_S)
            now = trio.current_time()
            for req_id, job in list(self.jobs.items()):
                orphan = self._gone(job.origin, job.started)
                if not orphan and self._replaced(job):
                    log.info("%s: dropping request %s: %s runs as a new process, which never knew it",
                             self.name, req_id, self.mesh.describe(job.origin))
                    orphan = True
                if orphan:
                    await self._drop_orphan(req_id)
                    continue
                if now - job.touched > JOB_IDLE_S:  # its end (a Release) never came
                    log.info("%s: dropping request %s, idle for %.0f s", self.name, req_id, now - job.touched)
                    await self._drop_orphan(req_id)
                    continue
                for peer in self._neighbours(job):
                    if peer not in job.reported and self.mesh.peer_down(peer):
                        job.reported.add(peer)
                        self.counters["reported_down"] += 1
                        await self._tell(job.origin, StageError(
                            req_id, self.name, f"{self.mesh.describe(peer)} is down: its data stream ended "
                            "and its port refused a dial", peer))

    def _gone(self, node: bytes, since: float | None) -> bool:
        """Whether ``node`` (an orchestrator) died, left or looks down since ``since`` (when a
        request of it started here; None for a request starting now), or stayed unknown for
        ORIGIN_UNKNOWN_S after it.

        A request is its orchestrator's word that it lived when it sent it: a mark from
        before the request started (dead, down) is about an older process.  A restarted
        orchestrator's new requests can reach us before the mesh tells us it is back, and a
        new one's before the mesh tells us of it at all."""
        if since is None:
            return False
        m = self.mesh.member_by_id(node)
        if m is None:
            return trio.current_time() - since > ORIGIN_UNKNOWN_S
        if not m.live and m.changed >= since:
            return True
        down = self.mesh.down_since(node)
        return down is not None and down >= since

    def _replaced(self, job: _Job) -> bool:
        """Whether ``job``'s orchestrator runs as another process now (restarted under its key
        faster than failure detection declares it dead): the new one never knew the job.
        Known at stage 0 only (``origin_epoch``), which then releases the job downstream."""
        now = self.mesh.peer_epoch(job.origin)
        return job.origin_epoch is not None and now is not None and now != job.origin_epoch

    def _neighbours(self, job: _Job) -> set[bytes]:
        """The nodes this stage exchanges the request's messages with."""
        out = route_neighbours(job.route, self.stage)
        out.discard(self.mesh.node_id)
        return out

    def active(self) -> list[str]:
        """Requests that moved within ACTIVE_S: the ones a drain waits for."""
        now = trio.current_time()
        return [r for r, job in self.jobs.items() if now - job.touched < ACTIVE_S]

    async def drain(self, timeout: float) -> None:
        """Leave gracefully: withdraw our names (new requests go to the replicas), let running
        requests finish for up to ``timeout`` seconds, then hand the rest over to replicas."""
        self.draining = True
        self.mesh.set_draining()
        log.info("%s draining: %d requests running", self.name, len(self.active()))
        with trio.move_on_after(timeout):
            while self.active():
                await trio.sleep(0.05)
        for req_id in self.active():
            job = self.jobs[req_id]
            self.counters["handed_over"] += 1
            await self._tell(job.origin, StageError(req_id, self.name, HANDING_OVER, self.mesh.node_id,
                                                      HANDED_OVER))
        await trio.sleep(0.2)  # the hand-over notes reach their orchestrators


@dataclass
class _Step:
    """A decode step waiting for the next batch."""

    msg: Activation
    job: _Job
    hidden: np.ndarray  # (1, D)
    trace: tuple[Hop, ...]
    queued: float  # trio time


@dataclass
class _Computed:
    """A step through this stage's layers: ``out`` is every row it ran, (T, D); ``trace``
    what of its trace goes on (nothing for a step that carries only its next transit)."""

    msg: Activation
    job: _Job
    out: np.ndarray
    trace: tuple[Hop, ...]


def _traced(step: int) -> bool:
    """Whether step ``step`` carries its whole trace on (see TRACE_EVERY)."""
    return step % TRACE_EVERY == 0


def _row(st: _Computed, head: bool = False) -> Row:
    """``st`` as a row of a Batch (see ``Batch.of``); for a head input, its position is
    where the sampled token goes."""
    msg = st.msg
    return (msg.req_id, msg.origin, msg.pos + st.out.shape[0] if head else msg.pos, msg.step, msg.sampling,
            st.job.route, st.trace)


def _rows_bytes(steps: list[_Computed]) -> bytes:
    """The one-row outputs of ``steps`` as one (rows, dims) float32 block, C order."""
    return np.ascontiguousarray(np.concatenate([st.out for st in steps]), dtype=np.float32).tobytes()


@dataclass
class _HeadJoin:
    """Stage 0's two halves of one step's LM head, whichever comes first."""

    input: HeadInput | None = None
    trace: tuple[Hop, ...] = ()
    mine: Shortlist | None = None
    mine_ms: float = 0.0
    theirs: Shortlist | None = None
    their_ms: float = 0.0


def _their_shortlist(msg: HeadPart, low: int, vocab: int) -> Shortlist:
    """The last stage's shortlist, checked: ids ascending within its rows [low, vocab)."""
    if len(msg.ids) % 8 or len(msg.values) != len(msg.ids) // 2 or not msg.ids:
        raise PipelineError(f"head part for {msg.req_id} step {msg.step}: {len(msg.ids)} bytes of ids "
                            f"and {len(msg.values)} of values do not pair up")
    ids = np.frombuffer(msg.ids, dtype="<i8").astype(np.int64)
    values = np.frombuffer(msg.values, dtype="<f4").astype(np.float32)
    if ids[0] < low or ids[-1] >= vocab or (ids.size > 1 and np.any(np.diff(ids) <= 0)):
        raise PipelineError(f"head part for {msg.req_id} step {msg.step}: ids outside {low}..{vocab - 1} "
                            f"or not ascending")
    return ids, values
