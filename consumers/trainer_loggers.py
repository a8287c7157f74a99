"""Optional step loggers of the trainer: Weights & Biases and TensorBoard.

Chosen by `trainer.wandb_project` and `trainer.tensorboard_dir` in the run config. Neither
package is a dependency of jetrl: each is imported only when its field is set
(`pip install wandb`, `pip install tensorboard`). Rank 0 logs the numbers of every step's
metrics (the `metrics.<rank>.<step>` KV entry): loss, reward, staleness, timings.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from schemas.config import RunConfig


class StepLogger(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record one optimizer step's numbers."""

    def close(self) -> None:
        """Flush and release; called once, after the last step."""


class TensorBoardLogger:
    """Scalars in a TensorBoard event file under `directory`."""

    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(str(directory))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """One Weights & Biases run per trainer process, grouped by the jetrl run id.

    A restarted trainer starts a new wandb run in the same group rather than resuming one:
    its first steps repeat steps already logged (those after its checkpoint), and wandb
    refuses steps that go backwards within a run.
    """

    def __init__(self, project: str, run: str, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(project=project, group=run, name=run, config=config)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


def step_loggers(config: RunConfig) -> list[StepLogger]:
    """The loggers the run's config asks for (none by default)."""
    loggers: list[StepLogger] = []
    if config.trainer.tensorboard_dir:
        loggers.append(TensorBoardLogger(Path(config.trainer.tensorboard_dir) / config.run))
    if config.trainer.wandb_project:
        loggers.append(
            WandbLogger(config.trainer.wandb_project, config.run, config.model_dump(mode="json"))
        )
    return loggers


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a step's metrics: not its lists (sample ids, staleness histogram),
    step or wall time."""
    return {
        name: float(value)
        for name, value in metrics.items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and name not in ("step", "time")
    }
