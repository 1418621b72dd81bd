"""Data-channel chunks are encrypted end to end: what the relay or a stream carries never
shows a message, a chunk that was altered or made up is dropped (and the message still
arrives, once), a mesh key admits only its holders to a stream, and a peer's new process
gets new keys and our messages."""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing

from meshd.identity import Identity
from meshd.keyring import Keyring, generate_key
from meshd.net.channel import ChannelConfig, DataChannel, DeliveryError
from meshd.net.data_keys import SEAL_OVERHEAD, ProcessKeys
from meshd.net.framing import frame, read_packet
from meshd.net.handshake import HandshakeError, LocalEnd, Proven, accept, dial, proof_data
from meshd.net.sender import CHUNK_BYTES
from meshd.testing.tcp_proxy import TcpProxy
from meshd.wire import (
    MAX_FRAME_BYTES,
    RELAY_DATA,
    STREAM_NONCE_BYTES,
    DataAck,
    DataChunk,
    Packet,
    StreamProof,
    decode,
    encode,
)

# Resends come soon, so a dropped chunk costs the tests half a second, not two.
FAST = ChannelConfig(ack_timeout=0.5, ack_delay=0.0)


class Relay:
    """An in-memory relay: forwards each payload to the channel it is addressed to, in order,
    and keeps everything it carried; ``tamper`` may rewrite a payload on its way."""

    def __init__(self) -> None:
        self.channels: dict[bytes, DataChannel] = {}
        self.carried: list[tuple[bytes, bytes, bytes]] = []  # (source, destination, payload)
        self.tamper: Callable[[bytes], bytes] | None = None
        self._in, self._out = trio.open_memory_channel[tuple[bytes, bytes, bytes]](math.inf)

    def sender(self, src: bytes) -> Callable[[bytes, bytes], Awaitable[None]]:
        async def send(dst: bytes, payload: bytes) -> None:
            if self.tamper is not None:
                payload = self.tamper(payload)
            self.carried.append((src, dst, payload))
            self._in.send_nowait((src, dst, payload))

        return send

    async def run(self) -> None:
        async for src, dst, payload in self._out:
            channel = self.channels.get(dst)
            if channel is not None:
                await channel.on_relay_payload(src, payload)

    def chunks(self, src: bytes) -> list[DataChunk]:
        """Every data chunk ``src`` sent through the relay, as the relay saw it."""
        return [msg for s, _, payload in self.carried if s == src
                for msg in decode(payload[1:], MAX_FRAME_BYTES).messages if isinstance(msg, DataChunk)]

    def acks(self, src: bytes) -> list[DataAck]:
        return [msg for s, _, payload in self.carried if s == src
                for msg in decode(payload[1:], MAX_FRAME_BYTES).messages if isinstance(msg, DataAck)]

    def bytes_from(self, src: bytes) -> bytes:
        return b"".join(payload for s, _, payload in self.carried if s == src)


