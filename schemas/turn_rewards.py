"""Per-turn rewards of an agent episode (`agent.turn_rewards`, issue 27): where they go.

An environment's `step` answers each model turn that made no tool call with (messages, reward,
done). Without the option the episode's reward is its outcome alone, added once on its last
token. With it, the reward of every step that did NOT end the episode is credited to the model
turn it answered; a turn answered by tools, and the turn the ending step answered, get 0 (the
ending step's reward is the outcome: it reaches the last token as the trajectory's reward, once,
so nothing is counted twice). The flow, and the one decision each stage takes:

    rollout   per model turn of the episode: turn_rewards [K] in task["episode"]
    reward    RewardEvent.turn_rewards float32 [K], K = the model turns in the response masks
              of every segment of the trajectory (`TrajectoryEvent.segments`, in order)
    buffer    `place_segments`: reward k on the LAST token of model turn k, in the row of the
              segment that holds the turn -> BatchEvent.token_rewards float32 [B, T], 0
              elsewhere (always on the loss mask)
    trainer   GAE's per-token rewards = outcome on the last loss token + token_rewards

Model turn k of a response is the k-th run of 1s in its `response_mask`: `EpisodeTokens`
appends a model turn (at least one token, mask 1) and, before the next model turn of the same
sample, the environment's render (the chat template's end of turn and generation prompt at
least, mask 0). A template that put nothing between two turns would merge their runs; the
counts then disagree and the reward worker fails that sample with the reason (never a silent
misplacement).

Pure numpy: no bus, no torch. Shapes: R response tokens, K model turns, B rows, T positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from schemas.array_checks import checked_values, finite
from schemas.segment import SegmentArrays
from schemas.tensor import Tensor


def turn_ends(mask: np.ndarray | None, length: int) -> np.ndarray:
    """int64 [K]: the response index of the last token of each model turn, in order: the last 1
    of each run of 1s in `mask` (0/1 [R]); None (a single-turn response): [R - 1], or [] when
    the response is empty."""
    if mask is None:
        return np.array([length - 1] if length else [], dtype=np.int64)
    on = np.asarray(mask).astype(bool)
    following = np.append(on[1:], False)  # [R]: is the next token a model token?
    return np.flatnonzero(on & ~following).astype(np.int64)


def _one_per_turn(turn_rewards: np.ndarray, turns: int) -> None:
    """ValueError unless `turn_rewards` is [turns]: one reward per model turn."""
    if turn_rewards.shape != (turns,):
        raise ValueError(
            f"{turn_rewards.shape[0] if turn_rewards.ndim == 1 else turn_rewards.shape} turn "
            f"rewards for {turns} model turns in the response mask"
        )


def place(turn_rewards: np.ndarray, mask: np.ndarray | None, length: int) -> np.ndarray:
    """float32 [R]: turn reward k (float [K]) on the last token of model turn k, 0 elsewhere.
    ValueError when K is not the number of model turns in `mask`."""
    ends = turn_ends(mask, length)
    _one_per_turn(turn_rewards, ends.size)
    out = np.zeros(length, np.float32)
    out[ends] = turn_rewards
    return out


def model_turns(mask: np.ndarray | None, length: int) -> int:
    """The model turns of a response of `length` tokens: the runs of 1s in `mask` (0/1 [R],
    already checked by the trajectory's validator), counted without `place`'s R floats."""
    if mask is None:
        return 1 if length else 0
    # a run of 1s ends where a 1 is followed by a 0, or at the last token
    return int(np.count_nonzero(mask[:-1] > mask[1:])) + int(length > 0 and mask[-1] == 1)


def check_turn_rewards(turn_rewards: Tensor, segments: Sequence[SegmentArrays]) -> None:
    """`RewardEvent.turn_rewards`: float32 [K], finite, one per model turn of the trajectory's
    segments (`TrajectoryEvent.segments`: its earlier samples' turns first)."""
    values = checked_values("turn_rewards", turn_rewards, "float32", 1)
    finite("turn_rewards", values)
    _one_per_turn(values, sum(model_turns(s.mask, s.response.shape[0]) for s in segments))


def place_segments(turn_rewards: np.ndarray, segments: Sequence[SegmentArrays]) -> list[np.ndarray]:
    """float32 [R_i] per segment: `place` of the segment's own turns' rewards, taken from
    `turn_rewards` (float [K], every segment's turns in order). ValueError when K is not the
    trajectory's model turns."""
    counts = [model_turns(s.mask, s.response.shape[0]) for s in segments]
    _one_per_turn(turn_rewards, sum(counts))
    starts = np.cumsum([0, *counts])
    return [
        place(turn_rewards[starts[i] : starts[i + 1]], s.mask, s.response.shape[0])
        for i, s in enumerate(segments)
    ]


def check_token_rewards(token_rewards: Tensor, off_loss: np.ndarray) -> None:
    """`BatchEvent.token_rewards`: float32 [B, T] like the loss mask, finite, 0 off the loss
    mask (GAE skips tokens off the mask: a reward there would be lost without a word).
    `off_loss`: bool [B, T], True off the loss mask (the batch's validator makes it once)."""
    if token_rewards.shape != off_loss.shape:
        raise ValueError(
            f"token_rewards has shape {token_rewards.shape}, expected {off_loss.shape}"
        )
    values = checked_values("token_rewards", token_rewards, "float32", 2)
    finite("token_rewards", values)
    if np.any(values[off_loss]):
        raise ValueError("token_rewards must be 0 off the loss mask")


def sample_turn_rewards(episode_turns: Sequence[float], sample_turns: int) -> list[float]:
    """The turn rewards of an episode's stored samples: its LAST `sample_turns` model turns
    (every sample of an episode is stored, so these are all its turns). Turns with no reward
    recorded (an episode resumed from a record written before the option existed) get 0: no
    credit, never a reward moved onto another turn."""
    known = [float(r) for r in episode_turns[max(0, len(episode_turns) - sample_turns) :]]
    return [0.0] * (sample_turns - len(known)) + known


def from_task(task: dict[str, Any]) -> np.ndarray | None:
    """float32 [K]: the turn rewards the rollout worker put in `task["episode"]`; None for a
    sample that has none (single-turn, or an agent that gives none)."""
    episode = task.get("episode")
    rewards = episode.get("turn_rewards") if isinstance(episode, dict) else None
    if rewards is None:
        return None
    return np.asarray(rewards, dtype=np.float32).reshape(-1)


def trajectory_turn_rewards(
    task: dict[str, Any], segments: Sequence[SegmentArrays]
) -> np.ndarray | None:
    """float32 [K]: a trajectory's turn rewards (`from_task`), checked against its segments'
    model turns (`place_segments`); None when it has none. ValueError naming the mismatch."""
    rewards = from_task(task)
    if rewards is not None:
        finite("turn_rewards", rewards)
        place_segments(rewards, segments)
    return rewards
