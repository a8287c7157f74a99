"""Riding out a JetStream leader election.

When a cluster node dies, every stream, consumer and KV bucket it led elects a new leader
(4-9 s each: nats-server's raft election timeout; the meta group, a stream and its
consumers may elect one after another). Until then requests to them time out or find no
responder; the connection itself fails over to another node in milliseconds. So a call
that an election can refuse is retried for a bounded time (`ride_out`), and a display that
cannot read a figure shows it as unknown (`or_unknown`) instead of stopping what it shows.

Only errors an election causes are retried: a missing stream, refused credentials or a
closed connection are not waited out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors

log = logging.getLogger("jetrl.bus")

T = TypeVar("T")

ELECTION_SECONDS = 30.0
"""How long a call is retried: three elections in a row (meta, stream,
consumer) at their slowest."""

TRANSIENT: tuple[type[BaseException], ...] = (
    asyncio.TimeoutError,  # nats.errors.TimeoutError too: a request nobody led answered
    nats.errors.NoRespondersError,  # a JetStream API subject with no leader behind it
    nats.js.errors.NoStreamResponseError,  # a publish to a stream with no leader
    nats.js.errors.ServiceUnavailableError,  # 503: JetStream has no meta leader yet
    nats.js.errors.ServerError,  # 500: "stream is offline" while its replicas elect
    nats.errors.StaleConnectionError,  # the node went away mid-request; the client fails over
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,  # the reconnect buffer filled while failing over
)
"""What a request meets while a leader is being elected or the client is failing over."""


async def ride_out(
    call: Callable[[], Awaitable[T]],
    what: str,
    deadline: float = ELECTION_SECONDS,
    retry_on: tuple[type[BaseException], ...] = TRANSIENT,
) -> T:
    """`await call()`, retried on `retry_on` errors until `deadline` seconds have passed.

    `call` makes a fresh awaitable each time (a lambda around the request). The pauses
    grow to 0.5 s, so the call goes through soon after the election. One warning per call,
    then debug: during an election a loop retries many times. The publisher's retries are
    this loop too, on every error (`bus.publisher`).
    """
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call()
        except retry_on as exc:
            pause = min(0.1 * attempt, 0.5)
            if loop.time() + pause > end:
                log.warning(
                    "%s: gave up after %d tries over %.0f s: %s",
                    what,
                    attempt,
                    deadline,
                    _reason(exc),
                )
                raise
            (log.warning if attempt == 1 else log.debug)(
                "%s failed (%s); retrying for up to %.0f s (a leader election?)",
                what,
                _reason(exc),
                deadline,
            )
            await asyncio.sleep(pause)


async def or_unknown(call: Callable[[], Awaitable[T]], what: str) -> T | None:
    """`await call()`, or None when the server cannot say now: a display shows it as unknown."""
    try:
        return await call()
    except TRANSIENT as exc:
        log.info("%s: unknown for now (%s)", what, _reason(exc))
        return None


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
