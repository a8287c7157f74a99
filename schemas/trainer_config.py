"""`trainer`: the train engine, its ranks and parallel sizes, checkpoints and loggers.

A section of `schemas.config.RunConfig`; `trainer.ranks` is how many trainer processes the run
has (data parallel x tensor parallel). `trainer.engine` is one section per engine type, told
apart by its `type` (a discriminated union): `{type: megatron, tensor_parallel_size: 2}`, or
the bare type, `fsdp`, for its defaults. `engines.build.build_train_engine` takes that section.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from schemas.section import Section, engine_section


class TorchEngineConfig(Section):
    """`trainer.engine: torch`: one process, CPU or one GPU (`engines.torch_train`); it holds a
    value model for `algorithm.advantage: gae`, as fsdp does. No settings of its own."""

    type: Literal["torch"] = "torch"
    """`torch` picks this engine's section."""
    grouped: ClassVar[bool] = False
    """Whether its ranks always meet in a process group, even a group of one."""

    @property
    def copy_size(self) -> int:
        """Ranks holding one model copy."""
        return 1


class FSDPEngineConfig(Section):
    """`trainer.engine: fsdp`: FSDP2, one process per rank, `dp_size` ranks that shard the model
    and take each optimizer step together (`engines.fsdp_train`); with `algorithm.advantage:
    gae` its value model is sharded alike (`engines.fsdp_critic`). No settings of its own."""

    type: Literal["fsdp"] = "fsdp"
    """`fsdp` picks this engine's section."""
    grouped: ClassVar[bool] = True
    """FSDP2 needs a process group, even of one rank."""

    @property
    def copy_size(self) -> int:
        return 1


class MegatronConfig(Section):
    """`trainer.engine: {type: megatron, ...}`: megatron-core's GPTModel (`pip install
    'jetrl[megatron]'`; ran on one GPU at TP = PP = 1 only) and how it cuts the model
    (`engines.megatron_train`)."""

    type: Literal["megatron"] = "megatron"
    """`megatron` picks this engine's section."""
    grouped: ClassVar[bool] = False
    """Alone at tensor and pipeline parallel 1; above, its ranks meet as fsdp ranks do."""

    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks one model copy's layers are split over (megatron's tensor parallelism: attention by
    query groups, MLP by columns and rows, the vocabulary by slices). Must divide the model's
    num_key_value_heads and intermediate_size. The trainer then runs tp x pp ranks (`--rank 0
    .. tp*pp-1`, the local job starts them), which meet as fsdp ranks do and all read
    `batches.0`."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Pipeline stages one model copy's layers are split over (consecutive layers per stage, the
    embedding on the first, the final norm and output layer on the last; megatron's 1F1B
    schedule over the step's micro-batches). Must divide num_hidden_layers. Each stage is
    `tensor_parallel_size` ranks."""

    @property
    def copy_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class SimulatedTrainConfig(Section):
    """`trainer.engine: simulated`, for scheduling studies (with `rollout.engine: simulated`):
    the torch engine's process, model, checkpoints and weight versions, with no optimizer step
    computed. A step only counts its version (the weights stay as loaded) and costs
    `trainer.simulated_seconds_per_token` a token it trained, whatever the model. `ops.bench.scale`
    uses it: one trainer process stands for a data-parallel trainer that grows with the fleet,
    so its step must not grow with the batch as a real step on this machine's cores does
    (`engines.simulated_train`). No settings of its own."""

    type: Literal["simulated"] = "simulated"
    """`simulated` picks this engine's section."""
    grouped: ClassVar[bool] = False
    """One process, as torch."""

    @property
    def copy_size(self) -> int:
        return 1


TrainEngineConfig = Annotated[
    TorchEngineConfig | FSDPEngineConfig | MegatronConfig | SimulatedTrainConfig,
    Field(discriminator="type"),
]
"""`trainer.engine`: the section of the engine its `type` names."""


