"""A stage's poller: it polls for its window after each message, pauses while a compute
thread runs, and is off (no task left spinning) at a window of 0; a stage polls only while
it serves a single request, and only for that request's own steps.

The poller's tests run on a clock that moves only when told (``mock_clock``): the window
opens and closes where the test says, however slow the machine."""

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


async def turns(n: int = 20) -> None:
    """Let every other task run ``n`` times (the poller, a turn of the loop each)."""
    for _ in range(n):
        await trio.lowlevel.checkpoint()


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


async def test_it_polls_for_its_window_after_each_touch_then_sleeps(mock_clock):
    poller = Poller(0.05)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        await turns()
        mock_clock.jump(1)
        assert poller.polled_s == 0, "no message yet: it sleeps"
        poller.touch()
        await turns()
        mock_clock.jump(0.03)
        assert poller.polling() and poller.polled_s == pytest.approx(0.03)
        mock_clock.jump(0.03)  # past the window
        await turns()
        assert not poller.polling() and poller.polled_s == pytest.approx(0.06)
        mock_clock.jump(1)
        await turns()
        assert poller.polled_s == pytest.approx(0.06), "the window closed: it sleeps until the next message"
        poller.touch()
        await turns()
        mock_clock.jump(0.02)
        poller.stop()  # the stage serves more than one request now
        await turns()
        assert not poller.polling() and poller.polled_s == pytest.approx(0.08)
        nursery.cancel_scope.cancel()


async def test_no_polling_while_a_compute_thread_runs(mock_clock):
    poller = Poller(0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(poller.run)
        poller.touch()
        await turns()
        mock_clock.jump(0.1)
        with poller.thread_running():
            assert not poller.polling()
            await turns()  # the poller's task sees the thread and stops
            during = poller.polled_s
            assert during == pytest.approx(0.1)
            await trio.to_thread.run_sync(time.sleep, 0.01)
            mock_clock.jump(0.1)
            await turns()
            assert poller.polled_s == during, "the loop slept while the thread held the CPU"
        await turns()
        assert poller.polling(), "the window still open goes on once the thread is done"
        mock_clock.jump(0.1)
        assert poller.polled_s == pytest.approx(during + 0.1)
        nursery.cancel_scope.cancel()


def test_a_stage_polls_for_a_single_request_and_stops_once_it_serves_more_or_none():
    """With several requests in flight a stage's batches keep it busy, and polling would take
    turns from a stage sharing its CPU: the window closes at the next message."""
    async def main() -> None:
        stage = SimpleNamespace(jobs={}, poller=Poller(0.5))
        StageService._due_soon(stage)  # type: ignore[arg-type]
        assert not stage.poller.polling(), "nothing runs here: nothing is due"
        stage.jobs["a"] = None
        StageService._due_soon(stage)  # type: ignore[arg-type]
        assert stage.poller.polling()
        stage.jobs["b"] = None
        StageService._due_soon(stage)  # type: ignore[arg-type]
        assert not stage.poller.polling()
        del stage.jobs["a"]
        StageService._due_soon(stage)  # type: ignore[arg-type]
        assert stage.poller.polling()

    trio.run(main)


async def test_only_a_running_requests_own_steps_keep_a_stage_polling(checkpoint):
    """A member off a request's route, or one naming a request not running here, cannot keep
    a stage's CPU spinning: its messages are refused without opening the window.  The
    request's own steps do open it (the positive control), and its end closes it."""
    lines: list[str] = []
    stranger = os.urandom(32)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, checkpoint, 3, lines, stage_options={1: {"poll_ms": 20.0}})
            orch, middle = nodes[0].app, nodes[2].app
            touched: list[int] = []
            touch = middle.poller.touch
            middle.poller.touch = lambda: (touched.append(len(middle.jobs)), touch())
            await orch.generate("Once upon a time", 4)
            assert touched and set(touched) == {1}, "a request's own steps open the window"
            while middle.jobs:  # its Release is on its way down the chain
                await trio.sleep(0.01)
            assert not middle.poller.polling(), "its end closed the window"
            touched.clear()
            dims = middle.model.config.hidden_size
            hidden = np.zeros((1, dims), dtype=np.float32).tobytes()
            route = tuple(n.node.node_id for n in nodes[1:])
            for src in (stranger, nodes[1].node.node_id):  # a stranger; the stage before, for no request
                step = Activation("nobody-runs-this", orch.mesh.node_id, 5, 1, 1, dims, hidden, (),
                                  Sampling(8, 0.0, 0, 0, False), 0.0, (), route)
                await middle._on_message(src, step)  # as the data channel hands it over
                await middle._on_message(src, Release("nobody-runs-this"))
            assert touched == [] and not middle.poller.polling()
            # A member may start a request of its own here, naming itself as the stage
            # before: the start opens the window, steps that do not follow it do not.
            own = (stranger, middle.mesh.node_id, nodes[3].node.node_id)
            start = Activation("strangers-own", orch.mesh.node_id, 0, 0, 1, dims, hidden, (),
                               Sampling(8, 0.0, 0, 0, False), 0.0, (), own)
            await middle._on_message(stranger, start)
            assert "strangers-own" in middle.jobs and len(touched) == 1
            for pos in (5, 7, 9):
                await middle._on_message(stranger, Activation("strangers-own", orch.mesh.node_id, pos, pos, 1,
                                                              dims, hidden, (), Sampling(8, 0.0, 0, 0, False),
                                                              0.0, (), own))
            assert len(touched) == 1
            nursery.cancel_scope.cancel()
