"""Each algorithm against values worked out by hand (the arithmetic is in the comments)."""

import math
from typing import Any

import pytest
import torch

from engines.algorithms import advantages, kl, losses


def close(actual: torch.Tensor | None, expected: float | list[Any], atol: float = 1e-5) -> None:
    assert actual is not None  # a gradient the test expects to exist
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0
    )


# ---- advantages --------------------------------------------------------------------------

# One group r = [0, 0, 0, 1]: mean 0.25, deviations [-.25, -.25, -.25, .75],
# unbiased var = (3 * .0625 + .5625) / 3 = .25, std = .5.
GROUP = torch.tensor([0.0, 0.0, 0.0, 1.0])


def test_grpo_divides_by_group_std() -> None:
    close(advantages.grpo(GROUP), [-0.5, -0.5, -0.5, 1.5])


def test_grpo_without_std_and_dr_grpo_only_centre() -> None:
    close(advantages.grpo(GROUP, normalize_std=False), [-0.25, -0.25, -0.25, 0.75])
    close(advantages.dr_grpo(GROUP), [-0.25, -0.25, -0.25, 0.75])


def test_grpo_rows_are_independent_groups_and_flat_groups_give_zero() -> None:
    rewards = torch.stack([GROUP, torch.ones(4)])  # [N=2, G=4]; row 2 has std 0
    close(advantages.grpo(rewards), [[-0.5, -0.5, -0.5, 1.5], [0.0, 0.0, 0.0, 0.0]])


def test_rloo_leaves_one_out() -> None:
    # r_0 - mean(r_1, r_2, r_3) = 0 - 1/3; r_3 - mean(0, 0, 0) = 1.
    close(advantages.rloo(GROUP), [-1 / 3, -1 / 3, -1 / 3, 1.0])


def test_reinforce_pp_baseline_uses_the_batch_std() -> None:
    # Centred per group: [[-.5, .5], [0, 0]]; over all 4: mean 0, unbiased var = .5 / 3,
    # std = .408248; -.5 / .408248 = -1.224745.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    close(advantages.reinforce_pp_baseline(rewards), [[-1.224745, 1.224745], [0.0, 0.0]])


def test_a_group_of_one_has_no_baseline() -> None:
    with pytest.raises(ValueError):
        advantages.grpo(torch.tensor([1.0]))


# ---- log-probs, entropy ------------------------------------------------------------------


def test_gather_logprobs_and_entropy() -> None:
    # logits [0, ln 3] -> p = [.25, .75]; H = .25 ln 4 + .75 ln(4/3) = .346574 + .215762.
    logits = torch.tensor([[0.0, math.log(3.0)]])
    close(losses.gather_logprobs(logits, torch.tensor([1])), [math.log(0.75)])
    close(losses.gather_logprobs(logits, torch.tensor([0])), [math.log(0.25)])
    close(losses.entropy_from_logits(logits), [0.562335])


# ---- policy losses -----------------------------------------------------------------------


def test_ppo_clip_higher_values_clip_flags_and_gradients() -> None:
    # Ratios [.5, 1, 1.5] (old = 0, logp = ln r), eps_low .2, eps_high .28 -> clip to [.8, 1.28].
    # A = +1: min(r, clip r) = [.5, 1, 1.28] -> loss [-.5, -1, -1.28]; only r = 1.5 clipped.
    # A = -1: min(-r, -clip r) = [-.8, -1, -1.5] -> loss [.8, 1, 1.5]; only r = .5 clipped.
    # d loss / d logp = -A r where not clipped, 0 where clipped.
    logp = torch.log(torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])).requires_grad_()
    out = losses.ppo_clip_loss(
        logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), eps_low=0.2, eps_high=0.28
    )
    close(out.loss.detach(), [[-0.5, -1.0, -1.28], [0.8, 1.0, 1.5]])
    assert out.clipped.tolist() == [[False, False, True], [True, False, False]]
    out.loss.sum().backward()
    close(logp.grad, [[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]])


