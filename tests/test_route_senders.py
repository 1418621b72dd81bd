"""A request hears only from the nodes that serve it.

Every mesh member can open a data stream to every other, so a member that is not on a
request's route (another pipeline's stage, a replica the request does not use, a
misbehaving host) could otherwise steer it: make stage 0 sample from a shortlist of its
choosing, end it at a middle stage, or hand the orchestrator tokens of its own.  Each
attack below is made while a real request runs, from a node id that is not on its route,
and the request still ends with the reference's tokens.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import trio

from meshd.net.faults import Faults
from meshd.pipeline import stage as stage_module
from meshd.pipeline.generate import generate
from meshd.pipeline.messages import Activation, HeadPart, Release, Sampling, Token
from meshd.pipeline.model import head_cut
from meshd.testing.inprocess import start_pipeline

PROMPT = "Once upon a time"
TOKENS = 40
STRANGER = os.urandom(32)  # a node id on no route


def reference(checkpoint, max_tokens: int) -> list[int]:
    return generate(checkpoint, PROMPT, max_tokens, 0.0, 0, 0)["tokens"]


@pytest.fixture
def cut_any_head(monkeypatch):
    """Cut the LM head between stage 0 and the last stage even for the tiny test model."""
    monkeypatch.setattr(stage_module, "HEAD_SPLIT_MIN_MACS", 0)


async def _running(nursery, checkpoint, lines):
    """A 3-stage pipeline whose stage 1 holds each message 15 ms (a request of TOKENS tokens
    runs for more than half a second), and a request running on it: (nodes, its wire id,
    a scope whose ``result`` is the request's result when it ends)."""
    nodes = await start_pipeline(nursery, checkpoint, 3, lines,
                                 stage_options={1: {"faults": Faults.parse(["delay:15"])}})
    orch = nodes[0].app
    done: dict = {}

    async def run() -> None:
        done.update(await orch.generate(PROMPT, TOKENS))

    nursery.start_soon(run)
    while not orch.requests or not next(iter(orch.requests.values())).tokens:
        await trio.sleep(0.005)
    return nodes, next(iter(orch.requests)), done


async def _finished(done: dict) -> dict:
    while not done:
        await trio.sleep(0.02)
    return done


async def test_head_parts_from_a_node_off_the_route_choose_no_token(checkpoint, cut_any_head, caplog):
    """Stage 0 samples from its own rows of the head and the last stage's shortlist: a
    stranger's shortlist for the coming steps, whose one entry outweighs every logit, is
    ignored, counted and said once."""
    caplog.set_level(logging.WARNING)
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes, wire_id, done = await _running(nursery, checkpoint, lines)
            orch, stage0 = nodes[0].app, nodes[1].app
            vocab = stage0.model.config.vocab_size
            loud = np.array([vocab - 1], dtype="<i8").tobytes(), np.array([1e6], dtype="<f4").tobytes()
            assert vocab - 1 >= head_cut(vocab)  # an id the last stage's shortlist may hold
            first = orch.requests[wire_id].next_step + 2  # steps stage 0 has not sampled yet
            for step in range(first, TOKENS):
                await stage0.on_message(STRANGER, HeadPart(wire_id, orch.mesh.node_id, step, *loud, 0.1))
            got = await _finished(done)
            assert got["tokens"] == reference(checkpoint, TOKENS)
            assert stage0.metrics.not_from_route == TOKENS - first
            said = [r.getMessage() for r in caplog.records if "does not serve it" in r.getMessage()]
            assert len(said) == 1 and "HeadPart" in said[0] and STRANGER.hex()[:8] in said[0], said
            nursery.cancel_scope.cancel()


async def test_a_release_from_a_node_off_the_route_ends_no_request(checkpoint):
    """A Release ends a request at a stage only from its orchestrator or the stage before."""
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes, wire_id, done = await _running(nursery, checkpoint, lines)
            middle = nodes[2].app
            await middle.on_message(STRANGER, Release(wire_id))
            assert wire_id in middle.jobs
            got = await _finished(done)
            assert got["tokens"] == reference(checkpoint, TOKENS) and got["failovers"] == []
            assert middle.metrics.not_from_route == 1
            nursery.cancel_scope.cancel()


async def test_a_token_from_a_node_off_the_route_never_reaches_the_caller(checkpoint, caplog):
    """The orchestrator takes a request's tokens and errors only from the nodes of its route."""
    caplog.set_level(logging.WARNING)
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes, wire_id, done = await _running(nursery, checkpoint, lines)
            orch = nodes[0].app
            req = orch.requests[wire_id]
            sampling = Sampling(TOKENS, 0.0, 0, 0, False)
            for step in range(req.next_step, req.next_step + 3):  # the next ones, before the real
                await orch.on_message(STRANGER, Token(wire_id, orch.mesh.node_id, step, 1, 0, "", b"",
                                                      sampling, 0.0, ()))
            got = await _finished(done)
            assert got["tokens"] == reference(checkpoint, TOKENS)
            assert orch.metrics.not_from_route == 3
            said = [r.getMessage() for r in caplog.records if "does not serve it" in r.getMessage()]
            assert len(said) == 1 and "Token" in said[0] and STRANGER.hex()[:8] in said[0], said
            nursery.cancel_scope.cancel()


async def test_a_node_that_knows_the_callers_request_id_cannot_claim_end_or_fail_the_request(checkpoint):
    """A stage holds a request by its wire id, which carries 64 random bits fresh for each
    attempt.  A member off the route that knows the caller's id (it chose it, or saw an
    earlier attempt) guesses every form the id could take on the wire: it starts each at
    every stage first, naming itself as the stage before, then sends Releases and steps
    ahead of the prefill (which would draw lost-state errors and fail the request over).
    The request runs on the route the orchestrator picked, with no failover."""
    lines: list[str] = []
    guesses = ["victim", *(f"victim.{n}" for n in range(4))]
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines,
                                         stage_options={1: {"faults": Faults.parse(["delay:15"])}})
            orch, stages = nodes[0].app, [n.app for n in nodes[1:]]
            dims = stages[0].model.config.hidden_size
            sampling = Sampling(TOKENS, 0.0, 0, 0, False)

            def forged(wid: str, k: int, pos: int) -> Activation:
                route = tuple(STRANGER if j == k - 1 else s.mesh.node_id for j, s in enumerate(stages))
                return Activation(wid, orch.mesh.node_id if k else STRANGER, pos, pos, 1, dims,
                                  np.zeros(dims, "<f4").tobytes(), (), sampling, 0.0, (), route)

            for wid in guesses:
                for k, stage in enumerate(stages):
                    await stage.on_message(STRANGER, forged(wid, k, 0))
            done: dict = {}

            async def run() -> None:
                done.update(await orch.generate(PROMPT, TOKENS, request_id="victim", token_timeout=10))

            nursery.start_soon(run)
            while not orch.requests:
                await trio.sleep(0.001)
            for wid in guesses:
                for k, stage in enumerate(stages):
                    await stage.on_message(STRANGER, Release(wid))
                    await stage._on_message(STRANGER, forged(wid, k, 7))
            got = await _finished(done)
            assert got["tokens"] == reference(checkpoint, TOKENS) and got["failovers"] == []
            nursery.cancel_scope.cancel()
