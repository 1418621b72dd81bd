"""The relay against clients that attack it: impersonation through the payload, and memory floods."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import trio
from test_relay import (
    BOOT_RE,
    WAIT,
    assert_exchange,
    authenticate,
    closed_with,
    next_frame,
    packet,
    raw_connect,
    start_client,
    start_relay,
    wait_until,
)

from meshd.identity import Identity
from meshd.relay import protocol
from meshd.relay.protocol import PeerNotHere, Recv
from meshd.relay.server import Relay, RelayConfig
from meshd.wire import Packet, Ping, encode

# --- a proven connection speaks only for itself ---


async def test_packet_claiming_another_sender_is_dropped_and_the_honest_one_delivered():
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery)
        a = await start_client(nursery, port)
        b = await start_client(nursery, port)  # the node A pretends to be
        c = await start_client(nursery, port)
        a_id, b_id, c_id = a.identity.node_id, b.identity.node_id, c.identity.node_id
        forged = encode(Packet(sender=b_id, messages=(Ping(1, c_id),)))
        await a.send(c_id, forged)  # gossip
        await a.send(c_id, b"D" + forged)  # data channel
        await a.send(c_id, b"not a packet")
        await a.send(c_id, b"D")
        honest = encode(Packet(sender=a_id, messages=(Ping(2, c_id),)))
        await a.send(c_id, honest)
        await a.send(c_id, b"D" + honest)
        # Frames from one connection are forwarded in order: the honest ones come first
        # only if nothing sent before them got through.
        assert await next_frame(c) == Recv(a_id, honest)
        assert await next_frame(c) == Recv(a_id, b"D" + honest)
        snap = relay.snapshot()
        assert snap["dropped_sender_mismatch"] == 2
        assert snap["dropped_malformed"] == 2
        assert snap["frames_forwarded"] == 2
        assert snap["clients"][a.identity.prefix]["dropped"] == 4
        # One bad frame does not cost the connection: A still talks to B, and C heard nothing more.
        assert a.connected and relay.is_connected(a_id)
        await assert_exchange(a, b)
        with pytest.raises(trio.WouldBlock):
            c.received.receive_nowait()
        nursery.cancel_scope.cancel()


# --- memory: clients that never read, fed by flooders ---

NON_READERS = 16
FLOODERS = 4
FLOOD_MIN_S = 10  # flood at least this long, and on until every non-reader is dropped
FLOOD_MAX_S = 20
RSS_GROWTH_LIMIT = 50 * 1024 * 1024


def rss_bytes(pid: int) -> tuple[int, int]:
    """The process's resident set now and at its peak (VmRSS, VmHWM), in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


async def connect_non_reader(port: int, nursery: trio.Nursery) -> bytes:
    """Authenticate a bare WebSocket, then never read from it again; its node id."""
    me = Identity.generate()
    ws, nonce = await raw_connect(port, nursery)
    await ws.send_message(authenticate(me, nonce))
    with trio.fail_after(WAIT):
        assert isinstance(protocol.decode(await ws.get_message()), protocol.Accepted)
    return me.node_id


async def flood(client, targets: list[bytes], dropped: set[bytes]) -> None:
    """Send full-size packets to ``targets`` in turn, as fast as the connection takes them;
    ``dropped`` collects the targets the relay reports gone."""
    frame = packet(client.identity.node_id, size=protocol.MAX_PAYLOAD, data=True)

    async def notices() -> None:
        async for item in client.received:
            if isinstance(item, PeerNotHere):
                dropped.add(item.node_id)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(notices)
        while True:
            for dst in targets:
                await client.send(dst, frame)



async def test_queues_are_bounded_in_bytes_per_client_and_in_all():
    frame = protocol.MAX_FRAME  # every Recv here is one full frame
    # Three full queues would hold 12 frames, more than the 10 allowed in all: once all three
    # clients stop taking frames, one queue reaches its own limit and the total reaches its.
    config = RelayConfig(queue_bytes=4 * frame, total_queue_bytes=10 * frame)
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery, Relay(config))
        stuck = [await connect_non_reader(port, nursery) for _ in range(3)]
        flooder = await start_client(nursery, port)
        peak_total = peak_client = 0

        async def watch() -> None:
            nonlocal peak_total, peak_client
            while True:
                peak_total = max(peak_total, relay.queued_bytes)
                clients = relay.snapshot()["clients"].values()
                peak_client = max([peak_client, *(c["queued_bytes"] for c in clients)])
                await trio.sleep(0)

        nursery.start_soon(watch)
        nursery.start_soon(flood, flooder, stuck, set())
        await wait_until(lambda: relay.dropped_queue_full and relay.dropped_relay_full, "both limits hit")
        assert peak_client == config.queue_bytes
        assert peak_total == config.total_queue_bytes
        # They are dropped for not reading, and what was queued for them is given back.
        await wait_until(lambda: not any(map(relay.is_connected, stuck)), "stuck clients dropped")
        assert relay.dead == 3
        await wait_until(lambda: relay.queued_bytes == 0, "queues released")
        nursery.cancel_scope.cancel()


