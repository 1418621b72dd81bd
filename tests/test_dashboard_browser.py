"""The page in a real browser (Debian's headless chromium, driven by playwright), looked at as
a user would: a 3-node mesh with a one-way drop, stage-1 killed and brought back.

Screenshots at 1280x800 and 1920x1080 are saved under the test's tmp_path (printed) and
copied to /tmp/meshd-shots/ (or $MESHD_SCREENSHOT_DIR) to be looked at.
"""

from __future__ import annotations

import os
import shutil
import time
from functools import partial
from pathlib import Path

import pytest
import trio

from meshd.net.faults import Faults
from meshd.node import NodeOptions
from meshd.relay.server import Relay, serve_relay
from meshd.testing.inprocess import start_killable, start_node, wait_converged
from meshd.testing.mesh import wait_asymmetric

CHROMIUM = "/usr/bin/chromium"
# NOTES.md's headless flags; playwright adds --headless and a fresh temporary profile itself.
FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
SHOTS = Path(os.environ.get("MESHD_SCREENSHOT_DIR") or "/tmp/meshd-shots")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                       reason=f"{CHROMIUM} missing: .ci/run installs it as root "
                              "(apt-get install -y chromium)"),
]

# What a user would call broken: an element past the viewport's right edge, a box whose
# content is cut (a scrolling or hidden overflow), two labels drawn over each other, or an
# edge label over a node.
LAYOUT = """() => {
  const vw = document.documentElement.clientWidth;
  const name = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')
    + (e.classList && e.classList.length ? '.' + [...e.classList].join('.') : '');
  const hit = (a, b) => a.left < b.right - 0.5 && b.left < a.right - 0.5
    && a.top < b.bottom - 0.5 && b.top < a.bottom - 0.5;
  const outside = [], clipped = [], overlaps = [];
  for (const e of document.querySelectorAll('body *')) {
    const r = e.getBoundingClientRect();
    if (!r.width && !r.height) continue;
    if (r.right > vw + 0.5 || r.left < -0.5) outside.push(`${name(e)} ${r.left}..${r.right}`);
    const cs = getComputedStyle(e);
    if (!(e instanceof SVGElement) && cs.overflowX !== 'visible' && cs.textOverflow !== 'ellipsis'
        && e.scrollWidth > e.clientWidth + 1) clipped.push(`${name(e)} ${e.scrollWidth} > ${e.clientWidth}`);
  }
  for (const svg of document.querySelectorAll('svg')) {
    const texts = [...svg.querySelectorAll('text')].map(t => [t, t.getBoundingClientRect()])
      .filter(([, r]) => r.width > 0);
    for (let i = 0; i < texts.length; i++) for (let j = i + 1; j < texts.length; j++) {
      const [[a, ra], [b, rb]] = [texts[i], texts[j]];
      if (hit(ra, rb)) overlaps.push(`${a.textContent} x ${b.textContent}`);
    }
  }
  const boxes = [...document.querySelectorAll('#topology g.node rect, #topology g.ghost rect')];
  for (const t of document.querySelectorAll('#labels text')) for (const b of boxes) {
    if (hit(t.getBoundingClientRect(), b.getBoundingClientRect())) overlaps.push(`${t.textContent} x a node`);
  }
  return {vw, scroll_width: document.documentElement.scrollWidth, outside, clipped, overlaps,
          edges: document.querySelectorAll('#topology .edge').length,
          edge_labels: document.querySelectorAll('#labels text').length,
          texts: document.querySelectorAll('svg text').length};
}"""


TEXTS = "els => els.map(e => e.textContent)"
FIRST_CELLS = "els => els.map(e => e.cells[0].textContent)"


def _until(page, expression: str, timeout: float = 20.0):
    """Poll ``expression`` in the page until it is truthy; returns it.  (page.wait_for_function
    would evaluate a string, which the page's CSP forbids.)"""
    deadline = time.monotonic() + timeout
    while True:
        value = page.evaluate(expression)
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{expression!r} still {value!r} after {timeout} s")
        time.sleep(0.05)


def _keep(shot: Path) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, SHOTS / shot.name)


