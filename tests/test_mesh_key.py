"""The mesh key: what it seals and opens, and a keyed mesh in one trio run.

The keyring's own rules (a packet opens with any key held, never after a
byte changed, rotation in the order install, use, remove), the relay's Auth
frame with its proofs, and then real nodes on loopback: a keyed mesh
converges; a node with another key or none is never taken in, and what it
sends is counted and dropped unread; a rotation applied at one node reaches
every member with no false suspicion; a relay with the key admits members
only and reads its file again when it changes.
"""

from __future__ import annotations

import os
import stat
from functools import partial

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket

from meshd import keyring, wire
from meshd.identity import Identity
from meshd.keyring import Keyring, KeyringError, generate_key, key_id
from meshd.node import NodeOptions
from meshd.relay import protocol
from meshd.relay.client import ClientConfig, RelayClient
from meshd.relay.server import Relay, serve_relay
from meshd.testing.inprocess import Running, start_node, wait_converged

# --- the keyring ---


def test_a_sealed_packet_opens_with_the_key_and_costs_the_stated_overhead():
    ring = Keyring([generate_key()])
    data = os.urandom(300)
    sealed = ring.seal(data)
    assert len(sealed) == len(data) + keyring.SEAL_OVERHEAD
    assert data not in sealed, "the payload travels encrypted"
    assert ring.open(sealed) == data
    assert ring.seal(data) != sealed, "a fresh nonce per packet"


def test_a_packet_sealed_with_a_key_we_do_not_hold_does_not_open():
    ours, theirs = Keyring([generate_key()]), Keyring([generate_key()])
    assert ours.open(theirs.seal(b"hello")) is None
    assert ours.open(b"") is None and ours.open(b"\x93\x07") is None  # an unsealed msgpack packet
    assert ours.open(keyring.MAGIC + b"\0" * 40) is None


def test_a_sealed_packet_with_any_byte_changed_does_not_open():
    ring = Keyring([generate_key()])
    sealed = ring.seal(b"x" * 64)
    for i in range(len(sealed)):
        tampered = bytearray(sealed)
        tampered[i] ^= 0x01
        assert ring.open(bytes(tampered)) is None, f"byte {i} changed and it still opened"
    assert ring.open(sealed[:-1]) is None and ring.open(sealed + b"\0") is None


def test_rotation_in_order_keeps_every_packet_opening_and_ends_with_the_new_key_only():
    old, new = generate_key(), generate_key()
    a, b = Keyring([old]), Keyring([old])
    new_id, old_id = key_id(new), key_id(old)
    for ring in (a, b):  # install: every member opens with both, still seals with the old one
        assert ring.apply("install", new_id, new)
        assert ring.primary_id == old_id
    assert b.open(a.seal(b"1")) == b"1"
    assert a.apply("use", new_id)  # a seals with the new key; b (not there yet) still opens it
    assert b.open(a.seal(b"2")) == b"2" and a.open(b.seal(b"3")) == b"3"
    assert b.apply("use", new_id)
    for ring in (a, b):
        assert ring.apply("remove", old_id)
        assert ring.ids == [new_id]
    assert a.open(Keyring([old]).seal(b"4")) is None, "the old key no longer opens anything"
    assert not a.apply("install", new_id, new) and not a.apply("use", new_id)
    assert not a.apply("remove", old_id), "a step done already changes nothing"


def test_the_key_that_seals_cannot_be_removed_and_a_key_not_held_cannot_be_used():
    ring = Keyring([generate_key()])
    with pytest.raises(KeyringError, match="the one in use"):
        ring.apply("remove", ring.primary_id)
    with pytest.raises(KeyringError, match="no key 0badc0de"):
        ring.apply("use", "0badc0de")
    key = generate_key()
    with pytest.raises(KeyringError, match="is not key"):
        ring.apply("install", "0badc0de", key)


