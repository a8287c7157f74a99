"""What the trainer makes of one step's micro-batches, apart from its I/O (`consumers.trainer`):

    take_batch     a batch read by position -> the step's micro-batch, or Reject (dead-lettered)
    micro_batch    BatchEvent -> the engine's MicroBatch (torch tensors, [B, T])
    loss_config    the run config -> the engine's LossConfig
    step_metrics   the step's batches + the engine's figures -> KV metrics.<rank>.<s>
    record_step    the step's OpenTelemetry metrics (duration, samples, staleness)

Pure but for `record_step`'s meters: tested without a bus (tests/test_algorithm_engine.py,
tests/test_episode_mask.py, tests/test_episode_segments.py).
"""

from __future__ import annotations

import math
import time

import numpy as np

from bus.metrics import STALENESS, TRAIN_STEP_SECONDS, count_samples
from bus.worker import Reject
from engines.protocols import MicroBatch
from engines.torch_train import LossConfig
from schemas import BatchEvent
from schemas.config import RunConfig


def micro_batch(batch: BatchEvent) -> MicroBatch:
    return MicroBatch(
        input_ids=batch.input_ids.torch().long(),
        attention_mask=batch.attention_mask.torch().long(),
        loss_mask=batch.loss_mask.torch().float(),
        advantages=batch.advantages.torch(),
        behaviour_logprobs=batch.behaviour_logprobs.torch(),
        ref_logprobs=None if batch.ref_logprobs is None else batch.ref_logprobs.torch(),
        token_rewards=None if batch.token_rewards is None else batch.token_rewards.torch(),
    )


def step_metrics(
    step: int, batches: list[BatchEvent], trained: dict[str, float], seconds: float
) -> dict:
    """What the producer's progress line and plots need from one step (`batches` may be empty:
    a step whose every micro-batch was refused)."""
    # One reward per sample: a split agent episode's segments are rows of one sample (one id,
    # one reward; `consumers.packing`), counted once.
    reward_of = {
        sid: float(r)
        for b in batches
        for sid, r in zip(b.sample_ids, b.rewards.numpy().tolist(), strict=True)
    }
    rewards = np.array(list(reward_of.values()), np.float32)
    versions = np.concatenate(
        [np.zeros(0, np.int32), *(b.versions.numpy()[b.loss_mask.numpy() == 1] for b in batches)]
    )
    return {
        "step": step,
        "time": time.time(),
        "train_seconds": seconds,
        "samples": int(rewards.size),
        "reward_mean": float(rewards.mean()) if rewards.size else math.nan,
        # Staleness of each token: the version being trained minus the version that made it.
        "staleness_max": int(step - versions.min()) if versions.size else 0,
        "staleness_hist": np.bincount(step - versions).tolist() if versions.size else [],
        "sample_ids": list(reward_of),
        # Not the engine's "step" (the float count *after* the step): it overwrote the index
        # above, so the KV key read `metrics.0.1.0` for step 0 and every reader was off by one.
        **{name: value for name, value in trained.items() if name != "step"},
        # KL in the reward: the coefficient the buffer penalised the step with,
        # and the KL it measured.
        **(
            {"kl_coef": batches[0].kl_coef, "kl_reward": batches[0].kl_mean}
            if batches and batches[0].kl_coef is not None
            else {}
        ),
        # Agent episodes: the whole step's figures, carried by every micro-batch.
        **(
            {
                "tool_use_rate": batches[0].tool_use_rate,
                "turns_mean": batches[0].turns_mean,
                "solved_rate": batches[0].solved_rate,
            }
            if batches and batches[0].tool_use_rate is not None
            else {}
        ),
    }


def record_step(step: int, batches: list[BatchEvent], seconds: float) -> None:
    """OpenTelemetry metrics of one step: its duration, its samples, and each sample's staleness."""
    TRAIN_STEP_SECONDS.record(seconds)
    count_samples("trainer", "trained", len({sid for b in batches for sid in b.sample_ids}))
    for b in batches:
        # A sample's staleness: the step minus the oldest version among its loss tokens.
        oldest = np.where(b.loss_mask.numpy() == 1, b.versions.numpy(), step).min(axis=1)
        for staleness in (step - oldest).tolist():
            STALENESS.record(staleness)


def take_batch(batch: BatchEvent, step: int, rank: int, collected: list[BatchEvent]) -> BatchEvent:
    """`batch` if it is a micro-batch of the step being collected, else Reject: a batch for
    another step or rank, or one that clashes with those `collected` (a repeated index, another
    count). Reading by position, the trainer cannot nak: what it rejects goes to `dead`."""
    if (batch.step, batch.dp_rank) != (step, rank):
        raise Reject(
            f"batch {batch.id} is for step {batch.step} rank {batch.dp_rank}, "
            f"expected step {step} rank {rank}"
        )
    if collected and (
        batch.micro_count != collected[0].micro_count
        or batch.micro_index in {b.micro_index for b in collected}
    ):
        raise Reject(
            f"batch {batch.id}: micro-batch {batch.micro_index} of {batch.micro_count} "
            "clashes with the "
            f"{len(collected)} collected of {collected[0].micro_count}"
        )
    return batch


def loss_config(cfg: RunConfig) -> LossConfig:
    """The engine's loss settings from the run config: the policy loss, aggregation, clip
    range, IS correction and regularisers of `algorithm`, and the rollout's sampling
    temperature (behaviour log-probs were taken at it, so the trainer's must be too). A KL in the
    reward is the buffer's: the loss then has no KL term."""
    algo = cfg.algorithm
    return LossConfig(
        policy_loss=algo.policy_loss,
        eps_low=algo.clip_low,
        eps_high=algo.clip_high,
        dual_clip_c=algo.dual_clip_c,
        aggregation=algo.loss_aggregation,
        norm_tokens=algo.loss_scale_tokens or cfg.data.sampling.max_tokens,
        tis_cap=algo.tis_cap,
        is_level=algo.is_level,
        is_mask_low=algo.is_mask_low,
        is_mask_high=algo.is_mask_high,
        reject_log_ratio=algo.reject_log_ratio,
        entropy_coef=algo.entropy_coef,
        kl_coef=algo.kl_coef if algo.kl_placement == "loss" else 0.0,
        kl_estimator=algo.kl_estimator,
        temperature=cfg.data.sampling.temperature,
    )
