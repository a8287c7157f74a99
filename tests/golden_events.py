"""One fixed instance of every event version, and the writer of the golden msgpack files.

`python -m tests.golden_events` writes the tests/golden/<name>.msgpack files that do not exist
yet (a new event version's): a file once written is the bytes its version wrote, never
rewritten, and must keep decoding (an older version through `schemas.codec`'s upgrades) to the
event named here for it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from schemas import (
    BatchEvent,
    Event,
    PromptEvent,
    RewardEvent,
    RewardGroupEvent,
    SamplingParams,
    Segment,
    Tensor,
    TensorSpec,
    TrajectoryEvent,
    TrajectoryGroupEvent,
    WeightVersionEvent,
    encode,
)

GOLDEN = Path(__file__).parent / "golden"
T0 = 1_790_000_000.25


def _i32(*values: int) -> Tensor:
    return Tensor.from_numpy(np.array(values, dtype=np.int32))


def golden() -> dict[str, Event]:
    traj = TrajectoryEvent(
        id="g/0/3/1",
        run="g",
        time=T0,
        source="host:1:rollout",
        prompt_id="g/0/3",
        sample_index=1,
        group_size=2,
        prompt_ids=_i32(1, 5, 7),
        response_ids=_i32(9, 4, 2),
        logprobs=Tensor.from_numpy(np.array([-0.5, -1.25, -0.125], dtype=np.float32)),
        versions=_i32(3, 3, 4),
        response_text="9 4",
        finish_reason="stop",
        task={"answer": "9 4"},
        engine="hf",
        timings={"generate": 0.5},
    )
    # An episode's response: model tokens, a tool result and the next turn's header (mask 0:
    # version -1, log-prob 0.0), then model tokens again.
    episode = TrajectoryEvent(
        id="g/0/3/0",
        run="g",
        time=T0,
        source="host:1:rollout",
        prompt_id="g/0/3",
        sample_index=0,
        group_size=2,
        prompt_ids=_i32(1, 5, 7),
        response_ids=_i32(9, 4, 6, 8, 2),
        logprobs=Tensor.from_numpy(np.array([-0.5, -1.25, 0.0, 0.0, -0.125], dtype=np.float32)),
        versions=_i32(3, 3, -1, -1, 4),
        response_text="9 4 = 8",
        finish_reason="stop",
        task={"answer": "9 4"},
        engine="hf",
        timings={"generate": 0.5},
        response_mask=Tensor.from_numpy(np.array([1, 1, 0, 0, 1], dtype=np.uint8)),
    )
    # An episode whose template dropped its earlier reasoning: one earlier segment (a model
    # turn, a tool result, a model turn), then its last sample (the fields of `episode`).
    earlier = Segment(
        prompt_ids=_i32(1, 5),
        response_ids=_i32(11, 12, 6, 13),
        logprobs=Tensor.from_numpy(np.array([-0.25, -0.75, 0.0, -2.0], dtype=np.float32)),
        versions=_i32(2, 2, -1, 3),
        response_mask=Tensor.from_numpy(np.array([1, 1, 0, 1], dtype=np.uint8)),
    )
    split = episode.model_copy(update={"earlier": (earlier,)})
    split_scored = RewardEvent(
        id=split.id,
        run="g",
        time=T0,
        source="host:1:reference",
        trajectory=split,
        reward=1.0,
        components={"exact": 1.0},
        ref_logprobs=Tensor.from_numpy(
            np.array([-0.25, -1.0, -3.5, -0.75, -0.125], dtype=np.float32)
        ),
        earlier_ref_logprobs=(
            Tensor.from_numpy(np.array([-0.5, -0.5, -4.0, -1.5], dtype=np.float32)),
        ),
        turn_rewards=Tensor.from_numpy(np.array([0.5, 0.0, 0.25, 0.0], dtype=np.float32)),
    )
    # A whole group of two (`schemas.group_events`): the split episode, then the plain sample.
    plain_scored = RewardEvent(
        id=traj.id,
        run="g",
        time=T0,
        source="host:1:reference",
        trajectory=traj,
        reward=0.0,
        failed=True,
        reason="TimeoutError: over 10 s",
        ref_logprobs=Tensor.from_numpy(np.array([-0.5, -2.0, -0.25], dtype=np.float32)),
    )
    b, t = 2, 4
    batch = BatchEvent(
        id="g/step/4/0/0",
        run="g",
        time=T0,
        source="host:1:buffer",
        step=4,
        dp_rank=0,
        dp_size=1,
        micro_index=0,
        micro_count=1,
        input_ids=Tensor.from_numpy(np.arange(b * t, dtype=np.int32).reshape(b, t)),
        attention_mask=Tensor.from_numpy(np.ones((b, t), dtype=np.uint8)),
        loss_mask=Tensor.from_numpy(np.array([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=np.uint8)),
        advantages=Tensor.from_numpy(np.array([1.0, -1.0], dtype=np.float32)),
        behaviour_logprobs=Tensor.from_numpy(np.full((b, t), -0.5, dtype=np.float32)),
        versions=Tensor.from_numpy(np.full((b, t), 3, dtype=np.int32)),
        rewards=Tensor.from_numpy(np.array([1.0, 0.0], dtype=np.float32)),
        sample_ids=("g/0/3/0", "g/0/3/1"),
        step_prompt_ids=("g/0/3",),
        traceparents=("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", ""),
    )
    return {
        "prompt.v1": PromptEvent(
            id="g/0/3",
            run="g",
            time=T0,
            source="host:1:producer",
            epoch=0,
            index=3,
            prompt="sort 4 9",
            token_ids=_i32(1, 5, 7),
            task={"answer": "4 9"},
            n=2,
            sampling=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8, stop_token_ids=(2,)),
            admitted_version=3,
        ),
        "trajectory.v1": traj,
        "reward.v1": RewardEvent(
            id=traj.id,
            run="g",
            time=T0,
            source="host:1:reward",
            trajectory=traj,
            reward=0.5,
            components={"exact": 0.0, "partial": 0.5},
        ),
        "trajectory.v2": episode,
        "reward.v2": RewardEvent(
            id=episode.id,
            run="g",
            time=T0,
            source="host:1:reference",
            trajectory=episode,
            reward=1.0,
            components={"exact": 1.0},
            ref_logprobs=Tensor.from_numpy(
                np.array([-0.25, -1.0, -3.5, -0.75, -0.125], dtype=np.float32)
            ),
        ),
        "batch.v1": batch,
        # An episode of two model turns: the first turn's reward on its last token (the episode's
        # outcome stays the reward, on the last token).
        "reward.v3": RewardEvent(
            id=episode.id,
            run="g",
            time=T0,
            source="host:1:reward",
            trajectory=episode,
            reward=1.0,
            components={"exact": 1.0},
            turn_rewards=Tensor.from_numpy(np.array([0.25, 0.0], dtype=np.float32)),
        ),
        "trajectory.v3": split,
        # The split episode scored by the reference stage, with a reward per model turn: two
        # in the earlier segment, then the last sample's two.
        "reward.v4": split_scored,
        "trajectory_group.v1": TrajectoryGroupEvent(
            id="g/0/3/group",
            run="g",
            time=T0,
            source="host:1:rollout",
            prompt_id="g/0/3",
            samples=(split, traj),
        ),
        "reward_group.v1": RewardGroupEvent(
            id="g/0/3/group",
            run="g",
            time=T0,
            source="host:1:reference",
            prompt_id="g/0/3",
            rewards=(split_scored, plain_scored),
        ),
        "batch.v2": batch.model_copy(
            update={
                "token_rewards": Tensor.from_numpy(
                    np.array([[0, 0, 0, 0.5], [0, -0.25, 0, 0]], dtype=np.float32)
                )
            }
        ),
        # An agent run's step: its episode figures.
        "batch.v3": batch.model_copy(
            update={"tool_use_rate": 0.5, "turns_mean": 1.5, "solved_rate": 0.25}
        ),
        "weights.v1": WeightVersionEvent(
            id="g/weights/4",
            run="g",
            time=T0,
            source="host:1:trainer",
            version=4,
            step=4,
            location="v4.safetensors",
            total_bytes=64,
            manifest=(
                TensorSpec(name="lm_head.weight", dtype="bfloat16", shape=(4, 8), sha256="ab" * 32),
            ),
        ),
    }


def current(name: str, event: Event) -> bool:
    """Whether golden `name` ("trajectory.v1") is of its event's current version."""
    return name.endswith(f".v{type(event).VERSION}")


if __name__ == "__main__":
    GOLDEN.mkdir(exist_ok=True)
    for name, event in golden().items():
        path = GOLDEN / f"{name}.msgpack"
        if path.exists():
            continue  # the bytes its version wrote: never rewritten
        if not current(name, event):
            raise SystemExit(f"{path} is missing, and only its own version's code can write it")
        path.write_bytes(encode(event))
        print(GOLDEN / f"{name}.msgpack")
