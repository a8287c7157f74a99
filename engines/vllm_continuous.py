"""Continuous batching and partial rollout on vLLM's `AsyncLLM` (``pip install 'jetrl[vllm]'``).

Read from vLLM's source (``vllm/v1/engine/async_llm.py``: `AsyncLLM.generate`, `abort`,
`pause_generation(mode=...)`, `resume_generation`, `collective_rpc`, `reset_prefix_cache`;
``vllm/sampling_params.py``: `RequestOutputKind`); never run here (no GPU). The shared logic
is `engines.continuous`; requests and log-probs are those of the batch adapter
(`engines.vllm_rollout`: ``processed_logprobs``, top_p 1), one sample per request, streamed
as deltas (``output_kind=DELTA``: each `RequestOutput` holds only the new tokens and their
log-probs).

- Each sample is one `AsyncLLM.generate` request, submitted when the worker calls
  `generate_sample`; vLLM batches the requests in flight (``max_num_seqs`` = `slots`).
- ``resubmit`` (default): a pause cancels the requests' streams (vLLM aborts a request whose
  `generate` is cancelled) and `abort`s them; after the load each is resubmitted as prompt +
  the tokens it has. ``keep``: ``pause_generation(mode="keep", clear_cache=False)`` freezes the
  requests in the scheduler and ``resume_generation`` lets them go on (vLLM releases that
  have ``mode``; older ones are refused at start-up).
- Weights: ``collective_rpc`` runs the model's own ``load_weights`` on every worker, one RPC
  per bucket of ``weight_bucket_bytes``, as safetensors bytes (the batch adapter's
  `pack_bucket`); the function travels pickled, so the adapter sets
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` before the engine starts (the batch adapter's
  `allow_function_rpc`); each bucket checked as the batch adapter checks it (`check_bucket`:
  the bytes' sha256 as received, the read-back); then ``reset_prefix_cache``.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engines.continuous import Chunk, ContinuousAdapter, EngineLoop, PartialMode
from engines.external_rollout import (
    EngineUnavailable,
    eos_token_ids,
    require,
    skeleton,
    torch_dtype,
    weight_buckets,
)
from engines.protocols import SamplingParams
from engines.vllm_rollout import (
    VLLMSettings,
    allow_function_rpc,
    check_bucket,
    llm_kwargs,
    load_on_worker,
    pack_bucket,
    sampling_kwargs,
)


def async_engine_kwargs(model_dir: Path, settings: VLLMSettings, slots: int) -> dict[str, Any]:
    """Keyword arguments of `vllm.AsyncEngineArgs`: the batch adapter's,
    the batch size capped at `slots`."""
    return {**llm_kwargs(model_dir, settings), "max_num_seqs": slots}


def request_kwargs(params: SamplingParams, eos: Sequence[int], delta: Any) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one sample, streamed as deltas (`delta`:
    ``RequestOutputKind.DELTA``)."""
    return {**sampling_kwargs(params, 1, eos), "output_kind": delta}


def delta_chunk(output: Any) -> Chunk:
    """One delta `RequestOutput` (one completion) as a `Chunk`;
    the finish reason once ``finished``."""
    if len(output.outputs) != 1:
        raise ValueError(f"vllm: {len(output.outputs)} completions in a request of n=1")
    completion = output.outputs[0]
    tokens = [int(t) for t in completion.token_ids]
    if tokens and completion.logprobs is None:
        raise ValueError("vllm: a completion without log-probs (the request must set logprobs=0)")
    ranked_positions = list(completion.logprobs or [])
    if len(ranked_positions) != len(tokens):
        raise ValueError(
            f"vllm: {len(tokens)} new tokens but {len(ranked_positions)} log-prob positions"
        )
    logprobs = []
    for position, (token, ranked) in enumerate(zip(tokens, ranked_positions, strict=True)):
        if token not in ranked:
            raise ValueError(
                f"vllm: new position {position} reports no log-prob for its sampled token {token}"
            )
        logprobs.append(float(ranked[token].logprob))
    finish = (completion.finish_reason or "abort") if output.finished else None
    return Chunk(tuple(tokens), tuple(logprobs), finish)


class VLLMContinuousEngine(ContinuousAdapter):
    """A `ContinuousEngine` over an in-process `vllm.AsyncLLMEngine`. Needs CUDA and the vllm
    extra."""

    name = "vllm"

    def __init__(
        self,
        model_dir: Path,
        settings: VLLMSettings = VLLMSettings(),
        slots: int = 64,
        partial_mode: PartialMode = "resubmit",
    ) -> None:
        vllm = require("vllm", "vllm")
        allow_function_rpc()  # collective_rpc with our loader, before the engine core starts
        super().__init__(slots, eos_token_ids(model_dir), partial_mode, EngineLoop("vllm-engine"))
        self.model = skeleton(model_dir, settings.max_model_len)
        self.dtype = torch_dtype(settings.dtype)
        self.bucket_bytes = settings.weight_bucket_bytes
        self._vllm = vllm
        self._delta = require("vllm.sampling_params", "vllm").RequestOutputKind.DELTA
        args = vllm.AsyncEngineArgs(**async_engine_kwargs(model_dir, settings, slots))
        self.engine = self.loop.run(
            self._start(args)
        )  # built on the engine loop, which its output handler needs
        if (
            partial_mode == "keep"
            and "mode" not in inspect.signature(self.engine.pause_generation).parameters
        ):
            self.close()
            raise EngineUnavailable(
                "rollout.engine.partial_mode keep (vllm) needs vLLM's "
                "pause_generation(mode='keep') "
                "(a newer vLLM); "
                "use partial_mode resubmit"
            )

    async def _start(self, args: Any) -> Any:
        return self._vllm.AsyncLLMEngine.from_engine_args(args)

    def check(self, params: SamplingParams) -> None:
        sampling_kwargs(params, 1, self.eos_token_ids)  # refuses top_p < 1

    async def stream(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[Chunk]:
        sampling = self._vllm.SamplingParams(
            **request_kwargs(params, self.eos_token_ids, self._delta)
        )
        async for output in self.engine.generate(
            {"prompt_token_ids": prompt}, sampling, request_id=request_id
        ):
            yield delta_chunk(output)

    async def engine_abort(self, request_ids: list[str]) -> None:
        await self.engine.abort(request_ids)

    async def engine_pause(self) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=False)

    async def engine_resume(self) -> None:
        await self.engine.resume_generation()

    async def engine_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for index, bucket in enumerate(weight_buckets(weights, self.bucket_bytes)):
            packed = pack_bucket(bucket)
            digest = hashlib.sha256(packed).hexdigest()
            answers = await self.engine.collective_rpc(load_on_worker, args=(packed, digest))
            check_bucket(index, [name for name, _ in bucket], digest, answers)
        await self.engine.reset_prefix_cache()  # cached KV was computed by the old weights

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        super().close()
