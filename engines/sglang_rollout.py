"""Rollout on SGLang (``pip install 'jetrl[sglang]'``): token ids in,
token ids and behaviour log-probs out.

Targets SGLang >= 0.5.10 (`SGLANG_FLOOR`, refused below by `require_sglang`), read from its
source: ``python/sglang/srt/sampling/sampling_params.py``
(the sampling-params dict), ``python/sglang/srt/entrypoints/engine.py`` (`Engine.generate`,
`Engine.update_weights_from_tensor`), ``python/sglang/srt/managers/tokenizer_manager.py``
(``meta_info``: ``output_token_logprobs`` as (logprob, token id, text or None) tuples,
``finish_reason`` as {"type": "stop", "matched": id} / {"type": "length", "length": n}) and
``python/sglang/srt/layers/sampler.py`` (which log-probs it returns).

Behaviour log-probs. With ``return_logprob=True`` SGLang returns, per output token, the log of
the temperature-scaled softmax it sampled from, taken before top-k/top-p filtering: ours
(`engines.hf_rollout`) for any top_p. The environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB``
switches that to temperature-1 log-probs; the engine refuses to start with it set. Greedy
(temperature 0): ``log_softmax(logits)``, as we do.

`n` samples: the prompt is repeated n times in one batch (each with n=1) rather than using
SGLang's ``n``, so the response order is ours by construction.

Weights: `update_weights_from_tensor` with (HF name, tensor) pairs, which the model's own
``load_weights`` maps onto its fused layers, one call per bucket of ``weight_bucket_bytes``;
``flush_cache`` (with the last bucket) drops the radix (prefix) cache the old weights
computed. Each bucket is checked: the call's answer, then `get_weights_by_name` of the first
row of its first tensor (SGLang maps an HF name onto its fused parameter there too); a
disagreement raises `WeightsNotLoaded`. The engine is not restarted.

Threads and loops. `Engine.__init__` binds the asyncio loop running in the thread that builds
it (``asyncio.get_running_loop()``), else that thread's current loop (0.5.23), else a new one
it sets as the thread's, and its
synchronous methods (`generate`, `update_weights_from_tensor`) run that loop with
``run_until_complete``: which fails while any thread runs it. The rollout worker builds its
engines inside its own running loop and calls them from `asyncio.to_thread`, so the engine is
built and driven on an `EngineThread` of its own. Built off the main thread, SGLang < 0.5.10
calls ``signal.signal`` in ``_set_envs_and_config``, which Python refuses there; 0.5.10 skips it
off the main thread (sgl-project/sglang#18752), hence the floor, for both SGLang adapters.

Memory (`ReleasableEngine`, `placement: colocated`): `Engine.release_memory_occupation()`
and `resume_memory_occupation()` (every tag: weights, KV cache and, where the release has
it, CUDA graphs), which free and retake the device memory only on an engine built with
``enable_memory_saver=True`` (`SGLangSettings.memory_saver`, set by `engines.build` when the
run is colocated; without it SGLang's memory saver is a no-op and the memory stays held).
Weights that arrive while released are loaded after the resume (`engines.release.Deferred`):
released, the parameters' memory is unmapped. Never run on a GPU yet (docs/engines.md).
"""

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from engines.external_rollout import (
    EngineThread,
    EngineUnavailable,
    eos_token_ids,
    make_sample,
    named_weights,
    require,
    require_version,
    skeleton,
    torch_dtype,
    weight_buckets,
)
from engines.protocols import Sample, SamplingParams, WeightsNotLoaded
from engines.release import Deferred, weight_bytes
from engines.sglang_group import answered, session
from engines.sglang_group import receive as group_receive
from engines.weights_group import Spec

ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
"""Set truthy, SGLang returns temperature-1 log-probs: not what the trainer computes."""

SGLANG_FLOOR = "0.5.10"
"""The first SGLang whose `Engine` can be built off the main thread (see the module doc); the
extra (pyproject.toml ``sglang``) asks for it too."""


def require_sglang() -> ModuleType:
    """The `sglang` package, refused in one line when missing or older than `SGLANG_FLOOR`."""
    sglang = require("sglang", "sglang")
    require_version(
        sglang,
        "sglang",
        SGLANG_FLOOR,
        "older releases call signal.signal when an Engine is built off the main thread",
    )
    return sglang


DEFAULT_WEIGHT_BUCKET_BYTES = 512 * 2**20
"""`SGLangSettings.weight_bucket_bytes`' default (`schemas.rollout_config` documents it)."""


@dataclass(frozen=True)
class SGLangSettings:
    """`rollout.engine` of type sglang (`schemas.rollout_config.SGLangRolloutConfig` documents
    each field)."""

    mem_fraction_static: float = 0.5
    tp_size: int = 1
    context_length: int | None = None
    dtype: str = "auto"
    seed: int = 0
    weight_bucket_bytes: int = DEFAULT_WEIGHT_BUCKET_BYTES
    memory_saver: bool = False
    """``enable_memory_saver``: what the release calls need (`placement: colocated`)."""


