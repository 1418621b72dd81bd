"""Scale sweep for ``meshd sim``: N = 100, 300, 1000, 3000, then a loss sweep.

    .venv/bin/python bench/sim_scale.py [--out docs/scale] [--periods 100]

Writes ``OUT/results.json``, ``OUT/table.md`` and the four PNG figures, and
prints the table and the log N fit.  The N sweep runs again at each of
``--load-losses`` for the load figure.  Everything but the CPU column is a
pure function of the seed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from meshd.sim.plots import plot_detection_cdf, plot_dissemination, plot_false_positives, plot_load
from meshd.sim.scenario import Scenario, simulate


def _f(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/scale")
    ap.add_argument("--ns", default="100,300,1000,3000")
    ap.add_argument("--periods", type=int, default=100)
    ap.add_argument("--max-node-periods", type=int, default=300_000,
                    help="cap N x periods (CPU, not the protocol); the default runs every N 100 periods")
    ap.add_argument("--loss", type=float, default=0.1)
    ap.add_argument("--crash", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sweep-n", type=int, default=300, help="N for the false-positive vs loss sweep")
    ap.add_argument("--sweep-losses", default="0,0.05,0.1,0.15,0.2,0.25")
    ap.add_argument("--sweep-periods", type=int, default=60)
    ap.add_argument("--load-losses", default="0,0.01",
                    help="other loss rates to run the N sweep at, for the load figure ('' for none)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    ns = [int(x) for x in args.ns.split(",")]

    def n_sweep(loss: float) -> list:
        out = []
        for n in ns:
            periods = min(args.periods, args.max_node_periods // n)
            sc = Scenario(nodes=n, periods=periods, loss=loss, crash=args.crash, seed=args.seed)
            r = simulate(sc)
            print(f"loss {loss:g} N={n}: {r.timing()['cpu_seconds']:.1f} s cpu", file=sys.stderr, flush=True)
            out.append(r)
        return out

    results = n_sweep(args.loss)
    load_sweeps = {loss: n_sweep(loss) for loss in [float(x) for x in args.load_losses.split(",") if x]}
    sweep = []
    for loss in [float(x) for x in args.sweep_losses.split(",")]:
        sc = Scenario(nodes=args.sweep_n, periods=args.sweep_periods, loss=loss, crash=0.0, seed=args.seed,
                      joins=0, meta_changes=0)
        sweep.append(simulate(sc))
        print(f"loss {loss}: done", file=sys.stderr, flush=True)

    figs = [plot_detection_cdf([r for r in results if r.scenario.nodes == 1000] or results[-1:], args.out)]
    path, (a, c) = plot_dissemination(results, args.out)
    figs += [path, plot_load(results, args.out, load_sweeps), plot_false_positives(sweep, args.out)]

    rows = [
        "| N | periods | false dead | first suspicion med (s) | all know dead med / max (s) "
        "| all know from first suspicion med / max (s) | suspicion min / max (s) "
        "| join 99% / 100% (periods) | meta 99% / 100% (periods) | msgs / member / period "
        "| bytes / member / period | CPU µs / node-period |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        d, dis, load, t = r.detection(), r.dissemination(), r.load(), r.timing()
        low, high = r.bounds
        rows.append(
            f"| {r.scenario.nodes} | {r.scenario.periods} | {r.false_dead} "
            f"| {_f(d['first_suspect_median_s'])} "
            f"| {_f(d['all_know_median_s'])} / {_f(d['all_know_max_s'])} "
            f"| {_f(d['all_know_from_first_suspect_median_s'])} "
            f"/ {_f(d['all_know_from_first_suspect_max_s'])} "
            f"| {low:.1f} / {high:.1f} "
            f"| {_f(dis['join']['p99_rounds_median'])} / {_f(dis['join']['p100_rounds_median'])} "
            f"| {_f(dis['meta']['p99_rounds_median'])} / {_f(dis['meta']['p100_rounds_median'])} "
            f"| {load['messages_per_member_period']:.2f} | {load['bytes_per_member_period']:.0f} "
            f"| {t['cpu_us_per_node_period']:.0f} |"
        )
    sweep_rows = ["| loss | false suspicions / member-period | false dead views | msgs / member / period |",
                  "|---|---|---|---|"]
    for r in sweep:
        rate = r.false_suspicions / r.member_periods / r.scenario.nodes
        sweep_rows.append(f"| {r.scenario.loss:g} | {rate:.2e} | {r.false_dead} "
                          f"| {r.load()['messages_per_member_period']:.2f} |")

    def load_line(loss: float, rs: list) -> str:
        msgs = [r.load()["messages_per_member_period"] for r in rs]
        gossip = [r.counters.get("tx_gossip", 0) / r.member_periods for r in rs]
        first = msgs[0]
        return (f"| {loss:g} | " + " | ".join(f"{m:.2f} ({g:.2f})" for m, g in zip(msgs, gossip, strict=True))
                + f" | {max(abs(m - first) / first for m in msgs):.1%} |")

    load_rows = ["| loss | " + " | ".join(f"N={n}" for n in ns) + " | max change from N=" + str(ns[0]) + " |",
                 "|---" * (len(ns) + 2) + "|"]
    for loss, rs in sorted({args.loss: results, **load_sweeps}.items()):
        load_rows.append(load_line(loss, rs))
    fit = f"join to 99%: rounds = {a:.3f} + {c:.3f}·ln N"
    text = "\n".join(rows + ["", fit, "", "messages per member per period (of which gossip):", ""] + load_rows
                     + [""] + sweep_rows)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"scale": [r.to_dict(timing=True) for r in results],
                   "load_sweeps": {f"{loss:g}": [r.to_dict(timing=True) for r in rs]
                                   for loss, rs in load_sweeps.items()},
                   "loss_sweep": [r.to_dict(timing=True) for r in sweep],
                   "fit": {"a": a, "c": c}}, f, indent=1)
        f.write("\n")
    print(text)
    print("figures: " + ", ".join(figs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
