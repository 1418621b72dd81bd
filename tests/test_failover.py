"""Churn in one trio run: a request moves to a replica when a node of its route fails, with
the same tokens; with no replica it fails by name; stages drop a gone orchestrator's work;
a restarted stage, new identity or old, serves the next request."""

from __future__ import annotations

import contextlib
from contextlib import asynccontextmanager

import pytest
import trio

from meshd.identity import Identity
from meshd.node import NodeOptions
from meshd.pipeline.api import NotReady, PipelineError, StageLost
from meshd.pipeline.checkpoint import init_checkpoint
from meshd.pipeline.generate import diverges, generate, near_ties
from meshd.pipeline.messages import HANDED_OVER, HANDING_OVER, StageError
from meshd.relay.server import serve_relay
from meshd.testing.inprocess import start_killable, wait_converged

PROMPT = "the quick brown fox"
SAMPLINGS = [(0.0, 0, 0), (0.9, 20, 7)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny6")
    init_checkpoint(path, "tiny", seed=0, num_hidden_layers=6)
    return path


@asynccontextmanager
async def running(checkpoint, replicas: list[int]):
    """A mesh with ``replicas[k]`` nodes for stage k, stopped when the block ends."""
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, checkpoint, len(replicas))
            await mesh.start(replicas)
            yield mesh
            nursery.cancel_scope.cancel()


class Mesh:
    """A relay, an orchestrator and stages (``replicas[k]`` nodes for stage k), each killable."""

    def __init__(self, nursery: trio.Nursery, model, stages: int) -> None:
        self.nursery, self.model, self.stages = nursery, str(model), stages
        self.lines: list[str] = []
        self.nodes: dict[bytes, tuple] = {}  # node id -> (Running, scope)

    async def start(self, replicas: list[int]) -> None:
        host, port = await self.nursery.start(serve_relay, "127.0.0.1", 0)
        self.opts = dict(profile="local", relay=f"ws://{host}:{port}", stages=self.stages, model=self.model)
        self.orch, self.orch_scope = await start_killable(
            self.nursery, NodeOptions(role="orchestrator", dashboard="127.0.0.1:0", **self.opts), self.lines)
        for k, n in enumerate(replicas):
            for _ in range(n):
                await self.add(k)
        await self.settle()

    async def add(self, stage: int, identity: Identity | None = None, model=None):
        opts = dict(self.opts, model=str(model or self.model))
        running, scope = await start_killable(
            self.nursery, NodeOptions(stage=stage, seeds=[self.orch.addr], **opts), self.lines, identity)
        self.nodes[running.node_id] = (running, scope)
        return running

    async def settle(self) -> None:
        live = [self.orch, *(r for r, s in self.nodes.values() if not s.cancel_called)]
        await wait_converged(live)
        await self.orch.app.wait_ready(10)

    def serving(self, stage: int) -> bytes:
        """The node serving ``stage`` for the one running request."""
        (req,) = self.orch.app.requests.values()
        return req.route[stage]

    def serving_any(self, stage: int) -> bytes:
        """The node serving ``stage`` for the oldest running request."""
        return next(iter(self.orch.app.requests.values())).route[stage]

    def kill(self, node: bytes) -> None:
        self.nodes[node][1].cancel()


def reference(model, max_tokens, temperature, top_k, seed):
    return generate(model, PROMPT, max_tokens, temperature, top_k, seed)["tokens"]


@pytest.mark.parametrize("temperature,top_k,seed", SAMPLINGS)
async def test_a_killed_replica_mid_generation_hands_the_request_to_another_with_the_same_tokens(
        checkpoint, temperature, top_k, seed):
    async with running(checkpoint, [1, 2, 1]) as mesh:
        killed = []

        # At its first token streamed (the next ones come some at a time, and a fast host can
        # finish a short request before they do), with most of the request still to run.
        async def on_token(_token):
            if not killed:
                killed.append(mesh.serving(1))
                mesh.kill(killed[0])

        got = await mesh.orch.app.generate(PROMPT, 60, temperature, top_k, seed, on_token=on_token)
        assert got["tokens"] == reference(checkpoint, 60, temperature, top_k, seed)
        (failover,) = got["failovers"]
        assert failover["stage"] == "stage-1" and failover["from"] == killed[0].hex()[:8]
        assert failover["to"] != failover["from"] and failover["ms"] is not None
        assert mesh.orch.app.metrics.failovers == 1  # meshd_failovers_total


