"""Continuous batching: concurrent requests share each stage's forward pass, and each still
gets its own reference's tokens.

The rule for what counts as the same (README, "Correctness and throughput"): a request alone, or with
``--max-batch 1``, is bit-identical to `meshd generate`.  Batched, a row's floats may
differ in the last bits with the batch (BLAS picks kernels by shape), so at every step
max |delta logits| <= 1e-4 * max |reference logits|, and the same token wherever the
reference's top-2 logit margin exceeds 1e-3.
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import trio

from meshd.launch.checks import Reference
from meshd.launch.report import Generated, Outcome, summary
from meshd.net.faults import Faults
from meshd.pipeline import model as model_module
from meshd.pipeline import stage as stage_module
from meshd.pipeline.admission import TooLarge
from meshd.pipeline.api import Busy, PipelineError
from meshd.pipeline.app import App
from meshd.pipeline.checkpoint import init_checkpoint
from meshd.pipeline.generate import LOGITS_TOLERANCE as TOLERANCE
from meshd.pipeline.generate import NEAR_TIE, diverges, generate, near_ties
from meshd.pipeline.messages import Activation, Batch, HeadPart, Hop, Sampling, Token
from meshd.pipeline.model import StageModel
from meshd.pipeline.stage import MIN_GROUP, SPLIT_GROUP, group_size
from meshd.testing.inprocess import start_pipeline

PROMPTS = ["Once upon a time", "A", "The quick brown fox jumps over the lazy dog, and then",
           "In a hole in the ground there lived", "x" * 40, "Hello, world"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny6")
    init_checkpoint(path, "tiny", seed=0, num_hidden_layers=6)
    return path


def requests(n: int) -> list[dict]:
    """Mixed prompts, lengths and sampling: greedy, temperature with top-k, top-p."""
    out = []
    for i in range(n):
        kind = i % 3
        out.append(dict(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=4 + (i * 7) % 21,
                        temperature=0.0 if kind == 0 else 0.8, top_k=0 if kind != 1 else 20, seed=i,
                        top_p=0.9 if kind == 2 else 1.0))
    return out


def same_by_the_rule(got: dict, want: dict, greedy: bool) -> int:
    """Assert the rule step by step; the near-tie steps seen.  Past a token that differs at a
    near-tie, the two runs continue from different texts: nothing more to compare."""
    near = 0
    for step, (g, w) in enumerate(zip(got["logits"], want["logits"], strict=False)):
        assert np.max(np.abs(g - w)) <= TOLERANCE * np.max(np.abs(w)), f"step {step}"
        top2 = np.sort(w)[-2:]
        tie = top2[1] - top2[0] <= NEAR_TIE
        near += tie
        if step < len(want["tokens"]) and got["tokens"][step:step + 1] != want["tokens"][step:step + 1]:
            margin = top2[1] - top2[0]
            assert greedy and tie, f"step {step}: token {got['tokens'][step:step + 1]} against " \
                                   f"{want['tokens'][step:step + 1]}, reference margin {margin:.2e}"
            return near
    assert got["tokens"] == want["tokens"]
    return near


async def test_sixteen_concurrent_requests_each_meet_the_rule_and_share_batches(checkpoint):
    specs = requests(16)
    lines: list[str] = []
    results: list[dict | None] = [None] * len(specs)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines)

            async def one(i: int) -> None:
                results[i] = await nodes[0].app.generate(**specs[i], want_logits=True)

            async with trio.open_nursery() as clients:
                for i in range(len(specs)):
                    clients.start_soon(one, i)
            sizes = [nodes[k + 1].app.metrics.batch for k in range(3)]
            nursery.cancel_scope.cancel()
    near = 0
    for spec, got in zip(specs, results, strict=True):
        assert got is not None
        want = generate(checkpoint, spec["prompt"], spec["max_tokens"], spec["temperature"], spec["top_k"],
                        spec["seed"], top_p=spec["top_p"], return_logits=True)
        near += same_by_the_rule(got, want, spec["temperature"] == 0)
    print(f"near-tie steps: {near}")
    # The steps did share forward passes: on average more than one request per batch.
    assert all(h.sum > h.count for h in sizes), [(h.sum, h.count) for h in sizes]


async def test_a_batch_travels_each_hop_as_one_message_and_the_cut_head_samples_every_row(checkpoint,
                                                                                            monkeypatch):
    """Greedy and top-k requests cut the LM head between the last stage and stage 0: a
    batch's activations go on as one Batch, its head inputs as one, its shortlists as one
    HeadParts; every row still gets its own reference's tokens, and its own trace."""
    monkeypatch.setattr(stage_module, "HEAD_SPLIT_MIN_MACS", 0)  # cut even the tiny model's head
    sent: list[tuple[str, ...]] = []
    send = App.send

    async def spy(self, dst, *msgs):
        sent.append(tuple(type(m).__name__ + (" head" if isinstance(m, Batch) and m.head else "")
                          for m in msgs))
        await send(self, dst, *msgs)

    monkeypatch.setattr(App, "send", spy)
    specs = [dict(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=6 + i % 5, temperature=0.0 if i % 2 else 0.8,
                  top_k=0 if i % 2 else 20, seed=i) for i in range(12)]
    results: list[dict | None] = [None] * len(specs)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, [])

            async def one(i: int) -> None:
                results[i] = await nodes[0].app.generate(**specs[i])

            async with trio.open_nursery() as clients:
                for i in range(len(specs)):
                    clients.start_soon(one, i)
            nursery.cancel_scope.cancel()
    for spec, got in zip(specs, results, strict=True):
        assert got is not None
        want = generate(checkpoint, **spec, return_logits=True)
        parted = diverges(got["tokens"], want["tokens"])
        assert parted is None or (spec["temperature"] == 0 and parted in near_ties(want["logits"])), spec
        hops = {(h["kind"], h["name"]) for h in got["timings"]["hops"]}
        assert {("compute", "stage-0"), ("compute", "stage-1"), ("compute", "stage-2"),
                ("compute", "stage-0 head"), ("compute", "stage-2 head"), ("transit", "stage-0->stage-1"),
                ("transit", "stage-1->stage-2"), ("transit", "stage-2->stage-0")} <= hops, hops
    kinds = {kind for msgs in sent for kind in msgs}
    assert {"Batch", "Batch head", "HeadParts"} <= kinds, kinds
    # What one batch sends to one node is one message: never one per row.
    assert not [msgs for msgs in sent if len(msgs) > 1 and set(msgs) & {"Activation", "HeadInput", "HeadPart"}
                and "Release" not in msgs]


