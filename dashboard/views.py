"""What the dashboard, `meshd peers` and `meshd doctor` show, computed from a snapshot.

Pure functions of the snapshot dict (``Node.snapshot()`` or ``GET /api/snapshot``):
no protocol objects, so the terminal commands and the page cannot disagree.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from meshd.readiness import NOT_PROBED, NOT_REPORTED, path, readiness
from meshd.relay.protocol import CLOSE_NOT_MEMBER
from meshd.snapshot import stage_sort_key

LIVE = ("alive", "suspect")


def _name(view: dict) -> str:
    return view.get("name") or view.get("prefix") or "?"


def replica_of(m: dict) -> str | None:
    """``stage-K`` for a stage's node (one of its replicas), None for the orchestrator."""
    if m.get("role") == "stage" and m.get("stage") is not None:
        return f"stage-{m['stage']}"
    return None


def pipeline_readiness(snap: dict) -> dict:
    """The node's own readiness fact; computed here only for a snapshot that lacks it."""
    return snap.get("readiness") or readiness(snap)


def peer_view(m: dict, *, me: bool = False) -> dict:
    """One PEER as in CONTRACT.md (plus ``name``, its checkpoint, epoch and draining flag, and
    ``replica_of``: the stage it is a replica of)."""
    return {
        "id": m["id"],
        "prefix": m["prefix"],
        "name": _name(m),
        "role": m.get("role"),
        "stage": m.get("stage"),
        "replica_of": replica_of(m),
        "state": m.get("state"),
        "checkpoint": m.get("checkpoint") or None,
        "draining": bool(m.get("draining")),
        "epoch": m.get("epoch"),
        "incarnation": m.get("incarnation"),
        "addr": m.get("addr"),
        "relay_url": m.get("relay_url"),
        "path_out": None if me else m.get("path_out", "direct"),
        "path_in": None if me else m.get("path_in", "none"),
        # Where our direct packets go when a punch through its NAT opened the way (None: its own).
        "punched": None if me else m.get("punched"),
        "nat": m.get("nat"),  # its NAT as the relays' STUN saw it
        "rtt_ms": None if me else m.get("rtt_ms"),
        "rtt_path": None if me else m.get("rtt_path"),  # the path that round trip was measured on
        "out_ok": None if me else m.get("path_checks", 0),
        "out_fail": None if me else m.get("direct_failures", 0),
        "in_seen": None if me else m.get("in_seen", {"direct": 0, "relay": 0}),
        "last_seen_s": None if me else m.get("last_seen_s"),
        "state_age_s": None if me else m.get("state_age_s"),  # how long it has been in that state
        "last_failure": None if me else m.get("last_failure"),
        "allowed": True if me else m.get("allowed", True),  # by our --allow-nodes, to hold stage names
    }


def peers(snap: dict) -> dict:
    """``/api/peers``: ourselves, every peer, and whether the pipeline can serve.

    A stage's live node also carries ``replica`` (its place, by prefix, among the live
    nodes of its stage, 1-based) and ``replicas`` (how many live nodes that stage has).
    A dead or departed node is no replica (its ``replica`` and ``replicas`` are None):
    the one that replaced it would otherwise show as one of two for as long as it is
    remembered.  Its ``replica_of`` still names its stage, as its last metadata said.
    """
    me = peer_view(snap["self"], me=True)
    others = [peer_view(m) for m in snap.get("members", [])]
    by_stage: dict[str, list[dict]] = {}
    for p in [me, *others]:
        if p["replica_of"] is not None and (p is me or p["state"] in LIVE):
            by_stage.setdefault(p["replica_of"], []).append(p)
    for p in [me, *others]:
        group = sorted(by_stage.get(p["replica_of"] or "", []), key=lambda v: v["prefix"])
        p["replica"] = next((i + 1 for i, v in enumerate(group) if v is p), None)
        p["replicas"] = len(group) if p["replica"] is not None else None
    ready = pipeline_readiness(snap)
    return {"self": me, "peers": others, "join": join_view(snap),
            "readiness": {k: ready[k] for k in ("ready", "why", "warnings", "stages")}}


def join_view(snap: dict) -> dict:
    """Whether this node is in the mesh: ``joined``, and if not, the seeds it waits on and why
    (``not joined: no answer from 10.0.0.5:7946 after 12 s``)."""
    join = snap.get("join") or {"joined": True}
    if join.get("joined"):
        return {"joined": True, "status": "joined"}
    problem = join.get("problem") or f"waiting for an answer from {', '.join(join.get('seeds') or [])}"
    return {**join, "status": f"not joined: {problem}"}


