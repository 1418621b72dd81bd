"""Readiness: whether the pipeline can serve now and why not, from a node's snapshot.

The pure function is driven with snapshots built by hand (a 3-stage run with
replicas, then one thing broken at a time); then ``meshd doctor`` and
``meshd peers`` read it from real in-process nodes.
"""

from __future__ import annotations

import json
from typing import Any

import trio

from dashboard.views import peers, problems, topology
from meshd.cli import main
from meshd.readiness import NO_MODEL, STAGES_UNKNOWN, readiness

RUN = "cd34" * 8  # the run's checkpoint fingerprint
OTHER = "ab12" * 8

ORCH, S0, S1A, S1B, S2 = "0cc0cc00", "50505050", "51a51a51", "51b51b51", "52525252"


def node(prefix: str, stage: int | None = None, *, state: str = "alive", stages: int | None = 3,
         checkpoint: str = RUN, draining: bool = False) -> dict:
    """A member view as ``meshd.snapshot.member_view`` writes it (the fields readiness reads)."""
    role = "orchestrator" if stage is None else "stage"
    return {"id": prefix * 8, "prefix": prefix, "name": role if stage is None else f"stage-{stage}",
            "role": role, "stage": stage, "state": state, "stages": stages, "checkpoint": checkpoint,
            "draining": draining, "epoch": 7, "addr": f"127.0.0.1:{int(prefix[:4], 16)}"}


def names_of(view: dict) -> list[str]:
    """What ``NodeOptions.names`` registers: the last stage knows it is last only from --stages."""
    if view["role"] == "orchestrator":
        return ["pp-orchestrator"]
    k, last = view["stage"], (view["stages"] or 0) - 1
    return [f"pp-stage-{k}"] + (["pp-entry"] if k == 0 else []) + (["pp-exit"] if k == last else [])


def snap_of(me: dict, others: list[dict], *, tombstoned: tuple[str, ...] = (),
            summaries: dict[str, dict[str, str]] | None = None) -> dict:
    """A snapshot seen from ``me``: every node claims its names (``tombstoned`` prefixes hold
    tombstones), and ``summaries`` gives gossiped paths {from prefix: {to prefix: path}}."""
    names: dict[str, dict] = {}
    for v in [me, *others]:
        for name in names_of(v):
            tomb = v["prefix"] in tombstoned
            live = not tomb and v["state"] in ("alive", "suspect")
            entry = {"owner": v["prefix"], "clock": 1, "tombstone": tomb, "live": live}
            names.setdefault(name, {"entries": []})["entries"].append(entry)
    for claim in names.values():
        claim["live"] = [e["owner"] for e in claim["entries"] if e["live"]]
        claim["resolves"] = bool(claim["live"])
        claim["tombstone"] = all(e["tombstone"] for e in claim["entries"])
        claim["owner"] = (claim["live"] or [claim["entries"][0]["owner"]])[0]
    paths = {frm * 8: {"entries": [{"to": to * 8, "path": way, "reason": "timeout", "direct_failures": 3}
                                   for to, way in row.items()]}
             for frm, row in (summaries or {}).items()}
    return {"self": me, "members": [{**v, "path_out": "direct"} for v in others], "names": names,
            "path_summaries": paths, "relay": None}


def healthy() -> tuple[dict, list[dict]]:
    return node(ORCH), [node(S0, 0), node(S1A, 1), node(S1B, 1), node(S2, 2)]


def test_a_healthy_three_stage_run_with_two_replicas_is_ready():
    me, others = healthy()
    r = readiness(snap_of(me, others))
    assert r["ready"] is True and r["why"] == [] and r["warnings"] == []
    assert [(s["name"], s["live"]) for s in r["stages"]] == [("stage-0", 1), ("stage-1", 2), ("stage-2", 1)]
    assert {x["prefix"] for x in r["stages"][1]["replicas"]} == {S1A, S1B}
    assert set(r["stages"][1]["replicas"][0]) >= {"prefix", "state", "checkpoint", "draining"}


def test_a_stage_nobody_claims_stops_the_run():
    me, others = healthy()
    r = readiness(snap_of(me, [v for v in others if v["prefix"] != S2]))
    assert r["ready"] is False and r["why"] == ["stage-2: no live owner of pp-stage-2"]


def test_a_last_stage_started_without_stages_leaves_pp_exit_unowned():
    me, others = healthy()
    others[3] = node(S2, 2, stages=None)
    r = readiness(snap_of(me, others))
    assert r["ready"] is False and r["why"] == ["stage-2: no live owner of pp-exit"]