async def test_one_request_alone_is_bit_identical_batched_or_not(checkpoint):
    want = generate(checkpoint, PROMPTS[0], 12, return_logits=True)
    for max_batch in (1, 16):
        lines: list[str] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nodes = await start_pipeline(nursery, checkpoint, 3, lines, max_batch=max_batch)
                got = await nodes[0].app.generate(PROMPTS[0], 12, want_logits=True)
                nursery.cancel_scope.cancel()
        assert got["tokens"] == want["tokens"]
        np.testing.assert_array_equal(got["logits"], want["logits"])


async def test_a_long_prefill_runs_in_chunks_and_the_decodes_in_flight_run_between_them(checkpoint,
                                                                                     monkeypatch):
    """A prompt of several chunks arrives while another request decodes: each stage runs the
    prompt chunk by chunk, the running request's decode passes go between the chunks, and
    both requests get their references' tokens."""
    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 16)
    long_prompt = "Pipeline stages pass activations along. " * 3  # 121 rows: 8 chunks
    want_long = generate(checkpoint, long_prompt, 6, return_logits=True)
    want_short = generate(checkpoint, PROMPTS[0], 120, return_logits=True)
    passes: list[tuple[int, int, int, int]] = []  # (stage's first layer, cache, position, rows), in order
    one_pass = StageModel.forward_batch

    def counted(self, hidden, parts):
        for cache, pos in parts:
            passes.append((self.layer_range.start, id(cache), pos, hidden.shape[0]))
        return one_pass(self, hidden, parts)

    monkeypatch.setattr(StageModel, "forward_batch", counted)
    lines: list[str] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines)
            got: dict[str, dict] = {}

            async def short() -> None:
                got["short"] = await nodes[0].app.generate(PROMPTS[0], 120, want_logits=True)

            async with trio.open_nursery() as clients:
                clients.start_soon(short)
                while not any(job.cache.length > 20 for job in nodes[2].app.jobs.values()):
                    await trio.sleep(0.001)  # decoding: its prompt is 17 rows
                got["long"] = await nodes[0].app.generate(long_prompt, 6, want_logits=True)
            nursery.cancel_scope.cancel()
    same_by_the_rule(got["long"], want_long, greedy=True)
    same_by_the_rule(got["short"], want_short, greedy=True)
    between = 0
    for first in sorted({f for f, *_ in passes}):
        here = [(cache, pos, rows) for f, cache, pos, rows in passes if f == first]
        long_cache = next(cache for cache, pos, rows in here if pos == 112 and rows == 9)
        chunks = [i for i, (cache, pos, rows) in enumerate(here) if cache == long_cache and pos < 121]
        # the prompt, cut where one process cuts it
        assert [here[i][1:] for i in chunks] == [(16 * k, 16) for k in range(7)] + [(112, 9)], here
        between += sum(cache != long_cache for cache, _, _ in here[chunks[0]:chunks[-1]])
    assert between > 0, "no decode pass ran between a prompt's chunks at any stage"


