"""The train engine's guards and the trainer's wiring of the run config, on the tiny model.

A step whose gradient overflows must not touch the weights (one NaN update poisons them for
good), and the clip range, TIS cap and temperature the run config names must be the ones the
loss uses: shown both on the LossConfig the trainer builds and on what a step reports.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from consumers.trainer_steps import loss_config
from engines.protocols import MicroBatch
from engines.torch_train import LossConfig, TorchTrainEngine
from schemas.config import RunConfig

ROWS, WIDTH, RESPONSE = 4, 10, 6  # each row: 4 prompt tokens, then 6 response tokens


def run_config(**algorithm: object) -> RunConfig:
    """Distinct values everywhere, none a default: a swapped or dropped field shows."""
    return RunConfig.model_validate(
        {
            "algorithm": {"clip_low": 0.05, "clip_high": 0.4, "tis_cap": None, **algorithm},
            "data": {"sampling": {"temperature": 0.7}},
        }
    )


def engine(model_dir: Path, cfg: RunConfig) -> TorchTrainEngine:
    # Weight decay > 0: an AdamW step changes the weights even when the clipped gradient is 0.
    return TorchTrainEngine(model_dir, lr=1e-2, weight_decay=0.01, seed=0, loss=loss_config(cfg))


def batch(eng: TorchTrainEngine, advantage: float, log_ratio: float | torch.Tensor) -> MicroBatch:
    """ROWS rows of random tokens whose response tokens have behaviour log-probs
    `log_ratio` (a number, or one per position [WIDTH]) below the engine's current ones:
    pi / pi_behaviour = exp(log_ratio) on each."""
    vocab: int = eng.model.config.vocab_size  # type: ignore[union-attr, assignment]  # a HF config
    input_ids = torch.randint(0, vocab, (ROWS, WIDTH), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(ROWS, WIDTH, dtype=torch.long)
    loss_mask = torch.zeros(ROWS, WIDTH)
    loss_mask[:, WIDTH - RESPONSE :] = 1
    behaviour = (eng.logprobs(input_ids, attention_mask) - log_ratio) * loss_mask
    return MicroBatch(
        input_ids, attention_mask, loss_mask, torch.full((ROWS,), advantage), behaviour
    )


def test_loss_config_carries_each_algorithm_field_to_its_own_place() -> None:
    cfg = run_config(tis_cap=2.5, policy_loss="gspo", loss_aggregation="seq-mean-token-sum")
    assert loss_config(cfg) == LossConfig(
        policy_loss="gspo",
        eps_low=0.05,
        eps_high=0.4,
        aggregation="seq-mean-token-sum",
        norm_tokens=16,
        tis_cap=2.5,
        temperature=0.7,
    )
    assert loss_config(run_config()).tis_cap is None  # no cap configured: plain PPO
    family = run_config(
        dual_clip_c=3.5,
        loss_aggregation="seq-mean-token-sum-norm",
        loss_scale_tokens=9,
        is_level="sequence",
        is_mask_low=0.3,
        is_mask_high=4.5,
        reject_log_ratio=2.5,
        entropy_coef=0.01,
        kl_coef=0.02,
        kl_estimator="k2",
    )
    assert loss_config(family) == LossConfig(
        eps_low=0.05,
        eps_high=0.4,
        dual_clip_c=3.5,
        aggregation="seq-mean-token-sum-norm",
        norm_tokens=9,
        is_level="sequence",
        is_mask_low=0.3,
        is_mask_high=4.5,
        reject_log_ratio=2.5,
        entropy_coef=0.01,
        kl_coef=0.02,
        kl_estimator="k2",
        temperature=0.7,
    )


@pytest.mark.parametrize(
    ("advantage", "log_ratio", "clip_frac"),
    [
        # A > 0, ratio 1.3: under 1 + clip_high (1.4), so no token clips; the default 0.28
        # or clip_low (0.05) in its place would clip every one.
        (1.0, math.log(1.3), 0.0),
        # A < 0, ratio 0.9: under 1 - clip_low (0.95), so every token clips; the default 0.2
        # or clip_high (0.4) in its place would clip none.
        (-1.0, math.log(0.9), 1.0),
    ],
    ids=["positive-ratio-1.3", "negative-ratio-0.9"],
)
def test_the_configured_clip_range_decides_which_tokens_clip(
    model_dir: Path, advantage: float, log_ratio: float, clip_frac: float
) -> None:
    eng = engine(model_dir, run_config())
    stats = eng.train_step([batch(eng, advantage, log_ratio)])
    assert stats["ratio_mean"] == pytest.approx(math.exp(log_ratio), rel=1e-4)
    assert stats["clip_frac"] == clip_frac, (
        f"clip_frac {stats['clip_frac']} at ratio {math.exp(log_ratio):.2f}, "
        f"advantage {advantage}: the engine's clip range "
        f"{eng.loss_config.eps_low}/{eng.loss_config.eps_high} is not the config's 0.05/0.4"
    )


def test_the_configured_policy_loss_and_aggregation_shape_the_step(model_dir: Path) -> None:
    # Log ratios +-0.5 alternating along each response (three of each): PPO's token ratios
    # average cosh(0.5); GSPO's one ratio per sequence is exp(mean log ratio) = 1.
    alternating = 0.5 * (-1.0) ** torch.arange(WIDTH)
    ppo = engine(model_dir, run_config())
    assert ppo.train_step([batch(ppo, 1.0, alternating)])["ratio_mean"] == pytest.approx(
        math.cosh(0.5), rel=1e-4
    )
    gspo = engine(model_dir, run_config(policy_loss="gspo", loss_aggregation="seq-mean-token-sum"))
    stats = gspo.train_step([batch(gspo, 1.0, alternating)])
    assert stats["ratio_mean"] == pytest.approx(1.0, rel=1e-4), (
        "the configured policy_loss (gspo) is not the one used"
    )
    # Each token's loss is -ratio * A = -1; summed per sequence, averaged over sequences: -RESPONSE
    # (the token mean would be -1).
    assert stats["loss"] == pytest.approx(-RESPONSE, rel=1e-4), (
        "the configured loss_aggregation is not the one used"
    )


def test_the_configured_tis_cap_truncates_the_is_weight(model_dir: Path) -> None:
    # pi_prox / pi_behaviour = 3 on every token: the weight is the cap, 2.5 (1 with no cap).
    eng = engine(model_dir, run_config(tis_cap=2.5))
    stats = eng.train_step([batch(eng, 1.0, math.log(3.0))])
    assert stats["is_weight_mean"] == pytest.approx(2.5, rel=1e-5), (
        "the configured tis_cap did not bound the weight"
    )
    # Decoupled PPO: the ratio is taken against the proximal policy, so it is 1, not 3.
    assert stats["ratio_mean"] == pytest.approx(1.0, rel=1e-5)
    uncapped = engine(model_dir, run_config(tis_cap=10.0))
    assert uncapped.train_step([batch(uncapped, 1.0, math.log(3.0))])[
        "is_weight_mean"
    ] == pytest.approx(3.0, rel=1e-4)


@pytest.mark.parametrize(
    ("advantage", "log_ratio"),
    [
        # A far-off behaviour log-prob no longer overflows (the log-ratio is clamped to +-20,
        # tests/test_engines.py); a finite advantage near float32's max still does.
        (1e38, 0.0),
        (-3e38, 0.0),
    ],
    ids=["advantage", "negative-advantage"],
)
def test_a_step_whose_gradient_overflows_leaves_every_weight_as_it_was(
    model_dir: Path, advantage: float, log_ratio: float
) -> None:
    eng = engine(model_dir, run_config())
    before = {name: p.detach().clone() for name, p in eng.model.named_parameters()}
    stats = eng.train_step([batch(eng, advantage, log_ratio)])
    assert not math.isfinite(stats["grad_norm"]), (
        f"grad_norm {stats['grad_norm']}: the gradient did not overflow"
    )
    assert stats["step"] == 1.0, (
        "a skipped update still counts as a step: versions stay aligned with batches"
    )
    not_finite = [
        name for name, p in eng.model.named_parameters() if not bool(torch.isfinite(p).all())
    ]
    changed = [name for name, p in eng.model.named_parameters() if not torch.equal(p, before[name])]
    assert not not_finite, f"not finite after a step with a non-finite gradient: {not_finite}"
    assert not changed, f"changed by a step with a non-finite gradient: {changed}"
    # The optimizer was left clean too: an ordinary step afterwards still moves every weight
    # to finite values.
    stats = eng.train_step([batch(eng, 1.0, 0.0)])
    assert math.isfinite(stats["grad_norm"]) and stats["grad_norm"] > 0
    assert all(bool(torch.isfinite(p).all()) for p in eng.model.parameters()), (
        "an ordinary step made weights non-finite"
    )
    assert any(not torch.equal(p, before[n]) for n, p in eng.model.named_parameters()), (
        "an ordinary step moved nothing"
    )
