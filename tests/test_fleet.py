"""The fleet supervisor and worker membership, with real processes on a real nats-server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from bus.embedded import EmbeddedNats
from bus.topology import Topology
from consumers.fleet_config import FleetConfig, RestartPolicy, RoleConfig, load_fleet, local_fleet
from consumers.supervisor import Supervisor
from schemas.config import ConfigError
from tests.helpers import declare_run, members, wait_for

ROOT = Path(__file__).resolve().parent.parent
STAND_IN = "tests.fleet_proc"


def fleet_cli(config: dict, tmp_path: Path) -> subprocess.Popen[str]:
    """`python -m consumers.fleet` on `config`; no worker here talks to NATS,
    so the URL is unused."""
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump({"run": "fleet-test", "logs": str(tmp_path / "logs"), **config}))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "consumers.fleet",
            "--config",
            str(path),
            "--nats",
            "nats://127.0.0.1:1",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_killed_worker_is_restarted_and_membership_follows_it(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    # A short TTL: the killed worker's entry must expire within the test.
    topology = Topology(run=f"t{uuid.uuid4().hex[:10]}", member_ttl=2.0)
    declare_run(nats_server.url, topology)
    config = FleetConfig(
        roles={"buffer": RoleConfig()}, logs=tmp_path, restart=RestartPolicy(backoff=0.1)
    )
    fleet = Supervisor(config, topology.run, nats_server.url)
    fleet.start()
    try:
        first = fleet.pid("buffer-0")
        wait_for(
            lambda: (
                [(m.role, m.pid) for m in members(nats_server.url, topology)] == [("buffer", first)]
            ),
            30,
        )
        fleet.kill("buffer-0")

        def restarted() -> bool:
            fleet.poll()
            return fleet.pid("buffer-0") not in (None, first)

        wait_for(restarted)
        second = fleet.pid("buffer-0")
        # The new process joins; the killed one's entry expires with the TTL (nobody deleted it).
        wait_for(lambda: [m.pid for m in members(nats_server.url, topology)] == [second], 30)
    finally:
        fleet.stop()
    proc = fleet.children["buffer-0"].proc
    assert proc is not None and proc.returncode == 0  # SIGTERM: drained and exited cleanly
    assert members(nats_server.url, topology) == []  # a clean exit deletes its entry at once


def test_a_crashing_worker_is_given_up_on_and_a_finished_one_is_not_restarted(
    tmp_path: Path,
) -> None:
    fleet = fleet_cli(
        {
            "roles": {
                "crasher": {"module": STAND_IN, "args": ["--mode", "crash"]},
                "finisher": {"module": STAND_IN, "args": ["--mode", "done"]},
            },
            "restart": {"max_restarts": 2, "backoff": 0.05},
        },
        tmp_path,
    )
    _, log = fleet.communicate(timeout=30)
    assert fleet.returncode == 1, log
    assert "GAVE UP on crasher-0: exited with 3 after 2 restarts in 300s" in log
    assert "every worker has exited; gave up on crasher-0" in log
    assert log.count("crasher-0 started") == 3 and log.count("finisher-0 started") == 1
    assert "finisher-0 exited 0: done" in log


def test_sigterm_drains_every_worker_kills_stragglers_and_exits_zero(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    stand_in = {"module": STAND_IN, "args": ["--marker", str(markers), "--mode"]}
    fleet = fleet_cli(
        {
            "roles": {
                "drainer": {
                    **stand_in,
                    "processes": 2,
                    "devices": [0, 1],
                    "args": [*stand_in["args"], "drain"],
                },
                "stubborn": {**stand_in, "args": [*stand_in["args"], "stubborn"]},
            },
            "stop_timeout": 1,
        },
        tmp_path,
    )
    wait_for(lambda: len(list(markers.glob("*.ready"))) == 3, 20)
    ready = {int(p.stem): p.read_text() for p in markers.glob("*.ready")}
    fleet.send_signal(signal.SIGTERM)
    _, log = fleet.communicate(timeout=20)
    assert fleet.returncode == 0, log
    drained = {int(p.stem) for p in markers.glob("*.drained")}
    assert sorted(ready[pid] for pid in drained) == ["0", "1"]  # both drainers, one GPU each
    (stubborn,) = set(ready) - drained
    assert "stubborn-0 still running 1s after SIGTERM: SIGKILL" in log
    with pytest.raises(ProcessLookupError):
        os.kill(stubborn, 0)


def running(pid: int) -> bool:
    """Whether `pid` still runs: an exited process its new parent has not reaped yet is a
    zombie, which `kill(pid, 0)` would still find."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_workers_of_a_killed_fleet_get_sigterm_and_exit(tmp_path: Path) -> None:
    """A fleet killed with -9 cannot stop its workers: Linux must, or a restarted fleet would
    run beside the orphans of the last one."""
    markers = tmp_path / "markers"
    markers.mkdir()
    fleet = fleet_cli(
        {
            "roles": {
                "drainer": {
                    "module": STAND_IN,
                    "processes": 2,
                    "args": ["--marker", str(markers), "--mode", "drain"],
                }
            }
        },
        tmp_path,
    )
    pids: set[int] = set()
    try:
        wait_for(lambda: len(list(markers.glob("*.ready"))) == 2, 20)
        pids = {int(p.stem) for p in markers.glob("*.ready")}
        fleet.kill()
        fleet.communicate(timeout=10)
        deadline = time.monotonic() + 10
        while (left := {pid for pid in pids if running(pid)}) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"workers {sorted(left)} still run 10 s after their fleet was SIGKILLed"
        # They were told (SIGTERM) and drained, not merely gone.
        assert {int(p.stem) for p in markers.glob("*.drained")} == pids
    finally:
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("run: r\nroles: {rollout: {}}\nreplica: 2\n", "replica: Extra inputs are not permitted"),
        (
            "run: r\nroles: {rollout: {gpus: [0]}}\n",
            "roles.rollout.gpus: Extra inputs are not permitted",
        ),
        (
            "run: r\nroles: {rollout: {processes: 0}}\n",
            "roles.rollout.processes: Input should be greater",
        ),
        (
            "run: r\nroles: {rollout: {replicas: 2}}\n",
            "roles.rollout: replicas was renamed to processes: write processes: 2",
        ),
        (
            "run: r\nroles: {trainer: {device: gpu0}}\n",
            "roles.trainer.device: String should match pattern",
        ),
        ("run: r\nroles: {rollot: {}}\n", "roles: role 'rollot': no module consumers.rollot"),
        ("run: r\nroles: {x: {module: no.such}}\n", "roles: role 'x': no module no.such"),
        ("run: a.b\nroles: {}\n", "run: run id 'a.b' must be 1-64 characters"),
        ("run: r\n", "roles: Field required"),
        ("run: r\nroles: {}\n", "roles: Dictionary should have at least 1 item"),
    ],
)
def test_config_errors_are_one_line_naming_the_key(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_fleet(path)
    assert str(error.value).startswith(f"{path}: {message}") and "\n" not in str(error.value)


@pytest.mark.parametrize("name", ["fleet.yaml", "fleet-rollout.yaml"])
def test_the_example_fleets_are_valid(name: str) -> None:
    roles = load_fleet(ROOT / "examples" / name).roles
    assert roles["rollout"].num_gpus == 1 and roles["rollout"].num_cpus == 1  # placed by ops.ray


def test_cli_reports_a_config_error_in_one_line(tmp_path: Path) -> None:
    fleet = fleet_cli({"roles": {"rollout": {"processes": 1, "gpus": [0]}}}, tmp_path)
    _, err = fleet.communicate(timeout=30)
    assert fleet.returncode == 1
    assert err.strip().splitlines() == [
        f"consumers.fleet: {tmp_path / 'fleet.yaml'}: roles.rollout.gpus: "
        "Extra inputs are not permitted"
    ]


def test_a_role_device_reaches_its_workers_and_the_local_job_starts_a_trainer_per_rank(
    tmp_path: Path,
) -> None:
    config = FleetConfig(
        roles={"trainer": RoleConfig(device="cuda:1", devices=[2, 3]), "reward": RoleConfig()}
    )
    children = Supervisor(config, "r", "nats://127.0.0.1:4222").children
    assert children["trainer-0"].env == {"CUDA_VISIBLE_DEVICES": "2", "JETRL_DEVICE": "cuda:1"}
    assert children["reward-0"].env == {}
    fleet = local_fleet(tmp_path, trainer_ranks=3)
    assert [r for r in fleet.roles if r.startswith("trainer")] == [
        "trainer",
        "trainer-rank1",
        "trainer-rank2",
    ]
    commands = {name: child.command for name, child in Supervisor(fleet, "r", "u").children.items()}
    assert commands["trainer-rank2-0"][1:] == [
        "-m",
        "consumers.trainer",
        "--run",
        "r",
        "--nats",
        "u",
        "--rank",
        "2",
    ]
    assert commands["trainer-0"][1:] == ["-m", "consumers.trainer", "--run", "r", "--nats", "u"]