def test_nodes_started_without_a_model_do_not_count_where_the_run_has_one():
    """A stage or an orchestrator with no --model (and no --stub) claims its name but serves
    nothing: seen from any node, the run is not ready, and the line says what to add."""
    me, others = healthy()
    others[0] = node(S0, 0, checkpoint="")
    r = readiness(snap_of(me, others))
    assert r["why"] == [f"stage-0: {S0} serves no model (started without --model or --stub) but the run's "
                        f"is {RUN[:12]}.."]
    # The orchestrator without one, seen from itself: the stages say which model the run serves.
    me, others = healthy()
    me = node(ORCH, checkpoint="")
    r = readiness(snap_of(me, others))
    assert not r["ready"] and r["why"] == [f"orchestrator: {ORCH} serves no model (started without --model "
                                           f"or --stub) but the run's is {RUN[:12]}.."]
    # A mesh where nobody serves a model (gossip alone) is judged by its names and paths only,
    # and warned that it cannot generate.
    me, others = node(ORCH, checkpoint=""), [node(p, k, checkpoint="") for p, k in
                                             ((S0, 0), (S1A, 1), (S1B, 1), (S2, 2))]
    r = readiness(snap_of(me, others))
    assert r["ready"] is True and r["warnings"] == [NO_MODEL], r


def test_a_stage_whose_owner_is_dead_names_it():
    me, others = healthy()
    others[0] = node(S0, 0, state="dead")
    r = readiness(snap_of(me, others))
    assert r["why"] == [f"stage-0: no live owner of pp-stage-0 ({S0} is dead)"]


def test_a_name_held_only_by_a_tombstone_says_whose():
    me, others = healthy()
    others = [node(S0, 0), node(S1A, 1, state="left"), node(S2, 2)]
    r = readiness(snap_of(me, others, tombstoned=(S1A,)))
    assert r["ready"] is False
    assert r["why"] == [f"stage-1: pp-stage-1 is held only by a tombstone (owner {S1A} left)"]


def test_a_replica_on_another_checkpoint_does_not_count():
    me, others = healthy()
    others[3] = node(S2, 2, checkpoint=OTHER)
    r = readiness(snap_of(me, others))
    assert r["why"] == [f"stage-2: {S2} serves checkpoint {OTHER[:12]}.. but the run's is {RUN[:12]}.."]
    assert r["stages"][2]["live"] == 0
    # Beside a replica on the run's checkpoint it is only a warning.
    others[1] = node(S1A, 1, checkpoint=OTHER)
    r = readiness(snap_of(me, [v for v in others if v["prefix"] != S2] + [node(S2, 2)]))
    assert r["ready"] is True and r["stages"][1]["live"] == 1
    assert r["warnings"] == [f"stage-1: {S1A} serves checkpoint {OTHER[:12]}.. but the run's is "
                             f"{RUN[:12]}..; not used; 1 other serves"]


def test_a_stage_started_for_another_split_does_not_count():
    # stage-1 of a 2-stage split holds layers 3-5 of 6, not stage-1's 2-3 of this 3-stage run.
    me, others = healthy()
    split = "runs a 2-stage split (--stages 2), but this run has 3 stages"
    r = readiness(snap_of(me, [node(S0, 0), node(S1A, 1, stages=2), node(S2, 2)]))
    assert r["ready"] is False and r["stages"][1]["live"] == 0
    assert f"stage-1: {S1A} {split}" in r["why"]
    assert [x["serving"] for x in r["stages"][1]["replicas"]] == [False]
    # Beside a replica of the run's split it is only a warning, said once.
    r = readiness(snap_of(me, [node(S0, 0), node(S1A, 1, stages=2), node(S1B, 1), node(S2, 2)]))
    assert r["ready"] is True and r["stages"][1]["live"] == 1
    assert r["warnings"] == [f"stage-1: {S1A} {split}; not used; 1 other serves"]
    # A stage number past this run's stages has no row: a warning says it.
    r = readiness(snap_of(me, [*others, node("53535353", 3, stages=4)]))
    assert r["ready"] is True
    assert r["warnings"] == ["stage-3: 53535353 expects 4 stages, this run 3"]


def test_the_run_checkpoint_is_the_orchestrators():
    me, others = healthy()
    me = node(S0, 0, checkpoint=OTHER)  # we, stage-0, serve another checkpoint than the orchestrator
    r = readiness(snap_of(me, [node(ORCH), *others[1:]]))
    assert r["checkpoint"] == RUN
    assert r["why"] == [f"stage-0: {S0} serves checkpoint {OTHER[:12]}.. but the run's is {RUN[:12]}.."]


def test_a_stage_whose_every_owner_drains_stops_the_run_and_one_draining_replica_warns():
    me, others = healthy()
    r = readiness(snap_of(me, others[:3] + [node(S2, 2, draining=True)]))
    assert r["why"] == [f"stage-2: every owner is draining and takes no new requests ({S2})"]
    r = readiness(snap_of(me, [others[0], node(S1A, 1, draining=True), *others[2:]]))
    assert r["ready"] is True
    assert r["warnings"] == [f"stage-1: replica {S1A} is draining (hands its requests over); 1 other serves"]


