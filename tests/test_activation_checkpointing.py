"""`trainer.activation_checkpointing`: every engine recomputes each transformer block in
backward instead of keeping its activations.

The evidence is the blocks' MLP forward calls during one train step: once per block and
micro-batch without checkpointing, twice with it (the second is the recomputation in
backward). Counted by wrapping each MLP's `forward`, not by module hooks: torch 2.13 runs no
forward hooks while it recomputes a checkpointed region. The loss must not change. Engines:
torch, fsdp (one gloo rank in this process) and megatron (TP = PP = 1, when megatron-core is
installed); the flag reaches the engine from the run config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from consumers.trainer_dist import configured_engine
from engines.algorithms.objective import LossConfig
from engines.protocols import MicroBatch, TrainEngine
from engines.tiny import build_tiny_model
from engines.torch_train import TorchTrainEngine
from producers.tasks import VOCAB
from schemas.config import RunConfig

BLOCKS = ("Qwen2DecoderLayer", "TransformerLayer")  # HF's block, megatron's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", VOCAB)


@pytest.fixture(autouse=True)
def _no_group_left() -> Iterator[None]:
    """fsdp and megatron make a one-rank default process group in this process (megatron its
    parallel state too): both go when the test ends."""
    yield
    try:
        from megatron.core import parallel_state
    except ImportError:
        pass
    else:
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def micro_batch(seed: int = 0) -> MicroBatch:
    """Two rows of 10 random tokens, the last 5 of each trained on, opposite advantages."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(VOCAB) - 1, (2, 10), generator=gen)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 5:] = 1
    return MicroBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=loss_mask,
        advantages=torch.tensor([1.0, -1.0]),
        behaviour_logprobs=-torch.rand(2, 10, generator=gen) * loss_mask,
    )


def step_counting_blocks(engine: TrainEngine) -> tuple[int, int, dict[str, float]]:
    """(blocks, block MLP forward calls in one train step, its metrics)."""
    model: Any = getattr(engine, "model")  # noqa: B009 - every engine here keeps its module
    calls = [0]
    # FSDP2 renames a block's class FSDP<name>.
    blocks = [m for m in model.modules() if type(m).__name__.endswith(BLOCKS)]
    assert blocks, "no transformer block found to count"

    def counted(forward: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return forward(*args, **kwargs)

        return call

    for block in blocks:
        block.mlp.forward = counted(block.mlp.forward)
    try:
        metrics = engine.train_step([micro_batch()])
    finally:
        for block in blocks:
            del block.mlp.forward  # the class's own again
    return len(blocks), calls[0], metrics


def torch_engine(model_dir: Path, on: bool) -> TrainEngine:
    return TorchTrainEngine(model_dir, lr=1e-3, activation_checkpointing=on)


def fsdp_engine(model_dir: Path, on: bool) -> TrainEngine:
    from engines.fsdp_train import FSDPTrainEngine, init_group

    if not dist.is_initialized():
        init_group(dist.HashStore(), 0, 1, torch.device("cpu"), timeout=60)
    return FSDPTrainEngine(model_dir, lr=1e-3, activation_checkpointing=on)


def megatron_engine(model_dir: Path, on: bool) -> TrainEngine:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (the dev extra)")
    from megatron.core import parallel_state

    from engines.megatron_train import MegatronTrainEngine

    parallel_state.destroy_model_parallel()  # each engine builds its own parallel state
    return MegatronTrainEngine(model_dir, lr=1e-3, activation_checkpointing=on)


@pytest.mark.parametrize(
    "build", [torch_engine, fsdp_engine, megatron_engine], ids=["torch", "fsdp", "megatron"]
)
def test_each_block_is_recomputed_in_backward_and_the_step_is_the_same(
    model_dir: Path, build: Callable[[Path, bool], TrainEngine]
) -> None:
    blocks, plain_calls, plain = step_counting_blocks(build(model_dir, False))
    assert plain_calls == blocks, f"{plain_calls} block forwards for {blocks} blocks, no recompute"
    blocks, calls, checkpointed = step_counting_blocks(build(model_dir, True))
    assert calls == 2 * blocks, f"{calls} block forwards for {blocks} blocks with checkpointing"
    assert checkpointed["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)


def test_the_config_key_reaches_the_engine(model_dir: Path) -> None:
    cfg = RunConfig.model_validate(
        {"model": {"path": str(model_dir)}, "trainer": {"activation_checkpointing": True}}
    )
    engine = configured_engine(cfg, LossConfig(), torch.device("cpu"))
    blocks, calls, _ = step_counting_blocks(engine)
    assert calls == 2 * blocks
