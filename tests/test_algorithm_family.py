"""The issue-14 family: each function against hand-worked values on a tiny example and against a
naive (loop-by-loop) reference on random tensors, values and gradients."""

import itertools
import math
from typing import Any

import pytest
import torch

from engines.algorithms import (
    advantages,
    correction,
    losses,
    objective,
    schedule,
    shaping,
)


def close(actual: torch.Tensor | None, expected: float | list[Any], atol: float = 1e-5) -> None:
    assert actual is not None  # a gradient the test expects to exist
    torch.testing.assert_close(
        actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0
    )


# ---- advantages --------------------------------------------------------------------------

GROUP = torch.tensor([0.0, 0.0, 0.0, 1.0])


def test_reinforce_pp_whitens_over_the_whole_step() -> None:
    # [0, 1, 0, 0]: mean .25, unbiased var (3 * .0625 + .5625) / 3 = .25, std .5.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    close(advantages.reinforce_pp(rewards), [[-0.5, 1.5], [-0.5, -0.5]])
    # An all-equal group still gets a signal: how its prompt did against the step.
    assert advantages.reinforce_pp(rewards)[1].abs().sum() > 0


def test_step_advantages_whiten_over_the_step_and_group_estimators_stay_per_group() -> None:
    a, b = torch.tensor([0.0, 2.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])
    # reinforce_pp_baseline: centred [-1, 1 | -.75, .25, .25, .25]; mean 0, sum sq 2.75, unbiased
    # var 2.75 / 5 = .55, std .741620 (the raw rewards' std would be .752773; GRPO on b alone
    # divides by .5).
    got = advantages.step_advantages("reinforce_pp_baseline", [a, b])
    close(torch.cat(got), [-1.348400, 1.348400, -1.011300, 0.337100, 0.337100, 0.337100])
    # On one group alone the baseline variant is GRPO; over a step it is not.
    close(advantages.step_advantages("reinforce_pp_baseline", [b])[0], advantages.grpo(b).tolist())
    assert not torch.allclose(got[1], advantages.grpo(b))
    # reinforce_pp over ragged groups = reinforce_pp of the concatenation.
    flat = torch.cat([a, b])
    close(
        torch.cat(advantages.step_advantages("reinforce_pp", [a, b])),
        advantages.reinforce_pp(flat).tolist(),
    )
    close(advantages.step_advantages("rloo", [a, b])[1], advantages.rloo(b).tolist())
    with pytest.raises(ValueError, match="unknown advantage"):
        advantages.step_advantages("nope", [a])


