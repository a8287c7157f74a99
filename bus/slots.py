"""A fixed set of tasks that run one coroutine function over the items given to them."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

log = logging.getLogger("jetrl.worker")

T = TypeVar("T")


class Slots(Generic[T]):
    """`size` tasks that run `work` on the items given to them, each item once, at most `size`
    at a time; `held` counts the items given and not yet done.

    Not a task per item: creating and scheduling one cost ~3 µs, as much as the server spends
    on a small message (ops.bench.bus). A slot takes the next item as soon as its work on the
    last one returns, so work that never waits runs back to back in one slot. Should it wait,
    the items behind it go on in other slots: whenever items are waiting, one idle slot is
    kept woken to take them.

    Work runs in its slot's context, not a fresh copy per item: work that sets a context
    variable must reset it (OpenTelemetry's `start_as_current_span` does, on exit).
    """

    def __init__(
        self, name: str, work: Callable[[T], Awaitable[object]], size: int, group: asyncio.TaskGroup
    ) -> None:
        self.name = name
        self.held = 0
        self._work = work
        self._half = size // 2
        self._ready: deque[T] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()
        self._woken = False  # an idle slot has been woken and has not yet run
        self._closing = False
        self._room = asyncio.Event()
        self._tasks = [group.create_task(self._slot()) for _ in range(size)]

    def give(self, items: list[T]) -> None:
        self._ready.extend(items)
        self.held += len(items)
        self._wake()

    async def half_free(self) -> None:
        """Return once at most half the slots hold an item."""
        while self.held > self._half:
            self._room.clear()
            await self._room.wait()

    async def close(self) -> None:
        """Finish the items given, then end the slots."""
        self._closing = True
        while self._idle:
            _wake(self._idle.popleft())
        await asyncio.gather(*self._tasks)

    def _wake(self) -> None:
        while self._ready and self._idle and not self._woken:
            waiter = self._idle.popleft()
            if not waiter.done():  # not one cancelled with its slot
                self._woken = True
                waiter.set_result(None)

    async def _slot(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self._ready:
                item = self._ready.popleft()
                self._wake()  # should this work wait, another slot takes the next item
                try:
                    await self._work(item)
                except asyncio.CancelledError:
                    # Work cancelled from within (a future it awaited was cancelled) ends that
                    # item, not the slot; only cancelling the slot itself does.
                    if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                        raise
                    log.warning("%s: work on an item was cancelled", self.name)
                except Exception:  # the work's own errors are its to handle; a slot goes on
                    log.exception("%s: work on an item failed", self.name)
                finally:
                    self.held -= 1
                    if self.held <= self._half:
                        self._room.set()
            if self._closing:
                return
            waiter = loop.create_future()
            self._idle.append(waiter)
            await waiter
            self._woken = False


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
