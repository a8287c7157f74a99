"""Continuous batching and partial rollout on SGLang's `Engine` (``pip install 'jetrl[sglang]'``).

Read from SGLang's source (``python/sglang/srt/entrypoints/engine.py``: `Engine.async_generate`
with ``stream=True`` and ``rid``; ``managers/tokenizer_manager.py``: `abort_request`,
`pause_generation`, `continue_generation`, `update_weights_from_tensor`, `begin_weight_update`,
`end_weight_update`; ``managers/io_struct.py``: `PauseGenerationReqInput(mode=...)`,
`ContinueGenerationReqInput`, `UpdateWeightsFromTensorReqInput`, `BeginWeightUpdateReqInput`,
`EndWeightUpdateReqInput`); never run here (no GPU). The shared logic is
`engines.continuous`; requests and log-probs are those of the batch adapter
(`engines.sglang_rollout`: temperature-scaled, before top-p), one sample per request.

- The `Engine` is built on the adapter's loop (its tokenizer manager binds to the loop it was
  made on), so every call goes through the async tokenizer manager there: `Engine`'s own
  synchronous methods run the loop themselves and cannot while it runs in our thread. That
  thread is not the main one, so SGLang must be >= 0.5.10 (`engines.sglang_rollout`
  `require_sglang`: older releases call ``signal.signal`` there, which Python refuses).
- Streams: a chunk's ``meta_info.output_token_logprobs`` holds every token so far, or only
  the new ones when the server streams incrementally; `stream_delta` tells them apart by
  ``completion_tokens`` (the tokens so far, in both).
- ``resubmit`` (default): a pause cancels the streams and `abort_request`s each request; after
  the load each is resubmitted as prompt + the tokens it has. ``keep``: the tokenizer manager's
  ``pause_generation`` in ``retract`` mode (running requests go back to the waiting queue; the
  cache is flushed by the load, so their KV is recomputed with the new weights) and
  ``continue_generation``.
- Weights: ``update_weights_from_tensor`` with the (HF name, tensor) pairs serialized once per
  tensor-parallel rank, as `Engine.update_weights_from_tensor` does, one call per bucket of
  ``weight_bucket_bytes`` (``flush_cache`` with the last), each checked by its answer and by
  ``get_weights_by_name`` (``GetWeightsByNameReqInput``) of its first tensor's first row.
  SGLang 0.5.23 loads only inside a weight-update session (outside one it answers ``(False,
  "update_weights_from_tensor must run between begin_weight_update() and
  end_weight_update()")``): each bucket's update runs in one (`session`, closed also when the
  load fails), as the batch adapter's do; an SGLang without the calls loads without one.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
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
from engines.sglang_group import answered
from engines.sglang_rollout import (
    SGLangSettings,
    check_first_row,
    check_logprob_env,
    check_update,
    engine_kwargs,
    require_sglang,
    sampling_params,
)


def continuous_engine_kwargs(
    model_dir: Path, settings: SGLangSettings, slots: int
) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine`: the batch adapter's,
    the running requests capped at `slots`."""
    return {**engine_kwargs(model_dir, settings), "max_running_requests": slots}


def stream_delta(output: dict[str, Any], seen: int) -> tuple[Chunk, int]:
    """One streamed output of a request as the `Chunk` of tokens after the first `seen`, and
    how many the request has now. Cumulative and incremental streams both carry
    ``completion_tokens`` (the tokens so far), which tells them apart."""
    meta = output.get("meta_info")
    if not isinstance(meta, dict) or meta.get("output_token_logprobs") is None:
        raise ValueError(
            "sglang: an output without meta_info.output_token_logprobs "
            "(request return_logprob=True)"
        )
    entries = list(meta["output_token_logprobs"])  # of (logprob, token id, text or None)
    total = int(meta.get("completion_tokens", seen + len(entries)))
    if len(entries) == total:  # cumulative: everything so far
        new = entries[seen:]
    elif len(entries) == total - seen:  # incremental: only what came since
        new = entries
    else:
        raise ValueError(
            f"sglang: {len(entries)} log-probs in a chunk, {total} tokens so far, "
            f"{seen} seen before"
        )
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    chunk = Chunk(tuple(int(e[1]) for e in new), tuple(float(e[0]) for e in new), reason)
    return chunk, total


