"""The run model: one master job (the orchestrator), worker jobs (N stages, each on one or
more replicas), optional auxiliary jobs (the relays), and the controller that decides what
to start and stop. A stage is lost when no replica of it is up, not when one replica fails.

Sans-IO: no trio, no subprocess, no clock. The driver (smoke-run) feeds what it saw as
observations and the current time to `step`, carries out the actions it returns, and saves
the run. `step` is idempotent: a second pass with nothing new returns no actions.

Statuses, termination reasons and the readable status messages follow dstack (0.19.12:
`exited (0)`, `exited (N)`, `stopped`, `error`, ...), and so do `startup_order` and
`stop_criteria`. One thing deliberately does not: dstack's multi-node restart loop
(dstack issue "Multinode tasks sometimes get stuck in a loop"), where a job that was done
while its sibling still ran made the replica count as inactive and the whole run was
submitted again. Here a job that finished normally is final: nothing in this module moves
a job out of done, and only a failed job, under an explicit RetryPolicy, is resubmitted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

_STAGE_JOB = re.compile(r"^stage-(?P<stage>\d+)(?:\.(?P<replica>[1-9]\d*))?$")
_RELAY_JOB = re.compile(r"^relay(?:-(?P<n>[2-9]|[1-9]\d+))?$")


class JobStatus(StrEnum):
    SUBMITTED = "submitted"
    PROVISIONING = "provisioning"
    RUNNING = "running"
    TERMINATING = "terminating"
    DONE = "done"
    FAILED = "failed"
    TERMINATED = "terminated"
    ABORTED = "aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISHED_JOB


_FINISHED_JOB = frozenset({JobStatus.DONE, JobStatus.FAILED, JobStatus.TERMINATED, JobStatus.ABORTED})


class Reason(StrEnum):
    """Why a job ended (or is ending)."""

    DONE_BY_RUNNER = "done_by_runner"  # the process finished on its own, exit 0
    MASTER_DONE = "master_done"  # stop_criteria master-done: stopped because the master was done
    RUN_DONE = "run_done"  # an auxiliary job (the relay) stopped because the run was done
    FAILED_TO_START = "failed_to_start"
    CONTAINER_EXITED_WITH_ERROR = "container_exited_with_error"
    LOST = "lost"  # the mesh declared the job's peer dead
    NO_PATH = "no_path"  # no direct or relayed path reaches the job
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"  # Ctrl-C or SIGTERM to the driver
    TERMINATED_BY_USER = "terminated_by_user"
    TERMINATED_BY_SERVER = "terminated_by_server"  # stopped because a sibling failed the run
    ABORTED = "aborted"  # never started: the run ended first


# The status a job ends in, by the reason it was stopped or ended for.
_FINAL_STATUS = {
    Reason.DONE_BY_RUNNER: JobStatus.DONE,
    Reason.MASTER_DONE: JobStatus.DONE,
    Reason.RUN_DONE: JobStatus.DONE,
    Reason.FAILED_TO_START: JobStatus.FAILED,
    Reason.CONTAINER_EXITED_WITH_ERROR: JobStatus.FAILED,
    Reason.LOST: JobStatus.FAILED,
    Reason.NO_PATH: JobStatus.FAILED,
    Reason.TIMEOUT: JobStatus.TERMINATED,
    Reason.INTERRUPTED: JobStatus.TERMINATED,
    Reason.TERMINATED_BY_USER: JobStatus.TERMINATED,
    Reason.TERMINATED_BY_SERVER: JobStatus.TERMINATED,
    Reason.ABORTED: JobStatus.ABORTED,
}


class RunStatus(StrEnum):
    SUBMITTED = "submitted"
    PROVISIONING = "provisioning"
    RUNNING = "running"
    TERMINATING = "terminating"
    DONE = "done"
    FAILED = "failed"
    TERMINATED = "terminated"

    @property
    def finished(self) -> bool:
        return self in (RunStatus.DONE, RunStatus.FAILED, RunStatus.TERMINATED)


class RunReason(StrEnum):
    """Why a run ended (or is ending)."""

    ALL_DONE = "all_done"  # stop criteria met: every job done, or the master done
    JOB_FAILED = "job_failed"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"
    STOPPED_BY_USER = "stopped_by_user"


_RUN_FINAL = {
    RunReason.ALL_DONE: RunStatus.DONE,
    RunReason.JOB_FAILED: RunStatus.FAILED,
    RunReason.TIMEOUT: RunStatus.FAILED,
    RunReason.INTERRUPTED: RunStatus.TERMINATED,
    RunReason.STOPPED_BY_USER: RunStatus.TERMINATED,
}

# The reason a still-active job is stopped for, by the reason its run ends.
_JOB_STOP_REASON = {
    RunReason.JOB_FAILED: Reason.TERMINATED_BY_SERVER,
    RunReason.TIMEOUT: Reason.TIMEOUT,
    RunReason.INTERRUPTED: Reason.INTERRUPTED,
    RunReason.STOPPED_BY_USER: Reason.TERMINATED_BY_USER,
}


class Role(StrEnum):
    ORCHESTRATOR = "orchestrator"  # the master job
    STAGE = "stage"  # a worker job
    RELAY = "relay"  # auxiliary: started before everyone, stopped after everyone


class StartupOrder(StrEnum):
    ANY = "any"
    MASTER_FIRST = "master-first"
    WORKERS_FIRST = "workers-first"


class StopCriteria(StrEnum):
    ALL_DONE = "all-done"
    MASTER_DONE = "master-done"


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Resubmit a failed job, at most `limit` times, when its reason is in `on`.

    The default retries nothing. A job that ended done is never retried, whatever the policy.
    """

    limit: int = 0
    on: frozenset[Reason] = frozenset(
        {Reason.FAILED_TO_START, Reason.CONTAINER_EXITED_WITH_ERROR, Reason.LOST}
    )


