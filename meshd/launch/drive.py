"""Driving a smoke run: the testbed, the model, the mesh converging, one generation.

Each step talks to live processes over their dashboards and raises
:class:`~meshd.launch.failure.RunFailed` with a :class:`~meshd.launch.failure.Failure`
naming what went wrong.  The orchestrator's API reports a failed generation as text;
:func:`orchestrator_failure` reads it into a Failure once, where the stream is read.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checks import Snapshot, cut_off
from .failure import Failure, Kind, RunFailed
from .jobs import JobDriver
from .local import LocalProcess, free_ports
from .netns import NetnsError, NetnsProvider
from .plan import FaultPlan, RunPlan, plan_faults
from .report import Progress

if TYPE_CHECKING:
    import httpx

_LOST = re.compile(r"^lost: (?P<job>[\w-]+) \((?P<detail>.*)\)$")
_PEER = re.compile(r"\bpeer (?P<peer>[0-9a-f]{8})\b")


@dataclass(frozen=True)
class Placement:
    """Where the jobs listen, and the run-level faults turned into a plan."""

    relay_bind: str
    addrs: dict[str, str]  # node job -> gossip HOST:PORT
    faults: FaultPlan


@dataclass(frozen=True)
class Dashboard:
    """A node's dashboard URL and, bound beyond loopback (netns), the token it asks for."""

    url: str
    headers: dict[str, str]


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    first_token_s: float | None  # from the request to the first token
    gen_s: float  # from the request to the end of the stream


@dataclass(frozen=True)
class Driven:
    """What driving the started mesh measured."""

    converge_s: float
    generation: Generation
    final: dict[str, Snapshot]  # the nodes still alive after the generation, by run name


def prepare_model(model: str | None, stub: bool, tmp: Path, progress: Progress) -> str:
    """The checkpoint to serve: the given one, the stub, or a small one written to ``tmp``."""
    if stub:
        from ..pipeline.stub import stub_checkpoint

        return str(stub_checkpoint())
    if model is None:
        from ..pipeline.checkpoint import init_checkpoint

        progress.update("writing a small checkpoint")
        model = str(tmp / "model")
        init_checkpoint(model, "small", seed=0)
    return model


def open_netns(names: list[str], progress: Progress) -> NetnsProvider:
    """A netns testbed for the relay and ``names``, not built yet (see :func:`place_jobs`)."""
    progress.update("building the netns testbed")
    try:
        return NetnsProvider(["relay", *names])
    except NetnsError as exc:
        raise RunFailed(Failure.error(str(exc))) from None


def place_jobs(provider: NetnsProvider | None, specs: list[str], names: list[str]) -> Placement:
    """Choose every job's address and plan the faults; on netns, build the testbed with its faults.

    ``provider`` None: local processes on ports free on loopback now.
    """
    try:
        if provider is None:
            ports = free_ports(len(names) + 1)
            relay_bind = f"127.0.0.1:{ports[0]}"
            addrs = {n: f"127.0.0.1:{p}" for n, p in zip(names, ports[1:], strict=True)}
            return Placement(relay_bind, addrs, plan_faults(specs, {**addrs, "relay": relay_bind}))
        faults = plan_faults([s for s in specs if not provider.handles(s)], provider.addresses())
        provider.setup([s for s in specs if provider.handles(s)])  # validates the specs before building
    except (NetnsError, ValueError) as exc:
        raise RunFailed(Failure.error(str(exc))) from None
    every = provider.addresses()  # after setup: a job behind NAT has its inside address
    return Placement(every["relay"], {n: every[n] for n in names}, faults)


def dashboard(proc: LocalProcess, timeout: float) -> Dashboard:
    prefix = "meshd dashboard url="
    line = proc.wait_for(lambda s: s.startswith(prefix), timeout, prefix.strip())
    url, *rest = line[len(prefix):].split()
    token = next((word[len("token="):] for word in rest if word.startswith("token=")), None)
    return Dashboard(url, {"X-Meshd-Token": token} if token else {})


def snapshot(client: httpx.Client, board: Dashboard) -> Snapshot:
    r = client.get(f"{board.url}/api/snapshot", headers=board.headers)
    r.raise_for_status()
    return r.json()


