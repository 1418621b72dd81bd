"""What a smoke run will do, decided before any process starts.

Run-level fault specs name nodes by run name; here they become each node's own
``--fault`` flags (``drop:A->B`` becomes ``drop:<B's address>`` on A) or actions
the driver carries out (``kill:X@token-T``, ``restart:X@token-T``, ``relay-down@S``).
With the addresses and the faults known, every job's command line follows.

A run has one relay, ``relay``, or several: ``relay``, ``relay-2``, ``relay-3``...; every
node is given all of them, the first first.  ``relay-down@S`` stops the first relay;
``relay-down:relay-2@S`` names another.

With replicas, ``stage-K`` is the stage's first replica and ``stage-K.j`` another.  In
``kill:`` and ``restart:`` alone, a replicated ``stage-K`` means whichever replica serves
the request at that moment, so there ``stage-K.1`` names the first replica precisely.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..pipeline.threads import shared_host_args
from .model import is_relay_job, parse_stage_job, stage_job_name, stage_job_names

_DISRUPT = re.compile(r"^(?P<what>kill|restart):(?P<who>[\w.-]+)@token-(?P<token>\d+)$")
_RELAY_DOWN = re.compile(r"^relay-down(?::(?P<who>[\w.-]+))?@(?P<s>\d+(\.\d+)?)$")
_DROP = re.compile(r"^drop:(?P<a>[\w.-]+)->(?P<b>[\w.-]+)$")
_EXPECTED = ("drop:A->B, isolate:X, loss:P, delay:MS, kill:X@token-T, restart:X@token-T, "
             "relay-down@SECONDS or relay-down:RELAY@SECONDS")


def node_names(stages: int, replicas: int = 1) -> list[str]:
    """The run's nodes (every job but the relay): the orchestrator, then the stage jobs by rank."""
    return ["orchestrator", *stage_job_names(stages, replicas)]


@dataclass(frozen=True)
class Disruption:
    """A ``kill:`` or ``restart:`` fault: SIGKILL a job once ``token`` tokens are out, and with
    ``restart`` start the same command again (its key, its address)."""

    spec: str  # as the user wrote it, for messages
    who: str  # a job; with ``serving``, the stage's first name
    token: int
    restart: bool = False
    serving: bool = False  # ``who`` is a replicated stage: the target is the replica serving then

    @property
    def stage(self) -> str:
        """The stage name the orchestrator's routes use: ``stage-K``."""
        parsed = parse_stage_job(self.who)
        return stage_job_name(parsed[0]) if parsed else self.who


@dataclass(frozen=True)
class RelayDown:
    """A ``relay-down@S`` (the first relay) or ``relay-down:relay-N@S`` fault: SIGKILL that relay
    job ``after_s`` seconds into the generation."""

    spec: str  # as the user wrote it, for messages and the report
    who: str  # a relay job: relay, relay-2, ...
    after_s: float


@dataclass
class FaultPlan:
    node_faults: dict[str, list[str]] = field(default_factory=dict)  # job -> its own --fault specs
    kills: list[Disruption] = field(default_factory=list)  # kill: and restart:, in the order given
    relay_downs: list[RelayDown] = field(default_factory=list)  # in the order given


def plan_faults(specs: list[str], addrs: dict[str, str], max_tokens: int | None = None) -> FaultPlan:
    """Turn run-level fault specs into per-node flags and actions; ValueError names a bad one.

    ``addrs`` maps every job that a spec may name (the relays included) to its HOST:PORT;
    ``max_tokens``, when given, refuses a kill that the generation would never reach.
    """
    names = set(addrs)
    plan = FaultPlan()

    def node(name: str, spec: str) -> str:
        if name not in names:
            raise ValueError(f"--fault {spec}: no node named {name!r} (have {', '.join(sorted(names))})")
        return name

    for spec in specs:
        if m := _DROP.match(spec):
            a, b = node(m["a"], spec), node(m["b"], spec)
            plan.node_faults.setdefault(a, []).append(f"drop:{addrs[b]}")
        elif spec.startswith("isolate:"):
            plan.node_faults.setdefault(node(spec[8:], spec), []).append("isolate")
        elif spec.startswith(("loss:", "delay:")):
            for n in names:
                plan.node_faults.setdefault(n, []).append(spec)
        elif spec.startswith(("kill:", "restart:")):
            plan.kills.append(_disruption(spec, node, names, max_tokens))
        elif m := _RELAY_DOWN.match(spec):
            who = node(m["who"] or "relay", spec)
            if not is_relay_job(who):
                raise ValueError(f"--fault {spec}: {who} is not a relay (relay-down stops a relay job)")
            plan.relay_downs.append(RelayDown(spec, who, float(m["s"])))
        elif spec.startswith(("nat:", "nat-symmetric:")):
            raise ValueError(f"--fault {spec}: {spec.split(':')[0]} needs --provider netns")
        else:
            raise ValueError(f"--fault {spec!r}: expected {_EXPECTED}")
    _check_after_master(plan.kills)
    return plan


