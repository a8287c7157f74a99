"""Checks of events against the model a worker holds: what the schemas cannot know.

`schemas.events` checks what an event says about itself (token ids >= 0, finite log-probs,
...). Whether its token ids exist in this model's vocabulary and whether its sequences fit
this model's context is known only to the workers that hold the model: the rollout for
prompts, the trainer for batches. A token id past the vocabulary would crash the embedding
lookup (IndexError) every time the event is retried; a sequence past the context would
run out of memory or, at best, train on positions the model never learned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bus.worker import Reject


@dataclass(frozen=True)
class ModelLimits:
    """The largest token id + 1 and the longest sequence a model takes."""

    vocab_size: int
    """Rows of the input embedding."""
    context: int | None
    """`max_position_embeddings` of the model's config; None when it does not say."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelLimits:
        """The limits of a Hugging Face model (its input embedding and config)."""
        embedding = model.get_input_embeddings()  # type: ignore[operator]
        return cls(embedding.num_embeddings, getattr(model.config, "max_position_embeddings", None))

    def check(self, largest_id: int, positions: int, what: str) -> None:
        """Reject `what` unless `largest_id` is in the vocabulary and `positions` fit the
        context."""
        if largest_id >= self.vocab_size:
            raise Reject(
                f"{what}: token id {largest_id} is outside the model's vocabulary of "
                f"{self.vocab_size}"
            )
        if self.context is not None and positions > self.context:
            raise Reject(
                f"{what}: needs {positions} positions, the model's context is {self.context}"
            )
