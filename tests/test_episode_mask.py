"""A multi-turn episode's environment tokens carry no gradient, through the real trainer.

A batch event whose loss mask is 0 at some response positions (a tool result, the next turn's
header: `TrajectoryEvent.response_mask` packed by `consumers.packing`) goes through the
trainer's own conversion (`consumers.trainer_steps.micro_batch`) into the real `TorchTrainEngine` on
the tiny model, for each policy loss with every term on (decoupled IS weight, entropy bonus, KL
to the reference log-probs the batch brings):
(a) whatever the behaviour log-probs, reference log-probs and versions hold at those positions,
    the loss and every parameter's gradient are bit for bit the same;
(b) the gradient of the loss with respect to the logits predicting those tokens is exactly 0
    (and not at the trained ones);
(c) token-mean aggregation divides by the trained tokens only.
And the objective itself (`token_objective`) stays finite where an environment token is very
improbable, which a mask applied only after the fact (inf x 0) would not.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch

from consumers.trainer_steps import micro_batch
from engines.algorithms.losses import aggregate
from engines.algorithms.objective import token_objective
from engines.torch_train import LossConfig, TorchTrainEngine
from schemas import BatchEvent, Tensor

PROMPT = 3
MASKS = ([1, 1, 0, 0, 1], [1, 1, 1, 1])
"""Row 0: an episode (two model tokens, two environment tokens, one model token); row 1: a
single turn of four tokens, then one position of padding."""
WIDTH = PROMPT + 5
ENV = [(0, PROMPT + 2), (0, PROMPT + 3)]
"""(row, position) of the environment tokens."""
LOSSES = {
    "ppo": LossConfig(
        tis_cap=2.0, entropy_coef=0.01, kl_coef=0.1, aggregation="token-mean", dual_clip_c=3.0
    ),
    "gspo": LossConfig(
        policy_loss="gspo",
        tis_cap=2.0,
        entropy_coef=0.01,
        kl_coef=0.1,
        aggregation="seq-mean-token-mean",
    ),
    "cispo": LossConfig(
        policy_loss="cispo",
        is_level="sequence",
        tis_cap=2.0,
        entropy_coef=0.01,
        kl_coef=0.1,
        aggregation="token-sum",
    ),
}


class Recording(TorchTrainEngine):
    """The real engine, keeping the logits of its last forward with a gradient (full-logits
    path), so the test can read the loss's gradient with respect to them."""

    logits: torch.Tensor | None = None

    def _token_logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        model: torch.nn.Module | None = None,
    ) -> torch.Tensor:
        logits = super()._token_logits(input_ids, attention_mask, model)
        if logits.requires_grad:
            logits.retain_grad()
            self.logits = logits
        return logits


def engine(model_dir: Path, loss: LossConfig) -> Recording:
    return Recording(model_dir, lr=1e-2, loss=loss, logprob_chunk_tokens=0, own_reference=False)


