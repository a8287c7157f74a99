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
``collective_rpc`` (the model's own loader maps HF names onto its fused layers), one RPC per
bucket of at most ``weight_bucket_bytes`` of tensors (`weight_buckets`), each bucket as
safetensors bytes (`pack_bucket`: the engine core decodes the call's arguments without types,
so a tensor would arrive as a list), then drops the prefix cache, whose KV entries the old
weights computed. The engine is not restarted. Each bucket is checked (`load_on_worker`,
`check_bucket`): every worker hashes the bytes it received and loads them only when the hash is
the one sent, then reads back each parameter that has a tensor's HF name and shape and
compares it; a disagreement raises `WeightsNotLoaded` naming the bucket and the tensor.
The loader is a plain function, which vLLM's msgpack encoder
(``vllm/v1/serial_utils.py`` `MsgpackEncoder`) refuses unless
``VLLM_ALLOW_INSECURE_SERIALIZATION`` is set, and which the engine-core process decodes only
if it started with it set: `allow_function_rpc`, called by both vLLM adapters before the
engine is built, is that rule.

Memory (`ReleasableEngine`, `placement: colocated`): ``LLM.sleep(level=1)`` (weights copied
to host memory, the KV cache dropped) and ``LLM.wake_up()`` (``vllm/entrypoints/llm.py``),
which vLLM allows only on an engine built with ``enable_sleep_mode=True``
(`VLLMSettings.sleep_mode`, set by `engines.build` when the run is colocated; vLLM asserts
"Sleep mode is not enabled in the model config" otherwise). Weights that arrive while asleep
are loaded after the wake (`engines.release.Deferred`): the sleeping engine's parameters are
unmapped. Never run on a GPU yet (docs/engines.md).
"""

import hashlib
import os
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from engines.external_rollout import (
    EngineUnavailable,
    eos_token_ids,
    make_sample,
    named_weights,
    require,
    skeleton,
    torch_dtype,
    weight_buckets,
)
from engines.protocols import Sample, SamplingParams, WeightsNotLoaded
from engines.release import Deferred, weight_bytes

LOGPROBS_MODE = "processed_logprobs"
"""`LLM(logprobs_mode=...)`: log-probs after temperature (see the module doc)."""

INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
"""Lets vLLM's msgpack encoder and decoder carry a function (pickled) through `collective_rpc`."""

DEFAULT_WEIGHT_BUCKET_BYTES = 512 * 2**20
"""`VLLMSettings.weight_bucket_bytes`' default (`schemas.rollout_config` documents it)."""


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
    weight_bucket_bytes: int = DEFAULT_WEIGHT_BUCKET_BYTES
    sleep_mode: bool = False
    """``enable_sleep_mode``: what `sleep` / `wake_up` need (`placement: colocated`)."""


def allow_function_rpc(environ: MutableMapping[str, str] = os.environ) -> None:
    """Sets ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` unless it is set, so that vLLM carries our
    loader function through `collective_rpc`; refuses it set to what vLLM reads as off (vLLM:
    ``bool(int(value))``). Must run before the engine is built: its engine-core process
    reads the variable when it starts."""
    value = environ.get(INSECURE_SERIALIZATION_ENV)
    if value is None:
        environ[INSECURE_SERIALIZATION_ENV] = "1"
        return
    try:
        allowed = bool(int(value))
    except ValueError:
        allowed = False
    if not allowed:
        raise EngineUnavailable(
            f"{INSECURE_SERIALIZATION_ENV}={value!r}: vLLM would refuse the weight loader this "
            "adapter sends through collective_rpc (a function); unset it or set it to 1"
        )


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
        "enable_sleep_mode": settings.sleep_mode,
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


def pack_bucket(weights: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """One bucket as the `collective_rpc` argument: safetensors bytes, which vLLM's msgpack
    carries as they are. Not the tensors themselves: the engine-core process decodes a utility
    call without types, so a tensor would reach the worker as ``[dtype, shape, buffer]``."""
    return safetensors.torch.save({name: tensor.contiguous() for name, tensor in weights})


def load_on_worker(worker: Any, bucket: bytes, sha256: str | None = None) -> dict[str, Any]:
    """Runs in each vLLM worker (`collective_rpc` passes the worker first): the model's own
    loader copies each HF-named tensor of the `pack_bucket` bytes into its (possibly fused,
    sharded) parameter, then the parameters that carry the same name and shape as a tensor of
    the bucket are read back and compared with it.

    Bytes whose sha256 is not `sha256` (what the adapter sent) are not loaded. Returns what
    `check_bucket` reads: the bytes' sha256, whether they were loaded, the names read back and
    those that differ. Fused (q/k/v, gate/up) and tensor-parallel-sharded parameters have no
    such twin and are not read back here."""
    data = bytes(bucket)
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        return {"sha256": digest, "loaded": False, "checked": [], "differ": []}
    weights = safetensors.torch.load(data)
    model = worker.model_runner.model
    model.load_weights(weights=iter(weights.items()))
    params = dict(model.named_parameters())
    checked, differ = [], []
    for name, tensor in weights.items():
        param = params.get(name)
        if param is None or tuple(param.shape) != tuple(tensor.shape):
            continue
        checked.append(name)
        if not torch.equal(param.data, tensor.to(device=param.device, dtype=param.dtype)):
            differ.append(name)
    return {"sha256": digest, "loaded": True, "checked": checked, "differ": differ}


def check_bucket(index: int, names: Sequence[str], sha256: str, answers: Sequence[Any]) -> set[str]:
    """Every worker's `load_on_worker` answer for bucket `index` (tensors `names`, bytes of
    `sha256`): the names read back, or `WeightsNotLoaded` naming the bucket and the tensor."""
    where = f"vllm: bucket {index} ({names[0]} .. {names[-1]}, {len(names)} tensors)"
    checked: set[str] = set()
    for rank, answer in enumerate(answers):
        if not isinstance(answer, dict) or answer.get("sha256") != sha256 or not answer["loaded"]:
            got = answer.get("sha256") if isinstance(answer, dict) else answer
            raise WeightsNotLoaded(
                f"{where}: worker {rank} received bytes of sha256 {got}, not {sha256}"
            )
        if answer["differ"]:
            raise WeightsNotLoaded(
                f"{where}: worker {rank} reads back {answer['differ'][0]} unlike the tensor sent"
            )
        checked |= set(answer["checked"])
    return checked


def load_weights(
    llm: Any,
    weights: list[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_WEIGHT_BUCKET_BYTES,
) -> set[str]:
    """Swaps `weights` into a running `vllm.LLM` without a restart, one `collective_rpc` per
    bucket of at most `bucket_bytes` (a larger tensor alone), each checked (`check_bucket`).
    Returns the names read back."""
    checked: set[str] = set()
    for index, bucket in enumerate(weight_buckets(weights, bucket_bytes)):
        packed = pack_bucket(bucket)
        digest = hashlib.sha256(packed).hexdigest()
        answers = llm.collective_rpc(load_on_worker, args=(packed, digest))
        checked |= check_bucket(index, [name for name, _ in bucket], digest, answers)
    llm.reset_prefix_cache()  # cached KV was computed by the old weights
    return checked


class VLLMRolloutEngine:
    """A `RolloutEngine` over an in-process `vllm.LLM`. Needs CUDA and the vllm extra."""

    def __init__(self, model_dir: Path, settings: VLLMSettings = VLLMSettings()) -> None:
        vllm = require("vllm", "vllm")
        allow_function_rpc()  # before the engine-core process starts
        self.model = skeleton(model_dir, settings.max_model_len)
        self.eos_token_ids = eos_token_ids(model_dir)
        self.dtype = torch_dtype(settings.dtype)
        self.bucket_bytes = settings.weight_bucket_bytes
        self._vllm = vllm
        self.llm = vllm.LLM(**llm_kwargs(model_dir, settings))
        self.version = 0
        self.asleep = False
        """Its memory given back (`release_memory`): no generation, loads deferred."""
        self.deferred = Deferred()

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        """`n` samples per prompt, grouped per prompt; see the module doc for the log-probs."""
        if self.asleep:
            raise RuntimeError("vllm: generate while the engine sleeps (its memory released)")
        if not prompts or min(map(len, prompts)) == 0:
            raise ValueError("need at least one non-empty prompt")
        sampling = self._vllm.SamplingParams(**sampling_kwargs(params, n, self.eos_token_ids))
        requests = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False
        )
        stop_ids = (*self.eos_token_ids, *params.stop_token_ids)
        return [request_to_samples(r, n, stop_ids) for r in requests]

    def load_state_dict(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Loads `tensors` (named as `TrainEngine.export_weights`; any subset of the model's)
        into the running engine, each bucket checked (`load_weights`). Asleep: names and
        shapes checked now, the tensors loaded on `resume_memory` (`version` set now: nothing
        generates before then)."""
        weights = named_weights(tensors, self.model, self.dtype)
        version = self.version + 1 if version is None else version
        with self.deferred.lock:  # not while the engine falls asleep or wakes
            if self.asleep:
                self.deferred.add(tensors, version)
            else:
                load_weights(self.llm, weights, self.bucket_bytes)
            self.version = version

    def device_bytes(self) -> int:
        """The weights' bytes (the model's parameters in the engine's dtype) while awake, 0
        asleep. A lower bound: the KV cache vLLM sizes at start-up is not counted."""
        return 0 if self.asleep else weight_bytes(self.model, self.dtype)

    def release_memory(self) -> None:
        """``sleep(level=1)``: weights to host memory, KV cache dropped. Twice: nothing."""
        with self.deferred.lock:
            if not self.asleep:
                self.llm.sleep(level=1)
                self.asleep = True

    def resume_memory(self) -> None:
        """``wake_up()``, then the weights that arrived meanwhile, loaded and checked."""
        with self.deferred.lock:
            if not self.asleep:
                return
            self.llm.wake_up()
            self.asleep = False
            deferred = self.deferred.take()
            if deferred is not None:
                self.load_state_dict(*deferred)
