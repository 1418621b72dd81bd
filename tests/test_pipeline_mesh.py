"""Pipelined generation over real loopback nodes equals the single-process reference."""

from __future__ import annotations

import numpy as np
import pytest
import trio

from meshd.node import NodeOptions
from meshd.pipeline import service
from meshd.pipeline import stage as stage_module
from meshd.pipeline.app import App
from meshd.pipeline.checkpoint import init_checkpoint
from meshd.pipeline.generate import generate
from meshd.pipeline.messages import Activation, HeadInput
from meshd.pipeline.service import NotReady
from meshd.pipeline.stage import StageService
from meshd.testing.inprocess import start_node, start_pipeline

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny preset with 6 layers, so it splits into up to 6 stages."""
    path = tmp_path_factory.mktemp("tiny6")
    init_checkpoint(path, "tiny", seed=0, num_hidden_layers=6)
    return path


def reference(model, max_tokens: int, temperature: float, top_k: int, seed: int) -> dict:
    return generate(model, PROMPT, max_tokens, temperature, top_k, seed, return_logits=True)


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
async def test_pipelined_tokens_and_logits_equal_the_reference(checkpoint, stages):
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, stages, lines)
            orch = nodes[0].app
            for temperature, top_k, seed in ((0.0, 0, 0), (0.9, 20, 7)):
                got = await orch.generate(PROMPT, 12, temperature, top_k, seed, want_logits=True)
                want = reference(checkpoint, 12, temperature, top_k, seed)
                assert got["tokens"] == want["tokens"]
                assert got["text"] == want["text"]
                assert got["logits"].shape == want["logits"].shape
                np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)
            # Where the time went: one compute entry per stage, one transit per hop.
            hops = {(h["kind"], h["name"]) for h in got["timings"]["hops"]}
            assert {("compute", f"stage-{k}") for k in range(stages)} <= hops
            assert ("transit", "orchestrator->stage-0") in hops
            # The orchestrator keeps the traces of steps 0, 4 and 8 of the 12: the others
            # came without one.  Each traced step holds every stage's compute.
            traced = orch.recent_traces[-1]["traces"]
            assert len(traced) == 3
            for trace in traced:
                computed = {name for kind, name, *_ in trace if kind == "compute"}
                assert {f"stage-{k}" for k in range(stages)} <= computed
            nursery.cancel_scope.cancel()


async def test_only_traced_steps_carry_their_trace_from_stage_to_stage_and_every_transit_counts(
        checkpoint, monkeypatch):
    """A step's trace travels between the stages only on one step in TRACE_EVERY; the others
    carry the transit they are on alone, which each node's metrics still count."""
    monkeypatch.setattr(stage_module, "HEAD_SPLIT_MIN_MACS", 0)  # the head input hop as well
    carried: list[tuple[str, int, int]] = []  # (message, step, hops of trace)
    send = App.send

    async def spy(self, dst, *msgs):
        for m in msgs:
            if isinstance(self, StageService) and isinstance(m, (Activation, HeadInput)):
                carried.append((type(m).__name__, m.step, len(m.trace)))
        await send(self, dst, *msgs)

    monkeypatch.setattr(App, "send", spy)
    tokens = 9
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, [])
            got = await nodes[0].app.generate(PROMPT, tokens)
            assert got["tokens"] == reference(checkpoint, tokens, 0.0, 0, 0)["tokens"]
            counted = {k: sum(h.count for (name, _), h in node.app.metrics.transit.items() if name == hop)
                       for k, (node, hop) in enumerate(((nodes[2], "stage-0->stage-1"),
                                                        (nodes[3], "stage-1->stage-2"),
                                                        (nodes[1], "stage-2->stage-0")))}
            nursery.cancel_scope.cancel()
    sent = {(kind, step) for kind, step, _ in carried}
    assert {("Activation", step) for step in range(tokens)} <= sent and ("HeadInput", tokens - 1) in sent
    for kind, step, hops in carried:
        if step % stage_module.TRACE_EVERY:
            assert hops == 1, (kind, step, hops)
        else:
            assert hops > 1, (kind, step, hops)
    # Every step crossed every hop, and each crossing was counted where it arrived.
    assert counted == {0: tokens, 1: tokens, 2: tokens}
    hops = {(h["kind"], h["name"]) for h in got["timings"]["hops"]}
    assert {("compute", "stage-0"), ("compute", "stage-1"), ("compute", "stage-2"),
            ("compute", "stage-0 head"), ("transit", "stage-0->stage-1"), ("transit", "stage-1->stage-2"),
            ("transit", "stage-2->stage-0")} <= hops, hops


@pytest.fixture
def cut_any_head(monkeypatch):
    """Cut the head even for the tiny test model (it is too small to pay for it)."""
    monkeypatch.setattr(stage_module, "HEAD_SPLIT_MIN_MACS", 0)


