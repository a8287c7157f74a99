"""`python -m ops.reference_loop [--steps N]`: the algorithm without the bus, in one process.

What the whole pipeline does, as one synchronous loop over the same engines, task, reward and
config (the baseline `ops.bench.learn` measures the pipeline against; docs/walkthrough.md sets
the two side by side):

    for each step:
        until the step holds prompts_per_step groups that carry an advantage:
            prompts     <- the dataset                          (producers.gate.Producer.feed)
            samples     <- engine.generate(prompts, n)          (consumers.rollout.Rollout.handle)
            rewards     <- reward(text, task) per sample        (consumers.reward.reward_handler)
            drop groups whose rewards are all equal             (consumers.buffer.Group.drop_reason)
            advantages  <- grpo(rewards) per group              (consumers.buffer.Buffer.advantages)
        micro-batches   <- pack_step(rows)                (consumers.buffer.Buffer.publish_step)
        trainer.train_step(micro-batches)                       (consumers.trainer.Trainer.train)
        engine.load_state_dict(trainer.export_weights())        (the weights sender -> receiver)

Nothing here is asynchronous: generation waits for training and training for generation, every
sample is on-policy (staleness 0), and nothing survives a crash. That is what the pipeline adds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from consumers.packing import Row, pack_step
from consumers.reward_pool import parse_spec
from engines.algorithms.advantages import grpo
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import MicroBatch, SamplingParams
from engines.torch_train import LossConfig, TorchTrainEngine
from producers.datasets import records
from schemas.config import RunConfig


def micro_batch(arrays: Any) -> MicroBatch:
    """One packed micro-batch as the train engine takes it: [rows, tokens] tensors."""
    return MicroBatch(
        torch.from_numpy(arrays.input_ids).long(),
        torch.from_numpy(arrays.attention_mask).long(),
        torch.from_numpy(arrays.loss_mask).float(),
        torch.from_numpy(arrays.advantages),
        torch.from_numpy(arrays.behaviour_logprobs),
    )


def run(
    cfg: RunConfig, steps: int, on_step: Callable[[int, float], None] | None = None
) -> dict[str, Any]:
    """Train `steps` steps of `cfg` synchronously; the figures `ops.bench.learn` compares."""
    from transformers import AutoTokenizer

    from engines.model_source import resolve_model_path

    model = resolve_model_path(cfg.model.path, cfg.model.revision)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rollout = HFRolloutEngine(model, seed=cfg.data.seed)
    algo, s = cfg.algorithm, cfg.data.sampling
    loss = LossConfig(eps_low=algo.clip_low, eps_high=algo.clip_high, temperature=s.temperature)
    trainer = TorchTrainEngine(model, lr=algo.lr, seed=cfg.trainer.seed, loss=loss)
    params = SamplingParams(s.temperature, s.top_p, s.max_tokens, s.stop_token_ids)
    module, name = parse_spec(cfg.data.reward)
    score = getattr(importlib.import_module(module), name)
    source: Iterator[tuple[Any, ...]] = records(cfg.data, 0)
    per_step = algo.prompts_per_step * cfg.data.n
    rewards_by_step: list[float] = []
    step_ends: list[float] = []
    started = time.perf_counter()
    for step in range(1, steps + 1):
        rows: list[Row] = []
        while len(rows) < per_step:
            # Dynamic sampling, as the buffer and the gate do: a group of equal rewards is
            # dropped and another prompt generated in its place, one batch for all missing.
            missing = algo.prompts_per_step - len(rows) // cfg.data.n
            batch = [next(source)[2] for _ in range(missing)]
            prompt_ids = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in batch]
            groups = rollout.generate(prompt_ids, cfg.data.n, params)  # [prompt][sample]
            for record, ids, samples in zip(batch, prompt_ids, groups, strict=True):
                texts = [
                    tokenizer.decode(x.token_ids.tolist(), skip_special_tokens=True)
                    for x in samples
                ]
                rewards = [score(text, record["task"]) for text in texts]
                if algo.drop_equal_reward_groups and len(set(rewards)) == 1:
                    continue
                advantages = grpo(torch.tensor(rewards)).tolist()  # [n]
                for sample, reward, adv in zip(samples, rewards, advantages, strict=True):
                    response = sample.token_ids.numpy().astype("int32")
                    prompt = torch.tensor(ids, dtype=torch.int32).numpy()
                    behaviour = sample.logprobs.numpy()
                    versions = np.zeros_like(response)  # every token from the current weights
                    rows.append(Row("", prompt, response, behaviour, versions, adv, reward, ""))
        rewards_by_step.append(sum(r.reward for r in rows) / len(rows))
        (micro_batches,) = pack_step(rows, 1, cfg.trainer.micro_batch_tokens)  # one rank
        trainer.train_step([micro_batch(m) for m in micro_batches])
        rollout.load_state_dict(trainer.export_weights())  # the next step is on-policy
        step_ends.append(time.perf_counter())
        if on_step is not None:
            on_step(step, rewards_by_step[-1])
    seconds = time.perf_counter() - started
    tenth = max(1, steps // 10)
    steady = step_ends[-1] - step_ends[0] if steps > 1 else 0.0
    return {
        "seconds": seconds,
        "samples_per_s": steps * per_step / seconds,
        "steady_samples_per_s": (steps - 1) * per_step / steady if steady > 0 else 0.0,
        "reward_start": sum(rewards_by_step[:tenth]) / tenth,
        "reward_end": sum(rewards_by_step[-tenth:]) / tenth,
    }


def main(argv: list[str] | None = None) -> None:
    import tempfile

    from producers.launcher import prepare
    from producers.prompts import BUILTIN
    from schemas.config import load_config

    doc = (__doc__ or "").split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m ops.reference_loop", description=doc)
    parser.add_argument("--steps", type=int, default=None, help="steps (default: the config's)")
    args = parser.parse_args(argv)
    cfg = load_config(BUILTIN)
    steps = args.steps or cfg.trainer.steps
    with tempfile.TemporaryDirectory() as tmp:

        def progress(step: int, reward: float) -> None:
            print(f"step {step}/{steps}: reward {reward:.3f}", flush=True)

        figures = run(prepare(cfg, Path(tmp)), steps, progress)
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
