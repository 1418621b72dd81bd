"""The pieces of `meshd smoke-run` that need no process: the fault plan, the failure read from
the orchestrator, the `--json` object's shape and the summary."""

from __future__ import annotations

import io
import json
import signal
import sys
import time
from pathlib import Path

import pytest

from meshd.launch.checks import paths, relay_moves, sees_all
from meshd.launch.drive import orchestrator_failure
from meshd.launch.failure import Failure, Kind
from meshd.launch.jobs import JobDriver
from meshd.launch.model import Lost, Running, Started, job_status_message, new_run, step
from meshd.launch.plan import Disruption, FaultPlan, RelayDown, RunPlan, job_argvs, node_names, plan_faults
from meshd.launch.report import Generated, Outcome, Progress, summary
from meshd.launch.state import read_run

ADDRS = {"relay": "127.0.0.1:9000", "orchestrator": "127.0.0.1:9001",
         "stage-0": "127.0.0.1:9002", "stage-1": "127.0.0.1:9003"}
TWO_RELAYS = {**ADDRS, "relay-2": "127.0.0.1:9004"}


def test_a_one_way_drop_becomes_the_senders_own_rule_naming_the_receivers_address():
    plan = plan_faults(["drop:stage-1->stage-0", "kill:stage-0@token-3", "relay-down@2.5"], ADDRS)
    assert plan.node_faults == {"stage-1": ["drop:127.0.0.1:9002"]}
    assert plan.kills == [Disruption("kill:stage-0@token-3", "stage-0", 3)]
    assert plan.relay_downs == [RelayDown("relay-down@2.5", "relay", 2.5)]


def test_relay_down_stops_the_first_relay_and_may_name_another_which_faults_may_name_too():
    plan = plan_faults(["relay-down@2", "relay-down:relay-2@3.5", "drop:stage-1->relay-2",
                        "kill:relay-2@token-4"], TWO_RELAYS)
    assert plan.relay_downs == [RelayDown("relay-down@2", "relay", 2.0),
                                RelayDown("relay-down:relay-2@3.5", "relay-2", 3.5)]
    assert plan.node_faults == {"stage-1": ["drop:127.0.0.1:9004"]}
    assert plan.kills == [Disruption("kill:relay-2@token-4", "relay-2", 4)]


@pytest.mark.parametrize("spec, words", [
    ("drop:stage-1->stage-7", "no node named 'stage-7'"),
    ("nat:stage-0", "nat needs --provider netns"),
    ("bogus", "expected drop:A->B"),
    ("relay-down:relay-2@2", "no node named 'relay-2'"),
    ("relay-down:stage-0@2", "stage-0 is not a relay"),
])
def test_a_bad_fault_spec_is_refused_with_a_message_naming_it(spec, words):
    with pytest.raises(ValueError, match=words):
        plan_faults([spec], ADDRS)


@pytest.mark.parametrize("specs, words", [
    (["restart:orchestrator@token-4", "kill:stage-1@token-12"],
     "kill:stage-1@token-12: after --fault restart:orchestrator@token-4 the requests start again"),
    (["kill:stage-0@token-9", "restart:orchestrator@token-8"], "give it a token up to 8"),
    (["restart:orchestrator@token-4", "kill:orchestrator@token-4"],
     "one kill: or restart: of the orchestrator"),
])
def test_a_fault_a_restarted_orchestrator_would_never_reach_is_refused(specs, words):
    with pytest.raises(ValueError, match=words):
        plan_faults(specs, ADDRS)


def test_faults_up_to_the_orchestrators_restart_are_taken():
    plan = plan_faults(["kill:stage-1@token-3", "restart:orchestrator@token-4", "restart:stage-0@token-4"],
                       ADDRS)
    assert [d.spec for d in plan.kills] == ["kill:stage-1@token-3", "restart:orchestrator@token-4",
                                            "restart:stage-0@token-4"]


