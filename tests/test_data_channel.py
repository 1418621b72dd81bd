"""The reliable per-peer data channel over real loopback sockets and the relay."""

from __future__ import annotations

import collections
import hashlib
import logging
import struct
from collections.abc import Callable
from functools import partial

import pytest
import trio

from meshd.identity import Identity
from meshd.net.channel import CHUNK_BYTES, DataChannel, DeliveryError
from meshd.net.data_keys import ProcessKeys
from meshd.net.faults import Faults
from meshd.net.framing import frame, next_frame, read_packet, read_some
from meshd.net.handshake import proof_data
from meshd.node import NodeOptions
from meshd.relay.server import RelayBindError, serve_relay
from meshd.swim import LOCAL
from meshd.testing.inprocess import start_killable, start_node, wait_converged
from meshd.testing.stranger import chunk_frame, open_data_stream
from meshd.wire import (
    MAX_FRAME_BYTES,
    STREAM_NONCE_BYTES,
    DataAck,
    DataChunk,
    Packet,
    StreamChallenge,
    StreamProof,
    decode,
)

N_MESSAGES = 1000


class Mesh:
    """A relay and four nodes: orchestrator (A), stage-0 (B), stage-1 (C), stage-2 (D)."""

    def __init__(self, nursery, relay_scope_nursery):
        self.nursery = nursery
        self.relay_nursery = relay_scope_nursery
        self.lines: list[str] = []

    async def start(self, c_faults: list[str]):
        self.relay_scope = trio.CancelScope()
        self.relay_addr = await self.relay_nursery.start(self._relay, 0)
        url = f"ws://{self.relay_addr[0]}:{self.relay_addr[1]}"
        opts = dict(profile="local", relay=url, stages=3)
        self.a = await start_node(self.nursery, NodeOptions(role="orchestrator", **opts), self.lines)
        self.b = await start_node(self.nursery, NodeOptions(stage=0, seeds=[self.a.addr], **opts), self.lines)
        self.d = await start_node(self.nursery, NodeOptions(stage=2, seeds=[self.a.addr], **opts), self.lines)
        faults = Faults.parse([spec.format(a=self.a.addr) for spec in c_faults])
        c_opts = NodeOptions(stage=1, seeds=[self.b.addr], faults=faults, **opts)
        self.c = await start_node(self.nursery, c_opts, self.lines)
        self.nodes = [self.a, self.b, self.c, self.d]
        await wait_converged(self.nodes)

    async def _relay(self, port, *, task_status=trio.TASK_STATUS_IGNORED):
        with self.relay_scope:
            await serve_relay("127.0.0.1", port, task_status=task_status)

    async def restart_relay(self):
        self.relay_scope.cancel()
        for _ in range(50):  # the old sockets may take a moment to let go of the port
            await trio.sleep(0.1)
            self.relay_scope = trio.CancelScope()
            try:
                await self.relay_nursery.start(self._relay, self.relay_addr[1])
                return
            except RelayBindError:
                continue
        raise AssertionError("the relay could not bind its port again")

    def dead_lines(self):
        return [line for line in self.lines if line.startswith("meshd member dead")]


async def _collect(node, count: int, out: list):
    async for src, data in node.data.received:
        out.append((src, data))
        if len(out) == count:
            return


async def _send_numbered(src, dst, count: int, paths: list[str]):
    for i in range(count):
        paths.append(await src.send(dst.identity.node_id, struct.pack("!I", i) + b"x" * 100, timeout=20))


