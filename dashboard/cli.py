"""``meshd peers URL`` and ``meshd doctor URL``: a node's dashboard, in the terminal.

Both read one ``GET /api/snapshot`` and compute through ``dashboard.views``, so
they say what the page says.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

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
                            description="Asymmetric pairs, missing paths, dead or suspect stages, the "
                                        "relay and unresolved pipeline names, each with what to check. "
                                        "Exit 0 when healthy, 1 when a problem is found, 2 when the "
                                        "dashboard cannot be read.")
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
    from rich.table import Table

    me = data["self"]
    console = Console(width=max(Console().width, 120))
    console.print(f"[bold]{me['name']}[/bold] {me['prefix']} {me['addr']} relay {me['relay_url'] or '-'}")
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for column in ("STAGE", "PREFIX", "STATE", "OUT", "IN", "RTT MS", "OK/FAIL", "IN DIRECT/RELAY", "SEEN",
                   "ADDRESS"):
        table.add_column(column, no_wrap=True)
    for p in data["peers"]:
        seen = p["in_seen"] or {}
        table.add_row(p["name"], p["prefix"], _styled(p["state"]), _styled(p["path_out"]),
                      _styled(p["path_in"]), "-" if p["rtt_ms"] is None else f"{p['rtt_ms']:.2f}",
                      f"{p['out_ok']}/{p['out_fail']}", f"{seen.get('direct', 0)}/{seen.get('relay', 0)}",
                      "-" if p["last_seen_s"] is None else f"{p['last_seen_s']:.1f}s ago", p["addr"] or "-")
    console.print(table)
    for a in topo["asymmetric"]:
        console.print(f"[red]asymmetric[/red] {a['detail']}")
    return 0


def _styled(value: str | None) -> str:
    colour = {"relay": "yellow", "none": "red", "dead": "red", "suspect": "yellow"}.get(value or "")
    return f"[{colour}]{value}[/{colour}]" if colour else (value or "-")


def _cmd_doctor(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    snap = _fetch(args, "doctor")
    if snap is None:
        return 2
    topo = views.topology(snap)
    found = views.problems(snap, topo)
    me = snap["self"]
    if args.json:
        print(json.dumps({"node": me.get("name"), "prefix": me.get("prefix"), "ok": not found,
                          "problems": found, "paths": [{"from": e["from_name"], "to": e["to_name"],
                                                        "path": e["path"]} for e in topo["edges"]]}))
        return 1 if found else 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    names = ", ".join(n["name"] for n in topo["nodes"])
    if not found:
        console.print(f"[green]ok[/green]: {len(topo['nodes'])} live nodes ({names}), "
                      f"{len(topo['edges'])} directed pairs, no problem seen from {me.get('name')}")
        return 0
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for column in ("PROBLEM", "WHERE", "WHAT", "CHECK"):
        table.add_column(column, overflow="fold")
    for p in found:
        table.add_row(f"[red]{p['kind']}[/red]", p["where"], p["detail"], p["check"])
    console.print(table)
    return 1
