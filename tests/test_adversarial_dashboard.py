"""Attacks on a node's dashboard, over real sockets on loopback, and what must not happen.

Each test aims at a node that could act (an orchestrator with a model behind it,
a join that would go through), records every join and every generation, and
checks the attack left both lists empty; a control request from the dashboard's
own side shows the same node does act when asked properly.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from contextlib import AsyncExitStack, asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, open_websocket_url, wrap_client_stream

from dashboard.app import MAX_BODY_BYTES
from dashboard.guard import HOSTS_ENV
from dashboard.live import MAX_CLIENT_MESSAGE_BYTES, MAX_CLIENT_MESSAGES, MAX_CLIENTS
from meshd.node import NodeOptions
from meshd.testing.inprocess import start_node, wait_converged

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync",
         # evil.example and attacker.example are names an attacker controls; here both point at us.
         "--host-resolver-rules=MAP evil.example 127.0.0.1, MAP attacker.example 127.0.0.1"]
JOIN = {"addr": "127.0.0.1:9"}
GENERATE = {"prompt": "pwned", "max_tokens": 2}
API = [("GET", "/api/peers"), ("GET", "/api/topology"), ("GET", "/api/traces"), ("GET", "/api/snapshot"),
       ("POST", "/api/peers/add"), ("POST", "/api/generate"), ("POST", "/v1/completions")]
MIB = 1 << 20
NOT_JSON = ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", None)


def refusal(r: httpx.Response) -> str:
    """A refusal's message: under /v1 in OpenAI's shape (``{"error": {"message", ..}}``), so its
    clients show it; elsewhere ``{"error": message}``."""
    error = r.json()["error"]
    if r.request.url.path.startswith("/v1/"):
        assert set(error) == {"message", "type", "param", "code"}, error
        return error["message"]
    return error


@asynccontextmanager
async def victim(checkpoint: Path | None = None, dashboard: str = "127.0.0.1:0"):
    """A node serving its dashboard (an orchestrator with one stage when given a checkpoint),
    with every join and generation it starts recorded in ``node.acted``."""
    lines: list[str] = []
    async with trio.open_nursery() as nursery:
        if checkpoint is None:
            node = await start_node(nursery, NodeOptions(profile="local", dashboard=dashboard), lines)
        else:
            opts = dict(profile="local", stages=1, model=str(checkpoint))
            node = await start_node(nursery, NodeOptions(role="orchestrator", dashboard=dashboard, **opts),
                                    lines)
            stage = await start_node(nursery, NodeOptions(stage=0, seeds=[node.addr], **opts), lines)
            await wait_converged([node, stage])
            await node.app.wait_ready(10)
        node.acted = []
        join = node.node.join
        node.node.join = lambda addrs: (node.acted.append(("join", addrs)), join(addrs))[1]
        if node.app is not None:
            generate = node.app.generate

            async def recorded_generate(**params):
                node.acted.append(("generate", params["prompt"]))
                return await generate(**params)

            node.app.generate = recorded_generate
        node.port = int(node.dashboard_url.rsplit(":", 1)[1])
        node.local_url = f"http://127.0.0.1:{node.port}"
        yield node
        nursery.cancel_scope.cancel()


async def test_a_foreign_host_is_refused_and_nothing_runs(checkpoint):
    with trio.fail_after(60):
        async with victim(checkpoint) as node, httpx.AsyncClient(base_url=node.local_url, timeout=30) as c:
            for host in (f"attacker.example:{node.port}", "attacker.example", f"localhost.evil:{node.port}"):
                # What a page whose DNS name was rebound to 127.0.0.1 sends: its own name.
                r = await c.post("/api/peers/add", json=JOIN, headers={"Host": host})
                assert r.status_code == 421, r.text
                assert host in r.json()["error"] and HOSTS_ENV in r.json()["error"]
                r = await c.post("/api/generate", json=GENERATE, headers={"Host": host})
                assert r.status_code == 421
                r = await c.get("/api/snapshot", headers={"Host": host})
                assert r.status_code == 421 and "self" not in r.json(), "nothing read either"
            # A port of digits that are digits to str.isdigit() but not to int() (², in Latin-1).
            r = await c.post("/api/generate", json=GENERATE, headers={"Host": b"127.0.0.1:\xb2"})
            assert r.status_code == 421, r.text
            assert node.acted == []
            assert node.app.recent_traces == type(node.app.recent_traces)([], maxlen=256)

            for host in (f"127.0.0.1:{node.port}", f"localhost:{node.port}"):
                r = await c.post("/api/generate", json=GENERATE, headers={"Host": host})
                assert r.status_code == 200, r.text
            assert node.acted == [("generate", "pwned")] * 2


async def test_a_name_the_user_allows_is_served(monkeypatch):
    monkeypatch.setenv(HOSTS_ENV, " meshd.test , other.test:1")
    with trio.fail_after(30):
        async with victim() as node, httpx.AsyncClient(base_url=node.local_url, timeout=10) as c:
            assert (await c.get("/api/peers", headers={"Host": f"meshd.test:{node.port}"})).status_code == 200
            assert (await c.get("/api/peers", headers={"Host": f"other.test:{node.port}"})).status_code == 421
            assert (await c.get("/api/peers", headers={"Host": "other.test:1"})).status_code == 200


async def test_a_cross_origin_post_is_refused_and_nothing_runs(checkpoint):
    with trio.fail_after(60):
        async with victim(checkpoint) as node, httpx.AsyncClient(base_url=node.local_url, timeout=30) as c:
            foreign = [{"Origin": "http://evil.example"},
                       {"Origin": f"http://evil.example:{node.port}"},
                       {"Origin": f"http://127.0.0.1:{node.port + 1}"},  # another port: another origin
                       {"Origin": "null"},  # a sandboxed frame or a file: page
                       {"Sec-Fetch-Site": "cross-site"},
                       {"Sec-Fetch-Site": "same-site"}]
            for headers in foreign:
                for path, body in (("/api/peers/add", JOIN), ("/api/generate", GENERATE),
                                   ("/v1/completions", GENERATE)):
                    r = await c.post(path, json=body, headers=headers)
                    assert r.status_code == 403, (path, headers, r.text)
                    assert "cannot change this node" in refusal(r)
            assert node.acted == []

            # The dashboard's own page, and clients that send no Origin (curl, httpx, openai), act.
            r = await c.post("/api/peers/add", json=JOIN, headers={"Origin": node.local_url,
                                                                    "Sec-Fetch-Site": "same-origin"})
            assert r.status_code == 202
            assert (await c.post("/v1/completions", json=GENERATE)).status_code == 200
            assert node.acted == [("join", ["127.0.0.1:9"]), ("generate", "pwned")]


async def test_a_post_that_is_not_json_is_refused_and_nothing_runs(checkpoint):
    """text/plain, form and multipart bodies are what a page can post without a preflight."""
    with trio.fail_after(60):
        async with victim(checkpoint) as node, httpx.AsyncClient(base_url=node.local_url, timeout=30) as c:
            for content_type in NOT_JSON:
                headers = {} if content_type is None else {"Content-Type": content_type}
                r = await c.post("/api/peers/add", content=b'{"addr": "127.0.0.1:9"}', headers=headers)
                assert r.status_code == 415, (content_type, r.text)
                assert "application/json" in r.json()["error"]
                r = await c.post("/api/generate", content=b'{"prompt": "pwned"}', headers=headers)
                assert r.status_code == 415
                r = await c.post("/v1/chat/completions", content=b'{"messages": []}', headers=headers)
                assert r.status_code == 415 and "application/json" in refusal(r)
            assert node.acted == []
            r = await c.post("/api/generate", content=b'{"prompt": "pwned", "max_tokens": 2}',
                             headers={"Content-Type": "application/json; charset=utf-8"})
            assert r.status_code == 200 and node.acted == [("generate", "pwned")]


def _peak_rss_reset() -> bool:
    """Reset this process's peak RSS (VmHWM), so it measures what comes next; False if not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


