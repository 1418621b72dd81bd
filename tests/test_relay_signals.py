"""``meshd relay`` leaves as ``meshd run`` does: on SIGTERM, SIGINT, and SIGHUP (its terminal
closed) unless started under ``nohup``, saying why and exiting 0."""

from __future__ import annotations

import signal
import time

import pytest

from meshd.launch.process import MeshProcess, parse_relay_url

pytestmark = pytest.mark.processes


def _relay(**kw) -> MeshProcess:
    p = MeshProcess("relay", ["relay", "--bind", "127.0.0.1:0"], **kw)
    p.wait_for(lambda line: parse_relay_url(line) is not None, 15, "the relay's url line")
    return p


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT], ids=["hup", "term", "int"])
def test_the_relay_leaves_on_a_signal_and_says_so(sig):
    relay = _relay()
    try:
        relay.signal(sig)
        assert relay.proc.wait(5.0) == 0
        relay.wait_for(lambda line: line == f"meshd relay leaving ({sig.name})", 2, "the leaving line")
    finally:
        relay.stop(timeout=2)
    assert not any("Traceback" in line for line in relay.lines)


def test_a_relay_started_under_nohup_outlives_a_sighup():
    relay = _relay(preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        relay.signal(signal.SIGHUP)
        time.sleep(1.0)
        assert relay.proc.poll() is None, "a relay started under nohup must outlive a SIGHUP"
    finally:
        relay.stop(timeout=2)
