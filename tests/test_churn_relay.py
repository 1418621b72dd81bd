"""A relay restarted under a mesh whose one direction only the relay carried: the
direction has no path while the relay is down, and a stage that cannot deliver into it
reports its peer gone.  Readiness (so ``meshd doctor``'s Why) names that direction, not a
process that may have died, since the peer is alive to the mesh.
"""

from __future__ import annotations

from meshd.readiness import readiness

ORCH, S0, S1, S2 = "0cc0cc00", "50505050", "51515151", "52525252"


def _node(prefix: str, stage: int | None, **extra) -> dict:
    role = "orchestrator" if stage is None else "stage"
    return {"id": prefix * 8, "prefix": prefix, "name": role if stage is None else f"stage-{stage}",
            "role": role, "stage": stage, "state": "alive", "stages": 3, "checkpoint": "cd34" * 8,
            "draining": False, "epoch": 7, "addr": f"127.0.0.1:{int(prefix[:4], 16)}", "path_out": "direct",
            **extra}


def _snap(s1: dict, summaries: dict[str, dict[str, str]]) -> dict:
    me, others = _node(ORCH, None), [_node(S0, 0), s1, _node(S2, 2)]
    names: dict[str, dict] = {}
    for v, claimed in ((me, ["pp-orchestrator"]), (others[0], ["pp-stage-0", "pp-entry"]),
                       (others[1], ["pp-stage-1"]), (others[2], ["pp-stage-2", "pp-exit"])):
        for name in claimed:
            names[name] = {"entries": [{"owner": v["prefix"], "clock": 1, "tombstone": False, "live": True}],
                           "live": [v["prefix"]], "resolves": True, "tombstone": False, "owner": v["prefix"]}
    paths = {frm * 8: {"entries": [{"to": to * 8, "path": way, "reason": "direct ping unanswered; only "
                                    "others vouched", "direct_failures": 2} for to, way in row.items()]}
             for frm, row in summaries.items()}
    return {"self": me, "members": others, "names": names, "path_summaries": paths, "relay": None}


def test_a_stage_reported_down_that_its_sender_has_no_path_to_is_named_by_that_direction():
    r = readiness(_snap(_node(S1, 1, reported_down=True), {S0: {S1: "none", S2: "direct"}}))
    assert r["ready"] is False
    [why] = r["why"]
    assert why.startswith(f"stage-1: {S1} is alive to the mesh, but a node that hands it work has no path")
    assert f"stage-0 ({S0})→stage-1 ({S1}): no path (direct ping unanswered" in why
    assert "is its process running?" not in why


def test_a_stage_reported_down_with_every_path_to_it_working_may_be_a_process_gone():
    r = readiness(_snap(_node(S1, 1, reported_down=True), {S0: {S1: "direct"}, S2: {S1: "none"}}))
    [why] = r["why"]  # stage-2 hands stage-1 no work: its path says nothing here
    assert why.startswith(f"stage-1: {S1} looks down to a node that sends to it")
    assert "is its process running?" in why
