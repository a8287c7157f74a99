"""The local job's embedded server takes per-run, per-role identities,
and none is on a command line.

The job (`python -m producers.prompts`) writes the run's seeds under `<out>/identities`, the
server's config names their public keys, each worker reads its own seed file; while it runs,
no process's command line holds a seed or a password, and a local client with no identity is
refused.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bus.connection import ConnectRefused, connect
from tests.test_main_job import ROOT, wait_for_a_step

SEED = re.compile(rb"SU[A-Z2-7]{50,}")


def command_lines() -> list[bytes]:
    lines = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue
    return lines


@pytest.mark.timeout(300)
def test_the_local_job_runs_on_per_role_identities_kept_off_command_lines(tmp_path: Path) -> None:
    run, out = f"ids{uuid.uuid4().hex[:8]}", tmp_path / "run"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--out",
            str(out),
            "--run",
            run,
            "--steps",
            "1000",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_a_step(job)  # every role attached with its seed and trained a step
        seeds = {path.stem: path.read_bytes().strip() for path in (out / "identities").glob("*.nk")}
        assert set(seeds) >= {"producer", "trainer", "buffer", "reward", "rollout", "admin"}
        assert all(
            (out / "identities" / f"{role}.nk").stat().st_mode & 0o777 == 0o600 for role in seeds
        )
        lines = command_lines()
        assert any(run.encode() in line for line in lines)  # the workers are there to be looked at
        assert not [
            line
            for line in lines
            if SEED.search(line) or any(seed in line for seed in seeds.values())
        ]
        assert not [
            line for line in lines if re.search(rb"nats://[^/\s\0]*@", line)
        ]  # no user:password@
        url = re.search(r"listen: (\S+)", (out / "nats" / "nats.conf").read_text()).group(1)  # type: ignore[union-attr]

        async def anonymous() -> None:
            with pytest.raises(ConnectRefused, match="refused this client's credentials"):
                await asyncio.wait_for(connect(f"nats://{url}", "anonymous", identity=None), 10)

        env_identity = os.environ.pop("JETRL_NATS_IDENTITY", None)
        try:
            asyncio.run(anonymous())
        finally:
            if env_identity is not None:
                os.environ["JETRL_NATS_IDENTITY"] = env_identity
    finally:
        job.terminate()
        try:
            job.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            job.kill()
            job.communicate()
