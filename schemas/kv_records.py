"""The records stored under the run's KV keys, one pydantic model per key family: what each
value holds and its one encode/decode. `bus.channels` declares each family's key (`KvKey`)
and names its record class there, as a `Channel` names its event class.

    drop.<prompt id>         DropRecord     buffer, rollout -> gate, audit, stall watch
    metrics.<rank>.<step>    StepMetrics    trainer -> gate (progress), stall watch, audit, chaos
    loss.<channel>           LossRecord     every work-queue worker -> audit, status
    trainer.rendezvous       Rendezvous     fsdp rank 0 -> the other ranks
    <worker> (members bucket) Member        every worker (heartbeat) -> status, stall, chaos

Records written before these models existed still read: a drop record was its reason as plain
text, a refused prompt's starting with "rollout: " (`DropRecord.decode`); the others' stored
forms are unchanged.

This module knows nothing of NATS.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError


class KvRecord(BaseModel):
    """A KV value: immutable, an unknown field an error. Stored as its JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes | None) -> Self:
        """The record stored as `data`; ValueError (a pydantic ValidationError) if it is not one."""
        return cls.model_validate_json(data or b"")


class DropRecord(KvRecord):
    """A group the buffer dropped, or a prompt the rollout refused; the gate replaces each once."""

    reason: str
    """Why, in words ("" for a record stored without one)."""
    refused: bool = False
    """The rollout refused the prompt itself (it can never be generated: untokenizable, too long
    for the model), not a group dropped for its samples; the gate stops a run that mostly
    refuses."""

    LEGACY_REFUSED: ClassVar[str] = "rollout: "
    """How an old plain-text record's reason started when the rollout refused the prompt."""

    @classmethod
    def decode(cls, data: bytes | None) -> DropRecord:
        """The record, from its JSON or from the plain-text reason stored before (undecodable
        bytes replaced: an old record's reason is shown, not refused)."""
        if data and data.lstrip().startswith(b"{"):
            try:
                return cls.model_validate_json(data)
            except ValidationError:
                pass  # an old reason that happens to start with "{": read as text
        text = (data or b"").decode(errors="replace")
        if text.startswith(cls.LEGACY_REFUSED):
            return cls(reason=text.removeprefix(cls.LEGACY_REFUSED), refused=True)
        return cls(reason=text)

    @property
    def text(self) -> str:
        """The record in one line as the audit and logs show it (a refusal: the rollout's)."""
        return f"rollout: {self.reason}" if self.refused else self.reason


STEP_FIELDS = (
    "step",
    "time",
    "train_seconds",
    "samples",
    "reward_mean",
    "staleness_max",
    "staleness_hist",
    "sample_ids",
    "kl_coef",
    "kl_reward",
)


class StepMetrics(KvRecord):
    """One trainer rank's numbers for one trained step (`consumers.trainer.step_metrics`).

    Stored flat, as one JSON object: the fields below, then the engine's own numbers (`trained`:
    loss, grad norm, ...) beside them; the KL fields only with the KL in the reward."""

    step: int
    time: float
    """Unix time the step was recorded."""
    train_seconds: float
    samples: int
    """Samples this rank trained in the step."""
    reward_mean: float
    """Their mean reward (NaN for a rank that trained none)."""
    staleness_max: int
    """The step minus the oldest version among the loss tokens (0 with none)."""
    staleness_hist: list[int]
    """Loss tokens by staleness (index: step - version)."""
    sample_ids: list[str]
    kl_coef: float | None = None
    """KL in the reward: the coefficient the buffer penalised the step with."""
    kl_reward: float | None = None
    """KL in the reward: the KL the buffer measured."""
    trained: dict[str, float] = {}
    """The engine's numbers for the step (loss, grad_norm, ...), by name."""

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> StepMetrics:
        """From the flat form: the named fields, every other key one of the engine's numbers."""
        named = {k: v for k, v in flat.items() if k in STEP_FIELDS}
        return cls(**named, trained={k: v for k, v in flat.items() if k not in STEP_FIELDS})

    def flat(self) -> dict[str, Any]:
        """The flat form: what is stored, and what the producer's report and loggers read."""
        # The KL pair only with the KL in the reward (a coefficient), as the trainer writes it.
        no_kl = {"kl_coef", "kl_reward"} if self.kl_coef is None else set()
        return {**self.model_dump(exclude={"trained", *no_kl}), **self.trained}

    def encode(self) -> bytes:
        return json.dumps(self.flat()).encode()  # NaN as json writes it: a rank with no samples

    @classmethod
    def decode(cls, data: bytes | None) -> StepMetrics:
        try:
            flat = json.loads(data or b"")
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a step's metrics: {exc}") from None
        if not isinstance(flat, dict):  # decode's contract: ValueError for what is not a record
            raise ValueError(f"not a step's metrics: {type(flat).__name__}")  # noqa: TRY004
        return cls.from_flat(flat)


class LossRecord(KvRecord):
    """The most messages of one work queue's stream a worker has seen deleted unacked (`bus.loss`).
    Stored as the count in decimal text, as it always was."""

    count: int

    def encode(self) -> bytes:
        return str(self.count).encode()

    @classmethod
    def decode(cls, data: bytes | None) -> LossRecord:
        return cls(count=int(data or b"0"))


class Rendezvous(KvRecord):
    """fsdp rank 0's announcement: where its store listens, the world size, and the generation
    (a new one each time rank 0 starts) that the other ranks join."""

    host: str
    port: int
    world_size: int
    generation: str


class Member(KvRecord):
    """One live worker process, as its heartbeat entry in the members bucket says
    (`bus.membership`)."""

    role: str
    """What it runs: rollout, reward, buffer, trainer, producer."""
    node: str
    """Hostname it runs on."""
    pid: int
    """Its process id on that node."""
    engine: str = ""
    """Engine it drives (hf, torch, vllm, ...); empty for roles without one."""
    weight_version: int | None = None
    """Rollout: the weight version it serves. Trainer: its optimizer step. None for other roles."""
    started_at: float
    """Unix time it joined the run."""
    updated_at: float
    """Unix time of its latest heartbeat."""
