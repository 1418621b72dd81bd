"""Attacks a stranger can make without any key, against real nodes on loopback.

One mesh (a relay, an orchestrator, two stages; one ``meshd run`` process
each) takes every attack in turn.  After each one the processes must be
alive, every member alive at every node, every name resolving, and memory
flat: nothing a stranger sends may crash a node, grow its memory without
bound, or make it attack somebody else.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd import keyring, wire
from meshd.identity import Identity
from meshd.launch.process import MeshProcess
from meshd.net.amplification import AmplificationGuard
from meshd.net.data_keys import SEAL_OVERHEAD
from meshd.relay.client import RelayClient
from meshd.swim.facts import accusation_data, alive_data, claim_data, paths_data
from meshd.testing.processes import start_mesh, wait_converged
from meshd.testing.stranger import (
    chunk_frame,
    open_data_stream,
    raw_packet,
    relay_data,
    rss_bytes,
    send_udp,
    snapshot_counter,
)

pytestmark = pytest.mark.processes

U64_MAX = 2**64 - 1
BIG = 64 * 1024 * 1024
MiB = 1024 * 1024


class Mesh:
    def __init__(self, relay: MeshProcess, procs: list[MeshProcess]) -> None:
        self.relay = relay
        self.procs = procs
        self.relay_url = relay.wait_for(lambda s: s.startswith("meshd relay url="), 10, "relay url"
                                        ).split()[2].split("=", 1)[1]
        self.urls = {}
        for p in procs:
            line = p.wait_for(lambda s: s.startswith("meshd dashboard url="), 15, "dashboard url")
            self.urls[p.name] = line.split()[2].split("=", 1)[1]
        self.by_name = {p.name: p for p in procs}

    def id(self, name: str) -> bytes:
        return bytes.fromhex(self.by_name[name].boot.id)

    def addr(self, name: str) -> str:
        return self.by_name[name].boot.addr

    def get(self, name: str, path: str) -> dict:
        return httpx.get(self.urls[name] + path, timeout=5).json()

    def snapshot(self, name: str) -> dict:
        return self.get(name, "/api/snapshot")

    def assert_unharmed(self) -> None:
        """Every process alive; every node sees every member alive and every name resolving."""
        for p in [self.relay, *self.procs]:
            assert p.proc.poll() is None, f"{p.name} exited ({p.proc.returncode}): {p.lines[-8:]}"
        ids = {p.boot.id for p in self.procs}
        for p in self.procs:
            snap = self.snapshot(p.name)
            states = {m["id"]: m["state"] for m in snap["members"]}
            others = ids - {p.boot.id}
            assert {i: states.get(i) for i in others} == {i: "alive" for i in others}, (p.name, states)
            names = snap["names"]
            for name in ("pp-orchestrator", "pp-entry", "pp-stage-0", "pp-stage-1", "pp-exit"):
                assert names.get(name, {}).get("resolves"), (p.name, name, names.get(name))


@contextlib.contextmanager
def _settled_mesh(make: Callable[[MeshProcess, list[MeshProcess]], Mesh], key_args: list[str]
                  ) -> Iterator[Mesh]:
    """A relay, an orchestrator and two stages (``key_args`` for each), names resolving
    everywhere; ``make`` wraps them.  Everything stops on the way out."""
    relay = MeshProcess("relay", ["relay", "--bind", "127.0.0.1:0", *key_args])
    procs: list[MeshProcess] = []
    try:
        url = relay.wait_for(lambda s: s.startswith("meshd relay url="), 10, "relay url").split()[2][4:]
        procs = start_mesh(2, extra=["--relay", url, "--dashboard", "127.0.0.1:0", *key_args])
        wait_converged(procs)
        m = make(relay, procs)
        _wait(lambda: _settled(m), 20, "names resolving everywhere")
        yield m
    finally:
        for p in procs:
            p.stop(timeout=3)
        relay.stop(timeout=3)


@pytest.fixture(scope="module")
def mesh():
    with _settled_mesh(Mesh, []) as m:
        yield m


def _settled(m: Mesh) -> bool:
    try:
        m.assert_unharmed()
    except AssertionError:
        return False
    return True


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g}s")
        time.sleep(0.2)


def _stranger() -> bytes:
    return os.urandom(32)


def _settle_and_check(mesh: Mesh, seconds: float = 1.5) -> None:
    time.sleep(seconds)
    mesh.assert_unharmed()


# --- one datagram with a number the node cannot answer ---


def _poisoned(mesh: Mesh, target: str) -> list[bytes]:
    """Each forged fact that made a node refute (or bury) at 2^64 and die."""
    victim, other = mesh.id(target), mesh.id("orchestrator" if target != "orchestrator" else "stage-0")
    third = mesh.id("stage-1" if target != "stage-1" else "stage-0")
    meta = ["stage", 1, 2, [], None, "", U64_MAX, U64_MAX, "", False, b"", []]
    sig = b"s" * 64
    return [
        raw_packet(_stranger(), (wire.Suspect.TAG, [U64_MAX, victim, other, sig])),
        raw_packet(_stranger(), (wire.NameClaim.TAG, ["pp-stage-1", mesh.id("stage-1"), U64_MAX, True, sig])),
        raw_packet(_stranger(), (wire.Dead.TAG, [U64_MAX, third, other, sig])),
        raw_packet(_stranger(), (wire.Alive.TAG, [U64_MAX, victim, "127.0.0.1:1", meta, sig])),
        raw_packet(other, (wire.Alive.TAG, [1, third, "127.0.0.1:1", meta, sig])),
        raw_packet(_stranger(), (wire.PathSummary.TAG, [victim, U64_MAX, [], sig])),
    ]


def test_a_forged_datagram_with_an_unanswerable_number_changes_nothing(mesh):
    before = {p.name: snapshot_counter(mesh.snapshot(p.name), "rx_bad_packet") for p in mesh.procs}
    for p in mesh.procs:
        for data in _poisoned(mesh, p.name):
            send_udp(p.boot.addr, data)
    _settle_and_check(mesh)
    for p in mesh.procs:
        refused = snapshot_counter(mesh.snapshot(p.name), "rx_bad_packet") - before[p.name]
        assert refused >= len(_poisoned(mesh, p.name)), (p.name, refused)


async def test_the_same_datagrams_through_the_relay_change_nothing(mesh):
    attacker = Identity.generate()
    client = RelayClient(mesh.relay_url, attacker)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            for p in mesh.procs:
                for data in _poisoned(mesh, p.name):
                    # The relay forwards only packets in the connection's own name.
                    sender_at = data.index(b"\xc4\x20") + 2
                    await client.send(mesh.id(p.name), data[:sender_at] + attacker.node_id
                                      + data[sender_at + 32:])
            await trio.sleep(1.5)
            nursery.cancel_scope.cancel()
    mesh.assert_unharmed()


# --- the topology in somebody else's name ---


def test_a_path_summary_forged_for_the_orchestrator_is_never_shown(mesh):
    orch, stage1 = mesh.id("orchestrator"), mesh.id("stage-1")
    forged_entry = [stage1, "none", 0, 99, "forged by a stranger", 0, "", False]
    stranger = Identity.generate()
    before = snapshot_counter(mesh.snapshot("stage-0"), "rx_bad_signature")
    # At 2^64-1 it is refused outright; at 2^62, unsigned or signed by somebody else, too.
    for sender, version, sig in ((_stranger(), U64_MAX, b""), (stage1, 2**62, b""),
                                 (stranger.node_id, 2**62, stranger.sign(b"anything"))):
        forged = raw_packet(sender, (wire.PathSummary.TAG, [orch, version, [forged_entry], sig]))
        send_udp(mesh.addr("stage-0"), forged)
    time.sleep(1.0)
    topo = mesh.get("stage-0", "/api/topology")
    assert "forged" not in str(topo)
    assert snapshot_counter(mesh.snapshot("stage-0"), "rx_bad_signature") - before == 2
    mesh.assert_unharmed()


# --- data-channel memory ---


def _unfinished(sender: bytes, session: int, count: int) -> list[wire.DataChunk]:
    return [wire.DataChunk(session, msg_id, BIG, 0, b"x") for msg_id in range(1, count + 1)]


async def _unfinished_direct(mesh: Mesh, target: MeshProcess) -> None:
    for session in range(1, 11):  # a fresh key and sessions at will
        stranger = Identity.generate()
        stream, proof = await open_data_stream(target.boot.addr, stranger)
        assert proof is not None, "a stranger's own key passes the stream handshake"
        async with stream:
            for chunk in _unfinished(stranger.node_id, session, 2):
                try:
                    await stream.send_all(chunk_frame(stranger.node_id, chunk))
                except trio.BrokenResourceError:
                    break  # refused: the node dropped the stream
            await trio.sleep(0.1)


async def _unfinished_relayed(mesh: Mesh, target: MeshProcess) -> None:
    for round_ in range(4):
        stranger = Identity.generate()
        client = RelayClient(mesh.relay_url, stranger)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            for chunk in _unfinished(stranger.node_id, round_ + 1, 5):
                await client.send(mesh.id(target.name), relay_data(stranger.node_id, chunk))
            await trio.sleep(0.3)
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("target, attack", [("stage-1", _unfinished_direct),
                                            ("stage-0", _unfinished_relayed)], ids=["direct", "relayed"])
async def test_20_unfinished_64_mib_messages_leave_memory_flat(mesh, target, attack):
    victim = mesh.by_name[target]
    start = rss_bytes(victim.proc.pid)
    with trio.fail_after(30):
        await attack(mesh, victim)
    await trio.sleep(1.0)
    grown = rss_bytes(victim.proc.pid) - start
    print(f"{target} RSS {start / MiB:.1f} MiB -> +{grown / MiB:.1f} MiB after 20 unfinished 64 MiB messages "
          f"({attack.__name__})")
    assert grown < 20 * MiB
    mesh.assert_unharmed()


async def test_whole_messages_behind_a_withheld_first_one_are_held_to_the_peer_budget(mesh):
    from meshd.net.reassembly import PEER_BUDGET

    target = mesh.by_name["orchestrator"]
    start = rss_bytes(target.proc.pid)
    refused_before = mesh.snapshot("orchestrator")["data"]["bad_frames"]
    stranger = Identity.generate()
    payload = os.urandom(wire.MAX_CHUNK_BYTES - SEAL_OVERHEAD)  # sealed, it fills a whole chunk
    sent = 0
    with trio.fail_after(60):
        stream, _ = await open_data_stream(target.boot.addr, stranger)
        async with stream:
            try:
                for msg_id in range(2, 400):  # message 1 never comes: 400 MiB if all were held
                    chunk = wire.DataChunk(7, msg_id, len(payload), 0, payload)
                    await stream.send_all(chunk_frame(stranger.node_id, chunk))
                    sent += len(payload)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # refused once over budget: the node drops the stream
    await trio.sleep(1.0)
    grown = rss_bytes(target.proc.pid) - start
    print(f"orchestrator RSS +{grown / MiB:.1f} MiB after {sent / MiB:.0f} MiB sent behind a withheld one")
    refused = mesh.snapshot("orchestrator")["data"]["bad_frames"] - refused_before
    assert refused >= 398 - PEER_BUDGET // len(payload), "past its budget, every message is refused"
    assert grown < PEER_BUDGET + 32 * MiB
    mesh.assert_unharmed()


# --- reflection: no node may be turned against a third party ---


def _listening_victim() -> socket.socket:
    victim = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    victim.bind(("127.0.0.1", 0))
    victim.settimeout(0.2)
    return victim


def _datagrams(sock: socket.socket, seconds: float) -> list[bytes]:
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            got.append(sock.recv(65536))
        except TimeoutError:
            pass
    return got


def _bytes_received(sock: socket.socket, seconds: float) -> int:
    return sum(map(len, _datagrams(sock, seconds)))


def _bare_probe(data: bytes) -> bool:
    try:
        messages = wire.decode(data).messages
    except wire.WireError:
        return False
    return len(messages) == 1 and isinstance(messages[0], wire.Ping | wire.Ack | wire.Nack)


def test_a_strangers_push_pull_gets_no_member_list_back(mesh):
    with _listening_victim() as asker:
        request = raw_packet(_stranger(), (wire.PushPull.TAG, [True, True, [], []]))
        assert len(request) < 50
        for p in mesh.procs:
            asker.sendto(request, ("127.0.0.1", int(p.boot.addr.rpartition(":")[2])))
        assert _bytes_received(asker, 1.5) == 0
    mesh.assert_unharmed()


def test_a_strangers_ping_req_makes_no_node_probe_another_address(mesh):
    with _listening_victim() as victim:
        victim_addr = f"127.0.0.1:{victim.getsockname()[1]}"
        for p in mesh.procs:
            for target in (mesh.id("stage-1"), _stranger()):
                forged = raw_packet(_stranger(), (wire.PingReq.TAG, [1, target, victim_addr, True]))
                send_udp(p.boot.addr, forged)
            # Even in a member's name: that member is not at the address it names.
            send_udp(p.boot.addr, raw_packet(mesh.id("stage-0"),
                                             (wire.PingReq.TAG, [2, mesh.id("stage-1"), victim_addr, False])))
        assert _bytes_received(victim, 1.5) == 0
    mesh.assert_unharmed()


def test_a_fake_member_at_a_third_partys_address_draws_little_traffic_there(mesh):
    """A stranger names a victim's address as its own and keeps that 'member' alive; every
    node would probe the address (with gossip piggybacked) for as long as it does."""
    guard = AmplificationGuard()
    seconds = 10.0
    with _listening_victim() as victim:
        victim_addr = f"127.0.0.1:{victim.getsockname()[1]}"
        key = Identity.generate()  # a member of its own making: it signs its own facts
        fake = key.node_id
        meta = wire.Meta(stage=7, stages=9, addrs=(victim_addr,))

        def signed(incarnation: int) -> bytes:
            return key.sign(alive_data(fake, incarnation, victim_addr, meta))

        entry = [fake, victim_addr, 0, wire.STATE_ALIVE, meta.to_body(), signed(0)]
        for p in mesh.procs:
            send_udp(p.boot.addr, raw_packet(fake, (wire.PushPull.TAG, [True, False, [entry], []])))
        got: list[bytes] = []
        start = time.monotonic()
        for incarnation in range(1, int(seconds) + 1):
            got += _datagrams(victim, 1.0)
            for p in mesh.procs:  # refute whatever suspicion the silence raised
                body = [incarnation, fake, victim_addr, meta.to_body(), signed(incarnation)]
                send_udp(p.boot.addr, raw_packet(fake, (wire.Alive.TAG, body)))
        elapsed = time.monotonic() - start
    # The stranger's packets came from its own address: the victim's earned nothing.  Bare
    # probes (a ping alone) always go, at the protocol's own rate; the rest is budgeted.
    probes = [d for d in got if _bare_probe(d)]
    budgeted = sum(len(d) for d in got if not _bare_probe(d))
    bound = len(mesh.procs) * (guard.allowance + guard.refill_per_s * elapsed)
    limited = sum(snapshot_counter(mesh.snapshot(p.name), "tx_amplification_limited")
                  + snapshot_counter(mesh.snapshot(p.name), "tx_cut_for_unproven") for p in mesh.procs)
    print(f"fake member at a third party, {elapsed:.1f} s: {budgeted} B beyond {len(probes)} bare probes "
          f"({sum(map(len, probes))} B) reached it (bound {bound:.0f} B); {limited} packets cut or held back")
    assert budgeted <= bound
    assert limited > 0, "the mesh kept probing the address: the guard must have held some of it back"
    mesh.assert_unharmed()


# --- a fuzz of well-formed messages with extreme values ---

# Only values msgpack can carry: anything larger cannot be sent by anybody.
EXTREME = st.sampled_from([wire.COUNTER_MAX + 1, 2**63, U64_MAX, -1, -(2**63)])
ANY_INT = EXTREME | st.sampled_from([0, 1, 2**32, wire.COUNTER_MAX])
TEXT = st.sampled_from(["", "pp-entry", "x" * 512, "x" * 513, "\u0000", "\ufffd" * 100])


def _fuzz_messages(ids: list[bytes]):
    node = st.sampled_from(ids) | st.binary(min_size=32, max_size=32)
    sig = st.binary(max_size=65)
    meta = st.tuples(TEXT, ANY_INT | st.none(), ANY_INT | st.none(), st.lists(TEXT, max_size=9),
                     TEXT | st.none(), TEXT, ANY_INT, ANY_INT, TEXT, st.booleans(), st.binary(max_size=33),
                     st.lists(TEXT, max_size=9)).map(list)
    member = st.tuples(node, TEXT, EXTREME, st.sampled_from([0, 1, 2, 3, 4, -1]), meta, sig).map(list)
    return st.one_of(
        st.tuples(st.just(wire.Alive.TAG), st.tuples(EXTREME, node, TEXT, meta, sig).map(list)),
        st.tuples(st.just(wire.Suspect.TAG), st.tuples(EXTREME, node, node, sig).map(list)),
        st.tuples(st.just(wire.Dead.TAG), st.tuples(EXTREME, node, node, sig).map(list)),
        st.tuples(st.just(wire.NameClaim.TAG), st.tuples(TEXT, node, EXTREME, st.booleans(), sig).map(list)),
        st.tuples(st.just(wire.PathSummary.TAG), st.tuples(node, EXTREME, st.just([]), sig).map(list)),
        st.tuples(st.just(wire.PushPull.TAG),
                  st.tuples(st.booleans(), st.booleans(), st.lists(member, min_size=1, max_size=3),
                            st.just([])).map(list)),
        st.tuples(st.just(wire.Ping.TAG), st.tuples(EXTREME, node).map(list)),
        st.tuples(st.just(wire.DataChunk.TAG), st.tuples(ANY_INT, EXTREME, ANY_INT, ANY_INT,
                                                         st.binary(max_size=8), st.booleans()).map(list)),
    )


def test_a_fuzz_of_messages_with_extreme_values_changes_nothing(mesh):
    ids = [mesh.id(p.name) for p in mesh.procs]
    targets = [p.boot.addr for p in mesh.procs]
    sent = []

    @settings(max_examples=300, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.sampled_from(ids) | st.binary(min_size=32, max_size=32),
           st.lists(_fuzz_messages(ids), min_size=1, max_size=4), st.sampled_from(targets))
    def fire(sender, messages, addr):
        try:
            data = raw_packet(sender, *messages)
        except (OverflowError, ValueError):
            return  # msgpack itself cannot carry it: nobody can send it
        send_udp(addr, data)
        sent.append(len(data))

    fire()
    assert len(sent) > 100
    _settle_and_check(mesh, 2.0)


# --- a member that holds the mesh key, but not the victim's node key ---
#
# The trust boundary (README, "Security"): whoever holds the mesh key may join and serve a
# stage; nobody may speak for another member.  Each attack runs against a mesh without a
# mesh key (where anyone is such a member) and against one with a key, which Mallory holds.


class Members(Mesh):
    """A mesh with or without a mesh key, and Mallory: a member's key pair of her own."""

    def __init__(self, relay: MeshProcess, procs: list[MeshProcess], ring: keyring.Keyring | None) -> None:
        super().__init__(relay, procs)
        self.ring = ring
        self.mallory = Identity.generate()

    def send(self, name: str, sender: bytes, *messages: wire.Message) -> None:
        """``messages`` in a packet from ``sender`` to ``name``, sealed with the mesh key if any."""
        data = wire.encode(wire.Packet(sender, messages))
        send_udp(self.addr(name), self.ring.seal(data) if self.ring is not None else data)

    def to_all(self, sender: bytes, *messages: wire.Message) -> None:
        for p in self.procs:
            if p.boot.id != sender.hex():
                self.send(p.name, sender, *messages)

    def counter(self, name: str) -> int:
        return sum(snapshot_counter(self.snapshot(p.name), name) for p in self.procs)

    def member(self, at: str, of: str) -> dict:
        (m,) = [m for m in self.snapshot(at)["members"] if m["id"] == self.id(of).hex()]
        return m