def converge(client: httpx.Client, driver: JobDriver, boards: dict[str, Dashboard],
             prefixes: dict[str, str], stages: int, timeout: float) -> float:
    """Wait until every node sees every other alive over a measured path and the orchestrator
    resolves every pipeline name; returns the seconds it took."""
    t_conv = time.monotonic()
    want = ["pp-entry", "pp-exit", *(f"pp-stage-{k}" for k in range(stages)), "pp-orchestrator"]
    deadline = t_conv + timeout
    while True:
        snaps = {n: snapshot(client, board) for n, board in boards.items()}
        live = all(sum(m["state"] == "alive" for m in s["members"]) == stages for s in snaps.values())
        # Every direction probed at least once, so the paths reported are measured, not assumed.
        probed = all(m["path_checks"] > 0 for s in snaps.values() for m in s["members"])
        orch_names = snaps["orchestrator"]["names"]
        if live and probed and all(orch_names.get(n, {}).get("resolves") for n in want):
            return time.monotonic() - t_conv
        for p in driver.procs.values():
            if not p.alive():
                raise RunFailed(Failure.exited(p.name, p.proc.returncode,
                                               f"{p.name} exited while converging: {p.lines[-3:]}"))
        if time.monotonic() > deadline:
            missing = [n for n in want if not orch_names.get(n, {}).get("resolves")]
            why = f"not converged within {timeout:g}s; unresolved: {', '.join(missing) or 'none'}"
            cut = cut_off(snaps, prefixes)
            raise RunFailed(Failure.unreachable(cut, why) if cut else Failure.timeout(why))
        time.sleep(0.2)


def converge_and_generate(driver: JobDriver, boards: dict[str, Dashboard], prefixes: dict[str, str],
                          plan: RunPlan, prompt: str, max_tokens: int, timeout: float,
                          progress: Progress) -> Driven:
    """Wait for the mesh to converge, then generate once with the run's faults; snapshot the rest."""
    import httpx

    faults = plan.faults
    progress.update("converging")
    with httpx.Client(timeout=10) as client:
        converge_s = converge(client, driver, boards, prefixes, plan.stages, timeout)
        progress.log(f"converged in {converge_s:.1f}s: " + " ".join(f"{p}={n}" for p, n in prefixes.items()))
        schedule_relay_down(driver, faults.relay_down_s)
        progress.update("generating")
        generation = generate(client, boards["orchestrator"], prompt, max_tokens, timeout, driver,
                              faults.kills, progress)
        final = {n: snapshot(client, board) for n, board in boards.items() if driver.procs[n].alive()}
    return Driven(converge_s, generation, final)


def schedule_relay_down(driver: JobDriver, after_s: float | None) -> None:
    """The ``relay-down@S`` fault: SIGKILL the relay ``after_s`` seconds from now."""
    if after_s is not None:
        relay = driver.procs["relay"]
        threading.Timer(after_s, lambda: relay.signal(signal.SIGKILL)).start()


def generate(client: httpx.Client, board: Dashboard, prompt: str, max_tokens: int, timeout: float,
             driver: JobDriver, kills: list[tuple[str, int]], progress: Progress) -> Generation:
    """Stream one completion from the orchestrator, carrying out the ``kill:X@token-T`` faults."""
    import httpx

    tokens: list[int] = []
    first_token_s, t_gen = None, time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    with client.stream("POST", f"{board.url}/v1/completions", json=body, headers=board.headers,
                       timeout=httpx.Timeout(timeout, connect=10)) as r:
        for token in _stream_tokens(r):
            tokens.append(token)
            first_token_s = first_token_s or time.monotonic() - t_gen
            rate = len(tokens) / max(time.monotonic() - t_gen, 1e-9)
            progress.update(f"generating: {len(tokens)}/{max_tokens} tokens, {rate:.1f} tokens/s")
            for who, at in kills:
                if len(tokens) == at and driver.procs[who].alive():
                    driver.procs[who].signal(signal.SIGKILL)
                    progress.log(f"killed {who} (SIGKILL) after token {at}")
    return Generation(tokens, first_token_s, time.monotonic() - t_gen)


def _stream_tokens(r: httpx.Response) -> Iterator[int]:
    """The tokens of a streamed completion, as they come; RunFailed for an error in the stream."""
    if r.status_code != 200:
        r.read()
        raise RunFailed(Failure.error(f"orchestrator answered {r.status_code}: {r.text}"))
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk: dict[str, Any] = json.loads(line[6:])
        if "error" in chunk:
            raise RunFailed(orchestrator_failure(chunk["error"]))
        extra = chunk.get("meshd")
        if extra is not None:
            yield extra["token"]


def orchestrator_failure(message: str) -> Failure:
    """The orchestrator's error text as a Failure: ``lost: stage-2 (peer 2b91108e dead)``
    names the stage and its peer; anything else is an error."""
    if not message.startswith("lost: "):
        return Failure.error(message)
    m = _LOST.match(message)
    if m is None:  # a loss we cannot tie to a job: the status still says it
        return Failure(Kind.LOST, message, "lost")
    peer = _PEER.search(m["detail"])
    return Failure.lost(m["job"], m["detail"], peer["peer"] if peer else None)
