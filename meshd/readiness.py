"""Whether the pipeline can serve now, and why not: one fact every surface shows.

A pure function of a node's snapshot dict (``meshd.snapshot.snapshot``): the
run's stage count (``--stages``), the live sets of the pipeline names
(``pp-orchestrator``, ``pp-stage-K``, ``pp-entry``, ``pp-exit``), each owner's
metadata (checkpoint, draining) and the gossiped paths between the nodes that
hand work to each other.  ``/api/topology``, ``/api/peers``, ``meshd doctor``
and the page read the result from the snapshot, so they cannot disagree.

A reason in ``why`` stops the pipeline; a warning in ``warnings`` does not
(another replica serves, or a pair of replicas has no path while another pair
has one).  Every message starts with the stage or hop it concerns.  Facts the
snapshot lacks are not guessed: an unreported path is never held against a
node.  An empty checkpoint fingerprint is a node started without a model
(no ``--model`` or ``--stub``): it serves nothing where the run has one.
"""

from __future__ import annotations

from typing import Any

LIVE = ("alive", "suspect")
ORCHESTRATOR = "pp-orchestrator"
STAGES_UNKNOWN = "stages unknown: no member says how many stages the run has"


def stage_name(k: int) -> str:
    """The registry name of stage ``k``."""
    return f"pp-stage-{k}"


def readiness(snap: dict) -> dict:
    """``{"ready", "why", "warnings", "stages", "orchestrator", "checkpoint", "expected_stages"}``.

    ``stages`` has one row per expected stage: its replicas (``prefix``, ``state``,
    ``checkpoint``, ``draining``, ``serving``) and ``live``, how many serve.
    """
    views = _views_by_prefix(snap)
    expected = expected_stages(snap)
    if expected is None:
        return {"ready": False, "why": [STAGES_UNKNOWN], "warnings": [], "stages": [],
                "orchestrator": None, "checkpoint": None, "expected_stages": None}
    names = snap.get("names") or {}
    run_checkpoint = _run_checkpoint(snap, names, views)
    why: list[str] = []
    warnings: list[str] = _stage_count_warnings(snap, expected)
    now = snap.get("time")  # wall clock, as the members' start times are
    lag = snap.get("suspicion_s")  # how long a death's verdict may trail it; None: not said
    cut_off = _cut_off(snap, views, expected)
    orchestrator = _role_row("orchestrator", ORCHESTRATOR, names, views, run_checkpoint, now, lag, why,
                             warnings, cut_off, expected)
    rows = []
    for k in range(expected):
        row = _role_row(f"stage-{k}", stage_name(k), names, views, run_checkpoint, now, lag, why, warnings,
                        cut_off, expected)
        rows.append({"stage": k, **row})
    _check_edge_names(rows, names, why)
    _check_hops(snap, orchestrator, rows, why, warnings)
    _check_models(snap, warnings)
    return {"ready": not why, "why": why, "warnings": warnings, "stages": rows,
            "orchestrator": orchestrator, "checkpoint": run_checkpoint or None, "expected_stages": expected}


def expected_stages(snap: dict) -> int | None:
    """The node's own ``--stages``, else the most any live member reports, else None."""
    own = snap["self"].get("stages")
    if own:
        return int(own)
    reported = [m.get("stages") for m in snap.get("members", []) if m.get("state") in LIVE]
    counts = [int(n) for n in reported if n]
    return max(counts) if counts else None


def _views_by_prefix(snap: dict) -> dict[str, dict]:
    """Member views (ourselves included) by the 8-hex prefix the name registry shows."""
    out = {m["prefix"]: m for m in snap.get("members", [])}
    out[snap["self"]["prefix"]] = snap["self"]
    return out


def _run_checkpoint(snap: dict, names: dict, views: dict[str, dict]) -> str:
    """Ours when we are an orchestrator (the one our requests need), else the orchestrator's
    checkpoint fingerprint when it says one, else ours, else the one every live member with a
    model serves ("" when none: a mesh without models)."""
    if snap["self"].get("role") == "orchestrator" and snap["self"].get("checkpoint"):
        return str(snap["self"]["checkpoint"])
    for owner in (names.get(ORCHESTRATOR) or {}).get("live", []):
        fingerprint = views.get(owner, {}).get("checkpoint")
        if fingerprint:
            return str(fingerprint)
    own = str(snap["self"].get("checkpoint") or "")
    if own:
        return own
    members = snap.get("members", [])
    served = {m["checkpoint"] for m in members if m.get("state") in LIVE and m.get("checkpoint")}
    return served.pop() if len(served) == 1 else ""


