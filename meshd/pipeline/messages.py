"""The pipeline's messages: payloads of the data channel, opaque to the mesh.

They share the gossip wire's codec (frozen records, msgpack bodies, every
field checked at decode) but have their own tag table and version, so a
pipeline change never bumps the gossip protocol, as memberlist keeps user
messages opaque.

ONLY APPEND TO THE TAG TABLE.  A tag, once shipped, keeps its meaning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..wire import (
    MAX_BATCH_ROWS,
    MAX_DATA_MESSAGE_BYTES,
    MAX_STAGES,
    Message,
    Packet,
    Record,
    WireError,
    check_blob,
    check_bool,
    check_float,
    check_node_id,
    check_str,
    check_uint,
    decode,
    encode,
    nested,
    tuple_of,
)


def check_peer(value: object) -> bytes:
    return b"" if value == b"" else check_node_id(value)


APP_VERSION = 5  # 2: Activation.route and .prefill, StageError.peer; 3: Sampling.top_p; 4: Batch, HeadParts;
# 5: StageError.kind
# A message and its envelope: an activation may be as large as the data channel carries.
MAX_APP_BYTES = MAX_DATA_MESSAGE_BYTES + 4096

def check_top_p(value: object) -> float:
    """A nucleus share: a float in (0, 1] (the sampler refuses anything else, so the decoder does)."""
    top_p = check_float(value)
    if not 0 < top_p <= 1:
        raise WireError(f"top_p {top_p!r} outside (0, 1]")
    return top_p


@dataclass(frozen=True, slots=True)
class Sampling(Record):
    max_tokens: int
    temperature: float
    top_k: int
    seed: int
    want_logits: bool  # send each step's logits back (tests compare them)
    top_p: float = 1.0  # nucleus sampling's share; 1 keeps every candidate
    _fields_ = (check_uint, check_float, check_uint, check_uint, check_bool, check_top_p)


@dataclass(frozen=True, slots=True)
class Hop(Record):
    """One line of an activation's trace: a stage's compute or a hop's transit."""

    kind: str  # "compute" or "transit"
    name: str  # "stage-1" or "stage-0->stage-1"
    ms: float
    path: str  # for transit: "direct" or "relay"
    _fields_ = (check_str, check_str, check_float, check_str)


_trace = tuple_of(nested(Hop), 64)


@dataclass(frozen=True, slots=True)
class Activation(Message):
    """Hidden states for positions [pos, pos + rows) of request ``req_id``, on their way
    to the next stage; stage 0 sends token ids (``tokens``) to itself this way too."""

    TAG = 1
    req_id: str
    origin: bytes  # the orchestrator, who gets the tokens
    pos: int
    step: int  # the index of the token this pass will produce
    rows: int
    dims: int
    hidden: bytes  # (rows, dims) float32, C order
    tokens: tuple[int, ...]  # for stage 0: the ids to embed
    sampling: Sampling
    sent_at: float  # sender's wall clock, for transit time
    trace: tuple[Hop, ...]
    route: tuple[bytes, ...]  # the node serving each stage for this request, stage 0 first
    # Rows [0, prefill) run as one forward pass, then each later row alone: a failover replay
    # (the prompt, then every token so far) in the shapes of the original run.  0: all at once.
    prefill: int = 0
    _fields_ = (check_str, check_node_id, check_uint, check_uint, check_uint, check_uint, check_blob,
                tuple_of(check_uint, 65536), nested(Sampling), check_float, _trace,
                tuple_of(check_node_id, MAX_STAGES), check_uint)


@dataclass(frozen=True, slots=True)
class Token(Message):
    """The last stage's sample for step ``step``; to the orchestrator and back to stage 0."""

    TAG = 2
    req_id: str
    origin: bytes
    step: int
    token: int
    pos: int  # where this token goes when fed back
    done: str  # "" while generating, else "eos" or "length"
    logits: bytes  # (vocab,) float32 when asked for, else empty
    sampling: Sampling
    sent_at: float
    trace: tuple[Hop, ...]
    _fields_ = (check_str, check_node_id, check_uint, check_uint, check_uint, check_str, check_blob,
                nested(Sampling), check_float, _trace)


@dataclass(frozen=True, slots=True)
class Release(Message):
    """Request ``req_id`` is over: drop its KV cache, and pass this on down the chain."""

    TAG = 3
    req_id: str
    _fields_ = (check_str,)


# What a draining stage's hand-over says, for people.
HANDING_OVER = "is draining: handing the request over"
# StageError.kind: what the orchestrator does about it beyond its text.
HANDED_OVER = "handed-over"  # ``peer`` is the sender, draining: go on elsewhere, never back to it
TOO_LARGE = "too-large"  # the request could never run at this stage (its KV cache): a client's error
NO_ROOM = "no-room"  # the stage's KV budget had no room for it in time: try again later
# ``peer`` runs, as far as the stage saw, yet no path carried a message to it within the send
# timeout (no direct path answered, no relay took it): a direction with no path.
UNDELIVERED = "undelivered"