async def _run_channel(identity: Identity, epoch: int, addrs: dict[bytes, str], relay: Relay | None,
                       *, keyring: Keyring | None = None, encrypt: bool = True,
                       task_status=trio.TASK_STATUS_IGNORED):
    """A channel on a fresh loopback port, in process ``epoch``, reachable at ``addrs`` and
    through ``relay``; reports it, its address and the scope whose cancel ends its process."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    addr = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    channel = DataChannel(identity.node_id, addr_of=addrs.get, describe=lambda n: n.hex()[:8],
                          relay_send=relay.sender(identity.node_id) if relay is not None else None,
                          sign=identity.sign, config=FAST, epoch=epoch, keyring=keyring, encrypt=encrypt)
    if relay is not None:
        relay.channels[identity.node_id] = channel
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.serve, listeners)
            task_status.started((channel, addr, scope))


def _channel(identity: Identity, epoch: int, addrs: dict[bytes, str], relay: Relay | None, **kw):
    """``_run_channel`` with its arguments, for ``nursery.start``."""

    async def run(*, task_status=trio.TASK_STATUS_IGNORED):
        await _run_channel(identity, epoch, addrs, relay, task_status=task_status, **kw)

    return run


def _introduce(*channels: DataChannel) -> None:
    """Each channel learns every other's process key, as their members' metadata would say it."""
    for a in channels:
        for b in channels:
            if a is not b:
                a.note_epoch(b.id, b.epoch, b.public_key)


async def _relayed_pair(nursery: trio.Nursery, relay: Relay) -> tuple[DataChannel, DataChannel]:
    """The in-memory relay running, and two channels that reach each other only through it."""
    nursery.start_soon(relay.run)
    a, _, _ = await nursery.start(_channel(Identity.generate(), 10, {}, relay))
    b, _, _ = await nursery.start(_channel(Identity.generate(), 20, {}, relay))
    return a, b


def _shows(wire: bytes, message: bytes) -> bool:
    """Whether any 32-byte piece of ``message``, taken every KiB, appears in ``wire``."""
    return any(message[i:i + 32] in wire for i in range(0, max(1, len(message) - 32), 1024))


async def _receive(channel: DataChannel, count: int) -> list[tuple[bytes, bytes]]:
    return [await channel.received.receive() for _ in range(count)]


async def _nothing_more(channel: DataChannel, seconds: float = 1.0) -> None:
    """Nothing else is delivered within ``seconds`` (a duplicate would be)."""
    with trio.move_on_after(seconds):
        extra = await channel.received.receive()
        raise AssertionError(f"delivered again: {extra[1][:40]!r}")


# --- nothing in clear on the wire ---


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed", "in-clear-the-recorder-sees-it"])
@pytest.mark.parametrize("path", ["relay", "direct"])
async def test_a_message_never_crosses_the_wire_in_clear(path, encrypt):
    """Neither the relay nor a stream carries any piece of a message (a prompt, an
    activation); with encryption off (benchmarks only) the same recorders see it, so they
    do look at the chunks."""
    a_key, b_key = Identity.generate(), Identity.generate()
    prompt = b"the prompt: what is the capital of France? " * 4
    activation = os.urandom(3 * CHUNK_BYTES + 1000)  # four chunks
    relay = Relay() if path == "relay" else None
    addrs: dict[bytes, str] = {}
    record = bytearray()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            if relay is not None:
                nursery.start_soon(relay.run)
            a, _, _ = await nursery.start(_channel(a_key, 10, addrs, relay, encrypt=encrypt))
            b, b_addr, _ = await nursery.start(_channel(b_key, 20, addrs, relay, encrypt=encrypt))
            if relay is None:
                proxy = TcpProxy(b_addr, on_bytes=lambda _, data: record.extend(data))
                addrs[b.id] = await nursery.start(proxy.serve)  # A reaches B through it
            else:
                _introduce(a, b)
            for data in (prompt, activation):
                assert await a.send(b.id, data) == path
            assert [data for _, data in await _receive(b, 2)] == [prompt, activation]
            wire = bytes(record) if relay is None else relay.bytes_from(a.id)
            assert len(wire) > len(prompt) + len(activation)  # the recorder saw both messages go by
            assert _shows(wire, prompt) is not encrypt
            assert _shows(wire, activation) is not encrypt
            nursery.cancel_scope.cancel()


# --- altered, moved and made-up chunks ---


async def test_a_tampered_chunk_is_dropped_and_the_message_arrives_once_by_resend():
    """The relay flips one bit of a chunk: it does not open, is dropped without an ack and
    counted; the sender, left without an ack, sends it again, and the message arrives once."""
    relay = Relay()
    tampered: list[int] = []

    def flip_first_chunk(payload: bytes) -> bytes:
        packet = decode(payload[1:], MAX_FRAME_BYTES)
        chunk = packet.messages[0]
        if tampered or not isinstance(chunk, DataChunk):
            return payload
        body = bytearray(chunk.chunk)
        body[len(body) // 2] ^= 0x01
        tampered.append(chunk.msg_id)
        forged = DataChunk(chunk.session, chunk.msg_id, chunk.total, chunk.offset, bytes(body), chunk.ack_now)
        return RELAY_DATA + encode(Packet(packet.sender, (forged,)), MAX_FRAME_BYTES)

    message = os.urandom(2 * CHUNK_BYTES)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a, b = await _relayed_pair(nursery, relay)
            _introduce(a, b)
            relay.tamper = flip_first_chunk
            assert await a.send(b.id, message) == "relay"
            assert await b.received.receive() == (a.id, message)
            await _nothing_more(b)
            assert tampered == [1]
            assert b.counters["rx_data_undecryptable"] == 1
            assert a.counters["resent"] >= 1
            nursery.cancel_scope.cancel()


async def test_chunks_made_up_or_moved_through_the_relay_are_dropped_and_deliver_nothing():
    """Whoever runs the relay can put any frame under a member's id: made-up bytes, a chunk
    in clear, or a real sealed chunk moved to another message, offset or session.  None
    opens; each is counted and dropped unacked, and the member's own messages still arrive."""
    relay = Relay()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a, b = await _relayed_pair(nursery, relay)
            _introduce(a, b)
            assert await a.send(b.id, b"real one") == "relay"
            assert await b.received.receive() == (a.id, b"real one")
            (real,) = relay.chunks(a.id)
            session, sealed = real.session, real.chunk
            forged = [
                DataChunk(session, 2, 100, 0, os.urandom(100 + SEAL_OVERHEAD)),  # made up
                DataChunk(session, 2, 100, 0, b"x" * 100),  # in clear
                DataChunk(session, 2, 5, 0, b"short"),  # shorter than a seal
                DataChunk(session, 2, real.total, 0, sealed),  # a real chunk, moved to message 2
                DataChunk(session ^ 1, 1, real.total, 0, sealed),  # to another session
                DataChunk(session, 1, real.total + 1, 0, sealed),  # claiming another size
            ]
            acks_before = len(relay.acks(b.id))
            for chunk in forged:
                await b.on_relay_payload(a.id, RELAY_DATA + encode(Packet(a.id, (chunk,)), MAX_FRAME_BYTES))
            await _nothing_more(b, 0.5)
            assert b.counters["rx_data_undecryptable"] == len(forged)
            assert len(relay.acks(b.id)) == acks_before  # none acked
            assert await a.send(b.id, b"real two") == "relay"
            assert await b.received.receive() == (a.id, b"real two")
            nursery.cancel_scope.cancel()


