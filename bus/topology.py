"""The streams, durable consumers, KV buckets and object store of one run, declared once.

Applying is idempotent: what is missing is created, so every process may call `apply` at
start-up; only an explicit update changes what exists.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

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
from schemas.names import check_run_id

GiB = 1 << 30
DAY = 24 * 3600.0
# Long enough that a redelivery after a restart is still deduplicated by the server
# (the default is 2 minutes); consumers also drop ids they have already seen.
DEDUP_WINDOW = 3600.0

STAGES = ("prompts", "trajectories", "rewards", "batches", "weights", "dead")


def run_id_arg(value: str) -> str:
    """argparse type for --run: the same check, reported as a usage error."""
    try:
        return check_run_id(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class WorkQueue:
    """A durable pull consumer shared by the competing workers of one stage."""

    stage: str
    """Stream it reads (one of STAGES)."""
    durable: str
    """Consumer name, the role of its workers."""
    ack_wait: float
    """Seconds before an unacked message is redelivered (workers heartbeat with in_progress)."""
    max_ack_pending: int
    """Most messages handed out and not yet acked, over all workers."""


@dataclass(frozen=True)
class Topology:
    """Names and settings of one run's JetStream objects."""

    run: str
    replicas: int = 1
    max_bytes: dict[str, int] = field(
        default_factory=lambda: {
            "prompts": 1 * GiB,
            "trajectories": 4 * GiB,
            "rewards": 4 * GiB,
            "batches": 8 * GiB,
            "weights": 64 << 20,
            "dead": 1 * GiB,
        }
    )
    max_age: float = 7 * DAY
    member_ttl: float = 15.0
    """Seconds a worker's membership entry lives without a heartbeat (set when the bucket is created)."""

    def __post_init__(self) -> None:
        check_run_id(self.run)
        if self.replicas not in (1, 3, 5):
            raise ValueError(f"replicas must be 1, 3 or 5, got {self.replicas}")

    # Subjects ---------------------------------------------------------------
    def subject(self, stage: str, *tokens: str | int) -> str:
        return ".".join(["rl", self.run, stage, *map(str, tokens)])

    def stream(self, stage: str) -> str:
        return f"RL_{self.run}_{stage.upper()}"

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

    # Work sharing -----------------------------------------------------------
    @property
    def queues(self) -> dict[str, WorkQueue]:
        return {
            "rollout": WorkQueue("prompts", "rollout", ack_wait=60.0, max_ack_pending=1024),
            "reward": WorkQueue("trajectories", "reward", ack_wait=60.0, max_ack_pending=4096),
            # The buffer holds scored samples unacked until they are inside a stored batch,
            # so its pending window must hold several steps of samples.
            "buffer": WorkQueue("rewards", "buffer", ack_wait=120.0, max_ack_pending=65536),
        }

    def stream_config(self, stage: str) -> StreamConfig:
        subjects = [self.subject(stage, ">")] if stage in ("batches", "dead") else [self.subject(stage)]
        return StreamConfig(
            name=self.stream(stage),
            subjects=subjects,
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_bytes=self.max_bytes[stage],
            max_age=self.max_age,
            max_msg_size=MAX_PAYLOAD,
            storage=StorageType.FILE,
            num_replicas=self.replicas,
            duplicate_window=DEDUP_WINDOW,
            allow_direct=True,
        )

    def consumer_config(self, queue: WorkQueue) -> ConsumerConfig:
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
            filter_subject=self.subject(queue.stage),
            num_replicas=self.replicas,
        )

    async def apply(self, js: JetStreamContext, update: bool = False) -> None:
        """Create what is missing: streams, consumers, KV buckets, object store.

        Existing streams and consumers are left as they are unless `update` (the operator's
        `ops.streams apply`): every worker applies at start-up, and one started with other
        settings (say `--replicas 1` on a 3-replica run) must not reconfigure the run.
        """
        for stage in STAGES:
            config = self.stream_config(stage)
            try:
                await js.stream_info(config.name)  # type: ignore[arg-type]
            except NotFoundError:
                await js.add_stream(config)
            else:
                if update:
                    await js.update_stream(config)
        for queue in self.queues.values():
            try:
                await js.consumer_info(self.stream(queue.stage), queue.durable)
            except NotFoundError:
                await js.add_consumer(self.stream(queue.stage), self.consumer_config(queue))
            else:
                if update:
                    await js.add_consumer(self.stream(queue.stage), self.consumer_config(queue))
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
        for stage in STAGES:
            try:
                await js.delete_stream(self.stream(stage))
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
