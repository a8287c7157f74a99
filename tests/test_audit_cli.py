"""`python -m ops.audit` on a run id that has no streams: one line saying so, exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bus.embedded import EmbeddedNats

ROOT = Path(__file__).resolve().parent.parent


def test_an_unknown_run_is_one_line(nats_server: EmbeddedNats) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ops.audit", "--run", "nosuchrun", "--nats", nats_server.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"ops.audit: run nosuchrun has no streams on {nats_server.url}; is the run id right?"
    ), done.stderr[-2000:]