def test_passk_by_hand() -> None:
    # G = 4, one correct, k = 2: R = 1 - C(3,2)/C(4,2) = .5, s = .5;
    # correct: (1 - .5)/.5 = 1; wrong: (1 - .5 - C(2,1)/C(3,1)) / .5 = (.5 - 2/3) / .5 = -1/3.
    close(advantages.passk(GROUP, 2), [-1 / 3, -1 / 3, -1 / 3, 1.0])
    # k = 1 is GRPO with the population std: r = [0,0,0,1], std .4330127 -> -.25/.433 = -.57735.
    close(advantages.passk(GROUP, 1), [-0.577350, -0.577350, -0.577350, 1.732051])
    # All correct, or every pair holding a correct one (3 of 4 correct, k = 2... C(1,2) = 0): zeros.
    close(advantages.passk(torch.tensor([1.0, 1.0, 1.0, 0.0]), 2), [0.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="0 or 1"):
        advantages.passk(torch.tensor([0.5, 1.0]), 1)
    with pytest.raises(ValueError, match="k <= group"):
        advantages.passk(GROUP, 5)


def naive_passk(rewards: list[float], k: int) -> list[float]:
    """Enumerate every k-subset: its reward is its max; a sample's advantage is the mean over the
    subsets holding it minus the mean over all, over the std of the subsets' rewards."""
    subsets = list(itertools.combinations(range(len(rewards)), k))
    value = {s: max(rewards[i] for i in s) for s in subsets}
    mean = sum(value.values()) / len(subsets)
    std = math.sqrt(sum((v - mean) ** 2 for v in value.values()) / len(subsets))
    if std < 1e-6:
        return [0.0] * len(rewards)
    return [
        (sum(value[s] for s in subsets if i in s) / sum(1 for s in subsets if i in s) - mean) / std
        for i in range(len(rewards))
    ]


def test_passk_matches_enumerating_every_subset() -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        g = int(torch.randint(2, 9, (1,), generator=gen))
        k = int(torch.randint(1, g + 1, (1,), generator=gen))
        r = (torch.rand(g, generator=gen) < 0.4).float()
        close(advantages.passk(r, k), naive_passk(r.tolist(), k), atol=1e-4)


def test_overlong_penalty_by_hand() -> None:
    # L = 16, C = 4: free up to 12, then -(len - 12) / 4, -1 from 16 on.
    close(
        shaping.overlong_penalty(torch.tensor([3, 12, 14, 16, 20]), 16, 4),
        [0.0, 0.0, -0.5, -1.0, -1.0],
    )
    close(shaping.overlong_penalty(torch.tensor([13]), 16, 4, penalty=2.0), [-0.5])


# ---- policy losses -----------------------------------------------------------------------


def test_dual_clip_bounds_the_loss_of_a_negative_advantage() -> None:
    # A = -1, eps .2/.28, c = 3. ratio 5: PPO loss = -min(-5, -1.28) = 5 > 3 -> 3 (dual, no grad).
    # ratio 2: loss 2 < 3 unchanged; ratio .5: clipped at .8 -> -min(-.5, -.8) = .8, low clip.
    # A = +1 at ratio 5: 1.28 (clip high), dual-clip does not touch A > 0.
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[5.0, 2.0, 0.5, 5.0]])).requires_grad_()
    adv = torch.tensor([-1.0])
    out = losses.ppo_clip_loss(logp[:, :3], old[:, :3], adv, dual_clip_c=3.0)
    close(out.loss, [[3.0, 2.0, 0.8]])
    assert out.dual_clipped is not None and out.dual_clipped.tolist() == [[True, False, False]]
    out.loss.sum().backward()
    assert logp.grad is not None
    close(logp.grad[:, :3], [[0.0, 2.0, 0.0]])  # d(-A r)/dlogp = -A r = 2 at ratio 2
    pos = losses.ppo_clip_loss(
        logp[:, 3:].detach(), old[:, 3:], torch.tensor([1.0]), dual_clip_c=3.0
    )
    close(pos.loss, [[-1.28]])
    # Without dual-clip the first token's loss is 5.
    close(losses.ppo_clip_loss(logp[:, :1].detach(), old[:, :1], adv).loss, [[5.0]])


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    # ratio [2, 1, .5], A = 1, eps .2/.28: weight [1.28, 1, .8]; loss = -w A logp; grad = -w A.
    logp = torch.log(torch.tensor([[2.0, 1.0, 0.5]])).requires_grad_()
    out = losses.cispo_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]))
    close(out.loss, [[-1.28 * math.log(2.0), 0.0, -0.8 * math.log(0.5)]])
    assert out.clipped.tolist() == [[True, False, True]]
    out.loss.sum().backward()
    assert logp.grad is not None
    close(logp.grad, [[-1.28, -1.0, -0.8]])


def naive_ppo(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, lo: float, hi: float, c: float
) -> torch.Tensor:
    """Token by token, as the dual-clip paper writes it."""
    rows = []
    for b in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            r = torch.exp(logp[b, t] - old[b, t])
            a = adv[b]
            surrogate = torch.min(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)
            if a < 0:
                surrogate = torch.max(surrogate, c * a)
            row.append(-surrogate)
        rows.append(torch.stack(row))
    return torch.stack(rows)


