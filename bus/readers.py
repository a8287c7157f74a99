"""One reader per read mode of `bus.channels.Read`, besides the work queue (`bus.worker`).

Each takes a `Channel` and yields `Stored` events: the channel's event, decoded, with its
stream sequence and subject. Bytes that are no such event (undecodable, unknown type or
version, invalid fields) are poison, handled in one place, `decode_or_poison`, the way
`bus.worker` handles them: dead-lettered under the reader's role (`Poison.dead_as`) with the
reason, logged, skipped. A reader with no role to dead-letter under (an operator's tool, the
producer) logs and skips.

    BROADCAST     Broadcast(js, topology, channel)         the last stored value, then each new one
    BY_POSITION   ByPosition(..., start_seq=s)             from sequence s on, in order, for ever
    REPLAY        Replay(...)                              the whole stream once, ends caught up
    LAST_STORED   LastStored(...).last() / .back() / .at() single messages, from the end back

The first three are ordered push consumers (ephemeral, no acks; nats-py recreates one whose
server dies); each is an async context manager that unsubscribes when its block ends: a
subscription nobody reads keeps its queue, and the connection's drain at exit waits on it
(commit b70a872). The server's flow control on ordered consumers bounds what is in flight
to the client. `LastStored` reads by sequence (`get_msg`) and holds nothing open. `Tap` is
no read of a stream: core subscriptions that see messages as they are sent (`ops.chaos`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Generic, TypeVar

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RawStreamMsg, RetentionPolicy
from nats.js.errors import NotFoundError

from bus.dead import dead_letter_bytes
from bus.election import ride_out
from bus.publisher import MSG_ID, Publisher
from bus.topology import Channel, Topology
from schemas.codec import DecodeError, decode
from schemas.events import Event

log = logging.getLogger("jetrl.readers")

E = TypeVar("E", bound=Event)
T = TypeVar("T")


@dataclass(frozen=True)
class Stored(Generic[E]):
    """One stored message of a channel, decoded: what every reader yields."""

    seq: int
    """Its stream sequence (the trainer's position, the gate's cursor)."""
    subject: str
    event: E
    data: bytes = field(repr=False)
    """The original bytes, for a dead letter of an event its reader refuses (`Reader.refuse`)."""
    stream: str = field(repr=False, default="")


@dataclass(frozen=True)
class Poison:
    """What a reader does with a message that is no event of its channel (or one it refuses):
    log one line, dead-letter the original bytes under `role` when a publisher is given, skip."""

    role: str
    """Who reads: the dead letter's stage (`dead.<role>`) and the log line's name."""
    publisher: Publisher | None = None
    """Where dead letters go; None for a reader that has no `dead.<role>` (an operator's tool)."""


async def decode_or_poison(
    channel: Channel[E],
    poison: Poison,
    data: bytes,
    subject: str,
    stream: str,
    seq: int,
    deliveries: int = 1,
) -> E | None:
    """The event these bytes hold, or None once they are handled as poison (`refuse`)."""
    try:
        return decode(data, channel.event)  # type: ignore[arg-type]
    except DecodeError as exc:
        await refuse(poison, data, subject, stream, seq, str(exc), deliveries)
        return None


async def refuse(
    poison: Poison,
    data: bytes,
    subject: str,
    stream: str,
    seq: int,
    reason: str,
    deliveries: int = 1,
) -> None:
    """Log one line and, with a publisher, dead-letter the bytes under the reader's role."""
    log.warning("%s: %s #%d skipped: %s", poison.role, stream, seq, reason)
    if poison.publisher is not None:
        await dead_letter_bytes(
            poison.publisher, poison.role, data, subject, stream, seq, deliveries, reason
        )


INACTIVE_THRESHOLD = 60.0
"""Seconds after its reader went away (a killed process) before the server deletes a replicated
reader's ephemeral consumer (an ordered consumer's goes with its connection)."""


class _Ordered(Generic[E]):
    """An ordered consumer on a channel's subject (or one token's), decoded through
    `decode_or_poison`; `async with` opens and closes it, `next` or `async for` reads."""

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        channel: Channel[E],
        poison: Poison,
        token: str | int | None = None,
        wanted: Callable[[str], bool] | None = None,
    ) -> None:
        """`wanted`: a message whose event id (its `Nats-Msg-Id`) it refuses is skipped before
        it is decoded (a reader that keeps a few events of a busy stream: decoding every one
        was a third of the producer's CPU, `producers.samples`)."""
        self.js, self.channel, self.poison, self.wanted = js, channel, poison, wanted
        self.stream = topology.stream(channel)
        self.subject = (
            topology.subjects(channel) if token is None else topology.subject(channel, token)
        )
        self._sub: JetStreamContext.PushSubscription | None = None

    def _config(self) -> ConsumerConfig:
        raise NotImplementedError

    async def open(self) -> None:
        """Create the consumer (callers that must ride out an election wrap this).

        On an interest-retention stream of several replicas (trajectories, rewards, scored at
        `--replicas 3`) the server refuses a consumer of fewer replicas than the stream (err
        10134, "consumer config replicas must match interest retention stream's replicas"), and
        nats-py makes every ordered consumer one replica in memory: there the reader is an
        ephemeral push consumer of the stream's replicas that acks nothing, delivering in order
        as the ordered one does (found by ops.bench.scale: the producer's samples.jsonl follower
        was refused on a 3-node cluster)."""
        stream = (await self.js.stream_info(self.stream)).config
        replicas = stream.num_replicas or 1
        if stream.retention == RetentionPolicy.INTEREST and replicas > 1:  # a str from the server
            config = self._config()
            config.ack_policy, config.num_replicas = AckPolicy.NONE, replicas
            config.inactive_threshold = INACTIVE_THRESHOLD
            self._sub = await self.js.subscribe(self.subject, config=config)
            return
        self._sub = await self.js.subscribe(
            self.subject, ordered_consumer=True, config=self._config()
        )

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except nats.errors.Error as exc:  # a closed connection has nothing left to clean
                log.debug("%s: unsubscribe failed: %s", self.subject, exc)

    async def __aenter__(self) -> _Ordered[E]:
        await self.open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def next(self, timeout: float | None = None) -> Stored[E]:
        """The next event, waiting up to `timeout` seconds for it (None: for ever); poison is
        skipped. Raises nats.errors.TimeoutError (a TimeoutError) when nothing came in time."""
        assert self._sub is not None, "open the reader first (async with)"
        while True:
            msg = await self._sub.next_msg(timeout=timeout)
            stored = await self._decoded(msg)
            if stored is not None:
                return stored

    async def _decoded(self, msg: Msg) -> Stored[E] | None:
        if self.wanted is not None and not self.wanted((msg.headers or {}).get(MSG_ID, "")):
            return None
        meta = msg.metadata
        seq = meta.sequence.stream
        event = await decode_or_poison(
            self.channel, self.poison, msg.data, msg.subject, meta.stream, seq
        )
        return None if event is None else Stored(seq, msg.subject, event, msg.data, meta.stream)

    def __aiter__(self) -> AsyncIterator[Stored[E]]:
        return self._forever()

    async def _forever(self) -> AsyncIterator[Stored[E]]:
        """Every event until the subscription ends (closed, or its connection closed)."""
        assert self._sub is not None, "open the reader first (async with)"
        async for msg in self._sub.messages:
            stored = await self._decoded(msg)
            if stored is not None:
                yield stored

    async def refuse(self, stored: Stored[E], reason: str) -> None:
        """An event the caller cannot use: handled as poison is (logged, dead-lettered)."""
        await refuse(self.poison, stored.data, stored.subject, stored.stream, stored.seq, reason)