class TrainerConfig(Section):
    steps: int = Field(60, ge=1)
    """Optimizer steps in the run."""
    sync_every: int = Field(1, ge=1)
    """Publish weights every this many steps."""
    checkpoint_every: int = Field(10, ge=1)
    """Checkpoint model, optimizer, RNG and last batch every this many steps."""
    engine: TrainEngineConfig = TorchEngineConfig()
    """The train engine and its settings, by `type`: torch (one process, CPU or one GPU), fsdp
    (FSDP2, one process per rank, `dp_size` ranks that shard the model and take each optimizer
    step together), megatron (megatron-core's GPTModel, with its parallel sizes; `pip install
    'jetrl[megatron]'`; ran on one GPU at TP = PP = 1 only) or simulated (no step computed: for
    scheduling studies beside `rollout.engine: simulated`). A bare type (`engine: fsdp`) takes
    its defaults."""
    dp_size: int = Field(1, ge=1)
    """Data-parallel trainer ranks (`--rank 0 .. dp_size-1`); the buffer balances each step's tokens
    across them on `batches.<rank>`. More than 1 needs engine fsdp."""
    dist_init: Literal["kv", "env"] = "kv"
    """How the fsdp ranks find each other. kv: rank 0 listens on a free port and publishes its
    address in the run's KV (`trainer.rendezvous`), the others read it (workers need only --run
    and --nats). env: torchrun's variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)."""
    dist_host: str | None = None
    """kv: the address rank 0 listens on and publishes; None: its address on the route to the
    NATS server (127.0.0.1 when NATS is on loopback)."""
    dist_timeout: float = Field(300.0, gt=0)
    """Seconds an fsdp rank waits in one collective, or for its peers at the rendezvous, before it
    fails (exit 1, and the fleet restarts it): a rank that died never leaves the others hanging."""
    micro_batch_tokens: int = Field(4096, ge=64)
    """Most tokens (rows x padded length) in one micro-batch."""
    logprob_chunk_tokens: int = Field(1024, ge=0)
    """Positions the trainer projects onto the vocabulary at once when it takes log-probs and
    entropy from the final hidden states (`engines.algorithms.logprobs`): the [B, T, V] logits
    are never held, only chunk x V at a time (forward and backward). 0: the model's full
    logits. The megatron engine at pipeline parallel takes the full logits whatever this says."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward instead of keeping them: the
    activation memory of one block rather than of every block, for about one more forward
    pass of compute. torch and fsdp engines: the HF model's gradient checkpointing per block
    (non-reentrant); megatron: `recompute_granularity: full`, one layer at a time."""
    offload_optimizer: bool = False
    """`placement: colocated`: the optimizer state (AdamW's two moments, 2x the float32
    weights) leaves the device at the end of each of the trainer's turns, after the step's
    checkpoint, and comes back at the start of the next, before it trains
    (`engines.release.Offload`: to host memory on a GPU; on the CPU to an unlinked file, out
    of the process), so the rollout engine's turn has that memory too, for a copy each way per
    step. verl's `optimizer_offload`. Refused unless colocated: separated, the trainer never
    gives its device back."""
    seed: int = 0
    """Trainer seed (torch, numpy, python)."""
    checkpoint_dir: str = ""
    """Where rank checkpoints go; empty means runs/<run>/checkpoints under the producer's
    directory."""
    wandb_project: str | None = None
    """Rank 0 logs each step's metrics to this Weights & Biases project
    (needs `pip install wandb`)."""
    tensorboard_dir: str | None = None
    """Rank 0 writes each step's metrics as TensorBoard scalars here
    (needs `pip install tensorboard`)."""
    simulated_seconds_per_token: float = Field(0.0, ge=0)
    """For scheduling studies (with `rollout.engine: simulated`): after each optimizer step,
    spend this many more seconds per token the step trained on this rank (attention-mask tokens,
    prompt and response), as a bigger model would; 0 adds nothing."""
    lend_after: float = Field(2.0, gt=0)
    """With `lend: true`: seconds the trainer waits for its next step's batches before it lends
    its device to rollout (`consumers.lending`). Shorter lends sooner, and pays the engine's
    wake and sleep for shorter stretches of work."""
    stall_after: float = Field(30.0, gt=0)
    """Seconds with no completed step after which the run counts as stalled: the producer's progress
    line, its log and `ops.status` then name the stage that holds the work and why
    (`producers.stall`)."""

    @field_validator("engine", mode="before")
    @classmethod
    def _engine(cls, value: object) -> object:
        return engine_section(value)

    @model_validator(mode="after")
    def _ranks_need_fsdp(self) -> TrainerConfig:
        if self.dp_size > 1 and self.engine.type != "fsdp":
            raise ValueError(
                f"dp_size {self.dp_size} needs engine fsdp: the {self.engine.type} engine has no "
                "gradient all-reduce, so each rank would train its own diverging copy"
            )
        return self

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks per pipeline stage: megatron's, else 1."""
        return self.engine.tensor_parallel_size if isinstance(self.engine, MegatronConfig) else 1

    @property
    def copy_size(self) -> int:
        """Ranks holding one model copy: megatron's tensor x pipeline parallel sizes, else 1."""
        return self.engine.copy_size

    @property
    def ranks(self) -> int:
        """Trainer processes of the run: dp_size x copy_size (`--rank 0 .. ranks-1`). Rank k reads
        `batches.<k // copy_size>`; the ranks of one model copy read the same batches."""
        return self.dp_size * self.copy_size