def test_a_key_names_itself_by_id_for_use_and_remove_and_travels_only_for_install():
    key = generate_key()
    text, kid = keyring.encode_key(key), key_id(key)
    assert keyring.parse_change("install", text) == (kid, key)
    assert keyring.parse_change("use", text) == (kid, b"")
    assert keyring.parse_change("remove", kid) == (kid, b"")
    with pytest.raises(KeyringError, match="a mesh key is 32 bytes"):
        keyring.parse_change("install", kid)
    with pytest.raises(KeyringError, match="not a key id"):
        keyring.parse_change("use", "nope")


def test_a_key_file_is_0600_comes_back_as_saved_and_is_never_overwritten(tmp_path):
    path = tmp_path / "mesh.key"
    ring = keyring.generate_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    ring.install(generate_key())
    ring.save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keyring.load(path).ids == ring.ids
    with pytest.raises(KeyringError, match="will not overwrite"):
        keyring.generate_file(path)
    (tmp_path / "bad.key").write_text("not a key\n")
    with pytest.raises(KeyringError, match="bad.key line 1"):
        keyring.load(tmp_path / "bad.key")


def test_a_proof_checks_under_any_key_held_and_never_for_other_data():
    old, new = generate_key(), generate_key()
    member, relay = Keyring([new, old]), Keyring([old])
    proofs = member.macs(b"challenge")
    assert len(proofs) == 2 and all(len(p) == protocol.MESH_PROOF_BYTES for p in proofs)
    assert not relay.check_mac(b"challenge", proofs[0]), "the relay does not hold the new key yet"
    assert relay.check_mac(b"challenge", proofs[1])
    assert not relay.check_mac(b"another", proofs[1])


def test_the_auth_frame_carries_proofs_and_reads_as_before_without_them():
    node, sig = os.urandom(32), os.urandom(64)
    plain = protocol.Auth(node, sig)
    assert plain.encode() == bytes((protocol.Auth.TAG,)) + node + sig, "no key: the same bytes as before"
    proofs = (os.urandom(20), os.urandom(20))
    assert protocol.decode(protocol.Auth(node, sig, proofs).encode()) == protocol.Auth(node, sig, proofs)
    for body in (node + sig + b"x", node + sig + b"p" * 20 * (protocol.MAX_MESH_PROOFS + 1), node):
        with pytest.raises(protocol.RelayProtocolError, match="auth frame"):
            protocol.decode(bytes((protocol.Auth.TAG,)) + body)


# --- a keyed mesh in one trio run ---


def _opts(ring: Keyring | None, **more) -> NodeOptions:
    return NodeOptions(profile="local", stages=2, mesh_key=ring, **more)


async def test_a_keyed_mesh_converges_and_a_node_without_the_key_never_joins():
    ring = Keyring([generate_key()])
    lines: list[str] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a, b = await _keyed_pair(nursery, ring, lines)
            assert b.core.members[a.node_id].meta.keyring == (ring.primary_id,), "peers see our key ids"
            other = await start_node(nursery, _opts(Keyring([generate_key()]), stage=1, seeds=[a.addr]),
                                     lines)
            bare = await start_node(nursery, _opts(None, stage=1, seeds=[a.addr]), lines)
            with trio.fail_after(10):
                while a.core.counters["rx_unsealed_dropped"] < 4:
                    await trio.sleep(0.1)  # both keep knocking: joins and their retries
            await trio.sleep(1.0)
            for n in (a, b):
                assert set(n.core.members) == {a.node_id, b.node_id}, "nobody without our key got in"
            assert other.core.live_count() == 1 and bare.core.live_count() == 1
            assert other.core.counters["rx_packets"] == 0, "not even an answer reached them"
            snap = a.snapshot()
            assert snap["counters"]["rx_unsealed_dropped"] >= 4
            nursery.cancel_scope.cancel()


