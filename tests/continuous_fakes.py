"""Fakes of vLLM's `AsyncLLM` and SGLang's `Engine` (the engine objects only) for CPU tests
of the continuous adapters (`engines.vllm_continuous`, `engines.sglang_continuous`).

Both answer through `FakeCore`, which decodes for real with the tiny HF model, one token per
`seconds_per_token`, each token drawn at the request's temperature and reported with its
log-prob ``log_softmax(logits / T)`` under the weights loaded at that moment, as the engines
do. It records what the adapters asked of it: every request submitted (id, prompt, max
tokens), aborts, pauses, loads, and any load made while one of its requests could compute.
The adapters, the rollout worker, the bus and the weight transport stay real; `adapter` builds
each with its own constructor, `sys.modules` holding stand-in ``vllm`` / ``sglang`` modules
(`tests.engine_standins`) whose engine is the fake. The fakes refuse what the packages refuse
(`tests.engine_standins`): `FakeAsyncLLM.collective_rpc` a function without
VLLM_ALLOW_INSECURE_SERIALIZATION, and hands its arguments on as vLLM decodes them (a tensor
as a list), recording each RPC's bytes; and
`FakeSGLangEngine` binds the event loop at construction where SGLang does, and its tokenizer
manager refuses an update outside a weight-update session with SGLang 0.5.23's words.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import torch
from transformers import AutoModelForCausalLM

from engines.continuous import ContinuousAdapter, PartialMode
from engines.sglang_continuous import SGLangContinuousEngine
from engines.sglang_rollout import SGLangSettings
from engines.vllm_continuous import VLLMContinuousEngine
from engines.vllm_rollout import (
    DEFAULT_WEIGHT_BUCKET_BYTES,
    INSECURE_SERIALIZATION_ENV,
    VLLMSettings,
)
from tests.engine_standins import (
    NO_SESSION,
    OUTSIDE_SESSION,
    SESSION_OPEN,
    bind_loop_as_sglang,
    payload_bytes,
    sglang_modules,
    vllm_module,
    vllm_rpc,
)

DELTA = "DELTA"
"""Stands for `vllm.sampling_params.RequestOutputKind.DELTA`."""


class FakeCore:
    def __init__(self, model_dir: Path, seconds_per_token: float = 0.005) -> None:
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.seconds_per_token = seconds_per_token
        self.paused = False
        self.active: dict[str, int] = {}
        """Request id -> tokens it has computed, for the requests in the engine now."""
        self.submitted: list[tuple[str, list[int], int]] = []
        self.events: list[str] = []
        self.violations: list[str] = []
        self.loads = 0
        self.skip: set[str] = set()
        """Names a load passes over without a word (a loader that skips them)."""

    def draw(self, request_id: str, ids: list[int], temperature: float) -> tuple[int, float]:
        with torch.no_grad():
            logits = self.hf(torch.tensor([ids])).logits[0, -1].float()
        if temperature == 0:
            logprobs = torch.log_softmax(logits, -1)
            token = int(logprobs.argmax())
        else:
            logprobs = torch.log_softmax(logits / temperature, -1)
            seed = hash((request_id, len(ids))) % 2**31  # the same draw whatever the interleaving
            token = int(
                torch.multinomial(logprobs.exp(), 1, generator=torch.Generator().manual_seed(seed))
            )
        return token, float(logprobs[token])

    async def tokens(
        self,
        request_id: str,
        prompt: list[int],
        temperature: float,
        max_tokens: int,
        stop_ids: Sequence[int],
    ) -> AsyncIterator[tuple[int, float, str | None]]:
        """Decode one request: (token, log-prob, finish reason on the last)."""
        self.submitted.append((request_id, list(prompt), max_tokens))
        self.active[request_id] = 0
        ids = list(prompt)
        try:
            for index in range(max_tokens):
                await asyncio.sleep(self.seconds_per_token)
                while self.paused:  # a paused engine computes nothing
                    await asyncio.sleep(0.002)
                token, logprob = self.draw(request_id, ids, temperature)
                ids.append(token)
                self.active[request_id] += 1
                finish = (
                    "stop" if token in stop_ids else "length" if index == max_tokens - 1 else None
                )
                yield token, logprob, finish
                if finish:
                    return
        finally:
            self.active.pop(request_id, None)

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.active and not self.paused:
            self.violations.append(f"weights loaded while {sorted(self.active)} could compute")
        params = dict(self.hf.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                if name not in self.skip:
                    params[name].copy_(tensor)
        self.loads += 1
        self.events.append("load")


class FakeAsyncLLM:
    """`vllm.AsyncLLM`: generate (delta outputs), abort, pause/resume_generation, collective_rpc."""

    def __init__(self, core: FakeCore, finish_override: str | None = None) -> None:
        self.core = core
        self.finish_override = finish_override
        """Report this finish reason instead of the real one (an engine-side abort, say)."""
        self.flag_at_start = os.environ.get(INSECURE_SERIALIZATION_ENV)
        self.rpc_bytes: list[int] = []
        """Bytes (tensors and bytes objects) each `collective_rpc` carried, in order."""
        model = SimpleNamespace(
            load_weights=lambda weights: core.load(list(weights)),
            named_parameters=core.hf.named_parameters,
        )
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))

    async def generate(
        self, prompt: dict[str, list[int]], sampling: dict[str, Any], request_id: str
    ) -> AsyncIterator[SimpleNamespace]:
        assert (sampling["n"], sampling["logprobs"], sampling["output_kind"]) == (1, 0, DELTA), (
            sampling
        )
        async for token, logprob, finish in self.core.tokens(
            request_id,
            prompt["prompt_token_ids"],
            sampling["temperature"],
            sampling["max_tokens"],
            sampling["stop_token_ids"],
        ):
            if finish and self.finish_override:
                finish = self.finish_override
            ranked = {token: SimpleNamespace(logprob=logprob, rank=1, decoded_token=None)}
            completion = SimpleNamespace(
                index=0, token_ids=[token], finish_reason=finish, logprobs=[ranked]
            )
            yield SimpleNamespace(
                request_id=request_id, finished=finish is not None, outputs=[completion]
            )

    async def abort(self, request_ids: list[str]) -> None:
        self.core.events.append(f"abort {len(request_ids)}")

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        assert mode == "keep", mode
        self.core.paused = True
        self.core.events.append("pause")

    async def resume_generation(self) -> None:
        self.core.paused = False
        self.core.events.append("resume")

    async def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        result = vllm_rpc(self.worker, method, args, kwargs, self.flag_at_start)
        self.rpc_bytes.append(payload_bytes((args, kwargs)))
        return [result]

    async def reset_prefix_cache(self) -> bool:
        self.core.events.append("reset prefix cache")
        return True

    def shutdown(self) -> None:
        pass


class FakeTokenizerManager:
    def __init__(self, core: FakeCore) -> None:
        self.core = core
        self.flushed: list[bool] = []
        """`flush_cache` of each update, in order."""
        self.session = False
        """A weight-update session is open (`begin_weight_update`)."""
        self.steps: list[str] = []
        """"begin", "update" and "end", each as called (a refused call too)."""
        self.refuse_loads = False
        """Every update answers ``(False, ...)``, as SGLang does a load that fails."""

    def abort_request(self, rid: str) -> None:
        self.core.events.append(f"abort {rid}")

    async def pause_generation(self, request: Any) -> None:
        assert request.mode == "retract", request
        self.core.paused = True
        self.core.events.append("pause")

    async def continue_generation(self, request: Any) -> None:
        self.core.paused = False
        self.core.events.append("resume")

    # SGLang 0.5.23's weight-update session (scheduler_components/weight_updater.py, as the
    # batch stand-in `StandInSGLangEngine` has it): an update outside one is refused.
    async def begin_weight_update(self, obj: Any, request: None = None) -> tuple[bool, str]:
        self.steps.append("begin")
        if self.session:
            return False, SESSION_OPEN
        self.session = True
        return True, "Success"

    async def end_weight_update(self, obj: Any, request: None = None) -> tuple[bool, str]:
        self.steps.append("end")
        if not self.session:
            return False, NO_SESSION
        self.session = False
        return True, "Success"

    async def update_weights_from_tensor(self, request: Any, http: None) -> tuple[bool, str]:
        self.steps.append("update")
        if not self.session:
            return False, OUTSIDE_SESSION.format("update_weights_from_tensor")
        if self.refuse_loads:
            return False, "Failed to update weights: shape mismatch."
        assert len(request.serialized_named_tensors) == 1, request
        self.core.load(request.serialized_named_tensors[0])
        self.flushed.append(request.flush_cache)
        return True, "ok"

    async def get_weights_by_name(self, request: Any, http: None) -> list[Any]:
        param = dict(self.core.hf.named_parameters())[request.name]
        return param[: request.truncate_size].detach().float().tolist()


class FakeSGLangEngine:
    """`sglang.Engine`: async_generate (cumulative stream) and the tokenizer manager's calls."""

    def __init__(self, core: FakeCore) -> None:
        self.core = core
        self.tokenizer_manager = FakeTokenizerManager(core)
        self.loop = bind_loop_as_sglang()  # the adapter's loop: it builds the engine there

    async def async_generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        return_logprob: bool,
        stream: bool,
        rid: str,
    ) -> AsyncIterator[dict[str, Any]]:
        assert stream and return_logprob and sampling_params["no_stop_trim"], sampling_params
        core = self.core

        async def outputs() -> AsyncIterator[dict[str, Any]]:
            entries: list[list[Any]] = []
            async for token, logprob, finish in core.tokens(
                rid,
                input_ids,
                sampling_params["temperature"],
                sampling_params["max_new_tokens"],
                sampling_params["stop_token_ids"],
            ):
                entries.append([logprob, token, None])
                reason = (
                    None
                    if finish is None
                    else (
                        {"type": "stop", "matched": token}
                        if finish == "stop"
                        else {"type": "length", "length": len(entries)}
                    )
                )
                yield {
                    "output_ids": [e[1] for e in entries],
                    "meta_info": {
                        "output_token_logprobs": [list(e) for e in entries],
                        "completion_tokens": len(entries),
                        "finish_reason": reason,
                    },
                }

        return outputs()

    def shutdown(self) -> None:
        pass


def adapter(
    kind: str,
    model_dir: Path,
    core: FakeCore,
    slots: int = 8,
    mode: PartialMode = "resubmit",
    bucket_bytes: int | None = None,
    **fake: Any,
) -> ContinuousAdapter:
    """The `kind` ("vllm" / "sglang") adapter built by its constructor over a fake engine
    (`fake`: the fake's options; `bucket_bytes`: the section's ``weight_bucket_bytes``)."""
    size = DEFAULT_WEIGHT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    if kind == "vllm":
        with patch.dict(
            sys.modules, vllm_module(async_engine=lambda _: FakeAsyncLLM(core, **fake))
        ):
            return VLLMContinuousEngine(
                model_dir, VLLMSettings(weight_bucket_bytes=size), slots, mode
            )
    with patch.dict(sys.modules, sglang_modules(engine=lambda **_: FakeSGLangEngine(core))):
        return SGLangContinuousEngine(
            model_dir, SGLangSettings(weight_bucket_bytes=size), slots, mode
        )