@pytest.mark.parametrize("prompt, first_chunk", [("Pipeline stages pass activations along. " * 3, 16),
                                                 ("Pipeline stage", 15)])
async def test_a_prompt_whose_caller_left_stops_at_the_next_chunk(checkpoint, monkeypatch, prompt,
                                                                  first_chunk):
    """The caller of a prompt leaves while stage 0 runs its first chunk (of several, or its
    only one): the Release reaches stage 0, which computes no further chunk and sends nothing
    on, so no stage after it holds a cache for the request."""
    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 16)
    passes: list[tuple[int, int]] = []  # (stage's first layer, rows)
    one_pass = StageModel.forward_batch
    left = trio.Event()
    nodes: list = []

    def counted(self, hidden, parts):
        passes.append((self.layer_range.start, hidden.shape[0]))
        if self.layer_range.start == 0 and hidden.shape[0] == first_chunk and not left.is_set():
            trio.from_thread.run_sync(left.set)  # the caller leaves now; this chunk finishes
            trio.from_thread.run(released_at_stage_0)
        return one_pass(self, hidden, parts)

    async def released_at_stage_0() -> None:
        while nodes[1].app.jobs:
            await trio.sleep(0.001)

    monkeypatch.setattr(StageModel, "forward_batch", counted)
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes.extend(await start_pipeline(nursery, checkpoint, 3, lines))
            passes.clear()
            async with trio.open_nursery() as caller:
                caller.start_soon(nodes[0].app.generate, prompt, 6)
                await left.wait()
                caller.cancel_scope.cancel()
            await released_at_stage_0()
            await trio.sleep(0.2)  # what stage 0 would send on has had time to arrive
            assert not any(node.app.jobs for node in nodes[1:])
            nursery.cancel_scope.cancel()
    assert passes == [(0, first_chunk)], passes  # one chunk at stage 0, nothing after it anywhere


async def test_past_the_running_limit_requests_wait_their_turn_and_all_complete(checkpoint):
    """Two may run; the others wait in the queue (the wait shows in their traces) and none is
    evicted or refused."""
    lines: list[str] = []
    results: list[dict] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines, max_running=2, max_queued=16)
            orch = nodes[0].app
            gauges: list[tuple[float, float]] = []  # (running, waiting) as /metrics says

            def read() -> tuple[float, float]:
                now = {f.name: f.series[0][1] for f in orch.metrics.families()
                       if f.name in ("meshd_requests_running", "meshd_requests_waiting")}
                return now["meshd_requests_running"], now["meshd_requests_waiting"]

            async def one(i: int) -> None:
                results.append(await orch.generate(PROMPTS[i % len(PROMPTS)], 8, seed=i))
                gauges.append(read())

            async with trio.open_nursery() as clients:
                for i in range(12):
                    clients.start_soon(one, i)
            assert orch.admission.running == 0 and not orch.admission.waiting
            assert read() == (0, 0)
            nursery.cancel_scope.cancel()
    # While the first ones ended, two ran and the rest waited; the queue emptied as they went.
    assert max(r for r, _ in gauges) <= 2 and max(w for _, w in gauges) >= 8
    assert len(results) == 12 and all(r["finish_reason"] in ("length", "eos") for r in results)
    waited = [r for r in results if r["timings"]["queued_s"] > 0]
    assert len(waited) >= 12 - 2
    assert all(any(h["kind"] == "wait" and h["name"] == "orchestrator queue" for h in r["timings"]["hops"])
               for r in waited)