def _direction(frm: dict, to: dict, edge: dict) -> str:
    """``direct, 0.4 ms`` / ``direct fails (timeout ×3), via relay ws://…`` / ``no path (…)``."""
    head = f"{frm['name']}→{to['name']}"
    path, rtt = edge["path"], edge.get("rtt_ms")
    reason = edge.get("reason") or "unanswered"
    fails = edge.get("direct_failures") or 0
    times = f" ×{fails}" if fails else ""
    if path == "direct":
        way = "direct (punched)" if edge.get("punched") else "direct"
        return f"{head}: {way}" + (f", {rtt:.1f} ms direct" if rtt is not None else "")
    since = edge.get("since_s")
    for_ = f", for {since:.0f} s" if since is not None else ""
    if path == "relay":
        via = edge.get("relay") or frm.get("relay_url") or "the relay"
        return f"{head}: direct fails ({reason}{times}), via relay {via}" + (
            f", {rtt:.1f} ms via relay" if rtt is not None else "") + for_
    if path == "none":
        return f"{head}: no path ({reason}{times}){for_}"
    return f"{head}: {edge.get('why_unknown') or NOT_REPORTED}"


_RANK = {"direct": 0, "relay": 1, "none": 2, "unknown": -1}


def topology(snap: dict) -> dict:
    """The directed view of the whole mesh, from every node's gossiped outbound summary.

    Our own outbound edges come from our own path table (fresher than our summary).  An
    edge whose path is ``unknown`` says why in ``why_unknown``: ours to a peer's new
    process not probed since its restart, or another node's not reported.
    """
    me = snap["self"]
    by_id: dict[str, dict] = {me["id"]: me}
    for m in snap.get("members", []):
        by_id[m["id"]] = m
    live = [v for v in by_id.values() if v.get("state") in LIVE]
    live_ids = {v["id"] for v in live}
    summaries = snap.get("path_summaries", {})

    def edge(a: dict, b: dict) -> dict:
        e = path(snap, a["id"], b["id"])
        ok = None if e["path"] == "unknown" else e["path"] != "none"
        return {"from": a["id"], "to": b["id"], "from_name": _name(a), "to_name": _name(b),
                "path": e["path"], "ok": ok, "rtt_ms": e["rtt_ms"],
                "direct_failures": e["direct_failures"], "reason": e["reason"], "since_s": e["since_s"],
                "relay": e["relay"], "punched": e["punched"], "why_unknown": e["why_unknown"]}

    order = sorted(live, key=lambda v: stage_sort_key(_name(v)))
    edges = [edge(a, b) for a in order for b in order if a["id"] != b["id"]]
    index = {(e["from"], e["to"]): e for e in edges}
    asymmetric = []
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            ab, ba = index[(a["id"], b["id"])], index[(b["id"], a["id"])]
            if "unknown" in (ab["path"], ba["path"]) or ab["path"] == ba["path"]:
                continue
            # Name the worse direction first: that is the one to look at.
            worse, better = (ab, ba) if _RANK[ab["path"]] >= _RANK[ba["path"]] else (ba, ab)
            fa, fb = by_id[worse["from"]], by_id[worse["to"]]
            fa, fb = {**fa, "name": _name(fa)}, {**fb, "name": _name(fb)}
            detail = f"{_direction(fa, fb, worse)}; {_direction(fb, fa, better)}"
            asymmetric.append({"a": _name(fa), "b": _name(fb), "a_id": fa["id"], "b_id": fb["id"],
                               "a_to_b": worse["path"], "b_to_a": better["path"], "detail": detail})
    nodes = [{"id": v["id"], "prefix": v["prefix"], "name": _name(v), "role": v.get("role"),
              "stage": v.get("stage"), "state": v.get("state"), "self": v["id"] == me["id"]}
             for v in order]
    ready = pipeline_readiness(snap)
    return {"nodes": nodes, "edges": edges, "asymmetric": asymmetric,
            "reported": sorted(k for k in summaries if k in live_ids),
            "readiness": {k: ready[k] for k in ("ready", "why", "warnings", "stages")}}


