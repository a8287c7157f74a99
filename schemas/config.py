"""The run config: one YAML per run, validated by pydantic; every field documented.

The producer stores it in the run's KV bucket (key `config`) so that every worker of the
run, on any node, reads the same settings from `--run R --nats URL` alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from schemas.agent_config import AgentConfig
from schemas.algorithm_config import AlgorithmFamily
from schemas.events import SamplingParams
from schemas.model_config import ModelConfig
from schemas.names import check_run_id
from schemas.placement import Placement, colocation_refusal, lend_refusal, offload_refusal
from schemas.report_config import ReportConfig
from schemas.rollout_config import RolloutConfig
from schemas.section import Section
from schemas.staleness import StalenessPolicy, sync_mode_sections
from schemas.streams_config import StreamsConfig, stream_needs
from schemas.tools_config import ToolsConfig
from schemas.trainer_config import TrainerConfig
from schemas.weight_event import TransportName

S = TypeVar("S", bound=Section)


BUILT_IN_TASKS: tuple[str, ...] = ("digits", "copy", "increment", "reverse")
"""Single-turn generated tasks (`producers.tasks`)."""
AGENT_TASKS: tuple[str, ...] = ("calc",)
"""Multi-turn generated tasks with tools (`producers.agent_tasks`): chat prompts for the episodes
of the `agent` section."""


class DataConfig(Section):
    task: str | None = "digits"
    """Built-in generated task: digits, copy, increment, reverse (single-turn, producers.tasks)
    or calc (multi-turn, needs `agent`: producers.agent_tasks); ignored when `dataset` is
    set."""
    dataset: str | None = None
    """A .jsonl or .parquet file with a `prompt` or `messages` field plus task fields."""
    reward: str = "producers.tasks:score_digits"
    """Reward function as `module:function(response_text, task) -> float`."""
    epochs: int = Field(1000, ge=1)
    """Passes over the dataset (a built-in task is generated: its epoch is 10,000 prompts)."""
    seed: int = 0
    """Shuffle seed."""
    n: int = Field(8, ge=1, le=1024)
    """Samples per prompt (the GRPO group)."""
    sampling: SamplingParams = SamplingParams()
    """Sampling parameters for every prompt."""

    @field_validator("task")
    @classmethod
    def _task(cls, value: str | None) -> str | None:
        known = (*BUILT_IN_TASKS, *AGENT_TASKS)
        if value is not None and value not in known:
            raise ValueError(f"unknown built-in task {value!r}; choose from {sorted(known)}")
        return value


class AlgorithmConfig(AlgorithmFamily):
    """`algorithm`: the step's shape and staleness here; the estimator, loss and regularisers in
    `schemas.algorithm_config.AlgorithmFamily`."""

    prompts_per_step: int = Field(8, ge=1)
    """Groups (prompts) in one optimizer step."""
    max_staleness: int = Field(1, ge=0)
    """A sample trained at version v was generated with weights >= v - max_staleness."""
    drop_equal_reward_groups: bool = True
    """Dynamic sampling: drop groups whose rewards are all equal (zero advantage)."""
    max_regenerations: int | None = Field(10, ge=0)
    """Dynamic sampling's cap (verl's `max_num_gen_batches`, 10 in its DAPO recipe): once this
    many times `prompts_per_step` groups were dropped for equal rewards while one step forms, the
    buffer trains the groups that complete next although their rewards are equal (zero advantage
    under grpo) until that step is formed, rather than regenerate for ever when the model solves
    every prompt or none. 0: never drop an equal group; None: no cap (drop for ever)."""
    lr: float = Field(3e-4, gt=0)
    """AdamW learning rate."""
    clip_low: float = Field(0.2, ge=0)
    """PPO clip epsilon below 1."""
    clip_high: float = Field(0.28, ge=0)
    """PPO clip epsilon above 1 (clip-higher)."""
    tis_cap: float | None = Field(None, ge=1)
    """None: PPO ratio against the behaviour log-probs. A number: decoupled PPO against the
    trainer's own pre-step policy, each token weighted by min(pi_prox / pi_behaviour, cap)."""
    max_group_wait_steps: int | None = Field(None, ge=1)
    """The buffer drops a group still incomplete when more than this many steps have been formed
    since its first sample came (a sample of a prompt never issued, or whose other samples are
    lost, would otherwise be held for ever): a `drop.<prompt id>` KV record, so the gate issues
    a replacement, and its samples to `dead` with the reason. Steps, not seconds: while the
    pipeline is stalled no step forms and nothing is dropped. None: max_staleness + 1
    (`StalenessPolicy.group_wait_steps`). A group completed later than that would be dropped as
    stale anyway (its first sample was made by weights no newer than the step being formed when
    it came, or one past it while a half-stored step is re-formed), so this drops nothing that
    could train; a smaller number may drop a group that is only slow."""


