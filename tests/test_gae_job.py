"""The built-in job with `algorithm.advantage: gae`: the buffer hands the trainer each sample's
outcome reward, the trainer's critic turns them into token advantages, and every step's critic
metrics reach the run's metrics file; the run's checkpoint holds the critic. With the torch
engine, and with the fsdp engine on two gloo ranks (the critic sharded, `engines.fsdp_critic`)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
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


def config(run: str, engine: str = "torch") -> dict:
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
        "trainer": {
            **example["trainer"],
            "checkpoint_every": 2,
            **({"engine": "fsdp", "dp_size": 2} if engine == "fsdp" else {}),
        },
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["torch", "fsdp"])
def test_the_job_trains_with_gae_and_records_the_critic(tmp_path: Path, engine: str) -> None:
    path = tmp_path / "gae.yaml"
    path.write_text(yaml.safe_dump(config(f"gae-{tmp_path.name[-12:]}", engine)))
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
    cfg = parse_config(config("gae", engine), "gae")
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
    if engine == "fsdp":  # the pointer, and the critic's shards in the DCP directory
        pointer = torch.load(out / "checkpoints" / "fsdp.pt", weights_only=True)
        assert pointer["critic"] is True and pointer["step"] == STEPS
        saved = torch.distributed.checkpoint.FileSystemReader(
            out / "checkpoints" / "fsdp.pt.d" / pointer["dir"]
        ).read_metadata()
        keys = set(saved.state_dict_metadata)
        assert any(k.startswith("critic_model.head.") for k in keys), sorted(keys)[:5]
        assert any(k.startswith("critic_optimizer.state.") for k in keys), sorted(keys)[:5]
        return
    state = torch.load(out / "checkpoints" / "rank0.pt", weights_only=True)
    assert set(state["critic"]) == {"model", "optimizer"} and state["step"] == STEPS
    assert any(name.startswith("head.") for name in state["critic"]["model"])
