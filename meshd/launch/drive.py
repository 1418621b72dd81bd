"""Driving a smoke run: the testbed, the model, the mesh converging, one generation (two when
a ``relay-down`` fault comes after the first has ended: the second runs with the relay down),
and with ``--streams`` the other requests sent at once beside it (:class:`Beside`).

Each step talks to live processes over their dashboards and raises
:class:`~meshd.launch.failure.RunFailed` with a :class:`~meshd.launch.failure.Failure`
naming what went wrong.  The orchestrator's API reports a failed generation as text;
:func:`orchestrator_failure` reads it into a Failure once, where the stream is read.
The stream's ``meshd`` objects carry each token, the request's id and, at the end, the
failovers the request went through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..swim import LOCAL
from .checks import Snapshot, cut_off, names_short, owners_needed, paths, sees_all
from .disrupt import Disruptor, RelayDowns
from .docker import DockerError, DockerProvider
from .failure import Failure, Kind, RunFailed
from .jobs import JobDriver
from .local import LocalProcess, free_ports
from .netns import NetnsError, NetnsProvider
from .plan import FaultPlan, RunPlan, plan_faults
from .process import MeshProcess
from .report import Progress

if TYPE_CHECKING:
    import httpx

# How long a pair that reads asymmetric after the generation is read again (see ``settled``):
# three probe periods of the `local` profile the run's nodes use, each of which rechecks it.
SETTLE_S = 3 * LOCAL.probe_interval
# The detail may hold one level of parentheses: "peer 65fd2979 stage-1 (65fd2979) is down: ..."
_LOST = re.compile(r"^lost: (?P<job>[\w.-]+) \((?P<detail>(?:[^()]|\([^()]*\))*)\)(?P<more>.*)$")
_PEER = re.compile(r"\bpeer (?P<peer>[0-9a-f]{8})\b")


@dataclass(frozen=True)
class Placement:
    """Where the jobs listen, and the run-level faults turned into a plan."""

    relays: dict[str, str]  # relay job -> HOST:PORT, the first (``relay``) first
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
    request: str | None = None  # the orchestrator's id for it, as the stream says
    failovers: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # as the stream reports them


@dataclass(frozen=True)
class Driven:
    """What driving the started mesh measured."""

    converge_s: float
    generation: Generation
    final: dict[str, Snapshot]  # the nodes still alive after the generation, by run name
    again: Generation | None = None  # generated again once relay-down faults late for the first came
    again_after: list[str] = dataclasses.field(default_factory=list)  # those faults' specs
    # The other streams when the run sent several at once, in order: each one's prompt, tokens
    # and failovers (as the orchestrator reports them).
    others: list[Other] = dataclasses.field(default_factory=list)


@dataclass(frozen=True)
class Other:
    """A stream sent beside the first (``--streams``), as it ended."""

    prompt: str
    sampling: dict[str, Any]  # temperature, top_k, seed: as sent, for its reference
    tokens: list[int]
    failovers: list[dict[str, Any]]


def other_requests(prompt: str, streams: int) -> list[tuple[str, dict[str, Any]]]:
    """The (prompt, sampling) of each request sent beside the first: each its own prompt, so
    each is checked against its own reference; every other one sampled (temperature 0.8,
    top-k 20, its own seed), the rest greedy."""
    return [(f"{prompt}, {k}", {"temperature": 0.8, "top_k": 20, "seed": k} if k % 2 else
             {"temperature": 0.0, "top_k": 0, "seed": 0}) for k in range(2, streams + 1)]


class Beside:
    """The run's other streams: requests sent at once beside the first (``--streams``), so
    the stages batch them.  Each goes in a thread and client of its own, whole (not
    streamed), through the run's faults as the first does; ``wait`` gives their tokens, or
    fails the run naming the stream that failed and why."""

    def __init__(self, board: Dashboard, requests: list[tuple[str, dict[str, Any]]], max_tokens: int,
                 timeout: float) -> None:
        self.board, self.requests, self.max_tokens, self.timeout = board, requests, max_tokens, timeout
        self.results: dict[int, Other | Failure] = {}
        self._threads = [threading.Thread(target=self._one, args=(k,), daemon=True,
                                          name=f"smoke-stream-{k + 2}") for k in range(len(requests))]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _one(self, k: int) -> None:
        import httpx

        prompt, sampling = self.requests[k]
        what = f"stream {k + 2} ({prompt!r})"
        body = {"prompt": prompt, "max_tokens": self.max_tokens, **sampling}
        try:
            # The answer comes whole at the end: the read timeout is the whole generation's.
            with httpx.Client(timeout=httpx.Timeout(self.timeout, connect=10)) as client:
                r = client.post(f"{self.board.url}/api/generate", json=body, headers=self.board.headers)
        except httpx.TimeoutException:
            self.results[k] = Failure.timeout(f"{what} got no answer within {self.timeout:g}s")
            return
        except httpx.HTTPError as exc:
            self.results[k] = Failure.error(f"{what} broke: {type(exc).__name__}: {exc}")
            return
        try:
            answer = r.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            answer = {}
        if r.status_code != 200 or not isinstance(answer.get("tokens"), list):
            error = answer.get("error")
            self.results[k] = Failure.error(f"{what} failed: {r.status_code} {error or r.text[:200]}")
            return
        failovers = answer.get("failovers")
        self.results[k] = Other(prompt, sampling, answer["tokens"],
                                failovers if isinstance(failovers, list) else [])

    def wait(self, progress: Progress) -> list[Other]:
        """Each other stream, once all have ended; RunFailed for the first that failed, or for
        one still running ``timeout`` seconds after the first stream ended."""
        deadline = time.monotonic() + self.timeout
        for k, thread in enumerate(self._threads):
            if thread.is_alive():
                progress.update(f"waiting for stream {k + 2} of {len(self._threads) + 1}")
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise RunFailed(Failure.timeout(f"stream {k + 2} ({self.requests[k][0]!r}) had not ended "
                                                f"{self.timeout:g}s after the first"))
        out = []
        for k in range(len(self.requests)):
            result = self.results[k]
            if isinstance(result, Failure):
                raise RunFailed(result)
            out.append(result)
        return out


def check_prompts_fit(model: str | None, prompt: str, streams: int, max_tokens: int, stages: int = 1) -> None:
    """Every prompt the run sends (the first and ``other_requests``') with ``max_tokens``
    fits the checkpoint's context; ValueError (``meshd generate``'s words) when one does not.
    ``model`` None: the preset ``prepare_model`` would write for ``stages``, read from its
    definition, so the check needs no checkpoint on disk."""
    from ..pipeline.config import LlamaConfig
    from ..pipeline.generate import check_context, prompt_ids
    from ..pipeline.tokenizer import Tokenizer, load_tokenizer

    tokenizer: Tokenizer
    if model is None:
        from ..pipeline.checkpoint import preset_config, preset_tokenizer

        config = preset_config(default_preset(stages))
        tokenizer = preset_tokenizer(default_preset(stages))
    else:
        config = LlamaConfig.load(model)
        tokenizer = load_tokenizer(model, config.bos_token_id, config.eos_token_ids)
    for text in [prompt, *(p for p, _ in other_requests(prompt, streams))]:
        check_context(config, len(prompt_ids(tokenizer, text)), max_tokens)


def default_preset(stages: int) -> str:
    """The checkpoint a run without ``--model`` or ``--stub`` writes: ``small``, or ``deep`` for
    more stages than ``small`` has layers."""
    from ..pipeline.checkpoint import PRESETS

    return "small" if stages <= PRESETS["small"]["num_hidden_layers"] else "deep"


def prepare_model(model: str | None, stub: bool, tmp: Path, progress: Progress, stages: int = 1) -> str:
    """The checkpoint to serve: the given one, the stub, or one written to ``tmp``: the
    ``default_preset`` for ``stages``."""
    if stub:
        from ..pipeline.stub import stub_checkpoint

        return str(stub_checkpoint())
    if model is None:
        from ..pipeline.checkpoint import init_checkpoint

        preset = default_preset(stages)
        progress.update(f"writing a {preset} checkpoint")
        model = str(tmp / "model")
        init_checkpoint(model, preset, seed=0)
    return model


def open_netns(relays: list[str], names: list[str], progress: Progress) -> NetnsProvider:
    """A netns testbed for the relays and ``names``, not built yet (see :func:`place_jobs`)."""
    progress.update("building the netns testbed")
    try:
        return NetnsProvider([*relays, *names])
    except NetnsError as exc:
        raise RunFailed(Failure.error(str(exc))) from None


def open_docker(relays: list[str], names: list[str], tmp: Path, model: str,
                progress: Progress) -> DockerProvider:
    """The run's containers' provider: the engine checked, the image ready and the run's
    network made (torn down with the run, see ``DockerProvider.teardown``)."""
    progress.update("checking the Docker engine")
    try:
        return DockerProvider([*relays, *names], tmp, model, progress.update)
    except DockerError as exc:
        raise RunFailed(Failure.error(str(exc))) from None


def place_jobs(provider: NetnsProvider | DockerProvider | None, specs: list[str], names: list[str],
               relays: list[str], max_tokens: int | None = None) -> Placement:
    """Choose every job's address and plan the faults; on netns, build the testbed with its faults.

    ``relays`` are the relay jobs' names, the first first.  ``provider`` None: local processes
    on ports free on loopback now; docker: the run's network made, its addresses fixed.
    """
    try:
        if provider is None:
            ports = free_ports(len(relays) + len(names))
            binds = {n: f"127.0.0.1:{p}" for n, p in zip(relays, ports, strict=False)}
            addrs = {n: f"127.0.0.1:{p}" for n, p in zip(names, ports[len(relays):], strict=True)}
            faults = plan_faults(specs, {**addrs, **binds}, max_tokens)
            return Placement(binds, addrs, faults)
        faults = plan_faults([s for s in specs if not provider.handles(s)], provider.addresses(), max_tokens)
        provider.setup([s for s in specs if provider.handles(s)])  # validates the specs before building
    except (NetnsError, DockerError, ValueError) as exc:
        raise RunFailed(Failure.error(str(exc))) from None
    every = provider.addresses()  # after setup: a job behind NAT has its inside address
    return Placement({n: every[n] for n in relays}, {n: every[n] for n in names}, faults)


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


def job_snapshot(client: httpx.Client, board: Dashboard, proc: MeshProcess) -> Snapshot:
    """The job's :func:`snapshot`; a dashboard that does not answer fails the run naming the
    job and its peer prefix: as exited when the process has ended (a crashed or killed node's
    port refuses), else with what the request met."""
    import httpx

    try:
        return snapshot(client, board)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an answer that is not JSON
        try:
            code = proc.proc.wait(timeout=1)  # a refused port: most often a process going down
        except subprocess.TimeoutExpired:
            code = None
        who = f"{proc.name} ({proc.boot.prefix})" if proc.boot is not None else proc.name
        if code is not None:
            raise RunFailed(Failure.exited(proc.name, code, f"{who} exited: {proc.lines[-3:]}")) from None
        raise RunFailed(Failure.error(f"{who}: its dashboard {board.url} did not answer: "
                                      f"{type(exc).__name__}: {exc}")) from None


def converge(client: httpx.Client, driver: JobDriver, boards: dict[str, Dashboard],
             prefixes: dict[str, str], needed: dict[str, int], timeout: float,
             progress: Progress | None = None, ready: bool = False) -> float:
    """Wait until every node of ``boards`` sees every other alive over a measured path and the
    orchestrator resolves every ``needed`` name to its live owners (and, with ``ready``, says
    the pipeline can serve: its readiness); returns the seconds it took."""
    t_conv = time.monotonic()
    deadline = t_conv + timeout
    peer_of = {job: peer for peer, job in prefixes.items()}
    while True:
        snaps = {n: job_snapshot(client, board, driver.procs[n]) for n, board in boards.items()}
        seeing = [n for n, snap in snaps.items() if sees_all(snap, {peer_of[o] for o in boards if o != n})]
        short = names_short(snaps["orchestrator"]["names"], needed)
        not_ready = not_serving(snaps["orchestrator"]) if ready else []
        if len(seeing) == len(snaps) and not short and not not_ready:
            return time.monotonic() - t_conv
        if progress is not None:
            progress.update(f"converging: {len(seeing)} of {len(snaps)} nodes see every other alive"
                            + (f"; unresolved: {', '.join(short)}" if short else "")
                            + (f"; orchestrator not ready: {'; '.join(not_ready)}" if not_ready else "")
                            + f" ({time.monotonic() - t_conv:.0f}s)")
        for n in boards:
            p = driver.procs[n]
            if not p.alive():
                raise RunFailed(Failure.exited(p.name, p.proc.returncode,
                                               f"{p.name} exited while converging: {p.lines[-3:]}"))
        if time.monotonic() > deadline:
            why = f"not converged within {timeout:g}s; unresolved: {', '.join(short) or 'none'}"
            if not_ready:
                why += f"; the orchestrator is not ready: {'; '.join(not_ready)}"
            cut = cut_off(snaps, prefixes)
            if cut:  # by run name and peer prefix, as the nodes' logs name them
                why += "; cut off: " + ", ".join(f"{job} ({peer_of[job]})" if job in peer_of else job
                                                 for job in cut)
            raise RunFailed(Failure.unreachable(cut, why) if cut else Failure.timeout(why))
        time.sleep(0.2)


def not_serving(snap: Snapshot) -> list[str]:
    """Why the node's readiness says the pipeline cannot serve now; empty when it can."""
    readiness = snap.get("readiness")
    if not isinstance(readiness, dict):
        return ["it reports no readiness"]
    if readiness.get("ready") is True:
        return []
    why = readiness.get("why")
    return [str(w) for w in why] if isinstance(why, list) and why else ["not ready"]