def problems(snap: dict, topo: dict | None = None) -> list[dict[str, Any]]:
    """What `meshd doctor` reports: each problem by stage and direction, and what to check."""
    topo = topo or topology(snap)
    out: list[dict[str, Any]] = []
    join = join_view(snap)
    relays = [r for r in snap.get("relays") or [snap.get("relay")] if isinstance(r, dict)]
    key_check = ("the relay admits mesh members only: does our --mesh-key-file hold a key its "
                 "--mesh-key-file holds (`meshd keys` lists both ids)?")
    if not join["joined"]:
        seeds = ", ".join(join.get("seeds") or [])
        check = (f"is a meshd node listening at {seeds}, and do our UDP packets reach it? Do we hold "
                 "its mesh key (--mesh-key-file)? A node drops every packet not sealed with a key it "
                 "holds. With a relay both hold (--relay), we join through it")
        if any(_not_member(r) for r in relays):
            check = f"{key_check} The mesh drops our packets for the same reason"
        out.append({"kind": "not-joined", "where": _name(snap["self"]), "detail": join["status"],
                    "check": check})
    for a in topo["asymmetric"]:
        check = (f"a firewall or NAT rule dropping {a['a']}'s packets to {a['b']} "
                 f"(UDP and TCP on {a['b']}'s port); {a['b']}→{a['a']} works, so it is "
                 f"one-way: look at {a['b']}'s input rules or {a['a']}'s egress")
        if "symmetric NAT" in a["detail"]:
            check = (f"{a['b']} is behind a symmetric NAT (a new public port for each peer it sends to), "
                     f"which no punch gets through, so the relay carries {a['a']}→{a['b']}; a NAT that "
                     f"keeps one mapping per socket (most home routers; masquerade without 'random') "
                     f"or a forwarded UDP and TCP port lets it be reached directly")
        out.append({"kind": "asymmetric", "where": f"{a['a']}→{a['b']}", "detail": a["detail"],
                    "check": check})
    end = _end_names(topo["nodes"])
    alive = {n["id"] for n in topo["nodes"] if n.get("state") == "alive"}
    unreported: dict[str, list[str]] = {}  # node id -> the peers it has not reported a path to
    for e in topo["edges"]:
        a, b = end[e["from"]], end[e["to"]]
        if e["path"] == "none":
            out.append({"kind": "no-path", "where": f"{a}→{b}",
                        "detail": e.get("reason") or "neither direct nor relay answered",
                        "check": f"is {b} up, and do both reach the relay?"})
        elif e["path"] == "unknown" and e["from"] == snap["self"]["id"] and e["to"] in alive:
            since = e.get("since_s")
            ago = f" (seen {since:.0f} s ago)" if since is not None else ""
            out.append({"kind": "unprobed", "where": f"{a}→{b}",
                        "detail": f"{a}→{b}: {NOT_PROBED}{ago}; our datagrams go direct meanwhile",
                        "check": f"wait a probe period or two: the first probe of {b}'s new process that "
                                 f"{b} or another member answers gives the verdict (direct, relay, or none "
                                 f"when only other members vouch for {b}); if it persists, nobody answers "
                                 f"our probes of {b}: is {b} up (its log), and do our packets reach the "
                                 f"other members?"})
        elif e["path"] == "unknown" and e["from"] != snap["self"]["id"] and e["from"] in alive:
            # (a suspect node's silence is its suspicion, said once, not once per peer)
            unreported.setdefault(e["from"], []).append(b)
    reported = set(topo.get("reported", []))
    for node, peers in unreported.items():  # one line for each such node, not one for each pair
        a = end[node]
        where = f"{a}→{peers[0]}" if len(peers) == 1 else f"{a}→{len(peers)} peers"
        to = ", ".join(peers) if len(peers) <= 3 else f"{len(peers)} peers"
        detail = f"{a} has not reported its path to {to} yet" if node in reported else \
            f"no path summary from {a} yet"
        out.append({"kind": "unreported", "where": where, "detail": detail,
                    "check": f"wait a few seconds; if it persists, {a}'s gossip does not reach us"})
    # A dead or suspect node whose run name another node serves, alive, was replaced (a
    # restart under a new identity) or has a replica: readiness warns of it; not a problem.
    served = {_name(m) for m in snap.get("members", []) if m.get("state") == "alive"}
    served.add(_name(snap["self"]))
    for m in snap.get("members", []):
        if _name(m) in served and m.get("state") != "alive":
            continue
        if m.get("state") in ("dead", "suspect"):
            out.append({"kind": m["state"], "where": _name(m),
                        "detail": f"{_name(m)} ({m['prefix']}) is {m['state']}",
                        "check": f"is {_name(m)}'s process running at {m.get('addr')}? its log, "
                                 "and the network between us"})
    for relay in relays:
        if relay.get("connected") is False:
            others = [r["url"] for r in relays if r.get("connected")]
            also = f"; pairs use {', '.join(others)} meanwhile" if others else ""
            refused = _not_member(relay)
            out.append({"kind": "relay", "where": _name(snap["self"]),
                        "detail": f"not connected to the relay {relay.get('url', '')}"
                                  + (": it refused us as not a member" if refused else "") + also,
                        "check": key_check if refused else "is the relay running and reachable over TCP "
                                                           "(WebSocket)?"})
    for m in snap.get("members", []):
        if m.get("allowed") is False and m.get("role") == "stage" and m.get("state") in LIVE:
            out.append({"kind": "not-allowed", "where": _name(m),
                        "detail": f"{_name(m)} ({m['prefix']}) is not in our --allow-nodes list: "
                                  "the stage names it claims are ignored, so it serves nothing",
                        "check": f"if it is ours, add its id ({m['id']}, the id= of its boot line) to "
                                 "the --allow-nodes file of every node; if not, a stranger holds a "
                                 "mesh key: rotate it (meshd keys)"})
    out.extend(_unresolved(snap))
    twin = snap.get("twin")
    if isinstance(twin, dict) and twin.get("seen_s_ago", TWIN_RECENT_S) < TWIN_RECENT_S:
        me = _name(snap["self"])
        fate = "it started later and gives the id up" if twin.get("keep") else \
            "it started first and keeps the id; this process stops"
        out.append({"kind": "twin", "where": me,
                    "detail": f"another process signs as {me} ({snap['self'].get('prefix')}) from "
                              f"{twin.get('addr')}, {twin.get('seen_s_ago')} s ago: {fate}",
                    "check": f"two processes hold {me}'s key (--key-file): stop the one at "
                             f"{twin.get('addr')}, or give it a key file of its own"})
    return out


