"""The engine builders, at the package door: the engine a config section names, as the
protocol a stage calls. No stage names an engine class; adding an engine is its module in
`engines/`, its section in the config's union and its case here (docs/engines.md).

    rollout.engine {type: hf | simulated | vllm | sglang, ...}
        -> build_rollout_engines -> [RolloutEngine] x rollout.engine_copies (each a ContinuousEngine
           where the engine takes samples one at a time and `rollout.continuous` asks for it)
    trainer.engine {type: torch | fsdp | megatron, ...}
        -> build_train_engine -> TrainEngine (a ShardedTrainEngine for fsdp)

Each engine module is imported only when its type is built, and vllm, sglang and megatron-core
only inside their engine's constructor: without the extra installed, a one-line
`EngineUnavailable` names the pip command.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.device import DTypeName, resolve_device, torch_dtype
from engines.protocols import RolloutEngine, TrainEngine
from schemas.rollout_config import (
    HFRolloutConfig,
    RolloutEngineConfig,
    SGLangRolloutConfig,
    SimulatedRolloutConfig,
    VLLMRolloutConfig,
)
from schemas.trainer_config import (
    FSDPEngineConfig,
    MegatronConfig,
    SimulatedTrainConfig,
    TorchEngineConfig,
    TrainEngineConfig,
)

if TYPE_CHECKING:  # the rollout side never imports the train engines
    from engines.torch_train import CriticConfig

CONTINUOUS_KEYS = {"type", "slots", "partial_mode"}
"""Keys of a vllm / sglang section that are not the engine's own settings (the section's tag,
and the continuous adapter's)."""


def build_rollout_engines(
    settings: RolloutEngineConfig,
    model: Path,
    copies: int,
    *,
    seed: int,
    dtype: DTypeName,
    continuous: bool,
    releasable: bool = False,
) -> list[RolloutEngine]:
    """`copies` engines of `settings` (`rollout.engine_copies`), each its own copy of the model,
    seeded apart (`seed + i`) so that they do not draw the same samples."""
    return [
        build_rollout_engine(
            settings,
            model,
            seed=seed + i,
            dtype=dtype,
            continuous=continuous,
            releasable=releasable,
        )
        for i in range(copies)
    ]


def build_rollout_engine(
    settings: RolloutEngineConfig,
    model: Path,
    *,
    seed: int,
    dtype: DTypeName = "float32",
    continuous: bool = False,
    releasable: bool = False,
) -> RolloutEngine:
    """The engine `settings` (`rollout.engine`) names, on this worker's device
    (`engines.device`) in `dtype` (`model.dtype`); the simulated one keeps the real model for
    the worker's checks only. `continuous` (`rollout.continuous`): vllm and sglang as their
    continuous adapters (async engines, samples submitted one at a time). `releasable`
    (`placement: colocated`): vllm built with sleep mode, sglang with its memory saver, which
    their release calls need (hf and simulated can always release)."""
    if isinstance(settings, VLLMRolloutConfig):
        from engines.vllm_rollout import VLLMSettings

        vllm = VLLMSettings(
            **settings.model_dump(exclude=CONTINUOUS_KEYS), seed=seed, sleep_mode=releasable
        )
        if continuous:
            from engines.vllm_continuous import VLLMContinuousEngine

            return VLLMContinuousEngine(model, vllm, settings.slots, settings.partial_mode)
        from engines.vllm_rollout import VLLMRolloutEngine

        return VLLMRolloutEngine(model, vllm)
    if isinstance(settings, SGLangRolloutConfig):
        from engines.sglang_rollout import SGLangSettings

        sglang = SGLangSettings(
            **settings.model_dump(exclude=CONTINUOUS_KEYS), seed=seed, memory_saver=releasable
        )
        if continuous:
            from engines.sglang_continuous import SGLangContinuousEngine

            return SGLangContinuousEngine(model, sglang, settings.slots, settings.partial_mode)
        from engines.sglang_rollout import SGLangRolloutEngine

        return SGLangRolloutEngine(model, sglang)
    from engines.hf_rollout import HFRolloutEngine

    hf = HFRolloutEngine(model, device=str(resolve_device()), dtype=torch_dtype(dtype), seed=seed)
    if isinstance(settings, HFRolloutConfig):
        return hf
    assert isinstance(settings, SimulatedRolloutConfig), settings
    from engines.simulated import SimulatedRolloutEngine, SimulatedSettings

    simulated = SimulatedSettings(
        settings.median_tokens,
        settings.sigma,
        settings.seconds_per_token,
        settings.slots,
        seed,
        settings.memory_mib,
        settings.sleep_seconds,
        settings.wake_seconds,
    )
    vocab = hf.model.get_input_embeddings().num_embeddings
    return SimulatedRolloutEngine(hf.model, vocab, hf.eos_token_ids[0], simulated)


def build_train_engine(
    settings: TrainEngineConfig,
    model_dir: Path,
    *,
    critic: CriticConfig | None = None,
    **common: Any,
) -> TrainEngine:
    """The engine `settings` (`trainer.engine`) names, from `model_dir`. `common`: the keyword
    arguments every train engine takes (`TorchTrainEngine`'s: lr, loss, device, dtype, ...);
    `critic`: the value model (`algorithm.advantage: gae`), which the torch and fsdp engines
    hold (the config refuses it with megatron). fsdp and megatron above one rank: after the
    process group is up (`engines.fsdp_train.init_group`)."""
    if isinstance(settings, MegatronConfig):
        from engines.megatron_train import MegatronTrainEngine  # megatron-core: inside, only now

        return MegatronTrainEngine(
            model_dir,
            tensor_parallel_size=settings.tensor_parallel_size,
            pipeline_parallel_size=settings.pipeline_parallel_size,
            **common,
        )
    if isinstance(settings, FSDPEngineConfig):
        from engines.fsdp_train import FSDPTrainEngine

        return FSDPTrainEngine(model_dir, critic=critic, **common)
    if isinstance(settings, SimulatedTrainConfig):
        from engines.simulated_train import SimulatedTrainEngine

        return SimulatedTrainEngine(model_dir, critic=critic, **common)
    assert isinstance(settings, TorchEngineConfig), settings
    from engines.torch_train import TorchTrainEngine

    return TorchTrainEngine(model_dir, critic=critic, **common)
