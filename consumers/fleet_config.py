"""What a node's fleet runs: the roles, their processes, devices, arguments, environment, and
the restart policy (the YAML given to `python -m consumers.fleet --config`)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from pydantic import Field, field_validator, model_validator

from schemas.config import Section, read_yaml, validate
from schemas.names import check_run_id
from schemas.section import refuse_renamed

ROLES = ("trainer", "buffer", "reference", "reward", "rollout")
"""The workers of a run, in the order the local job starts them (`reference` only with
`reference.enabled`)."""


class RestartPolicy(Section):
    """When a crashed worker is started again, and when the fleet stops trying."""

    max_restarts: int = Field(default=5, ge=0)
    """Restarts allowed inside `window`; a worker that needs one more is given up on."""
    window: float = Field(default=300.0, gt=0)
    """Seconds over which restarts are counted."""
    backoff: float = Field(default=1.0, gt=0)
    """Seconds before a restart, doubled for every other restart inside the window."""
    max_backoff: float = Field(default=60.0, gt=0)
    """Longest wait before a restart."""


class RoleConfig(Section):
    """The processes of one role on this node."""

    processes: int = Field(default=1, ge=1)
    """Processes of this role (`replicas` before, refused now: `replicas` means the streams'
    replicas, `--replicas`). A trainer runs one rank each: give each rank its own role
    entry (`module: consumers.trainer`, `args: ["--rank", "K"]`)."""
    module: str | None = None
    """Module run with `python -m`; default `consumers.<role name>`."""
    devices: list[int | str] = []
    """GPUs handed out round-robin as CUDA_VISIBLE_DEVICES: process i gets devices[i % len].
    An entry may name several ("0,1"). Empty: the variable is inherited unchanged.
    Ignored by `ops.ray`, where Ray picks each process's GPUs (see `num_gpus`)."""
    num_cpus: float = Field(default=1.0, ge=0)
    """CPUs one process needs; `ops.ray` places it on a node with that many free (unused here)."""
    num_gpus: float = Field(default=0.0, ge=0)
    """GPUs one process needs; `ops.ray` places it on a node with that many free and sets its
    CUDA_VISIBLE_DEVICES (a fraction shares a GPU). Unused by this fleet: see `devices`."""
    device: str | None = Field(default=None, pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where every process computes: auto, cpu, cuda or cuda:N, passed as JETRL_DEVICE
    (`engines.device`). None: auto, the first GPU CUDA_VISIBLE_DEVICES leaves it, else the CPU."""
    args: list[str] = []
    """Extra command-line arguments of every process."""
    env: dict[str, str] = {}
    """Extra environment variables of every process."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        return refuse_renamed(data, {"replicas": "processes"})


class FleetConfig(Section):
    """One node's fleet (the YAML given to `--config`)."""

    run: str | None = None
    """Run id the workers join; --run overrides it, and one of the two is required."""
    nats: str | None = None
    """NATS URL(s), comma separated; --nats overrides it; default $JETRL_NATS_URL, then nats://127.0.0.1:4222."""
    roles: dict[str, RoleConfig] = Field(min_length=1)
    """Workers by role name: rollout, reward, buffer, trainer, or any name that sets `module`."""
    logs: Path = Path("logs")
    """Directory of the worker logs, `<role>-<index>.log`, appended to across restarts."""
    restart: RestartPolicy = RestartPolicy()
    """Restart backoff and give-up limit."""
    stop_timeout: float = Field(default=30.0, gt=0)
    """Seconds the workers get to drain after SIGTERM before they are SIGKILLed."""

    @field_validator("run")
    @classmethod
    def _run(cls, value: str | None) -> str | None:
        return None if value is None else check_run_id(value)

    @field_validator("roles")
    @classmethod
    def _roles(cls, roles: dict[str, RoleConfig]) -> dict[str, RoleConfig]:
        for name, role in roles.items():
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
                raise ValueError(
                    f"role name {name!r} must be letters, digits, '_' or '-' (it names log files)"
                )
            module = role.module or f"consumers.{name}"
            if not _importable(module):
                raise ValueError(
                    f"role {name!r}: no module {module} (roles are {', '.join(ROLES)}, "
                    "or set `module`)"
                )
        return roles


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def load_fleet(path: Path) -> FleetConfig:
    """The fleet YAML at `path`, or a one-line ConfigError naming the bad key."""
    return validate(FleetConfig, read_yaml(path), str(path))


def local_fleet(logs: Path, trainer_ranks: int = 1, reference_workers: int = 0) -> FleetConfig:
    """The one-machine job's fleet: one worker of each role, `reference_workers` reference
    workers (`reference.workers` when the run has the stage, else none), and a trainer process
    per rank (`trainer.ranks`: data parallel x tensor parallel; `trainer` is rank 0,
    `trainer-rank<K>` runs `--rank K`)."""
    roles = {role: RoleConfig() for role in ROLES if role != "reference"}
    if reference_workers:
        roles["reference"] = RoleConfig(processes=reference_workers)
    for rank in range(1, trainer_ranks):
        roles[f"trainer-rank{rank}"] = RoleConfig(
            module="consumers.trainer", args=["--rank", str(rank)]
        )
    return FleetConfig(roles=roles, logs=logs)


def worker_name(role: str, index: int) -> str:
    """A worker's name in its fleet, `<role>-<index>`; also its log file's stem."""
    return f"{role}-{index}"