def _open(browser, url: str, width: int, height: int):
    page = browser.new_page(viewport={"width": width, "height": height})
    seen: dict[str, list[str]] = {"requests": [], "navigations": [], "errors": []}
    page.on("request", lambda r: seen["requests"].append(r.url))
    page.on("pageerror", lambda e: seen["errors"].append(str(e)))
    page.on("console", lambda m: seen["errors"].append(m.text) if m.type == "error" else None)
    page.on("framenavigated", lambda f: seen["navigations"].append(f.url) if f == page.main_frame else None)
    page.goto(url)
    page.wait_for_selector("svg#topology path.edge.asymmetric", timeout=20_000)
    page.wait_for_selector("#peers tbody tr", timeout=20_000)
    _until(page, "document.getElementById('feed').textContent === 'live'")
    return page, seen


def _watch(url: str, shots: Path, control: dict) -> dict:
    """Look at the page, kill stage-1 and bring it back through ``control`` (runs in a thread)."""
    from playwright.sync_api import sync_playwright

    shown: dict = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page, seen = _open(browser, url, 1280, 800)
            shown["asym_edges"] = page.eval_on_selector_all(
                "path.edge.asymmetric",
                "els => els.map(e => [e.dataset.from, e.dataset.to, e.dataset.path,"
                " e.getAttribute('stroke-dasharray')])")
            shown["labels"] = page.eval_on_selector_all("text.asym-label", TEXTS)
            shown["nodes"] = page.eval_on_selector_all("g.node", "els => els.map(e => e.dataset.name)")
            # Left to right in pipeline order.
            shown["order"] = page.eval_on_selector_all(
                "g.node", "els => els.map(e => [e.getBoundingClientRect().x, e.dataset.name])"
                          ".sort((a, b) => a[0] - b[0]).map(x => x[1])")
            shown["asymmetric"] = page.inner_text("#asymmetric")
            shown["banner"] = page.inner_text("#banner")
            shown["rows"] = page.eval_on_selector_all("#peers tbody tr", FIRST_CELLS)
            _until(page, "document.querySelectorAll('#chart-rtt polyline').length > 0")
            shown["charts"] = page.evaluate(
                "['chart-rtt', 'chart-paths'].map(id => "
                "document.getElementById(id).querySelectorAll('polyline, rect').length)")
            # Hover an edge's label, then click a node: the details say what they are.
            box = page.locator("text.asym-label").bounding_box()
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            shown["edge_details"] = _until(page, "(t => t.includes('stage-1 → orchestrator') && t)"
                                                 "(document.getElementById('details').innerText)", 5)
            box = page.locator("g.node[data-name='orchestrator'] rect").bounding_box()
            page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            page.mouse.move(1, 1)  # away: the click keeps it
            shown["node_details"] = _until(page, "(t => t.startsWith('orchestrator') && t)"
                                                 "(document.getElementById('details').innerText)", 5)
            page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)  # let go
            page.mouse.move(1, 1)
            _until(page, "document.querySelector('#details table.stages') !== null", 5)
            shown["layout_1280"] = page.evaluate(LAYOUT)
            page.screenshot(path=str(shots / "dashboard-1280x800.png"))

            wide, _ = _open(browser, url, 1920, 1080)
            _until(wide, "document.querySelectorAll('#chart-rtt polyline').length > 0")
            shown["layout_1920"] = wide.evaluate(LAYOUT)
            wide.screenshot(path=str(shots / "dashboard-1920x1080.png"))
            wide.close()

            # stage-1 dies: the node's own readiness fact turns, and the page shows it, pushed.
            control["kill"]()
            node_turned = page_turned = None
            deadline = time.monotonic() + 40
            while (node_turned is None or page_turned is None) and time.monotonic() < deadline:
                if node_turned is None and not control["ready"]():
                    node_turned = time.monotonic()
                if page_turned is None and page.inner_text("#banner-title").startswith("not ready"):
                    page_turned = time.monotonic()
                time.sleep(0.05)
            assert node_turned is not None and page_turned is not None, page.inner_text("#banner")
            shown["pushed_after_s"] = page_turned - node_turned
            shown["not_ready"] = page.inner_text("#banner-title")
            _until(page, "!document.getElementById('departed').hidden", 10)
            shown["rows_dead"] = page.eval_on_selector_all("#peers tbody tr", FIRST_CELLS)
            shown["departed"] = page.inner_text("#departed summary")
            shown["departed_open"] = page.evaluate("document.getElementById('departed').open")
            shown["ghost"] = page.eval_on_selector_all("g.ghost", "els => els.map(e => e.textContent)")
            shown["layout_dead"] = page.evaluate(LAYOUT)
            page.screenshot(path=str(shots / "not-ready-1280x800.png"))

            # It comes back (a new process with a new key): ready, one stage-1 row, the old folded.
            control["restart"]()
            _until(page, "document.getElementById('banner-title').textContent.startsWith('ready')", 30)
            shown["ready_again"] = page.inner_text("#banner-title")
            _until(page, "document.querySelectorAll('#peers tbody tr').length === 3", 10)
            shown["rows_back"] = page.eval_on_selector_all("#peers tbody tr", FIRST_CELLS)
            shown["departed_back"] = page.inner_text("#departed summary")
            shown["navigations"] = list(seen["navigations"])
            shown["requests"] = list(seen["requests"])
            shown["errors"] = list(seen["errors"])
            page.screenshot(path=str(shots / "back-1280x800.png"))
            return shown
        finally:
            browser.close()


