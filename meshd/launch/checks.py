"""What a smoke run is judged on: whether the mesh is whole (every node alive to every
other, every pipeline name owned by every replica), the tokens against ``meshd generate``,
each direction's path (and relay) and the pairs whose two directions differ, nodes cut off
from the rest, the failovers and the relay moves by job, and what teardown left behind.

Everything here reads snapshots and numbers the driver collected; nothing starts,
stops or asks a process anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..net.path_table import NONE as NONE_PATH
from ..net.path_table import UNKNOWN
from .model import parse_stage_job
from .process import parse_relay_move

Snapshot = dict[str, Any]  # a node's /api/snapshot
Member = dict[str, Any]  # one entry of a snapshot's "members"


@dataclass(frozen=True)
class Reference:
    """The generation compared with the single-process reference, by the rule of what counts
    as the same (meshd.pipeline.generate, README "Correctness and throughput"): the same tokens, or tokens
    that part from the reference's only at a step where its top two logits are within
    NEAR_TIE (where a batch's last-bit differences may pick the other)."""

    tokens: list[int]  # meshd generate's
    text: str  # the run's tokens, decoded
    matches: bool
    near_ties: list[int]  # the reference's steps whose top two logits are within NEAR_TIE
    diverged_at: int | None = None  # the first step where the tokens differ

    def judge(self, tokens: list[int]) -> bool:
        """Whether ``tokens`` (another run of the same request) count as the same."""
        from ..pipeline.generate import diverges

        step = diverges(tokens, self.tokens)
        return step is None or step in self.near_ties


def compare_with_reference(model: str, prompt: str, max_tokens: int, tokens: list[int],
                           temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> Reference:
    from ..pipeline.config import LlamaConfig
    from ..pipeline.generate import diverges, generate, near_ties
    from ..pipeline.tokenizer import load_tokenizer

    ref = generate(model, prompt, max_tokens, temperature, top_k, seed, return_logits=True)
    config = LlamaConfig.load(model)
    text = load_tokenizer(model, config.bos_token_id, config.eos_token_ids).decode(tokens)
    ties = near_ties(ref["logits"])
    step = diverges(tokens, ref["tokens"])
    return Reference(ref["tokens"], text, step is None or step in ties, ties, step)


def owners_needed(stages: int, jobs: Iterable[str]) -> dict[str, int]:
    """The pipeline names the orchestrator must resolve before generating, and how many live
    owners each needs: every running replica of a stage for its name, one for the others."""
    replicas = Counter(parsed[0] for job in jobs if (parsed := parse_stage_job(job)) is not None)
    return {"pp-entry": 1, "pp-exit": 1, **{f"pp-stage-{k}": max(replicas[k], 1) for k in range(stages)},
            "pp-orchestrator": 1}


def names_short(names: dict[str, Any], needed: dict[str, int]) -> list[str]:
    """The names of ``needed`` a snapshot's ``names`` do not resolve to enough live owners yet,
    as a person reads them (``pp-stage-1 (1/2 live)``)."""
    short = []
    for name, owners in needed.items():
        entry = names.get(name) or {}
        live = entry.get("live")
        count = len(live) if isinstance(live, list) else int(bool(entry.get("resolves")))
        if not entry.get("resolves") or count < owners:
            short.append(name if owners == 1 else f"{name} ({count}/{owners} live)")
    return short


def sees_all(snap: Snapshot, peers: set[str]) -> bool:
    """The node sees each of ``peers`` alive, each with a measured path, not an assumed one:
    probed at least once (it answered), or found to answer neither directly nor over a relay
    while others vouch for it (``none``); a peer's new process reads ``unknown`` until a probe
    of it gives a verdict."""
    seen = {m["prefix"] for m in snap["members"]
            if m["state"] == "alive" and m.get("path_out") != UNKNOWN
            and (m["path_checks"] > 0 or m.get("path_out") == NONE_PATH)}
    return peers <= seen


def cut_off(snaps: dict[str, Snapshot], prefixes: dict[str, str]) -> list[str]:
    """Nodes that most of the others do not see alive (e.g. an isolated one), by run name."""
    names = list(snaps)
    seen = {n: 0 for n in names}
    for snap in snaps.values():
        for m in snap["members"]:
            other = prefixes.get(m["prefix"])
            if other in seen and m["state"] == "alive":
                seen[other] += 1
    return [n for n in names if seen[n] * 2 < len(names) - 1]


def paths(snaps: dict[str, Snapshot], prefixes: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """Each ordered pair's path, from each node's own outbound view; and the asymmetric pairs.

    A direction to a peer's new process that no probe has given a verdict on yet reads
    ``unknown``; a pair with such a direction is not called asymmetric (nothing is known
    of it yet to differ)."""
    table: dict[tuple[str, str], Member] = {}
    for name, snap in snaps.items():
        for m in snap["members"]:
            other = prefixes.get(m["prefix"])
            if other is None:
                continue
            table[(name, other)] = m
    every = [{"from": a, "to": b, "path": "relay" if _uses_relay(m) else m["path_out"],
              "datagrams": m["path_out"], "data": m.get("data_out"),
              # Which relay, for a relayed direction: the one that carried its last frame.
              "relay": m.get("relay_via") if _uses_relay(m) else None,
              # The address a punch through its NAT opened, where datagrams (and data) go now.
              "punched": m.get("punched"),
              "rtt_ms": m.get("rtt_ms"), "why": m.get("last_failure"), "relay_ok": m.get("relay_ok"),
              "direct_failures": m.get("direct_failures")}
             for (a, b), m in sorted(table.items())]
    asymmetric = []
    for (a, b), m in sorted(table.items()):
        back = table.get((b, a))
        if back is None or a > b or UNKNOWN in (m["path_out"], back["path_out"]):
            continue
        if m["path_out"] != back["path_out"] or _uses_relay(m) != _uses_relay(back):
            asymmetric.append({"from": a, "to": b, "detail": f"{_side(a, b, m)}; {_side(b, a, back)}"})
    return every, asymmetric


def _uses_relay(m: Member) -> bool:
    """Either layer of this direction (datagrams, or the data stream) goes via the relay."""
    return "relay" in (m["path_out"], m.get("data_out"))


def _side(a: str, b: str, m: Member) -> str:
    """One direction in a line: ``stage-2→stage-0: relay (why)`` or ``…: direct, 0.4 ms``."""
    if not _uses_relay(m):
        rtt = f", {m['rtt_ms']:.1f} ms" if m.get("rtt_ms") is not None else ""
        return f"{a}→{b}: direct{' (punched)' if m.get('punched') else ''}{rtt}"
    # Why it is on the relay: a failure of another path (a relay's own lost ack says nothing
    # of that), else the datagrams' reason.
    why = m.get("data_last_failure") if m.get("data_out") == "relay" else None
    if why is not None and why.startswith("relay:"):
        why = None
    why = why or m.get("last_failure")
    layer = "" if m["path_out"] == "relay" else " (data; datagrams direct)"
    return f"{a}→{b}: relay{layer}" + (f", because {why}" if why else "")


def failovers(reported: list[Any], prefixes: dict[str, str]) -> list[dict[str, Any]]:
    """The failovers the orchestrator reported (``request``, ``stage``, ``from`` and ``to`` peer
    prefixes, ``ms``), each with the jobs its two peers are (``from_job``, ``to_job``) where the
    stage map knows them; a stage given as a number reads ``stage-K``."""
    out = []
    for item in reported:
        if not isinstance(item, dict):
            continue
        named = dict(item)
        if isinstance(named.get("stage"), int):
            named["stage"] = f"stage-{named['stage']}"
        for end in ("from", "to"):
            job = prefixes.get(str(named.get(end)))
            if job is not None:
                named[f"{end}_job"] = job
        out.append(named)
    return out


def relay_moves(lines: dict[str, list[str]], prefixes: dict[str, str],
                relays: dict[str, str]) -> list[dict[str, Any]]:
    """Every ``meshd relay-move`` line the nodes printed (``lines``: node job -> its output), in
    the order each node printed them: ``node`` (the job that printed it), ``to_node`` (the
    peer's job by ``prefixes``, else the name the node gave it), ``peer``, ``from`` and ``to``
    (relay URLs), ``why``, and ``from_relay`` / ``to_relay``, the relay jobs those URLs are
    (``relays``: relay job -> URL) when they are the run's."""
    job_of = {url: job for job, url in relays.items()}
    out = []
    for node, node_lines in lines.items():
        for line in node_lines:
            move = parse_relay_move(line)
            if move is None:
                continue
            out.append({"node": node, "to_node": prefixes.get(move.peer, move.to_node), "peer": move.peer,
                        "from": move.old, "to": move.new, "why": move.why,
                        "from_relay": job_of.get(move.old), "to_relay": job_of.get(move.new)})
    return out


def leftovers(processes_alive: int, testbed_left: int, tmp: Path) -> int:
    """What teardown left behind: processes still alive, testbed pieces, the run's temp dir."""
    return processes_alive + testbed_left + int(tmp.exists())
