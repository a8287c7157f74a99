"""The FSDP2 engine's side of tests/test_fsdp_critic.py: `rank_main`, the body of one rank.

Each rank trains `tests.fsdp_proc`'s recorded steps with a critic (`algorithm.advantage: gae`,
two PPO epochs per step) on its own micro-batches (with one rank: each step's union), checkpoints
after `CHECKPOINT_AFTER` steps, and a fresh engine resumes from that checkpoint for the rest.
It writes what it saw to `<out>/rank<K>.pt`: per-step metrics, the policy's and the critic's
full weights (rank 0), the resumed run's, and the reduce-scatters of one step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from engines.critic import CriticConfig
from engines.fsdp_train import FSDPTrainEngine, init_group
from tests import fsdp_proc

CHECKPOINT_AFTER = 2
CRITIC = CriticConfig(lr=1e-2, gamma=0.9, lam=0.8, value_clip=0.2, max_grad_norm=0.5)
ENGINE_ARGS: dict[str, Any] = {**fsdp_proc.ENGINE_ARGS, "critic": CRITIC, "ppo_epochs": 2}


def critic_weights(engine: FSDPTrainEngine) -> dict[str, torch.Tensor]:
    """The value model's full CPU tensors on rank 0 ({} on the others); every rank calls it."""
    assert engine.critic is not None
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(engine.critic.model, options=options)
    return {k: cast(torch.Tensor, v).clone() for k, v in full.items()} if engine.rank == 0 else {}


def own(step: list[list[Any]], rank: int, world: int) -> list[Any]:
    """This rank's micro-batches of a recorded step: its own, or with one rank the union."""
    return fsdp_proc.union(step) if world == 1 else step[rank]


def rank_main(rank: int, world: int, port: int, model_dir: str, out: str, vocab: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, wait_for_workers=False)
    init_group(store, rank, world, torch.device("cpu"), timeout=60)
    recorded = fsdp_proc.steps(vocab)
    checkpoint = Path(out) / "checkpoints" / "fsdp.pt"
    seen: dict[str, object] = {}

    a = FSDPTrainEngine(Path(model_dir), **ENGINE_ARGS)
    steps_a = []
    for index, step in enumerate(recorded):
        steps_a.append(a.train_step(own(step, rank, world)))
        if index + 1 == CHECKPOINT_AFTER:
            a.save_checkpoint(checkpoint, {"last_seq": index})
    seen["a"], seen["a_weights"], seen["a_critic"] = steps_a, a.export_weights(), critic_weights(a)

    # A fresh engine (fresh init) resumes from the checkpoint and trains the rest.
    b = FSDPTrainEngine(Path(model_dir), **ENGINE_ARGS)
    b.load_checkpoint(checkpoint)
    seen["b_step"] = b.step
    seen["b"] = [b.train_step(own(step, rank, world)) for step in recorded[CHECKPOINT_AFTER:]]
    seen["b_weights"], seen["b_critic"] = b.export_weights(), critic_weights(b)

    # Gradient sync once per update, not per micro-batch, for the critic as for the policy:
    # one PPO update over LAYOUT's step 2 (1 micro-batch on rank 0, 3 on rank 1: 3 passes).
    d = FSDPTrainEngine(Path(model_dir), **{**ENGINE_ARGS, "ppo_epochs": 1})
    assert d.critic is not None
    seen["units"] = sum(
        isinstance(m, FSDPModule) for m in [*d.model.modules(), *d.critic.model.modules()]
    )
    calls = [0]
    reduce_scatter = dist.reduce_scatter_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        d.train_step(own(recorded[2], rank, world))
    finally:
        dist.reduce_scatter_single = reduce_scatter
    seen["reduce_scatters"] = calls[0]

    # bfloat16 compute: the value head runs in the gathered parameters' dtype, a finite step.
    c = FSDPTrainEngine(Path(model_dir), dtype=torch.bfloat16, **ENGINE_ARGS)
    seen["bf16"] = c.train_step(own(recorded[0], rank, world))
    torch.save(seen, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()
