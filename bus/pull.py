"""Byte-bounded pulls from a durable pull consumer, through nats-py's public client API only.

nats-py's pull subscription cannot bound a request's bytes, and reading its messages fast
needs its private queue. Here a worker owns a plain inbox subscription and publishes each
pull request itself (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>`, the inbox as reply):
the server delivers the messages there with their `$JS.ACK...` reply subjects, so nats-py
builds them as ordinary, ackable `Msg`s with `.metadata`.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from bus.connection import JetStream, NatsClient

# Bytes one pull request may bring (its `max_bytes`), well under the 64 MiB the server lets
# a client fall behind before cutting it off, and over the 8 MiB max payload, so that any
# one message fits.
FETCH_BYTES_BUDGET = 32 << 20
# Seconds a pull request may take to deliver what it found, past its own expiry: only a
# broken connection takes that long.
DELIVERY_TIMEOUT = 10.0


class Puller:
    """One worker's pull requests and the inbox they deliver to; `open` before, `close` after."""

    def __init__(self, js: JetStream, stream: str, durable: str) -> None:
        self.client = js.client
        self.subject = f"{js.api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.inbox = self.client.new_inbox()
        # Filled by the subscription's callback and read by `pull`, which is woken only when
        # what it waits for may be there (its batch, or a status that ends it): the messages
        # of a request come over many reads of the socket, and waking per read cost as much
        # as the server spends on a message (nats-py's `next_msg` starts two tasks per call).
        self._arrived: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._need = 0
        # Times the connection dropped: a request sent before a drop may have died with its
        # server, and is given up then, not at its deadline (10 s without a worker at each
        # kill of a cluster node, measured).
        self._drops = 0
        self._sub: Subscription | None = None

    async def open(self) -> None:
        self._sub = await self.client.subscribe(self.inbox, cb=self._on_msg)
        if isinstance(self.client, NatsClient):
            self.client.drop_listeners.add(self._dropped)

    async def close(self) -> None:
        if isinstance(self.client, NatsClient):
            self.client.drop_listeners.discard(self._dropped)
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    def _dropped(self) -> None:
        self._drops += 1
        if self._waiter is not None:
            _wake(self._waiter)

    async def _on_msg(self, msg: Msg) -> None:
        self._arrived.append(msg)
        waiter = self._waiter
        if (
            waiter is not None
            and not waiter.done()
            and (len(self._arrived) >= self._need or status(msg) is not None)
        ):
            waiter.set_result(None)

    async def fetch(self, want: int, fetch_timeout: float) -> list[Msg]:
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
        msgs = await self.pull({"batch": want, "no_wait": True}, DELIVERY_TIMEOUT)
        if msgs:
            return msgs
        return await self.pull(
            {"batch": 1, "expires": int(fetch_timeout * 1e9)}, fetch_timeout + DELIVERY_TIMEOUT
        )

    async def pull(self, request: dict[str, int | bool], timeout: float) -> list[Msg]:
        """Send one pull request and read what it delivers until it ends: its last message, or
        a status (404 nothing there, 408 expired, 409 byte budget reached).

        A request that got its whole batch is then followed by a "409 Batch Completed" status
        (sent to requests with `max_bytes`), which the next request reads first and skips.
        Taken as the next request's end, it left that request's messages unread in the inbox,
        delivered but never handled, and a worker held ever more messages than its
        concurrency (measured: 18 with 2), which no other worker could then take.

        A request cut short by `timeout`, or by the connection dropping, leaves the rest of its
        delivery in the inbox, where the next request reads it. Raises
        nats.errors.TimeoutError if nothing came at all, `PullRefused` if a 409 ended it at once.
        """
        body = json.dumps({**request, "max_bytes": FETCH_BYTES_BUDGET}).encode()
        drops = self._drops
        await self.client.publish(self.subject, body, reply=self.inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        msgs: list[Msg] = []
        while len(msgs) < request["batch"]:
            if not self._arrived and not await self._arrival(
                request["batch"] - len(msgs), deadline, drops
            ):
                if msgs:
                    break
                raise nats.errors.TimeoutError
            msg = self._arrived.popleft()
            code = status(msg)
            if code is not None:
                if not msgs and description(msg) == "Batch Completed":
                    continue
                if not msgs and code == "409":
                    raise PullRefused(f"pull refused: 409 {description(msg)}")
                break
            msgs.append(msg)
        return msgs

    async def _arrival(self, need: int, deadline: float, drops: int) -> bool:
        """Wait until `need` messages or a status have arrived, until `deadline` (loop time), or
        until the connection drops (unless it has since `drops`); True if anything has arrived."""
        if self._drops != drops:
            return bool(self._arrived)
        loop = asyncio.get_running_loop()
        self._need = need
        self._waiter = waiter = loop.create_future()
        timer = loop.call_at(deadline, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        return bool(self._arrived)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class PullRefused(nats.errors.Error):
    """A request the server ended at once with a 409 and nothing delivered: more waiting
    requests than the consumer's `max_waiting` ("Exceeded MaxWaiting"), a leadership change, a
    deleted consumer. Returning nothing would send the next request at once, and a worker
    would spin on refusals (above 512 waiting workers, `bus.topology`); raised, the worker
    says why and waits before it asks again, as for any fetch failure."""


def status(msg: Msg) -> str | None:
    """The status code of a message the server sent about a request, None for a stream message.

    Stream messages come with their `$JS.ACK...` reply subject; a status has none, only its
    code and description in headers (a publisher may set a `Status` header of its own).
    """
    if msg.reply or not msg.headers:
        return None
    return msg.headers.get(api.Header.STATUS)


def description(msg: Msg) -> str | None:
    return (msg.headers or {}).get(api.Header.DESCRIPTION)