def sglang_io() -> SimpleNamespace:
    """The SGLang request types and serializer the adapter builds its control calls from."""
    io = require("sglang.srt.managers.io_struct", "sglang")
    utils = importlib.import_module("sglang.srt.utils")
    return SimpleNamespace(
        pause=getattr(io, "PauseGenerationReqInput", None),
        resume=getattr(io, "ContinueGenerationReqInput", None),
        update=io.UpdateWeightsFromTensorReqInput,
        read=io.GetWeightsByNameReqInput,
        begin=getattr(io, "BeginWeightUpdateReqInput", None),
        end=getattr(io, "EndWeightUpdateReqInput", None),
        serialize=utils.MultiprocessingSerializer.serialize,
    )


@contextlib.asynccontextmanager
async def session(manager: Any, io: SimpleNamespace) -> AsyncIterator[None]:
    """A weight-update session of the tokenizer manager around the body, closed also when the
    body raises, where this SGLang has one (0.5.23: `io.begin` / `io.end`); a refused begin or
    end is raised (`engines.sglang_group.answered`)."""
    if io.begin is None or io.end is None:
        yield
        return
    answered("begin_weight_update", await manager.begin_weight_update(io.begin(), None))
    try:
        yield
    finally:
        answered("end_weight_update", await manager.end_weight_update(io.end(), None))


class SGLangContinuousEngine(ContinuousAdapter):
    """A `ContinuousEngine` over an in-process `sglang.Engine`. Needs CUDA and the sglang extra."""

    name = "sglang"

    def __init__(
        self,
        model_dir: Path,
        settings: SGLangSettings = SGLangSettings(),
        slots: int = 64,
        partial_mode: PartialMode = "resubmit",
    ) -> None:
        sglang = require_sglang()  # >= 0.5.10: built on the loop's thread, not the main one
        check_logprob_env()
        super().__init__(slots, eos_token_ids(model_dir), partial_mode, EngineLoop("sglang-engine"))
        self.model = skeleton(model_dir, settings.context_length)
        self.dtype = torch_dtype(settings.dtype)
        self.tp_size = settings.tp_size
        self.bucket_bytes = settings.weight_bucket_bytes
        self.io = sglang_io()
        if partial_mode == "keep" and (self.io.pause is None or self.io.resume is None):
            raise EngineUnavailable(
                "rollout.engine.partial_mode keep (sglang) needs SGLang's PauseGenerationReqInput "
                "(a newer SGLang); "
                "use partial_mode resubmit"
            )
        kwargs = continuous_engine_kwargs(model_dir, settings, slots)
        self.engine = self.loop.run(self._start(sglang, kwargs))

    @staticmethod
    async def _start(sglang: Any, kwargs: dict[str, Any]) -> Any:
        return sglang.Engine(**kwargs)  # inside the loop: the engine takes it as its own

    async def stream(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[Chunk]:
        outputs = await self.engine.async_generate(
            input_ids=prompt,
            sampling_params=sampling_params(params, self.eos_token_ids),
            return_logprob=True,
            stream=True,
            rid=request_id,
        )
        seen = 0
        async for output in outputs:
            chunk, seen = stream_delta(output, seen)
            yield chunk

    async def engine_abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.engine.tokenizer_manager.abort_request(request_id)

    async def engine_pause(self) -> None:
        await self.engine.tokenizer_manager.pause_generation(self.io.pause(mode="retract"))

    async def engine_resume(self) -> None:
        await self.engine.tokenizer_manager.continue_generation(self.io.resume())

    async def engine_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """One update per bucket of `bucket_bytes` (the cache flushed with the last), each in a
        weight-update session (`session`) and checked as the batch adapter checks it: the
        answer, then its first tensor's first row read back through the tokenizer manager's
        `get_weights_by_name`."""
        manager = self.engine.tokenizer_manager
        buckets = weight_buckets(weights, self.bucket_bytes)
        for index, bucket in enumerate(buckets):
            request = self.io.update(
                serialized_named_tensors=[self.io.serialize(bucket) for _ in range(self.tp_size)],
                load_format=None,
                flush_cache=index == len(buckets) - 1,
            )
            async with session(manager, self.io):  # SGLang 0.5.23 loads only inside one
                result = await manager.update_weights_from_tensor(request, None)
            check_update(index, bucket, result)
            name, tensor = bucket[0]
            got = await manager.get_weights_by_name(self.io.read(name=name, truncate_size=1), None)
            check_first_row(index, name, tensor, got)

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        super().close()
