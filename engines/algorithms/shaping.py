"""Reward shaping applied before advantages (DAPO's overlong handling), as pure tensor functions."""

import torch


def overlong_penalty(
    lengths: torch.Tensor, max_tokens: int, buffer_tokens: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment. lengths [N] response tokens -> [N] reward terms (<= 0).

    With L = max_tokens and C = buffer_tokens: 0 up to L - C, then falling linearly to -penalty
    at L, -penalty past it:  -penalty * clamp((len - (L - C)) / C, 0, 1).
    """
    if not 0 < buffer_tokens < max_tokens:
        raise ValueError(
            f"buffer_tokens must be in (0, max_tokens {max_tokens}), not {buffer_tokens}"
        )
    over = (lengths.float() - (max_tokens - buffer_tokens)) / buffer_tokens
    return -penalty * over.clamp(0.0, 1.0)
