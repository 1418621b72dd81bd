"""What a smoke run will do, decided before any process starts.

Run-level fault specs name nodes by run name; here they become each node's own
``--fault`` flags (``drop:A->B`` becomes ``drop:<B's address>`` on A) or actions
the driver carries out (``kill:X@token-T``, ``relay-down@S``).  With the
addresses and the faults known, every job's command line follows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_KILL = re.compile(r"^kill:(?P<who>[\w-]+)@token-(?P<token>\d+)$")
_RELAY_DOWN = re.compile(r"^relay-down@(?P<s>\d+(\.\d+)?)$")
_DROP = re.compile(r"^drop:(?P<a>[\w-]+)->(?P<b>[\w-]+)$")


def node_names(stages: int) -> list[str]:
    """The run's nodes (every job but the relay), the orchestrator first."""
    return ["orchestrator", *(f"stage-{k}" for k in range(stages))]


@dataclass
class FaultPlan:
    node_faults: dict[str, list[str]] = field(default_factory=dict)  # job -> its own --fault specs
    kills: list[tuple[str, int]] = field(default_factory=list)  # (job, after this many tokens)
    relay_down_s: float | None = None  # the relay is killed this long into the generation


def plan_faults(specs: list[str], addrs: dict[str, str]) -> FaultPlan:
    """Turn run-level fault specs into per-node flags and actions; ValueError names a bad one.

    ``addrs`` maps every job that a spec may name (the relay included) to its HOST:PORT.
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
        elif m := _KILL.match(spec):
            plan.kills.append((node(m["who"], spec), int(m["token"])))
        elif m := _RELAY_DOWN.match(spec):
            plan.relay_down_s = float(m["s"])
        elif spec.startswith("nat:"):
            raise ValueError(f"--fault {spec}: nat needs --provider netns")
        else:
            raise ValueError(f"--fault {spec!r}: expected drop:A->B, isolate:X, loss:P, delay:MS, "
                             "kill:X@token-T or relay-down@SECONDS")
    return plan


@dataclass(frozen=True)
class RunPlan:
    """Where every job listens and which faults it carries: enough to write its command line."""

    stages: int
    model: str  # checkpoint directory
    relay_bind: str  # the relay's HOST:PORT
    addrs: dict[str, str]  # node job -> gossip HOST:PORT
    dashboards: dict[str, str]  # node job -> dashboard bind
    faults: FaultPlan
    snapshot_dir: str

    @property
    def names(self) -> list[str]:
        return list(self.addrs)


def job_argvs(plan: RunPlan) -> dict[str, list[str]]:
    """Each job's ``meshd`` arguments: the relay, then every node seeded through all the others."""
    common = ["--stages", str(plan.stages), "--relay", f"ws://{plan.relay_bind}", "--model", plan.model,
              "--profile", "local", "--snapshot-dir", plan.snapshot_dir, "--snapshot-interval", "1"]
    argvs = {"relay": ["relay", "--bind", plan.relay_bind]}
    for name, addr in plan.addrs.items():
        role = ["--role", "orchestrator"] if name == "orchestrator" else ["--role", "stage", "--stage",
                                                                            name.split("-")[1]]
        # Every other node is a seed: a node whose direct path to one is filtered joins through another.
        seeds = [f"--seed={other}" for n, other in plan.addrs.items() if n != name]
        faults = [f"--fault={f}" for f in plan.faults.node_faults.get(name, [])]
        argvs[name] = ["run", *role, "--bind", addr, "--dashboard", plan.dashboards[name],
                       *seeds, *faults, *common]
    return argvs