def test_a_draining_node_that_withdrew_its_names_is_shown_draining_not_missing():
    """Draining, a node withdraws its names (its entries become tombstones while it is
    alive) and says so in its metadata: it stays in its stage's listing as draining, serves
    no new work, and a stage it alone held says why it stopped."""
    me, others = healthy()
    others[1] = node(S1A, 1, draining=True)
    r = readiness(snap_of(me, others, tombstoned=(S1A,)))
    assert r["ready"] is True and r["stages"][1]["live"] == 1
    assert {(x["prefix"], x["draining"]) for x in r["stages"][1]["replicas"]} == {(S1B, False), (S1A, True)}
    assert r["warnings"] == [f"stage-1: replica {S1A} is draining (hands its requests over); 1 other serves"]
    others[3] = node(S2, 2, draining=True)
    snap = snap_of(me, others, tombstoned=(S1A, S2))
    r = readiness(snap)
    assert r["ready"] is False and r["stages"][2]["live"] == 0
    assert [x["prefix"] for x in r["stages"][2]["replicas"]] == [S2]
    assert r["why"] == [f"stage-2: every owner is draining and takes no new requests ({S2})"]
    assert r["warnings"] == [f"stage-1: replica {S1A} is draining (hands its requests over); 1 other serves"]
    # Doctor gives that reason, and no other problem for the names a draining node gave up
    # (no node has gossiped its paths in this snapshot: those are the only problems).
    assert {p["kind"] for p in problems(snap)} == {"unreported"}


def test_no_path_between_consecutive_stages_stops_the_run():
    me, others = healthy()
    r = readiness(snap_of(me, others, summaries={S0: {S1A: "none", S1B: "none"}}))
    assert r["ready"] is False
    assert r["why"] == [f"stage-0->stage-1: no path ({S0}→{S1A}: timeout ×3; {S0}→{S1B}: timeout ×3)"]
    # One pair broken while the other has a path: the run serves through the other replica.
    r = readiness(snap_of(me, others, summaries={S0: {S1A: "none", S1B: "relay"}}))
    assert r["ready"] is True
    assert r["warnings"] == [f"stage-0->stage-1: no path {S0}→{S1A}: timeout ×3; another pair works"]


def test_an_unreported_path_is_not_held_against_the_run():
    me, others = healthy()
    r = readiness(snap_of(me, others, summaries={S0: {}}))
    assert r["ready"] is True and r["warnings"] == []


def test_no_orchestrator_stops_the_run():
    me, others = healthy()
    r = readiness(snap_of(others[0], others[1:]))
    assert r["ready"] is False and r["why"] == ["orchestrator: no live owner of pp-orchestrator"]


def test_a_dead_replica_beside_a_live_one_is_a_warning():
    me, others = healthy()
    others[2] = node(S1B, 1, state="dead")
    r = readiness(snap_of(me, others, tombstoned=(S1B,)))
    assert r["ready"] is True and r["stages"][1]["live"] == 1
    assert r["warnings"] == [f"stage-1: replica {S1B} is down (dead); 1 other serves"]


def test_a_node_replaced_by_one_started_since_is_named_as_replaced_not_as_a_replica():
    """A stage restarted under a new identity leaves its old identity dead until the mesh
    forgets it: the node serving now came up after it went down, so it replaced it; a node
    that served before the other died is a replica that is left."""
    me, others = healthy()
    del others[2]  # stage-1 is S1A alone ...
    dead = {**node(S1B, 1, state="dead"), "state_age_s": 30.0}  # ... and the identity it replaced
    others[1]["state_age_s"] = 12.0
    r = readiness(snap_of(me, [*others, dead], tombstoned=(S1B,)))
    assert r["ready"] is True
    assert r["warnings"] == [f"stage-1: {S1B} is down (dead); {S1A}, started since, serves in its place"]
    others[1]["state_age_s"] = 300.0  # up before the other went down: that one was a replica
    r = readiness(snap_of(me, [*others, dead], tombstoned=(S1B,)))
    assert r["warnings"] == [f"stage-1: replica {S1B} is down (dead); 1 other serves"]
    # Restarted at its address before the mesh saw it die: the same port, so replaced.
    dead = {**dead, "addr": others[1]["addr"]}
    others[1]["state_age_s"] = 300.0
    r = readiness(snap_of(me, [*others, dead], tombstoned=(S1B,)))
    assert r["warnings"] == [f"stage-1: {S1B} is down (dead); {S1A}, started since, serves in its place"]
    r = readiness(snap_of(me, [*others, {**dead, "state_age_s": 3600.0}], tombstoned=(S1B,)))
    assert r["ready"] is True and r["warnings"] == []  # replaced at its address long ago
    # Elsewhere, long ago: still said (the newer node may be a replica added since).
    others[1]["state_age_s"] = 12.0
    far = {**dead, "addr": "127.0.0.1:9", "state_age_s": 3600.0}
    r = readiness(snap_of(me, [*others, far], tombstoned=(S1B,)))
    assert r["warnings"] == [f"stage-1: {S1B} is down (dead); {S1A}, started since, serves in its place"]
    # Two gone and one newer node: it took one place; the other is a replica lost.
    other_dead = {**node("51c51c51", 1, state="dead"), "addr": "127.0.0.1:8", "state_age_s": 40.0}
    r = readiness(snap_of(me, [*others, far, other_dead], tombstoned=(S1B, "51c51c51")))
    assert len([w for w in r["warnings"] if "serves in its place" in w]) == 1
    assert len([w for w in r["warnings"] if "is down (dead); 1 other serves" in w]) == 1


