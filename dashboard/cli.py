"""``meshd peers URL`` and ``meshd doctor URL``: a node's dashboard, in the terminal.

Both read one ``GET /api/snapshot`` and compute through ``dashboard.views``, so
they say what the page says.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from meshd.argtypes import positive_float

from . import views
from .guard import TOKEN_ENV

DEFAULT_TIMEOUT_S = 5.0  # for the whole request: connecting, sending, reading the snapshot


def add_parser(sub: argparse._SubParsersAction) -> None:
    peers = sub.add_parser("peers", help="a node's view of its peers (URL = its dashboard)",
                           description="Peers as one node sees them: state, paths out and in, RTT, "
                                       "counters; and every asymmetric pair of the mesh.")
    peers.add_argument("url", metavar="URL", help="the node's dashboard, e.g. http://127.0.0.1:8080")
    peers.add_argument("--json", action="store_true", help="the /api/peers object instead of tables")
    peers.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="S",
                       help="give up on the node after S seconds (default %(default)g)")
    peers.set_defaults(func=_cmd_peers)
    doctor = sub.add_parser("doctor", help="what is wrong and where, by stage name and direction",
                            description="First whether the pipeline can serve now and, if not, why "
                                        "(by stage); then asymmetric pairs, missing paths, dead or "
                                        "suspect stages, the relay and unresolved names, each with what "
                                        "to check. Exit 0 when ready and healthy, 1 when not ready or a "
                                        "problem is found, 2 when the dashboard cannot be read.")
    doctor.add_argument("url", metavar="URL", help="the node's dashboard, e.g. http://127.0.0.1:8080")
    doctor.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    doctor.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="give up on the node after S seconds (default %(default)g)")
    doctor.set_defaults(func=_cmd_doctor)


class FetchError(Exception):
    pass


def fetch_snapshot(url: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """The node's ``GET /api/snapshot``, within ``timeout`` seconds all told; FetchError names
    the URL and says what is wrong: no answer, a refusal, or an answer no meshd node gives."""
    from meshd.dashboard_client import NodeError, ask_node, dashboard_base

    try:
        base, token = dashboard_base(url)  # a dashboard beyond loopback wants the token
    except NodeError as exc:
        raise FetchError(str(exc)) from exc
    target = f"{base}/api/snapshot"
    try:
        r = ask_node("GET", target, headers={"X-Meshd-Token": token} if token else {}, timeout=timeout)
    except NodeError as exc:
        raise FetchError(f"cannot read {target}: {exc}") from exc
    if r.status == 401:
        raise FetchError(f"{target} wants the node's token (printed when it starts): "
                         f"URL?token=TOKEN or {TOKEN_ENV}=TOKEN")
    if r.status == 404:
        path = urlsplit(base).path
        hint = (f" (if it is one, give the dashboard's own URL, without {path}: the URL printed as "
                "'meshd dashboard url=')") if path else ""
        raise FetchError(f"{target} answered 404 {r.reason}: not a meshd dashboard{hint}")
    if r.status != 200:
        raise FetchError(f"{target} answered {r.status} {r.reason}" + (f": {r.text()}" if r.body else ""))
    try:
        snap = r.json()
    except ValueError:
        raise FetchError(f"{target} does not answer as a meshd node: its answer is not JSON "
                         f"({r.text(80) or 'empty'})") from None
    _check_snapshot(snap, target)
    return snap


def _check_snapshot(snap: Any, target: str) -> None:
    """FetchError unless ``snap`` has the frame of a meshd snapshot: ``self`` and each of
    ``members`` an object with an ``id`` and a ``prefix``, and the tables the views read
    objects.  What lies within is checked as the views read it (``_not_a_snapshot``)."""
    from meshd.dashboard_client import json_kind

    def wrong(what: str) -> FetchError:
        return FetchError(f"{target} does not answer as a meshd node: {what}")

    if not isinstance(snap, dict):
        raise wrong(f"its answer is {json_kind(snap)}, not an object")
    if not isinstance(snap.get("self"), dict):
        raise wrong("its answer has no 'self' object")
    members = snap.get("members", [])
    if not isinstance(members, list):
        raise wrong("its answer's 'members' is not a list")
    for where, m in [("self", snap["self"]), *((f"members[{i}]", m) for i, m in enumerate(members))]:
        if not isinstance(m, dict):
            raise wrong(f"{where} is {json_kind(m)}, not an object")
        for key in ("id", "prefix"):
            if not isinstance(m.get(key), str) or not m[key]:
                raise wrong(f"{where} has no '{key}' string")
    for key in ("names", "path_summaries", "readiness", "join", "load"):
        if snap.get(key) is not None and not isinstance(snap[key], dict):
            raise wrong(f"its answer's '{key}' is {json_kind(snap[key])}, not an object")


def _not_a_snapshot() -> tuple[type[Exception], ...]:
    """What reading a snapshot of the wrong shape raises in the views and here, past the frame
    ``_check_snapshot`` checks: a field missing, of another type, or markup rich refuses.  The
    node is a stranger; its answer gets one line, not a traceback."""
    from rich.errors import MarkupError

    return (LookupError, TypeError, AttributeError, ValueError, MarkupError)


def _show(args: argparse.Namespace, command: str, as_json: Callable[[dict], tuple[int, dict]],
          as_text: Callable[[Any, dict], int]) -> int:
    """Read the snapshot, compute and print: ``as_json(snap)`` -> (exit code, the object) with
    ``--json``, else ``as_text(console, snap)`` -> exit code.  Printed only once all of it is
    made, so a snapshot of the wrong shape prints its one error line and nothing else."""
    try:
        snap = fetch_snapshot(args.url, args.timeout)
    except FetchError as exc:
        print(f"meshd {command}: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            code, obj = as_json(snap)
            out = json.dumps(obj) + "\n"
        else:
            from rich.console import Console

            # Piped (a script, a log), no terminal width applies: wide enough that no column
            # (an address, a path) is cut.
            console = Console(width=max(Console().width, 120) if sys.stdout.isatty() else 400)
            with console.capture() as captured:
                code = as_text(console, snap)
            out = captured.get()
    except _not_a_snapshot() as exc:
        from meshd.dashboard_client import dashboard_base

        print(f"meshd {command}: {dashboard_base(args.url)[0]}/api/snapshot does not answer as a meshd "
              f"node: its snapshot does not fit ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})",
              file=sys.stderr)
        return 2
    sys.stdout.write(out)
    sys.stdout.flush()
    return code


def _cmd_peers(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    return _show(args, "peers", _peers_json, _print_peers)


def _peers_json(snap: dict) -> tuple[int, dict]:
    return 0, {**views.peers(snap), "asymmetric": views.topology(snap)["asymmetric"]}


def _print_peers(console: Any, snap: dict) -> int:
    from rich.markup import escape
    from rich.table import Table

    from meshd.snapshot import stage_sort_key

    data = views.peers(snap)
    topo = views.topology(snap)
    me = data["self"]
    console.print(f"[bold]{escape(me['name'])}[/bold]{escape(_replica(me))} {escape(me['prefix'])} "
                  f"{escape(str(me['addr']))} relay {escape(me['relay_url'] or '-')}"
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
        state = (_styled(p["state"]) + (" [yellow]draining[/yellow]" if p["draining"] else "")
                 + (" [red]not allowed[/red]" if p.get("allowed") is False and p["role"] == "stage" else ""))
        table.add_row(escape(p["name"] + _replica(p, short=True)), escape(p["prefix"]), state,
                      *([escape((p["checkpoint"] or "-")[:12])] if checkpoints else []),
                      _styled(p["path_out"]), _styled(p["path_in"]),
                      "-" if p["rtt_ms"] is None else
                      escape(f"{p['rtt_ms']:.2f} {p.get('rtt_path') or ''}".strip()),
                      f"{p['out_ok']}/{p['out_fail']}", f"{seen.get('direct', 0)}/{seen.get('relay', 0)}",
                      "-" if p["last_seen_s"] is None else f"{p['last_seen_s']:.1f}s ago",
                      escape(str(p["addr"] or "-")))
    console.print(table)
    for a in topo["asymmetric"]:
        console.print(f"[red]asymmetric[/red] {escape(a['detail'])}")
    return 0


def _replica(p: dict, *, short: bool = False) -> str:
    """`` (replica 2/2)`` (short: `` (2/2)``) for a node of a stage that has several, else empty
    (a node that is down or left is no replica)."""
    if p.get("replica") is None or (p.get("replicas") or 0) < 2:
        return ""
    return f" ({'' if short else 'replica '}{p['replica']}/{p['replicas']})"


def _styled(value: str | None) -> str:
    from rich.markup import escape

    colour = {"relay": "yellow", "none": "red", "dead": "red", "suspect": "yellow"}.get(value or "")
    return f"[{colour}]{value}[/{colour}]" if colour else escape(str(value or "-"))


def _cmd_doctor(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    return _show(args, "doctor", _doctor_json, _print_doctor)


def _doctor_json(snap: dict) -> tuple[int, dict]:
    topo = views.topology(snap)
    found = views.problems(snap, topo)
    ready = topo["readiness"]
    me = snap["self"]
    failed = 1 if found or not ready["ready"] else 0
    return failed, {"node": me.get("name"), "prefix": me.get("prefix"), "ok": not failed,
                    "ready": ready["ready"], "readiness": ready, "load": snap.get("load"),
                    "problems": found, "paths": [{"from": e["from_name"], "to": e["to_name"],
                                                  "path": e["path"]} for e in topo["edges"]]}


def _print_doctor(console: Any, snap: dict) -> int:
    from rich.markup import escape
    from rich.table import Table

    topo = views.topology(snap)
    found = views.problems(snap, topo)
    ready = topo["readiness"]
    me = snap["self"]
    _print_readiness(console, ready)
    names = ", ".join(f"{name}×{k}" if k > 1 else name
                      for name, k in Counter(n["name"] for n in topo["nodes"]).items())
    seen = (f"{len(topo['nodes'])} live nodes ({escape(names)}), {len(topo['edges'])} directed pairs, "
            f"no problem seen from {escape(me.get('name') or '?')}")
    if not found:
        console.print(f"[green]ok[/green]: {seen}" if ready["ready"] else f"mesh: {seen}")
        _print_load(console, snap)
        return 0 if ready["ready"] else 1
    console.print()
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for column in ("PROBLEM", "WHERE", "WHAT", "CHECK"):
        table.add_column(column, overflow="fold")
    for p in found:
        table.add_row(f"[red]{escape(p['kind'])}[/red]", escape(p["where"]), escape(p["detail"]),
                      escape(p["check"]))
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