def stage_job_name(stage: int, replica: int = 1) -> str:
    """A stage job's name: ``stage-K`` for the stage's first replica, ``stage-K.2``, ``stage-K.3``...
    for the others, so a run without replicas reads as it always has."""
    return f"stage-{stage}" if replica == 1 else f"stage-{stage}.{replica}"


def parse_stage_job(name: str) -> tuple[int, int] | None:
    """``stage-K`` -> (K, 1), ``stage-K.j`` -> (K, j); None for any other name.

    ``stage-K.1`` reads as (K, 1): the first replica, named precisely.
    """
    m = _STAGE_JOB.match(name)
    if m is None:
        return None
    return int(m["stage"]), int(m["replica"] or 1)


def relay_job_names(count: int) -> list[str]:
    """The relay jobs' names: ``relay`` for the first, then ``relay-2``, ``relay-3``..., so a run
    with one relay reads as it always has and ``relay`` always names the first."""
    return ["relay", *(f"relay-{i}" for i in range(2, count + 1))]


def is_relay_job(name: str) -> bool:
    """``relay`` or ``relay-N`` (N >= 2): a name ``relay_job_names`` gives."""
    return _RELAY_JOB.match(name) is not None


def stage_jobs(stages: int, replicas: int = 1) -> list[tuple[int, int]]:
    """Every stage job's (stage, replica) by rank: each stage's first replica, then each stage's
    second, and so on (so without replicas, stage-K has rank K + 1)."""
    return [(k, j) for j in range(1, replicas + 1) for k in range(stages)]


def stage_job_names(stages: int, replicas: int = 1) -> list[str]:
    """The stage jobs' names by rank."""
    return [stage_job_name(k, j) for k, j in stage_jobs(stages, replicas)]


@dataclass(slots=True)
class Job:
    name: str  # orchestrator, stage-K, stage-K.j (a replica), relay, relay-N
    role: Role
    stage: int | None = None
    status: JobStatus = JobStatus.SUBMITTED
    reason: Reason | None = None
    detail: str | None = None  # what the reason is about: "peer 2b91108e dead", an error text
    exit_code: int | None = None  # what the process returned, as observed
    pid: int | None = None
    address: str | None = None
    peer: str | None = None  # the node's id prefix, 8 hex
    submitted_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    attempt: int = 0  # resubmissions under a RetryPolicy
    restarts: int = 0  # times the driver killed its process and started it again (restart: faults)
    live: bool = False  # a process may exist: Start was issued and no exit seen yet
    stop_requested_at: float | None = None  # when a Stop action was issued
    finishing_at: float | None = None  # when it was seen finishing on its own
    kill_sent: bool = False

    @property
    def is_master(self) -> bool:
        return self.role is Role.ORCHESTRATOR

    @property
    def is_aux(self) -> bool:
        return self.role is Role.RELAY

    @property
    def finishing_normally(self) -> bool:
        """Done, or on its way to done by itself: it must count as done, never as inactive."""
        if self.status is JobStatus.DONE:
            return True
        return self.status is JobStatus.TERMINATING and self.reason is Reason.DONE_BY_RUNNER

    @property
    def status_message(self) -> str:
        return job_status_message(self)


