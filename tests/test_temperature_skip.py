"""At temperature 1 no full-logits path divides its [..., V] logits: the division is a
full-vocabulary copy that changes nothing (`engines.algorithms.logprobs.scaled_logits`).

The check records the aten ops each path runs (torch.profiler, with input shapes) and looks
for a division of a tensor whose last dimension is the vocabulary. At T = 0.7 the same
detector must find that division, so a path that stops dividing altogether fails too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from engines.algorithms.objective import LossConfig
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import SamplingParams
from engines.reference import ReferenceEngine
from engines.tiny import build_tiny_model
from engines.torch_train import TorchTrainEngine
from producers.tasks import VOCAB

V = len(VOCAB)


def vocabulary_divisions(run: Callable[[], object]) -> int:
    """aten::div calls in `run` whose first input's last dimension is the vocabulary (not
    counting torch.multinomial's own, inside its sampling)."""
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    return sum(
        1
        for event in prof.events()
        if event.name in ("aten::div", "aten::div_")
        and event.input_shapes
        and event.input_shapes[0]
        and event.input_shapes[0][-1] == V
        and not (event.cpu_parent is not None and event.cpu_parent.name == "aten::multinomial")
    )


@pytest.fixture(autouse=True)
def _no_group_left() -> Iterator[None]:
    """The megatron engine makes a one-rank default process group and megatron's parallel
    state in this process: both go when the test ends, so later tests start without them."""
    yield
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state
    except ImportError:
        pass
    else:
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", VOCAB)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V - 1, (2, 12), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def paths(model_dir: Path, temperature: float) -> dict[str, Callable[[], object]]:
    ids, mask = batch()
    loss = LossConfig(temperature=temperature)
    full = TorchTrainEngine(model_dir, lr=1e-3, loss=loss, logprob_chunk_tokens=0)
    chunked = TorchTrainEngine(model_dir, lr=1e-3, loss=loss, logprob_chunk_tokens=4)
    reference = ReferenceEngine(model_dir, temperature=temperature, chunk_tokens=0)
    rollout = HFRolloutEngine(model_dir, seed=0)
    sampling = SamplingParams(temperature=temperature, max_tokens=3)
    found: dict[str, Callable[[], object]] = {
        "trainer, full logits": lambda: full.logprobs(ids, mask),
        "trainer, chunked": lambda: chunked.logprobs(ids, mask),
        "reference, full logits": lambda: reference.token_logprobs(ids, mask),
        "rollout sampling": lambda: rollout.generate(ids[:1].tolist(), 1, sampling),
    }
    try:
        from engines.megatron_train import MegatronTrainEngine

        megatron = MegatronTrainEngine(model_dir, lr=1e-3, loss=loss, logprob_chunk_tokens=0)
        found["megatron, full logits"] = lambda: megatron.logprobs(ids, mask)
        megatron_chunked = MegatronTrainEngine(
            model_dir, lr=1e-3, loss=loss, logprob_chunk_tokens=4
        )
        found["megatron, chunked"] = lambda: megatron_chunked.logprobs(ids, mask)
    except ImportError:  # megatron-core is in the dev extra; a bare install skips its path
        pass
    return found


def test_no_path_divides_the_logits_at_temperature_one(model_dir: Path) -> None:
    divided = {name: vocabulary_divisions(run) for name, run in paths(model_dir, 1.0).items()}
    assert not any(divided.values()), f"[..., V] divisions at T = 1: {divided}"


def test_the_detector_sees_the_division_at_another_temperature(model_dir: Path) -> None:
    # The chunked path divides inside its autograd function (under no_grad too); every path
    # must show up here, or the test above would pass for a path the profiler cannot see.
    divided = {name: vocabulary_divisions(run) for name, run in paths(model_dir, 0.7).items()}
    assert all(divided.values()), f"paths with no [..., V] division at T = 0.7: {divided}"
