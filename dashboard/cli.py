"""``meshd peers URL`` and ``meshd doctor URL``: a node's dashboard, in the terminal.

Both read one ``GET /api/snapshot`` and compute through ``dashboard.views``, so
they say what the page says.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any

from . import views
from .guard import TOKEN_ENV


def add_parser(sub: argparse._SubParsersAction) -> None:
    peers = sub.add_parser("peers", help="a node's view of its peers (URL = its dashboard)",
                           description="Peers as one node sees them: state, paths out and in, RTT, "
                                       "counters; and every asymmetric pair of the mesh.")
    peers.add_argument("url", metavar="URL", help="the node's dashboard, e.g. http://127.0.0.1:8080")
    peers.add_argument("--json", action="store_true", help="the /api/peers object instead of tables")
    peers.set_defaults(func=_cmd_peers)
    doctor = sub.add_parser("doctor", help="what is wrong and where, by stage name and direction",
                            description="First whether the pipeline can serve now and, if not, why "
                                        "(by stage); then asymmetric pairs, missing paths, dead or "
                                        "suspect stages, the relay and unresolved names, each with what "
                                        "to check. Exit 0 when ready and healthy, 1 when not ready or a "
                                        "problem is found, 2 when the dashboard cannot be read.")
    doctor.add_argument("url", metavar="URL", help="the node's dashboard, e.g. http://127.0.0.1:8080")
    doctor.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    doctor.set_defaults(func=_cmd_doctor)


class FetchError(Exception):
    pass


def fetch_snapshot(url: str, timeout: float = 5.0) -> dict:
    from urllib.parse import parse_qs, urlsplit

    import httpx

    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    # A dashboard bound beyond loopback wants the token: from URL?token=TOKEN or the environment.
    token = (parse_qs(parts.query).get("token") or [os.environ.get(TOKEN_ENV, "")])[0]
    target = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}/api/snapshot"
    try:
        r = httpx.get(target, timeout=timeout, headers={"X-Meshd-Token": token} if token else {})
        if r.status_code == 401:
            raise FetchError(f"{target} wants the node's token (printed when it starts): "
                             f"URL?token=TOKEN or {TOKEN_ENV}=TOKEN")
        r.raise_for_status()
        snap = r.json()
    except httpx.HTTPError as exc:
        raise FetchError(f"cannot read {target}: {exc}") from exc
    except ValueError as exc:
        raise FetchError(f"{target} did not answer JSON: {exc}") from exc
    if not isinstance(snap, dict) or "self" not in snap:
        raise FetchError(f"{target} is not a meshd snapshot")
    return snap


def _fetch(args: argparse.Namespace, command: str) -> dict | None:
    try:
        return fetch_snapshot(args.url)
    except FetchError as exc:
        print(f"meshd {command}: {exc}", file=sys.stderr)
        return None


def _cmd_peers(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    snap = _fetch(args, "peers")
    if snap is None:
        return 2
    data = views.peers(snap)
    topo = views.topology(snap)
    if args.json:
        print(json.dumps({**data, "asymmetric": topo["asymmetric"]}))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from meshd.snapshot import stage_sort_key

    me = data["self"]
    console = Console(width=max(Console().width, 120))
    console.print(f"[bold]{escape(me['name'])}[/bold]{escape(_replica(me))} {me['prefix']} {me['addr']} "
                  f"relay {escape(me['relay_url'] or '-')}"
                  + (f" checkpoint {escape(me['checkpoint'][:12])}" if me["checkpoint"] else ""))
    ready = data["readiness"]
    console.print("pipeline: [green]ready[/green]" if ready["ready"] else
                  "pipeline: [red]not ready[/red]: " + escape("; ".join(ready["why"])), soft_wrap=True)
    rows = sorted(data["peers"], key=lambda p: (stage_sort_key(p["name"]), p["replica"] or 0, p["prefix"]))
    # The checkpoint gets a column only where the nodes disagree: then it is what to look at.
    checkpoints = len({p["checkpoint"] for p in [me, *rows] if p["checkpoint"]}) > 1
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    columns = ["STAGE", "PREFIX", "STATE", *(["CHECKPOINT"] if checkpoints else []), "OUT", "IN", "RTT MS",
               "OK/FAIL", "IN DIRECT/RELAY", "SEEN", "ADDRESS"]
    for column in columns:
        table.add_column(column, no_wrap=True)
    for p in rows:
        seen = p["in_seen"] or {}
        state = _styled(p["state"]) + (" [yellow]draining[/yellow]" if p["draining"] else "")
        table.add_row(escape(p["name"] + _replica(p, short=True)), p["prefix"], state,
                      *([escape((p["checkpoint"] or "-")[:12])] if checkpoints else []),
                      _styled(p["path_out"]), _styled(p["path_in"]),
                      "-" if p["rtt_ms"] is None else f"{p['rtt_ms']:.2f} {p.get('rtt_path') or ''}".strip(),
                      f"{p['out_ok']}/{p['out_fail']}", f"{seen.get('direct', 0)}/{seen.get('relay', 0)}",
                      "-" if p["last_seen_s"] is None else f"{p['last_seen_s']:.1f}s ago", p["addr"] or "-")
    console.print(table)
    for a in topo["asymmetric"]:
        console.print(f"[red]asymmetric[/red] {a['detail']}")
    return 0


def _replica(p: dict, *, short: bool = False) -> str:
    """`` (replica 2/2)`` (short: `` (2/2)``) for a node of a stage that has several, else empty."""
    if (p.get("replicas") or 0) < 2:
        return ""
    return f" ({'' if short else 'replica '}{p['replica']}/{p['replicas']})"


def _styled(value: str | None) -> str:
    colour = {"relay": "yellow", "none": "red", "dead": "red", "suspect": "yellow"}.get(value or "")
    return f"[{colour}]{value}[/{colour}]" if colour else (value or "-")


def _cmd_doctor(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    snap = _fetch(args, "doctor")
    if snap is None:
        return 2
    topo = views.topology(snap)
    found = views.problems(snap, topo)
    ready = topo["readiness"]
    me = snap["self"]
    failed = 1 if found or not ready["ready"] else 0
    if args.json:
        print(json.dumps({"node": me.get("name"), "prefix": me.get("prefix"), "ok": not failed,
                          "ready": ready["ready"], "readiness": ready, "load": snap.get("load"),
                          "problems": found, "paths": [{"from": e["from_name"], "to": e["to_name"],
                                                        "path": e["path"]} for e in topo["edges"]]}))
        return failed
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    _print_readiness(console, ready)
    names = ", ".join(f"{name}×{k}" if k > 1 else name
                      for name, k in Counter(n["name"] for n in topo["nodes"]).items())
    seen = (f"{len(topo['nodes'])} live nodes ({escape(names)}), {len(topo['edges'])} directed pairs, "
            f"no problem seen from {escape(me.get('name') or '?')}")
    if not found:
        console.print(f"[green]ok[/green]: {seen}" if ready["ready"] else f"mesh: {seen}")
        _print_load(console, snap)
        return failed
    console.print()
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for column in ("PROBLEM", "WHERE", "WHAT", "CHECK"):
        table.add_column(column, overflow="fold")
    for p in found:
        table.add_row(f"[red]{p['kind']}[/red]", escape(p["where"]), escape(p["detail"]), escape(p["check"]))
    console.print(table)
    _print_load(console, snap)
    return 1


def _print_load(console: Any, snap: dict) -> None:
    """The node's load, last: an orchestrator's requests, a stage's KV cache (``_load_line``)."""
    if isinstance(snap.get("load"), dict):
        console.print(_load_line(snap["load"]), soft_wrap=True)