NO_MODEL = ("no node serves a model (--model DIR or --stub): the mesh gossips and routes, "
            "but it cannot generate")


def _check_models(snap: dict, warnings: list[str]) -> None:
    """A mesh where no node has a model is ready by its names and paths (a membership-only
    mesh, maybe on purpose), but warned about: its API answers every request with a 404.
    (A node without one where the run has one is not ready: see ``_role_row``.)"""
    live = [m for m in snap.get("members", []) if m.get("state") in LIVE]
    if not any(v.get("checkpoint") for v in [snap["self"], *live]):
        warnings.append(NO_MODEL)


def _stage_count_warnings(snap: dict, expected: int) -> list[str]:
    """A live member that expects another stage count was started for another run.  (A stage
    replica's own row says so for the stage it claims: see ``other_split``.)"""
    out = []
    for m in snap.get("members", []):
        if m.get("role") == "stage" and isinstance(m.get("stage"), int) and 0 <= m["stage"] < expected:
            continue  # its stage's row says it
        if m.get("state") in LIVE and m.get("stages") and m["stages"] != expected:
            out.append(f"{_label(m)}: {m['prefix']} expects {m['stages']} stages, this run {expected}")
    return out


def _label(view: dict) -> str:
    if view.get("role") == "stage" and view.get("stage") is not None:
        return f"stage-{view['stage']}"
    return str(view.get("role") or view.get("name") or "?")


def _serves(checkpoint: str) -> str:
    if not checkpoint:
        return "serves no model (started without --model or --stub)"
    return f"serves checkpoint {_short(checkpoint)}"


def other_split(stages: int, run_stages: int) -> str:
    """What a stage started with ``--stages stages`` in a run of ``run_stages`` is, in words:
    it holds another share of the layers than the run's stage of its number, so no request
    goes through it."""
    return f"runs a {stages}-stage split (--stages {stages}), but this run has {run_stages} stages"


def serves_other(checkpoint: str, run_checkpoint: str) -> str:
    """What a node serving ``checkpoint`` (a fingerprint; "" for none) in a run of
    ``run_checkpoint`` serves, in words."""
    return f"{_serves(checkpoint)} but the run's is {_short(run_checkpoint)}"


def _short(fingerprint: str) -> str:
    return fingerprint if len(fingerprint) <= 12 else fingerprint[:12] + ".."


# ------------------------------------------------------------- one role


_REPLICA_KEYS = ("prefix", "state", "checkpoint", "draining", "serving", "id")


def _replica(entry: dict, views: dict[str, dict], run_checkpoint: str, now: float | None,
             lag: float | None, cut_off: dict[str, str], expected: int) -> dict:
    """One owner's entry as readiness sees it; ``serving`` when it can take new work, ``up_s``
    how long ago its process started (``_up_for``), ``down_s`` how long ago, at the most, a
    process gone went down (``_down_for``)."""
    view = views.get(entry["owner"], {})
    checkpoint = str(view.get("checkpoint") or "")
    draining = bool(view.get("draining"))
    mismatch = bool(run_checkpoint) and checkpoint != run_checkpoint  # no model at all, too
    # A stage of another split holds other layers under the same stage number.
    split = view.get("stages") if view.get("role") == "stage" else None
    split = int(split) if split and int(split) != expected else None
    live = bool(entry.get("live"))
    # A stage reported its process gone before failure detection says so: the orchestrator
    # routes no new request to it meanwhile (``Mesh.report_down``), so it does not serve.
    down = bool(view.get("reported_down"))
    return {"prefix": entry["owner"], "state": view.get("state", "unknown"), "checkpoint": checkpoint or None,
            "draining": draining,
            "serving": live and not draining and not mismatch and not down and split is None,
            "live": live, "mismatch": mismatch, "split": split, "expected": expected,
            "tombstone": bool(entry.get("tombstone")),
            "id": view.get("id"), "reported_down": down, "cut_off": cut_off.get(entry["owner"]),
            "age_s": view.get("state_age_s"),
            "up_s": _up_for(view, now), "down_s": _down_for(view, lag), "addr": view.get("addr")}