class Broadcast(_Ordered[E]):
    """BROADCAST: the last stored message, then every new one (each reader sees every value)."""

    def _config(self) -> ConsumerConfig:
        return ConsumerConfig(deliver_policy=DeliverPolicy.LAST)


class ByPosition(_Ordered[E]):
    """BY_POSITION: every message from stream sequence `start_seq` on, in order, for ever."""

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        channel: Channel[E],
        poison: Poison,
        start_seq: int,
        token: str | int | None = None,
        wanted: Callable[[str], bool] | None = None,
    ) -> None:
        super().__init__(js, topology, channel, poison, token, wanted)
        self.start_seq = max(1, start_seq)

    def _config(self) -> ConsumerConfig:
        return ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.start_seq
        )


class Replay(_Ordered[E]):
    """REPLAY: the whole stream once, in order, ending at the last sequence stored when it opened.

    Up to that sequence, not a count of messages: a stream's start may be trimmed meanwhile
    (never its end), and a count would then wait for ever. It also ends where the server says
    nothing more is pending (the rest deleted, or on other subjects than the reader's token).
    `timeout` bounds each wait."""

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        channel: Channel[E],
        poison: Poison,
        token: str | int | None = None,
        timeout: float = 10.0,
    ) -> None:
        super().__init__(js, topology, channel, poison, token)
        self.timeout = timeout
        self.end = 0

    def _config(self) -> ConsumerConfig:
        return ConsumerConfig(deliver_policy=DeliverPolicy.ALL)

    async def open(self) -> None:
        state = (await self.js.stream_info(self.stream)).state
        self.end = state.last_seq if state.messages else 0
        if self.end:  # an empty stream has nothing to replay: no consumer
            await super().open()

    async def _forever(self) -> AsyncIterator[Stored[E]]:
        assert self.end == 0 or self._sub is not None, "open the reader first (async with)"
        while self._sub is not None:
            msg = await self._sub.next_msg(timeout=self.timeout)
            stored = await self._decoded(msg)
            if stored is not None:
                yield stored
            meta = msg.metadata
            if meta.sequence.stream >= self.end or meta.num_pending == 0:
                return


