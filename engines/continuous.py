"""Continuous batching on vLLM and SGLang: what their `ContinuousEngine` adapters share.

Both engines are asyncio clients (vLLM's `AsyncLLM`, SGLang's `Engine.async_generate`) bound
to the event loop they were built on. The adapter owns that loop, in a thread of its own
(`EngineLoop`); the rollout worker calls `generate_sample` from up to `slots` threads, each
call submitting one request to the engine as soon as it is made and returning when that
request ends, whatever the others do (the engine batches the requests in flight itself).

    generate_sample(prompt) [worker thread] -> EngineLoop.run(sample) [engine loop]:
        attempt: submit prompt + tokens so far, max_tokens - len(tokens so far)
            -> stream of `Chunk`s (new token ids, their log-probs, finish reason at the end);
               each token is tagged with `computing`, the version whose weights run now
        finished ("stop" / "length") -> `Sample` with per-token `versions`
        interrupted by `pause` (resubmit mode) -> wait for `resume`, then a new attempt

Partial rollout around a weight load (`pause`, `load_state_dict`, `resume`), two modes:

- ``resubmit`` (default): `pause` cancels every attempt in flight (the engine aborts its
  request) and returns once all have ended; tokens the engine computed but had not handed
  over are dropped. `resume` resubmits each sample as prompt + the tokens it has, so the
  engine recomputes their KV with the new weights (one prefill per sample in flight). Every
  token's version is exact: a token is either handed over before the pause, under the old
  version, or computed after the resume, under the new one.
- ``keep``: the engine's own pause (vLLM ``pause_generation(mode="keep")``, SGLang
  ``pause_generation`` in ``retract`` mode): requests stay in the engine and go on after
  ``resume``. vLLM keeps their old KV cache (tokens after the load attend to keys and values
  the old weights computed); SGLang's retract recomputes them. A token is tagged with the
  version at the moment it reaches the adapter, and `computing` changes only at `resume`,
  so a token still in the engine's output pipe when `resume` runs is tagged with the new
  version though the old one computed it: the engines flush finished steps' outputs before
  their pause returns, which is what makes this rare, not impossible.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

import torch

from engines.external_rollout import make_sample, named_weights
from engines.protocols import Sample, SamplingParams

PartialMode = Literal["resubmit", "keep"]
T = TypeVar("T")


@dataclass(frozen=True)
class Chunk:
    """What one request's stream hands over next: the new tokens (maybe none) and their
    log-probs, position i of one the log-prob of token i; `finish_reason` set on the last."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None


class EngineLoop:
    """An asyncio loop running in a daemon thread: the engine's async client lives on it."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """`coro` run on the loop, from any other thread; its result or its exception."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


