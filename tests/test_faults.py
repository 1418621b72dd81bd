"""`meshd run --fault` specs: parsed strictly, applied as a packet filter would."""

import random
import re

import pytest

from meshd.net.faults import Faults, FaultSpecError


def test_drop_is_one_way_and_blocks_streams_both_ways():
    f = Faults.parse(["drop:127.0.0.1:7001"])
    assert f.direct_out_lost("127.0.0.1:7001")
    assert not f.direct_out_lost("127.0.0.1:7002")
    assert not f.direct_in_lost(("127.0.0.1", 7001)), "their datagrams to us still arrive"
    assert f.stream_blocked("127.0.0.1:7001")
    assert not f.relay_blocked()
    assert f.describe() == ["drop:127.0.0.1:7001"]


def test_isolate_cuts_everything_relay_included():
    f = Faults.parse(["isolate"])
    assert f.direct_out_lost("10.0.0.1:1") and f.direct_in_lost(("10.0.0.1", 1))
    assert f.stream_blocked("10.0.0.1:1") and f.relay_blocked()


def test_loss_drops_about_that_fraction():
    f = Faults.parse(["loss:0.25"])
    f.rng = random.Random(7)
    lost = sum(f.direct_out_lost("10.0.0.1:1") for _ in range(10_000))
    assert 2_200 < lost < 2_800


def test_delay_is_in_milliseconds():
    assert Faults.parse(["delay:40"]).delay_s == pytest.approx(0.040)
    assert not Faults.parse([]).active


@pytest.mark.parametrize(
    "spec, message",
    [
        ("drop:nowhere", "is not HOST:PORT"),
        ("loss:1", "loss must be in [0, 1)"),
        ("loss:x", "is not a number"),
        ("delay:-5", "must not be negative"),
        ("isolate:me", "expected drop:HOST:PORT"),
        ("flood", "expected drop:HOST:PORT"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(FaultSpecError, match=re.escape(message)):
        Faults.parse([spec])
