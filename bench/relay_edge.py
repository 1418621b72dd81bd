#!/usr/bin/env python3
"""One relayed pipeline edge against the all-direct pipeline, side by side in one run.

Each pair of runs is two ``meshd smoke-run --stages N --max-tokens K --json``: one
with every direct path working, one with ``--fault drop:stage-1->stage-2`` (stage-1's
direct packets to stage-2 are lost, so that edge's activations go over the relay).
The runs alternate, so both see the same machine; the figures are the medians over
the pairs, and the ratios the medians of the per-pair ratios.

What it shows: how much one relayed edge costs a token (tokens/s) and the first
token (whether the first activation waits for a direct dial to time out).  Extra
``--fault`` specs apply to both runs (``--fault delay:50`` compares a relayed edge
on a slow network).

    .venv/bin/python bench/relay_edge.py [--stages 3] [--tokens 64] [--runs 5] [--stub]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MESHD = [sys.executable, "-m", "meshd"]


def smoke(args: argparse.Namespace, faults: list[str]) -> dict:
    cmd = [*MESHD, "smoke-run", "--stages", str(args.stages), "--max-tokens", str(args.tokens), "--json",
           "--provider", args.provider, *(["--stub"] if args.stub else [])]
    for spec in [*args.fault, *faults]:
        cmd += ["--fault", spec]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = out.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"smoke-run printed no JSON (exit {out.returncode}):\n{out.stdout[-2000:]}"
                         f"\n{out.stderr[-2000:]}") from None
    if not result.get("ok"):
        raise SystemExit(f"smoke-run failed: {result.get('status')}: {result.get('reason')}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=5, help="pairs of runs (default %(default)s)")
    p.add_argument("--provider", default="local")
    p.add_argument("--stub", action="store_true", help="the tiny stub model (the network dominates)")
    p.add_argument("--fault", action="append", default=[], help="a fault spec for both runs")
    args = p.parse_args()
    relayed_fault = "drop:stage-1->stage-2"
    rows = []
    for i in range(args.runs):
        direct = smoke(args, [])
        relayed = smoke(args, [relayed_fault])
        edge = [e for e in relayed["paths"] if (e["from"], e["to"]) == ("stage-1", "stage-2")]
        rows.append((direct["timings"], relayed["timings"], edge[0]["path"] if edge else "?"))
        d, r = rows[-1][0], rows[-1][1]
        print(f"pair {i + 1}: direct first token {d['first_token_s'] * 1000:.0f} ms, "
              f"{d['tokens_per_s']:.1f} tok/s | stage-1->stage-2 {rows[-1][2]}: "
              f"first token {r['first_token_s'] * 1000:.0f} ms, {r['tokens_per_s']:.1f} tok/s", flush=True)

    def med(values) -> float:
        return statistics.median(values)

    first_d = med(d["first_token_s"] for d, _, _ in rows)
    first_r = med(r["first_token_s"] for _, r, _ in rows)
    tps_d = med(d["tokens_per_s"] for d, _, _ in rows)
    tps_r = med(r["tokens_per_s"] for _, r, _ in rows)
    first_gap = med((r["first_token_s"] - d["first_token_s"]) * 1000 for d, r, _ in rows)
    tps_ratio = med(r["tokens_per_s"] / d["tokens_per_s"] for d, r, _ in rows)
    model = "stub" if args.stub else "default model"
    print(f"\nmedians of {args.runs} pairs, {args.stages} stages, {args.tokens} tokens, {model}, "
          f"provider {args.provider}" + (f", faults {' '.join(args.fault)}" if args.fault else ""))
    print(f"  all direct:               first token {first_d * 1000:7.1f} ms   {tps_d:7.1f} tokens/s")
    print(f"  stage-1->stage-2 relayed: first token {first_r * 1000:7.1f} ms   {tps_r:7.1f} tokens/s")
    print(f"  relayed - direct, first token: {first_gap:+.1f} ms (median of pairs)")
    print(f"  relayed / direct, tokens/s:    {tps_ratio:.2f} (median of pairs)")
    print(f"  edge path in the relayed runs: {sorted({e for _, _, e in rows})}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
