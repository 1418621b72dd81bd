"""`meshd smoke-run --replicas`, the restart fault and the failovers report, without processes:
the plan's names and command lines, which replica a fault hits, and what the report says."""

from __future__ import annotations

import pytest

from meshd.launch.checks import failovers, names_short, owners_needed
from meshd.launch.disrupt import Disruptor, serving_job
from meshd.launch.drive import orchestrator_failure
from meshd.launch.failure import Kind, RunFailed
from meshd.launch.plan import Disruption, FaultPlan, RunPlan, job_argvs, node_names, plan_faults
from meshd.launch.report import Generated, Outcome, Progress, disruption_line, failover_line, summary

NAMES = node_names(2, 2)
ADDRS = {"relay": "127.0.0.1:9000", **{n: f"127.0.0.1:{9001 + i}" for i, n in enumerate(NAMES)}}
PREFIXES = {"0000aaaa": "orchestrator", "2b91108e": "stage-0", "77aa0011": "stage-1",
            "11bb2222": "stage-0.2", "5c3e9a10": "stage-1.2"}
REQUESTS = {"requests": [{"request": "ffff00000000", "route": {"stage-0": "11bb2222", "stage-1": "77aa0011"},
                          "tokens": 2},
                         {"request": "ab12cd34ef56", "route": {"stage-0": "2b91108e", "stage-1": "5c3e9a10"},
                          "tokens": 5}],
            "failovers": []}


# -- names and command lines ----------------------------------------------------------------


def test_replicas_follow_every_stages_first_node_by_rank():
    assert NAMES == ["orchestrator", "stage-0", "stage-1", "stage-0.2", "stage-1.2"]
    assert node_names(3) == ["orchestrator", "stage-0", "stage-1", "stage-2"]


def test_a_replica_runs_its_stage_with_its_own_key_address_and_dashboard():
    addrs = {n: ADDRS[n] for n in NAMES}
    plan = RunPlan(2, "/m", ADDRS["relay"], addrs, {n: f"127.0.0.1:{8000 + i}" for i, n in enumerate(NAMES)},
                   FaultPlan(), "/tmp/snaps", "/tmp/run/keys", replicas=2)
    argvs = job_argvs(plan)

    def flag(job: str, name: str) -> str:
        return argvs[job][argvs[job].index(name) + 1]

    assert argvs["stage-1.2"][:5] == ["run", "--role", "stage", "--stage", "1"]
    assert flag("stage-1.2", "--bind") == ADDRS["stage-1.2"]
    keys = {flag(n, "--key-file") for n in NAMES}
    assert len(keys) == len(NAMES), "every node has its own key file"
    assert flag("stage-1.2", "--key-file") == "/tmp/run/keys/stage-1.2/node.key"
    assert len({flag(n, "--dashboard") for n in NAMES}) == len(NAMES)
    assert job_argvs(plan) == argvs, "a restart runs the very same command line"


# -- kill: and restart: specs -----------------------------------------------------------------


def test_a_bare_stage_name_means_the_serving_replica_and_a_dotted_one_that_replica():
    plan = plan_faults(["kill:stage-1@token-5", "restart:stage-1.2@token-6", "kill:stage-0.1@token-7",
                        "restart:orchestrator@token-8"], ADDRS, max_tokens=12)
    assert plan.kills == [
        Disruption("kill:stage-1@token-5", "stage-1", 5, restart=False, serving=True),
        Disruption("restart:stage-1.2@token-6", "stage-1.2", 6, restart=True, serving=False),
        Disruption("kill:stage-0.1@token-7", "stage-0", 7, restart=False, serving=False),
        Disruption("restart:orchestrator@token-8", "orchestrator", 8, restart=True, serving=False),
    ]
    assert plan.kills[1].stage == "stage-1"


def test_without_replicas_a_stage_name_is_its_one_job():
    addrs = {"relay": "h:1", "orchestrator": "h:2", "stage-0": "h:3", "stage-1": "h:4"}
    assert plan_faults(["restart:stage-1@token-2"], addrs).kills == [
        Disruption("restart:stage-1@token-2", "stage-1", 2, restart=True, serving=False)]


