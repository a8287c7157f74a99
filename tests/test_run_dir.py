"""The local job's run directory as an operator uses it, on a real run: `ops.status --out` finds
the run's server and identity there; a stopped run leaves its metrics, summary, plots and
samples; a resume appends to them, says it is starting workers before its first step, and the
trainer says it replays the stored steps."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bus.run_dir import SERVER_FILE
from tests.test_main_job import ROOT, start, wait_for_a_step

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

MORE = 8
"""Steps the resume runs past what the stopped run's metrics.jsonl has: its trainer may have
recorded a few more after the producer last counted, and the resume must train some itself."""


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=90
    )


def check_samples(out: Path) -> list[dict]:
    """samples.jsonl: chosen groups (index % 8 == 0), each with its prompt as text and its 8
    responses, rewards, versions; a trained one with its step and staleness = step - version."""
    assert (out / "samples.jsonl").exists(), os.listdir(out)
    groups = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert groups, "no group sampled"
    for g in groups:
        assert int(g["prompt_id"].rsplit("/", 1)[1]) % 8 == 0, g["prompt_id"]
        assert re.fullmatch(r"[ci]\d{4}=", g["prompt"]), g["prompt"]
        assert g["group_size"] == 8 and 1 <= len(g["responses"]) <= 8, g
        assert all(isinstance(r["text"], str) and 0 <= r["reward"] <= 1 for r in g["responses"])
        assert g["outcome"] in ("trained", "dropped", "pending"), g
        if g["outcome"] == "trained":
            # max_staleness 1 (examples/digits.yaml): the step is the one that trained it
            assert g["step"] >= 0 and 0 <= g["staleness"] == g["step"] - g["version"] <= 1, g
            assert len(g["responses"]) == 8, g
        if g["outcome"] == "dropped":  # a stale group may be dropped before it is complete
            assert g["dropped"] and g["step"] is None, g
    assert any(g["outcome"] == "trained" for g in groups), [g["outcome"] for g in groups]
    assert len({g["prompt_id"] for g in groups}) == len(groups), "a group written twice"
    return groups


@pytest.mark.timeout(500)
def test_status_by_run_dir_stop_keeps_the_record_and_resume_extends_it(tmp_path: Path) -> None:
    run, out = f"dir{uuid.uuid4().hex[:8]}", tmp_path / "run"
    job = start(out, run, steps=1000)
    try:
        wait_for_a_step(job)
        status = run_tool("ops.status", "--out", str(out))
        assert status.returncode == 0, status.stderr[-2000:]
        assert status.stdout.startswith(f"run {run} ") and "workers:" in status.stdout, (
            status.stdout
        )
        assert "Error" not in status.stderr, status.stderr[-2000:]
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
    trained = int(re.search(r"after (\d+) of 1000 steps", stderr).group(1))  # type: ignore[union-attr]
    assert not (out / SERVER_FILE).exists(), "server.json outlived its server"

    # Stopped: what the run got to is on disk.
    assert (out / "metrics.jsonl").exists() and (out / "summary.json").exists(), os.listdir(out)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps))) and len(steps) >= trained >= 1, (steps, trained)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == len(steps) and len(summary["segments"]) == 1, summary
    assert all((out / f"{name}.png").exists() for name in ("reward", "staleness", "throughput"))
    check_samples(out)
    shown = run_tool("ops.samples", "--out", str(out))
    assert shown.returncode == 0 and "  prompt: " in shown.stdout, shown.stderr[-2000:]
    before = (out / "metrics.jsonl").read_text()

    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--out",
            str(out),
            "--run",
            run,
            "--steps",
            str(len(steps) + MORE),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Appended, not rewritten: the first segment's lines stay as they were.
    after = (out / "metrics.jsonl").read_text()
    assert after.startswith(before), "the resume rewrote the stopped run's metrics"
    total = len(steps) + MORE
    assert [json.loads(line)["step"] for line in after.splitlines()] == list(range(total))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == len(steps) + MORE and len(summary["segments"]) == 2, summary
    check_samples(out)
    # Until its first step, the resumed job says it is starting workers, not "step k ... nan".
    lines = resumed.stdout.splitlines()
    assert any("starting workers (" in line for line in lines), resumed.stdout[-2000:]
    assert not any("reward nan" in line for line in lines), resumed.stdout[-2000:]
    # No checkpoint yet (checkpoint_every 50): the trainer replays what the buffer stored.
    log = (out / "logs" / "trainer-0.log").read_text()
    assert "rank 0 starts at step 0" in log and "(no checkpoint, no stored batches)" in log
    assert re.search(
        r"rank 0 replays steps 0-\d+ from stored batches \(no checkpoint yet\)", log
    ), log[-3000:]
