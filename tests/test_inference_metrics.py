"""Inference metrics in ``GET /metrics``: a request through a 3-stage mesh moves each counter by
what it did, and every metric family speaks one unit."""

from __future__ import annotations

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from dashboard.metrics import render
from meshd.node import NodeOptions
from meshd.pipeline.api import Busy, NotReady, StageLost
from meshd.pipeline.config import LlamaConfig
from meshd.pipeline.generate import generate, prompt_ids
from meshd.pipeline.messages import Hop
from meshd.pipeline.metrics import OrchestratorMetrics, StageMetrics
from meshd.pipeline.tokenizer import load_tokenizer
from meshd.testing.inprocess import start_node, wait_converged

PROMPT = "Hello"
ORCHESTRATOR_FAMILIES = {
    "meshd_requests": "counter", "meshd_requests_in_flight": "gauge", "meshd_requests_running": "gauge",
    "meshd_requests_waiting": "gauge", "meshd_prompt_tokens": "counter",
    "meshd_generation_tokens": "counter", "meshd_failovers": "counter",
    "meshd_time_to_first_token_seconds": "histogram", "meshd_time_per_output_token_seconds": "histogram",
    "meshd_e2e_request_latency_seconds": "histogram", "meshd_hop_transit_seconds": "histogram",
    "meshd_messages_not_from_route": "counter",
}
STAGE_FAMILIES = {"meshd_stage_compute_seconds": "histogram", "meshd_hop_transit_seconds": "histogram",
                  "meshd_stage_batch_size": "histogram", "meshd_stage_room_wait_seconds": "histogram",
                  "meshd_messages_not_from_route": "counter", "meshd_stage_polled_seconds": "counter"}
