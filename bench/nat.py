#!/usr/bin/env python3
"""A stage behind a NAT against none, side by side in one run, on the netns testbed (root).

Each pair of runs is two ``meshd smoke-run --provider netns --stages N --relays 2 --json``:
one with no NAT, one with ``--fault nat:stage-K`` (stage-K behind a masquerading router:
nobody reaches its own address, and the pairs towards it go through a punch, or the relay).
The runs alternate, so both see the same machine; the figures are the medians over the
pairs, and the ratio the median of the per-pair ratios.

    .venv/bin/python bench/nat.py [--stages 5] [--nat stage-2] [--tokens 32] [--runs 3]
                                  [--kind nat|nat-symmetric]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

MESHD = [sys.executable, "-m", "meshd"]


def smoke(args: argparse.Namespace, faults: list[str]) -> dict:
    cmd = [*MESHD, "smoke-run", "--provider", "netns", "--stages", str(args.stages), "--relays", "2",
           "--max-tokens", str(args.tokens), "--json"]
    for spec in faults:
        cmd += ["--fault", spec]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        result = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"smoke-run printed no JSON (exit {out.returncode}):\n"
                         f"{out.stderr[-2000:]}") from None
    if not result.get("ok"):
        raise SystemExit(f"smoke-run failed: {result.get('status')}: {result.get('reason')}")
    return result


def into(result: dict, job: str) -> str:
    """How the pairs towards ``job`` went: punched, direct or relay, counted."""
    kinds = [("punched" if p.get("punched") else p["path"]) for p in result["paths"] if p["to"] == job]
    return ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=5)
    p.add_argument("--nat", default="stage-2", help="the job behind the NAT (default %(default)s)")
    p.add_argument("--kind", choices=["nat", "nat-symmetric"], default="nat")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=3, help="pairs of runs (default %(default)s)")
    args = p.parse_args()
    rows = []
    for i in range(args.runs):
        plain = smoke(args, [])
        natted = smoke(args, [f"{args.kind}:{args.nat}"])
        rows.append((plain["timings"], natted["timings"]))
        print(f"pair {i + 1}: no NAT {plain['timings']['tokens_per_s']:.1f} tok/s | {args.kind}:{args.nat} "
              f"{natted['timings']['tokens_per_s']:.1f} tok/s, NAT seen as {natted['nat'].get(args.nat)}; "
              f"pairs into it: {into(natted, args.nat)}", flush=True)
    tps_plain = statistics.median(a["tokens_per_s"] for a, _ in rows)
    tps_nat = statistics.median(b["tokens_per_s"] for _, b in rows)
    ratio = statistics.median(b["tokens_per_s"] / a["tokens_per_s"] for a, b in rows)
    first = statistics.median((b["first_token_s"] - a["first_token_s"]) * 1000 for a, b in rows)
    print(f"\nmedians of {args.runs} pairs, netns, {args.stages} stages, {args.tokens} tokens, 2 relays")
    print(f"  no NAT:                {tps_plain:7.1f} tokens/s")
    print(f"  {args.kind + ':' + args.nat:22} {tps_nat:7.1f} tokens/s")
    print(f"  NAT / no NAT, tokens/s:   {ratio:.2f} (median of pairs)")
    print(f"  NAT - no NAT, first token: {first:+.1f} ms (median of pairs)")


if __name__ == "__main__":
    main()