async def _keyed_pair(nursery: trio.Nursery, ring: Keyring, lines: list[str]) -> tuple[Running, Running]:
    """An orchestrator and a stage, each with its own copy of ``ring``, converged."""
    a = await start_node(nursery, _opts(Keyring(ring_keys(ring)), role="orchestrator"), lines)
    b = await start_node(nursery, _opts(Keyring(ring_keys(ring)), stage=0, seeds=[a.addr]), lines)
    await wait_converged([a, b])
    return a, b


def ring_keys(ring: Keyring) -> list[bytes]:
    """A copy's keys: each node holds its own ring, as separate processes would."""
    return [keyring.decode_key(line) for line in ring.to_text().splitlines()[1:]]


async def test_an_unsealed_dead_about_a_member_changes_nothing_and_is_logged_once(caplog):
    import socket

    from meshd.testing.stranger import raw_packet

    ring = Keyring([generate_key()])
    lines: list[str] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a, b = await _keyed_pair(nursery, ring, lines)
            before = a.core.counters["rx_unsealed_dropped"]
            host, _, port = a.addr.rpartition(":")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                for inc in range(5):
                    dead = (wire.Dead.TAG, [inc, b.node_id, b.node_id, b"s" * 64])  # "b left", unsealed
                    sock.sendto(raw_packet(b.node_id, dead), (host, int(port)))
            with trio.fail_after(5):
                while a.core.counters["rx_unsealed_dropped"] < before + 5:
                    await trio.sleep(0.05)
            await trio.sleep(0.5)
            assert a.core.members[b.node_id].state.name == "ALIVE"
            assert not any("member left" in line or "member dead" in line for line in lines)
            said = [r.getMessage() for r in caplog.records
                    if "not sealed with our mesh key" in r.getMessage()]
            assert len(said) == 1 and said[0].startswith("dropped packets from 127.0.0.1:"), said
            nursery.cancel_scope.cancel()


async def test_a_rotation_at_one_node_reaches_every_member_with_no_suspicion(tmp_path):
    old = generate_key()
    lines: list[str] = []
    files = [tmp_path / f"n{i}.key" for i in range(3)]
    for f in files:
        Keyring([old]).save(f)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = [await start_node(nursery, _opts(keyring.load(files[0]), role="orchestrator",
                                                     mesh_key_file=str(files[0]), dashboard="127.0.0.1:0"),
                                      lines)]
            for k in (0, 1):
                nodes.append(await start_node(nursery, _opts(keyring.load(files[k + 1]), stage=k,
                                                             seeds=[nodes[0].addr],
                                                             mesh_key_file=str(files[k + 1])), lines))
            await wait_converged(nodes)
            new = generate_key()
            new_id, old_id = key_id(new), key_id(old)
            url = f"{nodes[0].dashboard_url}/api/keys"

            async def step(op: str, key: str, done) -> None:
                r = await trio.to_thread.run_sync(partial(httpx.post, url, json={"op": op, "key": key},
                                                          timeout=5))
                assert r.status_code == 202, r.text
                with trio.fail_after(10):
                    while not all(done(m.core.me.meta.keyring) for m in nodes):
                        await trio.sleep(0.05)
                    while True:  # and the node asked sees it in every member's metadata
                        view = (await trio.to_thread.run_sync(partial(httpx.get, url, timeout=5))).json()
                        if all(done(tuple(m["keyring"])) for m in view["members"]):
                            break
                        await trio.sleep(0.1)

            await step("install", keyring.encode_key(new), lambda ids: new_id in ids)
            await step("use", new_id, lambda ids: ids[:1] == (new_id,))
            await step("remove", old_id, lambda ids: ids == (new_id,))
            for node, f in zip(nodes, files, strict=True):
                assert node.mesh_key.ids == [new_id]
                assert keyring.load(f).ids == [new_id], "a restart comes back with the new key"
                assert node.core.counters["suspicions"] == 0
            assert not any("member suspect" in line for line in lines)
            r = await trio.to_thread.run_sync(partial(httpx.post, url, json={"op": "remove", "key": new_id},
                                                      timeout=5))
            assert r.status_code == 400 and "still seals at stage-0" in r.json()["error"]
            nursery.cancel_scope.cancel()


