"""Chunked log-probs for the megatron engine (`trainer.logprob_chunk_tokens` > 0): GPTModel's
final hidden states projected onto its vocabulary-parallel output layer a chunk of positions
at a time, never the [B, T, V] logits.

    decoder (final norm included)  ->  hidden [N, H], N = B x (T - 1)
    per chunk of n positions, on each tensor-parallel rank r (its columns: V/TP of them):
        z_r = h_c W_r^T / T                     [n, V/TP] float32, dropped after use
        m   = max over ranks of max_v z_r       [n]   all-reduce MAX (no gradient: the
                                                      log-softmax does not depend on it)
        s   = sum_r sum_v exp(z_r - m)          [n]   } one all-reduce SUM of [3, n]; its
        q   = sum_r sum_v exp(z_r - m) z_r      [n]   } backward is the identity, since
        z_y = z_r[y] on the rank owning y       [n]   } every rank computes the same loss
        log p(y) = z_y - (m + log s),   H = (m + log s) - q / s

Each chunk runs under torch's non-reentrant checkpoint: backward recomputes its [n, V/TP]
logits instead of keeping them, so no op of a step holds more than one chunk's positions over
the vocabulary (or its V/TP slice). The gradient of the hidden states is summed over the
tensor-parallel ranks once, for all chunks (megatron's `copy_to_tensor_model_parallel_region`),
as the output layer's own backward does. At tensor parallel 1 nothing is reduced.

The temperature goes through `scaled_logits` (T = 1 is not divided), and the projection runs
in float32 outside the forward's autocast, as in the torch engine's chunked path
(`engines.algorithms.logprobs`). Checked on the CPU only, at tensor parallel 1 and 2
(`tests/test_megatron_chunked.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from engines.algorithms.logprobs import scaled_logits


@contextlib.contextmanager
def final_hidden_states(gpt: Any) -> Iterator[None]:
    """While inside, GPTModel's forward returns its decoder's output, [T, B, H] after the final
    norm, instead of the logits: megatron-core 0.16's `GPTModel._postprocess` returns the hidden
    states before the output layer when `post_process` is False (the final norm belongs to the
    decoder, built when the model was). Only for a model that holds the last stage."""
    if not gpt.post_process:
        raise ValueError("final_hidden_states: this GPTModel holds no output layer")
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = True


def _chunk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    first: int,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: hidden [n, H], weight [v, H] (this rank's real vocabulary rows, token ids
    first..first+v-1), targets [n] -> ([n] log-probs of the targets, [n] entropies), reduced
    over `group` (None: the whole vocabulary is here)."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    z = scaled_logits(hidden.float() @ weight.float().t(), temperature)  # [n, v]
    n, v = z.shape
    m = z.detach().amax(-1) if v else z.new_full((n,), float("-inf"))  # [n]
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = (z - m[:, None]).exp()  # [n, v]
    local = targets - first  # [n] the targets' columns here, where this rank owns them
    owned = (local >= 0) & (local < v)  # [n]
    # [n] z[y] where owned, 0 elsewhere (a rank with no real rows owns nothing).
    picked = z.gather(-1, local.clamp(0, max(v - 1, 0))[:, None]).squeeze(-1) if v else m * 0
    sums = torch.stack([e.sum(-1), (e * z).sum(-1), picked * owned])  # [3, n]
    if group is not None:
        sums = reduce_from_tensor_model_parallel_region(sums, group)
    s, q, target = sums.unbind(0)
    lse = m + s.log()  # [n] log sum_v exp(z_v) over the whole vocabulary
    return target - lse, lse - q / s


def vocab_parallel_chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    chunk: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., H] (final hidden states, identical on every tensor-parallel rank), weight
    [Vp/TP, H] (this rank's rows of the vocabulary-parallel output layer, padded vocabulary Vp),
    targets [...] int64 -> ([...] float32 log softmax(h W^T / T)[y], [...] float32 entropies)
    over the first `vocab_size` tokens; differentiable in `hidden` and `weight`. `group`: the
    tensor-parallel group (None or one rank: no reduction)."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 position, got {chunk}")
    parallel = group is not None and dist.get_world_size(group) > 1
    rows = weight.shape[0]
    first = (dist.get_rank(group) if parallel else 0) * rows  # megatron's vocabulary cut
    # Pad rows (the vocabulary rounded up to a multiple of TP) are no tokens: cut off, as the
    # full-logits path cuts their logits.
    real = weight[: max(0, min(rows, vocab_size - first))]  # [v, H]
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    if parallel:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        # Backward: each rank's dL/dh (through its columns only) summed over the ranks, once.
        flat = copy_to_tensor_model_parallel_region(flat, group)
    ids = targets.reshape(-1)
    if not ids.numel():  # one-token rows: nothing is predicted
        empty = torch.zeros(shape, dtype=torch.float32, device=hidden.device)
        return empty, empty.clone()
    reduce_group = group if parallel else None
    logprobs, entropies = [], []
    for start in range(0, flat.shape[0], chunk):
        args = (flat[start : start + chunk], real, ids[start : start + chunk])
        if torch.is_grad_enabled():  # backward recomputes the chunk's [n, v] logits
            out = torch.utils.checkpoint.checkpoint(
                _chunk_logprobs, *args, temperature, first, reduce_group, use_reentrant=False
            )
        else:
            out = _chunk_logprobs(*args, temperature, first, reduce_group)
        logprobs.append(out[0])
        entropies.append(out[1])
    return torch.cat(logprobs).reshape(shape), torch.cat(entropies).reshape(shape)
