"""Every data flow of a run, declared once: channels (stream, event, who writes, who reads how)
and the run's KV keys, as plain data: no connection, no stage's code.

Each flow between processes is a `Channel` in the tables below: its stream, the event it carries,
whether its subject has a per-rank or per-stage token, its durable work queue (when competing
workers share it), which roles publish it and which read it, and how. Publishing takes a channel
and an event (`bus.publisher.Publisher.publish`), serving takes a channel and a handler
(`bus.worker.Worker`); permissions (`bus.security`), `ops.status`, `ops.chaos`, the audit and the
architecture page derive from the tables instead of restating them. Roles appear here as plain
names only. `bus.topology` makes the JetStream objects of one run from them.

Which work queues a run has depends on one setting: with `reference.enabled` the reference stage
reads `rewards` (its own durable) and writes `scored`, which the buffer reads; without it the
buffer reads `rewards`. `work_queues(reference)` gives the set; every stream exists either way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from schemas.batch_event import BatchEvent
from schemas.codec import EVENT_TYPES
from schemas.episode_state import EpisodeState
from schemas.events import (
    Event,
    PromptEvent,
    Rewards,
    Trajectories,
)
from schemas.kv_records import (
    DeviceLease,
    DropRecord,
    KvRecord,
    LossRecord,
    Member,
    Rendezvous,
    StepMetrics,
)
from schemas.streams_config import GATED_WINDOWS
from schemas.weight_event import WeightVersionEvent

E = TypeVar("E", bound=Event)
R = TypeVar("R", bound=KvRecord)

# Channels -------------------------------------------------------------------------------


class Read(Enum):
    """How a role reads a channel; each way needs its own permissions (`bus.security`) and has
    one reader in bus/, which decodes and handles poison the same way (`bus.readers`)."""

    WORK_QUEUE = "work queue"
    """Competing workers share the channel's durable consumer: each message goes to one, acked.
    Read with `bus.worker.Worker`."""
    BY_POSITION = "by position"
    """An ordered consumer from a stream sequence the reader keeps (the trainer's checkpoint).
    Read with `bus.readers.ByPosition`."""
    BROADCAST = "broadcast"
    """An ordered consumer from the last message on: every reader sees every new value.
    Read with `bus.readers.Broadcast`."""
    REPLAY = "replay"
    """The whole stream once, in order, at start-up. Read with `bus.readers.Replay`."""
    LAST_STORED = "last stored"
    """Single messages by sequence, from the end back (a producer resuming after its last).
    Read with `bus.readers.LastStored`."""


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
    "prompts",
    PromptEvent,
    None,
    publishers=("producer",),
    # The trainer too: with `lend: true` it runs rollout while it waits (`consumers.lending`).
    readers=(
        Reader("rollout", Read.WORK_QUEUE),
        Reader("trainer", Read.WORK_QUEUE),
        Reader("producer", Read.LAST_STORED),
    ),
    queue=WorkQueue("rollout", ack_wait=ACK_WAIT, max_ack_pending=1024),
)
# `trajectories`, `rewards` and `scored` carry a sample's event, or a whole group's
# (`schemas.group_events`): a reader takes `each()`.
TRAJECTORIES: Channel[Trajectories] = Channel(
    "trajectories",
    Trajectories,
    None,
    publishers=("rollout", "trainer"),  # the trainer's: `lend: true` (`consumers.lending`)
    readers=(Reader("reward", Read.WORK_QUEUE),),
    queue=WorkQueue("reward", ack_wait=ACK_WAIT, max_ack_pending=4096),
)
REWARDS: Channel[Rewards] = Channel(
    "rewards",
    Rewards,
    None,
    publishers=("reward",),
    # The producer follows it for `samples.jsonl` (`producers.samples`).
    readers=(Reader("buffer", Read.WORK_QUEUE), Reader("producer", Read.BY_POSITION)),
    # The buffer holds scored samples unacked until they are inside a stored batch, so its
    # pending window must hold several steps of samples.
    queue=WorkQueue("buffer", ack_wait=ACK_WAIT, max_ack_pending=65536),
)
REWARDS_TO_REFERENCE: Channel[Rewards] = dataclasses.replace(
    REWARDS,
    readers=(Reader("reference", Read.WORK_QUEUE), Reader("producer", Read.BY_POSITION)),
    queue=WorkQueue("reference", ack_wait=ACK_WAIT, max_ack_pending=4096),
)
"""`rewards` as a run with `reference.enabled` has it: the same stream,
read by the reference stage."""
SCORED: Channel[Rewards] = Channel(
    "scored",
    Rewards,
    None,
    publishers=("reference",),
    readers=(Reader("buffer", Read.WORK_QUEUE),),
    queue=WorkQueue("buffer", ack_wait=ACK_WAIT, max_ack_pending=65536),
)
"""Scored samples with their reference log-probs (`RewardEvent.ref_logprobs`), for the buffer."""
BATCHES: Channel[BatchEvent] = Channel(
    "batches",
    BatchEvent,
    "rank",
    publishers=("buffer",),
    # The trainer also reads its last stored batch at start: does it replay stored steps?
    readers=(
        Reader("trainer", Read.BY_POSITION),
        Reader("buffer", Read.REPLAY),
        Reader("trainer", Read.LAST_STORED),
    ),
)
WEIGHTS: Channel[WeightVersionEvent] = Channel(
    "weights",
    WeightVersionEvent,
    None,
    publishers=("trainer",),
    readers=(Reader("rollout", Read.BROADCAST), Reader("producer", Read.BROADCAST)),
)
DEAD: Channel[Event] = Channel(
    "dead",
    None,
    "stage",
    publishers=("rollout", "reward", "reference", "buffer", "trainer"),
    readers=(),
)
"""What a stage cannot use, with the reason, under the stage that refused it
(read by the operator)."""

CHANNELS: tuple[Channel, ...] = (PROMPTS, TRAJECTORIES, REWARDS, SCORED, BATCHES, WEIGHTS, DEAD)
"""One per stream of a run; every run has all of them (`scored` stays empty without the reference
stage)."""


def work_queues(reference: bool) -> tuple[Channel, ...]:
    """The channels competing workers share through a durable consumer, in flow order: with the
    reference stage, rewards -> reference -> scored -> buffer; without, rewards -> buffer."""
    tail = (REWARDS_TO_REFERENCE, SCORED) if reference else (REWARDS,)
    return (PROMPTS, TRAJECTORIES, *tail)


WORK_QUEUES: tuple[Channel, ...] = work_queues(False)
"""The work queues of a run without the reference stage (`work_queues` for either)."""
EVERY_WORK_QUEUE: tuple[Channel, ...] = tuple(
    dict.fromkeys((*work_queues(False), *work_queues(True)))
)
"""Every work queue a run may have (permissions allow each role all of its own)."""
DECLARED: tuple[Channel, ...] = (
    PROMPTS,
    TRAJECTORIES,
    REWARDS,
    REWARDS_TO_REFERENCE,
    SCORED,
    BATCHES,
    WEIGHTS,
    DEAD,
)
"""Every declaration of the table, both readings of `rewards` among them: what roles and
permissions derive from (a role may do what any run asks of it)."""


def channels_of(reference: bool) -> tuple[Channel, ...]:
    """CHANNELS with `rewards` as the run reads it (by the buffer, or by the reference stage)."""
    return tuple(REWARDS_TO_REFERENCE if c is REWARDS and reference else c for c in CHANNELS)


def served_by(role: str, reference: bool = False) -> Channel | None:
    """The channel whose work queue `role`'s workers share, if any."""
    return next((c for c in work_queues(reference) if c.work_queue.durable == role), None)


# KV keys ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvKey(Generic[R]):
    """A family of keys in the run's KV bucket that crosses processes, and the record its values
    are (`schemas.kv_records`), as a `Channel` names its event class."""

    pattern: str
    """Its keys, as the docs write them."""
    filter: str
    """The subject filter of its keys under `$KV.<bucket>.` (for watches and permissions)."""
    writers: tuple[str, ...]
    why: str
    record: type[R] | None = None
    """The model of its values, with their one encode/decode; None for `config` (the run's
    YAML, `schemas.config.RunConfig`: `bus.runtime.publish_config`)."""


CONFIG: KvKey = KvKey(
    "config", "config", ("producer",), "the run's config, read by every worker at start-up"
)
DROPS = KvKey(
    "drop.<prompt id>",
    "drop.>",
    ("buffer",),
    "a dropped group and why: the gate replaces it",
    DropRecord,
)
METRICS = KvKey(
    "metrics.<rank>.<step>", "metrics.>", ("trainer",), "a trained step's numbers", StepMetrics
)
RENDEZVOUS = KvKey(
    "trainer.rendezvous",
    "trainer.rendezvous",
    ("trainer",),
    "fsdp rank 0's store address and group generation: the other ranks join it",
    Rendezvous,
)
LOSS = KvKey(
    "loss.<channel>",
    "loss.>",
    tuple(dict.fromkeys(c.work_queue.durable for c in EVERY_WORK_QUEUE)),
    "messages a work queue's stream deleted before they were acked (`bus.loss`): "
    "should never exist",
    LossRecord,
)
EPISODES = KvKey(
    "episode.<prompt id>.<sample>",
    "episode.>",
    ("rollout",),
    "an agent episode after its last completed turn: a rollout worker that takes the prompt "
    "over resumes it there (`consumers.episodes`); deleted once the prompt's trajectories are "
    "stored",
    EpisodeState,
)
LEASES = KvKey(
    "lease.<device>",
    "lease.>",
    ("rollout", "trainer"),
    "who holds a node's device now, in which phase (`placement: colocated`, `bus.lease`)",
    DeviceLease,
)
KV_KEYS: tuple[KvKey, ...] = (CONFIG, DROPS, METRICS, RENDEZVOUS, LOSS, EPISODES, LEASES)
MEMBERS = KvKey(
    "<host>_<pid>_<role>",
    ">",
    tuple(dict.fromkeys(r for c in DECLARED for r in (*c.publishers, *c.consumers))),
    "a live worker's heartbeat entry, in the run's members bucket (`bus.membership`)",
    Member,
)
"""Not in `KV_KEYS`: its keys live in the members bucket, which has its own TTL and permissions."""

CONFIG_KEY = CONFIG.pattern
RENDEZVOUS_KEY = RENDEZVOUS.pattern
_DROP, _METRICS = "drop.", "metrics."


REFUSED_PROMPT = DropRecord.LEGACY_REFUSED
"""The old plain-text form of a refused prompt's drop record began with this. Only the rollout
still writes that form (`consumers.rollout`, until it writes `DropRecord(refused=True)`);
`DropRecord.decode` reads both."""


def drop_key(prompt_id: str) -> str:
    return f"{_DROP}{prompt_id}"


def dropped_prompt(key: str) -> str | None:
    """The prompt id of a drop key, None for another key."""
    return key.removeprefix(_DROP) if key.startswith(_DROP) else None


def episode_key(prompt_id: str, sample: int) -> str:
    return f"episode.{prompt_id}.{sample}"


def loss_key(channel: str) -> str:
    return f"loss.{channel}"


def metrics_key(rank: int, step: int) -> str:
    return f"{_METRICS}{rank}.{step}"


def metrics_of(key: str) -> tuple[int, int] | None:
    """The (rank, step) of a metrics key, None for another key."""
    if not key.startswith(_METRICS):
        return None
    rank, _, step = key.removeprefix(_METRICS).partition(".")
    return (int(rank), int(step)) if rank.isdigit() and step.isdigit() else None


def metrics_prefix(rank: int | None = None) -> str:
    """`metrics.` or, for one rank, `metrics.<rank>.`: what its keys start with (a filter)."""
    return _METRICS if rank is None else f"{_METRICS}{rank}."


def markdown_tables() -> str:
    """The channel and KV key tables as the architecture page shows them (a test keeps it so)."""
    rows = [
        "| channel | subject | event | work queue | published by | read by (how) |",
        "| --- " * 6 + "|",
    ]
    for c in DECLARED:
        window = f"{c.queue.max_ack_pending}" if c.queue else ""
        if c.queue and c.name in GATED_WINDOWS:  # raised for a big run (`window_needs`)
            window = f"max({window}, the gate's in-flight bound x safety_factor)"
        subject = f"`rl.<run>.{c.name}{f'.<{c.token}>' if c.token else ''}`"
        carried = [t for t in EVENT_TYPES if c.event is not None and issubclass(t, c.event)]
        event = (
            " or ".join(f"`{t.__name__}`" for t in carried)
            or "the original bytes, reason in headers"
        )
        queue = (
            "-"
            if c.queue is None
            else (f"`{c.queue.durable}`: ack_wait {c.queue.ack_wait:g} s, at most {window} unacked")
        )
        readers = (
            ", ".join(f"{r.role} ({r.read.value})" for r in c.readers)
            or "the operator (`ops.status`)"
        )
        if c is REWARDS_TO_REFERENCE:
            readers += ", with `reference.enabled` instead of the buffer"
        elif c is SCORED:
            readers += ", with `reference.enabled`"
        rows.append(
            f"| `{c.name}` | {subject} | {event} | {queue} | {', '.join(c.publishers)} | {readers} "
            "|"
        )
    rows += ["", "| KV key (bucket `rl_<run>`) | record | written by | what |", "| --- " * 4 + "|"]
    rows += [
        f"| `{k.pattern}` | {f'`{k.record.__name__}`' if k.record else 'the run config (YAML)'} "
        f"| {', '.join(k.writers)} | {k.why} |"
        for k in KV_KEYS
    ]
    return "\n".join(rows) + "\n"