async def test_past_the_queue_a_request_gets_503_with_retry_after_counted_and_doctor_says_busy(checkpoint,
                                                                                              capsys):
    """One may run and one wait: a third HTTP request gets 503 with Retry-After at once (its
    client can retry; nothing of it starts), ``/metrics`` counts it as ``busy``, and ``meshd
    doctor`` says the queue is full without calling the mesh broken.  The first two complete."""
    import httpx

    from meshd.cli import main

    lines: list[str] = []
    done: list[httpx.Response] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            # stage-1's writes each leave 15 ms late: the running request takes seconds, so it is
            # still running, and the other still waiting, while doctor looks.
            nodes = await start_pipeline(nursery, checkpoint, 3, lines, max_running=1, max_queued=1,
                                         dashboard="127.0.0.1:0",
                                         stage_options={1: {"faults": Faults.parse(["delay:15"])}})
            orch, url = nodes[0].app, nodes[0].dashboard_url
            while await trio.to_thread.run_sync(main, ["doctor", url, "--json"]):
                await trio.sleep(0.2)  # until every node's first path summary arrived
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                async def one(prompt: str) -> None:
                    body = {"prompt": prompt, "max_tokens": 120}
                    done.append(await client.post("/api/generate", json=body))

                async with trio.open_nursery() as clients:
                    for prompt in PROMPTS[:2]:
                        clients.start_soon(one, prompt)
                    while not (orch.admission.running and orch.admission.waiting):
                        await trio.sleep(0.005)
                    body = {"prompt": PROMPTS[2], "max_tokens": 4}
                    refused = await client.post("/v1/completions", json=body)
                    capsys.readouterr()
                    code = await trio.to_thread.run_sync(main, ["doctor", url])
                    doctor = capsys.readouterr().out
                    code_json = await trio.to_thread.run_sync(main, ["doctor", url, "--json"])
                    load = json.loads(capsys.readouterr().out)["load"]
                    await trio.to_thread.run_sync(main, ["doctor", nodes[2].dashboard_url])
                    stage_doctor = capsys.readouterr().out  # stage-1's view: what it holds
                metrics = (await client.get("/metrics")).text
            nursery.cancel_scope.cancel()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["message"].startswith("busy: 1 requests running and 1 waiting")
    assert 'meshd_requests_total{outcome="busy"} 1' in metrics
    assert code == 0 and code_json == 0, doctor  # a full queue is load, not a fault
    assert "busy: 1 running (--max-running 1), 1 waiting (--max-queued 1)" in doctor, doctor
    assert "the queue is full: new requests get 503 with Retry-After; 1 refused as busy since start" in doctor
    assert (load["running"], load["waiting"], load["refused_busy"]) == (1, 1, 1)
    assert 0 < load["kv_used_mb"] <= load["kv_budget_mb"]
    assert "load: 1 request held, KV cache " in stage_doctor
    assert " of 1024 MB (--kv-budget-mb)" in stage_doctor
    assert [r.status_code for r in done] == [200, 200]


async def test_a_stage_with_less_kv_budget_than_the_orchestrator_makes_starts_wait_not_fail(checkpoint):
    """The orchestrator admits by its own --kv-budget-mb; stage-1's is smaller (a host with less
    memory).  The requests stage-1 has no room for wait there for a running one to end, the
    wait a step of their traces, instead of failing with 503; stage-1 never holds more than
    its budget, and every request gets its reference's tokens."""
    lines: list[str] = []
    results: list[dict] = []
    peak = [0]
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines, max_batch=1,
                                         stage_options={1: {"kv_budget_mb": 1}})
            orch, stage1 = nodes[0].app, nodes[2].app
            size = stage1.model.cache_bytes(stage1.model.config.max_position_embeddings)
            assert 12 * size > stage1.kv_budget >= size, "the budget must hold one request, not all"

            async def watch() -> None:
                while True:
                    peak[0] = max(peak[0], stage1.kv_in_use())
                    await trio.sleep(0)

            nursery.start_soon(watch)
            prompt_len = len(orch.tokenizer.encode(PROMPTS[0]))
            max_tokens = stage1.model.config.max_position_embeddings - prompt_len - 1

            async def one(i: int) -> None:
                results.append(await orch.generate(PROMPTS[0], max_tokens, seed=i))

            async with trio.open_nursery() as clients:
                for i in range(12):
                    clients.start_soon(one, i)
            waited = stage1.counters["waited_for_room"]
            room = [f for f in stage1.metrics.families() if f.name == "meshd_stage_room_wait_seconds"]
            nursery.cancel_scope.cancel()
    assert len(results) == 12 and waited > 0
    assert room[0].series[0][1].count == waited  # /metrics counts each start that waited
    assert peak[0] <= stage1.kv_budget
    want = generate(str(checkpoint), PROMPTS[0], max_tokens)["tokens"]
    assert all(r["tokens"] == want for r in results)
    assert sum(any(h["kind"] == "wait" and h["name"] == "stage-1 room" for h in r["timings"]["hops"])
               for r in results) == waited