def test_every_node_is_seeded_through_all_the_others_and_carries_only_its_faults():
    names = node_names(2)
    addrs = {n: ADDRS[n] for n in names}
    plan = RunPlan(2, "/m", ADDRS["relay"], addrs, dict.fromkeys(names, "127.0.0.1:0"),
                   FaultPlan(node_faults={"stage-0": ["isolate"]}), "/tmp/snaps", "/tmp/keys")
    argvs = job_argvs(plan)
    assert argvs["relay"] == ["relay", "--bind", ADDRS["relay"]]
    assert {a for a in argvs["stage-1"] if a.startswith("--seed=")} == {"--seed=127.0.0.1:9001",
                                                                         "--seed=127.0.0.1:9002"}
    assert "--fault=isolate" in argvs["stage-0"]
    assert not any(a.startswith("--fault") for a in argvs["stage-1"])
    assert argvs["stage-1"][:4] == ["run", "--role", "stage", "--stage"] and argvs["stage-1"][4] == "1"


def test_the_stages_split_the_hosts_cores_and_the_orchestrator_keeps_the_default(monkeypatch):
    from meshd.pipeline import threads

    names = node_names(3)
    plan = RunPlan(3, "/m", ADDRS["relay"], dict.fromkeys(names, "127.0.0.1:9"), dict.fromkeys(names, "x"),
                   FaultPlan(), "/tmp/snaps", "/tmp/keys")

    def given(argvs, name):
        argv = argvs[name]
        return argv[argv.index("--compute-threads") + 1] if "--compute-threads" in argv else None

    for cores, each in ((2, "1"), (8, "2"), (16, "5")):
        monkeypatch.setattr(threads, "host_cores", lambda cores=cores: cores)
        argvs = job_argvs(plan)
        assert [given(argvs, f"stage-{k}") for k in range(3)] == [each] * 3
        assert given(argvs, "orchestrator") is None


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="no CPU pinning here")
@pytest.mark.parametrize(("cpus", "want"), [
    ([0, 1], ["0", "0", "1", "0", "0", "1"]),  # stage 0's replica with stage 0, on its CPU
    ([4, 5, 6, 7], ["4", "5", "6-7", "4", "5", "6-7"]),
    ([0], [None] * 6),  # one CPU: nothing to choose
])
def test_each_stage_and_its_replicas_run_on_cpus_of_their_own(monkeypatch, cpus, want):
    from meshd.pipeline import threads

    names = node_names(3, replicas=2)
    plan = RunPlan(3, "/m", ADDRS["relay"], dict.fromkeys(names, "127.0.0.1:9"), dict.fromkeys(names, "x"),
                   FaultPlan(), "/tmp/snaps", "/tmp/keys")
    monkeypatch.setattr(threads, "host_cpus", lambda: cpus)
    argvs = job_argvs(plan)

    def given(name):
        argv = argvs[name]
        return argv[argv.index("--cpus") + 1] if "--cpus" in argv else None

    assert [given(n) for n in names if n != "orchestrator"] == want
    assert given("orchestrator") is None


def test_with_two_relays_every_node_holds_both_the_first_first_and_each_relay_has_the_mesh_key():
    names = node_names(2)
    addrs = {n: ADDRS[n] for n in names}
    plan = RunPlan(2, "/m", ADDRS["relay"], addrs, dict.fromkeys(names, "127.0.0.1:0"), FaultPlan(),
                   "/tmp/snaps", "/tmp/keys", mesh_key="/tmp/run/mesh.key",
                   extra_relays={"relay-2": "127.0.0.1:9004"})
    assert plan.relay_urls == {"relay": "ws://127.0.0.1:9000", "relay-2": "ws://127.0.0.1:9004"}
    argvs = job_argvs(plan)
    assert list(argvs) == ["relay", "relay-2", *names]
    assert argvs["relay-2"] == ["relay", "--bind", "127.0.0.1:9004", "--mesh-key-file", "/tmp/run/mesh.key"]
    assert argvs["relay"] == ["relay", "--bind", "127.0.0.1:9000", "--mesh-key-file", "/tmp/run/mesh.key"]
    for name in names:
        given = [argvs[name][i + 1] for i, a in enumerate(argvs[name]) if a == "--relay"]
        assert given == ["ws://127.0.0.1:9000", "ws://127.0.0.1:9004"], name


