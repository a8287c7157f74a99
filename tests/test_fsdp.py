"""FSDP2 on CPU: two gloo ranks train as the single-process engine does on the union of their
batches.

Two spawned processes run `tests.fsdp_proc.rank_main` over a recorded stream of 4 steps in
which the ranks' token counts differ, their micro-batch counts differ, and rank 1 has no
micro-batch at all in one step. The single-process `TorchTrainEngine`, in this process, trains
each step's union. To float tolerance: the same per-step loss, grad norm and metric sums on
both ranks, and the same final weights. A second FSDP engine resumed from the DCP checkpoint
written after step 2 trains steps 3-4 exactly as the uninterrupted one did.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from engines.tiny import build_tiny_model
from engines.torch_train import TorchTrainEngine
from producers.tasks import VOCAB
from tests import fsdp_proc
from tests.fsdp_proc import CHECKPOINT_AFTER, ENGINE_ARGS, WORLD

COMPARED = ("loss", "grad_norm", "tokens", "clip_frac", "ratio_mean", "entropy", "is_weight_mean")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, list[dict]]:
    """The model, its vocabulary size, and what each of the two ranks recorded."""
    out = tmp_path_factory.mktemp("fsdp")
    model = build_tiny_model(out / "model", VOCAB, seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    mp.spawn(
        fsdp_proc.rank_main,
        args=(free_port(), str(model), str(out), vocab),
        nprocs=WORLD,
        join=True,
    )
    return model, vocab, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single(ranks: tuple[Path, int, list[dict]]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The single-process engine on each step's union: its metrics and final weights."""
    model, vocab, _ = ranks
    torch.manual_seed(0)
    engine = TorchTrainEngine(model, **ENGINE_ARGS)  # type: ignore[arg-type]
    metrics = [engine.train_step(fsdp_proc.union(step)) for step in fsdp_proc.steps(vocab)]
    return metrics, engine.export_weights()


@pytest.mark.timeout(120)
def test_two_ranks_train_as_one_process_on_the_union(ranks, single) -> None:
    _, _, seen = ranks
    metrics, weights = single
    for rank in range(WORLD):
        for name in COMPARED:
            np.testing.assert_allclose(
                [m[name] for m in seen[rank]["a"]],
                [m[name] for m in metrics],
                rtol=2e-5,
                atol=1e-6,
                err_msg=f"rank {rank}: {name} per step",
            )
    # The step really had something to clip and to sync: a loss that moved the weights.
    assert any(m["grad_norm"] > 0 for m in metrics)
    assert seen[1]["a_weights"] == {}, "only rank 0 holds the gathered weights"
    exported = seen[0]["a_weights"]
    assert list(exported) == list(weights), "same names, same order, tied weights once"
    for name, tensor in weights.items():
        assert exported[name].dtype == torch.float32 and exported[name].shape == tensor.shape
        # Adam scales a gradient element to about lr (1e-2) per step whatever its size, so an
        # element whose gradient is near 0 turns the rounding of another summation order
        # into a visible update: allowed 0.1% of one step. A key bias's true gradient is 0 (a
        # constant added to every key of a query cancels in the softmax): its whole update is
        # such noise, allowed 1% of one step.
        atol = 1e-4 if name.endswith("k_proj.bias") else 1e-5
        torch.testing.assert_close(
            exported[name],
            tensor,
            rtol=1e-5,
            atol=atol,
            msg=lambda m, n=name: f"{n}: {m}",  # type: ignore[misc]  # the default binds the loop
        )


def test_a_resumed_engine_continues_exactly(ranks) -> None:
    _, _, seen = ranks
    for rank in range(WORLD):
        assert seen[rank]["has_checkpoint_before"] is False and seen[rank]["has_checkpoint"] is True
        assert seen[rank]["extra"] == {"last_seq": 100 * rank + CHECKPOINT_AFTER - 1}, (
            "each rank's own resume state"
        )
        assert seen[rank]["b_step"] == CHECKPOINT_AFTER
        for name in ("loss", "grad_norm"):
            np.testing.assert_allclose(
                [m[name] for m in seen[rank]["b"]],
                [m[name] for m in seen[rank]["a"][CHECKPOINT_AFTER:]],
                rtol=1e-6,
                err_msg=f"rank {rank}: {name} after resume",
            )
    for name, tensor in seen[0]["a_weights"].items():
        torch.testing.assert_close(seen[0]["b_weights"][name], tensor, rtol=1e-6, atol=1e-7)
    files = seen[0]["files"]
    assert "fsdp.pt" in files and any(f.endswith(".metadata") for f in files)
    assert {f for f in files if f.endswith(("rank0.pt", "rank1.pt"))} == {
        f"fsdp.pt.d/step-{CHECKPOINT_AFTER}/rank{r}.pt" for r in range(WORLD)
    }


def test_bfloat16_compute_keeps_float32_masters(ranks) -> None:
    _, _, seen = ranks
    for rank in range(WORLD):
        assert seen[rank]["bf16_shard_dtypes"] == ["torch.float32"]
        assert np.isfinite(seen[rank]["bf16"]["loss"]) and seen[rank]["bf16"]["grad_norm"] > 0
    assert seen[0]["bf16"]["loss"] == pytest.approx(seen[1]["bf16"]["loss"])


def test_gradients_sync_once_per_step_not_per_micro_batch(ranks) -> None:
    # Three micro-batches on each rank: a sync per micro-batch would reduce-scatter 3 x the
    # units (docs/engines.md: `set_requires_gradient_sync` on the last backward only).
    _, _, seen = ranks
    for rank in range(WORLD):
        assert seen[rank]["fsdp_units"] > 1, seen[rank]["fsdp_units"]
        assert seen[rank]["reduce_scatters"] == seen[rank]["fsdp_units"], (
            f"rank {rank}: {seen[rank]['reduce_scatters']} reduce-scatters in a step of 3 "
            f"micro-batches over {seen[rank]['fsdp_units']} FSDP units"
        )


def test_only_rank_0_reads_the_weights_unless_a_reference_copy_needs_them(ranks) -> None:
    # The other ranks build on the meta device and get their shards from rank 0
    # (`FSDPTrainEngine._load_model`); the steps above train the same as one process.
    _, _, seen = ranks
    assert [seen[r]["weight_loads"] for r in range(WORLD)] == [1, 0]
    assert [seen[r]["weight_loads_with_reference"] for r in range(WORLD)] == [1, 1]
