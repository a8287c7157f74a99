"""The GPU check's fsdp section: the FSDP2 train engine on one device, one rank.

Called by `ops.gpu_check` in a child process (its own default process group, world size 1,
over a file store in the section's scratch directory). On the Qwen2-0.5B shape in bf16
mixed precision (a tiny one with `--tiny`/`--cpu-smoke`): train steps per second and tokens
per second, peak device memory, and the seconds to export the weights the two ways the
trainer does (`export_weights`, gathered to rank 0; `export_shard`, each rank its own
tensors), with the exported bytes checked equal.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from ops.gpu.record import Record, say
from ops.gpu.sections import (
    _peak_gib,
    _reset_peak,
    _sync,
    qwen2_config,
    save_random_model,
)


def fsdp(args: argparse.Namespace, rec: Record) -> None:
    import torch
    import torch.distributed as dist

    from engines.delta_plan import assign_shards
    from engines.fsdp_train import FSDPTrainEngine, init_group
    from engines.protocols import MicroBatch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA not available")
    config = qwen2_config(args.tiny)
    model_dir = args.work / "model"
    params = save_random_model(config, args.device, model_dir)
    init_group(dist.FileStore(str(args.work / "store"), 1), 0, 1, device, timeout=120.0)
    try:
        started = time.monotonic()
        engine = FSDPTrainEngine(model_dir, lr=1e-6, device=device, dtype=torch.bfloat16)
        rec.put(
            "setup",
            {
                "params": params,
                "world_size": 1,
                "backend": dist.get_backend(),
                "build_s": round(time.monotonic() - started, 2),
            },
        )
        rows, width = (2, 64) if args.tiny else (8, 1024)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size - 1, (rows, width), generator=gen)
        loss_mask = torch.zeros(rows, width, dtype=torch.long)
        loss_mask[:, width // 2 :] = 1
        batch = MicroBatch(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            loss_mask=loss_mask,
            advantages=torch.randn(rows, generator=gen),
            behaviour_logprobs=-torch.rand(rows, width, generator=gen) * loss_mask,
        )
        engine.train_step([batch])  # warm-up
        _reset_peak(args.device)
        _sync(args.device)
        timed = 2 if args.tiny else 3
        t0 = time.monotonic()
        for _ in range(timed):
            metrics = engine.train_step([batch])
        _sync(args.device)
        seconds = (time.monotonic() - t0) / timed
        train: dict[str, Any] = {
            "rows": rows,
            "width": width,
            "compute_dtype": "bfloat16",
            "s_per_step": round(seconds, 4),
            "tokens_per_s": round(rows * width / seconds, 1),
            "peak_gib": _peak_gib(args.device),
            "loss_finite": math.isfinite(metrics["loss"]),
        }
        rec.put("train", train)
        say(
            "fsdp",
            f"train: {seconds:.3f} s/step, {rows * width / seconds:,.0f} tok/s, "
            f"peak {train['peak_gib']} GiB",
        )

        t0 = time.monotonic()
        full = engine.export_weights()
        full_s = time.monotonic() - t0
        t0 = time.monotonic()
        shard = engine.export_shard(assign_shards(engine.weight_sizes(), 1))
        shard_s = time.monotonic() - t0
        same = set(full) == set(shard) and all(
            torch.equal(full[name], shard[name]) for name in full
        )
        rec.put(
            "export",
            {
                "mb": round(sum(t.nbytes for t in full.values()) / 2**20, 1),
                "tensors": len(full),
                "export_weights_s": round(full_s, 3),
                "export_shard_s": round(shard_s, 3),
                "same_bytes": same,
            },
        )
        say("fsdp", f"export: full {full_s:.2f} s, own shard {shard_s:.2f} s, same bytes {same}")
    finally:
        dist.destroy_process_group()
