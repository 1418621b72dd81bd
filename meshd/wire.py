"""Every message meshd puts on the wire, and the one codec for them.

A packet is a msgpack array ``[version, sender, [[tag, body], ...]]``.  Each
message is a frozen dataclass with an integer tag and a body that is the list
of its fields in declaration order.  Decoding untrusted bytes raises only
:class:`WireError` (or its subclass :class:`UnsupportedVersion`); the receive
loop turns that into a counter, never a crash.

ONLY APPEND TO THE TAG TABLE.  A tag, once shipped, keeps its meaning.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

# 2: DataChunk.ack_now; 3: HeadInput, HeadPart; 4: stream handshake; 5: its epochs;
# 6: Meta.epoch and Meta.checkpoint, names keyed by (name, owner) with a signature field;
# 7: signed facts (Alive, Suspect, Dead, MemberState, PathSummary), Meta.dh and Meta.keyring,
# the handshake's key exchange and mesh-key proof, KeyringChange; 8: Meta.relays, relay peer lists;
# 9: Meta.nat, Punch, PunchAck, CallMeMaybe, PathEntry.punched
PROTOCOL_VERSION = 9

# A UDP datagram carries at most 65507 bytes of payload; we stay below it.
MAX_PACKET_BYTES = 60_000
# Push-pull may travel over a stream, where full state can be larger.
MAX_STREAM_BYTES = 4 * 1024 * 1024
# Gossip piggybacked on a probe should fit one Ethernet frame.
GOSSIP_BUDGET_BYTES = 1_200
MAX_MESSAGES_PER_PACKET = 512
MAX_STR = 512
MAX_ADDRS = 8
MAX_RELAYS = 8  # relays one member lists in its metadata
MAX_PUSHPULL_MEMBERS = 4_096
MAX_PUSHPULL_NAMES = 1_024
NODE_ID_BYTES = 32
_U64_MAX = 2**64 - 1
# Counters a node advances past what it hears (incarnations, name clocks, path
# summary versions, metadata generations) stay at or below this: a node can
# always encode the value it answers with (see ``next_counter``).
COUNTER_MAX = 2**63 - 1
# Stage numbers and stage counts: far above any real pipeline.
MAX_STAGES = 4096
MAX_BATCH_ROWS = 4096  # rows of one pipeline batch message: a stage's --max-batch at most
# The data channel: one message (an activation) may be up to 64 MiB, sent in chunks.
MAX_DATA_MESSAGE_BYTES = 64 * 1024 * 1024 + 64 * 1024
MAX_CHUNK_BYTES = 1024 * 1024
# A stream frame holds one chunk plus its envelope.
MAX_FRAME_BYTES = MAX_CHUNK_BYTES + 1024
# First byte of a relay payload that carries a data-channel frame (a packet follows);
# any other relay payload is a gossip packet.
RELAY_DATA = b"D"


class WireError(Exception):
    """Bytes that are not a valid meshd packet."""


class UnsupportedVersion(WireError):
    """A packet from a node speaking a newer protocol than ours."""

    def __init__(self, version: int, ours: int = PROTOCOL_VERSION) -> None:
        super().__init__(f"protocol version {version} is newer than ours ({ours})")
        self.version = version


# --- field checkers: each takes a decoded value and returns it, or raises ---


def _uint(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= _U64_MAX:
        raise WireError(f"expected an unsigned integer, got {type(value).__name__}")
    return value


def _counter(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= COUNTER_MAX:
        raise WireError(f"expected a counter in [0, 2^63), got {type(value).__name__}")
    return value


def next_counter(value: int) -> int:
    """``value + 1``, held at COUNTER_MAX: what a node answers a counter with stays encodable
    and within what every peer's decoder takes."""
    return value + 1 if value < COUNTER_MAX else COUNTER_MAX


