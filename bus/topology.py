"""The streams, durable consumers, KV buckets and object store of one run, declared once.

Every data flow between processes is a `Channel` in the `CHANNELS` table below: its stream,
the event it carries, whether its subject has a per-rank or per-stage token, its durable
work queue (when competing workers share it), which roles publish it and which read it, and
how. Publishing takes a channel and an event (`Publisher.publish`), serving takes a channel
and a handler (`bus.worker.Worker`); permissions (`ops.security`), `ops.status`, `ops.chaos`,
the audit and the architecture page derive from the table instead of restating it. Roles
appear here as plain names only: `bus` knows no stage's code.

Applying is idempotent: what is missing is created, so every process may call `apply` at
start-up; only an explicit update changes what exists.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Generic, TypeVar

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BucketNotFoundError, NotFoundError

from bus.embedded import MAX_PAYLOAD
from schemas.events import (
    BatchEvent,
    Event,
    PromptEvent,
    RewardEvent,
    TrajectoryEvent,
)
from schemas.names import check_run_id
from schemas.streams_config import stream_needs
from schemas.weight_event import WeightVersionEvent

if TYPE_CHECKING:
    from schemas.config import RunConfig

E = TypeVar("E", bound=Event)

GiB = 1 << 30
# Long enough that a redelivery after a restart is still deduplicated by the server
# (the default is 2 minutes); consumers also drop ids they have already seen.
DEDUP_WINDOW = 3600.0


def run_id_arg(value: str) -> str:
    """argparse type for --run: the same check, reported as a usage error."""
    try:
        return check_run_id(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# Channels -------------------------------------------------------------------------------


class Read(Enum):
    """How a role reads a channel; each way needs its own permissions (`ops.security`)."""

    WORK_QUEUE = "work queue"
    """Competing workers share the channel's durable consumer: each message goes to one, acked."""
    BY_POSITION = "by position"
    """An ordered consumer from a stream sequence the reader keeps (the trainer's checkpoint)."""
    BROADCAST = "broadcast"
    """An ordered consumer from the last message on: every reader sees every new value."""
    REPLAY = "replay"
    """The whole stream once, in order, at start-up."""
    LAST_STORED = "last stored"
    """Single messages by sequence, from the end back (a producer resuming after its last)."""


@dataclass(frozen=True)
class Reader:
    role: str
    read: Read


@dataclass(frozen=True)
class WorkQueue:
    """A durable pull consumer shared by the competing workers of one channel."""

    durable: str
    """Consumer name, the role of its workers."""
    ack_wait: float
    """Seconds before an unacked message is redelivered (workers heartbeat with in_progress)."""
    max_ack_pending: int
    """Most messages handed out and not yet acked, over all workers."""


@dataclass(frozen=True)
class Channel(Generic[E]):
    """One data flow between processes: a stream, its subject and event, who writes and reads it."""

    name: str
    """The stream stage: `rl.<run>.<name>` is its subject, `RL_<run>_<NAME>` its stream."""
    event: type[E] | None
    """The event class every message is; None for `dead`, which keeps the original bytes."""
    token: str | None
    """What the one extra subject token names (`batches.<rank>`), None for a plain subject."""
    publishers: tuple[str, ...]
    readers: tuple[Reader, ...]
    queue: WorkQueue | None = None
    """The durable work queue, when competing workers share the channel."""

    @property
    def consumers(self) -> tuple[str, ...]:
        """The roles that read the channel, in any way."""
        return tuple(dict.fromkeys(reader.role for reader in self.readers))

    @property
    def work_queue(self) -> WorkQueue:
        """The channel's work queue; ValueError for a channel that is not one."""
        if self.queue is None:
            raise ValueError(f"channel {self.name} has no work queue")
        return self.queue

    def with_queue(self, **changes: object) -> Channel[E]:
        """This channel with its work queue's settings changed: a test's short ack_wait, or an
        operator's (what the server has wins over the table: `bus.worker.consumer_ack_wait`)."""
        return dataclasses.replace(self, queue=dataclasses.replace(self.work_queue, **changes))  # type: ignore[arg-type]


ACK_WAIT = 10.0
"""Seconds a work queue's consumer waits for an ack before it redelivers. Short, so recovery is
bounded by liveness: a live worker heartbeats `in_progress` every ack_wait / 3 for every message
it runs or holds (`bus.worker`), however long the work takes, and a killed worker's messages come
back to the others within ack_wait. (At 60-120 s, one kill of the buffer stopped training for
up to 115 s.)"""

