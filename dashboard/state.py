"""What the page shows, as one JSON object: ``GET /api/state`` and each push of ``/api/live``.

Composed from one snapshot (``views``: peers, topology with readiness, what
``meshd doctor`` would report), the orchestrator's recent traces (where one
token's time goes) and, where the node knows them, the layers each stage
holds.  The page draws only this object, whether it came pushed or polled.
"""

from __future__ import annotations

from typing import Any

from meshd.pipeline.api import Generator

from . import views

MAX_TRACES = 32  # recent requests the token bar averages over


def traces(generator: Generator | None) -> list[dict]:
    """The orchestrator's recent request traces (hops as dicts), newest last."""
    if generator is None:
        return []
    out = []
    for item in list(generator.recent_traces)[-MAX_TRACES:]:
        hops = [[{"kind": h[0], "name": h[1], "ms": h[2], "path": h[3]} for h in trace]
                for trace in item.get("traces", [])]
        out.append({"req_id": item.get("req_id"), "traces": hops})
    return out


def token_breakdown(recent: list[dict]) -> list[dict]:
    """Where one token's time goes: mean ms per hop over the recent traces, in pipeline order."""
    sums: dict[str, list] = {}
    for item in recent:
        for trace in item["traces"]:
            for hop in trace:
                entry = sums.setdefault(hop["name"], [hop["kind"], hop["path"], 0.0, 0])
                entry[1] = hop["path"] or entry[1]
                entry[2] += hop["ms"]
                entry[3] += 1
    return [{"name": name, "kind": k, "path": path, "ms": round(total / n, 3)}
            for name, (k, path, total, n) in sums.items()]


def traces_view(generator: Generator | None) -> dict:
    """``GET /api/traces``."""
    recent = traces(generator)
    return {"orchestrator": generator is not None, "requests": recent, "per_token": token_breakdown(recent)}


def layers(generator: Generator | None) -> dict[str, dict[str, int]]:
    """``{"stage-K": {"first", "last", "of"}}``: the layers each stage holds, where this node
    knows the model (the orchestrator); empty elsewhere."""
    split = generator.layer_split() if generator is not None else {}
    total = max((r.stop for r in split.values()), default=0)
    return {name: {"first": r.start, "last": r.stop - 1, "of": total} for name, r in split.items()}


def _numbers(counters: Any) -> dict[str, int | float]:
    if not isinstance(counters, dict):
        return {}
    return {k: v for k, v in counters.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def page_state(snap: dict, generator: Generator | None = None) -> dict:
    """Everything the page draws, from ``snap`` (``Mesh.snapshot()``) and the orchestrator."""
    topo = views.topology(snap)
    return {
        "time": snap.get("time"),
        "peers": views.peers(snap),
        "topology": topo,
        "problems": views.problems(snap, topo),
        "traces": traces_view(generator),
        "layers": layers(generator),
        # This node's own counters, for its details: SWIM's and the data channel's.
        "counters": {"swim": _numbers(snap.get("counters")), "data": _numbers(snap.get("data"))},
        "relays": [r for r in (snap.get("relays") or [snap.get("relay")]) if isinstance(r, dict)],
    }