async def test_a_thousand_messages_each_way_arrive_once_and_in_order_across_a_one_way_drop():
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start(["drop:{a}"])  # C's direct packets to A are lost
            a, c = mesh.a, mesh.c
            at_a, at_c, paths_ac, paths_ca = [], [], [], []
            async with trio.open_nursery() as inner:
                inner.start_soon(_collect, a, N_MESSAGES, at_a)
                inner.start_soon(_collect, c, N_MESSAGES, at_c)
                inner.start_soon(_send_numbered, a, c, N_MESSAGES, paths_ac)
                inner.start_soon(_send_numbered, c, a, N_MESSAGES, paths_ca)
            for got, sender in ((at_a, c), (at_c, a)):
                assert [src for src, _ in got] == [sender.identity.node_id] * N_MESSAGES
                assert [struct.unpack("!I", d[:4])[0] for _, d in got] == list(range(N_MESSAGES))
            # A stream between them cannot complete either way: both directions of data use the relay.
            assert set(paths_ca) == {"relay"} and set(paths_ac[5:]) == {"relay"}
            # C either tried its stream to A and saw it fail, or knew from its probes that its
            # packets reach A only over the relay and went there at once.
            view = next(m for m in c.snapshot()["members"] if m["id"] == a.identity.node_id.hex())
            assert view["data_out"] == "relay"
            assert view["data_last_failure"] is None or "direct:" in view["data_last_failure"]
            # Pairs without a fault go direct (a first message may take the relay while the
            # stream's dial runs longer than its wait, on a loaded host; the next ones do not).
            paths = [await mesh.b.send(mesh.d.identity.node_id, b"hello")]
            while paths[-1] != "direct" and len(paths) < 20:
                await trio.sleep(0.05)
                paths.append(await mesh.b.send(mesh.d.identity.node_id, b"hello"))
            assert paths[-1] == "direct", paths
            assert mesh.dead_lines() == []
            nursery.cancel_scope.cancel()


async def test_a_members_data_path_says_what_carried_our_data_and_none_before_any():
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            sender, receiver = mesh.a, mesh.b
            async with trio.open_nursery() as inner:
                inner.start_soon(_collect, receiver, 1, [])
                assert await sender.send(receiver.identity.node_id, b"one") == "direct"

            def view(node, peer):
                return next(m for m in node.snapshot()["members"] if m["id"] == peer.identity.node_id.hex())

            assert view(sender, receiver)["data_out"] == "direct"
            assert view(sender, receiver)["data_sent"] == 1
            # The receiver only acked: it sent nothing back, so no path carries its data.
            assert view(receiver, sender)["data_out"] is None and view(receiver, sender)["data_sent"] == 0
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("size_mib, fault, path", [(64, [], "direct"), (4, ["drop:{a}"], "relay")])
async def test_large_messages_arrive_intact(size_mib, fault, path):
    payload = bytes(range(256)) * (size_mib * 4096)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start(fault)
            got = []
            async with trio.open_nursery() as inner:
                inner.start_soon(_collect, mesh.a, 1, got)
                assert await mesh.c.send(mesh.a.identity.node_id, payload, timeout=60) == path
            assert hashlib.sha256(got[0][1]).digest() == hashlib.sha256(payload).digest()
            nursery.cancel_scope.cancel()


async def test_isolated_node_is_declared_dead_and_sends_to_it_fail_naming_it():
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            c = mesh.c
            c.options.faults.isolate = True  # from now on C reaches nobody, relay included
            t0 = trio.current_time()
            with pytest.raises(DeliveryError) as info:
                await mesh.a.send(c.identity.node_id, b"are you there", timeout=4)
            message = str(info.value)
            assert f"stage-1 ({c.identity.prefix})" in message
            assert "direct:" in message and "relay:" in message
            low, high = LOCAL.suspicion_bounds(4)
            bound = high + 2 * LOCAL.probe_interval
            with trio.fail_after(bound):
                while not all(n.swim.members[c.identity.node_id].state.name == "DEAD"
                              for n in (mesh.a, mesh.b, mesh.d)):
                    await trio.sleep(0.1)
            took = trio.current_time() - t0
            print(f"\nisolated stage-1 declared dead by all 3 peers after {took:.1f}s (bound {bound:.0f}s)")
            assert f"prefix={c.identity.prefix}" in {line.split()[3] for line in mesh.dead_lines()}
            # Nobody the others still reach is dead to them (isolated C, in time, finds all of
            # them dead: its own view, printed into the same lines).
            for n in (mesh.a, mesh.b, mesh.d):
                dead = {node for node, m in n.swim.members.items() if m.state.name == "DEAD"}
                assert dead == {c.identity.node_id}, f"{n.swim.me.name} holds live members dead"
            view = {m["prefix"]: m for m in mesh.a.snapshot()["members"]}[c.identity.prefix]
            assert view["path_out"] == "none" and "member dead" in view["last_failure"]
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("leaves", [True, False])
async def test_a_peer_that_left_is_not_said_to_look_down_and_a_killed_one_is(leaves, caplog):
    """A peer's stream ends and its port refuses the next dial: news while the mesh holds it
    live (it was killed), not for a peer that said it leaves (its member line says so)."""
    caplog.set_level(logging.INFO, logger="meshd.channel")
    lines: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            opts = dict(profile="local", stages=2)
            a = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
            b, b_scope = await start_killable(nursery, NodeOptions(stage=0, seeds=[a.addr], **opts), lines)
            await wait_converged([a, b])
            async with trio.open_nursery() as inner:
                inner.start_soon(_collect, b, 1, [])
                assert await a.send(b.identity.node_id, b"hello") == "direct"
            if leaves:
                await b.node.leave()
                while a.core.members[b.identity.node_id].state.name != "LEFT":
                    await trio.sleep(0.01)
            b_scope.cancel()
            while not a.data.is_down(b.identity.node_id):
                await trio.sleep(0.01)
            said = [r.getMessage() for r in caplog.records if "looks down" in r.getMessage()]
            killed = [f"stage-0 ({b.identity.prefix}) looks down"]
            assert [m[:len(killed[0])] for m in said] == ([] if leaves else killed), said
            nursery.cancel_scope.cancel()


