"""What a stranger can send the relay before it has proved an id: frames, and connections.

A message may come in fragments, and the reader holds each fragment until the
last one; a stranger who never sends the last one (an endless run of empty
continuation frames, six bytes each) must not make the relay hold more and more.
Nor may a crowd of connections that never authenticate hold a socket each
until the relay can open no more.
"""

from __future__ import annotations

import base64
import os

import pytest
import trio
import trio.testing
from test_relay import assert_exchange, start_client, start_relay

from meshd.relay import wsframe
from meshd.relay.server import Relay, RelayConfig, serve_relay
from meshd.relay.wsframe import FrameError, FrameReader


def _masked(opcode: int, payload: bytes, *, fin: bool) -> bytes:
    key = os.urandom(4)
    assert len(payload) < 126
    head = bytes(((0x80 if fin else 0) | opcode, 0x80 | len(payload)))
    return head + key + wsframe.mask_bytes(payload, key)


FIRST = _masked(wsframe.OP_BINARY, b"", fin=False)
EMPTY_CONTINUATION = _masked(wsframe.OP_CONTINUATION, b"", fin=False)


def test_a_message_in_endless_empty_fragments_is_refused():
    reader = FrameReader(masked=True, max_message=64 * 1024)
    reader.feed(FIRST + EMPTY_CONTINUATION * (10 * wsframe.MAX_FRAGMENTS))
    with pytest.raises(FrameError) as caught:
        while reader.next_event() is not None:
            pass
    assert caught.value.code == wsframe.CLOSE_TOO_BIG
    assert "fragments" in str(caught.value)


def test_a_message_in_many_fragments_within_the_limit_reads_whole():
    reader = FrameReader(masked=True, max_message=64 * 1024)
    pieces = [_masked(wsframe.OP_BINARY, b"a", fin=False)]
    pieces += [_masked(wsframe.OP_CONTINUATION, b"b", fin=False)] * (wsframe.MAX_FRAGMENTS - 2)
    pieces += [_masked(wsframe.OP_CONTINUATION, b"c", fin=True)]
    reader.feed(b"".join(pieces))
    assert reader.next_event() == b"a" + b"b" * (wsframe.MAX_FRAGMENTS - 2) + b"c"


def _close_codes(data: bytes) -> list[int]:
    """The codes of the Close frames in what the relay wrote to us (unmasked, server to client)."""
    reader = FrameReader(masked=False, max_message=1 << 20)
    reader.feed(data)
    codes = []
    try:
        while (event := reader.next_event()) is not None:
            if isinstance(event, wsframe.Close):
                codes.append(event.code)
    except FrameError:
        pass
    return codes


async def test_the_relay_closes_a_connection_that_sends_endless_fragments():
    # Auth never times out here: only the fragments can end the connection with 1009.
    relay = Relay(RelayConfig(auth_timeout=3600, handshake_timeout=3600))
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(lambda task_status: serve_relay(
            "127.0.0.1", 0, relay=relay, task_status=task_status))
        stream = await trio.open_tcp_stream(host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        await stream.send_all((f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                               "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        await stream.send_all(FIRST + EMPTY_CONTINUATION * (4 * wsframe.MAX_FRAGMENTS))
        await stream.send_eof()
        got = bytearray()
        while data := await stream.receive_some(65536):
            got += data
        await stream.aclose()
        nursery.cancel_scope.cancel()
    head, _, frames = bytes(got).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101")
    assert wsframe.CLOSE_TOO_BIG in _close_codes(frames)
    assert relay.refused.get("oversized") == 1


async def _upgrade_and_wait(port: int, closed: list[int]) -> None:
    """Upgrade to a WebSocket, take the challenge, answer nothing; count it once the relay
    closes it."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    async with stream:
        await stream.send_all((f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                               "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        closed.append(1)
        await trio.sleep_forever()


async def test_a_crowd_that_never_authenticates_holds_a_bounded_number_of_sockets():
    limit = 8
    # Neither the upgrade nor the challenge times out here: only the bound can close them.
    relay = Relay(RelayConfig(handshake_timeout=3600, auth_timeout=3600, max_pending=limit))
    closed: list[int] = []
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery, relay)
        for _ in range(3 * limit):
            nursery.start_soon(_upgrade_and_wait, port, closed)
        await trio.testing.wait_all_tasks_blocked(0.2)
        assert relay.refused.get("busy", 0) >= 2 * limit
        with trio.fail_after(30):  # a guard against a hang: each close is over in a moment
            while len(closed) < relay.refused["busy"]:
                await trio.sleep(0.05)
        # Members that connect while the crowd waits still get through, and are relayed.
        a = await start_client(nursery, port)
        b = await start_client(nursery, port)
        await assert_exchange(a, b, b"past the crowd")
        nursery.cancel_scope.cancel()


async def test_a_stream_of_garbage_connections_is_counted_and_logged_once(caplog):
    relay = Relay()
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery, relay)
        for _ in range(50):
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(b"garbage\r\n\r\n")
                while await stream.receive_some(65536):
                    pass
        await trio.testing.wait_all_tasks_blocked(0.2)
        nursery.cancel_scope.cancel()
    assert relay.refused["handshake-failed"] == 50
    logged = [r for r in caplog.records if "no WebSocket upgrade" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]
