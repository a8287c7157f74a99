"""The fsdp engine takes its log-probs in chunks (`trainer.logprob_chunk_tokens`), as the torch
engine does: never the [B, T, V] logits, and the same steps as with them.

It runs inside the FSDP2 root module's forward (`FSDPTrainEngine._wrap`), where the root unit's
shards (embeddings, tied head, final norm) are gathered and their backward hooked. On one gloo
rank in this process (two ranks in tests/test_fsdp.py train chunked too, the default):
- two steps chunked and two with the full logits give the same losses and weights;
- chunked, no op of the step sees a [..., V] tensor larger than one chunk's (the profiler's
  input shapes), while the full-logits step does: the detector sees what it looks for.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

from engines.fsdp_train import FSDPTrainEngine, init_group
from engines.tiny import build_tiny_model
from producers.tasks import VOCAB
from tests.test_activation_checkpointing import micro_batch

CHUNK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", VOCAB)


@pytest.fixture
def one_rank() -> Iterator[None]:
    init_group(dist.HashStore(), 0, 1, torch.device("cpu"), timeout=60)
    yield
    dist.destroy_process_group()


def most_positions_over_the_vocabulary(engine: FSDPTrainEngine, engine_dir: Path) -> int:
    """The most positions any op input of one step holds over the whole vocabulary: the rows
    of a [..., V] tensor (the output projection's [H, V] transpose is not positions)."""
    hidden = int(AutoConfig.from_pretrained(engine_dir).hidden_size)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        engine.train_step([micro_batch()])
    return max(
        (
            math.prod(shape[:-1])
            for event in prof.events()
            for shape in event.input_shapes or []
            if shape and shape[-1] == len(VOCAB) and list(shape) != [hidden, len(VOCAB)]
        ),
        default=0,
    )


def test_chunked_steps_equal_full_logits_steps(model_dir: Path, one_rank: None) -> None:
    runs = {}
    for chunk in (0, CHUNK):
        engine = FSDPTrainEngine(model_dir, lr=1e-2, logprob_chunk_tokens=chunk)
        losses = [engine.train_step([micro_batch()])["loss"] for _ in range(2)]
        runs[chunk] = (losses, engine.export_weights())
    (full_losses, full), (chunked_losses, chunked) = runs[0], runs[CHUNK]
    assert chunked_losses == pytest.approx(full_losses, rel=1e-5)
    for name in full:
        torch.testing.assert_close(chunked[name], full[name], rtol=1e-4, atol=1e-5)


def test_no_step_holds_the_full_logits(model_dir: Path, one_rank: None) -> None:
    rows, width = micro_batch().input_ids.shape
    full = most_positions_over_the_vocabulary(
        FSDPTrainEngine(model_dir, lr=1e-2, logprob_chunk_tokens=0), model_dir
    )
    assert full >= rows * (width - 1), f"the detector missed the full logits ({full} positions)"
    chunked = most_positions_over_the_vocabulary(
        FSDPTrainEngine(model_dir, lr=1e-2, logprob_chunk_tokens=CHUNK), model_dir
    )
    assert chunked <= CHUNK, f"{chunked} positions over the vocabulary at once, chunk {CHUNK}"