def test_every_process_a_chain_of_restarts_at_one_address_left_behind_reads_as_replaced():
    """A stage restarted twice under new keys at its address: both earlier identities are
    gone processes of that one port, so the node serving there replaced both, whichever
    of them the registry lists first; neither is called a replica."""
    me, others = healthy()
    del others[2]  # stage-1 is S1A alone now, at the address ...
    at = others[1]["addr"]
    others[1]["state_age_s"] = 5.0
    first = {**node("51000000", 1, state="dead"), "addr": at, "state_age_s": 40.0}  # ... its first process
    second = {**node("51ffffff", 1, state="dead"), "addr": at, "state_age_s": 20.0}  # ... and its second
    for gone in ([first, second], [second, first]):
        r = readiness(snap_of(me, [*others, *gone], tombstoned=("51000000", "51ffffff")))
        assert r["ready"] is True and r["stages"][1]["live"] == 1
        assert sorted(r["warnings"]) == [
            f"stage-1: 51000000 is down (dead); {S1A}, started since, serves in its place",
            f"stage-1: 51ffffff is down (dead); {S1A}, started since, serves in its place"]
    # The second restart moved to another port: the node there replaced the second process,
    # and through it the first, which held the first port before it.
    moved = {**others[1], "addr": "127.0.0.1:7"}
    r = readiness(snap_of(me, [others[0], moved, others[2], first, second],
                          tombstoned=("51000000", "51ffffff")))
    assert sorted(r["warnings"]) == [
        f"stage-1: 51000000 is down (dead); {S1A}, started since, serves in its place",
        f"stage-1: 51ffffff is down (dead); {S1A}, started since, serves in its place"]
    # Two replicas at two addresses, both down, and one node started since: it took one
    # place, whichever order they are listed in; the other is a replica lost.
    lost = {**second, "addr": "127.0.0.1:8"}
    for gone in ([first, lost], [lost, first]):
        r = readiness(snap_of(me, [others[0], moved, others[2], *gone], tombstoned=("51000000", "51ffffff")))
        assert sorted(r["warnings"]) == [
            f"stage-1: 51ffffff is down (dead); {S1A}, started since, serves in its place",
            "stage-1: replica 51000000 is down (dead); 1 other serves"]


def test_a_chain_of_restarts_under_new_keys_at_new_addresses_reads_as_one_node_replaced():
    """Stage-1 restarted twice under new keys, at another address each time (a host swapped,
    a container moved): 51000000 went down, 51ffffff started after that and went down too,
    and S1A started after that.  Each process's start time (its own, gossiped in its
    metadata) follows the last one's going down, so doctor reads one node replaced twice,
    not a replica lost beside the one serving."""
    now = 1_800_000_000.0  # the snapshot's wall clock
    me, others = healthy()
    del others[2]  # stage-1 is S1A alone now, up 5 s
    others[1].update(state_age_s=5.0, started=int(now - 5))
    first = {**node("51000000", 1, state="dead"), "addr": "127.0.0.1:5", "state_age_s": 40.0,
             "started": int(now - 3600)}
    second = {**node("51ffffff", 1, state="dead"), "addr": "127.0.0.1:6", "state_age_s": 20.0,
              "started": int(now - 30)}
    replaced = [f"stage-1: 51000000 is down (dead); {S1A}, started since, serves in its place",
                f"stage-1: 51ffffff is down (dead); {S1A}, started since, serves in its place"]

    def seen(*gone: dict, serving: tuple[dict, ...] = tuple(others)) -> dict:
        return readiness({**snap_of(me, [*serving, *gone], tombstoned=("51000000", "51ffffff")), "time": now})

    for gone in ([first, second], [second, first]):
        r = seen(*gone)
        assert r["ready"] is True and r["stages"][1]["live"] == 1
        assert sorted(r["warnings"]) == replaced
    # The third process back at the first one's address: the same chain, read the same way.
    back = {**others[1], "addr": first["addr"]}
    assert sorted(seen(first, second, serving=(others[0], back, others[2]))["warnings"]) == replaced
    # Had the second started before the first went down, they were replicas: one is lost.
    r = seen(first, {**second, "started": int(now - 60)})
    assert sorted(r["warnings"]) == [replaced[1], "stage-1: replica 51000000 is down (dead); 1 other serves"]
    # A process that gives no start time (an older peer) links by address alone: here, nothing.
    r = seen(first, {**second, "started": None})
    assert sorted(r["warnings"]) == [replaced[1], "stage-1: replica 51000000 is down (dead); 1 other serves"]


