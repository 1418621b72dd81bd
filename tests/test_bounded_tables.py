"""What a node keeps per peer is bounded, and a flood of fresh node ids (anyone holding the
mesh key can make them) makes room with its own entries, never a live member's: a member's
session keeps its next message id, its process keys and its epoch, so its next message is
delivered, not acknowledged and held for ever.  Log lines anyone can cause are one a minute
per sender, with a count."""

from __future__ import annotations

from collections import OrderedDict

from meshd.bounded import evict_one
from meshd.logs import Quieted
from meshd.net import data_keys
from meshd.net.data_keys import ProcessKeys
from meshd.net.reassembly import Reassembler
from meshd.wire import DataChunk

MEMBER = b"m" * 32


def _whole(session: int, msg_id: int, data: bytes = b"step") -> DataChunk:
    return DataChunk(session, msg_id, len(data), 0, data)


def test_a_flood_of_new_senders_leaves_a_members_session_and_its_next_message_is_delivered():
    r = Reassembler(max_sessions=16, member=lambda sender: sender == MEMBER)
    for msg_id in (1, 2):
        assert r.accept(MEMBER, _whole(5, msg_id), 0.0) == (True, [b"step"])
    for n in range(200):  # fresh ids, a session each, newer than the member's
        r.accept(n.to_bytes(32, "big"), _whole(n, 1), 1.0)
    assert r.accept(MEMBER, _whole(5, 3, b"next"), 2.0) == (True, [b"next"])


def test_with_only_members_the_least_recently_active_session_makes_room():
    r = Reassembler(max_sessions=2)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    r.accept(a, _whole(1, 1), 0.0)
    r.accept(b, _whole(1, 1), 1.0)
    r.accept(a, _whole(1, 2), 2.0)  # a is active again: b is the oldest now
    r.accept(c, _whole(1, 1), 3.0)
    assert r.accept(a, _whole(1, 3), 4.0) == (True, [b"step"])  # a kept its place
    assert r.accept(b, _whole(1, 2), 5.0) == (True, [])  # b's session was forgotten: waits for 1


def test_a_member_sending_many_sessions_loses_only_its_own_oldest():
    r = Reassembler(max_sessions=100)
    for session in range(1, 7):
        r.accept(MEMBER, _whole(session, 1), float(session))
    assert r.accept(MEMBER, _whole(6, 2), 7.0) == (True, [b"step"])
    assert r.accept(MEMBER, _whole(1, 2), 8.0) == (True, [])  # its oldest went (4 per sender)


def test_a_flood_of_new_peers_keys_leaves_a_members_keys(monkeypatch):
    monkeypatch.setattr(data_keys, "MAX_PEERS", 8)
    me = ProcessKeys(b"i" * 32, 1, member=lambda peer: peer == MEMBER)
    theirs = ProcessKeys(MEMBER, 2)
    me.pair(MEMBER, 2, theirs.public)
    for n in range(50):
        stranger = ProcessKeys(n.to_bytes(32, "big"), 3)
        me.pair(stranger.node_id, 3, stranger.public)
    assert me.current(MEMBER, 2) is not None
    assert len(me._pairs) == 8


def test_evict_one_takes_the_oldest_strangers_entry_else_the_oldest():
    table = OrderedDict((k, None) for k in "mxmy")
    assert evict_one(table, lambda k: k == "m") == "x"
    assert evict_one(table, lambda k: k == "m") == "y"
    assert evict_one(table, lambda k: k == "m") == "m" and list(table) == []


def test_a_quieted_line_is_logged_once_per_interval_per_key_with_what_was_held_back():
    q = Quieted(interval=60.0, keys=2)
    assert q.due("a", 0.0) == 0
    assert [q.due("a", t) for t in (1.0, 2.0, 59.0)] == [None, None, None]
    assert q.due("b", 3.0) == 0  # another key has its own interval
    assert q.due("a", 60.0) == 3  # the three held back, said with the next line
    assert q.due("a", 61.0) is None
    q.due("c", 62.0)  # a third key: the oldest ("b") is forgotten
    assert q.due("b", 63.0) == 0