@pytest.fixture(scope="module", params=["no mesh key", "mesh key"])
def members(request, tmp_path_factory):
    ring, key_args = None, []
    if request.param == "mesh key":
        path = tmp_path_factory.mktemp("mesh") / "mesh.key"
        ring = keyring.generate_file(path)
        key_args = ["--mesh-key-file", str(path)]
    with _settled_mesh(lambda relay, procs: Members(relay, procs, ring), key_args) as m:
        yield m


def test_a_member_cannot_make_another_leave(members):
    m, victim = members, members.id("stage-1")
    before = m.counter("rx_bad_signature")
    # Low ones are older than the victim's incarnation (a node counts from its clock) and go
    # unread; one past it must be checked, and fails.
    for inc in (0, 1, 2, 3, 2**40, 2**62):
        forged = m.mallory.sign(accusation_data("dead", victim, inc, victim))
        m.to_all(m.mallory.node_id, wire.Dead(inc, victim, victim, forged))
        left = wire.MemberState(victim, m.addr("stage-1"), inc, wire.STATE_LEFT, wire.Meta(), forged)
        m.to_all(m.mallory.node_id, wire.PushPull(False, False, (left,), ()))
    _settle_and_check(m)
    assert m.counter("rx_bad_signature") > before
    assert not any("member left" in line for p in m.procs for line in p.lines)


