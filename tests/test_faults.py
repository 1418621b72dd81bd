"""`meshd run --fault` specs: parsed strictly, applied as a packet filter (or tc netem) would."""

import random
import re
from functools import partial

import pytest
import trio

from meshd.identity import Identity
from meshd.net.channel import DataChannel
from meshd.net.faults import RTO_S, Faults, FaultSpecError
from meshd.net.netem_socket import NetemSocket, with_stream_faults


def test_drop_is_one_way_and_blocks_streams_both_ways():
    f = Faults.parse(["drop:127.0.0.1:7001"])
    assert f.direct_out_lost("127.0.0.1:7001")
    assert not f.direct_out_lost("127.0.0.1:7002")
    assert not f.direct_in_lost(("127.0.0.1", 7001)), "their datagrams to us still arrive"
    assert f.stream_blocked("127.0.0.1:7001")
    assert not f.relay_blocked()
    assert f.describe() == ["drop:127.0.0.1:7001"]


def test_isolate_cuts_everything_relay_included():
    f = Faults.parse(["isolate"])
    assert f.direct_out_lost("10.0.0.1:1") and f.direct_in_lost(("10.0.0.1", 1))
    assert f.stream_blocked("10.0.0.1:1") and f.relay_blocked()


async def test_an_isolated_node_never_connects_to_its_relay_and_says_why():
    """``isolate`` cuts the relay too: the relay never sees the node, and the node reads its
    relay as not connected (which doctor names), as behind a real filter."""
    from meshd.relay.client import ClientConfig, RelayClient
    from meshd.relay.server import Relay, serve_relay

    relay = Relay()
    faults = Faults.parse(["isolate"])
    quick = ClientConfig(connect_timeout=0.2, backoff_initial=0.1, backoff_max=0.2)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(partial(serve_relay, "127.0.0.1", 0, relay=relay))
            client = RelayClient(f"ws://{host}:{port}", Identity.generate(), config=quick,
                                 blocked=faults.relay_blocked)
            await nursery.start(client.run)
            await trio.sleep(1.0)  # several attempts
            assert not client.connected and client.counters["attempts"] >= 2
            assert "a fault isolates this node" in (client.last_error or "")
            assert not relay._clients  # the relay never saw it
            faults.isolate = False  # the filter lifted: the next attempt connects
            with trio.fail_after(5):
                while not client.connected:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


def test_loss_drops_about_that_fraction():
    f = Faults.parse(["loss:0.25"])
    f.rng = random.Random(7)
    lost = sum(f.direct_out_lost("10.0.0.1:1") for _ in range(10_000))
    assert 2_200 < lost < 2_800


def test_delay_is_in_milliseconds():
    assert Faults.parse(["delay:40"]).delay_s == pytest.approx(0.040)
    assert not Faults.parse([]).active