def job_status_message(job: Job) -> str:
    """What a person reads in the STATUS column."""
    status, reason = job.status, job.reason
    if not status.finished:
        return status.value
    if status is JobStatus.DONE:
        return "exited (0)"
    if reason is Reason.LOST:
        return f"lost: {job.name} ({job.detail or 'peer dead'})"
    if reason is Reason.NO_PATH:
        return f"no path: {job.detail or job.name}"
    if reason is Reason.TIMEOUT:
        return "timeout"
    if reason is Reason.INTERRUPTED:
        return "interrupted"
    if reason is Reason.CONTAINER_EXITED_WITH_ERROR:
        return f"exited ({job.exit_code})"
    if status is JobStatus.FAILED:
        return "error"
    if status is JobStatus.ABORTED:
        return "aborted"
    return "stopped"


# -- observations: what the driver saw --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Started:
    """The process was spawned."""

    job: str
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class Running:
    """The node is up (its boot line was seen, or it joined the mesh)."""

    job: str
    address: str | None = None
    peer: str | None = None


@dataclass(frozen=True, slots=True)
class Finishing:
    """The job is finishing on its own and normally (it said so, or left the mesh gracefully);
    its process has not been reaped yet."""

    job: str


@dataclass(frozen=True, slots=True)
class Restarted:
    """The driver killed the job's process and started the same command again (a ``restart:``
    fault): the same job and node key in a new process, which has not booted yet."""

    job: str
    pid: int | None = None


@dataclass(frozen=True, slots=True)
class Exited:
    job: str
    exit_code: int


@dataclass(frozen=True, slots=True)
class FailedToStart:
    job: str
    error: str


@dataclass(frozen=True, slots=True)
class Lost:
    """The mesh declared the job's peer dead. `detail` reads e.g. "peer 2b91108e dead"."""

    job: str
    detail: str


@dataclass(frozen=True, slots=True)
class NoPath:
    """No path, direct or relayed, from `src` to `dst` (job names): `dst` failed."""

    src: str
    dst: str


@dataclass(frozen=True, slots=True)
class StopJob:
    """Someone asked for one job to stop (e.g. the `relay-down` fault). An auxiliary job
    stopped this way does not end the run; a master or worker stopped this way does."""

    job: str
    reason: Reason = Reason.TERMINATED_BY_USER


@dataclass(frozen=True, slots=True)
class StopRun:
    """Stop the whole run: Ctrl-C or SIGTERM (INTERRUPTED), a user's stop, or the driver's
    verdict (JOB_FAILED, e.g. a generation that lost its stage), with the message to show."""

    reason: RunReason = RunReason.INTERRUPTED
    message: str | None = None


Observation = (Started | Running | Restarted | Finishing | Exited | FailedToStart | Lost | NoPath | StopJob
               | StopRun)


# -- actions: what the driver must do ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    job: str
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class Stop:
    """Ask the job to stop (SIGTERM); Kill follows if it has not exited within the grace."""

    job: str
    reason: Reason


@dataclass(frozen=True, slots=True)
class Kill:
    job: str


@dataclass(frozen=True, slots=True)
class MarkRun:
    """The run's status changed; save it, show it."""

    status: RunStatus
    reason: RunReason | None
    message: str | None


Action = Start | Stop | Kill | MarkRun


