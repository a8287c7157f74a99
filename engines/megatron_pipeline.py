"""Pipeline-parallel passes of `engines.megatron_train` (`pipeline_parallel_size` > 1).

Each rank holds one stage of GPTModel (`engines.megatron_names.stage_params`). A step's
micro-batches run through megatron's `get_forward_backward_func` schedule (1F1B):

    stage 0: ids -> embedding, layers 0..L/p-1  --activations [T, B, H]-->  stage 1 ... last stage:
    final norm, output layer -> logits [B, T, Vp] -> our per-token objective (the torch engine's)
                                        <--activation grads--

Every rank of the copy reads the same micro-batches (the masks and positions are needed on
every stage; the ids on the first, the loss inputs on the last). Micro-batches differ in
[B, T], so the schedule sends each activation's shape first (`variable_seq_lengths`). The loss
is the torch engine's, already normalised by the step's denominator: `calculate_per_token_loss`
keeps megatron from dividing it again by the micro-batch count. Only the last stage computes
the loss and the metric sums; `reduce_totals` hands them to the other stages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from engines.algorithms.logprobs import scaled_logits
from engines.algorithms.losses import aggregate, entropy_from_logits, gather_logprobs
from engines.algorithms.objective import token_objective
from engines.protocols import MicroBatch

if TYPE_CHECKING:
    from engines.megatron_train import MegatronTrainEngine

# (logits [B, T - 1, V] at the temperature, micro-batch index)
#     -> (loss, extras kept for the caller).
LossFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, dict[str, Any]]]


def run_schedule(
    engine: MegatronTrainEngine,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: LossFn,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """Runs `batches` ([B, T] ids and attention masks, on the engine's device) through the
    pipeline; on the last stage `loss_fn(logits [B, T - 1, V] at the temperature, index)` gives
    each micro-batch's (loss, extras), and this returns the extras in order ([] elsewhere).
    Without `forward_only` the gradients accumulate in the stage's parameters."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    inputs: Iterator[tuple[int, torch.Tensor, torch.Tensor]] = iter(
        (i, ids, mask) for i, (ids, mask) in enumerate(batches)
    )

    def forward_step(
        data: Iterator[tuple[int, torch.Tensor, torch.Tensor]], model: torch.nn.Module
    ) -> Any:
        index, ids, mask = next(data)
        logits = engine._stage_forward(ids, mask, model)  # last stage: [B, T, Vp]; else [T, B, H]

        def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            # T = 1 is not divided (a full-vocabulary copy that changes nothing).
            scaled = scaled_logits(
                output[:, :-1, : engine.spec.vocab_size].float(), engine.loss_config.temperature
            )
            loss, extras = loss_fn(scaled, index)
            # The token count only matters to megatron's own averaging, which is off.
            return loss, torch.ones((), dtype=torch.int), extras

        return logits, loss_func

    ids0 = batches[0][0]
    return (
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=inputs,
            model=[engine.model],
            num_microbatches=len(batches),
            seq_length=ids0.shape[1],
            micro_batch_size=ids0.shape[0],
            forward_only=forward_only,
        )
        or []
    )


def stage_logprobs(
    engine: MegatronTrainEngine, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """[B, T] log-probs of each micro-batch (0 at t = 0), on the last stage; [] elsewhere."""

    def loss_fn(logits: torch.Tensor, index: int) -> tuple[torch.Tensor, dict[str, Any]]:
        ids = batches[index][0]
        logprobs = torch.nn.functional.pad(gather_logprobs(logits, ids[:, 1:]), (1, 0))
        return logits.new_zeros(()), {"logprobs": logprobs}

    with torch.no_grad():
        out = run_schedule(engine, batches, loss_fn, forward_only=True)
    return [o["logprobs"] for o in out]


def pipeline_update_passes(
    engine: MegatronTrainEngine,
    micro_batches: Sequence[MicroBatch],
    proximal: Sequence[torch.Tensor] | None,
    totals: dict[str, float],
    denominator: float,
) -> None:
    """Forward and backward of every micro-batch of one update; the loss and metric sums land
    in `totals` on the last stage (the gradients in every stage's parameters)."""
    cfg, device = engine.loss_config, engine.device
    batches = [(b.input_ids.to(device), b.attention_mask.to(device)) for b in micro_batches]

    def loss_fn(logits: torch.Tensor, index: int) -> tuple[torch.Tensor, dict[str, Any]]:
        batch = micro_batches[index]
        logprobs = torch.nn.functional.pad(
            gather_logprobs(logits, batches[index][0][:, 1:]), (1, 0)
        )
        kept = logits if cfg.entropy_coef else logits.detach()
        entropy = torch.nn.functional.pad(entropy_from_logits(kept), (1, 0))
        mask = batch.loss_mask.to(device).float()
        objective = token_objective(
            cfg,
            logprobs,
            batch.behaviour_logprobs.to(device),
            batch.advantages.to(device).float(),
            mask,
            proximal=None if proximal is None else proximal[index].to(device),
            entropy=entropy,
            ref_logprobs=None
            if batch.ref_logprobs is None
            else batch.ref_logprobs.to(device).float(),
        )
        loss = aggregate(
            objective.loss,
            mask,
            cfg.aggregation,
            denominator=denominator,
            norm_tokens=cfg.norm_tokens,
        )
        return loss, {"loss": loss.item(), **objective.sums}

    for extras in run_schedule(engine, batches, loss_fn, forward_only=False):
        for name, value in extras.items():
            totals[name] += value


def reduce_totals(engine: MegatronTrainEngine, totals: dict[str, float]) -> dict[str, float]:
    """The last stage's metric sums, on every rank of the copy (the others computed none)."""
    names = sorted(totals)
    values = torch.tensor([totals[n] for n in names], dtype=torch.float64, device=engine.device)
    last = dist.get_global_rank(engine.pp_group, engine.pp - 1)
    dist.broadcast(values, src=last, group=engine.pp_group)
    return dict(zip(names, values.tolist(), strict=True))


def broadcast_from_last(
    engine: MegatronTrainEngine, tensor: torch.Tensor | None, shape: torch.Size
) -> torch.Tensor:
    """`tensor` (on the last stage; None elsewhere) of `shape`, float32, on every stage."""
    buffer = (
        tensor.float().contiguous()
        if tensor is not None
        else torch.empty(shape, dtype=torch.float32, device=engine.device)
    )
    dist.broadcast(
        buffer, src=dist.get_global_rank(engine.pp_group, engine.pp - 1), group=engine.pp_group
    )
    return buffer
