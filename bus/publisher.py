"""Pipelined, idempotent JetStream publishing with bounded in-flight bytes.

- `Nats-Msg-Id` = event id, so a re-publish after a crash or a retry is stored once.
- In-flight bytes stay under `max_inflight_bytes`: the stream's intake queue is ~128 MB
  and thousands of large async publishes got "429 too many requests".
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
import math
from typing import TypeVar

from nats.js import JetStreamContext
from nats.js.api import PubAck

from bus import tracing
from bus.election import ride_out
from bus.embedded import MAX_PAYLOAD
from bus.topology import Channel, Topology
from schemas.codec import encode
from schemas.events import Event

E = TypeVar("E", bound=Event)

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
    """Publishes a run's events on its channels (`bus.topology.CHANNELS`)."""

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        max_inflight_bytes: int = 32 << 20,
        ack_timeout: float = 10.0,
        retry_for: float = 30.0,
        max_payload: int = MAX_PAYLOAD,
    ) -> None:
        self.js = js
        self.topology = topology
        self.max_inflight_bytes = max_inflight_bytes
        self.ack_timeout = ack_timeout
        self.retry_for = retry_for
        self.max_payload = max_payload
        self._inflight_bytes = 0
        self._freed = asyncio.Event()
        # Publishes awaiting their ack, by the tenth of a second their ack_timeout ends in.
        self._deadlines: dict[int, list[asyncio.Future[PubAck]]] = {}
        # The loop keeps only weak references to tasks: these keep the retries alive.
        self._retries: set[asyncio.Task[PubAck]] = set()

    async def send(
        self, channel: Channel[E], event: E, *tokens: str | int, attributes: dict[str, str | int | float] | None = None
    ) -> asyncio.Future[PubAck]:
        """Start publishing `event` on `channel` (with its rank or stage token, if it has one);
        return once it is in flight. Await the result for the ack.

        TypeError for an event that is not the channel's class: the readers would dead-letter
        every one of them, so it is a bug in the caller, not bad input.
        """
        if channel.event is None or not isinstance(event, channel.event):
            expected = channel.event.__name__ if channel.event else "raw bytes (send_bytes)"
            raise TypeError(f"channel {channel.name} carries {expected}, not {type(event).__name__}")
        return await self.send_bytes(channel, encode(event), event.id, *tokens, attributes=attributes)

    async def publish(
        self, channel: Channel[E], event: E, *tokens: str | int, attributes: dict[str, str | int | float] | None = None
    ) -> PubAck:
        """Publish `event` on `channel` and wait until the stream has stored it."""
        return await (await self.send(channel, event, *tokens, attributes=attributes))

    async def send_bytes(
        self,
        channel: Channel,
        data: bytes,
        msg_id: str,
        *tokens: str | int,
        headers: dict[str, str] | None = None,
        attributes: dict[str, str | int | float] | None = None,
    ) -> asyncio.Future[PubAck]:
        """Start publishing bytes as they are (dead letters keep the original's)."""
        subject = self.topology.subject(channel, *tokens)
        headers = tracing.send_headers(subject, msg_id, {**(headers or {}), MSG_ID: msg_id}, attributes)
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
        # Callbacks, not a coroutine per publish: a task and a `wait_for` each cost as much as
        # the server's work on a small event (ops.bench.bus).
        acked: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        self._expire_later(future)

        def settle(sent: asyncio.Future[PubAck]) -> None:
            self._release(len(data))
            if acked.done():  # the caller gave up on it
                return
            if not sent.cancelled() and sent.exception() is None:
                acked.set_result(sent.result())
                return
            reason = "no ack in time" if sent.cancelled() else f"{type(sent.exception()).__name__}: {sent.exception()}"
            log.warning("publish to %s failed (%s); retrying", subject, reason)
            retry = asyncio.create_task(self._retry(subject, data, headers))
            self._retries.add(retry)
            retry.add_done_callback(self._retries.discard)
            retry.add_done_callback(lambda r: _copy_outcome(r, acked))

        future.add_done_callback(settle)
        return acked

    def _expire_later(self, future: asyncio.Future[PubAck]) -> None:
        """Cancel `future` (which retries it) if no ack came within ack_timeout, +0.1 s.

        One timer per tenth of a second of deadlines, not one per publish: with 10k publishes
        in flight each timer cost ~10 Python-level comparisons in asyncio's heap, and a
        cancelled one stays there until its time comes.
        """
        loop = asyncio.get_running_loop()
        slot = math.ceil((loop.time() + self.ack_timeout) * 10)
        if slot not in self._deadlines:
            self._deadlines[slot] = []
            loop.call_at(slot / 10, self._expire, slot)
        self._deadlines[slot].append(future)

    def _expire(self, slot: int) -> None:
        for future in self._deadlines.pop(slot):
            future.cancel()  # does nothing to one that has its ack

    async def _retry(self, subject: str, data: bytes, headers: dict[str, str]) -> PubAck:
        """Publish as a request until stored or `retry_for` has passed.

        Every error is retried, not only an election's: dedup makes a repeat safe, and a store
        that refuses (its intake queue full, its limits reached) may accept once consumers
        catch up; the caller is told only when `retry_for` is spent."""
        return await ride_out(
            lambda: self.js.publish(subject, data, timeout=self.ack_timeout, headers=headers),
            f"publish to {subject}", self.retry_for, retry_on=(Exception,),
        )

    def _release(self, nbytes: int) -> None:
        self._inflight_bytes -= nbytes
        # A waiting sender resumes once half the budget is free, not at every ack, and then
        # sends a burst instead of one event per ack.
        if self._inflight_bytes <= self.max_inflight_bytes // 2:
            self._freed.set()


def _copy_outcome(source: asyncio.Future[PubAck], target: asyncio.Future[PubAck]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif (exc := source.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())
