"""The GPU check's megatron and nccl sections: megatron-core on one device, and the NCCL
broadcast between two processes.

Called by `ops.gpu_check` in a child process per section.

    megatron  MegatronTrainEngine, TP = PP = 1 (its own one-rank NCCL group), the Qwen2-0.5B
              shape in bf16 compute: step time, tokens/s, MFU, peak memory
    nccl      two processes broadcast float32 buckets (the collective transport's unit, 64 MiB)
              rank 0 -> rank 1 over NCCL: GB/s. With one GPU both ranks sit on the same device,
              which NCCL may refuse ("duplicate GPU"); the refusal is then the figure, in one line.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from ops.gpu.record import Record, say
from ops.gpu.sections import (
    qwen2_config,
    random_batch,
    save_random_model,
    timed_steps,
)


def megatron(args: argparse.Namespace, rec: Record) -> None:
    import torch

    from engines.megatron_train import MegatronTrainEngine

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA not available")
    try:
        import megatron.core
    except ImportError:
        rec.put("skipped", "megatron-core not installed (pip install 'jetrl[megatron]')")
        return

    config = qwen2_config(args.tiny)
    model_dir = args.work / "model"
    params = save_random_model(config, args.device, model_dir)
    batch = random_batch(config.vocab_size, args.tiny)
    # bf16 compute (autocast) is what `model.dtype: bfloat16` runs; float32 is the fallback
    # figure when it fails (on the CPU megatron's linear layers refuse autocast's bf16 input).
    engine: MegatronTrainEngine | None = None
    build_s = 0.0
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        try:
            if engine is None:
                started = time.monotonic()
                engine = MegatronTrainEngine(model_dir, lr=1e-6, device=device, dtype=dtype)
                build_s = time.monotonic() - started
            engine.compute_dtype = dtype  # the same engine, the other autocast
            engine.train_step([batch])  # warm-up
        except Exception as exc:  # noqa: BLE001 - recorded; the next dtype may still run
            rec.put(f"error_{name}", f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300])
            say("megatron", f"{name}: {rec.data[f'error_{name}']}")
            continue
        rec.put(
            "setup",
            {
                "megatron_core": getattr(megatron.core, "__version__", None),
                "params": params,
                "tp": 1,
                "pp": 1,
                "build_s": round(build_s, 2),
            },
        )
        train = timed_steps(args, engine, batch, params, compute_dtype=name, warm_up=False)
        rec.put("train", train)
        say(
            "megatron",
            f"train {name}: {train['s_per_step']:.3f} s/step, {train['tokens_per_s']:,.0f} tok/s",
        )
        break
    if engine is None or "train" not in rec.data:
        raise RuntimeError("megatron trained in neither bfloat16 nor float32")
    t0 = time.monotonic()
    full = engine.export_weights()
    rec.put(
        "export",
        {
            "mb": round(sum(t.nbytes for t in full.values()) / 2**20, 1),
            "tensors": len(full),
            "export_weights_s": round(time.monotonic() - t0, 3),
        },
    )
    # `trainer.activation_checkpointing`: megatron's full recompute, which forks the CUDA RNG
    # tracker (the path the CPU tests cannot take), in the dtype that ran above.
    del engine, full
    if args.tiny or rec.left() > 30:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()  # the next engine builds its own
        checkpointed = MegatronTrainEngine(
            model_dir, lr=1e-6, device=device, dtype=dtype, activation_checkpointing=True
        )
        checkpointed_train = timed_steps(
            args, checkpointed, batch, params, compute_dtype=str(dtype).removeprefix("torch.")
        )
        rec.put("train_activation_checkpointing", checkpointed_train)
        seconds = checkpointed_train["s_per_step"]
        say("megatron", f"with activation checkpointing: {seconds:.3f} s/step")


def _broadcast_rank(rank: int, init: str, device: str, mb: int, repeats: int, out: Any) -> None:
    """One rank of the two: rank 0 sends `repeats` buckets of `mb` MiB, rank 1 receives."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(torch.device(device))
    try:
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
        bucket = torch.full((mb << 18,), float(rank), device=device)  # float32: 4 bytes each
        dist.broadcast(bucket, src=0)  # warm-up: the communicator is built lazily here
        torch.cuda.synchronize()
        t0 = time.monotonic()
        for _ in range(repeats):
            dist.broadcast(bucket, src=0)
        torch.cuda.synchronize()
        seconds = time.monotonic() - t0
        out.put({"rank": rank, "seconds": seconds, "ok": bool((bucket == 0).all().item())})
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - the parent reports the refusal in one line
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"})


def nccl(args: argparse.Namespace, rec: Record) -> None:
    import multiprocessing as mp

    import torch

    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        rec.put("skipped", f"needs CUDA, device is {args.device}")
        return
    devices = torch.cuda.device_count()
    # Two GPUs: one rank each, as trainer and rollout. One: both on cuda:0 (NCCL may refuse).
    placement = ["cuda:0", "cuda:1" if devices > 1 else "cuda:0"]
    mb, repeats = 64, 16
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    init = f"file://{args.work / 'nccl_store'}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_broadcast_rank, args=(r, init, placement[r], mb, repeats, results))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + max(rec.left() - 5, 5)
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=1))
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting until the deadline
            if not any(p.is_alive() for p in procs) and results.empty():
                break
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    report: dict[str, Any] = {"gpus": devices, "placement": placement, "bucket_mb": mb}
    errors = [g["error"] for g in got if "error" in g]
    if errors or len(got) < 2:
        report["error"] = (errors or [f"{len(got)} of 2 ranks answered in time"])[0][:400]
    else:
        seconds = max(g["seconds"] for g in got)
        report.update(
            seconds=round(seconds, 4),
            gb_per_s=round(mb * repeats * 2**20 / seconds / 1e9, 2),
            received_ok=all(g["ok"] for g in got),
        )
    rec.put("broadcast", report)
    say("nccl", str(report))
