"""The pipeline's messages: their own tag table, on the gossip wire's codec."""

from __future__ import annotations

from dataclasses import replace

import msgpack
import pytest

from meshd import wire
from meshd.pipeline import messages

NODE_B = b"\xbb" * 32
SENDER = b"\x01" * 32

EXAMPLES: dict[int, wire.Message] = {
    messages.Activation.TAG: messages.Activation(
        req_id="r1", origin=NODE_B, pos=3, step=1, rows=1, dims=2, hidden=b"\0" * 8, tokens=(5,),
        sampling=messages.Sampling(max_tokens=8, temperature=0.7, top_k=40, seed=1, want_logits=False,
                                   top_p=0.9),
        sent_at=1.5, trace=(messages.Hop("compute", "stage-0", 0.25, ""),
                            messages.Hop("transit", "stage-0->stage-1", 0.1, "relay")),
        route=(NODE_B, SENDER), prefill=2,
    ),
    messages.Token.TAG: messages.Token(
        req_id="r1", origin=NODE_B, step=1, token=42, pos=4, done="", logits=b"",
        sampling=messages.Sampling(max_tokens=8, temperature=0.0, top_k=0, seed=0, want_logits=True),
        sent_at=2.0, trace=(),
    ),
    messages.Release.TAG: messages.Release(req_id="r1"),
    messages.StageError.TAG: messages.StageError(req_id="r1", stage="stage-2", message="stage-3 is down",
                                                         peer=NODE_B, kind=messages.HANDED_OVER),
    messages.HeadInput.TAG: messages.HeadInput(
        req_id="r1", origin=NODE_B, step=3, pos=9, hidden=b"\x00" * 16,
        sampling=messages.Sampling(max_tokens=8, temperature=0.8, top_k=20, seed=1, want_logits=False),
        sent_at=3.0, trace=(messages.Hop("compute", "stage-2", 0.5, ""),),
    ),
    messages.HeadPart.TAG: messages.HeadPart(req_id="r1", origin=NODE_B, step=3, ids=b"\x01" * 8,
                                     values=b"\x02" * 4, ms=0.25),
    messages.Batch.TAG: messages.Batch.of(
        False, [("r1", NODE_B, 7, 2, messages.Sampling(8, 0.0, 0, 0, False), (NODE_B, SENDER),
                 (messages.Hop("wait", "stage-0 batch", 1.5, ""),
                  messages.Hop("compute", "stage-0", 0.5, ""))),
                ("r2", SENDER, 3, 0, messages.Sampling(8, 0.8, 20, 4, False), (NODE_B, SENDER),
                 (messages.Hop("compute", "stage-0", 0.5, ""),))],
        b"\0" * 16, 2, 4.0, messages.Hop("transit", "stage-0->stage-1", 0.0, "direct")),
    messages.HeadParts.TAG: messages.HeadParts.of([
        messages.HeadPart("r1", NODE_B, 3, b"\x01" * 8, b"\x02" * 4, 0.25),
        messages.HeadPart("r2", NODE_B, 5, b"\x03" * 16, b"\x04" * 8, 0.25)]),
}


def test_examples_cover_every_message_type():
    assert set(EXAMPLES) == set(messages.APP_TYPES)
    for tag, msg in EXAMPLES.items():
        assert type(msg) is messages.APP_TYPES[tag] and msg.TAG == tag


def test_all_types_round_trip_in_one_payload():
    data = messages.encode_app(SENDER, *EXAMPLES.values())
    packet = messages.decode_app(data)
    assert packet.sender == SENDER and packet.messages == tuple(EXAMPLES.values())
    assert packet.version == messages.APP_VERSION


def test_a_pipeline_payload_is_not_gossip_and_gossip_is_not_a_pipeline_payload():
    # Pipeline tag 2 is gossip's Ack: told apart by the version and the body it carries.
    with pytest.raises(wire.WireError):
        wire.decode(messages.encode_app(SENDER, EXAMPLES[messages.Token.TAG]))
    gossip = wire.encode(wire.Packet(SENDER, (wire.Ping(1, NODE_B),)))
    with pytest.raises(wire.WireError):
        messages.decode_app(gossip)


def test_a_newer_pipeline_version_is_refused_by_name():
    data = msgpack.packb([messages.APP_VERSION + 1, SENDER, []], use_bin_type=True)
    with pytest.raises(wire.UnsupportedVersion, match=f"newer than ours \\({messages.APP_VERSION}\\)"):
        messages.decode_app(data)


def _stage_error(peer: object) -> bytes:
    body = [messages.StageError.TAG, ["r1", "stage-1", "m", peer, ""]]
    return msgpack.packb([messages.APP_VERSION, SENDER, [body]])


@pytest.mark.parametrize("peer", [b"", NODE_B])
def test_a_stage_error_names_a_node_or_none(peer):
    assert messages.decode_app(_stage_error(peer)).messages[0].peer == peer


@pytest.mark.parametrize("peer", [b"\xbb" * 31, b"\xbb" * 33, "", None])
def test_a_stage_error_names_a_whole_node_id_or_none(peer):
    with pytest.raises(wire.WireError):
        messages.decode_app(_stage_error(peer))


