"""Naming a stall: when no step has completed for `trainer.stall_after` seconds, which stage
holds the work and why, in one short line each.

A run that hangs with idle workers and no error is a run where every stage waits for another;
the bus shows who waits for what. `read_view` reads it once; `diagnose` (pure) judges it:

    members   no live worker of a role                 -> "no live trainer: ..."
    trainer   the micro-batches of its next step s stored on batches.<rank>
              -> "trainer at step s has k of n micro-batches of step s, waiting for micro-batch m"
    buffer    none of step s stored: the scored samples it holds unacked, what a step needs
    queues    work in flight with no live worker of the role (its holder stopped heartbeating:
              the messages come back only after ack_wait), or in flight at live workers that
              have acked nothing for stall_after (a stuck handler keeps them in progress)
    gate      StalenessPolicy.waits_for(issued, v, drops) -> "the gate has issued all N prompts ..."
    leases    placement colocated: who holds each device, in which phase, for how long, and who
              waits for it (`bus.lease`)
    drops     since the last step, by kind (`producers.drops`): the reward function failing
              (its reasons), groups of equal rewards dropped (algorithm.drop_equal_reward_groups,
              algorithm.max_regenerations): why the buffer forms no step

The bus cannot show which samples of which group the buffer lacks (its groups live in its
memory), so the buffer's line says how many samples it holds and the queue lines say where
the missing ones are held. Every read is guarded: a figure the bus cannot give now (a stream
electing a leader) is left out, and the lines that need it are not said.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import yaml
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from bus.lag import queue_info
from bus.membership import live_members, stored_keys
from bus.readers import LastStored, Poison
from bus.topology import (
    BATCHES,
    CONFIG_KEY,
    DROPS,
    LEASES,
    PROMPTS,
    WEIGHTS,
    Topology,
    metrics_key,
    metrics_of,
    metrics_prefix,
)
from producers.drops import DropTally, failure_counts
from producers.gate import Producer
from schemas import BatchEvent
from schemas.config import ConfigError, RunConfig, parse_config
from schemas.kv_records import DeviceLease, DropKind, DropRecord, StepMetrics

log = logging.getLogger("jetrl.stall")
T = TypeVar("T")

ROLES = {
    "producer": "producer",
    "rollout": "rollout worker",
    "reward": "reward worker",
    "buffer": "buffer",
    "trainer": "trainer",
    "reference": "reference worker",
}
"""Every role a run may need, and how a line names one worker of it (`needed`:
those of this run)."""
ITEMS = {
    "prompts": "prompts",
    "trajectories": "trajectories",
    "rewards": "scored samples",
    "scored": "samples with reference log-probs",
}
"""What a message of each work queue's stream is, in words."""
SCAN_BATCHES = 256
"""Most batch-stream messages read back to find the micro-batches of the trainer's next step."""
UNREADABLE = (nats.errors.Error, asyncio.TimeoutError)


@dataclass(frozen=True)
class QueueView:
    """One work queue as its durable consumer says."""

    stage: str
    """The stream it reads."""
    pending: int
    """Not yet delivered."""
    in_flight: int
    """Delivered, neither acked nor terminated."""
    redelivered: int
    """In flight and delivered more than once (a holder went past ack_wait)."""
    ack_wait: float
    """Seconds after a holder's last heartbeat before its messages go back to the queue."""
    idle: float
    """Seconds since the queue last saw an ack (since it was created, if never)."""


@dataclass(frozen=True)
class StoredStep:
    """The micro-batches of one step stored for one trainer rank."""

    indices: frozenset[int]
    count: int
    """Micro-batches the step has for this rank."""


@dataclass(frozen=True)
class RunView:
    """What the bus shows of a run at one moment; None where it could not be read."""

    cfg: RunConfig
    live: Counter[str] | None
    """Live workers by role."""
    queues: dict[str, QueueView | None]
    next_step: int | None
    """The step the trainer trains next (steps recorded so far)."""
    stored: dict[int, StoredStep | None]
    """Rank -> what of `next_step` is stored for it (None: nothing)."""
    issued: int | None
    version: int | None
    """The latest weight version, as the gate counts it."""
    dropped: int | None
    drops: DropTally | None = None
    """The drops recorded since the last step (`since_step`, `recent_failures`); None: unknown."""
    leases: dict[str, DeviceLease] | None = None
    """`placement: colocated`: each device's lease by its KV key (`bus.lease`); None: unknown
    or separated."""