class ContinuousAdapter:
    """The engine-independent part of a continuous adapter (a `ContinuousEngine` and a
    `RolloutEngine`). A subclass sets `name`, `model` (the meta-device skeleton the worker
    checks manifests and prompts against), `dtype`, and implements the engine hooks:
    `stream`, `engine_abort`, `engine_pause`, `engine_resume`, `engine_load`."""

    name = "engine"

    def __init__(
        self, slots: int, eos_token_ids: Sequence[int], partial_mode: PartialMode, loop: EngineLoop
    ) -> None:
        if slots < 1:
            raise ValueError(f"{self.name}: slots must be at least 1, not {slots}")
        if partial_mode not in ("resubmit", "keep"):
            raise ValueError(
                f"{self.name}: partial_mode {partial_mode!r}, expected 'resubmit' or 'keep'"
            )
        self.slots, self.eos_token_ids, self.partial_mode, self.loop = (
            slots,
            tuple(eos_token_ids),
            partial_mode,
            loop,
        )
        self.model: torch.nn.Module
        self.dtype: torch.dtype | None = None
        self.version = 0
        """The version of the weights loaded last (what the worker compares new versions with)."""
        self.computing = 0
        """The version whose weights compute tokens now; changes at `resume` (or at a load
        while nothing generates), so tokens handed over while paused keep the old one."""
        self.paused = False
        self.in_flight = 0
        """`generate_sample` calls running now (at most `slots`)."""
        self._count = threading.Lock()
        self._ids = itertools.count()
        self._running = asyncio.Event()  # loop side: set unless paused
        self._running.set()
        self._attempts: dict[str, asyncio.Task[str]] = {}
        self._interrupted: set[str] = set()

    # -- engine hooks (subclasses) ------------------------------------------------------
    def stream(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[Chunk]:
        """Submit one request (n = 1) and hand over its output as `Chunk`s until it finishes."""
        raise NotImplementedError

    async def engine_abort(self, request_ids: list[str]) -> None:
        """Make sure the engine drops these requests (their streams were cancelled)."""

    async def engine_pause(self) -> None:
        """keep mode: the engine stops computing; its requests stay."""
        raise NotImplementedError

    async def engine_resume(self) -> None:
        """keep mode: the engine goes on with its requests (and the weights loaded since)."""
        raise NotImplementedError

    async def engine_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Swap (HF name, tensor) pairs into the running engine and drop its prefix cache."""
        raise NotImplementedError

    def check(self, params: SamplingParams) -> None:
        """Refuse sampling the engine cannot report the trainer's log-probs for."""

    # -- ContinuousEngine -----------------------------------------------------------------
    def generate_sample(self, prompt: Sequence[int], params: SamplingParams) -> Sample:
        if not prompt:
            raise ValueError(f"{self.name}: an empty prompt")
        self.check(params)
        with self._count:
            if self.in_flight >= self.slots:
                raise RuntimeError(
                    f"{self.name}: a sample beyond the engine's {self.slots} slots "
                    "(the caller keeps that count)"
                )
            self.in_flight += 1
        try:
            return self.loop.run(self._sample(list(prompt), params))
        finally:
            with self._count:
                self.in_flight -= 1

    def pause(self) -> None:
        self.loop.run(self._pause())
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.loop.run(self._resume())

    def load_state_dict(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Loads `tensors` (named as `TrainEngine.export_weights`) into the running engine:
        between `pause` and `resume`, or while no sample generates."""
        if not self.paused and self.in_flight:
            raise RuntimeError(
                f"{self.name}: weights loaded while {self.in_flight} samples generate, not paused"
            )
        self.loop.run(self.engine_load(named_weights(tensors, self.model, self.dtype)))
        self.version = self.version + 1 if version is None else version
        if not self.paused:
            self.computing = self.version

    # -- RolloutEngine ----------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        """`n` samples per prompt, all submitted at once (the engine batches them)."""
        if not prompts or min(map(len, prompts)) == 0:
            raise ValueError("need at least one non-empty prompt")
        self.check(params)

        async def every() -> list[Sample]:
            return list(
                await asyncio.gather(
                    *(self._sample(list(p), params) for p in prompts for _ in range(n))
                )
            )

        samples = self.loop.run(every())
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def close(self) -> None:
        self.loop.close()

    # -- on the engine loop -----------------------------------------------------------------
    async def _sample(self, prompt: list[int], params: SamplingParams) -> Sample:
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        stop_ids = (*self.eos_token_ids, *params.stop_token_ids)
        finish: str | None = None
        while finish is None:
            await self._running.wait()
            if (
                tokens and tokens[-1] in stop_ids
            ):  # interrupted after its last token was handed over
                finish = "stop"
                break
            if len(tokens) >= params.max_tokens:
                finish = "length"
                break
            request_id = f"{self.name}-{next(self._ids)}"
            rest = replace(params, max_tokens=params.max_tokens - len(tokens))
            attempt = asyncio.ensure_future(
                self._attempt(request_id, prompt + tokens, rest, tokens, logprobs, versions)
            )
            self._attempts[request_id] = attempt
            try:
                await asyncio.wait({attempt})
            except asyncio.CancelledError:  # the caller is going away: so does its request
                attempt.cancel()
                raise
            finally:
                self._attempts.pop(request_id, None)
            interrupted = request_id in self._interrupted
            self._interrupted.discard(request_id)
            if attempt.cancelled():
                if not interrupted:  # not ours: the caller is going away
                    raise asyncio.CancelledError
                continue
            finish = attempt.result()
            if (
                finish == "abort" and interrupted
            ):  # the engine ended it for our pause: go on after resume
                finish = None
        sample = make_sample(tokens, logprobs, finish, stop_ids, self.name)
        return replace(sample, versions=torch.tensor(versions, dtype=torch.int32))

    async def _attempt(
        self,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        tokens: list[int],
        logprobs: list[float],
        versions: list[int],
    ) -> str:
        """One request's stream into the sample's lists; its finish reason."""
        async for chunk in self.stream(request_id, ids, params):
            if len(chunk.token_ids) != len(chunk.logprobs):
                raise ValueError(
                    f"{self.name}: {len(chunk.token_ids)} tokens but {len(chunk.logprobs)} "
                    "log-probs in one chunk"
                )
            tokens.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            versions.extend([self.computing] * len(chunk.token_ids))
            if chunk.finish_reason is not None:
                return chunk.finish_reason
        raise ValueError(f"{self.name}: request {request_id} ended without a finish reason")

    async def _pause(self) -> None:
        self._running.clear()  # no attempt starts until resume
        if self.partial_mode == "keep":
            await self.engine_pause()
            return
        attempts = dict(self._attempts)
        self._interrupted.update(attempts)
        for attempt in attempts.values():
            attempt.cancel()
        await asyncio.gather(*attempts.values(), return_exceptions=True)  # every stream has ended
        if attempts:
            await self.engine_abort(list(attempts))

    async def _resume(self) -> None:
        self.computing = self.version
        if self.partial_mode == "keep":
            await self.engine_resume()
        self._running.set()
