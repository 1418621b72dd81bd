"""A direction of a route with no path at all (its direct path dropped, no relay for the
sender) while the mesh rightly keeps both ends alive: the request fails naming that
direction and why, not as a bare timeout with every stage "alive"."""

from __future__ import annotations

import pytest
import trio

from meshd import node as node_module
from meshd.net import sender
from meshd.net.faults import Faults
from meshd.node import NodeOptions
from meshd.pipeline import app
from meshd.pipeline.api import NotReady, PipelineError, StageLost
from meshd.pipeline.checkpoint import init_checkpoint
from meshd.readiness import path as path_between
from meshd.readiness import readiness
from meshd.relay.server import serve_relay
from meshd.testing.inprocess import start_node, start_pipeline, wait_converged

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny3")
    init_checkpoint(path, "tiny", seed=0, num_hidden_layers=3)
    return path


async def _cut_stage0_to_stage1(checkpoint, nursery, lines):
    """A pipeline whose stage-0 has no relay and whose direct packets to stage-1 are lost:
    stage-0 -> stage-1 has no path, every other direction works, and others vouch for
    stage-1, so it stays alive.  Returns the nodes once the orchestrator sees that path as
    ``none`` in stage-0's gossiped summary."""
    nodes = await start_pipeline(nursery, checkpoint, 3, lines, stage_options={0: {"relay": None}})
    orch, s0, s1, _ = nodes
    s0.options.faults.drop_to.add(s1.addr)
    with trio.fail_after(30):
        while path_between(orch.app.mesh.snapshot(), s0.node_id.hex(), s1.node_id.hex())["path"] != "none":
            await trio.sleep(0.1)
    assert all(m.state == "alive" for m in orch.app.mesh.members())
    return nodes


async def test_a_send_with_no_path_fails_its_request_at_once_naming_the_direction(checkpoint, monkeypatch):
    monkeypatch.setattr(app, "SEND_TIMEOUT_S", 2.0)
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            orch, s0, s1, _ = await _cut_stage0_to_stage1(checkpoint, nursery, lines)
            t0 = trio.current_time()
            with pytest.raises(StageLost) as caught:
                await orch.app.generate(PROMPT, 4, token_timeout=60)
            # Stage-0's report of the undelivered step ends the request: no wait for the token timeout.
            assert trio.current_time() - t0 < 30
            text = str(caught.value)
            assert f"stage-1 (peer {s1.node_id.hex()[:8]} alive, but no path from stage-0 to it)" in text
            assert "no replica to take over" in text
            assert "could not deliver" in text and "stage-1" in text
            assert "relay: none configured" in text  # why the relay carried nothing
            # The next request is refused naming that direction, not a stage that may be gone.
            with pytest.raises(NotReady) as refused:
                await orch.app.generate(PROMPT, 4, token_timeout=60)
            text = str(refused.value)
            assert (f"stage-1 ({s1.node_id.hex()[:8]}) is alive, but there is no path from "
                    f"stage-0 ({s0.node_id.hex()[:8]}) to it") in text, text
            assert "reported gone" not in text
            nursery.cancel_scope.cancel()


async def test_a_stage_no_path_reaches_is_refused_while_the_cut_lasts_and_serves_once_a_path_is_back(
        checkpoint, monkeypatch):
    """The stage a request could not reach stays out of routing as long as the mesh sees that
    direction with no path, however long that is, and takes requests again as soon as a path
    carries it, with nothing restarted."""
    monkeypatch.setattr(app, "SEND_TIMEOUT_S", 2.0)
    monkeypatch.setattr(node_module, "REPORTED_DOWN_S", 0.0)  # no report holds by time alone
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            orch, s0, s1, _ = await _cut_stage0_to_stage1(checkpoint, nursery, lines)
            with pytest.raises(StageLost):
                await orch.app.generate(PROMPT, 4, token_timeout=60)
            cut = (f"stage-1 ({s1.node_id.hex()[:8]}) is alive, but there is no path from "
                   f"stage-0 ({s0.node_id.hex()[:8]}) to it")
            for _ in range(3):
                with pytest.raises(NotReady) as refused:
                    await orch.app.generate(PROMPT, 4, token_timeout=60)
                assert cut in str(refused.value), refused.value
                assert readiness(orch.app.mesh.snapshot())["ready"] is False
                await trio.sleep(0.5)
            # From here on only a path coming back ends the report.
            monkeypatch.setattr(node_module, "REPORTED_DOWN_S", 3600.0)
            s0.options.faults.drop_to.discard(s1.addr)
            await orch.app.wait_ready(60)
            assert readiness(orch.app.mesh.snapshot())["ready"] is True
            result = await orch.app.generate(PROMPT, 4, token_timeout=60)
            assert len(result["tokens"]) == 4 and result["failovers"] == []
            assert s1.app.counters["activations"] > 0
            nursery.cancel_scope.cancel()