def diagnose(view: RunView) -> list[str]:
    """Who holds the work of a stalled run and why, one short line each, most decisive first."""
    cfg, live = view.cfg, view.live
    lines = []
    if live is not None:
        for role, noun in ROLES.items():
            if role == "reference" and not cfg.reference.enabled:
                continue
            if not live[role]:
                queue = view.queues.get(role)
                waiting = (
                    f" ({queue.pending} {ITEMS[queue.stage]} wait in its queue)"
                    if queue and queue.pending
                    else ""
                )
                lines.append(f"no live {noun}: the run cannot progress until one joins{waiting}")
    s = view.next_step
    if s is not None and s < cfg.trainer.steps:
        for rank in range(cfg.trainer.dp_size):
            lines.append(trainer_line(view, rank, s))
        if view.drops is not None and not any(view.stored.values()):
            lines += drop_lines(cfg, view.drops, s)
    for role, queue in view.queues.items():
        if (
            queue is not None
            and live is not None
            and (line := queue_line(cfg, role, queue, live[role]))
        ):
            lines.append(line)
    if (gate := gate_line(view)) is not None:
        lines.append(gate)
    lines += lease_lines(view.leases or {}, time.time())
    if not lines:
        lines.append(
            "no stage found holding the work: every role is live and no queue holds work in flight"
        )
    return lines


def lease_lines(leases: dict[str, DeviceLease], now: float) -> list[str]:
    """Who holds each colocated device, and who waits for it."""
    lines = []
    for key, lease in sorted(leases.items()):
        device = key.removeprefix("lease.")
        if lease.holder is None:
            held = f"device {device} is free"
        else:
            held = (
                f"device {device} is held by {lease.holder} in its {lease.phase} phase for "
                f"{now - lease.since:.0f}s"
            )
        if lease.wanted is not None:
            held += f"; {lease.wanted_by} waits for it ({lease.wanted})"
        lines.append(held)
    return lines


def trainer_line(view: RunView, rank: int, step: int) -> str:
    """What the trainer rank has of its next step; with none of it stored, what the buffer holds."""
    who = "trainer" if view.cfg.trainer.dp_size == 1 else f"trainer rank {rank}"
    stored = view.stored.get(rank)
    if stored is not None and len(stored.indices) < stored.count:
        missing = min(set(range(stored.count)) - stored.indices)
        return (
            f"{who} at step {step} has {len(stored.indices)} of {stored.count} micro-batches of "
            f"step {step}, waiting for micro-batch {missing}"
        )
    if stored is not None:
        return (
            f"{who} at step {step} has all {stored.count} micro-batches of step {step} and has "
            "not recorded the step"
        )
    algo, held = view.cfg.algorithm, view.queues.get("buffer")
    holds = f"it holds {held.in_flight} scored samples, " if held is not None else ""
    needs = f"a step needs {algo.prompts_per_step} complete groups of {view.cfg.data.n}"
    return f"{who} at step {step} waits for the buffer to form step {step} ({holds}{needs})"


def drop_lines(cfg: RunConfig, drops: DropTally, step: int) -> list[str]:
    """What the drops since the last step say of a step the buffer does not form: the reward
    function failing (its commonest reasons), groups of equal rewards dropped (the settings)."""
    lines = []
    since = "since the run began" if step == 0 else f"since step {step - 1}"
    if failed := drops.since_step[DropKind.FAILED]:
        samples = sum(drops.recent_failures.values())
        lines.append(
            f"the reward function failed {samples} samples {since}, so the buffer dropped "
            f"{_groups(failed)}: {failure_counts(drops.recent_failures)}"
        )
    if equal := drops.since_step[DropKind.EQUAL]:
        cap = cfg.algorithm.max_regenerations
        bound = (
            "no cap: it drops them for ever"
            if cap is None
            else f"after {cap * cfg.algorithm.prompts_per_step} it trains them"
        )
        lines.append(
            f"the buffer dropped {_groups(equal)} {since} whose rewards were all equal "
            f"(algorithm.drop_equal_reward_groups true, algorithm.max_regenerations {cap}: "
            f"{bound})"
        )
    return lines


def _groups(n: int) -> str:
    return f"{n} group" if n == 1 else f"{n} groups"


def queue_line(cfg: RunConfig, role: str, queue: QueueView, live: int) -> str | None:
    """Work a queue's holders do not finish: held by a worker that stopped heartbeating, or by
    live ones that acked nothing for stall_after. The buffer holds samples by design, so only
    its first case is news."""
    noun, items = ROLES[role], ITEMS[queue.stage]
    if not queue.in_flight:
        return None
    if not live:
        return (
            f"the {role} queue holds {queue.in_flight} {items} in flight for a {noun} that stopped "
            f"heartbeating (no live {noun}), back to the queue {queue.ack_wait:.0f}s after its "
            "last heartbeat"
        )
    after = cfg.trainer.stall_after
    if role == "buffer" or queue.idle < after:
        return None
    workers = f"{live} live {noun}" + ("s" if live > 1 else "")
    again = (
        f", {queue.redelivered} of them redelivered past ack_wait {queue.ack_wait:.0f}s"
        if queue.redelivered
        else ""
    )
    return (
        f"the {role} queue has {queue.in_flight} {items} in flight at {workers} and none acked "
        f"for over {after:.0f}s{again}"
    )


