"""A multi-turn episode's trajectory (`TrajectoryEvent.response_mask`) on its way to a batch, with
no bus: the schema's checks, the upgrade of version-1 events, the packing of the mask as the
loss mask, and the one rule of which versions count (staleness, samples file, KL in the reward).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from consumers.buffer_groups import Group, response_kl
from consumers.packing import Row, arrays
from engines.algorithms.kl import kl_k3
from producers.samples import group_line
from schemas import BatchEvent, DecodeError, RewardEvent, Tensor, TrajectoryEvent, decode, encode
from tests.golden_events import GOLDEN, golden

MASK = [1, 1, 0, 0, 1]
"""The golden episode's: two model tokens, a tool result and a turn header, one model token."""


def episode_map() -> dict[str, Any]:
    return msgpack.unpackb((GOLDEN / "trajectory.v2.msgpack").read_bytes())


def golden_reward(name: str) -> RewardEvent:
    reward = golden()[name]
    assert isinstance(reward, RewardEvent)
    return reward


def wire(values: list[Any], dtype: str) -> dict[str, Any]:
    array = np.array(values, dtype=dtype)
    return {"dtype": dtype, "shape": list(array.shape), "data": array.tobytes()}


def test_the_golden_episode_reads_back_with_its_mask_and_trained_versions() -> None:
    event = decode((GOLDEN / "trajectory.v2.msgpack").read_bytes(), TrajectoryEvent)
    assert event.response_mask is not None
    assert event.response_mask.numpy().tolist() == MASK
    assert event.trained_mask().tolist() == [True, True, False, False, True]
    assert event.trained_versions().tolist() == [3, 3, 4]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"response_mask": wire(MASK, "int32")}, "response_mask must be uint8 with 1 dimension"),
        ({"response_mask": wire([1, 1, 0, 1], "uint8")}, "response_mask (4,) must match"),
        ({"response_mask": wire([1, 1, 0, 2, 1], "uint8")}, "response_mask must be 0/1"),
        (
            {
                "response_mask": wire([0] * 5, "uint8"),
                "versions": wire([-1] * 5, "int32"),
                "logprobs": wire([0.0] * 5, "float32"),
            },
            "response_mask has no model token",
        ),
        ({"versions": wire([3, 3, -1, 5, 4], "int32")}, "versions must be -1 at environment"),
        ({"versions": wire([3, -1, -1, -1, 4], "int32")}, "versions must be >= 0 at model"),
        (
            {"logprobs": wire([-0.5, -1.25, -0.1, 0.0, -0.125], "float32")},
            "logprobs must be 0.0 at environment",
        ),
        ({"response_mask": None}, "versions holds a negative value"),
    ],
)
def test_a_mask_that_breaks_the_convention_is_refused_with_its_reason(
    change: dict[str, Any], reason: str
) -> None:
    with pytest.raises(DecodeError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        decode(msgpack.packb({**episode_map(), **change}), TrajectoryEvent)


def test_an_empty_response_with_an_empty_mask_is_valid() -> None:
    empty = {
        "response_ids": wire([], "int32"),
        "logprobs": wire([], "float32"),
        "versions": wire([], "int32"),
        "response_mask": wire([], "uint8"),
    }
    event = decode(msgpack.packb({**episode_map(), **empty}), TrajectoryEvent)
    assert event.trained_versions().size == 0


def test_version_1_events_upgrade_to_version_2_with_no_mask() -> None:
    """The v1 goldens (bytes v1 wrote) decode as v2: the trajectory with no mask, the reward with
    its nested trajectory upgraded too; and they mean what they meant, every token trained."""
    trajectory = decode((GOLDEN / "trajectory.v1.msgpack").read_bytes(), TrajectoryEvent)
    # (and on to version 3, the trajectory's current: no earlier segments)
    assert (trajectory.schema_version, trajectory.response_mask, trajectory.earlier) == (
        3,
        None,
        (),
    )
    assert trajectory.trained_versions().tolist() == [3, 3, 4]
    reward = decode((GOLDEN / "reward.v1.msgpack").read_bytes(), RewardEvent)
    # (and on to version 4, the reward's current: no turn rewards)
    assert (reward.schema_version, reward.turn_rewards) == (4, None)
    assert reward.trajectory == trajectory
    assert msgpack.unpackb(encode(reward))["trajectory"]["schema_version"] == 3
    # A version-1 reward whose trajectory is broken still fails as the trajectory's problem.
    old = msgpack.unpackb((GOLDEN / "reward.v1.msgpack").read_bytes())
    with pytest.raises(DecodeError, match="trajectory"):
        decode(msgpack.packb({**old, "trajectory": 7}), RewardEvent)
    # A version-1 map naming a mask is not read as a masked version 2.
    mask = wire(MASK[:3], "uint8")
    with pytest.raises(DecodeError, match="schema_version 1 has no response_mask"):
        decode(msgpack.packb({**old["trajectory"], "response_mask": mask}), TrajectoryEvent)
    nested = {**old, "trajectory": {**old["trajectory"], "response_mask": mask}}
    with pytest.raises(DecodeError, match="schema_version 1 has no response_mask"):
        decode(msgpack.packb(nested), RewardEvent)


def test_reference_log_probs_at_environment_tokens_are_free() -> None:
    """The reference stage scores every token without the mask: any log-prob there is accepted
    (the golden reward's -3.5 at a tool-result token), and no reader uses it."""
    reward = golden_reward("reward.v2")
    assert decode(encode(reward), RewardEvent) == reward
    assert reward.ref_logprobs is not None and reward.ref_logprobs.numpy()[2] == -3.5


def test_packing_makes_the_mask_the_loss_mask_over_the_response() -> None:
    reward = golden_reward("reward.v2")
    mb = arrays(Row.all_of(reward, 0.5, ""))
    # Three prompt tokens, then the response's mask.
    assert mb.loss_mask.tolist() == [[0, 0, 0, *MASK]]
    assert mb.attention_mask.tolist() == [[1] * 8]
    assert mb.versions.tolist() == [[-1, -1, -1, 3, 3, -1, -1, 4]]
    assert mb.behaviour_logprobs.tolist() == [[0, 0, 0, -0.5, -1.25, 0, 0, -0.125]]
    assert mb.ref_logprobs is not None
    assert mb.ref_logprobs.tolist() == [[0, 0, 0, -0.25, -1.0, 0, 0, -0.125]]
    # And the batch event accepts it (versions -1 and log-probs 0.0 off the loss mask).
    BatchEvent(
        id="g/step/4/0/0",
        run="g",
        step=4,
        dp_rank=0,
        dp_size=1,
        micro_index=0,
        micro_count=1,
        input_ids=Tensor.from_numpy(mb.input_ids),
        attention_mask=Tensor.from_numpy(mb.attention_mask),
        loss_mask=Tensor.from_numpy(mb.loss_mask),
        advantages=Tensor.from_numpy(mb.advantages),
        behaviour_logprobs=Tensor.from_numpy(mb.behaviour_logprobs),
        versions=Tensor.from_numpy(mb.versions),
        rewards=Tensor.from_numpy(mb.rewards),
        sample_ids=(reward.id,),
        ref_logprobs=Tensor.from_numpy(mb.ref_logprobs),
    )


def test_a_trajectory_without_a_mask_packs_as_before() -> None:
    mb = arrays(Row.all_of(golden_reward("reward.v1"), 0.5, ""))
    assert mb.loss_mask.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert mb.versions.tolist() == [[-1, -1, -1, 3, 3, 4]]


def test_staleness_and_the_samples_file_count_only_trained_versions() -> None:
    reward = golden_reward("reward.v2")
    group = Group(reward.trajectory.prompt_id, 2)
    group.add(reward, None)  # type: ignore[arg-type]  # the Msg is only held
    assert group.min_version == 3
    line = group_line([reward], None, step=5)
    (response,) = line["responses"]
    assert (response["version"], response["staleness"]) == (3, 2)
    assert (response["tokens"], response["environment_tokens"]) == (5, 2)


def test_the_kl_in_the_reward_counts_only_trained_tokens() -> None:
    reward = golden_reward("reward.v2")
    kl, mask = response_kl([reward], kl_k3)
    assert mask.tolist() == [[float(m) for m in MASK]]
    assert kl[0, 2].item() == 0.0 and kl[0, 3].item() == 0.0
    # At a trained token it is k3 of the behaviour and reference log-probs.
    assert kl[0, 0].item() == pytest.approx(np.exp(-0.25 + 0.5) - 1 - (-0.25 + 0.5))


def test_version_2_trajectories_read_as_one_segment_and_version_3_split_ones_keep_theirs() -> None:
    """The trajectory.v2 golden (bytes version 2 wrote) reads as a version 3 with no earlier
    segment, and the reward.v3 golden as a version 4 without earlier reference log-probs; the
    trajectory.v3 golden reads back with its earlier segment, whose version counts."""
    trajectory = decode((GOLDEN / "trajectory.v2.msgpack").read_bytes(), TrajectoryEvent)
    assert (trajectory.schema_version, trajectory.earlier) == (3, ())
    assert len(trajectory.segments()) == 1
    reward = decode((GOLDEN / "reward.v3.msgpack").read_bytes(), RewardEvent)
    assert (reward.schema_version, reward.earlier_ref_logprobs) == (4, ())
    assert reward.trajectory == trajectory
    split = decode((GOLDEN / "trajectory.v3.msgpack").read_bytes(), TrajectoryEvent)
    (earlier,) = split.earlier
    assert earlier.response_mask.numpy().tolist() == [1, 1, 0, 1]
    assert split.trained_versions().tolist() == [2, 2, 3, 3, 3, 4]
    # A version-2 map naming earlier segments is not read as a version 3.
    old = episode_map()
    split_map = msgpack.unpackb(encode(split))
    with pytest.raises(DecodeError, match="schema_version 2 has no earlier segments"):
        decode(msgpack.packb({**old, "earlier": split_map["earlier"]}), TrajectoryEvent)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"response_mask": wire([1, 1, 0], "uint8")}, "response_mask (3,) must match"),
        ({"versions": wire([2, 2, 5, 3], "int32")}, "versions must be -1 at environment"),
        ({"response_ids": wire([], "int32"), "logprobs": wire([], "float32")}, "must be equal"),
        ({"prompt_ids": wire([], "int32")}, "an earlier segment needs a prompt and a response"),
    ],
)
def test_an_earlier_segment_that_breaks_the_convention_is_refused(
    change: dict[str, Any], reason: str
) -> None:
    fields = msgpack.unpackb((GOLDEN / "trajectory.v3.msgpack").read_bytes())
    fields["earlier"] = [{**fields["earlier"][0], **change}]
    with pytest.raises(DecodeError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        decode(msgpack.packb(fields), TrajectoryEvent)
