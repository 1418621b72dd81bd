#!/usr/bin/env python3
"""Start a mesh of real `meshd run` processes on loopback, show it, stop it.

Used by `make demo` until the smoke run lands: an orchestrator and N-1 stage
nodes join through the orchestrator, the stage map is printed once every node
sees every other, then each node gets SIGTERM, leaves gracefully, and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time

from meshd.testing.processes import start_mesh, wait_converged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3, help="total nodes, orchestrator included")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for convergence")
    args = parser.parse_args()
    if args.nodes < 2:
        parser.error("--nodes must be at least 2")

    print(f"starting {args.nodes} meshd nodes on loopback ...", flush=True)
    t0 = time.monotonic()
    procs = start_mesh(args.nodes - 1)
    ok = True
    try:
        for p in procs:
            print(f"  {p.name:<13} prefix={p.boot.prefix} addr={p.boot.addr}", flush=True)
        stage_map = wait_converged(procs, args.timeout)
        print(f"converged in {time.monotonic() - t0:.1f}s; stage map:", flush=True)
        for prefix, name in stage_map.items():
            print(f"  {prefix} = {name}", flush=True)
    except (TimeoutError, RuntimeError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        ok = False
    finally:
        print("stopping (SIGTERM: each node leaves the mesh gracefully) ...", flush=True)
        codes = {p.name: p.stop(timeout=5) for p in reversed(procs)}
    print("exit codes: " + ", ".join(f"{name}={code}" for name, code in codes.items()), flush=True)
    ok = ok and all(code == 0 for code in codes.values())
    print("demo passed" if ok else "demo FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
