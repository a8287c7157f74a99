"""The pull-worker loop every consuming stage runs.

One durable pull consumer per stage, shared by competing workers. For each message:
count deliveries -> decode -> run the handler under a process span while heartbeating
`in_progress` -> ack (or, for a handler that returns HOLD, keep heartbeating it until the
handler's owner settles it). Bad input (undecodable, unknown type/version, invalid fields, a
handler's `Reject`) goes to `dead` with its reason and is terminated; other errors are
nak'ed with a growing delay until `max_deliver`, then dead-lettered. A worker never
exits because of one message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.errors import MsgAlreadyAckdError
from nats.js import JetStreamContext

from bus import tracing
from bus.connection import JetStream
from bus.dead import dead_letter
from bus.publisher import Publisher
from bus.pull import Puller
from bus.slots import Slots
from bus.tasks import cancel_until_done
from bus.topology import Channel, Topology, WorkQueue
from schemas.codec import DecodeError, decode
from schemas.events import Event

log = logging.getLogger("jetrl.worker")

E = TypeVar("E", bound=Event)


class Reject(Exception):
    """Raised by a handler for input that can never succeed: dead-letter it, don't retry."""


class Hold:
    """Returned by a handler that keeps the message unacked and will ack (or term) it itself
    later; the worker's heartbeat keeps it in progress until then."""


HOLD = Hold()


@dataclass(frozen=True)
class WorkerOptions:
    concurrency: int = 4
    """Messages handled at once by this worker."""
    max_deliver: int = 5
    """Deliveries before a failing message goes to dead."""
    nak_delay: float = 0.5
    """First redelivery delay after a failure; doubles each time, capped at 30 s."""
    fetch_timeout: float = 1.0
    """Seconds one fetch waits for messages (also how fast a stop is noticed)."""


Handler = Callable[[E, Msg], Awaitable[Hold | None]]
OnDead = Callable[[E, str], Awaitable[None]]
"""Called with an event and the reason before it is dead-lettered (the rollout records the
prompt as dropped, so the gate issues another in its place)."""