class RewardConfig(Section):
    timeout: float = Field(5.0, gt=0)
    """Seconds one reward call may take before the sample is failed."""
    processes: int = Field(2, ge=1)
    """Reward worker pool size."""
    isolation: Literal["auto", "required", "off"] = "auto"
    """Namespaces around reward processes (no network, no other process's /proc, a private /tmp,
    the rest read-only, the interpreter's import paths kept readable wherever they are;
    consumers/reward_sandbox.py): `auto` uses them where `unshare` works and
    warns once where not, `required` refuses to start without them, `off` never tries."""
    batch: int = Field(16, ge=1)
    """Most trajectories scored in one round trip to a pool process (`consumers.reward_batch`):
    queued items travel together, each still under its own `timeout`; 1 scores one per trip."""
    max_failed_share: float = Field(0.5, gt=0, le=1)
    """The main job stops the run, naming the commonest failure, when more than this share of the
    samples of the last `failed_window_groups` groups finished failed the reward function (a bug
    in it fails every group, and the gate would replace each for ever)."""
    failed_window_groups: int = Field(32, ge=1)
    """Groups (dropped or trained, latest first) the `max_failed_share` is measured over. Before
    that many finished after the main job (re)started, the run stops as soon as the share is
    certain to be passed, the groups still to come counted as passing."""


class ReferenceConfig(Section):
    """`reference`: the stage between reward and buffer that scores each sampled response under the
    frozen initial model (`consumers.reference`), as verl's reference workers do."""

    enabled: bool = False
    """Run the stage: rewards go to it, and the buffer reads the `scored` stream it writes (each
    sample with its reference log-probs) instead of `rewards`; the trainer then holds no reference
    copy of its own. False: with a KL in the loss, the trainer scores the reference itself."""
    workers: int = Field(1, ge=1)
    """Reference processes the one-machine job's fleet starts
    (a cluster's fleet YAML says its own)."""
    concurrency: int = Field(8, ge=1)
    """Samples one reference worker holds at once; those waiting together share one forward pass."""
    batch: int = Field(8, ge=1)
    """Most samples in one forward pass of the reference model (right-padded together)."""


MIB = 1 << 20


class CollectiveConfig(Section):
    """`weights.collective`: the broadcast from the trainer ranks, each its own tensors, rank 0
    coordinating (`engines.collective.CollectiveSettings`)."""

    backend: Literal["gloo", "nccl"] = "gloo"
    """`gloo` (CPU; CI) or `nccl` (GPUs: one per rank, buckets on `device`)."""
    device: str = "cpu"
    """Where buckets and a receiver's staging buffer live: `cpu` for gloo, `cuda:N` for nccl."""
    bucket_mib: int = Field(64, ge=1)
    """MiB per broadcast; the trainer holds two buckets, a worker one buffer of the version's
    size."""
    op_timeout_s: float = Field(30.0, gt=0)
    """Longest one bucket's broadcast may take before the attempt fails and the group is rebuilt
    without the stalled member."""
    join_timeout_s: float = Field(30.0, gt=0)
    """How long the trainer waits for workers to check in to a version, and a worker for the
    trainer's plan; also what a dead worker still listed as a member costs each version."""
    max_attempts: int = Field(3, ge=1)
    """Attempts per version (each failure rebuilds the group) before the trainer gives up on it;
    workers then catch up from the fallback copy."""
    host: str = "127.0.0.1"
    """Address trainer rank 0's rendezvous store listens on and announces (one every rollout
    worker and trainer rank reaches: the trainer node's address on a cluster)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the rendezvous store; 0: any free port (announced in each weights event)."""

    @model_validator(mode="after")
    def _device(self) -> CollectiveConfig:
        if (self.backend == "nccl") != self.device.startswith("cuda"):
            raise ValueError(
                f"backend {self.backend} with device {self.device!r}: nccl needs cuda:N, gloo cpu"
            )
        return self


