"""Stages and the orchestrator on the mesh.

Stage K holds layers split_layers(N)[K] and a KV cache per request.  Stage 0
embeds; each stage runs its layers and forwards the hidden state to
``pp-stage-{K+1}``; the last stage samples, streams the token to the
orchestrator, and feeds it back to stage 0 (the autoregressive edge).  Names
resolve through the SWIM registry, and every message goes over the node's
data channel, so each hop uses whatever path works.  Each activation carries a
trace: every stage's compute time and every hop's transit time and path.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import trio

from ..mesh import Mesh
from ..wire import Message, WireError
from .api import NotReady, PipelineError, StageLost
from .config import LlamaConfig
from .generate import check_context, prompt_ids
from .messages import (
    Activation,
    HeadInput,
    HeadPart,
    Hop,
    Release,
    Sampling,
    StageError,
    Token,
    decode_app,
    encode_app,
)
from .model import KVCache, StageModel, head_cut, split_layers
from .sampling import Sampler, Shortlist, is_greedy, merge, shortlist
from .tokenizer import load_tokenizer

log = logging.getLogger("meshd.pipeline")

RESOLVE_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 30.0
MAX_CACHED_REQUESTS = 64
LOST_CHECK_S = 0.2  # how often a waiting request looks for dead stages
PREFILL_ROWS = 8  # more rows than this run in a thread, from a task of their own
# The LM head is cut between stage 0 and the last stage only when half of it outweighs the
# extra message that costs: on loopback a hop is about 0.3 ms, some 2-4 M multiply-adds of
# numpy.  The small preset's head (32000 x 288) is cut; the tiny one's (258 x 64) is not,
# and cutting it slowed `meshd smoke-run` from 64-89 to 48-64 tokens/s.
HEAD_SPLIT_MIN_MACS = 4_000_000
# Tokens streamed to the orchestrator wait up to this long to share one message (the first
# and last of a request go at once).  Each message wakes the orchestrator's process, and on
# a host with fewer cores than nodes a woken process can take the core of the stage that
# computes the next token: one message per token cost the pipeline about a tenth of its speed.
TOKEN_BATCH_S = 0.02
TOKEN_BATCH_MAX = 32


async def resolve(mesh: Mesh, name: str, timeout: float = RESOLVE_TIMEOUT_S) -> bytes:
    """The live owner of ``name``, waiting for it up to ``timeout`` seconds."""
    owner = mesh.resolve(name)
    if owner is not None:  # the usual case, on every hop: no cancel scope, no deadline
        return owner
    with trio.move_on_after(timeout):
        while True:
            owner = mesh.resolve(name)
            if owner is not None:
                return owner
            await trio.sleep(0.05)
    raise PipelineError(f"{mesh.name}: name {name} did not resolve within {timeout:g}s")


class _App:
    """Shared plumbing: messages in from the data channel, out through it.

    Each message is decoded and handled as the channel delivers it (see
    ``DataChannel.dispatch``), and a send writes to the peer's stream before
    it returns; the channel's per-peer task waits for acks and resends, so
    compute never waits on a round trip.
    """

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self._nursery: trio.Nursery | None = None

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            # Handlers run in the stream's reader: a decode step is short, and a prefill
            # (the one long piece of work) gets a task of its own (see _handle).
            await self.mesh.dispatch(self._handle, inline=True)

    async def _handle(self, src: bytes, data: bytes) -> None:
        try:
            packet = decode_app(data)
        except WireError as exc:
            log.warning("bad pipeline message from %s: %s", self.mesh.describe(src), exc)
            return
        for msg in packet.messages:
            if isinstance(msg, Activation) and max(msg.rows, len(msg.tokens)) > PREFILL_ROWS:
                # Another request's message from the same sender may go first: requests
                # are independent, and nothing else of this one comes before its prefill ends.
                assert self._nursery is not None  # messages arrive only while serve() runs
                self._nursery.start_soon(self._on_message, src, msg)
            else:
                await self._on_message(src, msg)

    async def _on_message(self, src: bytes, msg: Message) -> None:
        try:
            await self.on_message(src, msg)
        except Exception as exc:  # one bad request must not stop the stage
            log.exception("%s: %s failed", self.mesh.name, type(msg).__name__)
            await self.failed(msg, exc)

    async def send(self, dst: bytes, *msgs: Message) -> None:
        """To ``dst`` over the data channel, in order, without waiting for its ack.

        Several messages go as one, in order.  A message that cannot be
        delivered fails its request (``failed``).
        """
        data = encode_app(self.mesh.node_id, *msgs)
        if dst == self.mesh.node_id:
            await self.mesh.loopback(data)
            return

        async def undelivered(exc: Exception) -> None:
            log.warning("%s: %s", self.mesh.name, exc)
            # The channel's error names the peer and every path tried: it is the request's error.
            failure = PipelineError(str(exc))
            # One failure per request, though a batch may hold several of its tokens.
            for msg in {getattr(m, "req_id", id(m)): m for m in msgs}.values():
                await self.failed(msg, failure)

        await self.mesh.post(dst, data, SEND_TIMEOUT_S, undelivered)

    def path_to(self, dst: bytes) -> str:
        if dst == self.mesh.node_id:
            return "local"
        return self.mesh.path(dst)

    async def on_message(self, src: bytes, msg: Message) -> None:
        raise NotImplementedError

    async def failed(self, msg: Message, exc: Exception) -> None:
        pass


def _arrived(trace: tuple[Hop, ...], sent_at: float) -> tuple[Hop, ...]:
    """Fill in the transit time of the hop that just arrived (the last one)."""
    if not trace or trace[-1].kind != "transit":
        return trace
    last = trace[-1]
    ms = max(0.0, (time.time() - sent_at) * 1000)
    return (*trace[:-1], Hop("transit", last.name, ms, last.path))


class StageService(_App):
    def __init__(self, mesh: Mesh, model_dir: str | Path, stage: int, stages: int) -> None:
        super().__init__(mesh)
        self.stage, self.stages = stage, stages
        self.name = f"stage-{stage}"
        config = LlamaConfig.load(model_dir)
        self.layers = split_layers(config.num_hidden_layers, stages)[stage]
        self.last = stage == stages - 1
        # With two stages or more, stage 0 and the last stage each compute half of the LM
        # head's rows at once, and stage 0 samples (see _share_head): the head is the
        # biggest matmul of a decode step, and stage 0 would only wait for the token.
        self.split_head = stages >= 2 and config.vocab_size * config.hidden_size >= HEAD_SPLIT_MIN_MACS
        self.model = StageModel.load(model_dir, self.layers, config=config,
                                     head=True if stage == 0 and self.split_head else None)
        cut = head_cut(config.vocab_size)
        self.head_rows = slice(0, cut) if stage == 0 else slice(cut, config.vocab_size)
        self.eos = set(config.eos_token_ids)
        self.caches: dict[str, KVCache] = {}
        self.samplers: dict[str, Sampler] = {}
        self._heads: dict[tuple[str, int], _HeadJoin] = {}  # at stage 0: (req_id, step) -> the two halves
        self._outbox: dict[bytes, list[Message]] = {}  # per orchestrator: tokens (and errors) not yet sent
        self.counters = {"activations": 0, "tokens": 0, "errors": 0}

    def _splits_head(self, s: Sampling) -> bool:
        """Whether this request's head is cut in two; not when every logit must travel
        (``want_logits``) or be sampled from (temperature without top-k)."""
        return self.split_head and not s.want_logits and (is_greedy(s.temperature, s.top_k) or s.top_k > 0)

    async def on_message(self, src: bytes, msg: Message) -> None:
        if isinstance(msg, Activation):
            await self._activation(msg)
        elif isinstance(msg, Token):  # the feedback edge, at stage 0
            await self._activation(Activation(
                msg.req_id, msg.origin, msg.pos, msg.step + 1, 0, 0, b"", (msg.token,),
                msg.sampling, msg.sent_at, msg.trace,
            ))
        elif isinstance(msg, HeadInput):
            await self._head_input(msg)
        elif isinstance(msg, HeadPart):
            await self._head_part(msg)
        elif isinstance(msg, Release):
            self._forget(msg.req_id)
            if not self.last:
                await self.send(await resolve(self.mesh, f"pp-stage-{self.stage + 1}"), msg)

    async def _activation(self, msg: Activation) -> None:
        self.counters["activations"] += 1
        trace = _arrived(msg.trace, msg.sent_at)
        model = self.model
        if msg.tokens:
            hidden = model.embed(list(msg.tokens))  # (T, D)
        else:
            hidden = np.frombuffer(msg.hidden, dtype=np.float32).reshape(msg.rows, msg.dims)
        cache = self.caches.get(msg.req_id)
        if cache is None:
            if msg.pos != 0:
                raise PipelineError(f"{self.name} has no KV cache for request {msg.req_id} at position "
                                    f"{msg.pos} (did this stage restart?)")
            need = msg.pos + hidden.shape[0] + msg.sampling.max_tokens
            cache = self.caches[msg.req_id] = model.new_cache(min(need, model.config.max_position_embeddings))
            while len(self.caches) > MAX_CACHED_REQUESTS:
                self.caches.pop(next(iter(self.caches)))
        t0 = time.perf_counter()
        if hidden.shape[0] > PREFILL_ROWS:  # a prefill: off the event loop, so gossip keeps its timing
            out = await trio.to_thread.run_sync(model.forward, hidden, cache, msg.pos)
        else:  # a decode step is shorter than a thread hand-off
            out = model.forward(hidden, cache, msg.pos)
        pos = msg.pos + hidden.shape[0]
        if self.last and self._splits_head(msg.sampling):
            normed = model.final_norm(out[-1:])
            trace = (*trace, Hop("compute", self.name, (time.perf_counter() - t0) * 1000, ""))
            await self._share_head(msg, normed, trace, pos)
            return
        trace = (*trace, Hop("compute", self.name, (time.perf_counter() - t0) * 1000, ""))
        if not self.last:
            nxt = await resolve(self.mesh, f"pp-stage-{self.stage + 1}")
            hop = Hop("transit", f"{self.name}->stage-{self.stage + 1}", 0.0, self.path_to(nxt))
            await self.send(nxt, Activation(
                msg.req_id, msg.origin, msg.pos, msg.step, out.shape[0], out.shape[1],
                np.ascontiguousarray(out, dtype=np.float32).tobytes(), (), msg.sampling, time.time(),
                (*trace, hop),
            ))
            return
        logits = model.logits(out[-1:])[0]
        s = msg.sampling
        token = self._sampler(msg.req_id, s)(logits)
        done = self._done(token, msg.step, s)
        self.counters["tokens"] += 1
        entry = await resolve(self.mesh, "pp-stage-0")
        if not done:
            # The feedback edge first: it is on the critical path of the next token.
            hop = Hop("transit", f"{self.name}->stage-0", 0.0, self.path_to(entry))
            await self.send(entry, Token(msg.req_id, msg.origin, msg.step, token, pos, "", b"", s,
                                         time.time(), (hop,)))
        else:
            self._forget(msg.req_id)
            if self.stages > 1:
                await self.send(entry, Release(msg.req_id))
        raw = logits.astype(np.float32).tobytes() if s.want_logits else b""
        await self._stream(Token(msg.req_id, msg.origin, msg.step, token, pos, done, raw, s, time.time(),
                                 (*trace, Hop("transit", f"{self.name}->orchestrator", 0.0,
                                              self.path_to(msg.origin)))))

    async def _stream(self, token: Token) -> None:
        """Stream ``token`` to its orchestrator: a request's first and last token at once, the
        rest gathered for up to TOKEN_BATCH_S into one message (see TOKEN_BATCH_S).

        ``token.sent_at`` is when it joined the outbox; its trace ends with the transit to
        the orchestrator, still to be timed."""
        pending = self._outbox.setdefault(token.origin, [])
        pending.append(token)
        if token.step == 0 or token.done or token.logits or len(pending) >= TOKEN_BATCH_MAX:
            await self._flush(token.origin)
        elif len(pending) == 1:
            assert self._nursery is not None
            self._nursery.start_soon(self._flush_later, token.origin)

    async def _flush_later(self, origin: bytes) -> None:
        await trio.sleep(TOKEN_BATCH_S)
        await self._flush(origin)

    async def _flush(self, origin: bytes) -> None:
        """Send the outbox of ``origin``, in order, as one message."""
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
        transit to the orchestrator is timed from now."""
        wait = Hop("wait", f"{self.name} outbox", max(0.0, (now - token.sent_at) * 1000), "")
        return replace(token, sent_at=now, trace=(*token.trace[:-1], wait, token.trace[-1]))

    def _sampler(self, req_id: str, s: Sampling) -> Sampler:
        """The request's sampler: one per request, wherever it samples, so its seed draws in order."""
        sampler = self.samplers.get(req_id)
        if sampler is None:
            sampler = self.samplers[req_id] = Sampler(s.temperature, s.top_k, s.seed)
        return sampler

    def _done(self, token: int, step: int, s: Sampling) -> str:
        """Why generation ends with this token ("eos", "length"), or "" while it goes on."""
        return "eos" if token in self.eos else ("length" if step + 1 >= s.max_tokens else "")

    def _forget(self, req_id: str) -> None:
        self.caches.pop(req_id, None)
        self.samplers.pop(req_id, None)
        for key in [k for k in self._heads if k[0] == req_id]:
            del self._heads[key]

    # --- the LM head in two halves: the last stage and stage 0 ---

    async def _share_head(self, msg: Activation, normed: np.ndarray, trace: tuple[Hop, ...],
                          pos: int) -> None:
        """At the last stage: stage 0 gets the normalised hidden state first, and computes its
        rows while we compute ours; then it gets our shortlist, and samples."""
        s = msg.sampling
        entry = await resolve(self.mesh, "pp-stage-0")
        hop = Hop("transit", f"{self.name}->stage-0", 0.0, self.path_to(entry))
        await self.send(entry, HeadInput(msg.req_id, msg.origin, msg.step, pos,
                                         np.ascontiguousarray(normed[0], dtype="<f4").tobytes(), s,
                                         time.time(), (*trace, hop)))
        t0 = time.perf_counter()
        logits = self.model.head_logits(normed, self.head_rows)[0]
        ids, values = shortlist(logits, s.temperature, s.top_k, self.head_rows.start)
        await self.send(entry, HeadPart(msg.req_id, msg.origin, msg.step, ids.astype("<i8").tobytes(),
                                        values.astype("<f4").tobytes(), (time.perf_counter() - t0) * 1000))

    def _join(self, req_id: str, step: int) -> _HeadJoin:
        join = self._heads.get((req_id, step))
        if join is None:
            join = self._heads[(req_id, step)] = _HeadJoin()
            while len(self._heads) > MAX_CACHED_REQUESTS:  # halves of requests that died midway
                self._heads.pop(next(iter(self._heads)))
        return join

    async def _head_input(self, msg: HeadInput) -> None:
        """At stage 0: our rows of the head for this step."""
        dims = self.model.config.hidden_size
        if len(msg.hidden) != 4 * dims:
            raise PipelineError(f"{self.name}: head input of {len(msg.hidden)} bytes, expected {4 * dims}")
        trace = _arrived(msg.trace, msg.sent_at)
        s = msg.sampling
        t0 = time.perf_counter()
        normed = np.frombuffer(msg.hidden, dtype="<f4").reshape(1, dims)
        mine = shortlist(self.model.head_logits(normed, self.head_rows)[0], s.temperature, s.top_k)
        join = self._join(msg.req_id, msg.step)
        join.input, join.trace = msg, trace
        join.mine, join.mine_ms = mine, (time.perf_counter() - t0) * 1000
        if join.theirs is not None:
            await self._sample(msg.req_id, msg.step)

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
        s = msg.sampling
        t0 = time.perf_counter()
        token = self._sampler(req_id, s).choose(merge([join.mine, join.theirs], s.top_k))
        done = self._done(token, step, s)
        self.counters["tokens"] += 1
        trace = (*join.trace,
                 Hop("compute", f"{self.name} head", join.mine_ms + (time.perf_counter() - t0) * 1000, ""),
                 Hop("compute", f"stage-{self.stages - 1} head", join.their_ms, ""))
        if done:
            self._forget(req_id)
            await self.send(await resolve(self.mesh, f"pp-stage-{self.stage + 1}"), Release(req_id))
        else:
            # The next step first: it is the critical path; the orchestrator's copy after.
            await self._activation(Activation(req_id, msg.origin, msg.pos, step + 1, 0, 0, b"", (token,), s,
                                              0.0, ()))
        hop = Hop("transit", f"{self.name}->orchestrator", 0.0, self.path_to(msg.origin))
        await self._stream(Token(req_id, msg.origin, step, token, msg.pos, done, b"", s, time.time(),
                                 (*trace, hop)))

    async def failed(self, msg: Message, exc: Exception) -> None:
        self.counters["errors"] += 1
        origin = getattr(msg, "origin", None)
        req_id = getattr(msg, "req_id", "")
        if origin is None:
            return
        text = str(exc) if isinstance(exc, PipelineError) else f"{type(exc).__name__}: {exc}"
        # Behind the tokens waiting in the outbox: the orchestrator stops listening to a
        # request at its error, and every token before the error belongs to its stream.
        self._outbox.setdefault(origin, []).append(StageError(req_id, self.name, text[:500]))
        await self._flush(origin)


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


