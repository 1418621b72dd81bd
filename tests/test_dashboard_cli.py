"""``meshd peers`` and ``meshd doctor`` against a live mesh with a one-way drop."""

from __future__ import annotations

import json
from functools import partial

import trio

from meshd.cli import main
from meshd.testing.mesh import start_one_way_drop_mesh, wait_asymmetric


async def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await trio.to_thread.run_sync(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_peers_and_doctor_name_the_broken_direction(capsys):
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nodes = await start_one_way_drop_mesh(nursery, lines)
            await wait_asymmetric(nodes["orchestrator"])
            url = nodes["orchestrator"].dashboard_url

            code, out, _ = await _run(capsys, "peers", url, "--json")
            data = json.loads(out)
            assert code == 0 and data["self"]["name"] == "orchestrator"
            assert sorted(p["name"] for p in data["peers"]) == ["stage-0", "stage-1"]
            assert [(a["a"], a["b"]) for a in data["asymmetric"]] == [("stage-1", "orchestrator")]

            code, out, _ = await _run(capsys, "peers", url)
            assert code == 0
            assert "stage-1" in out and "asymmetric stage-1→orchestrator: direct fails" in out

            code, out, _ = await _run(capsys, "doctor", url, "--json")
            report = json.loads(out)
            assert code == 1 and report["ok"] is False
            [problem] = report["problems"]
            assert problem["kind"] == "asymmetric" and problem["where"] == "stage-1→orchestrator"
            assert "stage-1's packets to orchestrator" in problem["check"]
            assert {"from": "orchestrator", "to": "stage-1", "path": "direct"} in report["paths"]

            code, out, _ = await _run(capsys, "doctor", url)
            assert code == 1 and "stage-1→orchestrator" in out and "firewall" in out

            await wait_asymmetric(nodes["stage-0"])  # a third node learns the pair by gossip
            code, out, _ = await _run(capsys, "doctor", nodes["stage-0"].dashboard_url, "--json")
            assert code == 1 and json.loads(out)["problems"][0]["where"] == "stage-1→orchestrator", \
                "a third node diagnoses the pair from the gossip"
            nursery.cancel_scope.cancel()


async def test_doctor_says_ok_on_a_healthy_mesh_and_2_when_unreachable(capsys):
    from meshd.node import NodeOptions
    from meshd.testing.inprocess import start_node, wait_converged

    lines: list[str] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            opts = dict(profile="local", stages=1, dashboard="127.0.0.1:0")
            a = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
            b = await start_node(nursery, NodeOptions(stage=0, seeds=[a.addr], **opts), lines)
            await wait_converged([a, b])
            with trio.fail_after(10):
                while True:
                    code, out, _ = await _run(capsys, "doctor", a.dashboard_url)
                    if code == 0:
                        break
                    await trio.sleep(0.2)  # until stage-0's first summary arrives
            # Gossip alone, no model: ready by its names and paths, and warned it cannot generate.
            assert out.startswith("ready: yes (stage-0)\nWarnings\n  no node serves a model"), out
            assert "\nok: 2 live nodes (orchestrator, stage-0)" in out, out
            nursery.cancel_scope.cancel()
    code, _, err = await _run(capsys, "doctor", "http://127.0.0.1:1", "--json")
    assert code == 2 and "meshd doctor: cannot read http://127.0.0.1:1/api/snapshot" in err


def test_doctors_load_line_says_when_a_queue_or_a_stage_is_full():
    from dashboard.cli import _load_line

    orchestrator = {"running": 2, "waiting": 0, "max_running": 64, "max_queued": 256, "kv_used_mb": 4.6,
                    "kv_budget_mb": 1024.0, "refused_busy": 0}
    assert _load_line(orchestrator) == ("load: 2 running (--max-running 64), 0 waiting (--max-queued 256), "
                                        "KV cache 4.6 of 1024 MB at the largest stage")
    stage = {"requests": 5, "kv_used_mb": 3.8, "kv_budget_mb": 4.0, "waiting_for_room": 2}
    assert _load_line(stage) == ("[yellow]full[/yellow]: 5 requests held, KV cache 3.8 of 4 MB "
                                 "(--kv-budget-mb); 2 starts waiting for room (the orchestrator admits by a "
                                 "larger budget)")
    assert _load_line({**stage, "waiting_for_room": 0}).startswith("load: 5 requests held")


async def test_an_https_url_to_a_plain_http_dashboard_says_tls_failed_and_what_to_use(capsys):
    async def plain_http(stream: trio.SocketStream) -> None:
        await stream.receive_some(4096)
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await stream.aclose()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(partial(trio.serve_tcp, plain_http, 0, host="127.0.0.1"))
            port = listener.socket.getsockname()[1]
            code, _, err = await _run(capsys, "peers", f"https://127.0.0.1:{port}")
            nursery.cancel_scope.cancel()
    assert code == 2 and "TLS failed: " in err and "its URL starts with http://" in err, err