async def test_a_256_mib_body_is_cut_off_and_memory_stays_flat():
    """The node runs in this process: its peak RSS while 256 MiB stream at it is ours."""
    chunk = b"[" * (64 << 10)

    async def body():
        for _ in range(256 * MIB // len(chunk)):
            yield chunk

    with trio.fail_after(120):
        async with victim() as node, httpx.AsyncClient(base_url=node.local_url, timeout=60) as c:
            await c.get("/api/peers")  # warm: the first request allocates what every request reuses
            for lengths in ({}, {"Content-Length": str(256 * MIB)}):
                exact_peak = _peak_rss_reset()
                before = _status_kib("VmRSS")
                r = await c.post("/api/peers/add", content=body(),
                                 headers={"Content-Type": "application/json", **lengths})
                after = _status_kib("VmHWM" if exact_peak else "VmRSS")
                grown_mib = (after - before) / 1024
                print(f"256 MiB body{' with Content-Length' if lengths else ', chunked'}: "
                      f"RSS {before / 1024:.1f} MiB before, {'peak' if exact_peak else 'after'} "
                      f"{after / 1024:.1f} MiB (+{grown_mib:.1f} MiB)")
                assert r.status_code == 413, r.text
                assert str(MAX_BODY_BYTES) in r.json()["error"]
                assert grown_mib < 20
            assert node.acted == []
            # The node still serves: the cut-off cost one connection, nothing else.
            assert (await c.post("/api/peers/add", json=JOIN)).status_code == 202


async def test_deeply_nested_json_gets_400_not_500(checkpoint):
    deep = b"[" * 400_000 + b"]" * 400_000
    deep_in_object = b'{"addr": ' + b"[" * 400_000 + b"]" * 400_000 + b"}"
    with trio.fail_after(60):
        async with victim(checkpoint) as node, httpx.AsyncClient(base_url=node.local_url, timeout=30) as c:
            for path in ("/api/peers/add", "/api/generate", "/v1/completions"):
                for content in (deep, deep_in_object, b"[" * 400_000):
                    r = await c.post(path, content=content, headers={"Content-Type": "application/json"})
                    assert r.status_code == 400, (path, r.status_code, r.text[:200])
                    assert re.search(r"nested 40000\d levels deep; at most 32", refusal(r)), r.text
            # Brackets inside strings are text, not nesting.
            r = await c.post("/api/generate", json={"prompt": "[" * 100, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert node.acted == [("generate", "[" * 100)]


def _machine_ip() -> str | None:
    """This machine's address on its default route (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


async def test_beyond_loopback_every_api_endpoint_needs_the_token():
    with trio.fail_after(30):
        async with victim(dashboard="0.0.0.0:0") as node:
            token = node.dashboard_token
            assert token
            # Through loopback, and through the machine's own address (its Host is that address).
            bases = [node.local_url] + ([f"http://{ip}:{node.port}"] if (ip := _machine_ip()) else [])
            for base in bases:
                async with httpx.AsyncClient(base_url=base, timeout=10) as c:
                    for method, path in API:
                        r = await c.request(method, path, json={})
                        assert r.status_code == 401, (base, method, path, r.status_code)
                        assert "token" in refusal(r)
                        r = await c.request(method, path, json={},
                                            headers={"Authorization": "Bearer " + "x" * len(token)})
                        assert r.status_code == 401, (base, method, path, "a wrong token")
                    page = await c.get("/")
                    assert page.status_code == 200 and "<svg" in page.text
                    assert (await c.get("/static/app.js")).status_code == 200
                    metrics = await c.get("/metrics")
                    assert metrics.status_code == 200 and "meshd_" in metrics.text
                    for given in ({"headers": {"X-Meshd-Token": token}}, {"params": {"token": token}},
                                  {"headers": {"Authorization": f"Bearer {token}"}}):
                        assert (await c.get("/api/snapshot", **given)).status_code == 200
                        r = await c.post("/api/generate", json=GENERATE, **given)
                        assert r.status_code == 404, "past the guard: this node has no model"
            assert node.acted == []


async def test_every_response_carries_the_security_headers():
    with trio.fail_after(30):
        async with victim() as node, httpx.AsyncClient(base_url=node.local_url, timeout=10) as c:
            responses = [await c.get("/"), await c.get("/api/peers"), await c.get("/static/app.js"),
                         await c.get("/metrics"), await c.get("/nowhere"),
                         await c.post("/api/peers/add", json=JOIN, headers={"Origin": "http://evil.example"}),
                         await c.get("/", headers={"Host": "attacker.example"})]
            for r in responses:
                csp = r.headers.get("content-security-policy", "")
                assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, (r.url, r.headers)
                assert "unsafe-inline" not in csp
                assert r.headers["x-content-type-options"] == "nosniff"
                assert r.headers["x-frame-options"] == "DENY"
                assert r.headers["referrer-policy"] == "no-referrer"
            assert "<script>" not in responses[0].text and " style=" not in responses[0].text, \
                "nothing inline: the CSP would block it"


# -- the live feed (a WebSocket) ------------------------------------------------------------------

async def _live_refusal(url: str, headers: list[tuple[bytes, bytes]]) -> ConnectionRejected:
    """The handshake's refusal (raises if the feed was opened)."""
    try:
        async with open_websocket_url(url, extra_headers=headers, connect_timeout=10):
            pass
    except ConnectionRejected as refused:
        return refused
    raise AssertionError(f"{url} {headers}: the feed opened")


async def _first_push(url: str, headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    async with open_websocket_url(url, extra_headers=headers or [], connect_timeout=10,
                                  max_message_size=16 * MIB) as ws:
        return json.loads(await ws.get_message())


async def _closed_with(ws) -> int | None:
    """Read until the server closes; its close code."""
    try:
        while True:
            await ws.get_message()
    except ConnectionClosed as closed:
        return closed.reason.code


@pytest.mark.parametrize("dashboard", ["127.0.0.1:0", "0.0.0.0:0"])
async def test_a_live_feed_without_the_token_or_from_another_origin_is_refused(dashboard):
    with trio.fail_after(30):
        async with victim(dashboard=dashboard) as node:
            token = node.dashboard_token
            ws_url = f"ws://127.0.0.1:{node.port}/api/live"
            with_token = f"{ws_url}?token={token}" if token else ws_url
            refusals = [(with_token, [(b"Origin", b"http://evil.example")], 403),
                        (with_token, [(b"Origin", f"http://evil.example:{node.port}".encode())], 403),
                        (with_token, [(b"Origin", f"http://127.0.0.1:{node.port + 1}".encode())], 403),
                        (with_token, [(b"Origin", b"null")], 403),
                        (with_token, [(b"Sec-Fetch-Site", b"cross-site")], 403)]
            if token:
                refusals += [(ws_url, [], 401), (ws_url, [(b"Origin", node.local_url.encode())], 401),
                             (f"{ws_url}?token={'x' * len(token)}", [], 401)]
            for url, headers, status in refusals:
                refused = await _live_refusal(url, headers)
                assert refused.status_code == status, (url, headers, refused.status_code)
                body = json.loads(refused.body)
                assert "error" in body and "peers" not in body
                assert node.identity.prefix not in refused.body.decode(), "nothing of the node's told"
            # A page whose DNS name was rebound to us: its own name in Host.
            rebound: list[int] = []
            try:
                async with trio.open_nursery() as nursery:
                    stream = await trio.open_tcp_stream("127.0.0.1", node.port)
                    path = "/api/live" + (f"?token={token}" if token else "")
                    await wrap_client_stream(nursery, stream, f"attacker.example:{node.port}", path)
            except* ConnectionRejected as group:
                rebound = [e.status_code for e in group.exceptions if isinstance(e, ConnectionRejected)]
            assert rebound == [421]
            # The dashboard's own page, and clients without Origin, get the state.
            for headers in ([(b"Origin", node.local_url.encode())], []):
                push = await _first_push(with_token, headers)
                assert push["state"]["peers"]["self"]["prefix"] == node.identity.prefix
            assert node.acted == []


async def test_garbage_on_the_live_feed_does_not_break_the_node():
    with trio.fail_after(60):
        async with victim() as node:
            url = f"ws://127.0.0.1:{node.port}/api/live"
            # Junk the page never sends: read and dropped, the pushes go on.
            async with open_websocket_url(url, max_message_size=16 * MIB) as ws:
                await ws.get_message()
                for junk in (b"\xff\xfe\x00" * 100, "not json", "{", '{"op": "join", "addr": "127.0.0.1:9"}',
                             "\u0000" * 1000):
                    await ws.send_message(junk)
                state = json.loads(await ws.get_message())  # the next push
                assert state["state"]["peers"]["self"]["prefix"] == node.identity.prefix
            # A message past the cap is cut off (1009) before it is held.
            async with open_websocket_url(url, max_message_size=16 * MIB) as ws:
                await ws.send_message("x" * (MAX_CLIENT_MESSAGE_BYTES + 1))
                assert await _closed_with(ws) == 1009
            # A client that keeps talking is closed (1008).
            async with open_websocket_url(url, max_message_size=16 * MIB) as ws:
                try:
                    for _ in range(MAX_CLIENT_MESSAGES + 10):
                        await ws.send_message("hello?")
                    code = await _closed_with(ws)
                except ConnectionClosed as closed:  # closed while we were still talking
                    code = closed.reason.code
                assert code == 1008
            # Bytes that are not WebSocket frames after the handshake, and no handshake at all.
            for opening in (b"GET /api/live HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nUpgrade: websocket\r\n"
                            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                            b"Sec-WebSocket-Version: 13\r\n\r\n" % node.port,
                            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"):
                stream = await trio.open_tcp_stream("127.0.0.1", node.port)
                await stream.send_all(opening)
                await stream.send_all(bytes(range(256)) * 64)
                with trio.move_on_after(5):
                    while await stream.receive_some(65536):
                        pass
                await stream.aclose()
            # The node still serves, the feed too, and every place the garbage took is free again.
            async with httpx.AsyncClient(base_url=node.local_url, timeout=10) as c:
                assert (await c.get("/api/peers")).status_code == 200
            async with AsyncExitStack() as stack:
                for _ in range(MAX_CLIENTS):
                    ws = await stack.enter_async_context(open_websocket_url(url, max_message_size=16 * MIB))
                    assert "state" in json.loads(await ws.get_message())
            assert node.acted == []


async def test_the_live_feed_takes_so_many_listeners_and_then_says_poll():
    with trio.fail_after(60):
        async with victim() as node:
            url = f"ws://127.0.0.1:{node.port}/api/live"
            async with AsyncExitStack() as stack:
                listeners = [await stack.enter_async_context(open_websocket_url(url))
                             for _ in range(MAX_CLIENTS)]
                refused = await _live_refusal(url, [])
                assert refused.status_code == 503 and "/api/state" in json.loads(refused.body)["error"]
                async with httpx.AsyncClient(base_url=node.local_url, timeout=10) as c:
                    assert "state" in (await c.get("/api/state")).json(), "polling still answers"
                    scraped = (await c.get("/metrics")).text  # what an operator sees of the feed
                assert f"meshd_dashboard_live_listeners {float(MAX_CLIENTS)}" in scraped, scraped
                assert 'meshd_dashboard_live_events_total{event="refused_full"} 1.0' in scraped
                await listeners[0].aclose()
                while True:  # its place frees once the server hears it leave
                    try:
                        assert "state" in await _first_push(url)
                        break
                    except ConnectionRejected:
                        await trio.sleep(0.05)


# -- in a browser -----------------------------------------------------------------------------

needs_chromium = pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                                    reason=f"{CHROMIUM} missing: apt-get install -y chromium (as root)")

ATTACK_PAGE = """<!doctype html>
<html><body>
<form id="join" method="POST" action="{node}/api/peers/add" enctype="text/plain" target="sink1">
  <input name='{{"addr": "127.0.0.1:9", "x": "' value='"}}'>
</form>
<form id="gen" method="POST" action="{node}/api/generate" enctype="text/plain" target="sink2">
  <input name='{{"prompt": "pwned", "max_tokens": 2, "x": "' value='"}}'>
</form>
<iframe name="sink1"></iframe><iframe name="sink2"></iframe>
<script>
async function attack() {{
  for (const [path, body] of [["/api/peers/add", '{{"addr": "127.0.0.1:9"}}'],
                              ["/api/generate", '{{"prompt": "pwned", "max_tokens": 2}}']]) {{
    try {{
      await fetch("{node}" + path, {{method: "POST", mode: "no-cors", body,
                                     headers: {{"Content-Type": "text/plain"}}}});
    }} catch (e) {{}}
  }}
  document.getElementById("join").submit();
  document.getElementById("gen").submit();
}}
attack();
</script>
</body></html>
"""


def _serve_attacker(html: str) -> tuple[ThreadingHTTPServer, int]:
    """Another origin: a plain HTTP server on another port, serving the attacker's page."""

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _browse_attack(attack_url: str, node_url: str, port: int) -> dict:
    """Open the attacker's page and a rebound name; return what reached the node (runs in a thread)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page()
            hits: list[tuple[str, str, int]] = []
            page.on("response", lambda r: hits.append((r.request.method, r.url, r.status))
                    if r.url.startswith(node_url) else None)
            page.goto(attack_url)
            for _ in range(150):  # two fetches and two forms, each answered
                if len([h for h in hits if h[0] == "POST"]) >= 4:
                    break
                page.wait_for_timeout(100)
            shown = {"attack": sorted(hits)}
            # DNS rebinding: attacker.example now resolves to us, so its page reaches the node
            # with the attacker's name in Host, and same-origin rules let it read the answers.
            rebound = f"http://attacker.example:{port}"
            r = page.goto(rebound + "/")
            shown["rebound_page"] = r.status if r is not None else None
            shown["rebound_post"] = page.evaluate(
                """async () => (await fetch("/api/peers/add", {method: "POST",
                     headers: {"Content-Type": "application/json"},
                     body: JSON.stringify({addr: "127.0.0.1:9"})})).status""")
            return shown
        finally:
            browser.close()


def _browse_dashboard(url: str, wait_for: str) -> dict:
    """Open the dashboard; what it shows, and any CSP violation (runs in a thread)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page()
            messages: list[str] = []
            page.on("console", lambda m: messages.append(m.text))
            page.goto(url)
            # Polled from here: page.wait_for_function would evaluate a string, which the CSP forbids.
            for _ in range(400):
                if page.evaluate(wait_for):
                    break
                page.wait_for_timeout(50)
            return {"me": page.inner_text("#me"), "feed": page.inner_text("#feed"), "console": messages,
                    "rows": page.eval_on_selector_all("#peers tbody tr", "els => els.length")}
        finally:
            browser.close()


@needs_chromium
@pytest.mark.browser
async def test_a_page_from_another_origin_cannot_make_the_node_act(checkpoint):
    with trio.fail_after(120):
        async with victim(checkpoint) as node:
            server, attack_port = _serve_attacker(ATTACK_PAGE.format(node=node.local_url))
            try:
                shown = await trio.to_thread.run_sync(
                    _browse_attack, f"http://evil.example:{attack_port}/", node.local_url, node.port)
            finally:
                server.shutdown()
            assert node.acted == [], "the node joined or generated for the attacker"
    posts = [h for h in shown["attack"] if h[0] == "POST"]
    assert sorted(p[1].rsplit("/", 1)[1] for p in posts) == ["add", "add", "generate", "generate"], shown
    assert all(status in (403, 415) for _, _, status in posts), posts
    assert shown["rebound_page"] == 421
    assert shown["rebound_post"] == 421


@needs_chromium
@pytest.mark.browser
async def test_the_page_works_under_its_csp_and_with_a_token_beyond_loopback():
    with trio.fail_after(90):
        async with victim(dashboard="0.0.0.0:0") as node:
            url = f"{node.local_url}/?token={node.dashboard_token}"
            shown = await trio.to_thread.run_sync(
                _browse_dashboard, url, "document.getElementById('feed').textContent === 'live'")
            refused = await trio.to_thread.run_sync(
                _browse_dashboard, node.local_url + "/", "document.getElementById('me').textContent"
                                                         ".includes('401')")
    assert shown["me"].startswith(node.swim.me.name or node.identity.prefix), shown
    assert shown["feed"] == "live", "the token opens the pushed feed too"
    assert not [m for m in shown["console"] if "Content Security Policy" in m], shown["console"]
    assert "?token=TOKEN" in refused["me"], refused
    assert refused["feed"] != "live", "and nothing is pushed without it"