def test_gspo_uses_one_length_normalised_ratio_per_sequence() -> None:
    # Row 0: log ratios [.2, .4] (+ a masked 9.0) -> mean .3 -> s = e^.3 = 1.349859 > 1.2:
    #   with A = +1 the clip (eps .2) binds: loss -1.2 on each token, no gradient.
    # Row 1: log ratios [.1, -.1] -> mean 0 -> s = 1, A = +1: loss -1 per token.
    # seq-mean-token-mean = (mean_t loss_0 + mean_t loss_1) / 2, and d s_t / d logp_t = s, so
    #   d/d logp_t (row 1) = -A * s * (1 / |y| = 1/2) * (1 / B = 1/2) = -.25.
    logp = torch.tensor([[0.2, 0.4, 9.0], [0.1, -0.1, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out = losses.gspo_loss(
        logp, torch.zeros(2, 3), torch.tensor([1.0, 1.0]), mask, eps_low=0.2, eps_high=0.2
    )
    close(out.ratio, [[1.349859] * 3, [1.0] * 3])
    close((out.loss * mask).detach(), [[-1.2, -1.2, 0.0], [-1.0, -1.0, 0.0]])
    losses.aggregate(out.loss, mask, "seq-mean-token-mean").backward()
    close(logp.grad, [[0.0, 0.0, 0.0], [-0.25, -0.25, 0.0]])


def test_truncated_is_weight_caps_the_ratio() -> None:
    # pi_prox / pi_behaviour = [1 / .25, 1, 1 / 2] = [4, 1, .5]; cap 2 -> [2, 1, .5].
    behaviour = torch.log(torch.tensor([0.25, 1.0, 2.0]))
    close(losses.truncated_is_weight(torch.zeros(3), behaviour, cap=2.0), [2.0, 1.0, 0.5])


def test_log_ratios_past_twenty_are_clamped_before_exp() -> None:
    # log pi - log pi_old = [1e4, 0, -30, 5] -> clamped to [-20, 20]: [20, 0, -20, 5]; only the
    # first and third were clamped.
    logp = torch.tensor([[0.0, -1.0, 0.0, 0.0]])
    old = torch.tensor([[-1e4, -1.0, 30.0, -5.0]])
    log_ratio, clamped = losses.clamped_log_ratio(logp, old)
    close(log_ratio, [[20.0, 0.0, -20.0, 5.0]])
    assert clamped.tolist() == [[True, False, True, False]]


def test_ppo_ratio_of_a_far_off_behaviour_logprob_is_finite() -> None:
    # old = [-1e4, 0, 30] against logp 0: log ratios [1e4, 0, -30] -> [20, 0, -20],
    # r = [e^20, 1, e^-20]. A = -1, clip [.8, 1.28]: loss = max(r, clip r) = [e^20, 1, .8].
    # d loss / d logp: 0 where the log ratio was clamped (token 0) or the clip binds (token 2),
    # -A r = 1 on token 1. Unclamped, r_0 = exp(1e4) = inf: an inf loss and a NaN gradient.
    logp = torch.zeros(1, 3, requires_grad=True)
    out = losses.ppo_clip_loss(logp, torch.tensor([[-1e4, 0.0, 30.0]]), torch.tensor([-1.0]))
    torch.testing.assert_close(
        out.loss.detach(), torch.tensor([[math.exp(20), 1.0, 0.8]]), rtol=1e-6, atol=0
    )
    out.loss.sum().backward()
    close(logp.grad, [[0.0, 1.0, 0.0]])
    assert out.log_ratio_clamped.tolist() == [[True, False, True]]


def test_gspo_sequence_ratio_is_the_mean_of_clamped_token_log_ratios() -> None:
    # Token log ratios [1e4, 0, 0] (+ a masked 50) -> clamped [20, 0, 0] -> mean 20/3,
    # s = e^(20/3) = 786.1343. A = -1, clip [.8, 1.2]: loss = max(s, clip s) = s on each token.
    # seq-mean-token-mean, one sequence of 3 tokens: d/d logp_t = -A * s / 3 = 262.0448 on every
    # token (GSPO's gradient runs through log pi_t, not through the clamped ratio).
    logp = torch.zeros(1, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    old = torch.tensor([[-1e4, 0.0, 0.0, -50.0]])
    out = losses.gspo_loss(logp, old, torch.tensor([-1.0]), mask, eps_low=0.2, eps_high=0.2)
    s = math.exp(20 / 3)
    torch.testing.assert_close(out.ratio, torch.full((1, 4), s), rtol=1e-6, atol=0)
    losses.aggregate(out.loss, mask, "seq-mean-token-mean").backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[s / 3] * 3 + [0.0]]), rtol=1e-6, atol=0)
    assert out.log_ratio_clamped.tolist() == [[True, False, False, True]]


def test_truncated_is_weight_exponentiates_the_clamped_log_ratio() -> None:
    # pi_prox / pi_behaviour with log ratios [1e4, -1e4] -> clamped [20, -20]: [e^20, e^-20],
    # capped at 2 -> [2, e^-20] (exp of the unclamped -1e4 would be 0).
    weight = losses.truncated_is_weight(torch.zeros(2), torch.tensor([-1e4, 1e4]), cap=2.0)
    torch.testing.assert_close(weight, torch.tensor([2.0, math.exp(-20)]), rtol=1e-6, atol=0)


# ---- aggregation -------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 3: no response


@pytest.mark.parametrize(
    ("mode", "expected", "count"),
    [
        ("token-mean", (1 + 2 + 4) / 3, 3),  # 3 tokens
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2, 2),  # 2 sequences with tokens
        ("seq-mean-token-mean", (1.5 + 4) / 2, 2),
    ],
)
def test_aggregation_modes(mode: losses.AggregationMode, expected: float, count: int) -> None:
    assert losses.aggregation_count(MASK, mode) == count
    close(losses.aggregate(LOSS, MASK, mode), expected)
    # A step-wide denominator (say 7 tokens over all micro-batches) replaces the local one.
    close(losses.aggregate(LOSS, MASK, mode, denominator=7), expected * count / 7)


# ---- KL estimators -----------------------------------------------------------------------


def test_kl_estimators() -> None:
    # pi = .5, pi_ref = .25: log r = ln .5 = -.693147.
    # k1 = .693147; k2 = .5 * .693147^2 = .240227; k3 = (.5 - 1) + .693147 = .193147.
    logp, ref = torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.25, 0.3]))
    close(kl.kl_k1(logp, ref), [0.693147, 0.0])
    close(kl.kl_k2(logp, ref), [0.240227, 0.0])
    close(kl.kl_k3(logp, ref), [0.193147, 0.0])
