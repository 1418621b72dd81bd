"""Exactly-once, in-order delivery from chunks that arrive twice, late, or over two paths."""

import pytest

from meshd.net.reassembly import ChunkError, Reassembler
from meshd.wire import DataChunk

A, B = b"a" * 32, b"b" * 32
S = 7  # the sender's session


def chunks(msg_id: int, data: bytes, size: int = 4) -> list[DataChunk]:
    offsets = range(0, max(len(data), 1), size)
    return [DataChunk(S, msg_id, len(data), off, data[off:off + size]) for off in offsets]


def feed(r: Reassembler, sender: bytes, items) -> list[bytes]:
    out = []
    for c in items:
        out += r.accept(sender, c)[1]
    return out


def test_a_message_resent_over_another_path_halfway_is_delivered_once():
    r = Reassembler()
    first = chunks(1, b"hello world!")
    # Half went over the direct stream before it broke; the whole message is resent via the relay.
    assert feed(r, A, first[:2]) == []
    assert feed(r, A, first) == [b"hello world!"]
    assert feed(r, A, first) == []  # a third copy: acked again, never delivered again
    ack, ready = r.accept(A, first[0])
    assert ack and ready == []


def test_messages_wait_for_earlier_ids_and_senders_are_independent():
    r = Reassembler()
    assert feed(r, A, chunks(2, b"second")) == []
    assert feed(r, B, chunks(1, b"from b")) == [b"from b"]
    assert feed(r, A, chunks(1, b"first")) == [b"first", b"second"]
    assert feed(r, A, chunks(3, b"")) == [b""]


def test_ack_only_when_whole():
    r = Reassembler()
    parts = chunks(1, b"12345678")
    assert r.accept(A, parts[0]) == (False, [])
    assert r.accept(A, parts[1]) == (True, [b"12345678"])


@pytest.mark.parametrize(
    "bad",
    [
        DataChunk(S, 1, 4, 2, b"xyz"),  # runs past the end
        DataChunk(S, 10_000, 4, 0, b"x"),  # far ahead of anything delivered
    ],
)
def test_contradictions_are_refused(bad):
    with pytest.raises(ChunkError):
        Reassembler().accept(A, bad)


def test_a_message_cannot_change_its_size():
    r = Reassembler()
    r.accept(A, DataChunk(S, 1, 8, 0, b"1234"))
    with pytest.raises(ChunkError, match="changed its size"):
        r.accept(A, DataChunk(S, 1, 9, 4, b"5678"))


def test_a_restarted_sender_starts_a_new_session():
    r = Reassembler()
    assert feed(r, A, chunks(1, b"old run")) == [b"old run"]
    fresh = [DataChunk(S + 1, c.msg_id, c.total, c.offset, c.chunk) for c in chunks(1, b"new run")]
    assert feed(r, A, fresh) == [b"new run"]
