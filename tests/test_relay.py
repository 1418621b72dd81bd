"""The relay, end to end on loopback: authentication, forwarding, limits, liveness, STUN, restarts."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, open_websocket

from meshd.identity import Identity
from meshd.relay import protocol, stun
from meshd.relay.client import ClientConfig, RelayClient, RelayNotConnected, stun_query
from meshd.relay.protocol import PeerNotHere, Recv, Replaced
from meshd.relay.server import Relay, RelayBindError, RelayConfig, serve_relay
from meshd.wire import MAX_FRAME_BYTES, RELAY_DATA, DataChunk, Packet, encode

HOST = "127.0.0.1"
WAIT = 10  # seconds: the bound on every wait in this file; a healthy run needs a fraction of it
FAST = ClientConfig(backoff_initial=0.05, backoff_max=0.5, connect_timeout=2, auth_timeout=2)


class RunningRelay:
    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.scope = trio.CancelScope()
        self.stopped = trio.Event()
        self.port = 0

    async def run(self, port: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self.scope:
                await serve_relay(HOST, port, relay=self.relay, task_status=task_status)
        finally:
            self.stopped.set()

    async def kill(self) -> None:
        """Cancel the relay and wait until it has let go of its port."""
        self.scope.cancel()
        with trio.fail_after(WAIT):
            await self.stopped.wait()


async def start_relay(nursery: trio.Nursery, relay: Relay | None = None, port: int = 0):
    """Serve a relay in its own cancel scope, so a test can kill it; returns (handle, port, relay)."""
    running = RunningRelay(relay or Relay())
    host, running.port = await nursery.start(running.run, port)
    assert host == HOST
    return running, running.port, running.relay


async def start_client(nursery: trio.Nursery, port: int, identity: Identity | None = None,
                       config: ClientConfig = FAST) -> RelayClient:
    client = RelayClient(f"ws://{HOST}:{port}", identity or Identity.generate(), config=config)
    await nursery.start(client.run)
    assert client.connected, client.last_error
    return client


def packet(sender: bytes, body: bytes = b"", *, size: int | None = None, data: bool = False) -> bytes:
    """A payload the relay forwards from ``sender``: a packet from it with ``body`` in one chunk
    (padded so the payload is ``size`` bytes in all), bare or, with ``data``, behind the
    data-channel prefix."""
    head = RELAY_DATA if data else b""
    chunk = body
    for _ in range(4):  # the padding's length changes the msgpack headers around it; settle it
        out = head + encode(Packet(sender, (DataChunk(1, 1, len(chunk), 0, chunk),)), MAX_FRAME_BYTES)
        if size is None or len(out) == size:
            return out
        chunk = body + b"\0" * (len(chunk) - len(body) + size - len(out))
    raise AssertionError(f"cannot build a {size}-byte packet")


async def next_frame(client: RelayClient):
    with trio.fail_after(WAIT):
        return await client.received.receive()


async def assert_exchange(a: RelayClient, b: RelayClient, tag: bytes = b"") -> None:
    """A packet each way, a->b and b->a, arrives with its sender and payload intact."""
    ab, ba = packet(a.identity.node_id, b"a->b " + tag), packet(b.identity.node_id, b"b->a " + tag, data=True)
    await a.send(b.identity.node_id, ab)
    assert await next_frame(b) == Recv(a.identity.node_id, ab)
    await b.send(a.identity.node_id, ba)
    assert await next_frame(a) == Recv(b.identity.node_id, ba)


async def wait_until(predicate, what: str) -> None:
    with trio.fail_after(WAIT):
        while not predicate():
            await trio.sleep(0.01)


async def test_two_clients_exchange_frames_both_ways():
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery)
        a = await start_client(nursery, port)
        b = await start_client(nursery, port)
        for i in range(20):
            await assert_exchange(a, b, str(i).encode())
        big = packet(a.identity.node_id, os.urandom(1000), size=protocol.MAX_PAYLOAD)
        await a.send(b.identity.node_id, big)
        assert await next_frame(b) == Recv(a.identity.node_id, big)
        snap = relay.snapshot()
        assert snap["clients_connected"] == 2
        assert set(snap["clients"]) == {a.identity.prefix, b.identity.prefix}
        assert snap["frames_forwarded"] == 41
        nursery.cancel_scope.cancel()


async def test_frame_to_absent_peer_is_answered_peer_not_here():
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery)
        a = await start_client(nursery, port)
        absent = Identity.generate().node_id
        await a.send(absent, packet(a.identity.node_id, b"anyone there?"))
        assert await next_frame(a) == PeerNotHere(absent)
        assert relay.snapshot()["peer_not_here"] == 1
        assert a.counters["peer_not_here"] == 1
        nursery.cancel_scope.cancel()


async def test_a_frame_handler_gets_every_frame_in_order_and_survives_its_own_errors():
    async with trio.open_nursery() as nursery:
        _, port, _ = await start_relay(nursery)
        got: list = []

        async def handler(frame) -> None:
            got.append(frame)
            if len(got) == 3:
                raise RuntimeError("a handler bug")

        a = await start_client(nursery, port)
        b = RelayClient(f"ws://{HOST}:{port}", Identity.generate(), config=FAST, on_frame=handler)
        await nursery.start(b.run)
        sent = [packet(a.identity.node_id, i.to_bytes(2, "big")) for i in range(10)]
        for data in sent:
            await a.send(b.identity.node_id, data)
        await wait_until(lambda: len(got) == len(sent), "all frames handled")
        assert got == [Recv(a.identity.node_id, data) for data in sent]
        assert b.counters["handler_errors"] == 1 and b.connected
        with pytest.raises(trio.WouldBlock):
            b.received.receive_nowait()  # the handler had them all
        nursery.cancel_scope.cancel()


# --- clients that break the rules: refused, counted, and nobody else notices ---


async def raw_connect(port: int, nursery: trio.Nursery):
    """A bare WebSocket to the relay and the challenge nonce it sent."""
    ws = await nursery.start(_raw_ws, port)
    challenge = protocol.decode(await ws.get_message())
    assert isinstance(challenge, protocol.Challenge)
    return ws, challenge.nonce


async def _raw_ws(port, task_status=trio.TASK_STATUS_IGNORED):
    async with open_websocket(HOST, port, "/", use_ssl=False, max_message_size=1 << 22) as ws:
        task_status.started(ws)
        await trio.sleep_forever()


async def closed_with(ws) -> tuple[int, str]:
    """Read until the relay closes the connection; the close code and reason."""
    with trio.fail_after(WAIT):
        while True:
            try:
                await ws.get_message()
            except ConnectionClosed as exc:
                return exc.reason.code, exc.reason.reason or ""


def authenticate(identity: Identity, nonce: bytes, claim: bytes | None = None) -> bytes:
    node_id = claim or identity.node_id
    return protocol.Auth(node_id, identity.sign(protocol.auth_message(nonce, node_id))).encode()


async def refused_while_pair_keeps_talking(misbehave, reason: str, code: int) -> tuple[Relay, str]:
    """Connect a healthy pair, run ``misbehave(ws, nonce, pair)``, and check the relay
    refused it with ``code`` and counted ``reason``, while the pair kept exchanging frames."""
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery)
        a = await start_client(nursery, port)
        b = await start_client(nursery, port)
        await assert_exchange(a, b, b"before")
        ws, nonce = await raw_connect(port, nursery)
        await misbehave(ws, nonce, (a, b))
        got_code, text = await closed_with(ws)
        assert got_code == code, text
        await wait_until(lambda: relay.refused.get(reason) == 1, f"refused[{reason}]")
        await assert_exchange(a, b, b"after")
        assert a.connected and b.connected
        for client in (a, b):  # nothing from the intruder reached the pair
            with pytest.raises(trio.WouldBlock):
                client.received.receive_nowait()
        assert relay.snapshot()["clients_connected"] == 2
        nursery.cancel_scope.cancel()
    return relay, text


async def test_frame_before_authentication_is_refused():
    async def misbehave(ws, nonce, pair):
        await ws.send_message(protocol.Send(pair[1].identity.node_id, b"let me in").encode())

    relay, text = await refused_while_pair_keeps_talking(
        misbehave, "unauthenticated", protocol.CLOSE_UNAUTHENTICATED)
    assert "before authentication" in text
    assert relay.frames_forwarded == 4  # the pair's, before and after; never the intruder's


async def test_forged_signature_is_refused():
    async def misbehave(ws, nonce, pair):
        await ws.send_message(protocol.Auth(Identity.generate().node_id, os.urandom(64)).encode())

    _, text = await refused_while_pair_keeps_talking(misbehave, "bad-signature", protocol.CLOSE_BAD_SIGNATURE)
    assert "signature" in text


async def test_claim_to_another_nodes_id_is_refused_and_does_not_displace_it():
    async def misbehave(ws, nonce, pair):
        victim = pair[0].identity.node_id
        await ws.send_message(authenticate(Identity.generate(), nonce, claim=victim))

    relay, _ = await refused_while_pair_keeps_talking(
        misbehave, "bad-signature", protocol.CLOSE_BAD_SIGNATURE)
    assert relay.replaced == 0


async def test_signature_over_a_stale_nonce_is_refused():
    me = Identity.generate()

    async def misbehave(ws, nonce, pair):
        await ws.send_message(authenticate(me, os.urandom(32)))  # a replayed answer to another challenge

    await refused_while_pair_keeps_talking(misbehave, "bad-signature", protocol.CLOSE_BAD_SIGNATURE)


async def test_oversized_frame_is_refused():
    me = Identity.generate()

    async def misbehave(ws, nonce, pair):
        await ws.send_message(authenticate(me, nonce))
        assert isinstance(protocol.decode(await ws.get_message()), protocol.Accepted)
        frame = bytes([protocol.Send.TAG]) + pair[1].identity.node_id + b"x" * (protocol.MAX_PAYLOAD + 1)
        await ws.send_message(frame)

    await refused_while_pair_keeps_talking(misbehave, "oversized", protocol.CLOSE_TOO_BIG)


async def test_garbage_frame_after_authentication_is_refused():
    me = Identity.generate()

    async def misbehave(ws, nonce, pair):
        await ws.send_message(authenticate(me, nonce))
        assert isinstance(protocol.decode(await ws.get_message()), protocol.Accepted)
        await ws.send_message(b"\xfe\x00\xffgarbage")

    _, text = await refused_while_pair_keeps_talking(misbehave, "malformed", protocol.CLOSE_MALFORMED)
    assert "malformed" in text


async def test_garbage_instead_of_answering_the_challenge_is_refused():
    async def misbehave(ws, nonce, pair):
        await ws.send_message("not even binary")

    await refused_while_pair_keeps_talking(misbehave, "malformed", protocol.CLOSE_MALFORMED)


async def test_silence_after_the_challenge_is_refused_after_the_auth_timeout():
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery, Relay(RelayConfig(auth_timeout=0.3)))
        ws, _ = await raw_connect(port, nursery)
        code, text = await closed_with(ws)
        assert code == protocol.CLOSE_AUTH_TIMEOUT
        assert "challenge" in text
        assert relay.refused == {"auth-timeout": 1}
        nursery.cancel_scope.cancel()


async def test_garbage_bytes_on_the_tcp_port_are_refused_and_the_relay_stays_up():
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery, Relay(RelayConfig(handshake_timeout=0.3)))
        a = await start_client(nursery, port)
        b = await start_client(nursery, port)
        with trio.fail_after(WAIT):
            stream = await trio.open_tcp_stream(HOST, port)
            await stream.send_all(os.urandom(300) + b"\r\n\r\n")
            reply = b""
            while chunk := await stream.receive_some():
                reply += chunk  # the relay answers (400) and hangs up
            await stream.aclose()
        assert not reply or reply.startswith(b"HTTP/1.1 400")
        await wait_until(lambda: relay.refused.get("handshake-failed") == 1, "handshake-failed")
        await assert_exchange(a, b)
        nursery.cancel_scope.cancel()


# --- limits and liveness ---


async def test_rate_limit_drops_excess_frames_and_refills():
    config = RelayConfig(max_payload=1000, rate_bytes_per_s=2000, burst_bytes=5000)
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery, Relay(config))
        a = await start_client(nursery, port)
        b = await start_client(nursery, port)
        for i in range(50):
            await a.send(b.identity.node_id, packet(a.identity.node_id, i.to_bytes(2, "big"), size=500))
        await wait_until(lambda: relay.snapshot()["clients"][a.identity.prefix]["frames_in"] == 50, "50 in")
        snap = relay.snapshot()
        forwarded = snap["frames_forwarded"]
        # burst 5000 bytes / 533-byte frames: 9 pass at once (plus a refill of at most a few)
        assert 9 <= forwarded <= 20
        assert snap["rate_limited"] == 50 - forwarded
        assert snap["clients"][a.identity.prefix]["rate_limited"] == 50 - forwarded
        for _ in range(forwarded):
            assert isinstance(await next_frame(b), Recv)
        await trio.sleep(0.6)  # refill: 1200 bytes, two frames' worth
        after = packet(a.identity.node_id, b"after the pause")
        await a.send(b.identity.node_id, after)
        assert await next_frame(b) == Recv(a.identity.node_id, after)
        nursery.cancel_scope.cancel()


class FreezableProxy:
    """A TCP proxy that can stop passing bytes without closing: a path gone dead."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.frozen = False

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, down: trio.SocketStream) -> None:
        up = await trio.open_tcp_stream(HOST, self.target)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, down, up)
            nursery.start_soon(self._pump, up, down)

    async def _pump(self, src, dst) -> None:
        while data := await src.receive_some():
            if self.frozen:
                await trio.sleep_forever()
            await dst.send_all(data)


