"""GAE with a value model: the pure functions against hand-worked values and a naive per-step loop
(values and gradients), the critic trained by the torch engine (value loss falls, explained
variance rises on a fixed batch; the policy trains on the critic's advantages), its checkpoint,
and the run config's checks. The fsdp engine's critic: tests/test_fsdp_critic.py."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from engines.algorithms import gae
from engines.algorithms.advantages import step_advantages
from engines.critic import CriticConfig
from engines.protocols import MicroBatch
from engines.tiny import build_tiny_model
from engines.torch_train import TorchTrainEngine
from producers.tasks import VOCAB
from schemas.config import RunConfig


def close(actual: torch.Tensor | None, expected: float | list[Any], atol: float = 1e-5) -> None:
    assert actual is not None  # a gradient the test expects to exist
    torch.testing.assert_close(
        actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0
    )


# ---- pure functions by hand ----------------------------------------------------------------


def test_outcome_rewards_sit_on_each_rows_last_loss_token() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    close(
        gae.outcome_rewards(torch.tensor([2.0, -1.0, 5.0]), mask),
        [[0, 0, 2, 0], [0, 0, 0, -1], [0, 0, 0, 0]],
    )


def test_gae_by_hand() -> None:
    # Row 0: prompt token then 3 response tokens, V = .5 .6 .7, R = 1, gamma .9, lambda .8:
    #   t3: delta = 1 - .7 = .3,                  A = .3
    #   t2: delta = .9 * .7 - .6 = .03,           A = .03 + .72 * .3 = .246
    #   t1: delta = .9 * .6 - .5 = .04,           A = .04 + .72 * .246 = .21712
    # Row 1: loss tokens at 0 and 2 only (position 1 is skipped: no TD error, no bootstrap), R = 2:
    #   t2: delta = 2 - .4 = 1.6,                 A = 1.6
    #   t0: delta = .9 * .4 - .2 = .16,           A = .16 + .72 * 1.6 = 1.312
    mask = torch.tensor([[0, 1, 1, 1], [1, 0, 1, 0]], dtype=torch.float32)
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7], [0.2, 5.0, 0.4, 7.0]])
    rewards = gae.outcome_rewards(torch.tensor([1.0, 2.0]), mask)
    adv, ret = gae.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0, 0.21712, 0.246, 0.3], [1.312, 0, 1.6, 0]])
    close(ret, [[0, 0.71712, 0.846, 1.0], [1.512, 0, 2.0, 0]])
    # gamma = lambda = 1: every token's advantage is R - V_t (Monte Carlo), its return R.
    adv, ret = gae.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    close(adv, [[0, 0.5, 0.4, 0.3], [1.8, 0, 1.6, 0]])
    close(ret, [[0, 1, 1, 1], [2, 0, 2, 0]])


def test_whitening_spans_every_micro_batch_of_the_step() -> None:
    # Loss tokens 1, 2 | 3 (99 is off the mask): mean 2, unbiased var 1.
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 99.0]])
    ma, mb = torch.ones(1, 2), torch.tensor([[1.0, 0.0]])
    got = gae.whiten_step([a, b], [ma, mb])
    close(got[0], [[-1.0, 0.0]])
    close(got[1], [[1.0, 0.0]])


def test_value_loss_by_hand() -> None:
    # eps .2. (V, V_old, R): (1.5, 1, 2): plain .25, clipped V 1.2 -> .64: loss .32, clipped,
    # no grad; (1.1, 1, 2): inside the range, .405; (.5, 1, 0): plain .25, clipped V .8 -> .64:
    # .32, clipped; (.5, 1, 2): plain 2.25 > clipped 1.44: 1.125 with gradient V - R = -1.5.
    values = torch.tensor([[1.5, 1.1, 0.5, 0.5]], requires_grad=True)
    old, returns = torch.tensor([[1.0, 1.0, 1.0, 1.0]]), torch.tensor([[2.0, 2.0, 0.0, 2.0]])
    terms = gae.value_loss(values, old, returns, clip=0.2)
    close(terms.loss, [[0.32, 0.405, 0.32, 1.125]])
    assert terms.clipped.tolist() == [[True, False, True, False]]
    terms.loss.sum().backward()
    close(values.grad, [[0.0, -0.9, 0.0, -1.5]])
    close(gae.value_loss(values, old, returns, clip=None).loss, [[0.125, 0.405, 0.125, 1.125]])


def test_explained_variance_by_hand() -> None:
    returns = torch.tensor([1.0, 2.0, 3.0])
    assert gae.explained_variance(returns.clone(), returns) == pytest.approx(1.0)
    assert gae.explained_variance(torch.full((3,), 2.0), returns) == pytest.approx(0.0)
    assert gae.explained_variance(torch.zeros(3), returns) == pytest.approx(
        0.0
    )  # Var(R - 0) = Var(R)
    assert gae.explained_variance(torch.full((3,), 2.0) - returns + 2.0, returns) == pytest.approx(
        -3.0
    )
    assert math.isnan(gae.explained_variance(torch.zeros(1), torch.ones(1)))


# ---- against a naive per-step loop on random tensors ---------------------------------------


def naive_gae(
    rewards: list[float], values: list[float], mask: list[float], gamma: float, lam: float
) -> list[float]:
    """Textbook GAE over the row's loss tokens only, one step at a time; 0 off the mask."""
    steps = [t for t, m in enumerate(mask) if m > 0]
    out = [0.0] * len(mask)
    running = 0.0
    for k in reversed(range(len(steps))):
        t = steps[k]
        next_value = values[steps[k + 1]] if k + 1 < len(steps) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        out[t] = running
    return out


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.7), (0.99, 1.0), (1.0, 0.0)])
def test_gae_matches_a_naive_loop(gamma: float, lam: float) -> None:
    gen = torch.Generator().manual_seed(7)
    mask = (torch.rand(5, 12, generator=gen) > 0.3).float()
    mask[3] = 0  # a row with no loss token
    values = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    rewards = (
        torch.randn(5, 12, generator=gen, dtype=torch.float64) * mask
    )  # dense per-token rewards too
    adv, ret = gae.gae_advantages(rewards, values, mask, gamma, lam)
    for row in range(5):
        want = naive_gae(
            rewards[row].tolist(), values[row].tolist(), mask[row].tolist(), gamma, lam
        )
        torch.testing.assert_close(adv[row], torch.tensor(want, dtype=torch.float64))
        torch.testing.assert_close(
            ret[row], (torch.tensor(want, dtype=torch.float64) + values[row]) * mask[row]
        )


