"""Who may serve a stage while nodes come and go: a node left out of the ``--allow-nodes``
list every node reads (its own included) serves nothing, and its own view says so too,
so its ``meshd doctor`` never calls the pipeline ready on its account.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest

from meshd.identity import Identity
from meshd.launch.process import MeshProcess
from meshd.swim import LAN, Swim
from meshd.swim.facts import SignedFacts
from meshd.wire import Meta


def test_a_node_outside_its_own_allow_list_does_not_count_itself_an_owner_of_its_stage():
    listed, outsider = Identity.generate(), Identity.generate()
    swim = Swim(outsider.node_id, "10.0.0.2:7946", Meta(role="stage", stage=1, stages=2), LAN,
                random.Random(0), 0.0, facts=SignedFacts(outsider),
                allow_nodes=frozenset({listed.node_id}))
    swim.register_name("pp-stage-1", 1.0)
    swim.register_name("pp-exit", 1.0)
    swim.register_name("notes", 1.0)  # not a stage name: anyone may hold it
    assert swim.live_owners("pp-stage-1") == [] and swim.live_owners("pp-exit") == []
    assert swim.live_owners("notes") == [outsider.node_id]


def _dashboard(p: MeshProcess) -> str:
    line = p.wait_for(lambda s: s.startswith("meshd dashboard url="), 15, "dashboard url")
    return line.split()[2].split("=", 1)[1]


def _doctor(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshd", "doctor", url], capture_output=True, text=True,
                          timeout=30)


@pytest.mark.processes
def test_a_node_left_out_of_the_shared_allow_list_says_so_and_its_doctor_is_not_ready_without_the_listed_one(
        tmp_path):
    keys = {name: Identity.generate() for name in ("orchestrator", "stage-0", "stage-1", "outsider")}
    for name, key in keys.items():
        (tmp_path / f"{name}.key").write_bytes(key.to_pem())
    allow = tmp_path / "allow.txt"
    allow.write_text("".join(f"{keys[n].node_id.hex()}\n" for n in ("orchestrator", "stage-0", "stage-1")))
    procs: list[MeshProcess] = []

    def node(name: str, role: list[str], seed: str | None) -> MeshProcess:
        p = MeshProcess(name, ["run", *role, "--stages", "2", "--stub", "--profile", "local",
                               "--bind", "127.0.0.1:0", "--key-file", str(tmp_path / f"{name}.key"),
                               "--allow-nodes", str(allow), *([f"--seed={seed}"] if seed else [])])
        procs.append(p)
        p.wait_boot()
        return p

    try:
        orch = node("orchestrator", ["--role", "orchestrator"], None)
        seed = orch.wait_boot().addr
        node("stage-0", ["--role", "stage", "--stage", "0"], seed)
        listed = node("stage-1", ["--role", "stage", "--stage", "1"], seed)
        outsider = node("outsider", ["--role", "stage", "--stage", "1"], seed)
        said = outsider.wait_for(lambda s: "is not in its --allow-nodes list" in s, 15, "the warning")
        assert keys["outsider"].node_id.hex() in said and "pp-stage-1" in said, said
        url = _dashboard(outsider)
        listed.signal(signal.SIGKILL)
        listed.proc.wait(5)
        deadline = time.monotonic() + 30  # suspect first (it may refute), then dead
        while not (out := _doctor(url)).stdout.startswith("not ready"):
            assert time.monotonic() < deadline, out.stdout
            time.sleep(0.5)
        assert out.returncode == 1 and "stage-1" in out.stdout.split("Why", 1)[1], out.stdout
    finally:
        for p in procs:
            p.stop(timeout=3)


def test_an_orchestrator_started_with_another_checkpoint_than_the_stages_is_not_ready_by_its_own_view():
    """A second orchestrator of the mesh, given another checkpoint: every request it takes gets
    a 503 (no stage serves its checkpoint), so its own readiness must say not ready, whatever
    the first orchestrator serves."""
    from meshd.readiness import readiness

    run, other = "cd34" * 8, "ab12" * 8

    def view(prefix: str, stage: int | None, checkpoint: str) -> dict:
        role = "orchestrator" if stage is None else "stage"
        return {"id": prefix * 8, "prefix": prefix, "name": role if stage is None else f"stage-{stage}",
                "role": role, "stage": stage, "state": "alive", "stages": 1, "checkpoint": checkpoint,
                "draining": False, "epoch": 7, "addr": f"127.0.0.1:{int(prefix[:4], 16)}",
                "path_out": "direct"}

    me, first, stage = view("0cc0cc02", None, other), view("0cc0cc01", None, run), view("50505050", 0, run)
    names = {}
    for name, owners in {"pp-orchestrator": [first, me], "pp-stage-0": [stage], "pp-entry": [stage],
                         "pp-exit": [stage]}.items():
        live = sorted(v["prefix"] for v in owners)
        names[name] = {"entries": [{"owner": p, "clock": 1, "tombstone": False, "live": True} for p in live],
                       "live": live, "resolves": True, "tombstone": False, "owner": live[0]}
    r = readiness({"self": me, "members": [first, stage], "names": names, "path_summaries": {},
                   "relay": None})
    assert r["ready"] is False and r["checkpoint"] == other
    assert any(w.startswith("stage-0: 50505050 serves checkpoint") for w in r["why"]), r["why"]