def _check_after_master(kills: list[Disruption]) -> None:
    """A restarted orchestrator holds none of its requests: the run sends them again, from the
    first token, and a ``kill:``/``restart:`` due later in the first stream would never come.
    Refused here rather than left out unsaid."""
    master = next((d for d in kills if d.who == "orchestrator" and d.restart), None)
    if master is None:
        return
    for d in kills:
        if d is not master and d.token > master.token:
            raise ValueError(f"--fault {d.spec}: after --fault {master.spec} the requests start again "
                             f"from their first token, so a fault after token {master.token} would never "
                             f"be carried out; give it a token up to {master.token}")
        if d is not master and d.who == "orchestrator":
            raise ValueError(f"--fault {d.spec}: the run takes one kill: or restart: of the orchestrator "
                             f"(--fault {master.spec} is one)")


def _disruption(spec: str, node: Callable[[str, str], str], names: set[str],
                max_tokens: int | None) -> Disruption:
    """``kill:X@token-T`` or ``restart:X@token-T`` read and checked against the run's jobs."""
    what = spec.split(":", 1)[0]
    m = _DISRUPT.match(spec)
    if m is None:
        raise ValueError(f"--fault {spec!r}: expected {what}:X@token-T (X a run name, T a token count)")
    token = int(m["token"])
    if token < 1:
        raise ValueError(f"--fault {spec}: T counts tokens produced, from 1")
    if max_tokens is not None and token > max_tokens:
        raise ValueError(f"--fault {spec}: the run generates only {max_tokens} tokens")
    restart = what == "restart"
    parsed = parse_stage_job(m["who"])
    if parsed is None:  # the orchestrator or the relay
        return Disruption(spec, node(m["who"], spec), token, restart)
    stage, replica = parsed
    who = node(stage_job_name(stage, replica), spec)  # stage-K.1 is the job stage-K
    # A stage by its bare name, with a second replica in the run: the replica serving then.
    serving = m["who"] == stage_job_name(stage) and stage_job_name(stage, 2) in names
    return Disruption(spec, who, token, restart, serving)


@dataclass(frozen=True)
class RunPlan:
    """Where every job listens and which faults it carries: enough to write its command line."""

    stages: int
    model: str  # checkpoint directory
    relay_bind: str  # the first relay's (job ``relay``) HOST:PORT
    addrs: dict[str, str]  # node job -> gossip HOST:PORT
    dashboards: dict[str, str]  # node job -> dashboard bind
    faults: FaultPlan
    snapshot_dir: str
    key_dir: str  # every node's key file lives under it, so a restarted node keeps its identity
    replicas: int = 1
    mesh_key: str | None = None  # the run's mesh key file; None runs the mesh without one (--insecure)
    extra_relays: dict[str, str] = field(default_factory=dict)  # relay-2, relay-3, ... -> HOST:PORT

    @property
    def names(self) -> list[str]:
        """The node jobs (every job but the relays)."""
        return list(self.addrs)

    @property
    def relays(self) -> dict[str, str]:
        """Every relay job, the first (``relay``) first, -> its HOST:PORT."""
        return {"relay": self.relay_bind, **self.extra_relays}

    @property
    def relay_urls(self) -> dict[str, str]:
        """Every relay job -> the URL nodes are given for it."""
        return {name: f"ws://{bind}" for name, bind in self.relays.items()}


def key_file(plan: RunPlan, name: str) -> str:
    """The node's key file: a directory per job, since the node keeps its name clock beside the key."""
    return str(Path(plan.key_dir) / name / "node.key")


def job_argvs(plan: RunPlan) -> dict[str, list[str]]:
    """Each job's ``meshd`` arguments: the relays, then every node seeded through all the others
    and given every relay (the first first: its home relay); all of them with the run's mesh key
    (or, without one, every node told ``--insecure``)."""
    keyed = ["--mesh-key-file", plan.mesh_key] if plan.mesh_key else []
    relays = [arg for url in plan.relay_urls.values() for arg in ("--relay", url)]
    common = ["--stages", str(plan.stages), *relays, "--model", plan.model,
              "--profile", "local", "--snapshot-dir", plan.snapshot_dir, "--snapshot-interval", "1",
              *(keyed or ["--insecure"])]
    argvs = {name: ["relay", "--bind", bind, *keyed] for name, bind in plan.relays.items()}
    for name, addr in plan.addrs.items():
        # Every other node is a seed: a node whose direct path to one is filtered joins through another.
        seeds = [f"--seed={other}" for n, other in plan.addrs.items() if n != name]
        faults = [f"--fault={f}" for f in plan.faults.node_faults.get(name, [])]
        # Every stage shares this host's cores with the others, on CPUs of its own (a stage's
        # replicas on its CPUs); see meshd.pipeline.threads.
        job = parse_stage_job(name)
        threads = [] if job is None else shared_host_args(len(plan.addrs) - 1, job[0], plan.stages)
        argvs[name] = ["run", *_role(name), "--bind", addr, "--dashboard", plan.dashboards[name],
                       "--key-file", key_file(plan, name), *seeds, *faults, *threads, *common]
    return argvs


def _role(name: str) -> list[str]:
    """``--role`` (and ``--stage``) for a node job: the orchestrator, or stage-K / stage-K.j."""
    if name == "orchestrator":
        return ["--role", "orchestrator"]
    parsed = parse_stage_job(name)
    if parsed is None:
        raise ValueError(f"{name!r} is neither the orchestrator nor a stage job")
    return ["--role", "stage", "--stage", str(parsed[0])]
