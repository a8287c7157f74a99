"""Pipelined, idempotent JetStream publishing with bounded in-flight bytes.

- `Nats-Msg-Id` = event id, so a re-publish after a crash or a retry is stored once.
- In-flight bytes stay under `max_inflight_bytes`: the stream's intake queue is ~128 MB
  and thousands of large async publishes got "429 too many requests" (MEASURED.md).
- Every ack has a timeout: nats-py 2.16 can leave a `publish_async` future pending
  forever when the server answers with an error. A timed-out or failed publish is retried
  as a plain request publish, which dedup makes safe.
- Retries go on for `retry_for` seconds, not a number of tries: when a clustered stream
  loses its leader, publishes are refused at once ("no response from stream") until a new
  leader is elected, which takes 4-9 s (raft election timeout; measured 4.3-8.3 s, see
  docs/reliability.md). A short pause between tries keeps the stall close to the election.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from nats.js import JetStreamContext
from nats.js.api import PubAck

from bus import tracing
from bus.embedded import MAX_PAYLOAD
from schemas.codec import encode
from schemas.events import Event

log = logging.getLogger("jetrl.publisher")

MSG_ID = "Nats-Msg-Id"


class EventTooLarge(ValueError):
    """An encoded event over the server's max payload; split it or fail the sample."""


def wire_size(data: bytes, headers: dict[str, str]) -> int:
    """What the server counts against its max payload: the data plus the NATS header block.

    A message over it makes the server close the connection (nats-py checks the data alone).
    """
    block = len(b"NATS/1.0\r\n\r\n") + sum(len(f"{key}: {value}\r\n".encode()) for key, value in headers.items())
    return len(data) + block


class Publisher:
    def __init__(
        self,
        js: JetStreamContext,
        max_inflight_bytes: int = 32 << 20,
        ack_timeout: float = 10.0,
        retry_for: float = 30.0,
        max_payload: int = MAX_PAYLOAD,
    ) -> None:
        self.js = js
        self.max_inflight_bytes = max_inflight_bytes
        self.ack_timeout = ack_timeout
        self.retry_for = retry_for
        self.max_payload = max_payload
        self._inflight_bytes = 0
        self._freed = asyncio.Event()

    async def send(
        self, subject: str, event: Event, attributes: dict[str, str | int | float] | None = None
    ) -> Awaitable[PubAck]:
        """Start publishing `event`; return once it is in flight. Await the result for the ack."""
        return await self.send_bytes(subject, encode(event), event.id, attributes=attributes)

    async def publish(
        self, subject: str, event: Event, attributes: dict[str, str | int | float] | None = None
    ) -> PubAck:
        """Publish `event` and wait until the stream has stored it."""
        return await (await self.send(subject, event, attributes))

    async def send_bytes(
        self,
        subject: str,
        data: bytes,
        msg_id: str,
        headers: dict[str, str] | None = None,
        attributes: dict[str, str | int | float] | None = None,
    ) -> Awaitable[PubAck]:
        with tracing.send_span(subject, msg_id, attributes):
            headers = tracing.inject({**(headers or {}), MSG_ID: msg_id})
        if (size := wire_size(data, headers)) > self.max_payload:
            raise EventTooLarge(f"{msg_id}: {size} bytes is over the {self.max_payload}-byte max payload")
        # One message larger than the whole budget still goes, alone.
        while self._inflight_bytes and self._inflight_bytes + len(data) > self.max_inflight_bytes:
            self._freed.clear()
            await self._freed.wait()
        self._inflight_bytes += len(data)
        try:
            future = await self.js.publish_async(subject, data, headers=headers)
        except Exception:
            self._release(len(data))
            raise
        future.add_done_callback(lambda _: self._release(len(data)))
        return self._settle(future, subject, data, headers)

    async def _settle(self, future: asyncio.Future[PubAck], subject: str, data: bytes, headers: dict[str, str]) -> PubAck:
        try:
            return await asyncio.wait_for(future, self.ack_timeout)
        except Exception as exc:  # timeout, 429, stream busy: retry as a request, dedup makes it safe
            log.warning("publish to %s failed (%s: %s); retrying", subject, type(exc).__name__, exc)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_for
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self.js.publish(subject, data, timeout=self.ack_timeout, headers=headers)
            except Exception as exc:
                pause = min(0.1 * attempt, 0.5)
                if loop.time() + pause > deadline:
                    raise
                # One warning per publish: during an election every in-flight publish retries
                # twice a second for seconds.
                (log.warning if attempt == 1 else log.debug)("publish retry %d to %s failed: %s", attempt, subject, exc)
                await asyncio.sleep(pause)

    def _release(self, nbytes: int) -> None:
        self._inflight_bytes -= nbytes
        self._freed.set()