def test_a_restart_that_came_up_before_its_last_process_was_declared_dead_reads_as_replaced():
    """A supervisor restarted stage-1 at once under a new key at a new address: the old
    process died at t0, the new one started at t0+1 and joined at t0+30, and the mesh
    declared the old one dead only at t0+5, after its suspicion ran out.  The new one came
    up after the old one went down (when it was last heard from), so it replaced it; a node
    started well before that is a replica, and of two replicas that died together one
    node started since replaces one only."""
    t0 = 1_800_000_000.0
    now = t0 + 40  # the snapshot's wall clock
    me, others = healthy()
    del others[2]  # stage-1 is S1A alone, up since t0+1, joined at t0+30
    others[1].update(state_age_s=now - (t0 + 30), started=int(t0 + 1))
    old = {**node(S1B, 1, state="dead"), "addr": "127.0.0.1:5", "state_age_s": now - (t0 + 5),
           "last_seen_s": now - (t0 - 0.2), "started": int(t0 - 3600)}
    replaced = f"stage-1: {S1B} is down (dead); {S1A}, started since, serves in its place"

    def seen(*gone: dict, **extra: Any) -> dict:
        tombs = tuple(g["prefix"] for g in gone)
        return readiness({**snap_of(me, [*others, *gone], tombstoned=tombs), "time": now, **extra})

    assert seen(old)["warnings"] == [replaced]
    # Not heard from by us at all: its verdict less the suspicion timeout bounds its death.
    unheard = {**old, "last_seen_s": None}
    assert seen(unheard, suspicion_s=6.0)["warnings"] == [replaced]
    assert seen(unheard)["warnings"] == [f"stage-1: replica {S1B} is down (dead); 1 other serves"]
    # Started 20 s before the old one was last heard from: a replica, then and now.
    early = {**others[1], "started": int(t0 - 20)}
    r = readiness({**snap_of(me, [others[0], early, *others[2:], old], tombstoned=(S1B,)), "time": now,
                   "suspicion_s": 6.0})
    assert r["warnings"] == [f"stage-1: replica {S1B} is down (dead); 1 other serves"]
    # Two replicas at two addresses that died together, one node started since: one is lost.
    twin = {**old, "prefix": "51c51c51", "id": "51c51c51" * 8, "addr": "127.0.0.1:6"}
    r = seen(old, twin, suspicion_s=6.0)
    assert len([w for w in r["warnings"] if "serves in its place" in w]) == 1
    assert len([w for w in r["warnings"] if "is down (dead); 1 other serves" in w]) == 1


def test_the_snapshot_gives_each_process_s_start_time_for_readiness_to_read():
    """``meshd.snapshot.snapshot`` (what /api/snapshot, doctor and readiness read) says when
    each process started, ours included, by its own clock: None for a peer that says none;
    and the suspicion timeout, by which a death's verdict may trail the death."""
    from dataclasses import replace

    from test_swim_units import Bench

    from meshd.snapshot import snapshot
    from meshd.wire import Alive

    bench = Bench(3)
    a, b, c = bench.swims
    a.set_meta(replace(a.me.meta, started=1_800_000_000), 0.0)
    b.set_meta(replace(b.me.meta, started=1_800_000_100), 0.0)
    for peer in (b, c):  # c says no start time, as an older peer
        bench.tell(a, peer, Alive(peer.incarnation, peer.id, peer.me.addr, peer.me.meta), now=1.0)
    snap = snapshot(a, 1.0)
    assert snap["self"]["started"] == 1_800_000_000
    assert {m["prefix"]: m["started"] for m in snap["members"]} == {b.me.prefix: 1_800_000_100,
                                                                     c.me.prefix: None}
    # ... and how long a death's verdict may trail it: the longest suspicion at its size.
    assert snap["suspicion_s"] == a.config.suspicion_bounds(3)[1]


def test_a_suspect_node_whose_address_a_newer_node_of_its_stage_holds_is_replaced():
    """Restarted at once under a new identity, at its address: the old identity is suspect
    for a few seconds, and cannot serve (its port is the new process's)."""
    me, others = healthy()
    others[2] = {**node(S1B, 1, state="suspect"), "addr": others[1]["addr"], "state_age_s": 1.0}
    others[1]["state_age_s"] = 2.0
    r = readiness(snap_of(me, others))
    assert r["ready"] is True and r["stages"][1]["live"] == 1
    assert r["warnings"] == [f"stage-1: {S1B} is down (suspect); {S1A}, started since, serves in its place"]
    others[2]["addr"] = "127.0.0.1:9"  # elsewhere: a replica that may refute
    r = readiness(snap_of(me, others))
    assert r["stages"][1]["live"] == 2
    assert r["warnings"] == [f"stage-1: replica {S1B} is suspect; 1 other serves"]


def test_a_suspect_stage_of_one_node_is_not_called_a_replica():
    me, others = healthy()
    others[3] = node(S2, 2, state="suspect")
    r = readiness(snap_of(me, others))
    assert r["ready"] is True and r["warnings"] == [f"stage-2: {S2} is suspect"]


def test_a_stage_reported_down_before_failure_detection_says_so_stops_the_run_naming_it():
    """The orchestrator routes no new request to a process a stage reported gone: readiness
    says the same, or doctor would say all is well while every request gets a 503."""
    me, others = healthy()
    others[3] = {**node(S2, 2), "reported_down": True}
    r = readiness(snap_of(me, others))
    assert r["ready"] is False and r["stages"][2]["live"] == 0
    [why] = r["why"]
    assert why.startswith(f"stage-2: {S2} looks down to a node that sends to it")
    assert "is its process running?" in why