@pytest.mark.parametrize("stages", [2, 3, 5])
async def test_the_lm_head_cut_between_the_last_stage_and_stage_0_samples_the_same_tokens(
        checkpoint, stages, cut_any_head):
    """Without want_logits, greedy and top-k requests split the head's rows: the last stage
    and stage 0 each compute half and stage 0 samples from the merged shortlists.  The tokens
    are the reference's; temperature without top-k needs every logit and keeps the whole head
    at the last stage."""
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, stages, lines)
            orch = nodes[0].app
            steps = {True: 0, False: 0}  # passes through the pipeline, by whether the head was split
            for temperature, top_k, seed, split in ((0.0, 0, 0, True), (0.9, 20, 7, True), (1.3, 3, 11, True),
                                                    (0.9, 0, 5, False)):
                got = await orch.generate(PROMPT, 16, temperature, top_k, seed)
                steps[split] += len(got["tokens"]) + (got["finish_reason"] == "eos")
                want = reference(checkpoint, 16, temperature, top_k, seed)
                assert got["tokens"] == want["tokens"], (temperature, top_k, seed)
                names = {h["name"] for h in got["timings"]["hops"] if h["kind"] == "compute"}
                halves = {"stage-0 head", f"stage-{stages - 1} head"}
                assert (halves <= names) is split, names
            # Both halves count as head compute (meshd_stage_compute_seconds{phase="head"}).
            assert nodes[1].app.metrics.compute["head"].count == steps[True]
            assert nodes[-1].app.metrics.compute["head"].count == steps[True] + steps[False]
            nursery.cancel_scope.cancel()


async def test_feedback_edge_over_the_relay_still_matches(checkpoint, cut_any_head):
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines, feedback_drop=True)
            last, entry = nodes[3], nodes[1]
            while last.paths.out_path(entry.node_id) != "relay":  # its probes found direct lost
                await trio.sleep(0.05)
            # Two tokens: the feedback edge carries one message, its first; its trace names the
            # relay it took (no stream to stage 0 yet, and the probes say direct is lost).
            first = await nodes[0].app.generate(PROMPT, 2, 0.0, 0, 0)
            feedback = [h for h in first["timings"]["hops"] if h["name"] == "stage-2->stage-0"]
            assert [h["path"] for h in feedback] == ["relay"], first["timings"]["hops"]
            got = await nodes[0].app.generate(PROMPT, 10, 0.0, 0, 0, want_logits=True)
            want = reference(checkpoint, 10, 0.0, 0, 0)
            assert got["tokens"] == want["tokens"]
            np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)
            feedback = [h for h in got["timings"]["hops"] if h["name"] == "stage-2->stage-0"]
            assert feedback and feedback[0]["path"] == "relay"
            # The same with the head cut in two: both halves reach stage 0 over the relay.
            split = await nodes[0].app.generate(PROMPT, 10, 0.9, 20, 3)
            assert split["tokens"] == reference(checkpoint, 10, 0.9, 20, 3)["tokens"]
            feedback = [h for h in split["timings"]["hops"] if h["name"] == "stage-2->stage-0"]
            assert feedback and feedback[0]["path"] == "relay"
            assert not [line for line in lines if line.startswith("meshd member dead")]
            nursery.cancel_scope.cancel()


async def test_four_concurrent_requests_each_equal_their_reference(checkpoint):
    lines: list[str] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines)
            results: dict[int, dict] = {}

            async def one(seed: int) -> None:
                results[seed] = await nodes[0].app.generate(PROMPT, 10, 0.8, 16, seed)

            async with trio.open_nursery() as inner:
                for seed in range(4):
                    inner.start_soon(one, seed)
            for seed in range(4):
                assert results[seed]["tokens"] == reference(checkpoint, 10, 0.8, 16, seed)["tokens"]
            nursery.cancel_scope.cancel()


async def test_tokens_reach_the_orchestrator_several_to_a_message(checkpoint, cut_any_head, monkeypatch):
    """Each message wakes the orchestrator's process; tokens after the first share messages
    (up to TOKEN_BATCH_S apart), and every token still streams, in order."""
    monkeypatch.setattr(stage_module, "TOKEN_BATCH_S", 0.2)  # a slow machine's steps still share
    monkeypatch.setattr(stage_module, "TOKEN_BATCH_LATE_S", 0.2)
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines)
            orch_node = nodes[0]
            streamed: list[int] = []

            async def on_token(token: int) -> None:
                streamed.append(token)

            before = orch_node.data.counters["delivered"]
            got = await orch_node.app.generate(PROMPT, 40, on_token=on_token)
            messages = orch_node.data.counters["delivered"] - before
            assert got["tokens"] == reference(checkpoint, 40, 0.0, 0, 0)["tokens"]
            assert streamed == got["tokens"]
            assert 2 <= messages < len(got["tokens"]) / 2, messages
            waits = [h["name"] for h in got["timings"]["hops"] if h["kind"] == "wait"]
            # the outbox wait is shown as a wait, not counted as transit (a loaded machine may
            # also show a stage's wait for its batcher to run)
            assert "stage-0 outbox" in waits and set(waits) <= {"stage-0 outbox", *(f"stage-{k} batch"
                                                                                   for k in range(3))}
            nursery.cancel_scope.cancel()


