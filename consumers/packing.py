"""Turning complete groups into gradient-ready micro-batches, balanced by tokens across ranks.

Pure functions over numpy (no bus): the buffer calls `pack_step`; tests check the balance.

A row's loss mask over its response is its trajectory's `trained_mask` (a multi-turn episode's
environment and template tokens: 0, as the prompt); the behaviour log-probs and versions are
copied as they travel (0.0 and -1 at those tokens already), the reference log-probs only where
the loss mask is 1 (0 elsewhere, as `BatchEvent` says). An episode's turn rewards
(`agent.turn_rewards`) go on the last token of each model turn (`schemas.turn_rewards.place`).

A trajectory of several segments (an agent episode whose render stopped extending its tokens,
`schemas.segment`) is a row per segment, all with its id in `sample_ids`, its advantage and its
reward: each segment is its own sequence (its own prompt; no row attends to another's tokens).
The loss aggregation sees them as rows: token-mean counts every segment's tokens once;
a seq-mean aggregation weighs a split episode by its segments (as verl and slime weigh a
sample's segments when they split one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from schemas.events import RewardEvent, TrajectoryEvent
from schemas.turn_rewards import place_segments

BYTES_PER_TOKEN = 14
"""What one token takes in a BatchEvent: int32 id, uint8 attention and loss masks, float32
behaviour log-prob, int32 version."""
REF_BYTES_PER_TOKEN = 4
"""And the float32 reference log-prob, when the run has the reference stage."""
TURN_BYTES_PER_TOKEN = 4
"""And the float32 token reward, with `agent.turn_rewards`."""


def bytes_per_token(reference: bool, turn_rewards: bool) -> int:
    """What one token takes in a BatchEvent of a run with (or without) the reference stage, for
    a row with (or without) turn rewards."""
    return BYTES_PER_TOKEN + REF_BYTES_PER_TOKEN * reference + TURN_BYTES_PER_TOKEN * turn_rewards


def row_too_long(trajectory: TrajectoryEvent, per_token: int, max_payload: int) -> str | None:
    """Why a trajectory's rows could never go into a batch event (None if they can). A row
    may take half the server's max payload: the other half is for the ids a batch event
    carries. Each segment of a split episode is a row of its own (`Row.all_of`), so the
    longest segment must fit, not their sum."""
    tokens = max(s.prompt.shape[0] + s.response.shape[0] for s in trajectory.segments())
    if tokens * per_token > max_payload // 2:
        return f"a row of {tokens} tokens cannot fit one batch event"
    return None


@dataclass(frozen=True)
class Row:
    """One training sequence: prompt + response, with its per-sequence advantage."""

    sample_id: str
    prompt: np.ndarray  # int32 [P]
    response: np.ndarray  # int32 [R]
    logprobs: np.ndarray  # float32 [R]
    versions: np.ndarray  # int32 [R], -1 at environment tokens
    advantage: float
    reward: float
    traceparent: str
    ref_logprobs: np.ndarray | None = None  # float32 [R], from the reference stage
    trained: np.ndarray | None = None  # bool [R], the model's tokens; None: all of them
    token_rewards: np.ndarray | None = None  # float32 [R], each turn's on its last token

    @property
    def tokens(self) -> int:
        return len(self.prompt) + len(self.response)

    @classmethod
    def all_of(cls, reward: RewardEvent, advantage: float, traceparent: str) -> list[Row]:
        """One row per segment of the sample's trajectory (`TrajectoryEvent.segments`: an
        episode split where its render stopped extending its tokens has several), each with
        the sample's id, advantage and reward: the episode is one sample of its group, and
        every model token it generated is trained with the group's credit for it."""
        t = reward.trajectory
        segments = t.segments()
        refs = reward.ref_segments()
        turns = (
            None
            if reward.turn_rewards is None
            else place_segments(reward.turn_rewards.numpy(), segments)
        )
        return [
            cls(
                t.id,
                s.prompt,
                s.response,
                s.logprobs,
                s.versions,
                advantage,
                reward.reward,
                traceparent,
                None if refs is None else refs[i],
                s.trained,
                None if turns is None else turns[i],
            )
            for i, s in enumerate(segments)
        ]


