"""The built-in job with `trainer.engine: megatron` at tensor parallel 2, on CPU ranks (gloo).

The local job starts `trainer` (rank 0) and `trainer-rank1`: `trainer.ranks` is dp_size x
tensor parallel. They meet through the run's KV as fsdp ranks do, both read `batches.0` (one
model copy, cut in two), and take each step together: the same loss on both, each step's
samples trained once, one checkpoint of both cuts, and every version gathered to rank 0 and
loaded by the rollout worker under HF names. Needs megatron-core (the dev extra has it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from consumers.fleet_config import local_fleet
from schemas.config import parse_config

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'jetrl[megatron]')")

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4


def config(run: str) -> dict:
    example = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    trainer = {**example["trainer"], "engine": "megatron", "megatron": {"tensor_parallel_size": 2}, "checkpoint_every": 2}
    return {**example, "run": run, "trainer": trainer}


def test_tensor_parallel_ranks_are_trainer_processes_reading_one_batch_stream(tmp_path: Path) -> None:
    cfg = parse_config(config("tp2"), "tp2")
    assert (cfg.trainer.tp_size, cfg.trainer.ranks) == (2, 2)
    assert set(local_fleet(tmp_path, cfg.trainer.ranks).roles) >= {"trainer", "trainer-rank1"}
    torch_cfg = parse_config({**config("tp2"), "trainer": {"engine": "torch"}}, "torch")
    assert (torch_cfg.trainer.tp_size, torch_cfg.trainer.ranks) == (1, 1)  # tp applies to megatron only


@pytest.mark.timeout(300)
def test_the_job_trains_on_two_tensor_parallel_megatron_ranks(tmp_path: Path) -> None:
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(config(f"tp2-{tmp_path.name[-12:]}")))
    out = tmp_path / "run"
    job = subprocess.run(
        [sys.executable, "-m", "producers.prompts", "--config", str(path), "--steps", str(STEPS), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
    )
    logs = {p.name: p.read_text() for p in (out / "logs").glob("*.log")} if (out / "logs").exists() else {}
    assert job.returncode == 0, job.stderr[-2000:] + "".join(text[-1500:] for text in logs.values())
    summary = json.loads(job.stdout.strip().splitlines()[-1])
    cfg = parse_config(config("tp2"), "tp2")
    per_step = cfg.algorithm.prompts_per_step * cfg.data.n
    assert summary["steps"] == STEPS and summary["samples_trained"] == STEPS * per_step

    names = ("trainer-0.log", "trainer-rank1-0.log")
    for rank, name in enumerate(names):
        assert f"rank {rank} of 2 joined the process group" in logs[name]
    # One model copy: both cuts take every step on the same micro-batches, so the same loss.
    losses = {name: [line.rsplit("loss ", 1)[1] for line in logs[name].splitlines() if ": reward " in line] for name in names}
    assert losses[names[0]] == losses[names[1]] and len(losses[names[0]]) == STEPS, losses
    merged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["samples"]) for m in merged] == [(step, per_step) for step in range(STEPS)]

    checkpoints = out / "checkpoints"
    assert (checkpoints / "megatron.pt").exists()
    assert {p.name for p in (checkpoints / "megatron.pt.d" / f"step-{STEPS}").iterdir()} == {"rank0.pt", "rank1.pt"}
    # Each version is gathered to rank 0 under HF names: the rollout worker's HF model loads it.
    rollout = "".join(text for name, text in logs.items() if name.startswith("rollout"))
    served = [int(line.rsplit("weights v", 1)[1]) for line in rollout.splitlines() if "now serving weights v" in line]
    assert served and max(served) >= STEPS - 1, served
