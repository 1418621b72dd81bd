"""The run model and its controller: what a user of `smoke-run` / `meshd ps` would see.

The restart-loop matrix is dstack's multi-node bug ("Multinode tasks sometimes get stuck in
a loop"): a job done while its sibling still ran made the run count as inactive and resubmit.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.launch.model import (
    Exited,
    FailedToStart,
    Finishing,
    JobStatus,
    Kill,
    Lost,
    MarkRun,
    NoPath,
    Reason,
    Restarted,
    RetryPolicy,
    Running,
    RunReason,
    RunStatus,
    Start,
    Started,
    Stop,
    StopJob,
    StopRun,
    is_relay_job,
    new_run,
    parse_stage_job,
    relay_job_names,
    run_from_dict,
    run_to_dict,
    step,
)

PASSES = 5


class Driver:
    """Runs the controller the way smoke-run would, recording every action it returned."""

    def __init__(self, run, now: float = 1000.0) -> None:
        self.run = run
        self.now = now
        self.actions: list = []

    def step(self, *obs, dt: float = 1.0) -> list:
        self.now += dt
        out = step(self.run, list(obs), self.now)
        self.actions.extend(out)
        return out

    def starts(self) -> list[str]:
        return [a.job for a in self.actions if isinstance(a, Start)]

    def stops(self) -> list[Stop]:
        return [a for a in self.actions if isinstance(a, Stop)]

    def bring_up(self) -> None:
        """Start everything (whatever the order) and report each started job running."""
        for _ in range(len(self.run.jobs) + 1):
            self.step()
            pending = [j for j in self.run.jobs if j.status is JobStatus.PROVISIONING]
            if not pending:
                break
            obs = []
            for j in pending:
                obs += [Started(j.name, pid=100 + len(obs)), Running(j.name, f"127.0.0.1:{7000 + len(obs)}")]
            self.step(*obs)
        assert all(j.status is JobStatus.RUNNING for j in self.run.jobs)

    def status(self, name: str) -> str:
        return self.run.job(name).status_message


def running_run(stages=2, *, relay=False, **kw) -> Driver:
    d = Driver(new_run("smoke-1", stages, now=1000.0, relay=relay, **kw))
    d.bring_up()
    return d


# -- the restart-loop matrix ------------------------------------------------------------------

MATRIX = list(
    itertools.product(["orchestrator", "stage-1"], ["done", "terminating"], ["all-done", "master-done"])
)


@pytest.mark.parametrize("first,state,criteria", MATRIX, ids=["-".join(m) for m in MATRIX])
@pytest.mark.parametrize("relay", [False, True], ids=["no-relay", "relay"])
def test_a_job_finishing_first_is_never_restarted_nor_its_siblings_stopped(first, state, criteria, relay):
    d = running_run(3, relay=relay, stop_criteria=criteria)
    starts_before = d.starts()
    siblings = [j.name for j in d.run.main_jobs if j.name != first]

    finish = [Finishing(first)] if state == "terminating" else [Exited(first, 0)]
    d.step(*finish)
    for _ in range(PASSES):
        d.step()

    assert d.starts() == starts_before, "a finished job was resubmitted"
    master_done_ends_it = criteria == "master-done" and first == "orchestrator"
    if master_done_ends_it:
        # dstack's master-done: the master is done, so the workers are stopped, and shown exited (0).
        assert {s.job for s in d.stops() if s.job != "relay"} == set(siblings)
        assert all(s.reason is Reason.MASTER_DONE for s in d.stops() if s.job != "relay")
    else:
        assert [s for s in d.stops() if s.job in siblings] == [], "a sibling was stopped because of it"
        for name in siblings:
            assert d.run.job(name).status is JobStatus.RUNNING
        assert d.run.status is RunStatus.RUNNING
    assert d.run.job(first).status is (JobStatus.DONE if state == "done" else JobStatus.TERMINATING)

    # The finishing job's process exits; the siblings then finish their own way.
    if state == "terminating":
        d.step(Exited(first, 0))
    for _ in range(PASSES):
        d.step()
    assert d.starts() == starts_before
    for name in siblings:
        d.step(Exited(name, 0 if not master_done_ends_it else -15))
        for _ in range(PASSES):
            d.step()
    if relay:
        assert d.run.job("relay").status is JobStatus.TERMINATING
        d.step(Exited("relay", -15))
    for _ in range(PASSES):
        d.step()

    assert d.starts() == starts_before
    assert d.run.status is RunStatus.DONE
    assert d.run.reason is RunReason.ALL_DONE and d.run.message is None
    for job in d.run.jobs:
        assert job.status is JobStatus.DONE
        assert job.status_message == "exited (0)"
    if master_done_ends_it:
        assert {d.run.job(n).reason for n in siblings} == {Reason.MASTER_DONE}
    marks = [a.status for a in d.actions if isinstance(a, MarkRun)]
    assert marks[-1] is RunStatus.DONE and marks.count(RunStatus.DONE) == 1


@pytest.mark.parametrize("criteria", ["all-done", "master-done"])
def test_a_worker_done_first_then_the_master_ends_the_run_done(criteria):
    d = running_run(2, stop_criteria=criteria)
    d.step(Exited("stage-0", 0))
    for _ in range(PASSES):
        d.step()
    d.step(Exited("orchestrator", 0))
    if criteria == "master-done":
        assert [(s.job, s.reason) for s in d.stops()] == [("stage-1", Reason.MASTER_DONE)]
        d.step(Exited("stage-1", -15))
    else:
        assert d.stops() == []
        assert d.run.status is RunStatus.RUNNING  # all-done waits for stage-1
        d.step(Exited("stage-1", 0))
    assert d.run.status is RunStatus.DONE
    assert [d.status(j.name) for j in d.run.jobs] == ["exited (0)"] * 3
    assert d.starts() == ["orchestrator", "stage-0", "stage-1"]


def test_a_finished_job_seen_dead_by_the_mesh_is_not_lost():
    d = running_run(2)
    d.step(Finishing("stage-0"))
    d.step(Lost("stage-0", "peer 2b91108e dead"))
    d.step(Exited("stage-0", 0), Lost("stage-0", "peer 2b91108e dead"))
    assert d.status("stage-0") == "exited (0)"
    assert d.run.status is RunStatus.RUNNING and d.stops() == []


# -- startup order ----------------------------------------------------------------------------


def test_startup_any_starts_everyone_at_once():
    d = Driver(new_run("r", 3, now=0.0))
    started = [a.job for a in d.step() if isinstance(a, Start)]
    assert started == ["orchestrator", "stage-0", "stage-1", "stage-2"]
    assert d.step() == []


def test_workers_first_starts_the_master_only_when_every_worker_runs():
    d = Driver(new_run("r", 2, now=0.0, startup_order="workers-first"))
    d.step()
    assert d.starts() == ["stage-0", "stage-1"]
    d.step(Running("stage-0"))
    for _ in range(PASSES):
        d.step()
    assert d.starts() == ["stage-0", "stage-1"]
    d.step(Running("stage-1"))
    assert d.starts() == ["stage-0", "stage-1", "orchestrator"]


def test_master_first_starts_the_workers_once_the_master_runs():
    d = Driver(new_run("r", 2, now=0.0, startup_order="master-first"))
    d.step()
    d.step()
    assert d.starts() == ["orchestrator"]
    assert d.run.status is RunStatus.PROVISIONING
    d.step(Running("orchestrator", "127.0.0.1:7000", "2b91108e"))
    assert d.starts() == ["orchestrator", "stage-0", "stage-1"]
    assert d.run.status is RunStatus.RUNNING
    assert d.run.job("orchestrator").peer == "2b91108e"


@pytest.mark.parametrize("order", ["any", "master-first", "workers-first"])
def test_the_relay_starts_before_every_node(order):
    d = Driver(new_run("r", 2, now=0.0, relay=True, startup_order=order))
    d.step()
    d.step()
    assert d.starts() == ["relay"]
    d.step(Running("relay", "127.0.0.1:9000"))
    assert d.starts()[0] == "relay" and len(d.starts()) > 1


# -- failures ---------------------------------------------------------------------------------


def test_a_failed_worker_fails_the_run_naming_the_stage_and_stops_the_rest():
    d = running_run(3)
    d.step(Exited("stage-1", 3))
    assert d.status("stage-1") == "exited (3)"
    assert d.run.status is RunStatus.TERMINATING
    assert d.run.message == "stage-1: exited (3)"
    assert sorted(s.job for s in d.stops()) == ["orchestrator", "stage-0", "stage-2"]
    assert {s.reason for s in d.stops()} == {Reason.TERMINATED_BY_SERVER}
    d.step(*(Exited(n, -15) for n in ("orchestrator", "stage-0", "stage-2")))
    assert d.run.status is RunStatus.FAILED and d.run.reason is RunReason.JOB_FAILED
    assert [d.status(n) for n in ("orchestrator", "stage-0", "stage-2")] == ["stopped"] * 3
    for _ in range(PASSES):
        assert d.step() == []
    assert d.starts() == ["orchestrator", "stage-0", "stage-1", "stage-2"]  # no retry by default


def test_failed_to_start_reads_error_and_says_why():
    d = Driver(new_run("r", 2, now=0.0))
    d.step()
    d.step(FailedToStart("stage-0", "no such file: meshd"))
    assert d.status("stage-0") == "error"
    assert d.run.message == "stage-0: error (failed to start: no such file: meshd)"


def test_lost_stage_reads_lost_with_its_peer_and_its_process_is_stopped():
    d = running_run(3)
    d.step(Lost("stage-2", "peer 2b91108e dead"))
    assert d.status("stage-2") == "lost: stage-2 (peer 2b91108e dead)"
    assert d.run.message == "lost: stage-2 (peer 2b91108e dead)"
    assert ("stage-2", Reason.LOST) in [(s.job, s.reason) for s in d.stops()]
    d.step(*(Exited(j.name, -9) for j in d.run.jobs))
    assert d.status("stage-2") == "lost: stage-2 (peer 2b91108e dead)"  # the exit does not rewrite it
    assert d.run.status is RunStatus.FAILED


def test_no_path_reads_the_direction():
    d = running_run(3)
    d.step(NoPath("orchestrator", "stage-2"))
    assert d.status("stage-2") == "no path: orchestrator→stage-2"
    assert d.run.message == "no path: orchestrator→stage-2"


def test_timeout_stops_everything_and_fails_the_run():
    d = Driver(new_run("r", 2, now=0.0, timeout=30.0), now=0.0)
    d.bring_up()
    d.step(dt=10)
    assert d.stops() == []
    d.step(dt=30)
    assert {s.reason for s in d.stops()} == {Reason.TIMEOUT} and len(d.stops()) == 3
    d.step(*(Exited(j.name, -15) for j in d.run.jobs))
    assert d.run.status is RunStatus.FAILED and d.run.message == "timeout after 30 s"
    assert [j.status_message for j in d.run.jobs] == ["timeout"] * 3


def test_a_job_that_ignores_stop_is_killed_after_the_grace_once():
    d = running_run(1, stop_grace=5.0)
    d.step(StopRun())
    assert len(d.stops()) == 2
    d.step(dt=4)
    assert [a for a in d.actions if isinstance(a, Kill)] == []
    d.step(dt=2)
    d.step(dt=2)
    assert sorted(a.job for a in d.actions if isinstance(a, Kill)) == ["orchestrator", "stage-0"]
    d.step(Exited("orchestrator", -9), Exited("stage-0", -9))
    assert d.run.status is RunStatus.TERMINATED
    assert [j.status_message for j in d.run.jobs] == ["interrupted"] * 2


def test_interrupt_before_start_aborts_unstarted_jobs():
    d = Driver(new_run("r", 2, now=0.0, startup_order="workers-first"))
    d.step()
    d.step(StopRun())
    assert d.status("orchestrator") == "aborted"
    d.step(Exited("stage-0", -15), Exited("stage-1", -15))
    assert d.run.status is RunStatus.TERMINATED


def test_relay_down_does_not_end_the_run():
    d = running_run(2, relay=True)
    d.step(StopJob("relay"))
    assert [(s.job, s.reason) for s in d.stops()] == [("relay", Reason.TERMINATED_BY_USER)]
    d.step(Exited("relay", 0))
    assert d.status("relay") == "stopped"
    assert d.run.status is RunStatus.RUNNING
    d.step(Exited("orchestrator", 0), Exited("stage-0", 0), Exited("stage-1", 0))
    assert d.run.status is RunStatus.DONE


def test_several_relays_are_named_relay_relay_2_and_the_nodes_wait_for_every_one():
    assert relay_job_names(1) == ["relay"] and relay_job_names(3) == ["relay", "relay-2", "relay-3"]
    assert [is_relay_job(n) for n in ("relay", "relay-2", "relay-12", "relay-1", "relay-0", "relays",
                                      "stage-1")] == [True, True, True, False, False, False, False]
    d = Driver(new_run("r", 2, now=0.0, relay=2))
    assert [(j.name, j.role.value) for j in d.run.aux_jobs] == [("relay", "relay"), ("relay-2", "relay")]
    d.step()
    assert d.starts() == ["relay", "relay-2"]
    d.step(Running("relay", "127.0.0.1:9000"))
    assert d.starts() == ["relay", "relay-2"], "a node started before every relay was up"
    d.step(Running("relay-2", "127.0.0.1:9001"))
    assert d.starts()[2:] == ["orchestrator", "stage-0", "stage-1"]
    assert new_run("r", 1, now=0.0, relay=True).aux_jobs[0].name == "relay"


def test_one_of_two_relays_down_does_not_end_the_run_and_both_stop_when_it_is_done():
    d = running_run(2, relay=2)
    d.step(StopJob("relay"), Exited("relay", -9))
    assert d.status("relay") == "stopped" and d.run.status is RunStatus.RUNNING
    d.step(Exited("orchestrator", 0), Exited("stage-0", 0), Exited("stage-1", 0))
    assert d.run.job("relay-2").status is JobStatus.TERMINATING
    d.step(Exited("relay-2", -15))
    assert d.run.status is RunStatus.DONE and d.status("relay-2") == "exited (0)"


def test_retry_only_by_policy_and_never_a_done_job():
    d = running_run(2, retry=RetryPolicy(limit=1))
    d.step(Exited("stage-0", 0))
    d.step(Exited("stage-1", 1))
    assert d.starts().count("stage-1") == 2 and d.starts().count("stage-0") == 1
    assert d.run.job("stage-1").attempt == 1
    assert d.run.status is RunStatus.RUNNING
    d.step(Running("stage-1"))
    d.step(Exited("stage-1", 1))
    assert d.run.status is RunStatus.TERMINATING and d.run.message == "stage-1: exited (1)"
    assert d.starts().count("stage-1") == 2


def test_round_trips_through_a_dict():
    d = running_run(2, relay=True)
    d.step(Lost("stage-1", "peer 2b91108e dead"))
    data = run_to_dict(d.run)
    back = run_from_dict(data)
    assert run_to_dict(back) == data
    assert data["jobs"][-1]["status_message"] == "lost: stage-1 (peer 2b91108e dead)"


# -- any order of events ----------------------------------------------------------------------

_NAMES = ["orchestrator", "stage-0", "stage-1"]
_normal = st.one_of(
    st.builds(Running, st.sampled_from(_NAMES)),
    st.builds(Finishing, st.sampled_from(_NAMES)),
    st.builds(Exited, st.sampled_from(_NAMES), st.just(0)),
)
_any = st.one_of(
    _normal,
    st.builds(Exited, st.sampled_from(_NAMES), st.integers(1, 3)),
    st.builds(Lost, st.sampled_from(_NAMES), st.just("peer 2b91108e dead")),
    st.builds(NoPath, st.just("orchestrator"), st.sampled_from(_NAMES[1:])),
)


def _check_history(batches, criteria, order, expect_no_failure):
    d = Driver(new_run("r", 2, now=0.0, stop_criteria=criteria, startup_order=order), now=0.0)
    done: dict[str, Reason] = {}
    for batch in batches:
        out = d.step(*batch)
        for a in out:
            if isinstance(a, Start):
                assert a.job not in done, f"{a.job} was done and was started again"
            if isinstance(a, Stop) and expect_no_failure:
                assert a.reason in (Reason.MASTER_DONE, Reason.RUN_DONE)
                assert criteria == "master-done" and d.run.master.finishing_normally
        for job in d.run.jobs:
            if job.name in done:
                assert job.status is JobStatus.DONE and job.reason is done[job.name]
            elif job.status is JobStatus.DONE:
                done[job.name] = job.reason
        assert step(d.run, [], d.now) == [], "a second pass with nothing new acted again"


@settings(max_examples=300, deadline=None)
@given(
    batches=st.lists(st.lists(_normal, max_size=3), max_size=12),
    criteria=st.sampled_from(["all-done", "master-done"]),
    order=st.sampled_from(["any", "master-first", "workers-first"]),
)
def test_normal_endings_in_any_order_never_restart_nor_stop_a_sibling(batches, criteria, order):
    _check_history(batches, criteria, order, expect_no_failure=True)


@settings(max_examples=300, deadline=None)
@given(
    batches=st.lists(st.lists(_any, max_size=3), max_size=12),
    criteria=st.sampled_from(["all-done", "master-done"]),
    order=st.sampled_from(["any", "master-first", "workers-first"]),
)
def test_a_done_job_stays_done_whatever_happens_next(batches, criteria, order):
    _check_history(batches, criteria, order, expect_no_failure=False)


def test_done_at_the_deadline_is_done_not_a_timeout():
    d = Driver(new_run("r", 1, now=0.0, timeout=10.0), now=0.0)
    d.bring_up()
    d.step(Exited("orchestrator", 0), Exited("stage-0", 0), dt=20)
    assert d.run.status is RunStatus.DONE and d.stops() == []


# -- replicas and restarts (smoke-run --replicas, the restart: fault) -------------------------


def test_replicas_are_stage_jobs_named_by_rank():
    run = new_run("r", 2, now=0.0, replicas=3)
    assert [(j.name, j.stage) for j in run.workers] == [("stage-0", 0), ("stage-1", 1), ("stage-0.2", 0),
                                                         ("stage-1.2", 1), ("stage-0.3", 0), ("stage-1.3", 1)]
    assert [parse_stage_job(n) for n in ("stage-1", "stage-1.2", "stage-1.1", "stage-", "stage-1.0")] == [
        (1, 1), (1, 2), (1, 1), None, None]


@pytest.mark.parametrize("criteria", ["all-done", "master-done"])
def test_a_killed_replica_whose_stage_another_serves_does_not_fail_the_run(criteria):
    d = running_run(2, replicas=2, stop_criteria=criteria)
    d.step(Exited("stage-1.2", -9))
    assert d.status("stage-1.2") == "exited (-9)"
    assert d.run.reason is None and d.stops() == []
    d.step(Exited("orchestrator", 0))
    for name in ("stage-0", "stage-1", "stage-0.2"):
        d.step(Exited(name, 0 if criteria == "all-done" else -15))
    assert d.run.status is RunStatus.DONE and d.run.reason is RunReason.ALL_DONE
    assert d.status("stage-1.2") == "exited (-9)"


def test_a_stage_whose_every_replica_failed_fails_the_run_naming_the_last():
    d = running_run(2, replicas=2)
    d.step(Exited("stage-1.2", -9))
    d.step(Exited("stage-1", -9))
    assert d.run.message == "stage-1: exited (-9)"
    assert d.run.status is RunStatus.TERMINATING and d.run.reason is RunReason.JOB_FAILED


def test_a_generation_that_lost_a_replica_fails_the_run_even_with_its_sibling_up():
    d = running_run(2, replicas=2)
    d.step(Lost("stage-1.2", "peer 5c3e9a10 dead"),
           StopRun(RunReason.JOB_FAILED, "lost: stage-1.2 (peer 5c3e9a10 dead)"))
    assert d.run.message == d.status("stage-1.2") == "lost: stage-1.2 (peer 5c3e9a10 dead)"
    d.step(*(Exited(j.name, -15) for j in d.run.jobs if j.name != "stage-1.2"), Exited("stage-1.2", -9))
    assert d.run.status is RunStatus.FAILED


def test_a_restarted_job_boots_again_and_ends_like_any_other():
    d = running_run(2, relay=True)
    d.step(Restarted("stage-1", pid=4242))
    job = d.run.job("stage-1")
    assert (job.status, job.pid, job.restarts) == (JobStatus.PROVISIONING, 4242, 1)
    assert d.run.status is RunStatus.RUNNING and d.starts().count("stage-1") == 1
    d.step(Running("stage-1", "127.0.0.1:7003", "2b91108e"))
    assert job.status is JobStatus.RUNNING
    assert run_from_dict(run_to_dict(d.run)).job("stage-1").restarts == 1
    d.step(Exited("orchestrator", 0))
    d.step(Exited("stage-0", 0), Exited("stage-1", 0))
    d.step(Exited("relay", -15))
    assert d.run.status is RunStatus.DONE and d.status("stage-1") == "exited (0)"