def _up_for(view: dict, now: float | None) -> float | None:
    """How long ago the member's process started: by the start time it gossips (its own clock,
    seconds since 1970; ``now`` is the snapshot's), else, alive, for as long as we have seen
    it alive; None for a node gone that said no start time (an older peer)."""
    started = view.get("started")
    if started and now is not None:
        return max(0.0, now - started)
    return view.get("state_age_s") if view.get("state") == "alive" else None


def _down_for(view: dict, lag: float | None) -> float | None:
    """How long ago, at the most, a member no longer alive went down: its process cannot have
    gone before we last heard from it, nor before its verdict (its state's age) less ``lag``,
    the suspicion timeout by which a verdict of death trails the death (None: a snapshot
    that does not say it); the nearer of the two, and no nearer than the verdict.  None when
    its state says no age."""
    age = view.get("state_age_s")
    if age is None:
        return None
    bounds = [b for b in (view.get("last_seen_s"), None if lag is None else age + lag) if b is not None]
    return max(age, min(bounds)) if bounds else age


# A process started this long before another went down may still have started after it:
# start times count whole seconds (cut down), by another host's clock.
START_SLACK_S = 1.0


def _role_row(label: str, name: str, names: dict, views: dict[str, dict], run_checkpoint: str,
              now: float | None, lag: float | None, why: list[str], warnings: list[str],
              cut_off: dict[str, str], expected: int) -> dict:
    """The replicas of ``name`` and how many serve; adds its reasons and warnings."""
    entries = (names.get(name) or {}).get("entries", [])
    replicas = [_replica(e, views, run_checkpoint, now, lag, cut_off, expected) for e in entries]
    # A tombstone shows while its owner is known dead (a replica that went down), or while
    # its owner drains: draining withdraws a node's names, and it is still there, serving
    # no new work.
    shown = [r for r in replicas if not r["tombstone"] or r["state"] == "dead" or _drains(r)]
    replaced = _replacements(shown)
    for r in shown:
        if replaced[r["prefix"]] is not None:
            r["serving"] = False  # a suspect whose address a newer node holds is gone
    serving = [r for r in shown if r["serving"]]
    if serving:
        warnings.extend(_degraded(label, shown, replaced, len(serving), run_checkpoint))
    else:
        why.extend(_unserved(label, name, replicas, run_checkpoint))
    public = [{k: r[k] for k in _REPLICA_KEYS} for r in shown]
    return {"name": label, "replicas": public, "live": len(serving)}


def _unserved(label: str, name: str, replicas: list[dict], run_checkpoint: str) -> list[str]:
    """Why no owner of ``name`` can take new work, one line per cause."""
    if not replicas:
        return [f"{label}: no live owner of {name}"]
    live = [r for r in replicas if r["live"] or _drains(r)]
    if not live:
        claims = [r for r in replicas if not r["tombstone"]]
        if not claims:
            gone = ", ".join(f"{r['prefix']} {_gone(r['state'])}" for r in replicas)
            noun = "a tombstone (owner" if len(replicas) == 1 else "tombstones (owners"
            return [f"{label}: {name} is held only by {noun} {gone})"]
        owners = ", ".join(f"{r['prefix']} {_gone(r['state'])}" for r in claims)
        return [f"{label}: no live owner of {name} ({owners})"]
    if all(r["draining"] for r in live):
        owners = ", ".join(r["prefix"] for r in live)
        return [f"{label}: every owner is draining and takes no new requests ({owners})"]
    out = []
    for r in live:
        if r["reported_down"]:
            out.append(f"{label}: {r['prefix']} {_down(r)}")
        elif r["mismatch"]:
            out.append(f"{label}: {r['prefix']} {serves_other(r['checkpoint'], run_checkpoint)}")
        elif r["split"] is not None:
            out.append(f"{label}: {r['prefix']} {other_split(r['split'], r['expected'])}")
        elif r["draining"]:
            out.append(f"{label}: {r['prefix']} {_DRAINING}")
    return out


