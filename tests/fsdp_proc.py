"""The FSDP2 engine's side of tests/test_fsdp.py: recorded steps, and the body of one rank.

`steps(vocab)` is the recorded stream: per step, each rank's micro-batches as the buffer
would cut them (uneven on purpose: different token counts per rank, different micro-batch
counts, and one step where rank 1 has nothing). `union(step)` is the same step as one
rank sees it. `rank_main` is what each spawned rank runs; it writes what it saw to
`<out>/rank<K>.pt` for the test to compare with the single-process engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

from engines.fsdp_train import FSDPTrainEngine, init_group
from engines.protocols import MicroBatch
from engines.torch_train import LossConfig

WORLD = 2
CHECKPOINT_AFTER = 2
"""Engine A checkpoints after this many steps; engine B resumes from it."""
LOSS = LossConfig(temperature=0.7)
ENGINE_ARGS = {"lr": 1e-2, "weight_decay": 0.01, "seed": 0, "loss": LOSS}

# [step][rank] -> rows per micro-batch; rank 1 has no micro-batch in step 1 (all refused, say).
LAYOUT = [
    [[3, 2], [4]],
    [[5], []],
    [[2], [3, 1, 2]],
    [[4, 4], [2]],
]


def micro_batch(rng: np.random.Generator, rows: int, vocab: int) -> MicroBatch:
    """`rows` right-padded rows prompt + response, random lengths, ids and advantages."""
    prompts = rng.integers(2, 6, size=rows)
    responses = rng.integers(1, 7, size=rows)
    width = int((prompts + responses).max())
    ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    loss = torch.zeros(rows, width)
    behaviour = torch.zeros(rows, width)
    for i, (p, r) in enumerate(zip(prompts.tolist(), responses.tolist(), strict=True)):
        ids[i, : p + r] = torch.from_numpy(rng.integers(1, vocab, size=p + r))
        attention[i, : p + r] = 1
        loss[i, p : p + r] = 1
        # Near a random-init model's own log-probs, so ratios stay near 1 and some clip.
        behaviour[i, p : p + r] = torch.from_numpy(
            np.log(1 / vocab) + rng.normal(0, 0.3, size=r)
        ).float()
    advantages = torch.from_numpy(rng.normal(0, 1, size=rows)).float()
    return MicroBatch(ids, attention, loss, advantages, behaviour)


def steps(vocab: int) -> list[list[list[MicroBatch]]]:
    """[step][rank][micro] micro-batches, the same on every call."""
    rng = np.random.default_rng(7)
    return [[[micro_batch(rng, rows, vocab) for rows in rank] for rank in step] for step in LAYOUT]


def union(step: list[list[MicroBatch]]) -> list[MicroBatch]:
    """One step as a single rank trains it: every rank's micro-batches."""
    return [mb for rank in step for mb in rank]


def rank_main(rank: int, port: int, model_dir: str, out: str, vocab: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, wait_for_workers=False)
    init_group(store, rank, WORLD, torch.device("cpu"), timeout=60)
    recorded = steps(vocab)
    checkpoint = Path(out) / "checkpoints" / "fsdp.pt"
    seen: dict[str, object] = {}

    # Only rank 0 reads the checkpoint's weights (the others build on the meta device and get
    # their shards from it), unless a frozen reference copy needs them whole on every rank.
    loads = [0]
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def loading(*args: Any, **kwargs: Any) -> Any:
        loads[0] += 1
        return from_pretrained(*args, **kwargs)

    AutoModelForCausalLM.from_pretrained = loading  # type: ignore[method-assign]
    try:
        a = FSDPTrainEngine(Path(model_dir), **ENGINE_ARGS)
        alone = loads[0]
        with_kl = {**ENGINE_ARGS, "loss": LossConfig(temperature=0.7, kl_coef=0.1)}
        FSDPTrainEngine(Path(model_dir), **with_kl)
        seen["weight_loads"], seen["weight_loads_with_reference"] = alone, loads[0] - alone
    finally:
        AutoModelForCausalLM.from_pretrained = from_pretrained  # type: ignore[method-assign]
    seen["has_checkpoint_before"] = a.has_checkpoint(checkpoint)
    steps_a: list[dict[str, float]] = []
    seen["a"] = steps_a
    for index, step in enumerate(recorded):
        steps_a.append(a.train_step(step[rank]))
        if index + 1 == CHECKPOINT_AFTER:
            a.save_checkpoint(checkpoint, {"last_seq": 100 * rank + index})
    seen["a_weights"] = a.export_weights()

    # A fresh engine (fresh init) resumes from the checkpoint and trains the rest.
    b = FSDPTrainEngine(Path(model_dir), **ENGINE_ARGS)
    seen["has_checkpoint"] = b.has_checkpoint(checkpoint)
    seen["extra"] = b.load_checkpoint(checkpoint)
    seen["b_step"] = b.step
    seen["b"] = [b.train_step(step[rank]) for step in recorded[CHECKPOINT_AFTER:]]
    seen["b_weights"] = b.export_weights()
    seen["files"] = sorted(
        str(p.relative_to(checkpoint.parent)) for p in checkpoint.parent.rglob("*") if p.is_file()
    )

    # bfloat16 compute: float32 shards (what AdamW updates), a finite step.
    c = FSDPTrainEngine(Path(model_dir), dtype=torch.bfloat16, **ENGINE_ARGS)
    seen["bf16"] = c.train_step(recorded[0][rank])
    # FSDP2 makes every parameter a DTensor; nn.Module types them as plain Parameters.
    seen["bf16_shard_dtypes"] = sorted({str(p.to_local().dtype) for p in c.model.parameters()})  # type: ignore[attr-defined]

    # Gradient sync once per step, not per micro-batch: FSDP2 reduce-scatters each unit's
    # gradients through torch.distributed.reduce_scatter_single, counted over a step of 3
    # micro-batches on each rank (LAYOUT's step 2: 1 on rank 0, 3 on rank 1, passes = 3).
    d = FSDPTrainEngine(Path(model_dir), **ENGINE_ARGS)
    seen["fsdp_units"] = sum(isinstance(m, FSDPModule) for m in d.model.modules())
    calls = [0]
    reduce_scatter = dist.reduce_scatter_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        d.train_step(recorded[2][rank])
    finally:
        dist.reduce_scatter_single = reduce_scatter
    seen["reduce_scatters"] = calls[0]
    torch.save(seen, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()
