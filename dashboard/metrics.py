"""``GET /metrics``: the snapshot, and the pipeline service's inference metrics, as Prometheus
text rendered at scrape time.

One unit per metric name: the SWIM core's and the data channel's counters go
to ``meshd_swim_events_total`` / ``meshd_data_events_total`` (counts: packets,
probes, messages, dials, ..) and their byte counters (names ending ``_bytes``)
to ``meshd_swim_bytes_total`` / ``meshd_data_bytes_total``, labelled without
the suffix (``counter="rx"``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from meshd.pipeline.metrics import Family, PipelineMetrics

from . import views

_PATHS = ("direct", "relay", "none", "unknown")


def _counters(prefix: str, what: str, counters: dict) -> Iterator[Metric]:
    """``counters`` (name -> number) as two families of one unit each: counts, and bytes."""
    events = CounterMetricFamily(f"{prefix}_events", f"{what}: events (packets, messages, ..) by counter",
                                 labels=["counter"])
    sizes = CounterMetricFamily(f"{prefix}_bytes", f"{what}: bytes by counter", labels=["counter"])
    for name, value in counters.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if name.endswith("_bytes"):
            sizes.add_metric([name.removesuffix("_bytes")], value)
        else:
            events.add_metric([name], value)
    yield events
    yield sizes


def _family(family: Family) -> Metric:
    """One of the pipeline's metric families, as prometheus_client's."""
    out: Metric
    if family.kind == "histogram":
        out = HistogramMetricFamily(family.name, family.help, labels=family.labels)
        for labels, hist in family.series:
            out.add_metric(list(labels), [(floatToGoString(bound), n) for bound, n in hist.cumulative()],
                           hist.sum)
        return out
    kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
    out = kind(family.name, family.help, labels=family.labels)
    for labels, value in family.series:
        out.add_metric(list(labels), value)
    return out


class _SnapshotCollector:
    def __init__(self, snap: dict, inference: PipelineMetrics | None = None,
                 live: dict[str, int] | None = None) -> None:
        self.snap = snap
        self.inference = inference
        self.live = live

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
        path = GaugeMetricFamily("meshd_peer_path_out", "1 for the outbound path in use to a peer "
                                 "(unknown: a restarted peer not probed since)",
                                 labels=["peer", "name", "path"])
        fails = CounterMetricFamily("meshd_peer_direct_failures", "Probes whose direct ping went unanswered",
                                    labels=["peer", "name"])
        for m in members:
            labels = [m["prefix"], m.get("name") or ""]
            if m.get("rtt_ms") is not None:
                rtt.add_metric(labels, m["rtt_ms"] / 1000)
            for p in _PATHS:  # one of the four is 1: an unprobed direction is no missing path
                path.add_metric([*labels, p], 1.0 if m.get("path_out", "direct") == p else 0.0)
            fails.add_metric(labels, m.get("direct_failures", 0))
        yield rtt
        yield path
        yield fails
        yield from _counters("meshd_swim", "SWIM core counters", snap.get("counters") or {})
        yield from _counters("meshd_data", "Data channel counters", snap.get("data") or {})
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
        if self.inference is not None:
            for family in self.inference.families():
                yield _family(family)
        if self.live is not None:
            live = dict(self.live)
            yield GaugeMetricFamily("meshd_dashboard_live_listeners", "Pages listening on /api/live now",
                                    value=live.pop("listeners", 0))
            events = CounterMetricFamily("meshd_dashboard_live_events", "The /api/live feed: listeners "
                                         "accepted, refused (full), closed (slow, chatty), pushes",
                                         labels=["event"])
            for name, value in live.items():
                events.add_metric([name], value)
            yield events


def render(snap: dict, inference: PipelineMetrics | None = None,
           live: dict[str, int] | None = None) -> tuple[bytes, str]:
    """The Prometheus text of ``snap``, of ``inference`` (a pipeline service's metrics) and of
    the dashboard's live feed (``live``: its counters, and ``listeners``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap, inference, live))
    return generate_latest(registry), CONTENT_TYPE_LATEST