_DRAINING = "is draining (hands its requests over)"


def _drains(r: dict) -> bool:
    """Whether ``r``'s owner is draining and still there (its names withdrawn or not)."""
    return bool(r["draining"]) and r["state"] in LIVE


_REPORTED_DOWN = ("looks down to a node that sends to it (its stream ended and a dial was refused, or "
                  "its sends failed); failure detection has not said so yet: is its process running?")


def _down(r: dict) -> str:
    """Why a replica a stage reported gone serves nothing: a node that hands it work has no
    path to it while it is alive to the mesh (``_cut_off``), else its process may be gone."""
    if r.get("cut_off"):
        return f"is alive to the mesh, but a node that hands it work has no path to it: {r['cut_off']}"
    return _REPORTED_DOWN


def _cut_off(snap: dict, views: dict[str, dict], expected: int) -> dict[str, str]:
    """Members alive to the mesh that a live node handing them work (``_hops``) has no path
    to, by prefix: that direction, e.g. ``stage-0 (50505050)→stage-1 (51a51a51): no path (..)``.

    A stage that cannot deliver to such a member reports it as down; the direction says why."""
    out: dict[str, str] = {}
    for y in views.values():
        if y.get("state", "alive") != "alive" or not y.get("id"):
            continue
        for x in views.values():
            if x is y or not x.get("id") or x.get("state", "alive") not in LIVE:
                continue
            if _label(x) not in _senders_to(_label(y), expected):
                continue
            p = path(snap, x["id"], y["id"])
            if p["path"] == "none":
                out[y["prefix"]] = (f"{_label(x)} ({x['prefix']})→{_label(y)} ({y['prefix']}): no path "
                                    f"({p.get('reason') or 'unanswered'})")
                break
    return out


def _senders_to(label: str, expected: int) -> set[str]:
    """Who hands work to ``label`` (as ``_hops``): the stage before it; to stage-0 the
    orchestrator and the last stage; to the orchestrator the last stage."""
    last = f"stage-{expected - 1}" if expected else ""
    if label == "orchestrator":
        return {last}
    if label == "stage-0":
        return {"orchestrator", last}
    if label.startswith("stage-") and label[6:].isdigit():
        return {f"stage-{int(label[6:]) - 1}"}
    return set()


def _gone(state: str) -> str:
    return {"left": "left", "dead": "is dead", "unknown": "is not a known member"}.get(state, f"is {state}")


REPLACED_SHOWN_S = 600.0  # how long a warning names a dead node that a newer one replaced


def _replacements(shown: list[dict]) -> dict[str, dict | None]:
    """For each replica, the serving node that took its place, if any: its process was
    replaced (a restart under a new identity), not a replica lost beside one that serves.

    Each serving node ends a line of processes that followed one another, each started
    after the one before went down.  A place is an address: the processes that went down
    there followed one another (two cannot hold one port), however many restarts ago, so
    they are in the line of the node serving there, if one does.  A place elsewhere joins
    the line where it fits in time: its processes went down before the next in the line
    came up and, unless it goes first, the first of them came up after the one before went
    down (by the start times the processes gossip).  So a chain of restarts under new keys
    at new addresses, however long, reads as one node replaced; and two replicas that went
    down together do not both join the line of one node started since.  A suspect
    elsewhere may refute: a replica until dead.
    """
    out: dict[str, dict | None] = {r["prefix"]: None for r in shown}
    serving = [s for s in shown if s["serving"] and s["state"] == "alive"]
    places: dict[str, list[dict]] = {}
    for r in shown:
        if r["state"] != "alive":
            places.setdefault(r.get("addr") or r["prefix"], []).append(r)
    lines = {s["prefix"]: [s] for s in serving}  # newest first: the serving node, then before it
    elsewhere = []
    for where, gone in places.items():
        # The last to go down first (those that say no age after them): the line's order.
        gone.sort(key=lambda r: (r.get("age_s") is None, r.get("age_s") or 0.0))
        here = next((s for s in serving if s.get("addr") == where), None)
        if here is not None:
            lines[here["prefix"]] += gone
            out.update((r["prefix"], here) for r in gone)
        elif not any(r["live"] for r in gone) and all(r.get("age_s") is not None for r in gone):
            elsewhere.append(gone)
    # The place gone most recently first, into the newest gap it fits: whatever came up
    # since it went down came up since every earlier place did too, so each place that can
    # be filled is.
    for gone in sorted(elsewhere, key=lambda place: place[0]["age_s"]):
        fits = [(line[i]["up_s"], node, i + 1) for node, line in lines.items() for i in range(len(line))
                if _fits(gone, line[i], line[i + 1] if i + 1 < len(line) else None)]
        if fits:
            _, node, at = min(fits, key=lambda fit: fit[0])
            lines[node][at:at] = gone
            out.update((r["prefix"], lines[node][0]) for r in gone)
    return out


