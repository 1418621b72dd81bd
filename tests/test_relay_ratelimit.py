"""The relay's token bucket: exact arithmetic, time passed in."""

from meshd.relay.ratelimit import TokenBucket


def test_burst_then_refill_at_the_rate():
    bucket = TokenBucket(rate=100, burst=300, now=0.0)
    assert bucket.take(200, now=0.0)
    assert bucket.take(100, now=0.0)
    assert not bucket.take(1, now=0.0)  # burst spent
    assert not bucket.take(60, now=0.5)  # 50 refilled: not enough, and nothing spent
    assert bucket.take(50, now=0.5)
    assert not bucket.take(1, now=0.5)


def test_refill_never_exceeds_the_burst():
    bucket = TokenBucket(rate=100, burst=300, now=0.0)
    assert bucket.take(300, now=0.0)
    assert bucket.take(300, now=1000.0)
    assert not bucket.take(1, now=1000.0)


def test_a_clock_going_backwards_refills_nothing():
    bucket = TokenBucket(rate=100, burst=100, now=10.0)
    assert bucket.take(100, now=10.0)
    assert not bucket.take(1, now=5.0)
    assert bucket.take(100, now=11.0)