@pytest.mark.parametrize("spec, words", [
    ("restart:stage-1", "restart:stage-1.*expected restart:X@token-T"),
    ("kill:stage-1@5", "expected kill:X@token-T"),
    ("kill:stage-1@token-0", "kill:stage-1@token-0: T counts tokens produced, from 1"),
    ("restart:stage-1@token-13", "restart:stage-1@token-13: the run generates only 12 tokens"),
    ("kill:stage-1.3@token-2", "kill:stage-1.3@token-2: no node named 'stage-1.3'"),
    ("restart:stage-7@token-2", "no node named 'stage-7'"),
    ("drop:stage-1.2->stage-9.2", "drop:stage-1.2->stage-9.2: no node named 'stage-9.2'"),
    ("reboot:stage-1@token-2", "expected drop:A->B.*restart:X@token-T"),
])
def test_a_bad_kill_or_restart_spec_is_refused_naming_it(spec, words):
    with pytest.raises(ValueError, match=words):
        plan_faults([spec], ADDRS, max_tokens=12)


def test_a_drop_names_a_replica_by_its_dotted_name():
    plan = plan_faults(["drop:stage-1.2->stage-0.2"], ADDRS)
    assert plan.node_faults == {"stage-1.2": [f"drop:{ADDRS['stage-0.2']}"]}


# -- which replica a fault hits ---------------------------------------------------------------


def test_the_serving_replica_is_read_from_the_orchestrators_requests():
    assert serving_job(REQUESTS, "ab12cd34ef56", "stage-1", PREFIXES) == "stage-1.2"
    assert serving_job(REQUESTS, "ffff00000000", "stage-1", PREFIXES) == "stage-1"
    assert serving_job(REQUESTS, "ab12cd34ef56", "stage-0", PREFIXES) == "stage-0"
    one = {"requests": REQUESTS["requests"][:1]}
    assert serving_job(one, None, "stage-0", PREFIXES) == "stage-0.2"  # a stream that gave no id


def test_a_request_that_ended_before_its_token_was_read_is_found_where_it_ran_last():
    """A fast generation can end before smoke-run reads token T of its stream."""
    ended = {"requests": [], "ended": [{"request": "r1", "route": {"stage-1": "2b91108e"}},
                                       {"request": "r2", "route": {"stage-1": "9c3e1f07"}}]}
    prefixes = {"2b91108e": "stage-1", "9c3e1f07": "stage-1.2"}
    assert serving_job(ended, "r2", "stage-1", prefixes) == "stage-1.2"
    with pytest.raises(ValueError, match="0 requests are running"):
        serving_job(ended, None, "stage-1", prefixes)  # without an id, an ended one is no guess


@pytest.mark.parametrize("answer, request_id, words", [
    (REQUESTS, "000000000000", "request 000000000000 is not among the running ones"),
    (REQUESTS, None, "2 requests are running and the stream did not say which is ours"),
    ({"requests": [{"request": "r1", "route": {"stage-0": "2b91108e"}}]}, "r1", "no stage-1 in its route"),
    ({"requests": [{"request": "r1", "route": {"stage-1": "deadbeef"}}]}, "r1", "peer deadbeef, no job"),
    ({"requests": [{"request": "r1", "route": {"stage-1": "2b91108e"}}]}, "r1", "which is stage-0"),
    ({"error": {"message": "not found"}}, "r1", "no list of requests"),
])
def test_a_route_that_names_no_replica_of_the_stage_says_why(answer, request_id, words):
    with pytest.raises(ValueError, match=words):
        serving_job(answer, request_id, "stage-1", PREFIXES)


