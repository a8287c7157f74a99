"""The GPU check's fsdp section: the FSDP2 train engine on one device, one rank.

Called by `ops.gpu_check` in a child process (its own default process group, world size 1,
over a file store in the section's scratch directory). On the Qwen2-0.5B shape in bf16
mixed precision, then the Qwen2.5-3B shape where the budget leaves time (a tiny one with
`--tiny`/`--cpu-smoke`): train steps per second, tokens per second and MFU, peak device
memory, and the seconds to export the weights the two ways the trainer does (`export_weights`,
gathered to rank 0; `export_shard`, each rank its own tensors), with the exported bytes checked
equal.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time
from typing import Any

from ops.gpu.record import Record, say
from ops.gpu.sections import (
    qwen2_config,
    random_batch,
    save_random_model,
    timed_steps,
)

# A 3B model takes about a minute to build, save, load and step; below this, it is skipped.
LARGER_NEEDS_S = 120.0
# The 3B step again with activation checkpointing: a reload and four steps.
CHECKPOINTED_NEEDS_S = 40.0


def fsdp(args: argparse.Namespace, rec: Record) -> None:
    import torch
    import torch.distributed as dist

    from engines.fsdp_train import init_group

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA not available")
    # A bare "cuda", as a user's JETRL_DEVICE=cuda gives it: init_group must index it.
    init_group(dist.FileStore(str(args.work / "store"), 1), 0, 1, device, timeout=120.0)
    rec.put("setup", {"world_size": 1, "backend": dist.get_backend()})
    try:
        for size in ["tiny"] if args.tiny else ["0.5B", "3B"]:
            if size != "0.5B" and not args.tiny and rec.left() < LARGER_NEEDS_S:
                rec.put(size, {"skipped": f"{rec.left():.0f}s left"})
                break
            one_size(args, rec, size, device)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def one_size(args: argparse.Namespace, rec: Record, size: str, device: Any) -> None:
    import torch

    from engines.delta_plan import assign_shards
    from engines.fsdp_train import FSDPTrainEngine

    config = qwen2_config(args.tiny, size)
    model_dir = args.work / f"model-{size}"
    started = time.monotonic()
    params = save_random_model(config, args.device, model_dir)
    engine = FSDPTrainEngine(model_dir, lr=1e-6, device=device, dtype=torch.bfloat16)
    report: dict[str, Any] = {"params": params, "build_s": round(time.monotonic() - started, 2)}
    rec.put(size, report)
    batch = random_batch(config.vocab_size, args.tiny)
    report["train"] = timed_steps(args, engine, batch, params)
    rec.put(size, report)
    say(
        "fsdp",
        f"{size} train: {report['train']['s_per_step']} s/step, "
        f"{report['train']['tokens_per_s']:,.0f} tok/s, peak {report['train']['peak_gib']} GiB",
    )

    t0 = time.monotonic()
    full = engine.export_weights()
    full_s = time.monotonic() - t0
    t0 = time.monotonic()
    shard = engine.export_shard(assign_shards(engine.weight_sizes(), 1))
    shard_s = time.monotonic() - t0
    same = set(full) == set(shard) and all(torch.equal(full[name], shard[name]) for name in full)
    report["export"] = {
        "mb": round(sum(t.nbytes for t in full.values()) / 2**20, 1),
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in full.values()}),
        # what a version published in the rollout's bf16 would carry (issue 28)
        "bf16_mb": round(sum(t.numel() * 2 for t in full.values()) / 2**20, 1),
        "tensors": len(full),
        "export_weights_s": round(full_s, 3),
        "export_shard_s": round(shard_s, 3),
        "same_bytes": same,
    }
    rec.put(size, report)
    say("fsdp", f"{size} export: full {full_s:.2f} s, own shard {shard_s:.2f} s, same {same}")
    del engine, full, shard
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # The same step with `trainer.activation_checkpointing`: what it saves, what it costs.
    if args.tiny or rec.left() > CHECKPOINTED_NEEDS_S:
        engine = FSDPTrainEngine(
            model_dir, lr=1e-6, device=device, dtype=torch.bfloat16, activation_checkpointing=True
        )
        report["train_activation_checkpointing"] = timed_steps(args, engine, batch, params)
        rec.put(size, report)
        say(
            "fsdp",
            f"{size} with activation checkpointing: {report['train_activation_checkpointing']}",
        )
        del engine
    else:
        report["train_activation_checkpointing"] = {"skipped": f"{rec.left():.0f}s left"}
        rec.put(size, report)
    shutil.rmtree(model_dir, ignore_errors=True)