# --- no key, no data ---


async def test_a_sender_without_the_peers_key_sends_nothing_and_delivers_once_it_learns_it():
    """Before membership says a peer process's key, nothing goes to it (in clear or at all);
    the message waits, and goes as soon as the key is known."""
    relay = Relay()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a, b = await _relayed_pair(nursery, relay)
            b.note_epoch(a.id, a.epoch, a.public_key)
            a.note_epoch(b.id, b.epoch)  # its epoch, but not its key
            item = await a.post(b.id, b"waits for the key", timeout=20)
            await trio.sleep(1.0)
            assert relay.chunks(a.id) == []
            assert "no data key" in (a.view(b.id)["data_last_failure"] or "")
            a.note_epoch(b.id, b.epoch, b.public_key)
            assert await b.received.receive() == (a.id, b"waits for the key")
            await item.done.wait()
            assert item.error is None and item.path == "relay"
            assert all(len(chunk.chunk) == len(b"waits for the key") + SEAL_OVERHEAD
                       for chunk in relay.chunks(a.id))
            nursery.cancel_scope.cancel()


async def test_a_message_for_a_peer_whose_key_we_never_learn_fails_naming_why():
    relay = Relay()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a, b = await _relayed_pair(nursery, relay)
            with pytest.raises(DeliveryError, match="no data key for its current process"):
                await a.send(b.id, b"never sent", timeout=1.5)
            assert relay.chunks(a.id) == []
            nursery.cancel_scope.cancel()


# --- a restarted peer ---


