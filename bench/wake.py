#!/usr/bin/env python3
"""How long a message on loopback TCP takes to reach a process that was asleep waiting
for it, by how long it slept: a plain blocking ``recv`` beside a trio task in
``receive_some`` (how every meshd stage reads its data streams).

A writer process sends a 1500-byte message (its send time inside), waits for the
1500-byte answer, sleeps ``--idle`` µs, and sends again; the reader timestamps each
message as its read returns.  Medians of ``--messages`` one-way times, in µs, side by
side for each idle time.  A stage of a single-stream pipeline sleeps most of each token
(4-5 ms on the small preset), so each hop pays the long figure.

    .venv/bin/python bench/wake.py [--idle 300 5000] [--messages 400] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import statistics
import struct
import time

import trio

SIZE = 1500
_STAMP = struct.Struct("d")


def _writer(port: int, idle_s: float, count: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(count):
        sock.sendall(_STAMP.pack(time.time()) + bytes(SIZE - _STAMP.size))
        got = 0
        while got < SIZE:
            got += len(sock.recv(65536))
        time.sleep(idle_s)
    sock.close()


def _take(buf: bytearray, now: float, lat: list[float]) -> int:
    """One-way times of the whole messages in ``buf`` (removed from it); how many."""
    n = 0
    while len(buf) >= SIZE:
        lat.append(now - _STAMP.unpack_from(buf)[0])
        del buf[:SIZE]
        n += 1
    return n


def blocking_reader(conn: socket.socket) -> list[float]:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf, lat = bytearray(), list[float]()
    while data := conn.recv(65536):
        now = time.time()
        buf += data
        for _ in range(_take(buf, now, lat)):
            conn.sendall(bytes(SIZE))
    return lat


def trio_reader(conn: socket.socket) -> list[float]:
    async def main() -> list[float]:
        conn.setblocking(False)
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
        buf, lat = bytearray(), list[float]()
        while data := await stream.receive_some(65536):
            now = time.time()
            buf += data
            for _ in range(_take(buf, now, lat)):
                await stream.send_all(bytes(SIZE))
        return lat

    return trio.run(main)


def one_way_us(reader: str, idle_us: int, count: int) -> float:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    writer = multiprocessing.Process(target=_writer, args=(port, idle_us / 1e6, count))
    writer.start()
    try:
        listener.settimeout(30)
        conn, _ = listener.accept()
        conn.settimeout(None)
        with conn:
            lat = (blocking_reader if reader == "blocking" else trio_reader)(conn)
    finally:
        listener.close()
        writer.join(timeout=30)
        if writer.is_alive():
            writer.kill()
    if len(lat) < count:
        raise SystemExit(f"the writer stopped after {len(lat)} of {count} messages")
    return statistics.median(lat[count // 10:]) * 1e6  # past the first: connection warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, nargs="+", default=[300, 5000], metavar="US",
                        help="how long the writer waits between messages, µs (default: 300 5000)")
    parser.add_argument("--messages", type=int, default=400, help="messages per measurement (default: 400)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.messages < 10 or any(i < 0 for i in args.idle):
        parser.error("--messages must be at least 10 and every --idle at least 0")
    results = {str(idle): {reader: round(one_way_us(reader, idle, args.messages), 1)
                           for reader in ("blocking", "trio")} for idle in args.idle}
    if args.json:
        print(json.dumps({"one_way_us": results, "messages": args.messages}))
        return
    print(f"one-way time to a sleeping reader, µs (median of {args.messages} messages)")
    print(f"{'reader slept':>14} {'blocking recv':>14} {'trio':>8} {'trio / blocking':>16}")
    for idle, row in results.items():
        print(f"{int(idle) / 1000:>11.1f} ms {row['blocking']:>14.1f} {row['trio']:>8.1f} "
              f"{row['trio'] / row['blocking']:>15.2f}x")


if __name__ == "__main__":
    main()
