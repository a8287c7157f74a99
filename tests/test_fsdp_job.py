"""`examples/digits-dp2.yaml`, shortened: the local job starts two FSDP2 trainer ranks on CPU.

The producer's local fleet starts `trainer` (rank 0) and `trainer-rank1`; they meet through
the run's KV, each reads its own `batches.<rank>`, and every step's samples are trained
across the two: the run trains steps x prompts x n samples (the producer merges each step's
two records), both ranks log the whole step's loss (the same on both), and one checkpoint
for both ranks is committed at the end. With `weights.transport: collective` both ranks
broadcast their own tensors of every version, and the rollout worker loads each by broadcast
(v0 excepted: it goes out before the worker is alive, which then loads the stored copy).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from schemas.config import load_config
from tests.helpers import ROOT, run_local_job

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

CONFIG = ROOT / "examples" / "digits-dp2.yaml"
STEPS = 6
COLLECTIVE = {"transport": "collective", "collective": {"join_timeout_s": 10, "op_timeout_s": 10}}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("weights", [None, COLLECTIVE], ids=["object_store", "collective"])
def test_the_dp2_example_trains_every_sample_once_across_two_ranks(
    tmp_path: Path, weights: dict | None
) -> None:
    cfg = load_config(CONFIG)
    assert (cfg.trainer.engine.type, cfg.trainer.dp_size) == ("fsdp", 2)
    # The example itself, but for a run id of its own (a rerun resumes nothing of another).
    example = {**yaml.safe_load(CONFIG.read_text()), "run": f"dp2-{tmp_path.name[-12:]}"}
    job = run_local_job(
        {**example, "weights": weights} if weights else example, tmp_path, STEPS, timeout=220
    )
    summary, logs = job.summary, job.logs
    per_step = cfg.algorithm.prompts_per_step * cfg.data.n
    assert summary["steps"] == STEPS and summary["samples_trained"] == STEPS * per_step

    assert {"trainer-0.log", "trainer-rank1-0.log"} <= set(logs), sorted(logs)
    for name, rank in (("trainer-0.log", 0), ("trainer-rank1-0.log", 1)):
        assert f"rank {rank} of 2 joined the process group" in logs[name]

    # The KV is gone with the embedded server: metrics.jsonl holds the steps as the producer
    # merged them, each rank's log its own line per step.
    assert [(m["step"], m["samples"]) for m in job.merged_metrics()] == [
        (step, per_step) for step in range(STEPS)
    ]
    losses = {name: job.losses(name) for name in ("trainer-0.log", "trainer-rank1-0.log")}
    assert (
        losses["trainer-0.log"] == losses["trainer-rank1-0.log"]
        and len(losses["trainer-0.log"]) == STEPS
    )

    checkpoints = job.out / "checkpoints"
    assert (checkpoints / "fsdp.pt").exists()
    assert {p.name for p in (checkpoints / "fsdp.pt.d" / f"step-{STEPS}").iterdir()} >= {
        "rank0.pt",
        "rank1.pt",
        ".metadata",
    }

    if weights:  # every version after v0 by broadcast, from both ranks, none from the stored copy
        rollout, served = job.rollout_log(), job.served_versions()
        assert served and max(served) >= STEPS - 1, served
        assert "missed by broadcast" not in rollout, [
            line for line in rollout.splitlines() if "missed" in line
        ]
        for name in ("trainer-0.log", "trainer-rank1-0.log"):
            failed = [
                line
                for line in logs[name].splitlines()
                if ": broadcast to" in line and "weights v0:" not in line
            ]
            assert not failed, failed
            # Each rank sent its own part of the last version, neither the whole of it.
            sent = re.findall(
                rf"weights v{STEPS}: sent (\d+) bytes \(this rank's tensors\) of (\d+)", logs[name]
            )
            assert len(sent) == 1 and 0 < int(sent[0][0]) < 0.75 * int(sent[0][1]), (name, sent)
