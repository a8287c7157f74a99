"""Rollout on vLLM (``pip install 'jetrl[vllm]'``): token ids in,
token ids and behaviour log-probs out.

Targets vLLM >= 0.10.2 (the V1 engine), read from its source: ``vllm/sampling_params.py``
(`SamplingParams`), ``vllm/outputs.py`` (`RequestOutput`, `CompletionOutput`),
``vllm/logprobs.py`` (`Logprob`), ``vllm/v1/sample/sampler.py`` (`logprobs_mode`) and
``vllm/entrypoints/llm.py`` (`LLM.generate`, `LLM.collective_rpc`, `LLM.reset_prefix_cache`).

Behaviour log-probs. vLLM reports, for ``logprobs=0``, the log-prob of each sampled token only,
from the distribution `logprobs_mode` names. Its default, ``raw_logprobs``, is
``log_softmax(logits)`` at temperature 1, not ours. ``processed_logprobs`` (from 0.10.2 on, the
version whose sampler applies temperature before taking them; 0.10.0-0.10.1 took them before)
is ``log_softmax`` of the logits after temperature *and* top-k/top-p filtering, so it equals
ours (`engines.hf_rollout`: temperature applied, top-p not renormalised) exactly when top_p is 1.
This adapter asks for ``processed_logprobs`` and refuses top_p < 1 rather than hand the trainer
log-probs renormalised over the nucleus. Greedy (temperature 0): vLLM divides by 1, as we do.

Weights: `load_weights` runs ``model_runner.model.load_weights`` on every worker through
``collective_rpc`` (the model's own loader maps HF names onto its fused layers), then drops the
prefix cache, whose KV entries the old weights computed. The engine is not restarted.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.external_rollout import (
    eos_token_ids,
    make_sample,
    named_weights,
    require,
    skeleton,
    torch_dtype,
)
from engines.protocols import Sample, SamplingParams

LOGPROBS_MODE = "processed_logprobs"
"""`LLM(logprobs_mode=...)`: log-probs after temperature (see the module doc)."""


@dataclass(frozen=True)
class VLLMSettings:
    """`rollout.engine` of type vllm (`schemas.rollout_config.VLLMRolloutConfig` documents each
    field)."""

    gpu_memory_utilization: float = 0.5
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    enforce_eager: bool = False
    dtype: str = "auto"
    seed: int = 0


def llm_kwargs(model_dir: Path, settings: VLLMSettings) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` (its `EngineArgs` fields)."""
    return {
        "model": str(model_dir),
        "dtype": settings.dtype,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "max_model_len": settings.max_model_len,
        "enforce_eager": settings.enforce_eager,
        "seed": settings.seed,
        "logprobs_mode": LOGPROBS_MODE,
    }


def sampling_kwargs(
    params: SamplingParams, n: int, eos: Sequence[int], seed: int | None = None
) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for `n` samples of one prompt.

    The eos ids are passed as stop tokens explicitly, so vLLM stops where the HF engine would
    whatever eos its tokenizer declares. ``logprobs=0``: the sampled token's log-prob only.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    if params.top_p < 1.0:
        raise ValueError(
            f"rollout.engine vllm needs top_p 1 (not {params.top_p}): its log-probs are "
            "renormalised over the top-p nucleus, the trainer's are not; use engine hf or sglang "
            "for top_p < 1"
        )
    stop = list(dict.fromkeys((*eos, *params.stop_token_ids)))
    kwargs: dict[str, Any] = {
        "n": n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "stop_token_ids": stop,
        "logprobs": 0,
        "detokenize": False,
    }
    if seed is not None:
        kwargs["seed"] = seed
    return kwargs


def completion_to_sample(completion: Any, stop_ids: Sequence[int]) -> Sample:
    """One `CompletionOutput` (``token_ids``, ``logprobs`` [L] of {token id: `Logprob`},
    ``finish_reason``) as a `Sample`; the log-prob of position t is that of ``token_ids[t]``."""
    token_ids = list(completion.token_ids)
    if completion.logprobs is None:
        raise ValueError("vllm: a completion without log-probs (the request must set logprobs=0)")
    logprobs = []
    for position, (token, ranked) in enumerate(zip(token_ids, completion.logprobs, strict=False)):
        if token not in ranked:
            raise ValueError(
                f"vllm: position {position} reports no log-prob for its sampled token {token}"
            )
        logprobs.append(float(ranked[token].logprob))
    if len(completion.logprobs) != len(token_ids):
        logprobs.extend(
            [0.0] * (len(completion.logprobs) - len(token_ids))
        )  # make_sample names the mismatch
    return make_sample(token_ids, logprobs, completion.finish_reason, stop_ids, "vllm")


def request_to_samples(request: Any, n: int, stop_ids: Sequence[int]) -> list[Sample]:
    """One `RequestOutput` (its ``outputs``, in ``index`` order) as its `n` samples."""
    completions = sorted(request.outputs, key=lambda c: c.index)
    if len(completions) != n:
        raise ValueError(f"vllm: {len(completions)} completions for a request of n={n}")
    return [completion_to_sample(c, stop_ids) for c in completions]


def load_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs in each vLLM worker (`collective_rpc` passes the worker first): the model's own
    loader copies each HF-named tensor into its (possibly fused, sharded) parameter."""
    worker.model_runner.model.load_weights(weights=iter(weights))


def load_weights(llm: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Swaps `weights` into a running `vllm.LLM` without a restart."""
    llm.collective_rpc(load_on_worker, args=(weights,))
    llm.reset_prefix_cache()  # cached KV was computed by the old weights


class VLLMRolloutEngine:
    """A `RolloutEngine` over an in-process `vllm.LLM`. Needs CUDA and the vllm extra."""

    def __init__(self, model_dir: Path, settings: VLLMSettings = VLLMSettings()) -> None:
        vllm = require("vllm", "vllm")
        self.model = skeleton(model_dir, settings.max_model_len)
        self.eos_token_ids = eos_token_ids(model_dir)
        self.dtype = torch_dtype(settings.dtype)
        self._vllm = vllm
        self.llm = vllm.LLM(**llm_kwargs(model_dir, settings))
        self.version = 0

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        """`n` samples per prompt, grouped per prompt; see the module doc for the log-probs."""
        if not prompts or min(map(len, prompts)) == 0:
            raise ValueError("need at least one non-empty prompt")
        sampling = self._vllm.SamplingParams(**sampling_kwargs(params, n, self.eos_token_ids))
        requests = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False
        )
        stop_ids = (*self.eos_token_ids, *params.stop_token_ids)
        return [request_to_samples(r, n, stop_ids) for r in requests]

    def load_state_dict(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Loads `tensors` (named as `TrainEngine.export_weights`) into the running engine."""
        load_weights(self.llm, named_weights(tensors, self.model, self.dtype))
        self.version = self.version + 1 if version is None else version
