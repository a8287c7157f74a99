"""The algorithm family inside the torch train engine, on the tiny model: several updates per
step against a recomputed proximal policy, the frozen reference of the KL term, the entropy
bonus's gradient, and the LR schedule and weight decay the run config names."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from consumers.trainer_dist import configured_engine
from consumers.trainer_steps import loss_config
from engines.protocols import MicroBatch
from engines.torch_train import LossConfig, TorchTrainEngine
from schemas.config import RunConfig

ROWS, WIDTH, RESPONSE = 4, 10, 6


def batch(
    eng: TorchTrainEngine, advantage: float, seed: int = 0, log_ratio: float = 0.0
) -> MicroBatch:
    """ROWS rows of random tokens, behaviour log-probs `log_ratio` below the engine's current
    ones."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, eng.model.config.vocab_size, (ROWS, WIDTH), generator=gen)  # type: ignore[union-attr, arg-type]
    attention_mask = torch.ones(ROWS, WIDTH, dtype=torch.long)
    loss_mask = torch.zeros(ROWS, WIDTH)
    loss_mask[:, WIDTH - RESPONSE :] = 1
    behaviour = (eng.logprobs(input_ids, attention_mask) - log_ratio) * loss_mask
    advantages = torch.full((ROWS,), advantage) * torch.tensor([1.0, -1.0, 1.0, -1.0])
    return MicroBatch(input_ids, attention_mask, loss_mask, advantages, behaviour)


def weights(eng: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in eng.model.named_parameters()}


def test_more_updates_per_step_take_the_ratio_against_the_recomputed_proximal_policy(
    model_dir: Path,
) -> None:
    loss = LossConfig(tis_cap=5.0)
    one = TorchTrainEngine(model_dir, lr=5e-2, loss=loss)
    stats = one.train_step([batch(one, 1.0)])
    # One update: the proximal policy is the current one, the ratio is exactly 1.
    assert stats["updates"] == 1.0 and stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    three = TorchTrainEngine(model_dir, lr=5e-2, loss=loss, ppo_epochs=3)
    stats = three.train_step([batch(three, 1.0)])
    assert stats["updates"] == 3.0 and stats["step"] == 1.0, (
        "three updates are still one step (one version)"
    )
    # Updates 2 and 3 see weights the first moved: their ratio against the proximal policy
    # (recomputed before update 1, not the current weights) is no longer 1, and some clip.
    assert abs(stats["ratio_mean"] - 1.0) > 1e-3, (
        f"ratio_mean {stats['ratio_mean']}: the proximal policy moved along"
    )
    assert stats["clip_frac"] > 0
    assert stats["tokens"] == ROWS * RESPONSE, (
        "tokens count the step's tokens once, not once per epoch"
    )


def test_mini_batches_are_one_update_each(model_dir: Path) -> None:
    # Two mini-batches of one micro-batch each = two steps of one micro-batch each (plain PPO
    # against the behaviour policy, constant lr): the same weights at the end.
    split = TorchTrainEngine(model_dir, lr=1e-2, ppo_mini_batches=2)
    first, second = batch(split, 1.0, seed=1), batch(split, 1.0, seed=2)
    assert split.train_step([first, second])["updates"] == 2.0
    stepwise = TorchTrainEngine(model_dir, lr=1e-2)
    stepwise.train_step([first])
    stepwise.train_step([second])
    after, want = weights(split), weights(stepwise)
    assert all(torch.allclose(after[n], want[n], atol=1e-6) for n in want), (
        "a mini-batch is not an update of its own"
    )
    whole = TorchTrainEngine(model_dir, lr=1e-2)
    whole.train_step([first, second])
    assert any(not torch.allclose(weights(whole)[n], want[n], atol=1e-6) for n in want)


def test_the_kl_term_is_taken_against_the_frozen_initial_weights(model_dir: Path) -> None:
    eng = TorchTrainEngine(model_dir, lr=5e-2, loss=LossConfig(kl_coef=0.1, kl_estimator="k1"))
    assert eng.reference is not None
    frozen = {n: p.detach().clone() for n, p in eng.reference.named_parameters()}
    first = eng.train_step([batch(eng, 1.0)])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6), (
        "before any update the policy is the reference"
    )
    eng.train_step([batch(eng, 1.0, seed=1)])
    third = eng.train_step([batch(eng, 1.0, seed=2)])
    assert abs(third["kl"]) > 1e-4, "the policy moved but its KL to the reference did not"
    assert all(torch.equal(p, frozen[n]) for n, p in eng.reference.named_parameters()), (
        "the reference moved"
    )
    assert TorchTrainEngine(model_dir, lr=1e-2).reference is None, "no KL term, no reference copy"


