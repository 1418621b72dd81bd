"""What a smoke run tells a person and a script: live progress on a terminal, the summary
lines, and the ``--json`` object.

The JSON object's keys and their order are a contract (``smoke-run --json`` in
CONTRACT.md): :meth:`Outcome.to_json` is the one place that writes it, and the summary
is read from that object, so the two always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .failure import Failure, Kind


class Progress:
    """Live progress on a terminal; silent otherwise (and with --json)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._status: Any = None
        if enabled:
            from rich.console import Console

            self.console = Console(stderr=True)
            self._status = self.console.status("starting")
            self._status.start()

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)

    def log(self, text: str) -> None:
        if self.enabled:
            self.console.log(text)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()


@dataclass
class Generated:
    """A generation that ran to its end, and what the checks made of it."""

    tokens: list[int]
    text: str
    reference_tokens: list[int]
    matches_reference: bool  # by the rule of what counts as the same (README, "Correctness and throughput")
    stage_map: dict[str, str]  # node id prefix -> run name
    paths: list[dict]
    asymmetric: list[dict]
    converge_s: float
    first_token_s: float | None
    tokens_per_s: float | None
    # The generation run again once a relay-down came after the first had ended: its
    # ``after``, ``tokens``, ``matches_reference``, ``first_token_s`` and ``tokens_per_s``.
    again: dict[str, Any] | None = None
    nat: dict[str, str | None] | None = None  # node job -> its NAT as the relays' STUN saw it
    near_ties: list[int] = field(default_factory=list)  # reference steps within NEAR_TIE
    diverged_at: int | None = None  # the first step whose token differs from the reference's


@dataclass
class Outcome:
    """Everything the report says about one run; filled in as the run goes."""

    stages: int
    replicas: int = 1
    relays: dict[str, str] | None = None  # relay job -> the URL nodes hold for it, once planned
    failure: Failure | None = None
    testbed: dict | None = None  # the netns provider's layout
    run: str | None = None  # the run's name in the run dir
    generated: Generated | None = None
    failovers: list[dict[str, Any]] = field(default_factory=list)  # see checks.failovers
    disruptions: list[dict[str, Any]] = field(default_factory=list)  # kill:, restart:, relay-down carried out
    relay_moves: list[dict[str, Any]] = field(default_factory=list)  # see checks.relay_moves
    leftovers: int = 0
    run_status: str | None = None
    jobs: dict[str, str] | None = None  # job -> its status message
    total_s: float | None = None
    logs: str | None = None  # a failed run's job output, one file a job: <run dir>/<run>.logs/

    @property
    def ok(self) -> bool:
        return self.failure is None and self.generated is not None and self.leftovers == 0

    @property
    def exit_code(self) -> int:
        if self.failure is not None and self.failure.kind is Kind.STOPPED:
            return 130
        return 0 if self.ok else 1

    def to_json(self) -> dict[str, Any]:
        failure = self.failure
        status = "done" if failure is None and self.generated is not None else "failed"
        out: dict[str, Any] = {"ok": self.ok, "status": failure.status if failure else status,
                               "reason": failure.reason if failure else None, "stages": self.stages,
                               "replicas": self.replicas}
        if self.relays is not None:
            out["relays"] = self.relays
        if self.testbed is not None:
            out["testbed"] = self.testbed
        if self.run is not None:
            out["run"] = self.run
        if (g := self.generated) is not None:
            out.update({
                "tokens": g.tokens, "text": g.text, "reference_tokens": g.reference_tokens,
                "matches_reference": g.matches_reference, "near_ties": g.near_ties,
                "diverged_at": g.diverged_at, "stage_map": g.stage_map, "paths": g.paths,
                "asymmetric": g.asymmetric,
                "timings": {"converge_s": round(g.converge_s, 3),
                            "first_token_s": None if g.first_token_s is None else round(g.first_token_s, 3),
                            "tokens_per_s": g.tokens_per_s,
                            "total_s": None if self.total_s is None else round(self.total_s, 3)},
            })
            if g.again is not None:
                out["again"] = g.again
            if g.nat is not None:
                out["nat"] = g.nat
        out["failovers"] = self.failovers
        out["disruptions"] = self.disruptions
        out["relay_moves"] = self.relay_moves
        out["leftovers"] = self.leftovers
        if self.run_status is not None:
            out["run_status"] = self.run_status
            out["jobs"] = self.jobs
        if self.logs is not None:
            out["logs"] = self.logs
        return out


