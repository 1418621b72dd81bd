"""The pieces of `meshd smoke-run` that need no process: the fault plan, the failure read from
the orchestrator, the `--json` object's shape and the summary."""

from __future__ import annotations

import time

import pytest

from meshd.launch.drive import orchestrator_failure
from meshd.launch.failure import Failure, Kind
from meshd.launch.model import Lost, Running, Started, job_status_message, new_run, step
from meshd.launch.plan import Disruption, FaultPlan, RunPlan, job_argvs, node_names, plan_faults
from meshd.launch.report import Generated, Outcome, summary

ADDRS = {"relay": "127.0.0.1:9000", "orchestrator": "127.0.0.1:9001",
         "stage-0": "127.0.0.1:9002", "stage-1": "127.0.0.1:9003"}


def test_a_one_way_drop_becomes_the_senders_own_rule_naming_the_receivers_address():
    plan = plan_faults(["drop:stage-1->stage-0", "kill:stage-0@token-3", "relay-down@2.5"], ADDRS)
    assert plan.node_faults == {"stage-1": ["drop:127.0.0.1:9002"]}
    assert plan.kills == [Disruption("kill:stage-0@token-3", "stage-0", 3)] and plan.relay_down_s == 2.5


@pytest.mark.parametrize("spec, words", [
    ("drop:stage-1->stage-7", "no node named 'stage-7'"),
    ("nat:stage-0", "nat needs --provider netns"),
    ("bogus", "expected drop:A->B"),
])
def test_a_bad_fault_spec_is_refused_with_a_message_naming_it(spec, words):
    with pytest.raises(ValueError, match=words):
        plan_faults([spec], ADDRS)


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
                         "reference_tokens", "matches_reference", "stage_map", "paths", "asymmetric",
                         "timings", "failovers", "disruptions", "leftovers", "run_status", "jobs"]
    assert (out["ok"], out["status"], out["reason"]) == (True, "done", None)
    assert out["timings"] == {"converge_s": 1.235, "first_token_s": None, "tokens_per_s": 4.5,
                              "total_s": 9.877}
    assert outcome.exit_code == 0


def test_a_failed_run_says_why_and_exits_non_zero():
    outcome = Outcome(3, failure=Failure.unreachable(["stage-1"], "not converged within 6s"))
    out = outcome.to_json()
    assert out == {"ok": False, "status": "unreachable: stage-1", "reason": "not converged within 6s",
                   "stages": 3, "replicas": 1, "failovers": [], "disruptions": [], "leftovers": 0}
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
