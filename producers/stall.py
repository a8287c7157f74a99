"""Naming a stall: when no step has completed for `trainer.stall_after` seconds, which stage
holds the work and why, in one short line each.

A run that hangs with idle workers and no error is a run where every stage waits for another;
the bus shows who waits for what. `producers.stall_view.read_view` reads it once; `diagnose`
(pure) judges it:

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

import logging
import time

import yaml
from nats.js import JetStreamContext

from bus.topology import (
    CONFIG_KEY,
    Topology,
)
from producers.drops import DropTally, failure_counts
from producers.gate import Producer
from producers.stall_view import (
    UNREADABLE,
    QueueView,
    RunView,
    guarded,
    last_step,
    read_view,
)
from schemas.config import ConfigError, RunConfig, parse_config
from schemas.kv_records import DeviceLease, DropKind

log = logging.getLogger("jetrl.stall")

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
            f"{who} at step {step} has all {stored.count} micro-batches of step {step} and is "
            "training it (not recorded yet)"
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


def training(view: RunView) -> bool:
    """Whether the run waits only for a step being computed: a live trainer with every
    micro-batch of its next step stored on every rank. A slow step is work, not a stall: a real
    model's first steps on the CPU (SmolLM2-135M, 2 loaded cores) took 140 s, and a run shown
    as STALLED for them looked hung. How long it has run stays on the line."""
    if view.next_step is None or view.live is None or not view.live["trainer"]:
        return False
    return all(
        (stored := view.stored.get(rank)) is not None and len(stored.indices) == stored.count
        for rank in range(view.cfg.trainer.dp_size)
    )


def stall_text(seconds: float, reasons: list[str], busy: bool = False) -> str:
    """The words a run with no step for `trainer.stall_after` is shown with, in the progress line
    and in `ops.status`: TRAINING while the trainer computes a step it holds whole (`training`),
    else STALLED; the reasons apart by "; " (none of them holds one)."""
    return f"{'TRAINING' if busy else 'STALLED'} {seconds:.0f}s: " + "; ".join(reasons)


async def stalled_line(js: JetStreamContext, topology: Topology) -> str | None:
    """For `ops.status`: the stall line when the last step's metrics are older than the run's
    `stall_after` (from the config in KV), or no step came that long after the run was declared;
    None when the run is moving, complete, or its config cannot be read."""
    try:
        entry = await (await js.key_value(topology.kv_bucket)).get(CONFIG_KEY)
        cfg = parse_config(yaml.safe_load(entry.value or b""), f"run {topology.run} config in KV")
    except (*UNREADABLE, ConfigError, yaml.YAMLError):  # no config (yet): no stall to judge
        return None
    last = await guarded(last_step(js, topology))
    if last is None:
        return None
    next_step, moved = last[0] + 1, last[1]
    age = time.time() - moved
    if next_step >= cfg.trainer.steps or age < cfg.trainer.stall_after:
        return None
    view = await read_view(js, topology, cfg, next_step=next_step, since=moved)
    return stall_text(age, diagnose(view), training(view))


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
        reasons, busy = diagnose(view), training(view)
        for reason in reasons:
            if reason not in self.logged:
                if busy:
                    log.info("no step for %.0fs: %s", stalled, reason)
                else:
                    log.warning("stalled %.0fs: %s", stalled, reason)
        self.logged = set(reasons)
        return stall_text(stalled, reasons, busy)