def batch(env_behaviour: float, env_ref: float, env_version: int) -> BatchEvent:
    """The two rows as the buffer would publish them, with these values at the environment
    tokens (whatever a writer put there: the schema holds an event's to 0.0 and -1)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 15, (2, WIDTH)).astype(np.int32)
    attention = np.ones((2, WIDTH), np.uint8)
    attention[1, -1] = 0
    loss = np.zeros((2, WIDTH), np.uint8)
    for row, mask in enumerate(MASKS):
        loss[row, PROMPT : PROMPT + len(mask)] = mask
    behaviour = np.where(loss == 1, -rng.uniform(0.5, 3.0, (2, WIDTH)), 0.0).astype(np.float32)
    ref = np.where(loss == 1, -rng.uniform(0.5, 3.0, (2, WIDTH)), 0.0).astype(np.float32)
    versions = np.where(loss == 1, 2, -1).astype(np.int32)
    for row, position in ENV:
        behaviour[row, position], ref[row, position] = env_behaviour, env_ref
        versions[row, position] = env_version
    return BatchEvent(
        id="e/step/3/0/0",
        run="e",
        step=3,
        dp_rank=0,
        dp_size=1,
        micro_index=0,
        micro_count=1,
        input_ids=Tensor.from_numpy(ids),
        attention_mask=Tensor.from_numpy(attention),
        loss_mask=Tensor.from_numpy(loss),
        advantages=Tensor.from_numpy(np.array([1.0, -0.5], np.float32)),
        behaviour_logprobs=Tensor.from_numpy(behaviour),
        versions=Tensor.from_numpy(versions),
        rewards=Tensor.from_numpy(np.array([1.0, 0.0], np.float32)),
        sample_ids=("e/0/0/0", "e/0/0/1"),
        ref_logprobs=Tensor.from_numpy(ref),
    )


def trained(model_dir: Path, loss: LossConfig, event: BatchEvent) -> tuple[Recording, dict]:
    eng = engine(model_dir, loss)
    return eng, eng.train_step([micro_batch(event)])


def gradients(eng: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in eng.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_environment_tokens_change_neither_loss_nor_gradient(model_dir: Path, name: str) -> None:
    loss = LOSSES[name]
    base, base_stats = trained(model_dir, loss, batch(0.0, 0.0, -1))
    want = gradients(base)
    assert want and any(g.abs().sum() > 0 for g in want.values())
    # Values no writer should put there (the schema refuses them on a trajectory), yet valid
    # in a batch event: the trainer must not read them.
    for values in [(-7.0, -60.0, 0), (-0.01, -0.01, 3)]:
        other, stats = trained(model_dir, loss, batch(*values))
        assert stats["loss"] == base_stats["loss"], (name, values)
        got = gradients(other)
        assert got.keys() == want.keys()
        changed = [k for k in want if not torch.equal(got[k], want[k])]
        assert not changed, f"{name} {values}: gradients of {changed[:3]} changed"


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_logits_of_environment_tokens_get_no_gradient(model_dir: Path, name: str) -> None:
    eng, _ = trained(model_dir, LOSSES[name], batch(-7.0, -60.0, 0))
    assert eng.logits is not None and eng.logits.grad is not None
    grad = eng.logits.grad  # [B, T - 1, V]: index t - 1 predicts token t
    for row, position in ENV:
        assert torch.count_nonzero(grad[row, position - 1]) == 0, (name, row, position)
    # Nor the prompt's, nor padding's; every trained token's does.
    assert torch.count_nonzero(grad[:, : PROMPT - 1]) == 0
    assert torch.count_nonzero(grad[1, -1]) == 0
    for row, mask in enumerate(MASKS):
        for offset, on in enumerate(mask):
            if on:
                assert torch.count_nonzero(grad[row, PROMPT + offset - 1]) > 0, (row, offset)


def test_token_mean_divides_by_the_trained_tokens_only(model_dir: Path) -> None:
    loss = LossConfig(aggregation="token-mean")
    event = batch(-7.0, -60.0, 0)
    _, stats = trained(model_dir, loss, event)
    trained_tokens = sum(sum(mask) for mask in MASKS)  # 7 of the 9 response tokens
    assert stats["tokens"] == trained_tokens
    # The loss is the mean per-token loss over those 7: the same engine's objective, summed on
    # the mask, over 7 (fresh weights: `trained` stepped its own).
    fresh = engine(model_dir, loss)
    mb = micro_batch(event)
    objective = fresh._objective(mb, None)
    per_token = objective.loss.detach()
    on = mb.loss_mask > 0
    assert stats["loss"] == pytest.approx(float(per_token[on].sum()) / trained_tokens, rel=1e-6)
    assert stats["loss"] != pytest.approx(float(per_token[on].sum()) / 9, rel=1e-3)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_an_improbable_environment_token_keeps_the_objective_finite(
    estimator: Literal["k1", "k2", "k3"],
) -> None:
    """A tool result the policy finds very improbable (log-prob -200) where the batch holds 0.0
    for the behaviour and reference log-probs: every term there must stay finite, with a 0
    gradient, not an overflow that the mask turns into NaN."""
    logprobs = torch.tensor([[-1.0, -200.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    cfg = LossConfig(kl_coef=0.5, kl_estimator=estimator, tis_cap=2.0, is_level="sequence")
    objective = token_objective(
        cfg,
        logprobs,
        torch.tensor([[-1.2, 0.0, -0.4]]),
        torch.tensor([1.0]),
        mask,
        proximal=torch.tensor([[-1.1, 0.0, -0.45]]),
        ref_logprobs=torch.tensor([[-0.9, 0.0, -0.6]]),
    )
    total = aggregate(objective.loss, mask, cfg.aggregation)
    total.backward()
    assert math.isfinite(total.item()), f"{estimator}: loss {total.item()}"
    assert logprobs.grad is not None and logprobs.grad[0, 1].item() == 0.0
    assert torch.isfinite(logprobs.grad).all()
    assert torch.isfinite(objective.loss).all()
