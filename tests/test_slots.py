"""bus.slots: the worker's fixed set of tasks, each running one item at a time.

No bus here: the slots take any items, so these tests give them plain numbers and drive the
event loop step by step (`settle`), so that a slot that failed to take an item shows as an
assertion on what ran, not as a timeout.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from bus.slots import Slots


async def settle() -> None:
    """Let every task that can run, run (each step of a slot takes one pass of the loop)."""
    for _ in range(20):
        await asyncio.sleep(0)


def run(body: object) -> None:
    asyncio.run(asyncio.wait_for(body, 10.0))  # type: ignore[arg-type]


def test_items_behind_one_that_waits_go_on_in_other_slots() -> None:
    """The first item waits; the three behind it must not wait with it."""

    async def body() -> None:
        release, started, done = asyncio.Event(), [], []

        async def work(item: int) -> None:
            started.append(item)
            if item == 0:
                await release.wait()
            done.append(item)

        async with asyncio.TaskGroup() as group:
            slots = Slots("test", work, 4, group)
            await settle()  # every slot idle, as between fetches
            slots.give([0, 1, 2, 3])
            await settle()
            assert started == [0, 1, 2, 3] and done == [1, 2, 3], (started, done)
            assert slots.held == 1
            release.set()
            await slots.close()
        assert done == [1, 2, 3, 0]

    run(body())


def test_at_most_size_items_run_at_once_and_each_runs_once() -> None:
    async def body() -> None:
        running, most, done = 0, 0, []

        async def work(item: int) -> None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            await asyncio.sleep(0.001 * (item % 3))
            running -= 1
            done.append(item)

        async with asyncio.TaskGroup() as group:
            slots = Slots("test", work, 3, group)
            for start in range(0, 30, 3):  # the worker gives no more than is free
                await slots.half_free()
                while slots.held > 0:
                    await asyncio.sleep(0.001)
                slots.give(list(range(start, start + 3)))
            await slots.close()
        assert sorted(done) == list(range(30)) and most == 3, (done, most)

    run(body())


def test_half_free_returns_once_half_the_slots_are_free() -> None:
    async def body() -> None:
        gates = [asyncio.Event() for _ in range(4)]

        async def work(item: int) -> None:
            await gates[item].wait()

        async with asyncio.TaskGroup() as group:
            slots = Slots("test", work, 4, group)
            slots.give([0, 1, 2, 3])
            waiting = asyncio.create_task(slots.half_free())
            gates[0].set()
            await settle()
            assert not waiting.done() and slots.held == 3
            gates[1].set()
            await settle()
            assert waiting.done() and slots.held == 2
            for gate in gates:
                gate.set()
            await slots.close()

    run(body())


def test_a_failing_or_cancelled_item_leaves_its_slot_working(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One slot only: had the error or the cancellation ended it, nothing after would run."""

    async def body() -> None:
        done = []
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def work(item: str) -> None:
            if item == "raise":
                raise RuntimeError("boom")
            if item == "cancelled":
                asyncio.get_running_loop().call_soon(never.cancel)
                await never
            done.append(item)

        async with asyncio.TaskGroup() as group:
            slots = Slots("test", work, 1, group)
            slots.give(["raise"])
            await settle()
            slots.give(["cancelled"])
            await settle()
            slots.give(["after"])
            await settle()
            assert done == ["after"] and slots.held == 0
            await slots.close()

    with caplog.at_level(logging.WARNING, logger="jetrl.worker"):
        run(body())
    assert "boom" in caplog.text and "cancelled" in caplog.text


def test_close_finishes_what_was_given_then_ends_the_slots() -> None:
    async def body() -> None:
        done = []

        async def work(item: int) -> None:
            await asyncio.sleep(0.01)
            done.append(item)

        async with asyncio.TaskGroup() as group:
            slots = Slots("test", work, 4, group)
            slots.give([0, 1, 2])
            closing = asyncio.create_task(slots.close())
            await asyncio.sleep(0.1)
            assert closing.done() and sorted(done) == [0, 1, 2] and slots.held == 0, (closing, done)

    run(body())


def test_cancelling_the_group_ends_slots_that_are_working() -> None:
    async def body() -> None:
        started = asyncio.Event()

        async def work(item: int) -> None:
            started.set()
            await asyncio.sleep(60)

        async def serve() -> None:
            async with asyncio.TaskGroup() as group:
                slots = Slots("test", work, 2, group)
                slots.give([0])
                await asyncio.sleep(60)

        task = asyncio.create_task(serve())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(body())
