"""`python -m ops.bench.learn [--quick]`: the built-in job end to end, against a synchronous loop.

Runs `python -m producers.prompts` (embedded server, local fleet, built-in reverse task)
and reads its summary: reward at the start and the end, wall time, trained samples/s.
The baseline, measured in the same run, is the synchronous loop verl-style trainers use,
in one process with the same engines, task, config and step count (`ops.reference_loop`,
the algorithm without the bus): generate -> score ->
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
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ops import reference_loop
from producers.launcher import prepare
from producers.prompts import BUILTIN
from schemas.config import load_config

ROOT = Path(__file__).resolve().parent.parent.parent


def run_job(steps: int, out: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "producers.prompts", "--steps", str(steps), "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    # The steps' own metrics (producers.report): samples and the time each step was trained.
    metrics = [
        json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line
    ]
    span = metrics[-1]["time"] - metrics[0]["time"] if len(metrics) > 1 else 0.0
    summary["steady_samples_per_s"] = (
        sum(m["samples"] for m in metrics[1:]) / span if span > 0 else 0.0
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.learn", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="half the steps (about 3 minutes; the reward has only begun to climb)",
    )
    args = parser.parse_args()
    cfg = load_config(BUILTIN)
    steps = cfg.trainer.steps // 2 if args.quick else cfg.trainer.steps
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_job(steps, Path(tmp) / "job")
        print(f"jetrl:     {json.dumps(ours)}", flush=True)
        baseline = reference_loop.run(prepare(cfg, Path(tmp) / "sync"), steps)
        print(f"sync loop: {json.dumps(baseline)}", flush=True)
    print(
        json.dumps(
            {
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
                "steady_ratio": round(
                    ours["steady_samples_per_s"] / baseline["steady_samples_per_s"], 3
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