def test_value_loss_matches_a_naive_loop_in_value_and_gradient() -> None:
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(4, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    old = values.detach() + 0.3 * torch.randn(4, 9, generator=gen, dtype=torch.float64)
    returns = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    got = gae.value_loss(values, old, returns, clip=0.2).loss
    (grad,) = torch.autograd.grad(got.sum(), values)
    for i in range(4):
        for t in range(9):
            v, vo, r = values[i, t].item(), old[i, t].item(), returns[i, t].item()
            vc = min(max(v, vo - 0.2), vo + 0.2)
            plain, clipped = (v - r) ** 2, (vc - r) ** 2
            assert got[i, t].item() == pytest.approx(0.5 * max(plain, clipped), abs=1e-12)
            # d/dV: (V - R) from the plain branch; the clipped one moves with V only inside the
            # range.
            slope = (v - r) if plain >= clipped else ((vc - r) if abs(v - vo) < 0.2 else 0.0)
            assert grad[i, t].item() == pytest.approx(slope, abs=1e-12)


def test_whitening_matches_the_concatenated_step() -> None:
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((3, 7), (2, 4))]
    masks = [(torch.rand(p.shape, generator=gen) > 0.4).double() for p in parts]
    flat = torch.cat([p[m > 0] for p, m in zip(parts, masks, strict=True)])
    want = (flat - flat.mean()) / (flat.var() + gae.WHITEN_EPS).sqrt()
    got = torch.cat([w[m > 0] for w, m in zip(gae.whiten_step(parts, masks), masks, strict=True)])
    torch.testing.assert_close(got, want)


def test_the_buffer_hands_gae_the_rewards() -> None:
    groups = [torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5, 2.0])]
    got = step_advantages("gae", groups)
    assert [g.tolist() for g in got] == [g.tolist() for g in groups]


# ---- the critic inside the torch engine ----------------------------------------------------

ROWS, WIDTH, RESPONSE = 4, 10, 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), VOCAB, seed=0)