@dataclass(frozen=True, slots=True)
class StageError(Message):
    """A stage could not serve ``req_id``; the orchestrator fails the request with it."""

    TAG = 4
    req_id: str
    stage: str
    message: str
    # The node that failed this request (a send to it failed, it went down, or it is
    # handing the request over): the orchestrator moves the request to a replica.
    # Empty when the stage itself failed.
    peer: bytes = b""
    kind: str = ""  # HANDED_OVER, TOO_LARGE, NO_ROOM, UNDELIVERED, or "" (as is a kind not known here)
    _fields_ = (check_str, check_str, check_str, check_peer, check_str)


@dataclass(frozen=True, slots=True)
class HeadInput(Message):
    """The last stage's final hidden state for step ``step``, normalised, sent to stage 0,
    which computes its rows of the LM head while the last stage computes the rest."""

    TAG = 5
    req_id: str
    origin: bytes
    step: int
    pos: int  # where the sampled token goes
    hidden: bytes  # (dims,) float32
    sampling: Sampling
    sent_at: float
    trace: tuple[Hop, ...]
    _fields_ = (check_str, check_node_id, check_uint, check_uint, check_blob, nested(Sampling), check_float,
                _trace)


@dataclass(frozen=True, slots=True)
class HeadPart(Message):
    """The last stage's rows of the LM head for step ``step``, cut to the entries that can
    be sampled (``meshd.pipeline.sampling.shortlist``), sent to stage 0, which samples."""

    TAG = 6
    req_id: str
    origin: bytes
    step: int
    ids: bytes  # int64 token ids, ascending
    values: bytes  # float32, one per id
    ms: float  # the last stage's compute for its rows
    _fields_ = (check_str, check_node_id, check_uint, check_blob, check_blob, check_float)


_column = tuple_of(check_uint, MAX_BATCH_ROWS)  # one number per row of a batch
_ids = tuple_of(check_str, MAX_BATCH_ROWS)
_nodes = tuple_of(check_node_id, MAX_BATCH_ROWS)
Row = tuple[str, bytes, int, int, Sampling, tuple[bytes, ...], tuple[Hop, ...]]


def _shared(items: Sequence) -> tuple[tuple, tuple[int, ...]]:
    """The distinct ``items`` in first-seen order, and each item's index among them."""
    index: dict = {}
    of = tuple(index.setdefault(item, len(index)) for item in items)
    return tuple(index), of


def common_suffix(traces: Sequence[tuple[Hop, ...]]) -> int:
    """How many hops every trace of ``traces`` ends with alike."""
    first, k = traces[0], 0
    most = min(map(len, traces))
    while k < most:
        hop = first[-1 - k]
        if not all(t[-1 - k] is hop or t[-1 - k] == hop for t in traces):
            break
        k += 1
    return k