async def test_requests_batched_through_a_killed_replica_each_move_to_another(checkpoint):
    """Six requests at once, their steps batched: every one routed through the stage-1 node
    that dies moves to the other replica (the batch that could not be delivered fails each
    of its requests, which the orchestrator replays), and each still gets its own
    reference's tokens by the batched rule."""
    specs = [(0.0 if i % 2 else 0.9, 0 if i % 2 else 20, i) for i in range(6)]
    async with running(checkpoint, [1, 2, 1]) as mesh:
        killed: list[bytes] = []
        through: set[str] = set()  # the requests routed through the killed node

        async def on_token(_token):
            if not killed:
                killed.append(mesh.serving_any(1))
                through.update(r.req_id for r in mesh.orch.app.requests.values() if r.route[1] == killed[0])
                mesh.kill(killed[0])

        results: list[dict] = [{}] * len(specs)

        async def one(i: int) -> None:
            temperature, top_k, seed = specs[i]
            results[i] = await mesh.orch.app.generate(PROMPT, 40, temperature, top_k, seed, on_token=on_token)

        async with trio.open_nursery() as clients:
            for i in range(len(specs)):
                clients.start_soon(one, i)
    assert through
    for (temperature, top_k, seed), got in zip(specs, results, strict=True):
        want = generate(checkpoint, PROMPT, 40, temperature, top_k, seed, return_logits=True)
        parted = diverges(got["tokens"], want["tokens"])
        assert parted is None or (temperature == 0 and parted in near_ties(want["logits"])), seed
        moved = [f for f in got["failovers"] if f["stage"] == "stage-1"]
        assert bool(moved) is (got["request"] in through), (got["request"], got["failovers"])
        assert all(f["from"] == killed[0].hex()[:8] for f in moved)


async def test_with_no_replica_the_request_fails_naming_the_stage_and_the_next_one_needs_a_new_node(
        checkpoint):
    async with running(checkpoint, [1, 1, 1]) as mesh:
        want = reference(checkpoint, 60, 0.0, 0, 0)

        killed = []

        async def on_token(_token):  # at its first token, as above
            if not killed:
                killed.append(mesh.serving(1))
                mesh.kill(killed[0])

        with pytest.raises(StageLost, match=r"stage-1 \(peer [0-9a-f]{8} "):
            await mesh.orch.app.generate(PROMPT, 60, on_token=on_token)
        assert mesh.orch.app.metrics.requests["error"] == 1  # meshd_requests_total{outcome="error"}
        # The failed request's Release reaches the stages on both sides of the dead one: none
        # holds its cache until it ages out.
        alive = [r.app for r, scope in mesh.nodes.values() if not scope.cancel_called]
        with trio.fail_after(5):
            while any(app.jobs for app in alive):
                await trio.sleep(0.05)
        # A new process for stage-1, under a new identity: it serves as soon as it has joined.
        await mesh.add(1)
        await mesh.settle()
        assert (await mesh.orch.app.generate(PROMPT, 60))["tokens"] == want


async def test_a_stage_restarted_with_its_own_key_serves_the_next_request(checkpoint):
    async with running(checkpoint, [1, 1, 1]) as mesh:
        want = reference(checkpoint, 12, 0.0, 0, 0)
        assert (await mesh.orch.app.generate(PROMPT, 12))["tokens"] == want
        stage1 = next(r for r, _s in mesh.nodes.values() if r.options.stage == 1)
        identity = stage1.identity
        mesh.kill(stage1.node_id)
        await trio.sleep(0.2)
        await mesh.add(1, identity=identity)  # the same node id, a new process
        await mesh.settle()
        assert (await mesh.orch.app.generate(PROMPT, 12))["tokens"] == want


async def test_stages_drop_the_requests_of_an_orchestrator_that_is_gone(checkpoint):
    async with running(checkpoint, [1, 1]) as mesh:
        stages = [r.app for r, _s in mesh.nodes.values()]

        async def generate_forever():
            await mesh.orch.app.generate(PROMPT, 200)

        mesh.nursery.start_soon(generate_forever)
        while stages[-1].counters["tokens"] < 5:
            await trio.sleep(0.001)
        mesh.orch_scope.cancel()
        with trio.fail_after(30):  # the orchestrator's death, as the stages learn it: seconds, loaded
            while any(s.jobs for s in stages):
                await trio.sleep(0.05)
        computed = [s.counters["activations"] for s in stages]
        await trio.sleep(1.0)
        assert [s.counters["activations"] for s in stages] == computed  # nothing more computed
        # Dropped where the death was seen first; a stage before the last releases it downstream.
        assert any(s.counters["dropped_orphans"] > 0 for s in stages), [s.counters for s in stages]


