"""``meshd smoke-run``: R relays + orchestrator + N stages (K replicas each), one generation,
checked token for token against ``meshd generate``, then everything torn down.

This module puts the steps in order and owns what spans them: the signals, the
temp dir, the teardown and the exit code.  The steps live beside it: ``plan``
(fault specs and command lines), ``jobs``, ``drive`` and ``disrupt`` (processes,
convergence, the generation, kills, restarts and relays going down), ``checks``
(convergence, the reference, paths, failovers, relay moves, leftovers) and
``report`` (progress, the summary, the ``--json`` object).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from .. import ctrl_c
from ..argtypes import int_up_to, positive_float, positive_int, utf8_text
from ..keyring import generate_file
from ..net.faults import Faults
from . import checks
from .docker import DockerProvider
from .drive import (
    Driven,
    Generation,
    alive_prefixes,
    check_prompts_fit,
    converge_and_generate,
    dashboard,
    default_preset,
    open_docker,
    open_netns,
    place_jobs,
    prepare_model,
)
from .env import prepare_env
from .failure import Failure, Interrupted, RunFailed
from .jobs import JobDriver
from .local import LocalProcess
from .model import JobStatus, Run, RunStatus, job_status_message, new_run, relay_job_names
from .netns import NetnsProvider
from .plan import RunPlan, job_argvs, node_names, plan_faults
from .report import Generated, Outcome, Progress, print_report, summary
from .state import default_run_dir, next_run_name, save_logs

DEFAULT_PROMPT = "Once upon a time"
# SIGHUP: the terminal closed (an ssh session dropped); the run is torn down as for Ctrl-C.
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass
class _Session:
    """What teardown must undo, as far as the run got."""

    tmp: Path
    driver: JobDriver | None = None
    provider: NetnsProvider | DockerProvider | None = None  # None: the local provider (loopback)

    def fail(self, outcome: Outcome, failure: Failure) -> None:
        outcome.failure = failure
        if self.driver is not None:
            self.driver.record(failure)

    def tear_down(self) -> int:
        """Stop every job, take the testbed and the temp dir down; returns what is left."""
        alive = self.driver.finish() if self.driver is not None else 0
        testbed_left = 0
        if self.provider is not None:
            for sig in _SIGNALS:  # a second ^C must not leave half a testbed behind
                signal.signal(sig, signal.SIG_IGN)
            testbed_left = self.provider.teardown()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return checks.leftovers(alive, testbed_left, self.tmp)


def run_smoke(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    progress = Progress()
    outcome = Outcome(args.stages, args.replicas)
    session = _Session(Path(tempfile.mkdtemp(prefix="meshd-smoke-")))

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signal.Signals(signum).name)

    def noted(signum: int, frame: FrameType | None) -> None:
        # The run's outcome is settled; what is left is undoing it, which must not stop halfway
        # (not even on a terminal gone with a SIGHUP, which a write answers with EIO).
        with contextlib.suppress(OSError):
            print(f"smoke-run: {signal.Signals(signum).name} while tearing down: finishing the teardown",
                  file=sys.stderr, flush=True)

    handlers = {sig: signal.signal(sig, interrupted) for sig in _SIGNALS}
    try:
        try:
            if ctrl_c.lost():  # a Ctrl-C while the modules loaded: stopped before anything started
                raise Interrupted("SIGINT")
            _run(args, session, outcome, progress)
        except RunFailed as exc:
            session.fail(outcome, exc.failure)
        except Interrupted as exc:
            session.fail(outcome, Failure.stopped(str(exc)))
        except (TimeoutError, RuntimeError, OSError) as exc:
            session.fail(outcome, Failure.error(str(exc)))
        finally:
            # Teardown runs to its end whatever comes now, and the report is still printed.
            for sig in _SIGNALS:
                signal.signal(sig, noted)
            with contextlib.suppress(OSError):  # a terminal gone (SIGHUP): tear down all the same
                progress.update("tearing down")
            outcome.leftovers = session.tear_down()
            progress.stop()
        return _report(args, session, outcome, t_start)
    finally:
        for sig, old in handlers.items():
            signal.signal(sig, old)


def _report(args: argparse.Namespace, session: _Session, outcome: Outcome, t_start: float) -> int:
    """Print the run's outcome (JSON, a summary or the full report); returns its exit code."""
    if session.driver is not None:
        if outcome.failure is None and session.driver.run.status is RunStatus.FAILED:
            outcome.failure = _failed_job(session.driver.run)  # the run's record and the report agree
        outcome.run_status = str(session.driver.run.status)
        outcome.jobs = {j.name: job_status_message(j) for j in session.driver.run.jobs}
        outcome.relay_moves = _relay_moves(session.driver, outcome.relays or {})
        if not outcome.ok and outcome.run is not None:  # the temp dir is gone: keep what the jobs said
            procs = session.driver.procs.items()
            outcome.logs = str(save_logs(session.driver.run_dir, outcome.run, {n: p.lines for n, p in procs}))
    outcome.total_s = time.monotonic() - t_start
    result = outcome.to_json()
    if args.json or not sys.stdout.isatty():
        print(json.dumps(result) if args.json else summary(result), flush=True)
    else:
        print_report(result)
    return outcome.exit_code


