"""The page's feed: the node's history ring (``dashboard.history``), the push of ``/api/live``
(``dashboard.live``) and what the guard lets through to it, without a browser."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing
from starlette.testclient import TestClient, WebSocketDenialResponse

from dashboard.app import create_app
from dashboard.history import History, serve_history
from dashboard.live import CLOSE_POLICY, CLOSE_TRY_LATER, MAX_CLIENT_MESSAGES, TAIL, LiveHub, live
from meshd.pipeline.metrics import OrchestratorMetrics, StageMetrics

ME, PEER = "aa" * 32, "bb" * 32


def snap(path_out: str = "direct", rtt: float | None = 1.5, ready: bool = True) -> dict:
    """A node (the orchestrator) and one peer (stage-0), as ``Mesh.snapshot()`` has them."""
    me = {"id": ME, "prefix": ME[:8], "name": "orchestrator", "role": "orchestrator", "stage": None,
          "state": "alive", "incarnation": 0, "addr": "127.0.0.1:1", "relay_url": None}
    peer = {"id": PEER, "prefix": PEER[:8], "name": "stage-0", "role": "stage", "stage": 0, "state": "alive",
            "incarnation": 0, "addr": "127.0.0.1:2", "relay_url": None, "path_out": path_out, "rtt_ms": rtt}
    why = [] if ready else ["stage-0: no live owner of pp-stage-0"]
    return {"time": 1000.0, "self": me, "members": [peer], "names": {}, "relay": None, "path_summaries": {},
            "awareness": 0, "counters": {"rx_packets": 3}, "data": {"dials": 1},
            "readiness": {"ready": ready, "why": why, "warnings": [], "stages": []}}


class FakeNode:
    def __init__(self) -> None:
        self.snap = snap()

    def snapshot(self) -> dict:
        return self.snap

    def join(self, addrs: list[str]) -> None:
        pass


# -- the history ring ------------------------------------------------------------------------

def test_the_ring_keeps_the_newest_samples_and_no_more():
    history = History(capacity=5)
    for i in range(12):
        history.record(snap(), float(i))
    assert [s["seq"] for s in history.since()] == [8, 9, 10, 11, 12]
    assert [s["seq"] for s in history.since(10)] == [11, 12]
    assert history.since(12) == []
    view = history.view(11)
    assert view["capacity"] == 5 and [s["seq"] for s in view["samples"]] == [12]


def test_a_sample_holds_readiness_and_each_edges_path_and_rtt():
    history = History()
    sample = history.record(snap(path_out="relay", rtt=7.25, ready=False), 0.0)
    assert sample["ready"] is False and sample["why"] == "stage-0: no live owner of pp-stage-0"
    assert sample["edges"][f"{ME[:8]}>{PEER[:8]}"] == ["relay", 7.25]
    assert sample["edges"][f"{PEER[:8]}>{ME[:8]}"] == ["unknown", None], "the peer reported nothing yet"
    assert sample["nodes"] == {ME[:8]: "orchestrator", PEER[:8]: "stage-0"}
    assert sample["t"] == 1000.0
    assert sample["tokens_per_s"] is None and sample["steps_per_s"] is None, "no service, no rate"


def test_the_orchestrators_tokens_per_second_and_time_to_first_token():
    metrics = OrchestratorMetrics()
    history = History()
    first = history.record(snap(), 0.0, metrics)
    assert first["tokens_per_s"] is None and first["in_flight"] == 0, "a rate needs two readings"
    metrics.generation_tokens += 30
    metrics.first_token.observe(0.2)
    metrics.first_token.observe(0.4)
    metrics.in_flight = 2
    second = history.record(snap(), 2.0, metrics)
    assert second["tokens_per_s"] == 15.0
    assert second["ttft_ms"] == pytest.approx(300.0)
    assert second["in_flight"] == 2
    metrics.admitted = lambda: (16, 84)  # what the orchestrator's admission says now
    busy = history.record(snap(), 3.0, metrics)
    assert (busy["running"], busy["waiting"]) == (16, 84)
    metrics.admitted = lambda: (0, 0)
    idle = history.record(snap(), 4.0, metrics)
    assert idle["tokens_per_s"] == 0.0 and idle["ttft_ms"] is None, "no first token in that window"


def test_a_stages_compute_steps_per_second_and_their_mean_time():
    metrics = StageMetrics("stage-1")
    history = History()
    history.record(snap(), 10.0, metrics)
    for seconds in (0.001, 0.003):
        metrics.computed("decode", seconds)
    metrics.computed("prefill", 0.008)
    sample = history.record(snap(), 12.0, metrics)
    assert sample["steps_per_s"] == 1.5
    assert sample["step_ms"] == pytest.approx(4.0)
    assert sample["tokens_per_s"] is None


async def test_the_sampler_takes_one_sample_per_interval_and_survives_a_failing_snapshot(autojump_clock):
    history = History(interval=2.0)
    calls = 0

    def snapshot() -> dict:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("a bug in the snapshot")
        return snap()

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_history, history, snapshot)
        await trio.sleep(10.5)  # samples at 0, 2, 4 (fails), 6, 8, 10
        nursery.cancel_scope.cancel()
    assert calls == 6 and len(history.samples) == 5


# -- the push ----------------------------------------------------------------------------------

def test_listeners_are_capped():
    hub = LiveHub(lambda: {}, History(), max_clients=2)
    assert hub.admit() and hub.admit()
    assert not hub.admit()
    assert hub.counters["refused_full"] == 1
    hub.release()
    assert hub.admit()


async def test_a_push_carries_the_state_and_the_newest_samples():
    history = History()
    for i in range(10):
        history.record(snap(), float(i))
    hub = LiveHub(lambda: {"n": 1}, history)
    first = json.loads(hub.message())
    assert first["state"] == {"n": 1} and len(first["samples"]) == 10, "a new page gets the whole ring"
    got = []

    async def listen():
        got.append(await hub.next_push(0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(listen)
        await trio.testing.wait_all_tasks_blocked()
        hub.publish()
    [(version, text)] = got
    assert version == 1
    assert [s["seq"] for s in json.loads(text)["samples"]] == list(range(11 - TAIL, 11))


class FakeSocket:
    """Enough of Starlette's WebSocket for the endpoint: what it sends, and what it closes with."""

    def __init__(self, hub: LiveHub, incoming: list[dict] | None = None, *, stuck: bool = False) -> None:
        self.app = type("App", (), {"state": type("State", (), {"live": hub})()})()
        self.scope: dict = {"extensions": {}}
        self.incoming = incoming
        self.stuck = stuck
        self.sent: list[str] = []
        self.closed: tuple[int, str] | None = None

    async def accept(self) -> None:
        pass

    async def send_text(self, text: str) -> None:
        if self.stuck:
            await trio.sleep_forever()  # a client that stopped reading: the socket buffer is full
        self.sent.append(text)

    async def receive(self) -> dict:
        if self.incoming is None:
            await trio.sleep_forever()
        if not self.incoming:
            return {"type": "websocket.disconnect", "code": 1000}
        return self.incoming.pop(0)

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed = (code, reason or "")