async def test_the_page_says_whether_the_pipeline_can_serve_and_which_stage_and_direction_to_blame(tmp_path):
    lines: list[str] = []
    print(f"screenshots: {tmp_path} (copied to {SHOTS})")
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(partial(serve_relay, relay=Relay()), "127.0.0.1", 0)

            def options(**more) -> NodeOptions:
                return NodeOptions(profile="local", relay=f"ws://{host}:{port}", stages=2,
                                   dashboard="127.0.0.1:0", **more)

            orch = await start_node(nursery, options(role="orchestrator"), lines)
            s0 = await start_node(nursery, options(stage=0, seeds=[orch.addr]), lines)
            # stage-1's direct packets to the orchestrator are lost: it answers over the relay.
            stage1 = options(stage=1, seeds=[s0.addr], faults=Faults.parse([f"drop:{orch.addr}"]))
            s1, s1_scope = await start_killable(nursery, stage1, lines)
            await wait_converged([orch, s0, s1])
            await wait_asymmetric(s0)  # the watcher is neither end of the pair: it knows from gossip

            async def restart() -> None:
                await start_killable(nursery, stage1, lines)

            def ready() -> bool:  # the watcher's own readiness fact, read in the trio thread
                return trio.from_thread.run_sync(lambda: s0.snapshot()["readiness"]["ready"])

            control = {"kill": lambda: trio.from_thread.run_sync(s1_scope.cancel), "ready": ready,
                       "restart": lambda: trio.from_thread.run(restart)}
            shown = await trio.to_thread.run_sync(_watch, s0.dashboard_url, tmp_path, control)
            nursery.cancel_scope.cancel()

    for shot in sorted(tmp_path.glob("*.png")):
        assert shot.stat().st_size > 10_000, shot
        _keep(shot)

    # The pipeline in order, left to right, and the one broken direction drawn and labelled.
    assert shown["order"] == ["orchestrator", "stage-0", "stage-1"]
    assert shown["asym_edges"] == [["stage-1", "orchestrator", "relay", "7 5"]]
    assert shown["labels"] == ["stage-1→orchestrator: relay"]
    assert "stage-1→orchestrator: direct fails" in shown["asymmetric"]
    assert "orchestrator→stage-1: direct" in shown["asymmetric"]
    assert "check:" in shown["asymmetric"], "and what to look at"
    assert shown["banner"].startswith("ready: the pipeline can serve (orchestrator → stage-0 → stage-1)")
    assert "updated" in shown["banner"] and "s ago" in shown["banner"]
    assert shown["rows"] == ["orchestrator", "stage-0 · this node", "stage-1"]
    assert all(n > 0 for n in shown["charts"]), "the last minutes are drawn"
    assert "path" in shown["edge_details"] and "relay" in shown["edge_details"]
    assert "address" in shown["node_details"] and "last failure" in shown["node_details"]

    for size in ("layout_1280", "layout_1920", "layout_dead"):
        layout = shown[size]
        assert layout["scroll_width"] <= layout["vw"], (size, layout)
        assert layout["outside"] == [], (size, "past the right edge", layout["outside"])
        assert layout["clipped"] == [], (size, "content cut", layout["clipped"])
        assert layout["overlaps"] == [], (size, "labels over each other", layout["overlaps"])
    for size in ("layout_1280", "layout_1920"):
        assert shown[size]["edges"] == 6, "every ordered pair"
        assert shown[size]["edge_labels"] == 6, "every edge labelled"

    # stage-1 killed: named in the banner, its place drawn empty, its row folded away.
    assert shown["not_ready"].startswith("not ready: stage-1"), shown["not_ready"]
    assert shown["pushed_after_s"] < 2.0, "pushed to the open page within 2 s, without a reload"
    assert shown["ghost"] == ["stage-1no live owner"]
    assert shown["rows_dead"] == ["orchestrator", "stage-0 · this node"]
    assert shown["departed"] == "1 departed" and shown["departed_open"] is False

    # Back: ready again, and the dead process does not sit beside its successor.
    assert shown["ready_again"].startswith("ready"), shown["ready_again"]
    assert shown["rows_back"] == ["orchestrator", "stage-0 · this node", "stage-1"]
    assert shown["departed_back"] == "1 departed"

    origin = s0.dashboard_url.rstrip("/")
    assert all(u.startswith(origin) or u.startswith(origin.replace("http", "ws", 1))
               for u in shown["requests"]), "every asset from the app (no CDN)"
    assert len(shown["navigations"]) == 1, "no reload"
    assert shown["errors"] == [], "no script error, nothing refused"
    assert not [u for u in shown["requests"] if "/api/state" in u], "pushed over the WebSocket, not polled"