def test_a_member_cannot_declare_a_death_in_the_orchestrators_name(members):
    m, victim, orch = members, members.id("stage-1"), members.id("orchestrator")
    current = m.member("stage-0", "stage-1")["incarnation"]  # the one accusation that is read
    before = m.counter("rx_bad_signature")
    for inc in (0, 1, 2, 2**40, current, 2**62):
        forged = m.mallory.sign(accusation_data("dead", victim, inc, orch))
        m.to_all(orch, wire.Dead(inc, victim, orch, forged))
        forged = m.mallory.sign(accusation_data("suspect", victim, inc, orch))
        m.to_all(orch, wire.Suspect(inc, victim, orch, forged))
    _settle_and_check(m)
    assert m.counter("rx_bad_signature") > before
    # On a loaded host the orchestrator may suspect a slow member for real (at the member's
    # own incarnation, and refuted); a death in its name, or any word at a forged number, is
    # the forgery taken.
    lines = [line.split() for p in m.procs for line in p.lines
             if line.startswith("meshd member") and f"by={orch.hex()[:8]}" in line
             and f"prefix={victim.hex()[:8]}" in line]
    assert [w for w in lines if w[2] != "suspect" or f"incarnation={current}" not in w] == []


def test_a_member_cannot_move_another_or_rewrite_its_metadata(members):
    m, victim = members, members.id("stage-1")
    meta = wire.Meta(role="stage", stage=0, stages=2)  # "stage-1 is stage 0 now"
    for inc in (1, 2, 3, 2**40):
        forged = m.mallory.sign(alive_data(victim, inc, "127.0.0.1:9", meta))
        m.to_all(m.mallory.node_id, wire.Alive(inc, victim, "127.0.0.1:9", meta, forged))
    _settle_and_check(m)
    for p in m.procs:
        if p.name != "stage-1":
            seen = m.member(p.name, "stage-1")
            assert seen["addr"] == m.addr("stage-1"), (p.name, seen)


