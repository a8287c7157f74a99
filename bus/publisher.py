"""Pipelined, idempotent JetStream publishing with bounded in-flight bytes.

- `Nats-Msg-Id` = event id, so a re-publish after a crash or a retry is stored once.
- In-flight bytes stay under `max_inflight_bytes`: the stream's intake queue is ~128 MB
  and thousands of large async publishes got "429 too many requests".
- Acks come to the publisher's own inbox (one reply subject per publish), not through
  nats-py's `publish_async`: that costs as much again as the rest of a small event's
  publish (a random token from the OS, a semaphore and a dataclass conversion per publish;
  ops.bench.bus), and nats-py 2.16 left its future pending forever when the server answered
  with an error. Every ack has a timeout; a timed-out or failed publish is retried as a plain
  request publish, which dedup makes safe.
- Retries go on for `retry_for` seconds, not a number of tries: when a clustered stream
  loses its leader, publishes are refused at once ("no response from stream") until a new
  leader is elected, which takes 4-9 s (raft election timeout; measured 4.3-8.3 s, see
  docs/reliability.md). A short pause between tries keeps the stall close to the election.
- A full stream (discard new: `bus.topology`) is backpressure, not an error: its publishes wait
  with no deadline, in turn and in order, holding their in-flight bytes (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import Header, PubAck

from bus import tracing
from bus.connection import JetStream
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
    block = len(b"NATS/1.0\r\n\r\n") + sum(
        len(f"{key}: {value}\r\n".encode()) for key, value in headers.items()
    )
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
        if not isinstance(js, JetStream):
            raise TypeError(
                "Publisher takes its acks on the connection its JetStream context came from: "
                "make the context with bus.connection.connect(...).jetstream()"
            )
        self.js = js
        self.topology = topology
        self.max_inflight_bytes = max_inflight_bytes
        self.ack_timeout = ack_timeout
        self.retry_for = retry_for
        self.max_payload = max_payload
        self._inflight_bytes = 0
        self._freed = asyncio.Event()
        # Acks come to `<inbox>.<n>`, n counting this publisher's publishes; subscribed on the
        # first send, since subscribing needs the running loop.
        self._acks: Subscription | None = None
        self._reply_prefix = ""
        self._opening = asyncio.Lock()
        self._sent = 0
        # Publishes awaiting their ack, by reply subject: what a retry needs, and the
        # caller's future.
        self._awaiting: dict[str, tuple[asyncio.Future[PubAck], str, bytes, dict[str, str]]] = {}
        # Reply subjects of the publishes whose ack_timeout ends in each tenth of a second.
        self._deadlines: dict[int, list[str]] = {}
        # The loop keeps only weak references to tasks: these keep the retries alive.
        self._retries: set[asyncio.Task[PubAck]] = set()
        # When a publish last warned that its stream is full (loop time).
        self._full_said = -math.inf
        # Per subject: the publishes waiting for room in its full stream take turns.
        self._room: dict[str, asyncio.Lock] = {}

    async def send(
        self,
        channel: Channel[E],
        event: E,
        *tokens: str | int,
        attributes: dict[str, str | int | float] | None = None,
    ) -> asyncio.Future[PubAck]:
        """Start publishing `event` on `channel` (with its rank or stage token, if it has one);
        return once it is in flight. Await the result for the ack.

        TypeError for an event that is not the channel's class: the readers would dead-letter
        every one of them, so it is a bug in the caller, not bad input.
        """
        if channel.event is None or not isinstance(event, channel.event):
            expected = channel.event.__name__ if channel.event else "raw bytes (send_bytes)"
            raise TypeError(
                f"channel {channel.name} carries {expected}, not {type(event).__name__}"
            )
        return await self.send_bytes(
            channel, encode(event), event.id, *tokens, attributes=attributes
        )

    async def publish(
        self,
        channel: Channel[E],
        event: E,
        *tokens: str | int,
        attributes: dict[str, str | int | float] | None = None,
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
        headers = tracing.send_headers(
            subject, msg_id, {**(headers or {}), MSG_ID: msg_id}, attributes
        )
        if (size := wire_size(data, headers)) > self.max_payload:
            raise EventTooLarge(
                f"{msg_id}: {size} bytes is over the {self.max_payload}-byte max payload"
            )
        # One message larger than the whole budget still goes, alone.
        while self._inflight_bytes and self._inflight_bytes + len(data) > self.max_inflight_bytes:
            self._freed.clear()
            await self._freed.wait()
        if self._acks is None:
            await self._open()
        self._sent += 1
        reply = f"{self._reply_prefix}{self._sent}"
        # Callbacks, not a coroutine per publish: a task and a `wait_for` each cost as much as
        # the server's work on a small event (ops.bench.bus).
        acked: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        self._inflight_bytes += len(data)
        if (room := self._room.get(subject)) is not None and room.locked():
            # Its stream is full and earlier publishes wait their turn: this one queues behind
            # them instead of overtaking them when room comes.
            self._start_retry(acked, subject, data, headers)
            return acked
        self._awaiting[reply] = (acked, subject, data, headers)
        try:
            await self.js.client.publish(subject, data, reply=reply, headers=headers)
        except Exception:
            del self._awaiting[reply]
            self._release(len(data))
            raise
        self._expire_later(reply)
        return acked

    async def close(self) -> None:
        """Stop listening for acks; publishes still awaiting theirs are retried as requests."""
        if self._acks is not None:
            await self._acks.unsubscribe()
            self._acks = None
        for reply in list(self._awaiting):
            self._settle(reply, None)

    async def _open(self) -> None:
        async with self._opening:
            if self._acks is None:
                inbox = self.js.client.new_inbox()
                self._acks = await self.js.client.subscribe(f"{inbox}.*", cb=self._on_ack)
                self._reply_prefix = f"{inbox}."

    async def _on_ack(self, msg: Msg) -> None:
        self._settle(msg.subject, msg)

    def _settle(self, reply: str, answer: Msg | None) -> None:
        """Hand the stream's answer to the caller, or retry the publish: no answer in time
        (None), no stream listening, or an error."""
        awaiting = self._awaiting.pop(reply, None)
        if awaiting is None:  # its ack came after its deadline: its retry settles it
            return
        acked, subject, data, headers = awaiting
        if acked.done():  # the caller gave up on it
            self._release(len(data))
            return
        reason, full = "no ack in time", False
        if answer is not None:
            # Retried too: an error from the stream, no stream at all, or an answer that is no ack.
            try:
                acked.set_result(pub_ack(answer))
                self._release(len(data))
                return
            except (nats.errors.Error, ValueError, KeyError, TypeError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
                full = isinstance(exc, nats.js.errors.APIError) and stream_full(exc)
        # A full stream is said by the retry, once for all the publishes that wait.
        (log.debug if full else log.warning)("publish to %s failed (%s); retrying", subject, reason)
        self._start_retry(acked, subject, data, headers)

    def _start_retry(
        self, acked: asyncio.Future[PubAck], subject: str, data: bytes, headers: dict[str, str]
    ) -> None:
        retry = asyncio.create_task(self._retry(subject, data, headers))
        self._retries.add(retry)
        retry.add_done_callback(self._retries.discard)
        # Its bytes stay in flight until the retry settles: while a stream is full, senders
        # wait for the budget instead of piling more retries onto it.
        retry.add_done_callback(lambda _: self._release(len(data)))
        retry.add_done_callback(lambda r: _copy_outcome(r, acked))

    def _expire_later(self, reply: str) -> None:
        """Retry the publish if no ack came within ack_timeout, +0.1 s.

        One timer per tenth of a second of deadlines, not one per publish: with 10k publishes
        in flight each timer cost ~10 Python-level comparisons in asyncio's heap, and a
        cancelled one stays there until its time comes.
        """
        loop = asyncio.get_running_loop()
        slot = math.ceil((loop.time() + self.ack_timeout) * 10)
        if slot not in self._deadlines:
            self._deadlines[slot] = []
            loop.call_at(slot / 10, self._expire, slot)
        self._deadlines[slot].append(reply)

    def _expire(self, slot: int) -> None:
        for reply in self._deadlines.pop(slot):
            self._settle(reply, None)  # does nothing for one that has its ack

    async def _retry(self, subject: str, data: bytes, headers: dict[str, str]) -> PubAck:
        """Publish as a request until stored or `retry_for` has passed.

        Every error is retried, not only an election's: dedup makes a repeat safe, and a store
        that refuses (its intake queue full, its limits reached) may accept once consumers
        catch up; the caller is told only when `retry_for` is spent."""
        return await ride_out(
            lambda: self._publish_when_room(subject, data, headers),
            f"publish to {subject}",
            self.retry_for,
            retry_on=(Exception,),
        )

    async def _publish_when_room(
        self, subject: str, data: bytes, headers: dict[str, str]
    ) -> PubAck:
        """Publish as a request; while the stream is full (its limits reached, discard new), wait
        for its consumers with no deadline: that is backpressure, not a failure. The publishes
        waiting for one subject take turns (FIFO), so one of them polls the server, not all."""
        room = self._room.setdefault(subject, asyncio.Lock())
        if not room.locked():  # nobody waits for room: try at once
            try:
                return await self._request(subject, data, headers)
            except _StreamFull:
                pass
        loop = asyncio.get_running_loop()
        since = loop.time()
        async with room:
            while True:
                try:
                    return await self._request(subject, data, headers)
                except _StreamFull as full:
                    # One warning per FULL_LOG_EVERY for the whole publisher, not one per message.
                    if loop.time() - self._full_said >= FULL_LOG_EVERY:
                        log.warning(
                            "stream of %s is full (%s): publishes wait for its consumers to ack "
                            "(backpressure); this one for %.0f s so far",
                            subject,
                            full,
                            loop.time() - since,
                        )
                        self._full_said = loop.time()
                await asyncio.sleep(FULL_PAUSE)

    async def _request(self, subject: str, data: bytes, headers: dict[str, str]) -> PubAck:
        """One request publish; _StreamFull when the stream refused it for its limits."""
        try:
            return await self.js.publish(subject, data, timeout=self.ack_timeout, headers=headers)
        except nats.js.errors.APIError as exc:
            if stream_full(exc):
                raise _StreamFull(exc.description) from exc
            raise

    def _release(self, nbytes: int) -> None:
        self._inflight_bytes -= nbytes
        # A waiting sender resumes once half the budget is free, not at every ack, and then
        # sends a burst instead of one event per ack.
        if self._inflight_bytes <= self.max_inflight_bytes // 2:
            self._freed.set()


STREAM_FULL = 10077
"""JetStream's error code for a publish refused by a stream's limits (maximum bytes or messages
exceeded, with discard new); nats-py raises it as a 503."""
FULL_PAUSE = 0.5
"""Seconds between tries of a publish to a full stream."""
FULL_LOG_EVERY = 30.0
"""Seconds between the warnings of one publish waiting for room."""


class _StreamFull(Exception):
    """A publish the stream refused for its limits: waited out, never given to the caller."""


def stream_full(exc: nats.js.errors.APIError) -> bool:
    """Whether the stream refused the publish because it is full (not an election, not an error)."""
    return exc.err_code == STREAM_FULL


def pub_ack(answer: Msg) -> PubAck:
    """The stream's ack, from its answer to a publish: raises what `js.publish` would for an
    error (APIError) or for no stream listening on the subject (NoStreamResponseError)."""
    if answer.headers and answer.headers.get(Header.STATUS) == "503":
        raise nats.js.errors.NoStreamResponseError
    reply = json.loads(answer.data)
    if "error" in reply:
        raise nats.js.errors.APIError.from_error(reply["error"])
    return PubAck(
        stream=reply["stream"],
        seq=reply["seq"],
        domain=reply.get("domain"),
        duplicate=reply.get("duplicate"),
    )


def _copy_outcome(source: asyncio.Future[PubAck], target: asyncio.Future[PubAck]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif (exc := source.exception()) is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())
