"""The pipeline's messages: their own tag table, on the gossip wire's codec."""

from __future__ import annotations

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
                                                         peer=NODE_B),
    messages.HeadInput.TAG: messages.HeadInput(
        req_id="r1", origin=NODE_B, step=3, pos=9, hidden=b"\x00" * 16,
        sampling=messages.Sampling(max_tokens=8, temperature=0.8, top_k=20, seed=1, want_logits=False),
        sent_at=3.0, trace=(messages.Hop("compute", "stage-2", 0.5, ""),),
    ),
    messages.HeadPart.TAG: messages.HeadPart(req_id="r1", origin=NODE_B, step=3, ids=b"\x01" * 8,
                                     values=b"\x02" * 4, ms=0.25),
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
    body = [messages.StageError.TAG, ["r1", "stage-1", "m", peer]]
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
