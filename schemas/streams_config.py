"""`streams`: how much each stream of a run may hold, derived from the run's own bounds.

A work stream holds what its consumer has not acked yet. The admission gate bounds the samples
in flight at (max_staleness + 1) x prompts_per_step x n (`StalenessPolicy.in_flight_prompts` x n),
and the config bounds each sample's size (prompt tokens `streams.max_prompt_tokens`, response
tokens `data.sampling.max_tokens`); their product times `safety_factor` is what a stream must be
able to hold (`stream_needs`).
A full stream makes its publishers wait (discard new, `bus.topology`); it never drops unconsumed
work. Batches are trimmed behind the trainer's checkpoints (`batches_kept_from`), so their
need is the steps between two checkpoints plus what the gate lets the buffer run ahead
(`StalenessPolicy.batch_steps_kept`), not the whole run. `ops.streams show` prints the
derivation; docs/reliability.md states it for an example.

This module knows nothing of NATS: it works in bytes and seconds only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from schemas.section import Section

if TYPE_CHECKING:
    from schemas.config import RunConfig

MIB = 1 << 20
STREAM_NAMES = ("prompts", "trajectories", "rewards", "scored", "batches", "weights", "dead")
StreamName = Literal["prompts", "trajectories", "rewards", "scored", "batches", "weights", "dead"]

# Wire bytes per token of each event, from the event schemas (`schemas.events`): ids, versions
# and log-probs are int32/float32 (4 B each); text is counted at 4 B per token (about 4 characters
# per token of English BPE; the safety factor covers heavier text). Checked against the codec's
# real encoding in tests/test_stream_limits.py.
PROMPT_BYTES_PER_TOKEN = 8
"""Prompt text (4) plus its optional token ids (4)."""
TRAJECTORY_PROMPT_BYTES_PER_TOKEN = 4
"""`prompt_ids` (int32)."""
TRAJECTORY_RESPONSE_BYTES_PER_TOKEN = 16
"""`response_ids`, `logprobs`, `versions` (4 each) and `response_text` (4)."""
BATCH_BYTES_PER_TOKEN = 20
"""Per row and padded position: input_ids, advantages, behaviour_logprobs, versions (4 each),
attention_mask and loss_mask (1 each), rounded up."""
REFERENCE_BYTES_PER_TOKEN = 4
"""The reference log-prob (float32) a scored sample carries per response token, and a batch per
position when the run has the reference stage."""
TOKEN_REWARD_BYTES_PER_TOKEN = 4
"""The token reward (float32) a batch carries per position with `agent.turn_rewards`."""
EVENT_OVERHEAD = 4096
"""Ids, task dict, timings, headers of one event."""
WEIGHTS_EVENT_BYTES = 64 * 1024
"""One `WeightVersionEvent`: where a version is and its manifest (no tensor bytes: those go
through the weights transport)."""
GATED_WINDOWS = ("prompts", "rewards", "scored")
"""The streams whose work queue's `max_ack_pending` the gate's bound raises (`window_needs`)."""
MAX_WAITING = 4096
"""Default `streams.max_waiting`: room for a few thousand idle workers' pull requests."""
MAX_CONSUMERS = 65_536
"""Default `streams.max_consumers`: room for tens of thousands of workers' readers."""
MIN_STREAM_BYTES = 64 * MIB
"""No stream is made smaller than this: a tiny run's need is a few KB, and a few MB cost nothing."""
DEAD_BYTES = 1 << 30
"""The dead-letter stream is not bounded by the gate: what the stages refuse,
kept for the operator."""


