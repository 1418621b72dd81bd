"""What the services read of a member (``Mesh.member_by_id``) follows every change of it,
though the node keeps one MemberInfo per member between changes."""

from __future__ import annotations

from dataclasses import replace

from meshd.node import _Infos
from meshd.swim.state import Member, State
from meshd.wire import Meta


def test_a_members_info_follows_its_state_metadata_and_time_of_change() -> None:
    infos = _Infos()
    m = Member(b"\x01" * 32, "10.0.0.1:7946", Meta(stage=1, stages=3, epoch=5), 0, State.ALIVE, 1.0)
    first = infos.of(m, 1)
    assert (first.name, first.state, first.epoch, first.changed) == ("stage-1", "alive", 5, 1.0)
    assert infos.of(m, 1) is first  # nothing moved: the same record

    m.state, m.state_change = State.SUSPECT, 2.0
    assert (infos.of(m, 1).state, infos.of(m, 1).changed) == ("suspect", 2.0)
    m.meta = replace(m.meta, epoch=6, draining=True)  # a restart that drains
    assert (infos.of(m, 1).epoch, infos.of(m, 1).draining) == (6, True)
    m.state_change = 3.0  # refuted, then suspected again: the same state, a new time
    assert infos.of(m, 1).changed == 3.0


def test_what_is_kept_is_bounded_by_the_members_known() -> None:
    infos = _Infos()
    for i in range(1000):  # members come and are reaped; the table knows one at a time
        infos.of(Member(i.to_bytes(32, "big"), "10.0.0.1:7946", Meta(), 0, State.ALIVE, 0.0), 1)
    assert len(infos._made) <= 2 * 1 + 64 + 1
