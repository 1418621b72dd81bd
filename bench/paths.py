#!/usr/bin/env python3
"""Direct vs relay on loopback, side by side in one run.

Two meshd nodes in one trio process, and a relay in a process of its own
(``python -m meshd relay``), as it runs in a deployment: the relay's work
competes with the nodes' for a CPU, never for their event loop.  For each
path, N messages of SIZE bytes go A -> B over the data channel, one at a time
(each waits for its ack): the one-way latency is the receiver's clock minus
the sender's stamp (same process, same clock).  Then messages/s with W senders
in flight.  The relay path is forced with a one-way drop, as a real filter
would.

Each path runs twice, in one run: without a mesh key, and with one (every
gossip datagram and relay payload sealed, the relay admitting members only);
the data channel encrypts its chunks either way.  The last lines are the
ratios, relay / direct and mesh key / none.

    .venv/bin/python bench/paths.py [--messages 2000] [--size 1024] [--window 8]
"""

from __future__ import annotations

import argparse
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from meshd import keyring
from meshd.node import NodeOptions
from meshd.testing.inprocess import start_node, wait_converged

_STAMP = struct.Struct("!d")
RELAY_START_TIMEOUT = 20.0  # python start-up and imports, on a loaded machine
RELAY_STOP_TIMEOUT = 5.0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@asynccontextmanager
async def relay_process(key_file: Path | None, log_file: Path) -> AsyncIterator[str]:
    """``meshd relay`` on a free loopback port in a process of its own; yields its ws:// URL.

    Its stderr goes to ``log_file``, shown if it fails to start.  Stopped with SIGTERM
    (then SIGKILL) on the way out.
    """
    cmd = [sys.executable, "-m", "meshd", "relay", "--bind", "127.0.0.1:0"]
    if key_file is not None:
        cmd += ["--mesh-key-file", str(key_file)]
    with open(log_file, "wb") as err:
        proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    try:
        url = None
        buf = b""
        with trio.move_on_after(RELAY_START_TIMEOUT):
            while url is None:
                data = await proc.stdout.receive_some()
                if not data:
                    break  # it exited
                *lines, buf = (buf + data).split(b"\n")  # whole lines only
                for line in lines:
                    if line.startswith(b"meshd relay url="):
                        url = line.split()[2][len(b"url="):].decode()
        if url is None:
            raise RuntimeError(f"relay did not start within {RELAY_START_TIMEOUT:g}s: "
                               f"{log_file.read_text(errors='replace')[-2000:] or 'no output'}")
        yield url
    finally:
        with trio.CancelScope(shield=True):
            proc.terminate()
            with trio.move_on_after(RELAY_STOP_TIMEOUT):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await proc.stdout.aclose()


async def measure(path: str, messages: int, size: int, window: int, key_file: Path | None,
                  tmp: Path) -> dict:
    lines: list[str] = []
    mesh_key = keyring.load(key_file) if key_file is not None else None
    async with relay_process(key_file, tmp / "relay.log") as url, trio.open_nursery() as nursery:
        opts = dict(profile="local", relay=url, stages=2, mesh_key=mesh_key)
        b = await start_node(nursery, NodeOptions(stage=1, **opts), lines)
        a = await start_node(nursery, NodeOptions(stage=0, seeds=[b.addr], **opts), lines)
        await wait_converged([a, b])
        if path == "relay":
            # After the join (a seed must be reachable both ways): A's direct packets to B are lost.
            a.options.faults.drop_to.add(b.addr)
        dst = b.identity.node_id
        latencies: list[float] = []
        pad = b"x" * max(0, size - _STAMP.size)

        async def receive(count: int) -> None:
            async for _src, data in b.data.received:
                latencies.append(time.perf_counter() - _STAMP.unpack_from(data)[0])
                if len(latencies) == count:
                    return

        # Warm up: let the path settle (the relay case first tries direct and backs off).
        async with trio.open_nursery() as n:
            n.start_soon(receive, 20)
            for _ in range(20):
                used = await a.send(dst, _STAMP.pack(time.perf_counter()) + pad, timeout=30)
        assert used == path, f"expected the {path} path, got {used}"
        latencies.clear()

        async with trio.open_nursery() as n:
            n.start_soon(receive, messages)
            for _ in range(messages):
                await a.send(dst, _STAMP.pack(time.perf_counter()) + pad, timeout=30)
        one_way = list(latencies)
        latencies.clear()

        async def sender(count: int) -> None:
            for _ in range(count):
                await a.send(dst, _STAMP.pack(time.perf_counter()) + pad, timeout=30)

        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            n.start_soon(receive, messages)
            for i in range(window):  # the first messages % window senders send one more
                n.start_soon(sender, messages // window + (i < messages % window))
        rate = messages / (time.perf_counter() - t0)
        nursery.cancel_scope.cancel()
    return {
        "path": path + (" keyed" if key_file else ""),
        "median_ms": statistics.median(one_way) * 1000,
        "p99_ms": pct(one_way, 0.99) * 1000,
        "msgs_per_s": rate,
    }


def _ratios(label: str, a: dict, b: dict) -> str:
    return (f"{label}: median latency x{a['median_ms'] / b['median_ms']:.2f} "
            f"({a['median_ms'] - b['median_ms']:+.3f} ms), "
            f"p99 x{a['p99_ms'] / b['p99_ms']:.2f}, throughput x{a['msgs_per_s'] / b['msgs_per_s']:.2f}")


async def main_async(args) -> None:
    results = {}
    with tempfile.TemporaryDirectory(prefix="meshd-bench-") as tmp:
        key_file = Path(tmp) / "mesh.key"
        keyring.generate_file(key_file)
        for path in ("direct", "relay"):
            for key in (None, key_file):  # side by side: each path without, then with a mesh key
                r = await measure(path, args.messages, args.size, args.window, key, Path(tmp))
                results[r["path"]] = r
    print(f"{args.messages} messages of {args.size} B, A -> B on loopback (nodes in one process, "
          f"the relay in its own; msgs/s with {args.window} in flight)")
    print(f"{'path':<13} {'median one-way':>15} {'p99 one-way':>12} {'msgs/s':>9}")
    for r in results.values():
        print(f"{r['path']:<13} {r['median_ms']:>12.3f} ms {r['p99_ms']:>9.3f} ms {r['msgs_per_s']:>9.0f}")
    print(_ratios("relay/direct", results["relay"], results["direct"]))
    print(_ratios("relay/direct, mesh key", results["relay keyed"], results["direct keyed"]))
    print(_ratios("direct, mesh key/none", results["direct keyed"], results["direct"]))
    print(_ratios("relay, mesh key/none", results["relay keyed"], results["relay"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--window", type=int, default=8)
    args = parser.parse_args()
    if args.messages < args.window or args.size < _STAMP.size:
        parser.error("--messages must be at least --window, --size at least 8")
    trio.run(main_async, args)


if __name__ == "__main__":
    main()
