"""Stopping the main job: SIGTERM or Ctrl-C stops every child, says in one line where the run
stands and how to resume it, exits non-zero; the command it names resumes the run."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bus.embedded import EmbeddedNats
from bus.runtime import attach
from bus.topology import TRAJECTORIES, Topology
from producers.launcher import lag
from tests.helpers import declare_run

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

ROOT = Path(__file__).resolve().parent.parent
STOPPED = re.compile(
    r"^producers\.prompts: stopped by (SIG[A-Z]+) after (\d+) of 1000 steps; "
    r"every worker stopped\. "
    r"Resume with: python -m producers\.prompts --run \S+ --steps 1000 --out (\S+)$"
)


def processes_naming(*needles: str) -> list[str]:
    """Command lines of the live processes that contain any of `needles` (zombies excluded)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = (
                Path(f"/proc/{pid}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(needle in cmdline for needle in needles):
            found.append(cmdline)
    return found


def start(out: Path, run: str, steps: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--out",
            str(out),
            "--run",
            run,
            "--steps",
            str(steps),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_a_step(job: subprocess.Popen[str], deadline_s: float = 120.0) -> None:
    """Read progress lines until one shows a trained step."""
    assert job.stdout is not None
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        line = job.stdout.readline()
        assert line, (
            f"the job ended before training a step: {job.wait()} "
            f"{job.stderr.read() if job.stderr else ''}"
        )
        if (m := re.search(r"step\s+(\d+)/", line)) and int(m.group(1)) >= 1:
            return
    pytest.fail(f"no trained step within {deadline_s:.0f} s")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_every_child_says_how_to_resume_and_the_resume_works(
    tmp_path: Path, sig: signal.Signals
) -> None:
    run, out = f"stop{uuid.uuid4().hex[:8]}", tmp_path / "run"
    job = start(out, run, steps=1000)
    try:
        wait_for_a_step(job)
        job.send_signal(sig)
        stdout, stderr = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0, "a stopped run must not look like a finished one"
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    match = STOPPED.match(last)
    assert match, last
    assert match.group(1) == sig.name and match.group(3) == str(out) and int(match.group(2)) >= 1
    left = processes_naming(run, str(out))
    assert not left, f"still running after the job exited: {left}"

    if sig is signal.SIGINT:
        return  # one resume is enough to show the command works
    trained = int(match.group(2))
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
            str(trained + 2),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert '"steps": ' + str(trained + 2) in resumed.stdout.strip().splitlines()[-1]


def test_the_progress_line_shows_a_figure_it_cannot_read_as_unknown(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """A queue whose consumer the server cannot describe now (here: deleted; in a cluster: its
    stream electing a leader) shows as `?`, and the other figures still show."""
    declare_run(nats_server.url, topology)

    async def scenario() -> str:
        rt = await attach("producer", topology.run, nats_server.url)
        try:
            await rt.js.delete_consumer(
                topology.stream(TRAJECTORIES), TRAJECTORIES.work_queue.durable
            )
            return await lag(rt)
        finally:
            await rt.close()

    assert asyncio.run(scenario()) == "rollout 0+0 reward ? buffer 0+0"