class LastStored(Generic[E]):
    """LAST_STORED: single messages by sequence (`get_msg`), from the end back; nothing held open.

    With `patient`, each read rides out an election (`bus.election.ride_out`): for a producer
    resuming while the cluster elects a leader."""

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        channel: Channel[E],
        poison: Poison,
        patient: bool = False,
    ) -> None:
        self.js, self.topology, self.channel, self.poison = js, topology, channel, poison
        self.stream = topology.stream(channel)
        self.patient = patient

    async def _call(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        return await ride_out(call, what) if self.patient else await call()

    async def _decoded(self, raw: RawStreamMsg) -> Stored[E] | None:
        data, subject, seq = raw.data or b"", raw.subject or "", raw.seq or 0
        event = await decode_or_poison(self.channel, self.poison, data, subject, self.stream, seq)
        return None if event is None else Stored(seq, subject, event, data, self.stream)

    async def at(self, seq: int) -> Stored[E] | None:
        """Message `seq`; None when it is deleted or poison."""
        try:
            raw = await self._call(
                lambda: self.js.get_msg(self.stream, seq), f"reading {self.stream} #{seq}"
            )
        except NotFoundError:
            return None
        return await self._decoded(raw)

    async def last(self, *tokens: str | int) -> Stored[E] | None:
        """The last message on the channel's subject (with its token); None when there is none or
        it is poison."""
        subject = self.topology.subject(self.channel, *tokens)
        try:
            raw = await self._call(
                lambda: self.js.get_last_msg(self.stream, subject), f"reading {subject}"
            )
        except NotFoundError:
            return None
        return await self._decoded(raw)

    async def last_seq(self, *tokens: str | int) -> int:
        """The sequence of the last message on the channel's subject (with its token), whatever
        it holds; 0 when there is none."""
        subject = self.topology.subject(self.channel, *tokens)
        try:
            raw = await self._call(
                lambda: self.js.get_last_msg(self.stream, subject), f"reading {subject}"
            )
        except NotFoundError:
            return 0
        return raw.seq or 0

    async def bounds(self) -> tuple[int, int]:
        """The stream's (first, last) sequence now; (0, 0) when it is empty."""
        info = await self._call(lambda: self.js.stream_info(self.stream), f"reading {self.stream}")
        state = info.state
        return (state.first_seq, state.last_seq) if state.messages else (0, 0)

    async def back(
        self, start: int | None = None, limit: int | None = None
    ) -> AsyncIterator[Stored[E]]:
        """Events from sequence `start` (the stream's last by default) back to its first, or
        over at most `limit` sequences; deleted messages and poison are stepped over."""
        first = 1
        if start is None or limit is None:  # only then is the stream's state needed
            first, last = await self.bounds()
            start = last if start is None else start
        end = first if limit is None else start - limit + 1
        for seq in range(start, max(end, 1) - 1, -1):
            stored = await self.at(seq)
            if stored is not None:
                yield stored


class Tap:
    """Not a read mode: core subscriptions that see each message on some subjects as it is
    sent, before (or whether) a stream stores it, undecoded: `ops.chaos` times when a replaced
    process's first output goes out. `seen(kind, msg)` is called for each; `open` / `close`."""

    def __init__(
        self, nc: Client, subjects: dict[str, str], seen: Callable[[str, Msg], Awaitable[None]]
    ) -> None:
        self.nc, self.subjects, self.seen = nc, subjects, seen
        self._subs: list[Subscription] = []

    async def open(self) -> None:
        for kind, subject in self.subjects.items():
            self._subs.append(await self.nc.subscribe(subject, cb=partial(self.seen, kind)))

    async def close(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            await sub.unsubscribe()
