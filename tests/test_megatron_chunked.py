"""The megatron engine takes its log-probs in chunks (`trainer.logprob_chunk_tokens`), as the
torch and fsdp engines do: never the [B, T, V] logits, and the same steps as with them.

At tensor parallel 1 (one rank in this process) and 2 (two gloo ranks, spawned), an engine
with chunks of 4 positions against one with the full logits (`logprob_chunk_tokens` 0), both
at temperature 0.7 with an entropy bonus (so the scaling and the entropy's gradient count):
- the same log-probs (at 0.7 and at 1) and entropies;
- two steps over two micro-batches of different [B, T] with the same loss, grad norm and
  entropy, and the same exported weights after them;
- chunked, no op of a step sees a tensor over the vocabulary (V, or a rank's V/TP columns)
  with more than one chunk of positions (the profiler's input shapes), and none is kept for
  backward (each chunk is recomputed), while the full-logits step does both: the detectors
  see what they look for.

On the CPU only (`engines.megatron_patches.cpu_workarounds`); no GPU has run this path.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from engines.algorithms.objective import LossConfig
from engines.protocols import MicroBatch
from engines.tiny import build_tiny_model
from producers.tasks import VOCAB
from tests.megatron_cpu_proc import free_port

pytest.importorskip("megatron.core", reason="megatron-core not installed (the dev extra)")
pytestmark = pytest.mark.slow

CHUNK = 4
LOSS = LossConfig(temperature=0.7, entropy_coef=0.01)
METRICS = ("loss", "grad_norm", "entropy", "ratio_mean")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Head dim 12: the default's 16 is the vocabulary padded for TP 2.
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", VOCAB, hidden=48, seed=0)


@pytest.fixture(scope="module")
def untied_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its own output head (as Qwen2.5-7B and larger): the chunked path
    must project with `output_layer.weight`, not the input embedding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, tie_word_embeddings=False)
    with torch.no_grad():
        head = cast(torch.Tensor, model.get_input_embeddings().weight).clone()
        model.lm_head.weight = torch.nn.Parameter(head + 0.5 * torch.randn_like(head))
    out = tmp_path_factory.mktemp("untied") / "model"
    model.save_pretrained(out)
    return out


@pytest.fixture
def _no_group_left() -> Iterator[None]:
    """The engine makes a one-rank default process group and megatron's parallel state in
    this process: both go when the test ends."""
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def micro_batches() -> list[MicroBatch]:
    """[3, 12] with a left- and a right-padded row, and [2, 10]: the full logits' 33 + 18
    positions, no sequence length that is a vocabulary width (15; 16, 8 and 7 at TP 2)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, len(VOCAB), (3, 12), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, :3] = 0
    attention[2, 10:] = 0
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 6:10] = 1
    behaviour = -torch.rand(3, 12, generator=gen) * loss_mask
    batch = MicroBatch(ids, attention, loss_mask, torch.tensor([1.0, -0.5, 2.0]), behaviour)
    short = MicroBatch(
        ids[:2, :10],
        attention[:2, :10],
        loss_mask[:2, :10],
        torch.tensor([-1.0, 0.5]),
        behaviour[:2, :10],
    )
    return [batch, short]


def positions_over_the_vocabulary(engine: Any) -> tuple[tuple[int, str], int]:
    """In one step, over the vocabulary: the rows of a [..., w] tensor, w the whole vocabulary
    (padded or not) or this rank's columns of it (the output projection's [H, w] transpose is
    not positions). Returns the most positions any op input holds (and that op with its
    shape), and the positions of all such tensors kept for backward (saved tensors hooks: a
    checkpointed region keeps its own, which it recomputes, out of their sight)."""
    spec = engine.spec
    local = spec.padded_vocab_size // engine.tp
    real = max(0, min(local, spec.vocab_size - engine.tp_rank * local))
    widths = {spec.vocab_size, spec.padded_vocab_size, local, real}
    # No other dimension of the model may be a width, or its tensors would count.
    assert not widths & {spec.head_dim, spec.hidden_size}, (widths, spec)

    def rows(shape: Sequence[int]) -> int:
        over = bool(shape) and shape[-1] in widths and list(shape[:-1]) != [spec.hidden_size]
        return math.prod(shape[:-1]) if over else 0

    kept = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[0] += rows(tensor.shape)
        return tensor

    with (
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
    ):
        engine.train_step(micro_batches())
    most = max(
        (
            (rows(shape), f"{event.name} {shape}")
            for event in prof.events()
            for shape in event.input_shapes or []
            if shape
        ),
        default=(0, "none"),
    )
    return most, kept[0]