def _failed_job(run: Run) -> Failure:
    """Why a run whose generation passed was recorded failed: a job that failed on its own (a
    relay or a node that crashed), found as the run was torn down."""
    job = next((j for j in run.jobs if j.status is JobStatus.FAILED), None)
    if job is None:
        return Failure.error(run.message or "the run was recorded failed")
    return Failure.exited(job.name, job.exit_code, f"{job.name} {job_status_message(job)} during the run")


def _run(args: argparse.Namespace, session: _Session, outcome: Outcome, progress: Progress) -> None:
    """Plan, start, drive and check one run; RunFailed says why it failed."""
    plan = _plan(args, session, outcome, progress)
    driver = _start(args, plan, session, outcome, progress)
    boards = {name: dashboard(driver.procs[name], 30) for name in plan.names}
    prefixes = {_boot_prefix(driver.procs[name]): name for name in plan.names}
    driven = converge_and_generate(driver, boards, prefixes, plan, args.prompt, args.max_tokens,
                                   args.timeout, progress, outcome.disruptions, args.streams)
    outcome.failovers = checks.failovers(driven.generation.failovers, prefixes)
    progress.update("checking against meshd generate")
    outcome.generated = _check(plan, args, driven, prefixes)
    if not outcome.generated.matches_reference:
        session.fail(outcome, Failure.mismatch())


def _plan(args: argparse.Namespace, session: _Session, outcome: Outcome, progress: Progress) -> RunPlan:
    names = node_names(args.stages, args.replicas)
    relays = relay_job_names(args.relays)
    # Absolute: a container's working directory is not ours, and the job's --model must name
    # the path its checkpoint is mounted at.
    model = str(Path(prepare_model(args.model, args.stub, session.tmp, progress, args.stages)).resolve())
    try:  # the run's own checkpoint: before any process starts
        check_prompts_fit(model, args.prompt, args.streams, args.max_tokens, args.stages)
    except ValueError as exc:
        raise RunFailed(Failure.error(str(exc))) from None
    if args.provider == "netns":
        session.provider = open_netns(relays, names, progress)  # torn down even if building it fails
    elif args.provider == "docker":
        session.provider = open_docker(relays, names, session.tmp, model, progress)
    placement = place_jobs(session.provider, args.fault, names, relays, args.max_tokens)
    provider = session.provider
    if provider is not None:
        outcome.testbed = provider.describe()
    dashboards = {n: provider.dashboard_bind(n) if provider else "127.0.0.1:0" for n in names}
    mesh_key = None
    if not args.insecure_mesh:  # the relays and every node share one, as a real mesh would
        mesh_key = str(session.tmp / "mesh.key")
        generate_file(mesh_key)
    first, *others = placement.relays.items()
    plan = RunPlan(args.stages, model, first[1], placement.addrs, dashboards, placement.faults,
                   str(session.tmp / "snapshots"), str(session.tmp / "keys"), args.replicas, mesh_key,
                   dict(others))
    outcome.relays = plan.relay_urls
    return plan


def _start(args: argparse.Namespace, plan: RunPlan, session: _Session, outcome: Outcome,
           progress: Progress) -> JobDriver:
    """Record the run in the run dir and start its jobs in the startup order."""
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    run = new_run(next_run_name(run_dir), plan.stages, now=time.time(), replicas=plan.replicas,
                  relay=len(plan.relays), startup_order=args.startup_order, stop_criteria=args.stop_criteria)
    outcome.run = run.name
    spawn = session.provider.spawn if session.provider else LocalProcess
    driver = JobDriver(run, run_dir, job_argvs(plan), prepare_env(run, run_dir, plan.addrs), progress, spawn)
    session.driver = driver
    driver.observe()
    driver.wait_started([*plan.relays, *plan.names], args.timeout)
    return driver


