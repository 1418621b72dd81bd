"""The page in a real browser (Debian's headless chromium, driven by playwright):
a 3-node mesh with a one-way drop, and the asymmetric edge drawn and labelled."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import trio

from meshd.testing.mesh import start_one_way_drop_mesh, wait_asymmetric

CHROMIUM = "/usr/bin/chromium"
# NOTES.md's headless flags; playwright adds --headless and a fresh temporary profile itself.
FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                       reason=f"{CHROMIUM} missing: .ci/run installs it as root "
                              "(apt-get install -y chromium)"),
]


def _browse(url: str, shot: Path) -> dict:
    """Load the page, wait for the asymmetric edge, return what it shows (runs in a thread)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            requests: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.goto(url)
            page.wait_for_selector("svg#topology line.edge.asymmetric", timeout=20_000)
            page.wait_for_selector("#peers tbody tr", timeout=20_000)
            shown = {
                "asym_edges": page.eval_on_selector_all(
                    "line.edge.asymmetric",
                    "els => els.map(e => [e.dataset.from, e.dataset.to, e.dataset.path,"
                    " e.getAttribute('stroke-dasharray')])"),
                "labels": page.eval_on_selector_all("text.asym-label", "els => els.map(e => e.textContent)"),
                "nodes": page.eval_on_selector_all("g.node", "els => els.map(e => e.dataset.name)"),
                "edges": page.eval_on_selector_all("line.edge", "els => els.length"),
                "detail": page.inner_text("#asymmetric"),
                "rows": page.eval_on_selector_all("#peers tbody tr", "els => els.length"),
                "scroll_width": page.evaluate("document.documentElement.scrollWidth"),
                "requests": requests,
            }
            page.screenshot(path=str(shot), full_page=False)
            return shown
        finally:
            browser.close()


async def test_the_page_draws_the_asymmetric_edge_with_stage_names_and_direction(tmp_path):
    lines: list[str] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nodes = await start_one_way_drop_mesh(nursery, lines)
            watcher = nodes["stage-0"]  # a third node: it knows the pair only from the gossip
            await wait_asymmetric(watcher)
            shot = tmp_path / "dashboard.png"
            shown = await trio.to_thread.run_sync(_browse, watcher.dashboard_url, shot)
            nursery.cancel_scope.cancel()

    assert sorted(shown["nodes"]) == ["orchestrator", "stage-0", "stage-1"]
    assert shown["edges"] == 6
    # Exactly one direction is broken: stage-1→orchestrator, dashed (relay) and highlighted.
    assert shown["asym_edges"] == [["stage-1", "orchestrator", "relay", "7 5"]]
    assert shown["labels"] == ["stage-1→orchestrator: relay"]
    assert "stage-1→orchestrator: direct fails" in shown["detail"]
    assert "orchestrator→stage-1: direct" in shown["detail"]
    assert shown["rows"] == 2
    assert shown["scroll_width"] <= 1280, "readable at 1280x800 without scrolling sideways"
    origin = watcher.dashboard_url.rstrip("/")
    assert all(u.startswith(origin) for u in shown["requests"]), "every asset from the app (no CDN)"
    assert shot.stat().st_size > 10_000
    keep = os.environ.get("MESHD_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shot, Path(keep) / shot.name)


def _token_bar(url: str, shot: Path) -> tuple[list[str], str]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(url)
            page.wait_for_selector("#token-bar div", timeout=20_000)
            bars = page.eval_on_selector_all("#token-bar div", "els => els.map(e => e.title)")
            wait = page.inner_text("#token-wait")
            page.screenshot(path=str(shot))
            return bars, wait
        finally:
            browser.close()


async def test_the_orchestrator_page_draws_where_one_tokens_time_goes(tmp_path, checkpoint):
    import httpx

    from meshd.node import NodeOptions
    from meshd.testing.inprocess import start_node, wait_converged

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
            bars, wait = await trio.to_thread.run_sync(_token_bar, orch.dashboard_url, tmp_path / "token.png")
            nursery.cancel_scope.cancel()
    assert any(b.startswith("stage-0 (compute)") for b in bars), bars
    assert any(b.startswith("stage-1 (compute)") for b in bars), bars
    assert any("(transit, direct)" in b for b in bars), bars
    # Tokens wait in stage 0's outbox to share a message: said apart, not a step of the bar.
    assert not any("(wait" in b for b in bars), bars
    assert "in stage-1 outbox" in wait or "in stage-0 outbox" in wait, wait
