"""The one view of a node's state that leaves the process.

The snapshot dumper writes it as JSON lines; the dashboard serves it.  Nothing
outside this module reaches into protocol objects for display.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from .identity import prefix
from .net.path_table import RELAY, PathTable
from .readiness import readiness
from .swim import Member, Swim

log = logging.getLogger(__name__)


def member_view(m: Member, now: float) -> dict:
    return {
        "id": m.id.hex(),
        "prefix": m.prefix,
        "name": m.name,
        "role": m.meta.role,
        "stage": m.meta.stage,
        "state": m.state.name.lower(),
        "incarnation": m.incarnation,
        "addr": m.addr,
        "relay_url": m.meta.relay_url,
        "version": m.meta.version,
        "generation": m.meta.generation,
        "stages": m.meta.stages,
        "epoch": m.meta.epoch,
        # When its process started, by its own clock (seconds since 1970; None from a peer too
        # old to say): readiness links a chain of restarts under new keys at new addresses by it.
        "started": m.meta.started or None,
        "checkpoint": m.meta.checkpoint,
        "draining": m.meta.draining,
        "keyring": list(m.meta.keyring),  # ids of the mesh keys it holds, the one it seals with first
        "addrs": list(m.meta.addrs),  # where it may be reached: its own address, then its STUN mapping
        "nat": m.meta.nat or None,  # as two relays' STUN saw it: none, endpoint-independent, symmetric
        # The round trip over the path our probes take to it now, and which path that is.
        "rtt_ms": None if m.rtt is None else round(m.rtt * 1000, 3),
        "rtt_path": "direct",
        "rtt_direct_ms": None if m.rtt is None else round(m.rtt * 1000, 3),
        "rtt_relay_ms": None if m.relay_rtt is None else round(m.relay_rtt * 1000, 3),
        "last_seen_s": None if m.last_seen is None else round(now - m.last_seen, 3),
        "state_age_s": round(now - m.state_change, 3),
    }


IN_STALE_ROUNDS = 3  # probe rounds with nothing from a member before its way in reads none


def snapshot(swim: Swim, now: float, paths: PathTable | None = None, relay: dict | None = None,
             reported_down: Callable[[bytes], bool] | None = None) -> dict:
    """A JSON-ready picture of the node: self, members (with their paths), names, counters.
    ``reported_down(id)``: whether a stage reported the member's process gone (``Mesh.report_down``),
    which readiness counts as not serving."""
    members = []
    for m in swim.members.values():
        if m.id == swim.id:
            continue
        view = member_view(m, now)
        view["path_checks"] = swim.path_checks.get(m.id, 0)
        view["reported_down"] = reported_down is not None and reported_down(m.id)
        # Whether our --allow-nodes (if any) lets it hold stage names: a stage left out serves nothing.
        view["allowed"] = swim.allow_nodes is None or m.id in swim.allow_nodes
        if paths is not None:
            # Inbound, a live member is heard at least once a probe round (its ack to our
            # probe, if nothing else): three rounds of silence and its way in shows none.
            path_view = paths.view(m.id, now, IN_STALE_ROUNDS * swim.config.probe_interval
                                   * max(1, swim.live_count()) if m.state.live else 0.0)
            del path_view["peer"]
            view.update(path_view)
            if path_view["path_out"] == RELAY:
                view["rtt_ms"], view["rtt_path"] = view["rtt_relay_ms"], RELAY
        members.append(view)
    members.sort(key=lambda v: stage_sort_key(v["name"]))
    names = {}
    for name in swim.registry.names():
        live = swim.live_owners(name)
        entries = sorted(swim.registry.entries(name), key=lambda c: (c.tombstone, c.owner))
        names[name] = {
            # One owner it resolves to (else the first entry's), for readers that want one.
            "owner": prefix(live[0] if live else entries[0].owner),
            "tombstone": all(c.tombstone for c in entries),
            "resolves": bool(live),
            "live": [prefix(o) for o in live],
            "entries": [{"owner": prefix(c.owner), "clock": c.clock, "tombstone": c.tombstone,
                         "live": c.owner in live} for c in entries],
        }
    snap = {
        "time": time.time(),
        "self": member_view(swim.me, now),
        "members": members,
        "names": names,
        "relay": relay,
        "path_summaries": path_summaries(swim, now),
        "awareness": swim.awareness.score,
        # The longest a suspicion runs before a death's verdict, at the mesh's size now: readiness
        # allows for it when it asks whether a process started after another went down.
        "suspicion_s": swim.config.suspicion_bounds(swim.live_count())[1],
        "counters": dict(sorted(swim.counters.items())),
        "twin": twin_view(swim, now),
    }
    snap["readiness"] = readiness(snap)
    return snap


def twin_view(swim: Swim, now: float) -> dict | None:
    """The live twin heard from last (another process under our id, twin.py), and which of us
    keeps the id; None when no other process answered as us."""
    twin = swim.twins.latest_live()
    if twin is None:
        return None
    return {**twin.to_json(now), "keep": swim.twins.yielded is None}


def path_summaries(swim: Swim, now: float) -> dict:
    """Every node's gossiped outbound paths (ours included), by full node id."""
    out = {}
    for node, (summary, at) in swim.path_summaries.items():
        out[node.hex()] = {
            "version": summary.version,
            "age_s": round(now - at, 3),
            "entries": [{"to": e.peer.hex(), "path": e.path,
                         "rtt_ms": round(e.rtt_us / 1000, 3) if e.rtt_us else None,
                         "direct_failures": e.direct_failures, "reason": e.reason or None,
                         "relay": e.relay or None,
                         "punched": e.punched,
                         # since the summary was made, plus how long ago we took it in
                         "since_s": round(e.since_ms / 1000 + now - at, 3) if e.since_ms else None}
                        for e in summary.entries],
        }
    return out


def stage_sort_key(name: str) -> tuple:
    """orchestrator first, then stage-0, stage-1, ... by number."""
    if name.startswith("stage-") and name[6:].isascii() and name[6:].isdigit():
        return (1, int(name[6:]), name)
    return (0 if name == "orchestrator" else 2, 0, name)


class SnapshotWriter:
    """Appends one JSON line per snapshot to ``DIR/<prefix>.jsonl``."""

    def __init__(self, directory: str | os.PathLike, node_prefix: str) -> None:
        """Raises OSError when the file cannot be made there (the caller names the option)."""
        self.path = Path(directory) / f"{node_prefix}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        open(self.path, "a", encoding="utf-8").close()
        self._failing = False

    def write(self, snap: dict) -> None:
        """Append ``snap``; a write that fails (the disk full, the directory gone) is one log
        line until writes work again: the node serves on without its snapshots."""
        line = json.dumps(snap, separators=(",", ":")) + "\n"
        # One append of one line.  A reader that reads while it is under way can still
        # meet the line's first part only (the kernel copies a write page by page):
        # ``read_snapshots`` leaves an unterminated last line out.
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as exc:
            if not self._failing:
                log.warning("cannot write the snapshot to %s: %s; serving on without it",
                            self.path, exc.strerror or exc)
            self._failing = True
        else:
            if self._failing:
                log.info("writing snapshots to %s again", self.path)
            self._failing = False


def read_snapshots(path: str | os.PathLike) -> list[dict]:
    """The records of a snapshot file, oldest first; a last line still being written (no
    newline yet) is left out, so a file read while its node runs parses whole."""
    text = Path(path).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n")[:-1] if line]
