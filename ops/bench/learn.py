"""`python -m ops.bench.learn [--quick]`: the built-in job end to end, against a synchronous loop.

Runs `python -m producers.prompts` (embedded server, local fleet, built-in reverse task)
and reads its summary: reward at the start and the end, wall time, trained samples/s.
The baseline, measured in the same run, is the synchronous loop verl-style trainers use,
in one process with the same engines, task, config and step count: generate -> score ->
advantages -> train -> load weights. ratio = our samples/s / the synchronous loop's.

Both run the same algorithm: with `algorithm.drop_equal_reward_groups` (dynamic sampling, on
in the built-in config) the pipeline's buffer drops a group whose rewards are all equal and the
gate issues another prompt in its place, so the loop too generates more prompts until a step
holds `prompts_per_step` groups that carry an advantage. `steady_ratio` compares the two from
the end of their first step to the end of their last: the loop's clock starts with its engines
built, the job's with the processes still importing torch and loading the model.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from consumers.packing import Row, pack_step
from consumers.reward_pool import parse_spec
from engines.algorithms.advantages import grpo
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import MicroBatch, SamplingParams
from engines.torch_train import LossConfig, TorchTrainEngine
from producers.datasets import records
from producers.launcher import prepare
from producers.prompts import BUILTIN
from schemas.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parent.parent.parent


def run_job(steps: int, out: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "producers.prompts", "--steps", str(steps), "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    # The steps' own metrics (producers.report): samples and the time each step was trained.
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    span = metrics[-1]["time"] - metrics[0]["time"] if len(metrics) > 1 else 0.0
    summary["steady_samples_per_s"] = sum(m["samples"] for m in metrics[1:]) / span if span > 0 else 0.0
    return summary


def sync_loop(cfg: RunConfig, steps: int) -> dict:
    """The synchronous baseline: every stage waits for the one before it."""
    from transformers import AutoTokenizer

    from engines.model_source import resolve_model_path

    model = resolve_model_path(cfg.model.path, cfg.model.revision)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rollout = HFRolloutEngine(model, seed=cfg.data.seed)
    algo, s = cfg.algorithm, cfg.data.sampling
    trainer = TorchTrainEngine(model, lr=algo.lr, seed=cfg.trainer.seed,
                               loss=LossConfig(eps_low=algo.clip_low, eps_high=algo.clip_high, temperature=s.temperature))
    params = SamplingParams(s.temperature, s.top_p, s.max_tokens, s.stop_token_ids)
    module, name = parse_spec(cfg.data.reward)
    score = getattr(importlib.import_module(module), name)
    source = records(cfg.data, 0)
    rewards_by_step: list[float] = []
    step_ends: list[float] = []
    started = time.perf_counter()
    for _ in range(steps):
        rows: list[Row] = []
        while len(rows) < algo.prompts_per_step * cfg.data.n:
            # Dynamic sampling, as the buffer does: a group of equal rewards is dropped and
            # another prompt generated in its place, in one batch for all the missing groups.
            missing = algo.prompts_per_step - len(rows) // cfg.data.n
            batch = [next(source)[2] for _ in range(missing)]
            prompt_ids = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in batch]
            groups = rollout.generate(prompt_ids, cfg.data.n, params)
            for record, ids, samples in zip(batch, prompt_ids, groups, strict=True):
                rewards = [score(tokenizer.decode(x.token_ids.tolist(), skip_special_tokens=True), record["task"]) for x in samples]
                if algo.drop_equal_reward_groups and len(set(rewards)) == 1:
                    continue
                for sample, reward, adv in zip(samples, rewards, grpo(torch.tensor(rewards)).tolist(), strict=True):
                    response = sample.token_ids.numpy().astype("int32")
                    rows.append(Row("", torch.tensor(ids, dtype=torch.int32).numpy(), response,
                                    sample.logprobs.numpy(), np.zeros_like(response), adv, reward, ""))
        rewards_by_step.append(sum(r.reward for r in rows) / len(rows))
        (micro_batches,) = pack_step(rows, 1, cfg.trainer.micro_batch_tokens)
        trainer.train_step([
            MicroBatch(torch.from_numpy(m.input_ids).long(), torch.from_numpy(m.attention_mask).long(),
                       torch.from_numpy(m.loss_mask).float(), torch.from_numpy(m.advantages),
                       torch.from_numpy(m.behaviour_logprobs))
            for m in micro_batches
        ])
        rollout.load_state_dict(trainer.export_weights())
        step_ends.append(time.perf_counter())
    seconds = time.perf_counter() - started
    tenth = max(1, steps // 10)
    per_step = algo.prompts_per_step * cfg.data.n
    return {
        "seconds": seconds,
        "samples_per_s": steps * per_step / seconds,
        "steady_samples_per_s": (steps - 1) * per_step / (step_ends[-1] - step_ends[0]) if steps > 1 else 0.0,
        "reward_start": sum(rewards_by_step[:tenth]) / tenth,
        "reward_end": sum(rewards_by_step[-tenth:]) / tenth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m ops.bench.learn", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="half the steps (about 3 minutes; the reward has only begun to climb)")
    args = parser.parse_args()
    cfg = load_config(BUILTIN)
    steps = cfg.trainer.steps // 2 if args.quick else cfg.trainer.steps
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_job(steps, Path(tmp) / "job")
        print(f"jetrl:     {json.dumps(ours)}", flush=True)
        baseline = sync_loop(prepare(cfg, Path(tmp) / "sync"), steps)
        print(f"sync loop: {json.dumps(baseline)}", flush=True)
    print(json.dumps({
        "bench": "learn",
        "quick": args.quick,
        "steps": steps,
        "reward_start": round(ours["reward_start"], 3),
        "reward_end": round(ours["reward_end"], 3),
        "wall_seconds": round(ours["seconds"], 1),
        "samples_per_s": round(ours["samples_per_s"], 1),
        "sync_samples_per_s": round(baseline["samples_per_s"], 1),
        "sync_reward_end": round(baseline["reward_end"], 3),
        "ratio": round(ours["samples_per_s"] / baseline["samples_per_s"], 3),
        "steady_samples_per_s": round(ours["steady_samples_per_s"], 1),
        "sync_steady_samples_per_s": round(baseline["steady_samples_per_s"], 1),
        "steady_ratio": round(ours["steady_samples_per_s"] / baseline["steady_samples_per_s"], 3),
    }))


if __name__ == "__main__":
    main()