async def test_dead_client_is_dropped_and_an_idle_live_one_is_kept():
    config = RelayConfig(ping_interval=0.2, ping_timeout=0.3)
    patient = ClientConfig(ping_interval=60, backoff_initial=60)  # the client itself must not notice
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery, Relay(config))
        proxy = FreezableProxy(port)
        proxy_port = await nursery.start(proxy.serve)
        live = await start_client(nursery, port)
        doomed = await start_client(nursery, proxy_port, config=patient)
        await assert_exchange(live, doomed)
        proxy.frozen = True
        await wait_until(lambda: not relay.is_connected(doomed.identity.node_id), "dead client dropped")
        assert relay.dead == 1
        await trio.sleep(1.0)  # several ping intervals: the idle live client answers its pings
        assert relay.is_connected(live.identity.node_id)
        await live.send(doomed.identity.node_id, packet(live.identity.node_id, b"still there?"))
        assert await next_frame(live) == PeerNotHere(doomed.identity.node_id)
        nursery.cancel_scope.cancel()


async def test_client_notices_a_dead_relay_by_its_pings():
    config = ClientConfig(ping_interval=0.2, ping_timeout=0.3, backoff_initial=60)
    async with trio.open_nursery() as nursery:
        _, port, _ = await start_relay(nursery)
        proxy = FreezableProxy(port)
        proxy_port = await nursery.start(proxy.serve)
        client = await start_client(nursery, proxy_port, config=config)
        proxy.frozen = True
        await wait_until(lambda: not client.connected, "client drops the dead relay")
        assert client.counters["ping_timeouts"] == 1
        assert f"ws://{HOST}:{proxy_port}" in client.last_error and "pong" in client.last_error
        with pytest.raises(RelayNotConnected, match=f"ws://{HOST}:{proxy_port}"):
            await client.send(Identity.generate().node_id, b"x")
        nursery.cancel_scope.cancel()