def fixed_batch(eng: TorchTrainEngine) -> MicroBatch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, eng.model.config.vocab_size, (ROWS, WIDTH), generator=gen)  # type: ignore[union-attr, arg-type]
    attention = torch.ones(ROWS, WIDTH, dtype=torch.long)
    loss_mask = torch.zeros(ROWS, WIDTH)
    loss_mask[:, WIDTH - RESPONSE :] = 1
    behaviour = eng.logprobs(ids, attention) * loss_mask
    return MicroBatch(ids, attention, loss_mask, torch.tensor([1.0, 0.0, 1.0, 0.5]), behaviour)


def test_the_critic_learns_a_fixed_batch(model_dir: Path) -> None:
    eng = TorchTrainEngine(model_dir, lr=1e-3, critic=CriticConfig(lr=1e-2))
    batch = fixed_batch(eng)
    steps = [eng.train_step([batch]) for _ in range(12)]
    for name in (
        "value_loss",
        "value_clip_frac",
        "explained_variance",
        "value_mean",
        "return_mean",
    ):
        assert all(
            name in s and (math.isfinite(s[name]) or name == "explained_variance") for s in steps
        ), name
    # The head starts at zero: V = 0, so nothing of the returns' variance is explained.
    assert steps[0]["value_mean"] == 0.0 and steps[0]["explained_variance"] == pytest.approx(
        0.0, abs=1e-6
    )
    first, last = steps[0]["value_loss"], steps[-1]["value_loss"]
    assert last < 0.25 * first, [round(s["value_loss"], 4) for s in steps]
    assert steps[-1]["explained_variance"] > 0.5, [round(s["explained_variance"], 3) for s in steps]


def test_the_policy_trains_on_the_critics_whitened_gae(model_dir: Path) -> None:
    cfg = CriticConfig(lr=1e-2, gamma=0.9, lam=0.8)
    eng = TorchTrainEngine(model_dir, lr=1e-3, critic=cfg)
    batch = fixed_batch(eng)
    for _ in range(3):
        eng.train_step([batch])  # the critic's values move off zero
    assert eng.critic is not None
    with torch.no_grad():
        values = eng.critic.values(batch) * batch.loss_mask
    rewards = gae.outcome_rewards(batch.advantages, batch.loss_mask)
    adv, ret = gae.gae_advantages(rewards, values, batch.loss_mask, 0.9, 0.8)
    (want,) = gae.whiten_step([adv], [batch.loss_mask])
    (prepared,), (targets,), stats = eng.critic.prepare([batch], 1.0)
    assert values.abs().sum() > 0
    torch.testing.assert_close(prepared.advantages, want)
    torch.testing.assert_close(targets.returns, ret)
    torch.testing.assert_close(targets.old_values, values)
    assert stats["value_mean"] == pytest.approx(
        float(values.sum() / batch.loss_mask.sum()), rel=1e-5
    )


def test_the_policy_step_takes_the_gae_advantages_in_place_of_the_scores(model_dir: Path) -> None:
    # The head starts at zero, so the first step's advantages are whiten(GAE(R, V = 0)): a plain
    # engine given those [B, T] advantages must make the very same policy update.
    with_critic = TorchTrainEngine(
        model_dir, lr=1e-2, critic=CriticConfig(lr=1e-2, gamma=0.9, lam=0.8)
    )
    plain = TorchTrainEngine(model_dir, lr=1e-2)
    batch = fixed_batch(with_critic)
    rewards = gae.outcome_rewards(batch.advantages, batch.loss_mask)
    adv, _ = gae.gae_advantages(rewards, torch.zeros(ROWS, WIDTH), batch.loss_mask, 0.9, 0.8)
    (token_adv,) = gae.whiten_step([adv], [batch.loss_mask])
    with_critic.train_step([batch])
    plain.train_step([dataclasses.replace(batch, advantages=token_adv)])
    for (name, p), q in zip(
        with_critic.model.named_parameters(), plain.model.parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, msg=name)


