"""The chaos plan (ops.faults): every point once, spread over the run, armed at a pass that comes.

A point armed at a pass its process never makes is never hit; ops.chaos would then report
it as not hit and fail. These check the arithmetic, in milliseconds; tests/test_chaos.py
checks that the points do fire in a real run.
"""

from __future__ import annotations

import random

from ops.faults import ALL, Shape, arm_at, plan

SHAPE = Shape(prompts_per_step=16, samples_per_prompt=8, sync_every=1, checkpoint_every=4, lead=2)


def test_each_point_gets_its_own_slot_of_the_run() -> None:
    for seed in range(20):
        planned = plan(ALL, 3, 90, random.Random(seed))
        assert sorted(p.name for p, _ in planned) == sorted(p.name for p in ALL), (
            f"seed {seed}: {planned}"
        )
        targets = [t for _, t in planned]
        assert targets == sorted(targets) and len(set(targets)) == len(ALL), (
            f"seed {seed}: targets {targets}"
        )
        assert 3 <= targets[0] and targets[-1] <= 90, f"seed {seed}: targets {targets} outside 3-90"
        assert planned != plan(ALL, 3, 90, random.Random(seed + 1)), (
            "the seed does not change the plan"
        )


def test_a_fresh_process_is_armed_at_a_pass_made_by_its_target() -> None:
    rng = random.Random(0)
    for point in ALL:
        for target in range(3, 40):
            k = arm_at(SHAPE, point, target, None, rng)
            made = SHAPE.passes_by(point, target)
            assert 1 <= k <= max(1, made), (
                f"{point.name} at step {target}: pass {k}, but only {made} made by then"
            )
            assert k > SHAPE.passes_by(point, target - 2) - SHAPE.per_step(point) or k == 1, (
                f"{point.name} at step {target}: pass {k} comes long before the target"
            )


def test_a_replacement_counts_its_passes_from_its_own_start() -> None:
    rng = random.Random(0)
    # Trainer restarted after step 10, next point meant for step 20: ten steps' passes.
    assert [p.name for p in ALL if p.role == "trainer"] == [
        "trainer.mid_step",
        "trainer.metrics_written",
        "trainer.mid_checkpoint",
    ]
    mid_step, _, checkpoint = (p for p in ALL if p.role == "trainer")
    assert arm_at(SHAPE, mid_step, 20, 10, rng) == 10
    assert arm_at(SHAPE, checkpoint, 20, 10, rng) == 21 // 4 - 11 // 4
    # A target the run has already passed fires at the first pass after the restart's lead.
    assert arm_at(SHAPE, mid_step, 5, 10, rng) == 1