def _stage(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= MAX_STAGES:
        raise WireError(f"expected a stage number in [0, {MAX_STAGES}]")
    return value


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise WireError(f"expected a boolean, got {type(value).__name__}")
    return value


def _str(value: Any) -> str:
    if type(value) is not str or len(value) > MAX_STR:
        raise WireError(f"expected a string of at most {MAX_STR} characters")
    return value


def _node_id(value: Any) -> bytes:
    if type(value) is not bytes or len(value) != NODE_ID_BYTES:
        raise WireError("expected a 32-byte node id")
    return value


def _float(value: Any) -> float:
    if type(value) is not float or not math.isfinite(value):
        raise WireError("expected a finite float")
    return value


def _blob(value: Any) -> bytes:
    if type(value) is not bytes or len(value) > MAX_DATA_MESSAGE_BYTES:
        raise WireError("expected bytes within the data message limit")
    return value


def _chunk(value: Any) -> bytes:
    if type(value) is not bytes or len(value) > MAX_CHUNK_BYTES:
        raise WireError(f"expected a data chunk of at most {MAX_CHUNK_BYTES} bytes")
    return value


def _claim_signature(value: Any) -> bytes:
    if type(value) is not bytes or len(value) not in (0, 64):
        raise WireError("expected an empty or 64-byte signature")
    return value


# An X25519 public key (32 bytes), or empty where a node has none.
DH_KEY_BYTES = 32


def _dh_key(value: Any) -> bytes:
    if type(value) is not bytes or len(value) not in (0, DH_KEY_BYTES):
        raise WireError(f"expected an empty or {DH_KEY_BYTES}-byte key")
    return value


# Mesh key ids: short hex digests of the keys (never the keys themselves).
MAX_KEY_ID_CHARS = 16
MAX_KEYRING = 8


def _key_id(value: Any) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_KEY_ID_CHARS:
        raise WireError(f"expected a key id of at most {MAX_KEY_ID_CHARS} characters")
    return value


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def checker(value: Any) -> Any:
        return None if value is None else check(value)

    return checker


def _tuple_of(check: Callable[[Any], Any], limit: int) -> Callable[[Any], tuple]:
    def checker(value: Any) -> tuple:
        if type(value) is not list or len(value) > limit:
            raise WireError(f"expected a list of at most {limit} items")
        return tuple(map(check, value))

    checker.each, checker.limit = check, limit  # type: ignore[attr-defined]  # for _decoder
    return checker


def _nested(cls: type[_Record]) -> Callable[[Any], Any]:
    return cls.from_body


# The checkers a record's decoder tests in line (see ``_decoder``): each one's condition for
# raising, of the value ``{v}``, over the names in _INLINE_NAMES.  Each must hold exactly
# when its checker raises (tests/test_wire.py checks them against each other).
_INLINE: dict[Callable[[Any], Any], str] = {
    _uint: "type({v}) is not int or not 0 <= {v} <= _U64_MAX",
    _counter: "type({v}) is not int or not 0 <= {v} <= COUNTER_MAX",
    _bool: "type({v}) is not bool",
    _str: "type({v}) is not str or len({v}) > MAX_STR",
    _node_id: "type({v}) is not bytes or len({v}) != NODE_ID_BYTES",
    _float: "type({v}) is not float or not _isfinite({v})",
    _blob: "type({v}) is not bytes or len({v}) > MAX_DATA_MESSAGE_BYTES",
    _chunk: "type({v}) is not bytes or len({v}) > MAX_CHUNK_BYTES",
    _dh_key: "type({v}) is not bytes or len({v}) not in (0, DH_KEY_BYTES)",
    _claim_signature: "type({v}) is not bytes or len({v}) not in (0, 64)",
}
_INLINE_NAMES: dict[str, Any] = {
    "_U64_MAX": _U64_MAX, "COUNTER_MAX": COUNTER_MAX, "MAX_STR": MAX_STR, "NODE_ID_BYTES": NODE_ID_BYTES,
    "_isfinite": math.isfinite, "MAX_DATA_MESSAGE_BYTES": MAX_DATA_MESSAGE_BYTES,
    "MAX_CHUNK_BYTES": MAX_CHUNK_BYTES, "DH_KEY_BYTES": DH_KEY_BYTES,
}


class _Record:
    """Shared codec for the frozen dataclasses below.

    ``_fields_`` lists one checker per dataclass field, in order.
    """

    _fields_: ClassVar[tuple[Callable[[Any], Any], ...]] = ()

    def to_body(self) -> list:
        return [_plain(getattr(self, f.name)) for f in dataclasses.fields(self)]  # type: ignore[arg-type]

    @classmethod
    def from_body(cls, body: Any) -> Any:
        decode = _decoders.get(cls)
        if decode is None:
            decode = _decoders[cls] = _decoder(cls)
        return decode(body)


# Each record's decoder, made on its first use (``_decoder``).
_decoders: dict[type, Callable[[Any], Any]] = {}


def _decoder(cls: type[_Record]) -> Callable[[Any], Any]:
    """``cls.from_body`` as one function of its own: each field's check in line where the
    checker is one of ``_INLINE``'s (the checker itself is called only to raise its error),
    a call to the checker otherwise.  The same answers and errors as calling every field's
    checker in turn, with a fraction of the calls: a pipeline step decodes a dozen fields
    on every hop, the first work of a process just woken."""
    fields = cls._fields_
    names = [f"v{i}" for i in range(len(fields))]
    env: dict[str, Any] = {"WireError": WireError, "cls": cls, **_INLINE_NAMES}
    lines = ["def from_body(body):",
             f"    if type(body) is not list or len(body) != {len(fields)}:",
             f"        raise WireError({f'{cls.__name__}: expected {len(fields)} fields'!r})"]
    if fields:
        lines.append(f"    {', '.join(names)}, = body")
    for i, check in enumerate(fields):
        env[f"c{i}"] = check
        each = getattr(check, "each", None)
        if check in _INLINE:
            lines += [f"    if {_INLINE[check].format(v=f'v{i}')}:", f"        c{i}(v{i})"]
        elif each in _INLINE:  # a list of such values: as the checker does, element by element
            env[f"e{i}"] = each
            lines += [f"    if type(v{i}) is not list or len(v{i}) > {check.limit}:",  # type: ignore[attr-defined]
                      f"        c{i}(v{i})",
                      f"    for x in v{i}:",
                      f"        if {_INLINE[each].format(v='x')}:",
                      f"            e{i}(x)",
                      f"    v{i} = tuple(v{i})"]
        else:
            lines.append(f"    v{i} = c{i}(v{i})")
    lines.append(f"    return cls({', '.join(names)})")
    exec("\n".join(lines), env)  # noqa: S102  # our own source, from the field checkers above
    return env["from_body"]


def _plain(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_body()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


# What a node learned of its own NAT from two STUN servers: "none" (they saw our own
# address), "endpoint-independent" (one public mapping, whoever we send to: punchable) or
# "symmetric" (a mapping per destination: what a peer learns of it is no use to another).
NAT_KINDS = ("", "none", "endpoint-independent", "symmetric")


def _nat_kind(value: Any) -> str:
    if value not in NAT_KINDS:
        raise WireError("expected a NAT kind: none, endpoint-independent or symmetric")
    return value


# --- records nested inside messages ---


@dataclass(frozen=True, slots=True)
class Meta(_Record):
    """What a member says about itself; carried by Alive and push-pull."""

    role: str = "stage"
    stage: int | None = None
    stages: int | None = None
    addrs: tuple[str, ...] = ()
    relay_url: str | None = None
    version: str = ""
    generation: int = 0
    epoch: int = 0  # this process's random id: a new one under a known node id is a restart
    checkpoint: str = ""  # fingerprint of the checkpoint served (config and weights); "" for none
    draining: bool = False  # leaving soon: takes no new requests, finishes or hands over its own
    dh: bytes = b""  # this process's X25519 public key: data-channel keys with it derive from it
    keyring: tuple[str, ...] = ()  # ids of the mesh keys it holds, the one it sends with first
    relays: tuple[str, ...] = ()  # every relay it holds, its home relay (relay_url) first
    nat: str = ""  # its NAT's mapping as two STUN servers saw it (NAT_KINDS); "" if not known
    started: int = 0  # when this process started, seconds since 1970: of two under one id, the first keeps it

    _fields_ = (_str, _optional(_stage), _optional(_stage), _tuple_of(_str, MAX_ADDRS),
                _optional(_str), _str, _counter, _counter, _str, _bool, _dh_key,
                _tuple_of(_key_id, MAX_KEYRING), _tuple_of(_str, MAX_RELAYS), _nat_kind, _counter)

    @property
    def relay_urls(self) -> tuple[str, ...]:
        """The relays it can be reached over, its home relay first."""
        if self.relays:
            return self.relays
        return (self.relay_url,) if self.relay_url else ()

    @property
    def name(self) -> str:
        """The run name of this member: ``orchestrator`` or ``stage-K``."""
        if self.role == "stage" and self.stage is not None:
            return f"stage-{self.stage}"
        return self.role


# Member states as they travel in push-pull.
STATE_ALIVE, STATE_SUSPECT, STATE_DEAD, STATE_LEFT = 0, 1, 2, 3


def _state(value: Any) -> int:
    if value not in (STATE_ALIVE, STATE_SUSPECT, STATE_DEAD, STATE_LEFT) or type(value) is not int:
        raise WireError("unknown member state")
    return value


@dataclass(frozen=True, slots=True)
class MemberState(_Record):
    """One member in push-pull.  ``sig`` is the member's own: over its Alive (node,
    incarnation, addr, meta) for every state but left, over its leave for left."""

    node: bytes
    addr: str
    incarnation: int
    state: int
    meta: Meta
    sig: bytes = b""

    _fields_ = (_node_id, _str, _counter, _state, _nested(Meta), _claim_signature)


# --- messages: ONLY APPEND, never renumber ---


class Message(_Record):
    TAG: ClassVar[int]
    # The message's encoding, filled on first use: a fact is piggybacked many
    # times, and the object is immutable, so it is packed once.
    __slots__ = ("_wire",)
    _wire: bytes


@dataclass(frozen=True, slots=True)
class Ping(Message):
    TAG = 1
    seq: int
    target: bytes  # the node we mean to reach; a reused address must not ack for it
    _fields_ = (_uint, _node_id)


@dataclass(frozen=True, slots=True)
class PingReq(Message):
    TAG = 2
    seq: int
    target: bytes
    target_addr: str
    nack: bool  # ask the helper to say so if the target stays silent
    _fields_ = (_uint, _node_id, _str, _bool)


@dataclass(frozen=True, slots=True)
class Ack(Message):
    TAG = 3
    seq: int
    _fields_ = (_uint,)


@dataclass(frozen=True, slots=True)
class Nack(Message):
    TAG = 4
    seq: int
    _fields_ = (_uint,)


# Signed facts (see meshd.swim.facts): ``sig`` is empty where nobody signs (the simulator).


@dataclass(frozen=True, slots=True)
class Alive(Message):
    """``node`` says it lives at ``addr`` with ``meta``; ``sig`` is its own."""

    TAG = 5
    incarnation: int
    node: bytes
    addr: str
    meta: Meta
    sig: bytes = b""
    _fields_ = (_counter, _node_id, _str, _nested(Meta), _claim_signature)


@dataclass(frozen=True, slots=True)
class Suspect(Message):
    """``sender`` suspects ``node``; ``sig`` is the accuser's."""

    TAG = 6
    incarnation: int
    node: bytes
    sender: bytes  # who suspects; independent senders shorten the timer
    sig: bytes = b""
    _fields_ = (_counter, _node_id, _node_id, _claim_signature)


@dataclass(frozen=True, slots=True)
class Dead(Message):
    """``sender`` declares ``node`` dead, or (sender == node) ``node`` leaves; ``sig`` is the sender's."""

    TAG = 7
    incarnation: int
    node: bytes
    sender: bytes  # sender == node means a graceful leave
    sig: bytes = b""
    _fields_ = (_counter, _node_id, _node_id, _claim_signature)


@dataclass(frozen=True, slots=True)
class NameClaim(Message):
    """One entry of the name registry: ``owner``'s claim on ``name`` (or its tombstone).

    Entries are keyed by (name, owner); ``clock`` is the owner's own, and only a
    newer entry from the same key replaces one.  ``sig`` is the owner's signature
    over the entry once signed facts exist; empty until then.
    """

    TAG = 9
    name: str
    owner: bytes
    clock: int
    tombstone: bool
    sig: bytes = b""
    _fields_ = (_str, _node_id, _counter, _bool, _claim_signature)

    @property
    def key(self) -> tuple[str, bytes]:
        return self.name, self.owner

    def beats(self, other: NameClaim) -> bool:
        """Newer than ``other`` for the same key; a tombstone wins a tie (the owner went)."""
        return (self.clock, self.tombstone) > (other.clock, other.tombstone)


@dataclass(frozen=True, slots=True)
class PushPull(Message):
    """Full state, sent periodically and on join; ``reply`` asks for ours back."""

    TAG = 8
    join: bool
    reply: bool
    members: tuple[MemberState, ...]
    names: tuple[NameClaim, ...]
    _fields_ = (_bool, _bool, _tuple_of(_nested(MemberState), MAX_PUSHPULL_MEMBERS),
                _tuple_of(_nested(NameClaim), MAX_PUSHPULL_NAMES))


def _data_total(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= MAX_DATA_MESSAGE_BYTES:
        raise WireError(f"a data message holds at most {MAX_DATA_MESSAGE_BYTES} bytes")
    return value


@dataclass(frozen=True, slots=True)
class DataChunk(Message):
    """Part of one data-channel message; ``msg_id`` counts up per sender and receiver."""

    TAG = 10
    session: int  # random per sending process: a restarted peer starts afresh
    msg_id: int
    total: int  # bytes in the whole message
    offset: int
    chunk: bytes
    ack_now: bool = False  # someone waits on this message: acknowledge without delay
    _fields_ = (_uint, _counter, _data_total, _data_total, _chunk, _bool)


@dataclass(frozen=True, slots=True)
class DataAck(Message):
    """The receiver holds message ``msg_id`` whole; the sender may stop resending it."""

    TAG = 11
    session: int
    msg_id: int
    _fields_ = (_uint, _uint)


# --- the data channel's stream handshake: each end proves its node id ---

STREAM_NONCE_BYTES = 16
SIGNATURE_BYTES = 64


def _nonce(value: Any) -> bytes:
    if type(value) is not bytes or len(value) != STREAM_NONCE_BYTES:
        raise WireError(f"expected a {STREAM_NONCE_BYTES}-byte nonce")
    return value


def _mesh_proof(value: Any) -> bytes:
    if type(value) is not bytes or len(value) > 64:
        raise WireError("expected a mesh-key proof of at most 64 bytes")
    return value


def _signature(value: Any) -> bytes:
    if type(value) is not bytes or len(value) != SIGNATURE_BYTES:
        raise WireError(f"expected a {SIGNATURE_BYTES}-byte signature")
    return value


@dataclass(frozen=True, slots=True)
class StreamChallenge(Message):
    """The first frame on an accepted data stream: sign this to say who you are.
    ``epoch`` is the sender's process epoch (random per process: a new one means a restart)."""

    TAG = 19
    nonce: bytes
    epoch: int
    dh: bytes = b""  # the sender's X25519 public key for this process (data-channel keys)
    _fields_ = (_nonce, _counter, _dh_key)


@dataclass(frozen=True, slots=True)
class StreamProof(Message):
    """The packet's sender signed the other end's nonce and its own ``epoch`` (see
    ``meshd.net.handshake``); ``nonce`` is the sender's own challenge back, for the
    dialler's first proof."""

    TAG = 20
    nonce: bytes
    signature: bytes
    epoch: int
    dh: bytes = b""  # the sender's X25519 public key for this process (data-channel keys)
    mesh_proof: bytes = b""  # with a mesh key: its id and a MAC over the handshake (see handshake.py)
    _fields_ = (_nonce, _signature, _counter, _dh_key, _mesh_proof)


# --- path summaries: each node's own outbound view, gossiped for the topology ---

MAX_PATH_ENTRIES = 64
MAX_REASON_CHARS = 48
MAX_RELAY_URL_CHARS = 96  # in a path entry: longer ones are left out


def _path_name(value: Any) -> str:
    if value not in ("direct", "relay", "none"):
        raise WireError("expected a path: direct, relay or none")
    return value


def _relay_url(value: Any) -> str:
    if type(value) is not str or len(value) > MAX_RELAY_URL_CHARS:
        raise WireError(f"expected a relay URL of at most {MAX_RELAY_URL_CHARS} characters")
    return value


def _reason(value: Any) -> str:
    if type(value) is not str or len(value) > MAX_REASON_CHARS:
        raise WireError(f"expected a reason of at most {MAX_REASON_CHARS} characters")
    return value


@dataclass(frozen=True, slots=True)
class PathEntry(_Record):
    """How ``node`` reaches ``peer``: the path, the last RTT (microseconds, 0 = unknown),
    direct probes that went unanswered, why the last one failed ("" if none), and for how
    long this path has carried the direction (milliseconds when the summary was made), and
    the relay that carries it ("" unless the path is the relay)."""

    peer: bytes
    path: str
    rtt_us: int
    direct_failures: int
    reason: str
    since_ms: int
    relay: str = ""
    punched: bool = False  # a direct path through the peer's NAT, opened by hole punching
    _fields_ = (_node_id, _path_name, _uint, _uint, _reason, _uint, _relay_url, _bool)


@dataclass(frozen=True, slots=True)
class PathSummary(Message):
    """``node``'s outbound paths; a higher ``version`` from the same node replaces a lower."""

    TAG = 16
    node: bytes
    version: int
    entries: tuple[PathEntry, ...]
    sig: bytes = b""  # ``node``'s own
    _fields_ = (_node_id, _counter, _tuple_of(_nested(PathEntry), MAX_PATH_ENTRIES), _claim_signature)


KEYRING_OPS = ("install", "use", "remove")


def _keyring_op(value: Any) -> str:
    if value not in KEYRING_OPS:
        raise WireError("expected a keyring operation: install, use or remove")
    return value


def _mesh_key(value: Any) -> bytes:
    if type(value) is not bytes or len(value) not in (0, 32):
        raise WireError("expected an empty or 32-byte mesh key")
    return value


@dataclass(frozen=True, slots=True)
class KeyringChange(Message):
    """``issuer`` changes every member's mesh keyring: install ``key``, or use or remove the
    key ``key_id``.  Gossiped inside packets sealed with the mesh key; ``clock`` is the
    issuer's own and ``sig`` its signature, so a change is applied once and by nobody's
    word but a member's."""

    TAG = 21
    issuer: bytes
    clock: int
    op: str
    key_id: str
    key: bytes  # the key itself for install, empty otherwise
    sig: bytes = b""
    _fields_ = (_node_id, _counter, _keyring_op, _key_id, _mesh_key, _claim_signature)


# --- hole punching (see meshd.swim.punch) ---


@dataclass(frozen=True, slots=True)
class Punch(Message):
    """Sent to each address ``target`` may be reached at, when our direct pings go
    unanswered; it opens our NAT towards that address, and the one that answers is the path."""

    TAG = 22
    nonce: int
    target: bytes
    _fields_ = (_uint, _node_id)


@dataclass(frozen=True, slots=True)
class PunchAck(Message):
    """The answer to ``Punch``, sent to the address it came from; ``seen`` is that address
    as the answering end saw it (the sender's mapping on this path)."""

    TAG = 23
    nonce: int
    seen: str
    _fields_ = (_uint, _str)


@dataclass(frozen=True, slots=True)
class CallMeMaybe(Message):
    """Over the relay: our direct pings to you go unanswered; punch towards ``addrs`` (ours),
    so your NAT lets our packets in."""

    TAG = 24
    addrs: tuple[str, ...]
    _fields_ = (_tuple_of(_str, MAX_ADDRS),)


# Tags 12-15, 17 and 18 are taken (they carried pipeline messages, which now travel as
# data-channel payloads with their own table: meshd.pipeline.messages); never reuse them.
MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TAG: cls
    for cls in (Ping, PingReq, Ack, Nack, Alive, Suspect, Dead, PushPull, NameClaim, DataChunk, DataAck,
                PathSummary, StreamChallenge, StreamProof, KeyringChange, Punch, PunchAck, CallMeMaybe)
}


@dataclass(frozen=True, slots=True)
class Packet:
    sender: bytes
    messages: tuple[Message, ...]
    version: int = PROTOCOL_VERSION


def encode_message(msg: Message) -> list:
    return [msg.TAG, msg.to_body()]


_getters: dict[type, Callable[[Any], Any]] = {}


def _shallow_body(obj: Any) -> Any:
    """msgpack's ``default`` hook: a record becomes the tuple of its fields.

    Nested records come back through this hook; tuples pack as arrays, so the
    bytes equal those of ``packb(encode_message(msg))``.
    """
    getter = _getters.get(type(obj))
    if getter is None:
        if not isinstance(obj, _Record):
            raise TypeError(f"cannot encode {type(obj).__name__}")
        names = [f.name for f in dataclasses.fields(obj)]  # type: ignore[arg-type]
        if len(names) == 1:
            one = operator.attrgetter(names[0])
            getter = lambda o: (one(o),)  # noqa: E731
        else:
            getter = operator.attrgetter(*names)
        _getters[type(obj)] = getter
    return getter(obj)


def _message_bytes(msg: Message) -> bytes:
    try:
        return msg._wire
    except AttributeError:
        data = msgpack.packb((msg.TAG, msg), use_bin_type=True, default=_shallow_body)
        object.__setattr__(msg, "_wire", data)
        return data


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 65536:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode(packet: Packet, max_bytes: int = MAX_PACKET_BYTES) -> bytes:
    # Byte for byte ``packb([version, sender, [[tag, body], ...]])``, from each
    # message's cached encoding.
    head = msgpack.packb(packet.version) + msgpack.packb(packet.sender, use_bin_type=True)
    messages = packet.messages
    data = b"".join([b"\x93", head, _array_header(len(messages)), *map(_message_bytes, messages)])
    if len(data) > max_bytes:
        raise WireError(f"packet of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    return data


@functools.lru_cache(maxsize=64)
def _head_size(version: int, sender_len: int) -> int:
    # The array marker, the version and the sender: fixed for a version and id length.
    return 1 + len(msgpack.packb(version)) + len(msgpack.packb(b"\0" * sender_len, use_bin_type=True))


def packet_size(packet: Packet) -> int:
    """``len(encode(packet))`` without building the bytes (for simulations)."""
    messages = packet.messages
    n = len(messages)
    total = _head_size(packet.version, len(packet.sender)) + (1 if n < 16 else 3 if n < 65536 else 5)
    for msg in messages:
        try:
            total += len(msg._wire)
        except AttributeError:
            total += len(_message_bytes(msg))
    return total


def encoded_size(msg: Message) -> int:
    """Bytes this message adds to a packet."""
    return len(_message_bytes(msg))


# Overhead of the packet envelope around its messages (version, sender, list header).
PACKET_OVERHEAD = len(msgpack.packb([PROTOCOL_VERSION, b"\0" * NODE_ID_BYTES, [0] * 16])) - 16


def packet_sender(data: bytes) -> bytes:
    """The sender a packet claims, read from its first bytes without decoding the rest.

    For a relay (and a node receiving over one), which must check the claim
    against the id its connection proved.  Raises WireError when the bytes do
    not start like a packet.
    """
    try:
        unpacker = msgpack.Unpacker(max_bin_len=NODE_ID_BYTES, max_str_len=0, max_array_len=0,
                                    max_map_len=0, max_ext_len=0)
        unpacker.feed(data[:64])
        if unpacker.read_array_header() != 3:
            raise WireError("packet is not [version, sender, messages]")
        version = unpacker.unpack()
        sender = unpacker.unpack()
    except WireError:
        raise
    except Exception as exc:  # msgpack's many error types all mean "not a packet"
        raise WireError(f"not a packet: {exc.__class__.__name__}") from exc
    if type(version) is not int:
        raise WireError("bad protocol version")
    return _node_id(sender)


def decode(data: bytes, max_bytes: int = MAX_PACKET_BYTES, *,
           types: dict[int, type[Message]] = MESSAGE_TYPES, newest: int = PROTOCOL_VERSION) -> Packet:
    """Parse one packet of ``types`` (gossip's by default) at protocol ``newest`` or older.

    Raises WireError, and nothing else, on bad input.
    """
    if len(data) > max_bytes:
        raise WireError(f"packet of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_bin_len=max_bytes,
            max_str_len=max_bytes,
            max_array_len=MAX_PUSHPULL_MEMBERS,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types; all mean "garbage"
        raise WireError(f"not msgpack: {exc.__class__.__name__}") from exc
    if type(raw) is not list or len(raw) != 3:
        raise WireError("packet is not [version, sender, messages]")
    version, sender, messages = raw
    if type(version) is not int or version < 1:
        raise WireError("bad protocol version")
    if version > newest:
        raise UnsupportedVersion(version, newest)
    sender = _node_id(sender)
    if type(messages) is not list or len(messages) > MAX_MESSAGES_PER_PACKET:
        raise WireError("bad message list")
    out = []
    for item in messages:
        if type(item) is not list or len(item) != 2:
            raise WireError("message is not [tag, body]")
        tag, body = item
        if type(tag) is not int:
            # Never repr() untrusted structures: a deeply nested one overflows the stack.
            raise WireError(f"message tag is a {type(tag).__name__}, not an integer")
        cls = types.get(tag)
        if cls is None:
            raise WireError(f"unknown message tag {tag}")
        out.append(cls.from_body(body))
    return Packet(sender=sender, messages=tuple(out), version=version)


# The codec's parts, for message types defined beside their service (the pipeline's,
# in meshd.pipeline.messages): same checks, same encoding, their own tag table.
Record = _Record
check_uint, check_str, check_bool, check_float = _uint, _str, _bool, _float
check_node_id, check_blob = _node_id, _blob
optional, tuple_of, nested = _optional, _tuple_of, _nested