def test_value_clipping_binds_over_several_updates_and_the_critic_updates_with_each(
    model_dir: Path,
) -> None:
    eng = TorchTrainEngine(
        model_dir, lr=1e-3, critic=CriticConfig(lr=5e-2, value_clip=0.01), ppo_epochs=4
    )
    before = {n: p.detach().clone() for n, p in eng.critic.model.named_parameters()}  # type: ignore[union-attr]
    stats = eng.train_step([fixed_batch(eng)])
    assert stats["updates"] == 4.0
    assert stats["value_clip_frac"] > 0, "from the second update on, V has moved past V_old +- 0.01"
    assert eng.critic is not None and eng.critic.optimizer.state_dict()["state"][0]["step"] == 4
    assert any(not torch.equal(before[n], p) for n, p in eng.critic.model.named_parameters())


def test_the_checkpoint_holds_the_critic_and_its_optimizer(model_dir: Path, tmp_path: Path) -> None:
    eng = TorchTrainEngine(model_dir, lr=1e-3, critic=CriticConfig(lr=1e-2))
    batch = fixed_batch(eng)
    eng.train_step([batch])
    eng.save_checkpoint(tmp_path / "ck.pt")
    want = eng.train_step([batch])
    fresh = TorchTrainEngine(model_dir, lr=1e-3, critic=CriticConfig(lr=1e-2))
    fresh.load_checkpoint(tmp_path / "ck.pt")
    got = fresh.train_step([batch])
    for name in ("loss", "value_loss", "explained_variance", "value_mean", "critic_grad_norm"):
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-7), name
    TorchTrainEngine(model_dir, lr=1e-3).save_checkpoint(tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="holds no critic"):
        fresh.load_checkpoint(tmp_path / "plain.pt")


# ---- the run config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"algorithm": {"advantage": "gae"}, "trainer": {"engine": "megatron"}},
            "gae needs trainer.engine torch or fsdp: the megatron engine holds no value model",
        ),
        ({"algorithm": {"gamma": 0.9}}, "algorithm.gamma applies to advantage gae, not grpo"),
        (
            {"algorithm": {"advantage": "rloo", "critic_lr": 1e-5}},
            "critic_lr applies to advantage gae",
        ),
        (
            {"algorithm": {"advantage": "gae", "overlong_filter": True}},
            "overlong_filter does not apply",
        ),
        ({"algorithm": {"advantage": "gae"}, "data": {"n": 1}}, "drop_equal_reward_groups false"),
        ({"algorithm": {"advantage": "gae", "gae_lambda": 1.5}}, "less than or equal to 1"),
        ({"algorithm": {"advantage": "gae", "value_clip": 0}}, "greater than 0"),
        ({"data": {"n": 1}}, "group-relative advantages need at least 2"),
    ],
)
def test_the_config_refuses_gae_where_it_cannot_run(config: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RunConfig.model_validate(config)


def test_the_config_builds_the_critic(model_dir: Path) -> None:
    from consumers.trainer_dist import critic_config

    cfg = RunConfig.model_validate(
        {
            "algorithm": {
                "advantage": "gae",
                "gamma": 0.99,
                "gae_lambda": 0.9,
                "value_clip": None,
                "critic_lr": 1e-5,
            },
        }
    )
    assert critic_config(cfg) == CriticConfig(lr=1e-5, gamma=0.99, lam=0.9, value_clip=None)
    gae_critic = critic_config(
        RunConfig.model_validate({"algorithm": {"advantage": "gae", "lr": 2e-4}})
    )
    assert gae_critic is not None and gae_critic.lr == 2e-4
    assert critic_config(RunConfig.model_validate({})) is None
    one = RunConfig.model_validate(
        {"algorithm": {"advantage": "gae", "drop_equal_reward_groups": False}, "data": {"n": 1}}
    )
    assert one.data.n == 1


@pytest.mark.parametrize("engine", ["torch", "fsdp"])
def test_the_config_takes_gae_with_the_torch_and_fsdp_engines(engine: str) -> None:
    cfg = RunConfig.model_validate(
        {"algorithm": {"advantage": "gae"}, "trainer": {"engine": engine}}
    )
    assert cfg.algorithm.advantage == "gae" and cfg.trainer.engine.type == engine


def test_the_megatron_engine_refuses_a_critic(model_dir: Path) -> None:
    # The fsdp engine holds one (tests/test_fsdp_critic.py).
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from engines.megatron_train import MegatronTrainEngine

    with pytest.raises(
        ValueError, match="megatron engine: algorithm.advantage gae needs a value model"
    ):
        MegatronTrainEngine(model_dir, lr=1e-3, critic=CriticConfig(lr=1e-3))