async def test_relayed_pair_recovers_after_the_relay_restarts():
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start(["drop:{a}"])
            a, c = mesh.a, mesh.c
            got = []
            async with trio.open_nursery() as inner:
                inner.start_soon(_collect, a, 2, got)
                assert await c.send(a.identity.node_id, b"before", timeout=20) == "relay"
                await mesh.restart_relay()
                # Sent while C is still reconnecting: delivered once the relay is back.
                assert await c.send(a.identity.node_id, b"after", timeout=30) == "relay"
            assert [d for _, d in got] == [b"before", b"after"]
            assert c.relays.home.counters["connects"] >= 2
            assert mesh.dead_lines() == []
            nursery.cancel_scope.cancel()


async def test_messages_written_ahead_of_their_acks_survive_a_broken_stream_exactly_once():
    """post() writes without waiting for acks; a stream that breaks under unacked messages costs
    resends over another path, never a loss, a duplicate or a reordering."""
    count = 300
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            b, d = mesh.b, mesh.d
            dst = d.identity.node_id
            got: list = []
            items = []
            async with trio.open_nursery() as inner:
                inner.start_soon(_collect, d, count, got)
                for i in range(count):
                    items.append(await b.data.post(dst, struct.pack("!I", i) + b"y" * 500, timeout=30))
                    if i == count // 2:
                        assert not all(item.acked.is_set() for item in items), "some should wait for acks"
                        stream = b.data._sender.link(dst).stream  # no public seam: the world breaks it
                        assert stream is not None
                        await stream.aclose()  # the stream goes away under them
                for item in items:
                    await item.done.wait()
            assert [item.error for item in items] == [None] * count
            assert [src for src, _ in got] == [b.identity.node_id] * count
            assert [struct.unpack("!I", data[:4])[0] for _, data in got] == list(range(count))
            assert b.data.counters["resent"] > 0
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("inline", [False, True])
async def test_dispatch_keeps_a_senders_order_when_its_path_moves_from_the_relay_to_direct(inline):
    """dispatch() handles direct messages in the stream's reader and relayed ones from a queue;
    a sender whose earlier messages are still queued must not be overtaken by its later ones."""
    count = 400
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start(["drop:{a}"])  # C's direct packets to A are lost: C -> A goes by relay
            a, c = mesh.a, mesh.c
            got: list[int] = []
            all_in = trio.Event()

            async def handler(src: bytes, data: bytes) -> None:
                assert src == c.identity.node_id
                got.append(struct.unpack("!I", data[:4])[0])
                await trio.sleep(0.02)  # a slow handler: relayed messages pile up on the queue
                if len(got) == count:
                    all_in.set()

            nursery.start_soon(partial(a.data.dispatch, handler, inline=inline))
            items = []
            for i in range(count):
                if i == count // 4:
                    c.options.faults.drop_to.discard(a.addr)  # the direct path works again
                items.append(await c.data.post(a.identity.node_id, struct.pack("!I", i), timeout=60))
                await trio.sleep(0.008)
            await all_in.wait()
            assert got == list(range(count)), [(i, g) for i, g in enumerate(got) if g != i][:12]
            for item in items:
                await item.done.wait()
            paths = {item.path for item in items}
            assert paths == {"relay", "direct"}, paths  # both paths carried some of them
            nursery.cancel_scope.cancel()


