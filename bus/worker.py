"""The pull-worker loop every consuming stage runs.

One durable pull consumer per stage, shared by competing workers. For each message:
count deliveries -> decode -> run the handler under a process span while heartbeating
`in_progress` -> ack. Bad input (undecodable, unknown type/version, invalid fields, a
handler's `Reject`) goes to `dead` with its reason and is terminated; other errors are
nak'ed with a growing delay until `max_deliver`, then dead-lettered. A worker never
exits because of one message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import MsgAlreadyAckdError
from nats.js import JetStreamContext, api

from bus import tracing
from bus.dead import dead_letter
from bus.publisher import Publisher
from bus.topology import Channel, Topology, WorkQueue
from schemas.codec import DecodeError, decode
from schemas.events import Event

log = logging.getLogger("jetrl.worker")

E = TypeVar("E", bound=Event)

# Bytes one pull request may bring (its `max_bytes`), well under the 64 MiB the server lets
# a client fall behind before cutting it off, and over the 8 MiB max payload, so that any
# one message fits.
FETCH_BYTES_BUDGET = 32 << 20
# Seconds a pull request may take to deliver what it found, past its own expiry: only a
# broken connection takes that long.
DELIVERY_TIMEOUT = 10.0


class Reject(Exception):
    """Raised by a handler for input that can never succeed: dead-letter it, don't retry."""