# -- the run ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    name: str
    jobs: list[Job]
    startup_order: StartupOrder = StartupOrder.ANY
    stop_criteria: StopCriteria = StopCriteria.ALL_DONE
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout: float | None = None  # seconds from submission
    stop_grace: float = 5.0  # seconds between Stop and Kill
    submitted_at: float = 0.0
    finished_at: float | None = None
    reason: RunReason | None = None  # set once the run starts ending; never changes after
    message: str | None = None  # readable: "stage-2: exited (1)", "lost: stage-1 (peer .. dead)"
    last_status: RunStatus = RunStatus.SUBMITTED  # what the last MarkRun said

    def job(self, name: str) -> Job:
        for job in self.jobs:
            if job.name == name:
                return job
        raise KeyError(f"no job {name!r} in run {self.name!r}")

    @property
    def master(self) -> Job:
        return next(job for job in self.jobs if job.is_master)

    @property
    def workers(self) -> list[Job]:
        return [job for job in self.jobs if job.role is Role.STAGE]

    @property
    def main_jobs(self) -> list[Job]:
        return [job for job in self.jobs if not job.is_aux]

    @property
    def aux_jobs(self) -> list[Job]:
        return [job for job in self.jobs if job.is_aux]

    @property
    def status(self) -> RunStatus:
        return run_status(self)


def new_run(
    name: str,
    stages: int,
    *,
    now: float,
    replicas: int = 1,
    relay: bool | int = False,
    startup_order: StartupOrder | str = StartupOrder.ANY,
    stop_criteria: StopCriteria | str = StopCriteria.ALL_DONE,
    retry: RetryPolicy | None = None,
    timeout: float | None = None,
    stop_grace: float = 5.0,
) -> Run:
    """A run of one orchestrator, `replicas` jobs for each of the `stages` stages (by rank, see
    `stage_job_names`) and relay jobs: `relay` True (or 1) for one, `relay`; R for R of them,
    `relay`, `relay-2`, ... (see `relay_job_names`); all submitted."""
    if stages < 1:
        raise ValueError("a run needs at least one stage")
    if replicas < 1:
        raise ValueError("a stage needs at least one replica")
    if relay < 0:
        raise ValueError("a run's relay count cannot be negative")
    jobs = [Job(name, Role.RELAY, submitted_at=now) for name in relay_job_names(int(relay))] if relay else []
    jobs.append(Job("orchestrator", Role.ORCHESTRATOR, submitted_at=now))
    jobs.extend(Job(stage_job_name(k, j), Role.STAGE, stage=k, submitted_at=now)
                for k, j in stage_jobs(stages, replicas))
    return Run(
        name=name,
        jobs=jobs,
        startup_order=StartupOrder(startup_order),
        stop_criteria=StopCriteria(stop_criteria),
        retry=retry or RetryPolicy(),
        timeout=timeout,
        stop_grace=stop_grace,
        submitted_at=now,
    )


def run_status(run: Run) -> RunStatus:
    """The run's status, derived from its jobs and its termination reason."""
    if run.reason is not None:
        if all(job.status.finished and not job.live for job in run.jobs):
            return _RUN_FINAL[run.reason]
        return RunStatus.TERMINATING
    statuses = {job.status for job in run.jobs}
    if statuses & {JobStatus.RUNNING, JobStatus.TERMINATING, JobStatus.DONE}:
        return RunStatus.RUNNING
    if JobStatus.PROVISIONING in statuses:
        return RunStatus.PROVISIONING
    return RunStatus.SUBMITTED


# -- the controller ---------------------------------------------------------------------------


def step(run: Run, observations: Iterable[Observation], now: float) -> list[Action]:
    """Apply what the driver saw, then decide what to start, stop and kill.

    Mutates `run`; returns the actions to carry out. Calling it again with no new
    observations returns []. Never returns Start for a job that was done.
    """
    actions: list[Action] = []
    for obs in observations:
        _observe(run, obs, now)

    if run.reason is None:
        _check_run_end(run, now)

    if run.reason is None:
        _retry_failed(run, now)
        actions.extend(_starts(run, now))
    else:
        _abort_unstarted(run, now)
        actions.extend(_stops_for_run_end(run, run.reason, now))

    actions.extend(_stop_dead_processes(run, now))
    actions.extend(_kills(run, now))

    status = run.status
    if status.finished and run.finished_at is None:
        run.finished_at = now
    if status is not run.last_status:
        run.last_status = status
        actions.append(MarkRun(status, run.reason, run.message))
    return actions


