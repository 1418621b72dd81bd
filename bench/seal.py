#!/usr/bin/env python3
"""What the mesh key costs per packet: seal and open (AES-256-GCM), beside an ed25519
signature and its check, the other per-packet cost a signed fact can add.

Each figure is the median over ``--rounds`` rounds of ``--batch`` calls, in µs per call,
for a 200-byte packet (a ping with a little gossip) and a 1200-byte one (a full gossip
budget).

    .venv/bin/python bench/seal.py [--rounds 200] [--batch 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

from meshd.identity import Identity, verify
from meshd.keyring import Keyring, generate_key

SIZES = (200, 1200)


def median_us(call: Callable[[], object], rounds: int, batch: int) -> float:
    """Median µs per call of ``call``, over ``rounds`` timed batches of ``batch`` calls."""
    for _ in range(batch):  # warm up: caches, the allocator, the CPU's clock
        call()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(batch):
            call()
        times.append((time.perf_counter_ns() - t0) / batch / 1000)
    return statistics.median(times)


def measure(rounds: int, batch: int) -> dict[str, dict[str, float]]:
    ring = Keyring([generate_key()])
    identity = Identity.generate()
    out: dict[str, dict[str, float]] = {}
    for size in SIZES:
        data = os.urandom(size)
        sealed = ring.seal(data)
        signature = identity.sign(data)
        assert ring.open(sealed) == data and verify(identity.node_id, signature, data)
        out[str(size)] = {
            "seal_us": median_us(lambda d=data: ring.seal(d), rounds, batch),
            "open_us": median_us(lambda s=sealed: ring.open(s), rounds, batch),
            "sign_us": median_us(lambda d=data: identity.sign(d), rounds, batch),
            "verify_us": median_us(lambda d=data, s=signature: verify(identity.node_id, s, d),
                                   rounds, batch),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args()
    result = measure(args.rounds, args.batch)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'bytes':>6} {'seal µs':>8} {'open µs':>8} {'sign µs':>8} {'verify µs':>10}")
    for size, r in result.items():
        print(f"{size:>6} {r['seal_us']:8.2f} {r['open_us']:8.2f} {r['sign_us']:8.2f} {r['verify_us']:10.2f}")


if __name__ == "__main__":
    main()
