"""``GET /metrics``: the snapshot as Prometheus text, rendered at scrape time."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import views

_PATHS = ("direct", "relay", "none", "unknown")


class _SnapshotCollector:
    def __init__(self, snap: dict) -> None:
        self.snap = snap

    def collect(self):
        snap = self.snap
        me = snap["self"]
        members = snap.get("members", [])
        states = GaugeMetricFamily("meshd_members", "Members by state, as this node sees them",
                                   labels=["state"])
        for state in ("alive", "suspect", "dead", "left"):
            count = sum(1 for m in members if m.get("state") == state) + (state == "alive")  # + ourselves
            states.add_metric([state], count)
        yield states
        yield GaugeMetricFamily("meshd_awareness", "Lifeguard local health score (0 = healthy)",
                                value=snap.get("awareness") or 0)
        rtt = GaugeMetricFamily("meshd_peer_rtt_seconds", "Last RTT to a peer", labels=["peer", "name"])
        path = GaugeMetricFamily("meshd_peer_path_out", "1 for the outbound path in use to a peer",
                                 labels=["peer", "name", "path"])
        fails = CounterMetricFamily("meshd_peer_direct_failures", "Probes whose direct ping went unanswered",
                                    labels=["peer", "name"])
        for m in members:
            labels = [m["prefix"], m.get("name") or ""]
            if m.get("rtt_ms") is not None:
                rtt.add_metric(labels, m["rtt_ms"] / 1000)
            for p in _PATHS[:3]:
                path.add_metric([*labels, p], 1.0 if m.get("path_out", "direct") == p else 0.0)
            fails.add_metric(labels, m.get("direct_failures", 0))
        yield rtt
        yield path
        yield fails
        counters = CounterMetricFamily("meshd_swim_events", "SWIM core counters", labels=["counter"])
        for name, value in (snap.get("counters") or {}).items():
            counters.add_metric([name], value)
        yield counters
        data = CounterMetricFamily("meshd_data_events", "Data channel counters", labels=["counter"])
        for name, value in (snap.get("data") or {}).items():
            if isinstance(value, int | float):
                data.add_metric([name], value)
        yield data
        topo = views.topology(snap)
        edges = GaugeMetricFamily("meshd_mesh_edges", "Directed pairs of the whole mesh by path",
                                  labels=["path"])
        for p in _PATHS:
            edges.add_metric([p], sum(1 for e in topo["edges"] if e["path"] == p))
        yield edges
        yield GaugeMetricFamily("meshd_mesh_asymmetric_pairs", "Pairs whose two directions differ",
                                value=len(topo["asymmetric"]))
        info = GaugeMetricFamily("meshd_node_info", "This node", labels=["prefix", "name", "role", "version"])
        info.add_metric([me["prefix"], me.get("name") or "", me.get("role") or "",
                         me.get("version") or ""], 1)
        yield info


def render(snap: dict) -> tuple[bytes, str]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap))
    return generate_latest(registry), CONTENT_TYPE_LATEST
