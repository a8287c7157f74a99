"""`placement`: where a node's rollout engine and trainer run, and what colocation refuses.

    separated   the rollout engine and the trainer on devices of their own (the default)
    colocated   on one device of the node, taking turns in phases (`bus.lease`,
                `consumers.colocation`): the engine generates, gives its memory back, the
                trainer trains and publishes, the engine takes its memory again and loads

Every rollout engine can give its memory back (`RELEASABLE_ENGINES`: hf, vllm, sglang and
simulated; vLLM's and SGLang's calls have not run on a GPU yet, docs/engines.md). What
colocation cannot do yet is refused on load, in one line (`colocation_refusal`), so a run
never starts a placement that would stall or share a device unguarded: an engine over
several devices (tensor parallel), a trainer over several ranks, several engine copies,
continuous admission, the collective weights transport, agent episodes. The trainer's
`offload_optimizer` needs colocation (`offload_refusal`). This module knows nothing of NATS.

`lend: true` (separated only): the trainer lends its device to rollout while it waits for
its batches (`consumers.lending`); `lend_refusal` says what that cannot do yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from schemas.rollout_config import SGLangRolloutConfig, VLLMRolloutConfig

if TYPE_CHECKING:
    from schemas.config import RunConfig

Placement = Literal["separated", "colocated"]

RELEASABLE_ENGINES = ("simulated", "hf", "vllm", "sglang")
"""Rollout engines whose memory release and resume are wired (`engines.protocols
.ReleasableEngine`; on a GPU none has run yet: docs/engines.md)."""


def colocation_refusal(config: RunConfig) -> str | None:
    """Why `config` cannot run colocated (one line), or None when it can (or is separated)."""
    if config.placement != "colocated":
        return None
    engine, trainer, rollout = config.rollout.engine.type, config.trainer, config.rollout
    why = "placement colocated"
    if engine not in RELEASABLE_ENGINES:
        return (
            f"{why}: rollout.engine {engine} has no memory release wired yet (only "
            f"{', '.join(RELEASABLE_ENGINES)}); use placement: separated"
        )
    ranks = engine_ranks(config)
    if ranks != 1:
        return (
            f"{why} needs a rollout engine on one device (the lease is the node's one device), "
            f"not {engine} over {ranks} tensor-parallel ranks"
        )
    if trainer.engine.type != "torch" or trainer.dp_size != 1:
        return (
            f"{why} needs trainer.engine torch with dp_size 1 (one trainer rank per device), "
            f"not {trainer.engine.type} with dp_size {trainer.dp_size}"
        )
    if rollout.engine_copies != 1:
        return (
            f"{why} needs rollout.engine_copies 1 (one engine per device), not "
            f"{rollout.engine_copies}"
        )
    if rollout.continuous:
        return f"{why} needs rollout.continuous false: the device is taken per generated batch"
    if config.weights.transport == "collective":
        return (
            f"{why} needs a stored weights.transport, not collective: the trainer's broadcast "
            "would wait for a rollout engine that cannot run until the trainer's turn ends"
        )
    if config.agent is not None:
        return f"{why} does not run agent episodes yet: drop the agent section or separate"
    return None


def engine_ranks(config: RunConfig) -> int:
    """The devices the rollout engine spans: its tensor-parallel size (vllm, sglang), else 1."""
    settings = config.rollout.engine
    if isinstance(settings, VLLMRolloutConfig):
        return settings.tensor_parallel_size
    if isinstance(settings, SGLangRolloutConfig):
        return settings.tp_size
    return 1


def offload_refusal(config: RunConfig) -> str | None:
    """Why `config` cannot offload the trainer's optimizer state (one line), or None."""
    if config.trainer.offload_optimizer and config.placement != "colocated":
        return (
            f"trainer.offload_optimizer needs placement colocated, not {config.placement}: "
            "the trainer never gives its device back, so moving its optimizer state off and on "
            "would only slow each step"
        )
    return None


LENDABLE_ENGINES = ("simulated",)
"""Rollout engines a trainer can lend its device to: they stop between two tokens
(`ContinuousEngine.pause`) and give their memory back (`ReleasableEngine`)."""


def lend_refusal(config: RunConfig) -> str | None:
    """Why `config` cannot lend the trainer's device to rollout (one line), or None."""
    if not config.lend:
        return None
    engine, trainer = config.rollout.engine.type, config.trainer
    if config.placement != "separated":
        return (
            "lend: true needs placement separated: colocated, the trainer's device already "
            "runs the rollout engine in turns"
        )
    if engine not in LENDABLE_ENGINES:
        return (
            f"lend: true: rollout.engine {engine} cannot stop between two tokens and give its "
            f"memory back yet (only {', '.join(LENDABLE_ENGINES)}); use lend: false"
        )
    if trainer.engine.type != "torch" or trainer.dp_size != 1:
        return (
            f"lend: true needs trainer.engine torch with dp_size 1 (one trainer device), not "
            f"{trainer.engine.type} with dp_size {trainer.dp_size}"
        )
    if config.agent is not None:
        return "lend: true does not run agent episodes yet: drop the agent section or lend: false"
    return None