def test_a_replica_reported_down_beside_a_live_one_is_a_warning():
    me, others = healthy()
    others[2] = {**node(S1B, 1), "reported_down": True}
    r = readiness(snap_of(me, others))
    assert r["ready"] is True and r["stages"][1]["live"] == 1
    [warning] = r["warnings"]
    assert warning.startswith(f"stage-1: replica {S1B} looks down to a node")
    assert warning.endswith("1 other serves")


def test_the_stage_count_comes_from_us_else_from_the_members():
    me, others = healthy()
    silent = [node(v["prefix"], v["stage"], stages=None) for v in others]
    r = readiness(snap_of(node(ORCH, stages=None), silent))
    assert r["ready"] is False and r["why"] == [STAGES_UNKNOWN]
    r = readiness(snap_of(node(ORCH, stages=None), others))
    assert r["ready"] is True and r["expected_stages"] == 3
    # An orchestrator started with --stages 4 routes through none of these 3-stage stages.
    r = readiness(snap_of(node(ORCH, stages=4), others))
    split = "runs a 3-stage split (--stages 3), but this run has 4 stages"
    assert r["why"] == [f"stage-0: {S0} {split}", f"stage-1: {S1A} {split}", f"stage-1: {S1B} {split}",
                        f"stage-2: {S2} {split}", "stage-3: no live owner of pp-stage-3"]


def test_topology_peers_and_problems_carry_it():
    me, others = healthy()
    snap = snap_of(me, [v for v in others if v["prefix"] != S2])
    topo = topology(snap)
    assert topo["readiness"]["ready"] is False and topo["readiness"]["why"] == [
        "stage-2: no live owner of pp-stage-2"]
    data = peers(snap)
    assert data["readiness"] == topo["readiness"]
    by_prefix = {p["prefix"]: p for p in data["peers"]}
    assert by_prefix[S1A]["replica_of"] == "stage-1" and by_prefix[S1A]["checkpoint"] == RUN
    assert (by_prefix[S1A]["replica"], by_prefix[S1B]["replica"], by_prefix[S1A]["replicas"]) == (1, 2, 2)
    assert by_prefix[S0]["replicas"] == 1 and data["self"]["replica_of"] is None
    # A stage-1 node that died (one replaced, say) is no replica: the live one is 1 of 1.
    replaced = peers(snap_of(me, [v if v["prefix"] != S1B else {**v, "state": "dead"} for v in others]))
    by_prefix = {p["prefix"]: p for p in replaced["peers"]}
    assert (by_prefix[S1A]["replica"], by_prefix[S1A]["replicas"], by_prefix[S1B]["replica"]) == (1, 1, None)
    dead = snap_of(me, others[:3] + [node(S2, 2, state="dead")])
    [unresolved] = [p for p in problems(dead) if p["kind"] == "unresolved" and p["where"] == "pp-stage-2"]
    assert f"owners: {S2} dead" in unresolved["detail"]



def test_peers_prints_a_node_that_left_by_its_stage_and_counts_it_in_no_replica_set():
    from rich.console import Console

    from dashboard.cli import _print_peers

    me, others = healthy()
    gone = "51c51c51"
    snap = snap_of(me, [*others, node(gone, 1, state="left")], tombstoned=(gone,))
    by_prefix = {p["prefix"]: p for p in peers(snap)["peers"]}
    assert (by_prefix[gone]["replica_of"], by_prefix[gone]["replica"], by_prefix[gone]["replicas"]) == (
        "stage-1", None, None)
    assert (by_prefix[S1A]["replica"], by_prefix[S1B]["replica"], by_prefix[S1A]["replicas"]) == (1, 2, 2)
    console = Console(width=400)
    with console.capture() as captured:
        _print_peers(console, snap)
    rows = [line.split()[:3] for line in captured.get().splitlines() if line.startswith("stage-1")]
    assert rows == [["stage-1", gone, "left"], ["stage-1", "(1/2)", S1A], ["stage-1", "(2/2)", S1B]], \
        captured.get()


def test_a_problem_names_which_replica_and_says_once_what_a_node_has_not_reported():
    # Every path known but those from stage-1's second replica (no summary at all) and one
    # from stage-0 (its summary lacks stage-1's first replica); stage-0 has no path to stage-2.
    me, others = healthy()
    everyone = [me, *others]
    summaries = {v["prefix"]: {w["prefix"]: "direct" for w in everyone if w is not v}
                 for v in everyone if v["prefix"] not in (ORCH, S1B)}
    del summaries[S0][S1A]
    summaries[S0][S2] = "none"
    found = problems(snap_of(me, others, summaries=summaries))
    unreported = sorted((p["where"], p["detail"]) for p in found if p["kind"] == "unreported")
    assert unreported == [
        (f"stage-0→stage-1 ({S1A})", f"stage-0 has not reported its path to stage-1 ({S1A}) yet"),
        (f"stage-1 ({S1B})→4 peers", f"no path summary from stage-1 ({S1B}) yet"),
    ]
    [no_path] = [p for p in found if p["kind"] == "no-path"]
    assert no_path["where"] == "stage-0→stage-2" and "is stage-2 up" in no_path["check"]
    # Suspect, stage-1's second replica is a warning of readiness; its silence is no problem.
    others[2] = node(S1B, 1, state="suspect")
    found = problems(snap_of(me, others, summaries=summaries))
    assert [p["where"] for p in found if p["kind"] == "unreported"] == [f"stage-0→stage-1 ({S1A})"]