def _relay_moves(driver: JobDriver, relays: dict[str, str]) -> list[dict[str, Any]]:
    """The relay moves every node printed, whatever became of the run (a failed run's too)."""
    nodes = {name: proc for name, proc in driver.procs.items() if name not in relays}
    prefixes = {proc.boot.prefix: name for name, proc in nodes.items() if proc.boot is not None}
    return checks.relay_moves({name: list(proc.lines) for name, proc in nodes.items()}, prefixes, relays)


def _boot_prefix(proc: LocalProcess) -> str:
    if proc.boot is None:  # wait_started saw every node's boot line
        raise RunFailed(Failure.error(f"{proc.name} is up but printed no boot line"))
    return proc.boot.prefix


def _check(plan: RunPlan, args: argparse.Namespace, driven: Driven, prefixes: dict[str, str]) -> Generated:
    gen = driven.generation
    ref = checks.compare_with_reference(plan.model, args.prompt, args.max_tokens, gen.tokens)
    up = alive_prefixes(prefixes, driven.final)
    paths, asymmetric = checks.paths(driven.final, up)
    others = []
    for o in driven.others:  # each against its own reference, by the same rule
        other = checks.compare_with_reference(plan.model, o.prompt, args.max_tokens, o.tokens, **o.sampling)
        others.append({"prompt": o.prompt, "sampling": o.sampling, "tokens": o.tokens,
                       "matches_reference": other.matches,
                       "near_ties": other.near_ties, "diverged_at": other.diverged_at,
                       "failovers": checks.failovers(o.failovers, prefixes)})
    again: dict[str, Any] | None = None
    if (second := driven.again) is not None:
        again = {"after": ", ".join(driven.again_after), "tokens": second.tokens,
                 "matches_reference": ref.judge(second.tokens),
                 "first_token_s": None if second.first_token_s is None else round(second.first_token_s, 3),
                 "tokens_per_s": _rate(second)}
    return Generated(
        tokens=gen.tokens, text=ref.text, reference_tokens=ref.tokens, near_ties=ref.near_ties,
        diverged_at=ref.diverged_at,
        matches_reference=(ref.matches and (again is None or again["matches_reference"])
                           and all(o["matches_reference"] for o in others)),
        stage_map=prefixes, paths=paths, asymmetric=asymmetric, converge_s=driven.converge_s,
        first_token_s=gen.first_token_s, tokens_per_s=_rate(gen), again=again,
        nat={job: snap["self"].get("nat") for job, snap in sorted(driven.final.items())},
        other_streams=others,
    )


def _rate(gen: Generation) -> float | None:
    return round(len(gen.tokens) / gen.gen_s, 2) if gen.gen_s > 0 else None


def add_parser(sub: Any) -> None:
    p = sub.add_parser("smoke-run", help="relay, orchestrator, N stages: one generation, checked, torn down",
                       description="Start a relay (or R), an orchestrator and N stage nodes (K replicas "
                                   "each) on loopback, generate, compare with `meshd generate` token for "
                                   "token, and tear everything down. Exit 0 only if the run passed.")
    p.add_argument("--stages", type=_stages, required=True, metavar="N",
                   help="pipeline stages, each its own `meshd run` process (at most 16; the model "
                        "needs a layer per stage)")
    p.add_argument("--replicas", type=_replicas, default=1, metavar="K",
                   help="nodes per stage: stage-K, stage-K.2, ... (default 1)")
    p.add_argument("--relays", type=_relays, default=1, metavar="R",
                   help="relays: relay, relay-2, ...; every node holds them all, the first first (default 1)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", metavar="DIR",
                       help="checkpoint (default: a `small` one in a temp dir, `deep` past 6 stages)")
    model.add_argument("--stub", action="store_true", help="the tiny built-in model")
    p.add_argument("--prompt", type=utf8_text, default=DEFAULT_PROMPT,
                   help="the text to continue (default %(default)r)")
    p.add_argument("--max-tokens", type=positive_int, default=32, metavar="K",
                   help="tokens to generate, each checked against `meshd generate` (default %(default)s)")
    p.add_argument("--streams", type=_streams, default=1, metavar="S",
                   help="requests at once, so the stages batch them: the first streamed (the one "
                        "--fault counts tokens of), the others beside it with prompts of their own; "
                        "each checked against `meshd generate` (default 1)")
    p.add_argument("--provider", choices=["local", "netns", "docker"], default="local",
                   help="local: loopback processes; netns: a namespace per node, faults as nftables/tc "
                        "(root only); docker: a container per node on an internal network the run makes "
                        "(a running engine; the image is $MESHD_IMAGE, or meshd:latest built from this "
                        "checkout first)")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="drop:A->B, isolate:X, loss:P, delay:MS, kill:X@token-T, restart:X@token-T, "
                        "relay-down@SECONDS (the first relay; relay-down:relay-2@SECONDS another), nat:X "
                        "and nat-symmetric:X (netns); with replicas, kill:stage-K / restart:stage-K hit "
                        "the replica serving the request, stage-K.j names one")
    p.add_argument("--startup-order", choices=["any", "master-first", "workers-first"], default="any",
                   help="which jobs start first, as dstack's startup_order: the orchestrator "
                        "(master-first), the stages (workers-first), or all at once (default %(default)s)")
    p.add_argument("--stop-criteria", choices=["all-done", "master-done"], default="master-done",
                   help="when the run ends, as dstack's stop_criteria: once the orchestrator is done "
                        "(master-done), or every job (all-done) (default %(default)s)")
    p.add_argument("--timeout", type=positive_float, default=60.0, metavar="S",
                   help="how long each wait may take: the jobs starting, convergence, the generation "
                        "(default %(default)s)")
    p.add_argument("--run-dir", type=_run_dir, metavar="DIR",
                   help="where run state is kept (default $XDG_STATE_HOME/meshd/runs, else "
                        "~/.local/state/meshd/runs, as for meshd ps)")
    p.add_argument("--insecure-mesh", action="store_true",
                   help="run without a mesh key (by default the run makes one and gives it to the relay "
                        "and every node)")
    p.add_argument("--json", action="store_true",
                   help="end with one JSON object on stdout, the run's report (a refusal before the run "
                        "starts is one line on stderr and exit 2, as without --json)")
    p.set_defaults(func=_cmd_smoke)