async def test_stages_drop_the_requests_of_an_orchestrator_restarted_before_it_was_missed(checkpoint):
    """The orchestrator killed and started again under its key at once: failure detection never
    declares it dead, and its new process never knew the old one's request.  The stages drop
    that request as soon as they know the new process, not after JOB_IDLE_S."""
    async with running(checkpoint, [1, 1]) as mesh:
        stages = [r.app for r, _s in mesh.nodes.values()]
        identity = mesh.orch.node.identity

        async def generate_forever():
            with contextlib.suppress(PipelineError):
                await mesh.orch.app.generate(PROMPT, 200)

        mesh.nursery.start_soon(generate_forever)
        while stages[-1].counters["tokens"] < 5:
            await trio.sleep(0.001)
        mesh.orch_scope.cancel()
        seeds = [r.addr for r, _s in mesh.nodes.values()]
        mesh.orch, mesh.orch_scope = await start_killable(
            mesh.nursery, NodeOptions(role="orchestrator", seeds=seeds, **mesh.opts), mesh.lines, identity)
        with trio.move_on_after(15):
            while any(s.jobs for s in stages):
                await trio.sleep(0.05)
        assert not any(s.jobs for s in stages), [(s.stage, list(s.jobs), s.counters) for s in stages]
        # Stage 0 dropped it, and released it down the route.
        assert stages[0].stage == 0 and stages[0].counters["dropped_orphans"] == 1, stages[0].counters
        await mesh.settle()
        assert (await mesh.orch.app.generate(PROMPT, 8))["tokens"] == reference(checkpoint, 8, 0.0, 0, 0)


async def test_a_draining_replica_takes_no_new_request_and_none_fails(checkpoint):
    async with running(checkpoint, [2, 1]) as mesh:
        want = reference(checkpoint, 8, 0.0, 0, 0)
        results, errors = [], []

        async def back_to_back():
            for _ in range(20):
                try:
                    results.append((await mesh.orch.app.generate(PROMPT, 8))["tokens"])
                except Exception as exc:  # noqa: BLE001 - every failure is counted
                    errors.append(exc)

        async with trio.open_nursery() as inner:
            inner.start_soon(back_to_back)
            while len(results) < 5:
                await trio.sleep(0.01)
            leaving = mesh.serving(0) if mesh.orch.app.requests else next(
                r.node_id for r, _s in mesh.nodes.values() if r.options.stage == 0)
            node, scope = mesh.nodes[leaving]
            await node.app.drain(5.0)
            await node.node.leave()
            scope.cancel()
        assert errors == [] and results == [want] * 20


async def test_a_stage_whose_only_node_drains_gets_a_503_saying_so(checkpoint):
    async with running(checkpoint, [1, 1]) as mesh:
        (draining,) = [r for r, _s in mesh.nodes.values() if r.options.stage == 1]
        await draining.app.drain(1.0)
        with trio.fail_after(10):  # until the orchestrator hears of the drain
            while not any(m.draining for m in mesh.orch.app.mesh.members()):
                await trio.sleep(0.05)
        with pytest.raises(NotReady) as caught:
            await mesh.orch.app.generate(PROMPT, 4)
        said = f"stage-1 ({draining.identity.prefix}) is draining"
        # pp-exit is the last stage's name too: both say why.
        assert f"pp-stage-1 does not resolve ({said})" in str(caught.value), str(caught.value)
        assert f"pp-exit does not resolve ({said})" in str(caught.value), str(caught.value)


async def test_a_stage_handing_a_request_over_before_its_drain_is_gossiped_never_gets_it_back(checkpoint):
    """A draining stage's hand-over reaches the orchestrator on the data channel, before its
    leave does by gossip: the request still goes to the other replica, not back to it."""
    async with running(checkpoint, [1, 2, 1]) as mesh:
        told = []

        async def on_token(_token):
            if not told:
                node = mesh.serving(1)
                told.append(node)
                stage = mesh.nodes[node][0].app
                (req_id,) = stage.jobs
                await stage._tell(mesh.orch.node_id, StageError(req_id, stage.name, HANDING_OVER, node,
                                                           HANDED_OVER))

        got = await mesh.orch.app.generate(PROMPT, 60, on_token=on_token)
        assert got["tokens"] == reference(checkpoint, 60, 0.0, 0, 0)
        (failover,) = got["failovers"]
        assert failover["from"] == told[0].hex()[:8] and failover["to"] != failover["from"], failover
        assert failover["why"] == HANDING_OVER


