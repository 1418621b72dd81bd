"""Which path a peer's data takes, and which one the snapshot says it takes (meshd.net.sender).

Two channels on loopback that reach each other both directly and through an in-memory
relay.  The relay holds what it is given until told to carry it, and the direct dial
goes through a gate, so a message can be made to go over the relay while the dial is
held, and its ack to come back after the stream is up: no test here depends on how
fast anything runs.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import pytest
import trio

from meshd.identity import Identity
from meshd.net import sender as sender_module
from meshd.net.channel import ChannelConfig, DataChannel, DeliveryError
from meshd.testing.tcp_proxy import TcpProxy

# Nothing here may time out on its own: a resend after a missed ack would take the stream,
# and the message would no longer show what carried it first.
PATIENT = ChannelConfig(ack_timeout=60.0, handshake_timeout=60.0, dial_timeout=60.0)


class HeldRelay:
    """Carries each payload to the channel it is addressed to, in order, once ``open`` is set
    (to none, once ``channels`` holds none for its destination)."""

    def __init__(self) -> None:
        self.channels: dict[bytes, DataChannel] = {}
        self.open = trio.Event()
        self.carried = 0
        self._in, self._out = trio.open_memory_channel[tuple[bytes, bytes, bytes]](math.inf)

    def sender(self, src: bytes):
        async def send(dst: bytes, payload: bytes) -> None:
            self._in.send_nowait((src, dst, payload))

        return send

    async def run(self) -> None:
        async for src, dst, payload in self._out:
            await self.open.wait()
            self.carried += 1
            channel = self.channels.get(dst)
            if channel is not None:  # a process that ended gets nothing, as from a real relay
                await channel.on_relay_payload(src, payload)


async def _channel(identity: Identity, epoch: int, addrs: dict[bytes, str], relay: HeldRelay | None,
                   config: ChannelConfig = PATIENT, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A channel on a fresh loopback port, in process ``epoch``, reachable through ``relay``
    too unless it is None; reports it, its own address and the scope whose cancel ends its
    process."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    channel = DataChannel(identity.node_id, addr_of=addrs.get, describe=lambda n: n.hex()[:8],
                          relay_send=relay.sender(identity.node_id) if relay is not None else None,
                          sign=identity.sign, config=config, epoch=epoch)
    if relay is not None:
        relay.channels[identity.node_id] = channel
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.serve, listeners)
            task_status.started((channel, f"127.0.0.1:{listeners[0].socket.getsockname()[1]}", scope))


def _introduce(a: DataChannel, b: DataChannel) -> None:
    """Each learns the other's process key, as its signed metadata would say it."""
    a.note_epoch(b.id, b.epoch, b.public_key)
    b.note_epoch(a.id, a.epoch, a.public_key)


async def _relay_then_stream(nursery: trio.Nursery, a: DataChannel, b: DataChannel, b_addr: str,
                             addrs: dict[bytes, str], relay: HeldRelay, data: bytes) -> str:
    """``a`` posts ``data`` to ``b`` while its dial is held: the message goes over the relay.
    The dial then completes, and only after that does the relay carry the message and its ack.
    Returns the path that delivered it."""
    gate = TcpProxy(b_addr, closed=True)  # a dial to it waits there, as one to a slow peer would
    addrs[b.id] = await nursery.start(gate.serve)
    relay.open = trio.Event()
    item = await a.post(b.id, data)
    assert item.written == "relay"  # the dial outlasted its grace, held at the gate
    link = a._sender.link(b.id)
    gate.open()
    await link.dialed.wait()
    assert link.stream is not None, "the held dial did not complete"
    relay.open.set()
    await item.done.wait()
    assert item.error is None and await b.received.receive() == (a.id, data)
    return item.path


@pytest.mark.parametrize("peer", ["its first process", "its new process"])
async def test_a_stream_that_came_up_while_the_relay_carried_a_message_is_the_path_reported(peer):
    """A message went over the relay while the dial to the peer ran past its grace; the dial
    then completed, and the message's ack came back over the relay after that.  Our data to
    the peer goes direct from then on, and that is what the snapshot says (``data_out``),
    with no further message to show it: the relay carried one message before the direct
    path was proven, and does not carry our data now.  The same for a peer's new process
    (same key, new epoch), whose path starts afresh."""
    a_key, b_key = Identity.generate(), Identity.generate()
    addrs: dict[bytes, str] = {}
    relay = HeldRelay()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay.run)
            a, _, _ = await nursery.start(_channel, a_key, 10, addrs, relay)
            b, b_addr, b_scope = await nursery.start(_channel, b_key, 20, addrs, relay)
            _introduce(a, b)
            if peer == "its new process":
                relay.open.set()
                addrs[b.id] = b_addr
                assert await a.send(b.id, b"to the first process") == "direct"
                assert await b.received.receive() == (a.id, b"to the first process")
                b_scope.cancel()  # its process ends
                while not a.is_down(b_key.node_id):  # A reads the end and its port refusing
                    await trio.sleep(0.01)
                b, b_addr, _ = await nursery.start(_channel, b_key, 21, addrs, relay)
                _introduce(a, b)  # its new process says its epoch and key
                assert a.view(b.id)["data_out"] is None
            assert await _relay_then_stream(nursery, a, b, b_addr, addrs, relay, b"hello") == "relay"
            assert a.view(b.id)["data_out"] == "direct"
            assert a.path(b.id) == "direct"
            carried = relay.carried
            assert await a.send(b.id, b"next") == "direct"
            assert await b.received.receive() == (a.id, b"next")
            assert relay.carried == carried  # the relay carried nothing more: not even an ack
            assert a.view(b.id)["data_out"] == "direct"
            nursery.cancel_scope.cancel()


