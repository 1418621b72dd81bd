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
from meshd.testing.processes import smoke_signalled_at

pytestmark = pytest.mark.processes


@pytest.fixture(autouse=True)
def run_dir(tmp_path, monkeypatch):
    """Run state goes to the test's tmp dir, not the user's state dir."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state" / "meshd" / "runs"


# A fault at token T of a short completion may land after its last token is computed (the
# stream runs behind the pipeline): the fault tests ask for more tokens (the last --max-tokens wins).
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
    assert rc == 0, json.dumps(out)  # the whole report: tokens, failovers, paths, jobs
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
    assert rc == 0, json.dumps(out)  # the whole report: tokens, failovers, paths, jobs
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
    assert rc == 0, json.dumps(out)  # the whole report: tokens, failovers, paths, jobs
    r = subprocess.run([sys.executable, "-m", "meshd", "ps", "--json"], capture_output=True, text=True,
                       timeout=30, env={**os.environ, "XDG_STATE_HOME": str(run_dir.parent.parent)})
    runs = json.loads(r.stdout)["runs"]
    assert [run["name"] for run in runs] == [out["run"]]
    jobs = {j["name"]: j for j in runs[0]["jobs"]}
    assert set(jobs) == {"relay", "orchestrator", "stage-0", "stage-1"}
    assert {j["status_message"] for j in jobs.values()} == {"exited (0)"}
    assert (run_dir / f"{out['run']}.hosts").read_text().count("\n") == 3  # orchestrator + 2 stages


def test_with_two_relays_a_relayed_pair_moves_to_the_second_when_the_first_goes_down(run_dir):
    rc, out = smoke("--stages", "3", "--stub", "--relays", "2", "--fault", "drop:stage-1->stage-2",
                    "--fault", "relay-down@2")
    assert rc == 0, json.dumps(out)  # the whole report: tokens, paths, moves, jobs
    assert out["ok"] and out["matches_reference"] and out["tokens"] == out["reference_tokens"]
    relays = out["relays"]
    assert list(relays) == ["relay", "relay-2"] and relays["relay"] != relays["relay-2"]
    assert [(d["action"], d["job"], d["url"]) for d in out["disruptions"]] == [
        ("relay-down", "relay", relays["relay"])]
    # The pair the drop sends over a relay moved from the first relay to the second ...
    moves = [(m["node"], m["to_node"], m["from"], m["to"]) for m in out["relay_moves"]]
    assert ("stage-1", "stage-2", relays["relay"], relays["relay-2"]) in moves, out["relay_moves"]
    # ... and is carried by it at the end, after a generation with the first relay down.
    [pair] = [p for p in out["paths"] if (p["from"], p["to"]) == ("stage-1", "stage-2")]
    assert pair["path"] == "relay" and pair["relay"] == relays["relay-2"]
    if "again" in out:  # the generation ended before the relay went down: it ran once more
        assert out["again"]["after"] == "relay-down@2" and out["again"]["matches_reference"]
    assert out["run_status"] == "done" and out["jobs"]["relay"] == "stopped"
    assert out["jobs"]["relay-2"] == "exited (0)" and out["leftovers"] == 0
    assert meshd_children(run_dir) == []
    r = subprocess.run([sys.executable, "-m", "meshd", "ps", "--json"], capture_output=True, text=True,
                       timeout=30, env={**os.environ, "XDG_STATE_HOME": str(run_dir.parent.parent)})
    jobs = {j["name"]: j for j in json.loads(r.stdout)["runs"][0]["jobs"]}
    assert jobs["relay-2"]["role"] == "relay" and jobs["relay-2"]["address"] == relays["relay-2"][5:]


def test_a_killed_stage_without_replicas_fails_the_run_naming_it(run_dir):
    t0 = time.monotonic()
    rc, out = smoke("--stages", "3", "--replicas", "1", "--fault", "kill:stage-1@token-5",
                    "--max-tokens", "48")
    took = time.monotonic() - t0
    assert rc == 1
    assert [(d["action"], d["job"], d["token"]) for d in out["disruptions"]] == [("kill", "stage-1", 5)]
    # "lost: stage-1 (peer 2b91108e dead)", or "... down: ..." when its port refused a dial first
    assert out["status"].startswith(f"lost: stage-1 (peer {out['disruptions'][0]['peer']} "), out
    assert out["leftovers"] == 0 and meshd_children(run_dir) == []
    assert out["run_status"] == "failed" and out["jobs"]["stage-1"] == out["status"]
    assert took < 60 + LOCAL.suspicion_bounds(4)[1]


def test_replicas_run_every_stage_on_k_nodes_and_match_the_reference(run_dir):
    rc, out = smoke("--stages", "2", "--replicas", "2")
    assert rc == 0, json.dumps(out)  # the whole report: tokens, failovers, paths, jobs
    assert out["ok"] and out["matches_reference"] and out["replicas"] == 2
    names = ["orchestrator", "stage-0", "stage-1", "stage-0.2", "stage-1.2"]
    assert sorted(out["stage_map"].values()) == sorted(names)
    assert len(out["paths"]) == 5 * 4 and out["failovers"] == []
    assert out["run_status"] == "done" and set(out["jobs"]) == {"relay", *names}
    assert set(out["jobs"].values()) == {"exited (0)"}
    assert meshd_children(run_dir) == []


def test_a_killed_serving_replica_fails_over_and_the_run_passes(run_dir):
    rc, out = smoke("--stages", "3", "--replicas", "2", "--fault", "kill:stage-1@token-5",
                    "--max-tokens", "48")
    assert rc == 0, json.dumps(out)  # the whole report: tokens, failovers, paths, jobs
    assert out["matches_reference"] and out["leftovers"] == 0 and meshd_children(run_dir) == []
    [killed] = out["disruptions"]
    assert killed["action"] == "kill" and killed["job"] in ("stage-1", "stage-1.2")
    survivor = "stage-1.2" if killed["job"] == "stage-1" else "stage-1"
    [failover] = out["failovers"]
    assert (failover["stage"], failover["from"], failover["from_job"], failover["to_job"]) == (
        "stage-1", killed["peer"], killed["job"], survivor)
    assert out["run_status"] == "done" and out["jobs"][killed["job"]] == "exited (-9)"


def test_streams_at_once_through_a_killed_replica_each_match_their_own_reference(run_dir):
    """Six requests at once, batched at each stage; the replica of stage-1 serving the first is
    killed: the fault finds it among the six by the request id its stream names from the first
    token, every stream finishes (moved to the other replica where it went through the killed
    one), and each matches meshd generate for its own prompt."""
    rc, out = smoke("--stages", "3", "--replicas", "2", "--streams", "6", "--fault", "kill:stage-1@token-5",
                    "--max-tokens", "48")
    assert rc == 0, json.dumps(out)  # the whole report: tokens, failovers, paths, jobs
    others = out["other_streams"]
    assert len(others) == 5 and len({o["prompt"] for o in others} | {"Once upon a time"}) == 6
    assert all(o["matches_reference"] and len(o["tokens"]) == 48 for o in others), others
    assert sorted(o["sampling"]["temperature"] for o in others) == [0.0, 0.0, 0.0, 0.8, 0.8]  # some sampled
    [killed] = out["disruptions"]
    [failover] = out["failovers"]  # the first stream's, through the replica that was killed
    assert failover["from_job"] == killed["job"] and out["matches_reference"]
    assert all(f["from_job"] == killed["job"] for o in others for f in o["failovers"])
    assert out["leftovers"] == 0 and meshd_children(run_dir) == []


def test_a_restarted_serving_replica_comes_back_with_its_key_and_the_run_passes(run_dir):
    rc, out = smoke("--stages", "2", "--replicas", "2", "--fault", "restart:stage-1@token-4",
                    "--max-tokens", "48")
    assert rc == 0, json.dumps(out)  # the whole report: tokens, failovers, paths, jobs
    assert out["matches_reference"] and out["leftovers"] == 0 and meshd_children(run_dir) == []
    [restarted] = out["disruptions"]
    assert restarted["action"] == "restart" and out["stage_map"][restarted["peer"]] == restarted["job"]
    assert [f["from_job"] for f in out["failovers"]] == [restarted["job"]]
    # Back in the mesh (smoke-run waited for it), it ends like every other job.
    assert out["run_status"] == "done" and set(out["jobs"].values()) == {"exited (0)"}


@pytest.mark.parametrize("stage", ["stage-0", "stage-2"])
def test_a_stage_without_replicas_restarted_mid_generation_takes_its_request_back(run_dir, stage):
    """The entry and the last stage restarted under their key while a request runs through
    them: the request waits for the new process and replays on it, with the same tokens.
    The last stage gathers a stub's tokens for the orchestrator for up to 20 ms (TOKEN_BATCH_S),
    a few dozen tokens: the stream is read that far behind, and 96 tokens keep the request
    running when the stage goes."""
    rc, out = smoke("--stages", "3", "--stub", "--fault", f"restart:{stage}@token-4", "--max-tokens", "96")
    assert rc == 0, json.dumps(out)
    assert out["matches_reference"] and out["leftovers"] == 0 and meshd_children(run_dir) == []
    [failover] = out["failovers"]
    assert failover["from_job"] == failover["to_job"] == stage


def _ps(run_dir) -> dict:
    r = subprocess.run([sys.executable, "-m", "meshd", "ps", "--json"], capture_output=True, text=True,
                       timeout=30, env={**os.environ, "XDG_STATE_HOME": str(run_dir.parent.parent)})
    [run] = json.loads(r.stdout)["runs"]
    return run


def test_the_orchestrator_restarted_mid_generation_serves_the_request_sent_again(run_dir):
    """The orchestrator holds its clients' requests: restarted, it has none of them.  The run
    waits for it to come back with its key, sends the request again, and checks it as ever.
    The stream is read up to a 20 ms token batch (a few dozen stub tokens) behind the last
    stage: 128 tokens keep its end well past the restart, so the request is still in flight
    when the process goes."""
    rc, out = smoke("--stages", "2", "--stub", "--fault", "restart:orchestrator@token-3",
                    "--max-tokens", "128")
    assert rc == 0, json.dumps(out)
    assert out["matches_reference"] and out["leftovers"] == 0 and meshd_children(run_dir) == []
    [restarted] = out["disruptions"]
    assert (restarted["action"], restarted["job"], restarted["reissued"]) == ("restart", "orchestrator", True)
    run = _ps(run_dir)
    assert run["status"] == "done", run
    assert {j["status_message"] for j in run["jobs"]} == {"exited (0)"}, run


# Killed at its last token, the orchestrator may have sent the whole stream first: the run
# fails all the same, as the same exit, since nothing serves the run after it.
@pytest.mark.parametrize("token, max_tokens", [(3, 24), (6, 6)])
def test_a_failed_run_reads_failed_in_ps_not_stopped_by_its_user(run_dir, token, max_tokens):
    rc, out = smoke("--stages", "2", "--stub", "--fault", f"kill:orchestrator@token-{token}",
                    "--max-tokens", str(max_tokens))
    assert rc == 1 and out["status"] == "exited (-9)", json.dumps(out)
    assert out["reason"].startswith(f"the orchestrator was killed after token {token} "
                                    f"(--fault kill:orchestrator@token-{token}): ")
    assert "and no orchestrator serves the run" in out["reason"]
    assert out["run_status"] == "failed"
    run = _ps(run_dir)
    assert run["status"] == "failed", run
    assert "terminated_by_user" not in json.dumps(run), run
    jobs = {j["name"]: j["status_message"] for j in run["jobs"]}
    assert jobs["orchestrator"] == "exited (-9)" and jobs["stage-0"] == "stopped", jobs


def test_sigterm_mid_generation_leaves_no_process_behind(run_dir):
    rc, stdout, _ = smoke_signalled_at("generating", timeout=30)
    assert rc == 130
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["status"] == "stopped" and out["leftovers"] == 0
    time.sleep(0.5)
    assert meshd_children(run_dir) == []
    run = _ps(run_dir)  # stopped by its user: terminated, each job as interrupted
    assert (run["status"], run["message"]) == ("terminated", "interrupted"), run
    assert {j["status_message"] for j in run["jobs"]} == {"interrupted"}, run


def test_sigterm_while_tearing_down_lets_the_teardown_finish_and_the_report_out(run_dir):
    rc, stdout, stderr = smoke_signalled_at("tearing down", timeout=30)
    assert "Traceback" not in stderr
    assert "SIGTERM while tearing down: finishing the teardown" in stderr
    out = json.loads(stdout.strip().splitlines()[-1])  # the run's own outcome, reported whole
    assert out["status"] == "done" and out["matches_reference"] and out["leftovers"] == 0
    assert rc == 0
    time.sleep(0.5)
    assert meshd_children(run_dir) == []


def test_bad_fault_is_one_line():
    """A usage error, as a bad option is, --json or not: nothing starts, so no run to report."""
    r = subprocess.run([sys.executable, "-m", "meshd", "smoke-run", "--stages", "2", "--stub", "--json",
                        "--fault", "drop:stage-7->orchestrator"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    said = r.stderr.strip().splitlines()[-1]
    assert said == ("meshd: error: smoke-run: --fault drop:stage-7->orchestrator: no node named 'stage-7' "
                    "(have orchestrator, relay, stage-0, stage-1)")
    assert "Traceback" not in r.stderr


def test_a_restarted_process_runs_again_on_its_port_and_its_output_goes_on_in_the_same_lines():
    from meshd.launch.local import LocalProcess, free_ports

    port = free_ports(1)[0]
    relay = LocalProcess("relay", ["relay", "--bind", f"127.0.0.1:{port}"])
    try:
        url = relay.wait_for(lambda s: s.startswith("meshd relay url="), 30, "relay url")
        old = relay.proc
        relay.restart()
        assert old.returncode == -signal.SIGKILL, "the old process is reaped before the new one starts"
        assert relay.proc.pid != old.pid and relay.alive()
        assert relay.first_line > 0 and relay.lines[:relay.first_line].count(url) == 1
        again = relay.wait_for(lambda s: s.startswith("meshd relay url="), 30, "relay url")
        assert again == url and relay.lines.count(url) == 2
    finally:
        relay.stop()


def test_piped_the_phases_go_to_stderr_as_plain_lines_and_stdout_holds_only_the_json(run_dir):
    r = subprocess.run([sys.executable, "-m", "meshd", "smoke-run", "--stub", "--stages", "2", "--json",
                        "--max-tokens", "8"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 1 and json.loads(r.stdout)["ok"]
    lines = r.stderr.splitlines()
    assert lines and all(line.startswith("smoke-run: ") for line in lines), r.stderr
    assert "\x1b" not in r.stderr  # no terminal codes where no terminal is
    said = "\n".join(lines)
    for phase in ("starting orchestrator", "converging", "converged in", "generating",
                  "generated 8 tokens", "checking against meshd generate", "tearing down"):
        assert f"smoke-run: {phase}" in said, r.stderr


@pytest.mark.skipif(not os.path.exists("/usr/bin/script"), reason="util-linux `script` (a terminal) missing")
def test_on_a_terminal_the_phases_are_live_and_the_report_is_a_table(run_dir, tmp_path):
    """Under `script`, stdout and stderr are a terminal: one live status line that moves
    through the phases (with the nodes seen converged, and tokens/s), then the report as a
    table."""
    typescript = tmp_path / "typescript"
    command = f"{sys.executable} -m meshd smoke-run --stub --stages 2 --max-tokens 8"
    r = subprocess.run(["script", "-qec", command, str(typescript)], capture_output=True, text=True,
                       timeout=180, env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})
    assert r.returncode == 0, r.stdout
    shown = typescript.read_text(errors="replace")
    assert "\x1b[" in shown  # drawn for a terminal
    # the live line redraws about 12 times a second: the phases that last are seen in it; what
    # each phase ended with is logged above it and stays
    for live in ("starting ", "converging: ", "nodes see every other alive", "converged in ",
                 "generated 8 tokens in ", "tokens/s"):
        assert live in shown, shown
    assert "smoke-run: " in shown and "done" in shown
    table = shown[shown.rindex("smoke-run: "):]
    for row in ("stage map", "generated 8 tokens; matches meshd generate: yes", "leftovers", "│"):
        assert row in table, table


def test_a_ctrl_c_python_swallowed_as_smoke_run_started_stops_it_before_any_job(run_dir):
    """As `meshd smoke-run` loads, a Ctrl-C that lands in a weakref callback is dropped by
    Python; smoke-run reads it once its own handler holds SIGINT and stops, nothing started."""
    script = ("import sys; from meshd import ctrl_c, __main__ as entry; ctrl_c._raised = 1; "
              "sys.argv = ['meshd', 'smoke-run', '--json', '--stages', '1']; entry.entry()")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 130 and out["status"] == "stopped" and out["leftovers"] == 0, r
    assert "starting" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert meshd_children(run_dir) == []
