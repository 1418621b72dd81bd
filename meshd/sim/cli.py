"""``meshd sim``: argument parsing and output; the work is in scenario.py."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from ..argtypes import int_up_to, writable_dir
from ..swim import PROFILES

# Every member's view of every other is held in this process, so memory grows as N²: 3000
# nodes (the largest docs/scale.md measures) hold about 2.5 GB, 10000 would not fit in most
# machines' memory. A node-period costs 0.2-1 ms of CPU: 1000 periods of 100 nodes take a minute
# or two, of 3000 nodes most of an hour.
MAX_NODES = 3000
MAX_PERIODS = 1000


def _int_at_least(low: int, most: int | None = None, what: str = ""):
    """A whole number from ``low`` (to ``most``, when given); past ``most``, "must be at most
    ``most`` ``what``", as ``argtypes.int_up_to`` says it."""
    limit = f"{most} {what}" if what else str(most)

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {low}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {limit}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be in [0, 1)")
    return value


def _latency(text: str) -> str:
    from .network import Latency, SpecError

    try:
        return str(Latency.parse(text))
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "sim",
        help="simulate the real SWIM core on N in-memory nodes",
        description="Drive the real meshd SWIM core over a seeded in-memory network and measure "
        "failure detection, dissemination and load. The same seed gives the same output, byte for byte.",
    )
    p.add_argument("--nodes", type=_int_at_least(2, MAX_NODES, "nodes, held in one process"), default=100,
                   metavar="N", help=f"members at the start, 2 to {MAX_NODES} (default %(default)s)")
    p.add_argument("--periods", type=int_up_to(MAX_PERIODS, "periods"), default=100, metavar="P",
                   help=f"protocol periods to simulate, up to {MAX_PERIODS} (default %(default)s)")
    p.add_argument("--loss", type=_fraction, default=0.0, metavar="P",
                   help="packet loss on every link, each direction (default %(default)s)")
    p.add_argument("--latency", type=_latency, default="uniform:0.5:1.5", metavar="DIST",
                   help="one-way delay: fixed:MS, uniform:LO:HI or lognormal:MEDIAN_MS:SIGMA "
                   "(default %(default)s)")
    p.add_argument("--asym", type=_fraction, default=0.0, metavar="FRACTION",
                   help="fraction of directed links blocked one way (default %(default)s)")
    relay = p.add_mutually_exclusive_group()
    relay.add_argument("--relay", dest="relay", action="store_true", default=True,
                       help="a blocked direction goes through a relay (default)")
    relay.add_argument("--no-relay", dest="relay", action="store_false",
                       help="a blocked direction loses every packet")
    p.add_argument("--crash", type=_fraction, default=0.0, metavar="FRACTION",
                   help="fraction of nodes crashed early in the run (default %(default)s)")
    p.add_argument("--churn", type=_fraction, default=0.0, metavar="RATE",
                   help="per period, this fraction of members leaves and as many new ones join")
    p.add_argument("--seed", type=_int_at_least(0), default=0, metavar="S", help="(default %(default)s)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="lan",
                   help="protocol timings, as memberlist's profiles (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.add_argument("--timing", action="store_true",
                   help="include CPU time in the output (it varies run to run)")
    p.add_argument("--plot", type=writable_dir, metavar="DIR",
                   help="write the detection-time CDF for this run to DIR/detection_cdf.png")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .scenario import Scenario, simulate

    sc = Scenario(
        nodes=args.nodes, periods=args.periods, loss=args.loss, latency=args.latency,
        asym=args.asym, relay=args.relay, crash=args.crash, churn=args.churn,
        seed=args.seed, profile=args.profile,
    )
    if args.crash and round(args.crash * args.nodes) == 0:
        parser.error(f"sim: --crash {args.crash} of {args.nodes} nodes crashes none")
    progress: Callable[[int], None]
    show = not args.json and sys.stderr.isatty()
    if show:
        from rich.progress import Progress

        bar = Progress(transient=True)
        task = bar.add_task(f"{args.nodes} nodes", total=args.periods)
        bar.start()

        def progress(period: int) -> None:
            bar.update(task, completed=period)
    else:
        progress = _progress_lines(args.nodes, args.periods)

    try:
        result = simulate(sc, progress)
    finally:
        if show:
            bar.stop()
    data = result.to_dict(timing=args.timing)
    plot_failed = False
    if args.plot:
        from .plots import plot_detection_cdf

        try:
            path = plot_detection_cdf([result], args.plot)
        except OSError as exc:  # the directory went away or filled while the simulation ran
            print(f"meshd: error: sim: --plot {args.plot}: {exc.strerror or exc}", file=sys.stderr)
            plot_failed = True
        if not plot_failed and not args.json:
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(data, sort_keys=False))
    else:
        print(format_text(data))
        if not args.timing:
            t = result.timing()
            print(f"cpu: {t['cpu_seconds']:.1f} s, {t['cpu_us_per_node_period']:.0f} µs per "
                  "node-period", file=sys.stderr)
    return 1 if plot_failed else 0  # the results are printed all the same