class StreamsConfig(Section):
    """`streams`: the run's stream limits (`stream_needs`) and the loss guard."""

    safety_factor: float = Field(2.0, ge=1.0)
    """Each derived need is multiplied by this: messages redelivered or replaced (dropped groups
    are replaced by the gate), text heavier than 4 bytes per token."""
    max_prompt_tokens: int = Field(2048, ge=1)
    """The longest prompt the bounds assume, in tokens (the response's is
    `data.sampling.max_tokens`)."""
    max_bytes: dict[StreamName, int] = Field(default_factory=dict)
    """Operator overrides, in bytes, by stream (prompts, trajectories, rewards, scored, batches,
    weights, dead). One below the derived need is refused at load with the need and how it was
    derived; one above is used as it is."""
    max_dropped_share: float = Field(0.5, ge=0, lt=1)
    """The share of the prompts issued whose groups the prompts bound allows to be dropped (all
    rewards equal, too stale, refused by the rollout) and replaced by new prompts through the gate:
    a run that trains steps x prompts_per_step prompts issues up to that / (1 - share). A run
    dropping more fills its prompt stream (prompts are kept for the run), and the producer then
    waits for good (its log says the stream is full) instead of a prompt being lost: give such a
    run a higher share from the start."""
    max_age_s: float = Field(0.0, ge=0)
    """Seconds a message may live in any stream of the run; 0: no age limit. The default keeps
    every batch and weights event a restart from a checkpoint could still need, however long the
    run; a non-zero age can delete unconsumed work, which the loss guard then reports."""
    consumed: Literal["delete", "keep"] = "delete"
    """What happens to a trajectory, reward or scored sample once its work queue acked it. delete:
    the server removes it (interest retention), so those streams hold only unconsumed work and their
    need is the gate's bound. keep: it stays (limits retention) for replay and audit, so the need
    covers every sample of the run (trainer.steps x prompts_per_step x n)."""
    max_waiting: int = Field(MAX_WAITING, ge=1)
    """Pull requests each work queue's consumer keeps waiting at once. Every idle worker of a
    stage holds one open; past this number the server refuses the rest at once ("409 Exceeded
    MaxWaiting", `bus.pull.PullRefused`) and those workers back off instead of working. Set it
    above the largest number of workers one stage will run (at the old fixed 512, 88 of 600 idle
    workers' requests were refused: tests/test_fleet_windows.py)."""
    max_consumers: int = Field(MAX_CONSUMERS, ge=1)
    """Consumers each stream of the run may hold at once: every channel's stream, the KV
    buckets' and the object store's. nats-server 2.15 holds a stream that sets no limit to
    1,000 (and reads 0 or -1 as that default), and every rollout worker reads `weights` through
    a consumer of its own (with the object store, each version's chunks through another): at
    1,000 workers the server refused the next one ("maximum consumers limit reached", err
    10026; `ops.bench.scale`, docs/scale.md). Set it above the largest fleet the run will have.
    Set when the run's streams and buckets are made."""
    guard_seconds: float = Field(10.0, gt=0)
    """How often each worker checks its work queue for loss: the stream's first sequence past the
    durable consumer's ack floor (`bus.loss`)."""


@dataclass(frozen=True)
class Need:
    """What one stream must hold, and how that was derived (shown by `ops.streams show`)."""

    stream: str
    need: int
    """Bytes the run's bounds require (after the safety factor and the floor)."""
    limit: int
    """Bytes the stream is made with: the operator's override, else the need."""
    how: str
    """The derivation, in words and numbers."""


def _mib(value: float) -> str:
    return f"{value / MIB:,.1f} MiB"


def _needs(cfg: RunConfig) -> dict[str, tuple[float, str]]:
    """Raw need (before safety factor and floor) of every stream, with its derivation."""
    s, a = cfg.streams, cfg.algorithm
    prompt_tokens, response_tokens = s.max_prompt_tokens, cfg.data.sampling.max_tokens
    group = a.prompts_per_step * cfg.data.n
    staleness = cfg.staleness
    in_flight = staleness.in_flight_prompts * cfg.data.n
    run_samples = cfg.trainer.steps * group
    prompt = EVENT_OVERHEAD + prompt_tokens * PROMPT_BYTES_PER_TOKEN
    trajectory = (
        EVENT_OVERHEAD
        + prompt_tokens * TRAJECTORY_PROMPT_BYTES_PER_TOKEN
        + response_tokens * TRAJECTORY_RESPONSE_BYTES_PER_TOKEN
    )
    reward = trajectory + EVENT_OVERHEAD
    scored = reward + response_tokens * REFERENCE_BYTES_PER_TOKEN
    per_position = BATCH_BYTES_PER_TOKEN + (
        REFERENCE_BYTES_PER_TOKEN if cfg.reference.enabled else 0
    )
    if cfg.agent is not None and cfg.agent.turn_rewards:
        per_position += TOKEN_REWARD_BYTES_PER_TOKEN
    step = group * (prompt_tokens + response_tokens) * per_position + EVENT_OVERHEAD
    versions = cfg.trainer.steps // cfg.trainer.sync_every + 1
    trained_prompts = cfg.trainer.steps * a.prompts_per_step
    issued = math.ceil(trained_prompts / (1 - s.max_dropped_share))
    kept_steps = staleness.batch_steps_kept
    if s.consumed == "delete":
        samples, why = (
            in_flight,
            (
                f"gate bound (max_staleness {staleness.bound} + 1) x prompts_per_step "
                f"{a.prompts_per_step} "
                f"x n {cfg.data.n} = {in_flight} samples"
            ),
        )
    else:
        samples, why = (
            run_samples,
            (
                f"consumed: keep, every sample of the run: steps {cfg.trainer.steps} x "
                f"prompts_per_step {a.prompts_per_step} x n {cfg.data.n} = {run_samples} samples"
            ),
        )
    tokens = f"{prompt_tokens} prompt + {response_tokens} response tokens"
    return {
        "prompts": (
            issued * prompt,
            (
                "every prompt of the run (gate resume, audit), replacements of dropped groups "
                f"included: steps {cfg.trainer.steps} x prompts_per_step {a.prompts_per_step} = "
                f"{trained_prompts} trained / (1 - max_dropped_share {s.max_dropped_share:g}) = "
                f"{issued} issued x {prompt:,} B ({prompt_tokens} tokens)"
            ),
        ),
        "trajectories": (samples * trajectory, f"{why} x {trajectory:,} B ({tokens})"),
        "rewards": (samples * reward, f"{why} x {reward:,} B (a trajectory and its score)"),
        "scored": (
            samples * scored if cfg.reference.enabled else 0.0,
            f"{why} x {scored:,} B (a reward and its reference log-probs)"
            if cfg.reference.enabled
            else "reference.enabled false: nothing is written to it",
        ),
        "batches": (
            kept_steps * step,
            (
                f"the steps a restart can need (trimmed at each checkpoint): min(checkpoint_every "
                f"{cfg.trainer.checkpoint_every} + gate bound (max_staleness "
                f"{staleness.bound} + 1) + the "
                f"checkpoint's last step 1, steps {cfg.trainer.steps}) = {kept_steps} steps "
                f"x {group} rows x "
                f"({tokens}) x {per_position} B"
            ),
        ),
        "weights": (
            versions * WEIGHTS_EVENT_BYTES,
            (
                "every version's event of the run (small; audit and the delta chains' earlier "
                f"events): {versions} versions x {WEIGHTS_EVENT_BYTES:,} B per event (the bytes "
                f"themselves: weights.keep {cfg.weights.keep} versions + a delta chain of up to "
                f"full_every {cfg.weights.full_every} in the object store)"
            ),
        ),
    }