def converge_and_generate(driver: JobDriver, boards: dict[str, Dashboard], prefixes: dict[str, str],
                          plan: RunPlan, prompt: str, max_tokens: int, timeout: float,
                          progress: Progress, disruptions: list[dict[str, Any]], streams: int = 1) -> Driven:
    """Wait for the mesh to converge, then generate once with the run's faults (and, with
    ``streams`` over 1, that many requests at once: see ``Beside``); after a restart, wait
    for the restarted nodes to take their place back; snapshot the nodes still up.

    A ``relay-down`` fault that has not come when the generation ends is waited for, and the
    run generates once more with that relay down (``Driven.again``): a fault that never met a
    generation would test nothing.  ``disruptions`` collects the faults as they are carried out.
    """
    import httpx

    faults = plan.faults
    progress.update("converging")
    with httpx.Client(timeout=10) as client:
        converge_s = converge(client, driver, boards, prefixes, owners_needed(plan.stages, boards), timeout,
                              progress)
        progress.log(f"converged in {converge_s:.1f}s: " + " ".join(f"{p}={n}" for p, n in prefixes.items()))
        downs = RelayDowns(faults.relay_downs, driver, plan.relay_urls, progress, disruptions)
        downs.start()
        progress.update("generating")
        disruptor = Disruptor(faults.kills, driver, _requests_asker(client, boards["orchestrator"]), prefixes,
                              progress, disruptions)
        beside = Beside(boards["orchestrator"], other_requests(prompt, streams), max_tokens, timeout)
        beside.start()
        rejoined = False
        try:
            generation = generate(client, boards["orchestrator"], prompt, max_tokens, timeout, disruptor,
                                  prefixes, progress)
        except RunFailed as exc:
            master = _master_fault(disruptions)
            if master is None:
                raise
            if master["action"] == "kill":
                raise RunFailed(_master_killed(driver, master, "the request went with it",
                                               exc.failure.reason)) from None
            # The orchestrator holds its clients' requests: a new process of it has none of them.
            # Once it is back, with its key, every request is sent again and checked as ever.
            progress.log(f"the orchestrator restarted after token {master['token']}: the requests in flight "
                         "went with its process; sending them again once it is back")
            with contextlib.suppress(RunFailed):
                beside.wait(progress)  # their streams broke with it
            rejoin(client, driver, boards, prefixes, plan.stages, disruptor.restarted, timeout, progress)
            rejoined = True
            master["reissued"] = True
            beside = Beside(boards["orchestrator"], other_requests(prompt, streams), max_tokens, timeout)
            beside.start()
            generation = generate_again(client, driver, boards, prefixes, plan.stages, prompt, max_tokens,
                                        timeout, progress, "after the orchestrator's restart")
        else:
            master = _master_fault(disruptions)
            if master is not None and master["action"] == "kill":
                # Its last tokens were on their way as it was killed: the run still has no orchestrator.
                raise RunFailed(_master_killed(driver, master, "its stream had ended as it was killed"))
        progress.log(f"generated {len(generation.tokens)} tokens in {generation.gen_s:.1f}s, "
                     f"{len(generation.tokens) / max(generation.gen_s, 1e-9):.1f} tokens/s")
        others = beside.wait(progress)
        if others:
            progress.log(f"{len(others)} more streams at once: {sum(len(o.tokens) for o in others)} tokens")
        if disruptor.restarted and not rejoined:
            rejoin(client, driver, boards, prefixes, plan.stages, disruptor.restarted, timeout, progress)
        again, late = None, [d.spec for d in downs.pending]
        if late:
            progress.update(f"waiting for {', '.join(late)}")
            downs.wait()
            again = generate_again(client, driver, boards, prefixes, plan.stages, prompt, max_tokens, timeout,
                                   progress, f"after {', '.join(late)}")
        final = settled(client, driver, boards, prefixes, progress)
    return Driven(converge_s, generation, final, again, late, others)


