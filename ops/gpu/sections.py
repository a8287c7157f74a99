"""The GPU check's measuring sections: the HF engines and the object-store weight transport.

Called by `ops.gpu_check` in a child process per section (that module owns the budgets and
the report); each writes to its `Record` after every measurement, so a kill keeps the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from ops.gpu.record import Record, say

BF16_DENSE_PEAK = 989e12  # H100/H200 bf16 dense tensor-core FLOP/s, the usual MFU denominator
MB = 1 << 20
T = TypeVar("T")


# --- engines ------------------------------------------------------------------------------


def qwen2_config(tiny: bool, size: str = "0.5B") -> Any:
    """Qwen2-0.5B's shape, Qwen2.5-3B's (`size="3B"`) or a tiny one, built from a config as
    `engines.tiny` does."""
    from transformers import Qwen2Config

    dims: dict[str, Any]
    if tiny:
        dims = dict(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
        )
    elif size == "3B":
        dims = dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=32768,
        )
    else:
        dims = dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
        )
    eos = dims["vocab_size"] - 1
    return Qwen2Config(
        **dims,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def save_random_model(config: Any, device: str, model_dir: Path) -> int:
    """A random-init Qwen2 of `config` saved in bf16 to `model_dir`; its parameter count."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # random init on the device: seconds, not a minute of CPU
        model = Qwen2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    # transformers types `to` through a decorator that mypy reads as unbound.
    model.to("cpu", torch.bfloat16).save_pretrained(model_dir)  # type: ignore[arg-type]
    return params


def random_batch(vocab_size: int, tiny: bool) -> Any:
    """A seeded MicroBatch of random ids, [8, 1024] ([2, 64] with --tiny), loss on its second
    half, as the fsdp and megatron sections step it."""
    import torch

    from engines.protocols import MicroBatch

    rows, width = (2, 64) if tiny else (8, 1024)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size - 1, (rows, width), generator=gen)
    loss_mask = torch.zeros(rows, width, dtype=torch.long)
    loss_mask[:, width // 2 :] = 1
    return MicroBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=loss_mask,
        advantages=torch.randn(rows, generator=gen),
        behaviour_logprobs=-torch.rand(rows, width, generator=gen) * loss_mask,
    )


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> float | None:
    import torch

    return (
        round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.startswith("cuda") else None
    )


def timed_steps(
    args: argparse.Namespace,
    engine: Any,
    batch: Any,
    params: int,
    *,
    compute_dtype: str = "bfloat16",
    warm_up: bool = True,
) -> dict[str, Any]:
    """One warm-up step (unless the caller ran it), then the mean of the timed ones: seconds,
    tokens/s, MFU, peak memory."""
    rows, width = batch.input_ids.shape
    if warm_up:
        engine.train_step([batch])
    _reset_peak(args.device)
    _sync(args.device)
    timed = 2 if args.tiny else 3
    t0 = time.monotonic()
    for _ in range(timed):
        metrics = engine.train_step([batch])
    _sync(args.device)
    seconds = (time.monotonic() - t0) / timed
    return {
        "rows": rows,
        "width": width,
        "compute_dtype": compute_dtype,
        "s_per_step": round(seconds, 4),
        "tokens_per_s": round(rows * width / seconds, 1),
        # dense approximation (6 x params x tokens), attention excluded
        "mfu_vs_bf16_peak": round(6 * params * rows * width / seconds / BF16_DENSE_PEAK, 3),
        "peak_gib": _peak_gib(args.device),
        "loss_finite": math.isfinite(metrics["loss"]),
    }