def _orchestrator_page(url: str, shot: Path) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(url)
            page.wait_for_selector("#token-bar div", timeout=20_000)
            # A sample taken after the generation: tokens/s and time to first token drawn.
            _until(page, "document.querySelectorAll('#chart-latency circle').length > 0")
            shown = {
                "bars": page.eval_on_selector_all("#token-bar div", "els => els.map(e => e.title)"),
                "wait": page.inner_text("#token-wait"),
                "rate": page.inner_text("#cap-rate"),
                "latency": page.inner_text("#cap-latency"),
                "rate_drawn": page.evaluate("document.querySelectorAll('#chart-rate polyline, "
                                            "#chart-rate circle').length"),
                "stages": page.inner_text("#details"),
                "layout": page.evaluate(LAYOUT),
            }
            page.screenshot(path=str(shot), full_page=True)
            return shown
        finally:
            browser.close()


async def test_the_orchestrator_page_draws_where_a_tokens_time_goes_and_its_throughput(tmp_path, checkpoint):
    import httpx

    model = checkpoint
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            opts = dict(profile="local", stages=2, model=str(model), dashboard="127.0.0.1:0")
            orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
            stages = [await start_node(nursery, NodeOptions(stage=k, seeds=[orch.addr], **opts), lines)
                      for k in range(2)]
            await wait_converged([orch, *stages])
            await orch.app.wait_ready(10)
            async with httpx.AsyncClient(base_url=orch.dashboard_url, timeout=30) as client:
                r = await client.post("/api/generate", json={"prompt": "Hello", "max_tokens": 6})
                assert r.status_code == 200, r.text
            shot = tmp_path / "orchestrator-1280x800.png"
            shown = await trio.to_thread.run_sync(_orchestrator_page, orch.dashboard_url, shot)
            nursery.cancel_scope.cancel()
    _keep(shot)
    bars = shown["bars"]
    assert any(b.startswith("stage-0 (compute)") for b in bars), bars
    assert any(b.startswith("stage-1 (compute)") for b in bars), bars
    assert any("(transit, direct)" in b for b in bars), bars
    # Tokens wait in stage 0's outbox to share a message: said apart, not a step of the bar.
    assert not any("(wait" in b for b in bars), bars
    assert "in stage-1 outbox" in shown["wait"] or "in stage-0 outbox" in shown["wait"], shown["wait"]
    # Its load now, the request done: nothing running, nothing waiting for a slot.
    assert shown["rate"] == "Tokens/s · 0 running, 0 waiting"
    assert shown["latency"] == "Time to first token, ms"
    assert shown["rate_drawn"] > 0
    assert "layers" in shown["stages"] and "of 4" in shown["stages"], shown["stages"]
    layout = shown["layout"]
    assert layout["outside"] == [] and layout["clipped"] == [] and layout["overlaps"] == [], layout