async def test_second_connection_replaces_the_first_which_is_told():
    me = Identity.generate()
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery)
        peer = await start_client(nursery, port)
        first = await start_client(nursery, port, identity=me)
        second = await start_client(nursery, port, identity=me)
        assert await next_frame(first) == Replaced()
        await wait_until(lambda: first.state == "replaced", "first client gives up")
        assert "replaced by a newer connection" in first.last_error
        assert not first.connected
        await assert_exchange(peer, second)
        await trio.sleep(0.3)  # the first one does not come back to fight for the id
        assert relay.replaced == 1 and relay.accepted == 3
        nursery.cancel_scope.cancel()


# --- STUN ---


async def test_stun_binding_returns_our_reflexive_address():
    async with trio.open_nursery() as nursery:
        _, port, relay = await start_relay(nursery)
        with trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM) as sock:
            await sock.bind((HOST, 0))
            await sock.sendto(b"not stun at all", (HOST, port))
            with trio.fail_after(WAIT):
                mapped = await stun_query(HOST, port, timeout=5, sock=sock)
            assert mapped == (HOST, sock.getsockname()[1])
        with trio.fail_after(WAIT):
            ip, _ = await stun_query(HOST, port, timeout=5)
        assert ip == HOST
        assert relay.stun_answered == 2
        assert relay.stun_ignored == 1
        nursery.cancel_scope.cancel()


