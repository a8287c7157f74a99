"""What the workers call on an engine: the rollout and train Protocols and their data types.

A stage holds an engine only as one of these (`engines.build` makes it from the config); what
only some engines can do is a narrower protocol a stage checks for (`ContinuousEngine`,
`ShardedTrainEngine`), never an engine class.

Alignment convention shared by both sides (and by `BatchEvent`): for a row of token ids
``x[0..T)``, position ``t`` of every per-token tensor (log-probs, masks) refers to token
``x[t]`` and holds ``log p(x[t] | x[<t])``; position 0 has no prediction and holds 0.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy. ``<eos>`` always stops."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Sample:
    """One generated response.

    token_ids: [L] int64, the response only (no prompt), ending with the stop token when
        ``finish_reason == "stop"`` (the trainer must see it to learn when to stop).
    logprobs: [L] float32, behaviour log-prob of each token, ``log_softmax(logits / T)``
        (see `engines.hf_rollout`).
    versions: [L] int32, the weight version that computed each token, from an engine that
        loads weights mid-generation (`ContinuousEngine`, partial rollout); None: every token
        from the version the engine served when the generation started.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: FinishReason
    versions: torch.Tensor | None = None


@dataclass
class MicroBatch:
    """A gradient-ready micro-batch of B padded rows of length T, one sequence per row.

    Padding may sit on either side (positions are counted from `attention_mask`), with any
    token id under ``attention_mask == 0``.

    input_ids: [B, T] int64, prompt + response (+ padding).
    attention_mask: [B, T] 0/1, 1 on real tokens.
    loss_mask: [B, T] 0/1, 1 on response tokens (those the policy chose).
    advantages: [B] float32, one per sequence (broadcast over its tokens); with a critic (GAE)
        the [B] outcome scores, which the engine turns into [B, T] token advantages.
    behaviour_logprobs: [B, T] float32, log p_behaviour(x[t] | x[<t]), 0 where loss_mask is 0.
    ref_logprobs: [B, T] float32, log p_ref(x[t] | x[<t]) from the reference stage, 0 where
        loss_mask is 0; None: an engine that needs them scores its own frozen copy.
    token_rewards: [B, T] float32, rewards inside a response (`agent.turn_rewards`: each model
        turn's on its last token), 0 off loss_mask; a critic (GAE) adds them to the outcome
        score on the last loss token. None: the outcome alone.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    behaviour_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None


def empty_pass(micro_batches: Sequence[MicroBatch]) -> MicroBatch:
    """A pass that adds nothing: a 1-row batch with no loss token (its loss is exactly 0 and
    its gradient zeros, but it runs the model's forward and backward like any batch). A rank
    of a sharded engine with fewer micro-batches than the busiest runs these, so that every
    rank joins the same collectives."""
    if micro_batches:
        first = micro_batches[0]
        ids, attention = first.input_ids[:1], first.attention_mask[:1]
    else:
        ids, attention = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)
    return MicroBatch(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=torch.zeros(ids.shape),
        advantages=torch.zeros(1),
        behaviour_logprobs=torch.zeros(ids.shape),
    )


class WeightsNotLoaded(RuntimeError):
    """An engine's read-back after a weight load disagrees with what it was sent (a bucket
    whose bytes arrived changed, a tensor its loader skipped or wrote wrong). The message
    names the bucket and the tensor. The engine may hold a mix of two versions: the caller
    must not count the version as loaded (`consumers.rollout` loads it again whole, and ends
    the worker when that fails too)."""


class EngineUnavailable(RuntimeError):
    """The engine a config names cannot start here: not installed (or not importable), or an
    environment that would change what it reports. Said in one line (what to install)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates samples and takes new weights between generations."""

    version: int
    model: torch.nn.Module
    """The model's HF module (real, or a meta-device skeleton when the engine holds the weights
    elsewhere): what the worker checks manifests and prompts against."""

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        """`n` samples for each prompt (token ids), grouped per prompt, in prompt order."""
        ...

    def load_state_dict(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Swaps in weights named as `TrainEngine.export_weights` names them; sets `version`.

        `tensors` may be any subset of the model's parameters (the ones that changed since the
        version the engine holds: the others stay as they are); a name the model does not have
        raises KeyError, never ignored. Each load is read back (per tensor, or per bucket where
        the engine takes buckets) and a disagreement raises `WeightsNotLoaded`."""
        ...


