"""Why a smoke run failed, as data: the status a person reads, why, and which job and peer it names.

Planning, driving and the checks raise :class:`RunFailed` carrying a :class:`Failure`;
the report prints its ``status`` and ``reason``, and the run model learns about a lost
job from its fields (``job``, ``detail``), so no one reads a status line back.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    """What kind of failure: decides what the run model is told."""

    ERROR = "error"  # a bad spec, a testbed that cannot be built, an answer we cannot use
    EXITED = "exited"  # a job's process ended while it was needed
    TIMEOUT = "timeout"  # not started or not converged in time
    UNREACHABLE = "unreachable"  # not converged, and some jobs are cut off from the rest
    LOST = "lost"  # the mesh declared a stage's peer dead during the generation
    MISMATCH = "mismatch"  # the tokens differ from `meshd generate`
    STOPPED = "stopped"  # SIGINT or SIGTERM to smoke-run


@dataclass(frozen=True, slots=True)
class Failure:
    kind: Kind
    status: str  # the run's status line: "lost: stage-1 (peer 2b91108e dead)", "exited (1)", "timeout"
    reason: str  # one line on why
    job: str | None = None  # the job it names, by run name (stage-1, orchestrator, relay)
    peer: str | None = None  # that job's node id prefix, 8 hex, when known
    detail: str | None = None  # what happened to that job, as its own status says: "peer 2b91108e dead"

    @property
    def summary(self) -> str:
        """What ``meshd ps`` says of the run: the status, with why where the status alone
        does not say it (a lost or unreachable job is named by its status already)."""
        if self.kind in (Kind.LOST, Kind.UNREACHABLE) or not self.reason:
            return self.status
        return f"{self.status}: {self.reason}"

    @classmethod
    def error(cls, reason: str) -> Failure:
        return cls(Kind.ERROR, "error", reason)

    @classmethod
    def exited(cls, job: str, code: int | None, reason: str) -> Failure:
        return cls(Kind.EXITED, f"exited ({code})", reason, job=job)

    @classmethod
    def timeout(cls, reason: str) -> Failure:
        return cls(Kind.TIMEOUT, "timeout", reason)

    @classmethod
    def unreachable(cls, jobs: list[str], reason: str) -> Failure:
        """``jobs`` (at least one) cannot be reached; the failure names the job when there is one."""
        return cls(Kind.UNREACHABLE, f"unreachable: {', '.join(jobs)}", reason,
                   job=jobs[0] if len(jobs) == 1 else None)

    @classmethod
    def lost(cls, job: str, detail: str, peer: str | None = None, reason: str = "lost") -> Failure:
        """``detail`` reads ``peer 2b91108e dead``: the status is the job's own status message."""
        return cls(Kind.LOST, f"lost: {job} ({detail})", reason, job=job, peer=peer, detail=detail)

    @classmethod
    def mismatch(cls) -> Failure:
        return cls(Kind.MISMATCH, "failed", "output differs from meshd generate")

    @classmethod
    def stopped(cls, signal_name: str) -> Failure:
        return cls(Kind.STOPPED, "stopped", f"interrupted by {signal_name}")


class RunFailed(Exception):
    """The run cannot go on; ``failure`` says why."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.status)
        self.failure = failure


class Interrupted(BaseException):
    """SIGTERM or SIGINT: tear down, then exit non-zero."""