# --- restarts and binding ---


async def test_relay_restart_on_the_same_port_clients_reconnect_on_their_own():
    async with trio.open_nursery() as nursery:
        first, port, _ = await start_relay(nursery)
        # First retry after 0.15-0.3 s: time to read why the connection ended before a retry overwrites it.
        config = ClientConfig(backoff_initial=0.3, backoff_max=0.5)
        a = await start_client(nursery, port, config=config)
        b = await start_client(nursery, port, config=config)
        await assert_exchange(a, b, b"first life")
        await first.kill()
        await wait_until(lambda: not a.connected and not b.connected, "clients see the relay go")
        assert f"relay ws://{HOST}:{port} closed the connection (1001 relay shutting down)" == a.last_error
        with pytest.raises(RelayNotConnected):
            await a.send(b.identity.node_id, b"into the void")
        _, again, relay = await start_relay(nursery, port=port)
        assert again == port
        with trio.fail_after(WAIT):
            await a.wait_connected()
            await b.wait_connected()
        await assert_exchange(a, b, b"second life")
        assert a.counters["connects"] == 2 and b.counters["connects"] == 2
        assert relay.snapshot()["clients_connected"] == 2
        nursery.cancel_scope.cancel()


async def test_busy_port_is_a_bind_error_naming_the_address():
    async with trio.open_nursery() as nursery:
        _, port, _ = await start_relay(nursery)
        with pytest.raises(RelayBindError, match=f"{HOST}:{port}.*in use"):
            await serve_relay(HOST, port)
        nursery.cancel_scope.cancel()