class Hold:
    """Returned by a handler that keeps the message unacked and will ack it itself later."""


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
    _inflight: dict[int, Msg] = field(default_factory=dict)

    @property
    def queue(self) -> WorkQueue:
        return self.channel.work_queue

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch and handle until `stop`, then drain. The heartbeat runs in a TaskGroup with the
        loop: should it fail, the loop is cancelled and the error raised, rather than handlers
        running on while the server hands their messages to others."""
        sub = await self.js.pull_subscribe_bind(self.queue.durable, stream=self.topology.stream(self.channel))
        ack_wait = await consumer_ack_wait(self.js, self.topology, self.channel)
        async with asyncio.TaskGroup() as group:
            heartbeat = group.create_task(self._heartbeat(ack_wait))
            await self._serve(sub, stop)
            heartbeat.cancel()
        await sub.unsubscribe()

    async def _serve(self, sub: JetStreamContext.PullSubscription, stop: asyncio.Event) -> None:
        tasks: set[asyncio.Task[None]] = set()
        half = self.options.concurrency // 2
        room = asyncio.Event()

        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if len(tasks) <= half:
                room.set()

        while not stop.is_set():
            # Refill when half the slots are free: fetching one message per free slot
            # would make every message pay a request round trip.
            if len(tasks) > half:
                room.clear()
                await room.wait()
            try:
                msgs = await self._fetch(sub, self.options.concurrency - len(tasks))
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except nats.errors.Error as exc:  # connection trouble: the client reconnects
                log.warning("%s fetch failed: %s", self.queue.durable, exc)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                task = asyncio.create_task(self._handle(msg))
                tasks.add(task)
                task.add_done_callback(done)
        # Drain: finish what was fetched; unfetched messages stay in the stream.
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _fetch(self, sub: JetStreamContext.PullSubscription, want: int) -> list[Msg]:
        """Up to `want` messages and FETCH_BYTES_BUDGET bytes, returned as soon as any are there.

        A no-wait pull for what is there now; when nothing is, a long poll for one message
        (a pull for n that has to wait keeps waiting after the first message for the other
        n - 1 until it expires, and every hop of the pipeline would pay that).

        Not nats-py's `fetch`: it cannot bound a request's bytes, and when its timeout cuts a
        request short, that request goes on delivering while the next one starts. A message's
        size is known only once it arrives, and any may be as large as the max payload (a long
        trajectory, or poison the server accepted): with a batch sized for the usual size,
        a burst of 8 MiB messages piled up past the server's 64 MiB slow-client limit and
        the worker was disconnected on every fetch (measured). Here each request carries
        `max_bytes` and is read to its end before the next one goes out.
        """
        msgs = await self._pull(sub, {"batch": want, "no_wait": True}, DELIVERY_TIMEOUT)
        if msgs:
            return msgs
        expires = self.options.fetch_timeout
        return await self._pull(sub, {"batch": 1, "expires": int(expires * 1e9)}, expires + DELIVERY_TIMEOUT)

    async def _pull(
        self, sub: JetStreamContext.PullSubscription, request: dict[str, int | bool], timeout: float
    ) -> list[Msg]:
        """Send one pull request and read what it delivers until it ends: its last message, or
        a status (404 nothing there, 408 expired, 409 byte budget reached).

        A request that got its whole batch is then followed by a "409 Batch Completed" status
        (sent to requests with `max_bytes`), which the next request reads first and skips.
        Taken as the next request's end, it left that request's messages unread in the inbox,
        delivered but never handled, and a worker held ever more messages than its
        concurrency (measured: 18 with 2), which no other worker could then take.

        A request cut short by `timeout` leaves the rest of its delivery in the inbox, where
        the next request reads it. Raises nats.errors.TimeoutError if nothing came at all.
        """
        # nats-py keeps a pull subscription's inbox and request subject private.
        inbox, next_subject, reply = sub._sub, sub._nms, sub._deliver
        body = json.dumps({**request, "max_bytes": FETCH_BYTES_BUDGET}).encode()
        await self.js._nc.publish(next_subject, body, reply)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        msgs: list[Msg] = []
        while len(msgs) < request["batch"]:
            try:
                msg = await _next_msg(inbox, max(deadline - loop.time(), 0.001))
            except nats.errors.TimeoutError:
                if msgs:
                    break
                raise
            if JetStreamContext.is_status_msg(msg) is not None:
                if not msgs and (msg.headers or {}).get(api.Header.DESCRIPTION) == "Batch Completed":
                    continue
                break
            msgs.append(msg)
        return msgs

    async def _handle(self, msg: Msg) -> None:
        deliveries = msg.metadata.num_delivered
        if deliveries > self.options.max_deliver:
            await self._dead(msg, f"gave up after {deliveries - 1} deliveries")
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
            await self._dead(msg, f"rejected: {exc}")
            return
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if deliveries >= self.options.max_deliver:
                await self._dead(msg, f"failed {deliveries} times, last: {reason}")
            else:
                log.warning("%s: %s failed (delivery %d): %s", self.queue.durable, event.id, deliveries, reason)
                # A handler that acked before raising leaves nothing to nak.
                with contextlib.suppress(MsgAlreadyAckdError):
                    await msg.nak(delay=min(self.options.nak_delay * 2 ** (deliveries - 1), 30.0))
            return
        finally:
            self._inflight.pop(id(msg), None)
        if outcome is not HOLD:
            await msg.ack()

    async def _heartbeat(self, ack_wait: float) -> None:
        """Tell the server every running handler's message is still being worked on."""
        while True:
            await asyncio.sleep(ack_wait / 3)
            for msg in list(self._inflight.values()):
                await msg.in_progress()

    async def _dead(self, msg: Msg, reason: str) -> None:
        log.warning("%s: dead letter (seq %d): %s", self.queue.durable, msg.metadata.sequence.stream, reason)
        await dead_letter(self.publisher, self.queue.durable, msg, reason)
        await msg.term()


async def _next_msg(inbox: Subscription, timeout: float) -> Msg:
    """The inbox's next message, taken at once when one is there.

    nats-py's `next_msg` starts two tasks per call (~15 µs, as much as the server spends on
    the message); the messages of a pull request mostly arrive together, so all but the
    first of each request are already queued. Keeps the subscription's byte count and
    `task_done` as `next_msg` does.
    """
    queue = inbox._pending_queue
    if queue.empty():
        return await inbox.next_msg(timeout=timeout)
    msg = queue.get_nowait()
    inbox._pending_size -= len(msg.data)
    queue.task_done()
    return msg


async def consumer_ack_wait(js: JetStreamContext, topology: Topology, channel: Channel) -> float:
    """The ack_wait of the work queue's consumer as the server has it, which heartbeats must beat.

    Not the table's `ack_wait`: that is only the default the first process to declare the queue
    used. An operator (or `ops.chaos`, which shortens it so a killed worker's messages come
    back sooner) may have declared it shorter, and a heartbeat paced by the longer default
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
