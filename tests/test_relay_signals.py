"""``meshd relay`` leaves as ``meshd run`` does: on SIGTERM, SIGINT, and SIGHUP (its terminal
closed) unless started under ``nohup``.  Each connected node is told the relay is shutting
down (a WebSocket close, 1001), so it reconnects elsewhere at once instead of waiting out a
dead connection, and the relay says why and exits 0."""

from __future__ import annotations

import signal
import time

import pytest
import trio

from meshd.identity import Identity
from meshd.launch.process import MeshProcess, parse_relay_url
from meshd.relay.client import ClientConfig, RelayClient

pytestmark = pytest.mark.processes

# No retry within the test: the reason the connection ended stays the client's last word.
NO_RETRY = ClientConfig(backoff_initial=600.0, backoff_max=600.0)


def _relay(**kw) -> MeshProcess:
    p = MeshProcess("relay", ["relay", "--bind", "127.0.0.1:0"], **kw)
    p.wait_for(lambda line: parse_relay_url(line) is not None, 15, "the relay's url line")
    return p


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT],
                         ids=["hup", "term", "int"])
def test_the_relay_leaves_on_a_signal_and_tells_its_nodes(sig):
    relay = _relay()
    try:
        url = next(filter(None, map(parse_relay_url, relay.lines)), None)
        assert url is not None

        async def main() -> str | None:
            client = RelayClient(url, Identity.generate(), config=NO_RETRY)
            async with trio.open_nursery() as nursery:
                with trio.fail_after(15):
                    await nursery.start(client.run)
                assert client.connected, client.last_error
                relay.signal(sig)
                with trio.fail_after(15):
                    while client.connected:
                        await trio.sleep(0.02)
                nursery.cancel_scope.cancel()
            return client.last_error

        last_error = trio.run(main)
        assert last_error == f"relay {url} closed the connection (1001 relay shutting down)"
        assert relay.proc.wait(15) == 0
        relay.wait_for(lambda line: line == f"meshd relay leaving ({sig.name})", 5, "the leaving line")
    finally:
        relay.stop(timeout=5)
    assert not any("Traceback" in line for line in relay.lines)


def test_a_relay_started_under_nohup_outlives_a_sighup():
    relay = _relay(preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        relay.signal(signal.SIGHUP)
        time.sleep(1.0)
        assert relay.proc.poll() is None, "a relay started under nohup must outlive a SIGHUP"
    finally:
        relay.stop(timeout=2)
