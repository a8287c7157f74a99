"""KL in the reward and the adaptive coefficient, against hand-computed values and a naive loop."""

import math

import pytest
import torch

from engines.algorithms.kl import adaptive_kl_coef, kl_in_reward, kl_k1, kl_k3, mean_sequence_kl


def test_kl_in_reward_by_hand() -> None:
    # Row 0: prompt at t=0, response at t=1..3; kl [., .1, .2, .3], score 1, beta .5:
    #   token rewards [0, -.05, -.1, -.15 + 1] and total 1 - .5 * .6 = .7.
    # Row 1: response at t=1..2 (t=3 padding, kl there ignored), kl [., .4, -.2, 9], score -1:
    #   token rewards [0, -.2, .1 - 1, 0] and total -1 - .5 * .2 = -1.1.
    # Row 2: no response token: no reward anywhere, total = score 2.
    kl_tokens = torch.tensor([[0.0, 0.1, 0.2, 0.3], [0.0, 0.4, -0.2, 9.0], [0.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 0, 0, 0]])
    token, total = kl_in_reward(torch.tensor([1.0, -1.0, 2.0]), kl_tokens, mask, 0.5)
    torch.testing.assert_close(
        token, torch.tensor([[0, -0.05, -0.1, 0.85], [0, -0.2, -0.9, 0], [0, 0, 0, 0.0]])
    )
    torch.testing.assert_close(total, torch.tensor([0.7, -1.1, 2.0]))


def naive_kl_in_reward(
    rewards: list[float], kl: list[list[float]], mask: list[list[int]], beta: float
):
    token = [[0.0] * len(row) for row in kl]
    total = []
    for b, row in enumerate(kl):
        last = None
        for t, value in enumerate(row):
            if mask[b][t]:
                token[b][t] = -beta * value
                last = t
        if last is not None:
            token[b][last] += rewards[b]
        total.append(sum(token[b]) if last is not None else rewards[b])
    return token, total


@pytest.mark.parametrize("seed", range(5))
def test_kl_in_reward_matches_a_naive_loop_and_totals_are_token_sums(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logp, ref = -torch.rand(6, 9, generator=g) * 3, -torch.rand(6, 9, generator=g) * 3
    mask = (torch.rand(6, 9, generator=g) > 0.4).int()
    rewards, beta = torch.randn(6, generator=g), float(torch.rand(1, generator=g))
    kl_tokens = kl_k3(logp, ref)
    token, total = kl_in_reward(rewards, kl_tokens, mask, beta)
    want_token, want_total = naive_kl_in_reward(
        rewards.tolist(), kl_tokens.tolist(), mask.tolist(), beta
    )
    torch.testing.assert_close(token, torch.tensor(want_token), atol=1e-5, rtol=0)
    torch.testing.assert_close(total, torch.tensor(want_total), atol=1e-5, rtol=0)
    has = mask.sum(-1) > 0
    torch.testing.assert_close(token.sum(-1)[has], total[has], atol=1e-5, rtol=0)


def test_adaptive_kl_coef_by_hand() -> None:
    # kl .15 vs target .1: error .5, clipped to .2; 64 samples of a 10,000 horizon:
    # .2 * (1 + .2 * 64 / 10000) = .2 * 1.00128 = .200256.
    assert adaptive_kl_coef(0.2, 0.15, 0.1, 10_000, 64) == pytest.approx(0.200256)
    # kl .09 vs .1: error -.1 (inside the clip): .2 * (1 - .1 * 64 / 10000) = .199872.
    assert adaptive_kl_coef(0.2, 0.09, 0.1, 10_000, 64) == pytest.approx(0.199872)
    # kl 0: error -1, clipped to -.2; horizon 100, 50 samples: .2 * (1 - .1) = .18.
    assert adaptive_kl_coef(0.2, 0.0, 0.1, 100, 50) == pytest.approx(0.18)
    assert adaptive_kl_coef(0.2, 0.1, 0.1, 100, 50) == pytest.approx(0.2)


def test_adaptive_kl_coef_converges_from_either_side() -> None:
    # The KL falls as the coefficient rises (kl = .02 / beta):
    # the controller settles where kl = target.
    for beta in (0.01, 2.0):
        for _ in range(3000):
            beta = adaptive_kl_coef(beta, 0.02 / beta, 0.1, 1000, 64)
        assert beta == pytest.approx(0.2, rel=1e-3)


def test_mean_sequence_kl_averages_each_rows_token_mean() -> None:
    # Row 0: (.1 + .3) / 2 = .2; row 1: .6; row 2 has no token: left out -> (.2 + .6) / 2 = .4.
    kl_tokens = torch.tensor([[0.1, 0.3, 7.0], [0.6, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert mean_sequence_kl(kl_tokens, mask) == pytest.approx(0.4)
    assert mean_sequence_kl(kl_tokens, torch.zeros_like(mask)) == 0.0
    assert math.isclose(
        mean_sequence_kl(kl_k1(torch.zeros(1, 2), torch.zeros(1, 2)), torch.ones(1, 2)), 0.0
    )
