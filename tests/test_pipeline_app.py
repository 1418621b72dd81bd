"""The pipeline services' shared plumbing: what a failed send logs and fails."""

from __future__ import annotations

import logging

import trio

from meshd.pipeline import app as app_module
from meshd.pipeline.app import App
from meshd.pipeline.messages import Release

GONE = b"\x02" * 32


class _DeadPeerMesh:
    """A mesh whose every post to a peer fails its delivery at once, as to a process that died."""

    node_id = b"\x01" * 32
    name = "stage-0"

    def describe(self, node: bytes) -> str:
        return "stage-1 (02020202)"

    def peer_down(self, node: bytes) -> bool:
        return True  # its stream ended and its port refuses a dial

    async def post(self, node, data, timeout, on_error=None):
        gone = f"could not deliver message to {self.describe(node)}: its process went away"
        await on_error(RuntimeError(gone))


class _Recording(App):
    def __init__(self) -> None:
        super().__init__(_DeadPeerMesh())
        self.failed_ids: list[str] = []

    async def failed(self, msg, exc, peer=b""):
        self.failed_ids.append(msg.req_id)


async def test_messages_to_a_dead_peer_fail_each_request_and_log_one_line_then_a_count(
        caplog, autojump_clock):
    caplog.set_level(logging.WARNING, "meshd.pipeline")
    service = _Recording()
    async with trio.open_nursery() as nursery:
        service._nursery = nursery
        for i in range(24):
            await service.send(GONE, Release(f"r{i}"))
        assert service.failed_ids == [f"r{i}" for i in range(24)]  # every request hears of it
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ["stage-0: could not deliver message to stage-1 (02020202): its process went away"]
        await trio.sleep(app_module.UNDELIVERED_QUIET_S + 1)
        lines = [r.getMessage() for r in caplog.records]
        assert lines[1:] == ["stage-0: 23 more messages to stage-1 (02020202) could not be delivered "
                             "in the 5s after that"]
        # The quiet time is over: the next failure is logged in full again.
        await service.send(GONE, Release("r24"))
        assert [r.getMessage() for r in caplog.records][2].startswith("stage-0: could not deliver message")
        nursery.cancel_scope.cancel()


async def test_a_failure_after_the_service_stopped_is_logged_not_raised(caplog):
    caplog.set_level(logging.WARNING, "meshd.pipeline")
    service = _Recording()
    async with trio.open_nursery() as nursery:
        service._nursery = nursery
    # The nursery is closed (the service's serve() returned); the channel may still fail a message.
    await service.send(GONE, Release("late-1"))
    await service.send(GONE, Release("late-2"))
    assert service.failed_ids == ["late-1", "late-2"]
    assert len([r for r in caplog.records if "could not deliver" in r.getMessage()]) == 2
