"""Why a fleet stopped: each failed worker's one-line reason, the root cause first (issue 26b).

The ranking and the reason line are pure (consumers/failures.py); the supervisor test runs real
stand-in workers where the one that fails fastest (a reward import error) is not the cause (a
bad model path, said later by a slower worker). tests/test_stop_cause.py runs the whole job.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from consumers.failures import Failure, rank, reason_line, stop_message, tier
from consumers.fleet_config import FleetConfig, RestartPolicy, RoleConfig
from consumers.supervisor import FleetFailed, Supervisor

MODEL = "consumers.rollout: model.path '/nonexistent/model': no such directory, and not a hub id"
REWARD = (
    "consumers.reward: reward function 'producers.tasks:score_digits': cannot import "
    "'producers.tasks': ModuleNotFoundError: No module named 'producers'"
)


def failure(worker: str, reason: str, since: float, stage: str = "") -> Failure:
    return Failure(worker, stage or worker.rsplit("-", 1)[0], reason, since, "exited with 1")


def test_the_reason_is_the_last_line_of_the_latest_start_its_logging_did_not_write() -> None:
    tail = "\n".join(
        [
            "consumers.rollout: an older start's reason",
            "--- 2026-12-04 15:32:13 fleet starts python -m consumers.rollout --run r",
            "2026-12-04 15:32:15,730 rollout INFO left the run in 0.0 s",
            MODEL,
            "2026-12-04 15:32:15,731 rollout INFO a record after it",
            "",
        ]
    )
    assert reason_line(tail) == MODEL
    traceback = "--- start\nTraceback (most recent call last):\n  File x\nValueError: bad\n"
    assert reason_line(traceback) == "ValueError: bad"
    records = [
        "--- start",
        "2026-12-04 15:32:15,730 trainer ERROR rank 1 lost",
        "2026-12-04 15:32:15,731 trainer INFO loading model",
    ]
    assert reason_line("\n".join(records)) == "2026-12-04 15:32:15,730 trainer ERROR rank 1 lost"
    assert reason_line("\n".join(records[::2])) == ""  # killed while loading: no reason given
    assert reason_line("consumers.buffer: before\n--- start, killed silently\n") == ""


def test_configuration_before_model_stages_before_other_workers_before_downstream() -> None:
    reward = failure("reward-0", REWARD, since=1.0)
    stall = failure("buffer-0", "consumers.buffer: no live trainer for 30s", since=0.5)
    buffer = failure("buffer-1", "consumers.buffer: disk full", since=0.1)
    trainer = failure("trainer-rank1-0", "RuntimeError: NCCL error", since=0.2, stage="trainer")
    rollout = failure("rollout-0", MODEL, since=3.0)
    hub = failure("trainer-0", "consumers.trainer: model x@main is not in the hub cache", 2.0)
    assert [tier(f) for f in (hub, rollout, trainer, buffer, stall, reward)] == [0, 0, 1, 2, 3, 3]
    ranked = rank([reward, stall, buffer, trainer, rollout, hub])
    assert [f.worker for f in ranked] == [
        "trainer-0",  # configuration, failing since 2.0
        "rollout-0",  # configuration, since 3.0
        "trainer-rank1-0",
        "buffer-1",
        "buffer-0",  # downstream, since 0.5
        "reward-0",  # downstream, since 1.0
    ]


def test_among_equals_the_earliest_then_the_name_comes_first() -> None:
    late, early = failure("rollout-0", MODEL, 5.0), failure("rollout-1", MODEL, 4.0)
    twin = failure("rollout-2", MODEL, 4.0)
    assert [f.worker for f in rank([twin, late, early])] == ["rollout-1", "rollout-2", "rollout-0"]


def test_the_stop_message_opens_with_the_root_cause_and_lists_every_failed_worker() -> None:
    message = stop_message(
        [failure("reward-0", REWARD, 1.0), failure("rollout-0", MODEL, 2.0)], "/run/logs"
    )
    lines = message.splitlines()
    assert lines[0] == f"rollout-0: {MODEL}"
    assert lines[1] == "failed workers, root cause first (logs in /run/logs):"
    assert lines[2].startswith(f"  rollout-0: {MODEL} [configuration; exited with 1")
    assert lines[3].startswith(f"  reward-0: {REWARD} [downstream; exited with 1")
    assert len(lines) == 4


def test_the_supervisor_names_the_root_cause_not_the_first_worker_it_gave_up_on(
    tmp_path: Path,
) -> None:
    """The reward stand-in fails at once and is given up on first; the rollout stand-in says
    the model path is bad, later. The error names the model path first, then the reward."""
    roles = {
        "reward": RoleConfig(module="tests.fleet_proc", args=["--mode", "crash", "--say", REWARD]),
        "rollout": RoleConfig(
            module="tests.fleet_proc", args=["--mode", "crash", "--say", MODEL, "--after", "0.5"]
        ),
    }
    config = FleetConfig(
        roles=roles, logs=tmp_path, restart=RestartPolicy(max_restarts=2, backoff=0.3)
    )
    fleet = Supervisor(config, "failures-test", "nats://127.0.0.1:1")
    fleet.start()
    deadline = time.monotonic() + 60
    try:
        with pytest.raises(RuntimeError) as stopped:
            while time.monotonic() < deadline:
                fleet.check()
                time.sleep(0.05)
    finally:
        fleet.stop()
    assert fleet.children["reward-0"].state == "gave up"
    assert fleet.children["rollout-0"].state != "gave up"  # still being restarted
    lines = str(stopped.value).splitlines()
    assert lines[0] == f"rollout-0: {MODEL}", lines
    assert lines[2].startswith(f"  rollout-0: {MODEL} [configuration; exited with 3, failed "), (
        lines
    )
    assert lines[3].startswith(f"  reward-0: {REWARD} [downstream; exited with 3, failed 3x"), lines
    assert lines[3].endswith(", given up on]") and len(lines) == 4, lines
    assert isinstance(stopped.value, FleetFailed)