@dataclass
class Worker(Generic[E]):
    """Serves `channel`'s work queue with `handler` until `stop` is set: each message decoded
    to the channel's event class."""

    js: JetStreamContext
    topology: Topology
    channel: Channel[E]
    handler: Handler[E]
    publisher: Publisher
    options: WorkerOptions = WorkerOptions()
    on_dead: OnDead[E] | None = None
    fetching: asyncio.Event | None = None
    """Fetch only while this is set (None: always): a trainer lends its device to rollout only
    while it waits for its batches (`consumers.lending`); what it holds meanwhile is still
    heartbeaten."""
    _inflight: dict[int, Msg] = field(default_factory=dict)
    _held: dict[int, Msg] = field(default_factory=dict)
    """Messages handlers returned HOLD for, by stream sequence (a redelivery replaces the stale
    delivery), until they are settled."""

    def __post_init__(self) -> None:
        if not isinstance(self.js, JetStream):
            raise TypeError(
                "Worker pulls through the connection its JetStream context came from: "
                "make the context with bus.connection.connect(...).jetstream()"
            )

    @property
    def queue(self) -> WorkQueue:
        return self.channel.work_queue

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and handle until `stop`, then drain. The heartbeat runs in a TaskGroup with the
        loop: should it fail, the loop is cancelled and the error raised, rather than handlers
        running on while the server hands their messages to others."""
        assert isinstance(self.js, JetStream)
        puller = Puller(self.js, self.topology.stream(self.channel), self.queue.durable)
        await puller.open()
        ack_wait = await consumer_ack_wait(self.js, self.topology, self.channel)
        try:
            async with asyncio.TaskGroup() as group:
                heartbeat = group.create_task(self._heartbeat(ack_wait))
                await self._serve(
                    puller,
                    stop,
                    Slots(self.queue.durable, self._handle, self.options.concurrency, group),
                )
                await cancel_until_done([heartbeat])  # its `in_progress` can swallow one cancel
        finally:
            await puller.close()

    async def _serve(self, puller: Puller, stop: asyncio.Event, slots: Slots[Msg]) -> None:
        while not stop.is_set():
            # Refill when half the slots are free: fetching one message per free slot
            # would make every message pay a request round trip.
            await slots.half_free()
            if self.fetching is not None and not self.fetching.is_set():
                with contextlib.suppress(TimeoutError):  # woken each fetch_timeout for `stop`
                    await asyncio.wait_for(self.fetching.wait(), self.options.fetch_timeout)
                continue
            try:
                msgs = await puller.fetch(
                    self.options.concurrency - slots.held, self.options.fetch_timeout
                )
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except nats.errors.Error as exc:  # connection trouble: the client reconnects
                log.warning("%s fetch failed: %s", self.queue.durable, exc)
                await asyncio.sleep(0.5)
                continue
            slots.give(msgs)
        # Drain: finish what was fetched; unfetched messages stay in the stream.
        started = time.monotonic()
        log.info("%s: stopping, %d messages in hand", self.queue.durable, slots.held)
        await slots.close()
        log.info("%s: drained in %.1f s", self.queue.durable, time.monotonic() - started)

    async def _handle(self, msg: Msg) -> None:
        deliveries = msg.metadata.num_delivered
        if deliveries > self.options.max_deliver:
            try:
                given_up: E | None = decode(msg.data, self.channel.event)  # type: ignore[arg-type]
            except DecodeError:  # a poison message has no event to report
                given_up = None
            await self._dead(msg, f"gave up after {deliveries - 1} deliveries", given_up)
            return
        try:
            event = decode(msg.data, self.channel.event)  # type: ignore[arg-type]
        except DecodeError as exc:
            await self._dead(msg, str(exc))
            return
        self._inflight[id(msg)] = msg
        try:
            with tracing.process_span(msg.subject, event.id, msg.headers, {"jetrl.run": event.run}):
                outcome = await self.handler(event, msg)
        except Reject as exc:
            await self._dead(msg, f"rejected: {exc}", event)
            return
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if deliveries >= self.options.max_deliver:
                await self._dead(msg, f"failed {deliveries} times, last: {reason}", event)
            else:
                log.warning(
                    "%s: %s failed (delivery %d): %s",
                    self.queue.durable,
                    event.id,
                    deliveries,
                    reason,
                )
                # A handler that acked before raising leaves nothing to nak.
                with contextlib.suppress(MsgAlreadyAckdError):
                    await msg.nak(delay=min(self.options.nak_delay * 2 ** (deliveries - 1), 30.0))
            return
        finally:
            self._inflight.pop(id(msg), None)
        if outcome is HOLD:
            self._held[msg.metadata.sequence.stream] = msg
        else:
            await msg.ack()

    async def _heartbeat(self, ack_wait: float) -> None:
        """The one heartbeat: every running handler's message and every held one is still being
        worked on. Paced by the consumer's ack_wait (`consumer_ack_wait`), which is kept short so
        that a dead worker's messages come back within seconds, not minutes."""
        while True:
            await asyncio.sleep(ack_wait / 3)
            for seq, msg in list(self._held.items()):
                if msg.is_acked:  # settled by its holder since the last beat
                    del self._held[seq]
            for msg in [*self._inflight.values(), *self._held.values()]:
                await msg.in_progress()

    async def _dead(self, msg: Msg, reason: str, event: E | None = None) -> None:
        log.warning(
            "%s: dead letter (seq %d): %s", self.queue.durable, msg.metadata.sequence.stream, reason
        )
        if event is not None and self.on_dead is not None:
            await self.on_dead(event, reason)
        await dead_letter(self.publisher, self.queue.durable, msg, reason)
        await msg.term()


async def consumer_ack_wait(js: JetStreamContext, topology: Topology, channel: Channel) -> float:
    """The ack_wait of the work queue's consumer as the server has it, which heartbeats must beat.

    Not the table's `ack_wait`: that is only the default the first process to declare the queue
    used. An operator may have declared it shorter, and a heartbeat paced by the longer default
    would let held messages be redelivered while still being worked on.
    """
    queue = channel.work_queue
    info = await js.consumer_info(topology.stream(channel), queue.durable)
    return info.config.ack_wait or queue.ack_wait


def stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT set `stop`: the loop stops fetching, drains in-flight work, returns."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