async def test_a_start_without_room_in_time_fails_naming_the_stage_and_one_whose_caller_left_stops_waiting(
        checkpoint, monkeypatch, caplog):
    """While stage-1's budget is held by a request that runs on, a start waits there, and fails
    after ROOM_WAIT_S with that stage's reason; one cancelled while it waits (its Release
    reaches stage-1) ends its wait there: no failure is reported for it when the wait would
    have run out.  A start bigger than the whole budget fails at once."""
    monkeypatch.setattr(stage_module, "ROOM_WAIT_S", 1.0)
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines, max_batch=1)
            orch, stage1 = nodes[0].app, nodes[2].app
            stage1.kv_budget = stage1.model.cache_bytes(64)
            with pytest.raises(TooLarge) as info:  # a ValueError: the API's 400
                await orch.generate(PROMPTS[0], 100)  # 100 positions and more: never fits
            too_big = str(info.value)
            # A request that runs on (its route holds its caches; no step of it comes) fills it.
            now, route = trio.current_time(), tuple(n.app.mesh.node_id for n in nodes[1:])
            stage1.jobs["runs-on"] = stage_module._Job("runs-on", orch.mesh.node_id, route,
                                                       stage1.model.new_cache(64), now, now)
            with pytest.raises(Busy) as info:  # the API's 503 with Retry-After
                await orch.generate(PROMPTS[0], 8)
            failed = str(info.value)
            errors = stage1.counters["errors"]
            caplog.clear()
            async with trio.open_nursery() as clients:
                clients.start_soon(orch.generate, PROMPTS[1], 8)
                while stage1.counters["waited_for_room"] < 2:
                    await trio.sleep(0.01)
                clients.cancel_scope.cancel()  # its caller leaves: the orchestrator releases it
            await trio.sleep(1.5)  # past the wait it would have had
            after = stage1.counters["errors"]
            nursery.cancel_scope.cancel()
    assert "is more than this stage's whole --kv-budget-mb" in too_big and too_big.startswith("stage-1: ")
    # The request is named by the caller's id; the wire id stays between the request's nodes.
    assert not re.search(r"\.\d+\.[0-9a-f]{16}", too_big + failed), (too_big, failed)
    assert failed.startswith("stage-1: no room for request ") and "within 1.0 s" in failed, failed
    assert "held by 1 requests (--kv-budget-mb)" in failed
    assert after == errors, "the request whose caller left still waited and failed at stage-1"
    assert not [r for r in caplog.records if "no room" in r.getMessage()]


