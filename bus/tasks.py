"""Cancelling tasks that talk to NATS: once is not enough on Python 3.11.

nats-py awaits each request's reply (a KV put, a stream or consumer info) in `asyncio.wait_for`,
which on 3.11 swallows a cancel when the reply is in by the time the cancelled task resumes: the
call returns normally and the task goes on as if never cancelled. (nats-py's forced flush of a
full publish buffer swallows a cancel outright.) A stage's helper loop that was mid-request
when the stage stopped then ran forever, and so did the TaskGroup waiting for it: the fleet
SIGKILLed the worker 30 s after SIGTERM. Measured here: a loop of back-to-back requests, cancelled
once, went on in 39 of 60 tries; under load every request is slower, so a helper that requests
now and then (a heartbeat) is more often caught mid-request.

`cancel_until_done` cancels again, every `RECANCEL_SECONDS`, until each task has ended.
`recancelled` does the same for the tasks a TaskGroup cancels when one of its tasks fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

log = logging.getLogger("jetrl.tasks")

T = TypeVar("T")

RECANCEL_SECONDS = 0.1
"""How long a cancelled task has to end before it is cancelled again. Short: most of the time a
swallowed cancel is followed at once by the task's next request, where the next cancel lands."""
WARN_SECONDS = 5.0
"""A task still running this long after its first cancel is named in a warning (it is not only
racing replies: something in it catches CancelledError)."""


async def cancel_until_done(
    tasks: Iterable[asyncio.Task[Any]], again_after: float = RECANCEL_SECONDS
) -> None:
    """Cancel `tasks` and return once every one has ended, cancelling those still running again
    every `again_after` s. What they ended with (result, error, cancellation) is left to whoever
    awaits them (a TaskGroup sees a helper's error)."""
    loop = asyncio.get_running_loop()
    pending = {task for task in tasks if not task.done()}
    started, warned = loop.time(), False
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_after)
        if pending and not warned and loop.time() - started >= WARN_SECONDS:
            names = ", ".join(sorted(task.get_name() for task in pending))
            log.warning(
                "still running %.0f s after their cancel, cancelling again: %s", WARN_SECONDS, names
            )
            warned = True


async def recancelled(coro: Coroutine[Any, Any, T], name: str) -> T:
    """Await `coro`, run as its own task named `name`; when this is cancelled, cancel that task
    until it has ended (`cancel_until_done`), then raise CancelledError.

    For the tasks of a TaskGroup and for its body: when one of them fails, the group cancels each
    of the others once and waits for them. A task caught mid-request swallowed that one cancel
    and ran on, so the group waited for ever: the main job stopped by `reward.max_failed_share`
    hung silently with its workers gone, and ignored SIGTERM. Here the group's cancel lands on
    an await of a shield, which cannot swallow it, and the coroutine is cancelled until it ends.
    """
    inner = asyncio.ensure_future(coro)
    inner.set_name(name)
    try:
        return await asyncio.shield(inner)
    except asyncio.CancelledError:
        await cancel_until_done([inner])
        if not inner.cancelled() and inner.exception() is not None:
            log.warning("%s ended with %r while cancelled", name, inner.exception())
        raise