async def test_a_peer_restarted_behind_the_relay_gets_new_keys_and_our_messages():
    """B's new process (same node key, new epoch, new X25519 key) cannot open what A seals for
    its old one; once membership says its new key, A's sessions with it start again and the
    message arrives, once."""
    a_key, b_key = Identity.generate(), Identity.generate()
    relay = Relay()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay.run)
            a, _, _ = await nursery.start(_channel(a_key, 10, {}, relay))
            b, _, b_scope = await nursery.start(_channel(b_key, 20, {}, relay))
            _introduce(a, b)
            assert await a.send(b.id, b"before") == "relay"
            assert await b.received.receive() == (a.id, b"before")
            b_scope.cancel()  # B's process ends
            b2, _, _ = await nursery.start(_channel(b_key, 21, {}, relay))
            assert b2.public_key != b.public_key
            b2.note_epoch(a.id, a.epoch, a.public_key)  # it joins: A's metadata reaches it
            item = await a.post(b_key.node_id, b"after", timeout=20)  # sealed for B's old process
            with trio.fail_after(5):
                while not b2.counters["rx_data_undecryptable"]:
                    await trio.sleep(0.05)
            a.note_epoch(b2.id, b2.epoch, b2.public_key)  # B's new metadata reaches A
            assert await b2.received.receive() == (a.id, b"after")
            await item.done.wait()
            assert item.error is None
            await _nothing_more(b2)
            assert a.counters["peer_restarts"] == 1
            nursery.cancel_scope.cancel()


# --- the handshake: process keys and the mesh key ---


def _end(identity: Identity, epoch: int, keyring: Keyring | None = None) -> LocalEnd:
    return LocalEnd(identity.node_id, epoch, identity.sign, ProcessKeys(identity.node_id, epoch), keyring)


async def _handshake(dialler: LocalEnd, acceptor: LocalEnd) -> dict[str, object]:
    """Run both ends of a handshake over an in-memory stream; each end's Proven or its error."""
    left, right = trio.testing.memory_stream_pair()
    out: dict[str, object] = {}

    async def run(name: str, fn: Callable[[], Awaitable[object]], stream) -> None:
        try:
            out[name] = await fn()
        except HandshakeError as exc:
            out[name] = exc
            await stream.aclose()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            dialling = partial(dial, left, bytearray(), acceptor.node_id, dialler)
            accepting = partial(accept, right, bytearray(), acceptor, lambda _: False)
            nursery.start_soon(run, "dialler", dialling, left)
            nursery.start_soon(run, "acceptor", accepting, right)
    return out


async def test_each_end_of_a_handshake_learns_the_others_process_key():
    a, b = Identity.generate(), Identity.generate()
    dialler, acceptor = _end(a, 1), _end(b, 2)
    out = await _handshake(dialler, acceptor)
    assert out["acceptor"] == Proven(a.node_id, 1, dialler.keys.public)
    assert out["dialler"] == Proven(b.node_id, 2, acceptor.keys.public)
    # Both derived the same keys, each direction its own.
    to_b, at_b = dialler.keys.current(b.node_id, 2), acceptor.keys.current(a.node_id, 1)
    assert to_b is not None and at_b is not None
    sealed = to_b.seal(7, 1, 5, 0, b"hello")
    assert at_b.open(DataChunk(7, 1, 5, 0, sealed)) == b"hello"
    assert to_b.open(DataChunk(7, 1, 5, 0, sealed)) is None  # not the key of the other direction


@pytest.mark.parametrize("dialler_ring, acceptor_ring", [(None, "k1"), ("k2", "k1")],
                         ids=["no-key", "another-key"])
async def test_a_handshake_without_the_mesh_key_proof_fails_at_an_acceptor_with_a_keyring(
        dialler_ring, acceptor_ring):
    a, b = Identity.generate(), Identity.generate()
    rings = {"k1": Keyring([generate_key()]), "k2": Keyring([generate_key()])}
    out = await _handshake(_end(a, 1, rings.get(dialler_ring or "")), _end(b, 2, rings[acceptor_ring]))
    assert isinstance(out["acceptor"], HandshakeError)
    assert str(out["acceptor"]) == f"no valid mesh-key proof from {a.prefix}"
    assert isinstance(out["dialler"], HandshakeError)  # the stream closed under it