@pytest.mark.parametrize("chunk", [0, 1024], ids=["full-logits", "chunked"])
def test_the_entropy_bonus_has_a_gradient(model_dir: Path, chunk: int) -> None:
    # Advantage 0: the policy loss has no gradient, so whatever moves the weights is the bonus.
    plain = TorchTrainEngine(model_dir, lr=1e-2, logprob_chunk_tokens=chunk)
    assert plain.train_step([batch(plain, 0.0)])["grad_norm"] == 0.0
    bonus = TorchTrainEngine(
        model_dir, lr=1e-2, logprob_chunk_tokens=chunk, loss=LossConfig(entropy_coef=0.5)
    )
    before = bonus.train_step([batch(bonus, 0.0)])
    assert before["grad_norm"] > 0, "the entropy bonus reached no weight"
    for seed in range(1, 4):
        after = bonus.train_step([batch(bonus, 0.0, seed=seed)])
    assert after["entropy"] > before["entropy"], "minimising -coef * H did not raise the entropy"


def test_the_run_config_sets_the_lr_schedule_weight_decay_and_updates(model_dir: Path) -> None:
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "trainer": {"steps": 6},
            "algorithm": {
                "lr": 0.01,
                "weight_decay": 0.03,
                "lr_warmup_steps": 2,
                "lr_schedule": "cosine",
                "lr_min_ratio": 0.1,
                "ppo_epochs": 2,
                "ppo_mini_batches": 3,
            },
        }
    )
    eng = configured_engine(cfg, loss_config(cfg), torch.device("cpu"))
    assert isinstance(eng, TorchTrainEngine)
    assert eng.optimizer.param_groups[0]["weight_decay"] == 0.03
    assert (eng.ppo_epochs, eng.ppo_mini_batches) == (2, 3)
    lrs = [eng.train_step([batch(eng, 1.0, seed=s)])["lr"] for s in range(4)]
    # warmup .5, 1; cosine over steps 2..6: p = 0, .25.
    assert lrs == pytest.approx(
        [0.005, 0.01, 0.01, 0.001 + 0.009 * (1 + math.cos(math.pi / 4)) / 2]
    )
    assert eng.optimizer.param_groups[0]["lr"] == pytest.approx(lrs[-1])


def test_loss_config_decoupled_by_any_correction() -> None:
    assert not LossConfig().decoupled
    for name, value in (
        ("tis_cap", 2.0),
        ("is_mask_low", 0.5),
        ("is_mask_high", 2.0),
        ("reject_log_ratio", 1.0),
    ):
        assert dataclasses.replace(LossConfig(), **{name: value}).decoupled, name  # type: ignore[arg-type]  # float fields


def test_rejected_sequences_train_nothing_and_are_counted_once_per_step(model_dir: Path) -> None:
    # Every token's behaviour log-prob is 1 below the policy's: |log ratio| 1 > .5 on all rows.
    eng = TorchTrainEngine(model_dir, lr=1e-2, loss=LossConfig(reject_log_ratio=0.5), ppo_epochs=2)
    before = weights(eng)
    stats = eng.train_step([batch(eng, 1.0, log_ratio=1.0)])
    assert stats["is_rejected"] == ROWS, (
        f"{stats['is_rejected']} sequences rejected, not each of the {ROWS} once"
    )
    assert stats["is_weight_mean"] == 0.0 and stats["grad_norm"] == 0.0
    assert stats["logprob_gap"] == pytest.approx(1.0, abs=1e-5)
    assert all(torch.equal(p, before[n]) for n, p in eng.model.named_parameters()), (
        "a rejected batch moved weights"
    )
    kept = TorchTrainEngine(model_dir, lr=1e-2, loss=LossConfig(reject_log_ratio=1.5))
    assert kept.train_step([batch(kept, 1.0, log_ratio=1.0)])["is_rejected"] == 0.0