PROGRESS_EVERY_S = 10.0  # without a terminal: a line on stderr this often while a run goes on


def _progress_lines(nodes: int, periods: int) -> Callable[[int], None]:
    """Progress for a log or a pipe (stderr not a terminal): a line every PROGRESS_EVERY_S,
    ``meshd sim: period 300 of 1000 (30%), 42 s``; a run shorter than that prints none."""
    start = last = time.monotonic()

    def progress(period: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S and period < periods:
            last = now
            print(f"meshd sim: {nodes} nodes, period {period} of {periods} ({period / periods:.0%}), "
                  f"{now - start:.0f} s", file=sys.stderr, flush=True)

    return progress


def _yes(v: bool) -> str:
    return "yes" if v else "no"


def _fmt(v, unit: str = "") -> str:
    return "-" if v is None else f"{v:g}{unit}"


def format_text(d: dict) -> str:
    p, b, det, dis, load = d["params"], d["bounds"], d["detection"], d["dissemination"], d["load"]
    lines = [
        f"meshd sim: {p['nodes']} nodes, {p['periods']} periods, loss {p['loss']:g}, latency {p['latency']}, "
        f"asym {p['asym']:g} ({'relay' if p['relay'] else 'no relay'}), crash {p['crash']:g}, "
        f"churn {p['churn']:g}, seed {p['seed']}, profile {p['profile']}",
        f"suspicion bounds (memberlist): min {b['suspicion_min_s']:g} s, max {b['suspicion_max_s']:g} s",
        f"false dead: {d['false_dead']} (declared: {d['false_dead_declarations']}), "
        f"false suspicions: {d['false_suspicions']}",
    ]
    if det["crashes"]:
        lines += [
            f"crashes: {det['crashes']}, unresolved {det['unresolved']}",
            f"  first suspicion, median: {_fmt(det['first_suspect_median_s'], ' s')}",
            "  suspicion phase (first suspect -> first dead), median: "
            f"{_fmt(det['suspicion_phase_median_s'], ' s')}",
            f"  all know dead, from the crash, median: {_fmt(det['all_know_median_s'], ' s')}, "
            f"max: {_fmt(det['all_know_max_s'], ' s')}"
            f"  (all within max bound: {_yes(det['all_within_max_bound'])}; "
            f"median within min bound: {_yes(det['median_within_min_bound'])})",
            "  all know dead, from the first suspicion, median: "
            f"{_fmt(det['all_know_from_first_suspect_median_s'], ' s')}, "
            f"max: {_fmt(det['all_know_from_first_suspect_max_s'], ' s')}"
            f"  (median within min bound: {_yes(det['median_from_first_suspect_within_min_bound'])})",
        ]
    for kind, label in (("join", "join"), ("meta", "metadata change")):
        k = dis[kind]
        if k["count"]:
            lines.append(
                f"{label} known to 99%: median {_fmt(k['p99_rounds_median'])} periods; to 100%: "
                f"median {_fmt(k['p100_rounds_median'])} periods "
                f"({k['count']} measured, {k['unfinished']} unfinished)"
            )
    lines.append(f"load: {load['messages_per_member_period']:.2f} messages and "
                 f"{load['bytes_per_member_period']:.0f} bytes per member per period")
    if "timing" in d:
        t = d["timing"]
        lines.append(f"cpu: {t['cpu_seconds']:g} s, {t['cpu_us_per_node_period']:.0f} µs per node-period, "
                     f"wall {t['wall_seconds']:g} s")
    return "\n".join(lines)