def naive_cispo(
    logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, lo: float, hi: float
) -> torch.Tensor:
    rows = []
    for b in range(logp.shape[0]):
        rows.append(
            torch.stack(
                [
                    -torch.clamp(torch.exp(logp[b, t] - old[b, t]), 1 - lo, 1 + hi).detach()
                    * adv[b]
                    * logp[b, t]
                    for t in range(logp.shape[1])
                ]
            )
        )
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["ppo_dual", "cispo"])
def test_losses_match_a_naive_reference_in_value_and_gradient(kind: str) -> None:
    gen = torch.Generator().manual_seed(7)
    logp0 = -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 3
    old = logp0 + torch.randn(5, 6, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(5, generator=gen, dtype=torch.float64)
    mine, ref = logp0.clone().requires_grad_(), logp0.clone().requires_grad_()
    if kind == "ppo_dual":
        got = losses.ppo_clip_loss(mine, old, adv, eps_low=0.2, eps_high=0.3, dual_clip_c=2.0).loss
        want = naive_ppo(ref, old, adv, 0.2, 0.3, 2.0)
    else:
        got = losses.cispo_loss(mine, old, adv, eps_low=0.2, eps_high=0.3).loss
        want = naive_cispo(ref, old, adv, 0.2, 0.3)
    torch.testing.assert_close(got, want)
    weights = torch.rand(5, 6, generator=gen, dtype=torch.float64)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert mine.grad is not None and ref.grad is not None
    torch.testing.assert_close(mine.grad, ref.grad)


# ---- aggregation -------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor(
    [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
)  # row 3 empty: not a sequence


def test_token_sum_and_seq_mean_token_sum_norm() -> None:
    assert losses.aggregation_count(MASK, "token-sum") == 1
    close(losses.aggregate(LOSS, MASK, "token-sum"), 7.0)
    # ((1 + 2) / 4 + 4 / 4) / 2 sequences (the empty row not counted) = .875
    assert losses.aggregation_count(MASK, "seq-mean-token-sum-norm") == 2
    close(losses.aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm_tokens=4), 0.875)
    close(losses.aggregate(LOSS, MASK, "seq-mean-token-sum-norm"), 7 / 3 / 2)  # default T = 3


def naive_aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm: int) -> float:
    seqs = [
        [float(loss[b, t]) for t in range(loss.shape[1]) if mask[b, t]]
        for b in range(loss.shape[0])
    ]
    seqs = [s for s in seqs if s]  # verl: a row without a loss token is no sequence
    tokens = [x for s in seqs for x in s]
    return {
        "token-mean": sum(tokens) / len(tokens),
        "token-sum": sum(tokens),
        "seq-mean-token-sum": sum(sum(s) for s in seqs) / len(seqs),
        "seq-mean-token-mean": sum(sum(s) / len(s) for s in seqs) / len(seqs),
        "seq-mean-token-sum-norm": sum(sum(s) / norm for s in seqs) / len(seqs),
    }[mode]


@pytest.mark.parametrize("mode", list(losses.AggregationMode.__args__))  # type: ignore[attr-defined]
def test_every_aggregation_mode_matches_a_naive_reference(mode: losses.AggregationMode) -> None:
    gen = torch.Generator().manual_seed(11)
    loss = torch.randn(6, 7, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 7, generator=gen) < 0.6).double()
    mask[2] = 0  # an empty row
    assert math.isclose(
        float(losses.aggregate(loss, mask, mode, norm_tokens=9)),
        naive_aggregate(loss, mask, mode, 9),
        rel_tol=1e-9,
    )


# ---- importance weights ------------------------------------------------------------------