async def test_what_a_gone_process_took_along_fails_when_it_is_found_gone_and_the_next_one_gets_the_rest():
    """B's process ends holding a message of ours it never acked (it holds its acks).  Its
    stream ends and its port refuses our dial: the message fails then, saying so, long
    before its deadline, and not when a new process of B serves.  A message posted after
    that waits for a new process: one that none takes in its time fails saying so, and one
    B's new process (same key) comes in time for is delivered to it, alone."""
    a_key, b_key = Identity.generate(), Identity.generate()
    addrs: dict[bytes, str] = {}
    holds_acks = dataclasses.replace(PATIENT, ack_delay=3600.0)  # acks only when asked at once
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            a, _, _ = await nursery.start(_channel, a_key, 10, addrs, None)
            b, addrs[b_key.node_id], b_scope = await nursery.start(_channel, b_key, 20, addrs, None,
                                                                   holds_acks)
            _introduce(a, b)
            assert await a.send(b.id, b"first") == "direct"  # asked for its ack at once
            assert await b.received.receive() == (a.id, b"first")
            item = await a.post(b.id, b"taken along", timeout=3600)
            assert await b.received.receive() == (a.id, b"taken along")  # received, never acked
            b_scope.cancel()  # its process ends
            await item.done.wait()
            assert a.is_down(b.id)
            assert isinstance(item.error, DeliveryError)
            assert "its process went away before acking it (its stream ended and connect" in str(item.error)
            # Posted now, a message waits for a new process; one that never comes in its time
            # fails saying what it waited for.
            doomed = await a.post(b.id, b"in time for nobody", timeout=0.5)
            await doomed.done.wait()
            why = str(doomed.error)
            assert "within 0.5s" in why and "no process of it since one went away" in why
            later = await a.post(b.id, b"for its next process", timeout=3600)
            b2, addrs[b_key.node_id], _ = await nursery.start(_channel, b_key, 21, addrs, None)
            _introduce(a, b2)  # its new process says its epoch and key
            assert await b2.received.receive() == (a.id, b"for its next process")
            await later.done.wait()
            assert later.error is None and later.path == "direct"
            nursery.cancel_scope.cancel()


async def test_a_peer_whose_address_answers_but_fails_the_handshake_is_not_taken_as_cut_off(monkeypatch):
    """The peer's address accepts every dial and closes it before the handshake: a path
    reaches the host, so the message fails at its send timeout with what each dial met, not
    early as "no path reaches it" (which would tell the orchestrator the direction is cut),
    and the dials, each failing at once, are tried again after a pause, not in a spin."""
    monkeypatch.setattr(sender_module, "NO_PATH_GIVE_UP_S", 0.3)
    quick = ChannelConfig(ack_timeout=0.5, handshake_timeout=0.5, dial_timeout=0.5)
    a_key, b_key = Identity.generate(), Identity.generate()
    addrs: dict[bytes, str] = {}

    async def hang_up(stream: trio.SocketStream) -> None:
        await stream.aclose()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            [listener] = await nursery.start(partial(trio.serve_tcp, hang_up, 0, host="127.0.0.1"))
            a, _, _ = await nursery.start(_channel, a_key, 10, addrs, None, quick)
            b, _, _ = await nursery.start(_channel, b_key, 20, addrs, None, quick)
            _introduce(a, b)  # its key is known: only the address answers wrongly
            addrs[b_key.node_id] = f"127.0.0.1:{listener.socket.getsockname()[1]}"
            with pytest.raises(DeliveryError) as caught:
                await a.send(b_key.node_id, b"hello", timeout=2.0)
            text = str(caught.value)
            assert "within 2s" in text and "no path reaches it" not in text, text
            assert "handshake with" in text, text
            # Each dial comes back at once: they are paced, not spun (thousands in 2 s).
            assert a.counters["dials"] <= 2.0 / sender_module.RETRY_PAUSE_S + 1
            nursery.cancel_scope.cancel()