class FakeDriver:
    """What the disruptor asks of the job driver, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def kill(self, name: str) -> None:
        self.calls.append(("kill", name))

    def restart(self, name: str) -> None:
        self.calls.append(("restart", name))


def _disruptor(specs: list[str], answer=REQUESTS) -> tuple[Disruptor, FakeDriver, list[dict]]:
    def ask():
        if isinstance(answer, Exception):
            raise answer
        return answer

    driver, done = FakeDriver(), []
    kills = plan_faults(specs, ADDRS).kills
    return Disruptor(kills, driver, ask, PREFIXES, Progress(False), done), driver, done  # type: ignore[arg-type]


def test_kill_at_token_t_hits_the_replica_serving_our_request_then():
    disruptor, driver, done = _disruptor(["kill:stage-1@token-5", "restart:stage-0.2@token-6"])
    for count in range(1, 5):
        disruptor.after_token(count, "ab12cd34ef56")
    assert driver.calls == []
    disruptor.after_token(5, "ab12cd34ef56")
    disruptor.after_token(6, "ab12cd34ef56")
    assert driver.calls == [("kill", "stage-1.2"), ("restart", "stage-0.2")]
    # Each record says how far the request was at the orchestrator as its fault came.
    assert done == [
        {"fault": "kill:stage-1@token-5", "action": "kill", "job": "stage-1.2", "peer": "5c3e9a10",
         "token": 5, "request_at": 5},
        {"fault": "restart:stage-0.2@token-6", "action": "restart", "job": "stage-0.2", "peer": "11bb2222",
         "token": 6, "request_at": 5},
    ]
    assert disruptor.restarted == ["stage-0.2"]


def test_a_fault_naming_its_job_strikes_before_asking_how_far_the_request_was():
    """A round trip to the orchestrator before the kill would let a fast generation run on,
    or end, before its stage goes: the named job is hit first, the count asked for after.
    A replicated stage's fault due at the same token needs the serving replica as of that
    token: one answer, taken before anything is carried out, serves every fault of it."""
    def run(specs: list[str]) -> tuple[FakeDriver, list[dict], list[list]]:
        driver, done, seen = FakeDriver(), [], []

        def ask():
            seen.append(list(driver.calls))  # what had been carried out when the question went
            return REQUESTS

        kills = plan_faults(specs, ADDRS).kills
        Disruptor(kills, driver, ask, PREFIXES, Progress(False), done).after_token(3, "ab12cd34ef56")  # type: ignore[arg-type]
        return driver, done, seen

    driver, done, seen = run(["restart:stage-0.2@token-3"])
    assert seen == [[("restart", "stage-0.2")]] and done[0]["request_at"] == 5
    driver, done, seen = run(["restart:orchestrator@token-3", "kill:stage-1@token-3"])
    assert seen == [[]], "asked once, before the orchestrator went"
    assert driver.calls == [("restart", "orchestrator"), ("kill", "stage-1.2")]
    assert [d.get("request_at") for d in done] == [5, 5]


def test_a_fault_that_comes_after_its_request_ended_says_it_disrupted_nothing_of_it():
    ended = {"requests": [], "ended": [{"request": "ab12cd34ef56", "route": {"stage-1": "5c3e9a10"},
                                        "tokens": 32}]}
    disruptor, driver, done = _disruptor(["restart:stage-1@token-8"], ended)
    disruptor.after_token(8, "ab12cd34ef56")
    assert driver.calls == [("restart", "stage-1.2")]  # carried out, as asked
    assert done[0]["request_at"] == "ended"
    assert disruption_line(done[0]) == ("restarted stage-1.2 (5c3e9a10) after token 8 (the request had "
                                         "ended by then: nothing of it was disrupted)")
    ahead = {"requests": [{**ended["ended"][0], "tokens": 21}], "ended": []}
    disruptor, _, done = _disruptor(["kill:stage-1@token-8"], ahead)
    disruptor.after_token(8, "ab12cd34ef56")
    assert disruption_line(done[0]).endswith("after token 8 (the orchestrator had token 21 of the request "
                                              "by then)")


def test_an_orchestrator_that_cannot_say_who_serves_fails_the_run_naming_the_fault():
    disruptor, driver, _ = _disruptor(["kill:stage-1@token-2"], ValueError("GET /api/requests answered 404"))
    disruptor.after_token(1, "ab12cd34ef56")
    with pytest.raises(RunFailed) as exc:
        disruptor.after_token(2, "ab12cd34ef56")
    assert exc.value.failure.kind is Kind.ERROR
    assert exc.value.failure.reason == ("--fault kill:stage-1@token-2: cannot tell which replica of stage-1 "
                                        "serves the request: GET /api/requests answered 404")
    assert driver.calls == []


# -- converging with replicas ---------------------------------------------------------------------


def test_every_running_replica_must_own_its_stage_name_before_generating():
    needed = owners_needed(2, NAMES)
    assert needed == {"pp-entry": 1, "pp-exit": 1, "pp-stage-0": 2, "pp-stage-1": 2, "pp-orchestrator": 1}
    names = {n: {"resolves": True, "live": ["a"]} for n in needed}
    names["pp-stage-0"]["live"] = ["a", "b"]
    assert names_short(names, needed) == ["pp-stage-1 (1/2 live)"]
    del names["pp-exit"]
    assert names_short(names, needed) == ["pp-exit", "pp-stage-1 (1/2 live)"]
    # A replica killed for good no longer counts.
    assert owners_needed(2, [n for n in NAMES if n != "stage-1.2"])["pp-stage-1"] == 1


def test_a_lost_replica_is_named_by_its_job_and_what_follows_is_the_reason():
    message = "lost: stage-1 (peer 5c3e9a10 dead), and no replica to take over"
    failure = orchestrator_failure(message, PREFIXES)
    assert (failure.job, failure.peer, failure.status) == ("stage-1.2", "5c3e9a10",
                                                           "lost: stage-1.2 (peer 5c3e9a10 dead)")
    assert failure.reason == "no replica to take over"
    assert orchestrator_failure("lost: stage-1 (peer 77aa0011 dead)", PREFIXES).reason == "lost"
    down = orchestrator_failure("lost: stage-1 (peer 5c3e9a10 stage-1 (5c3e9a10) is down: refused), and no "
                                "replica to take over", PREFIXES)
    assert (down.job, down.detail, down.reason) == ("stage-1.2", "peer 5c3e9a10 stage-1 (5c3e9a10) is down: "
                                                    "refused", "no replica to take over")


# -- the report -------------------------------------------------------------------------------


REPORTED = [{"request": "ab12cd34ef56", "stage": "stage-1", "from": "77aa0011", "to": "5c3e9a10",
             "ms": 412.3}]


def test_a_failover_names_the_jobs_of_its_peers():
    assert failovers(REPORTED, PREFIXES) == [{**REPORTED[0], "from_job": "stage-1", "to_job": "stage-1.2"}]
    unknown = [{"request": "r", "stage": 1, "from": "77aa0011", "to": "99999999", "ms": 3}]
    assert failovers(unknown, PREFIXES) == [{"request": "r", "stage": "stage-1", "from": "77aa0011",
                                             "to": "99999999", "ms": 3, "from_job": "stage-1"}]


def test_the_report_prints_one_line_per_failover_and_the_json_lists_them():
    generated = Generated(tokens=[1, 2], text="ab", reference_tokens=[1, 2], matches_reference=True,
                          stage_map=PREFIXES, paths=[], asymmetric=[], converge_s=1.0, first_token_s=0.5,
                          tokens_per_s=4.0)
    done = {"fault": "kill:stage-1@token-5", "action": "kill", "job": "stage-1", "peer": "77aa0011",
            "token": 5}
    outcome = Outcome(2, 2, generated=generated, failovers=failovers(REPORTED, PREFIXES), disruptions=[done])
    out = outcome.to_json()
    assert out["ok"] and out["replicas"] == 2
    assert out["failovers"] == [{"request": "ab12cd34ef56", "stage": "stage-1", "from": "77aa0011",
                                 "to": "5c3e9a10", "ms": 412.3, "from_job": "stage-1", "to_job": "stage-1.2"}]
    assert out["disruptions"] == [done]
    lines = summary(out).splitlines()
    assert "killed stage-1 (77aa0011) after token 5" in lines
    assert ("failover: request ab12cd34ef56 stage-1 77aa0011 (stage-1) -> 5c3e9a10 (stage-1.2) in 412 ms"
            in lines)
    assert lines[-1] == "leftovers: 0"


def test_a_failover_line_leaves_out_what_is_not_known():
    line = failover_line({"request": "r", "stage": "stage-0", "from": "2b91108e", "to": "11bb2222"})
    assert line == "failover: request r stage-0 2b91108e -> 11bb2222"


def test_a_failover_line_says_what_became_of_the_node_left_when_it_is_one_word():
    same = {"request": "r", "stage": "stage-1", "from": "b68ab03d", "from_job": "stage-1", "to": "b68ab03d",
            "to_job": "stage-1", "ms": 401.2, "why": "restarted"}
    assert failover_line(same) == ("failover: request r stage-1 b68ab03d (stage-1) restarted -> b68ab03d "
                                   "(stage-1) in 401 ms")
    long = dict(same, why="could not deliver message 26 (19952 bytes) to stage-1 (b68ab03d) within 30s")
    assert failover_line(long) == ("failover: request r stage-1 b68ab03d (stage-1) -> b68ab03d (stage-1) "
                                   "in 401 ms")
