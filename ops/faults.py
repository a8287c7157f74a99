"""The kills of a chaos run: which crash points fire, near which trainer step,
and the pass that arms each.

A crash point kills the process armed with `JETRL_CRASH_AT=<point>@k` on its k-th pass,
counted from the process start (`bus.crashpoints`). A run's points are spread over
its steps: the steps from `first` to `last` are cut into one slot per point, each point (in
a seeded random order) gets a random step inside its slot, its *target*. k is the number
of passes the process will have made by the target, estimated from the run's shape: how
often the point is passed per trainer step. The estimates are low bounds, so a point fires
near its target, mostly before it, and well before the run ends.

    producer.mid_publish      one pass per prompt, a step's worth (prompts_per_step) per
                              step, published as the weights of the step arrive: k lands
                              inside the burst that opens at the target
    rollout.stored_not_acked  one per prompt: prompts_per_step a step
    rollout.mid_generation    one per generated batch: at least one a step (a batch holds
                              at most a step's worth of prompts)
    rollout.mid_weight_load   one per weight version loaded: one every sync_every steps
    reward.mid_scoring        one per trajectory: prompts_per_step * n a step
    buffer.*, trainer.mid_step, trainer.metrics_written
                              one per step
    trainer.mid_checkpoint    one per checkpoint: one every checkpoint_every steps

Several points of one role are armed one after the other: a process is armed with the
role's first point; when it fires, its replacement is armed with the next, k counted from
the step the trainer is at then (plus the `lead` the producer, rollout, reward and buffer
may have run ahead of it, so that k stays a low bound). Arming every point at the start
would not do: passes are counted per process, so a second point would fire in the first
process, before the one meant to come first.

Then, per run, a table of the kills (`print_run`) and, over the runs, per point whether it
was hit in every run it was armed in and its restart and recovery times (`summarize`).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Any

from bus.crashpoints import (
    BUFFER_MID_STEP,
    BUFFER_STEP_STORED,
    PRODUCER_MID_PUBLISH,
    REWARD_MID_SCORING,
    ROLLOUT_MID_GENERATION,
    ROLLOUT_MID_WEIGHT_LOAD,
    ROLLOUT_STORED_NOT_ACKED,
    TRAINER_METRICS_WRITTEN,
    TRAINER_MID_CHECKPOINT,
    TRAINER_MID_STEP,
    CrashPoint,
)
from bus.topology import BATCHES, METRICS, PROMPTS, REWARDS, TRAJECTORIES
from consumers.fleet_config import worker_name
from schemas.config import RunConfig

ALL: tuple[CrashPoint, ...] = (
    PRODUCER_MID_PUBLISH,
    ROLLOUT_MID_GENERATION,
    ROLLOUT_STORED_NOT_ACKED,
    ROLLOUT_MID_WEIGHT_LOAD,
    REWARD_MID_SCORING,
    BUFFER_MID_STEP,
    BUFFER_STEP_STORED,
    TRAINER_MID_STEP,
    TRAINER_METRICS_WRITTEN,
    TRAINER_MID_CHECKPOINT,
)
"""Every point a chaos run can fire."""

OUTPUT: dict[str, str] = {
    **{role: c.name for c in (PROMPTS, TRAJECTORIES, REWARDS, BATCHES) for role in c.publishers},
    **{
        role: "metrics" for role in METRICS.writers
    },  # every step writes metrics; weights only every sync_every
}
"""Per role, the kind of message that is its work: a replacement's first one ends its recovery."""


@dataclass(frozen=True)
class Shape:
    """What the pass counts of a run depend on."""

    prompts_per_step: int
    samples_per_prompt: int
    sync_every: int
    checkpoint_every: int
    lead: int
    """Steps of work the producer, rollout, reward and buffer may be ahead of the trainer
    (`StalenessPolicy.steps_ahead`)."""

    @classmethod
    def of(cls, config: RunConfig) -> Shape:
        return cls(
            config.algorithm.prompts_per_step,
            config.data.n,
            config.trainer.sync_every,
            config.trainer.checkpoint_every,
            config.staleness.steps_ahead,
        )

    def per_step(self, point: CrashPoint) -> int:
        """Passes of `point` a trainer step, for the points passed at least once a step."""
        if point in (PRODUCER_MID_PUBLISH, ROLLOUT_STORED_NOT_ACKED):
            return self.prompts_per_step
        if point is REWARD_MID_SCORING:
            return self.prompts_per_step * self.samples_per_prompt
        return 1

    def passes_by(self, point: CrashPoint, step: int) -> int:
        """A low estimate of the passes of `point` in a run (all its processes together) by the
        time the trainer writes step `step`'s metrics (steps count from 0)."""
        if step < 0:
            return 0
        if point is TRAINER_MID_CHECKPOINT:
            return (step + 1) // self.checkpoint_every
        if point is ROLLOUT_MID_WEIGHT_LOAD:  # version v is made by step v - 1; v0 is never loaded
            return (step + 1) // self.sync_every
        return self.per_step(point) * (step + 1)