@runtime_checkable
class TrainEngine(Protocol):
    """Holds the policy and its optimizer; one `train_step` is one optimizer step."""

    step: int
    name: str
    """What the trainer reports as its engine ("torch", "fsdp", "megatron")."""
    collective: bool
    """True when every data-parallel rank must call `train_step`, `export_weights` and the
    checkpoint methods together, in the same order (they communicate)."""

    def token_limits(self) -> tuple[int, int | None]:
        """The model's vocabulary size and longest sequence (None when its config does not say):
        what the trainer checks each batch against."""
        ...

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, T] float32 log-probs of `input_ids` under the current policy, aligned as above."""
        ...

    def train_step(self, micro_batches: Sequence[MicroBatch]) -> dict[str, float]:
        """Accumulates gradients over `micro_batches`, takes one optimizer step, returns metrics."""
        ...

    def export_weights(self) -> dict[str, torch.Tensor]:
        """CPU, contiguous tensors keyed by the model's parameter names (on rank 0; a
        collective engine's other ranks get {})."""
        ...

    # Weights out: what a rank hands the weights sender (`consumers.weights.sender`).
    weight_shards: int
    """How many ranks send a part of each weight version: 1, rank 0 sends every tensor
    (gathered from the others, if any); n, each of the n ranks sends its own shard."""

    def export_own_weights(self) -> dict[str, torch.Tensor]:
        """This rank's tensors of a weight version: its own shard when `weight_shards` > 1, else
        `export_weights()`. Every rank of a collective engine calls it, together."""
        ...

    def has_checkpoint(self, path: Path) -> bool:
        """Whether a completed `save_checkpoint(path)` is there to resume from."""
        ...

    def save_checkpoint(
        self,
        path: Path,
        extra: dict[str, Any] | None = None,
        before_replace: Callable[[], None] | None = None,
    ) -> None:
        """Writes model, optimizer, RNG states and `extra` atomically to `path` (`before_replace`:
        called just before the commit, a crash point for the tests)."""
        ...

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restores what `save_checkpoint` wrote and returns its `extra`."""
        ...


@runtime_checkable
class ReleasableTrainEngine(TrainEngine, Protocol):
    """A train engine that can move its optimizer state off its device between colocated turns
    and take it again (optional: `trainer.offload_optimizer`; the torch engine, through
    `engines.release.Offload`). `consumers.colocation.OptimizerTurns` calls these as the
    trainer's `Phases` ends and starts a turn."""

    def release_optimizer(self) -> int:
        """Move the optimizer state off the device (to host memory; on the CPU, out of the
        process); returns the bytes moved (0 before the first step: there is no state yet;
        0 when released already). No step or checkpoint save may run until
        `resume_optimizer`."""
        ...

    def resume_optimizer(self) -> int:
        """Bring the optimizer state back as it left; returns the bytes moved (0: it was held,
        and nothing was done)."""
        ...


@runtime_checkable
class ShardedTrainEngine(TrainEngine, Protocol):
    """A collective train engine each rank of which can export its own shard of the weights
    (optional: the fsdp engine), so that no rank gathers the whole model to publish it."""

    def weight_sizes(self) -> dict[str, int]:
        """Bytes of each tensor `export_weights` would name: what the shard layout is cut by."""
        ...

    def export_shard(self, layout: Sequence[Sequence[str]]) -> dict[str, torch.Tensor]:
        """This rank's tensors of `layout` (one list of names per rank), whole, on the CPU."""
        ...


@runtime_checkable
class ContinuousEngine(RolloutEngine, Protocol):
    """A rollout engine that takes samples one at a time, concurrently, as a continuous-batching
    engine does (optional: an engine without it is given batches through `generate`).

    The worker calls `generate_sample` from up to `slots` threads at once; each call returns as
    soon as its own sample ends, whatever the others do. `pause` returns once no token is being
    computed and none will start until `resume`; weights load between the two (partial
    rollout), and the samples in flight go on with the new weights, each token recording the
    version that computed it (`Sample.versions`).
    """

    slots: int

    def generate_sample(self, prompt: Sequence[int], params: SamplingParams) -> Sample:
        """One sample for `prompt` (token ids), with `versions` set."""
        ...

    def pause(self) -> None:
        """Stop between tokens: returns when no token is being computed;
        none starts until `resume`."""
        ...

    def resume(self) -> None:
        """Let the paused samples go on (with whatever weights were loaded meanwhile)."""
        ...


@runtime_checkable
class Releasable(Protocol):
    """What a colocated role gives back at the end of each turn on the device and takes again
    at the start of the next (`consumers.colocation.Phases`): a `ReleasableEngine`'s memory, or
    the trainer's optimizer state (`consumers.colocation.OptimizerTurns`)."""

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...


@runtime_checkable
class ReleasableEngine(RolloutEngine, Protocol):
    """A rollout engine that can give its device memory back between generations and take it
    again (optional: `placement: colocated` needs it; `consumers.colocation`). On a GPU these
    are vLLM's `sleep(level=1)` / `wake_up()` and SGLang's `release_memory_occupation` /
    `resume_memory_occupation`; the HF engine moves its weights off the device and back."""

    def device_bytes(self) -> int:
        """Bytes the engine holds on its device now (0 once released)."""
        ...

    def release_memory(self) -> None:
        """Give the device memory back (weights kept on the host, KV cache dropped); no
        generation may run until `resume_memory`. Releasing a released engine does nothing."""
        ...

    def resume_memory(self) -> None:
        """Take the device memory again, weights as they were, or as loaded meanwhile: a
        `load_state_dict` while released checks the names and takes the version at once but
        writes nothing to the device; the tensors are loaded (and read back) here
        (`engines.release`; `WeightsNotLoaded` when they do not read back)."""
        ...
