"""`python -m ops.ray up|down`: a fleet's workers as Ray actors, on a local 2-CPU Ray instance.

Skipped where `ray` (the optional `[ray]` extra) is not installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from bus.embedded import EmbeddedNats
from bus.topology import Topology
from tests.helpers import declare_run, members, require_extra, wait_for

ray = require_extra("ray", "ray")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ray_address() -> Iterator[str]:
    """A local Ray instance with 2 CPUs, owned by this test process (gone with it); its address."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="warning")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def named_actors() -> list[str]:
    return sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True))


@pytest.mark.timeout(240)
def test_up_runs_the_fleet_as_actors_and_down_drains_them(
    nats_server: EmbeddedNats, ray_address: str, tmp_path: Path
) -> None:
    topology = Topology(run=f"t{uuid.uuid4().hex[:10]}", member_ttl=2.0)
    declare_run(nats_server.url, topology)
    fleet = tmp_path / "fleet.yaml"
    # One CPU each (the default) on a 2-CPU cluster: both fit, nothing more would.
    fleet.write_text(
        yaml.safe_dump(
            {
                "run": topology.run,
                "logs": str(tmp_path / "logs"),
                "stop_timeout": 20,
                "roles": {"buffer": {}, "reward": {"env": {"OMP_NUM_THREADS": "1"}}},
            }
        )
    )

    def cli(action: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "ops.ray",
                action,
                str(fleet),
                "--address",
                ray_address,
                "--nats",
                nats_server.url,
            ],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    started = cli("up")
    assert started.returncode == 0, started.stdout + started.stderr
    placed = dict(re.findall(r"^(\w+)-0: pid (\d+) on \S+$", started.stdout, re.MULTILINE))
    assert placed.keys() == {"buffer", "reward"}, started.stdout
    assert named_actors() == [f"{topology.run}/fleet/buffer-0", f"{topology.run}/fleet/reward-0"]
    # The processes the actors started are the run's members.
    expected = sorted((role, int(pid)) for role, pid in placed.items())
    wait_for(
        lambda: sorted((m.role, m.pid) for m in members(nats_server.url, topology)) == expected, 60
    )

    stopped = cli("down")
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert stopped.stdout.splitlines() == [
        "buffer-0: drained (exit 0)",
        "reward-0: drained (exit 0)",
    ]
    assert members(nats_server.url, topology) == []  # a clean exit deletes its entry at once
    assert named_actors() == []
    assert "buffer-0: not up" in cli("down").stdout  # nothing left to stop
