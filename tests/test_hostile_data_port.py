"""What a stranger can do to a node's data port (TCP) before it has proved anything.

A handshake frame holds one StreamChallenge or StreamProof, a few hundred
bytes.  A stranger that announces a data frame's megabyte there, and sends all
but its last byte, must not make the node buffer that megabyte: a crowd of such
connections would hold a megabyte each.  Nor may a crowd of connections that
say nothing hold a socket each until the process can open no more.
"""

from __future__ import annotations

import struct

import trio
import trio.testing

from meshd.identity import Identity
from meshd.net.channel import MAX_PENDING_HANDSHAKES, ChannelConfig, DataChannel
from meshd.net.framing import read_packet
from meshd.testing.stranger import open_data_stream
from meshd.wire import MAX_FRAME_BYTES, StreamChallenge

STRANGERS = 16


async def _run_channel(identity: Identity, addrs: dict[bytes, str], config: ChannelConfig, *,
                       task_status=trio.TASK_STATUS_IGNORED):
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    addrs[identity.node_id] = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    channel = DataChannel(identity.node_id, addr_of=addrs.get, describe=lambda n: n.hex()[:8],
                          relay_send=None, sign=identity.sign, config=config)
    async with trio.open_nursery() as nursery:
        await nursery.start(channel.serve, listeners)
        task_status.started(channel)


async def _announce_a_megabyte(addr: str) -> None:
    """Take the challenge, then send a frame header of a data frame's size and all but the
    last byte of its body; keep the connection open."""
    host, _, port = addr.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    challenge = await read_packet(stream, bytearray())
    assert isinstance(challenge.messages[0], StreamChallenge)
    try:
        await stream.send_all(struct.pack("!I", MAX_FRAME_BYTES))
        await stream.send_all(b"\0" * (MAX_FRAME_BYTES - 1))
    except trio.BrokenResourceError:
        pass  # the node closed it on the header, with our bytes unread
    async with stream:
        await trio.sleep_forever()


async def test_a_handshake_frame_announced_at_a_data_frames_size_is_refused_from_its_header():
    node, honest = Identity.generate(), Identity.generate()
    addrs: dict[bytes, str] = {}
    # The handshake never times out here: only the frame's header can end these connections.
    config = ChannelConfig(handshake_timeout=3600)
    async with trio.open_nursery() as nursery:
        channel = await nursery.start(_run_channel, node, addrs, config)
        for _ in range(STRANGERS):
            nursery.start_soon(_announce_a_megabyte, addrs[node.node_id])
        await trio.testing.wait_all_tasks_blocked(0.2)
        assert channel.counters["handshake_failures"] == STRANGERS
        # A member's handshake still goes through.
        stream, answer = await open_data_stream(addrs[node.node_id], honest)
        assert answer is not None
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def _open_and_wait(addr: str, closed: list[int]) -> None:
    """Connect and say nothing; count it in ``closed`` once the node closes it."""
    host, _, port = addr.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        try:
            while await stream.receive_some(65536):
                pass  # the node's challenge
        except trio.BrokenResourceError:
            pass
        closed.append(1)
        await trio.sleep_forever()


async def test_a_crowd_of_silent_connections_holds_a_bounded_number_of_sockets():
    node, honest = Identity.generate(), Identity.generate()
    addrs: dict[bytes, str] = {}
    crowd = 3 * MAX_PENDING_HANDSHAKES
    config = ChannelConfig(handshake_timeout=3600)  # only the bound can close these connections
    closed: list[int] = []
    async with trio.open_nursery() as nursery:
        channel = await nursery.start(_run_channel, node, addrs, config)
        for _ in range(crowd):
            nursery.start_soon(_open_and_wait, addrs[node.node_id], closed)
        await trio.testing.wait_all_tasks_blocked(0.2)
        # The node holds at most the bound's worth of them; it closed the rest.
        assert len(closed) >= crowd - MAX_PENDING_HANDSHAKES
        assert channel.counters["handshakes_evicted"] == len(closed)
        # A member that dials while the crowd holds its connections still gets through.
        stream, answer = await open_data_stream(addrs[node.node_id], honest)
        assert answer is not None
        await stream.aclose()
        nursery.cancel_scope.cancel()