def _observe(run: Run, obs: Observation, now: float) -> None:
    if isinstance(obs, StopRun):
        _end_run(run, obs.reason, obs.message or _stop_run_message(obs.reason), now)
        return
    if isinstance(obs, NoPath):
        job = run.job(obs.dst)
        if job.status in (JobStatus.PROVISIONING, JobStatus.RUNNING):
            _finish(job, Reason.NO_PATH, now, detail=f"{obs.src}→{obs.dst}")
        return

    job = run.job(obs.job)
    if isinstance(obs, Started):
        if job.status is JobStatus.PROVISIONING:
            job.pid = obs.pid
    elif isinstance(obs, Running):
        if job.status in (JobStatus.PROVISIONING, JobStatus.RUNNING):
            job.status = JobStatus.RUNNING
            job.address = obs.address or job.address
            job.peer = obs.peer or job.peer
    elif isinstance(obs, Restarted):
        if job.status in (JobStatus.PROVISIONING, JobStatus.RUNNING):
            job.status = JobStatus.PROVISIONING  # Running again once the new process boots
            job.pid = obs.pid
            job.live = True
            job.restarts += 1
    elif isinstance(obs, Finishing):
        if job.status in (JobStatus.PROVISIONING, JobStatus.RUNNING):
            job.status = JobStatus.TERMINATING
            job.reason = Reason.DONE_BY_RUNNER
            job.finishing_at = now
    elif isinstance(obs, Exited):
        _observe_exit(job, obs.exit_code, now)
    elif isinstance(obs, FailedToStart):
        job.live = False
        if not job.status.finished:
            _finish(job, Reason.FAILED_TO_START, now, detail=obs.error)
    elif isinstance(obs, Lost):
        # A job leaving because it finished, or because we stopped it, is seen dead by its
        # peers too: that is not a loss. Only a job that should be up can be lost.
        if job.status in (JobStatus.PROVISIONING, JobStatus.RUNNING):
            _finish(job, Reason.LOST, now, detail=obs.detail)
    elif isinstance(obs, StopJob):
        if job.status is JobStatus.SUBMITTED:
            _finish(job, Reason.ABORTED, now)
        elif job.status in (JobStatus.PROVISIONING, JobStatus.RUNNING):
            job.status = JobStatus.TERMINATING
            job.reason = obs.reason
        if not job.is_aux and run.reason is None and not job.finishing_normally:
            _end_run(run, RunReason.STOPPED_BY_USER, f"{job.name}: stopped", now)


def _observe_exit(job: Job, code: int, now: float) -> None:
    if job.status is JobStatus.SUBMITTED:
        return  # never started: not this job's process
    job.live = False
    if job.exit_code is None:
        job.exit_code = code
    if job.status.finished:
        return  # the first cause wins: a lost job's exit does not rewrite why it ended
    if job.status is JobStatus.TERMINATING and job.reason is not None:
        if job.reason is Reason.DONE_BY_RUNNER and code != 0:
            _finish(job, Reason.CONTAINER_EXITED_WITH_ERROR, now)
        else:
            _finish(job, job.reason, now)
    elif code == 0:
        _finish(job, Reason.DONE_BY_RUNNER, now)
    else:
        _finish(job, Reason.CONTAINER_EXITED_WITH_ERROR, now)


def _finish(job: Job, reason: Reason, now: float, *, detail: str | None = None) -> None:
    job.status = _FINAL_STATUS[reason]
    job.reason = reason
    if detail is not None:
        job.detail = detail
    job.finished_at = now


def _end_run(run: Run, reason: RunReason, message: str | None, now: float) -> None:
    if run.reason is None:
        run.reason = reason
        run.message = message


def _stop_run_message(reason: RunReason) -> str:
    return {RunReason.INTERRUPTED: "interrupted", RunReason.STOPPED_BY_USER: "stopped"}.get(
        reason, reason.value
    )


def failure_message(job: Job) -> str:
    """A failed job's message for the run, naming the job."""
    message = job.status_message
    if job.reason in (Reason.LOST, Reason.NO_PATH):
        return message  # already names it: "lost: stage-2 (..)", "no path: a→stage-2"
    if job.reason is Reason.FAILED_TO_START and job.detail:
        return f"{job.name}: {message} (failed to start: {job.detail})"
    return f"{job.name}: {message}"


