"""The built-in job with `trainer.engine: megatron` at tensor parallel 2 and at pipeline
parallel 2, on CPU ranks (gloo).

The local job starts `trainer` (rank 0) and `trainer-rank1`: `trainer.ranks` is dp_size x
tensor x pipeline parallel. They meet through the run's KV as fsdp ranks do, both read `batches.0`
(one model copy, cut in two: by tensor slices or by layer stages), and take each step together: the
same loss on both (at pipeline parallel the last stage's, handed to the first), each step's
samples trained once, one checkpoint of both parts, and every version gathered to rank 0 and
loaded by the rollout worker under HF names. Needs megatron-core (the dev extra has it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from consumers.fleet_config import local_fleet
from schemas.config import parse_config
from tests.helpers import ROOT, run_local_job

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install 'jetrl[megatron]')"
)

STEPS = 4


SIZES = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


def config(run: str, sizes: str = "tp2") -> dict:
    example = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    trainer = {
        **example["trainer"],
        "engine": {"type": "megatron", **SIZES[sizes]},
        "checkpoint_every": 2,
    }
    return {**example, "run": run, "trainer": trainer}


def test_tensor_parallel_ranks_are_trainer_processes_reading_one_batch_stream(
    tmp_path: Path,
) -> None:
    cfg = parse_config(config("tp2"), "tp2")
    assert (cfg.trainer.tp_size, cfg.trainer.ranks) == (2, 2)
    assert set(local_fleet(tmp_path, cfg.trainer.ranks).roles) >= {"trainer", "trainer-rank1"}
    torch_cfg = parse_config({**config("tp2"), "trainer": {"engine": "torch"}}, "torch")
    assert (torch_cfg.trainer.tp_size, torch_cfg.trainer.ranks) == (
        1,
        1,
    )  # tp applies to megatron only


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sizes", ["tp2", "pp2"])
def test_the_job_trains_on_two_model_parallel_megatron_ranks(tmp_path: Path, sizes: str) -> None:
    job = run_local_job(
        config(f"{sizes}-{tmp_path.name[-12:]}", sizes), tmp_path, STEPS, timeout=280
    )
    summary, logs = job.summary, job.logs
    cfg = parse_config(config(sizes, sizes), sizes)
    assert (cfg.trainer.copy_size, cfg.trainer.ranks) == (2, 2)
    per_step = cfg.algorithm.prompts_per_step * cfg.data.n
    assert summary["steps"] == STEPS and summary["samples_trained"] == STEPS * per_step

    names = ("trainer-0.log", "trainer-rank1-0.log")
    for rank, name in enumerate(names):
        assert f"rank {rank} of 2 joined the process group" in logs[name]
    # One model copy: both parts take every step on the same micro-batches, so the same loss.
    losses = {name: job.losses(name) for name in names}
    assert losses[names[0]] == losses[names[1]] and len(losses[names[0]]) == STEPS, losses
    assert [(m["step"], m["samples"]) for m in job.merged_metrics()] == [
        (step, per_step) for step in range(STEPS)
    ]

    checkpoints = job.out / "checkpoints"
    assert (checkpoints / "megatron.pt").exists()
    assert {p.name for p in (checkpoints / "megatron.pt.d" / f"step-{STEPS}").iterdir()} == {
        "rank0.pt",
        "rank1.pt",
    }
    # Each version is gathered to rank 0 under HF names: the rollout worker's HF model loads it.
    served = job.served_versions()
    assert served and max(served) >= STEPS - 1, served
