"""The pipeline's messages: payloads of the data channel, opaque to the mesh.

They share the gossip wire's codec (frozen records, msgpack bodies, every
field checked at decode) but have their own tag table and version, so a
pipeline change never bumps the gossip protocol, as memberlist keeps user
messages opaque.

ONLY APPEND TO THE TAG TABLE.  A tag, once shipped, keeps its meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..wire import (
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


APP_VERSION = 3  # 2: Activation.route and .prefill, StageError.peer; 3: Sampling.top_p
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
    _fields_ = (check_str, check_str, check_str, check_peer)


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


APP_TYPES: dict[int, type[Message]] = {
    cls.TAG: cls for cls in (Activation, Token, Release, StageError, HeadInput, HeadPart)
}


def encode_app(sender: bytes, *msgs: Message) -> bytes:
    """``msgs`` from ``sender`` as one data-channel payload."""
    return encode(Packet(sender, msgs, APP_VERSION), MAX_APP_BYTES)


def decode_app(data: bytes) -> Packet:
    """One data-channel payload; raises WireError (UnsupportedVersion for a newer pipeline)."""
    return decode(data, MAX_APP_BYTES, types=APP_TYPES, newest=APP_VERSION)
