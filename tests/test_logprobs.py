"""Memory-lean log-probs (`engines.algorithms.logprobs`): the chunked path against the full logits.

Values and gradients (in the hidden states and the output projection) match the naive
log-softmax path to 1e-5, at temperature 1 and not, for chunk sizes that do and do not
divide the number of positions; the trainer's log-probs through it equal the full path's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.algorithms.logprobs import chunked_logprobs, naive_logprobs


def case(
    seed: int, n: int = 37, hidden: int = 16, vocab: int = 50, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, ...]:
    """Logits of a few units, as a trained model's are (scaled so that float32 rounding stays
    well under the tolerance)."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=gen)
    g_logp = torch.randn(n, generator=gen, dtype=torch.float64)
    g_ent = torch.randn(n, generator=gen, dtype=torch.float64)
    return h, w, y, g_logp, g_ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_log_probs_and_entropy_match_the_full_logits_with_their_gradients(
    temperature: float, chunk: int, dtype: torch.dtype
) -> None:
    h, w, y, g_logp, g_ent = case(seed=chunk, dtype=dtype)
    ours = chunked_logprobs(h, w, y, temperature, chunk)
    loss = (ours[0].double() * g_logp).sum() + (ours[1].double() * g_ent).sum()
    grad_h, grad_w = torch.autograd.grad(loss, (h, w))
    reference = naive_logprobs(h, w, y, temperature)
    ref_loss = (reference[0].double() * g_logp).sum() + (reference[1].double() * g_ent).sum()
    ref_h, ref_w = torch.autograd.grad(ref_loss, (h, w))
    for name, got, want in (
        ("log-probs", ours[0], reference[0]),
        ("entropy", ours[1], reference[1]),
        ("d/d hidden", grad_h, ref_h),
        ("d/d weight", grad_w, ref_w),
    ):
        assert torch.allclose(got.double(), want.double(), atol=1e-5, rtol=1e-5), (
            f"{name}: max |diff| {(got.double() - want.double()).abs().max():.3g}"
        )


def test_a_hand_computed_position() -> None:
    """h = [1, 0], W rows [0, 0], [1, 0], [0, 1]: logits [0, 1, 0]; log p(1) = 1 - log(e + 2)."""
    h = torch.tensor([[1.0, 0.0]])
    w = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    logp, entropy = chunked_logprobs(h, w, torch.tensor([1]), 1.0, chunk=1)
    z = torch.tensor([0.0, 1.0, 0.0])
    p = torch.softmax(z, 0)
    assert logp.item() == pytest.approx(1 - torch.log(torch.e + torch.tensor(2.0)).item(), abs=1e-6)
    assert entropy.item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-6)


def test_batched_shapes_and_a_bad_chunk() -> None:
    h, w, y, _, _ = case(seed=3, n=12)
    logp, entropy = chunked_logprobs(h.reshape(3, 4, -1), w, y.reshape(3, 4), chunk=5)
    assert logp.shape == entropy.shape == (3, 4)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        chunked_logprobs(h, w, y, chunk=0)


def test_the_trainer_log_probs_equal_the_full_logits_path(tmp_path: Path) -> None:
    from engines.tiny import build_tiny_model
    from engines.torch_train import LossConfig, TorchTrainEngine
    from producers.tasks import VOCAB

    model = build_tiny_model(tmp_path / "m", VOCAB)
    ids = torch.randint(3, len(VOCAB), (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    chunked = TorchTrainEngine(
        model, lr=1e-3, loss=LossConfig(temperature=0.8), logprob_chunk_tokens=4
    )
    full = TorchTrainEngine(
        model, lr=1e-3, loss=LossConfig(temperature=0.8), logprob_chunk_tokens=0
    )
    assert torch.allclose(chunked.logprobs(ids, mask), full.logprobs(ids, mask), atol=1e-5)


def test_a_train_step_through_the_chunks_makes_the_same_update_as_through_the_full_logits(
    tmp_path: Path,
) -> None:
    from engines.protocols import MicroBatch
    from engines.tiny import build_tiny_model
    from engines.torch_train import LossConfig, TorchTrainEngine
    from producers.tasks import VOCAB

    model = build_tiny_model(tmp_path / "m", VOCAB)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(VOCAB), (3, 10), generator=gen)
    attention = torch.ones_like(ids)
    loss_mask = torch.zeros(3, 10)
    loss_mask[:, 5:] = 1
    batch = MicroBatch(
        ids,
        attention,
        loss_mask,
        torch.tensor([1.0, -0.5, 0.25]),
        -torch.rand(3, 10, generator=gen) * loss_mask,
    )
    engines = [
        TorchTrainEngine(
            model, lr=1e-2, loss=LossConfig(temperature=0.9), logprob_chunk_tokens=chunk
        )
        for chunk in (7, 0)
    ]
    metrics = [engine.train_step([batch]) for engine in engines]
    for key in ("loss", "entropy", "ratio_mean", "grad_norm"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-6), key
    # The gradients the step took (AdamW's first step is about lr x sign(g): weights would
    # show float32 noise on gradients near 0 as lr-sized differences).
    chunked, full = ({n: p.grad for n, p in engine.model.named_parameters()} for engine in engines)
    # Every parameter has a gradient after the step.
    worst = max(((chunked[n] - full[n]).abs() / (full[n].abs() + 1e-4)).max().item() for n in full)  # type: ignore[operator, union-attr]
    assert worst < 1e-3, f"gradients differ by up to {worst:.3g} (relative)"
