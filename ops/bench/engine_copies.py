"""`python -m ops.bench.engine_copies [--quick] [--copies N] [--repeats R]`:
what engine copies in one rollout worker buy.

The rollout worker's own copy layer (`consumers.rollout_copies.EngineCopies`: the router, a
batcher per copy, generation in threads) with the tiny HF model on this machine's CPU,
one torch thread per generation as the worker sets it: all prompts submitted at once, the
time until the last is generated. Baseline in the same run: one copy. Each set-up is
timed `--repeats` times, alternating, and the median kept. Tokens counted are response
tokens (sampling at temperature 1 stops at eos, so lengths vary; every set-up draws with
the same seeds). ratio = response tokens/s with N copies / with one (least_in_flight).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from opentelemetry import context

from consumers.rollout_copies import EngineCopies, Pending
from engines.hf_rollout import HFRolloutEngine
from engines.router import make_router
from engines.tiny import build_tiny_model
from producers.tasks import VOCAB
from schemas import PromptEvent, Tensor
from schemas import SamplingParams as PromptSampling

SIZES = {"quick": {"prompts": 24, "max_tokens": 24}, "full": {"prompts": 96, "max_tokens": 48}}
BATCH = 8
"""rollout.max_batch_prompts."""
N = 4
"""Samples per prompt."""


def prompts(count: int, max_tokens: int) -> list[PromptEvent]:
    rng = np.random.default_rng(0)
    return [
        PromptEvent(
            id=f"bench/0/{i}",
            run="bench",
            epoch=0,
            index=i,
            n=N,
            token_ids=Tensor.from_numpy(rng.integers(3, len(VOCAB), 12).astype(np.int32)),
            sampling=PromptSampling(max_tokens=max_tokens),
        )
        for i in range(count)
    ]


async def generate_all(
    model_dir: Path, copies: int, events: list[PromptEvent]
) -> tuple[float, int]:
    """(seconds, response tokens) to generate `events` on `copies` fresh copies."""
    engines = [HFRolloutEngine(model_dir, seed=i) for i in range(copies)]
    layer = EngineCopies(engines, make_router("least_in_flight", copies), BATCH, "hf", "bench")
    layer.open_for_requests.set()
    batchers = [asyncio.create_task(layer.batcher(r)) for r in layer.copies]
    loop = asyncio.get_running_loop()
    try:
        started = time.perf_counter()
        # `prompts` gives every event its token ids.
        pending = [
            Pending(
                e,
                e.token_ids.numpy().astype(int).tolist(),  # type: ignore[union-attr]
                started,
                loop.create_future(),
                context.get_current(),
            )
            for e in events
        ]
        results = await asyncio.gather(*(layer.submit(p, p.prompt.id) for p in pending))
        seconds = time.perf_counter() - started
    finally:
        for task in batchers:
            task.cancel()
        await asyncio.gather(*batchers, return_exceptions=True)
    return seconds, sum(len(s.token_ids) for samples, _, _ in results for s in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts, shorter responses")
    parser.add_argument("--copies", type=int, default=2, help="copies measured against one")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as `python -m consumers.rollout` does
    size = SIZES["quick" if args.quick else "full"]
    events = prompts(size["prompts"], size["max_tokens"])
    runs: dict[int, list[tuple[float, int]]] = {1: [], args.copies: []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", VOCAB)
        asyncio.run(
            generate_all(model_dir, 1, events[:BATCH])
        )  # warm-up: first-call costs out of the figures
        for _ in range(args.repeats):
            for copies, timed in runs.items():
                timed.append(asyncio.run(generate_all(model_dir, copies, events)))
    rate = {
        r: statistics.median(tokens / seconds for seconds, tokens in timed)
        for r, timed in runs.items()
    }
    figures = {
        "bench": "copies",
        "quick": args.quick,
        "prompts": len(events),
        "n": N,
        "max_batch_prompts": BATCH,
        "max_tokens": size["max_tokens"],
        "torch_threads": 1,
        "repeats": args.repeats,
        "tokens_per_s_1": round(rate[1], 1),
        f"tokens_per_s_{args.copies}": round(rate[args.copies], 1),
        "seconds_1": [round(s, 3) for s, _ in runs[1]],
        f"seconds_{args.copies}": [round(s, 3) for s, _ in runs[args.copies]],
        "ratio": round(rate[args.copies] / rate[1], 3),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