def test_doctor_and_the_page_say_our_direction_to_a_restarted_peer_is_not_probed_yet():
    """Stage-0 restarted: our (the orchestrator's) path table reads unknown for its new
    process until a probe gives a verdict.  Doctor names that direction as not probed since
    the restart, where another node's direction it has not reported stays "not reported";
    the page's topology says which is which."""
    from rich.console import Console

    from dashboard.cli import _print_doctor

    me, others = healthy()
    everyone = [me, *others]
    summaries = {v["prefix"]: {w["prefix"]: "direct" for w in everyone if w is not v}
                 for v in everyone if v is not me}
    del summaries[S1A][S0]  # stage-1's first replica has not reported its path to stage-0 yet
    snap = snap_of(me, others, summaries=summaries)
    snap["members"][0].update(path_out="unknown", path_out_since_s=2.0)
    topo = topology(snap)
    why = {(e["from"][:8], e["to"][:8]): e["why_unknown"] for e in topo["edges"] if e["path"] == "unknown"}
    assert why == {(ORCH, S0): "not probed since its restart", (S1A, S0): "not reported"}
    found = problems(snap, topo)
    assert [(p["kind"], p["where"], p["detail"]) for p in found] == [
        ("unprobed", "orchestrator→stage-0", "orchestrator→stage-0: not probed since its restart "
                                             "(seen 2 s ago); our datagrams go direct meanwhile"),
        ("unreported", f"stage-1 ({S1A})→stage-0",
         f"stage-1 ({S1A}) has not reported its path to stage-0 yet")]
    console = Console(width=400)
    with console.capture() as captured:
        code = _print_doctor(console, snap)
    text = captured.get()
    assert code == 1
    assert "orchestrator→stage-0: not probed since its restart (seen 2 s ago)" in text, text


# ------------------------------------------------------------- through the CLI, on real nodes


