"""`model`: the policy's checkpoint (or the built-in tiny model), its dtype, and an optional
warm start (supervised fine-tuning on demonstrations before RL, `engines.warm_start`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.section import Section

WARM_START_REPORT = "warm_start.json"
"""Written last into the warm-started model's directory: its presence says the warm start is
complete (`engines.warm_start`; the producer's `prepare` skips it then)."""


class WarmStartConfig(Section):
    """Supervised fine-tuning on demonstration episodes before RL (`engines.warm_start`): the
    producer runs it once, before any worker starts, into the run directory's `model/`, which
    the run then trains (a resumed run finds it done). Each demonstration goes through the
    episode runner's own tokens (chat template, tools, the call format), with the loss on the
    assistant turns only."""

    dataset: str | None = None
    """A .jsonl of demonstrations, one conversation a row under `messages` (OpenAI format:
    assistant turns as `content` and/or `tool_calls`, tool results as `tool` messages); tools
    are shown as `agent.tools` shows them. None: the built-in agent task's generated
    demonstrations (`data.task: calc`: calls of random expressions, so the model learns the
    tool's format, never the task: `producers.agent_tasks.demonstration`)."""
    steps: int = Field(300, ge=1)
    """Optimizer steps (AdamW), `batch` samples each."""
    lr: float = Field(3e-3, gt=0)
    """AdamW learning rate (the built-in tiny model's; a pretrained model wants ~1e-5)."""
    batch: int = Field(32, ge=1)
    """Demonstration samples per step."""


class ModelConfig(Section):
    path: str | None = None
    """A local Hugging Face causal-LM directory, or a hub id (``org/name``) that each worker
    fetches into its hub cache (``HF_HUB_CACHE`` / ``HF_HOME``; with ``HF_HUB_OFFLINE=1`` it must
    already be there; `engines.model_source`). None builds the tiny built-in model into the run
    directory."""
    revision: str | None = None
    """The hub revision of a hub-id `path` (branch, tag or commit; None: the default branch).
    Pin a commit: every worker of a run must load the same weights."""
    hidden: int = Field(64, ge=8)
    """Hidden size of the built-in tiny model."""
    layers: int = Field(2, ge=1)
    """Layers of the built-in tiny model."""
    seed: int = 0
    """Seed of the built-in tiny model's random init."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the trainer's forward and backward. bfloat16: mixed precision (autocast
    in the torch engine, FSDP2's parameter dtype in the fsdp engine, gradients reduced in
    float32); the master weights and the AdamW moments stay float32. Weight versions are
    published in this dtype (bfloat16: half the bytes of float32, the trainer's masters cast
    as they are sent). The rollout's HF engine holds and runs its model in this dtype.
    Each worker's device is its own (`engines.device`: the GPU CUDA_VISIBLE_DEVICES gives it,
    else the CPU; a fleet role's `device` overrides)."""
    warm_start: WarmStartConfig | None = None
    """Supervised fine-tuning on demonstrations before RL (see its section). None: RL starts
    from the model as it is."""
