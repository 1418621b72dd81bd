"""The run model's actions carried out on processes, and what the processes did fed back to it.

:func:`meshd.launch.model.step` decides; :class:`JobDriver` starts, signals and
watches the processes and saves the run after each step, so ``meshd ps`` in
another process sees every change.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .failure import Failure, Kind, RunFailed
from .local import LocalProcess, stop_all
from .model import (
    Exited,
    Finishing,
    Kill,
    Lost,
    Observation,
    Restarted,
    Run,
    Running,
    RunReason,
    Start,
    Started,
    Stop,
    StopJob,
    StopRun,
    step,
)
from .process import parse_relay_url
from .report import Progress
from .state import save_run

# (name, argv, env) -> the started process: the provider's way of starting a job.
Spawn = Callable[[str, list[str], dict[str, str] | None], LocalProcess]


class JobDriver:
    def __init__(self, run: Run, run_dir: Path, argvs: dict[str, list[str]], envs: dict[str, dict[str, str]],
                 progress: Progress, spawn: Spawn = LocalProcess) -> None:
        self.run, self.run_dir, self.argvs, self.envs = run, run_dir, argvs, envs
        self.spawn = spawn
        self.progress = progress
        self.procs: dict[str, LocalProcess] = {}
        self._exited: set[str] = set()
        self._running: set[str] = set()
        self._relays = [job.name for job in run.aux_jobs]
        self._downed: set[str] = set()  # relays stopped by a relay-down fault
        self._killed: set[str] = set()  # jobs a kill: fault ended
        self._timers: list[threading.Timer] = []  # relay-down faults still to come

    def observe(self, *observations: Observation) -> None:
        pending = list(observations)
        while True:
            actions = step(self.run, pending, time.time())
            pending = []
            for action in actions:
                if isinstance(action, Start):
                    self.progress.update(f"starting {action.job}")
                    proc = self.spawn(action.job, self.argvs[action.job], self.envs.get(action.job))
                    self.procs[action.job] = proc
                    pending.append(Started(action.job, proc.proc.pid))
                elif isinstance(action, Stop) and action.job in self.procs:
                    self.procs[action.job].signal(signal.SIGTERM)
                elif isinstance(action, Kill) and action.job in self.procs:
                    self.procs[action.job].signal(signal.SIGKILL)
            save_run(self.run, self.run_dir)
            if not pending:
                return

    def poll(self) -> None:
        """Report processes that came up or went away since the last look.

        A node is up once it printed its boot line, a relay once it printed its URL (it listens).
        """
        seen: list[Observation] = []
        for name, proc in self.procs.items():
            if name not in self._running and name in self._relays:
                url = next((u for line in proc.lines[proc.first_line:] if (u := parse_relay_url(line))), None)
                if url is not None:
                    self._running.add(name)
                    seen.append(Running(name, url.removeprefix("ws://")))
            elif name not in self._running:
                if proc.boot is None:
                    with contextlib.suppress(TimeoutError, RuntimeError):
                        proc.wait_boot(0.01)
                if proc.boot is not None:
                    self._running.add(name)
                    seen.append(Running(name, proc.boot.addr, proc.boot.prefix))
            if name not in self._exited and not proc.alive():
                self._exited.add(name)
                if name in self._downed:  # stopped on purpose: the run goes on, the job reads stopped
                    seen.append(StopJob(name))
                seen.append(Exited(name, proc.proc.returncode))
        if seen:
            self.observe(*seen)

    def kill(self, name: str) -> None:
        """The ``kill:`` fault: SIGKILL the job's process; the run model learns of it by its exit."""
        self._killed.add(name)
        self.procs[name].signal(signal.SIGKILL)

    def down(self, name: str) -> None:
        """The ``relay-down`` fault: SIGKILL the relay's process, as a crash would end it; the run
        model learns by its exit that it was stopped on purpose, so the run goes on.

        Safe from a timer's thread: it only marks the job and sends the signal.
        """
        self._downed.add(name)
        self.procs[name].signal(signal.SIGKILL)

    def down_later(self, name: str, after_s: float, then: Callable[[], None]) -> threading.Timer:
        """:meth:`down` ``name`` in ``after_s`` seconds, then call ``then`` (in the timer's thread);
        :meth:`finish` cancels what has not come yet."""
        def fire() -> None:
            self.down(name)
            then()

        timer = threading.Timer(after_s, fire)
        timer.daemon = True  # a failed run's pending fault must not keep smoke-run alive
        self._timers.append(timer)
        timer.start()
        return timer

    def restart(self, name: str) -> None:
        """The ``restart:`` fault: SIGKILL the job's process and start the same command again
        (its key file, address and ports); the new process boots like a first one."""
        proc = self.procs[name]
        proc.restart()
        self._running.discard(name)
        self._exited.discard(name)
        self.observe(Restarted(name, proc.proc.pid))

    def wait_started(self, names: list[str], timeout: float) -> None:
        """Drive the startup order until every named job is up; RunFailed names a laggard."""
        deadline = time.monotonic() + timeout
        while not all(n in self._running for n in names):
            self.poll()
            for n, proc in self.procs.items():
                if not proc.alive():
                    why = f"{n} exited while starting: {' | '.join(proc.lines[-3:])}"
                    raise RunFailed(Failure.exited(n, proc.proc.returncode, why))
            if time.monotonic() > deadline:
                late = [n for n in names if n not in self._running]
                raise RunFailed(Failure.timeout(f"not started within {timeout:g}s: {', '.join(late)}"))
            time.sleep(0.05)

    def record(self, failure: Failure) -> None:
        """Tell the run model why the run failed, so statuses and ``meshd ps`` say it.

        A lost job fails the run even if a replica of its stage is up: the generation failed.
        Any other failure but a signal to smoke-run fails the run too (its jobs are stopped by
        the run, ``terminated_by_server``): only SIGINT, SIGTERM or SIGHUP to it is a user's stop.
        """
        if failure.kind is Kind.LOST and failure.job in self.procs and failure.detail is not None:
            self.observe(Lost(failure.job, failure.detail), StopRun(RunReason.JOB_FAILED, failure.status))
            return
        if failure.kind is Kind.STOPPED:
            # A user's stop: the jobs the same signal reached read interrupted, not their exits.
            self.observe(StopRun(RunReason.INTERRUPTED))
            return
        # A job a kill: fault ended reads as it ended (exited (-9)), not as stopped with the rest:
        # the stream it broke may end a moment before its process is reaped.
        for name in self._killed:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[name].proc.wait(1.0)
        self.poll()
        self.observe(StopRun(RunReason.JOB_FAILED, failure.summary))

    def finish(self, timeout: float = 8.0) -> int:
        """Let every job end (per the stop criteria), then make sure; returns processes left alive."""
        for timer in self._timers:
            timer.cancel()
        for timer in self._timers:
            timer.join()  # one firing now has marked its relay before we look
        self.poll()  # a job that died (a kill: fault) is seen failed before the run is done
        master = self.procs.get("orchestrator")
        if master is not None and master.alive() and not self.run.reason:
            # The master's work is done: it finishes normally (master-done stops the workers).
            self.observe(Finishing("orchestrator"))
            master.signal(signal.SIGTERM)
            if self.run.stop_criteria == "all-done":
                for job in self.run.workers:
                    if job.name in self.procs and self.procs[job.name].alive():
                        self.observe(Finishing(job.name))
                        self.procs[job.name].signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.alive() for p in self.procs.values()):
            self.poll()
            nodes = [p for n, p in self.procs.items() if n not in self._relays]
            if not self.run.reason and all(not p.alive() for p in nodes):
                self.observe(*(StopJob(relay) for relay in self._relays if relay in self.procs))
            time.sleep(0.05)
        left = stop_all(list(self.procs.values()))
        self.poll()
        return left