def engines(args: argparse.Namespace, rec: Record) -> None:
    import gc

    import torch

    from engines.hf_rollout import HFRolloutEngine
    from engines.protocols import MicroBatch, SamplingParams
    from engines.torch_train import TorchTrainEngine

    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("CUDA not available")
    config = qwen2_config(args.tiny)
    model_dir = args.work / "model"
    started = time.monotonic()
    params = save_random_model(config, device, model_dir)
    gc.collect()
    rec.put(
        "model",
        {
            "shape": "tiny" if args.tiny else "Qwen2-0.5B",
            "params": params,
            "vocab": config.vocab_size,
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
            "build_s": round(time.monotonic() - started, 2),
        },
    )
    say("engines", f"model built: {params / 1e6:.1f} M params in {time.monotonic() - started:.1f}s")

    new_tokens, prompt_len = (16, 8) if args.tiny else (256, 32)
    batches = (2, 4) if args.tiny else (8, 64)
    engine = HFRolloutEngine(model_dir, device=device, dtype=torch.bfloat16)
    params_dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    gen = torch.Generator().manual_seed(0)

    def prompts(batch: int) -> list[list[int]]:
        return torch.randint(0, config.vocab_size - 1, (batch, prompt_len), generator=gen).tolist()

    engine.generate(
        prompts(batches[0]), 1, SamplingParams(max_tokens=8)
    )  # warm-up: kernels, allocator
    rollout: list[dict[str, Any]] = []
    for batch in batches:
        if rec.left() < 30:
            rollout.append({"batch": batch, "skipped": f"{rec.left():.0f}s left"})
            break
        _reset_peak(device)
        _sync(device)
        t0 = time.monotonic()
        groups = engine.generate(
            prompts(batch), 1, SamplingParams(temperature=1.0, max_tokens=new_tokens)
        )
        _sync(device)
        seconds = time.monotonic() - t0
        tokens = sum(len(s.token_ids) for g in groups for s in g)
        steps = max(len(s.token_ids) for g in groups for s in g)
        rollout.append(
            {
                "batch": batch,
                "new_tokens": new_tokens,
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1),
                "ms_per_step": round(1000 * seconds / steps, 2),
                "peak_gib": _peak_gib(device),
            }
        )
        rec.put("rollout", {"dtype": params_dtype, "device": device, "runs": rollout})
        say(
            "engines",
            f"rollout batch {batch}: {tokens / seconds:,.0f} tok/s "
            f"({1000 * seconds / steps:.1f} ms/step)",
        )
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    rows, width = (2, 64) if args.tiny else (8, 1024)
    trainer = TorchTrainEngine(model_dir, lr=1e-6, device=device)
    train_dtype = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    ids = torch.randint(0, config.vocab_size - 1, (rows, width), generator=gen)
    loss_mask = torch.zeros(rows, width, dtype=torch.long)
    loss_mask[:, width // 2 :] = 1  # the response half, as after a prompt
    micro_batch = MicroBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=loss_mask,
        advantages=torch.randn(rows, generator=gen),
        behaviour_logprobs=-torch.rand(rows, width, generator=gen) * loss_mask,
    )
    # "float32" is what the product does; the others show what a precision change would buy.
    variants: list[tuple[str, Callable[[], contextlib.AbstractContextManager[Any]], bool]] = [
        ("float32", contextlib.nullcontext, False),
        ("tf32_matmul", contextlib.nullcontext, True),
        (
            "autocast_bf16",
            lambda: torch.autocast(torch.device(device).type, dtype=torch.bfloat16),
            False,
        ),
    ]
    train: dict[str, Any] = {
        "param_dtype": train_dtype,
        "device": device,
        "rows": rows,
        "width": width,
    }
    timed = 2 if args.tiny else 3
    for name, autocast, tf32 in variants:
        if rec.left() < 25:
            train[name] = {"skipped": f"{rec.left():.0f}s left"}
            break
        torch.backends.cuda.matmul.allow_tf32 = tf32
        with autocast():
            trainer.train_step([micro_batch])  # warm-up
            _reset_peak(device)
            _sync(device)
            t0 = time.monotonic()
            for _ in range(timed):
                metrics = trainer.train_step([micro_batch])
            _sync(device)
        seconds = (time.monotonic() - t0) / timed
        tokens = rows * width
        flops = 6 * params * tokens / seconds  # dense approximation, attention excluded
        train[name] = {
            "s_per_step": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 1),
            "tflops": round(flops / 1e12, 1),
            "mfu_vs_bf16_peak": round(flops / BF16_DENSE_PEAK, 3),
            "peak_gib": _peak_gib(device),
            "loss_finite": math.isfinite(metrics["loss"]),
        }
        rec.put("train", train)
        say(
            "engines",
            f"train {name}: {seconds:.3f} s/step, {tokens / seconds:,.0f} tok/s, "
            f"peak {_peak_gib(device)} GiB",
        )
    torch.backends.cuda.matmul.allow_tf32 = False


# --- weights ------------------------------------------------------------------------------


async def within(step: Awaitable[T], rec: Record, what: str) -> T:
    """`step`, cut off 5 s before the section's deadline with an error that names it."""
    limit = rec.left() - 5
    try:
        return await asyncio.wait_for(step, max(limit, 0.1))
    except TimeoutError:
        raise TimeoutError(f"{what} did not finish in {limit:.0f}s") from None