@pytest.mark.parametrize(
    "spec, message",
    [
        ("drop:nowhere", "is not HOST:PORT"),
        ("loss:1", "loss must be in [0, 1)"),
        ("loss:x", "is not a number"),
        ("delay:-5", "must be from 0 to 60000 ms"),
        ("isolate:me", "expected drop:HOST:PORT"),
        ("flood", "expected drop:HOST:PORT"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(FaultSpecError, match=re.escape(message)):
        Faults.parse([spec])


# ---------------------------------------------------------------- data streams, as netem holds them


async def _stream_pair(nursery, faults: Faults) -> tuple[trio.SocketStream, trio.SocketStream]:
    """A TCP connection on loopback whose first end's writes are held as ``faults`` say."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listeners[0]:
        port = listeners[0].socket.getsockname()[1]
        dialled = await trio.open_tcp_stream("127.0.0.1", port)
        accepted = await listeners[0].accept()
    held = with_stream_faults(dialled, faults, nursery.start_soon)
    assert isinstance(held.socket, NetemSocket)
    return held, accepted


async def _read_frames(stream, count: int, out: list) -> None:
    """Read ``count`` frames (4-byte numbers) off ``stream``, each with when it arrived."""
    buf = bytearray()
    while len(out) < count:
        data = await stream.receive_some(4096)
        assert data, f"the stream ended after {len(out)} of {count} writes"
        buf += data
        while len(buf) >= 4:
            out.append((int.from_bytes(buf[:4], "big"), trio.current_time()))
            del buf[:4]


async def test_a_delayed_stream_delivers_each_write_the_delay_late_and_in_order(autojump_clock):
    sent: dict[int, float] = {}
    got: list[tuple[int, float]] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            held, peer = await _stream_pair(nursery, Faults.parse(["delay:50"]))
            nursery.start_soon(_read_frames, peer, 20, got)
            for i in range(20):
                sent[i] = trio.current_time()
                await held.send_all(i.to_bytes(4, "big"))
                await trio.sleep(0.013 * (i % 3))  # some writes meet the one before in flight
            # The FIN follows the writes before it; the socket then closes, ending its task.
            await held.send_eof()
            await held.aclose()
    assert [n for n, _ in got] == list(range(20))
    assert all(at >= sent[n] + 0.050 for n, at in got), "a write arrived sooner than the delay"
    assert await peer.receive_some(10) == b""
    await peer.aclose()


async def test_a_lost_write_stalls_the_stream_by_an_rto_and_loses_nothing(autojump_clock):
    faults = Faults.parse(["loss:0.3"])
    faults.rng = random.Random(3)
    sent: dict[int, float] = {}
    got: list[tuple[int, float]] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            held, peer = await _stream_pair(nursery, faults)
            nursery.start_soon(_read_frames, peer, 50, got)
            for i in range(50):
                sent[i] = trio.current_time()
                await held.send_all(i.to_bytes(4, "big"))
                await trio.sleep(0.05)
            await held.aclose()
            await peer.aclose()
    assert [n for n, _ in got] == list(range(50)), "a write was lost or overtaken"
    late = [n for n, at in got if at >= sent[n] + RTO_S]
    assert 5 <= len(late) < 40, f"{len(late)} of 50 writes stalled by a retransmission timeout"


async def test_closing_a_held_stream_wakes_its_reader_and_still_sends_what_was_written(autojump_clock):
    got: list[tuple[int, float]] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            held, peer = await _stream_pair(nursery, Faults.parse(["delay:50"]))
            ended = trio.Event()

            async def read_own_end():
                with pytest.raises(trio.ClosedResourceError):
                    await held.receive_some(10)
                ended.set()

            nursery.start_soon(read_own_end)
            await trio.sleep(0.01)
            await held.send_all((7).to_bytes(4, "big"))
            await held.aclose()
            with trio.fail_after(0.001):  # at once, not when the write leaves
                await ended.wait()
            await _read_frames(peer, 1, got)
            assert await peer.receive_some(10) == b""
            await peer.aclose()
    assert [n for n, _ in got] == [7]


async def _channel(identity: Identity, addrs: dict[bytes, str], faults: Faults, *,
                   task_status=trio.TASK_STATUS_IGNORED):
    """A data channel of its own (no relay) on a loopback port, under ``faults``."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    addrs[identity.node_id] = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    channel = DataChannel(identity.node_id, addr_of=addrs.get, describe=lambda n: n.hex()[:8],
                          relay_send=None, sign=identity.sign, faults=faults)
    async with trio.open_nursery() as nursery:
        await nursery.start(channel.serve, listeners)
        task_status.started(channel)


async def _receive_timed(channel: DataChannel, count: int, out: list) -> None:
    for _ in range(count):
        _, data = await channel.received.receive()
        out.append((data, trio.current_time()))


async def test_a_message_over_a_delayed_data_stream_arrives_the_delay_late_in_order(autojump_clock):
    """``delay:50`` on the sender: on a stream already open, each message arrives no
    sooner than 50 ms after it was posted, and in the order posted."""
    a_key, b_key = Identity.generate(), Identity.generate()
    addrs: dict[bytes, str] = {}
    got: list[tuple[bytes, float]] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a = await nursery.start(_channel, a_key, addrs, Faults.parse(["delay:50"]))
            b = await nursery.start(_channel, b_key, addrs, Faults())
            t0 = trio.current_time()
            assert await a.send(b_key.node_id, b"dial") == "direct"
            # The connect, the handshake's frame and the message each took the delay.
            assert trio.current_time() >= t0 + 3 * 0.050
            assert await b.received.receive() == (a_key.node_id, b"dial")
            nursery.start_soon(_receive_timed, b, 30, got)
            posted = {}
            for i in range(30):
                data = b"m%d" % i
                posted[data] = trio.current_time()
                await a.post(b_key.node_id, data)
                await trio.sleep(0.01)
            while len(got) < 30:
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    assert [data for data, _ in got] == [b"m%d" % i for i in range(30)]
    assert all(at >= posted[data] + 0.050 for data, at in got), "a message arrived sooner than the delay"


async def test_loss_on_a_data_stream_stalls_messages_and_never_loses_or_reorders_one(autojump_clock):
    a_key, b_key = Identity.generate(), Identity.generate()
    faults = Faults.parse(["loss:0.3"])
    faults.rng = random.Random(5)
    addrs: dict[bytes, str] = {}
    got: list[tuple[bytes, float]] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            a = await nursery.start(_channel, a_key, addrs, faults)
            b = await nursery.start(_channel, b_key, addrs, Faults())
            nursery.start_soon(_receive_timed, b, 60, got)
            posted = {}
            for i in range(60):
                data = b"m%d" % i
                posted[data] = trio.current_time()
                await a.post(b_key.node_id, data)
                await trio.sleep(0.03)
            while len(got) < 60:
                await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
    assert [data for data, _ in got] == [b"m%d" % i for i in range(60)]
    assert b.counters["delivered"] == 60
    stalled = [data for data, at in got if at >= posted[data] + RTO_S]
    assert stalled, "no message was held by a retransmission timeout: the loss did not reach the stream"
