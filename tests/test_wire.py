"""The wire codec: round trips, limits, and "untrusted bytes raise only WireError"."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd import wire
from meshd.pipeline.messages import APP_TYPES

SENDER = bytes(range(32))
NODE_A = b"\xaa" * 32
NODE_B = b"\xbb" * 32
U64_MAX = 2**64 - 1

FUZZ = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The msgpack-shape strategies are costly to draw; fewer examples still cover every tag many times.
SHAPES = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_SMALL = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def raw_packet(messages, *, version=wire.PROTOCOL_VERSION, sender=SENDER) -> bytes:
    """Pack a packet without going through wire.encode, so it can be malformed."""
    return msgpack.packb([version, sender, messages], use_bin_type=True)


def decode_or_wire_error(data: bytes) -> wire.Packet | None:
    """Decode ``data``; None if it raised WireError. Any other exception escapes (and fails the test).

    Whatever decode accepts must survive a re-encode/decode unchanged: the decoder may
    not let through a value the rest of meshd cannot represent.
    """
    try:
        packet = wire.decode(data)
    except wire.WireError:
        return None
    assert isinstance(packet, wire.Packet)
    assert wire.decode(wire.encode(packet)) == packet
    return packet


# --- one hand-written example per message type ---

FULL_META = wire.Meta(
    role="stage",
    stage=2,
    stages=4,
    addrs=("10.0.0.1:7946", "[fe80::1]:7946"),
    relay_url="wss://relay.example/mesh",
    version="0.1.0",
    generation=wire.COUNTER_MAX,
)
EMPTY_META = wire.Meta(role="orchestrator", stage=None, stages=None, addrs=(), relay_url=None)
CLAIM = wire.NameClaim(name="stage-2", owner=NODE_A, clock=7, tombstone=False)

EXAMPLES: dict[int, wire.Message] = {
    wire.Ping.TAG: wire.Ping(seq=1, target=NODE_A),
    wire.PingReq.TAG: wire.PingReq(seq=U64_MAX, target=NODE_A, target_addr="10.0.0.2:7946", nack=True),
    wire.Ack.TAG: wire.Ack(seq=0),
    wire.Nack.TAG: wire.Nack(seq=42),
    wire.Alive.TAG: wire.Alive(incarnation=3, node=NODE_A, addr="10.0.0.1:7946", meta=FULL_META),
    wire.Suspect.TAG: wire.Suspect(incarnation=4, node=NODE_A, sender=NODE_B, sig=b"\x05" * 64),
    wire.Dead.TAG: wire.Dead(incarnation=5, node=NODE_A, sender=NODE_A),
    wire.PushPull.TAG: wire.PushPull(
        join=True,
        reply=False,
        members=(
            wire.MemberState(NODE_A, "10.0.0.1:7946", 1, wire.STATE_ALIVE, FULL_META),
            wire.MemberState(NODE_B, "", 0, wire.STATE_SUSPECT, EMPTY_META),
            wire.MemberState(SENDER, "x", 9, wire.STATE_DEAD, wire.Meta()),
            wire.MemberState(b"\0" * 32, "y", 2, wire.STATE_LEFT, wire.Meta(stage=0)),
        ),
        names=(CLAIM, wire.NameClaim(name="orchestrator", owner=NODE_B, clock=0, tombstone=True)),
    ),
    wire.NameClaim.TAG: CLAIM,
    wire.DataChunk.TAG: wire.DataChunk(session=3, msg_id=7, total=10, offset=4, chunk=b"\x00\xffabc"),
    wire.DataAck.TAG: wire.DataAck(session=3, msg_id=7),
    wire.PathSummary.TAG: wire.PathSummary(node=NODE_A, version=7, entries=(
        wire.PathEntry(NODE_B, "relay", 400, 3, "direct ping unanswered", 12_000),
        wire.PathEntry(SENDER, "direct", 0, 0, "", 0),
    )),
    wire.StreamChallenge.TAG: wire.StreamChallenge(nonce=b"\x07" * wire.STREAM_NONCE_BYTES, epoch=2**63 - 1),
    wire.StreamProof.TAG: wire.StreamProof(nonce=b"\x08" * wire.STREAM_NONCE_BYTES,
                                           signature=b"\x09" * wire.SIGNATURE_BYTES, epoch=0,
                                           dh=b"\x0a" * wire.DH_KEY_BYTES, mesh_proof=b"\x0b" * 20),
    wire.KeyringChange.TAG: wire.KeyringChange(issuer=NODE_B, clock=3, op="install", key_id="0a1b2c3d",
                                               key=b"\x0c" * 32, sig=b"\x0d" * wire.SIGNATURE_BYTES),
    wire.Punch.TAG: wire.Punch(nonce=2**62 + 1, target=NODE_B),
    wire.PunchAck.TAG: wire.PunchAck(nonce=7, seen="203.0.113.9:40123"),
    wire.CallMeMaybe.TAG: wire.CallMeMaybe(addrs=("10.0.0.2:7946", "203.0.113.9:40123")),
}


def test_examples_cover_every_message_type():
    assert set(EXAMPLES) == set(wire.MESSAGE_TYPES)
    for tag, msg in EXAMPLES.items():
        assert type(msg) is wire.MESSAGE_TYPES[tag]
        assert msg.TAG == tag


@pytest.mark.parametrize("tag", sorted(EXAMPLES))
def test_round_trip_each_message_type(tag):
    packet = wire.Packet(sender=SENDER, messages=(EXAMPLES[tag],))
    decoded = wire.decode(wire.encode(packet))
    assert decoded == packet
    assert type(decoded.messages[0]) is wire.MESSAGE_TYPES[tag]


def test_round_trip_all_types_in_one_packet():
    packet = wire.Packet(sender=SENDER, messages=tuple(EXAMPLES.values()))
    assert wire.decode(wire.encode(packet)) == packet


def test_round_trip_meta_with_none_fields():
    msg = wire.Alive(incarnation=0, node=NODE_A, addr="a", meta=EMPTY_META)
    decoded = wire.decode(wire.encode(wire.Packet(SENDER, (msg,)))).messages[0]
    assert decoded.meta == EMPTY_META
    assert decoded.meta.stage is None and decoded.meta.stages is None and decoded.meta.relay_url is None


def test_round_trip_empty_packet():
    packet = wire.Packet(sender=SENDER, messages=())
    assert wire.decode(wire.encode(packet)) == packet


# --- strategies for valid messages ---

node_ids = st.binary(min_size=32, max_size=32)
u64s = st.integers(min_value=0, max_value=U64_MAX)
counters = st.integers(min_value=0, max_value=wire.COUNTER_MAX)
stages = st.integers(min_value=0, max_value=wire.MAX_STAGES)
texts = st.text(max_size=16)

metas = st.builds(
    wire.Meta,
    role=st.sampled_from(["stage", "orchestrator"]) | texts,
    stage=st.none() | stages,
    stages=st.none() | stages,
    addrs=st.lists(texts, max_size=3).map(tuple),
    relay_url=st.none() | texts,
    version=texts,
    generation=counters,
)
member_states = st.builds(
    wire.MemberState,
    node=node_ids,
    addr=texts,
    incarnation=counters,
    state=st.sampled_from([wire.STATE_ALIVE, wire.STATE_SUSPECT, wire.STATE_DEAD, wire.STATE_LEFT]),
    meta=metas,
)
name_claims = st.builds(wire.NameClaim, name=texts, owner=node_ids, clock=counters, tombstone=st.booleans())

messages = st.one_of(
    st.builds(wire.Ping, seq=u64s, target=node_ids),
    st.builds(wire.PingReq, seq=u64s, target=node_ids, target_addr=texts, nack=st.booleans()),
    st.builds(wire.Ack, seq=u64s),
    st.builds(wire.Nack, seq=u64s),
    st.builds(wire.Alive, incarnation=counters, node=node_ids, addr=texts, meta=metas),
    st.builds(wire.Suspect, incarnation=counters, node=node_ids, sender=node_ids),
    st.builds(wire.Dead, incarnation=counters, node=node_ids, sender=node_ids),
    st.builds(
        wire.PushPull,
        join=st.booleans(),
        reply=st.booleans(),
        members=st.lists(member_states, max_size=4).map(tuple),
        names=st.lists(name_claims, max_size=4).map(tuple),
    ),
    name_claims,
    st.builds(wire.DataChunk, session=u64s, msg_id=counters,
              total=st.integers(0, wire.MAX_DATA_MESSAGE_BYTES),
              offset=st.integers(0, wire.MAX_DATA_MESSAGE_BYTES), chunk=st.binary(max_size=64)),
    st.builds(wire.DataAck, session=u64s, msg_id=u64s),
)
# Sizes above are bounded so that no drawn packet can exceed MAX_PACKET_BYTES.
packets = st.builds(wire.Packet, sender=node_ids, messages=st.lists(messages, max_size=8).map(tuple))


@FUZZ_SMALL
@given(packets)
def test_round_trip_random_packets(packet):
    data = wire.encode(packet)
    assert len(data) <= wire.MAX_PACKET_BYTES
    assert wire.decode(data) == packet


@FUZZ_SMALL
@given(packets)
def test_encoded_size_bounds_the_packet(packet):
    # The gossip packer budgets with PACKET_OVERHEAD + encoded_size(msg); that must never undercount.
    budget = wire.PACKET_OVERHEAD + sum(wire.encoded_size(m) for m in packet.messages)
    assert len(wire.encode(packet)) <= budget


# --- untrusted bytes raise only WireError ---


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes_raise_only_wire_error(data):
    decode_or_wire_error(data)


@st.composite
def mutated_packets(draw) -> bytes:
    data = bytearray(wire.encode(draw(packets)))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "delete", "insert", "duplicate", "splice"]))
        pos = draw(st.integers(min_value=0, max_value=len(data)))
        if kind == "flip" and pos < len(data):
            data[pos] ^= draw(st.integers(min_value=1, max_value=255))
        elif kind == "set" and pos < len(data):
            data[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC1, 0xC2, 0xC3,
                                              0xC4, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE, 0xDF, 0xFF]))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "delete":
            del data[pos:pos + draw(st.integers(min_value=1, max_value=16))]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "duplicate":
            end = draw(st.integers(min_value=pos, max_value=len(data)))
            data[end:end] = data[pos:end]
        elif kind == "splice":
            other = wire.encode(draw(packets))
            cut = draw(st.integers(min_value=0, max_value=len(other)))
            data = data[:pos] + other[cut:]
    return bytes(data)


@FUZZ
@given(mutated_packets())
def test_mutated_packets_raise_only_wire_error(data):
    decode_or_wire_error(data)


# Anything msgpack can carry, to put where a field of a different shape belongs.
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=U64_MAX)
    | st.sampled_from([-(2**63), -1, 0, 1, 2, 3, 4, 2**32, 2**63, U64_MAX])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.just("x" * (wire.MAX_STR + 1))
    | st.binary(max_size=40)
    | node_ids,
    lambda children: st.lists(children, max_size=8),
    max_leaves=20,
)


@SHAPES
@given(st.sampled_from(sorted(wire.MESSAGE_TYPES)), msgpack_values)
def test_wrong_shaped_body_raises_only_wire_error(tag, body):
    decode_or_wire_error(raw_packet([[tag, body]]))


@SHAPES
@given(st.sampled_from(sorted(wire.MESSAGE_TYPES)), st.data())
def test_right_length_body_with_wrong_fields_raises_only_wire_error(tag, data):
    n_fields = len(dataclasses.fields(wire.MESSAGE_TYPES[tag]))
    body = data.draw(st.lists(msgpack_values, min_size=n_fields, max_size=n_fields))
    decode_or_wire_error(raw_packet([[tag, body]]))


@st.composite
def valid_body_with_one_subtree_replaced(draw) -> list:
    """The plain msgpack form of a valid message, with one node (leaf or list) swapped for junk.

    This reaches the checks nested deep inside PushPull -> MemberState -> Meta.
    """
    plain = wire.encode_message(draw(messages))

    def replace(node):
        if type(node) is list and node and draw(st.booleans()):
            i = draw(st.integers(min_value=0, max_value=len(node) - 1))
            return node[:i] + [replace(node[i])] + node[i + 1:]
        return draw(msgpack_values)

    # Keep the tag at plain[0] most of the time so the body is what gets damaged.
    return [plain[0], replace(plain[1])] if draw(st.booleans()) else replace(plain)


@SHAPES
@given(valid_body_with_one_subtree_replaced())
def test_valid_message_with_a_junk_subtree_raises_only_wire_error(message):
    decode_or_wire_error(raw_packet([message]))


@SHAPES
@given(msgpack_values)
def test_random_msgpack_packet_raises_only_wire_error(value):
    decode_or_wire_error(msgpack.packb(value, use_bin_type=True))


@SHAPES
@given(msgpack_values, msgpack_values, msgpack_values)
def test_random_msgpack_envelope_raises_only_wire_error(version, sender, msgs):
    decode_or_wire_error(msgpack.packb([version, sender, msgs], use_bin_type=True))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # reserved msgpack byte
        b"\x93\x01",  # truncated array
        raw_packet([]) + b"\x00",  # trailing bytes
        msgpack.packb({"a": 1}),  # maps are not allowed anywhere
        msgpack.packb([1, SENDER, [[3, {"seq": 1}]]], use_bin_type=True),
        msgpack.packb(msgpack.ExtType(1, b"x")),
        msgpack.packb([1, SENDER, []], use_bin_type=True)[:-1],  # truncated message list
        b"\xa2\xff\xfe",  # a str that is not UTF-8
        msgpack.packb([1, SENDER, [[3, [1]]], 4], use_bin_type=True),  # four items
        msgpack.packb([1, SENDER], use_bin_type=True),
        msgpack.packb([1, SENDER, [3, [1]]], use_bin_type=True),  # message not wrapped in a list
        msgpack.packb([1, SENDER, [[3]]], use_bin_type=True),
        msgpack.packb([1, SENDER, [[3, [1], 0]]], use_bin_type=True),
        msgpack.packb([1, SENDER, [[3, [1, 2]]]], use_bin_type=True),  # too many fields
        msgpack.packb([1, SENDER, [[3, []]]], use_bin_type=True),  # too few fields
        msgpack.packb([1, SENDER, "msgs"], use_bin_type=True),
    ],
)
def test_garbage_raises_wire_error(data):
    with pytest.raises(wire.WireError):
        wire.decode(data)


def test_deeply_nested_arrays_raise_wire_error():
    # Nesting beyond msgpack's own stack must not surface as a RecursionError or similar.
    with pytest.raises(wire.WireError):
        wire.decode(b"\x91" * 5000 + b"\x90")


def test_deeply_nested_unknown_tag_raises_wire_error():
    # A tag that is a list nested ~1000 deep: msgpack decodes it fine (its limit is 1024), but
    # formatting it into the error message (repr/str) overflows Python's recursion limit.
    tag = b"\x91" * 1000 + b"\x90"
    data = b"\x93\x01\xc4\x20" + SENDER + b"\x91\x92" + tag + b"\x90"
    with pytest.raises(wire.WireError):
        wire.decode(data)


# --- version ---


def test_newer_version_raises_unsupported_version():
    data = wire.encode(wire.Packet(SENDER, (wire.Ack(1),), version=wire.PROTOCOL_VERSION + 1))
    with pytest.raises(wire.UnsupportedVersion) as info:
        wire.decode(data)
    assert isinstance(info.value, wire.WireError)
    assert info.value.version == wire.PROTOCOL_VERSION + 1


def test_newer_version_is_reported_before_the_rest_is_parsed():
    # A future protocol may change the envelope; the version must still be reported.
    with pytest.raises(wire.UnsupportedVersion) as info:
        wire.decode(raw_packet("future", version=99, sender=b"short"))
    assert info.value.version == 99


@pytest.mark.parametrize("version", [0, -1, True, False, 1.0, "1", None, b"\x01", [1]])
def test_bad_version_raises_plain_wire_error(version):
    with pytest.raises(wire.WireError) as info:
        wire.decode(raw_packet([], version=version))
    assert not isinstance(info.value, wire.UnsupportedVersion)


def test_current_version_is_accepted():
    assert wire.decode(raw_packet([], version=wire.PROTOCOL_VERSION)).version == wire.PROTOCOL_VERSION


# --- size limits ---


def _pushpull_of_size(target: int) -> wire.Packet:
    """A valid packet whose encoding is exactly ``target`` bytes long."""
    full = wire.MemberState(NODE_A, "a", 0, wire.STATE_ALIVE, wire.Meta(addrs=("a" * 500,) * wire.MAX_ADDRS))

    def build(n_full: int, n_long: int, last: int, pad: int = 0) -> wire.Packet:
        tail = wire.MemberState(NODE_B, "b", 0, wire.STATE_ALIVE,
                                wire.Meta(addrs=("b" * 500,) * n_long + ("c" * last,), version="v" * pad))
        return wire.Packet(SENDER, (wire.PushPull(False, False, (full,) * n_full + (tail,), ()),))

    def size(packet: wire.Packet) -> int:
        return len(msgpack.packb([packet.version, packet.sender, [wire.encode_message(m) for m in
                                                                  packet.messages]], use_bin_type=True))

    for n_full in range(30):
        for n_long in range(wire.MAX_ADDRS):
            for pad in (0, 256, 384, 512):
                short = size(build(n_full, n_long, 256, pad))
                if 0 <= target - short <= 256:  # str16 lengths 256..512 grow the packet byte by byte
                    packet = build(n_full, n_long, 256 + target - short, pad)
                    assert size(packet) == target
                    return packet
    raise AssertionError(f"cannot build a packet of {target} bytes")


def test_packet_of_exactly_max_size_round_trips():
    packet = _pushpull_of_size(wire.MAX_PACKET_BYTES)
    data = wire.encode(packet)
    assert len(data) == wire.MAX_PACKET_BYTES
    assert wire.decode(data) == packet


def test_encode_refuses_packet_over_max_size():
    with pytest.raises(wire.WireError):
        wire.encode(_pushpull_of_size(wire.MAX_PACKET_BYTES + 1))


def test_decode_refuses_bytes_over_max_size():
    packet = _pushpull_of_size(wire.MAX_PACKET_BYTES + 1)
    data = msgpack.packb([packet.version, packet.sender, [wire.encode_message(m) for m in packet.messages]],
                         use_bin_type=True)
    assert len(data) == wire.MAX_PACKET_BYTES + 1
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.decode(data)


def test_decode_refuses_long_garbage_without_parsing():
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.decode(b"\x00" * (wire.MAX_PACKET_BYTES + 1))


def test_string_of_max_len_accepted_and_one_more_refused():
    ok = wire.Ping(1, NODE_A)
    ok_claim = wire.NameClaim("n" * wire.MAX_STR, NODE_A, 1, False)
    assert wire.decode(wire.encode(wire.Packet(SENDER, (ok, ok_claim)))).messages[1] == ok_claim
    with pytest.raises(wire.WireError):
        wire.decode(raw_packet([[wire.NameClaim.TAG, ["n" * (wire.MAX_STR + 1), NODE_A, 1, False, b""]]]))


def test_long_string_nested_in_pushpull_meta_refused():
    member = wire.MemberState(NODE_A, "a", 0, wire.STATE_ALIVE, wire.Meta(version="v" * (wire.MAX_STR + 1)))
    data = raw_packet([wire.encode_message(wire.PushPull(False, False, (member,), ()))])
    with pytest.raises(wire.WireError):
        wire.decode(data)


@pytest.mark.parametrize("started", [-1, wire.COUNTER_MAX + 1, 1.5, "1764950400", None])
def test_a_process_start_time_that_is_no_counter_is_refused(started):
    body = [*wire.Meta().to_body()[:-1], started]
    alive = [wire.Alive.TAG, [1, NODE_A, "a", body, b"s" * 64]]
    with pytest.raises(wire.WireError):
        wire.decode(raw_packet([alive]))


@pytest.mark.parametrize(
    "node",
    [b"\x01" * 31, b"\x01" * 33, b"", "a" * 32, None, list(range(32))],
    ids=["31-bytes", "33-bytes", "empty", "str", "none", "list"],
)
def test_node_id_of_wrong_size_or_type_refused(node):
    assert wire.decode(raw_packet([[wire.Ping.TAG, [1, NODE_A]]])).messages == (wire.Ping(1, NODE_A),)
    with pytest.raises(wire.WireError):
        wire.decode(raw_packet([[wire.Ping.TAG, [1, node]]]))
    with pytest.raises(wire.WireError):
        wire.decode(raw_packet([], sender=node))


def _meta(**fields) -> list:
    """A Meta body with ``fields`` set to raw (possibly illegal) values."""
    body = ["stage", None, None, [], None, "", 0, 0, "", False, b"", []]
    names = [f.name for f in dataclasses.fields(wire.Meta)]
    for name, value in fields.items():
        body[names.index(name)] = value
    return body


def _alive(meta: list, sig: bytes = b"") -> list:
    return [wire.Alive.TAG, [1, NODE_A, "a", meta, sig]]


@pytest.mark.parametrize(
    "message",
    [
        [wire.Ack.TAG, [True]],  # bool is not an int
        [wire.Ack.TAG, [False]],
        [wire.Ack.TAG, [-1]],
        [wire.Ack.TAG, [-(2**63)]],
        [wire.Ack.TAG, [1.0]],
        [wire.Ack.TAG, ["1"]],
        [wire.Ack.TAG, [None]],
        [wire.PingReq.TAG, [1, NODE_A, "a", 1]],  # int is not a bool
        [wire.PingReq.TAG, [1, NODE_A, "a", None]],
        [wire.PingReq.TAG, [1, NODE_A, b"a", True]],  # bytes is not a str
        _alive(_meta(stage=-2)),
        _alive(_meta(stage=True)),
        _alive(_meta(addrs=["a"] * (wire.MAX_ADDRS + 1))),
        _alive(_meta(addrs=[1])),
        _alive(_meta(version=None)),
        [wire.Alive.TAG, [1, NODE_A, "a", ["stage", None, None, [], None, "", 0, 0]]],  # too few fields
        _alive(_meta(epoch=-1)),
        _alive(_meta(checkpoint=1)),
        _alive(_meta(draining=0)),
        _alive(_meta(dh=b"d" * 31)),
        _alive(_meta(keyring=["k"] * (wire.MAX_KEYRING + 1))),
        _alive(_meta(keyring=[""])),
        _alive(_meta(keyring=["k" * (wire.MAX_KEY_ID_CHARS + 1)])),
        _alive(_meta(), b"s" * 63),  # signature
        [wire.Suspect.TAG, [1, NODE_A, NODE_A, b"s" * 65]],
        [wire.KeyringChange.TAG, [NODE_A, 1, "rotate", "0a1b2c3d", b"", b""]],
        [wire.KeyringChange.TAG, [NODE_A, 1, "install", "0a1b2c3d", b"k" * 31, b""]],
        [wire.PushPull.TAG, [False, False, [[NODE_A, "a", 0, 4, _meta(), b""]], []]],  # bad state
        [wire.PushPull.TAG, [False, False, [[NODE_A, "a", 0, True, wire.Meta().to_body(), b""]], []]],
        [wire.PushPull.TAG, [False, False, [[NODE_A, "a", 0, 1.0, wire.Meta().to_body(), b""]], []]],
        [wire.PushPull.TAG, [False, False, [], [["n", NODE_A, 1, False, b""]] * (wire.MAX_PUSHPULL_NAMES + 1)
                             ]],
        [wire.PushPull.TAG, [False, False, None, []]],
        [wire.Alive.TAG, [1, NODE_A, "a", [*wire.Meta().to_body()[:-1], "cone"], b""]],  # no such NAT kind
        [wire.Punch.TAG, [1, b"short"]],
        [wire.PunchAck.TAG, [1, "a" * (wire.MAX_STR + 1)]],
        [wire.CallMeMaybe.TAG, [["a"] * (wire.MAX_ADDRS + 1)]],
    ],
)
def test_wrong_field_types_refused(message):
    with pytest.raises(wire.WireError):
        wire.decode(raw_packet([message]))


def test_boundary_values_accepted():
    # Guards the refusals above: the same shapes with legal values decode.
    msgs = [
        [wire.Ack.TAG, [U64_MAX]],
        [wire.PingReq.TAG, [1, NODE_A, "a", False]],
        [wire.Alive.TAG, [1, NODE_A, "a", ["stage", 0, None, ["a"] * wire.MAX_ADDRS, None, "", 0,
                                          wire.COUNTER_MAX, "f" * wire.MAX_STR, True, b"d" * 32,
                                          ["k" * wire.MAX_KEY_ID_CHARS] * wire.MAX_KEYRING,
                                          ["ws://r:1"] * wire.MAX_RELAYS, "symmetric",
                                          wire.COUNTER_MAX], b"s" * 64]],
        [wire.PushPull.TAG, [False, False, [[NODE_A, "a", 0, 3, wire.Meta().to_body(), b""]],
                             [["n", NODE_A, 1, False, b""]] * (wire.MAX_PUSHPULL_NAMES - 1)
                             + [["n", NODE_A, 1, False, b"s" * 64]]]],
    ]
    assert len(wire.decode(raw_packet(msgs)).messages) == len(msgs)


def test_message_count_limit():
    at_limit = [[wire.Ack.TAG, [i]] for i in range(wire.MAX_MESSAGES_PER_PACKET)]
    assert len(wire.decode(raw_packet(at_limit)).messages) == wire.MAX_MESSAGES_PER_PACKET
    with pytest.raises(wire.WireError):
        wire.decode(raw_packet(at_limit + [[wire.Ack.TAG, [0]]]))


@pytest.mark.parametrize("tag", [0, 99, 255, -1, U64_MAX, True, "1", b"\x01", None, 1.0, [1]])
def test_unknown_tag_raises_wire_error(tag):
    with pytest.raises(wire.WireError, match="tag"):
        wire.decode(raw_packet([[tag, [1]]]))


# --- NameClaim ordering ---


def test_name_claim_newer_from_the_same_owner_wins():
    old = wire.NameClaim("stage-1", NODE_A, clock=1, tombstone=False)
    assert wire.NameClaim("stage-1", NODE_A, clock=2, tombstone=False).beats(old)
    assert not old.beats(wire.NameClaim("stage-1", NODE_A, clock=2, tombstone=False))
    # At one clock the tombstone wins: every member writes the same one when the owner dies.
    assert wire.NameClaim("stage-1", NODE_A, clock=1, tombstone=True).beats(old)


def test_name_claim_does_not_beat_itself():
    assert not CLAIM.beats(CLAIM)
    assert not CLAIM.beats(dataclasses.replace(CLAIM))


def test_name_claim_signature_is_empty_or_64_bytes():
    for sig in (b"x", b"x" * 63, b"x" * 65, "x" * 64, None):
        with pytest.raises(wire.WireError, match="signature"):
            wire.decode(raw_packet([[wire.NameClaim.TAG, ["n", NODE_A, 1, False, sig]]]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.builds(wire.NameClaim, name=st.sampled_from(["n", "m"]),
                          owner=st.sampled_from([NODE_A, NODE_B, SENDER]),
                          clock=st.integers(0, 2), tombstone=st.booleans()), min_size=1, max_size=8),
       st.randoms())
def test_registry_converges_whatever_the_arrival_order(claims, rnd):
    # Every member must end with the same table from the same claims, heard in any order.
    from meshd.swim.registry import Registry

    def table(order):
        r = Registry()
        for claim in order:
            r.merge(claim)
        return sorted(r.claims, key=lambda c: (c.name, c.owner))

    shuffled = list(claims)
    rnd.shuffle(shuffled)
    assert table(shuffled) == table(claims)


# --- Meta.name ---


def test_meta_name():
    assert wire.Meta(role="stage", stage=2, stages=4).name == "stage-2"
    assert wire.Meta(role="stage", stage=0).name == "stage-0"
    assert wire.Meta(role="orchestrator").name == "orchestrator"
    assert wire.Meta(role="orchestrator", stage=2).name == "orchestrator"


def test_data_chunks_are_bounded():
    n = wire.MAX_CHUNK_BYTES + 1
    big = wire.DataChunk(session=1, msg_id=1, total=n, offset=0, chunk=b"x" * n)
    data = wire.encode(wire.Packet(SENDER, (big,)), max_bytes=wire.MAX_FRAME_BYTES * 2)
    with pytest.raises(wire.WireError, match="data chunk"):
        wire.decode(data, max_bytes=wire.MAX_FRAME_BYTES * 2)
    too_long = wire.DataChunk(session=1, msg_id=1, total=wire.MAX_DATA_MESSAGE_BYTES + 1, offset=0,
                              chunk=b"")
    with pytest.raises(wire.WireError, match="at most"):
        wire.decode(wire.encode(wire.Packet(SENDER, (too_long,))))


# --- numbers a node advances are refused where it could not answer them ---


@pytest.mark.parametrize("message", [
    wire.Suspect(incarnation=U64_MAX, node=NODE_A, sender=NODE_B),
    wire.Dead(incarnation=wire.COUNTER_MAX + 1, node=NODE_A, sender=NODE_B),
    wire.Alive(incarnation=U64_MAX, node=NODE_A, addr="x", meta=EMPTY_META),
    wire.NameClaim(name="pp-entry", owner=NODE_A, clock=U64_MAX, tombstone=True),
    wire.PathSummary(node=NODE_A, version=U64_MAX, entries=()),
    wire.Alive(incarnation=1, node=NODE_A, addr="x", meta=wire.Meta(generation=U64_MAX)),
    wire.Alive(incarnation=1, node=NODE_A, addr="x", meta=wire.Meta(stage=2**40)),
])
def test_counters_past_what_a_node_can_answer_are_refused(message):
    # A peer that refutes answers with the value + 1; past COUNTER_MAX that no longer decodes
    # at its peers (and past 2^64 - 1 it no longer encodes at all).
    data = msgpack.packb([wire.PROTOCOL_VERSION, SENDER, [wire.encode_message(message)]], use_bin_type=True)
    with pytest.raises(wire.WireError):
        wire.decode(data)


def test_next_counter_stops_at_the_limit():
    assert wire.next_counter(0) == 1
    assert wire.next_counter(wire.COUNTER_MAX - 1) == wire.COUNTER_MAX
    assert wire.next_counter(wire.COUNTER_MAX) == wire.COUNTER_MAX


@pytest.mark.parametrize("data", [b"", b"\x93", b"\x93\x04", b"\x92\x04\xc4\x20" + b"a" * 32,
                                  b"\x93\x04\xc4\x05abcde", b"\x93\x91\x01" + b"\xc4\x20" + b"a" * 32,
                                  b"\xc1" * 8, b"\xdd\xff\xff\xff\xff"])
def test_packet_sender_of_garbage_is_a_wire_error(data):
    with pytest.raises(wire.WireError):
        wire.packet_sender(data)


@FUZZ_SMALL
@given(packets)
def test_packet_sender_reads_the_claimed_sender(packet):
    assert wire.packet_sender(wire.encode(packet)) == packet.sender


# --- each record's generated decoder (wire._decoder) against its field checkers ---

_EDGE_VALUES = [0, 1, -1, 2**63 - 1, 2**63, U64_MAX, U64_MAX + 1, True, False, None, 0.0, -0.0, 1.5,
                float("inf"), float("-inf"), float("nan"), "", "é", "x" * wire.MAX_STR,
                "x" * (wire.MAX_STR + 1), b"", b"\0" * 31, b"\0" * 32, b"\0" * 33, b"\0" * 64,
                b"\0" * wire.MAX_CHUNK_BYTES, b"\0" * (wire.MAX_CHUNK_BYTES + 1), bytearray(32),
                [], [1], ["a"]]


@pytest.mark.parametrize("check", list(wire._INLINE), ids=lambda c: c.__name__)
def test_each_inline_check_holds_exactly_when_its_checker_raises(check):
    big = [b"\0" * wire.MAX_DATA_MESSAGE_BYTES, b"\0" * (wire.MAX_DATA_MESSAGE_BYTES + 1)]
    for value in _EDGE_VALUES + big:
        inline = eval(wire._INLINE[check].format(v="value"), dict(wire._INLINE_NAMES), {"value": value})
        try:
            check(value)
        except wire.WireError:
            raises = True
        else:
            raises = False
        assert inline == raises, (check.__name__, repr(value)[:40])


def _field_by_field(cls, body):
    """What ``cls.from_body`` answers, by each field's checker in turn (nested records too)."""
    fields = cls._fields_
    if type(body) is not list or len(body) != len(fields):
        raise wire.WireError("wrong length")
    return cls(*(_checked(check, value) for check, value in zip(fields, body, strict=True)))