MESH_FAMILIES = {"meshd_swim_events": "counter", "meshd_swim_bytes": "counter",
                 "meshd_data_events": "counter", "meshd_data_bytes": "counter"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from meshd.pipeline.checkpoint import init_checkpoint

    path = tmp_path_factory.mktemp("tiny6")
    init_checkpoint(path, "tiny", seed=0, num_hidden_layers=6)
    return path


def parse(text: str) -> dict:
    """``{family name: family}`` of a scrape."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, family: str, sample: str, **labels: str) -> float:
    """The sum of ``sample``'s values whose labels include ``labels`` (0 when there are none)."""
    if family not in families:
        return 0.0
    return sum(s.value for s in families[family].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def moved(before: dict, after: dict, family: str, sample: str, **labels: str) -> float:
    """How far ``sample`` (summed over what matches ``labels``) moved between two scrapes."""
    return value(after, family, sample, **labels) - value(before, family, sample, **labels)


def assert_one_unit_each(families: dict) -> None:
    """No family mixes units: seconds and bytes only in names saying so, never a byte counter
    among counts, counters' samples ending in ``_total``, histograms in seconds."""
    for name, family in families.items():
        unit = "seconds" if name.endswith("_seconds") else "bytes" if name.endswith("_bytes") else "count"
        for word in ("seconds", "bytes"):
            assert word not in name or unit == word, name
        if family.type == "histogram":  # of durations, or of sizes (a count each)
            assert unit == "seconds" or name.endswith("_size"), name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name in (f"{name}_total", f"{name}_created"), sample.name
            # A label that names a counter never names one of another unit.
            counter = sample.labels.get("counter", "")
            assert unit == "bytes" or not counter.endswith("_bytes"), (name, counter)


async def _mesh(nursery, checkpoint, lines: list[str]):
    opts = dict(profile="local", stages=3, model=str(checkpoint), dashboard="127.0.0.1:0")
    orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
    nodes = [orch]
    for k in range(3):  # stage-1 polls after each message (as `meshd run` stages do), the others sleep
        poll = 20.0 if k == 1 else 0.0
        options = NodeOptions(stage=k, seeds=[orch.addr], poll_ms=poll, **opts)
        nodes.append(await start_node(nursery, options, lines))
    await wait_converged(nodes)
    await orch.app.wait_ready(10)
    return nodes


async def _scrape(nodes) -> list[dict]:
    out = []
    for node in nodes:
        async with httpx.AsyncClient(base_url=node.dashboard_url, timeout=10) as client:
            r = await client.get("/metrics")
            assert r.status_code == 200
            out.append(parse(r.text))
    return out


async def test_a_request_moves_each_inference_counter_by_what_it_did(checkpoint):
    want = generate(checkpoint, PROMPT, 8)
    n = len(want["tokens"])
    steps = n + (want["finish_reason"] == "eos")  # each step is one pass through the stages
    config = LlamaConfig.load(checkpoint)
    prompt = len(prompt_ids(load_tokenizer(checkpoint, config.bos_token_id, config.eos_token_ids), PROMPT))
    assert prompt > 1 and n >= 2, "a prefill of several rows, and a gap between tokens"
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nodes = await _mesh(nursery, checkpoint, lines)
            before = await _scrape(nodes)
            async with httpx.AsyncClient(base_url=nodes[0].dashboard_url, timeout=30) as client:
                done = await client.post("/api/generate", json={"prompt": PROMPT, "max_tokens": 8})
                assert done.status_code == 200 and done.json()["tokens"] == want["tokens"]
                refused = await client.post("/api/generate", json={"prompt": PROMPT, "max_tokens": 1000})
                assert refused.status_code == 400, "longer than the context"
            after = await _scrape(nodes)
            nursery.cancel_scope.cancel()

    for families, expected in zip(after, [ORCHESTRATOR_FAMILIES, *[STAGE_FAMILIES] * 3], strict=True):
        assert_one_unit_each(families)
        for name, kind in {**expected, **MESH_FAMILIES}.items():
            assert families[name].type == kind, name

    b, a = before[0], after[0]
    outcome = "length" if want["finish_reason"] == "length" else "stop"
    for o in ("stop", "length", "error", "cancelled", "refused"):
        want_moved = o in (outcome, "refused")
        assert moved(b, a, "meshd_requests", "meshd_requests_total", outcome=o) == want_moved, o
    # The refused request never started: no prompt tokens of its own.
    assert moved(b, a, "meshd_prompt_tokens", "meshd_prompt_tokens_total") == prompt
    assert moved(b, a, "meshd_generation_tokens", "meshd_generation_tokens_total") == n
    assert moved(b, a, "meshd_failovers", "meshd_failovers_total") == 0
    assert value(a, "meshd_requests_in_flight", "meshd_requests_in_flight") == 0
    assert value(a, "meshd_requests_running", "meshd_requests_running") == 0
    assert value(a, "meshd_requests_waiting", "meshd_requests_waiting") == 0
    for family in ("meshd_time_to_first_token_seconds", "meshd_time_per_output_token_seconds",
                   "meshd_e2e_request_latency_seconds"):
        assert moved(b, a, family, f"{family}_count") == 1, family
        assert moved(b, a, family, f"{family}_bucket", le="+Inf") == 1, family
        assert moved(b, a, family, f"{family}_sum") > 0, family
    # The tokens came over the data channel: its byte counter, apart from its message counter.
    assert moved(b, a, "meshd_data_bytes", "meshd_data_bytes_total", counter="delivered") > 0
    assert moved(b, a, "meshd_data_events", "meshd_data_events_total", counter="delivered") > 0
    transit = ("meshd_hop_transit_seconds", "meshd_hop_transit_seconds_count")
    # Every token's trace ends with the last stage's hop to the orchestrator.
    assert moved(b, a, *transit, hop="stage-2->orchestrator") == steps

    compute = ("meshd_stage_compute_seconds", "meshd_stage_compute_seconds_count")
    batches = ("meshd_stage_batch_size", "meshd_stage_batch_size_count")
    for k, (b, a) in enumerate(zip(before[1:], after[1:], strict=True)):
        stage = f"stage-{k}"
        # one request alone: each decode step a batch of one
        assert moved(b, a, *batches, stage=stage) == moved(b, a, *compute, stage=stage, phase="decode") > 0
        assert moved(b, a, *compute, stage=stage, phase="prefill") == 1, stage
        assert moved(b, a, *compute, stage=stage, phase="decode") == steps - 1, stage
        assert moved(b, a, *compute, stage=stage, phase="head") == (steps if k == 2 else 0), stage
        into = "orchestrator->stage-0" if k == 0 else f"stage-{k - 1}->{stage}"
        assert moved(b, a, *transit, hop=into) == (1 if k == 0 else steps), stage
        polled = moved(b, a, "meshd_stage_polled_seconds", "meshd_stage_polled_seconds_total", stage=stage)
        assert polled > 0 if k == 1 else polled == 0, stage
        if k == 0:  # the feedback edge: every token but the last goes back to stage 0
            assert moved(b, a, *transit, hop="stage-2->stage-0") == steps - 1


def test_every_family_speaks_one_unit():
    """Byte counters and counts of the mesh go to families of their own, next to the
    pipeline's metrics; a histogram's buckets count every observation once."""
    snap = {"self": {"id": "ab12cd34" * 8, "prefix": "ab12cd34", "name": "stage-0", "role": "stage",
                     "state": "alive", "version": "0.1.0"},
            "members": [], "path_summaries": {},
            "counters": {"rx_bytes": 1200, "tx_bytes": 900, "tx_relay_bytes": 40, "rx_packets": 7,
                         "probes": 3},
            "data": {"sent": 4, "delivered": 4, "rx_bytes": 10}}
    stage = StageMetrics("stage-0")
    for seconds in (0.0002, 0.003, 0.003, 90.0):
        stage.computed("decode", seconds)
    stage.arrived((Hop("transit", "stage-2->stage-0", 1.5, "direct"),))
    orch = OrchestratorMetrics()
    orch.finished({"finish_reason": "eos", "tokens": [1, 2, 3],
                   "timings": {"total_s": 0.5, "first_token_s": 0.1}})
    for metrics in (stage, orch):
        families = parse(render(snap, metrics)[0].decode())
        assert_one_unit_each(families)
        assert value(families, "meshd_swim_bytes", "meshd_swim_bytes_total", counter="rx") == 1200
        assert value(families, "meshd_swim_bytes", "meshd_swim_bytes_total", counter="tx_relay") == 40
        assert value(families, "meshd_swim_events", "meshd_swim_events_total", counter="rx_packets") == 7
        assert value(families, "meshd_swim_events", "meshd_swim_events_total", counter="rx_bytes") == 0
        assert value(families, "meshd_data_bytes", "meshd_data_bytes_total", counter="rx") == 10
    families = parse(render(snap, stage)[0].decode())
    buckets = {s.labels["le"]: s.value for s in families["meshd_stage_compute_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["phase"] == "decode"}
    assert (buckets["0.00025"], buckets["0.0025"], buckets["0.005"], buckets["40.0"], buckets["+Inf"]) == \
        (1, 1, 3, 3, 4)
    families = parse(render(snap, orch)[0].decode())
    assert value(families, "meshd_requests", "meshd_requests_total", outcome="stop") == 1
    assert value(families, "meshd_time_per_output_token_seconds",
                 "meshd_time_per_output_token_seconds_sum") == pytest.approx(0.2)


def test_a_request_that_ends_in_an_exception_is_counted_by_why():
    metrics = OrchestratorMetrics()
    for exc in (NotReady(["pp-stage-1"]), ValueError("too long"), StageLost("stage-1 (peer 2b91108e dead)"),
                RuntimeError("a bug"), trio.Cancelled._create(), trio.BrokenResourceError(),
                Busy("busy: 64 requests running and 256 waiting")):  # the queue filled after its check
        metrics.failed(exc)
    assert metrics.requests == {"stop": 0, "length": 0, "error": 2, "cancelled": 2, "refused": 2, "busy": 1}
