"""`meshd smoke-run` end to end: real processes on loopback, one JSON object at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshd.swim import LOCAL

pytestmark = pytest.mark.processes


@pytest.fixture(autouse=True)
def run_dir(tmp_path, monkeypatch):
    """Run state goes to the test's tmp dir, not the user's state dir."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state" / "meshd" / "runs"


def smoke(*args: str, timeout: float = 180) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, "-m", "meshd", "smoke-run", "--json", "--max-tokens", "12", *args],
                       capture_output=True, text=True, timeout=timeout)
    assert r.stdout.strip(), r.stderr
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1])


def meshd_children(run_dir) -> list[str]:
    """This test's `meshd run` / `meshd relay` processes still alive: every job of a run
    carries MESHD_HOSTFILE in the run dir, so other runs on the machine do not count."""
    alive = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"MESHD_HOSTFILE={run_dir}".encode() in environ and " -m meshd " in cmdline:
            alive.append(f"{proc.name} {cmdline}")
    return alive


@pytest.mark.parametrize("stages", [2, 3, 5])
def test_smoke_run_passes_and_matches_the_reference(stages, run_dir):
    rc, out = smoke("--stages", str(stages))
    assert rc == 0, out
    assert out["ok"] and out["status"] == "done" and out["matches_reference"]
    assert out["tokens"] == out["reference_tokens"] and len(out["tokens"]) == 12
    names = ["orchestrator", *(f"stage-{k}" for k in range(stages))]
    assert sorted(out["stage_map"].values()) == sorted(names)
    assert len(out["paths"]) == (stages + 1) * stages  # every ordered pair
    assert out["leftovers"] == 0 and out["asymmetric"] == []
    assert out["timings"]["tokens_per_s"] > 0
    assert meshd_children(run_dir) == []
    # dstack's semantics: master-done stops the workers, and every job reads exited (0).
    assert out["run_status"] == "done"
    assert set(out["jobs"].values()) == {"exited (0)"}


@pytest.mark.parametrize("fault, pair", [
    ("drop:stage-0->orchestrator", ("orchestrator", "stage-0")),
    ("drop:stage-2->stage-0", ("stage-0", "stage-2")),  # the feedback edge
])
def test_one_way_drop_passes_and_reports_the_asymmetric_pair(fault, pair):
    rc, out = smoke("--stages", "3", "--fault", fault)
    assert rc == 0, out
    assert out["matches_reference"] and out["leftovers"] == 0
    a, b = fault[5:].split("->")
    paths = {(p["from"], p["to"]): p for p in out["paths"]}
    # The dropped direction cannot be direct; its data went over the relay.
    assert paths[(a, b)]["data"] in ("relay", None) and paths[(a, b)]["path"] in ("relay", "direct")
    assert {(x["from"], x["to"]) for x in out["asymmetric"]} == {pair}, out["asymmetric"]
    assert f"{a}→{b}: relay" in out["asymmetric"][0]["detail"]


def test_ps_shows_the_run_from_another_process(run_dir):
    rc, out = smoke("--stages", "2", "--stub", "--startup-order", "workers-first",
                    "--stop-criteria", "all-done")
    assert rc == 0, out
    r = subprocess.run([sys.executable, "-m", "meshd", "ps", "--json"], capture_output=True, text=True,
                       timeout=30, env={**os.environ, "XDG_STATE_HOME": str(run_dir.parent.parent)})
    runs = json.loads(r.stdout)["runs"]
    assert [run["name"] for run in runs] == [out["run"]]
    jobs = {j["name"]: j for j in runs[0]["jobs"]}
    assert set(jobs) == {"relay", "orchestrator", "stage-0", "stage-1"}
    assert {j["status_message"] for j in jobs.values()} == {"exited (0)"}
    assert (run_dir / f"{out['run']}.hosts").read_text().count("\n") == 3  # orchestrator + 2 stages


def test_a_killed_stage_fails_the_run_naming_it(run_dir):
    t0 = time.monotonic()
    rc, out = smoke("--stages", "3", "--fault", "kill:stage-1@token-3")
    took = time.monotonic() - t0
    assert rc == 1
    assert out["status"].startswith("lost: stage-1 (peer ") and out["status"].endswith(" dead)")
    assert out["leftovers"] == 0 and meshd_children(run_dir) == []
    assert out["run_status"] == "failed" and out["jobs"]["stage-1"] == out["status"]
    assert took < 60 + LOCAL.suspicion_bounds(4)[1]


def test_sigterm_mid_generation_leaves_no_process_behind(run_dir):
    argv = [sys.executable, "-m", "meshd", "smoke-run", "--stages", "3", "--max-tokens", "200", "--json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(meshd_children(run_dir)) < 4:  # relay + orchestrator + stages up
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.2)
    time.sleep(3)  # into the generation
    os.kill(proc.pid, signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["status"] == "stopped" and out["leftovers"] == 0
    time.sleep(0.5)
    assert meshd_children(run_dir) == []


def test_bad_fault_is_one_line():
    r = subprocess.run([sys.executable, "-m", "meshd", "smoke-run", "--stages", "2", "--stub", "--json",
                        "--fault", "drop:stage-7->orchestrator"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "no node named 'stage-7'" in out["reason"] and out["leftovers"] == 0
    assert "Traceback" not in r.stderr
