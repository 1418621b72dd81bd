"""What a smoke run tells a person and a script: live progress on a terminal, the summary
lines, and the ``--json`` object.

The JSON object's keys and their order are a contract (``smoke-run --json`` in
CONTRACT.md): :meth:`Outcome.to_json` is the one place that writes it, and the summary
is read from that object, so the two always agree.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from .failure import Failure, Kind


class Progress:
    """A run's phases on stderr as they happen, so stdout holds only the report (or
    ``--json``'s one object): on a terminal one live status line (rich), else a plain line
    ``smoke-run: PHASE`` when the phase changes, and at most every PLAIN_EVERY_S while it
    lasts.  ``shown`` False: nothing at all.  Writing progress never fails the run: a stderr
    that is closed, full or gone turns it off."""

    PLAIN_EVERY_S = 2.0

    def __init__(self, shown: bool = True, *, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr  # None: started with 2>&-
        self.enabled = shown and self.stream is not None
        self._status: Any = None
        self._phase, self._printed = "", 0.0
        try:
            live = self.enabled and self.stream.isatty()
        except (OSError, ValueError):  # closed
            live = self.enabled = False
        if live:
            from rich.console import Console

            self.console = Console(file=self.stream, log_path=False)
            self._status = self.console.status("starting")
            self._status.start()

    def update(self, text: str) -> None:
        """The phase now (``converging: 2 of 4 nodes ...``; the phase is what precedes ':')."""
        if self._status is not None:
            from rich.text import Text

            self._live(lambda: self._status.update(Text(text)))  # as it is: no markup
            return
        phase, now = text.split(":", 1)[0], time.monotonic()
        if self.enabled and (phase != self._phase or now - self._printed >= self.PLAIN_EVERY_S):
            self._phase, self._printed = phase, now
            self._line(text)

    def log(self, text: str) -> None:
        """Something that happened (a phase's result), kept above the live line."""
        if self._status is not None:
            self._live(lambda: self.console.log(text, markup=False, highlight=False))
        elif self.enabled:
            self._line(text)

    def _line(self, text: str) -> None:
        try:
            print(f"smoke-run: {text}", file=self.stream, flush=True)
        except (OSError, ValueError):  # stderr closed, full or gone: the run goes on
            self.enabled = False

    def _live(self, write: Any) -> None:
        try:
            write()
        except (OSError, ValueError):  # the terminal went away: no more progress
            self.stop()

    def stop(self) -> None:
        status, self._status, self.enabled = self._status, None, False
        if status is not None:
            try:
                status.stop()
            except (OSError, ValueError):
                pass


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
    # With --streams: the requests sent beside the first, each judged against its own reference
    # (``prompt``, ``sampling``, ``tokens``, ``matches_reference``, ``near_ties``, ``diverged_at``,
    # ``failovers``).
    other_streams: list[dict[str, Any]] = field(default_factory=list)


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
            if g.other_streams:
                out["other_streams"] = g.other_streams
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
    return "\n".join(line for _, line in summary_rows(result))


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary's lines, each with what it tells (``paths``, ``timings``, ...)."""
    reason = f" ({result['reason']})" if result.get("reason") else ""
    rows = [("smoke-run", f"smoke-run: {result['status']}{reason}")]
    if result.get("stage_map"):
        stage_map = " ".join(f"{p}={n}" for p, n in result["stage_map"].items())
        rows.append(("stage map", f"stage map: {stage_map}"))
    rows += [("asymmetric", f"asymmetric: {a['detail']}") for a in result.get("asymmetric", [])]
    relays = result.get("relays") or {}
    relay_job = {url: job for job, url in relays.items()} if len(relays) > 1 else {}
    if result.get("paths"):
        rows.append(("paths", _paths_line(result["paths"], relay_job)))
    if "tokens" in result:
        t = result["timings"]
        rows.append(("generated", f"generated {len(result['tokens'])} tokens; matches meshd generate: "
                                  f"{'yes' if result['matches_reference'] else 'NO'}{_ties(result)}"))
        rows.append(("timings", f"converge {t['converge_s']}s, first token {t['first_token_s']}s, "
                                f"{t['tokens_per_s']} tokens/s"))
    if others := result.get("other_streams"):
        rows.append(("streams", _streams_line(others)))
    if (again := result.get("again")) is not None:
        rows.append(("again", f"generated again after {again['after']}: {len(again['tokens'])} tokens; "
                              f"matches meshd generate: {'yes' if again['matches_reference'] else 'NO'}; "
                              f"{again['tokens_per_s']} tokens/s"))
    rows += [("disruption", disruption_line(d)) for d in result.get("disruptions", [])]
    rows += [("failover", failover_line(f)) for f in result.get("failovers", [])]
    rows += [("relay move", relay_move_line(m)) for m in result.get("relay_moves", [])]
    if result.get("logs"):
        rows.append(("logs", f"logs: {result['logs']}"))
    rows.append(("leftovers", f"leftovers: {result['leftovers']}"))
    return rows


def _streams_line(others: list[dict[str, Any]]) -> str:
    """The streams sent beside the first: whether each matches its reference, and where one
    parted from it (at a near tie, which the rule allows, or not)."""
    parted = [(k, o) for k, o in enumerate(others, start=2) if o["diverged_at"] is not None]
    ok = all(o["matches_reference"] for o in others)
    line = (f"streams: {len(others) + 1} at once; the other {len(others)} "
            f"({sum(len(o['tokens']) for o in others)} tokens) match meshd generate: {'yes' if ok else 'NO'}")
    if parted:
        line += " (" + "; ".join(f"stream {k} parted at step {o['diverged_at']}"
                                 + (", at a near tie" if o["matches_reference"] else "")
                                 for k, o in parted) + ")"
    moved = sum(bool(o.get("failovers")) for o in others)
    if moved:
        line += f"; {moved} of them failed over"
    return line


def print_report(result: dict[str, Any], file: TextIO | None = None) -> None:
    """The summary as a table for a terminal (rich), with the run's paths one per row."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    ok = result.get("ok")
    table = Table(title=f"smoke-run: {'[green]' if ok else '[red]'}{escape(str(result['status']))}"
                        f"{'[/green]' if ok else '[/red]'}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for label, line in summary_rows(result)[1:]:
        value = escape(line[len(label) + 2:] if line.startswith(f"{label}: ") else line)
        bad = label == "asymmetric" or (label in ("generated", "streams") and "generate: NO" in line) \
            or (label == "leftovers" and result["leftovers"])
        table.add_row(label, f"[red]{value}[/red]" if bad else value)
    console = Console(file=file)
    console.print(table)
    unusual = [p for p in result.get("paths") or [] if p["path"] != "direct" or p.get("punched")]
    if unusual:  # the pairs not plainly direct, one per row
        paths = Table("from", "to", "path", "punched", title="paths not plainly direct", title_justify="left")
        for p in unusual:
            path = p["path"] if p["path"] == "direct" else f"[yellow]{p['path']}[/yellow]"
            paths.add_row(p["from"], p["to"], path, "yes" if p.get("punched") else "")
        console.print(paths)


# How the paths line names each kind of direction that is not direct, in its order.
_NOT_DIRECT = (("relay", "via relay"), ("unknown", "not yet probed"), ("none", "no path"))


def _paths_line(paths: list[dict[str, Any]], relay_job: dict[str, str]) -> str:
    """``paths: 9 direct (1 punched: a→b), via relay: c→d, not yet probed: e→f``.  A direction
    to a peer's new process that no probe has given a verdict on yet (path ``unknown``) is
    said as such: nothing is known of it, relay least of all."""
    direct = [p for p in paths if p["path"] == "direct"]
    punched = [f"{p['from']}→{p['to']}" for p in direct if p.get("punched")]
    line = f"paths: {len(direct)} direct"
    if punched:
        line += f" ({len(punched)} punched: {', '.join(punched)})"
    for path, words in _NOT_DIRECT:
        named = [_relayed(p, relay_job) if path == "relay" else f"{p['from']}→{p['to']}"
                 for p in paths if p["path"] == path]
        if named:
            line += f", {words}: {', '.join(named)}"
    return line


def _relayed(path: dict[str, Any], relay_job: dict[str, str]) -> str:
    """``stage-1→stage-2``, and with several relays the one it uses: ``stage-1→stage-2 (relay-2)``."""
    job = relay_job.get(path.get("relay") or "")
    return f"{path['from']}→{path['to']}" + (f" ({job})" if job else "")


ENDED = "ended"  # a kill:'s or restart:'s request had ended when it came (``request_at``)


def landed(record: dict[str, Any]) -> str:
    """Where a kill: or restart: landed in its request, for the log and the report: the token
    the orchestrator had reached (a fast generation runs ahead of the stream smoke-run reads),
    or that the request had ended, so the fault disrupted nothing of it."""
    at = record.get("request_at")
    if at == ENDED:
        return " (the request had ended by then: nothing of it was disrupted)"
    if isinstance(at, int) and at > record.get("token", 0):
        return f" (the orchestrator had token {at} of the request by then)"
    return ""


def disruption_line(d: dict[str, Any]) -> str:
    """``killed stage-1.2 (77aa0011) after token 5``, ``restarted ...``, or
    ``relay-down: stopped relay (ws://127.0.0.1:4100) after 2s``."""
    if d["action"] == "relay-down":
        return f"relay-down: stopped {d['job']}" + (f" ({d['url']})" if d.get("url") else "") + \
            f" after {d['after_s']:g}s"
    done = "restarted" if d["action"] == "restart" else "killed"
    again = "; its requests were sent again" if d.get("reissued") else ""
    return (f"{done} {d['job']}" + (f" ({d['peer']})" if d.get("peer") else "") + f" after token {d['token']}"
            + landed(d) + again)


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
    """``failover: request ab12cd34ef56 stage-1 77aa0011 (stage-1.2) dead -> 5c3e9a10 (stage-1)
    in 412 ms``: what became of the node left, when the orchestrator said it in one word
    (``restarted``: the same node, as a new process, took the replay)."""
    def end(side: str) -> str:
        job = f.get(f"{side}_job")
        return f"{f.get(side)}" + (f" ({job})" if job else "")

    ms = f.get("ms")
    took = f" in {ms:.0f} ms" if isinstance(ms, int | float) else ""
    why = f.get("why")
    became = f" {why}" if isinstance(why, str) and why and " " not in why else ""
    return f"failover: request {f.get('request')} {f.get('stage')} {end('from')}{became} -> {end('to')}{took}"
