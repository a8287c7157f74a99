"""Per-token log-probs and entropy from final hidden states, without a [N, V] tensor kept.

The naive path projects every position onto the vocabulary, keeps the [N, V] logits (and a
float32 copy divided by the temperature) for backward, and takes a log-softmax. At V = 32k
and N = 4k tokens that is 0.5 GB per float32 copy. Here the projection runs over chunks of
`chunk` positions:

    forward   per chunk: z = h_c W^T / T   [n, V] float32, dropped after use
              logp = z[y] - logsumexp(z)   [n]
              H    = -sum p log p,  p = softmax(z)   [n]
    backward  per chunk, z recomputed:   p = softmax(z)
              dL/dz = g_logp (onehot(y) - p) - g_H p (z - sum p z)
              dL/dh_c = dL/dz W / T,   dL/dW += dL/dz^T h_c / T

so the peak is one chunk's [n, V] (and its softmax), not the whole [N, V]: the memory of
`chunk` positions instead of N, paid for with a second projection in backward. With T = 1
the division is skipped (no full-vocabulary copy for it).
"""

from __future__ import annotations

from typing import Any

import torch


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature`, or `logits` itself at T = 1: at B x T x V the division is a
    full-vocabulary copy (0.5 GB per 4k tokens at V = 32k in float32) that changes nothing.
    Every full-logits path (trainer, reference, megatron, HF rollout) goes through here."""
    return logits if temperature == 1.0 else logits / temperature


def _exact(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 inputs: a softmax over a vocabulary needs at least
    float32."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = h W^T / T for one chunk: [n, V], at least float32."""
    z = (hidden @ weight.to(hidden.dtype).t()).to(_exact(hidden.dtype))
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[n, v] b[n, v] -> [n], as a batched matmul: no [n, V] product is made."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _ChunkedLogprobs(torch.autograd.Function):
    """Two [n, V] buffers live per chunk, in forward and in backward: the log-softmax (made
    in place from the logits) and the softmax."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # an output nobody differentiates gets None, not zeros
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=_exact(hidden.dtype), device=hidden.device)
        entropy = torch.empty_like(logprobs)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            logp = _chunk_logits(hidden[start:stop], weight, temperature)
            logp.sub_(torch.logsumexp(logp, dim=-1, keepdim=True))  # [n, V] log softmax
            logprobs[start:stop] = logp.gather(-1, targets[start:stop].unsqueeze(-1)).squeeze(-1)
            entropy[start:stop] = -_rowdot(logp.exp(), logp)  # -sum p log p
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        hidden, weight, targets = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        exact = _exact(hidden.dtype)
        n = hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=exact, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            h = hidden[start:stop]
            dz = _chunk_logits(h, weight, temperature)
            dz.sub_(torch.logsumexp(dz, dim=-1, keepdim=True))  # log p, becoming dL/dz in place
            probs = dz.exp()
            if grad_entropy is not None:  # dH/dz = -p (log p - sum p log p)
                dz.sub_(_rowdot(probs, dz).unsqueeze(-1)).mul_(probs).mul_(
                    -grad_entropy[start:stop].to(exact).unsqueeze(-1)
                )
            else:
                dz.zero_()
            if grad_logprobs is not None:  # d log p[y] / dz = onehot(y) - p
                g = grad_logprobs[start:stop].to(exact).unsqueeze(-1)
                dz.sub_(probs.mul_(g))
                dz.scatter_add_(-1, targets[start:stop].unsqueeze(-1), g)
            del probs
            if temperature != 1.0:
                dz.div_(temperature)
            if grad_hidden is not None:
                grad_hidden[start:stop] = (dz.to(h.dtype) @ weight.to(h.dtype)).to(
                    grad_hidden.dtype
                )
            if grad_weight is not None:
                grad_weight.addmm_(dz.t(), h.to(exact))
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None,
            None,
        )


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(h W^T / T)[y] and the entropy of softmax(h W^T / T), per position.

    hidden [..., H] (the model's final hidden states, after its last norm), weight [V, H]
    (the output projection), targets [...] int64 -> two [...] float32 tensors (float64 for
    float64 inputs); differentiable
    in `hidden` and `weight`. `chunk`: positions projected at once (the peak memory is about
    chunk x V x 12 bytes).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 position, got {chunk}")
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    logprobs, entropy = _ChunkedLogprobs.apply(
        flat_hidden, weight, targets.reshape(-1), float(temperature), chunk
    )
    return logprobs.reshape(shape), entropy.reshape(shape)


def naive_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, through the full [..., V] logits (the reference the chunked path must match)."""
    logits = scaled_logits((hidden @ weight.t()).to(_exact(hidden.dtype)), temperature)
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked, -(logp.exp() * logp).sum(-1)