async def test_a_client_that_does_not_read_is_closed_not_waited_on(autojump_clock):
    hub = LiveHub(lambda: {}, History(), send_timeout=5.0)
    socket = FakeSocket(hub, stuck=True)
    with trio.fail_after(60):
        await live(socket)  # type: ignore[arg-type]
    assert socket.closed is not None and socket.closed[0] == CLOSE_TRY_LATER
    assert hub.counters["closed_slow"] == 1 and hub.clients == 0


async def test_a_client_that_keeps_sending_is_closed():
    hub = LiveHub(lambda: {}, History())
    chatter = [{"type": "websocket.receive", "text": "?"}] * (MAX_CLIENT_MESSAGES + 5)
    socket = FakeSocket(hub, list(chatter))
    with trio.fail_after(10):
        await live(socket)  # type: ignore[arg-type]
    assert socket.closed is not None and socket.closed[0] == CLOSE_POLICY
    assert hub.counters["client_messages"] == MAX_CLIENT_MESSAGES + 1 and hub.clients == 0
    assert len(socket.sent) == 1, "the first state went out before"


async def test_a_client_that_leaves_frees_its_place():
    hub = LiveHub(lambda: {}, History(), max_clients=1)
    socket = FakeSocket(hub, [{"type": "websocket.receive", "bytes": b"\xff\x00garbage"}])
    with trio.fail_after(10):
        await live(socket)  # type: ignore[arg-type]
    assert socket.closed is None and hub.clients == 0
    assert hub.admit(), "its place is free again"