async def test_a_client_that_disconnects_cancels_its_request_running_or_queued(checkpoint, caplog):
    """Two HTTP clients give up (a timeout, Ctrl-C): one whose request runs, one whose request
    waits behind it.  Both requests end there: the running one frees its slot and every
    stage's state for it well before its max_tokens, the queued one never starts, both count
    as cancelled, and the next request is served.  A step still on its way when the end
    lands is dropped quietly, not reported as a stage that lost its state."""
    import httpx

    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines, max_running=1,
                                         dashboard="127.0.0.1:0")
            orch, stages = nodes[0].app, [n.app for n in nodes[1:]]
            async with httpx.AsyncClient(base_url=nodes[0].dashboard_url, timeout=60) as client:
                async def give_up(prompt: str) -> None:
                    await client.post("/api/generate", json={"prompt": prompt, "max_tokens": 100})
                    raise AssertionError("a request ran to its end")

                async with trio.open_nursery() as clients:
                    for prompt in PROMPTS[:2]:
                        clients.start_soon(give_up, prompt)
                    while not (orch.admission.waiting and any(r["tokens"] >= 2 for r in orch.active())):
                        await trio.sleep(0.005)
                    clients.cancel_scope.cancel()
                while orch.admission.running or orch.admission.waiting or any(s.jobs for s in stages):
                    await trio.sleep(0.005)
                generated = orch.metrics.generation_tokens
                after = await client.post("/api/generate", json={"prompt": PROMPTS[2], "max_tokens": 3})
            outcomes = dict(orch.metrics.requests)
            nursery.cancel_scope.cancel()
    assert generated < 100, "the request ran on after its client left"
    assert outcomes["cancelled"] == 2 and outcomes["length"] == 1, outcomes  # the last request's
    assert after.status_code == 200 and len(after.json()["tokens"]) == 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "meshd.pipeline" in r.name], \
        [r.getMessage() for r in caplog.records]


async def test_a_step_arriving_after_its_request_ended_is_dropped_and_a_stranger_step_is_lost_state(
        checkpoint):
    """Steps of a request that ended here (sent before the end was known) are dropped without
    a word to the orchestrator; a step of a request this stage never held still says the
    stage has no state for it (the orchestrator replays it); and a new start of an ended
    request (a failover's replay) runs."""
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines)
            orch, stage0, stage1 = nodes[0].app, nodes[1].app, nodes[2].app
            result = await orch.generate(PROMPTS[0], 3)
            told: list = []

            async def tell(origin, error) -> None:
                told.append(error)

            stage0._tell = stage1._tell = tell
            (ended,) = stage0._ended  # the id its one attempt went by on the wire
            sampling = Sampling(3, 0.0, 0, 0, False)
            origin = orch.mesh.node_id
            route = tuple(n.app.mesh.node_id for n in nodes[1:])
            hidden = bytes(4 * 64)
            late = [(stage0, Token(ended, origin, 1, 5, 9, "", b"", sampling, 0.0, ())),
                    (stage0, HeadPart(ended, origin, 2, b"", b"", 0.1)),
                    (stage1, Activation(ended, origin, 9, 2, 1, 64, hidden, (), sampling, 0.0, (), route))]
            for stage, msg in late:
                await stage._on_message(origin, msg)
            assert told == []
            assert (stage0.counters["late_after_end"], stage1.counters["late_after_end"]) == (2, 1)
            stranger = Token("0123456789ab", origin, 1, 5, 9, "", b"", sampling, 0.0, ())
            await stage0._on_message(origin, stranger)
            assert [e.message for e in told] == ["has no KV cache for request 0123456789ab at step 2 "
                                                 "(did this stage restart?)"]
            restarted = Activation(ended, origin, 0, 0, 0, 0, b"", (1, 5), sampling, 0.0, (), route)
            await stage0._on_message(origin, restarted)
            assert ended in stage0.jobs
            nursery.cancel_scope.cancel()
    assert result["finish_reason"] == "length"


async def test_a_batch_row_that_is_not_a_running_requests_next_step_is_handled_as_its_own_message(
        checkpoint):
    """A batch from the stage before goes to the batcher row by row with one look at each
    row's request; a row of a request that ended here is dropped as late, and a row of a
    request this stage never held says so to its orchestrator, as each would alone."""
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines)
            orch, stage1 = nodes[0].app, nodes[2].app
            await orch.generate(PROMPTS[0], 3)
            (ended,) = stage1._ended  # the id its one attempt went by on the wire
            told: list = []

            async def tell(origin, error) -> None:
                told.append(error)

            stage1._tell = tell
            stage1._batching = lambda: True  # as while other requests decode here
            sampling = Sampling(3, 0.0, 0, 0, False)
            origin = orch.mesh.node_id
            route = tuple(n.app.mesh.node_id for n in nodes[1:])
            rows = [(req_id, origin, 9, 2, sampling, route, ()) for req_id in (ended, "0123456789ab")]
            hop = Hop("transit", "stage-0->stage-1", 0.0, "direct")
            batch = Batch.of(False, rows, bytes(4 * 64 * 2), 64, 0.0, hop)
            await stage1.on_rows(origin, batch)
            assert stage1.counters["late_after_end"] == 1
            assert [e.message for e in told] == ["has no KV cache for request 0123456789ab at "
                                                 "position 9 (did this stage restart?)"]
            assert stage1._ready == []  # neither went to the batcher
            nursery.cancel_scope.cancel()