# Each edge label's edge: a pipeline hop, or an edge in trouble (asymmetric, relayed, no path).
LABELLED = """() => [...document.querySelectorAll('#labels text')].map(t => {
  const e = document.querySelector(`#topology path.edge[data-key="${t.dataset.key}"]`);
  return [t.textContent, e ? [...e.classList].join(' ') : 'no edge', e ? e.dataset.path : ''];
})"""


def _dense_page(url: str, shot: Path, nodes: int) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1920, "height": 1080})
            page.goto(url)
            _until(page, f"document.querySelectorAll('#topology g.node').length === {nodes}")
            _until(page, f"document.querySelectorAll('#peers tbody tr').length === {nodes}")
            shown = {"layout": page.evaluate(LAYOUT), "labelled": page.evaluate(LABELLED),
                     "faint": page.evaluate("document.querySelectorAll('#topology path.edge.faint').length"),
                     "banner": page.inner_text("#banner")}
            page.screenshot(path=str(shot))
            narrow = browser.new_page(viewport={"width": 1280, "height": 800})
            narrow.goto(url)
            _until(narrow, "document.querySelectorAll('#details table.stages tr').length === 6")
            shown["stage_lines"] = narrow.evaluate(LINES)
            shown["layout_1280"] = narrow.evaluate(LAYOUT)
            narrow.screenshot(path=str(shot.with_name("dense-1280x800.png")))
            return shown
        finally:
            browser.close()


# Lines each cell of the stages table takes at 1280x800, and each replica in its cell.
LINES = """() => {
  const lines = e => {
    const r = document.createRange();
    r.selectNodeContents(e);
    return r.getClientRects().length;
  };
  return [...document.querySelectorAll('#details table.stages tr')].slice(1).map(tr => [
    tr.cells[0].textContent,
    [...tr.cells].filter(td => !td.classList.contains('replicas')).map(lines),
    [...tr.querySelectorAll('.replica')].map(lines)]);
}"""


async def test_a_dense_mesh_labels_only_the_pipeline_hops_and_the_trouble(tmp_path):
    # Four stages of two replicas each: 72 directed pairs.  The hops between consecutive
    # stages and any edge in trouble carry a label; the others are drawn faint, unlabelled,
    # and nothing overlaps or runs off a 1920x1080 page.
    lines: list[str] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            def options(**more) -> NodeOptions:
                return NodeOptions(profile="local", stages=4, dashboard="127.0.0.1:0", **more)

            orch = await start_node(nursery, options(role="orchestrator"), lines)
            nodes = [orch]
            for k in (0, 0, 1, 1, 2, 2, 3, 3):
                nodes.append(await start_node(nursery, options(stage=k, seeds=[orch.addr]), lines))
            await wait_converged(nodes)
            shot = tmp_path / "dense-1920x1080.png"
            shown = await trio.to_thread.run_sync(_dense_page, orch.dashboard_url, shot, len(nodes))
            nursery.cancel_scope.cancel()
    _keep(shot)

    assert shown["banner"].startswith("ready: the pipeline can serve"), shown["banner"]
    layout = shown["layout"]
    assert layout["outside"] == [] and layout["clipped"] == [] and layout["overlaps"] == [], layout
    assert layout["scroll_width"] <= layout["vw"]
    assert shown["faint"] > 0, "the edges that are neither hops nor trouble are drawn faint"
    assert shown["labelled"], "the hops are labelled"
    for text, classes, path in shown["labelled"]:
        assert "hop" in classes.split() or "asymmetric" in classes.split() or path in ("relay", "none"), \
            (text, classes, path)
        assert text != "not reported" or "hop" in classes.split(), text
    # At 1280x800 a stage's name, its serving count and its layers each keep to one line,
    # and each replica stays whole: the replicas' cell wraps between them.
    names = [name for name, _, _ in shown["stage_lines"]]
    assert names == ["orchestrator", *(f"stage-{k}" for k in range(4))]
    for name, cells, replicas in shown["stage_lines"]:
        assert cells == [1] * len(cells), (name, cells)
        assert all(n == 1 for n in replicas) and len(replicas) == (0 if name == "orchestrator" else 2), name
    layout = shown["layout_1280"]
    assert layout["outside"] == [] and layout["clipped"] == [] and layout["overlaps"] == [], layout
    _keep(shot.with_name("dense-1280x800.png"))