async def test_a_step_no_path_reaches_fails_before_its_send_timeout_naming_the_cut(checkpoint, monkeypatch):
    """With the send timeout as deployed, the step stage-0 cannot deliver fails once no path
    (no stream, every dial unanswered, no relay) has reached stage-1 for NO_PATH_GIVE_UP_S,
    and the request fails naming that, not at the 30 s send timeout."""
    monkeypatch.setattr(sender, "NO_PATH_GIVE_UP_S", 2.0)
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            orch, s0, s1, _ = await _cut_stage0_to_stage1(checkpoint, nursery, lines)
            with pytest.raises(StageLost) as caught:
                await orch.app.generate(PROMPT, 4, token_timeout=60)
            text = str(caught.value)
            assert f"stage-1 (peer {s1.node_id.hex()[:8]} alive, but no path from stage-0 to it)" in text
            assert "no path reaches it for 2s" in text and "within 30s" not in text, text
            assert "relay: none configured" in text
            nursery.cancel_scope.cancel()


async def test_a_request_that_times_out_names_the_hop_of_its_route_with_no_path(checkpoint, monkeypatch):
    monkeypatch.setattr(app, "SEND_TIMEOUT_S", 60.0)  # the stage's own report comes after the timeout
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            orch, s0, s1, _ = await _cut_stage0_to_stage1(checkpoint, nursery, lines)
            with pytest.raises(PipelineError) as caught:
                await orch.app.generate(PROMPT, 4, token_timeout=3)
            text = str(caught.value)
            assert "no token 0" in text
            hop = f"stage-0 ({s0.node_id.hex()[:8]})→stage-1 ({s1.node_id.hex()[:8]}): no path"
            assert hop in text
            assert text.count("no path") == 1  # the other directions of the route work
            nursery.cancel_scope.cancel()


async def test_a_new_request_takes_the_replica_its_stage_before_reaches(checkpoint):
    """Stage-1 has two replicas and stage-0 reaches only one: every request goes through
    that one from the start, with no failover, though the other ranks first by load, round
    trip and node id."""
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(serve_relay, "127.0.0.1", 0)
            opts = dict(profile="local", relay=f"ws://{host}:{port}", stages=3, model=str(checkpoint))
            orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
            seeds = [orch.addr]
            s0 = await start_node(nursery, NodeOptions(stage=0, seeds=seeds, **{**opts, "relay": None},
                                                       faults=Faults()), lines)
            replicas = [await start_node(nursery, NodeOptions(stage=1, seeds=seeds, **opts), lines)
                        for _ in range(2)]
            s2 = await start_node(nursery, NodeOptions(stage=2, seeds=seeds, **opts), lines)
            await wait_converged([orch, s0, *replicas, s2])
            await orch.app.wait_ready(10)
            cut, reached = replicas
            # The cut replica measures the lower round trip: it ranks first on everything but the path.
            orch.app.mesh.rtt = lambda node: 0.001 if node == cut.node_id else 0.002
            s0.options.faults.drop_to.add(cut.addr)
            snap = orch.app.mesh.snapshot
            with trio.fail_after(30):
                while path_between(snap(), s0.node_id.hex(), cut.node_id.hex())["path"] != "none":
                    await trio.sleep(0.1)
            assert orch.app.candidates(1)[0].id == cut.node_id
            for _ in range(4):
                result = await orch.app.generate(PROMPT, 3, token_timeout=20)
                assert result["failovers"] == []
            assert reached.app.counters["activations"] > 0
            assert cut.app.counters["activations"] == 0
            nursery.cancel_scope.cancel()


async def test_a_step_no_path_reaches_moves_its_request_to_a_replica(checkpoint, monkeypatch):
    """Stage-0 is cut from the stage-1 replica its request was routed through before the mesh
    has seen the cut: once no path has reached it for NO_PATH_GIVE_UP_S, the request moves to
    the other replica and completes, with the tokens of a request that never met the cut."""
    monkeypatch.setattr(sender, "NO_PATH_GIVE_UP_S", 2.0)
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            opts = dict(profile="local", stages=3, model=str(checkpoint))
            orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
            seeds = [orch.addr]
            s0 = await start_node(nursery, NodeOptions(stage=0, seeds=seeds, faults=Faults(), **opts), lines)
            replicas = [await start_node(nursery, NodeOptions(stage=1, seeds=seeds, **opts), lines)
                        for _ in range(2)]
            s2 = await start_node(nursery, NodeOptions(stage=2, seeds=seeds, **opts), lines)
            await wait_converged([orch, s0, *replicas, s2])
            await orch.app.wait_ready(10)
            want = (await orch.app.generate(PROMPT, 6, token_timeout=20))["tokens"]
            cut, other = replicas
            orch.app.mesh.rtt = lambda node: 0.001 if node == cut.node_id else 0.002
            orch.app.requests.clear()  # no load from the first request tilts the pick
            s0.options.faults.drop_to.add(cut.addr)
            s0.app.mesh.data._sender.drop_stream(s0.app.mesh.data._sender._peer(cut.node_id))
            result = await orch.app.generate(PROMPT, 6, token_timeout=60)
            assert result["tokens"] == want
            [failover] = result["failovers"]
            assert (failover["from"], failover["to"]) == (cut.node_id.hex()[:8], other.node_id.hex()[:8])
            assert "no path reaches it for 2s" in failover["why"], failover
            nursery.cancel_scope.cancel()