def _check_run_end(run: Run, now: float) -> None:
    for job in run.jobs:
        if job.status is JobStatus.FAILED and not _retryable(run, job) and not _replaced(run, job):
            _end_run(run, RunReason.JOB_FAILED, failure_message(job), now)
            return
    if run.stop_criteria is StopCriteria.MASTER_DONE:
        if run.master.finishing_normally:
            _end_run(run, RunReason.ALL_DONE, None, now)
    elif all(job.finishing_normally or _replaced(run, job) for job in run.main_jobs):
        _end_run(run, RunReason.ALL_DONE, None, now)
    # Done at the deadline is done, not a timeout.
    if run.timeout is not None and now >= run.submitted_at + run.timeout:
        _end_run(run, RunReason.TIMEOUT, f"timeout after {run.timeout:g} s", now)


def _replaced(run: Run, job: Job) -> bool:
    """A failed worker whose stage another replica still serves: the stage is not lost, so the
    run goes on (a driver that knows the run failed anyway says so with StopRun)."""
    return job.status is JobStatus.FAILED and job.role is Role.STAGE and any(
        other is not job and other.role is Role.STAGE and other.stage == job.stage and _up(other)
        for other in run.jobs
    )


def _retryable(run: Run, job: Job) -> bool:
    return (
        job.status is JobStatus.FAILED
        and job.reason in run.retry.on
        and job.attempt < run.retry.limit
    )


def _retry_failed(run: Run, now: float) -> None:
    """Resubmit a failed job the policy allows, once its process is gone. Never a done one."""
    for job in run.jobs:
        if _retryable(run, job) and not job.live:
            job.attempt += 1
            job.status = JobStatus.SUBMITTED
            job.reason = job.detail = job.exit_code = job.pid = None
            job.started_at = job.finished_at = job.stop_requested_at = job.finishing_at = None
            job.kill_sent = False
            job.submitted_at = now


def _may_start(run: Run, job: Job) -> bool:
    if job.is_aux:
        return True
    # The nodes need the relays' URLs: they start once every auxiliary job is up.
    if any(aux.status is not JobStatus.RUNNING for aux in run.aux_jobs):
        return False
    order = run.startup_order
    if order is StartupOrder.MASTER_FIRST and not job.is_master:
        return _up(run.master)
    if order is StartupOrder.WORKERS_FIRST and job.is_master:
        return all(_up(worker) for worker in run.workers)
    return True


def _up(job: Job) -> bool:
    return job.status is JobStatus.RUNNING or job.finishing_normally


def _starts(run: Run, now: float) -> list[Action]:
    actions: list[Action] = []
    for job in run.jobs:
        if job.status is JobStatus.SUBMITTED and _may_start(run, job):
            job.status = JobStatus.PROVISIONING
            job.live = True
            job.started_at = now
            actions.append(Start(job.name, job.attempt))
    return actions


def _abort_unstarted(run: Run, now: float) -> None:
    for job in run.jobs:
        if job.status is JobStatus.SUBMITTED:
            _finish(job, Reason.ABORTED, now)


def _stops_for_run_end(run: Run, ending: RunReason, now: float) -> list[Action]:
    """Stop every job still up, for the reason ``ending`` (the run's) gives it."""
    actions: list[Action] = []
    for job in run.jobs:
        if job.status not in (JobStatus.PROVISIONING, JobStatus.RUNNING):
            continue  # finishing by itself, being stopped already, or finished: leave it be
        if ending is RunReason.ALL_DONE:
            reason = Reason.RUN_DONE if job.is_aux else Reason.MASTER_DONE
        else:
            reason = _JOB_STOP_REASON[ending]
        job.status = JobStatus.TERMINATING
        job.reason = reason
        job.stop_requested_at = now
        actions.append(Stop(job.name, reason))
    return actions


def _stop_dead_processes(run: Run, now: float) -> list[Action]:
    """A job that failed while its process may live on (lost, no path) or was asked to stop
    by StopJob: stop the process, once."""
    actions: list[Action] = []
    for job in run.jobs:
        if not job.live or job.stop_requested_at is not None or job.reason is None:
            continue
        if job.status.finished or (
            job.status is JobStatus.TERMINATING and job.reason is not Reason.DONE_BY_RUNNER
        ):
            job.stop_requested_at = now
            actions.append(Stop(job.name, job.reason))
    return actions


