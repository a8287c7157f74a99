"""Many reward handlers, few round trips: concurrent `score` calls share pool requests.

The reward worker holds many trajectories at once, each in its own handler. A handler's
`score` call queues its item; at most one sender per pool process takes up to `batch`
queued items (an equal share per process) and scores them in one round trip
(`RewardPool.score_many`). Nothing waits to fill a batch: a sender takes what is queued the
moment a process is free, so a lone sample is scored as soon as before, and under load the
items that queued during one round trip travel together in the next.

The price: an item queued behind a call that hangs waits for that call's deadline (the
hung item fails with its reason, the rest are scored on a fresh process). Nothing is lost
or failed for it; `reward.batch: 1` restores one call per round trip.
"""

from __future__ import annotations

import asyncio
from typing import Any

from consumers.reward_pool import RewardPool, Score

Item = tuple[str, dict[str, Any], "asyncio.Future[Score]"]


class BatchScorer:
    """Scores one reward function's items through `pool`, up to `batch` per round trip."""

    def __init__(self, pool: RewardPool, fn: str, batch: int) -> None:
        if batch < 1:
            raise ValueError("a reward batch holds at least one item")
        self.pool = pool
        self.fn = fn
        self.batch = batch
        self._queued: list[Item] = []
        self._senders: set[asyncio.Task[None]] = set()
        self._busy = 0  # senders in a round trip
        self._running = 0  # senders started and not yet past their loop
        self.round_trips = 0
        """Requests sent so far (for tests and metrics)."""

    async def score(self, response_text: str, task: dict[str, Any]) -> Score:
        """Score one response; what `RewardPool.score` would return for it."""
        future: asyncio.Future[Score] = asyncio.get_running_loop().create_future()
        self._queued.append((response_text, task, future))
        if self._running < self.pool.processes:
            # Counted here and uncounted by the sender itself as its loop ends, with no await
            # between: a done callback would run a turn late, after the handlers its last
            # batch woke may have queued items that no sender would then take.
            self._running += 1
            sender = asyncio.create_task(self._send())
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        return await future

    async def _send(self) -> None:
        try:
            await self._send_queued()
        finally:
            self._running -= 1

    async def _send_queued(self) -> None:
        # Yield once first so the handlers started in the same loop turn queue their items too.
        await asyncio.sleep(0)
        while self._queued:
            # An equal share per free process, up to `batch`: a small queue is spread over the
            # processes rather than sent to one, so fewer items wait behind any one slow call.
            free = max(1, self.pool.processes - self._busy)
            share = min(self.batch, -(-len(self._queued) // free))
            taken, self._queued = self._queued[:share], self._queued[share:]
            # A handler cancelled while queued (its worker stopping) needs no score.
            taken = [item for item in taken if not item[2].done()]
            if not taken:
                continue
            self.round_trips += 1
            self._busy += 1
            try:
                scores = await self.pool.score_many(
                    self.fn, [(text, task) for text, task, _ in taken]
                )
            except BaseException as exc:  # a bad spec, or cancelled: every waiting handler hears it
                for _, _, future in taken:
                    if not future.done():
                        if isinstance(exc, Exception):
                            future.set_exception(exc)
                        else:
                            future.cancel()
                if not isinstance(exc, Exception):
                    raise
                continue
            finally:
                self._busy -= 1
            for (_, _, future), score in zip(taken, scores, strict=True):
                if not future.done():
                    future.set_result(score)
