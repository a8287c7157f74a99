"""What the vLLM and SGLang adapters share: the lazy import and its version floor, the model
skeleton, weights in HF names and in buckets, the thread an engine lives on, and the checks that
turn one engine response into a `Sample`.

Neither engine is a dependency: they are the extras ``jetrl[vllm]`` and ``jetrl[sglang]``,
imported only when ``rollout.engine`` names them (`require`, `require_version`). Everything
here runs on CPU without them, so their CI tests need no GPU.
"""

import asyncio
import importlib
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engines.protocols import EngineUnavailable, FinishReason, Sample

T = TypeVar("T")


def require(module: str, extra: str) -> ModuleType:
    """`module` imported, or one line saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise EngineUnavailable(
            f"rollout.engine {extra} needs the {module} package ({exc.__class__.__name__}: {exc}); "
            f"install it with: pip install 'jetrl[{extra}]'"
        ) from None


def release(version: str) -> tuple[int, ...]:
    """A version string's leading release numbers: "0.5.10.post1" -> (0, 5, 10)."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"{version!r} is not a version number")
    return tuple(int(part) for part in match.group(0).split("."))


def require_version(module: ModuleType, extra: str, floor: str, why: str) -> None:
    """Refuses, in one line, an installed `module` older than `floor` (`why`: what the older
    ones do wrong). The version is the module's ``__version__``, else its distribution's."""
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            version = metadata.version(module.__name__)
        except metadata.PackageNotFoundError:
            return  # a source checkout without metadata: nothing to compare
    if release(str(version)) < release(floor):
        raise EngineUnavailable(
            f"rollout.engine {extra} needs {module.__name__} >= {floor}, not {version} ({why}); "
            f"install it with: pip install 'jetrl[{extra}]'"
        )


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
    """`tensors` as the (HF name, tensor) pairs an engine's loader takes, cast to `dtype`, in
    the model's parameter order.

    `tensors` may be any subset of `model`'s parameters (a version's changed tensors; tied
    weights appear once, as `named_parameters` lists them, and both engines' loaders skip the
    tied head). A name the model does not have raises KeyError here: an engine's loader may
    skip a name it does not know (vLLM skips some), which would leave the old weights in
    silently. Shapes are checked here too, so a wrong tensor is refused before the GPU copy.
    """
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise KeyError(f"weight names the model does not have: {unknown[:5]}")
    pairs = []
    for name, param in params.items():
        if name not in tensors:
            continue
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


def weight_buckets(
    weights: Sequence[tuple[str, torch.Tensor]], max_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """`weights` in order, cut into buckets of at most `max_bytes` of tensor data each, so one
    call into the engine carries a bounded message; a tensor larger than `max_bytes` goes
    alone in its bucket (a tensor is never split)."""
    if max_bytes < 1:
        raise ValueError(f"a weight bucket must hold at least 1 byte, not {max_bytes}")
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or (buckets[-1] and size + nbytes > max_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


class EngineThread:
    """One thread that builds an engine and makes every call into it, with an event loop of its
    own set as the thread's current loop (never run forever).

    An engine whose synchronous methods run an asyncio loop themselves (SGLang's `Engine`:
    ``self.loop.run_until_complete(...)``) binds, when built, the loop running in the building
    thread, else that thread's own (the one set here, or a new one). Built here, it binds a loop
    no other thread runs, and every
    call runs it from this same thread: the worker's own loop (and the threads
    `asyncio.to_thread` lends it) never meet the engine's.
    """

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(1, name, initializer=self._own_loop)

    @staticmethod
    def _own_loop() -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` run on the engine's thread; its result or its exception."""
        return self._executor.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._executor.shutdown(wait=False)


def torch_dtype(name: str) -> torch.dtype | None:
    """A config's dtype name as torch's; "auto" -> None (the engine picks the checkpoint's)."""
    return None if name == "auto" else getattr(torch, name)