async def _stage0_twins(checkpoint, nursery, lines):
    """Two stage-0 replicas, the first (``cut``) with faults it can be given and the lower
    round trip, so it ranks first on everything but the paths."""
    opts = dict(profile="local", stages=3, model=str(checkpoint))
    orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
    seeds = [orch.addr]
    cut = await start_node(nursery, NodeOptions(stage=0, seeds=seeds, faults=Faults(), **opts), lines)
    other = await start_node(nursery, NodeOptions(stage=0, seeds=seeds, **opts), lines)
    s1 = await start_node(nursery, NodeOptions(stage=1, seeds=seeds, **opts), lines)
    s2 = await start_node(nursery, NodeOptions(stage=2, seeds=seeds, **opts), lines)
    await wait_converged([orch, cut, other, s1, s2])
    await orch.app.wait_ready(10)
    orch.app.mesh.rtt = lambda node: 0.001 if node == cut.node_id else 0.002
    return orch, cut, other, s1


async def test_a_stage_one_replica_of_the_stage_before_cannot_reach_serves_through_the_other(
        checkpoint, monkeypatch):
    """Stage-0 has two replicas and only one has no path to stage-1: stage-1 stays in
    routing, readiness says ready, and every request goes through the stage-0 that reaches
    it, with no failover, for as long as the cut lasts (past the report's own hold)."""
    monkeypatch.setattr(sender, "NO_PATH_GIVE_UP_S", 2.0)
    monkeypatch.setattr(node_module, "REPORTED_DOWN_S", 1.0)
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            orch, cut, other, s1 = await _stage0_twins(checkpoint, nursery, lines)
            cut.options.faults.drop_to.add(s1.addr)
            cut.app.mesh.data._sender.drop_stream(cut.app.mesh.data._sender._peer(s1.node_id))
            snap = orch.app.mesh.snapshot
            with trio.fail_after(30):
                while path_between(snap(), cut.node_id.hex(), s1.node_id.hex())["path"] != "none":
                    await trio.sleep(0.1)
            assert orch.app.candidates(0)[0].id == cut.node_id  # first on all but the path
            for _ in range(4):
                result = await orch.app.generate(PROMPT, 3, token_timeout=20)
                assert result["failovers"] == []
                assert readiness(orch.app.mesh.snapshot())["ready"] is True
                await trio.sleep(0.5)
            assert cut.app.counters["activations"] == 0
            assert other.app.counters["activations"] > 0
            nursery.cancel_scope.cancel()


async def test_a_step_the_stage_before_cannot_deliver_moves_to_the_replica_that_can(checkpoint, monkeypatch):
    """The stage-0 a request went through finds no path to stage-1, which has no replica,
    before the mesh has seen the cut: the request moves to the other stage-0, which reaches
    stage-1, and completes with the tokens of a request that never met the cut; the next
    requests go that way from the start."""
    monkeypatch.setattr(sender, "NO_PATH_GIVE_UP_S", 2.0)
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            orch, cut, other, s1 = await _stage0_twins(checkpoint, nursery, lines)
            want = (await orch.app.generate(PROMPT, 6, token_timeout=20))["tokens"]
            orch.app.requests.clear()
            cut.options.faults.drop_to.add(s1.addr)
            cut.app.mesh.data._sender.drop_stream(cut.app.mesh.data._sender._peer(s1.node_id))
            result = await orch.app.generate(PROMPT, 6, token_timeout=60)
            assert result["tokens"] == want
            [failover] = result["failovers"]
            assert failover["stage"] == "stage-0"
            assert (failover["from"], failover["to"]) == (cut.node_id.hex()[:8], other.node_id.hex()[:8])
            assert "has no path to stage-1" in failover["why"], failover
            again = await orch.app.generate(PROMPT, 6, token_timeout=20)
            assert again["tokens"] == want and again["failovers"] == []
            nursery.cancel_scope.cancel()


def test_an_undelivered_message_lists_each_failed_attempt_once_with_its_count():
    from meshd.net.sender import _counted

    dial = "direct: connect to 127.0.0.1:4 timed out after 1s"
    ack = "relay: no ack within 2s"
    assert _counted([dial] * 6 + ["relay: none of ours reaches it now"]) == (
        f"{dial} (x6); relay: none of ours reaches it now")
    assert _counted([dial, ack, dial, dial]) == f"{dial}; {ack}; {dial} (x2)"
    assert _counted([f"direct: attempt {i}" for i in range(9)]).startswith("direct: attempt 3;")
    assert _counted([]) == ""