@dataclass(frozen=True)
class MicroBatchArrays:
    """Right-padded arrays of one micro-batch, shapes as in `BatchEvent`."""

    input_ids: np.ndarray  # int32 [B, T]
    attention_mask: np.ndarray  # uint8 [B, T]
    loss_mask: np.ndarray  # uint8 [B, T]
    behaviour_logprobs: np.ndarray  # float32 [B, T]
    versions: np.ndarray  # int32 [B, T], -1 off the loss mask
    advantages: np.ndarray  # float32 [B]
    rewards: np.ndarray  # float32 [B]
    rows: tuple[Row, ...]
    ref_logprobs: np.ndarray | None = (
        None  # float32 [B, T], 0 off the loss mask; None unless every row has them
    )
    token_rewards: np.ndarray | None = None  # float32 [B, T]; None unless a row has them


def balance(rows: list[Row], ranks: int) -> list[list[Row]]:
    """Greedy longest-first assignment of samples to the rank with the fewest tokens so far;
    each rank's rows longest first.

    A sample's rows (an episode's segments, `Row.all_of`) go to one rank together: a rank
    counts the samples it trained by id in its step metrics, and the run adds the ranks'
    counts, so an episode split over two ranks would be counted twice. Deterministic for the same
    input order (ties go to the lowest rank), so a restarted buffer re-forms the same step.
    """
    samples: dict[str, list[Row]] = {}
    for row in rows:
        samples.setdefault(row.sample_id, []).append(row)
    buckets: list[list[Row]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for sample in sorted(samples.values(), key=lambda s: -sum(r.tokens for r in s)):
        rank = loads.index(min(loads))
        buckets[rank] += sample
        loads[rank] += sum(r.tokens for r in sample)
    return [sorted(bucket, key=lambda r: -r.tokens) for bucket in buckets]


def split(rows: Sequence[Row], max_tokens: int) -> list[list[Row]]:
    """Consecutive micro-batches whose padded size (rows x longest) stays <= max_tokens.

    Rows arrive longest first, so each micro-batch's padding is small. A single row longer
    than max_tokens still gets a micro-batch of its own.
    """
    batches: list[list[Row]] = []
    longest = (
        0  # of the last micro-batch, kept as it grows: a step of n rows costs O(n), not O(n^2)
    )
    for row in rows:
        if batches and (len(batches[-1]) + 1) * longest <= max_tokens:
            batches[-1].append(row)
            longest = max(longest, row.tokens)
        else:
            batches.append([row])
            longest = row.tokens
    return batches


def arrays(rows: list[Row]) -> MicroBatchArrays:
    b, t = len(rows), max(r.tokens for r in rows)
    input_ids = np.zeros((b, t), np.int32)
    attention = np.zeros((b, t), np.uint8)
    loss = np.zeros((b, t), np.uint8)
    logprobs = np.zeros((b, t), np.float32)
    versions = np.full((b, t), -1, np.int32)
    with_ref = all(row.ref_logprobs is not None for row in rows)
    ref = np.zeros((b, t), np.float32) if with_ref else None
    with_turns = any(row.token_rewards is not None for row in rows)
    token_rewards = np.zeros((b, t), np.float32) if with_turns else None
    for i, row in enumerate(rows):
        p, n = len(row.prompt), row.tokens
        input_ids[i, :p], input_ids[i, p:n] = row.prompt, row.response
        attention[i, :n] = 1
        loss[i, p:n] = 1 if row.trained is None else row.trained
        logprobs[i, p:n] = row.logprobs
        versions[i, p:n] = row.versions
        if ref is not None and row.ref_logprobs is not None:
            scored = row.ref_logprobs
            ref[i, p:n] = scored if row.trained is None else np.where(row.trained, scored, 0.0)
        if token_rewards is not None and row.token_rewards is not None:
            token_rewards[i, p:n] = row.token_rewards
    return MicroBatchArrays(
        input_ids,
        attention,
        loss,
        logprobs,
        versions,
        np.array([r.advantage for r in rows], np.float32),
        np.array([r.reward for r in rows], np.float32),
        tuple(rows),
        ref,
        token_rewards,
    )


def pack_step(rows: list[Row], ranks: int, max_tokens: int) -> list[list[MicroBatchArrays]]:
    """[rank][micro] micro-batches of one step. A rank may get none when rows < ranks."""
    return [[arrays(mb) for mb in split(bucket, max_tokens)] for bucket in balance(rows, ranks)]
