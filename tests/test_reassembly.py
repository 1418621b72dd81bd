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


def test_a_session_goes_on_where_it_was_after_its_senders_process_flipped_and_back():
    """Two processes sharing a key flip the epoch we hold for the node; the one that keeps it
    never restarted its sessions, and its next message is delivered, not held for ids 1..n."""
    r = Reassembler()
    for n in (1, 2):
        assert feed(r, A, chunks(n, b"m%d" % n)) == [b"m%d" % n]
    r.drop_unfinished(A)
    assert feed(r, A, chunks(3, b"m3")) == [b"m3"]


def test_a_senders_unfinished_message_is_dropped_when_its_process_changes_and_taken_again_whole():
    r = Reassembler()
    first = chunks(1, b"0123456789abcdef", size=8)
    assert r.accept(A, first[0]) == (False, [])  # half of it: held, not acknowledged
    held = r.held(A)
    assert held > 0
    r.drop_unfinished(A)
    assert r.held(A) == 0, "what a gone process left half-sent no longer counts against the peer"
    assert feed(r, A, first) == [b"0123456789abcdef"]  # a live sender's resend is taken whole


# --- what a peer can make us hold is bounded ---

BIG = 64 * 1024 * 1024


def test_a_declared_size_is_claimed_at_the_first_chunk_and_refused_past_the_peer_budget():
    r = Reassembler()
    for msg_id in (1, 2):
        ack, ready = r.accept(A, DataChunk(S, msg_id, BIG, 0, b"x"))
        assert not ack and ready == []
    with pytest.raises(ChunkError, match="this peer's unfinished messages"):
        r.accept(A, DataChunk(S, 3, BIG, 0, b"x"))
    with pytest.raises(ChunkError, match="this peer's"):  # another session of the same peer shares it
        r.accept(A, DataChunk(S + 1, 1, BIG, 0, b"x"))
    # Another peer still has its own room, and small messages from A still flow... once A's
    # claims are given back; here A is full, B is not.
    assert r.accept(B, DataChunk(S, 1, 5, 0, b"hello")) == (True, [b"hello"])


def test_all_peers_together_are_held_to_the_total_budget():
    r = Reassembler()
    peers = [bytes([n]) * 32 for n in range(1, 10)]
    taken = 0
    for peer in peers:
        try:
            r.accept(peer, DataChunk(S, 1, BIG, 0, b"x"))
            taken += 1
        except ChunkError as exc:
            assert "all peers'" in str(exc)
    assert taken == 4
    assert r.claimed_total <= r.total_budget


def test_complete_messages_waiting_for_a_withheld_first_one_count_against_the_budget():
    r = Reassembler(peer_budget=3 * (1000 + 64 * 1024))
    for msg_id in (2, 3, 4):
        assert r.accept(A, DataChunk(S, msg_id, 1000, 0, b"y" * 1000)) == (True, [])
    with pytest.raises(ChunkError):
        r.accept(A, DataChunk(S, 5, 1000, 0, b"y" * 1000))
    # The withheld one arrives after all: everything is delivered and the claims are given back.
    r2 = Reassembler()
    for msg_id in (2, 3):
        r2.accept(A, DataChunk(S, msg_id, 3, 0, b"abc"))
    assert r2.held(A) > 0
    assert r2.accept(A, DataChunk(S, 1, 3, 0, b"one")) == (True, [b"one", b"abc", b"abc"])
    assert r2.held(A) == 0 and r2.claimed_total == 0


def test_a_whole_next_message_is_delivered_at_once_and_still_held_to_the_budgets():
    # Whole in one chunk and next in order: nothing is held for it, and the opened bytes
    # given to accept() are what is delivered (not the sealed chunk).
    r = Reassembler(peer_budget=2 * (1000 + 64 * 1024))
    assert r.accept(A, DataChunk(S, 1, 5, 0, b"sealed-bytes"[:5]), data=b"plain") == (True, [b"plain"])
    assert r.held(A) == 0
    assert r.accept(A, DataChunk(S, 1, 5, 0, b"plain")) == (True, [])  # a copy: ack again only
    # Past the budget, even a whole message is refused, as its first chunk would be.
    r.accept(A, DataChunk(S, 3, 1000, 0, b"y" * 1000))  # ahead of 2: held
    with pytest.raises(ChunkError, match="this peer's unfinished messages"):
        r.accept(A, DataChunk(S, 2, 70_000, 0, b"z" * 70_000))
    assert r.accept(A, DataChunk(S, 2, 3, 0, b"two")) == (True, [b"two", b"y" * 1000])
    assert r.held(A) == 0


def test_a_session_that_stops_making_progress_is_dropped_with_what_it_holds():
    r = Reassembler(idle_expiry=60.0)
    r.accept(A, DataChunk(S, 1, BIG, 0, b"x"), now=0.0)
    r.accept(B, DataChunk(S, 1, 10, 0, b"01234"), now=50.0)
    assert r.expire(now=59.0) == 0
    assert r.expire(now=61.0) == 1
    assert r.held(A) == 0 and r.held(B) > 0
    # A can start over in full.
    r.accept(A, DataChunk(S, 1, BIG, 0, b"x"), now=62.0)
    r.accept(A, DataChunk(S, 2, BIG, 0, b"x"), now=62.0)


def test_a_peer_keeps_a_few_sessions_and_the_channel_a_bounded_number_in_all():
    r = Reassembler(max_sessions=8)
    for session in range(100):
        r.accept(A, DataChunk(session, 1, 10, 0, b"x"))
    assert len(r._senders) == 4
    assert r.held(A) <= 4 * (10 + 64 * 1024)
    for n in range(100):
        r.accept(bytes([n]) * 32, DataChunk(S, 1, 10, 0, b"x"))
    assert len(r._senders) == 8
    assert r.claimed_total <= 8 * (10 + 64 * 1024)


def test_a_message_resent_with_another_cut_is_assembled_from_the_new_cut_alone():
    # A stream's piece, then the whole message again over punched datagrams, cut finer:
    # the first overlapping piece starts the assembly afresh, and only the new cut counts.
    r = Reassembler()
    assert r.accept(A, DataChunk(S, 1, 10, 0, b"abcdef")) == (False, [])
    assert r.accept(A, DataChunk(S, 1, 10, 2, b"cdefgh")) == (False, [])
    assert r.recut == 1
    assert r.accept(A, DataChunk(S, 1, 10, 0, b"ab")) == (False, [])
    assert r.accept(A, DataChunk(S, 1, 10, 8, b"ij")) == (True, [b"abcdefghij"])
    assert r.held(A) == 0


def test_a_message_split_into_crumbs_is_refused():
    r = Reassembler()
    with pytest.raises(ChunkError, match="more pieces"):
        for offset in range(0, 4096):
            r.accept(A, DataChunk(S, 2, 4096, offset, b"z"))
    assert r.held(A) == 0
