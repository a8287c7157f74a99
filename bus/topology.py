"""The streams, durable consumers, KV buckets and object store of one run, made from the channel
table (`bus.channels`, re-exported here).

Applying is idempotent: what is missing is created, so every process may call `apply` at
start-up; only an explicit update changes what exists.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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

from bus.channels import (
    ACK_WAIT,
    BATCHES,
    CHANNELS,
    CONFIG,
    CONFIG_KEY,
    DEAD,
    DECLARED,
    DROPS,
    EVERY_WORK_QUEUE,
    KV_KEYS,
    LEASES,
    LOSS,
    MEMBERS,
    METRICS,
    PROMPTS,
    REFUSED_PROMPT,
    RENDEZVOUS,
    RENDEZVOUS_KEY,
    REWARDS,
    REWARDS_TO_REFERENCE,
    SCORED,
    TRAJECTORIES,
    WEIGHTS,
    WORK_QUEUES,
    Channel,
    KvKey,
    Read,
    Reader,
    WorkQueue,
    channels_of,
    drop_key,
    dropped_prompt,
    episode_key,
    loss_key,
    markdown_tables,
    metrics_key,
    metrics_of,
    metrics_prefix,
    served_by,
    work_queues,
)
from bus.embedded import MAX_PAYLOAD
from schemas.names import check_run_id
from schemas.streams_config import MAX_CONSUMERS, MAX_WAITING, stream_needs, window_needs

if TYPE_CHECKING:
    from schemas.config import RunConfig

__all__ = [
    "ACK_WAIT",
    "BATCHES",
    "CHANNELS",
    "CONFIG",
    "CONFIG_KEY",
    "DEAD",
    "DECLARED",
    "DROPS",
    "EVERY_WORK_QUEUE",
    "KV_KEYS",
    "LEASES",
    "LOSS",
    "MEMBERS",
    "METRICS",
    "PROMPTS",
    "REFUSED_PROMPT",
    "RENDEZVOUS",
    "RENDEZVOUS_KEY",
    "REWARDS",
    "REWARDS_TO_REFERENCE",
    "SCORED",
    "TRAJECTORIES",
    "WEIGHTS",
    "WORK_QUEUES",
    "Channel",
    "KvKey",
    "Read",
    "Reader",
    "Topology",
    "WorkQueue",
    "channels_of",
    "drop_key",
    "episode_key",
    "dropped_prompt",
    "loss_key",
    "markdown_tables",
    "metrics_key",
    "metrics_of",
    "metrics_prefix",
    "run_id_arg",
    "served_by",
    "work_queues",
]

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
            SCORED.name: 4 * GiB,
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
    """Seconds a worker's membership entry lives without a heartbeat
    (set when the bucket is created)."""
    windows: dict[str, int] = field(default_factory=dict)
    """Per channel name: the most unacked messages its work queue must allow, when more than the
    channel table's `max_ack_pending` (`schemas.streams_config.window_needs`: the gate's bound
    on prompts and samples in flight). The table's value is the floor."""
    max_waiting: int = MAX_WAITING
    """Pull requests a work queue's consumer keeps waiting at once (`streams.max_waiting`)."""
    max_consumers: int = MAX_CONSUMERS
    """Consumers each stream and bucket of the run may hold (`streams.max_consumers`)."""
    reference: bool = False
    """The run has the reference stage (`reference.enabled`): it reads `rewards`,
    the buffer `scored`."""

    @classmethod
    def for_config(cls, config: RunConfig, replicas: int = 1) -> Topology:
        """The run's objects with the limits its config derives
        (`schemas.streams_config.stream_needs`)."""
        return cls(
            run=config.run,
            replicas=replicas,
            max_bytes={name: need.limit for name, need in stream_needs(config).items()},
            max_age=config.streams.max_age_s,
            keep_consumed=config.streams.consumed == "keep",
            windows=window_needs(config),
            max_waiting=config.streams.max_waiting,
            max_consumers=config.streams.max_consumers,
            reference=config.reference.enabled,
        )

    @property
    def channels(self) -> tuple[Channel, ...]:
        """Every channel of the run, `rewards` as this run reads it (`bus.channels.channels_of`)."""
        return channels_of(self.reference)

    @property
    def work_queues(self) -> tuple[Channel, ...]:
        """The channels this run's competing workers share (`bus.channels.work_queues`)."""
        return work_queues(self.reference)

    @property
    def buffer_input(self) -> Channel:
        """What the buffer reads: `scored` behind the reference stage, else `rewards`."""
        return SCORED if self.reference else REWARDS

    def served_by(self, role: str) -> Channel | None:
        """The channel whose work queue `role`'s workers share in this run, if any."""
        return served_by(role, self.reference)

    def __post_init__(self) -> None:
        check_run_id(self.run)
        if self.replicas not in (1, 3, 5):
            raise ValueError(f"replicas must be 1, 3 or 5, got {self.replicas}")

    # Subjects ---------------------------------------------------------------
    def subject(self, channel: Channel, *tokens: str | int) -> str:
        """`rl.<run>.<channel>`, plus its one token (a rank, a stage,
        or a wildcard) if it has one."""
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
        the oldest messages whether or not anyone received them. Trajectories, rewards and scored
        are deleted once acked (interest retention) unless `keep_consumed`; prompts, batches and
        weights are kept (gate resume, audit, trainer restart). Only `dead` discards its oldest."""
        deleted_once_acked = (
            channel.name in (TRAJECTORIES.name, REWARDS.name, SCORED.name)
            and not self.keep_consumed
        )
        return StreamConfig(
            name=self.stream(channel),
            subjects=[self.subjects(channel)],
            retention=RetentionPolicy.INTEREST if deleted_once_acked else RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD if channel is DEAD else DiscardPolicy.NEW,
            max_bytes=self.max_bytes[channel.name],
            max_age=self.max_age,
            max_msg_size=MAX_PAYLOAD,
            # Explicit: the server's default is 1,000 consumers a stream (nats-server 2.15).
            max_consumers=self.max_consumers,
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
            max_ack_pending=self.max_ack_pending(channel),
            # One waiting request per idle worker: past it the server refuses pulls at once.
            max_waiting=self.max_waiting,
            filter_subject=self.subject(channel),
            num_replicas=self.replicas,
        )

    def max_ack_pending(self, channel: Channel) -> int:
        """The window of `channel`'s work queue: the table's, raised to the run's need."""
        return max(channel.work_queue.max_ack_pending, self.windows.get(channel.name, 0))

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
                    await js.add_stream(
                        dataclasses.replace(config, retention=RetentionPolicy.LIMITS)
                    )
                    interest_later.append(config)
                else:
                    await js.add_stream(config)
            else:
                if update:
                    await js.update_stream(config)
        for channel in self.work_queues:
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
                await js.create_key_value(
                    KeyValueConfig(bucket=bucket, history=1, ttl=ttl, replicas=self.replicas)
                )
                await self.allow_consumers(js, f"KV_{bucket}")
        try:
            await js.object_store(self.object_bucket)
        except (BucketNotFoundError, NotFoundError):
            await js.create_object_store(
                self.object_bucket,
                ObjectStoreConfig(bucket=self.object_bucket, replicas=self.replicas),
            )
            await self.allow_consumers(js, f"OBJ_{self.object_bucket}")

    async def allow_consumers(self, js: JetStreamContext, stream: str) -> None:
        """A bucket's stream given the run's `max_consumers` once it is made (nats-py's bucket
        configs have no such field; the server's default is 1,000 consumers a stream)."""
        config = (await js.stream_info(stream)).config
        await js.update_stream(dataclasses.replace(config, max_consumers=self.max_consumers))

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
