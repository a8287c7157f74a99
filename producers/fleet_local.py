"""The local fleet of the one-machine job: one subprocess per role, logs under the run dir."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROLES = ("trainer", "buffer", "reward", "rollout")


def start(run: str, url: str, logs: Path) -> dict[str, subprocess.Popen[bytes]]:
    logs.mkdir(parents=True, exist_ok=True)
    procs = {}
    for role in ROLES:
        with open(logs / f"{role}.log", "ab") as log:
            procs[role] = subprocess.Popen(
                [sys.executable, "-m", f"consumers.{role}", "--run", run, "--nats", url],
                stdout=log, stderr=subprocess.STDOUT,
            )
    return procs


def check(procs: dict[str, subprocess.Popen[bytes]], logs: Path) -> None:
    """Raise with the log's tail if a worker failed (the trainer exits 0 after its last step)."""
    for role, proc in procs.items():
        if proc.poll() not in (None, 0):
            tail = (logs / f"{role}.log").read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"{role} worker exited with {proc.returncode}:\n" + "\n".join(tail))


def stop(procs: dict[str, subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """SIGTERM all (they drain), then SIGKILL what is still running."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