def _chunk_frame(sender: bytes, data: bytes) -> bytes:
    """A whole message as one stream frame, sealed with the keys of ``sender``'s last
    handshake: message 1 of session 1."""
    return chunk_frame(sender, DataChunk(1, 1, len(data), 0, data))


async def _handshake_as(addr: str, claimed: bytes, signer: Identity, then: Callable[[], bytes]):
    """Dial ``addr`` as ``claimed``, signing with ``signer``'s key; then write ``then()``.

    Returns the node's proof packet, or None if it closed the stream instead."""
    stream, answer = await open_data_stream(addr, signer, claimed)
    async with stream:
        if answer is None:
            return None
        await stream.send_all(then())
        await trio.sleep(0.5)
        return answer


async def test_a_data_stream_must_prove_its_node_id_before_anything_is_delivered():
    """The handshake: a dialler that signs for an id it does not hold gets no stream, and
    nothing it sends is delivered; one that proves its own id is heard, as itself."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            a, victim = mesh.a, mesh.b.identity.node_id
            intruder = Identity.generate()
            got: list = []
            nursery.start_soon(_collect, a, 10, got)
            # Claims to be stage-0 but signs with its own key: refused, nothing delivered.
            forged = partial(_chunk_frame, victim, b"forged")
            assert await _handshake_as(a.addr, victim, intruder, forged) is None
            assert a.data.counters["handshake_failures"] == 1
            # The same client proving its own id is heard, under that id (the test's handshake is right).
            honest = partial(_chunk_frame, intruder.node_id, b"honest")
            answer = await _handshake_as(a.addr, intruder.node_id, intruder, honest)
            assert answer is not None and answer.sender == a.identity.node_id
            with trio.fail_after(5):
                while not got:
                    await trio.sleep(0.05)
            assert got == [(intruder.node_id, b"honest")]
            nursery.cancel_scope.cancel()


async def test_a_dial_answered_by_another_node_is_a_path_failure_naming_it():
    """A direct dial that reaches the wrong node fails its handshake; the relay carries on."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            b, c, d = mesh.b, mesh.c, mesh.d
            # B believes D lives at C's address (a stale or hijacked address).
            real = b.data.addr_of
            b.data.addr_of = lambda node: c.addr if node == d.identity.node_id else real(node)
            got: list = []
            async with trio.open_nursery() as inner:
                inner.start_soon(_collect, d, 1, got)
                assert await b.data.send(d.identity.node_id, b"for d only", timeout=10) == "relay"
            assert got == [(b.identity.node_id, b"for d only")]  # not C: the relay carried it to D
            failure = b.data.view(d.identity.node_id)["data_last_failure"]
            assert f"answers as {c.identity.prefix}, not {d.identity.prefix}" in failure
            nursery.cancel_scope.cancel()


