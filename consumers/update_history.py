"""The model's update history in constant size: which samples, in which order, made its weights.

"Nothing twice" (invariant 2 in docs/architecture.md) is a claim about the final model: the steps
that made its weights hold each sample at most once. Keeping every trained sample id in the
checkpoint made each checkpoint grow with the run, and rewriting it every `checkpoint_every` steps
made the total written quadratic. The checkpoint keeps a hash chain instead:

    digest_0 = sha256("")        digest_{s+1} = sha256(digest_s || ids of step s, one per line)

plus the count of ids. The ids themselves are already durable elsewhere: every step's
metrics record in the run's KV (`metrics.<rank>.<step>`, written before the checkpoint)
lists its sample ids. An auditor rebuilds the chain from those records for the steps the
checkpoint covers; equal digests mean the records are exactly the model's history, which can
then be checked for repeats.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

EMPTY = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class UpdateHistory:
    """How many samples the model was trained on, and the hash chain over their ids by step."""

    steps: int = 0
    """Optimizer steps the chain covers (steps 0 .. steps - 1)."""
    samples: int = 0
    """Sample ids over those steps (a sample trained twice counts twice)."""
    digest: str = EMPTY
    """Hex sha256 chain over each step's ids in training order."""

    def after_step(self, sample_ids: Sequence[str]) -> UpdateHistory:
        """The history once one more step, on `sample_ids`, is trained."""
        link = hashlib.sha256(bytes.fromhex(self.digest) + "\n".join(sample_ids).encode())
        return UpdateHistory(self.steps + 1, self.samples + len(sample_ids), link.hexdigest())

    @classmethod
    def of_steps(cls, steps: Iterable[Sequence[str]]) -> UpdateHistory:
        """The history of training on `steps` (each a step's sample ids), in order."""
        history = cls()
        for sample_ids in steps:
            history = history.after_step(sample_ids)
        return history

    def as_dict(self) -> dict[str, int | str]:
        """Plain data, as a checkpoint keeps it (checkpoints load with weights_only=True)."""
        return {"steps": self.steps, "samples": self.samples, "digest": self.digest}

    @classmethod
    def from_dict(cls, data: dict[str, int | str]) -> UpdateHistory:
        return cls(int(data["steps"]), int(data["samples"]), str(data["digest"]))