def _fits(gone: list[dict], later: dict, earlier: dict | None) -> bool:
    """Whether the processes of one place (``gone``, the last to go down first) came between
    ``earlier`` (None: nothing before) and ``later`` in a line: all may have gone down before
    ``later`` came up, and the first of them came up after ``earlier`` may have gone down.
    Going down is as early as it can have been (``down_s``), not when the mesh declared it:
    a process restarted at once comes up before its last one is declared dead."""
    downs = [r.get("down_s") for r in gone]
    if later.get("up_s") is None or None in downs:
        return False
    if not later["up_s"] < min(d for d in downs if d is not None) + START_SLACK_S:
        return False
    if earlier is None:
        return True
    ups = [r.get("up_s") for r in gone]
    if None in ups or earlier.get("down_s") is None:
        return False  # one of them may have come up first, before ``earlier`` went down
    return max(u for u in ups if u is not None) < earlier["down_s"] + START_SLACK_S


def _degraded(label: str, shown: list[dict], replaced: dict[str, dict | None], serving: int,
              run_checkpoint: str) -> list[str]:
    """What is wrong with some replicas while ``serving`` others take the work; ``replaced``:
    the node that took each one's place, if any (``_replacements``)."""
    out = []
    # Nodes of one stage are its replicas (a node and the one that replaced it are not);
    # two orchestrators are two orchestrators.
    peers = [r for r in shown if not replaced[r["prefix"]]]
    replica = "replica " if label.startswith("stage-") and len(peers) > 1 else ""
    for r in shown:
        others = serving - (1 if r["serving"] else 0)
        rest = f"; {others} other{'s' if others != 1 else ''} serve{'' if others != 1 else 's'}"
        newer = replaced[r["prefix"]]
        if newer is not None:
            # Said for ten minutes where the address shows the replacement; otherwise (a
            # newer node elsewhere might be a replica added since) for as long as it is known.
            if (r["age_s"] is None or r["age_s"] < REPLACED_SHOWN_S
                    or not r.get("addr") or newer.get("addr") != r["addr"]):
                out.append(f"{label}: {r['prefix']} is down ({r['state']}); {newer['prefix']}, "
                           f"started since, serves in its place")
        elif _drains(r):
            out.append(f"{label}: {replica}{r['prefix']} {_DRAINING}{rest}")
        elif not r["live"]:
            out.append(f"{label}: {replica}{r['prefix']} is down ({r['state']}){rest}")
        elif r["mismatch"]:
            out.append(f"{label}: {r['prefix']} {serves_other(r['checkpoint'], run_checkpoint)}; "
                       f"not used{rest}")
        elif r["split"] is not None:
            out.append(f"{label}: {r['prefix']} {other_split(r['split'], r['expected'])}; not used{rest}")
        elif r["reported_down"]:
            out.append(f"{label}: {replica}{r['prefix']} {_down(r)}{rest}")
        elif r["state"] == "suspect":
            out.append(f"{label}: {replica}{r['prefix']} is suspect" + (rest if others else ""))
    return out


def _check_edge_names(rows: list[dict], names: dict, why: list[str]) -> None:
    """``pp-entry`` and ``pp-exit`` are what the orchestrator sends to and hears from."""
    if not rows:
        return
    for row, name in ((rows[0], "pp-entry"), (rows[-1], "pp-exit")):
        if row["live"] and not (names.get(name) or {}).get("resolves"):
            why.append(f"{row['name']}: no live owner of {name}")


