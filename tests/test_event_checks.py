"""Every refusal of the events' validators, through `decode` (bytes from the wire), with its reason.

Each row breaks one field of a golden event's wire map in one way; the event must be refused
with the check's own reason, never decoded. The mask convention of a trajectory has its rows
in tests/test_episode_events.py, the upgrades of old versions in tests/test_schemas.py.
"""

from __future__ import annotations

import re
from typing import Any

import msgpack
import numpy as np
import pytest

from schemas import DecodeError, RewardEvent, Tensor, TrajectoryEvent, decode, events
from tests.golden_events import GOLDEN

NAN, INF = float("nan"), float("inf")


def golden_map(name: str) -> dict[str, Any]:
    return msgpack.unpackb((GOLDEN / f"{name}.msgpack").read_bytes())


def wire(values: Any, dtype: str, shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    array = np.array(values, dtype=dtype)
    return {
        "dtype": array.dtype.name,
        "shape": list(array.shape if shape is None else shape),
        "data": array.tobytes(),
    }


# The golden trajectory.v2 (an episode, mask [1, 1, 0, 0, 1]) with its mask dropped: every
# token the model's, so that a value breaks only the check the row names.
PLAIN = {
    "response_mask": None,
    "logprobs": wire([-0.5, -1.25, -0.5, -0.5, -0.125], "float32"),
    "versions": wire([3, 3, 3, 3, 4], "int32"),
}
TRAJECTORY = [
    ({"logprobs": wire([-0.5] * 4, "float32")}, "must be equal 1-D"),
    ({"prompt_ids": wire([[1, 5, 7]], "int32")}, "prompt_ids must be 1-D"),
    ({"sample_index": 2}, "sample_index 2 outside group of 2"),
    ({"id": "g/0/3/9"}, "must be <prompt_id>/<sample_index>"),
    ({"prompt_ids": wire([1, 5, 7], "int64")}, "prompt_ids must be int32 with 1 dimension"),
    ({"logprobs": wire([-0.5] * 5, "float64")}, "logprobs must be float32 with 1 dimension"),
    ({"response_ids": wire([9, 4, 6, 8], "int32", (5,))}, "tensor data has 16 bytes"),
    ({"prompt_ids": wire([], "int32")}, "prompt_ids is empty"),
    ({"logprobs": wire([-0.5, NAN, -1, -1, -1], "float32")}, "logprobs must be finite and <= 0"),
    ({"logprobs": wire([-0.5, 0.25, -1, -1, -1], "float32")}, "logprobs must be finite and <= 0"),
    ({"logprobs": wire([-0.5, -INF, -1, -1, -1], "float32")}, "logprobs must be finite and <= 0"),
    ({"prompt_ids": wire([1, -5, 7], "int32")}, "prompt_ids holds a negative value"),
    ({"response_ids": wire([9, 4, 6, -8, 2], "int32")}, "response_ids holds a negative value"),
    ({"versions": wire([3, 3, 3, -1, 4], "int32")}, "versions holds a negative value"),
]


MASKED = [
    # (tests/test_episode_events.py has the others): below -1 at an environment token
    ({"versions": wire([3, 3, -2, -1, 4], "int32")}, "versions must be -1 at environment"),
    ({"versions": wire([3, 3, -1, -1, -3], "int32")}, "versions must be >= 0 at model"),
    ({"logprobs": wire([-0.5, -1.25, -1e-45, 0.0, -0.125], "f4")}, "logprobs must be 0.0 at"),
]


@pytest.mark.parametrize(("change", "reason"), MASKED)
def test_a_broken_masked_trajectory_is_refused_with_its_reason(
    change: dict[str, Any], reason: str
) -> None:
    with pytest.raises(DecodeError, match=re.escape(reason)):
        decode(msgpack.packb({**golden_map("trajectory.v2"), **change}), TrajectoryEvent)


@pytest.mark.parametrize(("change", "reason"), TRAJECTORY)
def test_a_broken_trajectory_is_refused_with_its_reason(
    change: dict[str, Any], reason: str
) -> None:
    fields = {**golden_map("trajectory.v2"), **PLAIN, **change}
    with pytest.raises(DecodeError, match=re.escape(reason)):
        decode(msgpack.packb(fields), TrajectoryEvent)
    nested = {**golden_map("reward.v3"), "turn_rewards": None, "trajectory": fields}
    with pytest.raises(DecodeError, match=f"trajectory: .*{re.escape(reason)}"):
        decode(msgpack.packb(nested), RewardEvent)


REWARD = [
    ("reward.v3", {"id": "g/0/3/1"}, "must be its trajectory's id"),
    ("reward.v3", {"turn_rewards": wire([0.25, NAN], "float32")}, "turn_rewards must be finite"),
    ("reward.v3", {"turn_rewards": wire([0.25, 0, 1], "float32")}, "3 turn rewards for 2 model"),
    ("reward.v3", {"turn_rewards": wire([0.25], "float32")}, "1 turn rewards for 2 model"),
    ("reward.v3", {"turn_rewards": wire([0.25, 0], "float64")}, "turn_rewards must be float32"),
    ("reward.v2", {"ref_logprobs": wire([-1] * 4, "float32")}, "ref_logprobs (4,) must match"),
    ("reward.v2", {"ref_logprobs": wire([-1, 2, -1, -1, -1], "float32")}, "ref_logprobs must be"),
    ("reward.v2", {"ref_logprobs": wire([-1] * 5, "float16")}, "ref_logprobs must be float32"),
]


@pytest.mark.parametrize(("name", "change", "reason"), REWARD)
def test_a_broken_reward_is_refused_with_its_reason(
    name: str, change: dict[str, Any], reason: str
) -> None:
    with pytest.raises(DecodeError, match=re.escape(reason)):
        decode(msgpack.packb({**golden_map(name), **change}), RewardEvent)


def test_turn_rewards_count_the_runs_of_model_tokens() -> None:
    """One reward per run of 1s in the mask, a run at the very end or start included."""
    fields = golden_map("reward.v3")
    for mask, turns in (([1, 0, 1, 0, 1], 3), ([0, 1, 1, 1, 0], 1), ([1, 1, 1, 1, 1], 1)):
        on = np.array(mask) == 1
        trajectory = {
            **fields["trajectory"],
            "response_mask": wire(mask, "uint8"),
            "versions": wire(np.where(on, 3, -1), "int32"),
            "logprobs": wire(np.where(on, -0.5, 0.0), "float32"),
        }
        for count in (turns - 1, turns + 1):
            with pytest.raises(DecodeError, match=f"{count} turn rewards for {turns} model"):
                changed = {"trajectory": trajectory, "turn_rewards": wire([0.5] * count, "f4")}
                decode(msgpack.packb({**fields, **changed}), RewardEvent)
        right = {"trajectory": trajectory, "turn_rewards": wire([0.5] * turns, "float32")}
        decode(msgpack.packb({**fields, **right}), RewardEvent)
    # No mask: one turn, the whole response; an empty response has none.
    plain = {**fields["trajectory"], **PLAIN}
    decode(msgpack.packb({**fields, "trajectory": plain, "turn_rewards": wire([1], "f4")}))
    with pytest.raises(DecodeError, match="2 turn rewards for 1 model"):
        decode(msgpack.packb({**fields, "trajectory": plain, "turn_rewards": wire([1, 1], "f4")}))
    empty = {
        **plain,
        "response_ids": wire([], "int32"),
        "logprobs": wire([], "float32"),
        "versions": wire([], "int32"),
    }
    decode(msgpack.packb({**fields, "trajectory": empty, "turn_rewards": wire([], "f4")}))
    with pytest.raises(DecodeError, match="1 turn rewards for 0 model"):
        decode(msgpack.packb({**fields, "trajectory": empty, "turn_rewards": wire([1], "f4")}))


B2 = (2, 4)
BATCH = [
    ({"input_ids": wire(range(8), "int32")}, "input_ids must be [B, T]"),
    ({"loss_mask": wire([[1] * 2] * 2, "uint8")}, "loss_mask has shape (2, 2), expected (2, 4)"),
    ({"advantages": wire([1, 1, 1], "float32")}, "advantages has shape (3,), expected (2,)"),
    ({"sample_ids": ["g/0/3/0"]}, "1 sample_ids for 2 rows"),
    ({"micro_index": 1}, "micro_index/dp_rank out of range"),
    ({"dp_rank": 1}, "micro_index/dp_rank out of range"),
    ({"input_ids": wire([[0, 1, 2, 3], [4, -5, 6, 7]], "int32")}, "input_ids holds -5, below 0"),
    ({"input_ids": wire(range(8), "int64", B2)}, "input_ids must be int32 with 2 dimension"),
    ({"attention_mask": wire([[1, 1, 1, 2], [1] * 4], "uint8")}, "masks must be 0/1"),
    ({"loss_mask": wire([[0, 0, 1, 2], [0, 1, 1, 0]], "uint8")}, "masks must be 0/1"),
    (
        {"attention_mask": wire([[1, 1, 1, 0], [1] * 4], "uint8")},
        "loss_mask only where attention_mask is 1",
    ),
    ({"loss_mask": wire([], "uint8", B2)}, "tensor data has 0 bytes"),
    ({"advantages": wire([1, INF], "float32")}, "advantages must be finite"),
    ({"rewards": wire([NAN, 0], "float32")}, "rewards must be finite"),
    ({"behaviour_logprobs": wire([0.5] + [-0.5] * 7, "f4", B2)}, "behaviour_logprobs must be"),
    ({"ref_logprobs": wire([-0.5] * 4, "float32")}, "ref_logprobs has shape (4,), expected"),
    ({"ref_logprobs": wire([-0.5] * 7 + [NAN], "float32", B2)}, "ref_logprobs must be finite"),
    ({"token_rewards": wire([0.5] + [0] * 7, "float32", B2)}, "0 off the loss mask"),
    ({"token_rewards": wire([0] * 3 + [INF] + [0] * 4, "f4", B2)}, "token_rewards must be"),
    ({"token_rewards": wire([0] * 8, "float32")}, "token_rewards has shape (8,), expected"),
    ({"versions": wire([-2] + [3] * 7, "int32", B2)}, "versions holds -2, below -1"),
    ({"versions": wire([3] * 3 + [5] + [3] * 4, "int32", B2)}, "must be in [0, step 4]"),
    ({"versions": wire([3] * 3 + [-1] + [3] * 4, "int32", B2)}, "must be in [0, step 4]"),
]


@pytest.mark.parametrize(("change", "reason"), BATCH)
def test_a_broken_batch_is_refused_with_its_reason(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(DecodeError, match=re.escape(reason)):
        decode(msgpack.packb({**golden_map("batch.v2"), **change}))


def test_versions_off_the_loss_mask_may_be_minus_one_and_token_rewards_zero() -> None:
    """What a packed batch holds off the loss mask is accepted (the row above refuses more)."""
    fields = golden_map("batch.v2")
    loss = np.array([[0, 0, 1, 1], [0, 1, 1, 0]])
    versions = wire(np.where(loss == 1, 4, -1), "int32")
    decode(msgpack.packb({**fields, "versions": versions}))


def test_a_trajectory_given_as_a_field_is_not_checked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A RewardEvent built from a trajectory instance (the reward worker's, the reference
    stage's) keeps it as it is: it was checked when it was made. A trajectory map, nested or
    not, is checked once."""
    checks: list[str] = []
    non_negative = events.non_negative  # called once per trajectory check, by nothing else

    def counted(tensors: dict[str, Tensor]) -> None:
        checks.append("g/0/3/0")
        non_negative(tensors)

    monkeypatch.setattr(events, "non_negative", counted)
    fields = golden_map("reward.v3")
    trajectory = decode(msgpack.packb(fields["trajectory"]), TrajectoryEvent)
    assert checks == ["g/0/3/0"]
    reward = RewardEvent(id=trajectory.id, run="g", trajectory=trajectory, reward=1.0)
    assert reward.trajectory is trajectory and checks == ["g/0/3/0"]
    decode(msgpack.packb(fields), RewardEvent)
    assert checks == ["g/0/3/0"] * 2
    RewardEvent.model_validate({**dict(reward), "reward": 0.5})
    assert checks == ["g/0/3/0"] * 2
