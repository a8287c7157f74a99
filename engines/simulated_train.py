"""`trainer.engine: simulated`: the torch train engine with no optimizer step computed, for
scheduling studies beside the simulated rollout engine (`ops.bench.scale`).

    train_step(micro-batches) -> the version counts one more step; the weights stay as loaded
        -> the step's metrics: its tokens and lr, every loss figure 0
    (the trainer adds `trainer.simulated_seconds_per_token` x the step's tokens on top)

Why: `ops.bench.scale` stands one trainer process for a data-parallel trainer that grows with
the fleet, so a step must cost the same at any fleet size. The real tiny model's step does
not: forward, backward and AdamW over 2,000 rows of 24 tokens (N = 1,000 workers' batch) took
12 s on one idle core of this machine, 0.4 s over 20 rows, and the bench's steps at N = 1,000
took 42-50 s under its load where 20 s were asked for.
Everything else is the torch engine's: the process, the batches it reads and checks, the
weight versions it exports and publishes (each the loaded weights), its checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.protocols import MicroBatch
from engines.torch_train import TorchTrainEngine


class SimulatedTrainEngine(TorchTrainEngine):
    """A `TorchTrainEngine` whose `train_step` computes nothing."""

    name = "simulated"
    """What the trainer reports as its engine (membership)."""

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> dict[str, float]:
        """One step counted, no update: the metrics the torch engine names, the loss figures
        0, `tokens` the response tokens of the step."""
        tokens = float(sum(int(mb.loss_mask.sum()) for mb in micro_batches))
        factor = self.lr_schedule(self.step) if self.lr_schedule is not None else 1.0
        self.step += 1
        return {
            "loss": 0.0,
            "grad_norm": 0.0,
            "updates": 0.0,
            "lr": self.base_lr * factor,
            "tokens": tokens,
            "step": float(self.step),
        }