async def test_steps_that_do_not_follow_a_requests_cache_are_lost_state_in_one_line_not_a_traceback(
        checkpoint, caplog):
    """Steps resent to a restarted stage from before its restart (a prompt, then rows past
    it that skip some) find state that is not theirs: the stage says once that it lost the
    request, naming its position and the cache's, and lets that state go, so the orchestrator
    replays it.  Rows past the end of a cache they follow fail the request, and leave the
    cache as it was."""
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines)
            orch, stage1 = nodes[0].app, nodes[2].app
            told: list = []

            async def tell(origin, error) -> None:
                told.append(error)

            stage1._tell = tell
            sampling = Sampling(32, 0.0, 0, 0, False)
            origin = orch.mesh.node_id
            route = tuple(n.app.mesh.node_id for n in nodes[1:])

            async def send(pos: int, step: int, rows: int) -> None:
                hidden = bytes(4 * 64 * rows)
                msg = Activation("r1", origin, pos, step, rows, 64, hidden, (), sampling, 0.0, (), route)
                await stage1._on_message(origin, msg)

            await send(0, 0, 11)
            assert stage1.jobs["r1"].cache.length == 11
            size = stage1.jobs["r1"].cache.max_seq
            cache = f"does not follow its cache (11 of {size} filled)"
            await send(11, 1, 40)
            # The error names the stage once: in its ``stage``, which the orchestrator and the
            # stage's log put before the message.
            assert [(e.stage, e.message, e.peer) for e in told] == [
                ("stage-1", f"request r1 step 1 at position 11 (40 rows) {cache}", b"")]
            assert stage1.jobs["r1"].cache.length == 11
            for pos, rows in ((12, 2), (13, 1)):
                await send(pos, 1, rows)
            assert [(e.message, e.peer) for e in told[1:]] == [
                (f"request r1 step 1 at position 12 (2 rows) {cache}",
                 stage1.mesh.node_id)]  # lost here: replay it (said once)
            assert "r1" not in stage1.jobs  # its stale state holds no memory while the replay comes
            await send(0, 0, 11)  # the replay starts it again
            assert stage1.jobs["r1"].cache.length == 11
            assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
            nursery.cancel_scope.cancel()


async def test_a_hundred_concurrent_http_requests_all_complete_within_the_kv_budget(checkpoint):
    """Past --max-running the requests wait (none is refused: the queue holds them, and none
    is evicted), and what each stage holds stays within its KV budget."""
    import httpx

    lines: list[str] = []
    peaks = [0, 0, 0]
    budget_mb = 8
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines, max_running=16,
                                         kv_budget_mb=budget_mb, dashboard="127.0.0.1:0")
            stages = [n.app for n in nodes[1:]]

            async def watch() -> None:
                while True:
                    for k, stage in enumerate(stages):
                        peaks[k] = max(peaks[k], stage.kv_in_use())
                    await trio.sleep(0.01)

            nursery.start_soon(watch)
            statuses: list[int] = []
            async with httpx.AsyncClient(base_url=nodes[0].dashboard_url, timeout=200) as client:
                async def one(i: int) -> None:
                    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 4 + i % 13, "seed": i,
                            "temperature": 0.0 if i % 2 else 0.7}
                    r = await client.post("/api/generate", json=body)
                    statuses.append(r.status_code)
                    assert r.status_code == 200, r.text
                    assert r.json()["finish_reason"] in ("length", "eos")

                async with trio.open_nursery() as clients:
                    for i in range(100):
                        clients.start_soon(one, i)
            holding = [(s.metrics.holding(), s.counters["dropped_orphans"]) for s in stages]
            nursery.cancel_scope.cancel()
    assert statuses == [200] * 100
    assert all(0 < peak <= budget_mb << 20 for peak in peaks), peaks
    assert holding == [((0, 0), 0)] * 3  # every cache released, none dropped
    print(f"peak KV cache per stage with up to 16 requests in flight: {[p / 2**20 for p in peaks]} MiB")