def engine_kwargs(model_dir: Path, settings: SGLangSettings) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine` (its `ServerArgs` fields). Token ids in and out, so
    no tokenizer: stop strings are not used, stop token ids are."""
    return {
        "model_path": str(model_dir),
        "dtype": settings.dtype,
        "mem_fraction_static": settings.mem_fraction_static,
        "tp_size": settings.tp_size,
        "context_length": settings.context_length,
        "random_seed": settings.seed,
        "skip_tokenizer_init": True,
        "enable_memory_saver": settings.memory_saver,
    }


def sampling_params(params: SamplingParams, eos: Sequence[int]) -> dict[str, Any]:
    """SGLang's sampling-params dict for one sample of one prompt.

    The eos ids are passed as stop tokens explicitly, so SGLang stops where the HF engine would
    whatever eos its tokenizer declares; ``skip_special_tokens``/``no_stop_trim`` keep the stop
    token in the response, which the trainer must see.
    """
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_new_tokens": params.max_tokens,
        "stop_token_ids": list(dict.fromkeys((*eos, *params.stop_token_ids))),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }


def output_to_sample(output: dict[str, Any], stop_ids: Sequence[int]) -> Sample:
    """One element of `Engine.generate`'s list (``output_ids``, ``meta_info``) as a `Sample`."""
    meta = output.get("meta_info")
    if not isinstance(meta, dict) or meta.get("output_token_logprobs") is None:
        raise ValueError(
            "sglang: an output without meta_info.output_token_logprobs "
            "(request return_logprob=True)"
        )
    entries = meta["output_token_logprobs"]  # [L] of (logprob, token id, text or None)
    token_ids = [int(entry[1]) for entry in entries]
    logprobs = [float(entry[0]) for entry in entries]
    if "output_ids" in output and list(output["output_ids"]) != token_ids:
        raise ValueError("sglang: output_ids and the tokens of output_token_logprobs differ")
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    return make_sample(token_ids, logprobs, reason, stop_ids, "sglang")


def outputs_to_groups(
    outputs: Sequence[dict[str, Any]], prompts: int, n: int, stop_ids: Sequence[int]
) -> list[list[Sample]]:
    """`Engine.generate`'s outputs for each prompt repeated `n` times, grouped per prompt."""
    if len(outputs) != prompts * n:
        raise ValueError(f"sglang: {len(outputs)} outputs for {prompts} prompts x n={n}")
    samples = [output_to_sample(o, stop_ids) for o in outputs]
    return [samples[i * n : (i + 1) * n] for i in range(prompts)]


def check_logprob_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Refuses an environment that makes SGLang return temperature-1 log-probs."""
    if environ.get(ORIGINAL_LOGPROB_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        raise EngineUnavailable(
            f"{ORIGINAL_LOGPROB_ENV} is set: SGLang would return log-probs before temperature, "
            "not the behaviour log-probs the trainer computes; unset it"
        )


def check_update(index: int, bucket: Sequence[tuple[str, Any]], result: Any) -> None:
    """SGLang's answer to the update of bucket `index`: it reports a failed load as
    ``(False, message)``, not by raising, so that is raised here, naming the bucket."""
    if isinstance(result, Sequence) and len(result) >= 2 and not result[0]:
        raise WeightsNotLoaded(
            f"sglang: bucket {index} ({bucket[0][0]} .. {bucket[-1][0]}): "
            f"update_weights_from_tensor failed: {result[1]}"
        )


def check_first_row(index: int, name: str, tensor: torch.Tensor, got: Any) -> None:
    """`got`, SGLang's `get_weights_by_name(name, truncate_size=1)` (the parameter's first row
    as float32 lists), against the first row of the `tensor` sent for `name` in bucket
    `index`: equal as sent, or as rounded to the engine's bfloat16 or float16 (an "auto"
    engine keeps its checkpoint's dtype). Exact, not within a tolerance: one optimizer step
    at a small learning rate moves a weight by an ulp, which a tolerance would not see."""
    sent = tensor[:1]
    try:
        row = torch.tensor(got, dtype=torch.float32).reshape(sent.shape)
    except (TypeError, ValueError, RuntimeError):
        row = None
    if row is None or not any(
        torch.equal(row, sent.to(dtype).float())
        for dtype in (sent.dtype, torch.bfloat16, torch.float16)
    ):
        raise WeightsNotLoaded(
            f"sglang: bucket {index}: {name}'s first row reads back unlike the tensor sent"
        )


def load_weights(
    engine: Any,
    weights: list[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_WEIGHT_BUCKET_BYTES,
) -> None:
    """Swaps `weights` into a running `sglang.Engine` without a restart, one
    `update_weights_from_tensor` per bucket of at most `bucket_bytes` (a larger tensor alone;
    the cache flushed with the last), each checked: the call's answer (`check_update`), then
    the first row of the bucket's first tensor read back (`check_first_row`)."""
    buckets = weight_buckets(weights, bucket_bytes)
    for index, bucket in enumerate(buckets):
        last = index == len(buckets) - 1
        with session(engine):  # SGLang 0.5.23 loads only inside one
            result = engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=last)
        check_update(index, bucket, result)
        name, tensor = bucket[0]
        check_first_row(index, name, tensor, engine.get_weights_by_name(name, truncate_size=1))


class SGLangRolloutEngine:
    """A `RolloutEngine` over an in-process `sglang.Engine`. Needs CUDA and the sglang extra."""

    def __init__(self, model_dir: Path, settings: SGLangSettings = SGLangSettings()) -> None:
        sglang = require_sglang()
        check_logprob_env()
        self.model = skeleton(model_dir, settings.context_length)
        self.eos_token_ids = eos_token_ids(model_dir)
        self.dtype = torch_dtype(settings.dtype)
        self.bucket_bytes = settings.weight_bucket_bytes
        self.tp_size = settings.tp_size
        self.received: dict[str, str] = {}
        """The checksums of the last version received by broadcast (`receive_weights`)."""
        self.thread = EngineThread("sglang-engine")  # the engine binds this thread's loop
        self.engine = self.thread.call(sglang.Engine, **engine_kwargs(model_dir, settings))
        self.version = 0
        self.released = False
        """Its memory given back (`release_memory`): no generation, loads deferred."""
        self.deferred = Deferred()

    def device_bytes(self) -> int:
        """The weights' bytes (the model's parameters in the engine's dtype) while held, 0
        released. A lower bound: the KV cache SGLang sizes at start-up is not counted."""
        return 0 if self.released else weight_bytes(self.model, self.dtype)

    def release_memory(self) -> None:
        """``release_memory_occupation()``: weights, KV cache (and CUDA graphs) freed. Twice:
        nothing."""
        with self.deferred.lock:
            if not self.released:
                self.thread.call(self.engine.release_memory_occupation)
                self.released = True

    def resume_memory(self) -> None:
        """``resume_memory_occupation()``, then the weights that arrived meanwhile, loaded and
        checked."""
        with self.deferred.lock:
            if not self.released:
                return
            self.thread.call(self.engine.resume_memory_occupation)
            self.released = False
            deferred = self.deferred.take()
            if deferred is not None:
                self.load_state_dict(*deferred)

    def check_held(self, what: str) -> None:
        """Refuse `what` on an engine whose memory is released."""
        if self.released:
            raise RuntimeError(f"sglang: {what} while the engine's memory is released")

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        """`n` samples per prompt, grouped per prompt; see the module doc for the log-probs."""
        self.check_held("generate")
        if not prompts or min(map(len, prompts)) == 0:
            raise ValueError("need at least one non-empty prompt")
        rows = [list(p) for p in prompts for _ in range(n)]
        outputs = self.thread.call(
            self.engine.generate,
            input_ids=rows,
            sampling_params=sampling_params(params, self.eos_token_ids),
            return_logprob=True,
        )
        return outputs_to_groups(
            outputs, len(prompts), n, (*self.eos_token_ids, *params.stop_token_ids)
        )

    def load_state_dict(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Loads `tensors` (named as `TrainEngine.export_weights`; any subset of the model's)
        into the running engine, in checked buckets (`load_weights`). Released: names and
        shapes checked now, the tensors loaded on `resume_memory` (`version` set now: nothing
        generates before then)."""
        pairs = named_weights(tensors, self.model, self.dtype)
        version = self.version + 1 if version is None else version
        self.received = {}
        with self.deferred.lock:  # not while the memory is being released or resumed
            if self.released:
                self.deferred.add(tensors, version)
            else:
                self.thread.call(load_weights, self.engine, pairs, self.bucket_bytes)
            self.version = version

    @property
    def weight_ranks(self) -> int:
        """Ranks in a weight-update group: one per tensor-parallel rank."""
        return self.tp_size

    def join_weights_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """SGLang's `init_weights_update_group` (`engines.sglang_group`); raises on
        ``(False, message)``."""
        result = self.thread.call(
            self.engine.init_weights_update_group,
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        answered("init_weights_update_group", result)

    def receive_weights(
        self, specs: Sequence[Spec], group_name: str, checksums: Mapping[str, str], version: int
    ) -> None:
        """SGLang's `update_weights_from_distributed` in a session, then read back
        (`engines.sglang_group.receive`). Refused while released (colocation refuses the
        collective transport anyway)."""
        self.check_held("a broadcast weight load")
        previous, self.received = self.received, {}  # a failed load leaves nothing known
        self.thread.call(
            group_receive, self.engine, specs, group_name, checksums, self.bucket_bytes, previous
        )
        self.received = dict(checksums)
        self.version = version

    def leave_weights_group(self, group_name: str) -> None:
        self.thread.call(self.engine.destroy_weights_update_group, group_name=group_name)

    def close(self) -> None:
        """Shuts the engine (its scheduler processes) down on its thread, then the thread."""
        self.thread.call(self.engine.shutdown)
        self.thread.close()
