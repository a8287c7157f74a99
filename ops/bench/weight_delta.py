"""`python -m ops.bench.weight_delta [--quick] [--out DIR]`: delta versions after one AdamW step.

Model: a random-init Qwen2 from `engines.tiny.build_tiny_model`, about 480 MiB in bf16
(60 MiB with `--quick`). Update: one real AdamW step at lr 1e-6 on random tokens, in two
set-ups: float32 master weights published as bf16 (how a trainer serves bf16), and a model
trained in bf16 itself. Per set-up: delta bytes / full bytes, the fraction of elements that
changed, encode speed with 1 rank and with 4 (the slowest rank's shard: ranks encode in
parallel), decode speed (every shard applied and verified by one worker). MB/s count the
full version's bytes. Baseline in the same run: the full version as `engines.weights.pack` /
`unpack` handle it (safetensors + sha256 per tensor). ratio = delta bytes / full bytes of the
float32-master set-up (issue 11's `delta_bytes_ratio`; its target is <= 0.1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load
from transformers import AutoModelForCausalLM

from engines.delta_plan import assign_shards
from engines.tiny import build_tiny_model
from engines.weight_delta import apply_delta, encode_shard, read_shard
from engines.weights import manifest_of, serialize, verify
from producers.tasks import VOCAB

Weights = dict[str, torch.Tensor]


def pack(tensors: Weights) -> tuple[bytes, tuple]:
    """A full version as the transports publish it: safetensors bytes and the manifest
    (sha256 per tensor)."""
    return serialize(tensors), manifest_of(tensors)


def unpack(data: bytes, manifest: tuple) -> Weights:
    """A full version as a reader loads it: parsed and checked against the manifest."""
    tensors = load(data)
    verify(tensors, manifest)
    return tensors


MODELS = {
    "quick": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4},
    "full": {"hidden": 1024, "layers": 16, "heads": 16, "kv_heads": 8},
}
SETUPS = {
    "fp32_master_bf16": torch.float32,
    "bf16": torch.bfloat16,
}  # name -> dtype trained in; published as bf16


def adamw_step(model_dir: Path, train: torch.dtype, lr: float = 1e-6) -> tuple[Weights, Weights]:
    """(before, after) one AdamW step at `lr` on random tokens, both as bf16 copies."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=train)
    before = {
        n: p.detach().to(torch.bfloat16, copy=True).contiguous()
        for n, p in model.named_parameters()
    }
    ids = torch.randint(0, len(VOCAB), (2, 64), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=lr).step()
    return before, {
        n: p.detach().to(torch.bfloat16, copy=True).contiguous()
        for n, p in model.named_parameters()
    }


def timed(fn: Callable[[], object], repeat: int, setup: Callable[[], None] = lambda: None) -> float:
    """Median seconds of `fn` over `repeat` runs, `setup` run untimed before each."""
    times = []
    for _ in range(repeat):
        setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def unchanged(before: Weights, after: Weights) -> dict:
    """Tensors whose published bytes one step left as they were (what the rollout's engine is
    not sent again, issue 28): their count and their share of the version's bytes."""
    same = [
        n for n, t in after.items() if torch.equal(before[n].view(torch.int16), t.view(torch.int16))
    ]
    return {
        "tensors": len(after),
        "unchanged_tensors": len(same),
        "unchanged_bytes_fraction": sum(after[n].nbytes for n in same)
        / sum(t.nbytes for t in after.values()),
        "unchanged_names": same,
    }


def measure(before: Weights, after: Weights, repeat: int) -> dict:
    full_mb = sum(t.nbytes for t in after.values()) / 1e6
    figures: dict = {
        **unchanged(before, after),
        "changed_fraction": sum(
            int((before[n].view(torch.int16) != t.view(torch.int16)).sum())
            for n, t in after.items()
        )
        / sum(t.numel() for t in after.values()),
    }
    for world in (1, 4):
        shards = assign_shards({n: t.nbytes for n, t in after.items()}, world)
        encode = [
            lambda r=r, names=names, w=world: encode_shard(
                before, after, names, version=1, base_version=0, rank=r, world=w
            )
            for r, names in enumerate(shards)
        ]
        slowest = max(timed(fn, repeat) for fn in encode)
        figures[f"encode_mb_per_s_world{world}"] = full_mb / slowest
    out = [fn() for fn in encode]  # world 4: what the worker fetches
    payloads, manifest = [p for p, _ in out], [s for _, specs in out for s in specs]
    weights: Weights = {}

    def fresh() -> None:
        weights.clear()
        weights.update({n: t.clone() for n, t in before.items()})

    figures["decode_mb_per_s"] = full_mb / timed(
        lambda: apply_delta(weights, payloads, manifest, version=1, base_version=0), repeat, fresh
    )
    assert all(
        torch.equal(weights[n].view(torch.int16), after[n].view(torch.int16)) for n in after
    ), "not bit-exact"
    figures["delta_bytes_ratio"] = sum(map(len, payloads)) / (full_mb * 1e6)
    encodings: dict[str, int] = {}
    for payload in payloads:
        for entry in read_shard(payload)[0].tensors:
            encodings[entry.encoding] = encodings.get(entry.encoding, 0) + 1
    figures["encodings"] = encodings
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 MiB model instead of 480 MiB")
    parser.add_argument("--out", type=Path, help="also write weight_delta.json here")
    args = parser.parse_args()
    torch.manual_seed(0)
    repeat = 3
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(
            Path(tmp) / "model", VOCAB, **MODELS["quick" if args.quick else "full"]
        )
        steps = {name: adamw_step(model_dir, train) for name, train in SETUPS.items()}
    setups = {name: measure(before, after, repeat) for name, (before, after) in steps.items()}
    after = steps["fp32_master_bf16"][1]
    data, manifest = pack(after)
    full_mb = len(data) / 1e6
    figures = {
        "quick": args.quick,
        "model_mb": round(full_mb, 1),
        "tensors": len(after),
        "setups": setups,
        "full_pack_mb_per_s": full_mb / timed(lambda: pack(after), repeat),
        "full_unpack_mb_per_s": full_mb / timed(lambda: unpack(data, manifest), repeat),
        "delta_bytes_ratio": setups["fp32_master_bf16"]["delta_bytes_ratio"],
    }
    figures["ratio"] = figures["delta_bytes_ratio"]
    line = json.dumps(figures)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "weight_delta.json").write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
