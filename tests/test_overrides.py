"""KEY.PATH=VALUE overrides (`schemas.overrides`) and `--dry-run` on the entry points that take
a config, `producers.prompts` and `consumers.fleet` (and `ops.ray`, overrides only): the value
reaches the loaded config, an unknown key is refused in one line (exit 2), and a dry run prints
the resolved config and what it derives without starting anything. No server is needed:
nothing here connects."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bus.topology import Topology
from consumers.fleet_config import FleetConfig
from producers.prompts import parse, run_config
from schemas.config import ConfigError, RunConfig
from schemas.overrides import OverrideError, load_with_overrides
from schemas.rollout_config import SimulatedRolloutConfig, VLLMRolloutConfig
from schemas.trainer_config import MegatronConfig

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "examples" / "digits.yaml"
FLEET = ROOT / "examples" / "fleet.yaml"


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_override_values_reach_the_loaded_config() -> None:
    args = parse(
        [
            "--config",
            str(DIGITS),
            "algorithm.lr=1e-5",
            "--steps",
            "7",  # options and overrides may be mixed
            "algorithm.drop_equal_reward_groups=false",
            "model.path=/x",
            "data.sampling.stop_token_ids=[3, 4]",
            "streams.max_bytes.dead=2000000000",
        ]
    )
    cfg = run_config(args)
    assert cfg.algorithm.lr == 1e-5
    assert cfg.algorithm.drop_equal_reward_groups is False
    assert cfg.model.path == "/x"
    assert cfg.data.sampling.stop_token_ids == (3, 4)
    assert cfg.streams.max_bytes == {"dead": 2_000_000_000}
    assert cfg.trainer.steps == 7
    assert cfg.trainer.checkpoint_every == 50  # the file's keys not overridden stay


def test_without_a_config_file_overrides_apply_over_the_defaults() -> None:
    cfg = load_with_overrides(RunConfig, None, ["run=other", "data.n=4"])
    assert (cfg.run, cfg.data.n, cfg.algorithm.lr) == ("other", 4, RunConfig().algorithm.lr)


def test_engine_sections_take_a_bare_type_a_type_and_their_keys_in_any_order() -> None:
    bare = load_with_overrides(RunConfig, DIGITS, ["rollout.engine=simulated"])
    assert bare.rollout.engine == SimulatedRolloutConfig()
    # The key before the type: the type is applied first, the key lands in its section.
    keyed = load_with_overrides(
        RunConfig, DIGITS, ["rollout.engine.slots=9", "rollout.engine.type=simulated"]
    )
    assert keyed.rollout.engine == SimulatedRolloutConfig(slots=9)
    # Another engine keeps the keys the two share (slots) and drops the others (sigma).
    switched = load_with_overrides(
        RunConfig,
        DIGITS,
        ["rollout.engine={type: simulated, slots: 5, sigma: 0}", "rollout.engine.type=vllm"],
    )
    assert switched.rollout.engine == VLLMRolloutConfig(slots=5)
    megatron = load_with_overrides(
        RunConfig,
        DIGITS,
        ["trainer.engine.type=megatron", "trainer.engine.pipeline_parallel_size=2"],
    )
    assert megatron.trainer.engine == MegatronConfig(pipeline_parallel_size=2)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "trainer.stepz=3",
            "override 'trainer.stepz=3': unknown key trainer.stepz (nearest in trainer: steps)",
        ),
        ("trainer.lr=1e-5", "that name is at algorithm.lr, model.warm_start.lr"),
        ("rollout.engine.slots=2", "unknown key rollout.engine.slots (rollout.engine of type hf"),
        ("rollout.engine.type=tpu", "rollout.engine.type 'tpu' is not one of hf, simulated"),
        ("run.x=1", "run is a value, not a section"),
        ("trainer.steps", "expected KEY.PATH=VALUE"),
        ("trainer.steps=0", "with trainer.steps=0: trainer.steps: Input should be greater than"),
    ],
)
def test_a_bad_override_is_one_line_naming_it(override: str, message: str) -> None:
    with pytest.raises(OverrideError) as error:
        load_with_overrides(RunConfig, DIGITS, ["data.n=4", override])
    assert message in str(error.value) and "\n" not in str(error.value)
    assert "data.n=4" not in str(error.value)  # the override at fault, not every one


def test_the_file_is_checked_alone_first(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("trainer: {stepz: 3}\n")
    with pytest.raises(ConfigError) as error:
        load_with_overrides(RunConfig, path, ["trainer.steps=3"])
    assert not isinstance(error.value, OverrideError)  # the file's error: exit 1, as before
    assert str(error.value).startswith(f"{path}: trainer.stepz: Extra inputs")


@pytest.mark.parametrize(
    ("command", "line"),
    [
        (
            ["producers.prompts", "--config", str(DIGITS), "algorithm.max_stalenes=2"],
            "producers.prompts: override 'algorithm.max_stalenes=2': unknown key "
            "algorithm.max_stalenes (nearest in algorithm: max_staleness)",
        ),
        (
            ["consumers.fleet", "--config", str(FLEET), "roles.rollout.procs=2"],
            "consumers.fleet: override 'roles.rollout.procs=2': unknown key roles.rollout.procs "
            "(nearest in roles.rollout: processes)",
        ),
        (  # refused before Ray is imported: no `[ray]` extra needed
            ["ops.ray", "up", str(FLEET), "restart.max_restart=0"],
            "ops.ray: override 'restart.max_restart=0': unknown key restart.max_restart "
            "(nearest in restart: max_restarts)",
        ),
    ],
)
def test_cli_refuses_an_unknown_key_in_one_line_with_exit_2(command: list[str], line: str) -> None:
    done = cli(*command)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [line]  # one line, no traceback


def test_prompts_dry_run_prints_the_config_and_its_stream_limits_and_starts_nothing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    done = cli(
        "producers.prompts",
        "--config",
        str(DIGITS),
        "--dry-run",
        "--out",
        str(out),
        "trainer.steps=900",
        "rollout.engine=simulated",
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    config, derived = yaml.safe_load_all(done.stdout)
    cfg = RunConfig.model_validate(config)
    assert cfg.trainer.steps == 900 and cfg.rollout.engine.type == "simulated"
    topology = Topology.for_config(cfg)
    assert {name: s["max_bytes"] for name, s in derived["streams"].items()} == {
        topology.stream(channel): topology.max_bytes[channel.name] for channel in topology.channels
    }
    weights = derived["streams"]["RL_demo_WEIGHTS"]
    assert "901 versions" in weights["derivation"]  # derived from the overridden steps
    assert derived["work_queues"]["rollout"]["max_ack_pending"] == 1024
    assert not out.exists()  # no run directory, no built-in model, no server's store


def test_fleet_dry_run_prints_the_fleet_and_its_workers_and_starts_nothing(
    tmp_path: Path,
) -> None:
    logs = tmp_path / "logs"
    done = cli(
        "consumers.fleet",
        "--config",
        str(FLEET),
        "--dry-run",
        "roles.rollout.processes=3",
        f"logs={logs}",
        "--run",
        "dry",
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    config, derived = yaml.safe_load_all(done.stdout)
    assert FleetConfig.model_validate(config).roles["rollout"].processes == 3
    workers = derived["workers"]
    assert [name for name in workers if name.startswith("rollout")] == [
        "rollout-0",
        "rollout-1",
        "rollout-2",
    ]
    assert "-m consumers.rollout --run dry" in workers["rollout-2"]["command"]
    assert not logs.exists()  # no worker was started (a started one opens its log there)


@pytest.mark.parametrize("module", ["producers.prompts", "consumers.fleet", "ops.ray"])
def test_help_shows_the_override_syntax_and_points_to_the_reference(module: str) -> None:
    done = cli(module, "--help")
    assert "KEY.PATH=VALUE" in done.stdout and "docs/config.md" in done.stdout