def measure(model_dir: Path, tp: int) -> dict[int, dict[str, Any]]:
    """This rank's view of a full-logits engine (chunk 0) and a chunked one: log-probs at 0.7
    and at 1, entropies, two steps' metrics, the weights after them (on rank 0), and then the
    most positions over the vocabulary in a third step."""
    from engines.megatron_train import MegatronTrainEngine

    batches = micro_batches()
    ids, attention = batches[0].input_ids, batches[0].attention_mask
    runs: dict[int, dict[str, Any]] = {}
    for chunk in (0, CHUNK):
        engine = MegatronTrainEngine(
            model_dir,
            lr=1e-3,
            seed=0,
            loss=LOSS,
            logprob_chunk_tokens=chunk,
            tensor_parallel_size=tp,
        )
        run: dict[str, Any] = {"logprobs": engine.logprobs(ids, attention).detach()}
        with torch.no_grad():
            run["entropies"] = engine._token_logprobs(ids, attention)[1]
        engine.loss_config = dataclasses.replace(LOSS, temperature=1.0)
        run["logprobs_t1"] = engine.logprobs(ids, attention).detach()
        engine.loss_config = LOSS
        run["steps"] = [engine.train_step(batches) for _ in range(2)]
        run["weights"] = engine.export_weights()
        run["positions"], run["kept"] = positions_over_the_vocabulary(engine)
        runs[chunk] = run
    return runs


def _rank_main(rank: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.save(measure(Path(model_dir), tp=2), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def scored(attention: torch.Tensor) -> torch.Tensor:
    """Where token t and its predecessor are real (a first token after left padding is
    predicted from a position that sees no key: `tests/megatron_cpu_proc.py`)."""
    return attention * torch.nn.functional.pad(attention[:, :-1], (1, 0))


def assert_chunked_is_full(ranks: list[dict[int, dict[str, Any]]]) -> None:
    where = scored(micro_batches()[0].attention_mask).bool()
    for runs in ranks:
        full, chunked = runs[0], runs[CHUNK]
        for name in ("logprobs", "logprobs_t1", "entropies"):
            torch.testing.assert_close(
                chunked[name][where], full[name][where], rtol=1e-5, atol=1e-5, msg=name
            )
        for step, (a, b) in enumerate(zip(full["steps"], chunked["steps"], strict=True)):
            for key in METRICS:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (step, key)
        assert full["steps"][0]["grad_norm"] > 0, "a step with no gradient checks nothing"
        assert chunked["weights"].keys() == full["weights"].keys()
        for name, weight in full["weights"].items():
            torch.testing.assert_close(chunked["weights"][name], weight, rtol=1e-4, atol=1e-5)
    assert ranks[0][0]["weights"], "rank 0 exported no weights to compare"
    rows, width = micro_batches()[0].input_ids.shape
    seen, op = max(runs[0]["positions"] for runs in ranks)
    assert seen >= rows * (width - 1), f"the detector missed the full logits ({seen}: {op})"
    kept = min(runs[0]["kept"] for runs in ranks)
    assert kept >= rows * (width - 1), f"the hooks missed the full logits kept ({kept})"
    most, op = max(runs[CHUNK]["positions"] for runs in ranks)
    assert 0 < most <= CHUNK, f"{most} positions over the vocabulary at once ({op}), chunk {CHUNK}"
    kept = max(runs[CHUNK]["kept"] for runs in ranks)
    assert kept == 0, f"{kept} positions over the vocabulary kept for backward, not recomputed"


def test_chunked_equals_full_logits_at_tensor_parallel_1(
    model_dir: Path, _no_group_left: None
) -> None:
    assert_chunked_is_full([measure(model_dir, tp=1)])


def test_an_untied_head_is_the_one_projected(untied_model_dir: Path, _no_group_left: None) -> None:
    assert_chunked_is_full([measure(untied_model_dir, tp=1)])


def test_chunked_equals_full_logits_at_tensor_parallel_2(model_dir: Path, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(free_port(), str(model_dir), str(tmp_path)), nprocs=2, join=True)
    assert_chunked_is_full(
        [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    )