@dataclass
class _Request:
    req_id: str
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    traces: list[tuple[Hop, ...]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    changed: trio.Event = field(default_factory=trio.Event)


class Orchestrator(_App):
    def __init__(self, mesh: Mesh, model_dir: str | Path, stages: int) -> None:
        super().__init__(mesh)
        self.stages = stages
        self.config = LlamaConfig.load(model_dir)
        self.tokenizer = load_tokenizer(model_dir, self.config.bos_token_id, self.config.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self.recent_traces: deque[dict] = deque(maxlen=256)

    def missing(self) -> list[str]:
        """Pipeline names that do not resolve yet (for 503s and readiness)."""
        names = ["pp-entry", *(f"pp-stage-{k}" for k in range(self.stages)), "pp-exit"]
        return [n for n in names if self.mesh.resolve(n) is None]

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    async def wait_ready(self, timeout: float) -> None:
        with trio.move_on_after(timeout):
            while self.missing():
                await trio.sleep(0.05)
        if self.missing():
            raise NotReady(self.missing())

    async def generate(self, prompt: str, max_tokens: int, temperature: float = 0.0, top_k: int = 0,
                       seed: int = 0, *, want_logits: bool = False, token_timeout: float = 30.0,
                       on_token=None) -> dict:
        ids = prompt_ids(self.tokenizer, prompt)
        check_context(self.config, len(ids), max_tokens)
        missing = self.missing()
        if missing:
            raise NotReady(missing)
        entry = await resolve(self.mesh, "pp-entry", 1.0)
        req = _Request(uuid.uuid4().hex[:12])
        self.requests[req.req_id] = req
        sampling = Sampling(max_tokens, float(temperature), top_k, seed, want_logits)
        t0 = time.perf_counter()
        try:
            hop = Hop("transit", "orchestrator->stage-0", 0.0, self.path_to(entry))
            await self.send(entry, Activation(req.req_id, self.mesh.node_id, 0, 0, 0, 0, b"",
                                              tuple(ids), sampling, time.time(), (hop,)))
            seen = 0
            waited = 0.0
            while req.finish_reason is None and req.error is None:
                with trio.move_on_after(LOST_CHECK_S) as scope:
                    await req.changed.wait()
                if scope.cancelled_caught:
                    # A stage the mesh declared dead will never answer: say which, now.
                    lost = self.lost_stage()
                    if lost is not None:
                        raise StageLost(lost)
                    waited += LOST_CHECK_S
                    if waited >= token_timeout:
                        raise PipelineError(f"no token {len(req.tokens)} for request {req.req_id} within "
                                            f"{token_timeout:g}s; stages: {self._stage_states()}")
                    continue
                waited = 0.0
                req.changed = trio.Event()
                if on_token is not None:
                    while seen < len(req.tokens):
                        await on_token(req.tokens[seen])
                        seen += 1
            if req.error is not None:
                raise PipelineError(req.error)
        finally:
            self.requests.pop(req.req_id, None)
        total = time.perf_counter() - t0
        first = req.token_times[0] - t0 if req.token_times else None
        result: dict[str, Any] = {
            "tokens": req.tokens,
            "text": self.tokenizer.decode(req.tokens),
            "finish_reason": req.finish_reason,
            "timings": {
                "total_s": total,
                "first_token_s": first,
                "tokens_per_s": len(req.tokens) / total if total > 0 else 0.0,
                "hops": summarize(req.traces),
            },
        }
        if want_logits:
            result["logits"] = np.stack(req.logits) if req.logits else np.zeros((0, self.config.vocab_size),
                                                                               np.float32)
        self.recent_traces.append({"req_id": req.req_id, "traces": [[h.to_body() for h in t]
                                                                     for t in req.traces[-4:]]})
        return result

    def lost_stage(self) -> str | None:
        """``stage-2 (peer 2b91108e dead)`` if a stage of this run is dead or gone."""
        for k in range(self.stages):
            name = f"stage-{k}"
            gone = [m for m in self.mesh.members() if m.name == name and not m.live]
            live = self.mesh.member(name)
            if gone and live is None:
                m = gone[0]
                return f"{name} (peer {m.prefix} {m.state})"
        return None

    def _stage_states(self) -> str:
        out = []
        for k in range(self.stages):
            m = self.mesh.member(f"stage-{k}")
            out.append(f"stage-{k} {'missing' if m is None else m.state + ' ' + m.prefix}")
        return ", ".join(out)

    async def on_message(self, src: bytes, msg: Message) -> None:
        if isinstance(msg, Token):
            req = self.requests.get(msg.req_id)
            if req is None:
                return
            req.traces.append(_arrived(msg.trace, msg.sent_at))
            if msg.logits:
                req.logits.append(np.frombuffer(msg.logits, dtype=np.float32).copy())
            if msg.done != "eos":
                req.tokens.append(msg.token)
                req.token_times.append(time.perf_counter())
            if msg.done:
                req.finish_reason = msg.done
            req.changed.set()
        elif isinstance(msg, StageError):
            req = self.requests.get(msg.req_id)
            if req is not None:
                req.error = f"{msg.stage}: {msg.message}"
                req.changed.set()


def summarize(traces: list[tuple[Hop, ...]]) -> list[dict]:
    """Median ms per hop name over a request's steps: where a token's time goes."""
    by_name: dict[tuple[str, str], list[float]] = {}
    for trace in traces:
        for hop in trace:
            by_name.setdefault((hop.kind, hop.name), []).append(hop.ms)
    paths = {(h.kind, h.name): h.path for t in traces for h in t}
    return [{"kind": kind, "name": name, "median_ms": float(np.median(v)), "path": paths[(kind, name)]}
            for (kind, name), v in by_name.items()]
