"""The error that stops a run is its cause (issue 26b), on the whole local job.

A bad `model.path` stops the rollout and the trainer at startup; a reward function that cannot
be imported stops the reward worker too, and faster, so the fleet gives up on it first. The
console's stop message must still open with the model path error, and name every failed worker,
root cause first (consumers/failures.py ranks them; tests/test_failures.py unit-tests that).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

ROOT = Path(__file__).resolve().parent.parent
STOP = "producers.prompts: the run stopped: "


@pytest.mark.timeout(400)
def test_a_bad_model_path_is_the_stop_message_not_the_rewards_import_error(
    tmp_path: Path,
) -> None:
    # A directory that is there (so the main job's own check passes it) but holds no model:
    # only the workers find out.
    missing = tmp_path / "no-such-model"
    missing.mkdir()
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": f"stop-{tmp_path.name[-10:]}",
                "model": {"path": str(missing)},
                "data": {"task": "digits", "n": 4, "reward": "no_such_reward_module:score"},
                "algorithm": {"prompts_per_step": 4, "max_staleness": 1},
                "trainer": {"steps": 2},
            }
        )
    )
    job = subprocess.run(
        [sys.executable, "-m", "producers.prompts", "--config", str(config)]
        + ["--out", str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=360,
        check=False,
    )
    assert job.returncode == 1, job.stderr[-3000:]
    stop = job.stderr[job.stderr.find(STOP) :].splitlines() if STOP in job.stderr else []
    assert stop, job.stderr[-3000:]
    model_error = f"model.path '{missing}' is a directory without config.json"
    assert (
        stop[0].startswith((STOP + "rollout-0: ", STOP + "trainer-0: ")) and model_error in stop[0]
    ), stop
    listed = [line.strip().split(":", 1)[0] for line in stop[2:]]
    assert set(listed[:2]) == {"rollout-0", "trainer-0"} and listed[2:] == ["reward-0"], stop
    assert "cannot import 'no_such_reward_module'" in stop[4] and "given up on" in stop[4], stop
    assert "Traceback" not in job.stderr, job.stderr[-3000:]
