"""`python -m ops.bench.staleness [--quick] [--steps N] [--out DIR]`: does off-policy correction
let stale samples learn as well as fresh ones?

The built-in task (examples/digits.yaml), trained in one process by a loop whose rollout
engine runs the weights of `eta` steps ago (step s samples from version max(0, s - eta)),
for eta in 0, 2, 4, each without correction (PPO whose old policy is the behaviour one) and
with it (decoupled PPO: the ratio against the proximal policy, the truncated IS weight
min(pi_prox / pi_behaviour, 2) against the behaviour one; AReaL). Same seed, task and steps for
all six. Writes the mean reward per step (smoothed) of each to staleness.png and ends with one
JSON line: each run's final reward (mean over the last tenth of its steps) and its mean
clip fraction, IS weight and behaviour/current log-prob gap, and `ratio` = the
corrected eta = 4 run's final reward / the uncorrected eta = 0 run's (AReaL, Table 3, expects ~1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
from collections import deque
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

STALENESS = (0, 2, 4)
TIS_CAP = 2.0


def train(
    cfg: RunConfig, steps: int, eta: int, corrected: bool
) -> tuple[list[float], dict[str, float]]:
    """Mean reward of each step of one run whose samples come from weights `eta` steps old, and
    the run's mean of the off-policy metrics (clip_frac, is_weight_mean, logprob_gap)."""
    from transformers import AutoTokenizer

    from engines.model_source import resolve_model_path

    model = resolve_model_path(cfg.model.path, cfg.model.revision)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rollout = HFRolloutEngine(model, seed=cfg.data.seed)
    algo, s = cfg.algorithm, cfg.data.sampling
    loss = LossConfig(
        eps_low=algo.clip_low,
        eps_high=algo.clip_high,
        temperature=s.temperature,
        tis_cap=TIS_CAP if corrected else None,
    )
    trainer = TorchTrainEngine(model, lr=algo.lr, seed=cfg.trainer.seed, loss=loss)
    params = SamplingParams(s.temperature, s.top_p, s.max_tokens, s.stop_token_ids)
    module, name = parse_spec(cfg.data.reward)
    score = getattr(importlib.import_module(module), name)
    source = records(cfg.data, 0)
    # versions[0] is what generates: after step s the deque holds versions max(0,
    # s + 1 - eta) .. s + 1.
    versions = deque([trainer.export_weights()], maxlen=eta + 1)
    rewards_by_step: list[float] = []
    seen: dict[str, list[float]] = {"clip_frac": [], "is_weight_mean": [], "logprob_gap": []}
    for _ in range(steps):
        rollout.load_state_dict(versions[0])
        batch = [next(source)[2] for _ in range(algo.prompts_per_step)]
        prompt_ids = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in batch]
        rows: list[Row] = []
        for record, ids, samples in zip(
            batch, prompt_ids, rollout.generate(prompt_ids, cfg.data.n, params), strict=True
        ):
            rewards = [
                score(
                    tokenizer.decode(x.token_ids.tolist(), skip_special_tokens=True), record["task"]
                )
                for x in samples
            ]
            for sample, reward, adv in zip(
                samples, rewards, grpo(torch.tensor(rewards)).tolist(), strict=True
            ):
                response = sample.token_ids.numpy().astype("int32")
                rows.append(
                    Row(
                        "",
                        np.asarray(ids, dtype=np.int32),
                        response,
                        sample.logprobs.numpy(),
                        np.zeros_like(response),
                        adv,
                        reward,
                        "",
                    )
                )
        rewards_by_step.append(sum(r.reward for r in rows) / len(rows))
        (micro_batches,) = pack_step(rows, 1, cfg.trainer.micro_batch_tokens)
        stats = trainer.train_step(
            [
                MicroBatch(
                    torch.from_numpy(m.input_ids).long(),
                    torch.from_numpy(m.attention_mask).long(),
                    torch.from_numpy(m.loss_mask).float(),
                    torch.from_numpy(m.advantages),
                    torch.from_numpy(m.behaviour_logprobs),
                )
                for m in micro_batches
            ]
        )
        for key, values in seen.items():
            values.append(stats[key])
        versions.append(trainer.export_weights())
    return rewards_by_step, {key: round(float(np.mean(values)), 4) for key, values in seen.items()}


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rewards in curves.items():
        window = max(1, len(rewards) // 20)
        smooth = np.convolve(rewards, np.ones(window) / window, mode="valid")
        ax.plot(
            np.arange(len(smooth)) + window - 1,
            smooth,
            label=label,
            linestyle="-" if "corrected" in label else "--",
        )
    ax.set_xlabel("step")
    ax.set_ylabel(f"mean reward ({max(1, len(next(iter(curves.values()))) // 20)}-step mean)")
    ax.set_title("built-in task: sample staleness eta, with and without correction")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.staleness", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="a sixth of the built-in run's steps")
    parser.add_argument(
        "--steps", type=int, help="steps per run (overrides the default and --quick)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("."), help="where staleness.png goes (default: here)"
    )
    args = parser.parse_args()
    cfg = load_config(BUILTIN)
    steps = args.steps or (cfg.trainer.steps // 6 if args.quick else cfg.trainer.steps)
    if steps < 1:
        parser.error(f"--steps must be >= 1, got {steps}")
    curves: dict[str, list[float]] = {}
    off_policy: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prepared = prepare(cfg, Path(tmp) / "run")
        for eta in STALENESS:
            for corrected in (False, True):
                label = f"eta {eta}, {'corrected' if corrected else 'uncorrected'}"
                curves[label], off_policy[label] = train(prepared, steps, eta, corrected)
                tenth = max(1, steps // 10)
                print(
                    f"{label}: final reward {np.mean(curves[label][-tenth:]):.3f} "
                    f"{off_policy[label]}",
                    flush=True,
                )
    args.out.mkdir(parents=True, exist_ok=True)
    plot(curves, args.out / "staleness.png")
    tenth = max(1, steps // 10)
    final = {label: round(float(np.mean(r[-tenth:])), 3) for label, r in curves.items()}
    base = final["eta 0, uncorrected"]
    print(
        json.dumps(
            {
                "bench": "staleness",
                "quick": args.quick,
                "steps": steps,
                "final_reward": final,
                "off_policy": off_policy,
                "ratio": round(final["eta 4, corrected"] / base, 3) if base else None,
            }
        )
    )


if __name__ == "__main__":
    main()
