"""`rollout`: which engine generates, with its settings, and how the worker feeds it (part of
`schemas.config`).

`rollout.engine` is one section per engine type, told apart by its `type` (a discriminated
union): `{type: vllm, gpu_memory_utilization: 0.3}`, or the bare type, `vllm`, for its
defaults. `engines.build.build_rollout_engines` takes that section.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from schemas.section import Section, engine_section, refuse_renamed


class HFRolloutConfig(Section):
    """`rollout.engine: hf`: the reference engine, the run's model generating for real on the
    worker's device in `model.dtype` (`engines.hf_rollout`); it has no settings of its own."""

    type: Literal["hf"] = "hf"
    """`hf` picks this engine's section."""


class SimulatedRolloutConfig(Section):
    """`rollout.engine: {type: simulated, ...}`: the simulated engine's workload
    (`engines.simulated`), for scheduling studies only: its samples are random tokens after a
    simulated time."""

    type: Literal["simulated"] = "simulated"
    """`simulated` picks this engine's section."""

    median_tokens: float = Field(64.0, gt=0)
    """Median response length in tokens (the log-normal's exp(mu));
    capped at `data.sampling.max_tokens`, which the rollout still checks against the real model's
    context (the built-in tiny model: 64)."""
    sigma: float = Field(1.0, ge=0)
    """Standard deviation of the log of the response length: 0 makes every response the median,
    1 or more a long tail (a few responses many times the median)."""
    seconds_per_token: float = Field(0.001, ge=0)
    """Simulated decode time of one token in one slot."""
    slots: int = Field(4, ge=1)
    """Sequences generated at once, as a continuous-batching engine's slots: a sample waits for
    the first slot free, and a batch returns when its last sample ends."""
    memory_mib: float = Field(0.0, ge=0)
    """Simulated device memory the engine holds while awake (weights and KV cache): what it
    gives back between phases under `placement: colocated`."""
    sleep_seconds: float = Field(0.0, ge=0)
    """Simulated time to give the device memory back (vLLM's `sleep(level=1)`)."""
    wake_seconds: float = Field(0.0, ge=0)
    """Simulated time to take it again (vLLM's `wake_up()`)."""


EngineDtype = Literal["auto", "bfloat16", "float16", "float32"]
PartialMode = Literal["resubmit", "keep"]


class VLLMRolloutConfig(Section):
    """`rollout.engine: {type: vllm, ...}`: the model on an in-process `vllm.LLM` (a GPU and
    `pip install 'jetrl[vllm]'`; `engines.vllm_rollout`); needs `data.sampling.top_p` 1."""

    type: Literal["vllm"] = "vllm"
    """`vllm` picks this engine's section."""

    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """Fraction of the GPU's memory vLLM takes for weights, activations and KV cache; below vLLM's
    own 0.9 default so a trainer can share the GPU."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one engine shards the model over."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + response in tokens; None takes the model's context (more KV cache)."""
    enforce_eager: bool = False
    """True skips CUDA graph capture: faster start, slower decode."""
    dtype: EngineDtype = "auto"
    """Weights and activations dtype in the engine; auto: the checkpoint's. Loaded weights are
    cast to it."""
    weight_bucket_bytes: int = Field(512 * 2**20, ge=1)
    """Most bytes of tensors in one `collective_rpc` of a weight load (512 MiB): a version goes
    into the engine in buckets this size (a larger tensor alone), each one message the engine's
    processes hold at once, not the whole model in one."""
    slots: int = Field(64, ge=1)
    """With `rollout.continuous`: samples generating at once in one engine (vLLM's `max_num_seqs`);
    the worker submits a sample as soon as one of them is free (`engines.vllm_continuous`)."""
    partial_mode: PartialMode = "resubmit"
    """With `rollout.partial`, how a weight load interrupts the samples in flight: resubmit (abort
    them, load, resubmit each as prompt + its tokens so far: exact per-token versions, their KV
    recomputed with the new weights) or keep (vLLM's `pause_generation(mode="keep")`: requests
    frozen in the engine and resumed with their old KV cache; needs a vLLM that has it)."""


