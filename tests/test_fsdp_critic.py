"""The value model under FSDP2 on CPU (gloo): `algorithm.advantage: gae` with the fsdp engine at
1 and 2 ranks trains as the single-process torch engine does on the union of the ranks' batches.

Spawned processes run `tests.fsdp_critic_proc.rank_main` over `tests.fsdp_proc`'s recorded 4
steps (uneven token and micro-batch counts; rank 1 has nothing in one step), two PPO epochs a
step. To float tolerance: the same per-step policy and critic metrics (loss, value_loss, both
grad norms, the whitened-advantage statistics) and the same final policy and critic weights as
`TorchTrainEngine` in this process; a fresh FSDP engine resumed from the DCP checkpoint written
after step 2 trains steps 3-4 exactly as the uninterrupted one did; each unit of both models
reduce-scatters once per update.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from engines.tiny import build_tiny_model
from engines.torch_train import TorchTrainEngine
from producers.tasks import VOCAB
from tests import fsdp_critic_proc, fsdp_proc
from tests.fsdp_critic_proc import CHECKPOINT_AFTER, ENGINE_ARGS
from tests.test_fsdp import free_port

COMPARED = (
    "loss",
    "grad_norm",
    "tokens",
    "clip_frac",
    "value_loss",
    "critic_grad_norm",
    "value_mean",
    "return_mean",
    "explained_variance",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", VOCAB, seed=0)


@pytest.fixture(scope="module")
def single(model_dir: Path) -> tuple[list[dict], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The torch engine on each step's union: its metrics, final policy and critic weights."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    engine = TorchTrainEngine(model_dir, **ENGINE_ARGS)
    metrics = [engine.train_step(fsdp_proc.union(step)) for step in fsdp_proc.steps(vocab)]
    assert engine.critic is not None
    critic = {k: v.detach().clone() for k, v in engine.critic.model.state_dict().items()}
    return metrics, engine.export_weights(), critic


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def ranks(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    """What each rank recorded, at 1 and at 2 ranks."""
    world: int = request.param
    out = tmp_path_factory.mktemp(f"fsdp_critic_{world}")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    mp.spawn(
        fsdp_critic_proc.rank_main,
        args=(world, free_port(), str(model_dir), str(out), vocab),
        nprocs=world,
        join=True,
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


def same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want), f"{what}: the same names in the same order"
    for name, tensor in want.items():
        # As tests/test_fsdp.py: Adam turns the rounding of another summation order into an
        # update of about lr where a gradient element is near 0 (a key bias's always is).
        atol = 1e-4 if name.endswith("k_proj.bias") else 2e-5
        torch.testing.assert_close(
            got[name],
            tensor,
            rtol=1e-5,
            atol=atol,
            msg=lambda m, n=name: f"{what} {n}: {m}",  # type: ignore[misc]  # binds the loop
        )


@pytest.mark.timeout(300)
def test_the_fsdp_critic_trains_as_the_torch_engine_on_the_union(ranks, single) -> None:
    metrics, weights, critic = single
    for rank, seen in enumerate(ranks):
        for name in COMPARED:
            np.testing.assert_allclose(
                [m[name] for m in seen["a"]],
                [m[name] for m in metrics],
                rtol=2e-5,
                atol=1e-6,
                err_msg=f"rank {rank} of {len(ranks)}: {name} per step",
            )
        # A token inside the clip range has clip(V) == V up to rounding, so whether its clipped
        # branch counts as the larger is rounding noise (verl's vf_clipfrac alike): a token or
        # two of the 30-60 of an update may flip with the summation order.
        np.testing.assert_allclose(
            [m["value_clip_frac"] for m in seen["a"]],
            [m["value_clip_frac"] for m in metrics],
            atol=0.04,
            err_msg=f"rank {rank} of {len(ranks)}: value_clip_frac per step",
        )
    # Something to learn and to clip: the critic moved, its clipped loss bound in epoch 2.
    assert all(m["critic_grad_norm"] > 0 for m in metrics)
    assert any(m["value_clip_frac"] > 0 for m in metrics)
    assert not math.isclose(metrics[-1]["value_mean"], 0.0)
    same_weights(ranks[0]["a_weights"], weights, "policy")
    same_weights(ranks[0]["a_critic"], critic, "critic")
    assert all(seen["a_critic"] == {} for seen in ranks[1:]), "only rank 0 gathers"


@pytest.mark.timeout(300)
def test_a_resumed_fsdp_critic_continues_exactly(ranks) -> None:
    for rank, seen in enumerate(ranks):
        assert seen["b_step"] == CHECKPOINT_AFTER
        for name in ("loss", "grad_norm", "value_loss", "critic_grad_norm", "value_mean"):
            np.testing.assert_allclose(
                [m[name] for m in seen["b"]],
                [m[name] for m in seen["a"][CHECKPOINT_AFTER:]],
                rtol=1e-6,
                atol=1e-9,
                err_msg=f"rank {rank}: {name} after resume",
            )
    for key in ("weights", "critic"):
        for name, tensor in ranks[0][f"a_{key}"].items():
            torch.testing.assert_close(
                ranks[0][f"b_{key}"][name], tensor, rtol=1e-6, atol=1e-7, msg=f"{key} {name}"
            )


@pytest.mark.timeout(300)
def test_the_critic_syncs_its_gradients_once_per_update(ranks) -> None:
    # One rank reduce-scatters nothing (FSDP2 has no peer to reduce with): the count at 2.
    for rank, seen in enumerate(ranks):
        assert len(ranks) == 1 or seen["reduce_scatters"] == seen["units"], (
            f"rank {rank}: {seen['reduce_scatters']} reduce-scatters in an update of 3 passes "
            f"over {seen['units']} FSDP units of the policy and the critic"
        )
        bf16 = seen["bf16"]
        assert np.isfinite(bf16["value_loss"]) and bf16["critic_grad_norm"] > 0, bf16