async def test_a_bad_frame_does_not_lose_the_good_ones_read_with_it():
    """Frames before a garbled one in the same read were reassembled already: they are
    delivered (and acked) even though the stream is then dropped."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            a = mesh.a
            outsider = Identity.generate()
            got: list = []
            nursery.start_soon(_collect, a, 1, got)
            garbled = struct.pack("!I", 5) + b"\xc1\xc1\xc1\xc1\xc1"
            good = partial(_chunk_frame, outsider.node_id, b"good")
            # Both in one write.
            answer = await _handshake_as(a.addr, outsider.node_id, outsider, lambda: good() + garbled)
            assert answer is not None
            with trio.fail_after(5):
                while not got:
                    await trio.sleep(0.05)
            assert got == [(outsider.node_id, b"good")]
            assert a.data.counters["bad_frames"] == 1
            nursery.cancel_scope.cancel()


async def test_a_slow_handler_does_not_cost_the_sender_its_direct_path():
    """Handlers run in a task per sender, not in the stream's reader: while one takes 3 s,
    the stream is still read and acked, so the sender's ack timeout (2 s) never fires."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            a, b = mesh.a, mesh.b
            handled: list[bytes] = []

            async def slow(src: bytes, data: bytes) -> None:
                if data == b"first":
                    await trio.sleep(3)  # a long prefill
                handled.append(data)

            nursery.start_soon(b.data.dispatch, slow)
            dst = b.identity.node_id
            first = await a.data.post(dst, b"first", timeout=20)
            await trio.sleep(0.5)
            second = await a.data.post(dst, b"second", timeout=20)
            await first.done.wait()
            await second.done.wait()
            assert (first.path, second.path) == ("direct", "direct")
            assert a.data.view(dst)["data_last_failure"] is None
            with trio.fail_after(5):
                while len(handled) < 2:
                    await trio.sleep(0.05)
            assert handled == [b"first", b"second"]
            nursery.cancel_scope.cancel()


async def _accept_as(stream, identity: Identity, epoch: int = 3) -> bytearray:
    """The accepting end of a stream's handshake, as ``identity`` in process ``epoch``; returns
    what it read past it."""
    buf = bytearray()
    nonce = b"\x03" * STREAM_NONCE_BYTES
    dh = ProcessKeys(identity.node_id, epoch).public
    await stream.send_all(frame(Packet(identity.node_id, (StreamChallenge(nonce, epoch, dh),))))
    proof = await read_packet(stream, buf)
    signature = identity.sign(proof_data(proof.messages[0].nonce, proof.sender, identity.node_id, epoch, dh))
    await stream.send_all(frame(Packet(identity.node_id, (StreamProof(nonce, signature, epoch, dh),))))
    return buf