def window_needs(cfg: RunConfig) -> dict[str, int]:
    """Messages each gate-bounded work queue must let be unacked at once, by stream name.

    `prompts`: every prompt the gate lets be out (`StalenessPolicy.in_flight_prompts`) may sit
    in a rollout worker at once, held until its samples are stored; `rewards` and `scored`: the
    buffer holds every scored sample unacked until it is in a stored batch, up to the in-flight
    samples (x n). Times `streams.safety_factor` (redeliveries, replaced groups). A consumer
    whose window is smaller stalls the run: with 1,024 prompts at most, 1,000 rollout workers
    got about one prompt each whatever their slots (docs/scale.md)."""
    prompts = cfg.staleness.in_flight_prompts * cfg.streams.safety_factor
    samples = prompts * cfg.data.n
    return {
        "prompts": math.ceil(prompts),
        "rewards": math.ceil(samples),
        "scored": math.ceil(samples),
    }


def batches_kept_from(before_last_step: int) -> int:
    """The first sequence of `batches.<rank>` to keep once a checkpoint is committed, given
    `before_last_step`: the sequence of the last batch of the step before the checkpoint's last
    (the rank's resume position one step earlier; 0 if none).

    A trainer restarted from the checkpoint reads from the sequence after its last batch, which
    is later; the checkpoint's last step itself is kept for the buffer: a restarted buffer
    learns from the batch stream which step comes next and which samples are batched already
    (`consumers.buffer.read_batches`), and a stream trimmed to nothing would send it back to
    step 0. Everything before this sequence on the rank's subject is deleted."""
    return before_last_step + 1


def stream_needs(cfg: RunConfig) -> dict[str, Need]:
    """Every stream's need and limit; ValueError naming the key for an override below its need."""
    s = cfg.streams
    dead = s.max_bytes.get("dead", DEAD_BYTES)
    found = {
        "dead": Need(
            "dead",
            DEAD_BYTES,
            dead,
            "fixed: dead letters are not bounded by the gate (discard old)",
        )
    }
    for name, (raw, how) in _needs(cfg).items():
        need = max(int(raw * s.safety_factor), MIN_STREAM_BYTES)
        how = (
            f"{how} = {_mib(raw)}, x safety_factor {s.safety_factor:g} = "
            f"{_mib(raw * s.safety_factor)}"
        )
        if raw * s.safety_factor < MIN_STREAM_BYTES:
            how += f", at least {_mib(MIN_STREAM_BYTES)}"
        override = s.max_bytes.get(name)  # type: ignore[call-overload]
        if override is not None and override < need:
            raise ValueError(
                f"streams.max_bytes.{name} {override:,} is below the run's need of {need:,} bytes "
                f"({how}); a smaller stream would make its publishers wait for ever or lose work"
            )
        found[name] = Need(name, need, override if override is not None else need, how)
    return {name: found[name] for name in STREAM_NAMES}