PROMPTS: Channel[PromptEvent] = Channel(
    "prompts", PromptEvent, None, publishers=("producer",),
    readers=(Reader("rollout", Read.WORK_QUEUE), Reader("producer", Read.LAST_STORED)),
    queue=WorkQueue("rollout", ack_wait=ACK_WAIT, max_ack_pending=1024),
)
TRAJECTORIES: Channel[TrajectoryEvent] = Channel(
    "trajectories", TrajectoryEvent, None, publishers=("rollout",), readers=(Reader("reward", Read.WORK_QUEUE),),
    queue=WorkQueue("reward", ack_wait=ACK_WAIT, max_ack_pending=4096),
)
REWARDS: Channel[RewardEvent] = Channel(
    "rewards", RewardEvent, None, publishers=("reward",), readers=(Reader("buffer", Read.WORK_QUEUE),),
    # The buffer holds scored samples unacked until they are inside a stored batch, so its
    # pending window must hold several steps of samples.
    queue=WorkQueue("buffer", ack_wait=ACK_WAIT, max_ack_pending=65536),
)
BATCHES: Channel[BatchEvent] = Channel(
    "batches", BatchEvent, "rank", publishers=("buffer",),
    readers=(Reader("trainer", Read.BY_POSITION), Reader("buffer", Read.REPLAY)),
)
WEIGHTS: Channel[WeightVersionEvent] = Channel(
    "weights", WeightVersionEvent, None, publishers=("trainer",),
    readers=(Reader("rollout", Read.BROADCAST), Reader("producer", Read.BROADCAST)),
)
DEAD: Channel[Event] = Channel(
    "dead", None, "stage", publishers=("rollout", "reward", "buffer", "trainer"), readers=(),
)
"""What a stage cannot use, with the reason, under the stage that refused it (read by the operator)."""

CHANNELS: tuple[Channel, ...] = (PROMPTS, TRAJECTORIES, REWARDS, BATCHES, WEIGHTS, DEAD)
WORK_QUEUES: tuple[Channel, ...] = tuple(c for c in CHANNELS if c.queue is not None)
"""The channels that competing workers share through a durable consumer."""


def served_by(role: str) -> Channel | None:
    """The channel whose work queue `role`'s workers share, if any."""
    return next((c for c in WORK_QUEUES if c.work_queue.durable == role), None)


# KV keys ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvKey:
    """A family of keys in the run's KV bucket that crosses processes."""

    pattern: str
    """Its keys, as the docs write them."""
    filter: str
    """The subject filter of its keys under `$KV.<bucket>.` (for watches and permissions)."""
    writers: tuple[str, ...]
    why: str


CONFIG = KvKey("config", "config", ("producer",), "the run's config, read by every worker at start-up")
DROPS = KvKey("drop.<prompt id>", "drop.>", ("buffer",), "a dropped group and why: the gate replaces it")
METRICS = KvKey("metrics.<rank>.<step>", "metrics.>", ("trainer",), "a trained step's numbers")
RENDEZVOUS = KvKey(
    "trainer.rendezvous", "trainer.rendezvous", ("trainer",),
    "fsdp rank 0's store address and group generation: the other ranks join it",
)
LOSS = KvKey(
    "loss.<channel>", "loss.>", tuple(c.work_queue.durable for c in WORK_QUEUES),
    "messages a work queue's stream deleted before they were acked (`bus.loss`): should never exist",
)
KV_KEYS: tuple[KvKey, ...] = (CONFIG, DROPS, METRICS, RENDEZVOUS, LOSS)

CONFIG_KEY = CONFIG.pattern
RENDEZVOUS_KEY = RENDEZVOUS.pattern
_DROP, _METRICS = "drop.", "metrics."


REFUSED_PROMPT = "rollout: "
"""How a drop record's reason starts when the rollout refused the prompt itself (it can never be
generated: untokenizable, too long for the model), not when a group was dropped for its rewards."""


def drop_key(prompt_id: str) -> str:
    return f"{_DROP}{prompt_id}"


def dropped_prompt(key: str) -> str | None:
    """The prompt id of a drop key, None for another key."""
    return key.removeprefix(_DROP) if key.startswith(_DROP) else None


def loss_key(channel: str) -> str:
    return f"loss.{channel}"


def metrics_key(rank: int, step: int) -> str:
    return f"{_METRICS}{rank}.{step}"


def metrics_prefix(rank: int | None = None) -> str:
    """`metrics.` or, for one rank, `metrics.<rank>.`: what its keys start with."""
    return _METRICS if rank is None else f"{_METRICS}{rank}."