def _kills(run: Run, now: float) -> list[Action]:
    actions: list[Action] = []
    for job in run.jobs:
        if not job.live or job.kill_sent:
            continue
        since = job.stop_requested_at
        if since is None and run.reason is not None:
            since = job.finishing_at  # finishing by itself, but the run is over: do not wait forever
        if since is not None and now >= since + run.stop_grace:
            job.kill_sent = True
            actions.append(Kill(job.name))
    return actions


# -- serialisation ----------------------------------------------------------------------------


def job_to_dict(job: Job) -> dict[str, Any]:
    return {
        "name": job.name,
        "role": job.role.value,
        "stage": job.stage,
        "status": job.status.value,
        "reason": job.reason.value if job.reason else None,
        "status_message": job.status_message,
        "detail": job.detail,
        "exit_code": job.exit_code,
        "pid": job.pid,
        "address": job.address,
        "peer": job.peer,
        "submitted_at": job.submitted_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "attempt": job.attempt,
        "restarts": job.restarts,
        "live": job.live,
    }


def run_to_dict(run: Run) -> dict[str, Any]:
    return {
        "name": run.name,
        "status": run.status.value,
        "reason": run.reason.value if run.reason else None,
        "message": run.message,
        "startup_order": run.startup_order.value,
        "stop_criteria": run.stop_criteria.value,
        "timeout": run.timeout,
        "submitted_at": run.submitted_at,
        "finished_at": run.finished_at,
        "jobs": [job_to_dict(job) for job in run.jobs],
    }


def _optional(data: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``data[key]``, None when absent; a value of another type (a bool for a number
    included) raises TypeError naming the field."""
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise TypeError(f"field {key}: expected {getattr(kind, '__name__', 'a number')}, "
                        f"got {type(value).__name__}")
    return value


_NUMBER = (int, float)


def _seconds(data: dict[str, Any], key: str) -> float | None:
    """An optional time or duration: a number from 0 up that a float holds. JSON's NaN and
    Infinity, a time before 1970, or an integer past a float's range would break ``meshd ps``'s
    age column and its ``--json`` line."""
    value = _optional(data, key, _NUMBER)
    if value is None:
        return None
    try:
        fits = math.isfinite(float(value)) and value >= 0
    except OverflowError:
        fits = False
    if not fits:
        raise ValueError(f"field {key}: expected a finite number from 0 up, got {value!r:.40}")
    return value


def job_from_dict(data: dict[str, Any]) -> Job:
    _optional(data, "status_message", str)  # written for readers; ``meshd ps`` shows it
    return Job(
        name=str(data["name"]),
        role=Role(data["role"]),
        stage=_optional(data, "stage", int),
        status=JobStatus(data["status"]),
        reason=Reason(data["reason"]) if data.get("reason") else None,
        detail=_optional(data, "detail", str),
        exit_code=_optional(data, "exit_code", int),
        pid=_optional(data, "pid", int),
        address=_optional(data, "address", str),
        peer=_optional(data, "peer", str),
        submitted_at=_seconds(data, "submitted_at") or 0.0,
        started_at=_seconds(data, "started_at"),
        finished_at=_seconds(data, "finished_at"),
        attempt=_optional(data, "attempt", int) or 0,
        restarts=_optional(data, "restarts", int) or 0,
        live=bool(data.get("live")),
    )


def run_from_dict(data: dict[str, Any]) -> Run:
    """Raises KeyError, ValueError or TypeError on a malformed dict."""
    run = Run(
        name=str(data["name"]),
        jobs=[job_from_dict(job) for job in data["jobs"]],
        startup_order=StartupOrder(data.get("startup_order", "any")),
        stop_criteria=StopCriteria(data.get("stop_criteria", "all-done")),
        timeout=_seconds(data, "timeout"),
        submitted_at=_seconds(data, "submitted_at") or 0.0,
        finished_at=_seconds(data, "finished_at"),
        reason=RunReason(data["reason"]) if data.get("reason") else None,
        message=_optional(data, "message", str),
    )
    _optional(data, "owner_pid", int)  # the driver's, read by ``owner_alive``
    run.last_status = RunStatus(data["status"])
    return run
