"""The update history a checkpoint keeps: constant size, and it tells any change of the ids."""

from __future__ import annotations

import hashlib
import pickle

from consumers.update_history import EMPTY, UpdateHistory

STEPS = [["r/0/0/0", "r/0/0/1"], ["r/0/1/0"], []]


def test_the_chain_is_sha256_over_each_steps_ids_in_order() -> None:
    first = hashlib.sha256(bytes.fromhex(EMPTY) + b"r/0/0/0\nr/0/0/1").hexdigest()
    second = hashlib.sha256(bytes.fromhex(first) + b"r/0/1/0").hexdigest()
    third = hashlib.sha256(bytes.fromhex(second) + b"").hexdigest()
    assert UpdateHistory.of_steps(STEPS) == UpdateHistory(steps=3, samples=3, digest=third)
    assert UpdateHistory.from_dict(
        UpdateHistory.of_steps(STEPS).as_dict()
    ) == UpdateHistory.of_steps(STEPS)


def test_a_repeat_a_loss_a_reorder_or_a_move_between_steps_changes_the_digest() -> None:
    kept = UpdateHistory.of_steps(STEPS)
    for other in (
        [["r/0/0/0", "r/0/0/1"], ["r/0/1/0", "r/0/1/0"], []],  # a sample trained twice
        [["r/0/0/0"], ["r/0/1/0"], []],  # one lost
        [["r/0/0/1", "r/0/0/0"], ["r/0/1/0"], []],  # reordered
        [["r/0/0/0"], ["r/0/0/1", "r/0/1/0"], []],  # moved to another step
        [["r/0/0/0", "r/0/0/1"], ["r/0/1/0"]],  # a step fewer
    ):
        assert UpdateHistory.of_steps(other).digest != kept.digest, other


def test_what_a_checkpoint_keeps_does_not_grow_with_the_run() -> None:
    """It was every trained sample id, rewritten into every checkpoint: quadratic in steps."""
    short = UpdateHistory.of_steps([[f"r/0/{s}/{i}" for i in range(128)] for s in range(2)])
    long = UpdateHistory.of_steps([[f"r/0/{s}/{i}" for i in range(128)] for s in range(2000)])
    assert long.samples == 2000 * 128
    assert (
        len(pickle.dumps(long.as_dict())) - len(pickle.dumps(short.as_dict())) <= 8
    )  # the counts' digits