def markdown_tables() -> str:
    """The channel and KV key tables as the architecture page shows them (a test keeps it so)."""
    rows = ["| channel | subject | event | work queue | published by | read by (how) |", "| --- " * 6 + "|"]
    for c in CHANNELS:
        subject = f"`rl.<run>.{c.name}{f'.<{c.token}>' if c.token else ''}`"
        event = f"`{c.event.__name__}`" if c.event else "the original bytes, reason in headers"
        queue = "-" if c.queue is None else (
            f"`{c.queue.durable}`: ack_wait {c.queue.ack_wait:g} s, at most {c.queue.max_ack_pending} unacked"
        )
        readers = ", ".join(f"{r.role} ({r.read.value})" for r in c.readers) or "the operator (`ops.status`)"
        rows.append(f"| `{c.name}` | {subject} | {event} | {queue} | {', '.join(c.publishers)} | {readers} |")
    rows += ["", "| KV key (bucket `rl_<run>`) | written by | what |", "| --- | --- | --- |"]
    rows += [f"| `{k.pattern}` | {', '.join(k.writers)} | {k.why} |" for k in KV_KEYS]
    return "\n".join(rows) + "\n"


# The run's objects ------------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """Names and settings of one run's JetStream objects."""

    run: str
    replicas: int = 1
    max_bytes: dict[str, int] = field(
        default_factory=lambda: {
            PROMPTS.name: 1 * GiB,
            TRAJECTORIES.name: 4 * GiB,
            REWARDS.name: 4 * GiB,
            BATCHES.name: 8 * GiB,
            WEIGHTS.name: 64 << 20,
            DEAD.name: 1 * GiB,
        }
    )
    """Per channel name. A run's streams are made with the limits its config derives
    (`for_config`, `schemas.streams_config`); these defaults serve what declares a run without
    a config (tests, benchmarks) and the ops tools that only need the names."""
    max_age: float = 0.0
    """Seconds a message may live in a stream; 0: no age limit."""
    keep_consumed: bool = False
    """False: trajectories and rewards are removed once their work queue acked them (interest
    retention). True: they stay, for replay (limits retention)."""
    member_ttl: float = 15.0
    """Seconds a worker's membership entry lives without a heartbeat (set when the bucket is created)."""

    @classmethod
    def for_config(cls, config: RunConfig, replicas: int = 1) -> Topology:
        """The run's objects with the limits its config derives (`schemas.streams_config.stream_needs`)."""
        return cls(
            run=config.run, replicas=replicas,
            max_bytes={name: need.limit for name, need in stream_needs(config).items()},
            max_age=config.streams.max_age_s, keep_consumed=config.streams.consumed == "keep",
        )

    def __post_init__(self) -> None:
        check_run_id(self.run)
        if self.replicas not in (1, 3, 5):
            raise ValueError(f"replicas must be 1, 3 or 5, got {self.replicas}")

    # Subjects ---------------------------------------------------------------
    def subject(self, channel: Channel, *tokens: str | int) -> str:
        """`rl.<run>.<channel>`, plus its one token (a rank, a stage, or a wildcard) if it has one."""
        if not isinstance(channel, Channel):
            raise TypeError(f"a Channel of bus.topology (PROMPTS, BATCHES, ...), not {channel!r}")
        if len(tokens) != (channel.token is not None):
            what = f"one token ({channel.token})" if channel.token else "no token"
            raise ValueError(f"channel {channel.name} takes {what}, got {tokens}")
        return ".".join(["rl", self.run, channel.name, *map(str, tokens)])

    def subjects(self, channel: Channel) -> str:
        """The subject, or wildcard, of every message of `channel` (every rank's, every stage's)."""
        return self.subject(channel, ">") if channel.token else self.subject(channel)

    @property
    def all_subjects(self) -> str:
        """The wildcard of every channel's subject of the run."""
        return f"rl.{self.run}.>"

    def stream(self, channel: Channel) -> str:
        if not isinstance(channel, Channel):
            raise TypeError(f"a Channel of bus.topology (PROMPTS, BATCHES, ...), not {channel!r}")
        return f"RL_{self.run}_{channel.name.upper()}"

    @property
    def kv_bucket(self) -> str:
        return f"rl_{self.run}"

    @property
    def members_bucket(self) -> str:
        """One key per live worker process, expiring `member_ttl` after its last heartbeat."""
        return f"rl_{self.run}_members"

    @property
    def object_bucket(self) -> str:
        return f"rl_{self.run}_weights"

    def stream_config(self, channel: Channel) -> StreamConfig:
        """Work never dropped: a full stream refuses a publish (discard new) and the publisher
        waits until its consumers catch up (`bus.publisher`), instead of the server deleting
        the oldest messages whether or not anyone received them. Trajectories and rewards are
        deleted once acked (interest retention) unless `keep_consumed`; prompts, batches and
        weights are kept (gate resume, audit, trainer restart). Only `dead` discards its oldest."""
        deleted_once_acked = channel in (TRAJECTORIES, REWARDS) and not self.keep_consumed
        return StreamConfig(
            name=self.stream(channel),
            subjects=[self.subjects(channel)],
            retention=RetentionPolicy.INTEREST if deleted_once_acked else RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD if channel is DEAD else DiscardPolicy.NEW,
            max_bytes=self.max_bytes[channel.name],
            max_age=self.max_age,
            max_msg_size=MAX_PAYLOAD,
            storage=StorageType.FILE,
            num_replicas=self.replicas,
            # The server refuses a dedup window longer than the age limit.
            duplicate_window=min(DEDUP_WINDOW, self.max_age) if self.max_age else DEDUP_WINDOW,
            allow_direct=True,
        )

    def consumer_config(self, channel: Channel) -> ConsumerConfig:
        """The durable consumer of `channel`'s work queue."""
        queue = channel.work_queue
        return ConsumerConfig(
            durable_name=queue.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=queue.ack_wait,
            # The worker loop counts deliveries itself and dead-letters past its limit
            # *before* running the handler, so a message that crashes its worker still
            # ends in `dead` instead of being silently dropped by the server.
            max_deliver=-1,
            max_ack_pending=queue.max_ack_pending,
            max_waiting=512,
            filter_subject=self.subject(channel),
            num_replicas=self.replicas,
        )

    async def apply(self, js: JetStreamContext, update: bool = False) -> None:
        """Create what is missing: streams, consumers, KV buckets, object store.

        Existing streams and consumers are left as they are unless `update` (the operator's
        `ops.streams apply`): every worker applies at start-up, and one started with other
        settings (say `--replicas 1` on a 3-replica run) must not reconfigure the run.
        """
        interest_later = []
        for channel in CHANNELS:
            config = self.stream_config(channel)
            try:
                await js.stream_info(config.name)  # type: ignore[arg-type]
            except NotFoundError:
                if config.retention is RetentionPolicy.INTEREST:
                    # An interest stream deletes at once a message stored while no consumer
                    # exists: it keeps everything until its work queue is made, then switches.
                    await js.add_stream(dataclasses.replace(config, retention=RetentionPolicy.LIMITS))
                    interest_later.append(config)
                else:
                    await js.add_stream(config)
            else:
                if update:
                    await js.update_stream(config)
        for channel in WORK_QUEUES:
            try:
                await js.consumer_info(self.stream(channel), channel.work_queue.durable)
            except NotFoundError:
                await js.add_consumer(self.stream(channel), self.consumer_config(channel))
            else:
                if update:
                    await js.add_consumer(self.stream(channel), self.consumer_config(channel))
        for config in interest_later:
            await js.update_stream(config)
        await self.apply_buckets(js)

    async def apply_buckets(self, js: JetStreamContext) -> None:
        """Create the KV buckets and object store if missing: a worker opens the run's KV to read
        its config, and only then makes streams with the limits the config derives."""
        for bucket, ttl in ((self.kv_bucket, None), (self.members_bucket, self.member_ttl)):
            try:
                await js.key_value(bucket)
            except BucketNotFoundError:
                await js.create_key_value(KeyValueConfig(bucket=bucket, history=1, ttl=ttl, replicas=self.replicas))
        try:
            await js.object_store(self.object_bucket)
        except (BucketNotFoundError, NotFoundError):
            await js.create_object_store(
                self.object_bucket, ObjectStoreConfig(bucket=self.object_bucket, replicas=self.replicas)
            )

    async def delete(self, js: JetStreamContext) -> None:
        for channel in CHANNELS:
            try:
                await js.delete_stream(self.stream(channel))
            except NotFoundError:
                pass
        for delete, bucket in (
            (js.delete_key_value, self.kv_bucket),
            (js.delete_key_value, self.members_bucket),
            (js.delete_object_store, self.object_bucket),
        ):
            try:
                await delete(bucket)
            except (NotFoundError, BucketNotFoundError):
                pass
