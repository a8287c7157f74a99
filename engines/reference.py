"""The reference policy: the frozen initial model scoring sampled tokens (no bus, no stage).

    rows [(prompt ids [P], response ids [R])] -> right-padded [B, T] ids and mask
        -> final hidden states [B, T - 1, H] -> chunked log-softmax over the output head [V, H]
        -> per row, log pi_ref(response[i] | prompt, response[<i]) at the sampling temperature, [R]

The same computation as the trainer's own frozen copy (`engines.torch_train`, positions counted
from the attention mask, `engines.algorithms.logprobs.chunked_logprobs`), so the KL is the same
whichever of the two scores the reference. Weights never change: no optimizer, no grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from engines.algorithms.logprobs import chunked_logprobs, scaled_logits
from engines.algorithms.losses import gather_logprobs
from engines.device import autocast


class ReferenceEngine:
    """Holds the frozen model; `logprobs` scores a batch of (prompt, response) rows."""

    def __init__(
        self,
        model_dir: Path,
        *,
        temperature: float = 1.0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        chunk_tokens: int = 1024,
    ) -> None:
        """`temperature`: the rollout's sampling temperature (behaviour log-probs were taken at it);
        `dtype`: the compute dtype (bfloat16: autocast, float32 weights); `chunk_tokens`: positions
        projected onto the vocabulary at once (0: the model's full logits)."""
        self.device, self.dtype = torch.device(device), dtype
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # transformers types `to` through a decorator that mypy reads as unbound.
        self.model = model.to(self.device)  # type: ignore[arg-type]
        self.model.eval().requires_grad_(False)
        self.temperature, self.chunk_tokens = temperature, chunk_tokens

    @torch.no_grad()
    def logprobs(self, rows: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """Each row's response log-probs under the reference, float32 [R] (R may be 0)."""
        if not rows:
            return []
        lengths = [len(p) + len(r) for p, r in rows]
        ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (prompt, response) in enumerate(rows):
            ids[i, : lengths[i]] = torch.from_numpy(
                np.concatenate([prompt, response]).astype(np.int64)
            )
            mask[i, : lengths[i]] = 1
        per_token = (
            self.token_logprobs(ids.to(self.device), mask.to(self.device)).float().cpu().numpy()
        )
        return [
            per_token[i, len(p) : lengths[i]].astype(np.float32) for i, (p, _) in enumerate(rows)
        ]

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] ids -> [B, T] log pi_ref(x[t] | x[<t]), 0 at t = 0
        (aligned as `engines.protocols`)."""
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        targets = input_ids[:, 1:]
        with autocast(self.device, self.dtype):
            if not self.chunk_tokens:
                logits = self.model(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=positions
                ).logits
                logprobs = gather_logprobs(
                    scaled_logits(logits[:, :-1].float(), self.temperature), targets
                )
            else:
                hidden = self.model.get_decoder()(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=positions
                ).last_hidden_state[:, :-1]  # [B, T - 1, H]
        if self.chunk_tokens:
            head = self.model.get_output_embeddings().weight  # [V, H]
            logprobs, _ = chunked_logprobs(
                hidden, head, targets, self.temperature, self.chunk_tokens
            )
        return torch.nn.functional.pad(logprobs, (1, 0))
