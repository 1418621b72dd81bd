"""The orchestrator: takes requests, picks a route through the stages, and moves a request to a
replica when a node of its route fails.

Each request gets a route when it starts: one live owner of each ``pp-stage-K``
(replicas when a name has several).  The pick: a replica every hop reaches (the
mesh knows a path for each: from the stage before, and for the last stage to
stage 0 and to us) before one some hop does not, then alive before suspect,
then the fewest of our running requests, then the lowest measured round trip,
then the node id; a node that serves another checkpoint than ours, or is
draining, is never picked.  The route travels with every activation, so a request stays
on the nodes it started on.

When a node of the route fails (a stage reports that a send to it failed or
that it looks down, it becomes suspect or dead, it restarted, or it hands the
request over while draining), the request continues on a replica of that
stage under a new wire id: the new route replays the prompt as one prefill
and then every token so far one at a time, the shapes of the original run, so
the tokens stay the same bits as ``meshd generate``'s, and the sampler skips
the draws already made (Petals replays a client's history the same way).
With no replica, the request fails naming the stage and the peer; a suspect
without a replica is waited for, since it may refute.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import trio

from ..bounded import keep_newest
from ..mesh import MemberInfo, Mesh
from ..readiness import other_split, serves_other
from ..readiness import path as path_between
from ..wire import Message
from .admission import Admission, TooLarge, kv_bytes
from .api import Busy, NotReady, PipelineError, StageLost
from .app import App, Undelivered, arrived, resolve, route_neighbours
from .chat import ChatTemplate
from .checkpoint import fingerprint
from .config import LlamaConfig
from .generate import check_context, prompt_ids
from .messages import (
    HANDED_OVER,
    NO_ROOM,
    TOO_LARGE,
    UNDELIVERED,
    Activation,
    Hop,
    Release,
    Sampling,
    StageError,
    Token,
)
from .metrics import OrchestratorMetrics, measured
from .model import split_layers
from .stops import find_stop
from .tokenizer import IncrementalText, load_tokenizer

log = logging.getLogger("meshd.pipeline")

LOST_CHECK_S = 0.05  # how often a waiting request looks at the nodes of its route (``_tick``)
MAX_FAILOVERS = 8  # per request: past this, it fails
MAX_STRANGERS = 1024  # members logged once for messages off a request's route
# A node of a request's route whose process looks gone (its stream ended, a dial refused) while
# the mesh still holds it alive, with no replica to take over: the request waits this long for
# it to come back (a restart under its key takes a few seconds) or to be declared dead.
DOWN_WAIT_S = 15.0
# A request stalls when no token came for STALL_GAPS of its median gaps (at least STALL_MIN_S;
# STALL_FIRST_S before it has tokens): then its route is probed first.
STALL_GAPS = 8
STALL_MIN_S = 0.25
STALL_FIRST_S = 2.0
MAX_DEFAULT_TOKENS = 4096  # a request that names no max_tokens: the rest of the context, up to this
LONG_PROMPT_CHARS = 16384  # a prompt this long is tokenised in a worker thread
RELEASE_S = 1.0  # how long a request that ends early may take telling its route


# A node of a route that failed: (stage, node, why, gone).  ``gone``: the node cannot serve
# (dead, down, unreachable); otherwise it lost the request's state but may take its replay.
Trouble = tuple[int, bytes, str, bool]


def wire_id(req_id: str, attempt: int) -> str:
    """The id attempt ``attempt`` of request ``req_id`` goes by on the wire: the caller's id,
    the attempt, and 64 random bits.  A stage holds a request by this id alone, so a member
    off its route must never learn or guess it: one that knew it could claim it at a stage
    first (a start naming itself as the stage before), end it while it waits for room (a
    Release) or draw lost-state errors that fail it over (a step ahead of its prefill).  The
    caller's id may be its own choice and a failed route's nodes know the last attempt's;
    neither tells them the next."""
    return f"{req_id}.{attempt}.{secrets.token_hex(8)}"


@dataclass
class _Request:
    req_id: str  # the caller's id for it; the wire id (``wire_id``) changes with each attempt
    ids: list[int]
    sampling: Sampling
    route: tuple[bytes, ...] = ()
    epochs: tuple[int, ...] = ()  # each route node's process when it was picked
    wire_id: str = ""
    attempt: int = 0
    tokens: list[int] = field(default_factory=list)
    next_step: int = 0
    logits: list[np.ndarray] = field(default_factory=list)
    traces: list[tuple[Hop, ...]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str = ""  # the StageError's kind that ended it
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one
    text_end: int | None = None  # where the decoded text ends, when a stop string ended it
    decoded: IncrementalText | None = None  # the text so far, while stop strings are looked for
    trouble: Trouble | None = None  # reported by a stage, or by a failed send
    # The last node of the route that a message found no path to, who said so (a stage's
    # name, or "orchestrator"), the channel's words, and the sender's id: a direction with no path.
    no_path: tuple[bytes, str, str, bytes] | None = None
    failovers: list[dict[str, Any]] = field(default_factory=list)
    failover_started: float | None = None  # perf_counter when the last failover began
    stall_probed: bool = False  # its route was probed for this stall
    excluded: set[bytes] = field(default_factory=set)
    changed: trio.Event = field(default_factory=trio.Event)  # set by news, and by each tick
    news_at: float = 0.0  # trio time of its last news: a token, a stage's error, a failed send

    def tell(self) -> None:
        """Wake its loop with news: a token, or trouble to look at."""
        self.news_at = trio.current_time()
        self.changed.set()


class Orchestrator(App):
    def __init__(self, mesh: Mesh, model_dir: str | Path, stages: int, *,
                 admission: Admission | None = None) -> None:
        super().__init__(mesh)
        self.stages = stages
        self.admission = admission or Admission()
        self.config = LlamaConfig.load(model_dir)
        self.checkpoint = fingerprint(model_dir)
        self.model_name = Path(model_dir).resolve().name or "meshd"
        self.created = int(time.time())
        self.tokenizer = load_tokenizer(model_dir, self.config.bos_token_id, self.config.eos_token_ids)
        self.chat_template = ChatTemplate.load(model_dir)
        self.requests: dict[str, _Request] = {}  # by wire id
        self.recent_traces: deque[dict] = deque(maxlen=256)
        self.recent_failovers: deque[dict] = deque(maxlen=64)
        # Requests ended lately, as ``active`` shows a running one: a client that reads a
        # stream's tokens behind the request (smoke-run's faults) still finds its route.
        self.recently_ended: deque[dict] = deque(maxlen=64)
        self.metrics = OrchestratorMetrics()
        self.metrics.admitted = lambda: (self.admission.running, len(self.admission.waiting))
        # (node, what it serves) already logged as refused, oldest first, bounded
        self._refused: dict[tuple[bytes, str], None] = {}
        # Nodes a stage saw go down, with their process epoch then: not picked again until
        # the mesh says more (a new epoch), bounded.
        self._strangers: dict[bytes, None] = {}  # who sent for requests it does not serve (said once)

    def start_background(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._tick)

    async def _tick(self) -> None:
        """Wake every running request each LOST_CHECK_S without news, so it looks at its
        route and at how long it has waited.  One task for all: a timeout around each
        request's every wait (its token, about every 20 ms) costs a sixth of the
        orchestrator's profiled time at 16 streams (docs/performance.md)."""
        while True:
            await trio.sleep(LOST_CHECK_S)
            for req in list(self.requests.values()):
                req.changed.set()

    # --- readiness and routes ---

    def candidates(self, stage: int) -> list[MemberInfo]:
        """The nodes that may serve ``stage`` for a new request, best first."""
        load: dict[bytes, int] = {}
        for req in self.requests.values():
            for node in req.route:
                load[node] = load.get(node, 0) + 1
        out = [m for m in self.mesh.owners(f"pp-stage-{stage}") if self._unusable(m, stage) is None]

        def rank(m: MemberInfo) -> tuple:
            rtt = self.mesh.rtt(m.id)
            return (m.state != "alive", load.get(m.id, 0), float("inf") if rtt is None else rtt, m.id)

        return sorted(out, key=rank)

    def _seen_down(self, m: MemberInfo) -> bool:
        """A stage reported ``m`` down lately, and it runs the same process still (the mesh
        keeps the report, so the snapshot, and readiness, say the same)."""
        return self.mesh.reported_down(m.id)

    def _unusable(self, m: MemberInfo, stage: int) -> str | None:
        """Why ``m`` cannot serve ``stage`` for a new request (after its name, in words), or None."""
        if m.draining:
            return "is draining"
        if m.checkpoint != self.checkpoint:
            if self._first_refusal(m.id, m.checkpoint):
                log.warning("refusing %s as a replica of stage-%d: it serves checkpoint %s, this run's is %s",
                            self.mesh.describe(m.id), stage, m.checkpoint or "(none)", self.checkpoint)
            return serves_other(m.checkpoint, self.checkpoint)
        if m.stages is not None and m.stages != self.stages:
            if self._first_refusal(m.id, f"stages={m.stages}"):
                log.warning("refusing %s as a replica of stage-%d: it %s", self.mesh.describe(m.id), stage,
                            other_split(m.stages, self.stages))
            return other_split(m.stages, self.stages)
        if self._seen_down(m):
            return self._no_path_to(m) or "was reported gone by a stage"
        return None

    def _first_refusal(self, node: bytes, what: str) -> bool:
        """Whether ``node`` serving ``what`` is refused for the first time (then logged)."""
        if (node, what) in self._refused:
            return False
        keep_newest(self._refused, (node, what), MAX_STRANGERS)
        return True

    def _no_path_to(self, m: MemberInfo) -> str:
        """Why ``m``, reported down, is not used when the report held is of a direction with
        no path to its live process ("" when it is not): which node found no path, and the
        path the mesh knows now."""
        held = self.mesh.no_path_report(m.id)
        if held is None or not m.live:
            return ""
        sender, when = held
        p = path_between(self.mesh.snapshot(), sender.hex(), m.id.hex())
        if p["path"] == "none":
            return (f"is alive, but there is no path from {self.mesh.describe(sender)} to it "
                    f"({p.get('reason') or 'unanswered'})")
        return (f"is alive, but {self.mesh.describe(sender)} found no path to it "
                f"{trio.current_time() - when:.0f}s ago")

    def layer_split(self) -> dict[str, range]:
        split = split_layers(self.config.num_hidden_layers, self.stages)
        return {f"stage-{k}": layers for k, layers in enumerate(split)}

    def missing(self) -> list[str]:
        """Pipeline names with no usable live owner (for 503s)."""
        out = [] if self.mesh.resolve("pp-entry") else ["pp-entry"]
        out += [f"pp-stage-{k}" for k in range(self.stages) if not self.candidates(k)]
        return out + ([] if self.mesh.resolve("pp-exit") else ["pp-exit"])

    def not_ready(self) -> NotReady | None:
        missing = self.missing()
        if not missing:
            return None
        return NotReady(missing, reasons={n: why for n in missing if (why := self._why_unserved(n))})

    def _why_unserved(self, name: str) -> str:
        """Why the live owners of stage name ``name`` (pp-stage-K, pp-entry, pp-exit) cannot
        serve this run; "" when it has none (or is not a stage's name)."""
        if name.startswith("pp-stage-"):
            stage = int(name.removeprefix("pp-stage-"))
        elif name in ("pp-entry", "pp-exit"):  # stage 0's and the last stage's names
            stage = 0 if name == "pp-entry" else self.stages - 1
        else:
            return ""
        owners = self.mesh.owners(name)
        # A draining node withdrew its names: it owns none, yet is why its stage has no owner.
        held = {m.id for m in owners}
        owners += [m for m in self.mesh.members() if m.live and m.draining and m.name == f"stage-{stage}"
                   and m.id not in held]
        return "; ".join(f"{self.mesh.describe(m.id)} {why}" for m in owners
                         if (why := self._unusable(m, stage)) is not None)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids for a conversation, through the checkpoint's chat template;
        raises ChatTemplateError (a ValueError) when it cannot be written."""
        return self.chat_template.prompt_ids(messages, self.tokenizer)

    async def wait_ready(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            while self.missing():
                await trio.sleep(0.05)
        if (not_ready := self.not_ready()) is not None:
            raise not_ready

    def active(self) -> list[dict[str, Any]]:
        """Running requests: where each runs now (stage -> peer prefix), and how far it is."""
        return [_shown(req) for req in self.requests.values()]

    # --- one request ---

    @measured
    async def generate(self, prompt: str | list[int], max_tokens: int | None, temperature: float = 0.0,
                       top_k: int = 0, seed: int = 0, *, top_p: float = 1.0, stop: Sequence[str] = (),
                       want_logits: bool = False, token_timeout: float = 30.0, on_token=None,
                       request_id: str | None = None) -> dict:
        """Generate from ``prompt`` (text, BOS first; or token ids as they are).  ``max_tokens``
        None: as many as the context holds, up to MAX_DEFAULT_TOKENS.  ``stop``: generation
        ends at the first of these strings in the text, which ends before it.  ``request_id``:
        the request's id (``/api/requests``, the result's ``request``), a new one if None."""
        if not isinstance(prompt, str):
            ids = list(prompt)
        elif len(prompt) > LONG_PROMPT_CHARS:  # off the event loop: gossip and the others' tokens go on
            ids = await trio.to_thread.run_sync(prompt_ids, self.tokenizer, prompt)
        else:
            ids = prompt_ids(self.tokenizer, prompt)
        if not ids:
            raise ValueError("an empty prompt")
        if max_tokens is None:
            max_tokens = max(1, min(MAX_DEFAULT_TOKENS, self.config.max_position_embeddings - len(ids) + 1))
        check_context(self.config, len(ids), max_tokens)
        if (not_ready := self.not_ready()) is not None:
            raise not_ready
        await resolve(self.mesh, "pp-entry", 1.0)
        t0 = time.perf_counter()
        cost = kv_bytes(self.config, self.stages, len(ids) + max_tokens)
        try:
            queued = await self.admission.admit(cost)
        except TooLarge as exc:
            raise ValueError(str(exc)) from None
        self.metrics.queued(queued)
        try:
            sampling = Sampling(max_tokens, float(temperature), top_k, seed, want_logits, float(top_p))
            return await self._generate(ids, max_tokens, sampling, tuple(stop), t0, queued,
                                        token_timeout=token_timeout, on_token=on_token,
                                        request_id=request_id or uuid.uuid4().hex[:12])
        finally:
            self.admission.release(cost)

    def busy(self) -> Busy | None:
        """The refusal for a new request when every slot is taken and the queue is full (counted
        as a ``busy`` outcome), else None."""
        busy = self.admission.busy()
        if busy is not None:
            self.metrics.requests["busy"] += 1
        return busy

    def load(self) -> dict[str, int | float]:
        """The admission's load (``Admission.load``) and the requests refused as busy so far."""
        return {**self.admission.load(), "refused_busy": self.metrics.requests["busy"]}

    async def _generate(self, ids: list[int], max_tokens: int, sampling: Sampling, stop: tuple[str, ...],
                        t0: float, queued: float, *, token_timeout: float, on_token, request_id: str) -> dict:
        """A request admitted at ``t0`` (perf_counter), after ``queued`` seconds in the queue."""
        want_logits = sampling.want_logits
        req = _Request(request_id, ids, sampling, stop=stop)
        self.metrics.prompt_tokens += len(ids)
        outcome = "failed"  # how it ended, as /api/requests lists it among the ended
        try:
            looked = req.news_at = trio.current_time()
            await self._start(req)
            seen = 0
            while req.finish_reason is None and req.error is None:
                await req.changed.wait()  # news, or ``_tick``
                req.changed = trio.Event()
                await self._check_route(req)
                if req.news_at <= looked:  # a tick: no news since the last look
                    waited = trio.current_time() - req.news_at
                    if waited >= self._stall_s(req) and not req.stall_probed:
                        # A stalled request: its route is probed first, so a node gone silent
                        # is suspected a probe after the stall, not whenever its turn comes.
                        req.stall_probed = True
                        for node in set(req.route) - {self.mesh.node_id}:
                            self.mesh.probe_soon(node)
                    if waited >= token_timeout:
                        raise PipelineError(f"no token {len(req.tokens)} for request {req.req_id} within "
                                            f"{token_timeout:g}s; route: {self._describe_route(req)}"
                                            + "".join(f"; {hop}" for hop in self._hops_without_path(req)))
                    continue
                looked = req.news_at
                req.stall_probed = False
                seen = await _stream_tokens(req, seen, on_token)
            # The last tokens can land while the loop was not looking (a route check, a
            # stall's timeout): every token reaches the caller before the result does.
            await _stream_tokens(req, seen, on_token)
            if req.error is not None:
                if req.error_kind == TOO_LARGE and not req.tokens:
                    raise TooLarge(req.error)  # the request's own: a 400 (not a replica's, mid-way)
                raise (Busy if req.error_kind == NO_ROOM else PipelineError)(req.error)
        except PipelineError as exc:
            log.warning("request %s failed after %d of %d tokens: %s", req.req_id, len(req.tokens),
                        max_tokens, exc)
            outcome = f"failed: {exc}"
            raise
        except trio.Cancelled:
            log.info("request %s ended by its caller after %d of %d tokens", req.req_id, len(req.tokens),
                     max_tokens)
            outcome = "cancelled"
            raise
        else:
            outcome = req.finish_reason or "ended"
        finally:
            self.requests.pop(req.wire_id, None)
            if req.route:
                self.recently_ended.append({**_shown(req), "outcome": outcome})
            if req.route and req.finish_reason not in ("eos", "length"):
                await self._release(req)
        total = time.perf_counter() - t0
        first = req.token_times[0] - t0 if req.token_times else None
        if queued and req.traces:  # the wait for a slot, ahead of the first token's trace
            req.traces[0] = (Hop("wait", "orchestrator queue", queued * 1000, ""), *req.traces[0])
        text = self.tokenizer.decode(req.tokens)
        if req.stop and req.text_end is None and (end := find_stop(text, req.stop)) is not None:
            # a stop string that its last token's unfinished character held back
            req.text_end, req.finish_reason = end, "stop"
        result: dict[str, Any] = {
            "request": req.req_id,
            "prompt_tokens": len(req.ids),
            "tokens": req.tokens,
            "text": text[:req.text_end],
            "finish_reason": req.finish_reason,
            "failovers": req.failovers,
            "timings": {
                "total_s": total,
                "first_token_s": first,
                "tokens_per_s": len(req.tokens) / total if total > 0 else 0.0,
                "queued_s": queued,
                "hops": summarize(req.traces),
            },
        }
        if want_logits:
            result["logits"] = np.stack(req.logits) if req.logits else np.zeros((0, self.config.vocab_size),
                                                                               np.float32)
        self.recent_traces.append({"req_id": req.req_id, "traces": [[h.to_body() for h in t]
                                                                     for t in req.traces[-4:]]})
        return result

    async def _start(self, req: _Request, keep: tuple[bytes, ...] = (), replace: int = -1) -> None:
        """Send ``req`` down a route: a new one, or ``keep`` with stage ``replace`` and its
        excluded nodes picked again.

        A request with tokens already replays them (the prompt as one prefill, then each
        token alone), so the new route's KV caches hold what the old one's did."""
        # Each stage's node, as far as known: the kept ones from the start, each pick as made.
        plan: list[bytes | None] = [keep[k] if keep and keep[k] not in req.excluded and k != replace else None
                                    for k in range(self.stages)]
        snap: dict[str, Any] = {}
        usable: dict[int, list[bytes]] = {}  # each stage's candidates for it, best first, as first asked

        def usable_ids(j: int) -> list[bytes]:
            if j not in usable:
                usable[j] = [m.id for m in self.candidates(j) if m.id not in req.excluded]
            return usable[j]

        for k in range(self.stages):
            if plan[k] is None:
                picks = list(usable_ids(k))
                if not picks:
                    name = f"pp-stage-{k}"
                    raise NotReady([name], reasons={name: self._why_unserved(name)})
                if len(picks) > 1:
                    snap = snap or self.mesh.snapshot()
                    picks.sort(key=lambda node: self._no_path_count(snap, plan, k, node, usable_ids))
                plan[k] = picks[0]
        route = [node for node in plan if node is not None]
        req.route = tuple(route)
        req.epochs = tuple(self._epoch(n) for n in route)
        req.wire_id = wire_id(req.req_id, req.attempt)
        self.requests[req.wire_id] = req
        tokens = tuple(req.ids) + tuple(req.tokens)
        hop = Hop("transit", "orchestrator->stage-0", 0.0, self.path_to(route[0]))
        await self.send(route[0], Activation(req.wire_id, self.mesh.node_id, 0, req.next_step, 0, 0, b"",
                                             tokens, req.sampling, time.time(), (hop,), req.route,
                                             len(req.ids) if req.tokens else 0))

    async def _release(self, req: _Request) -> None:
        """Tell the route to drop a request it would go on computing: one a stop string ended,
        or whose caller left, or that failed.  The Release passes down the chain from stage 0,
        behind the request's messages in flight; each later stage gets one from us too, since
        the chain stops at a stage that is down (and then the stages past it would hold the
        request's cache until it aged out).  A stage that gets its Release before the request
        does holds the request until the chained one comes."""
        release = Release(req.wire_id)
        with trio.CancelScope(shield=True, deadline=trio.current_time() + RELEASE_S):
            for node in dict.fromkeys(req.route):
                entry = self.mesh.member_by_id(node) if node != self.mesh.node_id else None
                if node != self.mesh.node_id and (entry is None or not entry.live):
                    continue
                try:
                    await self.send(node, release)
                except Exception as exc:  # the request is over either way; its caches age out
                    log.warning("request %s: could not release it at %s: %s", req.req_id,
                                self.mesh.describe(node), exc)

    @staticmethod
    def _stall_s(req: _Request) -> float:
        """How long without a token counts as a stall: several of the request's usual gaps,
        and never less than STALL_MIN_S (a prefill, a busy host)."""
        times = req.token_times[-9:]
        if len(times) < 3:
            return STALL_FIRST_S
        gaps = sorted(b - a for a, b in itertools.pairwise(times))
        return max(STALL_MIN_S, STALL_GAPS * gaps[len(gaps) // 2])

    def _epoch(self, node: bytes) -> int:
        m = self.mesh.member_by_id(node)
        return m.epoch if m is not None else 0

    async def _check_route(self, req: _Request) -> None:
        """Move ``req`` to a replica if a node of its route failed; fail it if none can take over."""
        if req.finish_reason is not None or req.error is not None:
            return
        # What the mesh says first (a death or a restart is news a report may predate).
        trouble = self._route_trouble(req) or req.trouble
        req.trouble = None
        if trouble is None:
            return
        stage, node, why, gone = trouble
        if req.attempt >= MAX_FAILOVERS:
            raise PipelineError(f"request {req.req_id}: stage-{stage} failed again after {req.attempt} "
                                f"failovers: {why}")
        # A node that lost the request's state but runs (a restart, a cache it dropped) may
        # take the replay itself; one that is gone may not.
        replicas = [m for m in self.candidates(stage)
                    if m.id not in req.excluded and not (gone and m.id == node)]
        if not replicas:
            m = self.mesh.member_by_id(node)
            if (req.no_path is not None and req.no_path[0] == node and m is not None and m.state == "alive"
                    and m.epoch == req.epochs[stage] and not self.mesh.peer_down(node)):
                # It runs, and the mesh will keep it alive (others reach it), but this direction
                # has no path: waiting would not bring one, and no replica can take over.  A
                # node of the sender's stage that has a path to it can take the sender's place.
                sender = req.no_path[3]
                if sender in req.route and sender != node:
                    k = req.route.index(sender)
                    snap = self.mesh.snapshot()
                    if any(o.id not in req.excluded and o.id != sender and not self._cut(snap, o.id, node)
                           for o in self.candidates(k)):
                        req.excluded.add(sender)  # for this request: it cannot reach the next stage
                        req.no_path = None
                        await self._failover(req, k, sender, f"has no path to {self.mesh.describe(node)}")
                        return
                raise StageLost(f"stage-{stage} (peer {node.hex()[:8]} alive, but no path from "
                                f"{req.no_path[1]} to it), and no replica to take over ({req.no_path[2]})")
            if why == "suspect" or (" " in why and m is not None and m.state == "alive"):
                # It may refute, or what a stage saw may be its old process (a restart under
                # the same key): with no replica, the mesh's verdict decides.  Look again.
                req.trouble = trouble if why != "suspect" else None
                return
            if why == "down" and m is not None and m.state == "alive" and self._may_come_back(node):
                # Its process looks gone, and the mesh has not said so yet: one restarting under
                # its key comes back as a new process of the same member, which takes the
                # replay ("restarted"); one that does not is declared dead, or stays down past
                # DOWN_WAIT_S.  Either way the request fails only then.
                return
            state = self._state_word(node, why)
            detail = "" if why == state else f" ({why})"
            peer = node.hex()[:8]
            raise StageLost(f"stage-{stage} (peer {peer} {state}), and no replica to take over{detail}")
        if gone:
            req.excluded.add(node)
        await self._failover(req, stage, node, why)

    def _may_come_back(self, node: bytes) -> bool:
        """Whether ``node``, looking down, has not looked so for DOWN_WAIT_S yet."""
        since = self.mesh.down_since(node)
        return since is None or trio.current_time() - since < DOWN_WAIT_S

    def _state_word(self, node: bytes, why: str) -> str:
        """One word for what became of ``node``: its member state if it is not alive, else
        ``down`` or ``unreachable`` (what a stage or a send said), or ``why`` if that is one."""
        if " " not in why:
            return why
        m = self.mesh.member_by_id(node)
        if m is None or m.state != "alive":
            return m.state if m is not None else "gone"
        return "down" if self.mesh.peer_down(node) or "is down" in why else "unreachable"

    def _route_trouble(self, req: _Request) -> Trouble | None:
        """The first node of the route that is not fit to go on."""
        for k, node in enumerate(req.route):
            if node == self.mesh.node_id:
                continue
            m = self.mesh.member_by_id(node)
            if m is None or m.state != "alive":
                return k, node, m.state if m is not None else "gone", True
            if m.epoch != req.epochs[k]:
                return k, node, "restarted", False
            if self.mesh.peer_down(node):
                # Seen down here: routed to by no new request meanwhile, as if a stage said so.
                self.mesh.report_down(node, m.epoch, seen_here=True)
                return k, node, "down", True
        return None

    async def _failover(self, req: _Request, stage: int, node: bytes, why: str) -> None:
        old_id, old_route = req.wire_id, req.route
        self.requests.pop(old_id, None)
        req.attempt += 1
        self.metrics.failovers += 1
        req.failover_started = time.perf_counter()
        await self._start(req, keep=old_route, replace=stage)
        req.news_at = trio.current_time()  # its wait for a token starts again on the new route
        record = {"request": req.req_id, "stage": f"stage-{stage}", "from": node.hex()[:8],
                  "to": req.route[stage].hex()[:8], "ms": None, "why": why, "at_token": len(req.tokens)}
        req.failovers.append(record)
        self.recent_failovers.append(record)
        log.warning("request %s: %s %s; continuing on %s (replaying %d tokens)", req.req_id,
                    self.mesh.describe(node), why, self.mesh.describe(req.route[stage]), len(req.tokens))
        for other in set(old_route) - {node}:  # the old route's caches are no use now
            await self.send(other, Release(old_id))

    def _no_path_count(self, snap: dict[str, Any], plan: list[bytes | None], k: int, node: bytes,
                       later: Callable[[int], list[bytes]]) -> int:
        """How many of the hops ``node`` would take part in as stage ``k`` have no path, with
        the other stages' nodes as far as ``plan`` knows them: from the stage before (from
        us, for stage 0), to the stage after; from the last stage to stage 0 and to us.  A
        hop to or from a stage not picked yet counts when it has no path to or from any of
        that stage's ``later(j)`` candidates.  A replica every hop reaches goes before one
        some hop does not, whatever else ranks it."""
        me, last = self.mesh.node_id, self.stages - 1
        hops: list[tuple[bytes | int, bytes | int]] = [(plan[k - 1] or k - 1 if k else me, node)]
        if k < last:
            hops.append((node, plan[k + 1] or k + 1))
        else:
            hops += [(node, plan[0] or 0), (node, me)]
        if k == 0 and last:
            hops.append((plan[last] or last, node))  # the next token comes back to stage 0

        def cut(a: bytes, b: bytes) -> bool:
            return a != b and self._cut(snap, a, b)

        count = 0
        for a, b in hops:
            froms = later(a) if isinstance(a, int) else [a]
            tos = later(b) if isinstance(b, int) else [b]
            count += bool(froms and tos) and all(cut(x, y) for x in froms for y in tos)
        return count

    def _cut(self, snap: dict[str, Any], a: bytes, b: bytes) -> bool:
        """Whether the direction ``a``→``b`` has no path: the mesh's paths say so, or ``a``
        found none to ``b`` and the report of it holds."""
        held = self.mesh.no_path_report(b)
        return ((held is not None and held[0] == a)
                or path_between(snap, a.hex(), b.hex())["path"] == "none")

    def _hops_without_path(self, req: _Request) -> list[str]:
        """The hops of ``req``'s route that have no path, as this node knows them: its own
        directions from its path table, the stages' from the summaries they gossip, and a
        direction a message found no path on; each ``stage-0 (ab12cd34)→stage-1 (…): why``."""
        route, me = req.route, self.mesh.node_id
        hops = [(me, route[0]), *itertools.pairwise(route)]
        if len(route) > 1:
            hops.append((route[-1], route[0]))  # the next token, and the head's share
        hops.append((route[-1], me))
        snap = self.mesh.snapshot()
        out = []
        for a, b in dict.fromkeys(hops):
            if a != b and (p := path_between(snap, a.hex(), b.hex()))["path"] == "none":
                out.append(f"{self.mesh.describe(a)}→{self.mesh.describe(b)}: no path "
                           f"({p.get('reason') or 'unanswered'})")
        if req.no_path is not None and not out:
            node, sender, report, _ = req.no_path
            out.append(f"{sender}→{self.mesh.describe(node)}: no path ({report})")
        return out

    def _describe_route(self, req: _Request) -> str:
        out = []
        for k, node in enumerate(req.route):
            m = self.mesh.member_by_id(node)
            out.append(f"stage-{k} {node.hex()[:8]} {m.state if m is not None else 'gone'}")
        return ", ".join(out)

    # --- messages from the stages ---

    def _from_route(self, src: bytes, req: _Request, msg: Message) -> bool:
        """Whether ``src`` serves ``req`` now: only the nodes of its route send its tokens and
        errors, so no other member can put words in a request's mouth or end it."""
        if src in req.route or src == self.mesh.node_id:
            return True
        self.metrics.not_from_route += 1
        if src not in self._strangers:
            keep_newest(self._strangers, src, MAX_STRANGERS)
            log.warning("ignoring %s for request %s from %s, which does not serve it (its route: %s)",
                        type(msg).__name__, req.req_id, self.mesh.describe(src), self._describe_route(req))
        return False

    async def on_message(self, src: bytes, msg: Message) -> None:
        if isinstance(msg, (Token, StageError)):
            req = self.requests.get(msg.req_id)
            if req is None or not self._from_route(src, req, msg):
                return
        if isinstance(msg, Token):
            req = self.requests.get(msg.req_id)
            if req is None or req.finish_reason is not None or msg.step != req.next_step:
                return  # a request that ended (a stop string) or moved, or a step we have
            req.next_step += 1
            trace = arrived(msg.trace, msg.sent_at)
            self.metrics.arrived(trace)
            if len(trace) > 1:  # a whole step's (one in stage.TRACE_EVERY), not its last transit alone
                req.traces.append(trace)
            if msg.logits:
                req.logits.append(np.frombuffer(msg.logits, dtype=np.float32).copy())
            if msg.done != "eos":
                req.tokens.append(msg.token)
                req.token_times.append(time.perf_counter())
                self.metrics.generation_tokens += 1
            if req.failover_started is not None and req.failovers:
                req.failovers[-1]["ms"] = round((time.perf_counter() - req.failover_started) * 1000, 1)
                req.failover_started = None
            if msg.done != "eos" and req.stop and self._stopped(req):
                req.finish_reason = "stop"
            elif msg.done:
                req.finish_reason = msg.done
            req.tell()
        elif isinstance(msg, StageError):
            req = self.requests.get(msg.req_id)
            if req is None:
                return
            if msg.peer and msg.peer in req.route:
                # A stage naming itself lost the request's state, or hands it over while draining;
                # or one that sends to or hears from the named stage for this request saw it down.
                # Only those know: another member's word would take a live stage out of routing.
                neighbour = src in req.route and msg.peer in route_neighbours(req.route, req.route.index(src))
                if src not in (msg.peer, self.mesh.node_id) and not neighbour:
                    log.warning("%s says %s of request %s is down, but does not exchange its steps "
                                "with it: not taken", self.mesh.describe(src),
                                self.mesh.describe(msg.peer), req.req_id)
                    return
                if msg.peer == src and msg.kind == HANDED_OVER:
                    # Its leave may reach us by gossip only later: for this request it is gone.
                    req.excluded.add(src)
                req.trouble = (req.route.index(msg.peer), msg.peer, msg.message, msg.peer != src)
                no_path = msg.kind == UNDELIVERED and msg.peer != src
                if no_path:
                    req.no_path = (msg.peer, msg.stage, msg.message, src)
                if msg.peer != src:  # about the process the request was routed to
                    # Of a direction with no path: held while the mesh sees none that way.
                    self.mesh.report_down(msg.peer, req.epochs[req.route.index(msg.peer)],
                                          no_path_from=src if no_path else None)
            else:
                # The caller's id, not the wire id: that one stays between the request's nodes.
                req.error = f"{msg.stage}: {msg.message}".replace(req.wire_id, req.req_id)
                req.error_kind = msg.kind
            req.tell()

    def _stopped(self, req: _Request) -> bool:
        """Whether ``req``'s text holds one of its stop strings now (then it ends before it)."""
        if req.decoded is None:
            req.decoded = IncrementalText(self.tokenizer.decode)
        for token in req.tokens[len(req.decoded.tokens):]:
            req.decoded.add(token)
        req.text_end = find_stop(req.decoded.text, req.stop)
        return req.text_end is not None

    async def failed(self, msg: Message, exc: Exception, peer: bytes = b"") -> None:
        req = self.requests.get(getattr(msg, "req_id", ""))
        if req is not None and peer in req.route:
            req.trouble = (req.route.index(peer), peer, str(exc), True)
            if isinstance(exc, Undelivered):
                req.no_path = (peer, "orchestrator", str(exc), self.mesh.node_id)
            req.tell()


def summarize(traces: list[tuple[Hop, ...]]) -> list[dict]:
    """Median ms per hop name over a request's steps: where a token's time goes."""
    by_name: dict[tuple[str, str], list[float]] = {}
    for trace in traces:
        for hop in trace:
            by_name.setdefault((hop.kind, hop.name), []).append(hop.ms)
    paths = {(h.kind, h.name): h.path for t in traces for h in t}
    # statistics.median, not numpy's: over a dozen short lists numpy's per-call cost is most
    # of the work (5x here), and it is paid before the response leaves.
    return [{"kind": kind, "name": name, "median_ms": float(statistics.median(v)),
             "path": paths[(kind, name)]} for (kind, name), v in by_name.items()]


async def _stream_tokens(req: _Request, seen: int, on_token) -> int:
    """Hand ``req``'s tokens from ``seen`` on to ``on_token`` (if any); returns how many went."""
    if on_token is None:
        return seen
    while seen < len(req.tokens):
        await on_token(req.tokens[seen])
        seen += 1
    return seen


def _shown(req: _Request) -> dict[str, Any]:
    """A request as ``/api/requests`` lists it: its route (stage -> peer prefix), how far it is."""
    route = {f"stage-{k}": node.hex()[:8] for k, node in enumerate(req.route)}
    return {"request": req.req_id, "route": route, "tokens": len(req.tokens),
            "failovers": list(req.failovers)}