async def _weights(args: argparse.Namespace, rec: Record) -> None:
    import io

    import torch

    from bus.connection import connect
    from bus.embedded import EmbeddedNats
    from bus.topology import Topology
    from consumers.weights.object_store import ObjectStoreTransport
    from consumers.weights.sender import publish_version

    sizes = (1, 4, 8) if args.tiny else (64, 256, 512)
    runs: list[dict[str, Any]] = []
    with EmbeddedNats(args.work / "nats") as server:
        nc = await connect(server.url, "gpu-check")
        try:
            js = nc.jetstream()
            topology = Topology(run="gpucheck")
            await topology.apply(js)
            store = await js.object_store(topology.object_bucket)
            transport = ObjectStoreTransport(js, topology.object_bucket)
            for version, size in enumerate(sizes, start=1):
                if version == 3:  # the optional size: only if the growth seen so far says it fits
                    b = runs[1]
                    exponent = max(
                        1.0, growth_exponent([r["mb"] for r in runs], [r["get_s"] for r in runs])
                    )
                    predicted = (
                        2 * (b["put_s"] + b["get_writeinto_s"])
                        + b["get_s"] * (size / b["mb"]) ** exponent
                    )
                    if predicted * 1.3 > rec.left() - 10:
                        runs.append(
                            {
                                "mb": size,
                                "skipped": f"predicted {predicted:.0f}s, {rec.left():.0f}s left",
                            }
                        )
                        rec.put("runs", runs)
                        break
                numel = size * MB // 4 // 4
                tensors = {
                    f"layer{k}.weight": torch.randn(numel) for k in range(4)
                }  # float32, 4 tensors
                row: dict[str, Any] = {"mb": size}
                t0 = time.monotonic()
                event = await within(
                    publish_version(transport, "gpucheck", "gpu-check", version, tensors),
                    rec,
                    "put",
                )
                row["put_s"] = round(time.monotonic() - t0, 3)
                t0 = time.monotonic()
                await within(
                    store.get(event.location, writeinto=io.BytesIO()), rec, "get into a buffer"
                )
                row["get_writeinto_s"] = round(time.monotonic() - t0, 3)
                runs.append(row)
                rec.put("runs", runs)
                say(
                    "weights",
                    f"{size} MB: put {row['put_s']}s, get into a buffer {row['get_writeinto_s']}s",
                )
                t0 = time.monotonic()
                limit = rec.left() - 5
                try:
                    got = await asyncio.wait_for(transport.fetch(event), limit)
                except TimeoutError:
                    row["get_s"], row["get_timeout_s"] = None, round(limit, 1)
                    rec.put("runs", runs)
                    say("weights", f"{size} MB: fetch did not finish in {limit:.0f}s")
                    break
                row["get_s"] = round(time.monotonic() - t0, 3)
                row["round_trip_exact"] = all(torch.equal(got[k], tensors[k]) for k in tensors)
                for key in ("put", "get", "get_writeinto"):
                    row[f"{key}_mb_per_s"] = round(size / row[f"{key}_s"], 1)
                rec.put("runs", runs)
                say("weights", f"{size} MB: fetch {row['get_s']}s ({row['get_mb_per_s']} MB/s)")
                await store.delete(event.location)
                del tensors, got
        finally:
            await nc.close()
    done = [r for r in runs if r.get("get_s")]
    growth: dict[str, Any] = {
        "note": "least-squares slope of log(time) on log(size): 1 is linear, 2 is quadratic"
    }
    if len(done) >= 2:
        mbs = [r["mb"] for r in done]
        growth.update(
            sizes_mb=mbs,
            get_version_exponent=growth_exponent(mbs, [r["get_s"] for r in done]),
            get_writeinto_exponent=growth_exponent(mbs, [r["get_writeinto_s"] for r in done]),
            put_exponent=growth_exponent(mbs, [r["put_s"] for r in done]),
        )
    timed_out = [r for r in runs if r.get("get_timeout_s")]
    if done and timed_out:  # a get cut off at its limit still bounds the growth from below
        a, b = done[-1], timed_out[0]
        growth["get_version_exponent_at_least"] = growth_exponent(
            [a["mb"], b["mb"]], [a["get_s"], b["get_timeout_s"]]
        )
    rec.put("growth", growth)


def growth_exponent(sizes: list[float], seconds: list[float]) -> float:
    """The k in time ~ size^k: slope of the least-squares line through (log size, log time)."""
    xs, ys = [math.log(v) for v in sizes], [math.log(max(t, 1e-6)) for t in seconds]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return round(
        sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
        / sum((x - mx) ** 2 for x in xs),
        2,
    )


def weights(args: argparse.Namespace, rec: Record) -> None:
    asyncio.run(_weights(args, rec))