async def test_client_without_relay_reports_the_url_and_keeps_trying():
    with trio.socket.socket() as s:  # a port nobody listens on
        await s.bind((HOST, 0))
        port = s.getsockname()[1]
    async with trio.open_nursery() as nursery:
        client = RelayClient(f"ws://{HOST}:{port}", Identity.generate(), config=FAST)
        with trio.fail_after(WAIT):
            await nursery.start(client.run)
        assert not client.connected
        assert f"ws://{HOST}:{port}" in client.last_error
        await wait_until(lambda: client.counters["attempts"] >= 3, "retries")
        nursery.cancel_scope.cancel()


# --- the command ---

BOOT_RE = re.compile(r"^meshd relay url=ws://127\.0\.0\.1:(?P<port>\d+) stun=127\.0\.0\.1:(?P=port)/udp$")


def _relay_process(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshd", "relay", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)


@pytest.mark.processes
def test_relay_command_prints_its_url_refuses_a_busy_port_and_exits_zero_on_sigterm():
    proc = _relay_process("--bind", "127.0.0.1:0")
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "no boot line within 20s"
        boot = BOOT_RE.match(proc.stdout.readline().strip())
        assert boot, "boot line does not match the contract"
        busy = subprocess.run([sys.executable, "-m", "meshd", "relay", "--bind", f"127.0.0.1:{boot['port']}"],
                              capture_output=True, text=True, timeout=20)
        assert busy.returncode == 2
        assert busy.stderr.strip().splitlines() == [
            f"meshd: error: cannot bind relay on 127.0.0.1:{boot['port']}: address already in use"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- codecs: untrusted bytes raise only their own error type ---

FUZZ = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=200) | st.sampled_from(sorted(protocol.FRAME_TYPES)).flatmap(
    lambda tag: st.binary(max_size=120).map(lambda rest: bytes([tag]) + rest)))
def test_random_bytes_to_the_frame_decoder_raise_only_relay_protocol_error(data):
    try:
        frame = protocol.decode(data)
    except protocol.RelayProtocolError:
        return
    assert frame.encode() == data


@FUZZ
@given(st.binary(max_size=120))
def test_random_bytes_to_the_stun_responder_raise_only_stun_error(data):
    try:
        stun.binding_response(data, (HOST, 1234))
    except stun.StunError:
        pass


def test_stun_codec_round_trip():
    txid, request = stun.binding_request()
    response = stun.binding_response(request, ("203.0.113.7", 40000))
    assert stun.parse_binding_response(response, txid) == ("203.0.113.7", 40000)
    with pytest.raises(stun.StunError):
        stun.parse_binding_response(response, os.urandom(12))
