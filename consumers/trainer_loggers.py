"""Optional step loggers of the trainer: Weights & Biases and TensorBoard.

Chosen by `trainer.wandb_project` and `trainer.tensorboard_dir` in the run config. Neither
package is a dependency of jetrl: each is imported only when its field is set
(`pip install wandb`, `pip install tensorboard`). Rank 0 logs the numbers of every step's
metrics (the `metrics.<rank>.<step>` KV entry): loss, reward, staleness, timings. Weights &
Biases also gets a `samples` table per step: the rows of every `report.samples_every`-th group
of the step's batches (`sample_rows`), decoded with the run's tokenizer, as the main job's
`samples.jsonl` has them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from schemas import BatchEvent
from schemas.config import RunConfig

SAMPLE_COLUMNS = (
    "step",
    "sample_id",
    "prompt",
    "response",
    "reward",
    "advantage",
    "version",
    "staleness",
)
"""The columns of the Weights & Biases `samples` table."""


class StepLogger(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Record one optimizer step's numbers."""

    def samples(self, step: int, batches: Sequence[BatchEvent]) -> None:
        """Record some of the step's samples (a logger without a place for them ignores them)."""

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

    def samples(self, step: int, batches: Sequence[BatchEvent]) -> None:
        pass  # scalars only

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """One Weights & Biases run per trainer process, grouped by the jetrl run id.

    A restarted trainer starts a new wandb run in the same group rather than resuming one:
    its first steps repeat steps already logged (those after its checkpoint), and wandb
    refuses steps that go backwards within a run.
    """

    def __init__(self, project: str, run: str, config: RunConfig) -> None:
        import wandb

        self.wandb = wandb
        self.config = config
        self.run = wandb.init(
            project=project, group=run, name=run, config=config.model_dump(mode="json")
        )
        self.decode: Callable[[Sequence[int]], str] | None = None

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def samples(self, step: int, batches: Sequence[BatchEvent]) -> None:
        if self.decode is None:
            self.decode = run_tokenizer(self.config)
        rows = sample_rows(step, batches, self.config, self.decode)
        if rows:
            table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)
            self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def step_loggers(config: RunConfig) -> list[StepLogger]:
    """The loggers the run's config asks for (none by default)."""
    loggers: list[StepLogger] = []
    if config.trainer.tensorboard_dir:
        loggers.append(TensorBoardLogger(Path(config.trainer.tensorboard_dir) / config.run))
    if config.trainer.wandb_project:
        loggers.append(WandbLogger(config.trainer.wandb_project, config.run, config))
    return loggers


def run_tokenizer(config: RunConfig) -> Callable[[Sequence[int]], str]:
    """The run's tokenizer's decode, special tokens kept (as `samples.jsonl` writes them)."""
    from transformers import AutoTokenizer

    from engines.model_source import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(
        resolve_model_path(config.model.path, config.model.revision)
    )
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=False))


def sample_rows(
    step: int,
    batches: Sequence[BatchEvent],
    config: RunConfig,
    decode: Callable[[Sequence[int]], str],
) -> list[list[Any]]:
    """The `samples` table's rows (`SAMPLE_COLUMNS`) of a step: each row of its micro-batches
    whose group `report.samples_every` picks, its prompt (the tokens before the first loss
    token) and response (the real tokens from it on) decoded; its version is the oldest among
    its response tokens, its staleness the step minus that."""
    rows = []
    for batch in batches:
        ids, attention = batch.input_ids.numpy(), batch.attention_mask.numpy()
        loss, versions = batch.loss_mask.numpy(), batch.versions.numpy()
        rewards, advantages = batch.rewards.numpy(), batch.advantages.numpy()
        for i, sample_id in enumerate(batch.sample_ids):
            if not config.report.samples(sample_id.rsplit("/", 1)[0]):
                continue
            real = attention[i] == 1
            trained = (loss[i] == 1).nonzero()[0]
            cut = int(trained[0]) if trained.size else int(real.sum())
            prompt = [int(t) for t, r in zip(ids[i][:cut], real[:cut], strict=True) if r]
            response = [int(t) for t, r in zip(ids[i][cut:], real[cut:], strict=True) if r]
            on_loss = versions[i][loss[i] == 1]
            version = int(on_loss.min()) if on_loss.size else None
            rows.append(
                [
                    step,
                    sample_id,
                    decode(prompt),
                    decode(response),
                    float(rewards[i]),
                    float(advantages[i]),
                    version,
                    None if version is None else step - version,
                ]
            )
    return rows


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