async def test_a_dialler_with_a_keyring_refuses_an_acceptor_without_the_key():
    a, b = Identity.generate(), Identity.generate()
    out = await _handshake(_end(a, 1, Keyring([generate_key()])), _end(b, 2))
    assert str(out["dialler"]) == f"no valid mesh-key proof from {b.prefix}"


async def test_both_ends_holding_the_mesh_key_prove_it_even_mid_rotation():
    """The dialler seals with a new key the acceptor holds but does not use yet."""
    old, new = generate_key(), generate_key()
    a, b = Identity.generate(), Identity.generate()
    out = await _handshake(_end(a, 1, Keyring([new, old])), _end(b, 2, Keyring([old, new])))
    assert not isinstance(out["acceptor"], HandshakeError) and not isinstance(out["dialler"], HandshakeError)


async def _dial_with_proof(acceptor: LocalEnd, dialler: bytes, make_proof: Callable[[bytes], StreamProof]
                           ) -> object:
    """What ``accept`` makes of ``dialler``, whose proof ``make_proof(challenge nonce)`` builds by
    hand: its Proven, or its HandshakeError."""
    left, right = trio.testing.memory_stream_pair()
    outcome: list[object] = []

    async def acceptor_end() -> None:
        try:
            outcome.append(await accept(right, bytearray(), acceptor, lambda _: False))
        except HandshakeError as exc:
            outcome.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(acceptor_end)
            challenge = (await read_packet(left, bytearray())).messages[0]
            await left.send_all(frame(Packet(dialler, (make_proof(challenge.nonce),))))
    return outcome[0]


@pytest.mark.parametrize("case", ["no key", "low-order key", "key swapped on the way"])
async def test_a_dialler_whose_process_key_is_missing_bad_or_unsigned_fails_the_handshake(case):
    dialler, acceptor_id = Identity.generate(), Identity.generate()
    acceptor = _end(acceptor_id, 2)
    real = ProcessKeys(dialler.node_id, 1).public
    nonce = b"\x05" * STREAM_NONCE_BYTES

    def make_proof(challenge_nonce: bytes) -> StreamProof:
        sent = {"no key": b"", "low-order key": b"\x00" * 32, "key swapped on the way": real}[case]
        signed = ProcessKeys(dialler.node_id, 1).public if case == "key swapped on the way" else sent
        signature = dialler.sign(proof_data(challenge_nonce, acceptor_id.node_id, dialler.node_id, 1, signed))
        return StreamProof(nonce, signature, 1, sent)

    result = await _dial_with_proof(acceptor, dialler.node_id, make_proof)
    assert isinstance(result, HandshakeError)
    want = {"no key": "sent no X25519 key", "low-order key": "X25519 key is unusable",
            "key swapped on the way": "signature does not verify"}[case]
    assert want in str(result)
    assert acceptor.keys.current(dialler.node_id, 1) is None


async def test_channels_without_the_mesh_key_get_no_stream_and_with_it_deliver_direct():
    a_key, b_key, c_key = Identity.generate(), Identity.generate(), Identity.generate()
    ring = Keyring([generate_key()])
    addrs: dict[bytes, str] = {}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a, _, _ = await nursery.start(_channel(a_key, 10, addrs, None, keyring=ring))
            b, b_addr, _ = await nursery.start(_channel(b_key, 20, addrs, None, keyring=ring))
            c, _, _ = await nursery.start(_channel(c_key, 30, addrs, None))  # no mesh key
            addrs[b.id] = b_addr
            assert await a.send(b.id, b"member to member") == "direct"
            assert await b.received.receive() == (a.id, b"member to member")
            with pytest.raises(DeliveryError, match="handshake"):
                await c.send(b.id, b"outsider", timeout=2)
            assert b.counters["handshake_failures"] >= 1
            await _nothing_more(b, 0.2)
            nursery.cancel_scope.cancel()