class WeightsConfig(Section):
    transport: TransportName = "object_store"
    """How weight bytes go from the trainer to the rollout workers (the `WeightVersionEvent` on
    `weights` says where each version is): `object_store`, the run's JetStream object store,
    streamed in chunks (models up to about 1 GB); `filesystem`, a safetensors file per version
    under `dir`, on a node-local or shared filesystem, read with mmap (any size);
    `collective`, a torch.distributed broadcast from the trainer ranks (`collective`), every
    version also stored through `fallback` for workers that miss it."""
    fallback: Literal["object_store", "filesystem"] = "object_store"
    """collective: where every version is also stored, for a worker that joined late or missed
    a broadcast (it fetches the version there)."""
    collective: CollectiveConfig = CollectiveConfig()
    """collective: the broadcast's settings."""
    dir: str = ""
    """filesystem: the directory versions are written under,
    as `<dir>/<run>/v<version>-<token>.safetensors`; the trainer and every rollout worker of the run
    must see it at the same path. Empty: `weights` in the producer's run directory (filled in by the
    producer, like `trainer.checkpoint_dir`); a relative path is made absolute by the producer."""
    chunk_mib: int = Field(2, ge=1, le=64)
    """object_store: chunk size in MiB, capped at the server's max payload (8 MiB on the embedded
    server, 1 MiB on a default nats-server). Measured on 2 cores: reads run at the same speed from
    1 to 8 MiB, writes of 8 MiB chunks at about half the speed of 1-2 MiB ones (each chunk's
    publish waits for the server to store it)."""
    keep: int = Field(3, ge=2)
    """Most versions kept in the object store or the directory: after each publish, that version
    and the `keep - 1` written just before it; the rest are deleted. Once the version is
    announced, the trainer also deletes every older one no live rollout worker needs
    (`engines.weight_retention`: the latest delta chain, and a lagging worker's next version
    within the staleness bound), so with workers that keep up one version (one chain) stays.
    A worker still reading a deleted file keeps its open mapping; one that reaches a deleted
    version skips it, since a newer one is announced by then: at least 2, so that what a
    publish deletes is older than a version already announced (see docs/weights.md)."""
    stall_seconds: float = Field(10.0, gt=0)
    """object_store: a fetch with no chunk arriving for this long gives up (the worker keeps its
    weights; the next version is fetched when it comes)."""
    delta: bool = False
    """Publish delta versions: per tensor only the elements whose bits changed since the version
    published before (`engines.weight_delta`), with a full version every `full_every` versions and
    at every trainer start. Rollout workers keep a CPU copy of the version they serve to apply
    deltas onto; one without the base pulls the chain's full version first (docs/weights.md)."""
    full_every: int = Field(8, ge=1)
    """With `delta`: versions per chain, its full version included (1: every version full). A
    worker that joins late fetches the chain's full version and at most `full_every - 1` deltas;
    the store keeps the whole current chain besides the `keep` versions written last."""

    @model_validator(mode="after")
    def _delta_moves_bytes(self) -> WeightsConfig:
        if self.delta and self.transport == "collective":
            raise ValueError(
                "delta versions go through object_store or filesystem; "
                "collective broadcasts full versions"
            )
        return self

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_mib * MIB