# A twin (another process under our id) heard this recently is a problem doctor reports.
TWIN_RECENT_S = 120.0


def _not_member(relay: dict) -> bool:
    """Whether the relay's last word to us was that we hold none of its mesh keys."""
    return f"{CLOSE_NOT_MEMBER} not a member" in str(relay.get("last_error") or "")


def _end_names(nodes: list[dict]) -> dict[str, str]:
    """Node id -> how a problem names it: its name, and its prefix too where replicas share
    the name (``stage-1 (c0445736)``), so each problem says which replica."""
    count = Counter(n["name"] for n in nodes)
    return {n["id"]: n["name"] if count[n["name"]] == 1 else f"{n['name']} ({n['prefix']})" for n in nodes}


def _unresolved(snap: dict) -> list[dict[str, Any]]:
    """Names claimed by owners none of which is live.  A name held only by tombstones is
    one its owners gave up; for a pipeline name, readiness says so."""
    views = {m["prefix"]: m for m in snap.get("members", [])}
    views[snap["self"]["prefix"]] = snap["self"]
    out: list[dict[str, Any]] = []
    for name, claim in sorted(snap.get("names", {}).items()):
        if claim.get("resolves") or claim.get("tombstone"):
            continue
        owners = [e["owner"] for e in claim.get("entries", []) if not e.get("tombstone")] or [claim["owner"]]
        states = ", ".join(f"{o} {views.get(o, {}).get('state', 'unknown')}" for o in owners)
        out.append({"kind": "unresolved", "where": name,
                    "detail": f"{name} does not resolve to a live node (owners: {states})",
                    "check": f"start {name}'s node, or check why its owners are not alive"})
    return out


def keys(snap: dict) -> dict:
    """``GET /api/keys``: our mesh keyring and every member's, as their metadata says (``members``
    holds ourselves first, then the others in any state)."""
    me = snap["self"]
    ring = list(me.get("keyring") or [])
    members = [{"name": _name(m), "prefix": m["prefix"], "state": m.get("state"),
                "keyring": list(m.get("keyring") or [])} for m in [me, *snap.get("members", [])]]
    return {"keyring": ring, "primary": ring[0] if ring else None, "members": members}
