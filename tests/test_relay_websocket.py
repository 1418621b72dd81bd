"""The relay's WebSocket layer: framing checked against wsproto, limits, and a connection's
writes, reads and close on loopback."""

from __future__ import annotations

import os
import socket

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, TextMessage
from wsproto.events import Ping as WsPing

from meshd.relay import wsconn, wsframe
from meshd.relay.wsframe import Close, FrameError, FrameReader, Ping

WAIT = 10
MAX = 64 * 1024


def read_all(reader: FrameReader, data: bytes, cuts: list[int]) -> list:
    """Feed ``data`` in pieces cut at ``cuts``; every event that comes out."""
    events = []
    start = 0
    for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
        reader.feed(data[start:cut])
        start = max(start, cut)
        while (event := reader.next_event()) is not None:
            events.append(event)
    return events


# --- framing, against wsproto as the reference ---

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
payloads = st.binary(max_size=3000) | st.sampled_from([b"", b"x" * 125, b"y" * 126, b"z" * 65535,
                                                        b"w" * 65536])


@FUZZ
@given(st.lists(payloads, min_size=1, max_size=4), st.lists(st.integers(min_value=0), max_size=6))
def test_what_a_wsproto_client_sends_reads_back_whole_in_any_pieces(messages, cuts):
    client = Connection(ConnectionType.CLIENT)
    wire = b"".join(client.send(BytesMessage(data=m)) for m in messages)
    assert read_all(FrameReader(masked=True, max_message=MAX), wire, cuts) == messages