class RunConfig(Section):
    run: str = "demo"
    """Run id: names every stream, subject and bucket of the run."""
    mode: Literal["async", "sync"] = "async"
    """async: rollout runs ahead of the trainer by up to `algorithm.max_staleness` versions.
    sync: strictly on-policy, the synchronous baseline in the same stages: the gate admits step
    s's prompts only once version s (the update of step s - 1) is published, and the buffer forms
    step s only from samples every token of which version s generated. That is exactly
    `algorithm.max_staleness: 0` with `trainer.sync_every: 1`, which sync sets (left unset) or
    requires (set to anything else is refused)."""
    placement: Placement = "separated"
    """separated: the rollout engine and the trainer on devices of their own. colocated: a
    node's rollout engine and trainer share its device, in phases (generate; the engine gives
    its memory back; train and publish; the engine takes it again), verl's hybrid engine with
    `mode: sync`. With `mode: async` the next rollout still starts only once the trainer has
    released the device: generation overlaps training only across nodes (on one node the
    bound hides the stages that need no device: reward, buffer, the gate). For now: a rollout
    engine on one device (vllm and sglang at tensor-parallel size 1; their release calls have
    not run on a GPU yet, docs/engines.md), the torch trainer at dp_size 1, one engine copy,
    batch (not continuous) admission, no agent (`schemas.placement`). The trainer's optimizer
    state may leave the device between its turns too: `trainer.offload_optimizer`."""
    lend: bool = False
    """Lent capacity (dynamic scheduling, `placement: separated`): a trainer that has waited
    for its next batch longer than `trainer.lend_after` seconds generates rollout on its own
    device, as one more rollout worker (the prompts' durable consumer, every sample stored,
    traced and staleness-checked as any other), with the weights it last published, until its
    batch comes; then it stops between two tokens and gives the engine's memory back
    (`consumers.lending`). For now: the simulated rollout engine, the torch trainer at
    dp_size 1, no agent (`schemas.placement`)."""
    model: ModelConfig = ModelConfig()
    """The policy model: a local or hub checkpoint, or the built-in tiny model, and its dtype."""
    data: DataConfig = DataConfig()
    """The prompts (a built-in task or a dataset file), the reward function, samples per prompt
    and sampling."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """The step's shape, the staleness bound, the advantage estimator, loss and regularisers."""
    trainer: TrainerConfig = TrainerConfig()
    """The train engine, its ranks, checkpoints and loggers."""
    rollout: RolloutConfig = RolloutConfig()
    """The rollout engine and how a rollout worker feeds it."""
    reward: RewardConfig = RewardConfig()
    """The reward workers' process pool, timeout and isolation."""
    agent: AgentConfig | None = None
    """Multi-turn episodes with tools (`consumers.episodes`): the environment, the tools, the
    turn and token budgets. None: single-turn samples."""
    tools: ToolsConfig = ToolsConfig()
    """Agent tool calls: their sandbox, time limit and caps (`consumers.tool_runner`)."""
    reference: ReferenceConfig = ReferenceConfig()
    """The optional reference stage (reference log-probs for a KL)."""
    weights: WeightsConfig = WeightsConfig()
    """How weight versions go from the trainer to the rollout workers."""
    report: ReportConfig = ReportConfig()
    """What the main job writes to the run directory besides metrics and plots (`samples.jsonl`)."""
    streams: StreamsConfig = StreamsConfig()
    """Stream limits derived from the run's bounds, overrides, age limit,
    loss guard (`schemas.streams_config`)."""

    @property
    def staleness(self) -> StalenessPolicy:
        """The staleness bound and every decision it makes (`schemas.staleness`). Built on each
        read (a few fields), not cached: `model_copy(update=...)` would carry a cached one over."""
        return StalenessPolicy.of(self)

    @field_validator("run")
    @classmethod
    def _run(cls, value: str) -> str:
        return check_run_id(value)

    @model_validator(mode="before")
    @classmethod
    def _sync_is_on_policy(cls, data: object) -> object:
        """mode sync: the bound 0 and a version every step (`staleness.sync_mode_sections`)."""
        if not isinstance(data, dict) or data.get("mode") != "sync":
            return data
        algorithm, trainer = (
            # The keys set, their values as they are: a dump would turn a nested engine section
            # whose `type` was left at its default into a dict without the tag.
            (
                {name: getattr(section, name) for name in section.model_fields_set}
                if isinstance(section, BaseModel)
                else dict(section or {})
            )
            for section in (data.get("algorithm"), data.get("trainer"))
        )
        sync_mode_sections(algorithm, trainer)
        return {**data, "algorithm": algorithm, "trainer": trainer}

    @model_validator(mode="after")
    def _can_progress(self) -> RunConfig:
        """Refuse settings under which a run would stall with no error."""
        sync, staleness = self.trainer.sync_every, self.staleness
        ahead = staleness.steps_ahead
        if not staleness.versions_in_time(sync):
            # The gate admits step s's prompts only once weights v >= s - bound are published;
            # with versions published every sync_every steps that never happens.
            raise ValueError(
                f"trainer.sync_every {sync} > algorithm.max_staleness + 1 = {ahead}: "
                "the gate would wait for weights that are never published and the run would "
                "stall; raise max_staleness or sync more often"
            )
        rows = self.algorithm.prompts_per_step * self.data.n
        if self.trainer.dp_size > rows:
            # A rank with no row gets no batch event for the step and would wait for it forever.
            raise ValueError(
                f"trainer.dp_size {self.trainer.dp_size} > the {rows} rows of a step "
                "(algorithm.prompts_per_step x data.n): some rank would get nothing to train"
            )
        algo, max_tokens = self.algorithm, self.data.sampling.max_tokens
        if algo.advantage == "passk" and algo.passk_k > self.data.n:
            raise ValueError(
                f"algorithm.passk_k {algo.passk_k} > data.n {self.data.n}: a group has no k-subset"
            )
        if algo.overlong_buffer_tokens >= max_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer_tokens {algo.overlong_buffer_tokens} must be below "
                f"data.sampling.max_tokens {max_tokens}"
            )
        if algo.kl_placement == "reward" and not self.reference.enabled:
            raise ValueError(
                "algorithm.kl_placement reward needs reference.enabled: "
                "the buffer takes the reference log-probs from the reference stage"
            )
        if self.trainer.engine.type == "simulated" and self.rollout.engine.type != "simulated":
            raise ValueError(
                "trainer.engine simulated computes no step (for scheduling studies): it needs "
                f"rollout.engine simulated, not {self.rollout.engine.type}"
            )
        if algo.advantage == "gae" and self.trainer.engine.type == "megatron":
            raise ValueError(
                "algorithm.advantage gae needs trainer.engine torch or fsdp: "
                "the megatron engine holds no value model (critic)"
            )
        if algo.advantage == "gae" and self.data.n == 1 and algo.drop_equal_reward_groups:
            raise ValueError(
                "algorithm.advantage gae with data.n 1 needs algorithm.drop_equal_reward_groups "
                "false: a group of one sample always has equal rewards, so every group would be "
                "dropped"
            )
        if self.data.n < 2 and algo.advantage != "gae":
            raise ValueError(
                f"data.n {self.data.n}: group-relative advantages need at least 2 samples per "
                "prompt (a group of 1 has no baseline)"
            )
        if self.rollout.engine.type == "vllm" and self.data.sampling.top_p < 1:
            # vLLM's processed log-probs are renormalised over the nucleus; the trainer's are not.
            raise ValueError(
                f"rollout.engine vllm needs data.sampling.top_p 1, not {self.data.sampling.top_p}: "
                "its log-probs are renormalised over the top-p nucleus and would not match the "
                "trainer's; use engine hf or sglang for top_p < 1"
            )
        if self.data.dataset is None and self.data.task in AGENT_TASKS and self.agent is None:
            raise ValueError(
                f"data.task {self.data.task} is a multi-turn task with tools: it needs an agent "
                "section (e.g. agent: {tools: [producers.agent_tools:calculator]}; "
                "examples/agent_calc.yaml)"
            )
        if self.agent is not None and self.agent.turn_rewards:
            if algo.advantage != "gae" or self.agent.environment is None:
                raise ValueError(
                    "agent.turn_rewards needs algorithm.advantage gae and an agent.environment: "
                    "per-turn credit needs a per-token value baseline, and only an environment's "
                    f"step rewards a turn (advantage {algo.advantage}, environment "
                    f"{self.agent.environment})"
                )
        warm = self.model.warm_start
        if (
            warm
            and warm.dataset is None
            and (self.data.dataset or self.data.task not in AGENT_TASKS)
        ):
            raise ValueError(
                "model.warm_start.dataset: none given, and only a built-in agent task "
                f"({', '.join(AGENT_TASKS)}) has generated demonstrations: name a .jsonl of them"
            )
        if refusal := colocation_refusal(self) or lend_refusal(self) or offload_refusal(self):
            raise ValueError(refusal)
        stream_needs(self)  # an override below a stream's need: refused, with the derivation
        return self


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line naming the key."""


def validate(model: type[S], data: object, origin: str) -> S:
    """`model` from parsed YAML, or a ConfigError naming the first bad key."""
    try:
        return model.model_validate(data if data is not None else {})
    except ValidationError as exc:
        first = exc.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        if not first["loc"]:  # a check across sections: its message names the keys
            raise ConfigError(f"{origin}: {message}") from None
        key, tag = yaml_key(model, first["loc"])
        raise ConfigError(f"{origin}: {key}: {message}{f' (type {tag})' if tag else ''}") from None


def yaml_key(model: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[str, str | None]:
    """The dotted key of an error's `loc` as the YAML spells it, and the engine type it is in.

    Pydantic puts the tag of a discriminated union's member in the location
    (`rollout.engine.vllm.max_model_len`), where the YAML has none (`rollout.engine.max_model_len`
    under `type: vllm`): it is taken out and returned apart."""
    parts: list[str] = []
    tag: str | None = None
    current: type[BaseModel] | None = model
    rest = iter(loc)
    for part in rest:
        parts.append(str(part))
        field = current.model_fields.get(str(part)) if current is not None else None
        current = None
        if field is None:
            continue
        if field.discriminator is not None:
            member = next(rest, None)  # the tag pydantic names the union's member by
            tag = None if member is None else str(member)
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            current = field.annotation
    return ".".join(parts), tag


def read_yaml(path: Path) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read YAML: {' '.join(str(exc).split())}") from None


def parse_config(data: object, origin: str = "config") -> RunConfig:
    return validate(RunConfig, data, origin)


def load_config(path: Path) -> RunConfig:
    return parse_config(read_yaml(path), str(path))
