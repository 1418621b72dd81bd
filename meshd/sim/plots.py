"""The four scale figures, each with memberlist's analytic bound beside it.

matplotlib is imported here only, with the Agg backend: ``meshd sim`` without
``--plot`` never needs it.
"""

from __future__ import annotations

import math
import os

from ..swim import PROFILES
from .scenario import Result, log_fit


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, directory: str, name: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    # No timestamp in the PNG: the same results give the same file.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    _plt().close(fig)
    return path


def plot_detection_cdf(results: list[Result], directory: str) -> str:
    """CDF of crash -> first suspicion and crash -> all members know it dead."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        n = r.scenario.nodes
        tag = f"N={n}, loss {r.scenario.loss:g}" if len(results) > 1 else ""
        for attr, label, style in (("first_suspect", "first suspicion", "--"),
                                   ("all_know", "all know dead", "-")):
            xs = sorted(getattr(c, attr) - c.at for c in r.crashes if getattr(c, attr) is not None)
            if xs:
                ys = [(i + 1) / len(r.crashes) for i in range(len(xs))]
                ax.step(xs, ys, style, where="post", label=f"{label} {tag}".strip())
    r0 = results[0]
    low, high = r0.bounds
    ax.axvline(low, color="tab:green", lw=1, label=f"memberlist suspicion min {low:.1f} s")
    ax.axvline(high, color="tab:red", lw=1, label=f"memberlist suspicion max {high:.1f} s")
    ax.set_xlabel("seconds after the crash")
    ax.set_ylabel("fraction of crashes")
    ax.set_ylim(0, 1.02)
    s = r0.scenario
    ax.set_title(f"Crash detection: N={s.nodes}, loss {s.loss:g}, {len(r0.crashes)} crashes ({s.profile})")
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3)
    return _save(fig, directory, "detection_cdf.png")


def plot_dissemination(results: list[Result], directory: str) -> tuple[str, tuple[float, float]]:
    """Join spread (99% and 100%) vs N, the a + c·ln N fit, and the suspicion min bound."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ns, p99, p100 = [], [], []
    for r in results:
        d = r.dissemination()["join"]
        if d["p99_rounds_median"] is not None:
            ns.append(r.scenario.nodes)
            p99.append(d["p99_rounds_median"])
            p100.append(d["p100_rounds_median"])
    ax.plot(ns, p99, "o", label="join known to 99% (median)")
    ax.plot(ns, [v if v is not None else math.nan for v in p100], "s", label="join known to 100% (median)")
    fit = log_fit(ns, p99) if len(ns) > 1 else (p99[0] if p99 else 0.0, 0.0)
    xs = [ns[0] * (ns[-1] / ns[0]) ** (i / 50) for i in range(51)] if ns else []
    a, c = fit
    ax.plot(xs, [a + c * math.log(x) for x in xs], "-", lw=1, label=f"fit: {a:.2f} + {c:.3f}·ln N")
    cfg = PROFILES[results[0].scenario.profile]
    ax.plot(xs, [cfg.suspicion_bounds(int(x))[0] / cfg.probe_interval for x in xs], ":", color="tab:green",
            label="memberlist suspicion min (periods)")
    ax.set_xscale("log")
    ax.set_xlabel("members N")
    ax.set_ylabel("protocol periods")
    ax.set_title(f"Dissemination of a join, loss {results[0].scenario.loss:g}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, directory, "dissemination_vs_n.png"), fit


def plot_load(results: list[Result], directory: str, others: dict[float, list[Result]] | None = None) -> str:
    """Messages per member per period vs N, against memberlist's steady probe + gossip rate
    and meshd's probe + gossip budget.

    ``others`` adds one line per other loss rate (the same sweep, loss -> results).
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ns = [r.scenario.nodes for r in results]
    msgs = [r.load()["messages_per_member_period"] for r in results]
    kb = [r.load()["bytes_per_member_period"] / 1000 for r in results]
    loss = results[0].scenario.loss
    ax.plot(ns, msgs, "o-", label=f"messages per member per period, loss {loss:g}")
    top = list(msgs)
    for other_loss, rs in sorted((others or {}).items()):
        ys = [r.load()["messages_per_member_period"] for r in rs]
        top += ys
        ax.plot([r.scenario.nodes for r in rs], ys, "o:", label=f"messages, loss {other_loss:g}")
    lo, hi = msgs[0] * 0.8, msgs[0] * 1.2
    ax.axhspan(lo, hi, color="tab:green", alpha=0.12, label=f"±20% of N={ns[0]} at loss {loss:g}")
    cfg = PROFILES[results[0].scenario.profile]
    ceiling = 2 + cfg.gossip_nodes * cfg.probe_interval / cfg.gossip_interval
    ax.axhline(ceiling, color="tab:red", lw=1,
               label=f"memberlist probe + full gossip: 2 + {cfg.gossip_nodes}/gossip interval = {ceiling:g}"
               " (ping-req, relay, push-pull on top)")
    budget = 2 + cfg.gossip_per_period
    ax.axhline(budget, color="tab:purple", lw=1, ls="--",
               label=f"meshd probe + gossip budget: 2 + {cfg.gossip_per_period:g} = {budget:g}"
               " (ping-req, relay, push-pull on top)")
    ax2 = ax.twinx()
    ax2.plot(ns, kb, "s--", color="tab:gray", label=f"kB per member per period, loss {loss:g}")
    ax2.set_ylabel("kB per member per period")
    ax.set_xscale("log")
    ax.set_ylim(0, max([ceiling, *top]) * 1.15)
    ax2.set_ylim(0, max(kb) * 1.5 if kb else 1)
    ax.set_xlabel("members N")
    ax.set_ylabel("messages per member per period")
    ax.set_title("Per-member load vs N")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    return _save(fig, directory, "load_vs_n.png")


def false_suspicion_rate(loss: float, indirect_checks: int) -> float:
    """memberlist's chance that one probe of a live member fails.

    The direct ping or its ack is lost, and every one of the k indirect paths
    (ping-req, ping, ack, forwarded ack: four hops) loses a packet too.
    """
    direct = 1 - (1 - loss) ** 2
    indirect = 1 - (1 - loss) ** 4
    return direct * indirect**indirect_checks


def relay_failure_rate(loss: float, budget: float, rto: float, hops: int = 4) -> float:
    """Chance the relayed ping's round trip misses its deadline.

    Each of the ``hops`` stream hops (prober -> relay -> target, and the ack
    back the same way) resends after ``rto`` for every loss; the round trip
    fails when the resends take more than ``budget`` (what is left of the
    period after the direct timeout).  Resends over the hops are negative
    binomial: P(j) = C(j + hops - 1, j) (1-l)^hops l^j.
    """
    allowed = int(budget / rto + 1e-9)
    ok = sum(math.comb(j + hops - 1, j) * (1 - loss) ** hops * loss**j for j in range(allowed + 1))
    return max(0.0, 1 - ok)


def plot_false_positives(results: list[Result], directory: str) -> str:
    """False suspicions and false deaths per member-period vs loss, with the analytic probe-failure rate."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    results = sorted(results, key=lambda r: r.scenario.loss)
    losses = [r.scenario.loss for r in results]
    sus = [r.false_suspicions / r.member_periods / r.scenario.nodes for r in results]
    dead = [r.false_dead / r.member_periods for r in results]
    ax.plot(losses, sus, "o-", label="false suspicions per member-period (each seen by all)")
    ax.plot(losses, [max(d, 1e-9) for d in dead], "s-", label="false dead views per member-period")
    cfg = PROFILES[results[0].scenario.profile]
    xs = [i / 100 for i in range(1, int(max(losses) * 100) + 2)]
    ax.plot(xs, [false_suspicion_rate(x, cfg.indirect_checks) for x in xs], ":", color="tab:red",
            label=f"analytic probe failure, UDP only (k={cfg.indirect_checks})")
    if results[0].scenario.relay:
        budget = cfg.probe_interval - cfg.probe_timeout
        ax.plot(xs, [false_suspicion_rate(x, cfg.indirect_checks) * relay_failure_rate(x, budget, 0.2)
                     for x in xs], "--", color="tab:purple",
                label="analytic, with the relayed ping (4 stream hops, 200 ms resend)")
    ax.set_yscale("log")
    ax.set_ylim(1e-7, 1)
    n = results[0].scenario.nodes
    ax.set_xlabel("packet loss per link direction")
    ax.set_ylabel("rate per member per period")
    low, high = cfg.suspicion_bounds(n)
    ax.set_title(f"False positives vs loss: N={n}; suspicion {low:.1f}..{high:.1f} s")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    return _save(fig, directory, "false_positives_vs_loss.png")
