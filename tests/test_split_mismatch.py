"""A stage started with another ``--stages`` than the run's holds another share of the
layers under its stage number: the orchestrator never routes through it, even when it
ranks first on everything else, and a replica of the run's split beside it serves."""

from __future__ import annotations

import pytest
import trio

from meshd.node import NodeOptions
from meshd.pipeline.api import NotReady
from meshd.pipeline.checkpoint import init_checkpoint
from meshd.readiness import readiness
from meshd.testing.inprocess import start_node, wait_converged

PROMPT = "the quick brown fox"
SPLIT = "runs a 2-stage split (--stages 2), but this run has 3 stages"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny6")
    init_checkpoint(path, "tiny", seed=0, num_hidden_layers=6)
    return path


async def test_a_stage_of_another_split_is_never_routed_to(checkpoint):
    lines: list[str] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            opts = dict(profile="local", stages=3, model=str(checkpoint))
            orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
            seeds = [orch.addr]
            s0 = await start_node(nursery, NodeOptions(stage=0, seeds=seeds, **opts), lines)
            odd = await start_node(nursery, NodeOptions(stage=1, seeds=seeds, **{**opts, "stages": 2}), lines)
            s2 = await start_node(nursery, NodeOptions(stage=2, seeds=seeds, **opts), lines)
            await wait_converged([orch, s0, odd, s2])
            # Alone, it leaves stage-1 unserved: a 503 and readiness say why, naming it.
            named = f"stage-1 ({odd.node_id.hex()[:8]}) {SPLIT}"
            with pytest.raises(NotReady) as refused:
                await orch.app.generate(PROMPT, 3, token_timeout=20)
            assert named in str(refused.value), refused.value
            r = readiness(orch.app.mesh.snapshot())
            assert r["ready"] is False and f"stage-1: {odd.node_id.hex()[:8]} {SPLIT}" in r["why"], r
            # A replica of the run's split joins; the other ranks first by round trip and load.
            right = await start_node(nursery, NodeOptions(stage=1, seeds=seeds, **opts), lines)
            await wait_converged([orch, s0, odd, right, s2])
            await orch.app.wait_ready(20)
            orch.app.mesh.rtt = lambda node: 0.001 if node == odd.node_id else 0.002
            for _ in range(4):
                result = await orch.app.generate(PROMPT, 3, token_timeout=20)
                assert len(result["tokens"]) == 3 and result["failovers"] == []
            assert right.app.counters["activations"] > 0
            assert odd.app.counters["activations"] == 0
            r = readiness(orch.app.mesh.snapshot())
            assert r["ready"] is True
            assert f"stage-1: {odd.node_id.hex()[:8]} {SPLIT}; not used; 1 other serves" in r["warnings"], r
            nursery.cancel_scope.cancel()