def _checked(check, value):
    record = getattr(check, "__self__", None)  # a nested record: its from_body, bound
    if isinstance(record, type) and issubclass(record, wire.Record):
        return _field_by_field(record, value)
    each = getattr(check, "each", None)
    if each is not None:
        if type(value) is not list or len(value) > check.limit:
            raise wire.WireError("not a list within the limit")
        return tuple(_checked(each, v) for v in value)
    return check(value)


def _same_answer(cls, body):
    try:
        want = _field_by_field(cls, body)
    except wire.WireError:
        want = wire.WireError
    try:
        got = cls.from_body(body)
    except wire.WireError:
        got = wire.WireError
    same = got is not wire.WireError and want is not wire.WireError and (
        msgpack.packb(wire.encode_message(got)) == msgpack.packb(wire.encode_message(want)))
    assert got == want or same


@SHAPES
@given(valid_body_with_one_subtree_replaced())
def test_a_generated_decoder_answers_as_its_field_checkers_do(message):
    tag = message[0] if type(message) is list and len(message) == 2 else None
    if type(tag) is int and tag in wire.MESSAGE_TYPES:
        _same_answer(wire.MESSAGE_TYPES[tag], message[1])


@FUZZ_SMALL
@given(st.sampled_from([*wire.MESSAGE_TYPES.values(), *APP_TYPES.values()]), st.data())
def test_a_generated_decoder_answers_as_its_field_checkers_do_for_edge_values(cls, data):
    values = st.sampled_from(_EDGE_VALUES) | st.lists(st.sampled_from(_EDGE_VALUES), max_size=3)
    _same_answer(cls, data.draw(st.lists(values, min_size=len(cls._fields_), max_size=len(cls._fields_))))
