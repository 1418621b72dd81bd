"""The ``kill:`` and ``restart:`` faults, carried out as the tokens come, and the
``relay-down`` faults, carried out on a clock.

A fault names a job, or a replicated stage by its bare name (``stage-K``): then the
target is the replica serving the request at that moment, which only the orchestrator
knows.  Its ``GET /api/requests`` gives each running request's route (stage name ->
peer prefix), and the run's stage map ties the prefix to a job.  Each fault carried out
is recorded for the report, so a reader can match it with the failover (or, for a relay,
the relay moves) it caused.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

from .failure import Failure, RunFailed
from .jobs import JobDriver
from .model import parse_stage_job
from .plan import Disruption, RelayDown
from .report import ENDED, Progress, landed


def serving_job(answer: Any, request: str | None, stage: str, prefixes: dict[str, str]) -> str:
    """The job serving ``stage`` (``stage-K``) for ``request`` in an ``/api/requests`` answer.

    ``prefixes`` maps node id prefixes to job names.  ``request`` None (a stream that did not
    say its id) is taken to be the one running request, if only one runs.  ValueError says why
    no job can be named.
    """
    running = answer.get("requests") if isinstance(answer, dict) else None
    if not isinstance(running, list):
        raise ValueError(f"the answer has no list of requests: {answer!r:.200}")
    ended = answer.get("ended")
    if request is not None and isinstance(ended, list) and not any(
            isinstance(r, dict) and r.get("request") == request for r in running):
        # A fast generation may end before its stream's token T reaches us: where it ran last.
        running = [*running, *(r for r in ended if isinstance(r, dict) and r.get("request") == request)]
    entry = _our_request(running, request)
    route = entry.get("route")
    peer = route.get(stage) if isinstance(route, dict) else None
    if not isinstance(peer, str):
        raise ValueError(f"request {entry.get('request')} has no {stage} in its route {route!r}")
    job = prefixes.get(peer)
    if job is None:
        raise ValueError(f"{stage} of request {entry.get('request')} is peer {peer}, no job of this run")
    parsed, wanted = parse_stage_job(job), parse_stage_job(stage)
    if parsed is None or wanted is None or parsed[0] != wanted[0]:
        raise ValueError(f"{stage} of request {entry.get('request')} is peer {peer}, which is {job}")
    return job


def _our_request(running: list[Any], request: str | None) -> dict[str, Any]:
    entries = [r for r in running if isinstance(r, dict)]
    if request is None:
        if len(entries) != 1:
            raise ValueError(f"{len(entries)} requests are running and the stream did not say which is ours")
        return entries[0]
    for entry in entries:
        if entry.get("request") == request:
            return entry
    raise ValueError(f"request {request} is not among the running ones "
                     f"({', '.join(str(e.get('request')) for e in entries) or 'none'})")


class Disruptor:
    """Carries out the run's ``kill:`` / ``restart:`` faults when their token comes.

    ``ask_requests`` returns the orchestrator's ``/api/requests`` answer (ValueError when it
    cannot); ``done`` collects what was carried out, as the report shows it.
    """

    def __init__(self, kills: list[Disruption], driver: JobDriver, ask_requests: Callable[[], Any],
                 prefixes: dict[str, str], progress: Progress, done: list[dict[str, Any]]) -> None:
        self.kills, self.driver, self.ask_requests = kills, driver, ask_requests
        self.prefixes, self.progress, self.done = prefixes, progress, done

    @property
    def restarted(self) -> list[str]:
        """The jobs restarted so far, in order, each once."""
        return list(dict.fromkeys(d["job"] for d in self.done if d["action"] == "restart"))

    def after_token(self, count: int, request: str | None) -> None:
        """``count`` tokens are out (``request`` is the stream's id): carry out the faults due now."""
        due = [fault for fault in self.kills if fault.token == count]
        # A replicated stage's fault needs to know which replica serves the request at this
        # token: then one answer, taken before any fault of the token is carried out, serves
        # them all.  Faults that name their jobs alone are carried out at once and ask where
        # the request was after: the orchestrator's count stops when a stage goes, while a
        # round trip before the kill lets a fast generation run on (or end) first.
        before = self._ask() if any(fault.serving for fault in due) else None
        for fault in due:
            job = self.target(fault, request, before)
            self._act(fault, job)
            answer = before
            if answer is None and parse_stage_job(fault.who):
                answer = self._ask()
            self._record(fault, job, _how_far(answer, request))

    def _ask(self) -> Any:
        """The orchestrator's ``/api/requests`` answer, or None when it cannot give one."""
        with contextlib.suppress(Exception):
            return self.ask_requests()
        return None

    def target(self, fault: Disruption, request: str | None, answer: Any = None) -> str:
        """The job ``fault`` hits now; RunFailed when a replicated stage's serving replica is unknown.
        ``answer``: the orchestrator's ``/api/requests`` answer, asked for now if None."""
        if not fault.serving:
            return fault.who
        try:
            return serving_job(self.ask_requests() if answer is None else answer, request, fault.stage,
                               self.prefixes)
        except ValueError as exc:
            why = f"cannot tell which replica of {fault.stage} serves the request: {exc}"
            raise RunFailed(Failure.error(f"--fault {fault.spec}: {why}")) from None

    def _act(self, fault: Disruption, job: str) -> None:
        if fault.restart:
            self.driver.restart(job)
        else:
            self.driver.kill(job)

    def _record(self, fault: Disruption, job: str, at: int | str | None) -> None:
        """``at``: how far the request was as the fault came (its token count at the
        orchestrator, ENDED, or None when not known)."""
        peer = next((p for p, name in self.prefixes.items() if name == job), None)
        action = "restart" if fault.restart else "kill"
        record: dict[str, Any] = {"fault": fault.spec, "action": action, "job": job, "peer": peer,
                                  "token": fault.token}
        if at is not None:
            record["request_at"] = at
        self.done.append(record)
        self.progress.log(f"{action} {job} ({peer or 'no peer'}) after token {fault.token}{landed(record)}")


def _how_far(answer: Any, request: str | None) -> int | str | None:
    """How many tokens ``request`` had at the orchestrator, by its ``/api/requests`` answer;
    ENDED when it is among the ended ones only; None when the answer does not say."""
    if not isinstance(answer, dict) or request is None:
        return None
    for key in ("requests", "ended"):
        entries = answer.get(key)
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and entry.get("request") == request:
                tokens = entry.get("tokens")
                return ENDED if key == "ended" else tokens if isinstance(tokens, int) else None
    return None


class RelayDowns:
    """Carries out the run's ``relay-down`` faults: each relay is SIGKILLed ``after_s`` seconds
    from :meth:`start` (when the generation starts), and recorded in ``done`` as it goes down.

    ``urls`` maps each relay job to the URL the nodes hold for it, so the record and the relay
    moves in the report name the same relay the same way.
    """

    def __init__(self, downs: list[RelayDown], driver: JobDriver, urls: dict[str, str],
                 progress: Progress, done: list[dict[str, Any]]) -> None:
        self.downs, self.driver, self.urls, self.progress, self.done = downs, driver, urls, progress, done
        self._fired: set[str] = set()  # specs carried out, written by the timers' threads
        self._timers: list[threading.Timer] = []

    def start(self) -> None:
        for down in self.downs:
            self._timers.append(self.driver.down_later(down.who, down.after_s,
                                                       functools.partial(self._went_down, down)))

    @property
    def pending(self) -> list[RelayDown]:
        """The faults not carried out yet."""
        return [down for down in self.downs if down.spec not in self._fired]

    def wait(self) -> None:
        """Until every fault is carried out."""
        for timer in self._timers:
            timer.join()

    def _went_down(self, down: RelayDown) -> None:  # in the timer's thread
        self.done.append({"fault": down.spec, "action": "relay-down", "job": down.who,
                          "url": self.urls.get(down.who), "after_s": down.after_s})
        self._fired.add(down.spec)
        url = self.urls.get(down.who)
        self.progress.log(f"relay-down: stopped {down.who} ({url}) after {down.after_s:g}s")
