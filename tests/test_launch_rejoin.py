"""smoke-run waiting for a restarted node (``restart:X@token-T``): what it says when the node
does not come back, or comes back but the pipeline cannot serve through it.

The processes and their dashboards are stand-ins (no process, an in-memory HTTP transport), so
each wait ends at once: a timeout of 0 gives one look, and the failure that look finds.
"""

from __future__ import annotations

import httpx
import pytest

from meshd.launch.drive import Dashboard, rejoin
from meshd.launch.failure import Kind, RunFailed
from meshd.launch.process import Boot
from meshd.launch.report import Progress

PREFIXES = {"0a0a0a0a": "orchestrator", "1b1b1b1b": "stage-0", "2c2c2c2c": "stage-1"}
PEER_OF = {job: peer for peer, job in PREFIXES.items()}


class _Popen:
    def __init__(self, returncode: int | None) -> None:
        self.pid, self.returncode = 4242, returncode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


class _Proc:
    """A job's process as ``rejoin`` reads it: ``wait_boot`` and ``wait_for`` answer as the real
    one does (a line, TimeoutError when none came, RuntimeError when the process ended first)."""

    def __init__(self, name: str, *, boots: bool = True, exit_code: int | None = None) -> None:
        self.name, self.boots = name, boots
        self.proc = _Popen(exit_code)
        self.boot: Boot | None = None
        self.lines = ["meshd: starting"]

    def alive(self) -> bool:
        return self.proc.returncode is None

    def wait_for(self, pred, timeout: float, what: str, start: int | None = None) -> str:
        if self.proc.returncode is not None:
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before printing {what}; "
                               f"last lines: {self.lines[-5:]}")
        if what == "boot line" and not self.boots:
            raise TimeoutError(f"{self.name}: no {what} within {timeout:.0f}s; last lines: {self.lines[-5:]}")
        return f"meshd dashboard url=http://{self.name}.test"

    def wait_boot(self, timeout: float = 15.0) -> Boot:
        self.wait_for(lambda s: True, timeout, "boot line")
        self.boot = Boot("ab" * 32, PEER_OF[self.name], "stage", "-", "127.0.0.1:1", "-")
        return self.boot


class _Driver:
    def __init__(self, procs: dict[str, _Proc]) -> None:
        self.procs = procs


def _snapshot(job: str, ready: dict) -> dict:
    """A node that sees every other alive over a probed direct path, and whose name table
    resolves every pipeline name to one live owner."""
    members = [{"prefix": peer, "state": "alive", "path_out": "direct", "path_checks": 3}
               for peer, other in PREFIXES.items() if other != job]
    names = {name: {"resolves": True, "live": ["x"]}
             for name in ("pp-entry", "pp-exit", "pp-stage-0", "pp-stage-1", "pp-orchestrator")}
    return {"members": members, "names": names, "readiness": ready}


def _client(orchestrator_ready: dict) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        job = request.url.host.removesuffix(".test")
        ready = orchestrator_ready if job == "orchestrator" else {"ready": True, "why": []}
        return httpx.Response(200, json=_snapshot(job, ready))

    return httpx.Client(transport=httpx.MockTransport(answer))


def _boards() -> dict[str, Dashboard]:
    return {job: Dashboard(f"http://{job}.test", {}) for job in PREFIXES.values()}


def _rejoin(procs: dict[str, _Proc], orchestrator_ready: dict) -> None:
    driver = _Driver({job: procs.get(job) or _Proc(job) for job in PREFIXES.values()})
    with _client(orchestrator_ready) as client:
        rejoin(client, driver, _boards(), PREFIXES, 2, ["orchestrator"], 0, Progress(False))  # type: ignore[arg-type]


READY = {"ready": True, "why": []}


def test_a_restarted_orchestrator_back_and_ready_rejoins():
    _rejoin({}, READY)


def test_a_restarted_orchestrator_that_never_boots_fails_naming_it_and_the_line_it_waited_for():
    with pytest.raises(RunFailed) as caught:
        _rejoin({"orchestrator": _Proc("orchestrator", boots=False)}, READY)
    failure = caught.value.failure
    assert failure.kind is Kind.TIMEOUT and failure.status == "timeout"
    assert "after restarting orchestrator (0a0a0a0a)" in failure.reason
    assert "no boot line within 0s" in failure.reason
    assert "\n" not in failure.reason


def test_a_restarted_orchestrator_that_exits_again_fails_as_that_exit():
    with pytest.raises(RunFailed) as caught:
        _rejoin({"orchestrator": _Proc("orchestrator", exit_code=1)}, READY)
    failure = caught.value.failure
    assert (failure.kind, failure.status, failure.job) == (Kind.EXITED, "exited (1)", "orchestrator")
    assert failure.reason.startswith("after restarting orchestrator (0a0a0a0a): orchestrator exited (1)")


def test_a_restarted_orchestrator_seen_by_all_but_not_ready_fails_saying_why_it_cannot_serve():
    """A new orchestrator holds no request: the run sends its request again only once the
    orchestrator says the pipeline can serve, and otherwise says what it waited for."""
    with pytest.raises(RunFailed) as caught:
        _rejoin({}, {"ready": False, "why": ["stage-1: no path from stage-0 (1b1b1b1b)"]})
    reason = caught.value.failure.reason
    assert reason.startswith("after restarting orchestrator: not converged within 0s")
    assert "the orchestrator is not ready: stage-1: no path from stage-0 (1b1b1b1b)" in reason