def arm_at(
    shape: Shape, point: CrashPoint, target: int, since: int | None, rng: random.Random
) -> int:
    """The pass k that makes `point` fire near step `target` in a process started when the
    trainer had written step `since` (None: at the start of the run).

    A point passed many times a step fires a random pass into the step (the producer: inside
    the burst of prompts the target's weights let out)."""
    start = 0
    if since is not None:
        # The trainer restarts at or before `since` (from its checkpoint); the others may
        # already have done up to `lead` steps' work beyond it before the kill.
        ahead = since if point.role == "trainer" else since + shape.lead
        start = shape.passes_by(point, ahead)
        target = max(target, ahead + 1)  # at least one step's passes after the restart
    into_step = rng.randrange(shape.per_step(point))
    return max(1, shape.passes_by(point, target) - start - into_step)


def plan(
    points: tuple[CrashPoint, ...], first: int, last: int, rng: random.Random
) -> list[tuple[CrashPoint, int]]:
    """Each point with its target step, in a random order, one slot of [first, last] each."""
    order = rng.sample(points, len(points))
    bounds = [first + i * (last - first + 1) // len(order) for i in range(len(order) + 1)]
    return [
        (point, rng.randrange(bounds[i], max(bounds[i] + 1, bounds[i + 1])))
        for i, point in enumerate(order)
    ]


# What came of the kills: a table per run, figures per fault.


@dataclass
class Kill:
    """One armed crash point and, once it fired, what followed."""

    point: CrashPoint
    target: int
    """The step it was meant to fire near."""
    k: int | None = None
    """The pass it was armed at, once its role's process was armed with it."""
    since: int | None = None
    """The trainer's last step when it was armed (None: at the start of the run)."""
    at: float | None = None
    """Unix time it fired (its record's): None while it has not."""
    pid: int | None = None
    step: int | None = None
    """The last step the trainer had written when it fired."""
    note: str = ""
    """What the victim was doing: its record's note, and what the bus and the disk show."""
    restart_s: float | None = None
    """Kill -> the replacement joined the run."""
    recovery_s: float | None = None
    """Kill -> the replacement's first output."""
    resume_s: float | None = None
    """The replacement joined -> the next step trained: how long training stood still after the
    restart (the figure the defaults are held to: 15 s)."""

    @property
    def hit(self) -> bool:
        return self.at is not None

    @property
    def worker(self) -> str:
        return worker_name(self.point.role, 0)


@dataclass
class Outcome:
    """One run's figures."""

    run: str
    finished: bool
    error: str
    steps_per_s: float
    seconds: float
    accounts: dict[str, Any]
    kills: list[Kill] = field(default_factory=list)


def spread(values: list[float]) -> dict[str, float | int | None]:
    """Median and max (seconds, 1 decimal) and how many, of the figures that exist."""
    if not values:
        return {"median": None, "max": None, "n": 0}
    return {
        "median": round(statistics.median(values), 1),
        "max": round(max(values), 1),
        "n": len(values),
    }


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_run(outcome: Outcome) -> None:
    """A run's kills as a table, then its accounts in one line."""
    state = "finished" if outcome.finished else f"UNFINISHED {outcome.error}"
    print(
        f"\nrun {outcome.run}: {state} in {outcome.seconds:.0f} s, "
        f"{outcome.steps_per_s:.2f} steps/s"
    )
    if outcome.kills:
        print(
            f"  {'crash point':<24} {'target':>6} {'pass':>5} {'step':>5}  {'restart s':>9}  "
            f"{'recovery s':>10}  {'resume s':>8}  what it was doing"
        )
    for kill in outcome.kills:
        k = "-" if kill.k is None else str(kill.k)
        hit = str(kill.step) if kill.hit else "-"
        what = (
            kill.note
            if kill.hit
            else "NOT HIT" + ("" if kill.k is not None else " (never armed: no replacement)")
        )
        print(
            f"  {kill.point.name:<24} {kill.target:>6} {k:>5} {hit:>5}  "
            f"{seconds(kill.restart_s):>9}  {seconds(kill.recovery_s):>10}  "
            f"{seconds(kill.resume_s):>8}  {what}"
        )
    a = outcome.accounts
    print(
        f"  issued {a['issued']}  trained {a['trained']}  dropped {a['dropped']} "
        f"{a['drop_reasons']}  held {a['held']}  LOST {a['lost']}  DUPLICATES {a['duplicates']} "
        f"(stream {a['stream_duplicates']}, checkpoint history {a['history_duplicates']} of "
        f"{a['history_samples']})  STALENESS VIOLATIONS {a['staleness_violations']}",
        flush=True,
    )


def faults(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Per point armed: runs armed in, hit in every one of them, the steps hit at,
    restart and recovery."""
    by_point: dict[str, list[Kill]] = {}
    for kill in (k for o in outcomes for k in o.kills):
        by_point.setdefault(kill.point.name, []).append(kill)
    return {
        name: {
            "armed": len(kills),
            "hit": all(k.hit for k in kills),
            "hits": sum(k.hit for k in kills),
            "steps": [k.step for k in kills if k.hit],
            "restart_s": spread([k.restart_s for k in kills if k.restart_s is not None]),
            "recovery_s": spread([k.recovery_s for k in kills if k.recovery_s is not None]),
            "resume_s": spread([k.resume_s for k in kills if k.resume_s is not None]),
        }
        for name, kills in by_point.items()
    }


def by_role(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Per role killed: restart, recovery and resume seconds over all its kills."""
    roles: dict[str, list[Kill]] = {}
    for kill in (k for o in outcomes for k in o.kills if k.hit):
        roles.setdefault(kill.point.role, []).append(kill)
    return {
        role: {
            "kills": len(kills),
            "restart_s": spread([k.restart_s for k in kills if k.restart_s is not None]),
            "recovery_s": spread([k.recovery_s for k in kills if k.recovery_s is not None]),
            "resume_s": spread([k.resume_s for k in kills if k.resume_s is not None]),
        }
        for role, kills in roles.items()
    }


def print_roles(roles: dict[str, dict[str, Any]]) -> None:
    """Recovery per role: the table the defaults are judged by."""
    print(
        f"\n  {'role':<9} {'kills':>5}  {'restart s (median/max)':>22}  {'recovery s':>12}  "
        f"{'resume s':>12}"
    )
    for role, r in roles.items():
        cells = [
            f"{r[key]['median']}/{r[key]['max']}" for key in ("restart_s", "recovery_s", "resume_s")
        ]
        print(
            f"  {role:<9} {r['kills']:>5}  {cells[0]:>22}  {cells[1]:>12}  {cells[2]:>12}",
            flush=True,
        )


def summarize(
    outcomes: list[Outcome], baselines: list[Outcome], quick: bool, seed: int
) -> dict[str, Any]:
    """The invocation's figures: totals over the runs with kills, per fault, ratio."""
    per_fault = faults(outcomes)
    totals = {
        key: sum(o.accounts[key] for o in outcomes)
        for key in (
            "issued",
            "trained",
            "dropped",
            "held",
            "lost",
            "duplicates",
            "staleness_violations",
        )
    }
    steps_per_s = statistics.mean(o.steps_per_s for o in outcomes)
    return {
        "quick": quick,
        "runs": len(outcomes),
        "seed": seed,
        "steps": outcomes[0].accounts["steps"],
        "kills": sum(f["hits"] for f in per_fault.values()),
        "not_hit": sorted(name for name, f in per_fault.items() if not f["hit"]),
        "unfinished": sum(not o.finished for o in outcomes),
        **totals,
        "faults": per_fault,
        "roles": by_role(outcomes),
        "steps_per_s": round(steps_per_s, 3),
        "baseline_steps_per_s": round(statistics.mean(b.steps_per_s for b in baselines), 3)
        if baselines
        else None,
        "ratio": round(
            statistics.median(
                o.steps_per_s / b.steps_per_s for o, b in zip(outcomes, baselines, strict=False)
            ),
            3,
        )
        if baselines
        else None,
    }