class SGLangRolloutConfig(Section):
    """`rollout.engine: {type: sglang, ...}`: the model on an in-process `sglang.Engine` (a GPU
    and `pip install 'jetrl[sglang]'`; `engines.sglang_rollout`)."""

    type: Literal["sglang"] = "sglang"
    """`sglang` picks this engine's section."""

    mem_fraction_static: float = Field(0.5, gt=0, lt=1)
    """Fraction of the GPU's memory SGLang takes for weights and KV cache; below SGLang's own
    default so a trainer can share the GPU."""
    tp_size: int = Field(1, ge=1)
    """GPUs one engine shards the model over (tensor parallel)."""
    context_length: int | None = Field(None, ge=1)
    """Longest prompt + response in tokens; None takes the model's context."""
    dtype: EngineDtype = "auto"
    """Weights and activations dtype in the engine; auto: the checkpoint's. Loaded weights are
    cast to it."""
    weight_bucket_bytes: int = Field(512 * 2**20, ge=1)
    """Most bytes of tensors in one `update_weights_from_tensor` of a weight load (512 MiB): the
    tensors a version changed go into the engine in buckets this size (a larger tensor alone),
    each checked by SGLang's answer and a read-back of its first tensor's first row."""
    slots: int = Field(64, ge=1)
    """With `rollout.continuous`: samples generating at once in one engine (SGLang's
    `max_running_requests`); the worker submits a sample as soon as one is free
    (`engines.sglang_continuous`)."""
    partial_mode: PartialMode = "resubmit"
    """With `rollout.partial`, how a weight load interrupts the samples in flight: resubmit (abort
    them, load, resubmit each as prompt + its tokens so far: exact per-token versions) or keep
    (SGLang's `pause_generation` in retract mode, then `continue_generation`;
    needs an SGLang that has it)."""


RolloutEngineConfig = Annotated[
    HFRolloutConfig | SimulatedRolloutConfig | VLLMRolloutConfig | SGLangRolloutConfig,
    Field(discriminator="type"),
]
"""`rollout.engine`: the section of the engine its `type` names."""


BUILT_IN_ROUTERS = ("least_in_flight", "sticky_by_key")
"""The routers `rollout.router` names without a module (`engines.router.BUILT_IN`)."""


class RolloutConfig(Section):
    max_batch_prompts: int = Field(16, ge=1)
    """Most prompts generated together in one batch."""
    engine: RolloutEngineConfig = HFRolloutConfig()
    """The engine and its settings, by `type`: hf (the reference engine, `HFRolloutConfig`),
    simulated (scheduling studies: its length distribution, cost per token and slots), vllm or
    sglang (the model on vLLM or SGLang: memory share, parallelism, context, dtype, slots). A
    bare type (`engine: simulated`) takes that engine's defaults."""
    engine_copies: int = Field(1, ge=1)
    """Engines in one rollout worker, each a copy of the model with its own batcher (one
    generation at a time per copy); not the fleet's `processes` (worker processes) nor the
    streams' `--replicas`. Was `replicas`: refused now, with the new name."""
    continuous: bool = True
    """Continuous admission, for engines that take samples one at a time (simulated; vllm and
    sglang through their async engines, `rollout.engine.slots` at once):
    each sample takes an engine slot as one comes free and is stored as soon as it ends, with no
    batcher and no `max_batch_prompts`. False, and always for hf: batches of prompts, one
    generation at a time per replica (vllm and sglang through their batch `generate`)."""
    partial: bool = True
    """Partial rollout, with continuous admission: a new weight version pauses the engine between
    two tokens, loads, and resumes; the samples in flight go on with the new weights and each
    token records the version that computed it (the staleness bound applies to a sample's oldest
    token; vllm and sglang: `partial_mode` says how). False, or an engine without continuous
    admission (hf; vllm and sglang with continuous false): a load waits for every running
    generation to end (a drain), so every sample comes from one version."""
    router: str = "least_in_flight"
    """Which replica generates a prompt (`engines.router`): `least_in_flight` (fewest prompts
    queued or generating, ties to the lowest index), `sticky_by_key` (a prompt's routing key
    keeps the replica it was first given, for prefix-cache reuse; the key is
    `task.conversation_id` when the prompt has one, else the prompt id), or `module:Class`
    (built as `Class(engine_copies, **router_options)`, with a `pick(key, in_flight)` method;
    imported when the worker starts)."""
    router_options: dict[str, Any] = {}
    """Options of `router`: sticky_by_key takes `max_keys` (keys remembered, least recently
    used forgotten first; default 100000); least_in_flight none; an unknown one is an error."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        return refuse_renamed(data, {"replicas": "engine_copies"})

    @field_validator("engine", mode="before")
    @classmethod
    def _engine(cls, value: object) -> object:
        return engine_section(value)

    @field_validator("router")
    @classmethod
    def _router(cls, value: str) -> str:
        if value in BUILT_IN_ROUTERS:
            return value
        module, sep, name = value.partition(":")
        if not sep or not module or not name.isidentifier():
            raise ValueError(
                f"{value!r}: expected one of {', '.join(BUILT_IN_ROUTERS)} or 'module:Class'"
            )
        return value