def test_a_route_longer_than_any_run_is_refused():
    msg = EXAMPLES[messages.Activation.TAG].to_body()

    def payload() -> bytes:
        return msgpack.packb([messages.APP_VERSION, SENDER, [[messages.Activation.TAG, msg]]])

    msg[-2] = [NODE_B] * wire.MAX_STAGES
    assert len(messages.decode_app(payload()).messages[0].route) == wire.MAX_STAGES
    msg[-2] = [NODE_B] * (wire.MAX_STAGES + 1)
    with pytest.raises(wire.WireError):
        messages.decode_app(payload())


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, float("nan"), float("inf"), 1, "0.9", None])
def test_a_sampling_whose_top_p_is_not_within_zero_to_one_is_refused(top_p):
    body = EXAMPLES[messages.Token.TAG].to_body()
    body[7][5] = top_p  # Token.sampling.top_p
    with pytest.raises(wire.WireError):
        messages.decode_app(msgpack.packb([messages.APP_VERSION, SENDER, [[messages.Token.TAG, body]]]))
    body[7][5] = 0.25
    decoded = messages.decode_app(msgpack.packb([messages.APP_VERSION, SENDER, [[messages.Token.TAG, body]]]))
    assert decoded.messages[0].sampling.top_p == 0.25


def test_a_sampling_without_top_p_is_refused_not_guessed():
    body = EXAMPLES[messages.Token.TAG].to_body()
    del body[7][5]
    with pytest.raises(wire.WireError, match="Sampling: expected 6 fields"):
        messages.decode_app(msgpack.packb([messages.APP_VERSION, SENDER, [[messages.Token.TAG, body]]]))


def test_a_batch_sends_what_its_rows_share_once_and_gives_back_each_rows_own_message():
    batch = EXAMPLES[messages.Batch.TAG]
    assert batch.origins == (NODE_B, SENDER) and batch.routes == ((NODE_B, SENDER),)
    # The hops every row made alike travel once; each row keeps its own earlier ones.
    assert [h.name for h in batch.trace] == ["stage-0", "stage-0->stage-1"]
    assert [[h.name for h in p] for p in batch.prefixes] == [["stage-0 batch"], []]
    one, two = messages.decode_app(messages.encode_app(SENDER, batch)).messages[0].rows()
    assert (one.req_id, one.origin, one.pos, one.step, one.rows, one.dims) == ("r1", NODE_B, 7, 2, 1, 2)
    assert [h.name for h in one.trace] == ["stage-0 batch", "stage-0", "stage-0->stage-1"]
    assert (two.req_id, two.origin, two.sampling.top_k, two.route) == ("r2", SENDER, 20, (NODE_B, SENDER))
    assert one.hidden == two.hidden == b"\0" * 8 and one.sent_at == 4.0
    head = messages.Batch(**{**_fields(batch), "head": True})
    assert [type(m).__name__ for m in head.rows()] == ["HeadInput", "HeadInput"]
    data = messages.encode_app(SENDER, EXAMPLES[messages.HeadParts.TAG])
    parts = messages.decode_app(data).messages[0].rows()
    assert [(p.req_id, p.step, p.ids, p.values) for p in parts] == [
        ("r1", 3, b"\x01" * 8, b"\x02" * 4), ("r2", 5, b"\x03" * 16, b"\x04" * 8)]


def _fields(msg: wire.Message) -> dict:
    return {name: getattr(msg, name) for name in msg.__dataclass_fields__}


def _refused(tag: int, body: list) -> None:
    with pytest.raises(wire.WireError):
        messages.decode_app(msgpack.packb([messages.APP_VERSION, SENDER, [[tag, body]]], use_bin_type=True))


@pytest.mark.parametrize("field,value", [
    ("req_ids", []),  # no rows
    ("pos", [7]),  # a column shorter than the rows
    ("prefixes", [[], [], []]),  # longer
    ("hidden", b"\0" * 12),  # not rows x dims floats
    ("dims", 0),
    ("origin_of", [0, 2]),  # names an orchestrator it does not carry
    ("sampling_of", [0, 5]),
    ("route_of", [1, 0]),
    ("origins", [b"\xbb" * 31, SENDER]),
    ("steps", [2, -1]),
])
def test_a_batch_whose_columns_do_not_add_up_is_refused_whole(field, value):
    batch = EXAMPLES[messages.Batch.TAG]
    body = batch.to_body()
    body[list(_fields(batch)).index(field)] = value
    _refused(messages.Batch.TAG, body)


@pytest.mark.parametrize("field,value", [
    ("counts", [1, 3]),  # more entries than the blobs carry
    ("counts", [1]),
    ("values", b"\x02" * 8),  # ids and values do not pair up
    ("origin_of", [0, 1]),
    ("req_ids", []),
])
def test_head_parts_whose_columns_do_not_add_up_are_refused_whole(field, value):
    parts = EXAMPLES[messages.HeadParts.TAG]
    body = parts.to_body()
    body[list(_fields(parts)).index(field)] = value
    _refused(messages.HeadParts.TAG, body)


def test_a_batch_past_its_row_limit_is_refused():
    body = EXAMPLES[messages.HeadParts.TAG].to_body()
    n = messages.MAX_BATCH_ROWS + 1
    body[:5] = [["r"] * n, [0] * n, [NODE_B], [0] * n, [0] * n]
    _refused(messages.HeadParts.TAG, body)


def test_an_undelivered_batch_fails_each_of_its_requests_once():
    from meshd.pipeline.app import per_request

    token = EXAMPLES[messages.Token.TAG]  # of r1, as the batch's first row
    msgs = (token, replace(token, step=2), EXAMPLES[messages.Batch.TAG], EXAMPLES[messages.HeadParts.TAG])
    assert [m.req_id for m in per_request(msgs)] == ["r1", "r2"]