# ------------------------------------------------------------- paths


# Why a path reads ``unknown``: our own direction to a peer's new process that no probe has
# given a verdict on yet (the only way our path table shows one unknown), or a direction
# another node's gossiped summary does not name (not sent yet, or left out).
NOT_PROBED = "not probed since its restart"
NOT_REPORTED = "not reported"


def path(snap: dict, frm: str, to: str) -> dict:
    """The path from node ``frm`` to node ``to`` (full ids): ``{"path", "rtt_ms", "direct_failures",
    "reason", "since_s", "relay", "punched", "why_unknown"}``; ``path`` is ``direct``, ``relay``,
    ``none`` or ``unknown``, ``relay`` the relay that carries it (None when unknown or not the
    relay), ``punched`` whether a direct path goes through the peer's NAT, opened by hole
    punching, and ``why_unknown`` why an unknown path is (``NOT_PROBED`` or ``NOT_REPORTED``;
    None for a known one).

    Our own outbound paths come from our own path table (fresher than our
    summary); every other node's from the summary it gossiped.
    """
    if frm == snap["self"]["id"]:
        m: dict = next((v for v in snap.get("members", []) if v["id"] == to), {})
        way = m.get("path_out", "direct")
        return {"path": way, "rtt_ms": m.get("rtt_ms"), "direct_failures": m.get("direct_failures", 0),
                "reason": m.get("last_failure") if way != "direct" else None,
                "since_s": m.get("path_out_since_s"), "relay": m.get("relay_via") if way == "relay" else None,
                "punched": bool(m.get("punched")), "why_unknown": NOT_PROBED if way == "unknown" else None}
    entries = (snap.get("path_summaries") or {}).get(frm, {}).get("entries", [])
    x = next((e for e in entries if e.get("to") == to), None)
    if x is None:
        return {"path": "unknown", "rtt_ms": None, "direct_failures": 0, "reason": None, "since_s": None,
                "relay": None, "punched": False, "why_unknown": NOT_REPORTED}
    out = {k: x.get(k) for k in ("path", "rtt_ms", "direct_failures", "reason", "since_s", "relay")}
    return {**out, "punched": bool(x.get("punched")), "why_unknown": None}


def _hops(orchestrator: dict, rows: list[dict]) -> list[tuple[dict, dict]]:
    """Who hands work to whom: orchestrator to stage-0, each stage to the next, the last
    stage back to stage-0 (the next token) and to the orchestrator (the stream)."""
    hops = [(orchestrator, rows[0])]
    hops += [(rows[k], rows[k + 1]) for k in range(len(rows) - 1)]
    if len(rows) > 1:
        hops.append((rows[-1], rows[0]))
    hops.append((rows[-1], orchestrator))
    return hops


def _check_hops(snap: dict, orchestrator: dict, rows: list[dict], why: list[str],
                warnings: list[str]) -> None:
    """A hop with no working path between any pair of serving replicas stops the pipeline."""
    if not rows:
        return
    for a, b in _hops(orchestrator, rows):
        pairs = [(x, y) for x in a["replicas"] if x["serving"] and x["id"]
                 for y in b["replicas"] if y["serving"] and y["id"] and y["id"] != x["id"]]
        if not pairs:
            continue
        broken = [(x, y, p) for x, y in pairs if (p := path(snap, x["id"], y["id"]))["path"] == "none"]
        hop = f"{a['name']}->{b['name']}"
        if broken and len(broken) == len(pairs):
            why.append(f"{hop}: no path ({'; '.join(_pair(x, y, p) for x, y, p in broken)})")
        elif broken:
            works = any(path(snap, x["id"], y["id"])["path"] in ("direct", "relay") for x, y in pairs)
            other = "another pair works" if works else "the other pairs are not reported yet"
            warnings.extend(f"{hop}: no path {_pair(x, y, p)}; {other}" for x, y, p in broken)


def _pair(x: dict, y: dict, p: dict[str, Any]) -> str:
    fails = p.get("direct_failures") or 0
    return f"{x['prefix']}→{y['prefix']}: {p.get('reason') or 'unanswered'}" + (f" ×{fails}" if fails else "")