def _load_line(load: dict) -> str:
    """An orchestrator's requests against its limits: with the queue full, new requests get 503
    (``busy``), which is no fault of the mesh, so it does not fail doctor.  A stage's KV cache
    against its budget, and the starts waiting there for room."""
    if "max_running" not in load:  # a stage's
        waiting = load.get("waiting_for_room")
        held = f"{load['requests']} request{'' if load['requests'] == 1 else 's'} held"
        line = (f"{'[yellow]full[/yellow]' if waiting else 'load'}: {held}, KV cache "
                f"{load['kv_used_mb']:g} of {load['kv_budget_mb']:g} MB (--kv-budget-mb)")
        if waiting:
            line += f"; {waiting} starts waiting for room (the orchestrator admits by a larger budget)"
        return line
    full = load["waiting"] >= load["max_queued"] and load["running"] > 0
    head = "[yellow]busy[/yellow]" if full else "load"
    line = (f"{head}: {load['running']} running (--max-running {load['max_running']}), "
            f"{load['waiting']} waiting (--max-queued {load['max_queued']}), KV cache "
            f"{load['kv_used_mb']:g} of {load['kv_budget_mb']:g} MB at the largest stage")
    if full:
        line += "; the queue is full: new requests get 503 with Retry-After"
    if load.get("refused_busy"):
        line += f"; {load['refused_busy']} refused as busy since start"
    return line


def _print_readiness(console: Any, ready: dict) -> None:
    """The first thing doctor says: can the pipeline serve now, and if not, why (by stage)."""
    from rich.markup import escape

    if ready["ready"]:
        served = ", ".join(f"{s['name']}×{s['live']}" if s["live"] > 1 else s["name"]
                           for s in ready["stages"])
        console.print(f"[green]ready: yes[/green] ({escape(served)})")
    else:
        console.print("[red]not ready[/red]")
        console.print("[bold]Why[/bold]")
        for reason in ready["why"]:
            console.print(f"  {escape(reason)}", soft_wrap=True)
    if ready.get("warnings"):
        console.print("[bold]Warnings[/bold]")
        for warning in ready["warnings"]:
            console.print(f"  {escape(warning)}", soft_wrap=True)
