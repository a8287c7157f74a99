"""The built-in job with `algorithm.advantage: gae`: the buffer hands the trainer each sample's
outcome reward, the trainer's critic turns them into token advantages, and every step's critic
metrics reach the run's metrics file; the run's checkpoint holds the critic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from schemas.config import parse_config

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4
CRITIC_METRICS = (
    "value_loss",
    "value_clip_frac",
    "explained_variance",
    "value_mean",
    "return_mean",
    "critic_grad_norm",
)


def config(run: str) -> dict:
    example = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    algorithm = {
        **example["algorithm"],
        "advantage": "gae",
        "gamma": 1.0,
        "gae_lambda": 0.95,
        "critic_lr": 1e-3,
    }
    return {
        **example,
        "run": run,
        "algorithm": algorithm,
        "trainer": {**example["trainer"], "checkpoint_every": 2},
    }


@pytest.mark.timeout(300)
def test_the_job_trains_with_gae_and_records_the_critic(tmp_path: Path) -> None:
    path = tmp_path / "gae.yaml"
    path.write_text(yaml.safe_dump(config(f"gae-{tmp_path.name[-12:]}")))
    out = tmp_path / "run"
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--config",
            str(path),
            "--steps",
            str(STEPS),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    logs = (
        {p.name: p.read_text() for p in (out / "logs").glob("*.log")}
        if (out / "logs").exists()
        else {}
    )
    assert job.returncode == 0, job.stderr[-2000:] + "".join(text[-1500:] for text in logs.values())
    summary = json.loads(job.stdout.strip().splitlines()[-1])
    cfg = parse_config(config("gae"), "gae")
    assert summary["steps"] == STEPS
    assert summary["samples_trained"] == STEPS * cfg.algorithm.prompts_per_step * cfg.data.n

    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == list(range(STEPS))
    for m in steps:
        assert all(name in m for name in CRITIC_METRICS), sorted(m)
        assert all(
            math.isfinite(m[name]) for name in CRITIC_METRICS if name != "explained_variance"
        ), m
        assert m["value_loss"] > 0
    # The head starts at zero and the critic trains from the first step on.
    assert steps[0]["value_mean"] == 0.0 and steps[-1]["value_mean"] != 0.0
    state = torch.load(out / "checkpoints" / "rank0.pt", weights_only=True)
    assert set(state["critic"]) == {"model", "optimizer"} and state["step"] == STEPS
    assert any(name.startswith("head.") for name in state["critic"]["model"])
