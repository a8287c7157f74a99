"""The trainer's optional step loggers write what they are given (skipped without the package)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from consumers.trainer_loggers import SAMPLE_COLUMNS, WandbLogger, scalars, step_loggers
from schemas.config import RunConfig, TrainerConfig
from tests.helpers import require_extra
from tests.test_run_report import two_groups_batch

STEP_METRICS = {
    "step": 3,
    "time": 1.7e9,
    "train_seconds": 0.25,
    "samples": 64,
    "reward_mean": 0.5,
    "staleness_max": 1,
    "staleness_hist": [10, 3],
    "sample_ids": ["r/0/0/0"],
    "loss": -0.125,
}


def test_scalars_are_the_numbers_of_a_step() -> None:
    assert scalars(STEP_METRICS) == {
        "train_seconds": 0.25,
        "samples": 64.0,
        "reward_mean": 0.5,
        "staleness_max": 1.0,
        "loss": -0.125,
    }


def test_no_logger_unless_configured() -> None:
    assert step_loggers(RunConfig()) == []


def test_tensorboard_logger_writes_scalars(tmp_path: Path) -> None:
    require_extra("tensorboard", "loggers")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logger,) = step_loggers(
        RunConfig(run="tb", trainer=TrainerConfig(tensorboard_dir=str(tmp_path)))
    )
    for step in (0, 1):
        logger.log(step, {**scalars(STEP_METRICS), "loss": float(step)})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 0.0), (1, 1.0)]
    assert "reward_mean" in events.Tags()["scalars"]


def test_wandb_logger_logs_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_extra("wandb", "loggers")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: a local run directory
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    (logger,) = step_loggers(RunConfig(run="wb", trainer=TrainerConfig(wandb_project="jetrl-test")))
    logger.log(0, scalars(STEP_METRICS))
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(p.suffix == ".wandb" for p in runs[0].iterdir()), os.listdir(
        tmp_path
    )


def test_wandb_logger_logs_a_samples_table_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dir: Path
) -> None:
    """The chosen group's row goes to a `samples` table, decoded with the run's tokenizer."""
    require_extra("wandb", "loggers")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    config = RunConfig(
        run="wb",
        model={"path": str(model_dir)},
        trainer=TrainerConfig(wandb_project="jetrl-test"),
    )
    (logger,) = step_loggers(config)
    assert isinstance(logger, WandbLogger)
    files = Path(logger.run.dir)  # wandb keeps its first WANDB_DIR for the process
    logger.samples(5, [two_groups_batch()])
    logger.close()
    tables = list(files.glob("media/table/samples_*.json"))
    assert len(tables) == 1, "no samples table logged"
    data = json.loads(tables[0].read_text())
    assert data["columns"] == list(SAMPLE_COLUMNS)
    assert [row[:2] for row in data["data"]] == [[5, "r/0/8/2"]]