class _FakePopen:
    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = self.returncode if self.returncode is not None else -signal.SIGKILL


class _FakeProcess:
    """What JobDriver needs of a job's process, with no process: it is up at once, a relay having
    printed its URL and a node its boot line; a signal ends it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None) -> None:
        self.name, self.boot, self.first_line = name, None, 0
        self.proc = _FakePopen(4000 + len(name))
        port = argv[argv.index("--bind") + 1]
        self.lines = [f"meshd relay url=ws://{port} stun={port}/udp"] if argv[0] == "relay" else []
        if argv[0] == "run":
            from meshd.launch.process import Boot

            self.boot = Boot("ab" * 32, f"{len(name):08x}", "stage", "0", port, "-")

    def alive(self) -> bool:
        return self.proc.returncode is None

    def signal(self, signum: int) -> None:
        if self.alive():  # meshd exits 0 on SIGTERM
            self.proc.returncode = 0 if signum == signal.SIGTERM else -signum

    def wait_boot(self, timeout: float):
        return self.boot


def _two_relay_run(tmp_path: Path):
    """A one-stage run with relays ``relay`` and ``relay-2``, every job started (fake processes)."""
    names = node_names(1)
    plan = RunPlan(1, "/m", ADDRS["relay"], {n: ADDRS[n] for n in names}, dict.fromkeys(names, "127.0.0.1:0"),
                   FaultPlan(), "/tmp/snaps", "/tmp/keys", extra_relays={"relay-2": "127.0.0.1:9004"})
    run = new_run("smoke-1", 1, now=time.time(), relay=2)
    driver = JobDriver(run, tmp_path, job_argvs(plan), {}, Progress(False), _FakeProcess)
    driver.observe()
    driver.wait_started(["relay", "relay-2", *names], 5)
    return run, driver


def test_a_relay_downed_by_the_fault_reads_stopped_and_the_run_goes_on(tmp_path: Path):
    run, driver = _two_relay_run(tmp_path)
    assert [j.address for j in run.aux_jobs] == ["127.0.0.1:9000", "127.0.0.1:9004"]
    fired = []
    driver.down_later("relay", 0.0, lambda: fired.append(True)).join()
    assert fired and driver.procs["relay"].proc.returncode == -signal.SIGKILL
    driver.poll()
    assert run.reason is None, "a relay stopped by the fault ended the run"
    assert job_status_message(run.job("relay")) == "stopped"
    driver.finish(timeout=1)
    saved = read_run(tmp_path / "smoke-1.json")  # what `meshd ps` shows
    assert saved.status.value == "done"
    assert {j.name: j.status_message for j in saved.jobs} == {
        "relay": "stopped", "relay-2": "exited (0)", "orchestrator": "exited (0)", "stage-0": "exited (0)"}


def test_a_relay_that_dies_on_its_own_fails_the_run_naming_it(tmp_path: Path):
    run, driver = _two_relay_run(tmp_path)
    driver.procs["relay-2"].signal(signal.SIGKILL)
    driver.poll()
    assert run.message == "relay-2: exited (-9)"


def test_the_relay_moves_are_read_from_each_nodes_lines_naming_jobs_and_relays():
    line = ("meshd relay-move stage-1->stage-2 prefix=2b91108e from=ws://127.0.0.1:9000 "
            "to=ws://127.0.0.1:9004 (ws://127.0.0.1:9000: relay ws://127.0.0.1:9000 closed the connection "
            "(1006 ABNORMAL_CLOSURE))")
    moves = relay_moves({"stage-1": ["meshd stage-map 2b91108e=stage-2", line], "stage-0": []},
                        {"2b91108e": "stage-2.2"},
                        {"relay": "ws://127.0.0.1:9000", "relay-2": "ws://127.0.0.1:9004"})
    assert moves == [{"node": "stage-1", "to_node": "stage-2.2", "peer": "2b91108e",
                      "from": "ws://127.0.0.1:9000", "to": "ws://127.0.0.1:9004",
                      "why": "ws://127.0.0.1:9000: relay ws://127.0.0.1:9000 closed the connection "
                             "(1006 ABNORMAL_CLOSURE)",
                      "from_relay": "relay", "to_relay": "relay-2"}]


def test_a_relayed_direction_names_its_relay_and_a_direct_one_none():
    def member(prefix: str, path: str, via: str | None) -> dict:
        return {"prefix": prefix, "path_out": path, "data_out": path, "relay_via": via}

    snaps = {"stage-0": {"members": [member("bbbbbbbb", "relay", "ws://b")]},
             "stage-1": {"members": [member("aaaaaaaa", "direct", "ws://a")]}}
    every, _ = paths(snaps, {"aaaaaaaa": "stage-0", "bbbbbbbb": "stage-1"})
    assert [(p["from"], p["to"], p["path"], p["relay"]) for p in every] == [
        ("stage-0", "stage-1", "relay", "ws://b"), ("stage-1", "stage-0", "direct", None)]


def test_a_direction_to_a_restarted_peer_not_probed_yet_is_neither_asymmetric_nor_converged():
    """Until a probe of a peer's new process gives a verdict, our direction to it reads
    unknown: not a pair to report as asymmetric, and not a measured path to converge on."""
    def member(prefix: str, path: str) -> dict:
        return {"prefix": prefix, "state": "alive", "path_checks": 3, "path_out": path, "data_out": path}

    snaps = {"stage-0": {"members": [member("bbbbbbbb", "unknown")]},
             "stage-1": {"members": [member("aaaaaaaa", "direct")]}}
    every, asymmetric = paths(snaps, {"aaaaaaaa": "stage-0", "bbbbbbbb": "stage-1"})
    assert [(p["from"], p["path"]) for p in every] == [("stage-0", "unknown"), ("stage-1", "direct")]
    assert asymmetric == []
    assert not sees_all(snaps["stage-0"], {"bbbbbbbb"}) and sees_all(snaps["stage-1"], {"aaaaaaaa"})


def test_a_peer_that_never_answers_us_but_others_vouch_for_has_a_measured_path_none():
    """Our pings to stage-1 go unanswered both ways (a one-way drop, no relay) while other
    members vouch for it: the verdict is ``none``, a measured path, so smoke-run converges
    and reports it instead of waiting out its converge timeout."""
    def member(path: str, checks: int) -> dict:
        return {"prefix": "bbbbbbbb", "state": "alive", "path_checks": checks, "path_out": path}

    assert sees_all({"members": [member("none", 0)]}, {"bbbbbbbb"})
    assert not sees_all({"members": [member("direct", 0)]}, {"bbbbbbbb"})  # not probed yet: assumed


def test_the_summary_says_a_direction_not_yet_probed_is_unknown_not_relayed():
    """stage-0's direction to stage-1's new process has had no probe verdict yet: the JSON
    says ``unknown`` and the summary names it as not yet probed, never as via relay; a
    direction with no path is named as such too."""
    def member(prefix: str, path: str) -> dict:
        return {"prefix": prefix, "path_out": path, "data_out": "direct"}

    prefixes = {"aaaaaaaa": "orchestrator", "bbbbbbbb": "stage-0", "cccccccc": "stage-1"}
    snaps = {"orchestrator": {"members": [member("bbbbbbbb", "direct"), member("cccccccc", "relay")]},
             "stage-0": {"members": [member("aaaaaaaa", "direct"), member("cccccccc", "unknown")]},
             "stage-1": {"members": [member("aaaaaaaa", "direct"), member("bbbbbbbb", "none")]}}
    every, asymmetric = paths(snaps, prefixes)
    generated = _generated()
    generated.paths, generated.asymmetric = every, []
    out = Outcome(2, generated=generated).to_json()
    assert {(p["from"], p["to"]): p["path"] for p in out["paths"]}[("stage-0", "stage-1")] == "unknown"
    assert ("paths: 3 direct, via relay: orchestrator→stage-1, not yet probed: stage-0→stage-1, "
            "no path: stage-1→stage-0") in summary(out).splitlines()


@pytest.mark.parametrize("data_failure, because", [
    ("direct: connect to 127.0.0.1:7946 timed out", "direct: connect to 127.0.0.1:7946 timed out"),
    ("relay: no ack within 2s", "direct ping unanswered"),  # the relay's own: not why it is there
])
def test_a_relayed_direction_says_why_it_is_off_the_direct_path(data_failure, because):
    relayed = {"prefix": "bbbbbbbb", "path_out": "relay", "data_out": "relay",
               "data_last_failure": data_failure, "last_failure": "direct ping unanswered"}
    direct = {"prefix": "aaaaaaaa", "path_out": "direct", "data_out": "direct"}
    _, [pair] = paths({"stage-0": {"members": [relayed]}, "stage-1": {"members": [direct]}},
                      {"aaaaaaaa": "stage-0", "bbbbbbbb": "stage-1"})
    assert pair["detail"] == f"stage-0→stage-1: relay, because {because}; stage-1→stage-0: direct"


@pytest.mark.parametrize("reads, reported", [
    (["relay", "direct"], []),  # one late answer: the recheck moved it back
    (["relay"] * 100, [("stage-0", "stage-1")]),  # a drop that lasts
])
def test_an_asymmetric_pair_is_reported_only_if_it_lasts_past_the_settle_time(monkeypatch, reads, reported):
    from meshd.launch import drive

    def member(prefix: str, path: str) -> dict:
        return {"prefix": prefix, "path_out": path, "data_out": path, "last_failure": "unanswered"}

    left = list(reads)

    def snapshot(client, board):
        if board == "stage-0":
            return {"members": [member("bbbbbbbb", left.pop(0) if len(left) > 1 else left[0])]}
        return {"members": [member("aaaaaaaa", "direct")]}

    class Alive:
        def alive(self) -> bool:
            return True

    class Driver:
        procs = {"stage-0": Alive(), "stage-1": Alive()}

    monkeypatch.setattr(drive, "snapshot", snapshot)
    clock = [0.0]

    class Clock:  # drive's time: each sleep passes at once
        @staticmethod
        def monotonic() -> float:
            return clock[0]

        @staticmethod
        def sleep(s: float) -> None:
            clock[0] += s

    monkeypatch.setattr(drive, "time", Clock)
    prefixes = {"aaaaaaaa": "stage-0", "bbbbbbbb": "stage-1"}
    final = drive.settled(None, Driver(), {"stage-0": "stage-0", "stage-1": "stage-1"}, prefixes,
                          Progress(False))
    _, asymmetric = paths(final, prefixes)
    assert [(a["from"], a["to"]) for a in asymmetric] == reported
    assert clock[0] <= drive.SETTLE_S + 0.25, "a lasting pair is read again for SETTLE_S, not longer"


def test_a_lost_stage_reads_the_same_in_smoke_run_and_in_the_jobs_status():
    failure = orchestrator_failure("lost: stage-1 (peer 2b91108e dead)")
    assert failure.kind is Kind.LOST
    assert (failure.job, failure.peer, failure.detail) == ("stage-1", "2b91108e", "peer 2b91108e dead")
    run = new_run("smoke-1", 2, now=time.time())
    step(run, [], time.time())
    step(run, [Started("stage-1", 1), Running("stage-1", "a:1", "2b91108e")], time.time())
    step(run, [Lost(failure.job, failure.detail)], time.time())
    assert job_status_message(run.job("stage-1")) == failure.status == "lost: stage-1 (peer 2b91108e dead)"


def test_any_other_orchestrator_error_is_an_error_carrying_its_text():
    failure = orchestrator_failure("pipeline not ready: pp-stage-1 does not resolve")
    assert (failure.kind, failure.status) == (Kind.ERROR, "error")
    assert failure.reason == "pipeline not ready: pp-stage-1 does not resolve"


def _generated(matches: bool = True) -> Generated:
    return Generated(tokens=[1, 2], text="ab", reference_tokens=[1, 2] if matches else [1, 3],
                     matches_reference=matches, stage_map={"aaaaaaaa": "orchestrator", "bbbbbbbb": "stage-0"},
                     paths=[{"from": "orchestrator", "to": "stage-0", "path": "relay"}],
                     asymmetric=[{"from": "orchestrator", "to": "stage-0",
                                  "detail": "o→s: relay; s→o: direct"}],
                     converge_s=1.23456, first_token_s=None, tokens_per_s=4.5)


def test_the_json_object_has_the_contracts_keys_in_order():
    outcome = Outcome(1, run="smoke-1", generated=_generated(), run_status="done",
                      jobs={"orchestrator": "exited (0)"}, total_s=9.87654)
    out = outcome.to_json()
    assert list(out) == ["ok", "status", "reason", "stages", "replicas", "run", "tokens", "text",
                         "reference_tokens", "matches_reference", "near_ties", "diverged_at", "stage_map",
                         "paths", "asymmetric",
                         "timings", "failovers", "disruptions", "relay_moves", "leftovers", "run_status",
                         "jobs"]
    assert (out["ok"], out["status"], out["reason"]) == (True, "done", None)
    assert out["timings"] == {"converge_s": 1.235, "first_token_s": None, "tokens_per_s": 4.5,
                              "total_s": 9.877}
    assert outcome.exit_code == 0


def test_a_failed_run_says_why_and_exits_non_zero():
    outcome = Outcome(3, failure=Failure.unreachable(["stage-1"], "not converged within 6s"))
    out = outcome.to_json()
    assert out == {"ok": False, "status": "unreachable: stage-1", "reason": "not converged within 6s",
                   "stages": 3, "replicas": 1, "failovers": [], "disruptions": [], "relay_moves": [],
                   "leftovers": 0}
    assert outcome.exit_code == 1
    assert Outcome(3, failure=Failure.stopped("SIGTERM")).exit_code == 130


def test_leftovers_fail_a_run_that_matched():
    outcome = Outcome(1, generated=_generated(), leftovers=1)
    assert not outcome.to_json()["ok"] and outcome.exit_code == 1


def test_the_summary_names_the_asymmetric_pair_and_the_relayed_direction():
    text = summary(Outcome(1, failure=Failure.mismatch(), generated=_generated(matches=False)).to_json())
    assert text.splitlines()[0] == "smoke-run: failed (output differs from meshd generate)"
    assert "asymmetric: o→s: relay; s→o: direct" in text
    assert "paths: 0 direct, via relay: orchestrator→stage-0" in text
    assert "matches meshd generate: NO" in text and text.endswith("leftovers: 0")


def test_the_summary_names_the_relay_down_the_move_and_the_generation_after_it():
    urls = {"relay": "ws://127.0.0.1:9000", "relay-2": "ws://127.0.0.1:9004"}
    generated = _generated()
    generated.paths = [{"from": "stage-1", "to": "stage-2", "path": "relay", "relay": urls["relay-2"]}]
    generated.again = {"after": "relay-down@2", "tokens": [1, 2], "matches_reference": True,
                       "first_token_s": 0.1, "tokens_per_s": 9.5}
    outcome = Outcome(3, relays=urls, generated=generated,
                      disruptions=[{"fault": "relay-down@2", "action": "relay-down", "job": "relay",
                                    "url": urls["relay"], "after_s": 2.0}],
                      relay_moves=[{"node": "stage-1", "to_node": "stage-2", "peer": "2b91108e",
                                    "from": urls["relay"], "to": urls["relay-2"], "why": "relay closed",
                                    "from_relay": "relay", "to_relay": "relay-2"}])
    out = outcome.to_json()
    assert list(out)[:6] == ["ok", "status", "reason", "stages", "replicas", "relays"]
    assert list(out)[list(out).index("timings") + 1] == "again"
    lines = summary(out).splitlines()
    assert "paths: 0 direct, via relay: stage-1→stage-2 (relay-2)" in lines
    assert "generated again after relay-down@2: 2 tokens; matches meshd generate: yes; 9.5 tokens/s" in lines
    assert "relay-down: stopped relay (ws://127.0.0.1:9000) after 2s" in lines
    assert ("relay move: stage-1→stage-2 from ws://127.0.0.1:9000 (relay) to ws://127.0.0.1:9004 (relay-2): "
            "relay closed") in lines


def test_the_summary_says_whether_each_stream_beside_the_first_matched_and_where_one_parted():
    generated = _generated()
    def stream(prompt: str, tokens: list[int], matches: bool, ties: list[int], at: int | None,
               failovers: list[dict]) -> dict:
        return {"prompt": prompt, "sampling": {"temperature": 0.0, "top_k": 0, "seed": 0}, "tokens": tokens,
                "matches_reference": matches, "near_ties": ties, "diverged_at": at, "failovers": failovers}

    generated.other_streams = [stream("p, 2", [1, 2, 3], True, [], None, []),
                               stream("p, 3", [1, 9, 9], True, [1], 1, [{"stage": "stage-1"}]),
                               stream("p, 4", [7, 7, 7], False, [], 0, [])]
    out = Outcome(1, failure=Failure.mismatch(), generated=generated).to_json()
    assert list(out)[list(out).index("timings") + 1] == "other_streams"
    assert ("streams: 4 at once; the other 3 (9 tokens) match meshd generate: NO (stream 3 parted at "
            "step 1, at a near tie; stream 4 parted at step 0); 1 of them failed over"
            ) in summary(out).splitlines()
    generated.other_streams = generated.other_streams[:1]
    lines = summary(Outcome(1, generated=generated).to_json()).splitlines()
    assert "streams: 2 at once; the other 1 (3 tokens) match meshd generate: yes" in lines


def test_a_stream_beside_the_first_that_fails_fails_the_run_naming_it():
    from meshd.launch.drive import Beside, Dashboard, other_requests
    from meshd.launch.failure import RunFailed

    beside = Beside(Dashboard("http://127.0.0.1:1", {}), other_requests("Once upon a time", 2), 4, 5.0)
    beside.start()
    with pytest.raises(RunFailed) as info:
        beside.wait(Progress())
    failure = info.value.failure
    assert failure.kind is Kind.ERROR
    assert failure.reason.startswith("stream 2 ('Once upon a time, 2') broke: ConnectError"), failure.reason


def test_an_error_in_the_stream_in_openais_shape_fails_the_run_naming_the_stage():
    import httpx

    from meshd.launch.drive import _stream_meshd
    from meshd.launch.failure import RunFailed

    error = {"error": {"message": "lost: stage-1 (peer 2b91108e dead)", "type": "service_unavailable",
                       "param": None, "code": None}}
    body = f'data: {{"meshd": {{"token": 5, "index": 0}}}}\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n'
    seen = []
    with pytest.raises(RunFailed) as exc:
        for extra in _stream_meshd(httpx.Response(200, content=body.encode()), {"2b91108e": "stage-1.2"}):
            seen.append(extra)
    assert seen == [{"token": 5, "index": 0}]
    assert exc.value.failure.status == "lost: stage-1.2 (peer 2b91108e dead)"


class _FullDisk:
    """A stderr that refuses every write, as one on a full disk does (ENOSPC)."""

    def __init__(self) -> None:
        self.writes = 0

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        self.writes += 1
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise OSError(28, "No space left on device")


def test_progress_never_fails_the_run_when_stderr_is_full_closed_or_missing(monkeypatch):
    full = _FullDisk()
    progress = Progress(stream=full)
    progress.update("starting relay")  # the write fails: progress turns off, the run goes on
    progress.update("converging")
    progress.log("converged in 2.0s")
    progress.stop()
    assert full.writes == 1
    closed = io.StringIO()
    closed.close()
    Progress(stream=closed).update("generating")  # ValueError: I/O on a closed file
    monkeypatch.setattr(sys, "stderr", None)  # what a process started with 2>&- has
    missing = Progress()
    missing.update("tearing down")
    missing.log("done")
    missing.stop()
    assert not missing.enabled


def test_progress_piped_is_one_plain_line_per_phase():
    out = io.StringIO()
    progress = Progress(stream=out)
    for text in ("starting relay", "converging", "converging: 1 of 3 nodes see every other alive (0s)",
                 "generating", "generating: 3/8 tokens, 40.0 tokens/s"):
        progress.update(text)
    progress.log("generated 8 tokens in 0.2s, 40.0 tokens/s")
    assert out.getvalue().splitlines() == ["smoke-run: starting relay", "smoke-run: converging",
                                           "smoke-run: generating",
                                           "smoke-run: generated 8 tokens in 0.2s, 40.0 tokens/s"]


@pytest.mark.parametrize("failure", [
    Failure.error("the orchestrator's stream broke after 3 tokens"),
    Failure.timeout("not converged within 60s; unresolved: pp-stage-0"),
    Failure.mismatch(),
    Failure.exited("orchestrator", -9, "the orchestrator was killed after token 3"),
    Failure.unreachable(["stage-0"], "not converged within 60s; cut off: stage-0 (00000007)"),
])
def test_a_run_that_failed_reads_failed_in_ps_and_its_jobs_stopped_by_the_run(tmp_path: Path, failure):
    """Only a signal to smoke-run is its user's stop: any other failure is the run's own."""
    run, driver = _two_relay_run(tmp_path)
    driver.record(failure)
    driver.finish(timeout=1)
    saved = read_run(tmp_path / "smoke-1.json")  # what `meshd ps` shows
    assert (saved.status.value, saved.message) == ("failed", failure.summary)
    assert failure.reason in saved.message or failure.kind is Kind.UNREACHABLE  # why, not just "timeout"
    assert {j.reason.value for j in saved.jobs if j.reason} == {"terminated_by_server"}
    assert {j.status_message for j in saved.jobs} == {"stopped"}


def test_a_run_its_user_stopped_reads_terminated_and_its_jobs_interrupted(tmp_path: Path):
    run, driver = _two_relay_run(tmp_path)
    driver.record(Failure.stopped("SIGINT"))
    driver.finish(timeout=1)
    saved = read_run(tmp_path / "smoke-1.json")
    assert (saved.status.value, saved.message) == ("terminated", "interrupted")
    assert {j.status_message for j in saved.jobs} == {"interrupted"}


def test_a_runs_ports_are_free_distinct_and_below_the_range_ports_bound_to_0_come_from():
    """A node's dashboard binds port 0 and every outgoing connection takes an ephemeral port:
    neither can take a port handed to a node that has not bound it yet."""
    from meshd.launch.local import EPHEMERAL_RANGE, free_ports

    first = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    ports = free_ports(24)
    assert len(set(ports)) == 24
    if first >= 21000:
        assert all(20000 <= p < first for p in ports), ports