async def _serve_peer(nursery, node, identity: Identity, handler) -> None:
    """A peer ``identity`` that ``node`` dials at a listener running ``handler`` per stream."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, handler, listeners)
    real = node.data.addr_of
    node.data.addr_of = lambda n: f"127.0.0.1:{port}" if n == identity.node_id else real(n)


async def test_messages_posted_while_the_stream_is_dialled_go_out_without_waiting_for_an_ack():
    """The first post() to a peer dials it; the messages posted meanwhile are written as soon
    as the stream is open, not after the first message's ack (which may be held a while,
    or never come, as from this peer)."""
    peer_identity = Identity.generate()
    seen: list[int] = []
    all_seen = trio.Event()

    async def accept_and_read(stream):
        buf = await _accept_as(stream, peer_identity)
        while len(seen) < 5:
            seen.extend(msg.msg_id for msg in (await read_packet(stream, buf)).messages)
        all_seen.set()
        await trio.sleep_forever()  # and never acks

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            a = mesh.a
            await _serve_peer(nursery, a, peer_identity, accept_and_read)
            for i in range(5):
                await a.data.post(peer_identity.node_id, b"m%d" % i, timeout=30)
            # All five arrive well within one ack timeout: none waits for message 1's ack.
            with trio.fail_after(a.data.config.ack_timeout / 2):
                await all_seen.wait()
            assert sorted(seen) == [1, 2, 3, 4, 5]
            nursery.cancel_scope.cancel()


async def test_a_congested_stream_carries_each_message_once():
    """While post() waits to write into a full socket, the supervisor must not write the
    same message too: on a congested link that doubled the bytes sent."""
    peer_identity = Identity.generate()
    copies: collections.Counter = collections.Counter()
    chunks: dict[int, int] = {}
    done = trio.Event()

    async def accept_read_slowly_and_ack(stream):
        buf = await _accept_as(stream, peer_identity)
        received: collections.Counter = collections.Counter()
        while True:
            while (data := next_frame(buf)) is not None:
                for msg in decode(data, MAX_FRAME_BYTES).messages:
                    copies[msg.msg_id] += 1
                    chunks[msg.msg_id] = -(-msg.total // CHUNK_BYTES)
                    received[msg.msg_id] += 1
                    if received[msg.msg_id] == chunks[msg.msg_id]:
                        ack = frame(Packet(peer_identity.node_id, (DataAck(msg.session, msg.msg_id),)))
                        await stream.send_all(ack)
            if len(chunks) == 42 and all(received[i] >= chunks[i] for i in chunks):
                break  # the dial, the big one, and 40 more, each whole
            await trio.sleep(0.002)  # a slow reader: the sender's socket stays full
            buf += await stream.receive_some(16384)
        done.set()
        await trio.sleep_forever()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            a = mesh.a
            await _serve_peer(nursery, a, peer_identity, accept_read_slowly_and_ack)
            await a.data.post(peer_identity.node_id, b"dial", timeout=30)
            await trio.sleep(0.5)
            await a.data.post(peer_identity.node_id, b"x" * (8 * 1024 * 1024), timeout=30)  # fills the socket
            for _ in range(40):
                await a.data.post(peer_identity.node_id, b"y" * 20_000, timeout=30)
            await done.wait()
            twice = sorted(i for i, n in copies.items() if n > chunks[i])
            assert twice == [], f"messages written more than once: {twice}"
            nursery.cancel_scope.cancel()


async def test_post_to_a_peer_that_stops_reading_fails_at_its_deadline_and_returns():
    """A peer that completes the handshake and then never reads fills the socket buffers:
    post() must still return, and the message fails at its deadline, naming the peer."""
    peer_identity = Identity.generate()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            a = mesh.a

            async def accept_and_stall(stream):
                await _accept_as(stream, peer_identity)
                await trio.sleep_forever()  # never reads again

            await _serve_peer(nursery, a, peer_identity, accept_and_stall)
            failures: list[str] = []

            async def failed(exc):
                failures.append(str(exc))

            big = b"x" * (16 * 1024 * 1024)
            # Each post() returns by its deadline, though the peer reads nothing.
            items = [await a.data.post(peer_identity.node_id, big, timeout=2, on_error=failed)
                     for _ in range(2)]
            for item in items:
                await item.done.wait()
            assert [item.error is not None for item in items] == [True, True]
            assert len(failures) == 2 and "within 2s" in failures[0]
            nursery.cancel_scope.cancel()


async def test_a_frame_written_in_part_is_finished_before_the_next_one(monkeypatch):
    """post() writes a one-frame message straight into the socket; when the socket takes
    only part of it, the rest must follow before any other frame, or nothing after it
    parses.  Here every third write into the socket takes only half its bytes."""
    import os as real_os

    from meshd.net import framing

    halves = []

    class HalfWrites:
        def __getattr__(self, name):
            return getattr(real_os, name)

        def write(self, fd, data):
            if len(data) > 1000 and len(halves) % 3 == 0:
                halves.append(len(data))
                return real_os.write(fd, data[:len(data) // 2])
            halves.append(0)
            return real_os.write(fd, data)

    count = 60
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            a, b = mesh.a, mesh.b
            got: list = []
            nursery.start_soon(_collect, b, count, got)
            await a.data.send(b.identity.node_id, b"dial")  # the stream is open: post() writes itself
            monkeypatch.setattr(framing, "os", HalfWrites())  # no public seam for a short write
            for i in range(count - 1):
                await a.data.post(b.identity.node_id, bytes([i]) * (2000 + i))
            with trio.fail_after(20):
                while len(got) < count:
                    await trio.sleep(0.05)
            assert any(halves), "no write was cut in half: the test did not test"
            want = [b"dial"] + [bytes([i]) * (2000 + i) for i in range(count - 1)]
            assert [data for _, data in got] == want
            assert b.data.counters["bad_frames"] == 0
            nursery.cancel_scope.cancel()


async def test_after_a_message_fails_the_next_ones_are_still_delivered():
    """The receiver delivers in id order: a message given up on would leave it waiting for
    that id for ever, acking and holding everything after it.  The sender starts a new
    session with that peer instead, and later messages arrive."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            a, c = mesh.a, mesh.c
            got: list = []
            nursery.start_soon(_collect, c, 2, got)
            assert await a.data.send(c.identity.node_id, b"one") == "direct"
            c.options.faults.isolate = True  # C reaches nobody, and nobody reaches C
            with pytest.raises(DeliveryError):
                await a.data.send(c.identity.node_id, b"lost", timeout=2)
            c.options.faults.isolate = False
            await a.data.send(c.identity.node_id, b"after", timeout=20)
            with trio.fail_after(10):
                while len(got) < 2:
                    await trio.sleep(0.05)
            assert [data for _, data in got] == [b"one", b"after"]
            nursery.cancel_scope.cancel()