def gate_line(view: RunView) -> str | None:
    """The gate shut at the current weights (not at the run's end),
    and the version that opens it."""
    if view.issued is None or view.version is None or view.dropped is None:
        return None
    opens = view.cfg.staleness.waits_for(view.issued, view.version, view.dropped)
    if opens is None:
        return None
    return (
        f"the gate has issued all {view.issued} prompts it admits at weights v{view.version} "
        f"and waits for v{opens}"
    )


def stall_text(seconds: float, reasons: list[str]) -> str:
    """The words a stalled run is shown with, in the progress line and in `ops.status`: the
    reasons apart by "; " (none of them holds one)."""
    return f"STALLED {seconds:.0f}s: " + "; ".join(reasons)


async def read_view(
    js: JetStreamContext,
    topology: Topology,
    cfg: RunConfig,
    *,
    next_step: int | None = None,
    issued: int | None = None,
    version: int | None = None,
    dropped: int | None = None,
    drops: DropTally | None = None,
    since: float | None = None,
) -> RunView:
    """The run as the bus shows it now. Figures the caller knows better (the producer knows its
    own issued count, version and drops) are taken as given; the others are read (the drops
    since the last step: those recorded after `since`, its unix time)."""
    if next_step is None:
        last = await _read(last_step(js, topology))
        next_step = None if last is None else last[0] + 1
    live = await _read(_live_roles(js, topology))
    queues = {
        c.work_queue.durable: await _read(_queue(js, topology, c.work_queue.durable))
        for c in topology.work_queues
    }
    stored: dict[int, StoredStep | None] = {}
    if next_step is not None:
        for rank in range(cfg.trainer.dp_size):
            stored[rank] = await _read(_stored(js, topology, rank, next_step))
    if issued is None:
        issued = await _read(_stream_messages(js, topology))
    if version is None:
        version = await _read(_latest_version(js, topology))
    if dropped is None:
        dropped = await _read(_count_keys(js, topology, DROPS.filter))
    if drops is None and since is not None:
        drops = await _read(read_drops(js, topology, since))
    leases = await _read(_leases(js, topology)) if cfg.placement == "colocated" else None
    return RunView(cfg, live, queues, next_step, stored, issued, version, dropped, drops, leases)


async def _read(reading: Awaitable[T]) -> T | None:
    """The figure, or None when the bus cannot say now."""
    try:
        return await reading
    except UNREADABLE as exc:
        log.info("stall diagnosis: a figure is unknown now: %r", exc)
        return None


async def _leases(js: JetStreamContext, topology: Topology) -> dict[str, DeviceLease]:
    kv = await js.key_value(topology.kv_bucket)
    leases = {}
    for key in await stored_keys(js, topology.kv_bucket, LEASES.filter):
        with contextlib.suppress(KeyNotFoundError, KeyDeletedError):
            leases[key] = DeviceLease.decode((await kv.get(key)).value)
    return leases


async def _live_roles(js: JetStreamContext, topology: Topology) -> Counter[str]:
    return Counter(m.role for m in await live_members(js, topology))


async def _queue(js: JetStreamContext, topology: Topology, role: str) -> QueueView:
    channel = topology.served_by(role)
    assert channel is not None, f"{role} serves no work queue"
    queue = channel.work_queue
    info = await queue_info(js, topology, channel)
    acked = (
        info.ack_floor.last_active
        if info.ack_floor and info.ack_floor.last_active
        else info.created
    )
    return QueueView(
        channel.name,
        info.num_pending or 0,
        info.num_ack_pending or 0,
        info.num_redelivered or 0,
        info.config.ack_wait or queue.ack_wait,
        max(0.0, time.time() - acked.timestamp()),
    )


async def _stored(
    js: JetStreamContext, topology: Topology, rank: int, step: int
) -> StoredStep | None:
    """The micro-batches of `step` on batches.<rank>, read back from the stream's end: the buffer
    stores a step's micro-batches together and the steps in order, so they are the last ones of
    that step before an earlier step (or a later one) begins."""
    # Garbage the trainer dead-letters is logged and stepped over, as deleted batches are.
    batches: LastStored[BatchEvent] = LastStored(js, topology, BATCHES, Poison("stall watch"))
    end = await batches.last_seq(rank)
    if not end:
        return None
    indices: set[int] = set()
    count = 0
    async for stored in batches.back(start=end, limit=SCAN_BATCHES):
        batch = stored.event
        if batch.dp_rank != rank or batch.step > step:
            continue
        if batch.step < step:
            break
        indices.add(batch.micro_index)
        count = batch.micro_count
    return StoredStep(frozenset(indices), count) if indices else None