async def test_gathered_tokens_stream_while_the_next_step_is_stalled(checkpoint, monkeypatch):
    """Tokens gather at the stage that streams them until a later token leaves with them.
    When the next token is slow to come (here stage-1 holds a step for seconds), a timer
    sends what has gathered after TOKEN_BATCH_LATE_S: a streaming client sees every token
    made so far during the stall, not after it."""
    monkeypatch.setattr(stage_module, "TOKEN_BATCH_S", 60.0)  # no later token sends them: only the timer
    monkeypatch.setattr(stage_module, "TOKEN_BATCH_LATE_S", 0.05)
    stall_at, stall_s = 6, 3.0
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines)
            middle = nodes[2].app  # stage-1: never the stage that streams tokens
            real = middle._activation
            stalled = trio.Event()

            async def stalling(msg, trace=None):
                if msg.step == stall_at and not stalled.is_set():
                    stalled.set()
                    await trio.sleep(stall_s)
                await real(msg, trace)

            middle._activation = stalling
            streamed: list[int] = []

            async def on_token(token: int) -> None:
                streamed.append(token)

            got: dict = {}

            async def run() -> None:
                got.update(await nodes[0].app.generate(PROMPT, 12, on_token=on_token))

            nursery.start_soon(run)
            await stalled.wait()
            await trio.sleep(stall_s / 2)
            want = reference(checkpoint, 12, 0.0, 0, 0)["tokens"]
            assert streamed == want[:stall_at]  # tokens 0..5, in order, while step 6 waits
            while not got:
                await trio.sleep(0.05)
            assert got["tokens"] == want and streamed == want
            nursery.cancel_scope.cancel()


async def test_the_tokens_before_a_stage_error_are_all_streamed(checkpoint, caplog):
    """A stage that fails mid-request: every token it produced before the failure reaches
    the stream before the error does (the orchestrator stops listening at the error)."""
    fail_at = 10
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines)
            last = nodes[-1].app
            real = last._activation

            async def failing(msg):
                if msg.step == fail_at:
                    raise service.PipelineError("injected failure")
                await real(msg)

            last._activation = failing
            streamed: list[int] = []

            async def on_token(token: int) -> None:
                streamed.append(token)

            with pytest.raises(service.PipelineError, match="stage-2: injected failure"):
                await nodes[0].app.generate(PROMPT, 30, on_token=on_token)
            assert streamed == reference(checkpoint, 30, 0.0, 0, 0)["tokens"][:fail_at]
            # The orchestrator's log says which request failed, how far it got, and why.
            said = [r.getMessage() for r in caplog.records if r.name == "meshd.pipeline"]
            assert any(f"failed after {fail_at} of 30 tokens" in m and "injected failure" in m
                       for m in said), said
            nursery.cancel_scope.cancel()


async def test_a_missing_stage_is_named(checkpoint):
    lines: list[str] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            model = str(checkpoint)
            orch = await start_node(nursery, NodeOptions(role="orchestrator", profile="local", stages=2,
                                                         model=model), lines)
            await start_node(nursery, NodeOptions(stage=0, stages=2, profile="local", model=model,
                                                  seeds=[orch.addr]), lines)
            await trio.sleep(1)
            with pytest.raises(NotReady) as info:
                await orch.app.generate(PROMPT, 4)
            assert info.value.missing == ["pp-stage-1", "pp-exit"]
            assert "pp-stage-1 does not resolve" in str(info.value)
            nursery.cancel_scope.cancel()


async def test_a_streamed_generation_hands_every_token_to_the_caller(checkpoint, monkeypatch):
    """The last tokens of a request may land while the orchestrator's wait has just timed
    out (it looks at its route every LOST_CHECK_S): they still reach ``on_token``, in order,
    before the result.  A near-zero interval makes that the usual case."""
    from meshd.pipeline import orchestrator as orchestrator_module

    monkeypatch.setattr(orchestrator_module, "LOST_CHECK_S", 1e-6)
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines)
            orch = nodes[0].app
            for _ in range(5):
                streamed: list[int] = []

                async def on_token(token: int, into: list[int] = streamed) -> None:
                    into.append(token)

                got = await orch.generate(PROMPT, 12, on_token=on_token)
                assert streamed == got["tokens"] and len(streamed) == 12
            nursery.cancel_scope.cancel()