def summary(result: dict[str, Any]) -> str:
    """The lines a person reads at the end of a run, from the JSON object."""
    reason = f" ({result['reason']})" if result.get("reason") else ""
    lines = [f"smoke-run: {result['status']}{reason}"]
    if result.get("stage_map"):
        lines.append("stage map: " + " ".join(f"{p}={n}" for p, n in result["stage_map"].items()))
    lines += [f"asymmetric: {a['detail']}" for a in result.get("asymmetric", [])]
    relays = result.get("relays") or {}
    relay_job = {url: job for job, url in relays.items()} if len(relays) > 1 else {}
    relayed = [_relayed(p, relay_job) for p in result.get("paths", []) if p["path"] != "direct"]
    if result.get("paths"):
        punched = [f"{p['from']}→{p['to']}" for p in result["paths"]
                   if p["path"] == "direct" and p.get("punched")]
        lines.append(f"paths: {len(result['paths']) - len(relayed)} direct"
                     + (f" ({len(punched)} punched: {', '.join(punched)})" if punched else "")
                     + (f", via relay: {', '.join(relayed)}" if relayed else ""))
    if "tokens" in result:
        t = result["timings"]
        lines.append(f"generated {len(result['tokens'])} tokens; matches meshd generate: "
                     f"{'yes' if result['matches_reference'] else 'NO'}{_ties(result)}")
        lines.append(f"converge {t['converge_s']}s, first token {t['first_token_s']}s, "
                     f"{t['tokens_per_s']} tokens/s")
    if (again := result.get("again")) is not None:
        lines.append(f"generated again after {again['after']}: {len(again['tokens'])} tokens; matches meshd "
                     f"generate: {'yes' if again['matches_reference'] else 'NO'}; "
                     f"{again['tokens_per_s']} tokens/s")
    lines += [_disruption_line(d) for d in result.get("disruptions", [])]
    lines += [failover_line(f) for f in result.get("failovers", [])]
    lines += [relay_move_line(m) for m in result.get("relay_moves", [])]
    if result.get("logs"):
        lines.append(f"logs: {result['logs']}")
    lines.append(f"leftovers: {result['leftovers']}")
    return "\n".join(lines)


def _relayed(path: dict[str, Any], relay_job: dict[str, str]) -> str:
    """``stage-1→stage-2``, and with several relays the one it uses: ``stage-1→stage-2 (relay-2)``."""
    job = relay_job.get(path.get("relay") or "")
    return f"{path['from']}→{path['to']}" + (f" ({job})" if job else "")


def _disruption_line(d: dict[str, Any]) -> str:
    """``killed stage-1.2 (77aa0011) after token 5``, ``restarted ...``, or
    ``relay-down: stopped relay (ws://127.0.0.1:4100) after 2s``."""
    if d["action"] == "relay-down":
        return f"relay-down: stopped {d['job']}" + (f" ({d['url']})" if d.get("url") else "") + \
            f" after {d['after_s']:g}s"
    done = "restarted" if d["action"] == "restart" else "killed"
    return f"{done} {d['job']}" + (f" ({d['peer']})" if d.get("peer") else "") + f" after token {d['token']}"


def relay_move_line(m: dict[str, Any]) -> str:
    """``relay move: stage-1→stage-2 from ws://127.0.0.1:4100 (relay) to ws://127.0.0.1:4101 (relay-2):
    why``: a node moved a pair to another relay."""
    def end(side: str) -> str:
        job = m.get(f"{side}_relay")
        return f"{m.get(side)}" + (f" ({job})" if job else "")

    return f"relay move: {m.get('node')}→{m.get('to_node')} from {end('from')} to {end('to')}: {m.get('why')}"


def _ties(result: dict) -> str:
    """The near-ties, when the reference has any: where a token may differ and still count."""
    ties, at = result.get("near_ties") or [], result.get("diverged_at")
    if at is not None and at in ties:
        return f" (differs from step {at}, a near-tie of the reference; {len(ties)} near-ties in all)"
    if at is not None:
        return f" (differs from step {at})"
    return f" ({len(ties)} near-tie steps in the reference)" if ties else ""


def failover_line(f: dict[str, Any]) -> str:
    """``failover: request ab12cd34ef56 stage-1 77aa0011 (stage-1) -> 5c3e9a10 (stage-1.2) in 412 ms``."""
    def end(side: str) -> str:
        job = f.get(f"{side}_job")
        return f"{f.get(side)}" + (f" ({job})" if job else "")

    ms = f.get("ms")
    took = f" in {ms:.0f} ms" if isinstance(ms, int | float) else ""
    return f"failover: request {f.get('request')} {f.get('stage')} {end('from')} -> {end('to')}{took}"