def MiB(n: int) -> str:
    return f"{n / 1024 / 1024:.1f} MiB"


@pytest.mark.processes
async def test_non_reading_clients_under_a_flood_keep_the_relays_memory_bounded(tmp_path):
    with open(tmp_path / "relay.stderr", "w+") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "meshd", "relay", "--bind", "127.0.0.1:0"],
                                stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True)
        try:
            with trio.fail_after(20):
                line = await trio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
            boot = BOOT_RE.match(line.strip())
            assert boot, f"no boot line: {line!r}"
            port = int(boot["port"])
            await flood_and_measure(proc, port)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            stderr.seek(0)
            assert "Traceback" not in stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def flood_and_measure(proc: subprocess.Popen, port: int) -> None:
    async with trio.open_nursery() as nursery:
        non_readers = [await connect_non_reader(port, nursery) for _ in range(NON_READERS)]
        dropped: set[bytes] = set()
        async with trio.open_nursery() as flooding:
            flooders = [await start_client(flooding, port) for _ in range(FLOODERS)]
            await trio.sleep(0.5)  # let the relay settle after the connections
            start, _ = rss_bytes(proc.pid)
            began = trio.current_time()
            for i, client in enumerate(flooders):
                # Each flooder starts at a different target, so all the queues fill at once.
                k = i * NON_READERS // FLOODERS
                flooding.start_soon(flood, client, non_readers[k:] + non_readers[:k], dropped)
            with trio.move_on_after(FLOOD_MAX_S):
                await trio.sleep(FLOOD_MIN_S)
                while len(dropped) < NON_READERS:
                    await trio.sleep(0.1)
            flooded_s = trio.current_time() - began
            offered = sum(c.counters["sent"] for c in flooders) * protocol.MAX_PAYLOAD
            flooding.cancel_scope.cancel()  # the flooders and their connections
        _, peak = rss_bytes(proc.pid)
        assert proc.poll() is None, "the relay died under the flood"
        fresh_a = await start_client(nursery, port)
        fresh_b = await start_client(nursery, port)
        await assert_exchange(fresh_a, fresh_b, b"after the flood")
        end, _ = rss_bytes(proc.pid)
        print(f"relay RSS: start {MiB(start)}, peak {MiB(peak)} (+{MiB(peak - start)}), end {MiB(end)}; "
              f"flooded {MiB(offered)} in {flooded_s:.1f}s, {len(dropped)}/{NON_READERS} non-readers dropped")
        # The flood offered the relay far more than it may keep: holding it would fail the test.
        assert offered > 4 * RSS_GROWTH_LIMIT
        assert peak - start < RSS_GROWTH_LIMIT, f"relay RSS grew from {MiB(start)} to {MiB(peak)}"
        assert len(dropped) == NON_READERS, f"only {len(dropped)} of {NON_READERS} non-readers were dropped"
        nursery.cancel_scope.cancel()


async def test_past_max_clients_a_new_node_is_refused_and_a_connected_one_may_reconnect():
    """Without a mesh key anyone can prove a fresh id: a crowd of them fills the relay up to
    --max-clients, never past it, and the clients it holds keep their places."""
    with trio.fail_after(WAIT * 3):
        async with trio.open_nursery() as nursery:
            _, port, relay = await start_relay(nursery, Relay(RelayConfig(max_clients=2)))
            a = await start_client(nursery, port)
            b = await start_client(nursery, port)
            for _ in range(3):
                ws, nonce = await raw_connect(port, nursery)
                await ws.send_message(authenticate(Identity.generate(), nonce))
                code, text = await closed_with(ws)
                assert code == protocol.CLOSE_FULL and "holds 2 clients (--max-clients)" in text, text
            assert relay.refused["full"] == 3 and relay.snapshot()["clients_connected"] == 2
            await assert_exchange(a, b, b"still here")
            ws, nonce = await raw_connect(port, nursery)  # a's own id, from a new connection
            await ws.send_message(authenticate(a.identity, nonce))
            assert isinstance(protocol.decode(await ws.get_message()), protocol.Accepted)
            nursery.cancel_scope.cancel()


def test_relay_max_clients_must_be_a_positive_whole_number():
    out = subprocess.run([sys.executable, "-m", "meshd", "relay", "--max-clients", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--max-clients" in out.stderr and "Traceback" not in out.stderr