@FUZZ
@given(payloads, st.integers(min_value=1, max_value=5))
def test_a_fragmented_message_with_a_ping_between_fragments_reads_as_one(message, parts):
    client = Connection(ConnectionType.CLIENT)
    size = -(-len(message) // parts) or 1
    pieces = [message[i:i + size] for i in range(0, len(message), size)] or [b""]
    wire = b""
    for i, piece in enumerate(pieces):
        wire += client.send(BytesMessage(data=piece, message_finished=i == len(pieces) - 1))
        if i == 0:
            wire += client.send(WsPing(payload=b"mid"))
    expected = [Ping(b"mid"), message] if len(pieces) > 1 else [message, Ping(b"mid")]
    assert read_all(FrameReader(masked=True, max_message=MAX), wire, []) == expected


@FUZZ
@given(payloads, st.booleans())
def test_our_frames_read_back_in_wsproto(message, text):
    # Server to client (unmasked) and client to server (masked).
    for mask, reader in ((False, Connection(ConnectionType.CLIENT)),
                         (True, Connection(ConnectionType.SERVER))):
        opcode = wsframe.OP_TEXT if text else wsframe.OP_BINARY
        data = message.decode("latin-1") if text else message
        reader.receive_data(wsframe.frame(opcode, data.encode() if text else data, mask=mask))
        events = list(reader.events())
        assert len(events) == 1
        assert isinstance(events[0], TextMessage if text else BytesMessage)
        assert events[0].data == data


def test_close_frames_round_trip_with_wsproto():
    reader = Connection(ConnectionType.CLIENT)
    payload = wsframe.close_payload(4002, "malformed frame")
    reader.receive_data(wsframe.frame(wsframe.OP_CLOSE, payload, mask=False))
    (event,) = reader.events()
    assert isinstance(event, CloseConnection) and (event.code, event.reason) == (4002, "malformed frame")
    client = Connection(ConnectionType.CLIENT)
    wire = client.send(CloseConnection(code=1001, reason="going away"))
    assert read_all(FrameReader(masked=True, max_message=MAX), wire, []) == [Close(1001, "going away")]


def test_a_long_close_reason_is_cut_at_a_character_boundary():
    payload = wsframe.close_payload(4000, "é" * 100)
    assert len(payload) <= wsframe.MAX_CONTROL_PAYLOAD
    reader = FrameReader(masked=False, max_message=MAX)
    reader.feed(wsframe.frame(wsframe.OP_CLOSE, payload, mask=False))
    event = reader.next_event()
    assert isinstance(event, Close) and event.reason == "é" * 61


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_to_the_frame_reader_raise_only_frame_error(data, masked):
    reader = FrameReader(masked=masked, max_message=200)
    try:
        read_all(reader, data, [])
    except FrameError as exc:
        assert exc.code in (wsframe.CLOSE_PROTOCOL_ERROR, wsframe.CLOSE_INVALID_DATA, wsframe.CLOSE_TOO_BIG)


@pytest.mark.parametrize(("wire", "code"), [
    (bytes([0x82, 0x00]), wsframe.CLOSE_PROTOCOL_ERROR),  # a client's frame not masked
    (bytes([0xC2, 0x80]) + b"\0" * 4, wsframe.CLOSE_PROTOCOL_ERROR),  # a reserved bit
    (bytes([0x80, 0x80]) + b"\0" * 4, wsframe.CLOSE_PROTOCOL_ERROR),  # continuation, nothing to continue
    (bytes([0x09, 0x80]) + b"\0" * 4, wsframe.CLOSE_PROTOCOL_ERROR),  # a fragmented ping
    (bytes([0x83, 0x80]) + b"\0" * 4, wsframe.CLOSE_PROTOCOL_ERROR),  # an unknown opcode
    (bytes([0x88, 0x81]) + b"\0" * 5, wsframe.CLOSE_PROTOCOL_ERROR),  # a 1-byte close payload
    (bytes([0x81, 0x81]) + b"\0" * 4 + b"\xff", wsframe.CLOSE_INVALID_DATA),  # text that is not UTF-8
])
def test_frames_that_break_the_protocol_are_refused_with_their_close_code(wire, code):
    with pytest.raises(FrameError) as caught:
        read_all(FrameReader(masked=True, max_message=MAX), wire, [])
    assert caught.value.code == code


def test_an_oversized_message_is_refused_from_its_header_before_its_payload_is_read():
    reader = FrameReader(masked=True, max_message=1000)
    reader.feed(wsframe.header(wsframe.OP_BINARY, 2**40, b"\0\0\0\0"))  # a terabyte, announced
    with pytest.raises(FrameError) as caught:
        reader.next_event()
    assert caught.value.code == wsframe.CLOSE_TOO_BIG
    # Fragments count together: 600 + 600 bytes is over 1000 too.
    reader = FrameReader(masked=True, max_message=1000)
    client = Connection(ConnectionType.CLIENT)
    reader.feed(client.send(BytesMessage(data=b"a" * 600, message_finished=False)))
    assert reader.next_event() is None
    reader.feed(client.send(BytesMessage(data=b"b" * 600))[:14])
    with pytest.raises(FrameError):
        reader.next_event()


# --- a connection on loopback ---


async def socket_pair(nursery: trio.Nursery, max_message: int = MAX) -> tuple[wsconn.WebSocket,
                                                                               wsconn.WebSocket]:
    """A server and a client WebSocket connected over loopback TCP."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    accepted: trio.MemorySendChannel = None  # type: ignore[assignment]
    accepted, incoming = trio.open_memory_channel(1)

    async def serve(stream: trio.SocketStream) -> None:
        await accepted.send(await wsconn.accept(stream, max_message=max_message))
        await trio.sleep_forever()

    nursery.start_soon(trio.serve_listeners, serve, listeners)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    client = await wsconn.connect(stream, f"127.0.0.1:{port}", "/", max_message=max_message)
    return await incoming.receive(), client


async def test_both_ends_write_without_nagle():
    # Each frame is written as soon as it is sent: Nagle would hold a small one back for the
    # peer's ack of the last (up to 40 ms on a delayed-ack peer).
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            server, client = await socket_pair(nursery)
            for ws in (server, client):
                assert ws.stream.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            nursery.cancel_scope.cancel()


async def test_messages_the_socket_cannot_take_at_once_arrive_whole_and_in_order():
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            server, client = await socket_pair(nursery)
            nursery.start_soon(client.run_writer, 5.0)
            messages = [os.urandom(1) * 60_000 + i.to_bytes(4, "big") for i in range(200)]
            for m in messages:
                assert client.send_nowait(m)  # never waits: 12 MB is more than the socket holds
            assert client.queued_bytes > 0
            got = [await server.receive() for _ in messages]
            assert got == messages
            assert await client.flush()
            assert client.queued_bytes == 0
            nursery.cancel_scope.cancel()


async def test_a_peer_that_pings_and_never_reads_is_owed_one_pong_not_a_queue():
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            server, client = await socket_pair(nursery)
            nursery.start_soon(server.run_writer, 5.0)
            for _ in range(200):  # fill the server's socket towards the client, who does not read
                server.send_nowait(b"x" * 60_000)
            queued = server.queued_bytes
            nursery.start_soon(client.run_writer, 5.0)  # what the client's socket does not take at once
            for _ in range(5000):
                client.send_nowait(b"ping", opcode=wsframe.OP_PING)
            client.send_nowait(b"the end")
            assert await server.receive() == b"the end"  # every ping read before it
            assert server.queued_bytes - queued < 200  # one answer is owed, none queued per ping
            nursery.cancel_scope.cancel()


async def test_ping_is_answered_by_the_peer_reading():
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            server, client = await socket_pair(nursery)

            async def read() -> None:
                with pytest.raises(wsconn.ConnectionClosed):
                    await server.receive()

            nursery.start_soon(read)
            nursery.start_soon(client.receive)
            await client.ping()
            await client.ping()
            nursery.cancel_scope.cancel()


async def test_close_from_either_side_gives_the_other_its_code_and_reason():
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            server, client = await socket_pair(nursery)
            client.send_nowait(b"last words")
            await server.aclose(4002, "malformed frame: nope")  # reads (and drops) until the answer
            with pytest.raises(wsconn.ConnectionClosed) as caught:
                await client.receive()
            assert caught.value.reason == wsconn.CloseReason(4002, "malformed frame: nope")
            assert server.closed == wsconn.CloseReason(4002, "malformed frame: nope")
            await client.aclose()
            nursery.cancel_scope.cancel()
        async with trio.open_nursery() as nursery:
            server, client = await socket_pair(nursery)
            nursery.start_soon(client.aclose, 1001, "going away")
            with pytest.raises(wsconn.ConnectionClosed) as caught:
                await server.receive()
            assert caught.value.reason == wsconn.CloseReason(1001, "going away")
            nursery.cancel_scope.cancel()


async def test_a_stream_that_ends_without_a_close_frame_reads_as_1006():
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            server, client = await socket_pair(nursery)
            await client.abort()
            with pytest.raises(wsconn.ConnectionClosed) as caught:
                await server.receive()
            assert caught.value.reason.code == wsframe.CLOSE_ABNORMAL
            assert not server.send_nowait(b"to nobody")
            nursery.cancel_scope.cancel()


async def test_an_oversized_message_closes_with_1009():
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            server, client = await socket_pair(nursery, max_message=1000)
            client.send_nowait(b"x" * 1001)
            with pytest.raises(wsconn.ConnectionClosed) as caught:
                await server.receive()
            assert caught.value.reason.code == wsframe.CLOSE_TOO_BIG
            with pytest.raises(wsconn.ConnectionClosed) as caught:
                await client.receive()
            assert caught.value.reason.code == wsframe.CLOSE_TOO_BIG
            nursery.cancel_scope.cancel()


async def test_a_stream_that_is_not_a_socket_carries_messages_through_the_writer():
    left, right = trio.testing.memory_stream_pair()
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            accepted: list[wsconn.WebSocket] = []

            async def serve() -> None:
                accepted.append(await wsconn.accept(right, max_message=MAX))

            nursery.start_soon(serve)
            client = await wsconn.connect(left, "relay.example", "/", max_message=MAX)
            await wsconn_wait(accepted)
            server = accepted[0]
            nursery.start_soon(client.run_writer, 5.0)
            nursery.start_soon(server.run_writer, 5.0)
            for i in range(50):
                client.send_nowait(i.to_bytes(2, "big") * 1000)
            for i in range(50):
                assert await server.receive() == i.to_bytes(2, "big") * 1000
            server.send_nowait(b"back")
            assert await client.receive() == b"back"
            nursery.cancel_scope.cancel()


async def wsconn_wait(accepted: list) -> None:
    while not accepted:
        await trio.sleep(0.01)


async def test_garbage_instead_of_an_upgrade_is_answered_400():
    left, right = trio.testing.memory_stream_pair()
    with trio.fail_after(WAIT):
        await left.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # HTTP, but no upgrade
        with pytest.raises(wsconn.HandshakeError, match="not an upgrade"):
            await wsconn.accept(right, max_message=MAX)
        assert (await left.receive_some()).startswith(b"HTTP/1.1 400")