@dataclass(frozen=True, slots=True)
class Batch(Message):
    """One-row steps of several requests that travel one hop together, as one message:
    a batch computed as one forward pass goes on as one.

    Row i of ``hidden`` (rows x dims float32) is request ``req_ids[i]`` at position
    ``pos[i]`` and step ``steps[i]``.  What rows share travels once: the distinct
    orchestrators, samplings and routes, which ``origin_of``, ``sampling_of`` and
    ``route_of`` index per row; and ``trace``, the hops the rows made together, each
    row's own earlier hops in ``prefixes[i]``.  ``head`` False: decode steps on their
    way to the next stage, row i the Activation ``rows()`` gives.  True: the last
    stage's normalised final hidden states to stage 0, row i a HeadInput (``pos`` is
    where the sampled token goes)."""

    TAG = 7
    head: bool
    req_ids: tuple[str, ...]
    pos: tuple[int, ...]
    steps: tuple[int, ...]
    origins: tuple[bytes, ...]
    origin_of: tuple[int, ...]
    samplings: tuple[Sampling, ...]
    sampling_of: tuple[int, ...]
    routes: tuple[tuple[bytes, ...], ...]
    route_of: tuple[int, ...]
    dims: int
    hidden: bytes
    sent_at: float
    trace: tuple[Hop, ...]
    prefixes: tuple[tuple[Hop, ...], ...]
    _fields_ = (check_bool, _ids, _column, _column, _nodes, _column,
                tuple_of(nested(Sampling), MAX_BATCH_ROWS), _column,
                tuple_of(tuple_of(check_node_id, MAX_STAGES), MAX_BATCH_ROWS), _column,
                check_uint, check_blob, check_float, _trace, tuple_of(_trace, MAX_BATCH_ROWS))

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        if not n or any(len(col) != n for col in (self.pos, self.steps, self.origin_of, self.sampling_of,
                                                  self.route_of, self.prefixes)):
            raise WireError(f"batch of {n} requests whose columns are not all {n} long")
        if not self.dims or len(self.hidden) != 4 * n * self.dims:
            raise WireError(f"batch of {n} rows of {self.dims} floats carries {len(self.hidden)} bytes")
        for of, shared, what in ((self.origin_of, self.origins, "origin"),
                                 (self.sampling_of, self.samplings, "sampling"),
                                 (self.route_of, self.routes, "route")):
            if max(of) >= len(shared):
                raise WireError(f"batch row names {what} {max(of)} of {len(shared)}")

    @classmethod
    def of(cls, head: bool, rows: list[Row], hidden: bytes, dims: int, sent_at: float, hop: Hop) -> Batch:
        """A batch of ``rows`` (req_id, origin, pos, step, sampling, route, trace so far)
        whose traces all go on with ``hop``; ``hidden`` their rows, C order."""
        req_ids, origins, pos, steps, samplings, routes, traces = zip(*rows, strict=True)
        k = common_suffix(traces)
        origins, origin_of = _shared(origins)
        samplings, sampling_of = _shared(samplings)
        routes, route_of = _shared(routes)
        return cls(head, req_ids, pos, steps, origins, origin_of, samplings, sampling_of, routes, route_of,
                   dims, hidden, sent_at, (*traces[0][len(traces[0]) - k:], hop),
                   tuple(t[:len(t) - k] for t in traces))

    def rows(self) -> list[Activation] | list[HeadInput]:
        """The batch as the one-row messages it carries, in order."""
        size = 4 * self.dims
        out: list = []
        for i, req_id in enumerate(self.req_ids):
            origin, s, at = self.origins[self.origin_of[i]], self.samplings[self.sampling_of[i]], self.sent_at
            hidden, trace = self.hidden[i * size:(i + 1) * size], (*self.prefixes[i], *self.trace)
            if self.head:
                out.append(HeadInput(req_id, origin, self.steps[i], self.pos[i], hidden, s, at, trace))
            else:
                out.append(Activation(req_id, origin, self.pos[i], self.steps[i], 1, self.dims, hidden, (), s,
                                      at, trace, self.routes[self.route_of[i]]))
        return out


@dataclass(frozen=True, slots=True)
class HeadParts(Message):
    """The last stage's HeadPart of several steps, as one message: row i is request
    ``req_ids[i]``'s step ``steps[i]``, its shortlist the next ``counts[i]`` entries of
    ``ids`` (int64) and ``values`` (float32)."""

    TAG = 8
    req_ids: tuple[str, ...]
    steps: tuple[int, ...]
    origins: tuple[bytes, ...]
    origin_of: tuple[int, ...]
    counts: tuple[int, ...]
    ids: bytes
    values: bytes
    ms: float
    _fields_ = (_ids, _column, _nodes, _column, _column, check_blob, check_blob, check_float)

    def __post_init__(self) -> None:
        n, total = len(self.req_ids), sum(self.counts)
        if not n or any(len(col) != n for col in (self.steps, self.origin_of, self.counts)):
            raise WireError(f"head parts of {n} requests whose columns are not all {n} long")
        if len(self.ids) != 8 * total or len(self.values) != 4 * total:
            raise WireError(f"head parts of {total} entries carry {len(self.ids)} bytes of ids and "
                            f"{len(self.values)} of values")
        if max(self.origin_of) >= len(self.origins):
            raise WireError(f"head part names origin {max(self.origin_of)} of {len(self.origins)}")

    @classmethod
    def of(cls, parts: list[HeadPart]) -> HeadParts:
        origins, origin_of = _shared([p.origin for p in parts])
        return cls(tuple(p.req_id for p in parts), tuple(p.step for p in parts), origins, origin_of,
                   tuple(len(p.values) // 4 for p in parts), b"".join(p.ids for p in parts),
                   b"".join(p.values for p in parts), parts[0].ms)

    def rows(self) -> list[HeadPart]:
        out, at = [], 0
        for i, req_id in enumerate(self.req_ids):
            end = at + self.counts[i]
            out.append(HeadPart(req_id, self.origins[self.origin_of[i]], self.steps[i],
                                self.ids[8 * at:8 * end], self.values[4 * at:4 * end], self.ms))
            at = end
        return out


APP_TYPES: dict[int, type[Message]] = {
    cls.TAG: cls for cls in (Activation, Token, Release, StageError, HeadInput, HeadPart, Batch, HeadParts)
}


def encode_app(sender: bytes, *msgs: Message) -> bytes:
    """``msgs`` from ``sender`` as one data-channel payload."""
    return encode(Packet(sender, msgs, APP_VERSION), MAX_APP_BYTES)


def decode_app(data: bytes) -> Packet:
    """One data-channel payload; raises WireError (UnsupportedVersion for a newer pipeline)."""
    return decode(data, MAX_APP_BYTES, types=APP_TYPES, newest=APP_VERSION)
