"""The dashboard API: a live 3-node mesh with a one-way drop seen from a third node,
and every bad input to the mutating endpoint answered with a 4xx, never a 500."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from dashboard.app import create_app, is_loopback_bind, parse_peer_addr
from meshd.testing.mesh import start_one_way_drop_mesh, wait_asymmetric

JSON = {"Content-Type": "application/json"}
PEER_FIELDS = {"id", "prefix", "role", "stage", "state", "incarnation", "addr", "relay_url", "path_out",
               "path_in", "rtt_ms", "out_ok", "out_fail", "in_seen", "last_seen_s"}


async def test_any_node_sees_the_whole_mesh_and_the_one_way_drop():
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nodes = await start_one_way_drop_mesh(nursery, lines)
            orch, s0, s1 = nodes["orchestrator"], nodes["stage-0"], nodes["stage-1"]
            # stage-0 is neither end of the broken pair: it knows only from the gossip.
            await wait_asymmetric(s0)
            async with httpx.AsyncClient(base_url=s0.dashboard_url, timeout=10) as client:
                topo = (await client.get("/api/topology")).json()
                assert {n["name"] for n in topo["nodes"]} == {"orchestrator", "stage-0", "stage-1"}
                assert len(topo["edges"]) == 6, "every ordered pair"
                paths = {(e["from_name"], e["to_name"]): e["path"] for e in topo["edges"]}
                assert paths[("stage-1", "orchestrator")] == "relay"
                assert paths[("orchestrator", "stage-1")] == "direct"
                assert paths[("stage-0", "stage-1")] == "direct"
                [asym] = topo["asymmetric"]
                assert (asym["a"], asym["b"]) == ("stage-1", "orchestrator")
                assert asym["detail"].startswith("stage-1→orchestrator: direct fails (")
                assert f"via relay {s1.options.relay}" in asym["detail"]
                assert " s; orchestrator→stage-1" in asym["detail"], "and since when"
                relayed = next(e for e in topo["edges"] if e["path"] == "relay")
                assert relayed["since_s"] is not None and relayed["since_s"] >= 0
                assert "; orchestrator→stage-1: direct" in asym["detail"]
                for e in topo["edges"]:
                    assert set(e) >= {"from", "to", "path", "ok", "rtt_ms"}

                peers = (await client.get("/api/peers")).json()
                assert set(peers["self"]) >= PEER_FIELDS and peers["self"]["prefix"] == s0.identity.prefix
                assert {p["prefix"] for p in peers["peers"]} == {orch.identity.prefix, s1.identity.prefix}
                for p in peers["peers"]:
                    assert set(p) >= PEER_FIELDS and p["state"] == "alive" and p["path_out"] == "direct"

                metrics = await client.get("/metrics")
                assert metrics.status_code == 200
                assert "meshd_mesh_asymmetric_pairs 1.0" in metrics.text
                assert 'meshd_mesh_edges{path="relay"} 1.0' in metrics.text

                page = await client.get("/")
                assert page.status_code == 200 and "<svg" in page.text
                assert "http://" not in page.text.replace("http://www.w3.org/2000/svg", ""), "no CDN"

                snap = (await client.get("/api/snapshot")).json()
                assert set(snap["path_summaries"]) == {n.identity.node_id.hex() for n in nodes.values()}

                # The last minutes, as the node keeps them for the page's charts.
                history = (await client.get("/api/history")).json()
                last = history["samples"][-1]
                assert last["seq"] >= 1 and last["ready"] in (True, False)
                assert set(last["nodes"].values()) <= {"orchestrator", "stage-0", "stage-1"}
                state = (await client.get(f"/api/state?since={last['seq']}")).json()
                [pushed] = state["state"]["topology"]["asymmetric"]
                assert (pushed["a"], pushed["b"]) == ("stage-1", "orchestrator"), "what the page draws"
                assert all(s["seq"] > last["seq"] for s in state["samples"])

            async with httpx.AsyncClient(base_url=s1.dashboard_url, timeout=10) as client:
                peers = {p["name"]: p for p in (await client.get("/api/peers")).json()["peers"]}
                assert peers["orchestrator"]["path_out"] == "relay"
                assert peers["orchestrator"]["out_fail"] > 0
                assert "dashboard url=" in "\n".join(lines) and "token=" not in "\n".join(lines)
            nursery.cancel_scope.cancel()


async def test_add_peer_joins_a_node_that_knew_nobody():
    from meshd.node import NodeOptions
    from meshd.testing.inprocess import start_node, wait_converged

    lines: list[str] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a = await start_node(nursery, NodeOptions(profile="local", dashboard="127.0.0.1:0"), lines)
            b = await start_node(nursery, NodeOptions(profile="local", stage=0), lines)
            assert a.swim.live_count() == 1
            async with httpx.AsyncClient(base_url=a.dashboard_url, timeout=10) as client:
                r = await client.post("/api/peers/add", json={"addr": b.addr})
                assert r.status_code == 202 and r.json() == {"joining": b.addr}
            await wait_converged([a, b])
            nursery.cancel_scope.cancel()


class FakeNode:
    """Enough of a node for the app: a fixed snapshot, and joins recorded."""

    def __init__(self) -> None:
        self.joined: list[list[str]] = []

    def snapshot(self) -> dict:
        me = {"id": "aa" * 32, "prefix": "aaaaaaaa", "name": "orchestrator", "role": "orchestrator",
              "stage": None, "state": "alive", "incarnation": 0, "addr": "127.0.0.1:1", "relay_url": None}
        return {"self": me, "members": [], "names": {}, "relay": None, "path_summaries": {},
                "awareness": 0, "counters": {}}

    def join(self, addrs: list[str]) -> None:
        self.joined.append(list(addrs))


@pytest.fixture
def client():
    node = FakeNode()
    with TestClient(create_app(node), backend="trio") as c:
        c.node = node
        yield c


@pytest.mark.parametrize(("body", "message"), [
    (b"{", "not JSON"),
    (b"[]", "JSON object"),
    (b"{}", "'addr' must be"),
    (b'{"addr": 7}', "'addr' must be"),
    (b'{"addr": "10.0.0.1"}', "is not HOST:PORT"),
    (b'{"addr": "10.0.0.1:http"}', "is not a number"),
    (b'{"addr": "10.0.0.1:70000"}', "out of range"),
    (b'{"addr": "example.com:7946"}', "not an IP address"),
    (b'{"addr": "0.0.0.0:7946"}', "cannot be a peer"),
])
def test_bad_add_peer_bodies_get_400_with_a_message(client, body, message):
    r = client.post("/api/peers/add", content=body, headers=JSON)
    assert r.status_code == 400
    assert message in r.json()["error"]
    assert client.node.joined == []


def test_add_peer_normalises_the_address(client):
    r = client.post("/api/peers/add", json={"addr": "localhost:7946"})
    assert r.status_code == 202
    assert client.node.joined == [["127.0.0.1:7946"]]
    assert client.post("/api/peers/add", json={"addr": "[::1]:7946"}).json() == {"joining": "[::1]:7946"}


def test_beyond_loopback_add_peer_needs_the_token():
    node = FakeNode()
    with TestClient(create_app(node, token="s3cret"), backend="trio") as c:
        assert c.post("/api/peers/add", json={"addr": "10.0.0.1:7946"}).status_code == 401
        assert c.post("/api/peers/add", json={"addr": "10.0.0.1:7946"},
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post("/api/peers/add", json={"addr": "10.0.0.1:7946"},
                      headers={"Authorization": "Bearer s3cret"}).status_code == 202
        assert c.post("/api/peers/add?token=s3cret", json={"addr": "10.0.0.1:7946"}).status_code == 202
        assert c.get("/api/peers").status_code == 401, "reading needs the token too"
        assert c.get("/api/peers", headers={"X-Meshd-Token": "s3cret"}).status_code == 200
    assert node.joined == [["10.0.0.1:7946"]] * 2


@pytest.mark.parametrize(("bind", "loopback"), [("127.0.0.1:0", True), ("[::1]:80", True),
                                                ("localhost:1", True), ("0.0.0.0:0", False),
                                                ("10.1.2.3:9", False), ("example.com:1", False)])
def test_loopback_binds(bind, loopback):
    assert is_loopback_bind(bind) is loopback


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda inner: (st.lists(inner, max_size=3)
                                    | st.dictionaries(st.text(), inner, max_size=3)),
                     max_leaves=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(
    st.binary(max_size=64),
    st.builds(lambda v: json.dumps({"addr": v}).encode(), _json),
    st.builds(lambda h, p: json.dumps({"addr": f"{h}:{p}"}).encode(), st.text(max_size=20),
              st.text(max_size=8) | st.integers().map(str)),
    _json.map(lambda v: json.dumps(v).encode()),
))
def test_fuzzed_add_peer_never_gives_a_500(client, body):
    r = client.post("/api/peers/add", content=body, headers=JSON)
    assert r.status_code in (202, 400), r.text
    if r.status_code == 202:
        assert parse_peer_addr(json.loads(body)["addr"]) == r.json()["joining"]


async def test_the_orchestrator_shows_where_one_tokens_time_goes(checkpoint):
    from meshd.node import NodeOptions
    from meshd.testing.inprocess import start_node, wait_converged

    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            opts = dict(profile="local", stages=2, model=str(checkpoint), dashboard="127.0.0.1:0")
            orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
            stages = [await start_node(nursery, NodeOptions(stage=k, seeds=[orch.addr], **opts), lines)
                      for k in range(2)]
            await wait_converged([orch, *stages])
            await orch.app.wait_ready(10)
            async with httpx.AsyncClient(base_url=orch.dashboard_url, timeout=30) as client:
                assert (await client.get("/api/traces")).json()["per_token"] == []
                r = await client.post("/api/generate", json={"prompt": "Hello", "max_tokens": 4})
                assert r.status_code == 200, r.text
                traces = (await client.get("/api/traces")).json()
            assert traces["orchestrator"] is True and len(traces["requests"]) == 1
            hops = {h["name"]: h for h in traces["per_token"]}
            assert {"stage-0", "stage-1"} <= set(hops), hops
            assert hops["stage-0"]["kind"] == "compute" and hops["stage-0"]["ms"] > 0
            transit = [h for h in traces["per_token"] if h["kind"] == "transit"]
            assert transit and all(h["path"] in ("direct", "relay") for h in transit)
            async with httpx.AsyncClient(base_url=stages[0].dashboard_url, timeout=10) as client:
                assert (await client.get("/api/traces")).json() == {
                    "orchestrator": False, "requests": [], "per_token": []}
            nursery.cancel_scope.cancel()


async def test_beyond_loopback_the_boot_line_carries_the_token():
    from meshd.node import NodeOptions
    from meshd.testing.inprocess import start_node

    lines: list[str] = []
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            node = await start_node(nursery, NodeOptions(profile="local", dashboard="0.0.0.0:0"), lines)
            [line] = [x for x in lines if x.startswith("meshd dashboard ")]
            token = line.rsplit(" token=", 1)[1]
            assert len(token) >= 24 and token == node.dashboard_token
            port = node.dashboard_url.rsplit(":", 1)[1]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
                body = {"addr": "127.0.0.1:9"}
                assert (await client.post("/api/peers/add", json=body)).status_code == 401
                auth = {"Authorization": f"Bearer {token}"}
                r = await client.post("/api/peers/add", json=body, headers=auth)
                assert r.status_code == 202
            nursery.cancel_scope.cancel()