def test_a_member_cannot_take_or_bury_another_members_names(members):
    m, victim = members, members.id("stage-1")
    for clock in (1, 100, 2**40):
        for tomb in (True, False):
            claim = wire.NameClaim("pp-stage-1", victim, clock, tomb)
            m.to_all(m.mallory.node_id, wire.NameClaim("pp-stage-1", victim, clock, tomb,
                                                       m.mallory.sign(claim_data(claim))))
    _settle_and_check(m)
    for p in m.procs:
        owners = m.snapshot(p.name)["names"]["pp-stage-1"]
        assert owners.get("resolves"), (p.name, owners)


def test_a_member_cannot_replace_another_members_path_summary(members):
    m, orch, stage1 = members, members.id("orchestrator"), members.id("stage-1")
    forged = wire.PathSummary(orch, 2**62, (wire.PathEntry(stage1, "none", 0, 99, "forged by mallory", 0),))
    m.send("stage-0", m.mallory.node_id, replace(forged, sig=m.mallory.sign(paths_data(forged))))
    time.sleep(1.0)
    assert "forged" not in str(m.get("stage-0", "/api/topology"))
    m.assert_unharmed()


def test_accusations_by_somebody_who_never_joined_make_nobody_suspect(members):
    m, victim = members, members.id("stage-1")
    before = m.counter("suspicions")
    for _ in range(5):  # five "independent" accusers, each with a valid signature of its own
        accuser = Identity.generate()
        sig = accuser.sign(accusation_data("suspect", victim, 0, accuser.node_id))
        m.to_all(accuser.node_id, wire.Suspect(0, victim, accuser.node_id, sig))
    _settle_and_check(m)
    assert m.counter("suspicions") == before