async def _run(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = await trio.to_thread.run_sync(main, list(argv))
    return code, capsys.readouterr().out


async def _doctor_once_ok(capsys, url: str) -> str:
    """What ``meshd doctor URL`` prints once it exits 0 (every name and path summary arrived)."""
    with trio.fail_after(15):
        while True:
            code, out = await _run(capsys, "doctor", url)
            if code == 0:
                return out
            await trio.sleep(0.2)


async def _orchestrator_and_stage_0(nursery: trio.Nursery, lines: list[str]) -> tuple[Any, Any, dict]:
    """An orchestrator and stage-0 of a 2-stage run, converged; the options they share."""
    from meshd.node import NodeOptions
    from meshd.testing.inprocess import start_node, wait_converged

    opts = dict(profile="local", stages=2, dashboard="127.0.0.1:0")
    orch = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
    s0 = await start_node(nursery, NodeOptions(stage=0, seeds=[orch.addr], **opts), lines)
    await wait_converged([orch, s0])
    return orch, s0, opts


async def test_doctor_says_why_until_the_missing_stage_joins_then_peers_shows_its_replicas(capsys):
    from meshd.node import NodeOptions
    from meshd.testing.inprocess import start_node, wait_converged

    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            orch, s0, opts = await _orchestrator_and_stage_0(nursery, lines)
            code, out = await _run(capsys, "doctor", orch.dashboard_url)
            assert code == 1
            assert out.startswith("not ready\nWhy\n  stage-1: no live owner of pp-stage-1\n"), out
            code, out = await _run(capsys, "doctor", orch.dashboard_url, "--json")
            report = json.loads(out)
            assert code == 1 and report["ready"] is False
            assert report["readiness"]["why"] == ["stage-1: no live owner of pp-stage-1"]

            replicas = [await start_node(nursery, NodeOptions(stage=1, seeds=[s0.addr], **opts), lines)
                        for _ in range(2)]
            await wait_converged([orch, s0, *replicas])
            out = await _doctor_once_ok(capsys, orch.dashboard_url)
            assert out.startswith("ready: yes (stage-0, stage-1×2)\nWarnings\n  no node serves a model"), out
            assert "\nok: 4 live nodes" in out, out

            code, out = await _run(capsys, "peers", orch.dashboard_url)
            assert code == 0 and "pipeline: ready" in out

            rows = [line.split()[:3] for line in out.splitlines() if line.startswith("stage-1 ")]
            prefixes = sorted(r.identity.prefix for r in replicas)
            assert rows == [["stage-1", "(1/2)", prefixes[0]], ["stage-1", "(2/2)", prefixes[1]]], out

            # A stage reports one replica's process gone: a warning while the other serves;
            # both reported, the stage has nobody the orchestrator would route to.
            first, second = replicas
            orch.report_down(first.identity.node_id, first.data.epoch)
            code, out = await _run(capsys, "doctor", orch.dashboard_url)
            assert code == 0 and f"replica {first.identity.prefix} looks down to a node" in out, out
            orch.report_down(second.identity.node_id, second.data.epoch)
            code, out = await _run(capsys, "doctor", orch.dashboard_url)
            assert code == 1 and out.startswith("not ready\nWhy\n  stage-1: "), out
            assert f"{second.identity.prefix} looks down to a node" in out
            orch.report_down(second.identity.node_id, second.data.epoch + 1)  # another process
            code, out = await _run(capsys, "doctor", orch.dashboard_url)
            assert code == 0, out
            # Seen down by the orchestrator's own stream, which is up again: no longer down.
            orch.report_down(second.identity.node_id, second.data.epoch, seen_here=True)
            assert not orch.data.is_down(second.identity.node_id)
            code, out = await _run(capsys, "doctor", orch.dashboard_url)
            assert code == 0, out
            # A stage's report stands: the orchestrator's own stream says nothing of the stage's.
            orch.report_down(second.identity.node_id, second.data.epoch)
            orch.report_down(second.identity.node_id, second.data.epoch, seen_here=True)
            code, out = await _run(capsys, "doctor", orch.dashboard_url)
            assert code == 1 and f"{second.identity.prefix} looks down to a node" in out, out
            nursery.cancel_scope.cancel()


async def test_doctor_reads_a_chain_of_restarts_under_new_keys_at_new_addresses_as_one_node_replaced(capsys):
    """Stage-1 killed and started again twice, each time under a new key at a new port: the
    orchestrator's doctor names both identities left behind as replaced by the node serving
    now, by the start times the processes gossip, and none as a replica lost."""
    from meshd.node import NodeOptions
    from meshd.swim import State
    from meshd.testing.inprocess import start_killable, start_node, wait_converged

    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            orch, s0, opts = await _orchestrator_and_stage_0(nursery, lines)
            s1_opts = NodeOptions(stage=1, seeds=[orch.addr], **opts)
            gone = []
            for _ in range(2):
                s1, scope = await start_killable(nursery, s1_opts, lines)
                await wait_converged([orch, s0, s1])
                scope.cancel()
                gone.append(s1.identity)
                with trio.fail_after(30):
                    while orch.core.members[s1.identity.node_id].state is not State.DEAD:
                        await trio.sleep(0.1)
            s1 = await start_node(nursery, s1_opts, lines)  # port 0: a new address each time
            await wait_converged([orch, s0, s1])
            out = await _doctor_once_ok(capsys, orch.dashboard_url)
            warnings = [line.strip() for line in out.splitlines() if line.startswith("  stage-1:")]
            serving = s1.identity.prefix
            assert sorted(warnings) == sorted(
                f"stage-1: {g.prefix} is down (dead); {serving}, started since, serves in its place"
                for g in gone), out
            nursery.cancel_scope.cancel()


def test_doctor_names_the_mesh_key_when_the_relay_refused_us_as_not_a_member():
    """A node holding none of the mesh's keys is dropped by every node and refused by the
    relay: doctor points at the key, not at the network."""
    me = node(S0, 0)
    snap = snap_of(me, [])
    snap["join"] = {"joined": False, "seeds": ["127.0.0.1:7946"]}
    refused = {"url": "ws://127.0.0.1:3340", "connected": False, "last_error":
               "relay ws://127.0.0.1:3340 closed the connection during authentication (4008 not a member: "
               "no valid mesh-key proof)"}
    snap["relays"] = [refused]
    by_kind = {p["kind"]: p for p in problems(snap)}
    assert "refused us as not a member" in by_kind["relay"]["detail"]
    assert "--mesh-key-file" in by_kind["relay"]["check"] and "reachable" not in by_kind["relay"]["check"]
    assert by_kind["not-joined"]["check"].startswith("the relay admits mesh members only")
    # A relay that is simply down is still a network question; joining names the key as one.
    snap["relays"] = [{**refused, "last_error": "[Errno 111] Connection refused"}]
    by_kind = {p["kind"]: p for p in problems(snap)}
    assert by_kind["relay"]["check"] == "is the relay running and reachable over TCP (WebSocket)?"
    assert "mesh key (--mesh-key-file)" in by_kind["not-joined"]["check"]



def test_members_serving_two_checkpoints_are_not_called_a_mesh_without_a_model():
    """No run checkpoint can be told (the orchestrator and this node serve none, two stages
    serve different ones): a problem, but not "no node serves a model"."""
    me = node(ORCH, checkpoint="")
    others = [node(S0, 0, checkpoint=RUN), node(S1A, 1, checkpoint=OTHER), node(S2, 2, checkpoint="")]
    r = readiness(snap_of(me, others))
    assert NO_MODEL not in r["warnings"], r