def _master_fault(done: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``kill:`` or ``restart:`` fault carried out on the orchestrator, if one was."""
    return next((d for d in done if d.get("job") == "orchestrator" and d["action"] in ("kill", "restart")),
                None)


def _master_killed(driver: JobDriver, master: dict[str, Any], what: str, seen: str | None = None) -> Failure:
    """The failure of a run whose orchestrator a ``kill:`` fault ended: it exited as killed, and
    nothing serves the run's clients after it.  ``seen``: what the request met, when it broke."""
    proc = driver.procs["orchestrator"]
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.proc.wait(5)
    reason = (f"the orchestrator was killed after token {master['token']} (--fault {master['fault']}): "
              f"{what}, and no orchestrator serves the run" + (f" ({seen})" if seen else ""))
    code = proc.proc.returncode
    return Failure.error(reason) if code is None else Failure.exited("orchestrator", code, reason)


def settled(client: httpx.Client, driver: JobDriver, boards: dict[str, Dashboard], prefixes: dict[str, str],
            progress: Progress) -> dict[str, Snapshot]:
    """The snapshots of the nodes still up, once their paths settle.

    A direction moves to the relay when one direct ping goes unanswered within the probe
    timeout: on a loaded host, a node late to answer once.  The next probe period rechecks
    it, and one direct answer moves it back.  So a pair that reads asymmetric is read again
    for up to SETTLE_S, and reported only if it still is: a drop that lasts stays
    asymmetric, and its direct failures count in the paths either way."""
    def read() -> dict[str, Snapshot]:
        return {n: job_snapshot(client, board, driver.procs[n]) for n, board in boards.items()
                if driver.procs[n].alive()}

    final = read()
    deadline = time.monotonic() + SETTLE_S
    while (pairs := paths(final, alive_prefixes(prefixes, final))[1]) and time.monotonic() < deadline:
        progress.update(f"settling: {len(pairs)} asymmetric pair(s) rechecked for up to {SETTLE_S:g}s")
        time.sleep(0.25)
        final = read()
    return final


def alive_prefixes(prefixes: dict[str, str], final: dict[str, Snapshot]) -> dict[str, str]:
    return {peer: job for peer, job in prefixes.items() if job in final}  # not a killed replica


def generate_again(client: httpx.Client, driver: JobDriver, boards: dict[str, Dashboard],
                   prefixes: dict[str, str], stages: int, prompt: str, max_tokens: int, timeout: float,
                   progress: Progress, after: str) -> Generation:
    """Check the live nodes still make a whole mesh, then generate once more (no kill faults)."""
    alive = {n: board for n, board in boards.items() if driver.procs[n].alive()}
    try:
        converge(client, driver, alive, prefixes, owners_needed(stages, alive), timeout)
    except RunFailed as exc:
        raise RunFailed(dataclasses.replace(exc.failure, reason=f"{after}: {exc.failure.reason}")) from None
    progress.update(f"generating again, {after}")
    board = boards["orchestrator"]
    nothing = Disruptor([], driver, _requests_asker(client, board), prefixes, progress, [])
    try:
        return generate(client, board, prompt, max_tokens, timeout, nothing, prefixes, progress)
    except RunFailed as exc:
        raise RunFailed(dataclasses.replace(exc.failure, reason=f"{after}: {exc.failure.reason}")) from None


def rejoin(client: httpx.Client, driver: JobDriver, boards: dict[str, Dashboard], prefixes: dict[str, str],
           stages: int, restarted: list[str], timeout: float, progress: Progress) -> None:
    """Wait until the restarted nodes are back with their keys and the live nodes have converged
    again; ``boards`` gets the restarted nodes' new dashboards."""
    progress.update(f"waiting for {', '.join(restarted)} to rejoin")
    peer_of = {job: peer for peer, job in prefixes.items()}
    for job in restarted:
        if job not in boards:
            continue  # the relay: no dashboard, nothing to rejoin
        proc = driver.procs[job]
        after = f"after restarting {job} ({peer_of[job]})"
        try:
            boot = proc.wait_boot(timeout)
            if boot.prefix != peer_of[job]:
                raise RunFailed(Failure.error(f"{job} restarted as {boot.prefix}, not {peer_of[job]}: "
                                              "it did not keep its key"))
            boards[job] = dashboard(proc, timeout)
        except TimeoutError as exc:  # "orchestrator: no boot line within 60s; last lines: [..]"
            raise RunFailed(Failure.timeout(f"{after}: {exc}")) from None
        except RuntimeError as exc:  # it exited before printing it
            raise RunFailed(Failure.exited(job, proc.proc.returncode, f"{after}: {exc}")) from None
    alive = {n: board for n, board in boards.items() if driver.procs[n].alive()}
    try:
        # A new orchestrator has no request of its own: it must say it can serve before one is sent.
        took = converge(client, driver, alive, prefixes, owners_needed(stages, alive), timeout,
                        ready="orchestrator" in restarted)
    except RunFailed as exc:
        reason = f"after restarting {', '.join(restarted)}: {exc.failure.reason}"
        raise RunFailed(dataclasses.replace(exc.failure, reason=reason)) from None
    progress.log(f"{', '.join(restarted)} rejoined; converged again in {took:.1f}s")


def _requests_asker(client: httpx.Client, board: Dashboard) -> Callable[[], Any]:
    """A call that returns the orchestrator's ``GET /api/requests`` answer; ValueError when it cannot."""
    import httpx

    def ask() -> Any:
        try:
            r = client.get(f"{board.url}/api/requests", headers=board.headers)
        except httpx.HTTPError as exc:
            raise ValueError(f"GET /api/requests: {exc}") from exc
        if r.status_code != 200:
            raise ValueError(f"GET /api/requests answered {r.status_code}")
        return r.json()  # a JSONDecodeError is a ValueError

    return ask


def generate(client: httpx.Client, board: Dashboard, prompt: str, max_tokens: int, timeout: float,
             disruptor: Disruptor, prefixes: dict[str, str], progress: Progress) -> Generation:
    """Stream one completion from the orchestrator, carrying out the ``kill:`` / ``restart:`` faults.

    A stream that stalls for ``timeout`` seconds fails the run as a timeout, naming the tokens so far.
    """
    import httpx

    tokens: list[int] = []
    request: str | None = None
    failovers: list[dict[str, Any]] = []
    first_token_s, t_gen = None, time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    try:
        with client.stream("POST", f"{board.url}/v1/completions", json=body, headers=board.headers,
                           timeout=httpx.Timeout(timeout, connect=10)) as r:
            for extra in _stream_meshd(r, prefixes):
                request = extra.get("request", request)
                if isinstance(extra.get("failovers"), list):
                    failovers = extra["failovers"]
                if "token" not in extra:
                    continue
                tokens.append(extra["token"])
                first_token_s = first_token_s or time.monotonic() - t_gen
                rate = len(tokens) / max(time.monotonic() - t_gen, 1e-9)
                progress.update(f"generating: {len(tokens)}/{max_tokens} tokens, {rate:.1f} tokens/s")
                disruptor.after_token(len(tokens), request)
    except httpx.TimeoutException:
        raise RunFailed(Failure.timeout(f"the generation stalled: no token within {timeout:g}s after "
                                        f"{len(tokens)} of {max_tokens}")) from None
    except httpx.HTTPError as exc:
        # Only the orchestrator's process going away (or the network to it) breaks its stream.
        raise RunFailed(Failure.error(f"the orchestrator's stream ({board.url}) broke after {len(tokens)} "
                                      f"tokens: {exc or type(exc).__name__}")) from None
    return Generation(tokens, first_token_s, time.monotonic() - t_gen, request, failovers)


def _stream_meshd(r: httpx.Response, prefixes: dict[str, str]) -> Iterator[dict[str, Any]]:
    """The ``meshd`` objects of a streamed completion, as they come; RunFailed for an error in
    the stream (naming the job by ``prefixes`` when it names a peer)."""
    if r.status_code != 200:
        r.read()
        raise RunFailed(Failure.error(f"orchestrator answered {r.status_code}: {r.text}"))
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk: dict[str, Any] = json.loads(line[6:])
        if "error" in chunk:  # OpenAI's shape: {"error": {"message", "type", ...}}
            failure = chunk["error"]
            message = failure.get("message", "") if isinstance(failure, dict) else str(failure)
            raise RunFailed(orchestrator_failure(message, prefixes))
        extra = chunk.get("meshd")
        if isinstance(extra, dict):
            yield extra


def orchestrator_failure(message: str, prefixes: dict[str, str] | None = None) -> Failure:
    """The orchestrator's error text as a Failure: ``lost: stage-2 (peer 2b91108e dead)``
    names the stage and its peer, and what follows (``, and no replica to take over``) is the
    reason; anything else is an error.

    With ``prefixes`` (peer prefix -> job), the failure names the job that peer is, so a
    lost replica reads ``lost: stage-2.2 (peer 2b91108e dead)``.
    """
    if not message.startswith("lost: "):
        return Failure.error(message)
    m = _LOST.match(message)
    if m is None:  # a loss we cannot tie to a job: the status still says it
        return Failure(Kind.LOST, message, "lost")
    peer = _PEER.search(m["detail"])
    job = (prefixes or {}).get(peer["peer"], m["job"]) if peer else m["job"]
    more = m["more"].strip(" ,.;")
    reason = more.removeprefix("and ") if more else "lost"
    return Failure.lost(job, m["detail"], peer["peer"] if peer else None, reason)