def test_is_weights_token_and_sequence_level_by_hand() -> None:
    # r = [2, 1, .5 | 4, .25, (pad)] per token (proximal 0, behaviour -log r).
    r = torch.tensor([[2.0, 1.0, 0.5], [4.0, 0.25, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    prox, beh = torch.zeros(2, 3), -torch.log(r)
    w = correction.is_weights(prox, beh, mask, cap=3.0)
    close(w.weight * mask, [[2.0, 1.0, 0.5], [3.0, 0.25, 0.0]])
    # Masked IS: outside [.4, 3] -> 0 (the 4 and the .25).
    w = correction.is_weights(prox, beh, mask, mask_low=0.4, mask_high=3.0)
    close(w.weight * mask, [[2.0, 1.0, 0.5], [0.0, 0.0, 0.0]])
    assert w.masked.tolist() == [[False, False, False], [True, True, False]]
    # Sequence level: products 2 * 1 * .5 = 1 and 4 * .25 = 1 (the pad ignored).
    w = correction.is_weights(prox, beh, mask, level="sequence", cap=3.0)
    close(w.weight * mask, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # Both sequences' r = 1 < 2: masked on every loss token, never on padding.
    w = correction.is_weights(prox, beh, mask, level="sequence", mask_low=0.5, mask_high=0.9)
    assert w.masked.tolist() == mask.bool().tolist()
    # Rejection: |log 4| = 1.386 > 1 -> the whole of row 2 is 0; row 1's max |log 2| = .69 stays.
    w = correction.is_weights(prox, beh, mask, reject_log_ratio=1.0)
    assert w.rejected.tolist() == [False, True]
    close(w.weight * mask, [[2.0, 1.0, 0.5], [0.0, 0.0, 0.0]])


def test_is_weights_match_a_naive_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    prox = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 2
    beh = prox + torch.randn(4, 5, generator=gen, dtype=torch.float64) * 0.7
    mask = (torch.rand(4, 5, generator=gen) < 0.8).double()
    for level in ("token", "sequence"):
        got = correction.is_weights(
            prox, beh, mask, level=level, cap=2.0, mask_low=0.3, mask_high=1.8, reject_log_ratio=1.5
        ).weight
        for b in range(4):
            ratios = [math.exp(prox[b, t] - beh[b, t]) for t in range(5)]
            seq = math.prod(x for x, m in zip(ratios, mask[b], strict=True) if m)
            reject = (
                max((abs(prox[b, t] - beh[b, t]) for t in range(5) if mask[b, t]), default=0.0)
                > 1.5
            )
            for t in range(5):
                if not mask[b, t]:
                    continue
                raw = ratios[t] if level == "token" else seq
                want = 0.0 if reject or raw < 0.3 or raw > 1.8 else min(raw, 2.0)
                assert math.isclose(float(got[b, t]), want, rel_tol=1e-9, abs_tol=1e-12), (
                    level,
                    b,
                    t,
                )


# ---- the whole objective -----------------------------------------------------------------


def test_objective_adds_the_entropy_bonus_and_the_kl_term() -> None:
    # On-policy (ratio 1), A = 1, one token: PPO loss -1; entropy .5, coef .1 -> -.05;
    # k1 = logp - ref = -1 - (-1.5) = .5, coef .2 -> +.1. Total -1 - .05 + .1 = -.95.
    logp = torch.tensor([[-1.0]], requires_grad=True)
    ent = torch.tensor([[0.5]], requires_grad=True)
    cfg = objective.LossConfig(entropy_coef=0.1, kl_coef=0.2, kl_estimator="k1")
    out = objective.token_objective(
        cfg,
        logp,
        logp.detach(),
        torch.tensor([1.0]),
        torch.ones(1, 1),
        entropy=ent,
        ref_logprobs=torch.tensor([[-1.5]]),
    )
    close(out.loss, [[-0.95]])
    out.loss.sum().backward()
    assert ent.grad is not None and logp.grad is not None
    close(ent.grad, [[-0.1]])
    close(logp.grad, [[-1.0 + 0.2]])  # d(-r A)/dlogp = -1; d(.2 k1)/dlogp = .2
    assert out.sums["kl"] == pytest.approx(0.5) and out.sums["entropy"] == pytest.approx(0.5)


def test_objective_decoupled_takes_the_ratio_against_the_proximal_policy() -> None:
    # logp = log .5, proximal log .25 (ratio 2, clipped high at 1.28 for A = 1), behaviour log .5
    # (IS weight .25 / .5 = .5): loss = -.5 * 1.28 = -.64; clip_high counted, not clip_low.
    logp = torch.log(torch.tensor([[0.5]]))
    cfg = objective.LossConfig(tis_cap=2.0)
    out = objective.token_objective(
        cfg,
        logp,
        torch.log(torch.tensor([[0.5]])),
        torch.tensor([1.0]),
        torch.ones(1, 1),
        proximal=torch.log(torch.tensor([[0.25]])),
    )
    close(out.loss, [[-0.64]])
    assert out.sums["clipped_high"] == 1.0 and out.sums["clipped_low"] == 0.0
    assert out.sums["is_weight"] == pytest.approx(0.5)
    assert out.sums["logprob_gap"] == pytest.approx(0.0)


# ---- learning-rate schedule --------------------------------------------------------------


def test_lr_warmup_then_cosine_by_hand() -> None:
    f = [
        schedule.lr_factor(s, warmup=2, total=6, schedule="cosine", min_ratio=0.1) for s in range(8)
    ]
    # warmup 1/2, 2/2; then p = 0, .25, .5, .75, 1, 1: .1 + .9 (1 + cos(pi p)) / 2.
    expected = [
        0.5,
        1.0,
        1.0,
        0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2,
        0.55,
        0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2,
        0.1,
        0.1,
    ]
    assert f == pytest.approx(expected)
    assert schedule.lr_factor(5, warmup=0, schedule="constant") == 1.0


# ---- the config names each option, and refuses what cannot run ---------------------------


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"advantage": "passk", "passk_k": 9}, "passk_k 9 > data.n 8"),
        ({"overlong_buffer_tokens": 16}, "must be below data.sampling.max_tokens 16"),
        ({"policy_loss": "gspo", "dual_clip_c": 3.0}, "dual_clip_c applies to policy_loss ppo"),
        ({"advantage": "passk", "overlong_buffer_tokens": 4}, "passk takes 0/1 rewards"),
        ({"advantage": "reinforce"}, "reinforce_pp_baseline"),
        ({"loss_aggregation": "seq-sum"}, "seq-mean-token-sum-norm"),
        ({"dual_clip_c": 1.0}, "greater than 1"),
        ({"is_mask_low": 1.5}, "less than 1"),
        ({"ppo_epoch": 2}, "Extra inputs are not permitted"),
        ({"kl_coef": 0.1, "kl_placement": "reward"}, "needs reference.enabled"),
        ({"kl_placement": "reward"}, "needs kl_coef > 0"),
        ({"kl_coef": 0.1, "kl_target": 0.05}, "kl_target .* applies to kl_placement reward"),
        (
            {"kl_coef": 0.1, "kl_placement": "reward", "advantage": "gae"},
            "does not apply to advantage gae",
        ),
        ({"kl_placement": "in-reward"}, "'loss' or 'reward'"),
    ],
)
def test_the_config_refuses_what_cannot_run(algorithm: dict, message: str) -> None:
    from pydantic import ValidationError

    from schemas.config import RunConfig

    with pytest.raises(ValidationError, match=message):
        RunConfig.model_validate({"algorithm": algorithm})


def test_every_name_is_selectable() -> None:
    from schemas.config import RunConfig

    for key, names in (
        (
            "advantage",
            ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "passk", "gae"],
        ),
        ("policy_loss", ["ppo", "gspo", "cispo"]),
        ("loss_aggregation", list(losses.AggregationMode.__args__)),  # type: ignore[attr-defined]
        ("kl_estimator", ["k1", "k2", "k3"]),
        ("lr_schedule", ["constant", "cosine"]),
        ("is_level", ["token", "sequence"]),
        ("kl_placement", ["loss", "reward"]),
    ):
        for name in names:
            # kl_placement reward needs a coefficient and the reference stage
            extra = {"kl_coef": 0.1, "kl_target": 0.05} if name == "reward" else {}
            config = RunConfig.model_validate(
                {"algorithm": {key: name, **extra}, "reference": {"enabled": bool(extra)}}
            )
            assert getattr(config.algorithm, key) == name
