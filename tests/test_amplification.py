"""What a node may send to an address that has not proven it is a member's (sans-IO)."""

from meshd.net.amplification import AmplificationGuard

VICTIM = "192.0.2.9:53"


def test_an_unproven_address_gets_at_most_the_allowance_plus_three_times_what_it_sent():
    guard = AmplificationGuard(factor=3, allowance=2048, refill_per_s=64)
    guard.received(VICTIM, 44, now=0.0)  # a 44-byte packet with the victim's address on it
    sent = 0
    while guard.may_send(VICTIM, 100, now=0.0):
        sent += 100
    assert 2048 + 3 * 44 - 100 < sent <= 2048 + 3 * 44


def test_the_allowance_refills_slowly_so_a_member_learned_by_gossip_can_still_be_pinged():
    guard = AmplificationGuard(factor=3, allowance=2048, refill_per_s=64)
    assert guard.may_send(VICTIM, 2048, now=0.0)
    assert not guard.may_send(VICTIM, 60, now=0.5)  # 32 bytes back after half a second
    assert guard.may_send(VICTIM, 60, now=1.0)
    # Idle for a long time: the bank holds the allowance, no more.
    assert guard.may_send(VICTIM, 2048, now=1000.0)
    assert not guard.may_send(VICTIM, 100, now=1000.0)


def test_an_address_that_answered_our_ping_is_not_limited():
    guard = AmplificationGuard(factor=3, allowance=2048, refill_per_s=64)
    guard.verified(VICTIM)
    assert all(guard.may_send(VICTIM, 60_000, now=0.0) for _ in range(100))


def test_the_guard_remembers_a_bounded_number_of_addresses():
    guard = AmplificationGuard(max_addresses=16)
    for n in range(1000):
        guard.received(f"10.0.{n // 256}.{n % 256}:1", 100, now=0.0)
        guard.verified(f"10.1.{n // 256}.{n % 256}:1")
    assert len(guard._budgets) <= 16 and len(guard._verified) <= 16


def test_a_push_pull_over_the_budget_is_cut_to_the_members_that_fit_ourselves_first():
    from meshd import wire
    from meshd.node import _cut_push_pull

    members = tuple(wire.MemberState(bytes([n]) * 32, f"10.0.0.{n}:7946", 0, wire.STATE_ALIVE,
                                     wire.Meta(stage=n, addrs=(f"10.0.0.{n}:7946",)))
                    for n in range(1, 41))
    names = (wire.NameClaim("pp-entry", bytes([1]) * 32, 1, False),)
    push_pull = wire.PushPull(False, False, members, names)
    assert len(wire.encode(wire.Packet(b"\1" * 32, (push_pull,)))) > 2048
    data = _cut_push_pull(b"\1" * 32, push_pull, 2048)
    assert data is not None and len(data) <= 2048
    (cut,) = wire.decode(data).messages
    assert cut.names == names and cut.members == members[:len(cut.members)] and len(cut.members) >= 10
    assert _cut_push_pull(b"\1" * 32, push_pull, 100) is None