def test_allow_nodes_keeps_a_stage_for_the_listed_nodes(tmp_path):
    """A member outside --allow-nodes joins, claims stage 1, and serves nothing."""
    keys = {name: Identity.generate() for name in ("stage-0", "stage-1", "outsider")}
    for name, key in keys.items():
        (tmp_path / f"{name}.key").write_bytes(key.to_pem())
    allow = tmp_path / "allow.txt"
    listed = "".join(f"{keys[n].node_id.hex()}\n" for n in ("stage-0", "stage-1"))
    allow.write_text("# the run's stages\n" + listed)

    def flags(k: int, _addrs: list[str]) -> list[str]:
        return ["--key-file", str(tmp_path / f"stage-{k}.key")]

    procs = start_mesh(2, extra=["--allow-nodes", str(allow), "--dashboard", "127.0.0.1:0", "--stub"],
                       stage_extra=flags)
    try:
        wait_converged(procs)
        outsider = MeshProcess("outsider", [
            "run", "--role", "stage", "--stage", "1", "--stages", "2", "--stub", "--profile", "local",
            "--bind", "127.0.0.1:0", "--seed", procs[0].boot.addr,
            "--key-file", str(tmp_path / "outsider.key")])
        procs.append(outsider)
        outsider.wait_boot()
        urls = {p.name: p.wait_for(lambda s: s.startswith("meshd dashboard url="), 15, "dashboard url"
                                   ).split()[2].split("=", 1)[1] for p in procs[:3]}
        real = keys["stage-1"].node_id.hex()[:8]
        deadline = time.monotonic() + 20
        while True:  # the outsider has joined everywhere, and its claim reached the orchestrator
            snaps = {n: httpx.get(u + "/api/snapshot", timeout=5).json() for n, u in urls.items()}
            joined = all(any(m["id"] == outsider.boot.id and m["state"] == "alive" for m in s["members"])
                         for s in snaps.values())
            if joined and snapshot_counter(snaps["orchestrator"], "rx_names_refused") > 0:
                break
            assert time.monotonic() < deadline, "the outsider never joined, or its claim never arrived"
            time.sleep(0.3)
        for name, snap in snaps.items():
            entry = snap["names"]["pp-stage-1"]
            assert [e["owner"] for e in entry["entries"]] == [real] and entry["live"] == [real], (name, entry)
        for _ in range(5):
            r = httpx.post(urls["orchestrator"] + "/api/generate", json={"prompt": "hi", "max_tokens": 4},
                           timeout=30)
            assert r.status_code == 200, r.text
        # The outsider is flagged, not only ignored: peers marks it, doctor names it and its id.
        listed = httpx.get(urls["orchestrator"] + "/api/peers", timeout=5).json()["peers"]
        assert {p["id"]: p["allowed"] for p in listed}[outsider.boot.id] is False
        doctor = subprocess.run([sys.executable, "-m", "meshd", "doctor", urls["orchestrator"]],
                                capture_output=True, text=True, timeout=30)
        said = " ".join(doctor.stdout.split())
        assert doctor.returncode != 0 and "is not in our --allow-nodes list" in said, doctor.stdout
        assert outsider.boot.id in said.replace(" ", ""), doctor.stdout
    finally:
        for p in procs:
            p.stop(timeout=3)
