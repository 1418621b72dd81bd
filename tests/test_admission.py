"""The orchestrator's admission: slots, the KV budget, a FIFO queue, then 503."""

from __future__ import annotations

import pytest
import trio

from meshd.pipeline.admission import Admission, TooLarge, kv_bytes
from meshd.pipeline.api import Busy
from meshd.pipeline.checkpoint import preset_config


async def test_past_the_slots_requests_wait_in_order_and_past_the_queue_are_refused():
    adm = Admission(max_running=2, max_queued=2, budget_bytes=1000)
    assert await adm.admit(10) == 0 and await adm.admit(10) == 0
    order: list[int] = []

    async def wait(i: int) -> None:
        await adm.admit(10)
        order.append(i)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, 1)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert len(adm.waiting) == 2 and adm.busy() is not None
        with pytest.raises(Busy, match="busy: 2 requests running and 2 waiting"):
            await adm.admit(10)
        adm.release(10)
        await trio.testing.wait_all_tasks_blocked()
        assert order == [1]
        adm.release(10)
    assert order == [1, 2] and adm.running == 2 and adm.busy() is None


async def test_a_large_request_at_the_head_is_not_overtaken_by_small_ones():
    """No starvation: the queue is first come, first served, whatever fits."""
    adm = Admission(max_running=8, max_queued=8, budget_bytes=100)
    await adm.admit(60)
    order: list[str] = []

    async def wait(name: str, cost: int) -> None:
        await adm.admit(cost)
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "big", 80)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait, "small", 10)  # would fit now, but the big one came first
        await trio.testing.wait_all_tasks_blocked()
        assert order == [] and [w.cost for w in adm.waiting] == [80, 10]  # small waits behind big
        adm.release(60)
        assert not adm.waiting and adm.used == 90  # both admitted at once, big first
    assert sorted(order) == ["big", "small"]


async def test_a_waiter_that_gives_up_lets_the_next_through():
    adm = Admission(max_running=1, max_queued=4, budget_bytes=100)
    await adm.admit(90)
    got: list[str] = []

    async def wait(name: str, scope: trio.CancelScope) -> None:
        with scope:
            await adm.admit(50)
            got.append(name)

    gives_up, stays = trio.CancelScope(), trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "gives up", gives_up)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(wait, "stays", stays)
        await trio.testing.wait_all_tasks_blocked()
        gives_up.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert len(adm.waiting) == 1
        adm.release(90)
    assert got == ["stays"] and adm.running == 1 and adm.used == 50


async def test_a_request_over_the_whole_budget_is_refused_at_once():
    adm = Admission(budget_bytes=1000)
    with pytest.raises(TooLarge, match="more than the budget"):
        await adm.admit(1001)
    assert adm.running == 0


def test_kv_bytes_is_the_largest_stages_cache():
    config = preset_config("small")  # 6 layers, 6 kv heads of 48
    assert kv_bytes(config, 4, 100) == 100 * 2 * 6 * 48 * 2 * 4  # stages of 2, 2, 1, 1 layers