def check_faults(args: argparse.Namespace) -> None:
    """Each ``--fault`` as the run would plan it and each node would read its part, before
    anything starts: ValueError names a bad one.  The netns testbed checks its NAT specs."""
    names = node_names(args.stages, args.replicas)
    jobs = relay_job_names(args.relays) + names
    addrs = {name: f"127.0.0.1:{port}" for port, name in enumerate(jobs, start=1)}
    planned = []
    for spec in args.fault:
        if args.provider == "netns" and spec.startswith(("nat:", "nat-symmetric:")):
            if (who := spec.partition(":")[2]) not in names:
                raise ValueError(f"--fault {spec}: no node named {who!r} (have {', '.join(sorted(names))})")
            continue
        for flags in plan_faults([spec], addrs, args.max_tokens).node_faults.values():
            Faults.parse(flags)
        planned.append(spec)
    plan_faults(planned, addrs, args.max_tokens)  # and together (a fault no run would reach)


def _cmd_smoke(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Refuse, in one line and before anything starts, a fault spec the run cannot plan, a
    model that cannot be split so, and prompts and --max-tokens past its context."""
    try:
        check_faults(args)
    except ValueError as exc:
        parser.error(f"smoke-run: {exc}")
    from ..pipeline.checkpoint import CheckpointError, check_headers
    from ..pipeline.config import ConfigError, LlamaConfig
    from ..pipeline.model import split_layers
    from ..pipeline.tokenizer import TokenizerError

    model = args.model
    what = f"--model {model}"
    if args.stub:
        from ..pipeline.stub import stub_checkpoint

        model, what = str(stub_checkpoint()), "--stub"
    elif model is None:
        what = f"the {default_preset(args.stages)} checkpoint it writes (no --model)"
    try:
        if model is not None:  # the default preset splits into every --stages allowed
            config = LlamaConfig.load(model)
            split_layers(config.num_hidden_layers, args.stages)
            check_headers(model, config)  # as each `meshd run` would refuse it, once started
        check_prompts_fit(model, args.prompt, args.streams, args.max_tokens, args.stages)
    except (CheckpointError, ConfigError, TokenizerError, ValueError) as exc:
        print(f"meshd: error: smoke-run: {what}: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    try:  # the default one too ($XDG_STATE_HOME or ~/.local/state), which no argument type checked
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"meshd: error: smoke-run: cannot make the run dir {run_dir}: {exc.strerror or exc} "
              "(give --run-dir DIR)", file=sys.stderr)
        return 2
    return run_smoke(args)


def _run_dir(text: str) -> str:
    """A directory runs can be recorded in, made only when a run starts: it is one, or the
    nearest part of the path that exists is a directory this process can write in."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    probe = Path(text).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not writable")
    return text


_stages = int_up_to(16, "stages on one machine")
_streams = int_up_to(64, "streams (the orchestrator's --max-running)")
_replicas = int_up_to(4, "replicas of a stage on one machine")
_relays = int_up_to(8, "relays on one machine")