@pytest.mark.parametrize("value, words", [("0", "'0' must be at least 1"),
                                          ("4097", "'4097' must be at most 4096"),
                                          ("many", "'many' is not a whole number")])
def test_run_refuses_a_max_batch_no_batch_message_can_carry_in_one_line(value, words):
    """A batch crosses each hop as one message of at most MAX_BATCH_ROWS rows."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "meshd", "run", "--max-batch", value],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"argument --max-batch: {words}" in out.stderr and "Traceback" not in out.stderr


def test_the_rule_allows_a_different_token_only_at_a_near_tie():
    logits = np.array([[0.0, 5.0, 1.0], [2.0, 2.0005, 0.0], [1.0, 0.0, 3.0]], dtype=np.float32)
    assert near_ties(logits) == [1]
    assert diverges([1, 2, 2], [1, 2, 2]) is None
    assert diverges([1, 0, 2], [1, 1, 2]) == 1 and diverges([1], [1, 1]) == 1
    ref = Reference([1, 1, 2], "", True, near_ties(logits))
    assert ref.judge([1, 1, 2]) and ref.judge([1, 0, 0])  # parts at step 1, a near-tie: the same
    assert not ref.judge([0, 1, 2]) and not ref.judge([1, 1, 0])


def test_smoke_runs_summary_says_where_a_token_parted_at_a_near_tie():
    generated = Generated(tokens=[1, 0], text="", reference_tokens=[1, 1], matches_reference=True,
                          stage_map={}, paths=[], asymmetric=[], converge_s=1.0, first_token_s=0.1,
                          tokens_per_s=50.0, near_ties=[1], diverged_at=1)
    out = Outcome(1, run="smoke-1", generated=generated, run_status="done", jobs={}, total_s=2.0).to_json()
    assert out["near_ties"] == [1] and out["diverged_at"] == 1
    assert "matches meshd generate: yes (differs from step 1, a near-tie of the reference" in summary(out)


def test_stage_0_splits_the_requests_decoding_into_groups_of_about_min_group():
    # One batch of everything keeps one stage busy at a time; groups much smaller than
    # MIN_GROUP would pay a weight pass for too few rows, except that two groups go in
    # flight as soon as each holds SPLIT_GROUP.
    assert (MIN_GROUP, SPLIT_GROUP) == (8, 4)
    assert [group_size(n, 3, 16) for n in (1, 4, 7)] == [(1, 1), (4, 4), (7, 7)]  # one group
    assert group_size(8, 3, 16) == (4, 4) and group_size(11, 3, 16) == (5, 6)  # two small groups
    assert group_size(16, 3, 16) == (8, 8)  # two groups of 8 in flight
    # One request short of two full groups still makes two, of 7 and 8: one group of 15
    # would leave the other stages idle for the rest of the run.
    assert group_size(15, 3, 16) == (7, 8) and group_size(12, 3, 16) == (6, 6)
    assert group_size(24, 3, 16) == (8, 8) and group_size(31, 3, 16) == (10, 11)  # a group per stage
    assert group_size(48, 3, 12) == (12, 12)  # never past --max-batch
    assert group_size(32, 1, 64) == (32, 32)  # one stage: nothing to overlap
    assert group_size(16, 3, 1) == (1, 1)  # --max-batch 1


async def test_a_request_whose_tokens_stop_coming_probes_its_route_then_fails_naming_the_wait(checkpoint):
    """A stage that takes a request's steps and never answers, alive to the mesh: once the
    stall passes its bound the orchestrator probes each node of the route, once, and at
    ``token_timeout`` it fails the request, naming the token it waited for and the route."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, [])
            orch, last = nodes[0].app, nodes[2].app
            probed: list[bytes] = []
            orch.mesh.probe_soon = probed.append

            async def silent(src: bytes, msg: object) -> None:
                return

            last.on_message = silent
            t0 = trio.current_time()
            with pytest.raises(PipelineError, match=r"no token 0 for request \w+ within 2.5s; "
                                                    r"route: stage-0 \w{8} alive, stage-1 \w{8} alive"):
                await orch.generate(PROMPTS[0], 4, token_timeout=2.5)
            assert trio.current_time() - t0 >= 2.5
            assert sorted(probed) == sorted(n.app.mesh.node_id for n in nodes[1:])
            nursery.cancel_scope.cancel()
