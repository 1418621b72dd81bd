"""A stage's poller: it polls for its window after each message, pauses while a compute
thread runs, and is off (no task left spinning) at a window of 0; a stage polls only while
it serves a single request."""

import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import trio

from meshd.pipeline.messages import Activation, Release, Sampling
from meshd.pipeline.polling import Poller
from meshd.pipeline.stage import StageService
from meshd.testing.inprocess import start_pipeline


async def test_a_window_of_zero_never_polls():
    poller = Poller(0)
    with trio.fail_after(5):
        await poller.run()  # returns at once: nothing spins
    poller.touch()
    assert not poller.polling() and poller.polled_s == 0


@pytest.mark.parametrize("window", [-0.001, float("inf"), float("nan")])
def test_a_window_that_is_not_a_finite_duration_is_refused(window):
    with pytest.raises(ValueError, match="poll window"):
        Poller(window)


async def test_it_polls_for_its_window_after_each_touch_then_sleeps():
    poller = Poller(0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        await trio.sleep(0.02)
        assert poller.polled_s == 0, "no message yet: it sleeps"
        started = trio.current_time()
        poller.touch()
        assert poller.polling()
        # While it polls, the loop still runs every other task.
        ticks = 0
        while trio.current_time() - started < 0.1:
            await trio.sleep(0.005)
            ticks += 1
        assert ticks >= 2 and not poller.polling()
        first = poller.polled_s
        assert 0 < first <= trio.current_time() - started
        await trio.sleep(0.05)
        assert poller.polled_s == first, "the window closed: it sleeps until the next message"
        poller.touch()
        await trio.sleep(0.08)
        assert poller.polled_s > first
        nursery.cancel_scope.cancel()


async def test_no_polling_while_a_compute_thread_runs():
    poller = Poller(0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        poller.touch()
        await trio.sleep(0)
        with poller.thread_running():
            assert not poller.polling()
            await trio.sleep(0.01)  # the poller's task sees the thread and stops
            during = poller.polled_s
            await trio.to_thread.run_sync(time.sleep, 0.1)
            assert poller.polled_s == during, "the loop slept while the thread held the CPU"
        assert poller.polling(), "the window still open goes on"
        await trio.sleep(0.05)
        assert poller.polled_s > during
        poller.stop()
        assert not poller.polling()
        nursery.cancel_scope.cancel()


async def test_a_stage_polls_for_a_single_request_and_stops_once_it_serves_more():
    """With several requests in flight a stage's batches keep it busy, and polling would take
    turns from a stage sharing its CPU: the window closes at the next message."""
    stage = SimpleNamespace(jobs={"a": None}, poller=Poller(0.5))
    StageService._due_soon(stage)  # type: ignore[arg-type]
    assert stage.poller.polling()
    stage.jobs["b"] = None
    StageService._due_soon(stage)  # type: ignore[arg-type]
    assert not stage.poller.polling()
    del stage.jobs["a"]
    StageService._due_soon(stage)  # type: ignore[arg-type]
    assert stage.poller.polling()


async def test_only_a_running_requests_own_messages_keep_a_stage_polling(checkpoint):
    """A member off a request's route, or one naming a request not running here, cannot keep
    a stage's CPU spinning: its messages are refused without opening the window.  The
    request's own messages do open it (the positive control)."""
    lines: list[str] = []
    stranger = os.urandom(32)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines, stage_options={1: {"poll_ms": 20.0}})
            orch, middle = nodes[0].app, nodes[2].app
            await orch.generate("Once upon a time", 4)
            assert middle.poller.polled_s > 0, "a request's own messages open the window"
            await trio.sleep(0.05)
            assert not middle.poller.polling()
            polled = middle.poller.polled_s
            dims = middle.model.config.hidden_size
            hidden = np.zeros((1, dims), dtype=np.float32).tobytes()
            route = tuple(n.node.node_id for n in nodes[1:])
            for src in (stranger, nodes[1].node.node_id):  # a stranger; the stage before, for no request
                step = Activation("nobody-runs-this", orch.mesh.node_id, 5, 1, 1, dims, hidden, (),
                                  Sampling(8, 0.0, 0, 0, False), 0.0, (), route)
                await middle._on_message(src, step)  # as the data channel hands it over
                await middle._on_message(src, Release("nobody-runs-this"))
                assert not middle.poller.polling(), src.hex()[:8]
            await trio.sleep(0.03)
            assert middle.poller.polled_s == polled
            nursery.cancel_scope.cancel()