async def test_a_use_of_a_key_a_member_does_not_hold_is_ignored_there(caplog):
    import socket

    from meshd.swim.facts import keyring_change_data

    old, new = generate_key(), generate_key()
    lines: list[str] = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            a = await start_node(nursery, _opts(Keyring([old, new]), role="orchestrator"), lines)
            b = await start_node(nursery, _opts(Keyring([old]), stage=0, seeds=[a.addr]), lines)
            await wait_converged([a, b])
            with pytest.raises(KeyringError, match="not every member holds key"):
                a.change_keyring("use", key_id(new))
            # a's own signed word, as a member whose view of b was behind would send it.
            change = wire.KeyringChange(a.node_id, 1, "use", key_id(new), b"")
            change = wire.KeyringChange(a.node_id, 1, "use", key_id(new), b"",
                                        a.identity.sign(keyring_change_data(change)))
            host, _, port = b.addr.rpartition(":")
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.sendto(Keyring([old]).seal(wire.encode(wire.Packet(a.node_id, (change,)))),
                            (host, int(port)))
            with trio.fail_after(5):
                while not any("which we do not hold" in r.getMessage() for r in caplog.records):
                    await trio.sleep(0.05)
            assert b.mesh_key.ids == [key_id(old)], "b kept sealing with the key it holds"
            nursery.cancel_scope.cancel()


# --- the relay admits members only ---


async def _start_relay(nursery: trio.Nursery, relay: Relay) -> int:
    _, port = await nursery.start(partial(serve_relay, relay=relay), "127.0.0.1", 0)
    return port


async def _auth(port: int, identity: Identity, ring: Keyring | None) -> tuple[object, object]:
    """One raw handshake: what the relay answered to our Auth, or how it closed."""
    async with open_websocket("127.0.0.1", port, "/", use_ssl=False) as ws:
        challenge = protocol.decode(await ws.get_message())
        message = protocol.auth_message(challenge.nonce, identity.node_id)
        proofs = tuple(ring.macs(message)) if ring is not None else ()
        await ws.send_message(protocol.Auth(identity.node_id, identity.sign(message), proofs).encode())
        try:
            return protocol.decode(await ws.get_message()), None
        except ConnectionClosed as exc:
            return None, exc.reason


async def test_a_relay_with_the_mesh_key_refuses_a_client_without_it_and_admits_one_with_it(tmp_path):
    path = tmp_path / "relay.key"
    ring = keyring.generate_file(path)
    relay = Relay(mesh_key_file=path)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _start_relay(nursery, relay)
            for stranger in (None, Keyring([generate_key()])):
                answer, closed = await _auth(port, Identity.generate(), stranger)
                assert answer is None and closed.code == protocol.CLOSE_NOT_MEMBER
                assert closed.reason.startswith("not a member: no valid mesh-key proof")
            assert relay.snapshot()["refused"]["not-member"] == 2
            answer, closed = await _auth(port, Identity.generate(), Keyring(ring_keys(ring)))
            assert isinstance(answer, protocol.Accepted), closed
            client = RelayClient(f"ws://127.0.0.1:{port}", Identity.generate(),
                                 config=ClientConfig(backoff_initial=0.05), mesh_key=Keyring(ring_keys(ring)))
            await nursery.start(client.run)
            assert client.connected
            nursery.cancel_scope.cancel()