async def _run_channel(identity: Identity, epoch: int, addrs: dict[bytes, str], *,
                       task_status=trio.TASK_STATUS_IGNORED):
    """A channel of its own (no relay) on a fresh loopback port, in process ``epoch``; reports
    it and the scope whose cancel ends it, as its process's end would."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    addrs[identity.node_id] = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    channel = DataChannel(identity.node_id, addr_of=addrs.get, describe=lambda n: n.hex()[:8],
                          relay_send=None, sign=identity.sign, epoch=epoch)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.serve, listeners)
            task_status.started((channel, scope))


@pytest.mark.parametrize("first", ["we dial it", "it dials us"])
async def test_a_peer_restarted_with_its_key_gets_our_messages_at_once(first):
    """A peer's new process (same key, new epoch) never saw our message ids.  As soon as a
    handshake shows the new epoch, every session with it starts again, so what we send
    next is delivered at once: not held waiting for ids its old process took along."""
    a_key, b_key = Identity.generate(), Identity.generate()
    a_id, b_id = a_key.node_id, b_key.node_id
    addrs: dict[bytes, str] = {}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a, _ = await nursery.start(_run_channel, a_key, 10, addrs)
            b, b_scope = await nursery.start(_run_channel, b_key, 20, addrs)
            for i in range(3):
                assert await a.send(b_id, b"before %d" % i) == "direct"
                assert await b.received.receive() == (a_id, b"before %d" % i)
            assert a.peer_epoch(b_id) == 20 and b.peer_epoch(a_id) == 10
            b_scope.cancel()  # B's process ends
            await trio.sleep(0.2)  # and A reads the end of its stream
            b2, _ = await nursery.start(_run_channel, b_key, 21, addrs)  # same key, new port
            if first == "it dials us":
                assert await b2.send(a_id, b"hello again") == "direct"
                assert await a.received.receive() == (b_id, b"hello again")
                # Nothing of ours has reached the new process yet: no path to it is claimed,
                # and nothing the old one's paths did is held against it.
                assert a.view(b_id) == {"data_out": None, "data_sent": 0, "data_last_failure": None}
            with trio.fail_after(5):  # a held message would wait for the send timeout (30 s)
                assert await a.send(b_id, b"after") == "direct"
                assert await b2.received.receive() == (a_id, b"after")
            assert a.peer_epoch(b_id) == 21
            assert a.counters["peer_restarts"] == 1 and b2.counters["peer_restarts"] == 0
            nursery.cancel_scope.cancel()


async def test_a_stream_closed_to_make_room_still_handles_the_message_it_was_handing_over(monkeypatch):
    """A stream's reader hands messages to the node itself (``inline``), after acking them: a
    stream closed to make room lets the message in hand finish, and the sender's next one
    comes on a new stream.  Nothing acked is lost."""
    from meshd.net import channel

    monkeypatch.setattr(channel, "MAX_INBOUND_PER_PEER", 1)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            a, b = mesh.a, mesh.b
            started, release = trio.Event(), trio.Event()
            handled: list[bytes] = []

            async def handler(src: bytes, data: bytes) -> None:
                if data == b"slow":
                    started.set()
                    await release.wait()
                handled.append(data)

            nursery.start_soon(partial(a.data.dispatch, handler, inline=True))
            assert await b.node.send(a.node_id, b"slow", 10) == "direct"
            await started.wait()
            assert list(a.data._inbound.values()) == [b.node_id]
            assert a.data._make_room(b.node_id)  # b's one stream goes, its reader mid-message
            assert a.data.counters["streams_evicted"] == 1 and not a.data._inbound
            release.set()
            await b.node.send(a.node_id, b"after", 10)
            while len(handled) < 2:
                await trio.sleep(0.02)
            assert handled == [b"slow", b"after"]
            nursery.cancel_scope.cancel()


async def test_strangers_streams_are_bounded_and_go_before_the_members(monkeypatch):
    """On a mesh without a key anyone can prove a fresh node id and hold a stream: a crowd of
    them never holds more than the bound, each id no more than its own, and the members'
    streams stay (their messages still arrive, on the streams they had)."""
    from meshd.net import channel

    monkeypatch.setattr(channel, "MAX_INBOUND_STREAMS", 6)
    monkeypatch.setattr(channel, "MAX_INBOUND_PER_PEER", 2)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            mesh = Mesh(nursery, nursery)
            await mesh.start([])
            a = mesh.a
            for sender in (mesh.b, mesh.c, mesh.d):  # each member holds a stream to a
                await sender.node.send(a.node_id, b"before", 10)
            members = set(a.data._inbound.values())
            assert len(members) == 3
            held = []
            one = Identity.generate()
            for _ in range(3):  # one id, three streams: its oldest goes
                stream, answer = await open_data_stream(a.addr, one)
                assert answer is not None
                held.append(stream)
            await trio.sleep(0.1)
            assert list(a.data._inbound.values()).count(one.node_id) == 2
            for _ in range(10):  # a crowd of fresh ids
                stream, _answer = await open_data_stream(a.addr, Identity.generate())
                held.append(stream)
            await trio.sleep(0.1)
            assert len(a.data._inbound) <= 6 and members <= set(a.data._inbound.values())
            assert a.data.counters["streams_evicted"] >= 9
            assert await held[0].receive_some(100) == b"", "an evicted stream is closed"
            got: list = []
            nursery.start_soon(_collect, a, 6, got)  # the three before, then the three after
            for sender in (mesh.b, mesh.c, mesh.d):
                await sender.node.send(a.node_id, b"after", 10)
            with trio.fail_after(5):
                while len(got) < 6:
                    await trio.sleep(0.05)
            assert sorted(got[3:]) == sorted((s.node_id, b"after") for s in (mesh.b, mesh.c, mesh.d))
            for stream in held:
                await stream.aclose()
            nursery.cancel_scope.cancel()


async def test_read_some_takes_what_the_socket_holds_without_waiting():
    left, right = trio.socket.socketpair()
    reader, writer = trio.SocketStream(left), trio.SocketStream(right)
    assert read_some(reader) is None  # nothing yet: the caller waits the usual way
    await writer.send_all(b"abc")
    assert read_some(reader) == b"abc"
    await writer.aclose()
    assert read_some(reader) == b""  # the peer closed
    await reader.aclose()
    with pytest.raises(trio.BrokenResourceError):
        read_some(reader)


async def test_a_frame_already_in_the_socket_is_handled_before_a_trip_through_the_scheduler():
    """At stage 0 the last stage's share of the head waits in the socket while stage 0
    computes its own; the reader takes it at once when its handler returns, not after
    whatever else is runnable (on every token's critical path)."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            lines: list[str] = []
            opts = dict(profile="local", stages=1)
            a = await start_node(nursery, NodeOptions(role="orchestrator", **opts), lines)
            b = await start_node(nursery, NodeOptions(stage=0, seeds=[a.addr], **opts), lines)
            await wait_converged([a, b])
            order: list[object] = []
            second_sent, done = trio.Event(), trio.Event()

            async def round_ran() -> None:
                order.append("round")

            async def handler(src: bytes, data: bytes) -> None:
                order.append(data)
                if data == b"1":
                    await second_sent.wait()
                    await trio.sleep(0.2)  # message 2 is in our socket now
                    nursery.start_soon(round_ran)  # runs at the next trip through the scheduler
                if data == b"2":
                    done.set()

            nursery.start_soon(partial(b.data.dispatch, handler, inline=True))
            await a.data.send(b.identity.node_id, b"0", timeout=10)  # the stream is up
            await a.data.post(b.identity.node_id, b"1", timeout=10)
            await trio.sleep(0.1)
            await a.data.post(b.identity.node_id, b"2", timeout=10)
            second_sent.set()
            await done.wait()
            await trio.sleep(0.05)
            assert order == [b"0", b"1", b"2", "round"], order
            nursery.cancel_scope.cancel()