# -- through the guard (Starlette's test client) -----------------------------------------------

def test_the_live_feed_is_refused_without_the_token_or_from_another_origin():
    app = create_app(FakeNode(), token="s3cret")
    with TestClient(app, backend="trio") as c:
        for url, headers, status in [
            ("/api/live", {}, 401),
            ("/api/live?token=wrong", {}, 401),
            ("/api/live?token=s3cret", {"Origin": "http://evil.example"}, 403),
            ("/api/live?token=s3cret", {"Origin": "http://testserver:8080"}, 403),
            ("/api/live?token=s3cret", {"Origin": "null"}, 403),
            ("/api/live?token=s3cret", {"Sec-Fetch-Site": "cross-site"}, 403),
            ("/api/live?token=s3cret", {"Host": "attacker.example"}, 421),
        ]:
            with pytest.raises(WebSocketDenialResponse) as refused, c.websocket_connect(url, headers=headers):
                pass
            assert refused.value.status_code == status, (url, headers)
            assert "self" not in refused.value.text
        assert c.get("/api/state").status_code == 401 and c.get("/api/history").status_code == 401
        with c.websocket_connect("/api/live?token=s3cret", headers={"Origin": "http://testserver"}) as ws:
            message = ws.receive_json()
        assert message["state"]["peers"]["self"]["prefix"] == ME[:8]
        assert set(message["state"]) >= {"peers", "topology", "problems", "traces", "layers", "counters"}


def test_state_and_history_over_http_are_the_polling_fallback():
    node = FakeNode()
    app = create_app(node)
    app.app.state.history.record(node.snapshot(), 0.0)
    with TestClient(app, backend="trio") as c:
        state = c.get("/api/state").json()
        assert state["state"]["topology"]["readiness"]["ready"] is True
        assert [s["seq"] for s in state["samples"]] == [1]
        assert c.get("/api/state?since=1").json()["samples"] == []
        history = c.get("/api/history").json()
        assert history["ring"] == state["ring"], "one ring: the page knows a restarted node by another"
        assert history["capacity"] == 300 and history["interval_s"] == 2.0 and len(history["samples"]) == 1
        for bad in ("-1", "x", "9" * 40, "%C2%B2", "%E2%91%A0"):  # ², ①: digits to isdigit(), not to int()
            r = c.get(f"/api/history?since={bad}")
            assert r.status_code == 400 and "since" in r.json()["error"]


async def test_a_write_to_a_client_that_never_reads_ends_at_the_deadline():
    """Hypercorn writes inside a shielded scope, where no deadline of the app's reaches: the
    connection's own stream cuts a write that the client does not take, and closes it."""
    import socket

    from dashboard.server import DeadlineStream

    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stream = DeadlineStream(trio.SocketStream(trio.socket.from_stdlib_socket(ours)), deadline=0.2)
    try:
        # shielded, as Hypercorn's protocol_send runs it; the scope's own deadline ends a write
        # the stream failed to cut, so the test fails rather than hangs
        with trio.CancelScope(shield=True, deadline=trio.current_time() + 10) as hypercorn:
            with pytest.raises(trio.BrokenResourceError, match="took no data for 0.2 s"):
                await stream.send_all(b"x" * (8 << 20))
        assert not hypercorn.cancelled_caught
        with pytest.raises(trio.ClosedResourceError):
            await stream.send_all(b"more")
    finally:
        theirs.close()
