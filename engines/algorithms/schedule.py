"""Learning-rate schedule as a pure function of the step."""

import math
from typing import Literal


def lr_factor(
    step: int,
    *,
    warmup: int = 0,
    total: int = 1,
    schedule: Literal["constant", "cosine"] = "constant",
    min_ratio: float = 0.0,
) -> float:
    """The multiplier of the base learning rate for the update made at `step` (0-based).

    Warmup: (step + 1) / warmup for step < warmup (the first update is not at lr 0). Then
    constant 1, or cosine from 1 at step = warmup to min_ratio at step = total:
        min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2,  p = (step - warmup) / (total - warmup)
    (p capped at 1: steps past `total` keep min_ratio).
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