async def test_a_relay_reads_its_key_file_again_when_it_changes(tmp_path):
    path = tmp_path / "relay.key"
    ring = keyring.generate_file(path)
    relay = Relay(mesh_key_file=path)
    new = generate_key()
    member_after = Keyring([new, ring.primary_key])  # sends proofs for both: the new one first
    only_new = Keyring([new])
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await _start_relay(nursery, relay)
            answer, _ = await _auth(port, Identity.generate(), member_after)
            assert isinstance(answer, protocol.Accepted), "the old key's proof still admits it"
            _, closed = await _auth(port, Identity.generate(), only_new)
            assert closed.code == protocol.CLOSE_NOT_MEMBER
            ring.install(new)
            ring.save(path)
            answer, closed = await _auth(port, Identity.generate(), only_new)
            assert isinstance(answer, protocol.Accepted), closed
            assert relay.snapshot()["mesh_keys"] == ring.ids and relay.mesh_key_reloads == 1
            path.write_text("garbage\n")
            answer, _ = await _auth(port, Identity.generate(), only_new)
            assert isinstance(answer, protocol.Accepted), "a broken file keeps the keys we hold"
            nursery.cancel_scope.cancel()


async def test_keyed_nodes_talk_through_a_keyed_relay_with_sealed_payloads(tmp_path):
    from meshd.net.faults import Faults

    path = tmp_path / "mesh.key"
    keyring.generate_file(path)
    relay = Relay(mesh_key_file=path)
    lines: list[str] = []
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            port = await _start_relay(nursery, relay)
            url = f"ws://127.0.0.1:{port}"
            ring = partial(keyring.load, path)
            a = await start_node(nursery, _opts(ring(), role="orchestrator", relay=url), lines)
            c = await start_node(nursery, _opts(ring(), stage=0, seeds=[a.addr], relay=url), lines)
            b = await start_node(nursery, _opts(ring(), stage=1, seeds=[c.addr], relay=url,
                                                faults=Faults.parse([f"drop:{a.addr}"])), lines)
            await wait_converged([a, b, c])
            await a.data.send(b.node_id, b"over the relay", 10)  # b's direct packets to a are lost
            with trio.fail_after(10):
                while b.paths.out_path(a.node_id) != "relay":
                    await trio.sleep(0.1)
            await b.data.send(a.node_id, b"back over the relay", 10)
            snap = relay.snapshot()
            assert snap["frames_forwarded"] > 0 and snap["dropped_malformed"] == 0
            assert a.core.counters["rx_unsealed_dropped"] == 0
            nursery.cancel_scope.cancel()


# --- smoke-run and the bench ---


def test_smoke_run_gives_the_relay_and_every_node_the_run_s_key_or_tells_nodes_insecure():
    from meshd.launch.plan import FaultPlan, RunPlan, job_argvs, node_names

    names = node_names(2)
    addrs = {n: f"127.0.0.1:{9001 + i}" for i, n in enumerate(names)}
    plan = RunPlan(2, "/m", "127.0.0.1:9000", addrs, dict.fromkeys(names, "127.0.0.1:0"), FaultPlan(),
                   "/tmp/snaps", "/tmp/keys", mesh_key="/tmp/run/mesh.key")
    keyed = job_argvs(plan)
    assert keyed["relay"] == ["relay", "--bind", "127.0.0.1:9000", "--mesh-key-file", "/tmp/run/mesh.key"]
    for name in names:
        assert "--mesh-key-file" in keyed[name] and "--insecure" not in keyed[name]
    bare = job_argvs(RunPlan(**{**plan.__dict__, "mesh_key": None}))
    assert bare["relay"] == ["relay", "--bind", "127.0.0.1:9000"]
    assert all("--insecure" in bare[n] and "--mesh-key-file" not in bare[n] for n in names)


def test_bench_seal_prints_seal_open_sign_and_verify_for_both_sizes():
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "seal.py"
    r = subprocess.run([sys.executable, str(script), "--rounds", "3", "--batch", "3", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"200", "1200"}
    assert all(set(v) == {"seal_us", "open_us", "sign_us", "verify_us"} for v in out.values())
