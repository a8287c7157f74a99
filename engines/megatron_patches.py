"""Patches megatron-core needs around our use of it, apart from the engine's steps
(`engines.megatron_train`):

    cpu_workarounds()        megatron-core 0.16's CUDA-only spots, on a CPU model (dev, CI)
    no_cuda_copy(active)     while building a tied model cut into stages on the CPU
    recompute_in_backward()  `trainer.activation_checkpointing` per TransformerLayer (torch's
                             checkpoint, not megatron's: see its docstring for the H200 failure)

megatron-core is imported inside the functions, never at module import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint


def cpu_workarounds() -> None:
    """Let megatron-core 0.16's forward run on a CPU model (development and CI;
    no GPU run needs it).

    With the local layer spec and `use_cpu_initialization` the model builds on the CPU, but its
    forward reaches for CUDA in two places: the rotary embedding moves its frequencies to
    `torch.cuda.current_device()` (here: "cpu"), and the attention forks the model-parallel CUDA
    RNG state around dropout (dropout is 0 in this engine, so the fork is a no-op context); at
    pipeline parallel, two more (below). All are process-wide patches,
    applied only in a process whose engine runs on the CPU."""
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # Pipeline parallel: the p2p shape exchange synchronizes the CUDA device, and the 1F1B
    # schedule counts tokens in a tensor made on "cuda".
    from megatron.core.pipeline_parallel import schedules

    torch.cuda.synchronize = lambda *a, **k: None
    schedules.torch = _CpuTorch()


class _CpuTorch:
    """`torch` as megatron's schedules module sees it on the CPU:
    a tensor asked for on "cuda" is made on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


@contextlib.contextmanager
def no_cuda_copy(active: bool) -> Iterator[None]:
    """While building a CPU GPTModel: `Tensor.cuda()` returns the tensor. A tied model cut into
    pipeline stages moves its embedding to CUDA to sum it over the first and last stage."""
    if not active:
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def recompute_in_backward(layer: torch.nn.Module) -> None:
    """`trainer.activation_checkpointing` for one megatron TransformerLayer: its forward runs
    under torch's non-reentrant checkpoint, so backward recomputes it instead of keeping its
    activations.

    Not megatron's own `recompute_granularity`: its CheckpointFunction recomputes outside the
    forward's autocast, and with bf16 compute (autocast, float32 masters) the recomputed layer
    met bf16 activations with float32 weights ("expected mat1 and mat2 to have the same dtype",
    the first H200 run, 2026-12-04). torch's checkpoint re-enters the forward's autocast state,
    and needs no CUDA RNG tracker (dropout is 0 here).
    """
    forward = layer.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed
