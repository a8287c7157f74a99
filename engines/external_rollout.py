"""What the vLLM and SGLang adapters share: the lazy import, the model skeleton, weights in HF
names and the checks that turn one engine response into a `Sample`.

Neither engine is a dependency: they are the extras ``jetrl[vllm]`` and ``jetrl[sglang]``,
imported only when ``rollout.engine`` names them (`require`). Everything here runs on CPU
without them, so their CI tests need no GPU.
"""

import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engines.protocols import EngineUnavailable, FinishReason, Sample


def require(module: str, extra: str) -> ModuleType:
    """`module` imported, or one line saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise EngineUnavailable(
            f"rollout.engine {extra} needs the {module} package ({exc.__class__.__name__}: {exc}); "
            f"install it with: pip install 'jetrl[{extra}]'"
        ) from None


def skeleton(model_dir: Path, context: int | None = None) -> torch.nn.Module:
    """The model's HF module on the meta device: its parameter names and shapes, no memory.

    The engine holds the real weights (on its GPU, maybe in another process); the rollout
    still needs the names and shapes to refuse a wrong manifest before fetching a byte
    (`engines.weights.check_manifest`) and the vocabulary and context to check prompts. A
    `context` below the model's (the engine's max_model_len) becomes the context the rollout
    checks prompts against, so a prompt the engine would refuse is rejected up front.
    """
    config = AutoConfig.from_pretrained(model_dir)
    model_context = getattr(config, "max_position_embeddings", None)
    if context is not None and (model_context is None or context < model_context):
        config.max_position_embeddings = context
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """The eos ids of the model's generation config, which the HF engine stops on too."""
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    if eos is None:
        raise ValueError(f"{model_dir} declares no eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (eos,)


def named_weights(
    tensors: dict[str, torch.Tensor], model: torch.nn.Module, dtype: torch.dtype | None
) -> list[tuple[str, torch.Tensor]]:
    """`tensors` as the (HF name, tensor) pairs an engine's loader takes, cast to `dtype`.

    The names must be exactly `model`'s parameters (tied weights appear once, as
    `named_parameters` lists them; both engines' loaders skip the tied head). Shapes are
    checked here, not left to the engine, so a wrong tensor is refused before the GPU copy.
    """
    params = dict(model.named_parameters())
    if set(tensors) != set(params):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise KeyError(f"weight names differ: missing {missing}, extra {extra}")
    pairs = []
    for name, param in params.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)}, the model's is {tuple(param.shape)}"
            )
        pairs.append((name, (tensor if dtype is None else tensor.to(dtype)).contiguous()))
    return pairs


def make_sample(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    finish_reason: str | None,
    stop_ids: Sequence[int],
    engine: str,
) -> Sample:
    """One engine response as a `Sample`, refusing what would break the trainer's alignment.

    A "stop" response must end with one of `stop_ids` (the trainer learns the stop from it);
    an "abort" or unknown reason is an error, never a silently short sample.
    """
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{engine}: {len(token_ids)} tokens but {len(logprobs)} log-probs")
    if not token_ids:
        raise ValueError(f"{engine}: an empty response (finish reason {finish_reason!r})")
    reason: FinishReason
    if finish_reason == "stop":
        if token_ids[-1] not in stop_ids:
            raise ValueError(
                f"{engine}: finished by 'stop' on token {token_ids[-1]}, "
                f"not one of the stop ids {sorted(stop_ids)}"
            )
        reason = "stop"
    elif finish_reason == "length":
        reason = "length"
    else:
        raise ValueError(
            f"{engine}: response finished by {finish_reason!r}, expected 'stop' or 'length'"
        )
    return Sample(
        token_ids=torch.tensor(list(token_ids), dtype=torch.long),
        logprobs=torch.tensor(list(logprobs), dtype=torch.float32),
        finish_reason=reason,
    )


def torch_dtype(name: str) -> torch.dtype | None:
    """A config's dtype name as torch's; "auto" -> None (the engine picks the checkpoint's)."""
    return None if name == "auto" else getattr(torch, name)