async def _stream_messages(js: JetStreamContext, topology: Topology) -> int:
    """Prompts issued: the messages of the prompt stream."""
    return (await js.stream_info(topology.stream(PROMPTS))).state.messages


async def _latest_version(js: JetStreamContext, topology: Topology) -> int:
    """The latest weight version; 0 before the first, as the gate counts it."""
    last = await LastStored(js, topology, WEIGHTS, Poison("stall watch")).last()
    return 0 if last is None else last.event.version


async def _count_keys(js: JetStreamContext, topology: Topology, pattern: str) -> int:
    return len(await stored_keys(js, topology.kv_bucket, pattern))


async def read_drops(js: JetStreamContext, topology: Topology, since: float) -> DropTally:
    """Every drop record of the run, counted; those recorded after `since` (unix time) also as
    the drops since the last step. Read by one KV watch: its initial values end at a None."""
    kv = await js.key_value(topology.kv_bucket)
    watcher = await kv.watch(DROPS.filter)
    tally, recent = DropTally(), DropTally()
    try:
        while (entry := await watcher.updates(timeout=5.0)) is not None:
            if entry.value is None:
                continue
            record = DropRecord.decode(entry.value)
            tally.add(record)
            if record.time is not None and record.time >= since:
                recent.add(record)
    finally:
        await watcher.stop()
    tally.since_step, tally.recent_failures = recent.kinds, recent.failures
    return tally


async def last_step(js: JetStreamContext, topology: Topology) -> tuple[int, float]:
    """The last step rank 0 recorded and the time it recorded it; (-1, when the run's queues were
    declared) before any. Raises what the bus raises when it cannot say now."""
    keys = await stored_keys(js, topology.kv_bucket, metrics_prefix(0) + "*")
    steps = [rank_step[1] for key in keys if (rank_step := metrics_of(key)) is not None]
    if not steps:
        return -1, (await queue_info(js, topology, PROMPTS)).created.timestamp()
    entry = await (await js.key_value(topology.kv_bucket)).get(metrics_key(0, max(steps)))
    try:
        return max(steps), StepMetrics.decode(entry.value).time
    except ValueError:  # not the trainer's metrics: the step counts, its time not
        return max(steps), time.time()


async def stalled_line(js: JetStreamContext, topology: Topology) -> str | None:
    """For `ops.status`: the stall line when the last step's metrics are older than the run's
    `stall_after` (from the config in KV), or no step came that long after the run was declared;
    None when the run is moving, complete, or its config cannot be read."""
    try:
        entry = await (await js.key_value(topology.kv_bucket)).get(CONFIG_KEY)
        cfg = parse_config(yaml.safe_load(entry.value or b""), f"run {topology.run} config in KV")
    except (*UNREADABLE, ConfigError, yaml.YAMLError):  # no config (yet): no stall to judge
        return None
    last = await _read(last_step(js, topology))
    if last is None:
        return None
    next_step, moved = last[0] + 1, last[1]
    age = time.time() - moved
    if next_step >= cfg.trainer.steps or age < cfg.trainer.stall_after:
        return None
    view = await read_view(js, topology, cfg, next_step=next_step, since=moved)
    return stall_text(age, diagnose(view))


class StallWatch:
    """The producer's stall clock: reset by each new step, it names the stall once it passes
    `after` seconds and logs each reason once, when it first appears."""

    def __init__(self, after: float, since: float) -> None:
        self.after = after
        self.steps = 0
        self.moved = since
        """Unix time of the last new step, or the producer's start before any."""
        self.logged: set[str] = set()

    async def check(self, producer: Producer) -> str:
        """'' while steps come; the stall's words once none came for `after` seconds."""
        if len(producer.metrics) != self.steps:
            self.steps, self.moved, self.logged = len(producer.metrics), time.time(), set()
        stalled = time.time() - self.moved
        if stalled < self.after:
            return ""
        rt = producer.rt
        view = await read_view(
            rt.js,
            rt.topology,
            producer.cfg,
            next_step=max(producer.metrics, default=-1) + 1,
            issued=producer.issued,
            version=producer.version,
            dropped=len(producer.dropped),
            drops=producer.drops,
        )
        reasons = diagnose(view)
        for reason in reasons:
            if reason not in self.logged:
                log.warning("stalled %.0fs: %s", stalled, reason)
        self.logged = set(reasons)
        return stall_text(stalled, reasons)