async def test_a_replica_with_another_checkpoint_is_refused_with_a_line_saying_why(checkpoint, tmp_path,
                                                                                   caplog):
    other = tmp_path / "other"
    init_checkpoint(other, "tiny", seed=1, num_hidden_layers=6)
    async with running(checkpoint, [1, 1]) as mesh:
        stranger = await mesh.add(1, model=other)
        await mesh.settle()
        for _ in range(4):
            got = await mesh.orch.app.generate(PROMPT, 6)
            assert got["tokens"] == reference(checkpoint, 6, 0.0, 0, 0)
        assert stranger.app.counters["activations"] == 0
        said = [r.message for r in caplog.records if "refusing" in r.message]
        assert any(stranger.identity.prefix in line for line in said)


async def test_the_http_api_shows_the_route_while_it_runs_and_the_failover_after(checkpoint):
    import httpx

    async with running(checkpoint, [2, 1]) as mesh:
        async with httpx.AsyncClient(base_url=mesh.orch.dashboard_url, timeout=30) as client:
            empty = {"requests": [], "ended": [], "failovers": []}
            assert (await client.get("/api/requests")).json() == empty
            killed = []

            async def watch():
                while not killed:
                    running = (await client.get("/api/requests")).json()["requests"]
                    if running and running[0]["tokens"] >= 1:
                        prefix = running[0]["route"]["stage-0"]
                        killed.append(prefix)
                        mesh.kill(next(n for n in mesh.nodes if n.hex()[:8] == prefix))
                    await trio.sleep(0.01)

            async with trio.open_nursery() as inner:
                inner.start_soon(watch)
                r = await client.post("/api/generate", json={"prompt": PROMPT, "max_tokens": 60})
                inner.cancel_scope.cancel()
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["tokens"] == reference(checkpoint, 60, 0.0, 0, 0)
            assert killed and [f["from"] for f in body["failovers"]] == killed
            after = (await client.get("/api/requests")).json()
            recent = after["failovers"]
            assert recent == body["failovers"] and recent[0]["request"] == body["request"]
            # Ended, it is listed where it ran last: on the replica it moved to.
            (ended,) = after["ended"]
            assert ended["request"] == body["request"] and ended["route"]["stage-0"] == recent[0]["to"]
            assert ended["outcome"] == body["finish_reason"]  # how it ended: length here


async def test_a_replica_gone_silent_mid_generation_is_suspected_and_its_request_moves(checkpoint):
    # Silent: it reads nothing more, answers no probe and reaches nobody, but its streams stay
    # open (a stopped process): only failure detection can tell, once the stall has its route
    # probed first.
    async with running(checkpoint, [1, 2, 1]) as mesh:
        silenced = []

        async def hang(_src, _msg):
            await trio.sleep_forever()

        async def on_token(_token):
            if not silenced:  # at its first token, as above
                node, _scope = mesh.nodes[mesh.serving(1)]
                silenced.append(node.node_id)
                node.app.on_message = hang
                node.options.faults.isolate = True

        got = await mesh.orch.app.generate(PROMPT, 60, on_token=on_token)
        assert got["tokens"] == reference(checkpoint, 60, 0.0, 0, 0)
        (failover,) = got["failovers"]
        assert failover["from"] == silenced[0].hex()[:8] and failover["why"] == "suspect"


async def test_only_a_stage_that_exchanges_a_requests_steps_with_a_node_reports_it_down(checkpoint, caplog):
    """A stage reports the next one down when its sends fail (and the last stage, stage 0,
    which it sends its head share to).  Another member of the route knows nothing of that
    link: its word neither takes the node out of routing nor moves the request."""
    from meshd.pipeline.messages import Sampling, StageError
    from meshd.pipeline.orchestrator import _Request
    from meshd.testing.inprocess import start_pipeline

    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 4, lines)
            orch = nodes[0].app
            route = tuple(n.app.mesh.node_id for n in nodes[1:])
            epochs = tuple(orch.mesh.member_by_id(n).epoch for n in route)
            req = _Request("r1", [1, 2], Sampling(8, 0.0, 0, 0, False), route, epochs, "w1")
            orch.requests["w1"] = req
            s0, _, s2, s3 = route

            await orch.on_message(s2, StageError("w1", "stage-2", "stage-0 is down", s0))
            assert req.trouble is None and not orch.mesh.reported_down(s0)
            assert "stage-2 (" in caplog.text and "says stage-0 (" in caplog.text
            assert "of request r1 is down, but does not exchange its steps with it: not taken" in caplog.text

            await orch.on_message(s3, StageError("w1", "stage-3", "stage-0 is down", s0))
            assert req.trouble is not None and req.trouble[1] == s0
            assert orch.mesh.reported_down(s0)
            nursery.cancel_scope.cancel()
