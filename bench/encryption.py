#!/usr/bin/env python3
"""What end-to-end encryption costs the data channel: sealed vs in clear, side by side.

Two data channels in one trio process, A -> B over a loopback stream (the
path where the cipher's cost shows most: the relay's own costs would hide
it).  For each message size, the same code path runs with chunks sealed
(AES-256-GCM, as always in production) and in clear (``DataChannel(...,
encrypt=False)``, which exists for this comparison only), in alternating
rounds so both see the same machine state:

- one-way latency: one message at a time, each waiting for its ack; the
  receiver's clock minus the sender's stamp (same process, same clock);
- throughput: ``--burst`` messages posted back to back, until the last is
  received.

Each figure is the median over ``--rounds`` rounds.

    .venv/bin/python bench/encryption.py [--rounds 5] [--messages 300] [--burst 400]
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from meshd.identity import Identity
from meshd.net.channel import DataChannel
from meshd.net.data_keys import ProcessKeys
from meshd.wire import DataChunk

_STAMP = struct.Struct("!d")
SIZES = (64 * 1024, 4 * 1024)
MODES = ("sealed", "clear")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@asynccontextmanager
async def channel_pair(encrypt: bool) -> AsyncIterator[tuple[DataChannel, DataChannel]]:
    """A and B, serving on loopback; A reaches B by a stream (its handshake exchanges the keys)."""
    addrs: dict[bytes, str] = {}
    channels = []
    async with trio.open_nursery() as nursery:
        for identity in (Identity.generate(), Identity.generate()):
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            addrs[identity.node_id] = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            channel = DataChannel(identity.node_id, addr_of=addrs.get, describe=lambda n: n.hex()[:8],
                                  relay_send=None, sign=identity.sign, encrypt=encrypt)
            await nursery.start(channel.serve, listeners)
            channels.append(channel)
        yield channels[0], channels[1]
        nursery.cancel_scope.cancel()


async def latency(a: DataChannel, b: DataChannel, size: int, messages: int) -> list[float]:
    """One-way seconds of ``messages`` messages of ``size`` bytes, sent one at a time."""
    pad = b"x" * (size - _STAMP.size)
    out: list[float] = []

    async def receive() -> None:  # as each arrives, not after its ack
        for _ in range(messages):
            _, data = await b.received.receive()
            out.append(time.perf_counter() - _STAMP.unpack_from(data)[0])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        for _ in range(messages):
            await a.send(b.id, _STAMP.pack(time.perf_counter()) + pad)
    return out


async def throughput(a: DataChannel, b: DataChannel, size: int, burst: int) -> float:
    """Bytes per second of ``burst`` messages of ``size`` bytes posted back to back."""
    data = b"y" * size

    async def drain() -> None:
        for _ in range(burst):
            await b.received.receive()

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain)
        for _ in range(burst):
            await a.post(b.id, data, timeout=60)
    return burst * size / (time.perf_counter() - t0)


async def one_round(size: int, encrypt: bool, messages: int, burst: int) -> dict[str, float]:
    with trio.fail_after(300):
        async with channel_pair(encrypt) as (a, b):
            await latency(a, b, size, 20)  # warm up: the dial, the handshake, the allocator
            one_way = await latency(a, b, size, messages)
            rate = await throughput(a, b, size, burst)
    return {"median_us": statistics.median(one_way) * 1e6, "p99_us": pct(one_way, 0.99) * 1e6,
            "mb_s": rate / 1e6}


def cipher_us(size: int, rounds: int = 2000) -> tuple[float, float]:
    """µs to seal and to open ``size`` bytes as one chunk (the cipher alone, no I/O)."""
    a, b = ProcessKeys(b"a" * 32, 1), ProcessKeys(b"b" * 32, 2)
    to_b, at_b = a.pair(b.node_id, 2, b.public), b.pair(a.node_id, 1, a.public)
    data = b"z" * size
    t0 = time.perf_counter()
    for _ in range(rounds):
        sealed = to_b.seal(1, 1, size, 0, data)
    t1 = time.perf_counter()
    chunk = DataChunk(1, 1, size, 0, sealed)
    for _ in range(rounds):
        at_b.open(chunk)
    t2 = time.perf_counter()
    return (t1 - t0) / rounds * 1e6, (t2 - t1) / rounds * 1e6


async def main_async(args: argparse.Namespace) -> None:
    results: dict[tuple[int, str], list[dict[str, float]]] = {(s, m): [] for s in SIZES for m in MODES}
    for _ in range(args.rounds):
        for size in SIZES:
            for mode in MODES:
                results[size, mode].append(await one_round(size, mode == "sealed", args.messages, args.burst))

    def med(size: int, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[size, mode])

    print(f"data channel A -> B over a loopback stream, one process; median of {args.rounds} rounds "
          f"({args.messages} one-at-a-time messages, {args.burst} posted back to back)")
    print(f"{'size':>7} {'chunks':<7} {'one-way median':>15} {'p99':>11} {'throughput':>12} "
          f"{'cipher alone':>16}")
    for size in SIZES:
        seal_us, open_us = cipher_us(size)
        for mode in MODES:
            cipher = f"{seal_us:.1f}+{open_us:.1f} µs" if mode == "sealed" else "-"
            print(f"{size // 1024:>4} KiB {mode:<7} {med(size, mode, 'median_us'):>12.0f} µs "
                  f"{med(size, mode, 'p99_us'):>8.0f} µs {med(size, mode, 'mb_s'):>8.1f} MB/s {cipher:>16}")
    for size in SIZES:
        lat = med(size, "sealed", "median_us") / med(size, "clear", "median_us")
        p99 = med(size, "sealed", "p99_us") / med(size, "clear", "p99_us")
        rate = med(size, "sealed", "mb_s") / med(size, "clear", "mb_s")
        print(f"sealed/clear at {size // 1024} KiB: median latency x{lat:.2f}, p99 x{p99:.2f}, "
              f"throughput x{rate:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--burst", type=int, default=400)
    args = parser.parse_args()
    if min(args.rounds, args.messages, args.burst) < 1:
        parser.error("--rounds, --messages and --burst must be at least 1")
    trio.run(main_async, args)


if __name__ == "__main__":
    main()
